"""fp8 attention under sequence parallelism (issue 54): the fused DiT blocks of ComfyUI's Flux, SD3 (its MMDiT-X block
too) and Wan in bf16 under precision fp8, over 2 gloo processes on the CPU, cuDNN's fp8 kernel emulated in torch
(fp8_attention.sdpa_fp8_ref) as tests/test_fp8_attention.py does. Every attention of the spread call runs in fp8 at
the gathered shape (all tokens, half the heads), its q and k cross the exchange as e4m3 bytes (the message of the way
in a third smaller than three bf16 tensors) and its e4m3 output comes back as bytes; the output is the one process's
fp8 output as closely as the spread 16-bit attention's is the one process's 16-bit output (Flux and Wan to the bit).
Where the kernels' times differ between the ranks, both choose the same one. On a GPU with cuDNN's fp8 attention, a
spread fp8 call in one NCCL process replays CUDA graphs cut at its exchanges."""

from __future__ import annotations

import contextlib

import pytest
import torch

import comfy_helpers as H
from gloo_helpers import run_ranks

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))

FP8 = torch.float8_e4m3fn
# config name -> text tokens: Flux's split over 2 (8), SD3's whole on every rank (7, as SD3.5's 333)
MODELS = {"tiny-flux": 8, "tiny-sd3": 7, "tiny-wan": 7}


def _emulated(monkeypatch) -> list:
    """cuDNN's fp8 attention emulated wherever asked for (FlashAttention-3 and -4 out of the choice); returns the
    (shape, q dtype) of each kernel call."""
    from sd_accel.accel.engine import fp8_attention

    calls = []

    def build(shape, device, out_dtype):
        def run(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, out):
            assert all(t.dtype == FP8 and t.shape == shape and t.is_contiguous() for t in (q8, k8, v8))
            calls.append((tuple(shape), str(q8.dtype)))
            out.copy_(fp8_attention.sdpa_fp8_ref(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, out_dtype))
        return run

    monkeypatch.setattr(fp8_attention, "available", lambda device: (True, "emulated"))
    monkeypatch.setattr(fp8_attention.flash3, "takes", lambda device, head_dim: False)
    monkeypatch.setattr(fp8_attention.flash4, "takes", lambda device, head_dim: False)
    monkeypatch.setattr(fp8_attention, "_build", build)
    monkeypatch.setattr(fp8_attention, "_KERNELS", {})
    return calls


def _exchanges(monkeypatch) -> list:
    """The (dtype, bytes) of every all-to-all's input, as they come."""
    import torch.distributed as dist

    sent, real = [], dist.all_to_all_single

    def counted(out, x, *args, **kwargs):
        sent.append((str(x.dtype), x.numel() * x.element_size()))
        return real(out, x, *args, **kwargs)

    monkeypatch.setattr(dist, "all_to_all_single", counted)
    return sent


def _model(name: str):
    from sd_accel.accel.models import configs

    if name != "tiny-sd3":
        return configs.build_dit(name, "comfy", comfyui_root=H.comfy_root(), dtype=torch.bfloat16)
    import comfy.ldm.modules.diffusionmodules.mmdit as mmdit
    import comfy.ops

    _, cfg = configs.COMFY_DIT_CONFIGS[name]
    embedder = {"target": "torch.nn.Linear", "params": {"in_features": 32, "out_features": 256}}
    model = mmdit.OpenAISignatureMMDITWrapper(**{**cfg, "depth": 4, "context_embedder_config": embedder},
                                              operations=comfy.ops.disable_weight_init)
    return configs.seed_dit_parameters(model, 0).eval().to(torch.bfloat16)


def _inputs(name: str, text: int) -> dict:
    from sd_accel.accel.models import configs

    inp = configs.dit_example_inputs(name, batch=2, latent=8)  # 4 x 4 = 16 image tokens
    inp["context"] = torch.cat((inp["context"], inp["context"][:, :1]), 1)[:, :text]
    return {k: v.to(torch.bfloat16) if k in ("x", "context", "y") else v for k, v in inp.items()}


def _one_model(name: str, text: int, g, monkeypatch) -> dict:
    """One model's fused blocks under precision fp8: one process's output with fp8 and with 16-bit attention, the
    spread output with each, compared with the one process's; the kernel calls of one process's call and of the spread
    call with fp8 attention, and that call's exchanges."""
    from sd_accel.accel.engine import fp8, fp8_attention, fusions
    from sd_accel.accel.models.dit import CanonicalDiT
    from sd_accel.accel.parallel.sequence import sequence_parallel

    calls, sent = _emulated(monkeypatch), _exchanges(monkeypatch)
    model, inp = _model(name), _inputs(name, text)
    undo, _ = fusions.apply(model)
    canon = CanonicalDiT(model)
    marks = fusions.Undo()
    fp8.apply(model, "fp8", marks)
    try:
        with torch.no_grad():
            one = canon(**inp)
            one_calls = list(calls)
            with monkeypatch.context() as m:
                m.setattr(fp8_attention, "wanted", lambda *args: False)
                sixteen = canon(**inp)
            calls.clear()
            with sequence_parallel(model, g):
                spread = canon(**inp)
            spread_calls, spread_sent = list(calls), list(sent)
            with monkeypatch.context() as m, sequence_parallel(model, g):
                m.setattr(fp8_attention, "wanted", lambda *args: False)
                spread16 = canon(**inp)
    finally:
        marks()
        undo()
    return {"rel": H.rel(spread, one), "rel_spread_16": H.rel(spread16, sixteen), "rel_16": H.rel(sixteen, one),
            "finite": bool(torch.isfinite(spread).all()),
            "one_calls": one_calls, "calls": spread_calls, "sent": spread_sent}


def _agreeing(g, monkeypatch) -> list:
    """The choice between cuDNN's and FlashAttention-3's fp8 kernels, where rank 0 times cuDNN's faster and rank 1
    FlashAttention-3's: the kernel each rank chooses alone, under the exchange (by the largest time of each over the
    ranks), and under the exchange where rank 1's cuDNN does not take the shape, by name."""
    from sd_accel.accel.engine import fp8_attention
    from sd_accel.accel.parallel.exchange import Eight
    from sd_accel.accel.parallel.shards import Shards

    _emulated(monkeypatch)
    monkeypatch.setattr(fp8_attention, "_CHOSEN", {})
    rank = g.rank
    # rank 0: cuDNN 1.0 ms, FA3 2.0 ms; rank 1: cuDNN 3.0 ms, FA3 2.5 ms. Largest of each: cuDNN 3.0, FA3 2.5
    times = {"cudnn": (1.0, 3.0)[rank], "three": (2.0, 2.5)[rank]}
    monkeypatch.setattr(fp8_attention, "_ms", lambda run, *a: times["three" if run is fp8_attention._flash3
                                                                    else "cudnn"])
    alone, _ = fp8_attention.choose((1, 8, 2, 16), torch.device("cpu"), FP8, torch.bfloat16, True, True)
    agreed, _ = fp8_attention.choose((1, 8, 2, 16), torch.device("cpu"), FP8, torch.bfloat16, True, True,
                                     Eight(Shards(g)).agree)
    # where cuDNN does not take the shape on rank 1, rank 0 (which times it faster) takes FlashAttention-3's too
    kernel = fp8_attention.kernel
    monkeypatch.setattr(fp8_attention, "kernel", lambda *a, **k: None if rank == 1 else kernel(*a, **k))
    refused, _ = fp8_attention.choose((1, 8, 2, 32), torch.device("cpu"), FP8, torch.bfloat16, True, True,
                                      Eight(Shards(g)).agree)
    return ["FlashAttention-3" if k is fp8_attention._flash3 else "cuDNN" for k in (alone, agreed, refused)]


def _ranks(world: int) -> dict:
    from sd_accel.accel.parallel.group import Group

    H.use_comfy_attention("pytorch")
    out = {}
    for name, text in MODELS.items():
        with pytest.MonkeyPatch.context() as m:
            out[name] = _one_model(name, text, Group(), m)
    with pytest.MonkeyPatch.context() as m:
        out["agreed"] = _agreeing(Group(), m)
    return out


@pytest.mark.fp8_products("cpu")
def test_fp8_attention_over_two_processes_is_the_one_process_fp8_attention(tmp_path):
    pytest.importorskip("triton")
    from sd_accel.kernels import qk_rope

    if not qk_rope.supported(torch.zeros(1, 1, 4)):
        pytest.skip("the Triton kernels run on the CPU under Triton's interpreter only (not chosen where a GPU is)")
    results = run_ranks(_ranks, 2, tmp_path)
    for r in results:
        for name, text in MODELS.items():
            got = r[name]
            assert got["one_calls"] and got["calls"] and got["finite"], (name, got)
            # every spread attention in fp8, at the gathered shape: all tokens, half the heads
            assert len(got["calls"]) == len(got["one_calls"]), (name, got)
            for (shape, dtype), (one_shape, _) in zip(got["calls"], got["one_calls"]):
                B, L, heads, D = one_shape
                assert dtype == str(FP8) and tuple(shape) == (B, L, heads // 2, D), (name, shape, one_shape)
            # the way in: q and k as e4m3 bytes beside 16-bit v (4 bytes per channel, not 6), the way back the e4m3
            # output's bytes; one all-to-all each way per attention
            assert len(got["sent"]) == 2 * len(got["calls"]) and {d for d, _ in got["sent"]} == {"torch.uint8"}
            for (shape, _), (_, way_in), (_, way_back) in zip(got["calls"], got["sent"][::2], got["sent"][1::2]):
                B, L, h, D = shape
                # the rows the exchange moves, all ranks': SD3's text is whole on each rank (not in its MMDiT-X
                # block's image-only attention), the others' split
                split = L - (text if name == "tiny-sd3" and L > 16 else 0)
                assert way_in == 2 * (-(-(64 * 4 + B * split // 2 * 4 * h * D) // 16) * 16), (name, shape, way_in)
                assert way_back == 2 * B * (L - split // 2) * h * D, (name, shape, way_back)
            # the scales are the one process's: the spread fp8 output is the one process's as closely as the spread
            # 16-bit attention's is its one process's (Flux and Wan to the bit; SD3's whole text rows take other
            # bf16 roundings on either path), and the 16-bit attention's output is another
            assert got["rel"] <= 1.5 * got["rel_spread_16"] + 1e-6 and got["rel_16"] > 1e-3, (name, got)
            assert got["rel"] == 0 or name == "tiny-sd3", (name, got)
    assert [r["agreed"] for r in results] == [["cuDNN", "FlashAttention-3", "FlashAttention-3"],
                                              ["FlashAttention-3", "FlashAttention-3", "FlashAttention-3"]]


def test_joining_a_group_drops_the_choices_agreed_in_the_last_one(monkeypatch):
    """ComfyUI's process (rank 0) outlives its worker pools. A kernel choice it agreed with the last pool's workers
    must not keep it out of the next pool's agreement: it would go straight to the exchange while the new workers wait
    for its times, and the run would hang. Joining a group drops the agreed choices and keeps the process's own."""
    from sd_accel.accel.engine import fp8_attention
    from sd_accel.accel.parallel.rendezvous import free_port, join

    alone = ((1, 8, 2, 16), torch.device("cpu"), FP8, torch.bfloat16)
    monkeypatch.setattr(fp8_attention, "_CHOSEN", {alone: ("alone", FP8), (*alone, "agreed"): ("agreed", FP8)})
    join("gloo", free_port(), 0, 1, 60)
    try:
        assert fp8_attention._CHOSEN == {alone: ("alone", FP8)}
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the fp8 attention kernels need a GPU")
def test_a_sequence_parallel_fp8_call_replays_cuda_graphs_cut_at_its_collectives(monkeypatch):
    """A small Flux of head size 128 (cuDNN's and FlashAttention-3's) under precision fp8, sequence parallel in one
    NCCL process (the exchanges run, as copies): every attention in fp8 through the exchange, the call captured in
    pieces (one all-to-all each way per block, the gather at the end), its replays the plain first call's on those
    inputs and the one-process fp8 call's within fp8's noise."""
    pytest.importorskip("triton")
    H.import_comfy()
    from sd_accel.accel.accelerate import accelerate
    from sd_accel.accel.engine import flash3, fp8_attention
    from sd_accel.accel.models import configs
    from sd_accel.accel.parallel.group import Group
    from sd_accel.accel.parallel.rendezvous import free_port, join
    from sd_accel.accel.parallel.sequence import sequence_parallel
    from sd_accel.accel.parallel.spread import SPREAD_OPTIONS
    from test_fp8_attention import _tiny_flux_128

    device = torch.device("cuda", 0)
    ok, why = fp8_attention.available(device)
    if not ok and not flash3.takes(device, 128):  # either kernel serves the exchanged attention
        pytest.skip(f"fp8 attention cannot run: {why}, and FlashAttention-3 (fa3-fwd) does not run here either")
    _tiny_flux_128(monkeypatch)
    H.use_comfy_attention("pytorch", monkeypatch.setattr)
    join("nccl", free_port(), 0, 1, 120, device)
    try:
        model = configs.build_dit("tiny-flux-128", "comfy", comfyui_root=H.comfy_root(), dtype=torch.bfloat16,
                                  device=device)
        acc = accelerate(model, preference="torch",
                         options={**SPREAD_OPTIONS, "cuda_graphs": True, "precision": "fp8"})

        def call(seed: int, spread: bool) -> torch.Tensor:
            inp = _inputs("tiny-flux-128", 8)
            inp = {k: v.to(device) for k, v in inp.items()}
            inp["x"] = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(seed)).to(inp["x"])
            with torch.no_grad(), sequence_parallel(model, Group()) if spread else contextlib.nullcontext():
                return acc(inp["x"], inp["timesteps"], inp["context"], inp.get("y"),
                           guidance=inp.get("guidance")).float()

        fp8_attention.served_clear()
        spread = {}
        for seed in (0, 1, 0, 2, 1, 2):  # seed 0 first: the plain call; then the capture, and replays of each
            out = call(seed, True)
            assert torch.isfinite(out).all() and H.rel(out, spread.setdefault(seed, out)) <= 1e-3, seed
        served = fp8_attention.served()
        assert served and all("exchanged over 1 process" in line for line in served), served
        (entry,) = acc.engine.graphs._entries.values()
        blocks = len(model.double_blocks) + len(model.single_blocks)
        assert len(entry.pieces.graphs) == 2 * blocks + 2 and acc.engine.graphs.captures == 1
        for seed in (0, 1, 2):  # the same shapes alone: fp8 attention without the exchange
            assert H.rel(call(seed, False), spread[seed]) <= 2e-2, seed
        acc.release()
    finally:
        torch.distributed.destroy_process_group()
