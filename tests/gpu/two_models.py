"""Two models one after the other in one ComfyUI process, as a workflow that loads a second checkpoint runs them
(issue 53). Under DynamicVRAM (ComfyUI 0.33) the suite's process crashed twice with a segmentation fault as its second
model started (SDXL after SD1.5, SD3.5-medium after Flux), so tests/gpu/run runs each model in a process of its own.
These checks find out whose crash it is: `two-models-plain` runs plain ComfyUI alone on SD1.5, then SDXL, then SD1.5
again; `two-models` does the same with the Accelerated UNet node on each, every run against plain's latents of that
visit. Each step is printed before it starts and faulthandler prints the Python stack of a crash, so a crash names
the step and the line it died in."""

from __future__ import annotations

import faulthandler
import gc
from dataclasses import dataclass, field

import torch

import comfy_helpers as H
import sequences

MODELS = ("sd15", "sdxl", "sd15")  # the first model again after the second: its copies and graphs must still serve
PAIRS = {"two-models-plain": False, "two-models": True}  # name: whether the node runs on each model


@dataclass
class Visit:
    model: str
    error: float  # relative L2 of the node's latents from plain's of the same visit; plain alone: from its first visit
    limit: float
    finite: bool
    engine_calls: int = 0
    plain_calls: int = 0

    def problems(self, node: bool) -> list[str]:
        bad = [] if self.finite else ["NaN/inf in the latents"]
        if self.error > self.limit:
            bad.append(f"latents {self.error:.2e} off, over {self.limit:.2e}")
        if node and (self.plain_calls or not self.engine_calls):
            bad.append(f"calls engine/ComfyUI's forward {self.engine_calls}/{self.plain_calls}, not all the engine")
        return bad


@dataclass
class PairReport:
    name: str
    node: bool
    visits: list[Visit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        bad = [f"{self.name} visit {i + 1} ({v.model}): {p}" for i, v in enumerate(self.visits)
               for p in v.problems(self.node)]
        if len(self.visits) < len(MODELS):
            bad.append(f"{self.name}: {len(self.visits)} of {len(MODELS)} visits ran")
        return bad

    def table(self) -> str:
        what = "the node against plain, each visit" if self.node else "plain against its first visit of the model"
        lines = [f"== {self.name}: {' -> '.join(MODELS)} in one process; {what}",
                 f"{'visit':<6} {'model':<6} {'error':>9} {'limit':>9} {'calls':>7}  ok"]
        for i, v in enumerate(self.visits):
            problems = v.problems(self.node)
            lines.append(f"{i + 1:<6} {v.model:<6} {v.error:>9.2e} {v.limit:>9.2e} "
                         f"{v.engine_calls:>3}/{v.plain_calls:<3}  " + ("ok" if not problems else
                                                                        "FAIL: " + "; ".join(problems)))
        return "\n".join(lines + [f"   note: {n}" for n in self.notes])


def run_pair(name: str, size: str = "full", device: str = "cuda") -> PairReport:
    """The visits of `name` (PAIRS) in this process, each model built once by the suite's harness (its file loaded
    by ComfyUI's loader at full size) and kept while the next runs, as ComfyUI keeps a loaded model."""
    faulthandler.enable()
    node = PAIRS[name]
    report = PairReport(name, node, notes=[sequences.set_up(device)])
    run = sequences.Run("7 steps", 7)
    harnesses: dict[str, sequences.Harness] = {}
    accelerated: dict[str, object] = {}
    first: dict[str, torch.Tensor] = {}
    try:
        for i, model in enumerate(MODELS):
            print(f"{name}: visit {i + 1}, {model}, {'node and plain' if node else 'plain'}", flush=True)
            h = harnesses.get(model)
            if h is None:
                h = harnesses[model] = sequences.Harness(model, size, device)
                h.prepare()
            plain = h.sample(h.model, run)[0]
            if not node:
                error = H.rel(plain, first.setdefault(model, plain))
                report.visits.append(Visit(model, error, h.limit(False), bool(torch.isfinite(plain).all())))
                continue
            if model not in accelerated:
                accelerated[model] = h.node(h.model)
            acc = accelerated[model]
            status = h._status(acc)
            before = (status.engine_calls, status.plain_calls)
            out = h.sample(acc, run)[0]
            report.visits.append(Visit(model, H.rel(out, plain), h.limit(False), bool(torch.isfinite(out).all()),
                                       status.engine_calls - before[0], status.plain_calls - before[1]))
            report.notes += [m for m in status.messages if m not in report.notes]
    except Exception as e:  # a visit that raises ends the check: say which
        report.notes.append(f"stopped at visit {len(report.visits) + 1}: {sequences.said(e)}")
    accelerated.clear()
    for h in harnesses.values():
        h.model = None
    gc.collect()
    return report
