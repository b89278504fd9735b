"""The extension inside A1111 1.10.1 and Forge on a GPU, as their users run it: each host's own headless API server in
fp16 with its defaults (A1111's cross-attention optimization set to sdp), full-size SD1.5 and SDXL checkpoints with
seeded weights built by A1111's own classes (tests/a1111/make_checkpoint.py; Forge reads the same files), and the
same txt2img requests with the host's built-in UNet and with sd-accel (A1111: SD Unet None / the sd-accel option;
Forge: Settings > sd-accel > backend off / auto).

Per host and model, first a pass of every case with each setting (a warm-up request per setting and shape,
unmeasured, then one request of each case): each case's image against the built-in's (PSNR and the largest pixel
difference), the UNet calls sd-accel's engine served and those it left to the host, and each request's seconds.
Cases: the two step counts, a LoRA at ON, at CHANGED, at ON again (after a change of weight), at ON in a batch of 2,
and removed, hires fix, a second size, batch 2.

Then the timing (issue 58): each of the two step-count cases again with the two settings alternating (built-in,
sd-accel, built-in, ...), RUNS timed requests of each (tests/gpu/timing.py's interleaved runs). Before each timed
request the setting is switched through the server's options and one untimed request of the few-steps case runs
with it: the host applies a switch inside the next request, not when the option is set (A1111's sd_unet: the next
generation's apply_unet moves the UNet to the CPU and back and makes a new SD Unet, whose engine sd-accel builds
again on its first call; Forge reads sd-accel's backend option when each sampling starts), so that request carries
the switch's cost and the timed one does not. Each side is the median of its timed requests with their range, the
speed-up the ratio of the medians, beside the host's CPU model and load; the table's lines say so, and what the
request after each switch took. The sampler's seconds per step come from those medians ((t(many) - t(few)) / the
steps between). The other cases' seconds are their one request in their setting's pass, with no ratio.

The bound: an image is off when its PSNR to the built-in's is below MIN_PSNR (30 dB: fp16 arithmetic in another order
moves a 20-step image a few pixel levels, a wrong UNet moves it by tens). The table names the built-in's own fp16
noise beside it: its first image of batch 2 against its batch-1 image of the same seed. A LoRA can make the sampling
amplify that noise (ON below says how much this one does): for the LoRA cases the bound is the built-in's own noise
with the LoRA (its batch of 2 against its batch of 1) less NOISE_DB, where that is lower than MIN_PSNR. A LoRA that leaves the
built-in's image within the bound fails too: its comparisons would prove nothing. On the CPU (tests/test_gpu_hosts.py)
the same code runs the tiny checkpoint in fp32, where every image equals the built-in's.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import a1111_helpers as a1
import timing

HOSTS = ("a1111", "forge")
MIN_PSNR = 30.0
# The test LoRA's weights: on, then changed. At 1.0 the seeded LoRA makes sampling chaotic, so any fp16 difference gives
# another image (BENCHMARKS.md, "A1111 and Forge servers on the GPU").
ON, CHANGED = 0.5, 0.25
NOISE_DB = 10.0  # an image may lie about 3 times the built-in's own fp16 noise from its image (20 log10 3 = 9.5 dB)
RUNS = timing.RUNS  # timed requests of each setting for each step count, interleaved
PROMPT = "a photograph of a lighthouse on a cliff at dusk"
LORA = "lora"  # the LoRA file of model M is M-lora


@dataclass(frozen=True)
class Model:
    arch: str  # a1111_helpers.make_models' arch
    size: tuple[int, int]  # W x H
    other: tuple[int, int]
    hires_scale: float
    steps: tuple[int, int]  # few and many: the sampler's seconds per step come from the two


MODELS = {"sd15": Model("sd15", (512, 512), (768, 512), 1.5, (10, 30)),
          "sdxl": Model("sdxl", (1024, 1024), (832, 1216), 1.25, (8, 20))}
TINY = {"tiny": Model("tiny", (64, 64), (96, 64), 2.0, (2, 4))}
# The options that choose the built-in UNet and sd-accel.
SETTINGS = {"a1111": {"built-in": {"sd_unet": "None"}, "sd-accel": {"sd_unet": a1.ACCEL_UNET}},
            "forge": {"built-in": {"sd_accel_backend": "off"}, "sd-accel": {"sd_accel_backend": "auto"}}}


@dataclass(frozen=True)
class Timed:
    """A step-count case's timed requests, the settings alternating (seconds per image), and the untimed request
    after each switch to a setting, where the host applied the switch."""

    builtin: timing.Spread
    accel: timing.Spread
    builtin_switch: timing.Spread
    accel_switch: timing.Spread
    cpu: str  # the host's CPU model and cores (timing.host_cpu)
    load: float | None  # its 1-minute load average right after the timed requests

    @property
    def ratio(self) -> float:
        return self.builtin.median / self.accel.median

    def lines(self, case: str) -> list[str]:
        return [f"timed {case}: sd-accel median {self.accel.text('s')}, built-in {self.builtin.text('s')} over "
                f"{len(self.accel.samples)} interleaved warm runs each: {self.ratio:.2f}x; CPU {self.cpu}, load "
                f"{timing.load_text(self.load)}",
                f"   the untimed request after each switch (the few-steps case): sd-accel "
                f"{self.accel_switch.text('s')}, built-in {self.builtin_switch.text('s')}"]


@dataclass
class Row:
    case: str
    images: int  # per request
    builtin_s: float  # seconds per image: the timed cases' medians (`timed`), else the one request of its pass
    accel_s: float
    psnr: float  # sd-accel's first image against the built-in's, dB
    max_diff: float  # the largest difference of one pixel channel, 0..255
    engine_calls: int  # UNet calls sd-accel's engine served during its request(s)
    plain_calls: int  # and those it left to the host's UNet
    min_psnr: float = MIN_PSNR
    timed: Timed | None = None  # the step-count cases' interleaved requests

    @property
    def ok(self) -> bool:
        return self.psnr >= self.min_psnr and self.engine_calls > 0 and self.plain_calls == 0

    def line(self) -> str:
        # a ratio only of interleaved medians (issue 58): one request of each setting's pass gives none
        speedup = f"{self.timed.ratio:>7.2f}x" if self.timed else f"{'-':>8}"
        return (f"{self.case:<16} {self.builtin_s:>10.3f} {self.accel_s:>10.3f} {speedup} {self.psnr:>8.1f} "
                f"{self.max_diff:>8.0f} {self.engine_calls:>5}/{self.plain_calls:<4} {'ok' if self.ok else 'FAIL'}")


@dataclass
class Report:
    host: str
    model: str
    step_s: dict[str, float] = field(default_factory=dict)  # setting: sampler seconds per step
    noise_psnr: float = 0.0  # the built-in's batch-2 first image against its batch-1 image
    lora_psnr: float = 0.0  # the built-in's image with the LoRA (at ON) against its image without
    lora_noise_psnr: float = 0.0  # the built-in's batch-2 first image with the LoRA against its batch-1 one
    lora_bound: float = MIN_PSNR  # the bound of the rows with the LoRA on
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        bad = [f"{r.case}: PSNR {r.psnr:.1f} dB, calls {r.engine_calls}/{r.plain_calls}" for r in self.rows if not r.ok]
        # a LoRA within the LoRA rows' bound of the image without could be ignored unseen
        if self.lora_psnr >= self.lora_bound:
            bad.append(f"the LoRA left the built-in's image within the bound ({self.lora_psnr:.1f} dB)")
        return bad

    def table(self) -> str:
        builtin, accel = self.step_s.get("built-in", 0.0), self.step_s.get("sd-accel", 0.0)
        lines = [f"== {self.host} {self.model}: bound PSNR >= {self.rows[0].min_psnr if self.rows else MIN_PSNR:.0f} "
                 f"dB; the built-in's own noise (batch 2 vs 1) {self.noise_psnr:.1f} dB; LoRA's effect on the "
                 f"built-in {self.lora_psnr:.1f} dB; its own noise with the LoRA {self.lora_noise_psnr:.1f} dB",
                 f"{'case':<16} {'built-in s':>10} {'sd-accel s':>10} {'speedup':>8} {'PSNR dB':>8} {'max diff':>8} "
                 f"{'calls':>10} ok",
                 f"{'s per step':<16} {builtin:>10.4f} {accel:>10.4f} "
                 f"{(builtin / accel if accel else float('nan')):>7.2f}x"]
        timed = [r for r in self.rows if r.timed]
        legend = (f"   s per image; {', '.join(r.case for r in timed)}: the medians of interleaved warm runs, as the "
                  "lines below say (s per step from them); other cases: one request each in its setting's pass, no "
                  "ratio")
        return "\n".join(lines + [r.line() for r in self.rows] + [legend]
                         + [line for r in timed for line in r.timed.lines(r.case)]
                         + [f"   note: {n}" for n in self.notes])

    def record(self) -> dict:
        return dataclasses.asdict(self)


def cases(host: str, name: str, model: Model) -> dict[str, dict]:
    """name: the request's fields beyond the base request (the few-steps one)."""
    few, many = model.steps
    hires = {"enable_hr": True, "hr_scale": model.hires_scale, "hr_upscaler": "Latent", "denoising_strength": 0.6,
             "hr_second_pass_steps": max(1, few // 2)}
    if host == "forge":  # Forge's API asks which VAE and text encoders the second pass uses
        hires["hr_additional_modules"] = ["Use same choices"]
    lora = f"{name}-{LORA}"
    return {f"{many} steps": {"steps": many}, f"{few} steps": {},
            f"LoRA {ON}": {"prompt": f"{PROMPT} <lora:{lora}:{ON}>"},
            f"LoRA {CHANGED}": {"prompt": f"{PROMPT} <lora:{lora}:{CHANGED}>"},
            f"LoRA {ON} again": {"prompt": f"{PROMPT} <lora:{lora}:{ON}>"},
            f"LoRA {ON} batch 2": {"prompt": f"{PROMPT} <lora:{lora}:{ON}>", "batch_size": 2}, "LoRA off": {},
            "hires fix": hires, "other size": {"width": model.other[0], "height": model.other[1]},
            "batch 2": {"batch_size": 2}}


TIMED = 2  # the first two cases: the step counts, timed with the settings interleaved


def _calls(status: dict) -> tuple[int, int]:
    return status.get("engine_calls", 0), status.get("plain_calls", 0)


def _image(srv: a1.Server, request: dict) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    image = srv.image("/sdapi/v1/txt2img", request)
    return image, time.perf_counter() - start


def requests(host: str, name: str, model: Model) -> dict[str, dict]:
    """Each case's txt2img request."""
    base = {"prompt": PROMPT, "negative_prompt": "blurry", "seed": 1234, "sampler_name": "Euler", "cfg_scale": 7.0,
            "width": model.size[0], "height": model.size[1], "steps": model.steps[0]}
    return {case: {**base, **fields} for case, fields in cases(host, name, model).items()}


def _setting(srv: a1.Server, host: str, name: str, model: Model, setting: str
             ) -> dict[str, tuple[np.ndarray, float, tuple[int, int]]]:
    """Every case once with one setting: case: (image, seconds per image, (engine, plain) calls)."""
    srv.options(**SETTINGS[host][setting])
    out = {}
    warm = set()
    for case, request in requests(host, name, model).items():
        shape = (request["width"], request["height"], request.get("batch_size", 1), request.get("enable_hr", False))
        if shape not in warm:  # a first request at a shape builds what the shape needs, in both settings
            _image(srv, request)
            warm.add(shape)
        before = _calls(srv.status())
        image, seconds = _image(srv, request)
        after = _calls(srv.status())
        out[case] = (image, seconds / request.get("batch_size", 1), (after[0] - before[0], after[1] - before[1]))
    return out


def _interleaved(srv: a1.Server, host: str, request: dict, settle: dict, runs: int) -> Timed:
    """`request` timed `runs` times with each setting, the settings alternating, built-in first. Before each timed
    request: the setting through the server's options and one untimed request, `settle` (the few-steps case), in which
    the host applies the switch; neither is in the timed interval."""
    images = request.get("batch_size", 1)
    after_switch: dict[str, list[float]] = {setting: [] for setting in SETTINGS[host]}

    def side(setting: str):
        def run() -> float:
            srv.options(**SETTINGS[host][setting])
            after_switch[setting].append(_image(srv, settle)[1] / settle.get("batch_size", 1))
            return _image(srv, request)[1] / images
        return run

    builtin, accel = timing.interleaved(side("built-in"), side("sd-accel"), runs)
    host_load = timing.load()
    return Timed(timing.Spread.of(builtin), timing.Spread.of(accel), timing.Spread.of(after_switch["built-in"]),
                 timing.Spread.of(after_switch["sd-accel"]), timing.host_cpu(), host_load)


def _psnr_diff(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    return a1.psnr(a, b), float(np.abs(a - b).max())


def run_model(srv: a1.Server, host: str, name: str, model: Model, runs: int = RUNS,
              min_psnr: float = MIN_PSNR) -> Report:
    """One model on a started server whose models folder holds NAME.safetensors and NAME-lora.safetensors; runs:
    the timed requests of each setting for each step count (at least timing.MIN_RUNS behind a printed figure; the
    CPU test passes fewer)."""
    srv.options(sd_model_checkpoint=f"{name}.safetensors")
    report = Report(host, name)
    passes = {setting: _setting(srv, host, name, model, setting) for setting in SETTINGS[host]}
    builtin, accel = passes["built-in"], passes["sd-accel"]
    few, many = model.steps
    asked = requests(host, name, model)
    timed = {case: _interleaved(srv, host, asked[case], asked[f"{few} steps"], runs) for case in list(asked)[:TIMED]}
    for setting, side in (("built-in", "builtin"), ("sd-accel", "accel")):
        medians = {case: getattr(t, side).median for case, t in timed.items()}
        report.step_s[setting] = (medians[f"{many} steps"] - medians[f"{few} steps"]) / (many - few)
    report.noise_psnr = a1.psnr(builtin["batch 2"][0], builtin[f"{few} steps"][0])
    report.lora_psnr = a1.psnr(builtin[f"LoRA {ON}"][0], builtin["LoRA off"][0])
    report.lora_noise_psnr = a1.psnr(builtin[f"LoRA {ON} batch 2"][0], builtin[f"LoRA {ON}"][0])
    report.lora_bound = min(min_psnr, report.lora_noise_psnr - NOISE_DB)
    for case in builtin:
        psnr, diff = _psnr_diff(accel[case][0], builtin[case][0])
        images = 2 if "batch 2" in case else 1
        bound = report.lora_bound if case.startswith("LoRA") and case != "LoRA off" else min_psnr
        t = timed.get(case)
        report.rows.append(Row(case, images, t.builtin.median if t else builtin[case][1],
                               t.accel.median if t else accel[case][1], psnr, diff, *accel[case][2], min_psnr=bound,
                               timed=t))
    status = srv.status()
    report.notes += [f"sd-accel: backend {status.get('backend')}, attention {status.get('attention')}",
                     f"plan: {status.get('plan')}"]
    return report


def start(host: str, data: Path, names: tuple[str, ...], gpu: bool = True, models: dict[str, Model] = MODELS
          ) -> a1.Server:
    """The host's server on `data`, with each named model's checkpoint and LoRA built there first (on the GPU when
    gpu), A1111 with the sdp cross-attention optimization."""
    for name in names:
        a1.make_models(data / "models", name=name, lora=f"{name}-{LORA}", arch=models[name].arch,
                       device="cuda" if gpu else "cpu")
    config = {"live_previews_enable": False, "sd_model_checkpoint": f"{names[0]}.safetensors"}
    if host == "a1111":  # the option takes an optimization's title; "Automatic" picks Doggettx on CUDA
        config["cross_attention_optimization"] = "sdp - scaled dot product"
    (data / "config.json").write_text(json.dumps(config))
    return a1.Server(data, forge=host == "forge", gpu=gpu, startup_timeout=300)


def missing(host: str) -> str | None:
    return a1.forge_missing() if host == "forge" else a1.missing()


def chosen(wanted: str) -> tuple[str, ...]:
    """The hosts SD_ACCEL_GPU_MODELS names (they run only when named)."""
    return tuple(n for n in (n.strip() for n in wanted.split(",")) if n in HOSTS)


def run_host(host: str, data: Path, names: tuple[str, ...] = tuple(MODELS)) -> tuple[list[Report], str]:
    """Every named model on one server of the host: the reports, and the server's console."""
    srv = start(host, data, names)
    try:
        return [run_model(srv, host, name, MODELS[name]) for name in names], srv.log()
    finally:
        srv.stop()
