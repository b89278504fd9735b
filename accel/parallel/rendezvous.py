"""How processes on this machine meet in one process group: a TCP rendezvous on 127.0.0.1 (the host's worker pool,
`bench --gpus`, the tests' gloo groups), the CPU threads each takes when they share the CPU, and the settings NCCL
needs on shared multi-GPU hosts."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) off in NCCL, PyTorch and NVSHMEM: on shared multi-GPU hosts a program that uses it can put
# the host's GPUs out of service. Set in the processes' environment where the user has not set them.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for the group to meet on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(backend: str, port: int, rank: int, world: int, timeout_s: float, device: torch.device | None = None) -> None:
    """This process into the default group of `world` processes meeting on 127.0.0.1:port; device: its GPU, which NCCL
    binds the group to (None on the CPU). timeout_s: how long a collective waits for the others before it fails."""
    from ..engine import fp8_attention

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), device_id=device)
    # every rank of the new group takes part in its first agreements (the host's process outlives worker pools)
    fp8_attention.forget_agreed()


def cpu_threads(world: int) -> int:
    """Threads for each of `world` processes that share this machine's CPU."""
    return max(1, (os.cpu_count() or 1) // world)
