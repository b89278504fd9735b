"""Recognising a VAE and translating its layers into a program (program.py): the two model forms.

diffusers: `AutoencoderKL` with `Encoder`/`Decoder` of `ResnetBlock2D`, `Attention`, `Upsample2D`, `Downsample2D`.
ldm / ComfyUI / A1111: `comfy.ldm.modules.diffusionmodules.model.Encoder/Decoder` (and the same classes in A1111's
ldm copy), whose blocks hold the same layers under other names. Both give the same program, so everything after this
module is form-agnostic. The tiled path reads only the modules' weights (cast at use, so ComfyUI's manual-cast
layers work) and never calls their forward methods, which is why weight patches applied only inside a forward
(ComfyUI's low-VRAM LoRA) are not seen.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import UnsupportedModel
from .program import _add_attn, _add_pass, _Attn, _conv, _is_identity, _linear, _norm, _Program, _resnet, _silu, _Term


# ----- diffusers form


def _d_resnet(prog: _Program, x: int, r: nn.Module, what: str) -> int:
    if type(r).__name__ != "ResnetBlock2D" or r.upsample is not None or r.downsample is not None:
        raise UnsupportedModel(f"{what} is a {type(r).__name__} that resamples or is not a ResnetBlock2D.",
                               "Decode this VAE with its own decode().")
    _silu(r.nonlinearity, f"{what}.nonlinearity")
    return _resnet(prog, x, r.norm1, r.conv1, r.norm2, r.conv2, r.conv_shortcut, float(r.output_scale_factor), what)


def _d_attn(prog: _Program, x: int, a: nn.Module, what: str) -> int:
    if getattr(a, "spatial_norm", None) is not None or a.group_norm is None:
        raise UnsupportedModel(f"{what} is an attention without its own GroupNorm (or with a spatial norm).",
                               "Decode this VAE with its own decode().")
    return _add_attn(prog, x, _Attn(
        0, 0, _norm(a.group_norm, f"{what}.group_norm"), _linear(a.to_q, f"{what}.to_q"),
        _linear(a.to_k, f"{what}.to_k"), _linear(a.to_v, f"{what}.to_v"), _linear(a.to_out[0], f"{what}.to_out"),
        int(a.heads), float(a.scale), bool(a.residual_connection), float(a.rescale_output_factor), what))


def _d_mid(prog: _Program, x: int, mid: nn.Module, what: str) -> int:
    x = _d_resnet(prog, x, mid.resnets[0], f"{what}.resnets.0")
    for i, (attn, resnet) in enumerate(zip(mid.attentions, mid.resnets[1:])):
        if attn is not None:
            x = _d_attn(prog, x, attn, f"{what}.attentions.{i}")
        x = _d_resnet(prog, x, resnet, f"{what}.resnets.{i + 1}")
    return x


def _d_decoder(prog: _Program, x: int, dec: nn.Module) -> int:
    x = _add_pass(prog, [_Term(x, _conv(dec.conv_in, "decoder.conv_in"))], "decoder.conv_in")
    x = _d_mid(prog, x, dec.mid_block, "decoder.mid_block")
    for i, block in enumerate(dec.up_blocks):
        what = f"decoder.up_blocks.{i}"
        if type(block).__name__ != "UpDecoderBlock2D":
            raise UnsupportedModel(f"{what} is a {type(block).__name__}; the tiled VAE knows UpDecoderBlock2D.",
                                   "Decode this VAE with its own decode().")
        for j, r in enumerate(block.resnets):
            x = _d_resnet(prog, x, r, f"{what}.resnets.{j}")
        for up in block.upsamplers or []:
            if up.use_conv_transpose or up.norm is not None or not up.interpolate or not up.use_conv:
                raise UnsupportedModel(f"{what}.upsamplers is not nearest-2x then conv.",
                                       "Decode this VAE with its own decode().")
            conv = up.conv if up.name == "conv" else up.Conv2d_0
            x = _add_pass(prog, [_Term(x, _conv(conv, f"{what}.upsamplers.conv"), up=2)], f"{what}.upsamplers")
    _silu(dec.conv_act, "decoder.conv_act")
    return _add_pass(prog, [_Term(x, _conv(dec.conv_out, "decoder.conv_out"),
                                  _norm(dec.conv_norm_out, "decoder.conv_norm_out"), True)], "decoder.conv_out")


def _d_encoder(prog: _Program, x: int, enc: nn.Module) -> int:
    x = _add_pass(prog, [_Term(x, _conv(enc.conv_in, "encoder.conv_in"))], "encoder.conv_in")
    for i, block in enumerate(enc.down_blocks):
        what = f"encoder.down_blocks.{i}"
        if type(block).__name__ != "DownEncoderBlock2D":
            raise UnsupportedModel(f"{what} is a {type(block).__name__}; the tiled VAE knows DownEncoderBlock2D.",
                                   "Encode with this VAE's own encode().")
        for j, r in enumerate(block.resnets):
            x = _d_resnet(prog, x, r, f"{what}.resnets.{j}")
        for down in block.downsamplers or []:
            if not down.use_conv or down.norm is not None:
                raise UnsupportedModel(f"{what}.downsamplers is not a strided conv.", "Encode with its own encode().")
            pad = (0, 1, 0, 1) if down.padding == 0 else (0, 0, 0, 0)
            x = _add_pass(prog, [_Term(x, _conv(down.conv, f"{what}.downsamplers.conv"), pad=pad)],
                          f"{what}.downsamplers")
    x = _d_mid(prog, x, enc.mid_block, "encoder.mid_block")
    _silu(enc.conv_act, "encoder.conv_act")
    return _add_pass(prog, [_Term(x, _conv(enc.conv_out, "encoder.conv_out"),
                                  _norm(enc.conv_norm_out, "encoder.conv_norm_out"), True)], "encoder.conv_out")


# ----- ldm / ComfyUI form


def _l_resnet(prog: _Program, x: int, r: nn.Module, what: str) -> int:
    shortcut = None
    if r.in_channels != r.out_channels:
        shortcut = r.conv_shortcut if getattr(r, "use_conv_shortcut", False) else r.nin_shortcut
    return _resnet(prog, x, r.norm1, r.conv1, r.norm2, r.conv2, shortcut, 1.0, what)


def _l_attn(prog: _Program, x: int, a: nn.Module, what: str) -> int:
    c = prog.shapes[x][0]
    return _add_attn(prog, x, _Attn(
        0, 0, _norm(a.norm, f"{what}.norm"), _linear(a.q, f"{what}.q"), _linear(a.k, f"{what}.k"),
        _linear(a.v, f"{what}.v"), _linear(a.proj_out, f"{what}.proj_out"), 1, c ** -0.5, True, 1.0, what))


def _l_mid(prog: _Program, x: int, mid: nn.Module, what: str) -> int:
    x = _l_resnet(prog, x, mid.block_1, f"{what}.block_1")
    x = _l_attn(prog, x, mid.attn_1, f"{what}.attn_1")
    return _l_resnet(prog, x, mid.block_2, f"{what}.block_2")


def _no_level_attn(level: nn.Module, what: str) -> None:
    if len(getattr(level, "attn", ())) > 0:
        raise UnsupportedModel(f"{what} has attention at image resolution, which the tiled VAE does not cover.",
                               "Use this VAE's own decode()/encode().")


def _l_decoder(prog: _Program, x: int, dec: nn.Module) -> int:
    if getattr(dec, "give_pre_end", False):
        raise UnsupportedModel("the decoder stops before its output layers (give_pre_end).", "Use its own decode().")
    x = _add_pass(prog, [_Term(x, _conv(dec.conv_in, "decoder.conv_in"))], "decoder.conv_in")
    x = _l_mid(prog, x, dec.mid, "decoder.mid")
    for i in reversed(range(len(dec.up))):
        level, what = dec.up[i], f"decoder.up.{i}"
        _no_level_attn(level, what)
        for j, r in enumerate(level.block):
            x = _l_resnet(prog, x, r, f"{what}.block.{j}")
        if hasattr(level, "upsample"):
            up = level.upsample
            if not getattr(up, "with_conv", True) or float(getattr(up, "scale_factor", 2.0)) != 2.0:
                raise UnsupportedModel(f"{what}.upsample is not nearest-2x then conv.", "Use its own decode().")
            x = _add_pass(prog, [_Term(x, _conv(up.conv, f"{what}.upsample.conv"), up=2)], f"{what}.upsample")
    prog.tanh = bool(getattr(dec, "tanh_out", False))
    return _add_pass(prog, [_Term(x, _conv(dec.conv_out, "decoder.conv_out"), _norm(dec.norm_out, "decoder.norm_out"),
                                  True)], "decoder.conv_out")


def _l_encoder(prog: _Program, x: int, enc: nn.Module) -> int:
    x = _add_pass(prog, [_Term(x, _conv(enc.conv_in, "encoder.conv_in"))], "encoder.conv_in")
    for i, level in enumerate(enc.down):
        what = f"encoder.down.{i}"
        _no_level_attn(level, what)
        for j, r in enumerate(level.block):
            x = _l_resnet(prog, x, r, f"{what}.block.{j}")
        if hasattr(level, "downsample"):
            if not getattr(level.downsample, "with_conv", True):
                raise UnsupportedModel(f"{what}.downsample is average pooling.", "Use the VAE's own encode().")
            x = _add_pass(prog, [_Term(x, _conv(level.downsample.conv, f"{what}.downsample.conv"), pad=(0, 1, 0, 1))],
                          f"{what}.downsample")
    x = _l_mid(prog, x, enc.mid, "encoder.mid")
    return _add_pass(prog, [_Term(x, _conv(enc.conv_out, "encoder.conv_out"), _norm(enc.norm_out, "encoder.norm_out"),
                                  True)], "encoder.conv_out")


# ----- the VAE's parts


@dataclass
class _Parts:
    encoder: nn.Module | None
    decoder: nn.Module | None
    quant_conv: nn.Module | None
    post_quant_conv: nn.Module | None


def _parts(vae) -> _Parts:
    vae = getattr(vae, "first_stage_model", vae)  # a ComfyUI VAE holds the model here
    if hasattr(vae, "decoder") or hasattr(vae, "encoder"):
        pq, q = getattr(vae, "post_quant_conv", None), getattr(vae, "quant_conv", None)
        return _Parts(getattr(vae, "encoder", None), getattr(vae, "decoder", None),
                      None if _is_identity(q) else q, None if _is_identity(pq) else pq)
    if hasattr(vae, "conv_in") and (hasattr(vae, "up_blocks") or hasattr(vae, "up")):
        return _Parts(None, vae, None, None)
    if hasattr(vae, "conv_in") and (hasattr(vae, "down_blocks") or hasattr(vae, "down")):
        return _Parts(vae, None, None, None)
    raise UnsupportedModel(f"a {type(vae).__name__} is not an SD-style VAE (no encoder/decoder found).",
                           "Pass a diffusers AutoencoderKL, a ComfyUI VAE, or its Encoder/Decoder module.")


def _pointwise(prog: _Program, x: int, m: nn.Module, what: str) -> int:
    conv = _conv(m, what)
    if tuple(conv.kernel_size) != (1, 1) or tuple(conv.stride) != (1, 1):
        raise UnsupportedModel(f"{what} is a {tuple(conv.kernel_size)} conv, not 1x1.", "Use the VAE's own methods.")
    return _add_pass(prog, [_Term(x, conv)], what)


def _first_conv(parts: _Parts, encode: bool) -> nn.Module:
    """The layer the input meets first (its in_channels are what the input needs)."""
    if encode:
        if parts.encoder is None:
            raise UnsupportedModel("this VAE has no encoder.", "Pass the whole VAE (or its Encoder) to encode().")
        return parts.encoder.conv_in
    if parts.decoder is None:
        raise UnsupportedModel("this VAE has no decoder.", "Pass the whole VAE (or its Decoder) to decode().")
    return parts.post_quant_conv if parts.post_quant_conv is not None else parts.decoder.conv_in


def _decode_program(parts: _Parts, shape: tuple[int, int, int]) -> _Program:
    prog = _Program()
    x = prog.new(shape)
    if parts.post_quant_conv is not None:
        x = _pointwise(prog, x, parts.post_quant_conv, "post_quant_conv")
    x = (_d_decoder if hasattr(parts.decoder, "up_blocks") else _l_decoder)(prog, x, parts.decoder)
    prog.result = x
    return prog


def _encode_program(parts: _Parts, shape: tuple[int, int, int]) -> _Program:
    prog = _Program()
    x = prog.new(shape)
    x = (_d_encoder if hasattr(parts.encoder, "down_blocks") else _l_encoder)(prog, x, parts.encoder)
    if parts.quant_conv is not None:
        x = _pointwise(prog, x, parts.quant_conv, "quant_conv")
    prog.result, prog.take = x, prog.shapes[x][0] // 2
    return prog
