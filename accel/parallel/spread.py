"""One host model's calls spread over several devices (accel/parallel/workers.py): which devices, and the policy an
EngineSlot follows when it has a Spread.

The workers start on the first call that can use them (the host's progress bar shows the start and the weights going
out) and take the host's weights again whenever its weights key changes (a LoRA added or removed). Each call runs under
the best layout that takes it (accel/parallel/layout.py), remembered per input shapes; a call that no layout takes runs
on the host's device alone while the workers wait. A worker that dies ends the parallel call: that call and the rest
of the run are served by the host alone, with one message, and the workers start again at the next run; workers that
cannot start or load the model are not tried again for it. The workers go when the model is dropped: unloaded by the
host (close()) or this Spread collected (the host's node session ended).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import BadInput
from ..progress import NullProgress, Progress
from .layout import candidates
from .workers import DEFAULT_TIMEOUT, Pool, Recipe, WorkerLost, new_key, pool_for

log = logging.getLogger("sd-accel")

GPUS = ("1", "2", "4", "all")
# The torch path's options while calls are spread, on every process alike: no compiling ahead (kernels/ahead.py runs a
# call twice in a process that lacks kernels, so the processes' collectives would fall out of step), and no
# torch.compile (sequence parallelism hooks the blocks afresh for each call, and compiled blocks guard on their hooks: a
# recompile every step). CUDA graphs stay as asked: a CFG half's call holds no collective and replays its graph; a
# sequence-parallel call replays graphs cut at its collectives, which run between them (accel/engine/graphs.py).
SPREAD_OPTIONS = {"parallel_compile": False, "compile": False}


def devices_for(asked: str, first: torch.device, visible: int, nccl: bool) -> tuple[list[str], str]:
    """The devices a model asked to run on `asked` GPUs (one of GPUS) gets, `first` (the host's own) first, and what to
    say when that is fewer than asked ('' when nothing): never more than are visible, never an error."""
    if asked not in GPUS:
        raise BadInput(f"gpus {asked!r} is not one of {', '.join(GPUS)}.", "Choose one of them.")
    if asked == "1":
        return [str(first)], ""
    if first.type != "cuda":
        return [str(first)], f"gpus {asked}: the model runs on the {first.type}, so one device serves it."
    if not nccl:
        return [str(first)], (f"gpus {asked}: this PyTorch has no NCCL, which spreading over GPUs needs (Linux builds "
                              "have it); one GPU serves the model.")
    want = visible if asked == "all" else int(asked)
    index = first.index if first.index is not None else torch.cuda.current_device()
    devices = [f"cuda:{index}"] + [f"cuda:{i}" for i in range(visible) if i != index][: want - 1]
    if len(devices) < want:
        are = "GPUs are" if visible > 1 else "GPU is"
        return devices, f"gpus {asked}: {visible} {are} visible, so the model runs on {len(devices)}."
    if len(devices) == 1:
        return devices, "gpus all: one GPU is visible, so one GPU serves the model."
    return devices, ""


def devices_here(asked: str, first: torch.device) -> tuple[list[str], str]:
    """devices_for with this machine's visible GPUs."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return devices_for(asked, torch.device(first), visible, dist.is_available() and dist.is_nccl_available())


class Spread:
    """A model's calls over devices (the first: the host's). call() serves one, or says it runs on one device."""

    def __init__(self, devices: list[str], recipe: Callable[[], Recipe], options: dict,
                 tell: Callable[[str, str], None], progress: Callable[[], Progress] | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        self.devices = [str(d) for d in devices]
        self.recipe = recipe  # made when the workers load the model: the host's state then
        self.options = options  # the host engine's (read when the workers load the model)
        self.tell = tell
        self.progress = progress or NullProgress
        self.timeout = timeout
        self.why_one = ""  # why the last call ran on one device ('' when it was spread)
        self.layout = ""  # the layout of the last spread call, in words
        self.start_seconds = 0.0  # the last start of the workers with the model on them
        self._pool: Pool | None = None
        self._key: Hashable | None = None
        self._module: nn.Module | None = None
        self._dropper: weakref.finalize | None = None
        self._tries: dict[tuple, list[str]] = {}  # per input shapes: the layouts left to try, best first
        self._refused: dict[tuple, str] = {}  # per input shapes that no layout takes: why
        self._off = ""  # the workers could not start or load the model: not tried again
        self._lost = ""  # a worker died in this run: the rest of the run on one device
        self._held = ""  # the host keeps this run's calls on one device (hold())

    def call(self, module: nn.Module, weights_key, runner: Callable[..., torch.Tensor], x: torch.Tensor,
             timesteps: torch.Tensor, context: torch.Tensor, y: torch.Tensor | None = None,
             guidance: torch.Tensor | None = None) -> torch.Tensor | None:
        """runner's canonical call (module is what it runs) spread over the devices, or None: the caller runs it on the
        host's device alone (why_one says why; said once)."""
        if self._off or self._lost or self._held:
            self.why_one = self._off or self._lost or self._held
            return None
        if timesteps.dim() == 0:
            timesteps = timesteps.expand(x.shape[0])
        inputs = tuple(None if t is None else t.contiguous() for t in (x, timesteps, context, y, guidance))
        shapes = tuple(None if t is None else (tuple(t.shape), t.dtype) for t in inputs)
        dead = self._pool.lost() if self._pool is not None else ""
        if dead:  # a worker died since the last call
            return self._lose(dead)
        try:
            pool = self._ready(module, weights_key)
        except BadInput as e:  # this call's model cannot be sent (not all on the device): alone, the workers kept
            return self._alone(f"spread:{e.problem}", f"{e} This call runs on one GPU.")
        except WorkerLost as e:
            return self._lose(str(e))
        if pool is None:
            return None
        tries = self._tries.setdefault(shapes, candidates(x.shape[0], pool.layouts))
        if not tries:  # no layout takes calls of these shapes (said when they were refused)
            self.why_one = self._refused[shapes]
            return None
        while tries:
            try:
                out = pool.call(self._key, tries[0], module, runner, inputs)
            except BadInput as e:
                self._refused[shapes] = f"{e.problem} Such calls run on one GPU."
                tries.pop(0)
                continue
            except WorkerLost as e:
                return self._lose(str(e))
            self._refused.pop(shapes, None)
            self.layout, self.why_one = pool.layouts[tries[0]].name, ""
            return out
        return self._alone(f"layout:{self._refused[shapes]}", self._refused[shapes])

    def _alone(self, key: str, why: str) -> None:
        self.why_one = why
        self.tell(key, why)
        return None

    def _lose(self, why: str) -> None:
        """A worker is gone: the pool stops, and this call and the rest of the run run on one device."""
        if self._pool is not None and self._pool.running:
            self._pool.stop(abort=True)
        self._forget()
        self._lost = f"{why} One GPU serves this call and the rest of the run; the workers start again at the next run."
        return self._alone(self._lost, self._lost)

    def _ready(self, module: nn.Module, weights_key) -> Pool | None:
        """The pool with this model on it, its weights the host's now: started, loaded or sent as needed. None when
        the workers cannot start or load the model (said once; not tried again for it)."""
        pool = self._pool
        if pool is not None and module is self._module and self._key in pool.models:
            pool.sync(self._key, module, self.progress(), weights_key)
            return pool
        if module is not self._module:  # what the layouts took or refused was this module's
            self._tries, self._refused = {}, {}
        self._forget()
        start = time.perf_counter()
        key = new_key()
        try:
            pool = pool_for(self.devices, self.progress, self.timeout)
            pool.load(key, self.recipe(), module, self.options, self.progress(), weights_key)
        except WorkerLost as e:
            self._off = (f"the worker processes for {len(self.devices) - 1} more device(s) could not start or load the "
                         f"model ({e}); it runs on one GPU until the node runs again.")
            return self._alone("spread:off", self._off)
        self._pool, self._module, self._key = pool, module, key
        self._dropper = weakref.finalize(self, pool.drop, key)
        self.start_seconds = time.perf_counter() - start
        log.info("sd-accel: the model is on %d devices (%s); workers ready in %.1f s", len(self.devices),
                 ", ".join(self.devices), self.start_seconds)
        return pool

    def _forget(self) -> None:
        if self._dropper is not None:
            self._dropper()  # pool.drop(key), once
        self._dropper, self._pool, self._key, self._module = None, None, None, None

    def hold(self, why: str) -> None:
        """The host keeps its calls on one device until it says otherwise (why == ''), saying why once: it changed
        the model in ways the workers' copies do not see."""
        self._held = why
        if why:
            self.tell(f"held:{why}", why)

    def end_run(self) -> None:
        """The host's run ended: after a worker died, the next run starts the workers again."""
        self._lost = ""

    def close(self) -> None:
        """The host unloaded the model: its workers go (the pool stops with its last model)."""
        self._forget()
