"""Tiled VAE decode/encode against the untiled VAE, on the CPU with tiny seeded VAEs (diffusers and ldm form)."""

import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sd_accel.accel.cli.vae_bench import bench_vae
from sd_accel.accel.errors import BadInput, UnsupportedModel
from sd_accel.accel.models.configs import build_vae
from sd_accel.accel.vae import attention, forms, memory, plan as planner
from sd_accel.accel.vae import decode, encode, naive_tiled_decode, release_host_memory, tile_plan

TOL = 1e-3


@pytest.fixture(scope="module")
def vae():
    return build_vae("tiny", seed=0)


def _latents(shape=(2, 4, 20, 28), seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Recorder:
    def __init__(self):
        self.stages, self.advanced, self.done_calls = [], 0, 0

    def stage(self, name, total=1):
        self.stages.append((name, total))

    def advance(self, n=1):
        self.advanced += n

    def done(self):
        self.done_calls += 1


def test_decode_matches_untiled_where_per_tile_norms_do_not(vae):
    z = _latents()  # the tiny VAE upsamples 2x: a 40x56 image, 3x4 tiles of 16 px
    ref = vae.decode(z).sample
    assert tile_plan(vae, z, tile=16).grid == (3, 4)
    ours = decode(vae, z, tile=16, overlap=4)
    naive = naive_tiled_decode(vae, z, tile=16, overlap=4)
    assert ours.shape == ref.shape
    # Not a degenerate image: it varies across the picture.
    assert float(ref.std(dim=(2, 3)).min()) > 0.1
    err, naive_err = float((ours - ref).abs().max()), float((naive - ref).abs().max())
    assert err <= TOL
    assert naive_err > 0.05 and naive_err > 50 * err


def test_encode_matches_untiled(vae):
    x = torch.rand(2, 3, 40, 56, generator=torch.Generator().manual_seed(2)) * 2 - 1
    ref = vae.encode(x).latent_dist.mean
    ours = encode(vae, x, tile=16)
    assert tile_plan(vae, x, encode=True, tile=16).grid == (3, 4)
    assert ours.shape == ref.shape == (2, 4, 20, 28)
    assert float((ours - ref).abs().max()) <= TOL


def test_bands_in_host_memory_match_untiled(vae):
    # offload=True: whole-image activations channels-last in host memory, tiles are bands of whole rows, and
    # buffers freed by one pass are reused by later ones (batch 2 also takes the non-view reshape of the norm).
    z = _latents((2, 4, 20, 28))
    plan = tile_plan(vae, z, tile=16, offload=True)
    assert plan.bands and plan.store == "cpu" and plan.grid[1] == 1 and plan.grid[0] > 1
    assert float((decode(vae, z, tile=16, offload=True) - vae.decode(z).sample).abs().max()) <= TOL
    x = torch.rand(2, 3, 37, 29, generator=torch.Generator().manual_seed(5)) * 2 - 1
    ref = vae.encode(x).latent_dist.mean
    assert float((encode(vae, x, tile=12, offload=True) - ref).abs().max()) <= TOL


def test_odd_sizes_and_one_tile(vae):
    # Odd image sides exercise the strided downsample's one-sided padding at the tile edges.
    x = torch.rand(1, 3, 37, 29, generator=torch.Generator().manual_seed(3)) * 2 - 1
    ref = vae.encode(x).latent_dist.mean
    assert float((encode(vae, x, tile=12) - ref).abs().max()) <= TOL
    z = _latents((1, 4, 7, 9))
    assert float((decode(vae, z, tile=1024) - vae.decode(z).sample).abs().max()) <= TOL


def test_progress_counts_tiles_and_passes(vae):
    z = _latents((1, 4, 20, 28))
    rec = Recorder()
    decode(vae, z, tile=16, progress=rec)
    dec = vae.decoder
    resnets = len(dec.mid_block.resnets) + sum(len(b.resnets) for b in dec.up_blocks)
    upsamplers = sum(len(b.upsamplers or []) for b in dec.up_blocks)
    # post_quant_conv, conv_in, two passes per resnet, the attention, each upsampler, conv_out.
    passes = 2 + 2 * resnets + len(dec.mid_block.attentions) + upsamplers + 1
    plan = tile_plan(vae, z, tile=16)
    assert plan.tiles == 12 and plan.passes == passes
    assert rec.stages == [("vae decode", 12 * passes)]
    assert rec.advanced == 12 * passes and rec.done_calls == 1


def test_fp16_overflow_reruns_in_fp32():
    half, full = build_vae("tiny", dtype=torch.float16), build_vae("tiny")
    for m in (half, full):  # activations past fp16's 65504 right after conv_in
        with torch.no_grad():
            m.decoder.conv_in.weight.mul_(10)
    z = _latents((1, 4, 12, 12)) * 1e4
    assert not bool(torch.isfinite(half.decode(z.half()).sample).all())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = decode(half, z, tile=8)
    assert any("overflowed at decoder.conv_in" in str(w.message) for w in caught)
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())
    assert float((out.float() - full.decode(z).sample).abs().max()) < 1e-2


@pytest.mark.parametrize("rows,chunk", [(50, 16), (64, 64), (33, 1000)])
def test_attention_in_query_chunks_is_exact(rows, chunk):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 1, rows, 8, generator=g) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert torch.allclose(attention._sdpa(q, k, v, 0.3, chunk=chunk), full, atol=1e-6)


def test_wide_heads_take_the_gemm_path_exactly(monkeypatch):
    # The SD VAE's 512-wide head is past what the fused kernels take; that path is forced here on the CPU.
    monkeypatch.setattr(attention, "FUSED_HEAD_DIM", 4)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 1, 70, 8, generator=g) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    monkeypatch.setattr(attention, "SCORE_BYTES", 70 * 4 * 16)  # 16 query rows of scores at a time
    assert torch.allclose(attention._sdpa(q, k, v, 0.3), full, atol=1e-6)


def test_plan_follows_free_memory(vae, monkeypatch):
    z = torch.empty(1, 4, 64, 64)
    off_gpu = tile_plan(vae, z)
    assert (off_gpu.tile, off_gpu.store) == (planner.DEFAULT_TILE, "cpu")  # no free-memory figure: the default
    sd = build_vae("sd", device="meta")  # the real SD VAE's layout, without weights: nothing is computed
    prog = forms._decode_program(forms._parts(sd), (4, 512, 512))  # a 4096 px image

    def plan(gib, offload=None, memory_gb=None):
        monkeypatch.setattr(planner, "_free_bytes", lambda device: gib << 30)
        return planner._plan(prog, (4096, 4096), 1, torch.device("cuda", 0), torch.float16, None, offload,
                             memory_gb)

    steps = planner._step_bytes(prog, 1, 2)
    # Activations kept between passes, fp16: input, hidden state and skip of the first full-resolution block.
    assert 12e9 < max(s for s, _, _, _ in steps) < 13e9
    roomy = plan(64)
    assert (roomy.store, roomy.tile, roomy.grid, roomy.bands) == ("cuda:0", planner.TILE_CAP, (4, 4), False)
    assert plan(64, offload=True).store == "cpu"
    # The activations do not fit: host memory, in bands of whole rows, the tallest that fits beside the weights.
    budget = planner.MEMORY_USE * (4 << 30)
    for tight in (plan(4), plan(64, memory_gb=budget / planner.MEMORY_USE / 1e9)):
        assert tight.store == "cpu" and tight.bands and tight.grid == (-(-4096 // tight.tile), 1)
        assert planner._peak(steps, (tight.tile, 4096), (4096, 4096), False) <= budget
        assert planner._peak(steps, (tight.tile + 8, 4096), (4096, 4096), False) > budget or \
            (tight.tile + 8) * 4096 > planner.TILE_CAP ** 2


@pytest.mark.parametrize("call,problem", [
    (lambda v: decode(v, torch.zeros(4, 8, 8)), "4 dimensions"),
    (lambda v: decode(v, torch.zeros(1, 3, 8, 8)), "3 channels"),
    (lambda v: decode(v, torch.full((1, 4, 8, 8), float("nan"))), "NaN"),
    (lambda v: decode(v, torch.full((1, 4, 8, 8), float("inf"))), "Inf"),
    (lambda v: decode(v, torch.zeros(1, 4, 8, 8), tile=0), "positive"),
    (lambda v: decode(v, torch.zeros(1, 4, 8, 8), tile=-64), "positive"),
    (lambda v: decode(v, torch.zeros(1, 4, 8, 8), tile=64, overlap=64), "larger than its overlap"),
    (lambda v: decode(v, torch.zeros(1, 4, 8, 8), tile=64, overlap=-1), "not be negative"),
    (lambda v: decode(v, torch.zeros(1, 4, 8, 8), tile=48.0), "whole number"),
    (lambda v: naive_tiled_decode(v, torch.zeros(1, 4, 8, 8), tile=32, overlap=40), "larger than its overlap"),
    (lambda v: encode(v, torch.zeros(1, 16, 16, 3)), "channels-last"),
])
def test_bad_input_says_what_is_wrong(vae, call, problem):
    with pytest.raises(BadInput) as e:
        call(vae)
    assert problem in str(e.value) and e.value.fix


def test_unsupported_model_says_so(vae):
    with pytest.raises(UnsupportedModel, match="not an SD-style VAE"):
        decode(nn.Linear(4, 4), torch.zeros(1, 4, 8, 8))
    with pytest.raises(UnsupportedModel, match="has no decoder"):
        decode(vae.encoder, torch.zeros(1, 4, 8, 8))


def test_bench_tiny_rows():
    rows = bench_vae(tiny=True, sizes=(48,), runs=1)
    assert [r["size"] for r in rows] == [48]
    row = rows[0]
    assert isinstance(row["untiled_ms"], float) and isinstance(row["tiled_ms"], float)
    assert (row["tile"], row["grid"], row["store"]) == (12, "4x4", "cpu")
    assert row["compare_tile"] == "12/2"
    assert row["psnr_tiled_db"] > 60 and row["psnr_tiled_db"] > row["psnr_naive_db"] + 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_offload_matches_untiled(no_tf32):
    # TF32 convolutions pick different algorithms for NCHW and channels-last inputs: compare in true fp32.
    v = build_vae("tiny", device="cuda")
    z = _latents().cuda()
    ref = v.decode(z).sample
    for offload in (True, False):
        assert float((decode(v, z, tile=16, offload=offload) - ref).abs().max()) <= TOL
    release_host_memory()
    # Bands through page-locked host memory on two streams; the buffers are kept for the next run, then freed.
    assert float((decode(v, z, memory_gb=0.001) - ref).abs().max()) <= TOL
    kept = list(memory._POOL)
    assert kept and all(b.data_ptr() in memory._PINNED for b in kept)
    assert float((decode(v, z, memory_gb=0.001) - ref).abs().max()) <= TOL
    assert {b.data_ptr() for b in memory._POOL} == {b.data_ptr() for b in kept}  # reused, none added
    release_host_memory()
    assert not memory._POOL and not memory._PINNED


# ----- ldm / ComfyUI form: a small model with the structure of comfy.ldm.modules.diffusionmodules.model


def _norm(c):
    return nn.GroupNorm(32, c, eps=1e-6)


class ResnetBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.in_channels, self.out_channels, self.use_conv_shortcut = cin, cout, False
        self.norm1, self.conv1 = _norm(cin), nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm2, self.conv2 = _norm(cout), nn.Conv2d(cout, cout, 3, 1, 1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        return (self.nin_shortcut(x) if self.in_channels != self.out_channels else x) + h


class AttnBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = _norm(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        b, c, hh, ww = x.shape
        q = self.q(h).reshape(b, c, -1).permute(0, 2, 1)
        k, v = self.k(h).reshape(b, c, -1), self.v(h).reshape(b, c, -1)
        w = torch.softmax(torch.bmm(q, k) * c ** -0.5, dim=2)
        return x + self.proj_out(torch.bmm(v, w.permute(0, 2, 1)).reshape(b, c, hh, ww))


class Upsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.with_conv, self.conv = True, nn.Conv2d(c, c, 3, 1, 1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.with_conv, self.conv = True, nn.Conv2d(c, c, 3, 2, 0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


def _mid(c):
    mid = nn.Module()
    mid.block_1, mid.attn_1, mid.block_2 = ResnetBlock(c, c), AttnBlock(c), ResnetBlock(c, c)
    return mid


class Decoder(nn.Module):
    def __init__(self, ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, out_ch=3, tanh_out=False):
        super().__init__()
        block_in = ch * ch_mult[-1]
        self.tanh_out = tanh_out
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, 1, 1)
        self.mid = _mid(block_in)
        self.up = nn.ModuleList()
        for i_level in reversed(range(len(ch_mult))):
            up = nn.Module()
            up.block, up.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                up.block.append(ResnetBlock(block_in, ch * ch_mult[i_level]))
                block_in = ch * ch_mult[i_level]
            if i_level != 0:
                up.upsample = Upsample(block_in)
            self.up.insert(0, up)
        self.norm_out, self.conv_out = _norm(block_in), nn.Conv2d(block_in, out_ch, 3, 1, 1)

    def forward(self, z):
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for i_level in reversed(range(len(self.up))):
            for block in self.up[i_level].block:
                h = block(h)
            if i_level != 0:
                h = self.up[i_level].upsample(h)
        h = self.conv_out(F.silu(self.norm_out(h)))
        return torch.tanh(h) if self.tanh_out else h


class Encoder(nn.Module):
    def __init__(self, ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, in_channels=3):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, 1, 1)
        self.down = nn.ModuleList()
        block_in = ch
        for i_level, mult in enumerate(ch_mult):
            down = nn.Module()
            down.block, down.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks):
                down.block.append(ResnetBlock(block_in, ch * mult))
                block_in = ch * mult
            if i_level != len(ch_mult) - 1:
                down.downsample = Downsample(block_in)
            self.down.append(down)
        self.mid = _mid(block_in)
        self.norm_out, self.conv_out = _norm(block_in), nn.Conv2d(block_in, 2 * z_channels, 3, 1, 1)

    def forward(self, x):
        h = self.conv_in(x)
        for level in self.down:
            for block in level.block:
                h = block(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(F.silu(self.norm_out(h)))


class LdmAutoencoderKL(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = Encoder(), Decoder(tanh_out=True)
        self.quant_conv, self.post_quant_conv = nn.Conv2d(8, 8, 1), nn.Conv2d(4, 4, 1)


@pytest.fixture(scope="module")
def ldm_vae():
    torch.manual_seed(5)
    return LdmAutoencoderKL().eval().requires_grad_(False)


def test_ldm_form_decode_and_encode(ldm_vae):
    comfy_vae = types.SimpleNamespace(first_stage_model=ldm_vae)  # what ComfyUI's VAE object holds
    z = _latents((1, 4, 18, 22), seed=6)
    with torch.no_grad():
        ref = ldm_vae.decoder(ldm_vae.post_quant_conv(z))
    ours = decode(comfy_vae, z, tile=12)
    assert tile_plan(comfy_vae, z, tile=12).grid == (3, 4)
    assert float((ours - ref).abs().max()) <= TOL
    assert float(ref.std()) > 0.05
    assert float((naive_tiled_decode(comfy_vae, z, tile=16, overlap=4) - ref).abs().max()) > 50 * TOL

    x = torch.rand(1, 3, 36, 44, generator=torch.Generator().manual_seed(7)) * 2 - 1
    with torch.no_grad():
        moments = ldm_vae.quant_conv(ldm_vae.encoder(x))
    assert float((encode(ldm_vae, x, tile=12) - moments[:, :4]).abs().max()) <= TOL


def test_ldm_bare_decoder(ldm_vae):
    z = _latents((1, 4, 10, 10), seed=8)
    with torch.no_grad():
        ref = ldm_vae.decoder(z)
    assert float((decode(ldm_vae.decoder, z, tile=8) - ref).abs().max()) <= TOL
