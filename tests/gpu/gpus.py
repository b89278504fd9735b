"""The node's gpus option on full-size Wan 2.1 14B inside ComfyUI's own classes and sampler (`tests/gpu/run
wan21-14b-gpus`, for a machine with 4 GPUs; with fewer the node runs on what there is and says so): a 20-step
text-to-video run at 832x480, 81 frames (21 latent frames), CFG 5, bf16, seeded well-conditioned weights, with the
Accelerated UNet node on 1 GPU and then with gpus 2 and 4, each spread run twice (the second: its workers up, its
graphs captured); each run's seconds (a spread run's first start of its workers, with the weights sent, shown apart)
and its relative distance from the 1-GPU latents. The node on 1 GPU and plain ComfyUI are timed against each other as
tests/gpu/timing.py says (interleaved warm runs, medians, GPU busy) in seconds per step, over runs of TIMED_STEPS
steps: Wan 2.1 14B's over 1 step (a step takes seconds, so a run's own overhead is small beside it, and 5 runs of each
side at 5 steps would take 5 of the check's 10 minutes).

The limit is bf16 noise measured on this very run: how far the 1-GPU run moves when its starting noise changes by one
bf16 rounding (each value times 1 + 2^-8 r, r ~ N(0, 1)); a spread run may lie 3 times that from the 1-GPU run. That
second 1-GPU run is also its warm timing (CUDA graphs captured). The suite's own yardstick, plain bf16 against fp32,
would take a 56 GB fp32 model and about a minute a step here.

flux-dev-gpus runs the same check on Flux.1-dev 1024 (20 steps, guidance 3.5 in its model, no CFG batch): each
step of a spread run is sequence parallel, and its CUDA graphs replay in pieces between the exchanges.
wan21-1.3b-gpus-fp8 runs Wan 2.1 1.3B's with the node's precision fp8 (fp8 attention kept under sequence parallelism),
and once more after ComfyUI unloads the model: the node's workers go with the model and a new pool starts, whose
ranks agree on the fp8 attention kernel afresh with ComfyUI's process, which outlived the last pool (it hung until the
deadline when that process kept the last pool's choice; that needs two fp8 attention kernels to choose between:
cudnn-frontend and fa3-fwd installed).

`size="tiny"` runs the same check on the tiny Wan on the CPU, its workers placed on the CPU by the engine-level hook
(accelerated_unet.use_devices), which is how the CPU tests keep this file honest.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

import comfy_helpers as H
import sequences
import timing


@dataclass(frozen=True)
class Check:
    model: str  # sequences.MODELS; the 1.3B Wan (its 17-frame clip) is the short first look
    precision: str = "auto"  # the node's precision widget
    unload: bool = False  # each spread node runs once more after ComfyUI unloads the model: a new pool of workers


CHECKS = {"wan21-14b-gpus": Check("wan21-14b"), "wan21-1.3b-gpus": Check("wan21-1.3b"),
          "flux-dev-gpus": Check("flux-dev"), "wan21-1.3b-gpus-fp8": Check("wan21-1.3b", "fp8", unload=True)}
STEPS = 20
TIMED_STEPS = {"wan21-14b": 1}  # steps of each timed run, by model; 5 for the others


@dataclass
class GpuRow:
    setting: str
    devices: int  # the devices the node used
    seconds: float  # the sampling run, wall clock
    start: float  # of which the workers' start and the weights going out (the run's first step)
    distance: float  # relative L2 from the 1-GPU latents
    limit: float
    finite: bool
    engine_calls: int
    spread_calls: int

    @property
    def ok(self) -> bool:
        spread = self.devices == 1 or self.spread_calls == self.engine_calls
        return self.finite and self.distance <= self.limit and self.engine_calls > 0 and spread

    def line(self) -> str:
        per_step = (self.seconds - self.start) / STEPS
        return (f"{self.setting:<24} {self.devices:>4} {self.seconds:>8.1f} {self.start:>7.1f} {per_step:>8.2f} "
                f"{self.distance:>9.2e} {self.limit:>9.2e} {self.engine_calls:>3}/{self.spread_calls:<3}  "
                f"{'ok' if self.ok else 'FAIL'}")


@dataclass
class GpuReport:
    name: str
    yardstick: float = 0.0
    timed: timing.Timed | None = None  # the node on 1 GPU against plain ComfyUI, seconds per step
    rows: list[GpuRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        return [r.setting for r in self.rows if not r.ok] + ([] if self.yardstick > 0 else ["the yardstick is 0"])

    def table(self) -> str:
        head = (f"== {self.name}: {STEPS} steps; yardstick (1 GPU, noise moved by one bf16 rounding) "
                f"{self.yardstick:.2e}")
        timed = [f"   {line}" for line in self.timed.lines()] if self.timed else []
        columns = (f"{'setting':<24} {'gpus':>4} {'run s':>8} {'start':>7} {'s/step':>8} {'vs 1 GPU':>9} "
                   f"{'limit':>9} {'calls/spread':>7}  ok")
        return "\n".join([head, *timed, columns] + [r.line() for r in self.rows]
                         + [f"   note: {n}" for n in self.notes])


def spread_node(h: sequences.Harness, gpus: str, precision: str = "auto"):
    """The node's output asked for `gpus` GPUs; on the CPU its calls spread over as many CPU processes."""
    from sd_accel.nodes import accelerated_unet

    out = h.node(h.model, precision=precision, gpus=gpus)
    if h.device.type != "cuda" and gpus != "1":  # CPU workers: slow to answer while CI's other pass shares the cores
        accelerated_unet.use_devices(out, ["cpu"] * int(gpus), timeout=180)
    return out


def _timed(h: sequences.Harness, node, run: sequences.Run) -> timing.Timed:
    """The node's output `node` against plain ComfyUI, both warm, in seconds per step of `run`."""
    return timing.measure(lambda: h.sample(node, run)[1], lambda: h.sample(h.model, run)[1],
                          gpu=h.device.type == "cuda", per=run.steps, unit="s/step")


def run_check(name: str, size: str = "full", device: str = "cuda", gpus: tuple[str, ...] = ("2", "4")) -> GpuReport:
    """The 1-GPU run, its yardstick, then one run per entry of gpus, each against the 1-GPU latents."""
    H.import_comfy()
    import comfy.model_management as mm

    from sd_accel.nodes import accelerated_unet

    check = CHECKS[name]
    h = sequences.Harness(check.model, size, device)
    h.model = h.build(h.dtype)
    report = GpuReport(name)
    run = sequences.Run(f"{STEPS} steps", STEPS)
    short = sequences.Run("timed", TIMED_STEPS.get(check.model, 5))
    h.sample(h.model, short)  # plain's first run loads the model: not one of its timed runs

    def served(acc) -> tuple[int, int, int, float]:
        """(devices, engine calls, spread calls, workers' start seconds) of acc's last run."""
        session = accelerated_unet.session_of(acc)
        engine, _, spread_calls = session.run_calls()
        report.notes += [m for m in session.slot.status.messages if m not in report.notes]
        spread = session.slot.spread
        return session.slot.status.devices, engine, spread_calls, spread.start_seconds if spread else 0.0

    def row(setting: str, out: torch.Tensor, seconds: float, ref: torch.Tensor, calls: tuple) -> None:
        devices, engine, spread_calls, start = calls
        report.rows.append(GpuRow(setting, devices, seconds, start, H.rel(out, ref), 3 * report.yardstick,
                                  bool(torch.isfinite(out).all()), engine, spread_calls))
        print(report.rows[-1].line(), flush=True)

    one = spread_node(h, "1", check.precision)
    ref, seconds = h.sample(one, run)
    first = served(one)
    g = torch.Generator().manual_seed(7)
    noise = h.noise(run)
    moved, warm = h.sample(one, run, noise * (1 + 2**-8 * torch.randn(noise.shape, generator=g)))
    report.yardstick = H.rel(moved, ref)
    print(f"{name}: yardstick {report.yardstick:.2e}", flush=True)
    row("gpus 1", ref, seconds, ref, first)
    row("gpus 1, warm (moved noise)", moved, warm, ref, served(one))
    report.timed = _timed(h, one, short)
    print("\n".join(f"{name}: {line}" for line in report.timed.lines()), flush=True)
    del one
    gc.collect()
    for asked in gpus:
        acc = spread_node(h, asked, check.precision)
        out, seconds = h.sample(acc, run)
        row(f"gpus {asked}", out, seconds, ref, served(acc))
        out, seconds = h.sample(acc, run)  # the workers up, the graphs captured: what every later run costs
        row(f"gpus {asked}, again", out, seconds, ref, (*served(acc)[:3], 0.0))
        if check.unload:
            mm.unload_all_models()
            out, seconds = h.sample(acc, run)
            row(f"gpus {asked} after unload", out, seconds, ref, served(acc))
        del acc
        gc.collect()
    h.model = None
    gc.collect()
    return report
