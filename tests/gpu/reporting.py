"""The GPU suite's output: each table printed, and with SD_ACCEL_GPU_REPORT, written there with its JSON record."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def report(name: str, table: str, record: dict) -> None:
    """Print the table; with SD_ACCEL_GPU_REPORT, also write it and the record there."""
    print("\n" + table, flush=True)
    folder = os.environ.get("SD_ACCEL_GPU_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"{name}.txt").write_text(table + "\n")
        Path(folder, f"{name}.json").write_text(json.dumps({"model": name, "gpu": torch.cuda.get_device_name(),
                                                            **record}, indent=1))
