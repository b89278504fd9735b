"""The example UI workflows (workflows/*.json, not their *_api.json twins) as ComfyUI's front end draws them: every
node's rectangle, its title bar included, holds the node's slots and widgets, and no two rectangles come closer than
GAP, when the workflow is loaded and after a run, when web/sd_accel.js has added its text box to the sd-accel nodes.

No browser: a node's least size is the sum LiteGraph makes (LGraphNode.computeSize in comfyui-frontend-package
1.27.10, the front end ComfyUI 0.3.64 pins; on load, ComfyUI's app.loadGraphData grows every node to it), from the
node's declared inputs and outputs: the pack's own INPUT_TYPES for its nodes; for ComfyUI's nodes the tree that
COMFYUI_ROOT names (read in a subprocess), else the table CORE below, which a test checks against that tree. These
sums were compared once with the front end itself in headless Chromium: every node's computeSize() there was the
height computed here, and the text box's growth after a run too."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import comfy_helpers as H

UI_WORKFLOWS = sorted(p for p in H.REPO.glob("workflows/*.json") if not p.name.endswith("_api.json"))
assert len(UI_WORKFLOWS) >= 5, "workflows/ has the SD1.5, SDXL, Flux, Wan and Qwen-Image examples"

# LiteGraph's constants in ComfyUI's front end (LiteGraphGlobal, BaseWidget)
TITLE_HEIGHT = 30  # NODE_TITLE_HEIGHT: the title bar, drawn above pos[1]
SLOT_HEIGHT = 20  # NODE_SLOT_HEIGHT: one row of link slots (inputs on the left, outputs on the right)
WIDGET_HEIGHT = 20  # NODE_WIDGET_HEIGHT: a combo, number, toggle or one-line text widget
WIDGET_SPACING = 4  # computeSize adds this below every widget,
WIDGETS_MARGIN = 8  # this below them all,
BOTTOM_MARGIN = 6  # and this below everything
TEXTBOX_HEIGHT = 50  # a multiline text box's least height (a DOM widget's default minHeight)
NODE_WIDTH = 140  # NODE_WIDTH: the least width; 1.5 times it for a node with widgets
TEXT_SIZE = 14  # NODE_TEXT_SIZE: text is measured as 0.6 of it per character where no canvas measures it
WIDGET_PADDING = 42 + 2 * (15 + 6 + 10)  # minValueWidth + 2 (margin + arrowMargin + arrowWidth) beside a label
TEXT_GROWTH = 100  # web/sd_accel.js: the room it adds below the text box it puts on its nodes after a run
GAP = 20  # the least space between two nodes' rectangles in the examples

# How each kind of input is drawn: the heights of its widgets; a link input is a slot row instead.
KINDS = {"combo": [WIDGET_HEIGHT], "number": [WIDGET_HEIGHT], "toggle": [WIDGET_HEIGHT], "text": [WIDGET_HEIGHT],
         "seed": [WIDGET_HEIGHT] * 2,  # an INT with its "control after generate" combo
         "combo+control": [WIDGET_HEIGHT] * 3,  # a combo with its control and filter combos
         "textbox": [TEXTBOX_HEIGHT], "link": [],
         # the pack's inputs declared advanced: web/sd_accel.js hides them until the node shows its advanced inputs
         # (the front end's canvas draws ComfyUI's own advanced inputs, CLIPLoader's device: it does not read the flag)
         "advanced": []}

# ComfyUI's nodes that the examples use: (name, kind) of each input in INPUT_TYPES order (required, then optional),
# and how many outputs. What ComfyUI 0.3.64 declares (test_core_table_is_what_comfyui_declares checks it).
CORE = {
    "CheckpointLoaderSimple": ([("ckpt_name", "combo")], 3),
    "CLIPLoader": ([("clip_name", "combo"), ("type", "combo"), ("device", "combo")], 1),
    "DualCLIPLoader": ([("clip_name1", "combo"), ("clip_name2", "combo"), ("type", "combo"), ("device", "combo")], 1),
    "UNETLoader": ([("unet_name", "combo"), ("weight_dtype", "combo")], 1),
    "VAELoader": ([("vae_name", "combo")], 1),
    "CLIPTextEncode": ([("text", "textbox"), ("clip", "link")], 1),
    "ConditioningZeroOut": ([("conditioning", "link")], 1),
    "FluxGuidance": ([("conditioning", "link"), ("guidance", "number")], 1),
    "ModelSamplingSD3": ([("model", "link"), ("shift", "number")], 1),
    "ModelSamplingAuraFlow": ([("model", "link"), ("shift", "number")], 1),
    "EmptyLatentImage": ([("width", "number"), ("height", "number"), ("batch_size", "number")], 1),
    "EmptySD3LatentImage": ([("width", "number"), ("height", "number"), ("batch_size", "number")], 1),
    "EmptyHunyuanLatentVideo": ([("width", "number"), ("height", "number"), ("length", "number"),
                                 ("batch_size", "number")], 1),
    "KSampler": ([("model", "link"), ("seed", "seed"), ("steps", "number"), ("cfg", "number"),
                  ("sampler_name", "combo"), ("scheduler", "combo"), ("positive", "link"), ("negative", "link"),
                  ("latent_image", "link"), ("denoise", "number")], 1),
    "VAEDecode": ([("samples", "link"), ("vae", "link")], 1),
    "SaveImage": ([("images", "link"), ("filename_prefix", "text")], 0),
    "SaveAnimatedWEBP": ([("images", "link"), ("filename_prefix", "text"), ("fps", "number"), ("lossless", "toggle"),
                          ("quality", "number"), ("method", "combo")], 0),
}


def kind_of(name: str, declared) -> str:
    """How the front end draws one declared input (its widget constructors for the ComfyUI 1.x input types)."""
    kind = declared[0]
    opts = declared[1] if len(declared) > 1 and isinstance(declared[1], dict) else {}
    if opts.get("advanced") and not opts.get("forceInput"):
        return "advanced"
    if isinstance(kind, (list, tuple)) or kind == "COMBO":
        return "combo+control" if opts.get("control_after_generate") else "combo"
    if opts.get("forceInput"):
        return "link"
    if kind == "INT":  # control_after_generate ?? the legacy names
        control = opts.get("control_after_generate")
        return "seed" if (name in ("seed", "noise_seed") if control is None else control) else "number"
    if kind == "FLOAT":
        return "number"
    if kind == "BOOLEAN":
        return "toggle"
    if kind == "STRING":
        return "textbox" if opts.get("multiline") else "text"
    return "link"


def declared_inputs(input_types: dict) -> list[tuple[str, str]]:
    return [(name, kind_of(name, spec)) for part in ("required", "optional")
            for name, spec in input_types.get(part, {}).items()]


# Run in a subprocess, so that ComfyUI's modules (`nodes`, `utils`, ...) stay out of the test process: each named
# class's declared inputs (lists as "COMBO", the options that change how they are drawn) and outputs, as JSON.
_READ_TREE = r"""
import asyncio, inspect, json, sys
tests, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path.insert(0, tests)
import comfy_helpers as H
sys.path.insert(0, str(H.comfy_root()))
H.import_comfy()
import utils.extra_config  # as main.py does before `nodes`, which puts comfy/ (with a utils.py) on sys.path
import nodes
init = nodes.init_extra_nodes  # comfy_extras: FluxGuidance, the SD3/Hunyuan latents, SaveAnimatedWEBP, ...
wanted = {"init_custom_nodes": False, "init_api_nodes": False}
done = init(**{k: v for k, v in wanted.items() if k in inspect.signature(init).parameters})
if inspect.isawaitable(done):
    asyncio.run(done)
keep = ("multiline", "control_after_generate", "forceInput")
found = {}
for name in names:
    cls = nodes.NODE_CLASS_MAPPINGS.get(name)
    if cls is None:
        continue
    types = cls.INPUT_TYPES()
    def drawn(v):
        opts = v[1] if len(v) > 1 and isinstance(v[1], dict) else {}
        return ["COMBO" if isinstance(v[0], (list, tuple)) else str(v[0]), {o: opts[o] for o in keep if o in opts}]
    found[name] = {"input": {part: {k: drawn(v) for k, v in types.get(part, {}).items()}
                             for part in ("required", "optional")},
                   "outputs": len(cls.RETURN_TYPES)}
with open(out, "w") as f:
    json.dump(found, f)
"""


def _tree_declarations(names, tmp: Path) -> dict:
    out = tmp / "declared.json"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run([sys.executable, "-c", _READ_TREE, str(H.REPO / "tests"), str(out), *sorted(names)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp), check=False)
    assert run.returncode == 0 and out.is_file(), f"reading ComfyUI's nodes failed:\n{run.stderr[-4000:]}"
    return {name: (declared_inputs(d["input"]), d["outputs"]) for name, d in json.loads(out.read_text()).items()}


def _ui(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def declarations(tmp_path_factory) -> dict:
    """Node type -> ([(input, kind)], outputs) for every type in the UI examples."""
    pack = H.load_pack()
    used = {n["type"] for p in UI_WORKFLOWS for n in _ui(p)["nodes"]}
    ours = {t: (declared_inputs(pack.NODE_CLASS_MAPPINGS[t].INPUT_TYPES()),
                len(pack.NODE_CLASS_MAPPINGS[t].RETURN_TYPES)) for t in used & set(pack.NODE_CLASS_MAPPINGS)}
    core = used - set(ours)
    if os.environ.get("COMFYUI_ROOT", "").strip():
        assert H.comfy_root() is not None, "COMFYUI_ROOT is not a ComfyUI checkout"
        theirs = _tree_declarations(core, tmp_path_factory.mktemp("comfyui-nodes"))
    else:
        theirs = {t: CORE[t] for t in core if t in CORE}
    missing = core - set(theirs)
    assert not missing, f"node types the examples use that neither the pack nor ComfyUI (or CORE) declare: {missing}"
    return {**ours, **theirs}


def _text_width(text: str) -> float:
    return TEXT_SIZE * 0.6 * len(text)


def least_size(node: dict, declared) -> tuple[float, float]:
    """LGraphNode.computeSize for this node as the front end builds it from its declaration."""
    inputs, outputs = declared
    links = max(sum(kind == "link" for _, kind in inputs), sum("widget" not in i for i in node.get("inputs", [])))
    rows = max(links, outputs, len(node.get("outputs", [])), 1)
    widgets = [h for _, kind in inputs for h in KINDS[kind]]  # the shown ones
    # LiteGraph's least width and widget margin count hidden widgets too
    any_widget = any(kind != "link" for _, kind in inputs)
    drawn = [name for name, kind in inputs if kind not in ("link", "advanced")]
    height = rows * SLOT_HEIGHT
    if any_widget:
        height += sum(h + WIDGET_SPACING for h in widgets) + WIDGETS_MARGIN
    height += BOTTOM_MARGIN
    title = TITLE_HEIGHT * 1.33 + _text_width(node.get("title") or node["type"])
    link_names = [name for name, kind in inputs if kind == "link"]
    in_w = max(map(_text_width, link_names), default=0)
    out_w = max((_text_width(o.get("label") or o.get("name", "")) for o in node.get("outputs", [])), default=0)
    slots = in_w + out_w + 2 * SLOT_HEIGHT + (5 if in_w and out_w else 0)
    labels = max((_text_width(name) + WIDGET_PADDING for name in drawn), default=0)
    width = max(NODE_WIDTH * (1.5 if any_widget else 1), title, slots, labels)
    return width, height


def _text_nodes() -> set[str]:
    """The nodes web/sd_accel.js gives a text box after a run: its TEXT_NODES, names or constants that name them."""
    script = (H.REPO / "web" / "sd_accel.js").read_text()
    constants = dict(re.findall(r'^const (\w+) = "(\w+)";', script, re.MULTILINE))
    items = re.search(r"^const TEXT_NODES = \[([^\]]*)\];", script, re.MULTILINE).group(1).split(",")
    return {constants.get(item.strip(), item.strip().strip('"')) for item in items}


def rectangles(path: Path, declarations: dict, after_run: bool = False) -> dict:
    """Node id -> (x, y, w, h) as drawn: the title bar included, grown to the least size as loadGraphData does;
    after_run: the text nodes grown as web/sd_accel.js grows them (computeSize with the text box, plus TEXT_GROWTH)."""
    text_nodes = _text_nodes() if after_run else set()
    out = {}
    for node in _ui(path)["nodes"]:
        least_w, least_h = least_size(node, declarations[node["type"]])
        w, h = max(node["size"][0], least_w), max(node["size"][1], least_h)
        if node["type"] in text_nodes:
            h = max(h, least_h + TEXTBOX_HEIGHT + WIDGET_SPACING + TEXT_GROWTH)
        out[node["id"]] = (node["pos"][0], node["pos"][1] - TITLE_HEIGHT, w, h + TITLE_HEIGHT)
    return out


def _too_close(a, b) -> bool:
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    return not (ax + aw + GAP <= bx or bx + bw + GAP <= ax or ay + ah + GAP <= by or by + bh + GAP <= ay)


def _clashes(rects: dict, names: dict) -> list[str]:
    ids = sorted(rects)
    return [f"{names[a]} {rects[a]} and {names[b]} {rects[b]}"
            for i, a in enumerate(ids) for b in ids[i + 1:] if _too_close(rects[a], rects[b])]


def _names(path: Path) -> dict:
    return {n["id"]: f"#{n['id']} {n.get('title') or n['type']}" for n in _ui(path)["nodes"]}


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=[p.name for p in UI_WORKFLOWS])
def test_every_node_is_as_large_as_the_front_end_draws_it(path, declarations):
    small = []
    for node in _ui(path)["nodes"]:
        least = least_size(node, declarations[node["type"]])
        if node["size"][0] < least[0] or node["size"][1] < least[1]:
            small.append(f"#{node['id']} {node.get('title') or node['type']}: size {node['size']}, "
                         f"the front end draws at least [{least[0]:.0f}, {least[1]:.0f}]")
    assert not small, "\n".join(small)


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=[p.name for p in UI_WORKFLOWS])
def test_no_node_covers_another(path, declarations):
    clashes = _clashes(rectangles(path, declarations), _names(path))
    assert not clashes, f"nodes closer than {GAP} px (rectangles x, y, w, h with the title bar):\n" + "\n".join(clashes)


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=[p.name for p in UI_WORKFLOWS])
def test_no_node_covers_another_after_a_run(path, declarations):
    clashes = _clashes(rectangles(path, declarations, after_run=True), _names(path))
    assert not clashes, ("after a run, with the sd-accel nodes' text boxes, nodes closer than "
                         f"{GAP} px:\n" + "\n".join(clashes))


def test_the_sums_are_the_front_ends(declarations):
    """Heights that the front end (1.27.10, headless Chromium) gave nodes of the examples: computeSize() on load, and
    the node's height after web/sd_accel.js showed a text (the text-box nodes)."""
    loaded = {"SDAccelAcceleratedUNet": 154, "SDAccelTiledVAEDecode": 126, "SDAccelInfo": 78, "KSampler": 262,
              "CLIPTextEncode": 88, "CheckpointLoaderSimple": 98, "DualCLIPLoader": 130, "ConditioningZeroOut": 26,
              "VAEDecode": 46, "SaveAnimatedWEBP": 154, "EmptyHunyuanLatentVideo": 130}
    after_run = {"SDAccelAcceleratedUNet": 308, "SDAccelTiledVAEDecode": 280, "SDAccelInfo": 232}
    for name, height in loaded.items():
        outputs = declarations[name][1]
        node = {"type": name, "outputs": [{"name": "X"}] * outputs}
        least = least_size(node, declarations[name])[1]
        assert least == height, name
        if name in after_run:
            assert name in _text_nodes()
            assert least + TEXTBOX_HEIGHT + WIDGET_SPACING + TEXT_GROWTH == after_run[name], name


@pytest.mark.skipif(not os.environ.get("COMFYUI_ROOT", "").strip(),
                    reason="COMFYUI_ROOT is not set to a ComfyUI checkout")
def test_core_table_is_what_comfyui_declares(tmp_path):
    """The table stands in for the tree: the same inputs, and slot rows as many (ComfyUI 0.33's SaveImage and
    SaveAnimatedWEBP declare an output, drawn beside their one input row: the same size)."""
    assert H.comfy_root() is not None, "COMFYUI_ROOT is not a ComfyUI checkout"
    tree = _tree_declarations(set(CORE), tmp_path)
    assert {name: inputs for name, (inputs, _) in tree.items()} == {name: inputs for name, (inputs, _) in CORE.items()}

    def rows(declared) -> int:
        inputs, outputs = declared
        return max(sum(kind == "link" for _, kind in inputs), outputs, 1)

    assert {name: rows(d) for name, d in tree.items()} == {name: rows(d) for name, d in CORE.items()}
