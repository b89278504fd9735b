"""The Accelerated UNet node stacked with ComfyUI's own tools on the GPU (issue 55): `tests/gpu/run stack-sd15`,
`stack-sd15-tools`, `stack-flux-dev`, `stack-sd15-compile`, `stack-flux-dev-compile`, `stack-flux-dev-flags`,
`stack-flux-dev-controlnet`, `stack-sd35-medium`, `stack-sdxl-multigpu` (MODES; `stack`: the first three;
tests/gpu/README.md has their GPU times).
tests/test_comfyui_stacking.py pins the same stacks down on the CPU; here they run full size, each in the host's own
sampler with the model loaded from its file by ComfyUI's loader (tests/gpu/sequences.py's Harness, its yardstick and
limits).

Each stack is a 20-step run of plain ComfyUI with the stack against the node with the same stack, the host node
applied before and after the Accelerated UNet node:

- EasyCache and LazyCache (comfy_extras/nodes_easycache.py, their default widgets): the latents within the suite's
  limit, the steps the cache skipped the same in every run of both sides (its own summary line, logged), and every
  step it ran through the engine;
- ModelSamplingFlux / ModelSamplingSD3 (their defaults, the image's size): the engine serves every call at the shifted
  sigmas;
- ControlNet (SD1.5 and Flux): a seeded ControlNet of the model's layout (Flux's: XLabs', an image hint and 2 double
  blocks) written to a file, loaded by comfy.controlnet and applied by ControlNetApplyAdvanced, as a workflow does;
  the residuals reach the engine;
- TorchCompileModel (inductor): the node steps aside (its serving wrapper left out of the run, so that the compiled
  forward is plain's own), says so once, and the image is plain's with the same compile (one order: both nest the same
  way, and each compile takes minutes);
- `--fast fp16_accumulation` and `--use-sage-attention`: ComfyUI reads them when its modules are imported, so each runs
  in a process of its own with the flag set in ComfyUI's cli_args before those imports (under DynamicVRAM with
  comfy-aimdo loaded first, as tests/gpu/run does), loading the same model file. Its limit takes plain's own move
  under the flag into the yardstick (yardstick + how far plain with the flag lies from plain without). Where the flag
  cannot take (no CUDA, a torch without fp16 accumulation, no `sageattention` package: ComfyUI would exit at its
  start), the stack says so in one line and is skipped, never failed.
- MultiGPU CFG Split (ComfyUI 0.33's comfy_extras/nodes_multigpu.py, max_gpus 2; SDXL 1024 at CFG 7, so that each step
  has a cond and an uncond to split; a machine with 2 GPUs): plain ComfyUI with the split, as a user stacks it, against
  the node with its own split (gpus 2: the engine on each GPU, cond on one and uncond on the other), its latents
  within the limit of both plain's with the split and plain's without, every call spread; then the node (gpus 1)
  with the split before and after it, where it steps aside (the split's threads call each GPU's own copy at once),
  says so once, and the latents are plain's with the split. The split's own move (plain with it against plain
  without: cond and uncond run apart) joins the yardstick, as a flag's does. The timed pair is the node with gpus 2
  against plain with the split, plain alone run third in each round for context; the step-aside rows are one run of
  each side (they run ComfyUI's forward, as plain does). Where ComfyUI has no such node or fewer than 2 GPUs are
  visible, the mode says so in one line before any model is built.

Then both sides' warm runs of the stack are timed as timing.py does (interleaved, each side's median and range, the
ratio of the medians, GPU busy). `size="tiny"` runs the same on tiny models on the CPU (tests/test_gpu_sequences.py):
there a second CPU device index stands for the split's second GPU (as in tests/test_comfyui_stacking.py) and the node's
gpus 2 spreads over two CPU processes (as in tests/gpu/gpus.py).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import comfy_helpers as H
import gpus
import sequences
import timing

ORDERS = ("before", "after")  # the host node before or after the Accelerated UNet node in the workflow
PRECISION = {"flux-dev": "fp8", "sd35-medium": "fp8"}  # the node's precision widget, by model; "auto" for the others
FLAGS = {"--fast fp16_accumulation": "fp16_accumulation", "--use-sage-attention": "sage"}


@dataclass(frozen=True)
class Stack:
    name: str
    kind: str  # "model": a node from MODEL to MODEL; "controlnet": on the conditioning; "flag": a ComfyUI cli flag
    module: str = ""  # the node's comfy_extras module
    node: str = ""  # and class
    orders: tuple[str, ...] = ORDERS
    aside: str = ""  # the node is to step aside (ComfyUI's forward serves every call), saying these words once
    cache: bool = False  # a step cache: its skipped steps are compared


def _cache_inputs(h: sequences.Harness) -> dict:
    """EasyCache's and LazyCache's widgets: ComfyUI's defaults; on tiny models, which change little from step to step
    over few steps, a threshold that makes them skip."""
    if h.size == "tiny":
        return dict(reuse_threshold=0.5, start_percent=0.0, end_percent=1.0, verbose=False)
    return dict(reuse_threshold=0.2, start_percent=0.15, end_percent=0.95, verbose=False)


STACKS = {s.name: s for s in (
    Stack("EasyCache", "model", "nodes_easycache", "EasyCacheNode", cache=True),
    Stack("LazyCache", "model", "nodes_easycache", "LazyCacheNode", cache=True),
    Stack("ModelSamplingFlux", "model", "nodes_model_advanced", "ModelSamplingFlux"),
    Stack("ModelSamplingSD3", "model", "nodes_model_advanced", "ModelSamplingSD3"),
    Stack("ControlNet", "controlnet", orders=("-",)),
    Stack("TorchCompileModel", "model", "nodes_torch_compile", "TorchCompileModel", orders=("after",),
          aside="TorchCompileModel compiles this model"),
    Stack("MultiGPUCFGSplit", "multigpu", "nodes_multigpu", "MultiGPUCFGSplitNode",
          aside="MultiGPU CFG Split (MultiGPU_WorkUnits) runs each step's calls on several GPUs"),
    *(Stack(flag, "flag", orders=("-",)) for flag in FLAGS),
)}
INPUTS: dict[str, Callable[[sequences.Harness], dict]] = {
    "EasyCache": _cache_inputs, "LazyCache": _cache_inputs,
    "ModelSamplingFlux": lambda h: dict(max_shift=1.15, base_shift=0.5, width=h.base[0], height=h.base[1]),
    "ModelSamplingSD3": lambda h: dict(shift=3.0),
    "TorchCompileModel": lambda h: dict(backend="inductor"),
    "MultiGPUCFGSplit": lambda h: dict(max_gpus=2),
}
# the modes of tests/gpu/run: (model, stacks); each fits a 10-minute call on an H200 by the suite's step times
MODES = {
    "stack-sd15": ("sd15", ("EasyCache", "LazyCache", "ControlNet")),
    "stack-sd15-tools": ("sd15", ("TorchCompileModel", *FLAGS)),
    "stack-sd15-compile": ("sd15", ("TorchCompileModel",)),  # the -tools mode's first stack alone
    "stack-flux-dev": ("flux-dev", ("EasyCache", "LazyCache", "ModelSamplingFlux")),
    "stack-flux-dev-compile": ("flux-dev", ("TorchCompileModel",)),
    "stack-flux-dev-flags": ("flux-dev", tuple(FLAGS)),
    "stack-flux-dev-controlnet": ("flux-dev", ("ControlNet",)),
    "stack-sd35-medium": ("sd35-medium", ("EasyCache", "ModelSamplingSD3")),
    "stack-sdxl-multigpu": ("sdxl", ("MultiGPUCFGSplit",)),  # ComfyUI 0.33 and 2 GPUs
}
STACK = ("stack-sd15", "stack-sd15-tools", "stack-flux-dev")  # `tests/gpu/run stack`


def steps(size: str) -> int:
    return 20 if size == "full" else 8


@dataclass
class StackRow:
    order: str  # "before", "after": the host node before or after the node; "-": not a model node
    error: float  # relative L2 of the node's latents from plain ComfyUI's, both with the stack
    limit: float
    finite: bool
    steps: int
    engine_calls: int  # the compared run's calls the engine served
    plain_calls: int  # and those the node left to ComfyUI's forward
    seconds: float = 0.0  # the node's first run with the stack (the timed: the median of its warm runs)
    plain_seconds: float = 0.0
    aside: bool = False  # the node is to step aside, saying so once
    said: int = 0  # how often the node's message that it steps aside was logged over its runs
    skipped: tuple[int, ...] = ()  # a cache's skipped steps in each of the node's runs (the compared, then the timed)
    plain_skipped: tuple[int, ...] = ()  # and in plain's
    flag_on: bool | None = None  # a cli flag: whether ComfyUI put it in effect
    cuda: bool = True
    timed: timing.Timed | None = None
    vs_plain: float | None = None  # the node's own split: its latents' distance from plain's without any split
    devices: int | None = None  # a split over devices: how many the run had (the split's copies, the node's workers)
    spread_calls: int | None = None  # the node's own split: its calls spread over its devices

    def problems(self) -> list[str]:
        bad = [] if self.finite else ["NaN/inf in the latents"]
        if self.error > self.limit:
            bad.append(f"latents {self.error:.2e} from plain's, over {self.limit:.2e}")
        if self.vs_plain is not None and not self.vs_plain <= self.limit:
            bad.append(f"latents {self.vs_plain:.2e} from plain's without the split, over {self.limit:.2e}")
        if self.devices is not None and self.devices < 2:
            bad.append(f"the run had {self.devices} device(s), not 2: nothing was split")
        if self.spread_calls is not None and self.spread_calls != self.engine_calls:
            bad.append(f"the node spread {self.spread_calls} of its {self.engine_calls} calls over its devices")
        calls = self.engine_calls + self.plain_calls
        if self.aside and self.devices is not None and calls != self.devices * self.steps:
            # CFG's cond and uncond: one call a step on each device where the split runs them apart
            bad.append(f"{calls} calls for {self.steps} steps on {self.devices} devices: cond and uncond were not "
                       "run apart")
        if self.aside:
            if self.engine_calls:
                bad.append(f"the engine served {self.engine_calls} calls it was to leave to ComfyUI's forward")
            if self.said != 1:
                bad.append(f"the node said it steps aside {self.said} times, not once")
        elif self.plain_calls or not self.engine_calls:
            bad.append(f"calls engine/ComfyUI's forward {self.engine_calls}/{self.plain_calls}, not all the engine")
        if self.plain_skipped or self.skipped:
            if len(set(self.skipped + self.plain_skipped)) != 1:
                bad.append(f"skipped steps differ: node {list(self.skipped)}, plain {list(self.plain_skipped)}")
            elif self.engine_calls + self.plain_calls != self.steps - self.skipped[0]:
                bad.append(f"{self.engine_calls + self.plain_calls} calls for {self.steps - self.skipped[0]} steps run")
        if self.flag_on is False and self.cuda:
            bad.append("ComfyUI did not put the flag in effect")
        return bad

    @property
    def ok(self) -> bool:
        return not self.problems()

    def line(self) -> str:
        skipped = f"{self.skipped[0]}/{self.plain_skipped[0]}" if self.skipped and self.plain_skipped else "-"
        # a ratio only of interleaved medians (issue 58): a row of one run each shows none
        ratio = f"{self.plain_seconds / self.seconds:>6.2f}x" if self.timed and self.seconds > 0 else f"{'-':>7}"
        return (f"{self.order:<7} {self.error:>9.2e} {self.limit:>9.2e} {skipped:>7} {self.seconds:>7.3f} "
                f"{self.plain_seconds:>7.3f} {ratio} {self.engine_calls:>3}/{self.plain_calls:<3}  "
                + ("ok" if self.ok else "FAIL: " + "; ".join(self.problems())))

    def lines(self) -> list[str]:
        return [self.line()] + [f"   {t}" for t in (self.timed.lines() if self.timed else [])]


@dataclass
class StackReport:
    model: str
    stack: str
    setting: str  # the node's precision
    yardstick: float = 0.0
    rows: list[StackRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str = ""  # why the stack did not run here
    effect: float | None = None  # a ControlNet's: how far plain's image with it lies from plain's without
    raised: str = ""  # the exception that stopped the stack before it compared anything

    def failures(self) -> list[str]:
        bad = [f"{self.model} + {self.stack}: raised {self.raised}"] if self.raised else []
        bad += [f"{self.model} + {self.stack} ({r.order}): {p}" for r in self.rows for p in r.problems()]
        if self.effect is not None and self.effect <= 1e-3:
            bad.append(f"{self.model} + {self.stack}: it changed plain's image by {self.effect:.1e}: nothing compared")
        return bad

    def table(self) -> str:
        if self.skipped:
            return f"== {self.model} + {self.stack}: skipped: {self.skipped}"
        if self.raised:
            return "\n".join([f"== {self.model} + {self.stack}: FAIL: raised {self.raised}"]
                              + [f"   note: {n}" for n in self.notes])
        effect = "" if self.effect is None else f"; its effect on plain {self.effect:.2e}"
        head = (f"== {self.model} + {self.stack}: node {self.setting}, {self.rows[0].steps if self.rows else 0} "
                f"steps, node+stack vs plain+stack; yardstick {self.yardstick:.2e}{effect}")
        columns = (f"{'order':<7} {'vs plain':>9} {'limit':>9} {'skipped':>7} {'node s':>7} {'plain s':>7} "
                   f"{'ratio':>7} {'calls':>7}  ok")
        legend = ("   order: the stack's node before or after the Accelerated UNet node; skipped: the cache's skipped "
                  "steps, node/plain; node s, plain s: the medians of interleaved warm runs of each (as many as the "
                  "timed line says), their ranges under the row (a row without: one run each); calls: the engine's / "
                  "ComfyUI's forward's")
        if any(r.spread_calls is not None for r in self.rows):
            legend += ("\n   gpus 2: the node alone with its own split over 2 GPUs, against plain with the stack; "
                       "its distance from plain's without the stack: "
                       + ", ".join(f"{r.vs_plain:.2e}" for r in self.rows if r.vs_plain is not None)
                       + "; calls spread over its devices: "
                       + ", ".join(f"{r.spread_calls}/{r.engine_calls} over {r.devices}" for r in self.rows
                                   if r.spread_calls is not None))
        return "\n".join([head, columns] + [line for r in self.rows for line in r.lines()] + [legend]
                         + [f"   note: {n}" for n in self.notes])

    def record(self) -> dict:
        import dataclasses

        return dataclasses.asdict(self)


def skipped_steps(messages: list[str], cache: str) -> list[int]:
    """The steps `cache` says it skipped, one entry per sampling run (its own summary line)."""
    return [int(m.group(1)) for text in messages for m in [re.search(rf"{cache} - skipped (\d+)/", text)] if m]


def _status(model):
    from sd_accel.nodes import accelerated_unet

    return accelerated_unet.session_of(model).slot.status


# ----------------------------------------------------------------------------------------------- one stack


class Stacker:
    """One model's stacks: the Harness's model, yardstick and runs, and the node with each stack against plain."""

    def __init__(self, h: sequences.Harness) -> None:
        self.h = h
        self.precision = PRECISION.get(h.name, "auto")
        self.fp8 = self.precision == "fp8"
        self.run = sequences.Run(f"{steps(h.size)} steps", steps(h.size))
        self.cuda = h.device.type == "cuda"

    def stack(self, name: str) -> StackReport:
        stack = STACKS[name]
        report = StackReport(self.h.name, name, self.precision, self.h.report.yardstick)
        if stack.kind == "flag":
            return self.flag(stack, report)
        if stack.kind == "multigpu":
            return self.multigpu(stack, report)
        if stack.kind == "controlnet":
            if not (self.h.unet or self.h.cls == "Flux"):
                report.skipped = "the ControlNet stack has SD1.5's and Flux's ControlNets"
                return report
            conditioning = self.controlnet_conditioning()
            ref = self.compare(report, stack, "-", lambda m: m, self.h.node(self.h.model, self.precision), conditioning)
            report.effect = H.rel(ref, self.h.plain(self.run)[0])  # the ControlNet must change the image
            return report
        cls, why = H.host_node(stack.module, stack.node)
        if cls is None:
            report.skipped = why
            return report
        inputs = INPUTS[name](self.h)

        def host(m):
            return H.run_node(cls, m, **inputs)

        for order in stack.orders:
            node = self.h.node(host(self.h.model) if order == "before" else self.h.model, self.precision)
            self.compare(report, stack, order, host, host(node) if order == "after" else node)
            del node
            gc.collect()
        return report

    def compare(self, report: StackReport, stack: Stack, order: str, host, node, conditioning=None,
                timed: bool = True, devices: int | None = None) -> torch.Tensor:
        """The node's output `node` (the stack in it) against plain ComfyUI with host(model): the compared run, then
        both timed (not timed: one more run of the node, which must not say again what it said). devices: the devices
        a split gave the run. Returns plain's latents."""
        h, run = self.h, self.run
        plain = host(h.model)
        said = sequences.Said()
        status = _status(node)
        with said.on():
            ref, plain_seconds = h.sample(plain, run, conditioning=conditioning)
            plain_skipped = skipped_steps(said.take(), stack.name)
            before = (status.engine_calls, status.plain_calls)
            out, seconds = h.sample(node, run, conditioning=conditioning)
            calls = (status.engine_calls - before[0], status.plain_calls - before[1])
            node_messages = said.take()
            skipped = skipped_steps(node_messages, stack.name)
            timed_node, timed_plain = [], []

            def side(model, into: list):
                def go() -> float:
                    seconds = h.sample(model, run, conditioning=conditioning)[1]
                    into.extend(said.take())
                    return seconds
                return go

            said.take()
            pair = timing.measure(side(node, timed_node), side(plain, timed_plain), gpu=self.cuda) if timed else None
            if pair:
                seconds, plain_seconds = pair.node.median, pair.plain.median
            else:
                side(node, timed_node)()
        report.rows.append(StackRow(
            order, H.rel(out, ref), self.h.limit(self.fp8), bool(torch.isfinite(out).all()), run.steps, *calls,
            seconds, plain_seconds, bool(stack.aside),
            sum(bool(stack.aside) and stack.aside in m for m in node_messages + timed_node),
            tuple(skipped + skipped_steps(timed_node, stack.name)) if stack.cache else (),
            tuple(plain_skipped + skipped_steps(timed_plain, stack.name)) if stack.cache else (),
            cuda=self.cuda, timed=pair, devices=devices))
        print(f"{h.name} + {stack.name}: " + "\n   ".join(report.rows[-1].lines()), flush=True)
        report.notes += [m for m in status.messages if m not in report.notes]
        if stack.cache and not any(plain_skipped):
            report.notes.append(f"{stack.name} skipped no step of plain's run: its bookkeeping alone was compared")
        return ref

    # ------------------------------------------------------------------------------------ a split over GPUs

    def multigpu(self, stack: Stack, report: StackReport) -> StackReport:
        """ComfyUI's MultiGPU CFG Split: plain ComfyUI with it against the node's own split (gpus 2), then the node
        (gpus 1) with it before and after, where the node steps aside. The split's own move joins the yardstick."""
        h, run = self.h, self.run
        cls, _ = H.host_node(stack.module, stack.node)
        inputs = INPUTS[stack.name](h)
        stale = []

        def split(m):
            stale.append(forget_collected())
            return H.run_node(cls, m, **inputs)

        def devices(m) -> int:
            return 1 + len(m.get_additional_models_with_key("multigpu"))

        unsplit = h.plain(run)[0]
        yardstick = h.report.yardstick
        with self.second_device():
            plain = split(h.model)
            ref = h.sample(plain, run)[0]
            moved = H.rel(ref, unsplit)
            h.report.yardstick = report.yardstick = yardstick + moved
            report.notes.append(f"yardstick with the split: the run's {yardstick:.2e} + plain's move under the split "
                                f"{moved:.2e} (cond and uncond apart); plain with the split ran on {devices(plain)} "
                                "device(s)")
            try:
                self.own_split(report, plain, ref, unsplit)
                for order in stack.orders:
                    node = h.node(split(h.model)) if order == "before" else split(h.node(h.model))
                    self.compare(report, stack, order, split, node, timed=False, devices=devices(node))
                    del node
                    gc.collect()
            finally:
                h.report.yardstick = yardstick
        if any(stale):
            report.notes.append(f"{sum(stale)} loaded-model entries whose patchers were collected were dropped before "
                                "the split (forget_collected)")
        return report

    def own_split(self, report: StackReport, plain, ref: torch.Tensor, unsplit: torch.Tensor) -> None:
        """The node with gpus 2 against plain ComfyUI with the core's split (`plain`, its latents `ref`), and against
        plain's latents without it (`unsplit`); then both timed, plain alone run third in each round."""
        from sd_accel.nodes import accelerated_unet

        h, run = self.h, self.run
        node = gpus.spread_node(h, "2")
        session = accelerated_unet.session_of(node)
        out, seconds = h.sample(node, run)
        engine, plain_calls, spread_calls = session.run_calls()

        def side(model):
            return lambda: h.sample(model, run)[1]

        pair = timing.measure(side(node), side(plain), gpu=self.cuda, beside=("plain alone (no split)", side(h.model)))
        report.rows.append(StackRow(
            "gpus 2", H.rel(out, ref), h.limit(self.fp8), bool(torch.isfinite(out).all()), run.steps, engine,
            plain_calls, pair.node.median, pair.plain.median, cuda=self.cuda, timed=pair, vs_plain=H.rel(out, unsplit),
            devices=session.slot.status.devices, spread_calls=spread_calls))
        print(f"{h.name} + {report.stack}: " + "\n   ".join(report.rows[-1].lines()), flush=True)
        report.notes += [m for m in session.slot.status.messages if m not in report.notes]

    @contextlib.contextmanager
    def second_device(self):
        """Within: on the CPU a second CPU device index stands for the split's second GPU (comfy.model_management's
        device list, as tests/test_comfyui_stacking.py has it), and a tiny model, built here rather than loaded from a
        file, gets the way to load it again that ComfyUI's loaders register (the split loads a copy for the other
        device)."""
        import comfy.model_management as mm

        if self.h.size == "tiny":
            self.h.model.cached_patcher_init = (self.h.build, (self.h.dtype,))
        own = mm.get_all_torch_devices
        if not self.cuda:
            mm.get_all_torch_devices = lambda exclude_current=False: [self.h.model.load_device, torch.device("cpu", 1)]
        try:
            yield
        finally:
            mm.get_all_torch_devices = own

    def controlnet_conditioning(self):
        """The Harness's conditioning with a seeded ControlNet of the model's layout, written to a file, loaded by
        comfy.controlnet.load_controlnet (as ControlNetLoader loads it) and applied by ControlNetApplyAdvanced."""
        import comfy.controlnet
        import safetensors.torch

        weights, detected = self._controlnet()
        path = Path(H.temporary_folder("sd-accel-gpu-controlnet-")) / "controlnet.safetensors"
        safetensors.torch.save_file({k: (v.to(self.h.dtype) if v.is_floating_point() else v).detach().contiguous()
                                     for k, v in weights.items()}, str(path))
        del weights
        with detected:
            net = comfy.controlnet.load_controlnet(str(path))
        w, h = self.h.base
        hint = torch.rand(1, h, w, 3, generator=torch.Generator().manual_seed(4))  # an IMAGE: batch, height, width, RGB
        if "nodes" not in sys.modules:
            H.comfy_nodes()
        apply = sys.modules["nodes"].ControlNetApplyAdvanced()
        pos, neg = self.h.conditioning
        return apply.apply_controlnet(pos, neg, net, hint, 0.8, 0.0, 1.0)

    def _controlnet(self) -> tuple[dict[str, torch.Tensor], contextlib.AbstractContextManager]:
        """(a seeded ControlNet's weights as its published files name them, the context in which ComfyUI's loader
        reads the file). SD1.5's: the UNet's encoder; Flux's: XLabs' layout (image hint), the model's blocks, 2 double
        and no single ones, its output projections quiet as the DiTs' residual projections are (trained ControlNets
        start them at zero), its q/k norms' weights named `scale` (ComfyUI 0.33's own modules call them `weight`, and
        its loader knows an XLabs file by the published name). A tiny file's widths are no published model's:
        ComfyUI's detection is given them, its loader does the rest."""
        import comfy.ops

        from sd_accel.accel.models import configs

        tiny = self.h.size == "tiny"
        if self.h.unet:
            import comfy.cldm.cldm

            unet_only = ("out_channels", "transformer_depth_output", "use_temporal_attention", "use_temporal_resblock")
            config = {k: v for k, v in configs.LDM_UNET_CONFIGS[self.h.config].items() if k not in unet_only}
            with H.layers_with_weights():  # to be seeded here, not filled by DynamicVRAM's loader
                control = comfy.cldm.cldm.ControlNet(hint_channels=3, operations=comfy.ops.disable_weight_init,
                                                     **config)
            configs.seed_parameters(control, 61)
            detected = (H.detected_as("SD15", configs.LDM_UNET_CONFIGS[self.h.config], {"context_dim": 768}) if tiny
                        else contextlib.nullcontext())
            return control.state_dict(), detected
        import comfy.ldm.flux.controlnet

        config = {**configs.comfy_dit_config(self.h.config)[1], "depth_single_blocks": 0}
        config["depth"] = min(config["depth"], 2)
        with H.layers_with_weights():
            control = comfy.ldm.flux.controlnet.ControlNetFlux(operations=comfy.ops.disable_weight_init, **config)
        configs.seed_dit_parameters(control, 61)
        with torch.no_grad():
            for block in control.controlnet_blocks:
                block.weight.mul_(0.1)
        weights = {re.sub(r"(_norm)\.weight$", r"\1.scale", k): v for k, v in control.state_dict().items()}
        return weights, H.detected_as("Flux", config) if tiny else contextlib.nullcontext()

    # -------------------------------------------------------------------------------------------- cli flags

    def flag(self, stack: Stack, report: StackReport) -> StackReport:
        import comfy.model_management as mm

        ref = self.h.plain(self.run)[0]  # plain without the flag: how far the flag moves plain's own run
        folder = Path(tempfile.mkdtemp(prefix="sd-accel-gpu-flag-"))
        try:
            torch.save(ref, folder / "plain.pt")
            args = dict(model=self.h.name, size=self.h.size, device=str(self.h.device), flag=stack.name,
                        yardstick=self.h.report.yardstick, fp8_yardstick=self.h.report.fp8_yardstick,
                        file=str(self.h.model_file() or ""), plain=str(folder / "plain.pt"),
                        out=str(folder / "report.pickle"), aimdo="comfy_aimdo.control" in sys.modules)
            mm.unload_all_models()  # the flagged process loads its own copy
            if self.cuda:
                torch.cuda.empty_cache()
            code = subprocess.call([sys.executable, "-c", CHILD, json.dumps(args)], cwd=H.REPO, env=_child_env())
            if code != 0 or not (folder / "report.pickle").exists():
                report.rows.append(StackRow("-", float("inf"), 0.0, False, self.run.steps, 0, 0, cuda=self.cuda))
                report.notes.append(f"the process with {stack.name} ended with exit status {code}")
                return report
            return pickle.loads((folder / "report.pickle").read_bytes())
        finally:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)


def forget_collected() -> int:
    """Drop ComfyUI's loaded-model entries whose patcher has been collected while its model lives on (the loader's
    patcher holds it); returns how many. A patcher collected by the cycle collector takes its parent with it, so the
    entry cannot fall back to the parent and keeps None (ComfyUI calls it dead, a leak); 0.33's MultiGPU CFG Split
    then fails on it (create_multigpu_deepclones reads `.model` of every loaded_models() entry: AttributeError). The
    split's patcher and its copies for the other GPUs refer to each other, so any clone around the split, plain
    ComfyUI's `clone()` as much as the node's, is collected with its parent once dropped (checked on the CPU in 0.33:
    the next split then raises); the stack drops outputs between its orders, and the split's own test
    (tests/test_comfyui_stacking.py) unloads every model first."""
    import comfy.model_management as mm

    gc.collect()
    live = [m for m in mm.current_loaded_models if m.model is not None]
    dropped = len(mm.current_loaded_models) - len(live)
    mm.current_loaded_models[:] = live
    return dropped


def unavailable(name: str, device: torch.device) -> str | None:
    """Why the stack `name` cannot run here (it is then skipped, before the model is built), or None: a cli flag that
    cannot take, or a split over GPUs without its node or a second GPU (on the CPU the tiny run's stand-ins serve)."""
    stack = STACKS[name]
    if stack.kind == "multigpu":
        found, why = H.host_node(stack.module, stack.node)
        if found is None:
            return why
        count = torch.cuda.device_count() if device.type == "cuda" else 2
        return None if count >= 2 else f"needs 2 GPUs; {count} visible"
    if stack.kind != "flag":
        return None
    flag = name
    if device.type != "cuda":
        return f"needs a CUDA GPU (ComfyUI sets {flag} up on GPUs only)"
    if FLAGS[flag] == "fp16_accumulation" and not hasattr(torch.backends.cuda.matmul, "allow_fp16_accumulation"):
        return f"torch {torch.__version__} has no fp16 accumulation (torch.backends.cuda.matmul)"
    if FLAGS[flag] == "sage" and importlib.util.find_spec("sageattention") is None:
        return "the sageattention package is not installed (ComfyUI would exit at start-up with the flag)"
    return None


def _child_env() -> dict:
    here = Path(__file__).resolve().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here), str(here.parent), env.get("PYTHONPATH")]))
    return env


# The flagged process: comfy-aimdo before torch where the parent runs under DynamicVRAM (as tests/gpu/run starts it)
CHILD = """import json, sys
args = json.loads(sys.argv[1])
if args["aimdo"]:
    import comfy_aimdo.control
    comfy_aimdo.control.init(simple_vram_headroom=None, nvml_pressure=True)
import stacking
stacking.flagged(args)
"""


def set_flag(flag: str) -> None:
    """`flag` in ComfyUI's parsed command line, before its modules read it (call after import_comfy, before
    comfy.model_management is imported)."""
    import comfy.cli_args as cli

    if "comfy.model_management" in sys.modules:
        raise RuntimeError(f"{flag}: comfy.model_management was imported before the flag was set")
    if FLAGS[flag] == "fp16_accumulation":
        cli.args.fast = set(cli.args.fast or ()) | {cli.PerformanceFeature.Fp16Accumulation}
    else:
        cli.args.use_sage_attention = True


def flag_on(flag: str) -> bool:
    if FLAGS[flag] == "fp16_accumulation":
        return bool(getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", False))
    import comfy.ldm.modules.attention as attention

    return getattr(attention.optimized_attention, "__name__", "") == "attention_sage"


def fell_back(messages: list[str]) -> list[str]:
    """ComfyUI's lines saying that sage attention raised for a call and PyTorch's attention ran it instead (sage 1.x
    takes head sizes 64, 96 and 128 only: SD1.5's 40, 80 and 160 fall back at every call)."""
    return [m for m in messages if m.startswith("Error running sage attention")]


def flagged(args: dict) -> None:
    """The flagged process's stack: ComfyUI set up with the flag, the model loaded from the parent's file (tiny: made
    with the same seeds), plain with the flag against the node with it; its report pickled to args["out"]."""
    H.import_comfy()
    set_flag(args["flag"])
    if torch.device(args["device"]).type == "cuda":
        H.set_up_like_main()
    h = sequences.Harness(args["model"], args["size"], args["device"])
    if args["file"]:
        h.reuse_file(Path(args["file"]))
    h.report.fp8_yardstick = args["fp8_yardstick"]
    h.model = h.build(h.dtype)
    s = Stacker(h)
    ref = torch.load(args["plain"])
    with sequences.Said().on() as said:
        moved = H.rel(h.plain(s.run)[0], ref)
    refused = fell_back(said.messages)
    if refused:
        report = StackReport(h.name, args["flag"], s.precision, skipped=(
            f"ComfyUI's sage attention refused {len(refused)} of plain's attention calls ({refused[0]}): ComfyUI ran "
            "PyTorch's attention after an error at each, so nothing of sage would be measured"))
        Path(args["out"]).write_bytes(pickle.dumps(report))
        return
    h.report.yardstick = args["yardstick"] + moved
    report = StackReport(h.name, args["flag"], s.precision, h.report.yardstick)
    report.notes.append(f"yardstick with the flag: the run's {args['yardstick']:.2e} + plain's move under the flag "
                        f"{moved:.2e}")
    s.compare(report, STACKS[args["flag"]], "-", lambda m: m, h.node(h.model, s.precision))
    report.rows[-1].flag_on = flag_on(args["flag"])
    if not report.rows[-1].flag_on:
        report.notes.append("the flag is not in effect here (ComfyUI sets it up on NVIDIA and AMD GPUs)")
    Path(args["out"]).write_bytes(pickle.dumps(report))


# ------------------------------------------------------------------------------------------------ a mode


def shared_file(name: str, size: str) -> Path | None:
    """Where the modes of one `tests/gpu/run` call keep `name`'s 16-bit file for the next one: its
    SD_ACCEL_GPU_SHARED folder, removed when the call ends (under DynamicVRAM each mode runs in a process of its own,
    so a folder, not the process, has to hold it); None where no such folder is given."""
    folder = os.environ.get("SD_ACCEL_GPU_SHARED", "")
    return Path(folder) / f"{name}-{size}.safetensors" if folder else None


def run_mode(mode: str, size: str = "full", device: str = "cuda") -> list[StackReport]:
    """The stacks of `mode` (MODES) on its model: the model and yardstick as the suite's sequences make them, then
    each stack against plain with the same stack. Modes of one model in one call (`tests/gpu/run
    stack-flux-dev,stack-flux-dev-controlnet`) load the file the first one wrote (the same seed, the same weights;
    shared_file): a full-size model is seeded and written once, and the disk holds one copy."""
    name, stacks = MODES[mode]
    note = sequences.set_up(device)
    h = sequences.Harness(name, size, device)
    shared = shared_file(name, size)
    if shared is not None and shared.is_file():
        h.reuse_file(shared)
    s = Stacker(h)
    skipped = []
    for stack in stacks:
        why = unavailable(stack, h.device)
        if why:
            skipped.append(StackReport(name, stack, s.precision, skipped=why, notes=[note]))
            print(f"{name} + {stack}: skipped: {why}", flush=True)
    stacks = [n for n in stacks if n not in {r.stack for r in skipped}]
    if not stacks or not h.prepare(s.fp8):
        return skipped
    if shared is not None and not shared.exists() and (path := h.model_file()) is not None:
        try:  # a second name for the file, which outlives this process's folder and takes no more disk
            os.link(path, shared)
        except OSError as e:
            print(f"{name}: a later mode writes its file again: cannot link it into {shared.parent} ({e})", flush=True)
    reports = skipped
    # the flags last: their processes load the model again beside this one, which is unloaded for them
    for stack in sorted(stacks, key=lambda n: STACKS[n].kind == "flag"):
        try:
            reports.append(s.stack(stack))
        except Exception as e:  # one broken stack is its failure, and the others still run
            reports.append(StackReport(name, stack, s.precision, h.report.yardstick, raised=sequences.said(e)))
        reports[-1].notes.insert(0, note)
    h.model = None
    gc.collect()
    return reports
