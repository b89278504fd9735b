"""The tile plan: how large a tile, and whether whole-image activations stay on the GPU or go to host memory.

From the program's liveness (which activations are alive at each step) it estimates the peak device memory of a run
for a given tile, and picks the largest tile that fits the free memory (or `memory_gb`); when a tile of
MIN_DEVICE_TILE does not fit beside the activations, they go to host memory and the tiles become bands of whole rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import SCORE_BYTES
from .program import _Attn, _in_place, _last_use, _Program, _reads


# Tile side (image px) where no free-memory figure guides the choice (CPU, MPS, ...).
DEFAULT_TILE = 512
MIN_TILE = 64
# Tile side (image px) past which a GPU gains nothing: a 1024 px tile keeps it busy, and larger only costs memory.
TILE_CAP = 1024
# Activations stay on the GPU only when tiles of at least this side still fit beside them.
MIN_DEVICE_TILE = 512
# Part of the free device memory this module plans to use; the rest absorbs allocator slack.
MEMORY_USE = 0.9
# Margin on the estimated tile temporaries for conv workspaces.
WORKSPACE = 1.5
# Bands computed at once when activations live in host memory (see passes._Ctx.streams).
BAND_STREAMS = 2


@dataclass(frozen=True)
class TilePlan:
    """How a tiled decode/encode will run: tile (image px), grid, where activations live, layer passes.

    With the activations in host memory the tiles are bands across the whole width (grid (n, 1), `tile` their
    height): stored channels-last, a band is then one contiguous block, copied in one transfer each way."""

    tile: int
    grid: tuple[int, int]  # tiles down, tiles across
    store: str  # device holding the whole-image activations between passes
    passes: int  # steps of the program; each visits every tile (the attention counts as one)
    bands: bool = False  # tiles are bands of whole rows (activations in host memory)

    @property
    def tiles(self) -> int:
        return self.grid[0] * self.grid[1]


def _step_bytes(prog: _Program, batch: int, elem: int) -> list[tuple[int, float, float, int]]:
    """Per step, following the program's liveness: (bytes of whole-image activations alive during it, tile
    temporaries per image px of tile area, outputs waiting to be written per image px of a band of tiles (see
    _in_place), temporaries that do not depend on the tile)."""
    last = _last_use(prog)
    size = lambda i: batch * elem * math.prod(prog.shapes[i])
    px = lambda i: prog.shapes[i][1] * prog.shapes[i][2] / _image_area(prog)
    live = {0: size(0)}
    out = []
    for i, step in enumerate(prog.steps):
        into = _in_place(prog, i, last)
        if into is None:
            live[step.dst] = size(step.dst)
        c = prog.shapes[step.dst][0]
        if isinstance(step, _Attn):
            scores = min(SCORE_BYTES, size(step.src) // c * prog.shapes[step.src][1] * prog.shapes[step.src][2])
            out.append((sum(live.values()), 0.0, 0.0, 6 * size(step.src) + 2 * scores))  # x, norm, q, k, v, out
            continue
        need = 3 * c * px(step.dst)  # the output, one summand, the copy written out
        for t in step.terms:
            need += 2 * prog.shapes[t.src][0] * px(t.src) * t.up * t.up  # normalized input, upsampled copy
        waiting = c * px(step.dst) if into is not None and into[1] else 0.0
        out.append((sum(live.values()), need * batch * elem * WORKSPACE, waiting * batch * elem, 0))
        for s in _reads(step):
            if last.get(s) == i and s != 0:
                live.pop(s, None)
    return out


def _image_area(prog: _Program) -> int:
    """Pixels of the image side of the program: its output when decoding, its input when encoding."""
    side = 0 if prog.take is not None else prog.result
    return prog.shapes[side][1] * prog.shapes[side][2]


def _peak(steps: list[tuple[int, float, float, int]], tile_hw: tuple[int, int], image_hw: tuple[int, int],
          on_device: bool) -> float:
    """Estimated peak device bytes; with activations in host memory, BAND_STREAMS bands are in flight."""
    th, tw = min(tile_hw[0], image_hw[0]), min(tile_hw[1], image_hw[1])
    inflight = 1 if on_device else BAND_STREAMS
    return max((stored if on_device else 0) + inflight * per_px * th * tw + waiting * th * (image_hw[1] + 2 * tw)
               + fixed for stored, per_px, waiting, fixed in steps)


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _grid(prog: _Program, image_hw: tuple[int, int], tile_hw: tuple[int, int]) -> tuple[int, int]:
    smallest = [min(prog.shapes[i][a] for i in prog.shapes) for a in (1, 2)]
    return tuple(max(1, min(math.ceil(image_hw[a] / tile_hw[a]), smallest[a])) for a in (0, 1))


def _band(tile: int, width: int) -> int:
    """Height of a band of about a tile's area (at least MIN_TILE // 8 rows)."""
    return max(MIN_TILE // 8, tile * tile // width)


def _plan(prog: _Program, image_hw: tuple[int, int], batch: int, device: torch.device, dtype: torch.dtype,
          tile: int | None, offload: bool | None, memory_gb: float | None = None) -> TilePlan:
    free = _free_bytes(device)
    width = image_hw[1]
    if free is None:
        side = tile or DEFAULT_TILE
        hw = (_band(side, width), width) if offload else (side, side)
        return TilePlan(hw[0], _grid(prog, image_hw, hw), "cpu" if offload else str(device), len(prog.steps),
                        bool(offload))
    steps = _step_bytes(prog, batch, torch.finfo(dtype).bits // 8)
    budget = MEMORY_USE * (free if memory_gb is None else min(free, memory_gb * 1e9))
    if offload is None:
        on_device = _peak(steps, (tile or MIN_DEVICE_TILE,) * 2, image_hw, True) <= budget
    else:
        on_device = not offload
    if on_device:
        if tile is None:
            # The largest tile up to TILE_CAP that fits: beyond it the GPU is busy anyway and memory only grows.
            tile = MIN_TILE
            while (tile < min(TILE_CAP, max(image_hw))
                   and _peak(steps, (tile + MIN_TILE,) * 2, image_hw, True) <= budget):
                tile += MIN_TILE
        return TilePlan(tile, _grid(prog, image_hw, (tile, tile)), str(device), len(prog.steps))
    if tile is None:
        # The tallest band of at most TILE_CAP**2 px that fits beside nothing but the weights. Temporaries that
        # do not depend on the band (the whole-latent attention) are left out: they are what they are.
        rows, step = MIN_TILE // 8, MIN_TILE // 8
        banded = [(0, per_px, waiting, 0) for _, per_px, waiting, _ in steps]
        while (rows < image_hw[0] and (rows + step) * width <= TILE_CAP * TILE_CAP
               and _peak(banded, (rows + step, width), image_hw, False) <= budget):
            rows += step
    else:
        rows = _band(tile, width)
    return TilePlan(rows, _grid(prog, image_hw, (rows, width)), "cpu", len(prog.steps), True)
