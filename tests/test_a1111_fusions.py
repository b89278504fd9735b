"""The torch path's fusions keep the function of the hosts' own UNet classes, which are not ComfyUI's or diffusers':
A1111's (ldm for SD1.x/SD2.x, sgm for SDXL) and Forge's (backend.nn.unet), each in its host's environment
(tests/a1111_helpers.py), kernels in Triton's interpreter on the CPU, fused against unfused, then undone."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import a1111_helpers as a1


def _check(python: str, path: list[Path], *args: str) -> dict:
    link = os.environ["SD_ACCEL_TEST_IMPORT_DIR"]  # tests/conftest.py: the checkout importable as sd_accel
    env = a1.host_env({"PYTHONPATH": os.pathsep.join(map(str, [link, *path])), "TRITON_INTERPRET": "1"})
    run = subprocess.run([python, str(a1.HERE / "fusions_check.py"), *args], capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return {r["model"]: r for r in map(json.loads, (ln for ln in run.stdout.splitlines() if ln.startswith("{")))}


def _assert_same_function(results: dict, models: set, also: tuple[str, ...] = ()) -> None:
    assert set(results) == models
    for r in results.values():
        assert r["rel"] <= 1e-4 and r["undo_exact"], r
        assert all(r["counts"][k] > 0 for k in ("groupnorm", "geglu", "resnet", "qkv", "conv_bias", *also)), r


@pytest.mark.skipif(a1.missing() is not None, reason=f"A1111 tests: {a1.missing()}")
def test_fusions_keep_the_function_of_a1111s_unet_classes_and_undo_restores_them():
    repos = a1.repositories(a1.a1111_root())
    results = _check(a1.python(), [repos / "stable-diffusion-stability-ai", repos / "generative-models"])
    # ldm's and sgm's transformer blocks take the skip-LayerNorm and channels_last layout fusions too
    _assert_same_function(results, {"ldm (SD1.x)", "sgm (SDXL)"}, ("skip_layernorm", "layout"))


@pytest.mark.skipif(a1.forge_missing() is not None, reason=f"Forge tests: {a1.forge_missing()}")
def test_fusions_keep_the_function_of_forges_unet_class_and_undo_restores_it():
    root = Path(os.environ["FORGE_ROOT"])
    # Forge's backend reads its command line at import: --always-cpu keeps it off CUDA.
    results = _check(os.environ["FORGE_PYTHON"], [root, root / "packages_3rdparty"], "--always-cpu")
    _assert_same_function(results, {"forge (SD1.x)", "forge (SDXL)"})
