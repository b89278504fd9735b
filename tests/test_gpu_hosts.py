"""The GPU suite's A1111/Forge harness (tests/gpu/hosts.py) on the CPU: A1111's server with the tiny checkpoint in
fp32, every case once with the built-in UNet and with sd-accel, through the same code as on the GPU. On the CPU the
torch path runs the built-in's own kernels, so every image equals the built-in's and every step runs the engine."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

import a1111_helpers as a1

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
import hosts  # noqa: E402

@pytest.mark.skipif(a1.missing() is not None, reason=f"A1111 tests: {a1.missing()}")
def test_the_hosts_harness_runs_every_case_through_the_engine(tmp_path):
    model = hosts.TINY["tiny"]
    srv = hosts.start("a1111", tmp_path / "a1111", ("tiny",), gpu=False, models=hosts.TINY)
    try:
        report = hosts.run_model(srv, "a1111", "tiny", model, repeats=1, min_psnr=60)
    finally:
        srv.stop()
    print(report.table())
    assert [r.case for r in report.rows] == list(hosts.cases("a1111", "tiny", model))
    assert not report.failures(), report.table()
    assert all(math.isinf(r.psnr) and r.max_diff == 0 for r in report.rows), report.table()
    assert report.lora_psnr < hosts.MIN_PSNR  # the LoRA cases compare images the LoRA changed
    assert all(r.builtin_s > 0 and r.accel_s > 0 for r in report.rows)
    assert set(report.step_s) == {"built-in", "sd-accel"}
    assert json.loads(json.dumps(report.record()))["rows"][0]["case"] == report.rows[0].case


def test_an_image_off_the_builtin_or_a_run_without_the_engine_fails():
    row = hosts.Row("c", 1, 1.0, 1.0, psnr=40.0, max_diff=3, engine_calls=10, plain_calls=0)
    assert row.ok
    assert not hosts.Row("c", 1, 1.0, 1.0, psnr=25.0, max_diff=60, engine_calls=10, plain_calls=0).ok
    assert not hosts.Row("c", 1, 1.0, 1.0, psnr=math.inf, max_diff=0, engine_calls=0, plain_calls=10).ok
    report = hosts.Report("a1111", "m", lora_psnr=45.0, rows=[row])
    assert report.failures() == ["the LoRA left the built-in's image within the bound (45.0 dB)"]
