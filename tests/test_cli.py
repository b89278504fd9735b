"""The commands a user types: doctor, bench --tiny and demo run on a CPU-only machine and say what they did."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import comfy_helpers as H

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str, cwd: str = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}  # PYTHONPATH: the tests' import link (conftest.py), not the checkout
    return subprocess.run([sys.executable, "-m", "sd_accel", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_doctor_names_device_and_plan():
    from sd_accel.accel.plan.device import describe, detect

    r = run("doctor")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == describe(detect())
    assert "packages: onnxruntime" in r.stdout and "backend: " in r.stdout
    lines = r.stdout.splitlines()
    assert f"cache: {os.environ['SD_ACCEL_CACHE']}" in lines  # conftest sets it
    assert any(line.startswith("settings: ") and "SD_ACCEL_CACHE=" in line for line in lines)
    assert any(line.startswith("versions: sd-accel ") and ", torch " in line for line in lines)
    if not torch.cuda.is_available():
        assert "fp8 attention (precision fp8, fp8 weights): no, it runs on NVIDIA GPUs only (cuDNN); 16-bit " \
               "attention" in lines


def test_doctor_json_has_what_the_text_shows(tmp_path):
    import torch

    import sd_accel.accel
    from sd_accel.accel.plan.device import detect

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
    assert info["versions"] == {"sd-accel": sd_accel.accel.__version__, "torch": torch.__version__}
    assert info["packages"]["cudnn_frontend"] in (True, False)
    assert info["packages"]["flash_attn_4"] in (True, False) and info["packages"]["fa3_fwd"] in (True, False)
    if not torch.cuda.is_available():
        assert info["fp8_attention"] == {"available": False, "why": "it runs on NVIDIA GPUs only (cuDNN)"}
        assert info["flash_attention_4"] == {"available": False, "why": "it runs on NVIDIA GPUs only"}
        assert info["flash_attention_3"] == {"available": False, "why": "it runs on NVIDIA GPUs only"}


def test_doctor_plan_wording_on_the_cpu():
    r = run("doctor", "--backend", "torch", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert "backend: torch (the plain model serves any call it cannot)" in r.stdout.splitlines()
    assert "falls back" not in r.stdout and ". ;" not in r.stdout


def test_doctor_json_into_a_pipe_closed_early_exits_cleanly():
    """`doctor --json | head -0`: the reader is gone before the JSON is written."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.Popen([sys.executable, "-m", "sd_accel", "doctor", "--json"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=600) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err


def test_usage_names_the_command_as_typed(tmp_path):
    assert run("--help").stdout.startswith("usage: python -m sd_accel ")
    assert run("cache", "--help").stdout.startswith("usage: python -m sd_accel cache ")
    # The console script pip installs runs a file named sd-accel that calls main().
    script = tmp_path / "sd-accel"
    script.write_text("import sys\nfrom sd_accel.accel.cli.main import main\nsys.exit(main())\n")
    r = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.startswith("usage: sd-accel "), r.stdout + r.stderr


def test_cache_info_of_an_unknown_key_is_one_line_with_the_fix(tmp_path):
    r = run("cache", "info", "0123abcd", "--root", str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith("sd-accel: ") and "'0123abcd'" in line and "cache ls" in line


def test_log_lines_start_on_their_own_line_while_a_bar_is_open():
    """A host's sampler bar is open while the first step builds the engine: the engine's log line must not be
    written after the bar's text."""
    import io
    import logging

    from tqdm import tqdm

    from sd_accel.accel.progress import keep_logs_off_bars

    out = io.StringIO()
    logger = logging.getLogger("sd-accel.test-bars")
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    keep_logs_off_bars(logger)
    try:
        bar = tqdm(total=2, desc="sampling", file=out)
        bar.update(1)
        logger.warning("sd-accel: the torch path is ready")
        bar.close()
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    before = text[:text.index("sd-accel: the torch path is ready")]
    assert "sampling" in before and before.rsplit("\r", 1)[-1].strip() == ""


def test_checkpoint_cast_says_only_real_float32_warnings():
    """demo --checkpoint casts the UNet and the VAE: diffusers warned twice that modules 'should be kept in
    float32: []', naming none. A model that has such modules still gets diffusers' warning."""
    import logging

    import torch
    from diffusers import AutoencoderKL
    from diffusers.utils import logging as diffusers_logging

    from sd_accel.accel.models.checkpoint import _cast

    said: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    # What diffusers' logger says, read from the logger itself: its stream handler keeps the stderr of the test that
    # first configured it.
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_warning()  # as in a demo process (building the random-weight models lowers it)
    root, handler = logging.getLogger("diffusers"), Collect()
    root.addHandler(handler)
    try:
        _cast(vae, "cpu", torch.float16)
        assert next(vae.parameters()).dtype == torch.float16
        assert not any("kept in float32" in m for m in said)
        vae._keep_in_fp32_modules = ["quant_conv"]
        _cast(vae, "cpu", torch.float32)
        assert any("should be kept in float32: ['quant_conv']" in m for m in said)
    finally:
        root.removeHandler(handler)
        diffusers_logging.set_verbosity(verbosity)


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
    # each row's times, and for a row after eager's the eager runs interleaved with them (tests/test_bench_timing.py)
    for row in rows:
        assert set(row["timed"]) == {"median", "min", "max", "times"}
        assert len(row["timed"]["times"]) == 2 and row["timed"]["median"] == row["ms"]
        assert (row["baseline"] is None) == row["variant"].startswith("eager (")
    assert all(len(row["baseline"]["times"]) == 2 for row in ours)
    host = json.loads(out.read_text())["host"]
    assert host["cpu"].endswith(" cores)") and "load" in host
    lines = r.stderr.splitlines()
    assert lines[-1].startswith(f"host: CPU {host['cpu']}, load ")
    head = next(line for line in lines if line.startswith("model "))  # the table, off stdout while it carries the JSON
    # On the CPU no speed-up is claimed, as the demo says: the times, no ratios, and one line saying why.
    assert "ms/step" in head and "speedup" not in head
    assert all(row["speedup"] is None for row in rows) and not re.search(r"ms/step, x\d", r.stderr)
    assert any(line.startswith("speedup: none on the CPU, so no speed-up is claimed") for line in lines)
    legend = [line for line in lines if line.startswith("setup s = ")]
    assert legend and "seen shape = a call at a shape already captured" in legend[0]


def test_bench_times_diffusion_transformers_with_their_floor(tmp_path):
    out = tmp_path / "bench.json"
    r = run("bench", "--tiny", "--models", "flux,sd3", "--iters", "2", "--paths", "torch,onnxruntime",
            "--json-file", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["unet"]
    by = {(row["model"], row["variant"].split(":")[0]): row for row in rows}
    for model in ("tiny-flux/diffusers", "tiny-sd3/diffusers"):
        eager, ours = by[(model, "eager (SDPA)")], by[(model, "sd-accel torch")]
        assert ours["rel_err"] <= 1e-5 and ours["ms"] > 0
        assert eager["extra"]["tflop"] >= 0 and eager["extra"]["floor_ms"] > 0  # the FLOP count and its floor
        assert (model, "floor") in by
        # the ONNX Runtime path builds UNets only: it says so instead of timing the torch path under its name
        assert "UNets only" in by[(model, "sd-accel onnxruntime")]["note"]
    assert by[("tiny-flux/diffusers", "eager (SDPA)")]["extra"]["batch"] == 1  # guidance-distilled: no CFG batch


def test_bench_times_a_second_checkpoint_built_from_the_cached_onnxruntime_graph(tmp_path):
    """onnxruntime-refit: the path's row, then another checkpoint of the model built from the cached graph with its
    own weights put in (no export), each against its own fp32 output."""
    pytest.importorskip("onnxruntime")
    out = tmp_path / "bench.json"
    r = run("bench", "--tiny", "--models", "sd15", "--iters", "2", "--no-compile", "--paths", "onnxruntime-refit",
            "--json-file", str(out), env={"SD_ACCEL_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    rows = {row["variant"]: row for row in json.loads(out.read_text())["unet"]}
    first, second = rows["sd-accel onnxruntime"], rows["sd-accel onnxruntime, 2nd checkpoint"]
    assert first["rel_err"] <= 1e-4 and second["rel_err"] <= 1e-4 and second["setup_s"] > 0
    stages = [line for line in r.stderr.splitlines() if "second checkpoint build stage" in line]
    assert any("stage refit:" in line for line in stages) and not any("stage export:" in line for line in stages)


def test_bench_vae_prints_a_table(tmp_path):
    out = tmp_path / "bench.json"
    r = run("bench", "--vae", "--tiny", "--vae-sizes", "64", "--json-file", str(out))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "{" not in r.stdout  # no Python dicts
    assert lines[0] == "VAE decode, float32 on cpu"
    assert lines[1].split()[:3] == ["px", "untiled", "ms"] and set(lines[2]) == {"-"}
    row = json.loads(out.read_text())["vae"][0]
    cells = lines[3].split()
    assert cells[0] == "64" and cells[1] == f"{row['untiled_ms']:.1f}" and row["grid"] in cells


def test_vae_table_leaves_out_columns_without_figures():
    from sd_accel.accel.cli.vae_bench import table

    cpu = {"size": 64, "dtype": "float32", "device": "cpu", "untiled_ms": 5.0, "untiled_peak_gb": None,
           "tiled_ms": 9.0, "tiled_peak_gb": None, "tile": 16, "grid": "4x4", "store": "cpu", "capped_ms": None,
           "capped_peak_gb": None, "capped_plan": None, "compare_tile": "16/8", "psnr_tiled_db": 120.0,
           "psnr_naive_db": 30.0, "notes": ""}
    text = table([cpu])
    assert "GB" not in text.splitlines()[1] and "capped" not in text
    assert "tile/overlap 16/8 px" in text
    gpu = {**cpu, "device": "cuda", "untiled_ms": "OOM", "untiled_peak_gb": "OOM", "capped_ms": 7.0,
           "capped_peak_gb": 3.5, "capped_plan": "512 px x 2x2 on cpu", "compare_tile": None}
    lines = table([gpu]).splitlines()
    assert "capped GB" in lines[1] and lines[3].split()[1:3] == ["OOM", "OOM"]
    assert "    capped: 512 px x 2x2 on cpu" in lines


def test_bench_says_what_it_cannot_time(tmp_path):
    r = run("bench", "--tiny", "--models", "sd21", "--paths", "torch")
    assert r.returncode == 2 and "no 'tiny-sd21' model to time. Choose from tiny-sd15, tiny-sdxl, tiny-flux" in r.stderr
    r = run("bench", "--tiny", "--models", "sd15", "--paths", "torch", "--comfyui", str(tmp_path))
    assert r.returncode == 2 and "is not a ComfyUI checkout" in r.stderr and "Traceback" not in r.stderr
    r = run("bench", "--vae", "--tiny", "--models", "wan21")
    assert r.returncode == 2 and "builds ComfyUI's Wan VAEs. Pass --comfyui DIR" in r.stderr


@pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))
def test_bench_wan_vae_checks_the_video_sizes():
    r = run("bench", "--vae", "--models", "wan22", "--video-sizes", "1280x712", "--comfyui", str(H.comfy_root()))
    assert r.returncode == 2 and "'1280x712' is not a video size wan22 decodes" in r.stderr
    assert "multiple of 16" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))
def test_bench_times_comfyuis_own_unet(tmp_path):
    out = tmp_path / "bench.json"
    r = run("bench", "--tiny", "--iters", "2", "--paths", "torch", "--comfyui", str(H.comfy_root()),
            "--json-file", str(out))
    assert "speedup" in r.stdout
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["unet"]
    assert {row["model"] for row in rows} == {"tiny-sd15/comfy", "tiny-sdxl/comfy"}
    assert all(row["rel_err"] <= 1e-5 for row in rows if row["variant"] == "sd-accel torch")


@pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))
def test_bench_runs_comfyuis_classes_with_the_attention_its_flags_choose(tmp_path):
    """--comfy-attention split starts ComfyUI as --use-split-cross-attention does (sage and flash need their packages
    and a GPU): the eager rows run it and say so; every row's error is against exact attention."""
    import importlib.util

    out = tmp_path / "bench.json"
    r = run("bench", "--tiny", "--models", "flux,sd15", "--iters", "1", "--paths", "torch", "--comfyui",
            str(H.comfy_root()), "--comfy-attention", "split", "--json-file", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["unet"]
    by = {(row["model"], row["variant"]): row for row in rows}
    for model in ("tiny-flux/comfy", "tiny-sd15/comfy"):
        eager, ours = by[(model, "eager (ComfyUI's split attention)")], by[(model, "sd-accel torch")]
        assert 0 < eager["rel_err"] <= 1e-5 and ours["rel_err"] <= 1e-5, (eager, ours)
    r = run("bench", "--tiny", "--models", "flux", "--comfy-attention", "split")
    assert r.returncode == 2 and "Pass --comfyui DIR" in r.stderr
    r = run("bench", "--tiny", "--gpus", "2", "--comfyui", str(H.comfy_root()), "--comfy-attention", "split")
    assert r.returncode == 2 and "does not reach the --gpus ranks" in r.stderr and "Traceback" not in r.stderr
    if importlib.util.find_spec("sageattention") is None:
        r = run("bench", "--tiny", "--models", "flux", "--comfyui", str(H.comfy_root()), "--comfy-attention",
                "sage")
        assert r.returncode == 2 and "needs the sageattention package" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))
@pytest.mark.parametrize("name,cls,batch", [("z-image", "ZImage", 1), ("hunyuan-video15", "HunyuanVideo15", 2),
                                            ("ltx2", "LTXAV", 2)])
def test_bench_times_comfyui_033s_models_in_comfyuis_class(tmp_path, name, cls, batch):
    """bench --models z-image / hunyuan-video15 / ltx2 builds ComfyUI 0.33's class in the model's form (NextDiT in
    Z-Image's, HunyuanVideo in 1.5's, LTXAVModel in LTX-2's, on its video and audio latents; tiny-<name> with --tiny)
    and times it at the batch a step runs (Z-Image-Turbo at CFG 1, HunyuanVideo 1.5 and LTX-2 with CFG's two halves);
    the torch path's output is the fp32 reference's."""
    H.import_comfy()  # for the version the skip names
    if f"class {cls}(" not in (H.comfy_root() / "comfy" / "supported_models.py").read_text():
        pytest.skip(f"ComfyUI {H.comfy_version()} has no {name} (supported_models.{cls})")
    out = tmp_path / "bench.json"
    r = run("bench", "--tiny", "--models", name, "--iters", "1", "--paths", "torch", "--no-compile",
            "--comfyui", str(H.comfy_root()), "--json-file", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["unet"]
    by = {(row["model"], row["variant"].split(":")[0]): row for row in rows}
    ours = by[(f"tiny-{name}/comfy", "sd-accel torch")]
    assert ours["rel_err"] <= 1e-5 and ours["ms"] > 0 and ours["extra"]["batch"] == batch
    assert (f"tiny-{name}/comfy", "floor") in by


def test_demo_saves_png_and_reports(tmp_path):
    png = tmp_path / "demo.png"
    r = run("demo", "--out", str(png), "--steps", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "agreement:" in r.stdout and "OK" in r.stdout and "path:        torch" in r.stdout
    lines = r.stdout.splitlines()
    # On the CPU the torch path is the plain model: no speed-up is claimed, no second time to compare, and no graphs
    # (the plan has none).
    assert "accelerated: none on the CPU: the torch path runs the plain model there, so no speed-up is claimed " \
           "(the torch path's kernels and graphs need a GPU)." in lines
    assert "speed-up x" not in r.stdout and r.stdout.count("ms/step") == 1 and "noise" not in r.stdout
    # Progress bars are for a terminal: piped, as here, no bar or its remnant ("prepare torch path:   0%|") shows.
    assert "%|" not in r.stdout + r.stderr and "prepare torch path" not in r.stdout + r.stderr
    build = next(line for line in lines if line.startswith("build:"))
    assert "no graphs: cuda_graphs is off in the plan" in build and "captured" not in build
    assert "saves no engine" in build
    # The file is what the tiny VAE decodes (x2 of the 16x16 latent), and the path is absolute.
    assert f"image:       {png}" in lines
    assert any("the decoded image, 32x32" in line for line in lines)
    from PIL import Image

    assert Image.open(png).size == (32, 32)


def test_demo_relative_out_is_printed_absolute(tmp_path):
    r = run("demo", "--out", "rel.png", "--steps", "2", "--backend", "off", cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"image:       {tmp_path / 'rel.png'}" in r.stdout.splitlines()
    assert "accelerated: none: acceleration is off, so both runs are the plain model and no speed-up is claimed." \
        in r.stdout.splitlines() and "speed-up x" not in r.stdout


def test_demo_on_onnxruntime_reports_the_cache_and_keeps_ort_quiet(tmp_path):
    pytest.importorskip("onnxruntime")
    env = {"SD_ACCEL_CACHE": str(tmp_path / "cache")}
    args = ("demo", "--backend", "onnxruntime", "--steps", "2", "--out", str(tmp_path / "o.png"))
    first = run(*args, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "path:        onnxruntime" in first.stdout
    build = next(line for line in first.stdout.splitlines() if line.startswith("build:"))
    assert "the onnxruntime engine was built in" in build and "torch path" not in build
    # ORT's optimizer lines ("Fused Gelu: 4", "Removed 54 Identity nodes") are dropped; sd-accel's own stay.
    both = first.stdout + first.stderr
    assert "Fused " not in both and "Removed " not in both and "opset version" not in both
    assert "sd-accel: onnxruntime engine built in" in first.stderr
    second = run(*args, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "the onnxruntime engine was loaded from the cache" in second.stdout


def test_demo_refuses_pickled_checkpoint(tmp_path):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"not really")
    r = run("demo", "--checkpoint", str(ckpt))
    assert r.returncode != 0
    assert "pickled checkpoints" in (r.stdout + r.stderr) and "Traceback" not in r.stderr


def test_profile_classes_sum_to_busy_time_and_top_is_ordered():
    from sd_accel.accel.cli import profile

    kernels = {"sm90_xmma_gemm_f16f16_f16f32": (1.5, 40), "fmha_cutlassF_f16_aligned": (1.0, 16),
               "cudnn::conv2d_fprop_kernel": (2.0, 98), "_group_norm_apply_nhwc": (0.5, 61),
               "vectorized_elementwise_kernel<add>": (0.25, 200), "_geglu_linear_tma_kernel": (0.5, 16),
               "_geglu_kernel": (0.25, 16)}
    classes = profile.by_class(kernels)
    assert classes == {"gemm": 2.0, "attention": 1.0, "conv": 2.0, "norm": 0.5, "elementwise/other": 0.5,
                       "busy total": 6.0, "launches": 447}
    assert [name for name, _, _ in profile.top(kernels, n=2)] == ["cudnn::conv2d_fprop_kernel",
                                                                   "sm90_xmma_gemm_f16f16_f16f32"]


def test_bench_first_call_times_each_size_in_fresh_processes():
    r = run("bench", "--first-call", "--tiny", "--models", "sd15", "--iters", "2", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["first_call"]
    processes = ["1: empty Triton cache", "2: after process 1", "3: empty, compiled in turn", "4: with cuDNN search"]
    assert [(row["process"], row["shape"]) for row in rows] == [(p, s) for p in processes for s in ("64x64", "64x96")]
    assert all(row["first_s"] > 0 and row["second_s"] > 0 and row["steady_ms"] > 0 for row in rows)
    assert "first s" in r.stderr and "Triton's compilation = process 1 - process 2" in r.stderr
    bad = run("bench", "--first-call", "--models", "sd99")
    assert bad.returncode == 2 and "no first-call shapes for 'sd99'" in bad.stderr


def test_bench_runs_in_its_own_process_when_the_hosts_folder_is_on_the_path_through_a_link(tmp_path, monkeypatch):
    """`bench --comfyui DIR` starts itself again with DIR on PYTHONPATH only where the folder is not on the import path
    already; a folder on it through a link (a checkout whose ../shared is one) counts as on it."""
    import argparse

    from sd_accel.accel.cli import main as cli

    tree = tmp_path / "ComfyUI"
    (tree / "comfy" / "ldm" / "modules" / "diffusionmodules").mkdir(parents=True)
    (tree / "comfy" / "ldm" / "modules" / "diffusionmodules" / "openaimodel.py").write_text("")
    link = tmp_path / "linked"
    link.symlink_to(tree)
    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, env: calls.append(env["PYTHONPATH"]) or 0)
    args = argparse.Namespace(comfyui=str(tree), a1111=None, forge=None, kernels=False, vae=False, first_call=False,
                              unet=False, gpus=None, argv=["bench", "--comfyui", str(tree)])
    assert cli._host_process(args) == 0
    assert calls[0].split(os.pathsep)[0] == str(tree)
    monkeypatch.syspath_prepend(str(link))
    assert cli._host_process(args) is None
    assert len(calls) == 1
