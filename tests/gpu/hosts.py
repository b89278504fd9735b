"""The extension inside A1111 1.10.1 and Forge on a GPU, as their users run it: each host's own headless API server in
fp16 with its defaults (A1111's cross-attention optimization set to sdp), full-size SD1.5 and SDXL checkpoints with
seeded weights built by A1111's own classes (tests/a1111/make_checkpoint.py; Forge reads the same files), and the
same txt2img requests with the host's built-in UNet and with sd-accel (A1111: SD Unet None / the sd-accel option;
Forge: Settings > sd-accel > backend off / auto).

Per host and model, for both: seconds per image (a warm-up request per setting and shape, unmeasured, then the median
of REPEATS), the sampler's seconds per step from two step counts ((t(many) - t(few)) / the steps between), and each
case's image against the built-in's: PSNR and the largest pixel difference. Cases: the two step counts, a LoRA at
ON, at CHANGED, at ON again (after a change of weight), at ON in a batch of 2, and removed, hires fix, a second size,
batch 2.

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
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import a1111_helpers as a1

HOSTS = ("a1111", "forge")
MIN_PSNR = 30.0
# The test LoRA's weights: on, then changed. At 1.0 the seeded LoRA makes sampling chaotic, so any fp16 difference gives
# another image (BENCHMARKS.md, "A1111 and Forge servers on the GPU").
ON, CHANGED = 0.5, 0.25
NOISE_DB = 10.0  # an image may lie about 3 times the built-in's own fp16 noise from its image (20 log10 3 = 9.5 dB)
REPEATS = 3
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


@dataclass
class Row:
    case: str
    images: int  # per request
    builtin_s: float  # seconds per image (median of REPEATS for the timed cases)
    accel_s: float
    psnr: float  # sd-accel's first image against the built-in's, dB
    max_diff: float  # the largest difference of one pixel channel, 0..255
    engine_calls: int  # UNet calls sd-accel's engine served during its request(s)
    plain_calls: int  # and those it left to the host's UNet
    min_psnr: float = MIN_PSNR

    @property
    def ok(self) -> bool:
        return self.psnr >= self.min_psnr and self.engine_calls > 0 and self.plain_calls == 0

    def line(self) -> str:
        speedup = self.builtin_s / self.accel_s if self.accel_s else float("nan")
        return (f"{self.case:<14} {self.builtin_s:>10.3f} {self.accel_s:>10.3f} {speedup:>7.2f}x {self.psnr:>8.1f} "
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
                 f"{'case':<14} {'built-in s':>10} {'sd-accel s':>10} {'speedup':>8} {'PSNR dB':>8} {'max diff':>8} "
                 f"{'calls':>10} ok",
                 f"{'s per step':<14} {builtin:>10.4f} {accel:>10.4f} "
                 f"{(builtin / accel if accel else float('nan')):>7.2f}x"]
        return "\n".join(lines + [r.line() for r in self.rows] + [f"   note: {n}" for n in self.notes])

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


TIMED = 2  # the first two cases: the step counts, each run REPEATS times


def _calls(status: dict) -> tuple[int, int]:
    return status.get("engine_calls", 0), status.get("plain_calls", 0)


def _image(srv: a1.Server, request: dict) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    image = srv.image("/sdapi/v1/txt2img", request)
    return image, time.perf_counter() - start


def _setting(srv: a1.Server, host: str, name: str, model: Model, setting: str, repeats: int
             ) -> dict[str, tuple[np.ndarray, float, tuple[int, int]]]:
    """Every case with one setting: case: (first image, seconds per image, (engine, plain) calls)."""
    srv.options(**SETTINGS[host][setting])
    base = {"prompt": PROMPT, "negative_prompt": "blurry", "seed": 1234, "sampler_name": "Euler", "cfg_scale": 7.0,
            "width": model.size[0], "height": model.size[1], "steps": model.steps[0]}
    out = {}
    warm = set()
    for i, (case, fields) in enumerate(cases(host, name, model).items()):
        request = {**base, **fields}
        shape = (request["width"], request["height"], request.get("batch_size", 1), request.get("enable_hr", False))
        if shape not in warm:  # a first request at a shape builds what the shape needs, in both settings
            _image(srv, request)
            warm.add(shape)
        before = _calls(srv.status())
        runs = [_image(srv, request) for _ in range(repeats if i < TIMED else 1)]
        after = _calls(srv.status())
        images = request.get("batch_size", 1)
        out[case] = (runs[0][0], statistics.median(t for _, t in runs) / images,
                     (after[0] - before[0], after[1] - before[1]))
    return out


def _psnr_diff(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    return a1.psnr(a, b), float(np.abs(a - b).max())


def run_model(srv: a1.Server, host: str, name: str, model: Model, repeats: int = REPEATS,
              min_psnr: float = MIN_PSNR) -> Report:
    """One model on a started server whose models folder holds NAME.safetensors and NAME-lora.safetensors."""
    srv.options(sd_model_checkpoint=f"{name}.safetensors")
    report = Report(host, name)
    runs = {setting: _setting(srv, host, name, model, setting, repeats) for setting in SETTINGS[host]}
    builtin, accel = runs["built-in"], runs["sd-accel"]
    few, many = model.steps
    for setting, done in runs.items():
        report.step_s[setting] = (done[f"{many} steps"][1] - done[f"{few} steps"][1]) / (many - few)
    report.noise_psnr = a1.psnr(builtin["batch 2"][0], builtin[f"{few} steps"][0])
    report.lora_psnr = a1.psnr(builtin[f"LoRA {ON}"][0], builtin["LoRA off"][0])
    report.lora_noise_psnr = a1.psnr(builtin[f"LoRA {ON} batch 2"][0], builtin[f"LoRA {ON}"][0])
    report.lora_bound = min(min_psnr, report.lora_noise_psnr - NOISE_DB)
    for case in builtin:
        psnr, diff = _psnr_diff(accel[case][0], builtin[case][0])
        images = 2 if "batch 2" in case else 1
        bound = report.lora_bound if case.startswith("LoRA") and case != "LoRA off" else min_psnr
        report.rows.append(Row(case, images, builtin[case][1], accel[case][1], psnr, diff, *accel[case][2],
                               min_psnr=bound))
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
