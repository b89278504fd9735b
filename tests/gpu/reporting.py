"""The GPU suite's output: each table printed, and with SD_ACCEL_GPU_REPORT, written there with its JSON record."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def report(name: str, table: str, record: dict) -> None:
    """Print the table; with SD_ACCEL_GPU_REPORT, also write it and the record there."""
    print("\n" + table, flush=True)
    folder = _folder()
    if folder:
        Path(folder, f"{name}.txt").write_text(table + "\n")
        Path(folder, f"{name}.json").write_text(json.dumps({"model": name, "gpu": _gpu(), **record}, indent=1))


def yardsticks(name: str, yardstick: float, fp8_yardstick: float | None, notes: list[str]) -> None:
    """With SD_ACCEL_GPU_REPORT, write a model's yardsticks there as soon as they are measured (NAME.yardstick.json),
    so that a call its time limit ends in the sequences leaves them for SD_ACCEL_GPU_YARDSTICK to give the next."""
    folder = _folder()
    if folder:
        Path(folder, f"{name}.yardstick.json").write_text(json.dumps(
            {"model": name, "gpu": _gpu(), "yardstick": yardstick, "fp8_yardstick": fp8_yardstick, "notes": notes},
            indent=1))


def _folder() -> Path | None:
    """SD_ACCEL_GPU_REPORT's folder, made where it names one."""
    folder = os.environ.get("SD_ACCEL_GPU_REPORT")
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder)


def _gpu() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
