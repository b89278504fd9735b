"""`bench --gpus` (accel/cli/parallel_bench.py) on the CPU: tiny-wan in 1, 2, 3 and 4 gloo processes through the
command line, every layout's row, outputs as the one-process output, a layout the model refuses as a row that says
why; the inputs a user can get wrong as one line and exit code 2; a failing process as its own message."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import comfy_helpers as H
from sd_accel.accel.cli import parallel_bench
from sd_accel.accel.cli.timing import interleaved

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_comfyui = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sd_accel", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """One run over 1 to 4 processes (4 heads: 3 processes cannot share them) and what it wrote."""
    out = tmp_path_factory.mktemp("bench") / "parallel.json"
    r = run("--tiny", "--gpus", "2,3,4", "--iters", "2", "--comfyui", str(H.comfy_root()),
            "--json-file", str(out))
    return r, json.loads(out.read_text())["parallel"] if out.exists() else None


@needs_comfyui
def test_every_layout_gives_the_one_process_output(worlds):
    r, rows = worlds
    assert r.returncode == 0, r.stderr
    timed = {(row["gpus"], row["layout"]): row for row in rows if row["ms"] is not None}
    assert set(timed) == {(1, "1 GPU"), (2, "sequence"), (2, "CFG"), (4, "sequence"), (4, "CFG x sequence")}, rows
    assert all(row["model"] == "tiny-wan" and row["size"] == "64x64" for row in rows)
    base = timed[1, "1 GPU"]
    # the yardstick: the one-process output moved by one bf16 rounding of its input, far above fp32's differences
    assert base["speedup"] == 1.0 and base["rel_err"] is None and base["noise"] > 1e-4, base
    for key, row in timed.items():
        if key[0] > 1:
            assert 0 <= row["rel_err"] <= 1e-5 and row["noise"] is None, row
            # against the 1-GPU call timed alternately with the layout in its own processes
            assert row["one_gpu_ms"] > 0 and row["speedup"] == pytest.approx(row["one_gpu_ms"] / row["ms"]), row
            assert row["one_gpu_range"][0] <= row["one_gpu_ms"] <= row["one_gpu_range"][1], row
    for row in timed.values():
        assert row["ms_range"][0] <= row["ms"] <= row["ms_range"][1], row
    progress = [f"[tiny-wan 64x64] {w} GPUs, {layout}: " for w, layout in timed if w > 1]
    assert all(line in r.stderr for line in ["[tiny-wan 64x64] 1 GPU: ", *progress]), r.stderr
    assert "tiny-wan" in r.stdout and "CFG x sequence" in r.stdout and "host: CPU " in r.stdout


def test_each_timed_call_follows_an_untimed_call_of_its_own_side():
    """The 1-GPU call reads the host's attention function where a spread call reads its exchange, so the engine's CUDA
    graphs of the shape are captured again at each switch (on a GPU a capture doubled both sides' medians): the
    capture must fall on an untimed call, and the timed one replay."""
    calls = []

    def side(name: str, ms: float):
        return parallel_bench._settled(lambda: calls.append(f"{name} untimed"),
                                       lambda: calls.append(f"{name} timed") or ms)

    assert interleaved(side("1 GPU", 9.0), side("spread", 5.0), 3) == ([9.0] * 3, [5.0] * 3)
    assert calls == ["1 GPU untimed", "1 GPU timed", "spread untimed", "spread timed"] * 3


@needs_comfyui
def test_a_world_that_does_not_divide_the_heads_is_a_row_with_the_reason(worlds):
    r, rows = worlds
    assert [(row["layout"], row["ms"]) for row in rows if row["gpus"] == 3] == [("sequence", None)]
    refused = next(row for row in rows if row["gpus"] == 3)
    assert refused["note"].startswith("refused: 3 processes do not divide the model's 4 attention heads.")
    assert "refused: 3 processes do not divide" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("gpus, bad", [("0", "0"), ("x", "x"), ("1,,2", "")])
def test_a_bad_gpus_value_is_one_line(gpus, bad):
    r = run("--tiny", "--gpus", gpus)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"sd-accel: --gpus {gpus!r}: {bad!r} is not a number of GPUs. Give whole numbers of 1 "
                                "or more, comma-separated, e.g. --gpus 1,2,4.")


def test_more_processes_than_gpus_is_one_line():
    r = run("--gpus", "1,2", CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 2
    assert r.stderr.strip() == ("sd-accel: --gpus asks for 2 CUDA GPUs, and this machine has no CUDA GPUs. Run it on a "
                                "machine with GPUs, or add --tiny to run tiny models in processes on the CPU.")


@needs_comfyui
def test_profile_of_processes_on_the_cpu_is_one_line():
    r = run("--tiny", "--gpus", "2", "--profile", "--comfyui", str(H.comfy_root()))
    assert r.returncode == 2
    assert r.stderr.strip() == ("sd-accel: --profile reads the GPUs' kernel times, and --tiny runs on the CPU. Drop one "
                                "of them.")


def test_collective_kernels_are_a_class_of_their_own():
    from sd_accel.accel.cli.profile import by_class

    kernels = {"ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": (2.0, 3),
               "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT": (5.0, 10), "fmha_cudnn_kernel": (1.5, 2)}
    assert by_class(kernels) == {"collective": 2.0, "gemm": 5.0, "attention": 1.5, "busy total": 8.5, "launches": 15}


@pytest.mark.parametrize("model", ["sdxl", "hunyuan-video15", "ltx2"])
def test_a_model_it_cannot_spread_is_one_line(model):
    r = run("--tiny", "--gpus", "2", "--models", model)
    assert r.returncode == 2 and r.stderr.startswith(f"sd-accel: the multi-GPU bench has no model '{model}'.")
    assert "Traceback" not in r.stderr


def test_a_failing_process_ends_the_bench_with_its_message(tmp_path):
    # A folder that passes for a ComfyUI checkout, whose modules the processes then cannot import.
    fake = tmp_path / "ComfyUI"
    (fake / "comfy" / "ldm" / "modules" / "diffusionmodules").mkdir(parents=True)
    (fake / "comfy" / "ldm" / "modules" / "diffusionmodules" / "openaimodel.py").touch()
    r = run("--tiny", "--gpus", "2", "--comfyui", str(fake))
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("sd-accel bench: rank 0 of 1, building tiny-wan: ModuleNotFoundError: No module named "
                           "'comfy."), r.stderr
    assert "Traceback" not in r.stderr and "[2 GPUs]" not in r.stderr


def test_video_sizes_give_the_native_latents():
    from sd_accel.accel.cli.parallel_bench import model_sizes
    from sd_accel.accel.models.configs import DIT_SHAPES

    assert model_sizes("wan21-14b", "832x480,1280x720") == (("832x480", DIT_SHAPES["wan21-14b"][1]),
                                                             ("1280x720", (90, 160)))
    assert model_sizes("wan22-5b", "1280x704") == (("1280x704", DIT_SHAPES["wan22-5b"][1]),)
    assert model_sizes("sd35-large", "832x480") == (("1024x1024", (128, 128)),)


def test_the_distance_is_from_the_one_process_output(tmp_path):
    from sd_accel.accel.cli.parallel_bench import Job, Result, _compare

    ref = torch.randn(2, 16, 3, 8, 8, generator=torch.Generator().manual_seed(0))

    def job(world: int) -> Job:
        return Job(world, 0, ("tiny-wan",), {}, 1, False, "", str(tmp_path))

    _compare(Result("tiny-wan", "64x64", 1, "1 GPU", ms=8.0), ref, job(1))
    row = Result("tiny-wan", "64x64", 2, "CFG", ms=4.0, one_gpu_ms=8.0)
    _compare(row, ref + 0.01 * ref.norm() / ref.numel() ** 0.5 * torch.randn_like(ref), job(2))
    assert row.rel_err == pytest.approx(0.01, rel=0.05) and row.speedup == 2.0


def test_precision_fp8_rows_name_the_fp8_attention_that_served_them(tmp_path):
    """--paths torch-fp8 (issue 54): rows under precision fp8 beside the auto ones, each compared with the 1-GPU
    output of its own precision, and each saying which fp8 attention kernel served it at which shape (or that the
    attention stayed 16-bit): so that a GPU log shows fp8 attention under sequence parallelism."""
    from sd_accel.accel.cli.parallel_bench import Job, Result, _compare, _line, precisions, table

    assert precisions(["torch", "torch-compile", "onnxruntime"]) == ("auto",)
    assert precisions(["torch-fp8"]) == ("fp8",) and precisions(["torch", "torch-fp8"]) == ("auto", "fp8")
    assert precisions(["onnxruntime"]) == ("auto",)
    assert precisions(["torch-fp8", "torch-int8"]) == ("fp8", "int8")
    ref = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    job = Job(1, 0, ("wan21-1.3b",), {}, 1, False, "", str(tmp_path))
    _compare(Result("wan21-1.3b", "832x480", 1, "1 GPU", ms=8.0), ref, job)
    eight = Result("wan21-1.3b", "832x480", 1, "1 GPU", ms=6.0, precision="fp8", attention="cuDNN at 2x32760x12x128")
    _compare(eight, -ref, job)  # its own reference: the auto row's is not overwritten
    spread = Result("wan21-1.3b", "832x480", 2, "sequence", ms=3.0, one_gpu_ms=6.0, precision="fp8",
                    attention="cuDNN at 2x32760x6x128 exchanged over 2 processes")
    _compare(spread, -ref, Job(2, 0, ("wan21-1.3b",), {}, 1, False, "", str(tmp_path)))
    assert spread.rel_err == 0.0
    assert _line(spread).endswith("; fp8 attention: cuDNN at 2x32760x6x128 exchanged over 2 processes")
    sixteen = Result("wan21-1.3b", "832x480", 2, "CFG", ms=3.0, one_gpu_ms=6.0, speedup=2.0, rel_err=0.0,
                     precision="fp8", attention="")
    assert _line(sixteen).endswith("; fp8 attention: none, the attention ran in 16 bits")
    lines = table([eight, spread, sixteen]).splitlines()
    assert lines[2].startswith("wan21-1.3b fp8 832x480")
    assert lines[3].strip() == "fp8 attention: cuDNN at 2x32760x12x128"
    assert "fp8 attention" not in _line(Result("wan21-1.3b", "832x480", 1, "1 GPU", ms=8.0, speedup=1.0, noise=1e-3))
