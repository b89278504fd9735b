"""GroupNorm with whole-image statistics: per-tile sums in, normalized tiles out.

Each tile of a pass adds the per-channel sum and sum of squares of the region it wrote (tiles do not overlap, so each
pixel counts once); the next pass merges them into the whole-image mean and variance and normalizes every tile with
them. This is what makes tiled and untiled images equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def tile_stats(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(N, C) sum and sum of squares of a tile, fp32 (no fp16 overflow: the squares are never stored)."""
    s = y.sum(dim=(2, 3), dtype=torch.float32)
    q = torch.linalg.vector_norm(y, 2, dim=(2, 3), dtype=torch.float32)
    return s, q * q


_BN_EPS = 1e-12


@dataclass
class NormParams:
    """A GroupNorm with whole-image statistics: per-(N, G) mean and rstd, the affine weight and bias (fp32)."""

    mean: torch.Tensor
    rstd: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    _per_channel: tuple[torch.Tensor, ...] | None = None

    def per_channel(self, channels: int) -> tuple[torch.Tensor, ...]:
        """Per-(N*C) mean, variance, weight and bias for F.batch_norm, computed once per pass, not per tile."""
        if self._per_channel is None:
            n, per = self.mean.shape[0], channels // self.mean.shape[1]
            mean_c = self.mean.float().repeat_interleave(per, dim=1).reshape(-1)
            # batch_norm adds an eps of its own and refuses 0 on CUDA: hand it var + norm eps less that tiny one.
            var_c = (self.rstd.float().pow(-2) - _BN_EPS).repeat_interleave(per, dim=1).reshape(-1)
            wt = None if self.weight is None else self.weight.float().repeat(n)
            bs = None if self.bias is None else self.bias.float().repeat(n)
            self._per_channel = (mean_c, var_c, wt, bs)
        return self._per_channel


def _triton_groupnorm(x: torch.Tensor):
    """kernels.groupnorm where its Triton kernels run on x's device (a GPU), else None."""
    if x.device.type == "cpu":
        return None
    try:
        from ..engine.fusions.base import kernel_module

        groupnorm = kernel_module("groupnorm")
    except ImportError:
        return None
    return groupnorm if groupnorm.supported(x) else None


def norm_apply(x: torch.Tensor, params: NormParams, silu: bool) -> torch.Tensor:
    """GroupNorm of x (a tile, maybe a strided view) with whole-image statistics, then SiLU when asked.

    Computes in fp32 and returns x's dtype, as torch's own GroupNorm does. On a GPU, the Triton kernel of the
    torch path (kernels/groupnorm.py) normalizes, scales and applies SiLU in one pass; elsewhere an eval-mode
    batch norm over (1, N*C, H, W), one kernel that takes given per-channel statistics.
    """
    kernel = _triton_groupnorm(x)
    if kernel is not None:
        return kernel.group_norm_apply(x, params.mean, params.rstd, params.weight, params.bias, silu)
    n, c, h, w = x.shape
    mean_c, var_c, wt, bs = params.per_channel(c)
    y = F.batch_norm(x.reshape(1, n * c, h, w), mean_c, var_c, wt, bs, False, 0.0, _BN_EPS).view(n, c, h, w)
    return F.silu(y, inplace=True) if silu else y


def _norm_params(s: torch.Tensor, sq: torch.Tensor, norm: nn.GroupNorm, count: int,
                 device: torch.device) -> NormParams:
    """NormParams for a GroupNorm of an activation of `count` pixels, from the per-(N, C) sums `s` and sums of
    squares `sq` its producer gathered over all tiles."""
    n, c = s.shape
    g = norm.num_groups
    cnt = count * (c // g)
    mean = s.view(n, g, c // g).sum(-1) / cnt
    var = (sq.view(n, g, c // g).sum(-1) / cnt - mean * mean).clamp_min(0.0)
    param = lambda p: None if p is None else p.to(device, torch.float32)
    return NormParams(mean.float(), torch.rsqrt(var + norm.eps).float(), param(norm.weight), param(norm.bias))
