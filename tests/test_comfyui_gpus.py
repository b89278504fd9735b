"""The Accelerated UNet node's gpus option inside ComfyUI: its WanModel through WAN21_T2V, comfy.sample.sample, LoRA
patches added through ModelPatcher.add_patches, unload_all_models, in this process, with the worker processes on the
CPU (gloo) as the engine-level hook accelerated_unet.use_devices places them (on a machine without GPUs the node itself
uses one device and says so). Each run against plain ComfyUI's latents, in float32: splitting the CFG batch or the
tokens changes the order of float sums, so within 1e-5, not equal."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

import comfy_helpers as H
from sd_accel.nodes import accelerated_unet

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))


def accelerate(pack, model, gpus: str = "1"):
    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    out = node.apply(model, "torch", True, False, **H.PROFILE, gpus=gpus, unique_id="11")
    return out["result"][0], out["ui"]["text"][0]


def spread(pack, model, processes: int):
    """The node's output with its calls spread over `processes` CPU processes (this one and workers)."""
    acc, _ = accelerate(pack, model)
    accelerated_unet.use_devices(acc, ["cpu"] * processes, timeout=60)
    return acc


def sample(model, positive, negative, size=8, cfg=3.0):
    """A 3-frame Wan video latent sampled in 2 steps; CFG above 1 makes every call a batch of 2."""
    return H.sample_frames(model, positive, negative, 3, size=size, cfg=cfg)


def info(model) -> str:
    """Accel Info's report on the model."""
    from sd_accel.nodes import info

    return info.model_state(accelerated_unet.session_of(model), on_cpu=True)


def status(model):
    return accelerated_unet.session_of(model).slot.status


def pool():
    from sd_accel.accel.parallel import workers

    return workers.current()


def gone(pids: list[int]) -> bool:
    """Whether none of these processes is left (stopped and reaped)."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def with_lora(model, strength: float = 1.0):
    """A clone with a seeded LoRA on the blocks' q projections and feed-forward, through ModelPatcher.add_patches."""
    import comfy.lora

    sd = H.lora_patches(model, 9, take=lambda key: key.endswith((".q.weight", "ffn.0.weight")))
    patched = model.clone()
    patched.add_patches(comfy.lora.load_lora(sd, comfy.lora.model_lora_keys_unet(model.model, {}), log_missing=False),
                        strength)
    return patched


@pytest.fixture(scope="module")
def wan(pack):
    """A tiny Wan, its conditioning, plain ComfyUI's latents, and the node's output over 2 processes (shared by the
    tests below, in order: a start costs seconds)."""
    model = H.tiny_dit("wan", 3)
    pos, neg = H.tiny_dit_conditioning("wan", 4)
    plain = sample(model, pos, neg)
    acc = spread(pack, model, 2)
    yield model, acc, pos, neg, plain
    accelerated_unet.session_of(acc).slot.spread.close()


def test_two_runs_are_spread_over_two_processes_and_equal_plain(wan):
    model, acc, pos, neg, plain = wan
    for run in range(2):
        before = status(acc).spread_calls
        out = sample(acc, pos, neg)
        assert H.rel(out, plain) <= 1e-5, run
        s = status(acc)
        assert s.spread_calls - before == 2 and s.plain_calls == 0, s  # both steps' calls, CFG split over 2
        assert s.layout == "CFG parallel over 2" and pool().world == 2
    said = "GPUs: 2 served every accelerated call of the run (CFG parallel over 2)"
    assert said in info(acc) and accelerated_unet.status_payload(accelerated_unet.session_of(acc))["gpus"] == said


def test_a_lora_reaches_the_workers_and_leaves_with_its_patches(wan):
    model, acc, pos, neg, plain = wan
    plain_lora = sample(with_lora(model), pos, neg)
    assert H.rel(plain_lora, plain) > 1e-3  # the LoRA changes the video
    before = status(acc).spread_calls
    assert H.rel(sample(with_lora(acc), pos, neg), plain_lora) <= 1e-5
    assert H.rel(sample(acc, pos, neg), plain) <= 1e-5  # and without it again: the workers take the weights back
    assert status(acc).spread_calls - before == 4


def test_a_call_no_layout_takes_runs_alone_and_the_workers_serve_the_next(wan):
    """CFG 1 makes calls of batch 1, which sequence parallelism takes: 48 tokens split over 2, 27 do not."""
    model, acc, pos, neg, _ = wan
    s = status(acc)
    before = s.spread_calls
    odd = sample(acc, pos, neg, size=6, cfg=1.0)  # 3 frames x 3 x 3 patches: 27 tokens
    assert H.rel(odd, sample(model, pos, neg, size=6, cfg=1.0)) <= 1e-5
    assert s.spread_calls == before and "27 image tokens do not split over 2 processes" in s.one_device
    assert sum("27 image tokens" in m for m in s.messages) == 1, s.messages
    even = sample(acc, pos, neg, cfg=1.0)
    assert H.rel(even, sample(model, pos, neg, cfg=1.0)) <= 1e-5
    assert s.spread_calls == before + 2 and s.layout == "sequence parallel over 2"


def test_parts_of_the_model_replaced_in_comfyuis_process_keep_the_run_on_one_process(wan):
    """An object patch inside the diffusion model (another node's replaced module) exists in ComfyUI's process only."""
    import copy

    model, acc, pos, neg, plain = wan
    head = copy.deepcopy(model.model.diffusion_model.head)
    with torch.no_grad():
        head.head.weight.mul_(1.5)

    def replaced(m):
        patched = m.clone()
        patched.add_object_patch("diffusion_model.head", head)
        return patched

    plain_replaced = sample(replaced(model), pos, neg)
    assert H.rel(plain_replaced, plain) > 1e-3
    s = status(acc)
    before = (s.engine_calls, s.spread_calls)
    assert H.rel(sample(replaced(acc), pos, neg), plain_replaced) <= 1e-5
    assert (s.engine_calls, s.spread_calls) == (before[0] + 2, before[1])
    assert "diffusion_model.head" in s.one_device and sum("diffusion_model.head" in m for m in s.messages) == 1
    assert H.rel(sample(acc, pos, neg), plain) <= 1e-5 and s.spread_calls == before[1] + 2  # without it: spread again


def test_a_second_node_output_on_the_model_shares_the_workers_copy(pack, wan):
    """A widget changed (a new node output on the same ComfyUI model): the workers keep their copy, build nothing and
    take no weights (the host's are those they hold); dropping either output leaves the other's. Through a LoRA on the
    same model, a new output shares the copy and sends the LoRA's weights."""
    from sd_accel.accel.progress import StageLog

    model, acc, pos, neg, plain = wan
    sample(acc, pos, neg)
    pids = pool().pids()
    other = spread(pack, model, 2)
    stages = []
    accelerated_unet.session_of(other).slot.spread.progress = lambda: StageLog(stages.append)
    assert H.rel(sample(other, pos, neg), plain) <= 1e-5 and status(other).spread_calls == 2
    assert pool().pids() == pids and not any("building" in s or "sending" in s for s in stages), stages
    accelerated_unet.session_of(other).slot.spread.close()
    before = status(acc).spread_calls
    assert H.rel(sample(acc, pos, neg), plain) <= 1e-5 and status(acc).spread_calls == before + 2
    assert pool().pids() == pids
    lora = spread(pack, with_lora(model), 2)
    accelerated_unet.session_of(lora).slot.spread.progress = lambda: StageLog(stages.append)
    assert H.rel(sample(lora, pos, neg), sample(with_lora(model), pos, neg)) <= 1e-5
    assert pool().pids() == pids and any("sending" in s for s in stages) and not any("building" in s for s in stages)
    accelerated_unet.session_of(lora).slot.spread.close()
    assert H.rel(sample(acc, pos, neg), plain) <= 1e-5  # its weights go back to the workers


def test_a_killed_worker_leaves_the_run_to_one_process_with_one_message(wan):
    model, acc, pos, neg, plain = wan
    s = status(acc)
    pids = pool().pids()
    os.kill(pids[0], 9)
    while not pool().lost():  # the worker is gone before the run starts
        time.sleep(0.01)
    before = (s.engine_calls, s.spread_calls, s.plain_calls, len(s.messages))
    assert H.rel(sample(acc, pos, neg), plain) <= 1e-5
    assert (s.engine_calls, s.spread_calls, s.plain_calls) == (before[0] + 2, before[1], before[2])
    said = s.messages[before[3]:]
    assert len(said) == 1 and "was ended by signal 9" in said[0] and "rest of the run" in said[0], said
    assert f"GPUs: one served the run: {said[0]}" in info(acc)
    assert gone(pids) and pool() is None
    # the next run starts the workers again
    assert H.rel(sample(acc, pos, neg), plain) <= 1e-5
    assert s.spread_calls == before[1] + 2 and pool() is not None


def test_unloading_the_model_stops_the_workers(wan):
    import comfy.model_management as mm

    model, acc, pos, neg, plain = wan
    sample(acc, pos, neg)
    pids = pool().pids()
    assert pids and not gone(pids)
    mm.unload_all_models()
    assert pool() is None and gone(pids)
    before = status(acc).spread_calls
    assert H.rel(sample(acc, pos, neg), plain) <= 1e-5  # sampling again loads the model and starts them again
    assert status(acc).spread_calls == before + 2


def test_four_processes_split_cfg_and_tokens_and_go_with_the_session(pack):
    """CFG over 2 pairs of processes, the tokens over each pair; the node's output dropped (its session ends): the
    workers go."""
    model = H.tiny_dit("wan", 5)
    pos, neg = H.tiny_dit_conditioning("wan", 6)
    plain = sample(model, pos, neg)
    acc = spread(pack, model, 4)
    assert H.rel(sample(acc, pos, neg), plain) <= 1e-5
    s = status(acc)
    assert s.spread_calls == 2 and s.layout == "CFG parallel over 2 x sequence parallel over 2", s
    pids = pool().pids()
    assert len(pids) == 3
    del acc, s
    gc.collect()
    assert pool() is None and gone(pids)


def failing_in_a_call(config_class, state, device):
    """A worker's build (pickled by reference; this module is on the workers' path too): ComfyUI's diffusion model
    whose output head fails, after the call's first collectives."""
    from sd_accel.nodes.gpus import diffusion_model

    module = diffusion_model(config_class, state, device)
    module.head.register_forward_pre_hook(_fail)
    return module


def _fail(*_args):
    raise RuntimeError("this worker fails in a call")


def test_a_worker_that_fails_in_a_call_leaves_the_run_to_one_process(pack):
    import dataclasses
    import pickle

    model = H.tiny_dit("wan", 14)
    pos, neg = H.tiny_dit_conditioning("wan", 15)
    plain = sample(model, pos, neg)
    acc = spread(pack, model, 2)
    spread_ = accelerated_unet.session_of(acc).slot.spread
    host = spread_.recipe
    config = model.model.model_config
    spread_.recipe = lambda: dataclasses.replace(host(), model=pickle.dumps((failing_in_a_call,
                                                                             (type(config), dict(vars(config))))))
    assert H.rel(sample(acc, pos, neg), plain) <= 1e-5
    s = status(acc)
    assert s.spread_calls == 0 and s.engine_calls == 2 and s.plain_calls == 0 and pool() is None
    said = [m for m in s.messages if "fails in a call" in m]
    assert len(said) == 1 and "exited (code 1)" in said[0] and "rest of the run" in said[0], s.messages


def test_workers_that_cannot_load_the_model_are_not_tried_again(pack):
    import functools
    import pickle

    from sd_accel.accel.parallel.workers import Recipe

    model = H.tiny_dit("wan", 12)
    pos, neg = H.tiny_dit_conditioning("wan", 13)
    plain = sample(model, pos, neg)
    acc = spread(pack, model, 2)
    # a build the worker cannot run: int("no model", device=...) raises TypeError there
    accelerated_unet.session_of(acc).slot.spread.recipe = lambda: Recipe(functools.partial(abs, 0),
                                                                         pickle.dumps((int, ("no model",))))
    for run in range(2):
        assert H.rel(sample(acc, pos, neg), plain) <= 1e-5
        s = status(acc)
        assert s.spread_calls == 0 and s.engine_calls == 2 * (run + 1) and pool() is None
        said = [m for m in s.messages if "could not start or load the model" in m]
        assert len(said) == 1 and "TypeError" in said[0], s.messages


@pytest.mark.skipif(torch.cuda.is_available(), reason="the node's own choice of devices on a machine without GPUs")
def test_gpus_on_a_machine_without_gpus_run_on_one_device_and_say_so(pack):
    model = H.tiny_dit("wan", 7)
    pos, neg = H.tiny_dit_conditioning("wan", 8)
    acc, text = accelerate(pack, model, gpus="all")
    said = "gpus all: the model runs on the cpu, so one device serves it."
    assert said in text and status(acc).messages == [said]
    assert accelerated_unet.session_of(acc).slot.spread is None
    assert torch.equal(sample(acc, pos, neg), sample(model, pos, neg))


@pytest.mark.parametrize("asked,visible,nccl,devices,said", [
    ("1", 4, True, ["cuda:0"], ""),
    ("2", 4, True, ["cuda:0", "cuda:1"], ""),
    ("all", 4, True, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"], ""),
    ("4", 2, True, ["cuda:0", "cuda:1"], "gpus 4: 2 GPUs are visible, so the model runs on 2."),
    ("2", 1, True, ["cuda:0"], "gpus 2: 1 GPU is visible, so the model runs on 1."),
    ("all", 1, True, ["cuda:0"], "gpus all: one GPU is visible, so one GPU serves the model."),
    ("2", 4, False, ["cuda:0"], "gpus 2: this PyTorch has no NCCL"),
])
def test_the_devices_a_number_of_gpus_gets(asked, visible, nccl, devices, said):
    from sd_accel.accel.parallel.spread import devices_for

    got, text = devices_for(asked, torch.device("cuda", 0), visible, nccl)
    assert got == devices and text.startswith(said) and bool(text) == bool(said)


def test_the_host_device_comes_first():
    from sd_accel.accel.parallel.spread import devices_for

    assert devices_for("2", torch.device("cuda", 2), 4, True)[0] == ["cuda:2", "cuda:0"]
