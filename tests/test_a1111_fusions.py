"""The torch path's fusions keep the function of A1111's own UNet classes (ldm's for SD1.x/SD2.x, sgm's for SDXL),
which are not ComfyUI's or diffusers': run in A1111's environment (tests/a1111_helpers.py), kernels in Triton's
interpreter on the CPU, fused against unfused, then undone."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import a1111_helpers as a1

pytestmark = pytest.mark.skipif(a1.missing() is not None, reason=f"A1111 tests: {a1.missing()}")


def test_fusions_keep_the_function_of_a1111s_unet_classes_and_undo_restores_them():
    repos = a1.repositories(a1.a1111_root())
    path = os.pathsep.join(str(p) for p in (a1.REPO, repos / "stable-diffusion-stability-ai",
                                             repos / "generative-models"))
    run = subprocess.run([a1.python(), str(a1.HERE / "fusions_check.py")], capture_output=True, text=True,
                         timeout=600, env=a1.host_env({"PYTHONPATH": path, "TRITON_INTERPRET": "1"}))
    assert run.returncode == 0, run.stderr[-3000:]
    results = {r["model"]: r for r in map(json.loads, (ln for ln in run.stdout.splitlines() if ln.startswith("{")))}
    assert set(results) == {"ldm (SD1.x)", "sgm (SDXL)"}
    for r in results.values():
        assert r["rel"] <= 1e-4 and r["undo_exact"], r
        assert all(r["counts"][k] > 0 for k in ("groupnorm", "geglu", "resnet", "qkv", "conv_bias")), r
