"""The extension inside A1111 and Forge on the GPU (tests/gpu/hosts.py): `tests/gpu/run a1111` and `tests/gpu/run
forge` (or both, a1111,forge) run them; no other mode does. Skipped without a CUDA GPU, and, naming what is missing,
without the host (tests/a1111_helpers.py; on a machine without a package index tests/gpu/host-env makes its
Python). With SD_ACCEL_GPU_REPORT, each host's tables, JSON and server console are written there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import hosts
from reporting import report

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA GPU: the GPU suite runs on one (tests/gpu/run)")


@pytest.mark.parametrize("host", hosts.chosen(os.environ.get("SD_ACCEL_GPU_MODELS", "quick")))
def test_sd_accel_in_the_host_matches_its_builtin_unet(host, tmp_path):
    if hosts.missing(host):
        pytest.skip(f"{host}: {hosts.missing(host)}")
    reports, console = hosts.run_host(host, tmp_path / host)
    folder = os.environ.get("SD_ACCEL_GPU_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"{host}-server.log").write_text(console)
    for r in reports:
        report(f"{host}-{r.model}", r.table(), r.record())
    failures = [f"{r.model}: {f}" for r in reports for f in r.failures()]
    assert not failures, "off the built-in UNet's images: " + "; ".join(failures)
