"""The DiT kernels (adaLN modulation, q/k RMSNorm with the rotary embedding) against their torch references, at odd
shapes; on the CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 first)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from sd_accel.accel.errors import BadInput  # noqa: E402
from sd_accel.kernels import adaln, qk_rope  # noqa: E402

from test_kernels import DEVICE, _close, _randn  # noqa: E402  (the interpreter set-up and tolerances)

if not adaln.supported(torch.zeros(1, 1, 8, device=DEVICE)):
    pytest.skip("Triton cannot run here (imported before TRITON_INTERPRET=1): run pytest from the repository root.",
                allow_module_level=True)


def _flux_mod(B, C, dtype, seed):
    """Flux's modulation: chunks of one (B, 1, 6C) projection, so (B, 1, C) views with batch stride 6C."""
    return _randn(B, 1, 6 * C, dtype=dtype, seed=seed, scale=0.5).chunk(6, dim=-1)


@pytest.mark.parametrize("B,L,C,dtype", [(2, 13, 40, torch.float32), (1, 7, 300, torch.bfloat16),
                                         (3, 5, 64, torch.float16)])
def test_modulated_layer_norm_is_flux_modulation(B, L, C, dtype):
    x = _randn(B, L, C, dtype=dtype, offset=2.0)
    shift, scale, gate, *_ = _flux_mod(B, C, dtype, 1)
    want = (F.layer_norm(x.float(), (C,), eps=1e-6) * (1 + scale.float()) + shift.float())
    _close(adaln.modulated_layer_norm(x, scale, shift), want, dtype)
    _close(adaln.modulated_layer_norm_ref(x, scale, shift), want, dtype)
    # MMDiT's (B, C) modulation and its scale-only variant (no shift)
    _close(adaln.modulated_layer_norm(x, scale[:, 0], None), F.layer_norm(x.float(), (C,), eps=1e-6)
           * (1 + scale.float()), dtype)


@pytest.mark.parametrize("B,L,C,dtype", [(2, 11, 48, torch.float32), (1, 9, 200, torch.bfloat16)])
def test_gated_residual_then_modulated_layer_norm(B, L, C, dtype):
    x, u = _randn(B, L, C, dtype=dtype), _randn(B, L, C, dtype=dtype, seed=2)
    shift, scale, gate, *_ = _flux_mod(B, C, dtype, 3)
    y, s = adaln.modulated_layer_norm(x, scale, shift, update=u, gate=gate)
    s_want = x.float() + gate.float() * u.float()
    _close(s, s_want, dtype)
    _close(y, F.layer_norm(s.float(), (C,), eps=1e-6) * (1 + scale.float()) + shift.float(), dtype)
    y_ref, s_ref = adaln.modulated_layer_norm_ref(x, scale, shift, update=u, gate=gate)
    _close(y, y_ref, dtype)
    _close(s, s_ref, dtype)


@pytest.mark.parametrize("B,L,C,dtype", [(2, 11, 48, torch.float32), (1, 9, 200, torch.bfloat16)])
def test_rms_form_is_ltx2s_rms_adaln_after_its_residual_in_place(B, L, C, dtype):
    """LTX-2's video norms: comfy-kitchen's rms_adaln (RMS norm, then the modulation) and the plain RMS norm before
    its text attention, each after the residual ComfyUI adds to the stream in place just before."""
    x, u = _randn(B, L, C, dtype=dtype, offset=1.0), _randn(B, L, C, dtype=dtype, seed=2)
    shift, scale, gate, *_ = _flux_mod(B, C, dtype, 6)
    rms = lambda s: F.rms_norm(s.float(), (C,), eps=1e-6)  # noqa: E731
    _close(adaln.modulated_layer_norm(x, scale, shift, rms=True), rms(x) * (1 + scale.float()) + shift.float(), dtype)
    s_want = x.float() + gate.float() * u.float()
    y_ref, s_ref = adaln.modulated_layer_norm_ref(x, None, None, update=u, gate=gate, rms=True)
    ptr = x.data_ptr()
    y, s = adaln.modulated_layer_norm(x, None, None, update=u, gate=gate, rms=True, in_place=True)
    assert s is x and x.data_ptr() == ptr
    _close(s, s_want, dtype)
    _close(y, rms(s), dtype)
    _close(y, y_ref, dtype)
    _close(s, s_ref, dtype)
    with pytest.raises(BadInput, match="in_place"):
        adaln.modulated_layer_norm(x[:, ::2], scale, shift, update=u[:, ::2], rms=True, in_place=True)


@pytest.mark.parametrize("B,L,C,dtype", [(2, 11, 48, torch.float32), (1, 9, 1300, torch.bfloat16)])
def test_gated_add_is_the_gated_residual_in_place(B, L, C, dtype):
    x, u = _randn(B, L, C, dtype=dtype), _randn(B, L, C, dtype=dtype, seed=2)
    gate = _flux_mod(B, C, dtype, 4)[2]
    want = x.float() + gate.float() * u.float()
    ptr = x.data_ptr()
    out = adaln.gated_add_(x, gate, u)
    assert out is x and x.data_ptr() == ptr
    _close(x, want, dtype)
    with pytest.raises(BadInput, match="contiguous"):
        adaln.gated_add_(x[:, ::2], gate, u[:, ::2])


@pytest.mark.parametrize("T,L", [(3, 12), (4, 18), (7, 7), (5, 3)])
def test_modulation_per_run_of_tokens_is_comfyuis_repeat_e(T, L):
    """Wan 2.2's modulation (B, T, C), spread over L tokens as ComfyUI's repeat_e spreads it: T dividing L, not
    dividing it (each row once more, the end cut), a row per token, more rows than tokens; and the stream after Wan's
    cross-attention, whose update comes ungated."""
    B, C = 2, 24
    x, u = _randn(B, L, C), _randn(B, L, C, seed=2)
    scale, shift, gate = (_randn(B, T, C, seed=s, scale=0.5) for s in (3, 4, 5))
    per = L // T if L // T * T == L else L // T + 1
    rows = lambda t: torch.repeat_interleave(t, per, dim=1)[:, :L]  # noqa: E731 (repeat_e's arithmetic)
    norm = lambda s: F.layer_norm(s, (C,), eps=1e-6) * (1 + rows(scale)) + rows(shift)  # noqa: E731
    y, s = adaln.modulated_layer_norm(x, scale, shift, update=u, gate=gate)
    _close(s, x + rows(gate) * u, torch.float32)
    _close(y, norm(s), torch.float32)
    y, s = adaln.modulated_layer_norm(x, scale, shift, update=u)
    _close(s, x + u, torch.float32)
    _close(y, norm(x + u), torch.float32)
    _close(adaln.modulated_layer_norm_ref(x, scale, shift, update=u, gate=gate)[0], norm(x + rows(gate) * u),
           torch.float32)
    want = x + rows(gate) * u
    _close(adaln.gated_add_(x, gate, u), want, torch.float32)


def test_modulation_of_one_sample_broadcasts_over_the_batch():
    x = _randn(3, 4, 24)
    scale, shift = _randn(1, 24, seed=1), _randn(1, 24, seed=2)
    _close(adaln.modulated_layer_norm(x, scale, shift), adaln.modulated_layer_norm_ref(x, scale.expand(3, 24),
                                                                                       shift.expand(3, 24)),
           torch.float32)


def test_modulated_layer_norm_errors_say_what_to_do():
    x = _randn(2, 3, 8)
    with pytest.raises(BadInput, match="scale has shape"):
        adaln.modulated_layer_norm(x, _randn(2, 7), None)
    with pytest.raises(BadInput, match="a gate goes with an update"):
        adaln.modulated_layer_norm(x, _randn(2, 8), None, gate=_randn(2, 8))
    with pytest.raises(BadInput, match="batch, tokens, channels"):
        adaln.modulated_layer_norm(_randn(6, 8), _randn(2, 8), None)


def _flux_pe(B, total, D, seed=5):
    """Flux's rotary table: (B, 1, total, D/2, 2, 2) rotation matrices of random angles."""
    a = _randn(B, 1, total, D // 2, seed=seed, scale=3.0).float()
    c, s = torch.cos(a), torch.sin(a)
    return torch.stack([c, -s, s, c], dim=-1).reshape(B, 1, total, D // 2, 2, 2)


@pytest.mark.parametrize("B,L,H,D,dtype", [(2, 9, 3, 16, torch.float32), (1, 5, 2, 24, torch.bfloat16),
                                           (1, 33, 4, 128, torch.float32)])
def test_qk_norm_rope_is_flux_attention_input(B, L, H, D, dtype):
    qkv = _randn(B, L, 3 * H * D, dtype=dtype, scale=2.0)
    qw, kw = _randn(D, seed=1, offset=1.0, scale=0.1), _randn(D, seed=2, offset=1.0, scale=0.1)
    pe = _flux_pe(B, L, D)
    got = qk_rope.empty_qkv(B, L, H, D, qkv)
    qk_rope.qk_norm_rope(qkv, H, got, q_weight=qw, k_weight=kw, pe=pe)
    # Flux's own code: view, RMSNorm per head, rotation in float32
    q, k, v = qkv.view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
    q, k = (F.rms_norm(t, (D,), w.to(dtype), 1e-6) for t, w in ((q, qw), (k, kw)))

    def rot(t):
        t2 = t.float().reshape(*t.shape[:-1], -1, 1, 2)
        return (pe[..., 0] * t2[..., 0] + pe[..., 1] * t2[..., 1]).reshape(t.shape).to(dtype)

    for out, want in zip(got, (rot(q), rot(k), v)):
        _close(out.transpose(1, 2), want, dtype)
    for out, want in zip(got, qk_rope.qk_norm_rope_ref(qkv, H, qw, kw, pe=pe)):
        _close(out, want, dtype)


def test_qk_norm_rope_assembles_a_joint_sequence_from_strided_rows():
    """Text then image tokens written at their offsets; the image's qkv a slice of a wider projection (Flux's single
    blocks), no norm (SD3 without qk norm) or no rotation (SD3.5)."""
    B, H, D, Lt, Li = 2, 2, 8, 3, 6
    wide = _randn(B, Li, 3 * H * D + 20, seed=7)
    img, txt = wide[..., :3 * H * D], _randn(B, Lt, 3 * H * D, seed=8)
    pe = _flux_pe(1, Lt + Li, D)
    got = qk_rope.empty_qkv(B, Lt + Li, H, D, img)
    qk_rope.qk_norm_rope(txt, H, got, 0, pe=pe)
    qk_rope.qk_norm_rope(img, H, got, Lt, pe=pe)
    want = [torch.cat(p, dim=1) for p in zip(qk_rope.qk_norm_rope_ref(txt, H, pe=pe, offset=0),
                                              qk_rope.qk_norm_rope_ref(img, H, pe=pe, offset=Lt))]
    for out, w in zip(got, want):
        _close(out, w, torch.float32)
    qw, kw = _randn(D, seed=1), _randn(D, seed=2)
    got = qk_rope.empty_qkv(B, Li, H, D, img)
    qk_rope.qk_norm_rope(img, H, got, q_weight=qw, k_weight=kw)
    for out, w in zip(got, qk_rope.qk_norm_rope_ref(img, H, qw, kw)):
        _close(out, w, torch.float32)


@pytest.mark.parametrize("B,L,H,D,dtype", [(2, 13, 3, 8, torch.float32), (1, 21, 5, 16, torch.bfloat16)])
def test_qk_row_norm_rope_is_wan_attention_input(B, L, H, D, dtype):
    """Wan's self-attention inputs: q and k RMS-normalized over all heads (its RMSNorm of dim channels), rotated by the
    table of its rope_encode (B|1, L, 1, D / 2, 2, 2), whose transpose the kernel takes."""
    q, k, v = (_randn(B, L, H * D, dtype=dtype, seed=s, scale=2.0) for s in (3, 4, 5))
    qw, kw = _randn(H * D, seed=1, offset=1.0, scale=0.1), _randn(H * D, seed=2, offset=1.0, scale=0.1)
    pe = _flux_pe(1, L, D)
    got = qk_rope.empty_qkv(B, L, H, D, q)
    qk_rope.qk_row_norm_rope((q, k, v), H, got, qw.to(dtype), kw.to(dtype), 1e-6, pe)

    def wan(t, w):  # RMSNorm over the row, then the rotation in float32 per head, as ComfyUI's apply_rope1
        t = F.rms_norm(t, (H * D,), w.to(dtype), 1e-6).view(B, L, H, D)
        t2 = t.float().reshape(B, L, H, -1, 1, 2)
        rows = pe.transpose(1, 2)  # (1, L, 1, D / 2, 2, 2): Wan's layout
        return (rows[..., 0] * t2[..., 0] + rows[..., 1] * t2[..., 1]).reshape(t.shape).to(dtype)

    for out, want in zip(got, (wan(q, qw), wan(k, kw), v.view(B, L, H, D))):
        _close(out, want, dtype)
    with pytest.raises(BadInput, match="rows have"):
        qk_rope.qk_row_norm_rope((q, k, v), H, got, qw[:D], kw, 1e-6, pe)


# the last: runs of 8 tokens a program (the launch's choice from B * L), the last run cut short
@pytest.mark.parametrize("B,L,H,D,dtype,pe_batch", [(2, 13, 3, 8, torch.float32, 2), (1, 21, 5, 16, torch.bfloat16, 1),
                                                     (2, 7, 2, 128, torch.bfloat16, 1), (1, 4101, 1, 8, torch.float32, 1)])
def test_qk_row_norm_split_rope_is_ltx2_attention_input(B, L, H, D, dtype, pe_batch):
    """LTX-2's self-attention inputs: q and k RMS-normalized over all heads, then rotated by its split table (B|1, L,
    heads, D / 2, 2, 2) in the projections' dtype, element j of each head with element j + D / 2, in float32 on the
    normalized values rounded to the dtype, as ComfyUI's rms norm and comfy-kitchen's apply_rope_split_half compute
    them; in e4m3 under the row's bound, the 16-bit result quantized."""
    q, k, v = (_randn(B, L, H * D, dtype=dtype, seed=s, scale=2.0) for s in (3, 4, 5))
    qw, kw = (_randn(H * D, seed=s, offset=1.0, scale=0.1).to(dtype) for s in (1, 2))
    a = _randn(pe_batch, L, H, D // 2, seed=6, scale=3.0).float()
    c, s_ = torch.cos(a).to(dtype), torch.sin(a).to(dtype)
    pe = torch.stack([c, -s_, s_, c], dim=-1).reshape(pe_batch, L, H, D // 2, 2, 2)
    got = qk_rope.empty_qkv(B, L, H, D, q)
    qk_rope.qk_row_norm_split_rope((q, k, v), H, got, qw, kw, 1e-6, pe)

    def ltx2(t, w):
        x1, x2 = F.rms_norm(t, (H * D,), w, 1e-6).view(B, L, H, D).float().chunk(2, dim=-1)
        r = pe.float()
        return torch.cat([r[..., 0, 0] * x1 + r[..., 0, 1] * x2, r[..., 1, 0] * x1 + r[..., 1, 1] * x2], -1).to(dtype)

    for out, want in zip(got, (ltx2(q, qw), ltx2(k, kw), v.view(B, L, H, D))):
        _close(out, want, dtype)
    descales = qk_rope.qk_descales([qw], [kw])
    eight = qk_rope.empty_qkv(B, L, H, D, q, qk_fp8=True)
    amax = qk_rope.new_v_amax(DEVICE)
    qk_rope.qk_row_norm_split_rope((q, k, v), H, eight, qw, kw, 1e-6, pe, descales=descales, v_amax=amax)
    for out, ref, d in zip(eight[:2], got[:2], descales[:, 0]):
        _e4m3_close(out, (ref.float() / d).to(qk_rope.FP8), d)
    assert torch.equal(eight[2], v.view(B, L, H, D)) and amax.max().item() == v.float().abs().max().item()
    with pytest.raises(BadInput, match="split rotary table"):
        qk_rope.qk_row_norm_split_rope((q, k, v), H, got, qw, kw, 1e-6, pe.transpose(1, 2))


@pytest.mark.parametrize("B,L,H,D,dtype,pe_batch", [(2, 9, 3, 16, torch.float32, 2), (1, 21, 4, 32, torch.bfloat16, 1)])
def test_row_norm_split_rope_is_ltx2_cross_attention_input(B, L, H, D, dtype, pe_batch):
    """An LTX-2 audio-video attention's q (or k) alone, from a strided view (its k is half of the packed k/v
    projection): RMS-normalized over all heads with its weight, then rotated by the split table of its own tokens, as
    ComfyUI's rms norm and comfy-kitchen's apply_rope_split_half1 compute it."""
    kv = _randn(B, L, 2 * H * D, dtype=dtype, seed=7, scale=2.0)
    x = kv[..., :H * D]
    w = _randn(H * D, seed=8, offset=1.0, scale=0.1).to(dtype)
    a = _randn(pe_batch, L, H, D // 2, seed=9, scale=3.0).float()
    c, s_ = torch.cos(a), torch.sin(a)
    pe = torch.stack([c, -s_, s_, c], dim=-1).reshape(pe_batch, L, H, D // 2, 2, 2)
    got = torch.empty(B, L, H, D, dtype=dtype, device=x.device)
    qk_rope.row_norm_split_rope(x, H, got, w, 1e-6, pe)
    x1, x2 = F.rms_norm(x, (H * D,), w, 1e-6).view(B, L, H, D).float().chunk(2, dim=-1)
    want = torch.cat([pe[..., 0, 0] * x1 + pe[..., 0, 1] * x2, pe[..., 1, 0] * x1 + pe[..., 1, 1] * x2], -1)
    _close(got, want.to(dtype), dtype)
    with pytest.raises(BadInput, match="split rotary table"):
        qk_rope.row_norm_split_rope(x, H, got, w, 1e-6, pe[:, :-1])


def test_qk_norm_rope_errors_say_what_to_do():
    qkv = _randn(1, 4, 48)
    out = qk_rope.empty_qkv(1, 4, 2, 8, qkv)
    with pytest.raises(BadInput, match="not 3 x 5 heads"):
        qk_rope.qk_norm_rope(qkv, 5, out)
    with pytest.raises(BadInput, match="do not fit"):
        qk_rope.qk_norm_rope(qkv, 2, out, offset=2)
    with pytest.raises(BadInput, match="pe has shape"):
        qk_rope.qk_norm_rope(qkv, 2, out, pe=_flux_pe(1, 4, 8).half())
    with pytest.raises(BadInput, match="three projections"):
        qk_rope.qk_norm_rope((qkv[..., :16], qkv[..., 16:32], _randn(1, 4, 16)), 2, out)  # one layout differs


def test_qk_norm_rope_takes_q_k_and_v_as_three_projections():
    """diffusers' attention projects q, k and v separately: the same result as the packed projection."""
    B, L, H, D = 2, 7, 2, 8
    qkv = _randn(B, L, 3 * H * D, seed=4, scale=2.0)
    q, k, v = (t.contiguous() for t in qkv.chunk(3, dim=-1))
    qw, kw, pe = _randn(D, seed=1, offset=1.0), _randn(D, seed=2, offset=1.0), _flux_pe(1, L, D)
    packed, separate = qk_rope.empty_qkv(B, L, H, D, qkv), qk_rope.empty_qkv(B, L, H, D, qkv)
    qk_rope.qk_norm_rope(qkv, H, packed, q_weight=qw, k_weight=kw, pe=pe)
    qk_rope.qk_norm_rope((q, k, v), H, separate, q_weight=qw, k_weight=kw, pe=pe)
    assert all(torch.equal(a, b) for a, b in zip(packed, separate))


def test_qk_norm_rope_takes_a_rotary_table_in_the_activations_dtype():
    """Qwen-Image's forward casts its table (B, L, 1, D / 2, 2, 2) to the activations' bfloat16 and rotates in
    bfloat16 (its apply_rotary_emb); the kernel reads that table and rotates in float32, within bfloat16's rounding."""
    B, L, H, D = 2, 11, 3, 16
    q, k, v = (_randn(B, L, H * D, dtype=torch.bfloat16, seed=s, scale=2.0) for s in (3, 4, 5))
    qw, kw = _randn(D, seed=1, offset=1.0, scale=0.1), _randn(D, seed=2, offset=1.0, scale=0.1)
    table = _flux_pe(B, L, D).transpose(1, 2).to(torch.bfloat16)  # Qwen-Image's layout
    got = qk_rope.empty_qkv(B, L, H, D, q)
    qk_rope.qk_norm_rope((q, k, v), H, got, q_weight=qw, k_weight=kw, pe=table.transpose(1, 2))

    def qwen(t, w):  # RMSNorm per head, then the rotation in bfloat16, as ComfyUI's Qwen-Image attention
        t = F.rms_norm(t.view(B, L, H, D), (D,), w.to(t.dtype), 1e-6)
        t2 = t.reshape(B, L, H, -1, 1, 2)
        return (table[..., 0] * t2[..., 0] + table[..., 1] * t2[..., 1]).reshape(t.shape)

    for out, want in zip(got, (qwen(q, qw), qwen(k, kw), v.view(B, L, H, D))):
        _close(out, want, torch.bfloat16)
    with pytest.raises(BadInput, match="pe has shape"):  # a 16-bit table of another dtype than q's
        qk_rope.qk_norm_rope((q, k, v), H, got, pe=table.transpose(1, 2).half())


@pytest.mark.parametrize("M,K,dtype", [(7, 300, torch.bfloat16), (5, 4096, torch.float16), (3, 64, torch.float32),
                                     (3, 18432, torch.bfloat16), (2, 16385, torch.float16)])
def test_quantize_rows_scales_each_row_to_e4m3s_range(M, K, dtype):
    """The kernel against its reference, to the bit (values are rounded to e4m3 before the conversion, so under
    Triton's interpreter too); rows longer than one block (MAX_K) in steps."""
    from sd_accel.kernels import quant

    x = _randn(M, K, dtype=dtype, scale=3.0)
    x[1] = 0  # an all-zero row still gets a usable scale
    q_ref, s_ref = quant.quantize_rows_ref(x)
    q, s = quant.quantize_rows(x)
    assert q.dtype == quant.FP8 and q.shape == (M, K) and s.shape == (M, 1)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), q_ref.float())
    assert q.float().abs().amax(dim=1)[0] > 400  # the largest value lands near 448
    # e4m3 keeps 3 mantissa bits: within one step (1/8 of the value) of x
    assert ((q.float() * s - x.float()).abs() <= x.float().abs() / 8 + s * 2 ** -9).all()
    assert (x.float().abs() / s <= 448).all()
    strided = _randn(M, 2 * K, dtype=dtype)[:, :K]  # rows of a wider tensor
    assert all(torch.equal(a.float(), b.float())
               for a, b in zip(quant.quantize_rows(strided), quant.quantize_rows_ref(strided)))
    with pytest.raises(BadInput, match="contiguous rows"):
        quant.quantize_rows(x.t())
    # the engine quantizes with it on GPUs; the CPU takes the reference (the same values, at torch's speed)
    assert quant.supported(x) == (DEVICE == "cuda")


def _within_one_e4m3_step(q: torch.Tensor, s: torch.Tensor, want: torch.Tensor) -> None:
    """q * s is want quantized per row: the scale maps each row's largest magnitude to 448, every value within one
    e4m3 step (3 mantissa bits) of want."""
    torch.testing.assert_close(s, (want.abs().amax(dim=1, keepdim=True) / 448).clamp_min(1e-12), rtol=1e-5, atol=0)
    assert ((q.float() * s - want).abs() <= want.abs() / 8 + s * 2 ** -9).all()


@pytest.mark.parametrize("M,K,dtype", [(7, 300, torch.bfloat16), (5, 12288, torch.float16),
                                     (2, 18432, torch.bfloat16)])
def test_quantize_rows_with_gelu_quantizes_the_tanh_gelu(M, K, dtype):
    """An MLP's hidden activation: the tanh GELU (in float32) and the quantization in one pass."""
    from sd_accel.kernels import quant

    x = _randn(M, K, dtype=dtype, scale=3.0)
    want = F.gelu(x.float(), approximate="tanh")
    _within_one_e4m3_step(*quant.quantize_rows_ref(x, gelu=True), want)
    _within_one_e4m3_step(*quant.quantize_rows(x, gelu=True), want)


@pytest.mark.parametrize("M,H,dtype", [(7, 150, torch.bfloat16), (4, 8192, torch.float16), (3, 9000, torch.bfloat16),
                                     (2, 18432, torch.bfloat16), (0, 64, torch.bfloat16), (3, 1, torch.float32)])
def test_quantize_rows_with_swiglu_quantizes_silu_of_the_gate_times_up(M, H, dtype):
    """Flux.2's MLP: rows of [gate | up] (ComfyUI's SiLUActivation chunks them in that order) to SiLU(gate) * up in
    float32, quantized, in one pass: half the row's width, one block up to MAX_K loaded values, steps past it (Flux.2's
    18,432-wide hidden)."""
    from sd_accel.kernels import quant

    x = _randn(M, 2 * H, dtype=dtype, scale=3.0)
    if M:
        x[-1] = 0
    gate, up = x.float().chunk(2, dim=1)
    want = F.silu(gate) * up
    q, s = quant.quantize_rows(x, swiglu=True)
    assert q.shape == (M, H) and s.shape == (M, 1)
    _within_one_e4m3_step(q, s, want)
    q_ref, s_ref = quant.quantize_rows_ref(x, swiglu=True)
    _within_one_e4m3_step(q_ref, s_ref, want)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # float32 SiLUs a bit apart (exp's last bit) may round to neighbouring e4m3 values, and rarely do
    assert (q.float() != q_ref.float()).sum() <= q.numel() // 1000
    with pytest.raises(BadInput, match="even number"):
        quant.quantize_rows(x[:, 1:], swiglu=True)
    with pytest.raises(BadInput, match="one of them"):
        quant.quantize_rows(x, gelu=True, swiglu=True)


@pytest.mark.parametrize("M,K,dtype,act", [(7, 300, torch.bfloat16, ""), (3, 18432, torch.bfloat16, ""),
                                         (5, 1000, torch.float16, "gelu"), (4, 2 * 1536, torch.bfloat16, "swiglu"),
                                         (2, 2 * 9000, torch.bfloat16, "swiglu")])
def test_quantize_rows_to_int8_rounds_each_row_onto_127_steps(M, K, dtype, act):
    """int8 rows (int8 products): each row's largest magnitude to 127, every value within half a step of the row's
    scale (7 bits where e4m3 keeps 3), rounded half away from zero as the reference does; held and walked rows."""
    from sd_accel.kernels import quant

    x = _randn(M, K, dtype=dtype, scale=3.0)
    x[1] = 0
    kw = {act: True} if act else {}
    want = x.float()
    if act == "gelu":
        want = F.gelu(want, approximate="tanh")
    if act == "swiglu":
        gate, up = want.chunk(2, dim=1)
        want = F.silu(gate) * up
    q, s = quant.quantize_rows(x, dtype=quant.INT8, **kw)
    q_ref, s_ref = quant.quantize_rows_ref(x, dtype=quant.INT8, **kw)
    assert q.dtype == q_ref.dtype == torch.int8 and q.shape == want.shape and s.shape == (M, 1)
    torch.testing.assert_close(s, (want.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12), rtol=1e-5, atol=0)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # an activation's float32 last bits may move a value to the neighbouring step, and rarely do
    assert (q.int() - q_ref.int()).abs().max() <= (1 if act else 0)
    assert (q != q_ref).sum() <= q.numel() // 1000
    assert q.int().abs().amax(dim=1)[0] == 127 and (q.int().abs() <= 127).all()
    assert ((q.float() * s - want).abs() <= s * 0.5001 + want.abs() * 1e-6).all()
    with pytest.raises(BadInput, match="e4m3 or int8"):
        quant.quantize_rows(x, dtype=torch.float16)


@pytest.mark.parametrize("M,K,N,bias,out_dtype", [(70, 96, 48, True, torch.bfloat16), (5, 64, 80, False, torch.float16),
                                               (33, 200, 36, True, torch.float16), (0, 32, 16, True, torch.bfloat16)])
def test_int8_matmul_is_the_scaled_int32_product(M, K, N, bias, out_dtype):
    """The int8 product against its reference (torch's exact int32 product, scaled and biased in float32): the same to
    a 16-bit rounding; at odd shapes (edge tiles masked); and as a product it is close to the 16-bit one of the
    values the operands were quantized from."""
    from sd_accel.kernels import int8_gemm, quant

    x = _randn(M, K, scale=2.0)
    w = _randn(N, K, seed=1, scale=K ** -0.5)
    b = _randn(N, seed=2, dtype=out_dtype) if bias else None
    a, sa = quant.quantize_rows_ref(x, dtype=quant.INT8)
    wq, sw = quant.quantize_rows_ref(w, dtype=quant.INT8)
    y = int8_gemm.int8_matmul(a, sa, wq, sw.reshape(1, -1).contiguous(), b, out_dtype)
    ref = int8_gemm.int8_matmul_ref(a, sa, wq, sw, b, out_dtype)
    assert y.shape == (M, N) and y.dtype == out_dtype
    _close(y, ref, torch.bfloat16)
    if M:
        exact = x @ w.t() + (b.float() if bias else 0)
        assert (y.float() - exact).norm() / exact.norm() < 2e-2
        out = torch.empty(M, N, dtype=out_dtype, device=DEVICE)
        assert int8_gemm.int8_matmul(a, sa, wq, sw, b, out_dtype, out=out) is out and torch.equal(out, y)
        wide = torch.zeros(N, K + 32, dtype=torch.int8, device=DEVICE)  # a split projection's columns of a weight
        wide[:, 32:] = wq
        assert torch.equal(int8_gemm.int8_matmul(a, sa, wide[:, 32:], sw, b, out_dtype), y)
    with pytest.raises(BadInput, match="int8 \\(M, K\\)"):
        int8_gemm.int8_matmul(x, sa, wq, sw)
    with pytest.raises(BadInput, match="w_scale"):
        int8_gemm.int8_matmul(a, sa, wq, sw[:1])


def _ulps(dtype: torch.dtype) -> float:
    """The relative size of one step of dtype's mantissa."""
    return 2.0 ** -{torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]


def _steps(dtype: torch.dtype) -> int:
    """How many of dtype's steps the SwiGLU kernel may be from torch's: one where its exponential's last bit moves a
    rounding; two for bfloat16 under the interpreter (it truncates bfloat16 conversions where the GPU rounds, twice
    here); four in float32, where nothing rounds away the exponentials' and the divisions' last bits."""
    return 4 if dtype == torch.float32 else 2 if DEVICE == "cpu" and dtype == torch.bfloat16 else 1


@pytest.mark.parametrize("shape,dtype", [((2, 5, 2 * 300), torch.bfloat16), ((3, 2 * 18432), torch.bfloat16),
                                         ((1, 7, 2 * 1000), torch.float16), ((4, 2 * 33), torch.float32),
                                         ((0, 2 * 64), torch.bfloat16)])
def test_swiglu_is_torchs_silu_times_up(shape, dtype):
    """The [gate | up] halves of one tensor, read in place: torch's F.silu(gate) * up, rounded as its two kernels
    round (_steps)."""
    from sd_accel.kernels import swiglu as sw

    a = _randn(*shape, dtype=dtype, scale=3.0)
    gate, up = a.chunk(2, dim=-1)
    y, want = sw.swiglu(gate, up), sw.swiglu_ref(gate, up)
    assert y.shape == want.shape and y.dtype == dtype and y.is_contiguous()
    diff = (y.float() - want.float()).abs()
    assert (diff <= want.float().abs() * _steps(dtype) * _ulps(dtype) + torch.finfo(dtype).tiny).all()
    if DEVICE == "cuda" and dtype != torch.float32:
        assert (diff > 0).sum() <= y.numel() // 1000  # rounded as torch's two kernels round: most values to the bit


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_swiglu_of_two_tensors_keeps_float16_finite_as_comfyui_does(dtype):
    """Z-Image's MLP: gate and up from products of their own, the float16 product clamped as ComfyUI's clamp_fp16
    clamps it (infinities to 65504, NaN to 0); bfloat16 left as it is, as there."""
    from sd_accel.kernels import swiglu as sw

    gate, up = _randn(3, 40, dtype=dtype, scale=3.0), _randn(3, 40, dtype=dtype, seed=1, scale=3.0)
    gate[0, :4] = torch.tensor([256.0, 256.0, -float("inf"), 1.0])
    up[0, :4] = torch.tensor([256.0, -256.0, 1.0, float("nan")])
    y, want = sw.swiglu(gate, up, finite=True), sw.swiglu_ref(gate, up, finite=True)
    if dtype == torch.float16:
        assert y[0, :4].tolist() == [65504.0, -65504.0, 0.0, 0.0] == want[0, :4].tolist()
    else:
        assert y[0, :2].tolist() == want[0, :2].tolist() and y[0, 2:4].isnan().all()
    _close(y[1:], want[1:], dtype)
    with pytest.raises(BadInput, match="halves"):
        sw.swiglu(gate, up[:, :20])


@pytest.mark.parametrize("B,L,C,dtype,update,rms", [(2, 13, 40, torch.bfloat16, False, False),
                                                    (1, 9, 3072, torch.bfloat16, True, False),
                                                    (3, 5, 64, torch.float16, True, False),
                                                    (2, 7, 4096, torch.bfloat16, True, True)])
def test_modulated_layer_norm_hands_fp8_rows_to_the_next_product(B, L, C, dtype, update, rms):
    """out_fp8: the modulated LayerNorm's (or RMS norm's: LTX-2's video stream) output quantized per row in the same
    pass (CUDA only: the interpreter converts to fp8 wrongly, and says so)."""
    x = _randn(B, L, C, dtype=dtype, offset=2.0)
    shift, scale, gate, *_ = _flux_mod(B, C, dtype, 1)
    u = _randn(B, L, C, dtype=dtype, seed=3) if update else None
    g = gate if update else None
    if DEVICE != "cuda":
        with pytest.raises(BadInput, match="CUDA only"):
            adaln.modulated_layer_norm(x, scale, shift, update=u, gate=g, out_fp8=True, rms=rms)
        return
    out = adaln.modulated_layer_norm(x, scale, shift, update=u, gate=g, out_fp8=True, rms=rms)
    (q, s), stream = out if update else (out, None)
    if update:
        torch.testing.assert_close(stream, adaln.modulated_layer_norm(x, scale, shift, update=u, gate=g, rms=rms)[1])
        x = stream
    want = adaln.modulated_layer_norm_ref(x.float(), scale.float(), shift.float(), rms=rms).reshape(B * L, C)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (B * L, C) and s.shape == (B * L, 1)
    _within_one_e4m3_step(q, s, want)


@pytest.mark.parametrize("B,L,C,dtype", [(2, 13, 40, torch.float32), (1, 9, 300, torch.bfloat16)])
def test_z_images_sandwich_is_the_post_norm_the_gated_residual_and_the_next_pre_norm_in_one_pass(B, L, C, dtype):
    """Z-Image's block between its attention and its MLP: s = x + tanh(gate) * RMSNorm2(update), then the MLP's input
    RMSNorm1(s) * (1 + scale), each norm with its weight, as ComfyUI's modules compute it; and that input as int8 rows
    (kernels/quant.py's int8 rows of the 16-bit output, within one step: the pass rounds from float32)."""
    x = _randn(B, L, C, dtype=dtype, offset=1.0)
    u = _randn(B, L, C, dtype=dtype, seed=3, scale=4.0)
    scale, gate = _randn(B, C, dtype=dtype, seed=4, scale=0.5), _randn(B, C, dtype=dtype, seed=5).tanh()
    w1, w2 = (_randn(C, dtype=dtype, seed=s, scale=0.2, offset=1.0) for s in (6, 7))
    kw = dict(update=u, gate=gate, rms=True, weight=w1, update_weight=w2, update_eps=1e-5)
    y, stream = adaln.modulated_layer_norm(x, scale, None, 1e-5, **kw)
    y_ref, stream_ref = adaln.modulated_layer_norm_ref(x, scale, None, 1e-5, **kw)
    _close(stream, stream_ref, dtype)
    _close(y, y_ref, dtype)
    host_s = x.float() + gate.float()[:, None] * F.rms_norm(u.float(), (C,), w2.float(), 1e-5)
    host_y = F.rms_norm(host_s, (C,), w1.float(), 1e-5) * (1 + scale.float()[:, None])
    _close(stream, host_s.to(dtype), dtype)
    _close(y, host_y.to(dtype), dtype)
    from sd_accel.kernels import quant

    (q, rs), _ = adaln.modulated_layer_norm(x, scale, None, 1e-5, out_int8=True, **kw)
    q_ref, rs_ref = quant.quantize_rows_ref(y_ref.reshape(B * L, C).float(), dtype=quant.INT8)
    assert q.dtype == torch.int8 and q.shape == (B * L, C) and rs.shape == (B * L, 1)
    torch.testing.assert_close(rs, rs_ref, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=0)
    assert (q.int() - q_ref.int()).abs().max() <= 1
    with pytest.raises(BadInput, match="update_weight normalizes an update"):
        adaln.modulated_layer_norm(x, scale, None, update_weight=w2)
    with pytest.raises(BadInput, match="weight has shape"):
        adaln.modulated_layer_norm(x, scale, None, weight=w1[:-1])


def _e4m3_close(got: torch.Tensor, want: torch.Tensor, descale: torch.Tensor) -> None:
    """Two e4m3 tensors of one scale agree within one e4m3 step (3 mantissa bits) of each other's values, most of
    them exactly (a value rounded to bfloat16 first, 8 bits, lands on an e4m3 tie about once in 32)."""
    a, b = got.float() * descale, want.float() * descale
    assert ((a - b).abs() <= torch.maximum(a.abs(), b.abs()) / 8 + descale * 2 ** -9).all()
    assert (got.float() == want.float()).float().mean() > 0.9


@pytest.mark.parametrize("B,H,D,dtype,rope", [(2, 3, 16, torch.bfloat16, True), (1, 2, 24, torch.float32, False),
                                               (1, 2, 128, torch.float16, True)])
def test_qk_norm_rope_writes_e4m3_q_and_k_and_gathers_vs_amax(B, H, D, dtype, rope):
    """fp8 attention's inputs: a joint text+image sequence of two streams with their own norm weights; q and k in
    e4m3 under one descale each (from both streams' weights), v in 16 bits with its largest magnitude gathered."""
    Lt, Li = 5, 11
    txt, img = _randn(B, Lt, 3 * H * D, dtype=dtype, seed=3, scale=2.0), _randn(B, Li, 3 * H * D, dtype=dtype, seed=4)
    img[0, 3, -1] = 40.0  # v's largest magnitude, in the second stream
    weights = [_randn(D, seed=s, offset=1.0, scale=0.5).to(dtype) for s in (10, 11, 12, 13)]  # txt q, k; img q, k
    weights[2][3] = -6.0  # img's q weight has the largest magnitude
    descales = qk_rope.qk_descales([weights[0], weights[2]], [weights[1], weights[3]])
    assert descales.shape == (2, 4) and descales.stride() == (4, 1)
    torch.testing.assert_close(descales[:, 0], torch.tensor([6.0, max(w.abs().max().item() for w in weights[1::2])],
                                                            device=DEVICE) * D ** 0.5 * (1 + 2 ** -6) / 448)
    pe = _flux_pe(1, Lt + Li, D) if rope else None
    got = qk_rope.empty_qkv(B, Lt + Li, H, D, img, qk_fp8=True)
    assert [t.dtype for t in got] == [qk_rope.FP8, qk_rope.FP8, dtype]
    amax = qk_rope.new_v_amax(DEVICE)
    qk_rope.qk_norm_rope(txt, H, got, 0, weights[0], weights[1], pe=pe, descales=descales, v_amax=amax)
    qk_rope.qk_norm_rope(img, H, got, Lt, weights[2], weights[3], pe=pe, descales=descales, v_amax=amax)
    want = [torch.cat(p, dim=1) for p in zip(
        qk_rope.qk_norm_rope_ref(txt, H, weights[0], weights[1], pe=pe, offset=0, descales=descales),
        qk_rope.qk_norm_rope_ref(img, H, weights[2], weights[3], pe=pe, offset=Lt, descales=descales))]
    for out, w, d in zip(got[:2], want[:2], descales[:, 0]):
        # torch's rms_norm rounds on the way where the kernel computes in float32: a 16-bit step apart before the
        # rotation, which may cancel down to a small value
        assert w.dtype == qk_rope.FP8
        a, b = out.float() * d, w.float() * d
        assert ((a - b).abs() <= b.abs() / 8 + b.abs().amax() * 2 ** -7).all()
    assert torch.equal(got[2], want[2])
    # v's largest magnitude, spread over partial maxima, is what quantize_tensor scales v by
    assert amax.shape == (qk_rope.AMAX_SLOTS,) and amax.max().item() == 40.0
    from sd_accel.kernels import quant

    (v8, descale, _), (v8_ref, descale_ref, _) = quant.quantize_tensor(got[2], amax), quant.quantize_tensor_ref(got[2])
    assert torch.equal(v8.float(), v8_ref.float())
    torch.testing.assert_close(descale, descale_ref, rtol=1e-6, atol=0)
    # the bound holds: no value saturates, and the largest lands well inside e4m3's range
    largest = max(t.float().abs().max().item() for t in got[:2])
    assert 448 / (2 * D ** 0.5) < largest < 448
    # the kernel's own 16-bit output, quantized
    sixteen = qk_rope.empty_qkv(B, Lt + Li, H, D, img)
    qk_rope.qk_norm_rope(txt, H, sixteen, 0, weights[0], weights[1], pe=pe)
    qk_rope.qk_norm_rope(img, H, sixteen, Lt, weights[2], weights[3], pe=pe)
    for out, ref, d in zip(got[:2], sixteen[:2], descales[:, 0]):
        _e4m3_close(out, (ref.float() / d).to(qk_rope.FP8), d)


@pytest.mark.parametrize("B,L,H,D,dtype", [(2, 13, 3, 8, torch.float32), (1, 5, 40, 128, torch.bfloat16)])
def test_qk_row_norm_rope_writes_e4m3_under_the_rows_bound(B, L, H, D, dtype):
    """Wan's q and k in e4m3 (40 heads of 128: Wan 2.1 14B's row): a norm over all heads' channels bounds an element
    by sqrt(heads * head_dim) * max|w|, which qk_descales reads from the weights' size. A token whose row is one
    element reaches that bound: it stays below 448 where the per-head bound, sqrt(head_dim) * max|w|, would
    saturate it; typical values sit far above e4m3's subnormals (2^-6)."""
    q, k, v = (_randn(B, L, H * D, dtype=dtype, seed=s, scale=2.0) for s in (3, 4, 5))
    q[0, 0] = 0
    q[0, 0, 5] = 3.0
    qw, kw = (_randn(H * D, seed=s, offset=1.0, scale=0.1).to(dtype) for s in (1, 2))
    qw[5] = 1.5  # the largest weight, on the lone element
    pe = _flux_pe(1, L, D)
    descales = qk_rope.qk_descales([qw], [kw])
    torch.testing.assert_close(descales[:, 0], torch.stack([qw.float().abs().max(), kw.float().abs().max()])
                               * (H * D) ** 0.5 * (1 + 2 ** -6) / 448)
    got = qk_rope.empty_qkv(B, L, H, D, q, qk_fp8=True)
    amax = qk_rope.new_v_amax(DEVICE)
    qk_rope.qk_row_norm_rope((q, k, v), H, got, qw, kw, 1e-6, pe, descales=descales, v_amax=amax)
    sixteen = qk_rope.empty_qkv(B, L, H, D, q)
    qk_rope.qk_row_norm_rope((q, k, v), H, sixteen, qw, kw, 1e-6, pe)
    for out, ref, d in zip(got[:2], sixteen[:2], descales[:, 0]):
        _e4m3_close(out, (ref.float() / d).to(qk_rope.FP8), d)
        scaled = out.float().abs()
        assert scaled.max() < 448 and (scaled[ref != 0] < 2 ** -6).float().mean() < 1e-2
    assert sixteen[0].float().abs().max() / (descales[0, 0] / H ** 0.5) > 448 > got[0].float().abs().max() > 448 / 2
    assert torch.equal(got[2], v.view(B, L, H, D)) and amax.max().item() == v.float().abs().max().item()
    with pytest.raises(BadInput, match="expected contiguous"):
        qk_rope.qk_row_norm_rope((q, k, v), H, sixteen, qw, kw, 1e-6, pe, descales=descales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qk_descales_are_each_weights_bound_to_the_bit(dtype):
    """qk_descales' one reduction over all weights gives, to the bit, the bounds sqrt(n) * max|w| taken weight by
    weight and their largest for q and for k (Wan's one row weight, Qwen-Image's two streams, Flux's per-head ones);
    weights not paired or not of one size are refused."""
    for streams, n, scale in ((1, 5120, 0.1), (2, 128, 3.0), (3, 8, 1e-3)):
        weights = [_randn(n, dtype=dtype, seed=10 * streams + i, scale=scale) for i in range(2 * streams)]
        got = qk_rope.qk_descales(weights[0::2], weights[1::2])
        bounds = [torch.stack([w.float().abs().amax() * n ** 0.5 for w in weights[part::2]]).amax() for part in (0, 1)]
        want = (torch.stack(bounds).view(2, 1).expand(2, 4) * ((1 + 2 ** -6) / 448)).clamp_min(1e-12)
        assert torch.equal(got, want) and got.stride() == (4, 1)
    zeros = torch.zeros(8, dtype=dtype, device=DEVICE)
    assert torch.equal(qk_rope.qk_descales([zeros], [zeros]), torch.full((2, 4), 1e-12, device=DEVICE))
    with pytest.raises(BadInput, match="one of each per stream, of one size"):
        qk_rope.qk_descales([zeros], [torch.zeros(16, dtype=dtype, device=DEVICE)])
    with pytest.raises(BadInput, match="2 q and 1 k weights"):
        qk_rope.qk_descales([zeros, zeros], [zeros])


def test_qk_norm_rope_e4m3_needs_its_buffers_and_norm_weights():
    qkv = _randn(1, 4, 48)
    descales = torch.ones(2, 4, device=DEVICE)
    with pytest.raises(BadInput, match="expected contiguous"):
        qk_rope.qk_norm_rope(qkv, 2, qk_rope.empty_qkv(1, 4, 2, 8, qkv), q_weight=_randn(8), k_weight=_randn(8),
                             descales=descales)
    with pytest.raises(BadInput, match="need the RMSNorm weights"):
        qk_rope.qk_norm_rope(qkv, 2, qk_rope.empty_qkv(1, 4, 2, 8, qkv, qk_fp8=True), descales=descales)
    with pytest.raises(BadInput, match="v_amax"):
        qk_rope.qk_norm_rope(qkv, 2, qk_rope.empty_qkv(1, 4, 2, 8, qkv), v_amax=torch.zeros(2, 2, device=DEVICE))
    for count in (0, 1025):  # no slot to fold into; more than quantize_tensor reads
        with pytest.raises(BadInput, match="1 to 1024 values"):
            qk_rope.qk_norm_rope(qkv, 2, qk_rope.empty_qkv(1, 4, 2, 8, qkv), v_amax=torch.zeros(count, device=DEVICE))


def test_quantize_tensor_rounds_to_e4m3_as_torch_does():
    """Every e4m3 value and every midpoint between two (ties go to even), subnormals, values past 448 (saturated):
    the kernel's rounding is torch's conversion, under the interpreter as on a GPU."""
    from sd_accel.kernels import quant

    values = torch.arange(256, dtype=torch.uint8).view(quant.FP8).float()
    values = values[~values.isnan()].sort().values
    x = torch.cat([values, (values[1:] + values[:-1]) / 2, torch.tensor([460.0, 464.0, 470.0, -1e4, 2 ** -11]),
                   _randn(3000, seed=9, scale=30.0).cpu()]).to(DEVICE)
    q, descale, scale = quant.quantize_tensor(x, torch.full((1,), 448.0, device=DEVICE))
    assert descale.tolist() == [1.0] and scale.tolist() == [1.0]
    assert torch.equal(q.float(), x.clamp(-448, 448).to(quant.FP8).float())


@pytest.mark.parametrize("shape,dtype", [((2, 9, 3, 16), torch.bfloat16), ((1, 5000), torch.float16)])
def test_quantize_tensor_scales_by_a_device_amax(shape, dtype):
    from sd_accel.kernels import quant

    x = _randn(*shape, dtype=dtype, scale=3.0)
    amax = x.float().abs().amax().reshape(1)
    q, descale, scale = quant.quantize_tensor(x, amax)
    q_ref, descale_ref, scale_ref = quant.quantize_tensor_ref(x)
    assert q.shape == x.shape and q.dtype == quant.FP8 and q.float().abs().max().item() == 448
    torch.testing.assert_close(descale, descale_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), q_ref.float())
    # the largest of partial maxima (qk_rope.new_v_amax's) scales as the one value does
    parts = torch.zeros(64, device=DEVICE)
    parts[5], parts[40] = amax[0] / 2, amax[0]
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(quant.quantize_tensor(x, parts), (q, descale, scale)))
    # a smaller amax saturates rather than overflowing
    assert quant.quantize_tensor(x, amax / 4)[0].float().abs().max().item() == 448
    with pytest.raises(BadInput, match="1 to 1024"):
        quant.quantize_tensor(x, torch.zeros(2000, device=DEVICE))
    with pytest.raises(BadInput, match="contiguous x"):
        quant.quantize_tensor(x[..., ::2], amax)
