"""ComfyUI's quantized checkpoints on the GPU: the Accelerated UNet node on a model ComfyUI's own loader read from a
quantized file (comfy_helpers.write_quantized_file: the "fp8_scaled" layout, or ComfyUI 0.33's mixed-precision one),
run after run as tests/gpu/sequences.py runs the other models, each run against plain ComfyUI on the same file; and
timed: the node's warm 20-step run (sequences.TIMED: medians of interleaved runs) must not be slower than plain
ComfyUI's on that file.

The weights are sequences.py's seeded ones, the quantized layers (every Linear of an "fp8_scaled" file; the blocks'
projections of a mixed-precision one) stored in e4m3 with one scale per tensor; the yardstick's float32 reference holds
the very values the file stores for them: the yardstick is plain ComfyUI's own quantized run against float32
(its fp8 products, where the GPU has them, included), and every run of the node may lie 3 times that from plain's.

Not collected by tests/gpu/run (it is no test_*.py file); run it by name, one model a process, as tests/gpu/run starts
each under ComfyUI 0.33's DynamicVRAM (comfy-aimdo before torch):

  SD_ACCEL_GPU_MODELS=flux-dev SD_ACCEL_QUANTIZED_FORM=comfy_quant COMFYUI_ROOT=<ComfyUI 0.33> python3 -c '
  import sys, comfy_aimdo.control
  comfy_aimdo.control.init(simple_vram_headroom=None, nvml_pressure=True)
  import pytest; sys.exit(pytest.main(sys.argv[1:]))' tests/gpu/quantized.py -q -s -p no:cacheprovider -rs

SD_ACCEL_GPU_MODELS: one of sequences.MODELS (flux-dev by default; wan21-1.3b, qwen-image, sd15 and sdxl are the others
worth a run); SD_ACCEL_QUANTIZED_FORM: comfy_quant (default), scaled_fp8 (the only form ComfyUI 0.3.6x reads) or
quantization_metadata; SD_ACCEL_GPU_QUICK=1: the node's default setting only, without the widget changes.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from pathlib import Path

import pytest
import torch

import comfy_helpers as H
import sequences
from reporting import report as _report

# The repeated blocks' layers of each model: what a mixed-precision file stores in e4m3 (the rest stays 16-bit)
BLOCKS = {"flux": ("double_blocks.", "single_blocks."), "chroma": ("double_blocks.", "single_blocks."),
          "sd3": ("joint_blocks.",), "wan": ("blocks.",), "qwen-image": ("transformer_blocks.",)}
UNET_BLOCKS = ".transformer_blocks."  # the UNets' attention and feed-forward projections
FLOAT32_ORDER = 1e-6  # the least yardstick: float32 sums taken in another order


class QuantizedHarness(sequences.Harness):
    """sequences.Harness with its 16-bit model loaded from a quantized file of `form`."""

    def __init__(self, name: str, form: str, size: str = "full", device: str = "cuda") -> None:
        super().__init__(name, size, device)
        self.form = form
        self._quick = False
        self.report.model = f"{name} ({form})"

    def _layers(self, name: str) -> str | None:
        if self.unet:
            inside = UNET_BLOCKS in f".{name}"
        else:
            from sd_accel.accel.models import configs

            inside = name.startswith(BLOCKS[configs.COMFY_DIT_CONFIGS[self.config][0]])
        return "float8_e4m3fn" if self.form == "scaled_fp8" or inside else None

    def build(self, dtype: torch.dtype):
        """The seeded model loaded by ComfyUI from a file: in float32 (the yardstick's reference) an ordinary file whose
        quantized layers hold the values the quantized file stores; in 16 bits the quantized file."""
        import comfy.sd

        module = self.seeded(dtype).diffusion_model
        # the file stays while the model is in use: under DynamicVRAM ComfyUI loads it again for a resident copy
        folder = Path(H.temporary_folder("sd-accel-gpu-quantized-"))
        self._files.append(folder)
        if dtype == torch.float32:
            # the values the quantized file stores: its writer quantizes the 16-bit model's weights, which are these
            # (the same seed) rounded to the 16-bit dtype
            with torch.no_grad():
                for key, w in module.state_dict().items():
                    if w.dim() == 2 and key.endswith(".weight") and self._layers(key[: -len(".weight")]):
                        q, scale = H.quantize_per_tensor(w.to(self.dtype), "float8_e4m3fn")
                        w.copy_(q.float() * scale)
            with self._detected():
                return H.load_diffusion_model_file(module, folder, dtype)
        path = H.write_quantized_file(module, folder, self.form, self._layers, dtype=dtype)
        with self._detected():
            return comfy.sd.load_diffusion_model(str(path))

    def settings(self, quick: bool = False) -> list[tuple[str, str, bool]]:
        """precision auto (the e4m3 layers as fp8 products), graphs on and, unless quick, off; and 16bit, where the
        quantized layers run ComfyUI's own kernels inside the fused blocks."""
        graphs = ((True,) if quick else (True, False)) if self.device.type == "cuda" else (False,)
        out = [(f"auto, graphs {'on' if g else 'off'}", "auto", g) for g in graphs]
        return out if quick else out + [(f"16bit, graphs {'on' if graphs[0] else 'off'}", "16bit", graphs[0])]

    def measure_yardstick(self) -> None:
        super().measure_yardstick()
        # On the CPU (tiny) plain's and the node's float32 runs differ only by the order comfy-kitchen's dispatch
        # sums in, within inference mode and outside it; a GPU's 16-bit yardstick lies far above this.
        self.report.yardstick = max(self.report.yardstick, FLOAT32_ORDER)

    def check(self, setting: str, model, run: sequences.Run, fp8: bool) -> None:
        super().check(setting, model, run, True)  # every setting's products read e4m3 weights

    def run_all(self, quick: bool = False, only: str = "") -> sequences.Report:
        self._quick = quick
        return super().run_all(quick, only)

    def widget_changes(self) -> None:
        if not self._quick:
            super().widget_changes()


def speed_failures(report: sequences.Report) -> list[str]:
    """The node's timed run (warm, 20 steps: the medians of interleaved runs) with precision auto and graphs on slower
    than plain ComfyUI's."""
    rows = [r for r in report.rows if r.run == sequences.TIMED and r.setting.startswith("auto, graphs on")]
    return [f"{r.setting}: the node took {r.seconds:.3f} s, plain ComfyUI {r.plain_seconds:.3f} s (medians)"
            for r in rows if r.seconds > r.plain_seconds]


def run_quantized(name: str, form: str, size: str = "full", device: str = "cuda",
                  quick: bool = False) -> sequences.Report:
    note = sequences.set_up(device)
    harness = QuantizedHarness(name, form, size, device)
    harness.report.notes.append(f"{note}; a {form} file")
    report = harness.run_all(quick)
    harness.model = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: this check runs on one")
@pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))
def test_quantized_checkpoint_matches_plain_comfyui_and_is_not_slower():
    name = os.environ.get("SD_ACCEL_GPU_MODELS", "flux-dev")
    form = os.environ.get("SD_ACCEL_QUANTIZED_FORM", "comfy_quant")
    if H.reads_quantized_form(form):
        pytest.skip(H.reads_quantized_form(form))
    report = run_quantized(name, form, quick=os.environ.get("SD_ACCEL_GPU_QUICK") == "1")
    table = report.table()
    _report(f"{name}-{form}", table, {"cpu": report.cpu, "load": report.load, "yardstick": report.yardstick,
                                      "rows": [dataclasses.asdict(r) for r in report.rows], "notes": report.notes})
    failures = report.failures() + speed_failures(report)
    assert not failures, f"{'; '.join(failures)}\n{table}"
