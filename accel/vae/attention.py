"""Exact self-attention over every pixel of the (latent-resolution) mid-block activation, in query chunks.

Chunking the queries keeps the result exact (each row of the softmax still sees every key) while bounding the
score memory, so the attention never needs tiling and never breaks the "same as untiled" promise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .memory import _OOM


# Widest attention head the fused SDPA kernels (flash, cuDNN) take; wider ones are computed with explicit GEMMs.
FUSED_HEAD_DIM = 256
# Bytes of attention scores computed at once by the GEMM path.
SCORE_BYTES = 1 << 29


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int | None = None) -> torch.Tensor:
    """Attention over all keys, for query chunks of `chunk` rows (all at once when None): exact either way.

    On out-of-memory the chunk shrinks, so a 1M-token latent (8192 px) still runs where the math kernel is chosen.
    Heads wider than the fused kernels take (the SD VAE's single 512-wide head) go through two GEMMs and a softmax
    per chunk instead: SDPA's fallback kernel for them is far slower than the GEMMs.
    """
    rows = q.shape[2]
    wide = q.is_cuda and q.shape[-1] > FUSED_HEAD_DIM
    if chunk is None and wide:
        chunk = max(64, SCORE_BYTES // (q.shape[0] * q.shape[1] * k.shape[2] * q.element_size()))
    chunk = chunk or rows
    while True:
        try:
            if chunk >= rows and not wide:
                return F.scaled_dot_product_attention(q, k, v, scale=scale)
            out = torch.empty_like(q)
            kt = k.transpose(-1, -2)
            for i in range(0, rows, chunk):
                if wide:
                    out[:, :, i:i + chunk] = torch.matmul(torch.matmul(q[:, :, i:i + chunk] * scale, kt).softmax(-1), v)
                else:
                    out[:, :, i:i + chunk] = F.scaled_dot_product_attention(q[:, :, i:i + chunk], k, v, scale=scale)
            return out
        except _OOM:
            if chunk <= 64:
                raise
            chunk = max(64, min(chunk, rows) // 4)
