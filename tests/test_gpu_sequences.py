"""The GPU suite's sequences (tests/gpu/sequences.py) on tiny models on the CPU: the same harness, ComfyUI's own
classes and sampler, every run of the node against plain ComfyUI's. On the CPU the torch path runs the plain
model's float32 kernels, so each run must equal plain's exactly (the yardstick is 0) and go through the engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import comfy_helpers as H

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
import sequences  # noqa: E402
import timing

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))


@pytest.mark.parametrize("name", ["sd15", "sdxl-fp8weights", "flux-dev", "chroma", "wan21-1.3b", "qwen-image",
                                  "z-image", "hunyuan-video15"])
def test_every_run_of_the_sequence_equals_plain_comfyui(name):
    H.import_comfy()
    import comfy.supported_models

    if not hasattr(comfy.supported_models, sequences.MODELS[name][0]):
        pytest.skip(f"ComfyUI {H.comfy_version()} has no supported_models.{sequences.MODELS[name][0]}")
    report = sequences.run_model(name, size="tiny", device="cpu")
    runs, settings = {r.run for r in report.rows}, {r.setting for r in report.rows}
    assert {"20 steps again", "LoRA 0.4", "LoRA removed", "after unload", "other size", "batch 2"} <= runs
    assert {"widget: back", "two nodes: B"} <= settings
    assert report.yardstick == 0.0 and not report.failures(), report.table()
    assert report.lora_effect > 1e-3  # the LoRA runs compare images the LoRA changed
    timed = [r for r in report.rows if r.run == sequences.TIMED]
    assert timed and all(len(r.timed.node.samples) == len(r.timed.plain.samples) == timing.RUNS for r in timed)
    assert all(r.seconds == r.timed.node.median and r.plain_seconds == r.timed.plain.median for r in timed)
    fp8_rows = [r for r in report.rows if r.setting.startswith("fp8")]
    if name in sequences.UNETS:
        assert report.fp8_yardstick is None and not fp8_rows
    else:  # plain ComfyUI's own fp8 weight dtype rounds the weights to e4m3: its latents move, and bound fp8's
        assert report.fp8_yardstick > 1e-3 and fp8_rows, report.table()
        assert all(r.limit == 1.5 * report.fp8_yardstick for r in fp8_rows)
    print(report.table())


def test_the_yardstick_measured_alone_serves_a_later_run(tmp_path, monkeypatch):
    """SD_ACCEL_GPU_YARDSTICK: a call that measures only the yardstick, and a later one that takes it from that call's
    report; the later run's limits are the given yardstick's, and a report of another model is refused."""
    monkeypatch.setenv("SD_ACCEL_GPU_YARDSTICK", "only")
    alone = sequences.run_model("sd15", size="tiny", device="cpu")
    assert not alone.rows and not alone.sequences and not alone.failures()
    path = tmp_path / "sd15.json"
    path.write_text(json.dumps({"model": "sd15", "yardstick": 2e-3}))
    monkeypatch.setenv("SD_ACCEL_GPU_YARDSTICK", str(path))
    report = sequences.run_model("sd15", size="tiny", device="cpu", only="no setting: the widget changes alone")
    assert report.yardstick == 2e-3 and any(str(path) in note for note in report.notes)
    assert report.rows and {r.limit for r in report.rows} == {2e-3 * 1.5} and not report.failures(), report.table()
    path.write_text(json.dumps({"model": "flux-dev", "yardstick": 2e-3}))
    with pytest.raises(SystemExit, match="holds no yardstick of sd15"):
        sequences.run_model("sd15", size="tiny", device="cpu")


def test_the_several_gpu_check_on_cpu_processes():
    """tests/gpu/gpus.py's check on the tiny Wan, its spread run over 2 CPU processes, twice: every call spread, the
    latents within the measured limit of the 1-GPU run's; the second run's seconds with no start of the workers in
    them."""
    import gpus

    report = gpus.run_check("wan21-14b-gpus", size="tiny", device="cpu", gpus=("2",))
    print(report.table())
    assert [r.setting for r in report.rows] == ["gpus 1", "gpus 1, warm (moved noise)", "gpus 2", "gpus 2, again"]
    for spread in report.rows[2:]:
        assert spread.devices == 2 and spread.spread_calls == spread.engine_calls == gpus.STEPS
        assert 0 < spread.distance
    assert report.rows[2].start > 0 and report.rows[3].start == 0
    assert len(report.timed.node.samples) == len(report.timed.plain.samples) == timing.RUNS
    assert not report.failures(), report.table()


def test_a_run_off_plain_fails():
    row = sequences.Row("m", "s", "r", error=2e-3, limit=1e-3, finite=True, engine_calls=3)
    assert not row.ok
    assert not dataclasses_replace(row, error=0.0, finite=False).ok
    assert not dataclasses_replace(row, error=0.0, plain_calls=1).ok  # the plain model ran: nothing was compared
    assert dataclasses_replace(row, error=0.0).ok


def dataclasses_replace(row, **changes):
    import dataclasses

    return dataclasses.replace(row, **changes)
