"""ComfyUI started headless (main.py --cpu, loopback) with this pack as a custom node: workflows posted to /prompt
run the Accelerated UNet, the tiled VAE nodes and Accel Info on a tiny seeded model (built by the test-only nodes
in comfy_helpers.py), and the saved images of the accelerated branch equal those of the plain branch (for a tiny
Wan video model, the saved latents).
Skipped unless COMFYUI_ROOT names a ComfyUI checkout.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import comfy_helpers as H
from comfy_server import Server

pytestmark = pytest.mark.skipif(H.comfy_unavailable(server=True) is not None,
                                reason=str(H.comfy_unavailable(server=True)))

LORA = "sd_accel_tiny_lora.safetensors"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfyui")
    H.import_comfy()
    from safetensors.torch import save_file

    (base / "models" / "loras").mkdir(parents=True)
    save_file(H.lora_patches(H.tiny_model(0)), str(base / "models" / "loras" / LORA))
    srv = Server(base)
    try:
        yield srv
    finally:
        srv.stop()


def base_prompt(prefix: str) -> dict:
    """The tiny model, an accelerated and a plain branch with the same sampler settings, each decoded by the tiled
    decode and saved; the accelerated image goes back through the tiled encode; Accel Info reports on it."""
    sampler = {"seed": 1, "steps": 2, "cfg": 5.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0,
               "positive": ["1", 2], "negative": ["1", 3], "latent_image": ["3", 0]}
    tiles = {"vae": ["1", 1], "tile_size": 64, "overlap": 0}
    return {
        "1": {"class_type": "SDAccelTestTinySD", "inputs": {"seed": 0}},
        "2": {"class_type": "SDAccelAcceleratedUNet", "inputs": {
            "model": ["1", 0], "backend": "torch", "cuda_graphs": True, "torch_compile": False,
            "min_width": 64, "opt_width": 64, "max_width": 512, "min_height": 64, "opt_height": 64,
            "max_height": 512, "min_batch": 1, "opt_batch": 1, "max_batch": 2}},
        "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "4": {"class_type": "KSampler", "inputs": {"model": ["2", 0], **sampler}},
        "5": {"class_type": "SDAccelTiledVAEDecode", "inputs": {"samples": ["4", 0], **tiles}},
        "6": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": f"{prefix}_accel"}},
        "7": {"class_type": "KSampler", "inputs": {"model": ["1", 0], **sampler}},
        "8": {"class_type": "SDAccelTiledVAEDecode", "inputs": {"samples": ["7", 0], **tiles}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": f"{prefix}_plain"}},
        "10": {"class_type": "SDAccelTiledVAEEncode", "inputs": {"pixels": ["5", 0], **tiles}},
        "11": {"class_type": "VAEDecode", "inputs": {"samples": ["10", 0], "vae": ["1", 1]}},
        "12": {"class_type": "SaveImage", "inputs": {"images": ["11", 0], "filename_prefix": f"{prefix}_roundtrip"}},
        "13": {"class_type": "SDAccelInfo", "inputs": {"backend": "auto", "model": ["2", 0]}},
    }


def image(server, entry: dict, node: str) -> np.ndarray:
    from PIL import Image

    (saved,) = entry["outputs"][node]["images"]
    path = server.base / "output" / saved["subfolder"] / saved["filename"]
    return np.asarray(Image.open(path)).astype(np.int16)


def test_workflow_with_all_nodes_matches_the_plain_model(server):
    entry = server.run(base_prompt("base"))
    accel, plain = image(server, entry, "6"), image(server, entry, "9")
    assert accel.shape == (64, 64, 3) and accel.std() > 5  # a picture, not a flat fill
    assert np.abs(accel - plain).max() <= 1
    assert image(server, entry, "12").shape == (64, 64, 3)
    info = info_text(entry, "13")
    assert info.startswith("model: ") and "\nGPU: " in info and "engine cache: " in info
    assert "\ncalls this run: 2 " in info.split("\nGPU: ")[0]  # what ran comes first
    first_run = server.log().split("Prompt executed")[0]
    assert "the torch path is ready" in first_run
    assert "plain model" not in first_run and "own forward" not in first_run
    # The line starts on its own, not after the text of the sampler's open progress bar (ComfyUI 0.33's log puts its
    # coloured level before each line).
    plain_log = re.sub(r"\x1b\[[0-9;]*m", "", first_run)
    ready = [line for line in re.split(r"[\r\n]", plain_log) if "the torch path is ready" in line]
    assert ready and all(re.match(r"(\[\w+\] )?sd-accel: the torch path is ready", line) for line in ready), ready
    # cuda_graphs is on, the node's default: graphs where the GPU has them; nothing to say where it has none.
    assert "cuda_graphs" not in first_run and "cuda_graphs" not in info


def info_text(entry: dict, node: str) -> str:
    """Accel Info's report in a history entry, filed under the node's own id: the id the front end shows it on."""
    assert entry["meta"][node]["node_id"] == entry["meta"][node]["display_node"] == node, entry["meta"]
    return "\n".join(entry["outputs"][node]["text"])


def calls_line(info: str) -> str:
    return next(line for line in info.splitlines() if line.startswith("calls"))


def test_accel_info_counts_the_calls_of_this_run_with_and_without_after(server):
    """Without `after` ComfyUI may run Accel Info before the sampler; it waits for the model's samplers itself.
    Either way it reports the calls of this run: not the last run's, not a sum over runs. (The server runs ComfyUI
    on the CPU, where the torch path's calls are the plain model's computation.)"""
    for seed, steps, after in ((21, 2, False), (22, 3, False), (23, 4, True), (24, 2, True)):
        prompt = base_prompt(f"info{seed}")
        prompt["4"]["inputs"].update(seed=seed, steps=steps)
        if after:
            prompt["13"]["inputs"]["after"] = ["4", 0]
        entry = server.run(prompt)
        calls = calls_line(info_text(entry, "13"))
        assert calls.startswith(f"calls this run: {steps} on the torch path"), (seed, after, calls)
    # Two samplers of the model (a second pass on the first one's latent): the report waits for both.
    prompt = base_prompt("info-two")
    prompt["4"]["inputs"].update(seed=25, steps=2)
    prompt["14"] = {"class_type": "KSampler", "inputs": {**prompt["4"]["inputs"], "latent_image": ["4", 0],
                                                         "steps": 3, "denoise": 0.5}}
    prompt["15"] = {"class_type": "SaveImage", "inputs": {"images": ["16", 0], "filename_prefix": "info_two"}}
    prompt["16"] = {"class_type": "VAEDecode", "inputs": {"samples": ["14", 0], "vae": ["1", 1]}}
    info = info_text(server.run(prompt), "13")
    assert calls_line(info).startswith(f"calls this run: 5 on the torch path")
    # The same prompt again: ComfyUI reuses the samplers' outputs, and the report says the model did not sample.
    again = calls_line(info_text(server.run(prompt), "13"))
    assert again.startswith("calls this run: none: the model did not sample in this run") and "last run: 5 " in again
    # The server runs ComfyUI on the CPU (--cpu), where the torch path is the plain model: no speed-up is claimed.
    assert "the torch path runs the plain model there, so nothing is sped up and no speed-up is claimed" in info


@pytest.mark.parametrize("afters", [(None,), (None, None), ("4", None), (None, None, None)],
                         ids=["one", "two-without-after", "one-with-one-without", "three"])
def test_accel_info_nodes_on_one_model_each_report_under_their_own_id(server, afters):
    """Several Accel Info nodes on one model, with `after` on the sampler or without: each waits for the model's
    sampler without waiting for the others (no dependency cycle) and files its report under its own node id."""
    prompt = base_prompt(f"infos-{len(afters)}-{afters[0]}")
    prompt["4"]["inputs"]["seed"] = 30 + 2 * len(afters) + (afters[0] is not None)  # a new run: the sampler samples
    del prompt["13"]
    ids = [str(50 + i) for i in range(len(afters))]
    for node, after in zip(ids, afters):
        prompt[node] = {"class_type": "SDAccelInfo", "inputs": {"backend": "auto", "model": ["2", 0]}}
        if after is not None:
            prompt[node]["inputs"]["after"] = [after, 0]
    entry = server.run(prompt)
    assert {k for k, meta in entry["meta"].items() if meta["display_node"] in ids} == set(ids), entry["meta"]
    for node in ids:
        info = info_text(entry, node)
        assert "model: through an Accelerated UNet node, on the CPU" in info, (node, info)
        assert calls_line(info).startswith("calls this run: 2 on the torch path"), (node, info)


def test_accel_info_in_a_prompt_from_the_history_edited_and_posted_again(server):
    """The history keeps the prompt with the links Accel Info was given to wait for the samplers; posted again
    without the nodes some of them lead to, the node waits on links to the nodes that are there."""
    prompt = base_prompt("info-again")
    prompt["4"]["inputs"]["seed"] = 40
    prompt["14"] = {"class_type": "KSampler", "inputs": {**prompt["4"]["inputs"], "latent_image": ["4", 0],
                                                         "denoise": 0.5}}
    prompt["15"] = {"class_type": "SaveImage", "inputs": {"images": ["16", 0], "filename_prefix": "info_again"}}
    prompt["16"] = {"class_type": "VAEDecode", "inputs": {"samples": ["14", 0], "vae": ["1", 1]}}
    stored = server.run(prompt)["prompt"][2]
    # the last node with an output on the second pass's branch: its decode, or from ComfyUI 0.33, whose SaveImage
    # returns its images, the save
    assert ["16", 0] in stored["13"]["inputs"].values() or ["15", 0] in stored["13"]["inputs"].values()
    for node in ("14", "15", "16"):
        del stored[node]
    stored["4"]["inputs"]["seed"] = 41
    info = info_text(server.run(stored), "13")
    assert calls_line(info).startswith("calls this run: 2 on the torch path"), info


def test_lora_downstream_and_upstream_of_the_node(server):
    prompt = base_prompt("lora")
    lora = {"lora_name": LORA, "strength_model": 1.0}
    prompt["20"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["2", 0], **lora}}  # after the node
    prompt["21"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], **lora}}  # before it
    prompt["22"] = {"class_type": "SDAccelAcceleratedUNet", "inputs": {**prompt["2"]["inputs"], "model": ["21", 0]}}
    prompt["23"] = {"class_type": "KSampler", "inputs": {**prompt["4"]["inputs"], "model": ["22", 0]}}
    prompt["24"] = {"class_type": "SDAccelTiledVAEDecode", "inputs": {**prompt["5"]["inputs"], "samples": ["23", 0]}}
    prompt["25"] = {"class_type": "SaveImage", "inputs": {"images": ["24", 0], "filename_prefix": "lora_before"}}
    prompt["4"]["inputs"]["model"] = ["20", 0]
    prompt["7"]["inputs"]["model"] = ["21", 0]
    entry = server.run(prompt)
    after, before, plain = image(server, entry, "6"), image(server, entry, "25"), image(server, entry, "9")
    assert np.abs(after - plain).max() <= 1 and np.abs(before - plain).max() <= 1
    without = image(server, server.run(base_prompt("nolora")), "9")
    assert np.abs(plain - without).max() > 8  # the LoRA changes the picture


def test_controlnet_on_the_torch_path(server):
    prompt = base_prompt("control")
    prompt["30"] = {"class_type": "SDAccelTestControlNet", "inputs": {"seed": 9}}
    prompt["31"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1,
                                                           "color": 0x3366CC}}
    prompt["32"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
        "positive": ["1", 2], "negative": ["1", 3], "control_net": ["30", 0], "image": ["31", 0],
        "strength": 1.0, "start_percent": 0.0, "end_percent": 1.0}}
    for sampler in ("4", "7"):
        prompt[sampler]["inputs"].update(positive=["32", 0], negative=["32", 1])
    entry = server.run(prompt)
    accel, plain = image(server, entry, "6"), image(server, entry, "9")
    assert np.abs(accel - plain).max() <= 1
    without = image(server, server.run(base_prompt("nocontrol")), "9")
    assert np.abs(plain - without).max() > 8


def test_attention_patch_that_changes_with_the_step(server):
    prompt = base_prompt("attn")
    prompt["40"] = {"class_type": "SDAccelTestStepAttention", "inputs": {"model": ["2", 0], "strength": 0.5}}
    prompt["41"] = {"class_type": "SDAccelTestStepAttention", "inputs": {"model": ["1", 0], "strength": 0.5}}
    prompt["4"]["inputs"]["model"] = ["40", 0]
    prompt["7"]["inputs"]["model"] = ["41", 0]
    entry = server.run(prompt)
    accel, plain = image(server, entry, "6"), image(server, entry, "9")
    assert np.abs(accel - plain).max() <= 1
    without = image(server, server.run(base_prompt("noattn")), "9")
    assert np.abs(plain - without).max() > 8
    assert "attn2 replace" in server.log()


def test_example_workflows_use_nodes_and_inputs_the_server_knows(server):
    """workflows/*_api.json against /object_info: every class exists and every input is one it declares."""
    info = server.get("/object_info")
    paths = sorted(H.REPO.glob("workflows/*_api.json"))
    assert len(paths) >= 2
    for path in paths:
        for node_id, node in json.loads(path.read_text()).items():
            assert node["class_type"] in info, f"{path.name} node {node_id}: unknown {node['class_type']}"
            spec = info[node["class_type"]]["input"]
            declared = {**spec.get("required", {}), **spec.get("optional", {})}
            unknown = set(node["inputs"]) - set(declared)
            assert not unknown, f"{path.name} node {node_id} ({node['class_type']}): unknown inputs {unknown}"
            missing = set(spec.get("required", {})) - set(node["inputs"])
            assert not missing, f"{path.name} node {node_id} ({node['class_type']}): missing inputs {missing}"


SHAPES = ("min_width", "opt_width", "max_width", "min_height", "opt_height", "max_height", "min_batch", "opt_batch",
          "max_batch")


def widget_names(spec: dict) -> list[str]:
    """The widgets the front end makes from a node's /object_info entry, in its order: required, then optional, each
    in input_order (comfyui-frontend-package 1.27's getOrderedInputSpecs); link inputs make none. Saved UI workflows
    keep their widgets' values in this order (widgets_values), and the front end gives them back by position."""
    names = []
    for part in ("required", "optional"):
        for name in spec["input_order"].get(part, []):
            kind = spec["input"][part][name][0]
            if isinstance(kind, list) or kind in ("INT", "FLOAT", "BOOLEAN", "STRING", "COMBO"):
                names.append(name)
    return names


@pytest.mark.parametrize("path", sorted(p for p in H.REPO.glob("workflows/*.json") if not p.name.endswith("_api.json")),
                         ids=lambda p: p.name)
def test_saved_ui_workflow_with_the_shape_values_loads_and_runs(server, path):
    """A UI workflow saved before the nine shape inputs became optional and advanced (the examples are such files:
    their widgets_values hold all fourteen values): the front end hands the values to the widgets by position, so
    each lands on the widget it was saved from (the same inputs as the workflow's API twin), and the prompt the
    front end makes from them runs, its image the plain model's."""
    spec = server.get("/object_info/SDAccelAcceleratedUNet")["SDAccelAcceleratedUNet"]
    (node,) = [n for n in json.loads(path.read_text())["nodes"] if n["type"] == "SDAccelAcceleratedUNet"]
    names = widget_names(spec)
    assert names[3:12] == list(SHAPES) and len(names) == len(node["widgets_values"])
    values = dict(zip(names, node["widgets_values"]))
    twin = json.loads(path.with_name(path.stem + "_api.json").read_text())[str(node["id"])]["inputs"]
    assert values == {k: v for k, v in twin.items() if k != "model"}
    prompt = base_prompt(f"saved_{path.stem}")
    prompt["2"]["inputs"] = {"model": ["1", 0], **values}
    entry = server.run(prompt)
    assert np.abs(image(server, entry, "6") - image(server, entry, "9")).max() <= 1


def test_api_prompt_without_the_shape_inputs_runs(server):
    """The nine shape inputs are optional: a prompt that leaves them out validates and runs, its image the plain
    model's, and nothing is said about a shape profile."""
    prompt = base_prompt("noshapes")
    for sampler in ("4", "7"):  # a new run of both branches
        prompt[sampler]["inputs"]["seed"] = 50
    for name in SHAPES:
        del prompt["2"]["inputs"][name]
    before = len(server.log())
    entry = server.run(prompt)
    assert np.abs(image(server, entry, "6") - image(server, entry, "9")).max() <= 1
    assert calls_line(info_text(entry, "13")).startswith("calls this run: 2 on the torch path")
    assert "profile" not in server.log()[before:]


def test_the_shape_inputs_are_optional_advanced_and_say_they_serve_onnxruntime_only(server):
    """What the front end gets: the nine optional, where they were in the widget order, advanced (hidden until the
    node shows its advanced inputs), each with a tooltip that says only the onnxruntime backend reads it; every
    widget of the node has a tooltip."""
    spec = server.get("/object_info/SDAccelAcceleratedUNet")["SDAccelAcceleratedUNet"]
    assert spec["input_order"]["optional"][:9] == list(SHAPES)
    optional = spec["input"]["optional"]
    for name in SHAPES:
        options = optional[name][1]
        assert options["advanced"] is True, name
        assert options["tooltip"].startswith("Used only by the onnxruntime backend: ") and \
            "The torch path captures CUDA graphs per shape and ignores it" in options["tooltip"], name
    for part in ("required", "optional"):
        for name, declared in spec["input"][part].items():
            assert len(declared) > 1 and declared[1].get("tooltip"), name
    shown = [n for n in widget_names(spec) if not ({**spec["input"]["required"], **optional}[n][1].get("advanced"))]
    assert shown == ["backend", "cuda_graphs", "torch_compile", "precision", "gpus"]


def latent(server, entry: dict, node: str):
    """The latent a SaveLatent node wrote (ComfyUI's .latent file: safetensors)."""
    from safetensors.torch import load_file

    (saved,) = entry["outputs"][node]["latents"]
    return load_file(str(server.base / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]


def test_tiny_wan_video_through_the_node_equals_plain(server):
    """ComfyUI's WanModel (text-to-video) as workflows/wan21_t2v_api.json runs it: the node after the loader,
    ModelSamplingSD3 after the node, video latents from EmptyHunyuanLatentVideo, uni_pc. The accelerated branch's
    latents are the plain branch's (the server runs on the CPU, where the torch path runs the plain model's
    computation: exactly), and the engine served every call."""
    steps = 3
    sampler = {"seed": 5, "steps": steps, "cfg": 6.0, "sampler_name": "uni_pc", "scheduler": "simple",
               "denoise": 1.0, "positive": ["1", 1], "negative": ["1", 2], "latent_image": ["3", 0]}
    prompt = {
        "1": {"class_type": "SDAccelTestTinyWan", "inputs": {"seed": 3}},
        "2": {"class_type": "SDAccelAcceleratedUNet", "inputs": {
            "model": ["1", 0], "backend": "torch", "cuda_graphs": True, "torch_compile": False,
            "min_width": 64, "opt_width": 64, "max_width": 512, "min_height": 64, "opt_height": 64,
            "max_height": 512, "min_batch": 1, "opt_batch": 1, "max_batch": 2}},
        "3": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 5,
                                                                  "batch_size": 1}},
        "4": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["2", 0], "shift": 8.0}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["4", 0], **sampler}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": "wan_accel"}},
        "7": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["1", 0], "shift": 8.0}},
        "8": {"class_type": "KSampler", "inputs": {"model": ["7", 0], **sampler}},
        "9": {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0], "filename_prefix": "wan_plain"}},
        "10": {"class_type": "SDAccelInfo", "inputs": {"backend": "auto", "model": ["2", 0], "after": ["5", 0]}},
    }
    before = len(server.log())
    entry = server.run(prompt)
    accel, plain = latent(server, entry, "6"), latent(server, entry, "9")
    assert accel.shape == (1, 16, 2, 8, 8)  # (batch, channels, 1 + (5 - 1) / 4 frames, 64 / 8, 64 / 8)
    assert plain.std() > 0.1  # sampled, not the empty latent
    assert torch.equal(accel, plain)
    info = info_text(entry, "10")
    assert calls_line(info).startswith(f"calls this run: {steps} on the torch path"), info
    log = server.log()[before:]
    assert "plain model" not in log and "own forward" not in log, log
