"""Bad input to `python -m sd_accel`: one line naming the option, file or setting and the fix, exit code 2, no stack
trace, nothing written to the engine cache, and no slow work done before the input is checked (the one line is all
the command printed: no model was built, nothing was timed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SD15_KEY = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"


def run(*args: str, cache: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, **env, "SD_ACCEL_CACHE": cache}  # PYTHONPATH: the tests' import link (conftest.py)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=600)


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stdout + r.stderr
    return lines[0]


def _valid(path):
    save_file({"w": torch.zeros(64)}, str(path))


def _text(path):
    path.write_text("this is not a checkpoint\n")


def _truncated(path):
    _valid(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


CASES = {
    "text": ("x.safetensors", _text, "is not a readable .safetensors file"),
    "truncated": ("cut.safetensors", _truncated, "is not a readable .safetensors file"),
    "folder": ("folder.safetensors", lambda p: p.mkdir(), "is a folder, not a file"),
    "missing-ckpt": ("missing.ckpt", lambda p: None, "not found"),
    "missing": ("missing.safetensors", lambda p: None, "not found"),
    "upper-case-suffix": ("X.SAFETENSORS", _valid, "is not an SD1.x, SD2.x or SDXL checkpoint"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_checkpoint_is_one_line_with_the_fix(tmp_path, case):
    name, make, words = CASES[case]
    path = tmp_path / name
    make(path)
    cache = tmp_path / "cache"
    line = one_line(run("-m", "sd_accel", "demo", "--checkpoint", str(path), "--out", str(tmp_path / "o.png"),
                        cache=str(cache)))
    assert line.startswith("sd-accel: ") and name in line and words in line
    assert "pickled" not in line  # only a .ckpt/.pt file that exists is refused for being pickled
    assert ("Give the path" in line or "Download it again" in line or "Use a single-file" in line)
    assert not cache.exists() or not any(cache.iterdir())
    assert not (tmp_path / "o.png").exists()


def test_upper_case_suffix_is_read_as_safetensors(tmp_path):
    from sd_accel.accel.models.checkpoint import check_checkpoint

    path = tmp_path / "MODEL.SAFETENSORS"
    save_file({SD15_KEY: torch.zeros(320, 768)}, str(path))
    assert check_checkpoint(path) == (path, "sd15")


def test_checkpoint_missing_weights_is_one_line(tmp_path):
    path = tmp_path / "partial.safetensors"
    save_file({SD15_KEY: torch.zeros(320, 768)}, str(path))
    line = one_line(run("-m", "sd_accel", "demo", "--checkpoint", str(path), "--out", str(tmp_path / "o.png"),
                        cache=str(tmp_path / "cache")))
    assert "partial.safetensors" in line and "lacks weights" in line and "Use a complete" in line


def test_bad_backend_setting_is_reported_before_the_slow_work(tmp_path):
    code = ("import sys; from sd_accel.accel.cli.main import main; rc = main(['demo', '--out', sys.argv[1]]); "
            "print('imported diffusers' if 'diffusers' in sys.modules else 'no diffusers', rc)")
    r = run("-c", code, str(tmp_path / "o.png"), cache=str(tmp_path / "cache"), SD_ACCEL_BACKEND="bogus")
    assert r.stdout.strip() == "no diffusers 2", r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert "SD_ACCEL_BACKEND is 'bogus'" in r.stderr and "Use one of: auto, torch" in r.stderr
    assert not (tmp_path / "o.png").exists()


@pytest.mark.parametrize("option, value, fix", [("--steps", "1", "Use --steps 2 or more."),
                                                ("--size", "32", "Use --size 64 or more.")])
def test_bad_demo_argument_is_one_line(tmp_path, option, value, fix):
    line = one_line(run("-m", "sd_accel", "demo", option, value, cache=str(tmp_path / "cache")))
    assert f"{option} {value}" in line and fix in line


# (arguments, words the one line holds: the option, the value and what it accepts). {tmp}: the test's folder.
BENCH_CASES = {
    "json-file-folder-missing": (["--tiny", "--models", "sd15", "--json-file", "{tmp}/nope/out.json"],
                                 ["--json-file", "{tmp}/nope", "does not exist", "Create the folder"]),
    "json-file-is-a-folder": (["--tiny", "--models", "sd15", "--json-file", "{tmp}"],
                              ["--json-file", "is a folder", "give a file name in it"]),
    "unknown-path": (["--tiny", "--models", "sd15", "--paths", "torch,warp"],
                     ["--paths", "'warp' is not a path", "torch, torch-compile, torch-cudnn-search", "onnxruntime-refit"]),
    "no-iters": (["--tiny", "--models", "sd15", "--iters", "0"], ["--iters", "'0'", "whole number of 1 or more"]),
    "negative-vae-memory": (["--vae", "--tiny", "--vae-memory-gb", "-3"],
                            ["--vae-memory-gb", "'-3'", "give a positive number"]),
    "vae-side-off-the-grid": (["--vae", "--tiny", "--vae-sizes", "64,100"],
                              ["--vae-sizes", "'100'", "multiple of 8"]),
    "malformed-video-size": (["--tiny", "--video-sizes", "12"],
                             ["--video-sizes", "'12'", "width x height in pixels", "832x480"]),
    "unknown-compile-mode": (["--models", "sd15", "--compile-modes", "default,fast"],
                             ["--compile-modes", "'fast'", "default, reduce-overhead, max-autotune"]),
    "unknown-model": (["--tiny", "--models", "sd15,sd99"], ["--models", "'tiny-sd99'", "tiny-sd15, tiny-sdxl"]),
    "comfyui-only-model": (["--models", "sd15,wan21-14b"], ["--models wan21-14b", "ComfyUI's form only",
                                                            "Pass --comfyui DIR"]),
    "unknown-video-vae": (["--vae", "--tiny", "--models", "wan12"], ["--vae --models", "'wan12'", "wan21, wan22"]),
    "unknown-first-call-model": (["--first-call", "--tiny", "--models", "sd99"],
                                 ["--first-call", "'tiny-sd99'", "sd15, sd21, sdxl"]),
    "unknown-option": (["--tiny", "--itres", "2"], ["unrecognized arguments: --itres", "--help"]),
}


@pytest.mark.parametrize("case", BENCH_CASES)
def test_bad_bench_option_is_one_line_before_any_work(tmp_path, case):
    args, words = BENCH_CASES[case]
    r = run("-m", "sd_accel", "bench", *(a.format(tmp=tmp_path) for a in args), cache=str(tmp_path / "cache"))
    line = one_line(r)  # the only line: nothing was built or timed before it
    assert line.startswith("sd-accel: ") and "Traceback" not in r.stderr
    assert all(w.format(tmp=tmp_path) in line for w in words), line


DEMO_CASES = {
    "out-folder-missing": (["--out", "{tmp}/nope/demo.png"], ["--out", "{tmp}/nope", "does not exist"]),
    "out-not-an-image": (["--out", "{tmp}/demo.txt"], ["--out", "demo.txt", "end it in .png"]),
    "negative-seed": (["--seed", "-1"], ["--seed", "'-1'", "from 0 to"]),
    "unknown-backend": (["--backend", "warp"], ["--backend", "'warp'", "auto, torch, onnxruntime, off"]),
}


@pytest.mark.parametrize("case", DEMO_CASES)
def test_bad_demo_option_is_one_line_before_any_work(tmp_path, case):
    args, words = DEMO_CASES[case]
    r = run("-m", "sd_accel", "demo", *(a.format(tmp=tmp_path) for a in args), cache=str(tmp_path / "cache"))
    line = one_line(r)
    assert line.startswith("sd-accel: ") and all(w.format(tmp=tmp_path) in line for w in words), line
    assert not list(tmp_path.glob("**/*.png"))


def test_a_comfyui_whose_requirements_are_missing_is_one_line_naming_the_package(tmp_path):
    """ComfyUI 0.33 imports comfy-aimdo and comfy-kitchen, which 0.3.64 did not: `bench --comfyui` in a Python without
    one of ComfyUI's packages says which and how to install them, not ComfyUI's stack trace. psutil stands for the
    missing package (both versions import it before any model file): a package of that name first on the import path
    of the bench and of any process it starts raises as a missing one does."""
    from comfy_helpers import comfy_root

    root = comfy_root()
    if root is None:
        pytest.skip("no ComfyUI checkout (COMFYUI_ROOT)")
    missing = tmp_path / "missing" / "psutil"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'psutil'\", name='psutil')\n")
    r = run("-m", "sd_accel", "bench", "--models", "wan21-1.3b", "--paths", "torch", "--no-compile", "--comfyui",
            str(root), cache=str(tmp_path / "cache"),
            PYTHONPATH=os.pathsep.join([str(missing.parent), os.environ["PYTHONPATH"]]))
    line = one_line(r)  # nothing built before it
    assert "Traceback" not in r.stderr
    assert f"ComfyUI at {root.resolve()}" in line and "it imports psutil" in line, line
    assert f"pip install -r {root.resolve() / 'requirements.txt'}" in line, line


def test_unknown_doctor_backend_is_one_line(tmp_path):
    line = one_line(run("-m", "sd_accel", "doctor", "--backend", "warp", cache=str(tmp_path)))
    assert "--backend" in line and "'warp'" in line and "auto, torch, onnxruntime, off" in line


def test_results_the_json_file_cannot_take_go_to_stdout(tmp_path):
    """--json-file writable when checked, and not when written (a full disk): the results come on stdout."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full to stand for a full disk")
    r = run("-m", "sd_accel", "bench", "--vae", "--tiny", "--vae-sizes", "64", "--json-file", "/dev/full",
            cache=str(tmp_path))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "sd-accel: --json-file /dev/full could not be written (No space left on device); the results follow on " \
           "stdout." in r.stderr.splitlines()
    assert json.loads(r.stdout[r.stdout.index("{"):])["vae"][0]["size"] == 64


@pytest.mark.parametrize("action", ["ls", "clear", "prune", "info abc"])
def test_cache_root_that_does_not_exist_is_one_line(tmp_path, action):
    missing = tmp_path / "nope"
    line = one_line(run("-m", "sd_accel", "cache", *action.split(), "--root", str(missing), cache=str(tmp_path)))
    assert line == (f"sd-accel: the cache folder {missing} (--root) does not exist. Give --root the folder engines are "
                    "built in (`python -m sd_accel doctor` shows it; a build makes it).")
    assert not missing.exists()


@pytest.mark.parametrize("action", ["ls", "clear"])
def test_cache_setting_that_names_a_file_is_one_line(tmp_path, action):
    file = tmp_path / "cache"
    file.write_text("not a folder\n")
    line = one_line(run("-m", "sd_accel", "cache", action, cache=str(file)))
    assert line == (f"sd-accel: the cache folder {file} (SD_ACCEL_CACHE) is a file, not a folder. Set SD_ACCEL_CACHE "
                    "to a folder (a build makes it).")
    assert file.read_text() == "not a folder\n"


def test_default_cache_folder_not_made_yet_is_no_error(tmp_path):
    """Nothing named a folder, and a fresh install has built nothing: `ls` says so, exit code 0."""
    r = run("-m", "sd_accel", "cache", "ls", cache="", XDG_CACHE_HOME=str(tmp_path))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == (f"cache: {tmp_path / 'sd-accel'} does not exist yet: nothing has been built, so there is "
                        "nothing to list.\n")
