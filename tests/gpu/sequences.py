"""Run after run as a ComfyUI user works: ComfyUI's own model classes, ModelPatcher and `comfy.sample.sample`, in this
process, each run of the Accelerated UNet node compared with plain ComfyUI's same run.

One model, one sequence per node setting (precision, CUDA graphs; compile off) in one process: 20 steps, then 1, 3
and 7, 20 again, a second sampler and scheduler, another image size, a batch of 2 and back, a LoRA added through
ModelPatcher.add_patches at strength 1 and 0.4 and removed, the model unloaded and sampled again. Then, once per
model, a node widget changed between runs (a new node output on the same model, as ComfyUI makes when a widget
changes) and two nodes on one model, alternately.

The timed run ("20 steps again") runs again, the node's and plain ComfyUI's alternately, timing.RUNS times each
(timing.CPU_RUNS on the CPU, where the tests check the harness), warm: its row shows each side's median, and the lines
below it the range, the ratio of the medians, the host's CPU and load, and how long the GPU was busy within one more
(profiled) run of each (tests/gpu/timing.py). Its latents are compared once, as every run's are. SD_ACCEL_GPU_RUNS=timed
runs only the first 20-step run and the timed run of each setting (the yardsticks are still measured first, unless
SD_ACCEL_GPU_YARDSTICK gives them).

The yardstick is how far plain ComfyUI's own 16-bit run lies from its fp32 run of the same model (1 step and 20
steps; the larger): an accelerated run may differ from plain's by 1.5 times that in 16 bits, 3 times with fp8
products, and never hold a NaN or inf. A transformer whose fp8 settings run also gets an fp8 yardstick: how far plain
ComfyUI running the same weights as a scaled fp8 checkpoint (every Linear weight in e4m3 with a per-tensor scale, as
published *_fp8_scaled files store them) lies from its 16-bit run, the same two runs; fp8 products may differ by 1.5
times that where it is the larger bound. How far rounding to e4m3 moves the latents depends on the model: where a
block's output is RMS-normalized before its residual add (Z-Image's sandwich norms), the seeded weights' quiet
projections do not damp it. (ComfyUI's weight dtype fp8_e4m3fn casts without a scale: the seeded weights, most below
e4m3's smallest normal, lose far more there, so it is no yardstick.) SD_ACCEL_GPU_YARDSTICK splits it from the sequences where both do not fit
one call (Qwen-Image's 20 float32 steps take most of ten minutes): "only" measures it alone (and the fp8 one where fp8
settings are chosen), and the path of the JSON report that run wrote (tests/gpu/reporting.py) gives their values to a
later run, which then builds the 16-bit model alone and says where its yardsticks came from. Any run that measures
them with SD_ACCEL_GPU_REPORT set writes them there at once (NAME.yardstick.json, which serves the same way): a call
cut off by its time limit in the sequences still leaves them.

Full size (the published architectures, seeded well-conditioned weights) on a GPU; `size="tiny"` runs the same
sequences on tiny models, which is how the CPU tests keep this file honest.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import comfy_helpers as H
import reporting
import timing

# name: (ComfyUI's supported_models class, config name in accel/models/configs.py, 16-bit dtype, cfg, base size W x H,
# another size W x H, text tokens)
MODELS: dict[str, tuple[str, str, torch.dtype, float, tuple[int, int], tuple[int, int], int]] = {
    "sd15": ("SD15", "sd15", torch.float16, 7.0, (512, 512), (768, 512), 77),
    "sdxl": ("SDXL", "sdxl", torch.float16, 7.0, (1024, 1024), (832, 1216), 77),
    # SDXL with its weights stored in fp8 (WEIGHTS), as ComfyUI loads it with weight dtype fp8_e4m3fn
    "sdxl-fp8weights": ("SDXL", "sdxl", torch.float16, 7.0, (1024, 1024), (832, 1216), 77),
    "flux-dev": ("Flux", "flux-dev", torch.bfloat16, 1.0, (1024, 1024), (1024, 768), 512),
    "sd35-medium": ("SD3", "sd35-medium", torch.bfloat16, 4.5, (1024, 1024), (1024, 768), 333),
    "chroma": ("Chroma", "chroma", torch.bfloat16, 4.0, (1024, 1024), (1024, 768), 512),
    # A short clip keeps a sequence of runs within minutes: 17 frames (5 latent frames) at 480p.
    "wan21-1.3b": ("WAN21_T2V", "wan21-1.3b", torch.bfloat16, 5.0, (832, 480), (480, 832), 512),
    "qwen-image": ("QwenImage", "qwen-image", torch.bfloat16, 2.5, (1024, 1024), (1024, 768), 512),
    # Z-Image-Turbo (ComfyUI 0.33 and later) as its workflows run it: CFG 1, one call per step
    "z-image": ("ZImage", "z-image", torch.bfloat16, 1.0, (1024, 1024), (1024, 768), 512),
    # HunyuanVideo 1.5 480p text-to-video (ComfyUI 0.33 and later) at its CFG 6: a short clip, 17 frames (5 latent
    # frames) at 848x480, which its VAE makes 53x30 latents of 32 channels (LATENT)
    "hunyuan-video15": ("HunyuanVideo15", "hunyuan-video15", torch.bfloat16, 6.0, (848, 480), (480, 848), 256),
    # LTX-2 (ComfyUI 0.33 and later) at full width with 8 of its 48 blocks (ltx2-8l: 4.1B parameters; the whole 19.6B
    # model's files, float32 and fp8 beside 16-bit, and its runs do not fit one call), a short clip and its audio:
    # 17 frames (3 latent frames) at 768x512, 17 audio latents
    "ltx2-8l": ("LTXAV", "ltx2-8l", torch.bfloat16, 3.0, (768, 512), (512, 768), 256),
    # Flux.2-dev (ComfyUI 0.33 and later) at full width with 2 of its 8 double blocks and 8 of its 48 single blocks
    # (flux2-dev-10l: 6.7B parameters; the whole 32B model's files, float32 and fp8 beside 16-bit, and its runs do not
    # fit one call), guidance-distilled as Flux.1-dev: CFG 1, guidance 4 (GUIDANCE); 128 latent channels at 16x
    # (LATENT), Mistral's text padded to 512 tokens by ComfyUI
    "flux2-dev-10l": ("Flux2", "flux2-dev-10l", torch.bfloat16, 1.0, (1024, 1024), (1024, 768), 512),
    # Wan 2.1's native clip, 81 frames (21 latent frames) at 480p: the several-GPU check's model (tests/gpu/gpus.py)
    "wan21-14b": ("WAN21_T2V", "wan21-14b", torch.bfloat16, 5.0, (832, 480), (480, 832), 512),
}
TINY = {"sd15": "tiny-sd15", "sdxl": "tiny-sdxl", "sdxl-fp8weights": "tiny-sdxl", "flux-dev": "tiny-flux",
        "sd35-medium": "tiny-sd3", "chroma": "tiny-chroma", "wan21-1.3b": "tiny-wan", "qwen-image": "tiny-qwen-image",
        "wan21-14b": "tiny-wan", "z-image": "tiny-z-image", "hunyuan-video15": "tiny-hunyuan-video15",
        "ltx2-8l": "tiny-ltx2", "flux2-dev-10l": "tiny-flux2-dev-10l"}
# latent frames; the others are images (Qwen-Image's: one frame)
FRAMES = {"wan21-1.3b": 5, "wan21-14b": 21, "hunyuan-video15": 5, "ltx2-8l": 3}
# (latent channels, pixels per latent pixel) of the transformers whose VAE is not 16 channels at 8x
LATENT = {"hunyuan-video15": (32, 16), "ltx2-8l": (128, 32), "flux2-dev-10l": (128, 16)}
AUDIO = {"ltx2-8l": 17}  # audio latents beside the video's (LTX-2's: 25 a second, as its frames at 25 fps)
# the guidance a guidance-distilled model's conditioning carries (FluxGuidance's; ComfyUI's Flux.2 workflows give 4)
GUIDANCE = {"flux-dev": 3.5, "flux2-dev-10l": 4.0}
QUICK = ("sd15", "flux-dev")
# named alone: each takes a 10-minute call of its own or more (Qwen-Image and HunyuanVideo 1.5 two: the yardstick,
# then the sequences), and Z-Image, HunyuanVideo 1.5, LTX-2 and Flux.2 need ComfyUI 0.33
NOT_IN_FULL = ("wan21-1.3b", "qwen-image", "wan21-14b", "z-image", "hunyuan-video15", "ltx2-8l", "flux2-dev-10l")
UNETS = ("sd15", "sdxl", "sdxl-fp8weights")
# Models whose sequences run precision int8 too (not in quick): those whose fp8 error int8 is for (accel/engine/fp8.py)
INT8 = ("z-image",)
# Models whose weights are stored in another dtype than they compute in: ComfyUI's cast-on-the-fly layers widen each
# weight per call to the dtype the model runs in (the 16-bit one, or float32 for the yardstick's reference, which so
# keeps the same fp8 weights and measures the 16-bit computation's noise alone).
WEIGHTS = {"sdxl-fp8weights": torch.float8_e4m3fn}
TIMED = "20 steps again"  # the run of each sequence that times the node against plain ComfyUI


@dataclass(frozen=True)
class Run:
    label: str
    steps: int = 7
    sampler: str = "euler"
    scheduler: str = "simple"
    size: str = "base"  # or "other"
    batch: int = 1
    lora: float = 0.0  # a LoRA's strength, 0: none

    def config(self) -> "Run":
        """The run without its label: what decides the latents (noise seed included)."""
        return Run("", self.steps, self.sampler, self.scheduler, self.size, self.batch, self.lora)


# SD_ACCEL_GPU_RUNS: every run; just the first 20-step run and the timed run; or the runs that change the model (a
# LoRA added to a node that has run, changed, removed; an unload; the widget changes), for a call whose time would end
# before the whole sequence reaches them (Flux.1-dev fp8 in ComfyUI 0.3.64, whose first LoRA runs take 20 s a side)
RUN_SETS = ("all", "timed", "changes")


def sequence(unet: bool, runs: str = "all") -> list[Run]:
    """A setting's runs: all of them, or (runs="timed") the first 20-step run and the timed run, or (runs="changes")
    a first 7-step run and the LoRA and unload runs after it, for a call whose time would end before the whole
    sequence reaches them."""
    if runs not in RUN_SETS:
        raise ValueError(f"SD_ACCEL_GPU_RUNS={runs!r}: use {' or '.join(RUN_SETS)}")
    if runs == "timed":
        return [Run("20 steps", 20), Run(TIMED, 20)]
    changes = [Run("LoRA 1.0", 7, lora=1.0), Run("LoRA 0.4", 7, lora=0.4), Run("LoRA removed", 7),
               Run("after unload", 7)]
    if runs == "changes":
        return [Run("7 steps", 7), *changes]
    second = ("dpmpp_2m", "karras") if unet else ("dpmpp_2m", "beta")
    return [Run("20 steps", 20), Run("1 step", 1), Run("3 steps", 3), Run("7 steps", 7), Run(TIMED, 20),
            Run(f"{second[0]}/{second[1]}", 7, *second), Run("other size", 7, size="other"),
            Run("batch 2", 7, batch=2), Run("back to batch 1", 3), *changes]


@dataclass
class Row:
    model: str
    setting: str
    run: str
    error: float  # relative L2 of the node's latents from plain ComfyUI's
    limit: float
    finite: bool
    seconds: float = 0.0  # the node's run, wall clock (the timed run: the median of its timed runs)
    plain_seconds: float = 0.0  # plain's first run of this configuration (the timed run: its median warm run)
    engine_calls: int = 0  # the run's calls the node's engine served
    plain_calls: int = 0  # and those it left to the plain model (a comparison with plain then proves nothing)
    timed: timing.Timed | None = None  # the timed run's interleaved runs

    @property
    def ok(self) -> bool:
        return self.finite and self.error <= self.limit and self.engine_calls > 0 and self.plain_calls == 0

    def line(self) -> str:
        return (f"{self.setting:<20} {self.run:<18} {self.error:>9.2e} {self.limit:>9.2e} {self.seconds:>7.3f} "
                f"{self.plain_seconds:>7.3f} {self.engine_calls:>3}/{self.plain_calls:<3}  "
                f"{'ok' if self.ok else 'FAIL' + ('' if self.finite else ' (NaN/inf)')}")

    def lines(self) -> list[str]:
        """The row, and under it its timed runs where it has them."""
        return [self.line()] + [f"   {t}" for t in (self.timed.lines() if self.timed else [])]


@dataclass
class Report:
    model: str
    cpu: str = ""  # the host's CPU model and cores (timing.host_cpu)
    load: float | None = None  # its 1-minute load average when the model's runs began
    yardstick: float = 0.0
    fp8_yardstick: float | None = None  # plain on a scaled fp8 checkpoint against plain 16-bit, where measured
    lora_effect: float = 0.0  # how far plain's LoRA run lies from its run without: a LoRA must change the image
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sequences: bool = True  # False where the yardstick alone was measured

    @property
    def lora_runs(self) -> bool:
        """Whether the runs had a LoRA's (SD_ACCEL_GPU_RUNS=timed has none, and measures no LoRA effect)."""
        return any(r.run.startswith("LoRA") for r in self.rows)

    def failures(self) -> list[str]:
        bad = [f"{r.setting} / {r.run}" for r in self.rows if not r.ok]
        if not self.sequences or not self.lora_runs:
            return bad
        return bad + ([] if self.lora_effect > 1e-3 else [f"the LoRA changed plain's image by {self.lora_effect:.1e}"])

    def table(self) -> str:
        fp8 = ("" if self.fp8_yardstick is None
               else f"; fp8 yardstick (plain, scaled fp8 file, vs 16-bit) {self.fp8_yardstick:.2e}")
        lora = f"{self.lora_effect:.2e}" if self.lora_runs else "not measured"
        lines = [f"== {self.model}: yardstick (plain 16-bit vs fp32) {self.yardstick:.2e}{fp8}; LoRA's effect on "
                 f"plain {lora}; CPU {self.cpu}, load {timing.load_text(self.load)}",
                 f"{'setting':<20} {'run':<18} {'vs plain':>9} {'limit':>9} {'node s':>7} {'plain s':>7} "
                 f"{'calls':>7}  ok"]
        legend = (f"   node s, plain s: one run each (plain's: its first of that run's configuration); {TIMED}: the "
                  "medians of interleaved warm runs of each, as many as the lines under it say")
        return "\n".join(lines + [line for r in self.rows for line in r.lines()] + [legend]
                         + [f"   note: {n}" for n in self.notes])


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


class Harness:
    """One model of ComfyUI's classes on `device`, its plain runs (kept per run configuration) and the node's."""

    def __init__(self, name: str, size: str = "full", device: str = "cuda") -> None:
        self.name, self.size, self.device = name, size, torch.device(device)
        cls, config, self.dtype, self.cfg, self.base, self.other, self.tokens = MODELS[name]
        if size == "tiny":
            config = TINY[name]
            self.base, self.other, self.tokens = (64, 64), (128, 64), 7
            if not self.device.type == "cuda":
                self.dtype = torch.float32  # the CPU runs the plain model's float32 kernels
        self.cls, self.config = cls, config
        self.unet = name in UNETS
        self.xl = MODELS[name][1] == "sdxl"
        self.av = name in AUDIO  # a video latent with an audio latent beside it (LTX-2)
        self.report = Report(name, timing.host_cpu(), timing.load())
        self.pack = H.load_pack()
        self._plain: dict[Run, tuple[torch.Tensor, float]] = {}
        self._conditioning = self._make_conditioning()
        self.model = None
        self._files: list[Path] = []  # the files full-size models were loaded from, while in use
        self._file16: Path | None = None  # a 16-bit file the float32 yardstick read, which the 16-bit model reads too

    # ------------------------------------------------------------------ models and runs

    def seeded(self, dtype: torch.dtype, compute: torch.dtype | None = None, device: str | torch.device = "cpu"):
        """ComfyUI's own model (BaseModel) of this architecture, its weights in `dtype` computing in `compute` (None:
        the same), seeded: the same seed gives the same weights."""
        import comfy.supported_models

        from sd_accel.accel.models import configs

        if self.unet:
            unet_config = dict(configs.LDM_UNET_CONFIGS[self.config])
        else:
            unet_config = dict(configs.comfy_dit_config(self.config)[1])
        config = getattr(comfy.supported_models, self.cls)(dict(unet_config))
        config.unet_config.update(unet_config)  # the classes add their own entries (head counts)
        config.set_inference_dtype(dtype, compute)
        with H.layers_with_weights():
            model = config.get_model({}, device=device)
        # no gradients, as a loaded checkpoint's (ComfyUI's fp8 LoRA patching writes its rounding into out= tensors)
        configs.seed_dit_parameters(model.diffusion_model, 0).requires_grad_(False)
        return model

    def build(self, dtype: torch.dtype):
        """A ModelPatcher around ComfyUI's own model of this architecture, seeded (same seed: same weights), computing
        in `dtype` (its weights stored in WEIGHTS' dtype where the model has one)."""
        import comfy.model_management as mm
        import comfy.model_patcher

        stored = WEIGHTS.get(self.name)
        if self.size == "full" and dtype == self.dtype and self._file16 is not None:
            return H.load_diffusion_model_path(self._file16, stored or dtype)
        # Full size: the weights of the file ComfyUI loads, made on the CPU (under DynamicVRAM nothing but ComfyUI's
        # loaders may put a model on the GPU: direct allocations there beside comfy-aimdo's arena crashed the process)
        model = self.seeded(stored or dtype, dtype if stored else None, "cpu" if self.size == "full" else self.device)
        if self.size == "full":
            # as a user runs it: its file loaded by ComfyUI's own loader (under DynamicVRAM, the patcher it builds
            # is the only kind ComfyUI runs). The file stays while the model is in use: ComfyUI loads it again for a
            # resident copy.
            folder = Path(H.temporary_folder("sd-accel-gpu-model-"))
            self._files.append(folder)
            size = sum(t.numel() * t.element_size() for t in model.diffusion_model.state_dict().values())
            if dtype == torch.float32 and shutil.disk_usage(folder).free < 1.05 * size:
                # Qwen-Image's 82 GB in float32 fits no GPU machine's disk: the file holds the 16-bit rounding of the
                # same weights (those the 16-bit model gets, from this file too: ComfyUI keeps a file it has loaded
                # mapped, so a second one would not fit either), loaded in float32, so the yardstick measures the
                # 16-bit arithmetic alone and the limits are tighter, never looser
                model.diffusion_model.to(self.dtype)
                self._file16 = folder / "diffusion_model.safetensors"
                print(f"{self.name}: the float32 yardstick reads {self.dtype} weights ({size / 2**30:.0f} GiB in "
                      f"float32 > {shutil.disk_usage(folder).free / 2**30:.0f} GiB free)", flush=True)
            path = H.write_diffusion_model_file(model.diffusion_model, folder, self._metadata())
            del model  # before ComfyUI loads its own copy: a full-size model's weights twice fill the CPU's memory
            gc.collect()
            return H.load_diffusion_model_path(path, stored or dtype)
        return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                                offload_device=mm.unet_offload_device())

    def _metadata(self) -> dict | None:
        """The metadata its files carry that ComfyUI's detection reads (LTX-2's config), as a published file's."""
        from sd_accel.accel.models import configs

        return None if self.unet else configs.comfy_file_metadata(self.config)

    def _make_conditioning(self):
        from sd_accel.accel.models import configs

        g = torch.Generator().manual_seed(_seed(self.name, "text"))
        if self.unet:
            dim = configs.LDM_UNET_CONFIGS[self.config]["context_dim"]
            pooled = 1280 if self.xl else None
        else:
            family, cfg = configs.COMFY_DIT_CONFIGS[self.config]
            dim = {"sd3": lambda: cfg["context_embedder_config"]["params"]["in_features"],
                   "wan": lambda: cfg["text_dim"], "qwen-image": lambda: cfg["joint_attention_dim"],
                   "z-image": lambda: cfg["cap_feat_dim"], "ltx2": lambda: 2 * cfg["caption_channels"]}.get(
                family, lambda: cfg["context_in_dim"])()
            pooled = {"flux": cfg.get("vec_in_dim"), "sd3": cfg.get("adm_in_channels")}.get(family)

        def cond(scale: float):
            # as CLIPTextEncode gives it: the key is there, None for text encoders with no pooled output (Chroma's
            # T5), which ComfyUI's Flux-derived classes read
            extra = {"pooled_output": torch.randn(1, pooled, generator=g) * scale if pooled else None}
            if self.name in GUIDANCE:
                extra["guidance"] = GUIDANCE[self.name]
            if self.xl:
                extra.update(width=self.base[0], height=self.base[1], target_width=self.base[0],
                             target_height=self.base[1])
            return [[torch.randn(1, self.tokens, dim, generator=g) * scale, extra]]

        return cond(1.0), cond(0.5)

    def lora(self, model, strength: float):
        """A clone of model with a seeded rank-4 LoRA (ComfyUI's lora_unet_* format, loaded by comfy.lora) on the
        attention and MLP projections of the first blocks, at `strength`."""
        import comfy.lora

        key_map = comfy.lora.model_lora_keys_unet(model.model, {})
        g = torch.Generator().manual_seed(_seed(self.name, "lora"))
        names = ("attn1.to_", "attn2.to_", "ff.net", "img_attn.", "txt_attn.", "linear1", "linear2", "attn.qkv",
                 "attn.proj", "img_mlp.", "mlp.fc", "self_attn.", "cross_attn.", "ffn.", "attn.to_",
                 "attention.qkv", "attention.out", "feed_forward.")
        sd, taken = {}, 0
        for key, w in model.model.diffusion_model.state_dict().items():
            if w.dim() != 2 or not key.endswith(".weight") or not any(n in key for n in names) or taken >= 48:
                continue
            name = "lora_unet_" + key[: -len(".weight")].replace(".", "_")
            rank = 4
            sd[f"{name}.lora_up.weight"] = torch.randn(w.shape[0], rank, generator=g) * (0.3 / rank ** 0.5)
            sd[f"{name}.lora_down.weight"] = torch.randn(rank, w.shape[1], generator=g) / w.shape[1] ** 0.5
            sd[f"{name}.alpha"] = torch.tensor(float(rank))
            taken += 1
        patched = model.clone()
        patched.add_patches(comfy.lora.load_lora(sd, key_map, log_missing=False), strength)
        return patched

    def noise(self, run: Run):
        """The run's starting noise (seeded by what decides the latents); LTX-2's: its video and audio latents, nested
        as LTXVConcatAVLatent nests them."""
        w, h = self.base if run.size == "base" else self.other
        g = torch.Generator().manual_seed(_seed(self.name, run.config()))
        channels, scale = (4, 8) if self.unet else LATENT.get(self.name, (16, 8))
        frames = (FRAMES.get(self.name, 1),) if self.name in FRAMES or self.name == "qwen-image" else ()
        shape = (run.batch, channels, *frames, h // scale, w // scale)
        if self.av:  # beside the video's, the audio's 8 channels of 16 frequency bins
            import comfy.nested_tensor

            audio = (run.batch, 8, AUDIO[self.name] if self.size == "full" else 5, 16)
            return comfy.nested_tensor.NestedTensor([torch.randn(shape, generator=g), torch.randn(audio, generator=g)])
        return torch.randn(shape, generator=g)

    @property
    def conditioning(self):
        """(positive, negative): the runs' CONDITIONING, as CLIPTextEncode gives it."""
        return self._conditioning

    def model_file(self) -> Path | None:
        """The 16-bit file the model was loaded from (full size), which another process may load too (reuse_file)."""
        if self._file16 is not None:
            return self._file16
        return self._files[-1] / "diffusion_model.safetensors" if self._files else None

    def reuse_file(self, path: Path) -> None:
        """The 16-bit model is to be loaded from `path` (another harness's model_file), not written again."""
        self._file16 = path

    def sample(self, model, run: Run, noise: torch.Tensor | None = None,
               conditioning=None) -> tuple[torch.Tensor, float]:
        """(latents, seconds) of one sampling run, from the run's noise unless given, with the harness's conditioning
        unless given; nested latents (LTX-2's) as one (batch, values) tensor."""
        import comfy.sample

        noise = self.noise(run) if noise is None else noise
        seed = _seed(self.name, run.config())
        latent = noise * 0 if getattr(noise, "is_nested", False) else torch.zeros(noise.shape)
        pos, neg = self._conditioning if conditioning is None else conditioning
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = comfy.sample.sample(model, noise, run.steps, self.cfg, run.sampler, run.scheduler, pos, neg, latent,
                                  disable_pbar=True, seed=seed)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if getattr(out, "is_nested", False):
            out = torch.cat([t.reshape(t.shape[0], -1) for t in out.unbind()], 1)
        return out.float().cpu(), time.perf_counter() - start

    def _with_lora(self, model, run: Run):
        return self.lora(model, run.lora) if run.lora else model

    def plain(self, run: Run) -> tuple[torch.Tensor, float]:
        """Plain ComfyUI's latents for this run configuration (once per configuration)."""
        key = run.config()
        if key not in self._plain:
            self._plain[key] = self.sample(self._with_lora(self.model, run), run)
        return self._plain[key]

    def node(self, model, precision: str = "auto", cuda_graphs: bool = True, gpus: str = "1"):
        node = self.pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
        w, h = self.base
        out = node.apply(model, "torch", cuda_graphs, False, min_width=64, opt_width=w, max_width=2048,
                         min_height=64, opt_height=h, max_height=2048, min_batch=1, opt_batch=1, max_batch=4,
                         precision=precision, gpus=gpus, unique_id=f"gpu-{precision}-{cuda_graphs}-{gpus}")
        return out["result"][0]

    def check(self, setting: str, model, run: Run, fp8: bool) -> None:
        status = self._status(model)
        before = (status.engine_calls, status.plain_calls)
        out, seconds = self.sample(self._with_lora(model, run), run)
        calls = (status.engine_calls - before[0], status.plain_calls - before[1])  # of the compared run alone
        ref, plain_seconds = self.plain(run)
        timed = self.timed(model, run) if run.label == TIMED else None
        if timed:
            seconds, plain_seconds = timed.node.median, timed.plain.median
        self.report.rows.append(Row(self.name, setting, run.label, H.rel(out, ref), self.limit(fp8),
                                    bool(torch.isfinite(out).all()), seconds, plain_seconds, *calls, timed))
        print("\n".join(self.report.rows[-1].lines()), flush=True)  # as it goes: a run that hangs or dies shows where
        for message in status.messages:
            if message not in self.report.notes:
                self.report.notes.append(message)

    def timed(self, model, run: Run) -> timing.Timed:
        """The node's runs (`model`) and plain ComfyUI's of `run`, interleaved and warm (both have run it before)."""
        return timing.measure(lambda: self.sample(model, run)[1], lambda: self.sample(self.model, run)[1],
                              gpu=self.device.type == "cuda")

    @staticmethod
    def _status(model):
        from sd_accel.nodes import accelerated_unet

        return accelerated_unet.session_of(model).slot.status

    # ------------------------------------------------------------------ the sequences

    def settings(self, quick: bool = False) -> list[tuple[str, str, bool]]:
        """(label, precision, cuda_graphs) of each node setting that applies to this model. quick: graphs on, and a
        transformer's fp8 only (its 16-bit path runs in the widget changes and as the second of two nodes); int8 too
        for the models of INT8."""
        graphs = ((True,) if quick else (True, False)) if self.device.type == "cuda" else (False,)
        precisions = ("auto",) if self.unet else (("fp8",) if quick else ("auto", "fp8"))
        if not quick and self.name in INT8:
            precisions += ("int8",)
        return [(f"{p}, graphs {'on' if g else 'off'}", p, g) for p in precisions for g in graphs]

    def measure_yardstick(self) -> None:
        """Plain ComfyUI in fp32 against plain ComfyUI in 16 bits, 1 step and 20 steps; the fp32 model goes before
        the 16-bit one is made (a full-size Flux in fp32 takes 48 GB)."""
        import comfy.model_management as mm

        runs = [Run("1 step", 1), Run("20 steps", 20)]
        model32 = self.build(torch.float32)
        ref32 = [self.sample(model32, r)[0] for r in runs]
        del model32  # ComfyUI holds loaded models by weak reference: this frees it, with no copy to the CPU
        gc.collect()
        mm.cleanup_models()
        for folder in [f for f in self._files if self._file16 is None or f != self._file16.parent]:
            shutil.rmtree(folder, ignore_errors=True)  # the float32 file goes before the 16-bit one is written
            self._files.remove(folder)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.model = self.build(self.dtype)
        self.report.yardstick = max(H.rel(self.plain(r)[0], ref) for r, ref in zip(runs, ref32))
        print(f"{self.name}: yardstick {self.report.yardstick:.2e} (plain {self.dtype} vs float32)", flush=True)

    def measure_fp8_yardstick(self) -> None:
        """Plain ComfyUI running this model's weights as a scaled fp8 checkpoint (H.write_quantized_file's
        "scaled_fp8", loaded by ComfyUI's own loader) against its 16-bit runs (1 step and 20 steps); the file and
        model go before the sequences. Skipped, said in the notes, where the file would not fit the disk."""
        import comfy.model_management as mm
        import comfy.sd

        module = self.seeded(self.dtype).diffusion_model
        folder = Path(H.temporary_folder("sd-accel-gpu-fp8-"))
        need = sum(t.numel() for t in module.state_dict().values())  # at most a byte each, and the 16-bit rest
        if self.size == "full" and shutil.disk_usage(folder).free < 1.2 * need:
            del module
            shutil.rmtree(folder, ignore_errors=True)
            self.report.notes.append(f"no fp8 yardstick: its file ({need / 2**30:.0f} GiB) does not fit the disk "
                                     "beside the 16-bit one")
            return
        try:
            path = H.write_quantized_file(module, folder, "scaled_fp8", dtype=self.dtype, metadata=self._metadata())
            del module
            gc.collect()
            with self._detected():
                model8 = comfy.sd.load_diffusion_model(str(path))
            runs = [Run("1 step", 1), Run("20 steps", 20)]
            out8 = [self.sample(model8, r)[0] for r in runs]
            del model8
            gc.collect()
            mm.cleanup_models()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.report.fp8_yardstick = max(H.rel(self.plain(r)[0], o) for r, o in zip(runs, out8))
        print(f"{self.name}: fp8 yardstick {self.report.fp8_yardstick:.2e} (plain on a scaled fp8 file, vs "
              f"{self.dtype})", flush=True)

    def _detected(self):
        """A tiny model's widths for ComfyUI's detection of a file (comfy_helpers.detected_as); the published ones it
        reads. Z-Image's tiny file is identified as Lumina 2's class, which ZImage shares."""
        if self.size != "tiny" or self.av:  # LTX-2's file carries its config, which the detection reads
            return contextlib.nullcontext()
        from sd_accel.accel.models import configs

        identify = {"image_model": "lumina2"} if self.cls == "ZImage" else None
        return H.detected_as(self.cls, configs.comfy_dit_config(self.config)[1], identify)

    def prepare(self, fp8: bool = False) -> bool:
        """The 16-bit model (self.model) and its yardstick, and with fp8 runs to come on a transformer, the fp8
        yardstick: measured, or given by SD_ACCEL_GPU_YARDSTICK (a report's path; the fp8 one where the report holds
        it). False where SD_ACCEL_GPU_YARDSTICK=only asks for the yardsticks alone."""
        given = os.environ.get("SD_ACCEL_GPU_YARDSTICK", "")
        if given and given != "only":
            self.report.yardstick, fp8_given = yardsticks_from(given, self.name)
            self.report.notes.append(f"yardstick {self.report.yardstick:.2e} from {given}")
            if fp8 and fp8_given is not None:
                self.report.fp8_yardstick = fp8_given
                self.report.notes.append(f"fp8 yardstick {fp8_given:.2e} from {given}")
            self.model = self.build(self.dtype)
        else:
            self.measure_yardstick()
        if fp8 and not self.unet and self.name not in WEIGHTS and self.report.fp8_yardstick is None:
            self.measure_fp8_yardstick()
        if not given or given == "only":
            reporting.yardsticks(self.name, self.report.yardstick, self.report.fp8_yardstick, self.report.notes)
        if given == "only":
            self.report.sequences = False
            return False
        return True

    def limit(self, fp8: bool) -> float:
        """How far the node's latents may lie from plain's: 1.5 times the yardstick in 16 bits; with fp8 (or int8)
        products 3 times it, or 1.5 times the fp8 yardstick where that is the larger."""
        if fp8:
            return max(self.report.yardstick * 3.0, (self.report.fp8_yardstick or 0.0) * 1.5)
        return self.report.yardstick * 1.5

    def run_all(self, quick: bool = False, only: str = "", runs: str = "all") -> Report:
        """Every setting's sequence, then the widget changes; only: just the settings whose label contains it; runs:
        "timed" for each setting's first 20-step run and timed run alone (no LoRA, no widget changes), "changes" for
        its LoRA and unload runs after a first run, and the widget changes."""
        import comfy.model_management as mm

        runs_of = sequence(self.unet, runs)
        fp8 = any(p in ("fp8", "int8") and only in label for label, p, _ in self.settings(quick))
        if not self.prepare(fp8):
            return self.report
        if runs != "timed":
            lora = Run("LoRA 1.0", 7, lora=1.0)
            self.report.lora_effect = H.rel(self.plain(lora)[0], self.plain(Run("7 steps", 7))[0])
        try:
            for label, precision, graphs in self.settings(quick):
                if only not in label:
                    continue
                acc = self.node(self.model, precision, graphs)
                for run in runs_of:
                    if run.label == "after unload":
                        mm.unload_all_models()
                    self.check(label, acc, run, precision in ("fp8", "int8"))
                del acc
                gc.collect()
            if runs != "timed":
                self.widget_changes()
        except Exception as e:  # a broken run (an illegal address ends the CUDA context) ends the sequence: say where
            self.report.rows.append(Row(self.name, "error", type(e).__name__, float("inf"), 0.0, False))
            self.report.notes.append(f"stopped after {len(self.report.rows) - 1} runs: {said(e)}")
        return self.report

    def widget_changes(self) -> None:
        """A widget changed between runs (ComfyUI then runs the node again: a new output on the same model), and two
        nodes on one model, alternately."""
        fp8 = not self.unet
        other = dict(precision="fp8") if fp8 else dict(cuda_graphs=False)
        run = Run("7 steps", 7)
        first = self.node(self.model)
        self.check("widget: default", first, run, False)
        changed = self.node(self.model, **other)
        self.check(f"widget: {'fp8' if fp8 else 'graphs off'}", changed, run, fp8)
        back = self.node(self.model)
        self.check("widget: back", back, run, False)
        del first, changed, back
        a, b = self.node(self.model, **other), self.node(self.model)
        for label, model, is_fp8 in (("two nodes: A", a, fp8), ("two nodes: B", b, False), ("two nodes: A", a, fp8)):
            self.check(label, model, Run("3 steps", 3), is_fp8)


def yardsticks_from(path: str, name: str) -> tuple[float, float | None]:
    """The yardstick of `name` in the JSON report of an earlier run (SD_ACCEL_GPU_YARDSTICK=only), and its fp8
    yardstick where that run measured one."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"SD_ACCEL_GPU_YARDSTICK: cannot read {path} ({e}); give the .json report that "
                         f"SD_ACCEL_GPU_YARDSTICK=only wrote for {name}, or leave it unset to measure it") from None
    if record.get("model") != name or not isinstance(record.get("yardstick"), (int, float)):
        raise SystemExit(f"SD_ACCEL_GPU_YARDSTICK: {path} holds no yardstick of {name} (model "
                         f"{record.get('model')!r}, yardstick {record.get('yardstick')!r})")
    fp8 = record.get("fp8_yardstick")
    return float(record["yardstick"]), float(fp8) if isinstance(fp8, (int, float)) else None


def set_up(device: str) -> str:
    """ComfyUI imported and, on a GPU, set up as its main.py does; the note that says which ComfyUI and patcher."""
    H.import_comfy()
    patcher = H.set_up_like_main() if torch.device(device).type == "cuda" else "ModelPatcher"
    return f"ComfyUI {H.comfy_version()}, its loaders building {patcher}"


def said(e: BaseException) -> str:
    """An exception as a report's one line: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class Said(logging.Handler):
    """The messages logged to `logger` (the root: every logger's) while it is installed, INFO and up (ComfyUI's caches
    say what they skipped at INFO; the node's messages go to the "sd-accel" logger, as ComfyUI's console shows them)."""

    def __init__(self, logger: str = "") -> None:
        super().__init__(logging.INFO)
        self.logger = logger
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    @contextlib.contextmanager
    def on(self):
        logger = logging.getLogger(self.logger or None)
        level = logger.level
        logger.addHandler(self)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)

    def take(self) -> list[str]:
        taken, self.messages = self.messages, []
        return taken


def run_model(name: str, size: str = "full", device: str = "cuda", quick: bool = False, only: str = "",
              runs: str = "all") -> Report:
    note = set_up(device)
    harness = Harness(name, size, device)
    harness.report.notes.append(note)
    with Said("sd-accel").on() as node:  # the node's console lines, each once: which path and attention ran
        report = harness.run_all(quick, only, runs)
    report.notes += [f"said: {line}" for line in dict.fromkeys(node.messages)]
    harness.model = None
    gc.collect()
    if report.rows and report.rows[-1].setting != "error" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return report
