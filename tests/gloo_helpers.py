"""A test's function run in several processes of one gloo group on the CPU (ComfyUI importable in each), each
process's JSON-able result brought back."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import comfy_helpers as H


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, fn: Callable[[int], dict], world: int, port: int, report: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
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
    mp.spawn(_rank, args=(fn, world, _free_port(), report), nprocs=world)
    return [json.loads(Path(f"{report}.{r}").read_text()) for r in range(world)]
