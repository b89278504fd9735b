"""Per-shape CUDA/HIP graph capture with static input buffers, bounded and sharing one memory pool.

A graph replays the kernels it captured on the memory it captured them with: new inputs are copied into
its static buffers, and weights are read from wherever the parameters lived at capture time. So the cache
is keyed by the inputs' shapes, dtypes and device, and each entry remembers a token of the weights'
storage; a host that swaps Parameter objects (ComfyUI's LoRA patching does) changes the token and the
shape is captured again instead of replaying stale weights.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

_registrations = 0


def _count_registration(*_args) -> None:
    global _registrations
    _registrations += 1


_hooks = [
    torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration),
    torch.nn.modules.module.register_module_buffer_registration_hook(_count_registration),
    torch.nn.modules.module.register_module_module_registration_hook(_count_registration),
]


class WeightsWatch:
    """Identity of the storage every parameter and buffer of a module reads from, cheap enough for every step.

    In-place updates keep the token (a graph then reads the new values, which is right); a tensor moved or
    re-cast (`.data` replaced) changes its pointer. A Parameter or submodule replaced by assignment is seen
    through torch's global registration hooks, which make the tensor list be gathered again.
    Walking the module tree at every step would cost milliseconds of CPU per SD1.5 step; reading the pointers of a
    kept list costs a small fraction of that.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._seen = -1
        self._tensors: list[torch.Tensor] = []

    def tensors(self) -> list[torch.Tensor]:
        if self._seen != _registrations:
            self._seen = _registrations
            self._tensors = list(self.module.parameters()) + list(self.module.buffers())
        return self._tensors

    def token(self) -> tuple:
        return tuple(map(torch.Tensor.data_ptr, self.tensors()))


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    output: torch.Tensor
    token: tuple


class GraphCache:
    """Replays `fn(*tensors)` from a CUDA graph per input signature; at most `max_graphs` live at once.

    The first call at a signature runs `fn` itself, and the graph is captured when the signature comes again: a new
    image size gives its first output after one plain step (which also does the lazy initialisation, Triton's
    compilation and cuDNN's algorithm choice the capture must not see), and a size used once costs no capture."""

    def __init__(self, fn: Callable[..., torch.Tensor], max_graphs: int = 4,
                 run_first: Callable[..., torch.Tensor] | None = None) -> None:
        self.fn = fn
        # How the plain call at a new signature runs fn: run_first(fn, *tensors).
        self.run_first = run_first or (lambda fn, *tensors: fn(*tensors))
        self.max_graphs = max(1, max_graphs)
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._seen: set[tuple] = set()  # signatures called at least once
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self.captures = 0
        self.capture_s = 0.0  # time spent warming up and capturing, for the bench's first-call breakdown

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def signature(tensors: Sequence[torch.Tensor]) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)

    def __call__(self, tensors: Sequence[torch.Tensor], token: tuple) -> torch.Tensor:
        key = self.signature(tensors)
        entry = self._entries.get(key)
        if entry is not None and entry.token != token:
            del self._entries[key]
            entry = None
        if entry is None:
            if key not in self._seen:
                self._seen.add(key)
                return self.run_first(self.fn, *tensors)
            entry = self._capture(tensors, token)
            self._entries[key] = entry
            while len(self._entries) > self.max_graphs:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        for dst, src in zip(entry.inputs, tensors):
            dst.copy_(src)
        entry.graph.replay()
        # Graphs share one pool, so another shape's replay may reuse this output's memory: hand out a copy.
        return entry.output.clone()

    def _capture(self, tensors: Sequence[torch.Tensor], token: tuple) -> _Entry:
        start = time.perf_counter()
        static = [t.detach().clone() for t in tensors]
        # One side stream for every warm-up: cuBLAS keeps a workspace per stream that is never given back.
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the side stream's own allocations and cuBLAS workspace stay out of the graph
            self.fn(*static)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None or not self._entries:
            # A pool is released with the last graph that used it: start a new one when none is left.
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # Factory calls default to the graph's device while it is captured: a host's code that builds a constant
        # on the CPU and copies it over (ldm's and sgm's timestep_embedding, as A1111 runs SDXL) cannot be captured.
        with torch.cuda.graph(graph, pool=self._pool), torch.device(static[0].device):
            output = self.fn(*static)
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return _Entry(graph, static, output, token)

    def clear(self) -> None:
        self._entries.clear()
        self._pool = None
