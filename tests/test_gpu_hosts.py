"""The GPU suite's A1111/Forge harness (tests/gpu/hosts.py) on the CPU: A1111's server with the tiny checkpoint in
fp32, every case once with the built-in UNet and with sd-accel, then the two step counts timed with the settings
alternating (timing.CPU_RUNS of each, not the GPU's 5: this checks the timing's code, not its figures, which on the CPU are
the server's noise), through the same code as on the GPU. On the CPU the torch path runs the built-in's own kernels,
so every image equals the built-in's and every step runs the engine."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

import a1111_helpers as a1

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
import hosts  # noqa: E402
import timing  # noqa: E402

# Timed requests of each setting per step count: the suite's CPU count (each adds 4 requests to the test; the order and
# the range are checked with fake timers in tests/test_gpu_timing.py and below).
RUNS_HERE = timing.CPU_RUNS


@pytest.mark.skipif(a1.missing() is not None, reason=f"A1111 tests: {a1.missing()}")
def test_the_hosts_harness_runs_every_case_through_the_engine(tmp_path):
    model = hosts.TINY["tiny"]
    srv = hosts.start("a1111", tmp_path / "a1111", ("tiny",), gpu=False, models=hosts.TINY)
    try:
        report = hosts.run_model(srv, "a1111", "tiny", model, runs=RUNS_HERE, min_psnr=60)
    finally:
        srv.stop()
    print(report.table())
    assert [r.case for r in report.rows] == list(hosts.cases("a1111", "tiny", model))
    assert not report.failures(), report.table()
    assert all(math.isinf(r.psnr) and r.max_diff == 0 for r in report.rows), report.table()
    assert report.lora_psnr < hosts.MIN_PSNR  # the LoRA cases compare images the LoRA changed
    assert all(r.builtin_s > 0 and r.accel_s > 0 for r in report.rows)
    assert set(report.step_s) == {"built-in", "sd-accel"}
    few, many = model.steps
    timed = [r for r in report.rows if r.timed]
    assert [r.case for r in timed] == [f"{many} steps", f"{few} steps"]
    for r in timed:  # the row's seconds are the interleaved medians, its speed-up their ratio
        assert all(len(s.samples) == RUNS_HERE for s in (r.timed.builtin, r.timed.accel, r.timed.builtin_switch,
                                                         r.timed.accel_switch))
        assert (r.builtin_s, r.accel_s) == (r.timed.builtin.median, r.timed.accel.median)
        assert r.timed.cpu and f"{r.timed.ratio:.2f}x" in report.table()
    assert report.step_s["sd-accel"] == (timed[0].accel_s - timed[1].accel_s) / (many - few)
    assert "interleaved warm runs each" in report.table()
    assert json.loads(json.dumps(report.record()))["rows"][0]["case"] == report.rows[0].case


def test_an_image_off_the_builtin_or_a_run_without_the_engine_fails():
    row = hosts.Row("c", 1, 1.0, 1.0, psnr=40.0, max_diff=3, engine_calls=10, plain_calls=0)
    assert row.ok
    assert not hosts.Row("c", 1, 1.0, 1.0, psnr=25.0, max_diff=60, engine_calls=10, plain_calls=0).ok
    assert not hosts.Row("c", 1, 1.0, 1.0, psnr=math.inf, max_diff=0, engine_calls=0, plain_calls=10).ok
    report = hosts.Report("a1111", "m", lora_psnr=45.0, rows=[row])
    assert report.failures() == ["the LoRA left the built-in's image within the bound (45.0 dB)"]


def test_a_ratio_only_of_interleaved_medians():
    spread = hosts.timing.Spread.of
    timed = hosts.Timed(spread([2.0, 2.2, 1.9]), spread([1.0, 1.1, 0.9]), spread([2.5] * 3), spread([4.0] * 3),
                        "Some CPU (2 cores)", 1.5)
    rows = [hosts.Row("20 steps", 1, 2.0, 1.0, math.inf, 0, 20, 0, timed=timed),
            hosts.Row("hires fix", 1, 3.0, 1.0, math.inf, 0, 20, 0)]
    table = hosts.Report("a1111", "m", step_s={"built-in": 0.1, "sd-accel": 0.05}, rows=rows).table()
    assert rows[0].line().split()[2:5] == ["2.000", "1.000", "2.00x"]
    assert rows[1].line().split()[2:5] == ["3.000", "1.000", "-"]  # one request of each setting: no ratio
    assert ("timed 20 steps: sd-accel median 1.00 s (0.900-1.10), built-in 2.00 s (1.90-2.20) over 3 interleaved "
            "warm runs each: 2.00x; CPU Some CPU (2 cores), load 1.50") in table
    assert "after each switch (the few-steps case): sd-accel 4.00 s (4.00-4.00), built-in 2.50 s" in table
