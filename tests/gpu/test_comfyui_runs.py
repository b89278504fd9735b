"""The Accelerated UNet node inside ComfyUI on the GPU, run after run (tests/gpu/sequences.py). Run it with
tests/gpu/run (quick: SD1.5 and Flux.1-dev; full: the five models); without a CUDA GPU it is skipped.

SD_ACCEL_GPU_MODELS picks the models (quick, full, or names separated by commas); SD_ACCEL_GPU_SETTINGS, the node
settings whose label contains it ("fp8, graphs on"); SD_ACCEL_GPU_REPORT names a folder for each model's table and
JSON."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

import comfy_helpers as H
import sequences

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the GPU suite runs on one (tests/gpu/run)"),
    pytest.mark.skipif(H.comfy_root() is None, reason="COMFYUI_ROOT is not set to a ComfyUI checkout"),
]


def _chosen() -> tuple[str, ...]:
    wanted = os.environ.get("SD_ACCEL_GPU_MODELS", "quick")
    if wanted == "quick":
        return sequences.QUICK
    if wanted == "full":
        return tuple(n for n in sequences.MODELS if n not in sequences.NOT_IN_FULL)
    names = tuple(n.strip() for n in wanted.split(",") if n.strip())
    unknown = [n for n in names if n not in sequences.MODELS]
    if unknown:
        raise ValueError(f"SD_ACCEL_GPU_MODELS: unknown {unknown}; use quick, full or {', '.join(sequences.MODELS)}")
    return names


@pytest.mark.parametrize("name", _chosen())
def test_node_matches_plain_comfyui_run_after_run(name):
    report = sequences.run_model(name, quick=os.environ.get("SD_ACCEL_GPU_MODELS", "quick") == "quick",
                                 only=os.environ.get("SD_ACCEL_GPU_SETTINGS", ""))
    table = report.table()
    print("\n" + table, flush=True)
    folder = os.environ.get("SD_ACCEL_GPU_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"{name}.txt").write_text(table + "\n")
        Path(folder, f"{name}.json").write_text(json.dumps(
            {"model": name, "gpu": torch.cuda.get_device_name(), "yardstick": report.yardstick,
             "rows": [dataclasses.asdict(r) for r in report.rows], "notes": report.notes}, indent=1))
    failures = report.failures()
    assert not failures, f"off plain ComfyUI's: {'; '.join(failures)}\n{table}"
