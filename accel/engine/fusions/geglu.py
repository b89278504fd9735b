"""GEGLU (ONNX Runtime's BiasSplitGelu): the feed-forward projection's bias, split, exact GELU and product in
one pass after a bias-free GEMM, instead of a GEMM with bias, a GELU kernel and a multiply kernel.

Where kernels/geglu.linear_covers says the fused kernel is the faster (on GPUs with TMA every projection of 2048 or
more rows: SDXL's two upper levels, SD1.5's two upper ones; elsewhere SD1.5's first level), the GEMM goes into the
same kernel and the (tokens, 2 x inner) projection is never written.

Covers diffusers' and ldm/ComfyUI's GEGLU modules (both hold `proj` and compute
`hidden, gate = proj(x).chunk(2, -1); hidden * gelu(gate)`) whose projection is a plain Linear; others run their own
forward.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .base import COMFY_ATTENTION, Undo, changed_host_block, kernel_module, patch_forward, plain_linear
from .registry import fusion


def _forward(self: nn.Module, x, *args, **kwargs):
    geglu = kernel_module("geglu")
    if not plain_linear(self.proj):  # ComfyUI's cast-on-the-fly weights (lowvram), a LoRA layer
        return type(self).forward(self, x, *args, **kwargs)
    if geglu.linear_covers(x, self.proj.weight):
        return geglu.geglu_linear(x, self.proj.weight, self.proj.bias)
    h = F.linear(x, self.proj.weight)
    if geglu.supported(h):
        return geglu.geglu(h, self.proj.bias)
    if self.proj.bias is not None:
        h = h + self.proj.bias
    hidden, gate = h.chunk(2, dim=-1)
    return hidden * F.gelu(gate)


@fusion("geglu")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if type(m).__name__ == "GEGLU" and not changed_host_block(m, "GEGLU", COMFY_ATTENTION, ("proj",), ("x",)) \
                and plain_linear(getattr(m, "proj", None)) \
                and getattr(m, "approximate", "none") == "none":
            patch_forward(m, _forward, undo)
            n += 1
    return n
