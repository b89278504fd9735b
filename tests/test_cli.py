"""The commands a user types: doctor, bench --tiny and demo run on a CPU-only machine and say what they did."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str, cwd: str = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "accel", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_doctor_names_device_and_plan():
    from accel.device import describe, detect

    r = run("doctor")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == describe(detect())
    assert "packages: onnxruntime" in r.stdout and "backend: " in r.stdout
    lines = r.stdout.splitlines()
    assert f"cache: {os.environ['SD_ACCEL_CACHE']}" in lines  # conftest sets it
    assert any(line.startswith("settings: ") and "SD_ACCEL_CACHE=" in line for line in lines)
    assert any(line.startswith("versions: sd-accel ") and ", torch " in line for line in lines)


def test_doctor_json_has_what_the_text_shows(tmp_path):
    import torch

    import accel
    from accel.device import detect

    r = run("doctor", "--json", env={"SD_ACCEL_BACKEND": "torch", "SD_ACCEL_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    gpu = detect()
    assert info["gpu"]["vendor"] == gpu.vendor and info["family"] == gpu.family
    assert info["packages"]["onnxruntime"] in (True, False)
    assert info["plan"]["backend"] == "torch" and "SD_ACCEL_BACKEND=torch asked for the torch path." in \
        info["plan"]["reasons"]
    assert info["cache"] == str(tmp_path)
    assert info["settings"]["SD_ACCEL_BACKEND"] == "torch" and info["settings"]["SD_ACCEL_CACHE"] == str(tmp_path)
    assert info["versions"] == {"sd-accel": accel.__version__, "torch": torch.__version__}


def test_doctor_plan_wording_on_the_cpu():
    r = run("doctor", "--backend", "torch", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert "backend: torch (the plain model serves any call it cannot)" in r.stdout.splitlines()
    assert "falls back" not in r.stdout and ". ;" not in r.stdout


def test_bench_tiny_writes_rows_with_errors(tmp_path):
    out = tmp_path / "bench.json"
    r = run("bench", "--tiny", "--iters", "2", "--paths", "torch", "--json", "--json-file", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads(out.read_text())  # --json: stdout is the JSON alone
    rows = json.loads(out.read_text())["unet"]
    variants = {(row["model"], row["variant"]) for row in rows}
    assert ("tiny-sd15", "sd-accel torch") in variants and ("tiny-sdxl", "eager (SDPA)") in variants
    ours = [row for row in rows if row["variant"] == "sd-accel torch"]
    assert all(row["rel_err"] <= 1e-5 and row["ms"] > 0 for row in ours)
    assert "speedup" in r.stderr  # the table, off stdout while it carries the JSON


def test_bench_says_what_it_cannot_time(tmp_path):
    r = run("bench", "--tiny", "--models", "sd21", "--paths", "torch")
    assert r.returncode == 2 and "no 'tiny-sd21' UNet to time; choose from tiny-sd15, tiny-sdxl" in r.stderr
    r = run("bench", "--tiny", "--models", "sd15", "--paths", "torch", "--comfyui", str(tmp_path))
    assert r.returncode == 2 and "is not a ComfyUI checkout" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(not os.environ.get("COMFYUI_ROOT"), reason="COMFYUI_ROOT is not set to a ComfyUI checkout")
def test_bench_times_comfyuis_own_unet(tmp_path):
    out = tmp_path / "bench.json"
    r = run("bench", "--tiny", "--iters", "2", "--paths", "torch", "--comfyui", os.environ["COMFYUI_ROOT"],
            "--json-file", str(out))
    assert "speedup" in r.stdout
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["unet"]
    assert {row["model"] for row in rows} == {"tiny-sd15/comfy", "tiny-sdxl/comfy"}
    assert all(row["rel_err"] <= 1e-5 for row in rows if row["variant"] == "sd-accel torch")


def test_demo_saves_png_and_reports(tmp_path):
    png = tmp_path / "demo.png"
    r = run("demo", "--out", str(png), "--steps", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "agreement:" in r.stdout and "OK" in r.stdout and "path:        torch" in r.stdout


def test_demo_refuses_pickled_checkpoint(tmp_path):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"not really")
    r = run("demo", "--checkpoint", str(ckpt))
    assert r.returncode != 0
    assert "pickled checkpoints" in (r.stdout + r.stderr) and "Traceback" not in r.stderr


def test_profile_classes_sum_to_busy_time_and_top_is_ordered():
    from accel import profile

    kernels = {"sm90_xmma_gemm_f16f16_f16f32": (1.5, 40), "fmha_cutlassF_f16_aligned": (1.0, 16),
               "cudnn::conv2d_fprop_kernel": (2.0, 98), "_group_norm_apply_nhwc": (0.5, 61),
               "vectorized_elementwise_kernel<add>": (0.25, 200), "_geglu_linear_tma_kernel": (0.5, 16),
               "_geglu_kernel": (0.25, 16)}
    classes = profile.by_class(kernels)
    assert classes == {"gemm": 2.0, "attention": 1.0, "conv": 2.0, "norm": 0.5, "elementwise/other": 0.5,
                       "busy total": 6.0, "launches": 447}
    assert [name for name, _, _ in profile.top(kernels, n=2)] == ["cudnn::conv2d_fprop_kernel",
                                                                   "sm90_xmma_gemm_f16f16_f16f32"]
