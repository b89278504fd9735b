"""A cheap identity for a set of weights: names, shapes, dtypes and a fixed sample of each tensor's values.

Hashing every byte of a 5 GB SDXL UNet takes seconds on every run; a sample of about a thousand evenly
spaced elements per tensor takes milliseconds and still separates the cases the engine cache must
separate: another checkpoint, a merged LoRA (a low-rank delta changes essentially every element of
the weights it touches), another dtype. Values are sampled in logical (row-major) order, so the same
weights give the same fingerprint on the CPU or the GPU and in channels_last or contiguous layout.
"""

from __future__ import annotations

import hashlib
import json
from typing import Mapping

import torch
from torch import nn

from ..errors import BadInput

SAMPLES_PER_TENSOR = 1024


def _sample_index(numel: int, device: torch.device, memo: dict) -> torch.Tensor | None:
    """Flat indices of the sample: every element of small tensors, else evenly spaced ones plus first and last."""
    if numel <= SAMPLES_PER_TENSOR + 2:
        return None
    k = (numel, device)
    if k not in memo:
        idx = torch.linspace(0, numel - 1, SAMPLES_PER_TENSOR + 2, dtype=torch.float64).round().to(torch.int64)
        memo[k] = idx.to(device)
    return memo[k]


def _sample(t: torch.Tensor, memo: dict) -> torch.Tensor:
    t = t.detach()
    idx = _sample_index(t.numel(), t.device, memo)
    if idx is None:
        picked = t.reshape(-1)
    elif t.is_contiguous():
        picked = t.view(-1)[idx]
    else:  # channels_last and other strided layouts: gather the logical positions without copying the tensor
        picked = t[torch.unravel_index(idx, t.shape)]
    return picked.contiguous().view(torch.uint8)


def weights_fingerprint(weights: nn.Module | Mapping[str, torch.Tensor]) -> str:
    """A hex digest that changes when any tensor's name, shape, dtype or (sampled) values change.

    Accepts a module (its state dict, buffers included) or a state dict, on any device. Samples are
    gathered on each tensor's device and only the small samples are copied to the CPU, one copy per device.
    """
    sd = weights.state_dict() if isinstance(weights, nn.Module) else weights
    meta: list[list] = []
    samples: list[torch.Tensor] = []
    memo: dict = {}
    for name in sorted(sd):
        t = sd[name]
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_meta:
            raise BadInput(f"weight {name!r} is on the meta device (not loaded), so it has no values to identify it by.",
                           "Load the model's weights before building an accelerated engine.")
        meta.append([name, str(t.dtype).replace("torch.", ""), list(t.shape)])
        if t.numel():
            samples.append(_sample(t, memo))
    h = hashlib.sha256(json.dumps(meta, separators=(",", ":")).encode())
    for chunk in _to_host(samples):
        h.update(chunk.numpy().tobytes())
    return h.hexdigest()


def _to_host(samples: list[torch.Tensor]) -> list[torch.Tensor]:
    """The samples on the CPU, in their order, with one device-to-host copy per device (a model may be split)."""
    out: list[torch.Tensor | None] = [None] * len(samples)
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(samples):
        by_device.setdefault(s.device, []).append(i)
    for positions in by_device.values():
        parts = [samples[i] for i in positions]
        host = torch.cat(parts).cpu()
        for i, piece in zip(positions, torch.split(host, [p.numel() for p in parts])):
            out[i] = piece
    return out  # type: ignore[return-value]
