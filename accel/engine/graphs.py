"""Per-shape CUDA/HIP graph capture with static input buffers, bounded and sharing one memory pool.

A graph replays the kernels it captured on the memory it captured them with: new inputs are copied into
its static buffers, and weights are read from wherever the parameters lived at capture time. So the cache
is keyed by the inputs' shapes, dtypes and device, and each entry remembers a token of the weights'
storage; a host that swaps Parameter objects (ComfyUI's LoRA patching does) changes the token and the
shape is captured again instead of replaying stale weights.

A call over several processes (sequence parallelism: accel/parallel/exchange.py) holds collectives. Each one cuts the
capture: the graph so far ends before it, the collective runs, and the next graph begins after it; a replay runs the
graphs with the collectives between them, on the same tensors. NCCL captured inside one graph made a spread Flux step
three times slower, and running such a call without graphs left its GPU idle a fifth of the step while the CPU
launched its kernels (BENCHMARKS.md). The tensors a collective reads and writes come from `empty()`, which keeps them
outside the graphs' pool, two per shape taken in turn, so the memory they need does not grow with the blocks.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

_registrations = 0


def count_registration(*_args) -> None:
    """Count one registration: the hooks below call it, and so does code that swaps a module's tensors in ways they do
    not see (widen.py)."""
    global _registrations
    _registrations += 1


_hooks = [
    torch.nn.modules.module.register_module_parameter_registration_hook(count_registration),
    torch.nn.modules.module.register_module_buffer_registration_hook(count_registration),
    torch.nn.modules.module.register_module_module_registration_hook(count_registration),
]


def registrations() -> int:
    """How many Parameters, buffers and submodules have been registered on any module so far (attribute assignment
    registers them). While it stays the same, no module tree got a new submodule or tensor that way, nor a swap that
    count_registration() was told of."""
    return _registrations


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
        if self._seen != registrations():
            self._seen = registrations()
            self._tensors = list(self.module.parameters()) + list(self.module.buffers())
        return self._tensors

    def token(self) -> tuple:
        return tuple(map(torch.Tensor.data_ptr, self.tensors()))


class _Buffers:
    """The tensors the collectives of one captured call read and write: made in the warm-up call before the capture
    (none can be made outside the graphs' pool while one is captured), two per shape, dtype and device, taken in turn.
    A collective's output is read before the second collective after it of its shape writes there again, and every
    collective waits for what the stream did before it."""

    def __init__(self) -> None:
        self.held: dict[tuple, list[torch.Tensor]] = {}
        self.turns: Counter = Counter()
        self.made = False  # the warm-up call is over: a capture takes only what it made

    def seal(self) -> None:
        """The warm-up call is over: the capture takes the same tensors in the same turns."""
        self.made, self.turns = True, Counter()

    def take(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (tuple(shape), dtype, torch.device(device))
        ring = self.held.setdefault(key, [])
        turn = self.turns[key] % 2
        self.turns[key] += 1
        if turn == len(ring):
            if self.made:
                raise RuntimeError(f"a collective's tensor {key} was not made in the call before the capture")
            ring.append(torch.empty(tuple(shape), dtype=dtype, device=device))
        return ring[turn]


@dataclass
class _Pieces:
    """One call's graphs and the collectives between them, in order (one graph more than collectives)."""

    pool: tuple
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    between: list[Callable[[], None]] = field(default_factory=list)
    open: bool = False  # the last graph is being captured

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        # With a process group, NCCL's watchdog thread queries the events of collectives (the warm-up's, those between
        # the pieces) while a piece is captured. CUDA's global mode forbids such calls to every thread while a capture
        # lasts; thread_local forbids them to the capturing thread only.
        graph.capture_begin(*self.pool, capture_error_mode="thread_local" if dist.is_initialized() else "global")
        self.graphs.append(graph)
        self.open = True

    def end(self) -> None:
        if self.open:
            self.open = False
            self.graphs[-1].capture_end()

    def cut(self, run: Callable[[], None]) -> None:
        self.end()
        run()
        self.between.append(run)
        self.begin()

    def replay(self) -> None:
        for graph, run in zip(self.graphs, self.between):
            graph.replay()
            run()
        self.graphs[-1].replay()


_buffers: _Buffers | None = None  # while GraphCache warms up or captures a call
_pieces: _Pieces | None = None  # while GraphCache captures a call


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor for a collective to read or write (between()): a new one, or while a call is captured, one kept with
    its graphs."""
    if _buffers is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    return _buffers.take(shape, dtype, device)


def between(run: Callable[[], None]) -> None:
    """run() now: a collective over the processes, on tensors from empty(). While a call is captured it cuts the
    capture, and each replay runs it between the two graphs."""
    if _pieces is None:
        run()
    else:
        _pieces.cut(run)


@contextlib.contextmanager
def _capturing(buffers: _Buffers, pieces: _Pieces | None = None) -> Iterator[None]:
    global _buffers, _pieces
    _buffers, _pieces = buffers, pieces
    try:
        yield
    finally:
        _buffers, _pieces = None, None


@dataclass
class _Entry:
    pieces: _Pieces
    buffers: _Buffers
    inputs: list[torch.Tensor]
    output: torch.Tensor | list[torch.Tensor]
    token: tuple


class GraphCache:
    """Replays `fn(*tensors)` (a tensor, or a list of them) from a CUDA graph per input signature; at most
    `max_graphs` live at once.

    The first call at a signature runs `fn` itself, and the graph is captured when the signature comes again: a new
    image size gives its first output after one plain step (which also does the lazy initialisation, Triton's
    compilation and cuDNN's algorithm choice the capture must not see), and a size used once costs no capture."""

    def __init__(self, fn: Callable[..., torch.Tensor | list[torch.Tensor]], max_graphs: int = 4,
                 run_first: Callable[..., torch.Tensor | list[torch.Tensor]] | None = None) -> None:
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

    def __call__(self, tensors: Sequence[torch.Tensor], token: tuple) -> torch.Tensor | list[torch.Tensor]:
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
        entry.pieces.replay()
        # Graphs share one pool, so another shape's replay may reuse this output's memory: hand out a copy.
        if isinstance(entry.output, torch.Tensor):
            return entry.output.clone()
        return [t.clone() for t in entry.output]

    def _capture(self, tensors: Sequence[torch.Tensor], token: tuple) -> _Entry:
        start = time.perf_counter()
        static = [t.detach().clone() for t in tensors]
        buffers = _Buffers()
        # One side stream for every warm-up: cuBLAS keeps a workspace per stream that is never given back.
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), _capturing(buffers):  # the side stream's allocations stay out of the graph
            self.fn(*static)
        torch.cuda.current_stream().wait_stream(stream)
        buffers.seal()
        if self._pool is None or not self._entries:
            # A pool is released with the last graph that used it: start a new one when none is left.
            self._pool = torch.cuda.graph_pool_handle()
        pieces = _Pieces((self._pool,))
        # What torch.cuda.graph does before its capture, which cannot be cut; the pieces of one call share the pool
        # and replay in the order they were captured, so each may reuse what the ones before it freed.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # Factory calls default to the graph's device while it is captured: a host's code that builds a constant
        # on the CPU and copies it over (ldm's and sgm's timestep_embedding, as A1111 runs SDXL) cannot be captured.
        # Captured on the warm-up's stream, whose cuBLAS workspace the warm-up made.
        with torch.cuda.stream(stream), torch.device(static[0].device), _capturing(buffers, pieces):
            pieces.begin()
            try:
                output = self.fn(*static)
            finally:  # a collective that failed between two pieces left none open
                pieces.end()
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return _Entry(pieces, buffers, static, output, token)

    def clear(self) -> None:
        self._entries.clear()
        self._pool = None
