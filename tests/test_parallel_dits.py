"""Sequence parallelism (accel/parallel) for ComfyUI's Flux, Chroma, SD3/SD3.5 MMDiT, Qwen-Image and Wan over 2 and 4
gloo processes on the CPU. Tiny seeded models of ComfyUI's own classes (4 heads) give on every rank the output of one
process, in float32, with text the world splits (8 tokens) and text it does not (7, as SD3.5's 333; Wan's text enters
by cross-attention, outside the exchange): with ComfyUI's
own blocks, and with the torch path's fused blocks (accelerate() with the Triton kernels, run by Triton's
interpreter), whose attention the exchange reaches too, also where ComfyUI chose another attention function for the
whole host. After the context the model is its own again; image token counts the world does not divide, and
ControlNet residuals, are refused."""

from __future__ import annotations

import contextlib

import pytest
import torch

import comfy_helpers as H
from gloo_helpers import run_ranks

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))

# config name -> the torch path's fusion for its blocks (None where it has none), and the text tokens it is run with
# in that form: split (8) for Flux as Flux's 512 are, whole (7) for SD3 as SD3.5's 333 are
MODELS = {"tiny-flux": ("flux", 8), "tiny-chroma": ("chroma", 7), "tiny-sd3": ("mmdit", 7),
          "tiny-qwen-image": ("qwen_image", 7), "tiny-wan": ("wan", 7)}
# the fused runs beyond one per model: Flux under another attention ComfyUI chose, Qwen-Image's text (whatever length
# the prompt gives it) also split
EXTRA = {"tiny-flux fused under split": ("tiny-flux", "split", None),
         "tiny-qwen-image fused, text split": ("tiny-qwen-image", "pytorch", 8)}
ATTENTION = {"tiny-flux": ("comfy.ldm.flux.math", "optimized_attention"),
             "tiny-chroma": ("comfy.ldm.flux.math", "optimized_attention"),
             "tiny-sd3": ("comfy.ldm.modules.diffusionmodules.mmdit", "optimized_attention"),
             "tiny-qwen-image": ("comfy.ldm.qwen_image.model", "optimized_attention_masked"),
             "tiny-wan": ("comfy.ldm.wan.model", "optimized_attention")}


def _model(name: str):
    """The tiny config (SD3: 4 blocks, so 4 heads; its first block MMDiT-X's) built from ComfyUI's class, seeded."""
    from sd_accel.accel.models import configs

    if name != "tiny-sd3":
        return configs.build_dit(name, "comfy", comfyui_root=H.comfy_root())
    import comfy.ldm.modules.diffusionmodules.mmdit as mmdit
    import comfy.ops

    _, cfg = configs.COMFY_DIT_CONFIGS[name]
    embedder = {"target": "torch.nn.Linear", "params": {"in_features": 32, "out_features": 256}}
    model = mmdit.OpenAISignatureMMDITWrapper(**{**cfg, "depth": 4, "context_embedder_config": embedder},
                                              operations=comfy.ops.disable_weight_init)
    return configs.seed_dit_parameters(model, 0).eval()


def _inputs(name: str, latent: int, text: int = 7) -> dict:
    from sd_accel.accel.models import configs

    inp = configs.dit_example_inputs(name, batch=2, latent=latent)  # 7 text tokens
    inp["context"] = torch.cat((inp["context"], inp["context"][:, :1]), 1)[:, :text]
    return inp


def _qwen_zero(model) -> bool:
    """Whether Qwen-Image's blocks are ComfyUI 0.33's, whose forward takes timestep_zero_index."""
    import inspect

    return "timestep_zero_index" in inspect.signature(type(model.transformer_blocks[0]).forward).parameters


def _qwen_edit(model, inp: dict):
    """A Qwen-Image-Edit call: a reference latent's 2 x 2 tokens after the image's 16 (20, which 2 and 4 processes
    split), in ComfyUI 0.33 modulated at timestep zero ("index_timestep_zero": ranks hold tokens on one side of the
    blocks' timestep_zero_index or on both)."""
    ref = torch.randn(2, 16, 1, 4, 4, generator=torch.Generator().manual_seed(3))
    method = {"ref_latents_method": "index_timestep_zero"} if _qwen_zero(model) else {}
    return lambda: model(inp["x"], inp["timesteps"], inp["context"], ref_latents=[ref], **method)


def _hooked(model) -> bool:
    return any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def _plain(name: str, g) -> dict:
    """ComfyUI's own blocks: the parallel output against one process's (text split and whole; Flux with an
    attention mask; Qwen-Image-Edit with a reference latent), refusals (in ComfyUI 0.33 Qwen-Image's text mask too),
    and the model after the context."""
    import importlib

    from sd_accel.accel.errors import BadInput
    from sd_accel.accel.models.dit import CanonicalDiT
    from sd_accel.accel.parallel.sequence import sequence_parallel

    model = _model(name)
    canon = CanonicalDiT(model)
    inputs = [_inputs(name, 8, text) for text in (7, 8)]  # 4 x 4 = 16 image tokens
    if name == "tiny-flux":  # an attention mask (a bias over the joint sequence, as ComfyUI's regional prompts give)
        mask = torch.randn(2, 8 + 16, 8 + 16, generator=torch.Generator().manual_seed(2))
        inputs.append({**inputs[1], "attention_mask": mask})
    module, attr = ATTENTION[name]
    host = getattr(importlib.import_module(module), attr)
    refused = []
    calls = [lambda inp=inp: canon(**inp) for inp in inputs]
    if name == "tiny-qwen-image":
        calls.append(_qwen_edit(model, inputs[0]))
    with torch.no_grad():
        refs = [call() for call in calls]
        with sequence_parallel(model, g):
            outs = [call() for call in calls]
            inp = inputs[0]
            try:  # 3 x 3 = 9 image tokens: neither 2 nor 4 processes split them
                canon(**_inputs(name, 6))
            except BadInput as e:
                refused.append(str(e))
            try:
                model(inp["x"], inp["timesteps"], inp["context"], control={"input": [], "output": []})
            except BadInput as e:
                refused.append(str(e))
            if name == "tiny-qwen-image" and _qwen_zero(model):
                try:  # a text mask (a batch of prompts of different lengths), which ComfyUI 0.33's attention applies
                    model(inp["x"], inp["timesteps"], inp["context"],
                          attention_mask=torch.ones(2, inp["context"].shape[1], dtype=torch.long))
                except BadInput as e:
                    refused.append(str(e))
        again = canon(**inp)
    return {"rel": max(map(H.rel, outs, refs)), "refused": refused,
            "masks": int(name == "tiny-qwen-image" and _qwen_zero(model)),
            "restored": torch.equal(again, refs[0]) and not _hooked(model)
            and getattr(importlib.import_module(module), attr) is host}


def _fused(name: str, g, attention: str = "pytorch", text: int | None = None) -> dict:
    """The torch path's fused blocks, with ComfyUI's `attention` chosen for the whole host (its PyTorch attention, as
    on a GPU; or another, as its flags choose: the fused blocks take that call too), and `text` tokens (MODELS' by
    default): the parallel output against one process's and ComfyUI's own, and how many attentions the fused blocks
    ran in each."""
    from sd_accel.accel.accelerate import accelerate
    from sd_accel.accel.models.dit import CanonicalDiT
    from sd_accel.accel.parallel.sequence import sequence_parallel

    H.use_comfy_attention(attention)
    sdpa = H.counted_sdpa()
    model = _model(name)
    fusion, default = MODELS[name]
    inp = _inputs(name, 8, text or default)
    args = (inp["x"], inp["timesteps"], inp["context"], inp.get("y"))
    with torch.no_grad():
        ref = CanonicalDiT(model)(**inp)
        acc = accelerate(model, preference="torch", options={"triton_kernels": True})
        one = acc(*args, guidance=inp.get("guidance"))
        one_calls = len(sdpa)
        sdpa.clear()
        with sequence_parallel(model, g):
            out = acc(*args, guidance=inp.get("guidance"))
        acc.release()
    return {"rel": H.rel(out, one), "rel_plain": H.rel(out, ref), "calls": [one_calls, len(sdpa)],
            "fused": acc.engine.fusion_counts[fusion]}


def _ranks(world: int) -> dict:
    from sd_accel.accel.parallel.group import Group

    result = {name: _plain(name, Group()) for name in MODELS}
    result.update({f"{name} fused": _fused(name, Group()) for name, (fusion, _) in MODELS.items() if fusion})
    result.update({key: _fused(name, Group(), attention, text) for key, (name, attention, text) in EXTRA.items()})
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_transformers_over_several_processes_equal_one_process(tmp_path, world):
    pytest.importorskip("triton")
    results = run_ranks(_ranks, world, tmp_path)
    for r in results:
        for name in MODELS:
            plain = r[name]
            assert plain["rel"] <= 1e-5 and plain["restored"], (name, plain)
            assert [f"do not split over {world} processes" in plain["refused"][0],
                    "ControlNet" in plain["refused"][1]] == [True, True], (name, plain)
            # ComfyUI 0.33's Qwen-Image: a text mask refused as well
            assert len(plain["refused"]) == 2 + plain["masks"], (name, plain)
            assert all("text attention mask" in r for r in plain["refused"][2:]), (name, plain)
        for name in [f"{n} fused" for n, (fusion, _) in MODELS.items() if fusion] + list(EXTRA):
            fused = r[name]
            # every attention of the one-process call ran in a fused block, under the exchange as well
            assert fused["calls"][0] > 0 and fused["calls"][0] == fused["calls"][1] and fused["fused"], (name, fused)
            assert fused["rel"] <= 1e-5 and fused["rel_plain"] <= 1e-5, (name, fused)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_world_that_does_not_divide_the_heads_is_refused(monkeypatch, name):
    H.import_comfy()
    from sd_accel.accel.errors import BadInput
    from sd_accel.accel.parallel import sequence

    monkeypatch.setattr(sequence.Group, "world", property(lambda self: 3))
    with pytest.raises(BadInput, match="3 processes do not divide the model's 4 attention heads") as e:
        with sequence.sequence_parallel(_model(name), sequence.Group()):
            pass
    assert "24" in e.value.fix


def test_another_model_is_refused():
    from sd_accel.accel.errors import BadInput
    from sd_accel.accel.parallel.group import Group
    from sd_accel.accel.parallel.sequence import sequence_parallel

    with pytest.raises(BadInput, match="not Linear") as e:
        with sequence_parallel(torch.nn.Linear(2, 2), Group()):
            pass
    assert "one GPU" in e.value.fix


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_sequence_parallel_calls_replay_cuda_graphs_cut_at_their_collectives():
    """A sequence-parallel call (one NCCL process on the GPU: the exchanges run, as copies) is captured in pieces, one
    more than its collectives (two per block, the gather at the end), and each replay runs them between the pieces:
    call after call, its output is its plain first call's on those inputs, and the one-process call's."""
    pytest.importorskip("triton")
    H.import_comfy()
    from sd_accel.accel.accelerate import accelerate
    from sd_accel.accel.parallel.group import Group
    from sd_accel.accel.parallel.rendezvous import free_port, join
    from sd_accel.accel.parallel.sequence import sequence_parallel
    from sd_accel.accel.parallel.spread import SPREAD_OPTIONS

    device = torch.device("cuda", 0)
    join("nccl", free_port(), 0, 1, 120, device)
    try:
        model = _model("tiny-flux").to(device, torch.bfloat16)
        acc = accelerate(model, preference="torch", options={**SPREAD_OPTIONS, "cuda_graphs": True})

        def call(seed: int, spread: bool) -> torch.Tensor:
            inp = {k: v.to(device) for k, v in _inputs("tiny-flux", 8, 8).items()}
            inp["x"] = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(seed)).to(inp["x"])
            with torch.no_grad(), sequence_parallel(model, Group()) if spread else contextlib.nullcontext():
                return acc(inp["x"], inp["timesteps"], inp["context"], inp.get("y"),
                           guidance=inp.get("guidance")).float()

        spread = {}
        for seed in (0, 1, 0, 2, 1):  # seed 0 first: the plain call; then the capture, and replays
            out = call(seed, True)
            assert torch.isfinite(out).all() and H.rel(out, spread.setdefault(seed, out)) <= 1e-3, seed
        (entry,) = acc.engine.graphs._entries.values()
        blocks = len(model.double_blocks) + len(model.single_blocks)
        assert len(entry.pieces.graphs) == 2 * blocks + 2 and acc.engine.graphs.captures == 1
        for seed in (0, 1, 2):  # the same shapes alone: the graph captured again, without collectives
            assert H.rel(call(seed, False), spread[seed]) <= 1e-2, seed  # the same math in other orders, in bf16
        assert [len(e.pieces.graphs) for e in acc.engine.graphs._entries.values()] == [1]
        acc.release()
    finally:
        torch.distributed.destroy_process_group()
