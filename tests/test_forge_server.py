"""The extension inside a real Forge (stable-diffusion-webui-forge main; tests/a1111_helpers.py says what it needs):
its API server on the CPU, a full-size SD1.5 checkpoint with seeded weights, the same requests with
Settings > sd-accel > backend off and auto.

Forge has no SD Unet routing: the extension clones forge_objects.unet with a model function wrapper for every
sampling. Proven here: every step runs the engine (counted), the images equal Forge's own, LoRAs through Forge's own
LoRA code reach the weights the engine reads, hires fix (two shapes), and another extension's UNet patch (FreeU) runs
Forge's forward with one message; every image is a picture (not blank). The status says sd-accel is inactive while
the backend is off and names the attention that ran; the console says once per size that the engine served a call.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

import a1111_helpers as a1
from a1111_helpers import psnr

pytestmark = pytest.mark.skipif(a1.forge_missing() is not None, reason=f"Forge tests: {a1.forge_missing()}")

BASE = {"steps": 3, "width": 64, "height": 64, "seed": 5, "sampler_name": "Euler", "cfg_scale": 7.0, "prompt": "a cat"}
FREEU = {"FreeU Integrated (SD 1.x, SD 2.x, SDXL)": {"args": [True, 1.5, 1.6, 0.9, 0.2, 0.0, 1.0]}}
# FreeU at 128x128: at 64x64 the UNet's deepest features are 1x1, where FreeU's normalisation (max - min) divides by
# zero and every pixel is NaN (a black image, with the backend off as well).
BASE_128 = {**BASE, "width": 128, "height": 128}
# name: (request, UNet calls through the engine, UNet calls on Forge's forward)
CASES = {
    "txt2img": (BASE, 3, 0),
    "lora": ({**BASE, "prompt": "a cat <lora:testlora:1>"}, 3, 0),
    "hires fix": ({**BASE, "enable_hr": True, "hr_scale": 2, "hr_upscaler": "Latent", "denoising_strength": 0.6,
                   "hr_second_pass_steps": 2, "hr_additional_modules": ["Use same choices"]}, 3 + 2, 0),
    "txt2img 128": (BASE_128, 3, 0),
    "freeu": ({**BASE_128, "alwayson_scripts": FREEU}, 0, 3),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("forge")
    a1.make_models(data / "models", name="sd15", arch="sd15")
    srv = a1.Server(data, forge=True, startup_timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def runs(server):
    """Each case with backend off (Forge's own UNet), then each with backend auto, with the calls it made."""
    out = {}
    for backend in ("off", "auto"):
        server.options(sd_accel_backend=backend)
        server.image("/sdapi/v1/txt2img", BASE)  # the same history before both runs
        for name, (request, _, _) in CASES.items():
            before = server.status()
            image = server.image("/sdapi/v1/txt2img", request)
            after = server.status()
            calls = (after.get("engine_calls", 0) - before.get("engine_calls", 0),
                     after.get("plain_calls", 0) - before.get("plain_calls", 0))
            out[backend, name] = (image, calls, after)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_images_equal_forges_own_and_the_engine_serves_what_it_can(runs, name):
    image, calls, status = runs["auto", name]
    assert psnr(image, runs["off", name][0]) >= 60
    assert calls == CASES[name][1:], (name, calls)


@pytest.mark.parametrize("name", list(CASES))
def test_every_image_is_a_picture(runs, name):
    """Not blank, not one colour (NaN latents decode to black): the comparisons above compare pictures."""
    for backend in ("off", "auto"):
        image = runs[backend, name][0]
        assert image.std() > 10 and image.max() - image.min() > 64, (backend, name, image.mean(), image.std())


def test_the_comparisons_can_fail(runs):
    assert psnr(runs["off", "lora"][0], runs["off", "txt2img"][0]) < 40
    assert psnr(runs["off", "freeu"][0], runs["off", "txt2img 128"][0]) < 40


def test_a_patch_from_another_extension_is_named_once(runs):
    status = runs["auto", "freeu"][2]
    said = [m for m in status["messages"] if "output_block_patch" in m]
    assert len(said) == 1 and "Forge's own forward" in said[0]


def test_no_sd_unet_option_on_forge_and_a_clean_console(server, runs):
    log = server.log()
    assert "Traceback" not in log, log[log.find("Traceback") - 1500:log.find("Traceback") + 1500]
    assert "sd-accel (fastest path" not in log


# What Forge's console says it chose (backend/attention.py) and the attention function that is.
FORGE_ATTENTION = {"Using xformers cross attention": "attention_xformers",
                   "Using pytorch cross attention": "attention_pytorch",
                   "Using split optimization for cross attention": "attention_split",
                   "Using sub quadratic optimization for cross attention": "attention_sub_quad"}


def test_status_says_inactive_while_the_backend_is_off_and_names_the_attention_that_ran(server, runs):
    off, auto = runs["off", "txt2img"][2], runs["auto", "txt2img"][2]
    assert off["backend"] == "inactive" and not off["active"] and "backend is off" in off["reason"], off
    assert auto["active"] and auto["backend"] == "torch", auto
    # Forge's UNet calls the attention function Forge chose at start-up (sub-quadratic on the CPU); no fusion
    # replaces it, and the plan's preferred SDPA kernel is not what ran.
    chosen = [fn for line, fn in FORGE_ATTENTION.items() if line in server.log()]
    assert len(chosen) == 1 and auto["attention"] == f"Forge's {chosen[0]}", (chosen, auto)
    assert f"attention Forge's {chosen[0]}," in auto["plan"] and "attention math" not in auto["plan"], auto["plan"]


def test_console_says_once_per_size_that_the_engine_served(server, runs):
    served = re.compile(r"sd-accel: the torch path served sd15's UNet at (\d+)x(\d+) px \(width x height\), "
                        r"batch (\d+); its first call at this size took \d+\.\d s")
    lines = [ln for ln in re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", server.log()).splitlines() if served.match(ln)]
    sizes = Counter(served.match(ln).groups() for ln in lines)
    # Forge decides from free memory whether the prompt and the negative prompt run as one batch.
    assert set(sizes.values()) == {1} and {size[:2] for size in sizes} == {("64", "64"), ("128", "128")}, lines
    assert "the path was prepared for this model" in lines[0], lines[0]
