"""The extension inside a real AUTOMATIC1111 (tests/a1111_helpers.py says what it needs): its API server on the CPU
in full precision, a tiny seeded SD1.x checkpoint built by A1111's own classes, and the same requests with the
built-in UNet and with "sd-accel" chosen as SD Unet.

On the CPU the torch path runs the module as it is, so these tests prove the integration: A1111 routes every UNet
call to the extension (counted by the extension), the engine's own calls reach A1111's original forward (no
recursion), the Lora extension's networks reach the weights the engine reads (both of its modes), hires fix,
batches and img2img, the settings with --nowebui, the tiled VAE decode and --medvram; images equal the built-in
ones. What the user is told: an sd_unet value that is not the option's text, the status once A1111 switched away
(totals kept), the console's line per model and size, the attention that ran. Kernels are proven against their
references elsewhere (test_kernels, test_fusions) and on the GPU.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter

import numpy as np
import pytest

import a1111_helpers as a1
from a1111_helpers import ACCEL_UNET, psnr

pytestmark = pytest.mark.skipif(a1.missing() is not None, reason=f"A1111 tests: {a1.missing()}")

BASE = {"steps": 4, "width": 64, "height": 64, "seed": 11, "sampler_name": "Euler", "cfg_scale": 7.0}
TXT, IMG = "/sdapi/v1/txt2img", "/sdapi/v1/img2img"


def _init_image() -> str:
    y, x = np.mgrid[0:64, 0:64]
    rgb = np.stack([x * 4, y * 4, (x + y) * 2], axis=-1).astype(np.float64)
    return a1.png_b64(rgb)


# name: (path, request, options, UNet calls the request makes: 1 per sampling step with CFG batched)
CASES = {
    "txt2img": (TXT, {**BASE, "prompt": "a cat"}, {}, 4),
    "lora": (TXT, {**BASE, "prompt": "a cat <lora:testlora:1>"}, {}, 4),
    "lora reweighted": (TXT, {**BASE, "prompt": "a cat <lora:testlora:0.4>"}, {}, 4),
    "lora removed": (TXT, {**BASE, "prompt": "a dog"}, {}, 4),
    "hires fix": (TXT, {**BASE, "prompt": "a cat", "enable_hr": True, "hr_scale": 2, "hr_upscaler": "Latent",
                        "denoising_strength": 0.6, "hr_second_pass_steps": 3}, {}, 4 + 3),
    "batch": (TXT, {**BASE, "prompt": "a cat", "batch_size": 2, "n_iter": 2}, {}, 2 * 4),
    "img2img": (IMG, {**BASE, "prompt": "a dog <lora:testlora:1>", "init_images": [_init_image()],
                      "denoising_strength": 0.5}, {}, 3),  # A1111 runs the last int(0.5 * 4) + 1 steps
}
FUNCTIONAL = (TXT, {**BASE, "prompt": "a cat <lora:testlora:1>"}, {"lora_functional": True}, 4)


@pytest.fixture(scope="module")
def installed():
    """install.py run as A1111 runs an extension's installer (its Python, A1111's folder on PYTHONPATH), before
    the server starts: (its run, pip freeze before, pip freeze after)."""
    freeze = [a1.python(), "-m", "pip", "freeze", "--all"]
    before = subprocess.run(freeze, capture_output=True, text=True, check=True).stdout
    run = subprocess.run([a1.python(), str(a1.REPO / "install.py")], capture_output=True, text=True, timeout=900,
                         env=a1.host_env({"PYTHONPATH": str(a1.a1111_root())}), cwd=a1.REPO)
    after = subprocess.run(freeze, capture_output=True, text=True, check=True).stdout
    return run, before, after


@pytest.fixture(scope="module")
def server(tmp_path_factory, installed):
    data = tmp_path_factory.mktemp("a1111")
    a1.make_models(data / "models")
    srv = a1.Server(data)
    yield srv
    srv.stop()


def _run(srv, case) -> np.ndarray:
    path, request, options, _ = case
    srv.options(**{"lora_functional": False, **options})
    return srv.image(path, request)


@pytest.fixture(scope="module")
def builtin(server):
    """Every case with the built-in UNet, in one order; a warm-up request first so both runs see the same history
    (A1111's first img2img after a batch job differs from the next one, with or without sd-accel)."""
    server.options(sd_unet="None")
    _run(server, CASES["txt2img"])
    return {name: _run(server, case) for name, case in [*CASES.items(), ("functional", FUNCTIONAL)]}


@pytest.fixture(scope="module")
def accelerated(server, builtin):
    """Every case with sd-accel as SD Unet, in the same order, with the extension's count of calls per case."""
    server.options(sd_unet=ACCEL_UNET)
    _run(server, CASES["txt2img"])
    images, calls = {}, {}
    for name, case in [*CASES.items(), ("functional", FUNCTIONAL)]:
        before = server.status()
        images[name] = _run(server, case)
        after = server.status()
        calls[name] = (after["engine_calls"] - before["engine_calls"], after["plain_calls"] - before["plain_calls"])
    return images, calls, server.status()


def test_install_py_changes_no_package_of_a1111_and_a1111_then_starts(installed, server):
    run, before, after = installed
    assert run.returncode == 0, run.stdout + run.stderr
    assert before == after, run.stdout
    assert all(ln.startswith("[sd-accel]") for ln in run.stdout.splitlines() if ln.strip()), run.stdout
    assert server.get("/sdapi/v1/sd-models")[0]["model_name"] == "tiny"  # started, and found the checkpoint


def test_settings_exist_without_the_ui(server):
    options = server.get("/sdapi/v1/options")
    assert options["sd_accel_backend"] == "auto" and options["sd_accel_tiled_vae"] == "auto"
    status = server.status()
    assert status["backend"] == "inactive" and not status["active"] and "'Automatic'" in status["reason"]


@pytest.mark.parametrize("name", list(CASES))
def test_images_equal_the_builtin_unet_and_every_step_runs_the_engine(builtin, accelerated, name):
    images, calls, _ = accelerated
    assert psnr(images[name], builtin[name]) >= 60, f"{name}: {psnr(images[name], builtin[name]):.1f} dB"
    assert calls[name] == (CASES[name][3], 0), f"{name}: (engine, plain) calls {calls[name]}"


def test_loras_change_the_image_so_the_comparisons_can_fail(builtin):
    assert psnr(builtin["lora"], builtin["txt2img"]) < 40
    assert psnr(builtin["lora reweighted"], builtin["lora"]) < 40


def test_functional_lora_mode_runs_the_builtin_unet_and_says_so_once(builtin, accelerated):
    images, calls, status = accelerated
    assert psnr(images["functional"], builtin["functional"]) >= 60
    assert calls["functional"] == (0, FUNCTIONAL[3])
    said = [m for m in status["messages"] if "use old method" in m]
    assert len(said) == 1 and "Turn that setting off" in said[0]


def test_backend_off_runs_the_builtin_unet(server, builtin, accelerated):
    server.options(sd_unet=ACCEL_UNET, sd_accel_backend="off")  # takes effect on the next image
    try:
        before = server.status()
        image = _run(server, CASES["txt2img"])
        status = server.status()
    finally:
        server.options(sd_accel_backend="auto")
    assert psnr(image, builtin["txt2img"]) >= 60
    assert status["backend"] == "plain" and status["active"]
    assert (status["engine_calls"] - before["engine_calls"], status["plain_calls"] - before["plain_calls"]) == (0, 4)
    assert any("off" in m for m in [status["source"], *status["messages"]])


def test_tiled_vae_decode_gives_the_untiled_image(server, builtin, accelerated):
    request = {**BASE, "prompt": "a cat", "width": 128, "height": 128}
    server.options(sd_unet="None", sd_accel_tiled_vae="off")
    untiled = server.image(TXT, request)
    before = server.status()["tiled_decodes"]
    server.options(sd_accel_tiled_vae="always")
    try:
        tiled = server.image(TXT, request)
        after = server.status()["tiled_decodes"]
    finally:
        server.options(sd_accel_tiled_vae="auto")
    assert after == before + 1
    assert psnr(tiled, untiled) >= 60


def test_console_has_no_traceback_and_no_recursion(server, accelerated):
    log = server.log()
    for bad in ("Traceback", "RecursionError", "Encountered", "Error completing request"):
        assert bad not in log, log[log.find(bad) - 2000:log.find(bad) + 2000]
    lines = [ln for ln in log.splitlines() if "sd-accel" in ln.lower()]
    assert any("sd-accel: active" in ln for ln in lines)


def test_medvram_runs_the_builtin_unet_with_one_message(tmp_path, server, builtin):
    data = tmp_path / "medvram"
    data.mkdir()
    (data / "models").symlink_to(server.data / "models", target_is_directory=True)
    low = a1.Server(data, "--medvram")
    try:
        low.options(sd_unet=ACCEL_UNET)
        image = _run(low, CASES["txt2img"])
        image2 = _run(low, CASES["txt2img"])
        status = low.status()
    finally:
        low.stop()
    assert psnr(image, builtin["txt2img"]) >= 60 and psnr(image2, image) == float("inf")
    assert status["engine_calls"] == 0 and status["plain_calls"] == 8
    assert sum("--medvram" in m for m in status["messages"]) == 1


# -- what the user is told (issue 36 item 5)

def test_sd_unet_set_to_sd_accel_in_other_words_says_not_active(server, accelerated):
    """A1111 accepts any text as sd_unet and runs its built-in UNet for one that names no option: the status says
    sd-accel is not active and which text chooses it; the console says so once."""
    server.options(sd_unet="sd-accel")
    try:
        before = server.status()
        for _ in range(2):
            _run(server, CASES["txt2img"])
        status = server.status()
    finally:
        server.options(sd_unet=ACCEL_UNET)
    assert status["backend"] == "inactive" and not status["active"], status
    assert "'sd-accel'" in status["reason"] and f"'{ACCEL_UNET}'" in status["reason"], status["reason"]
    assert status["engine_calls"] == before["engine_calls"]  # the built-in UNet ran
    said = [ln for ln in server.log().splitlines() if "SD Unet is 'sd-accel'" in ln]
    assert len(said) == 1 and said[0].startswith("sd-accel: not active") and ACCEL_UNET in said[0], said


def test_status_says_inactive_once_a1111_switched_away_and_keeps_the_totals(server, accelerated):
    server.options(sd_unet=ACCEL_UNET)
    _run(server, CASES["txt2img"])
    active = server.status()
    server.options(sd_unet="None")  # A1111 applies it at the next generation
    switched = server.status()
    _run(server, CASES["txt2img"])
    builtin_ran = server.status()
    server.options(sd_unet=ACCEL_UNET)
    chosen = server.status()
    _run(server, CASES["txt2img"])
    again = server.status()
    calls = lambda s: (s["engine_calls"], s["plain_calls"])  # noqa: E731
    assert active["backend"] == "torch" and switched["backend"] == "inactive", (active, switched)
    assert calls(again) == (active["engine_calls"] + 4, active["plain_calls"]), (active, again)
    assert calls(switched) == calls(builtin_ran) == calls(active)
    assert active["active"] and not switched["active"] and "'None'" in switched["reason"]
    assert switched["last_backend"] == "torch"
    assert not chosen["active"] and "next generation" in chosen["reason"]
    assert again["active"] and again["backend"] == "torch"


SERVED = re.compile(r"sd-accel: the torch path served tiny's UNet at (\d+)x(\d+) px \(width x height\), batch (\d+); "
                    r"its first call at this size took \d+\.\d s")


def test_console_says_once_per_model_and_size_that_the_engine_served(server, accelerated):
    # A line of its own: the open bars are cleared before it (the log keeps the cursor moves a terminal obeys).
    lines = [ln for ln in re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", server.log()).splitlines() if SERVED.match(ln)]
    sizes = Counter(SERVED.match(ln).groups() for ln in lines)
    # UNet batches: the prompt and the negative prompt together (2), batch_size 2 (4); hires fix's second pass.
    assert sizes == {("64", "64", "2"): 1, ("64", "64", "4"): 1, ("128", "128", "2"): 1}, lines
    assert "the path was prepared for this model" in lines[0] and "no speed-up" in lines[0], lines[0]


def test_status_reports_the_attention_that_ran(server, accelerated):
    """On the CPU A1111's Automatic cross-attention optimization is InvokeAI's; the torch path keeps it."""
    assert "Applying attention optimization: InvokeAI" in server.log()
    server.options(sd_unet=ACCEL_UNET)
    _run(server, CASES["txt2img"])
    invoke = server.status()
    server.options(cross_attention_optimization="Doggettx")
    try:
        _run(server, CASES["txt2img"])
        doggettx = server.status()
    finally:
        server.options(cross_attention_optimization="Automatic")
    assert invoke["attention"] == "A1111's InvokeAI", invoke
    assert "attention A1111's InvokeAI," in invoke["plan"] and "attention math" not in invoke["plan"], invoke["plan"]
    assert doggettx["attention"] == "A1111's Doggettx", doggettx
