"""The tiled Wan video decode against ComfyUI's own (untiled) decode, on the CPU with ComfyUI's WanVAE classes at
width 4 (tiny-wan21, tiny-wan22: the published layouts, seeded weights). Skipped unless COMFYUI_ROOT names a ComfyUI
checkout."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import comfy_helpers as H
from sd_accel.accel.cli.vae_bench import bench_video_vae, video_table
from sd_accel.accel.errors import BadInput, UnsupportedModel
from sd_accel.accel.models.configs import build_comfy_video_vae, build_vae, COMFY_VIDEO_VAE_CONFIGS
from sd_accel.accel.progress import CallbackProgress
from sd_accel.accel.vae import decode_video, video, video_plan
from sd_accel.accel.vae.memory import _OOM
from sd_accel.accel.vae.plan import MEMORY_USE

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))

# Exact on the CPU (the same kernels on the same values); a looser bound would hide a wrong border pixel.
TOL = 1e-5


def _tiled(vae):
    """vae, where the tiled decode takes this ComfyUI's Wan 2.1 decoder; ComfyUI 0.33's runs its up blocks chunk by
    chunk, which the decode declines (test_comfyui_nodes.py checks that the node says so and ComfyUI's decode runs)."""
    if hasattr(vae.decoder, "run_up"):
        pytest.skip("this ComfyUI's Wan 2.1 decoder (run_up, 0.33) is declined by the tiled video decode")
    return vae


@pytest.fixture(scope="module")
def wan21():
    H.import_comfy()
    return _tiled(build_comfy_video_vae("tiny-wan21", H.comfy_root(), seed=0))


@pytest.fixture(scope="module")
def wan22():
    H.import_comfy()
    return build_comfy_video_vae("tiny-wan22", H.comfy_root(), seed=0)


def _latents(vae, t: int, h: int, w: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, vae.conv2.in_channels, t, h, w, generator=torch.Generator().manual_seed(seed))


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors that operators create while it is active (by storage, each counted
    once, until the last tensor seen on it is gone): what a GPU's allocated-memory peak counts, less workspaces."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _gone(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                storage = t.untyped_storage()
                entry = self.live.setdefault(storage.data_ptr(), [storage.nbytes(), 0])
                if entry[1] == 0:
                    self.now += entry[0]
                    self.peak = max(self.peak, self.now)
                entry[1] += 1
                weakref.finalize(t, self._gone, storage.data_ptr())
        return out


# (model, latent frames, h, w, tile px): two tiles down or across, each reading short of the far border, so that
# the halo decides what the border pixels of its core see.
CASES = {"wan21 rows": ("tiny-wan21", 3, 16, 2, 64), "wan21 columns": ("tiny-wan21", 2, 2, 16, 64),
         "wan22 rows": ("tiny-wan22", 3, 28, 1, 224)}


@pytest.mark.parametrize("case", CASES)
def test_tiles_give_the_untiled_video(case, request):
    name, t, h, w, tile = CASES[case]
    vae = request.getfixturevalue("wan21" if name == "tiny-wan21" else "wan22")
    z = _latents(vae, t, h, w)
    plan = video_plan(vae, z, tile=tile)
    with torch.no_grad():
        ref = vae.decode(z)
    split = 0 if h > w else 1
    assert plan.grid[split] == 2 and plan.grid[1 - split] == 1
    assert plan.tile[split] + plan.halo < ref.shape[3 + split]  # the first tile's read stops short of the far side
    seen = []
    ours = decode_video(vae, z, tile=tile, progress=CallbackProgress(lambda name, done, eta: seen.append((name, done))))
    assert ours.shape == ref.shape and ref.shape[2] == 1 + 4 * (t - 1)
    assert float(ref.std(dim=(3, 4)).min()) > 0.1  # frames that vary across the picture, in every frame
    assert float((ours - ref).abs().max()) <= TOL
    # the whole stage, then each tile
    assert seen == [("vae decode", f) for f in (0.0, 1 / 3, 2 / 3, 1.0, 1.0)]


def test_the_halo_is_the_reach_of_the_tiled_layers():
    """In float64, so that rounding cannot hide it: with the planned halo the seam is exact, with one latent pixel
    less the last rows of the first tile's core see zero padding where their furthest inputs were (only faintly:
    that far out each path passes through every conv's edge taps)."""
    H.import_comfy()
    vae = _tiled(build_comfy_video_vae("tiny-wan21", H.comfy_root(), seed=0, dtype=torch.float64))
    z = _latents(vae, 2, 16, 2).double()
    with torch.no_grad():
        ref = vae.decode(z)
    exact = decode_video(vae, z, tile=64)
    assert float((exact - ref).abs().max()) < 1e-12
    real = video._halo
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(video, "_halo", lambda ops, what: real(ops, what) - 1)
        short = decode_video(vae, z, tile=64)
    err = (short - ref).abs().amax(dim=(0, 1, 2, 4))  # per output row; the seam is at row 64
    assert float(err[:62].max()) < 1e-12 and float(err[66:].max()) < 1e-12
    assert float(err[62:66].min()) > 1e-11


@pytest.fixture(scope="module")
def published():
    """Wan 2.1's and Wan 2.2's VAE at their published widths, on the meta device: shapes without weights, for plans."""
    H.import_comfy()
    import comfy.ldm.wan.vae
    import comfy.ldm.wan.vae2_2

    with torch.device("meta"):
        return (_tiled(comfy.ldm.wan.vae.WanVAE(**COMFY_VIDEO_VAE_CONFIGS["wan21"][1])),
                comfy.ldm.wan.vae2_2.WanVAE(**COMFY_VIDEO_VAE_CONFIGS["wan22"][1]))


def test_halos_of_the_published_layouts(published):
    """The halos derived by hand from ComfyUI's layers, backwards from the output. Wan 2.1, whose tiles begin at
    the first upsampling layer: the head conv, three blocks of two 3x3 convs and the upsampling conv at 8x: 8 px, 4
    at 4x; plus 6 + 1: 11, 6 at 2x; plus 6 + 1: 13, 7 at the latent resolution. Wan 2.2, whose first up block runs
    six convs at the latent resolution before it upsamples, so the tiles begin after it: 8 at 8x, 4 at 4x; 11, 6 at
    2x; plus the next block's six: 12 at 2x, the resolution the tiles cut."""
    s21, s22 = (video._stages(v) for v in published)
    assert (s21.whole_scale, s21.halo, s21.scale, s21.frames, s21.channels) == (1, 7, 8, 4, 3)
    assert (s22.whole_scale, s22.halo, s22.scale, s22.frames, s22.channels) == (2, 12, 8, 4, 3)


def test_plan_follows_the_memory_limit(published):
    wan21 = published[0]
    z = torch.zeros(1, 16, 21, 90, 160)  # 1280x720, 81 frames
    whole = video_plan(wan21, z, tile=1280)
    assert whole.tiles == 1 and whole.work == 1.0
    limits = [whole.peak_gb / MEMORY_USE, whole.peak_gb / 2, whole.peak_gb / 3]
    plans = [video_plan(wan21, z, memory_gb=gb) for gb in limits]
    assert plans[0].tiles == 1 and 1 < plans[1].tiles < plans[2].tiles
    for gb, p in zip(limits, plans):
        assert p.peak_gb <= MEMORY_USE * gb
    # Smaller tiles recompute more of their neighbours' pixels, but at 720p not much.
    assert 1.0 < plans[1].work < plans[2].work < 1.5
    least = video_plan(wan21, z, memory_gb=1e-6)  # nothing fits: the grid of least memory
    assert least.peak_gb < plans[2].peak_gb and least.peak_gb <= video_plan(wan21, z, tile=8).peak_gb


def test_memory_peak_is_below_the_untiled_one_and_within_the_estimate(wan21):
    z = _latents(wan21, 2, 40, 2)
    with torch.no_grad(), LiveBytes() as untiled:
        ref = wan21.decode(z)
    plan = video_plan(wan21, z, tile=112)
    assert plan.grid == (3, 1)
    with LiveBytes() as tiled:
        ours = decode_video(wan21, z, tile=112)
    assert float((ours - ref).abs().max()) <= TOL
    assert tiled.peak < 0.85 * untiled.peak
    assert tiled.peak <= plan.peak_gb * 1e9
    assert untiled.peak <= video_plan(wan21, z, tile=40 * 8).peak_gb * 1e9  # one tile's estimate: the untiled


def test_a_tile_out_of_memory_starts_the_tiles_again_smaller(wan21, monkeypatch):
    z = _latents(wan21, 1, 48, 1)  # one frame, one column: quick
    with torch.no_grad():
        ref = wan21.decode(z)
    one = video_plan(wan21, z, tile=48 * 8)
    assert torch.equal(decode_video(wan21, z, tile=48 * 8), ref)  # one tile: the host's own decode
    first = video_plan(wan21, z, memory_gb=0.75 * one.peak_gb)
    assert first.grid == (2, 1)
    real, seen = video._decode_tile, []

    def tight(st, a):  # the first plan's tiles, of 24 + 7 latent rows, do not fit
        seen.append(a.shape[3])
        if a.shape[3] >= (first.tile[0] + first.halo) // 8:
            raise _OOM("out of memory (test)")
        return real(st, a)

    monkeypatch.setattr(video, "_decode_tile", tight)
    with pytest.warns(UserWarning, match="ran out of GPU memory"):
        ours = decode_video(wan21, z, memory_gb=0.75 * one.peak_gb)
    assert seen[0] == 31 and max(seen[1:]) < 31
    assert float((ours - ref).abs().max()) <= TOL


@pytest.mark.parametrize("call,problem", [
    (lambda v: decode_video(v, torch.zeros(16, 2, 4, 4)), "Add the batch dimension"),
    (lambda v: decode_video(v, torch.zeros(1, 16, 4, 4)), "5 dimensions"),
    (lambda v: decode_video(v, torch.zeros(1, 4, 2, 4, 4)), "4 channels"),
    (lambda v: decode_video(v, torch.full((1, 16, 2, 4, 4), float("nan"))), "NaN"),
    (lambda v: decode_video(v, torch.zeros(1, 16, 2, 4, 4), tile=0), "positive"),
    (lambda v: decode_video(v, torch.zeros(1, 16, 2, 4, 4), memory_gb=0), "memory_gb"),
])
def test_bad_input_says_what_is_wrong(wan21, call, problem):
    with pytest.raises(BadInput) as e:
        call(wan21)
    assert problem in str(e.value) and e.value.fix


def test_models_the_tiles_cannot_compute_are_refused():
    with pytest.raises(UnsupportedModel, match="not a Wan video VAE"):
        decode_video(build_vae("tiny"), torch.zeros(1, 4, 2, 4, 4))
    H.import_comfy()
    import comfy.ldm.wan.vae

    # attention in the second up block (2x the latent): it mixes a whole frame, which no tile holds
    attn = _tiled(comfy.ldm.wan.vae.WanVAE(**{**COMFY_VIDEO_VAE_CONFIGS["tiny-wan21"][1], "attn_scales": [0.5]}))
    with pytest.raises(UnsupportedModel, match="attention past the latent resolution"):
        decode_video(attn, torch.zeros(1, 16, 2, 4, 4))


def test_bench_tiny_rows():
    H.import_comfy()
    _tiled(build_comfy_video_vae("tiny-wan21", H.comfy_root(), seed=0))
    rows = bench_video_vae(["tiny-wan21"], str(H.comfy_root()), tiny=True, runs=1)
    assert len(rows) == 1
    row = rows[0]
    assert (row["model"], row["size"], row["frames"], row["halo"]) == ("tiny-wan21", "16x512", 5, 56)
    assert row["grid"] == "5x1" and 0 < row["est_peak_gb"] <= MEMORY_USE * row["cap_gb"]
    assert row["max_err"] <= TOL and row["untiled_peak_gb"] is None and row["dtype_psnr_db"] is None
    lines = video_table(rows).splitlines()
    assert lines[1].split()[:3] == ["model", "size", "frames"] and lines[3].split()[:3] == ["tiny-wan21", "16x512", "5"]
