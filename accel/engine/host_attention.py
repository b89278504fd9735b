"""Ours or the host's attention function, whichever was the faster for a shape.

A host's user may choose one attention function for the whole host (ComfyUI's --use-sage-attention,
--use-flash-attention, --use-split-cross-attention): a preference for speed or memory, not a patch that changes what a
call computes. The fused blocks compute attention themselves, so they honour it by timing the host's function against
their own (PyTorch's SDPA with the engine's backend order, or sd-accel's short-key kernel) at the first call at a
shape on the GPU, and run the faster from then on, saying once which and why. The first call at a shape is a plain
one (graphs.py captures at the second), so neither a capture nor its warm-up times anything: they find the choice
made. Where nothing can be timed (the CPU, other devices) ours runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger("sd-accel")

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # attend(q, k, v) -> output

WARM, TIMED = 2, 5  # calls of each before timing (the first compiles Triton kernels: sage's are Triton), calls timed
# The host's must beat ours by this much: a tie keeps ours, which takes every head size, where sage's takes 64, 96 and
# 128 and falls back with an error logged at each call.
MARGIN = 0.97


@dataclass(frozen=True)
class Host:
    """The host's attention function chosen for the whole host: `fn` itself (choices are kept per function), its
    short name and the words that say where it comes from (for the message), and `attend`, fn called in the form of
    the caller's q, k and v."""

    fn: Callable
    name: str  # "sage"
    why: str  # "ComfyUI's attention is sage (--use-sage-attention)"
    attend: Attend


@dataclass(frozen=True)
class Choice:
    host: bool  # the host's function serves the shape
    ours_ms: float | None = None  # None: nothing was timed
    host_ms: float | None = None


_CHOICES: dict[tuple, Choice] = {}
_SAID: set[tuple] = set()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ours: Attend, ours_name: Callable[[], str],
           host: Host) -> torch.Tensor:
    """ours(q, k, v) or host.attend(q, k, v): the one timed faster at the first call for these shapes, dtype and device
    with this host function (ours where nothing is timed); the choice is said once, ours_name() naming what ours
    runs."""
    key = (tuple(q.shape), tuple(k.shape), q.dtype, q.device, host.fn)
    new = key not in _CHOICES
    choice = choose(key, q, k, v, ours, host.attend)
    if choice is None:
        return ours(q, k, v)
    if new:
        say(choice, ours_name(), host, q, k)
    return (host.attend if choice.host else ours)(q, k, v)


def choose(key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ours: Attend, theirs: Attend) \
        -> Choice | None:
    """Whether theirs(q, k, v) serves `key` (Choice.host) rather than ours: timed at the first call under key where
    a time can be taken, then kept; ours where nothing is timed (the CPU). None at a moment on the GPU that cannot
    be timed (see _may_time): ours serves that call, and the next chooses."""
    choice = _CHOICES.get(key)
    if choice is None:
        if not _may_time(q):
            if q.is_cuda:
                return None
            choice = Choice(host=False)
        else:
            choice = _timed(q, k, v, ours, theirs)
        _CHOICES[key] = choice
    return choice


def _may_time(q: torch.Tensor) -> bool:
    """Whether a time taken now is the attention's own: on a CUDA/HIP device, outside a graph capture, and outside the
    recording run of kernels/ahead.py, where launches of our kernels not compiled yet do nothing."""
    if not q.is_cuda or torch.cuda.is_current_stream_capturing():
        return False
    from ...kernels import ahead

    return not ahead.recording()


def _timed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ours: Attend, theirs: Attend) -> Choice:
    ours_ms, host_ms = call_ms(ours, q, k, v), call_ms(theirs, q, k, v)
    return Choice(host_ms < MARGIN * ours_ms, ours_ms, host_ms)


def call_ms(fn: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """Milliseconds per call of fn(q, k, v) on the GPU, after WARM calls untimed."""
    for _ in range(WARM):
        fn(q, k, v)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMED):
        fn(q, k, v)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / TIMED


def say(choice: Choice, ours_name: str, host: Host, q: torch.Tensor, k: torch.Tensor, topic: str = "") -> None:
    """Once per host function, outcome and topic (fp8 attention's choice is said apart from the 16-bit one's): a model
    whose shapes split between the two says both."""
    said = (topic, host.fn, choice.host, choice.ours_ms is None)
    if said in _SAID:
        return
    _SAID.add(said)
    if choice.ours_ms is None:
        log.warning("sd-accel: %s; on the %s nothing is timed: the fused blocks run %s.", host.why, q.device.type,
                    ours_name)
        return
    tokens = f"{q.shape[1]} tokens" + ("" if k.shape[1] == q.shape[1] else f" ({k.shape[1]} keys)")
    if choice.host:
        log.warning("sd-accel: %s; the fused blocks run it: %.2f ms against %.2f ms for %s at %s.", host.why,
                    choice.host_ms, choice.ours_ms, ours_name, tokens)
    else:
        log.warning("sd-accel: %s; the fused blocks run %s: %.2f ms against %.2f ms for %s at %s.", host.why,
                    ours_name, choice.ours_ms, choice.host_ms, host.name, tokens)
