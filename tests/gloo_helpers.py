"""A test's function run in several processes of one gloo group on the CPU (ComfyUI importable in each), each
process's JSON-able result brought back."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import comfy_helpers as H
from sd_accel.accel.parallel.rendezvous import free_port, join

TIMEOUT_S = 300  # a collective that waits longer fails the test rather than hangs it


def _rank(rank: int, fn: Callable[[int], dict], world: int, port: int, report: str) -> None:
    torch.set_num_threads(1)
    join("gloo", port, rank, world, TIMEOUT_S)
    try:
        H.import_comfy()
        result = fn(world)
        with open(f"{report}.{rank}", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[[int], dict], world: int, folder: Path) -> list[dict]:
    """fn(world) in `world` processes (fn a module-level function, so that they can import it); their results in
    rank order."""
    report = str(folder / "result")
    mp.spawn(_rank, args=(fn, world, free_port(), report), nprocs=world)
    return [json.loads(Path(f"{report}.{r}").read_text()) for r in range(world)]
