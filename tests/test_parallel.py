"""Sequence parallelism (accel/parallel/sequence.py) over 2, 3 and 4 processes with gloo on the CPU: ComfyUI's own
WanModel (tiny, 12 heads, seeded) gives on every rank the output of one process, in float32, with its own blocks and
with the fused ones (Wan 2.2's modulation per frame too); so do batch (CFG) parallelism over 2, and both over 4
(2 x 2)."""

from __future__ import annotations

import pytest
import torch

import comfy_helpers as H
from gloo_helpers import run_ranks

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))


def _wan():
    import comfy.ldm.wan.model
    import comfy.ops

    from sd_accel.accel.models import configs

    _, cfg = configs.COMFY_DIT_CONFIGS["tiny-wan"]
    cfg = {k: v for k, v in cfg.items() if k != "image_model"}
    model = comfy.ldm.wan.model.WanModel(**{**cfg, "dim": 96, "ffn_dim": 192, "num_heads": 12},
                                         operations=comfy.ops.disable_weight_init)
    return configs.seed_dit_parameters(model, 0).eval()


def _wan_ranks(world: int) -> dict:
    from sd_accel.accel.engine import fusions
    from sd_accel.accel.errors import BadInput
    from sd_accel.accel.parallel.batch import batch_parallel
    from sd_accel.accel.parallel.group import Group, mesh
    from sd_accel.accel.parallel.sequence import sequence_parallel

    model = _wan()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 3, 8, 8, generator=g)  # 3 x 4 x 4 = 48 tokens per sample
    t = torch.tensor([0.3, 0.8])
    ctx = torch.randn(2, 7, 32, generator=g)
    per_frame = torch.tensor([[0.2, 0.5, 0.9], [0.1, 0.1, 0.7]])  # Wan 2.2's timesteps per latent frame
    with torch.no_grad():
        ref, ref_frames = model(x, t, ctx), model(x, per_frame, ctx)
        with sequence_parallel(model, Group()):
            out, frames = model(x, t, ctx), model(x, per_frame, ctx)
            try:  # 5 x 4 x 4 = 80 tokens: 3 processes do not split them
                model(torch.randn(2, 16, 5, 8, 8, generator=g), t, ctx)
                refused = ""
            except BadInput as e:
                refused = str(e)
        undo, counts = fusions.apply(model, ["wan"])  # the torch path's fused blocks (Triton's interpreter)
        with sequence_parallel(model, Group()):
            fused, fused_frames = model(x, t, ctx), model(x, per_frame, ctx)
        undo()
        again = model(x, t, ctx)
        outputs = [(out, ref), (frames, ref_frames), (fused, ref), (fused_frames, ref_frames)]
        if world == 2:  # CFG parallel: one sample of the batch per process
            outputs += [(batch_parallel(model, Group(), x, t, ctx), ref),
                        (batch_parallel(model, Group(), x, per_frame, ctx), ref_frames)]
        if world == 4:  # both: CFG over 2 pairs of processes, sequence parallel inside each pair
            batch, seq = mesh(2)
            with sequence_parallel(model, seq):
                outputs += [(batch_parallel(model, batch, x, t, ctx), ref),
                            (batch_parallel(model, batch, x, per_frame, ctx), ref_frames)]
    return {"rel": max(H.rel(a, b) for a, b in outputs), "refused": refused,
            "restored": bool(torch.equal(again, ref)), "fused": counts["wan"]}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_wan_over_several_processes_equals_one_process(tmp_path, world):
    results = run_ranks(_wan_ranks, world, tmp_path)
    for r in results:
        assert r["rel"] <= 1e-5 and r["restored"] and r["fused"] == 3, results
        assert ("do not split over 3 processes" in r["refused"]) == (world == 3), results


def test_a_world_that_does_not_divide_the_heads_is_refused(monkeypatch):
    H.import_comfy()
    from sd_accel.accel.errors import BadInput
    from sd_accel.accel.parallel import sequence

    monkeypatch.setattr(sequence.Group, "world", property(lambda self: 5))
    with pytest.raises(BadInput, match="5 processes do not divide the model's 12 attention heads"):
        with sequence.sequence_parallel(_wan(), sequence.Group()):
            pass


@pytest.mark.parametrize("frames,tokens,world", [(3, 48, 2), (3, 48, 3), (3, 48, 4), (4, 18, 3), (6, 6, 2)])
def test_each_rank_gets_the_modulation_rows_comfyuis_repeat_e_gives_its_tokens(frames, tokens, world):
    """Wan 2.2's per-frame modulation, spread over a rank's share of the tokens, equals that share of what ComfyUI's
    repeat_e gives one process: where the tokens divide into frames, where they do not (18 tokens of 4 frames: ComfyUI
    repeats each frame 5 times and cuts), and one row per token. (A share of one frame is one row, which the block's
    arithmetic broadcasts over the share, as ComfyUI's repeat_e leaves a single row.)"""
    H.import_comfy()
    from comfy.ldm.wan.model import repeat_e

    from sd_accel.accel.parallel.shards import Shards

    e = torch.randn(1, frames, 6, 8)
    whole = repeat_e(e, torch.empty(1, tokens, 8))
    for rank in range(world):
        g = type("G", (), {"world": world, "rank": rank})()
        share = tokens // world
        mine = Shards(g).rows(e, 1, tokens)
        got = torch.broadcast_to(repeat_e(mine, torch.empty(1, share, 8)), (1, share, 6, 8))
        assert torch.equal(got, whole[:, rank * share:(rank + 1) * share])
