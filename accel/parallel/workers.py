"""Worker processes on the other devices, each holding a copy of the host's diffusion model and following the host's
model calls (the host process is rank 0: its own sampler drives every call).

The host starts the workers with its own Python and import path (accel/parallel/boot.py; not multiprocessing's spawn,
which would import the host's __main__ again in every child: ComfyUI's main.py parses arguments and runs custom nodes'
prestartup scripts at import). They join a process group over TCP on 127.0.0.1 (NCCL on GPUs, one process per GPU;
gloo on the CPU, which is how the tests run it). A worker builds the model's structure from a Recipe the host gives
(ComfyUI: the same class and config ComfyUI built it from), receives every parameter and buffer by broadcast from the
host (as the host holds them: LoRA patches merged), and wraps it in the torch path with the host's options.

Control travels over each worker's stdin (pickled messages: load a model, share a loaded one under another key, take new
weights, run a call, drop a model, stop) and its replies over its stdout; tensors (weights, a call's inputs, the
layouts' exchanges) over the process group. A worker waits for its next message on a pipe, not in a collective, so an
idle pool never times out, and a worker whose host is gone reads the end of its stdin and exits. The host watches the
workers: before each call it checks they are alive, and it waits for replies and for a call's collectives with a
deadline, so a dead or stuck worker ends the call with WorkerLost rather than hanging the host (on NCCL the host aborts
the group). A worker that fails in a call exits after saying why, so the host's next collective fails at once rather
than at the deadline.

One pool runs in a process at a time (it holds the default process group); models are loaded into it under keys, so
two models sampled in turn (Wan 2.2's high- and low-noise experts) keep their workers. It stops when its last model is
dropped.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import json
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist
from torch import nn

from ..errors import AccelError, BadInput, is_interrupt
from ..progress import Progress
from .layout import Layout, canonical, make_layouts
from .rendezvous import NO_MULTICAST, cpu_threads, free_port, join

log = logging.getLogger("sd-accel")

ROOT = Path(os.path.abspath(__file__)).parents[2]  # the checkout: the package sd_accel
BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot.py")
# In the host for the pool's life, besides NVLink multicast off (as in the workers): NCCL's watchdog must not end the
# host on a timeout; the pool's own deadline aborts the group and the host goes on on one GPU.
HOST_NCCL_ENV = {**NO_MULTICAST, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
DEFAULT_TIMEOUT = 300.0  # seconds: a worker's first call may compile kernels the host has cached


class WorkerLost(AccelError):
    """A worker died, failed or did not answer: the pool is stopped."""


@dataclass(frozen=True)
class Recipe:
    """How a worker makes the host's model. setup() readies the host's modules in the worker (its settings); model,
    unpickled after setup, is (build, args), and build(*args, device=device) makes the module's structure, whose values
    the host then sends. Pickled by reference, so build and setup must be importable functions of sd_accel."""

    setup: Callable[[], None]
    model: bytes


def named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer, in the order both sides send and receive them."""
    return [*module.named_parameters(), *module.named_buffers()]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as bytes: any dtype (fp8 included) travels as the same bits."""
    return t.view(-1).view(torch.uint8)


class _Worker:
    """One worker process as the host sees it: its pipes, its replies (read on a thread) and its last log lines."""

    def __init__(self, rank: int, device: str, config: dict, env: dict) -> None:
        self.rank, self.device = rank, device
        self.proc = subprocess.Popen([sys.executable, BOOT, json.dumps(config)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.replies: queue.Queue = queue.Queue()
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        threading.Thread(target=self._read_replies, daemon=True).start()
        self._log = threading.Thread(target=self._read_log, daemon=True)
        self._log.start()

    def _read_replies(self) -> None:
        try:
            while True:
                self.replies.put(pickle.load(self.proc.stdout))
        except Exception:  # the end of the pipe: the process is ending
            self.replies.put(None)

    def _read_log(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            text = line.decode(errors="replace").rstrip()
            if text:
                self.tail.append(text)
                log.info("sd-accel worker %d (%s): %s", self.rank, self.device, text)

    def send(self, message: tuple) -> None:
        try:
            pickle.dump(message, self.proc.stdin)
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:  # a closed pipe: the process is gone
            why = self.describe() or f"the worker process on {self.device} cannot be reached ({e})."
            raise WorkerLost(why) from None

    def describe(self) -> str:
        """Why this worker is gone, or '' while it runs."""
        code = self.proc.poll()
        if code is None:
            return ""
        self._log.join(timeout=1.0)  # its last words
        last = next((t for t in reversed(self.tail) if not t.startswith((" ", "Traceback"))), "")
        how = f"was ended by signal {-code}" if code < 0 else f"exited (code {code})"
        return f"the worker process on {self.device} {how}" + (f": {last}" if last else "") + "."

    def stop(self, wait: float) -> None:
        if self.proc.poll() is None and wait > 0:
            try:
                self.send(("stop",))
                self.proc.wait(timeout=wait)
            except (WorkerLost, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                pipe.close()
            except OSError:
                pass


class Pool:
    """Worker processes on devices[1:]; this process is rank 0 on devices[0]. start() before anything else."""

    def __init__(self, devices: list[str], timeout: float = DEFAULT_TIMEOUT) -> None:
        self.devices = [str(d) for d in devices]
        self.timeout = timeout
        self.backend = "nccl" if torch.device(self.devices[0]).type == "cuda" else "gloo"
        self.layouts: dict[str, Layout] = {}
        self.models: set[Hashable] = set()
        # per model: its host module, its options, the weights key its weights were last sent under
        self._sources: dict[Hashable, tuple[weakref.ref, dict, Hashable]] = {}
        self.running = False
        self._joined = False  # this process is in the pool's process group (the default one)
        self._workers: list[_Worker] = []
        self._env: dict[str, str | None] = {}  # the host's values of what the pool set, for stop()
        self._lock = threading.Lock()  # one exchange at a time
        self._dropped: list[Hashable] = []  # drops that came during an exchange (a finalizer mid-call, another thread)

    @property
    def world(self) -> int:
        return len(self.devices)

    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return [w.proc.pid for w in self._workers]

    # -- life

    def start(self, progress: Progress) -> None:
        """Start the workers and join them in the default process group; WorkerLost (all stopped) when that fails."""
        if dist.is_initialized():
            raise BadInput("torch.distributed is already in use in this process (another extension?).",
                           "Run the model on one GPU, or remove what else spreads work over GPUs here.")
        port = free_port()
        env = {**os.environ, **{k: os.environ.get(k, v) for k, v in NO_MULTICAST.items()},
               "PYTHONPATH": os.pathsep.join(sys.path)}  # the host's import path: ComfyUI's and its packages
        threads = cpu_threads(self.world)
        progress.stage(f"starting {self.world - 1} worker process(es) on {', '.join(self.devices[1:])}",
                       total=self.world - 1)
        try:
            for rank, device in enumerate(self.devices[1:], 1):
                config = {"root": str(ROOT), "rank": rank, "world": self.world, "port": port,
                          "device": device, "backend": self.backend, "timeout": self.timeout, "threads": threads}
                self._workers.append(_Worker(rank, device, config, env))
            for w in self._workers:
                self._expect(w, "hello")
                progress.advance()
            if self.backend == "nccl":
                self._env = {k: os.environ.get(k) for k in HOST_NCCL_ENV}
                for k, v in HOST_NCCL_ENV.items():
                    os.environ.setdefault(k, v)
            join(self.backend, port, 0, self.world, self.timeout,
                 torch.device(self.devices[0]) if self.backend == "nccl" else None)
            self._joined = True
            self.layouts = make_layouts()
            self.running = True
        except BaseException:
            self.stop(abort=True)
            raise
        finally:
            progress.done()

    def lost(self) -> str:
        """Why the pool cannot serve (a worker gone), or ''."""
        if not self.running:
            return "the workers were stopped."
        return next((d for d in (w.describe() for w in self._workers) if d), "")

    def stop(self, abort: bool = False) -> None:
        """End the workers (at once with abort: they may be stuck in a collective) and leave the process group."""
        self.running = False
        for w in self._workers:
            w.stop(wait=0 if abort else 10.0)
        self._workers = []
        if self._joined:
            if abort and self.backend == "nccl":
                dist.distributed_c10d._abort_process_group()
            dist.destroy_process_group()
            self._joined = False
        for k, v in self._env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._env = {}
        self.layouts, self.models, self._sources = {}, set(), {}
        global _POOL
        if _POOL is self:
            _POOL = None

    # -- models

    def load(self, key: Hashable, recipe: Recipe, module: nn.Module, options: dict, progress: Progress,
             weights: Hashable = None) -> None:
        """Every worker builds the model (recipe), takes module's values and prepares the torch path with options;
        weights: the host's key for those values (its patches' identity). A module the workers hold already with these
        options (another node output on the same host model: a widget changed, two nodes) is shared under the new key,
        and takes the host's values again unless it holds them (sync)."""
        same = next((k for k, (held, opts, _) in self._sources.items() if held() is module and opts == options), None)
        if same is not None:
            with self._exchange():
                for w in self._workers:
                    w.send(("share", key, same))
            self.models.add(key)
            self._sources[key] = (weakref.ref(module), dict(options), self._sources[same][2])
            self.sync(key, module, progress, weights)
            return
        tensors = self._tensors(module)
        spec = [(name, tuple(t.shape), t.dtype) for name, t in tensors]
        with self._exchange():
            progress.stage(f"building the model on {self.world - 1} worker(s)", total=self.world - 1)
            for w in self._workers:
                w.send(("load", key, pickle.dumps(recipe), options, spec))
            for w in self._workers:
                self._expect(w, "built")
                progress.advance()
            self._send_weights(tensors, progress)
            progress.stage(f"preparing the torch path on {self.world - 1} worker(s)", total=self.world - 1)
            for w in self._workers:
                self._expect(w, "ready")
                progress.advance()
            progress.done()
        self.models.add(key)
        self._sources[key] = (weakref.ref(module), dict(options), weights)

    def sync(self, key: Hashable, module: nn.Module, progress: Progress, weights: Hashable) -> None:
        """The workers' copy of the model under key holds the host's values under the weights key `weights`: sent
        again where the copy holds others (a LoRA added or removed; another node output on the same module sent its
        own). Every key sharing the copy holds them then."""
        _, options, sent = self._sources[key]
        if sent == weights:
            return
        tensors = self._tensors(module)
        with self._exchange():
            self._resend(key, tensors, progress)
        for k, (other, opts, _) in list(self._sources.items()):
            if other() is module and opts == options:
                self._sources[k] = (other, opts, weights)

    def _resend(self, key: Hashable, tensors: list[tuple[str, torch.Tensor]], progress: Progress) -> None:
        for w in self._workers:
            w.send(("weights", key))
        self._send_weights(tensors, progress)
        for w in self._workers:
            self._expect(w, "ready")

    def drop(self, key: Hashable) -> None:
        """Forget a model; the pool stops with its last. Safe from a finalizer, also in the middle of a call (the drop
        then waits for the call's end)."""
        if not self._lock.acquire(blocking=False):
            self._dropped.append(key)
            return
        try:
            if key in self.models:
                self.models.discard(key)
                self._sources.pop(key, None)
                if not self.models:
                    self.stop()
                else:
                    for w in self._workers:
                        w.send(("drop", key))
        except WorkerLost:
            self.stop(abort=True)
        finally:
            self._lock.release()

    def _drop_deferred(self) -> None:
        dropped, self._dropped = self._dropped, []
        for key in dropped:
            self.drop(key)

    def call(self, key: Hashable, layout: str, module: nn.Module, runner: Callable[..., torch.Tensor],
             inputs: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """runner's canonical call on inputs (as layout.canonical takes them, contiguous, on devices[0]) spread under the
        named layout; module is what runner runs (sequence_parallel hooks it). BadInput when the layout cannot take the
        call (every process refused it alike; the pool still serves), WorkerLost when a worker failed (the pool is
        stopped)."""
        specs = [None if t is None else (tuple(t.shape), t.dtype) for t in inputs]
        with self._exchange():
            for w in self._workers:
                w.send(("call", key, layout, specs))
            with torch.inference_mode():
                for t in inputs:
                    if t is not None and t.numel():
                        dist.broadcast(_as_bytes(t), 0)
                out = self.layouts[layout].run(module, canonical(runner), *inputs)
            self._settle()
        return out

    # -- the exchange

    def _tensors(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        tensors = named_tensors(module)
        here = torch.device(self.devices[0])
        away = [name for name, t in tensors if t.device != here]
        if away:
            raise BadInput(f"{len(away)} of the model's tensors are not on {here} ({away[0]}, ...), so they cannot be "
                           "sent to the other GPUs.", "Let the model load fully on its GPU (free VRAM).")
        return tensors

    def _send_weights(self, tensors: list[tuple[str, torch.Tensor]], progress: Progress) -> None:
        total = sum(t.numel() * t.element_size() for _, t in tensors) or 1
        progress.stage(f"sending the weights ({total / 2**30:.1f} GiB) to {self.world - 1} worker(s)", total=100)
        sent, shown = 0, 0
        with torch.inference_mode():
            for _, t in tensors:
                if t.numel():
                    dist.broadcast(_as_bytes(t.detach().contiguous()), 0)
                sent += t.numel() * t.element_size()
                if 100 * sent // total > shown:
                    progress.advance(int(100 * sent // total) - shown)
                    shown = int(100 * sent // total)
        self._settle()
        progress.done()

    @contextlib.contextmanager
    def _exchange(self) -> Iterator[None]:
        """Around one message and its collectives, one at a time: the workers are checked first. Any failure but
        BadInput leaves the processes out of step, so it stops the pool, and but for a host's interrupt it becomes
        WorkerLost: the caller runs the call on one device."""
        with self._lock:
            why = self.lost()
            if why:
                self.stop(abort=True)
                raise WorkerLost(why)
            try:
                yield
            except BadInput:
                raise
            except Exception as e:
                passes = isinstance(e, WorkerLost) or is_interrupt(e)
                why = "" if passes else self._why_failed(e)
                self.stop(abort=True)
                if passes:
                    raise
                raise WorkerLost(why) from e
            except BaseException:
                self.stop(abort=True)
                raise
        self._drop_deferred()

    def _why_failed(self, e: Exception) -> str:
        """What ended an exchange: a worker's exit, given a moment to show (gloo sees a peer's socket close before the
        process is reaped), else the error itself."""
        deadline = time.monotonic() + 1.0
        while not self.lost() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.lost() or f"the spread call failed ({type(e).__name__}: {e})."

    def _expect(self, w: _Worker, kind: str) -> tuple:
        """The worker's next reply, which must be `kind`: WorkerLost when it fails, exits or stays silent."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                reply = w.replies.get(timeout=0.1)
            except queue.Empty:
                why = w.describe()
                if not why and time.monotonic() > deadline:
                    why = f"the worker process on {w.device} did not answer in {self.timeout:.0f} s."
                if why:
                    raise WorkerLost(why) from None
                continue
            if reply is None:  # its stdout closed: it is ending
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(timeout=5.0)
                raise WorkerLost(w.describe() or f"the worker process on {w.device} closed its pipe.")
            if reply[0] == "error":
                raise WorkerLost(f"the worker process on {w.device} failed: {reply[1]}")
            if reply[0] == kind:
                return reply

    def _settle(self) -> None:
        """Wait for this process's collectives (NCCL runs them behind the host's back) while watching the workers:
        WorkerLost when one dies or the deadline passes. gloo ran them already and raised if a peer was gone."""
        if self.backend != "nccl":
            return
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + self.timeout
        pause = 0.0005  # short for the short steps; no more than 2 ms late, and few checks while a long one runs
        while not done.query():
            why = self.lost()
            if why or time.monotonic() > deadline:
                raise WorkerLost(why or f"the workers did not finish in {self.timeout:.0f} s.")
            time.sleep(pause)
            pause = min(2 * pause, 0.002)


_POOL: Pool | None = None
_KEYS = itertools.count(1)


def new_key() -> int:
    """A key for a model in the pool, never reused in this process."""
    return next(_KEYS)


def current() -> Pool | None:
    """The pool running in this process, if any."""
    return _POOL


def pool_for(devices: list[str], progress: Callable[[], Progress], timeout: float = DEFAULT_TIMEOUT) -> Pool:
    """The running pool over these devices, started (reporting to progress()) when there is none; a pool over other
    devices is stopped first: one pool at a time. WorkerLost or BadInput when it cannot start."""
    global _POOL
    devices = [str(d) for d in devices]
    if _POOL is not None and (_POOL.devices != devices or _POOL.lost()):
        _POOL.stop(abort=bool(_POOL.lost()))
    if _POOL is None:
        pool = Pool(devices, timeout)
        pool.start(progress())
        _POOL = pool
    return _POOL


@atexit.register
def _stop_at_exit() -> None:
    if _POOL is not None:
        _POOL.stop()


# ------------------------------------------------------------------------------------------------ the worker side

class _Replica:
    """A worker's copy of one model: built from the recipe, its tensors laid out as the host's (spec), its engine."""

    def __init__(self, recipe: bytes, options: dict, spec: list, device: torch.device) -> None:
        made: Recipe = pickle.loads(recipe)
        made.setup()
        build, args = pickle.loads(made.model)
        self.module = build(*args, device=device).eval().requires_grad_(False)
        self.tensors = _mirror(self.module, spec)
        self.options, self.device, self.acc = options, device, None

    def receive(self) -> None:
        with torch.inference_mode():
            for t in self.tensors:
                if t.numel():
                    dist.broadcast(_as_bytes(t), 0)
        if self.acc is None:
            from ..accelerate import accelerate

            self.acc = accelerate(self.module, "torch", self.options)
        elif getattr(self.acc.engine, "weights_changed", None) is not None:
            self.acc.engine.weights_changed()

    def call(self, layout: Layout, specs: list) -> None:
        with torch.inference_mode():
            inputs = [None if s is None else torch.empty(s[0], dtype=s[1], device=self.device) for s in specs]
            for t in inputs:
                if t is not None and t.numel():
                    dist.broadcast(_as_bytes(t), 0)
            try:
                layout.run(self.module, canonical(self.acc), *inputs)
            except BadInput:  # refused on every process alike: the host runs this call alone
                pass


def _mirror(module: nn.Module, spec: list) -> list[torch.Tensor]:
    """module's tensors in the host's order, each made the host's shape and dtype (the host may hold some in another
    dtype than a fresh build: ComfyUI casts some at load). BadInput when the two models' tensors differ by name."""
    mine = dict(named_tensors(module))
    names = [name for name, _, _ in spec]
    if set(mine) != set(names):
        odd = sorted(set(mine) ^ set(names))
        raise BadInput(f"the worker's model and the host's differ in {len(odd)} tensor(s) ({odd[0]}, ...).",
                       "Run this model on one GPU.")
    out = []
    for name, shape, dtype in spec:
        t = mine[name]
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            t.data = torch.empty(shape, dtype=dtype, device=t.device)
        out.append(t)
    return out


def serve(config: dict, replies: BinaryIO) -> None:
    """A worker's life (boot.py): say hello on replies, join the group, then follow the host's messages until it says
    stop or is gone."""

    def reply(*message) -> None:
        pickle.dump(message, replies)
        replies.flush()

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    device = torch.device(config["device"])
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(config["threads"])
        reply("hello", os.getpid())
        join(config["backend"], config["port"], config["rank"], config["world"], config["timeout"],
             device if device.type == "cuda" else None)
        layouts = make_layouts()
        models: dict[Hashable, _Replica] = {}
        while True:
            try:
                message = pickle.load(sys.stdin.buffer)
            except EOFError:  # the host is gone
                break
            op = message[0]
            if op == "stop":
                break
            if op == "load":
                _, key, recipe, options, spec = message
                models[key] = _Replica(recipe, options, spec, device)
                reply("built")
                models[key].receive()
                reply("ready")
            elif op == "share":
                models[message[1]] = models[message[2]]
            elif op == "weights":
                models[message[1]].receive()
                reply("ready")
            elif op == "call":
                _, key, layout, specs = message
                models[key].call(layouts[layout], specs)
            elif op == "drop":
                models.pop(message[1], None)
        dist.destroy_process_group()
    except BaseException as e:
        # Say why, then end at once: the host's next collective with this process fails rather than waits.
        import traceback

        traceback.print_exc()
        try:
            reply("error", f"{type(e).__name__}: {e}")
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)
