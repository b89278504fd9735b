"""The Accelerated UNet node inside ComfyUI on the GPU, run after run (tests/gpu/sequences.py), and over several GPUs
(tests/gpu/gpus.py), stacked with ComfyUI's own tools (tests/gpu/stacking.py), and beside a second model in one process
(tests/gpu/two_models.py). Run it with tests/gpu/run (quick:
SD1.5 and Flux.1-dev; full: the five models; stack: the stacks' modes; a name: that model, check or mode); without a
CUDA GPU it is skipped.

SD_ACCEL_GPU_MODELS picks the models (quick, full, or names separated by commas); SD_ACCEL_GPU_SETTINGS, the node
settings whose label contains it ("fp8, graphs on"); SD_ACCEL_GPU_RUNS=timed, just each setting's first 20-step run
and its timed run; SD_ACCEL_GPU_REPORT names a folder for each model's table and JSON."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import comfy_helpers as H
import gpus
import hosts
import sequences
import stacking
import two_models
from reporting import report as _report

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the GPU suite runs on one (tests/gpu/run)"),
    pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable())),
]


def _chosen() -> tuple[str, ...]:
    """The models and several-GPU checks (gpus.CHECKS) SD_ACCEL_GPU_MODELS names."""
    wanted = os.environ.get("SD_ACCEL_GPU_MODELS", "quick")
    if wanted == "quick":
        return sequences.QUICK
    if wanted == "full":
        return tuple(n for n in sequences.MODELS if n not in sequences.NOT_IN_FULL)
    if wanted == "stack":
        return stacking.STACK
    names = tuple(n.strip() for n in wanted.split(",") if n.strip())
    known = (*sequences.MODELS, *gpus.CHECKS, *hosts.HOSTS, *stacking.MODES, *two_models.PAIRS)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"SD_ACCEL_GPU_MODELS: unknown {unknown}; use quick, full, stack or {', '.join(known)}")
    return names


@pytest.mark.parametrize("name", [n for n in _chosen() if n in sequences.MODELS])
def test_node_matches_plain_comfyui_run_after_run(name):
    # SD_ACCEL_GPU_QUICK: tests/gpu/run's quick mode, one model per process
    quick = os.environ.get("SD_ACCEL_GPU_MODELS", "quick") == "quick" or os.environ.get("SD_ACCEL_GPU_QUICK") == "1"
    report = sequences.run_model(name, quick=quick, only=os.environ.get("SD_ACCEL_GPU_SETTINGS", ""),
                                 runs=os.environ.get("SD_ACCEL_GPU_RUNS", "all"))
    table = report.table()
    _report(name, table, {"cpu": report.cpu, "load": report.load, "yardstick": report.yardstick,
                          "fp8_yardstick": report.fp8_yardstick, "rows": [dataclasses.asdict(r) for r in report.rows],
                          "notes": report.notes})
    failures = report.failures()
    assert not failures, f"off plain ComfyUI's: {'; '.join(failures)}\n{table}"


@pytest.mark.parametrize("name", [n for n in _chosen() if n in gpus.CHECKS])
def test_node_over_several_gpus_matches_one_gpu(name):
    present = torch.cuda.device_count()  # a count the machine lacks would only repeat a smaller one
    report = gpus.run_check(name, gpus=tuple(g for g in ("2", "4") if int(g) <= present) or ("2",))
    table = report.table()
    _report(name, table, {"yardstick": report.yardstick,
                          "timed": dataclasses.asdict(report.timed) if report.timed else None,
                          "gpus": torch.cuda.device_count(), "rows": [dataclasses.asdict(r) for r in report.rows],
                          "notes": report.notes})
    failures = report.failures()
    assert not failures, f"off the 1-GPU run: {'; '.join(failures)}\n{table}"


@pytest.mark.parametrize("mode", [n for n in _chosen() if n in stacking.MODES])
def test_node_stacked_with_comfyuis_tools_matches_plain_with_the_same_stack(mode):
    reports = stacking.run_mode(mode)
    tables = "\n\n".join(r.table() for r in reports)
    _report(mode, tables, {"stacks": [r.record() for r in reports]})
    failures = [f for r in reports for f in r.failures()]
    assert not failures, f"off plain ComfyUI's with the same stack: {'; '.join(failures)}\n{tables}"


@pytest.mark.parametrize("name", [n for n in _chosen() if n in two_models.PAIRS])
def test_a_second_model_in_one_process_leaves_both_right(name):
    report = two_models.run_pair(name)
    table = report.table()
    _report(name, table, {"visits": [dataclasses.asdict(v) for v in report.visits], "notes": report.notes})
    failures = report.failures()
    assert not failures, f"two models in one process: {'; '.join(failures)}\n{table}"
