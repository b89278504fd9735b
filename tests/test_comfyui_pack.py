"""The ComfyUI pack without ComfyUI: it imports as ComfyUI imports it, its nodes' declarations match their
functions, the example workflows agree with the nodes and with themselves, install.py plans per GPU, and the
host-agnostic engine slot (accel/hosts/support.py) serves, refits and falls back as the nodes rely on."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import types

import pytest
import torch

import comfy_helpers as H
from sd_accel.accel.plan.device import GpuInfo
from sd_accel.accel.errors import BadInput
from sd_accel.accel.hosts.support import EngineSlot, shape_profile

WORKFLOWS = sorted(H.REPO.glob("workflows/*_api.json"))
assert len(WORKFLOWS) >= 2, "workflows/ has the SD1.5 and SDXL examples"


def test_pack_imports_like_comfyui_imports_it_without_comfy():
    code = (
        "import sys\n"
        "sys.path.insert(0, %r)\n"
        "import comfy_helpers as H\n"
        "pack = H.load_pack()\n"
        "print(sorted(pack.NODE_CLASS_MAPPINGS), pack.WEB_DIRECTORY, 'comfy' in sys.modules)\n"
    ) % str(H.REPO / "tests")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['SDAccelAcceleratedUNet',", "'SDAccelInfo',", "'SDAccelTiledVAEDecode',",
                                  "'SDAccelTiledVAEEncode']", "./web", "False"]
    assert (H.REPO / "web" / "sd_accel.js").is_file()


@pytest.fixture(scope="module")
def pack():
    return H.load_pack()


def test_every_node_function_takes_exactly_its_declared_inputs(pack):
    for name, cls in pack.NODE_CLASS_MAPPINGS.items():
        types_ = cls.INPUT_TYPES()
        declared = {k for part in ("required", "optional", "hidden") for k in types_.get(part, {})}
        params = inspect.signature(getattr(cls, cls.FUNCTION)).parameters
        named = {k for k, v in params.items() if v.kind != v.VAR_KEYWORD} - {"self"}
        assert named == declared, name
        # Only Accel Info takes more: the links that order the copy of itself it makes to wait for the samplers.
        assert any(v.kind == v.VAR_KEYWORD for v in params.values()) == (name == "SDAccelInfo"), name
        assert cls.CATEGORY == "sd-accel" and len(cls.RETURN_TYPES) == 1
        assert name in pack.NODE_DISPLAY_NAME_MAPPINGS


def _widgets(cls) -> list[str]:
    """The inputs of a node that are widgets (not links), in the order ComfyUI stores their values."""
    types_ = cls.INPUT_TYPES()
    inputs = {**types_["required"], **types_.get("optional", {})}
    return [k for k, v in inputs.items() if isinstance(v[0], list) or v[0] in ("INT", "FLOAT", "BOOLEAN", "STRING")]


@pytest.mark.parametrize("api_path", WORKFLOWS, ids=[p.name for p in WORKFLOWS])
def test_example_workflow_ui_and_api_agree(pack, api_path):
    api = json.loads(api_path.read_text())
    ui = json.loads(api_path.with_name(api_path.name.replace("_api", "")).read_text())
    nodes = {str(n["id"]): n for n in ui["nodes"]}
    assert set(nodes) == set(api)
    used = {n["class_type"] for n in api.values()}
    assert {"SDAccelAcceleratedUNet", "KSampler"} <= used
    # Wan's VAE (Qwen-Image's too) decodes with ComfyUI's VAEDecode in those examples: at their sizes it fits, where
    # the tiled node would run one tile, which is that same decode.
    video_vae = any(n["inputs"].get("vae_name") in ("wan_2.1_vae.safetensors", "qwen_image_vae.safetensors")
                    for n in api.values())
    assert ("VAEDecode" if video_vae else "SDAccelTiledVAEDecode") in used
    links = {link[0]: link for link in ui["links"]}
    for node_id, node in api.items():
        assert nodes[node_id]["type"] == node["class_type"]
        for slot, entry in enumerate(nodes[node_id]["inputs"]):  # every UI link is the API's reference
            link = links[entry["link"]]
            assert link[3] == int(node_id) and link[4] == slot
            assert node["inputs"][entry["name"]] == [str(link[1]), link[2]]
        cls = pack.NODE_CLASS_MAPPINGS.get(node["class_type"])
        if cls is not None:  # our nodes: every widget value in the UI file is the API's value, in order
            names = _widgets(cls)
            assert nodes[node_id]["widgets_values"] == [node["inputs"][k] for k in names]
            profile = {k: v for k, v in node["inputs"].items() if k.endswith(("_width", "_height", "_batch"))}
            if profile:
                dims = ("batch", "height", "width")
                shape_profile(*[[profile[f"{m}_{d}"] for m in ("min", "opt", "max")] for d in dims])


# ------------------------------------------------------------------------------------------ shape profile

def test_shape_profile_checks_order_and_multiples_of_8():
    p = shape_profile((1, 1, 4), (512, 768, 1024), (512, 1024, 1536))
    assert p.options() == {"batch": [1, 2, 8], "height": [512, 768, 1024], "width": [512, 1024, 1536]}
    assert p.contains((8, 4, 128, 192)) and p.contains((1, 4, 64, 64))
    assert not p.contains((9, 4, 64, 64)) and not p.contains((2, 4, 136, 64)) and not p.contains((2, 4, 32, 64))
    with pytest.raises(BadInput, match="min 1024, opt 768, max 2048.*Set min height <= opt height"):
        shape_profile((1, 1, 1), (1024, 768, 2048), (512, 512, 512))
    with pytest.raises(BadInput, match="width 516 is not a multiple of 8"):
        shape_profile((1, 1, 1), (512, 512, 512), (512, 516, 1024))
    with pytest.raises(BadInput, match="min batch is 0"):
        shape_profile((0, 1, 1), (512, 512, 512), (512, 512, 512))


# ------------------------------------------------------------------------------------------ engine slot

@pytest.fixture(scope="module")
def unet_and_inputs():
    from sd_accel.accel.models.configs import build_unet, example_inputs

    unet = build_unet("tiny-sd15")
    return unet, example_inputs(unet, batch=2, latent=8)


def reference(unet, x, t, ctx):
    from sd_accel.accel.models.spec import CanonicalUNet

    with torch.inference_mode():
        return CanonicalUNet(unet)(x, t, ctx)


def test_slot_builds_on_first_call_serves_and_undoes_at_run_end(unet_and_inputs):
    unet, (x, t, ctx, _y) = unet_and_inputs
    changes = []
    slot = EngineSlot("torch", on_change=lambda s: changes.append(s.backend))
    plain_calls = []

    def plain():
        plain_calls.append(1)
        return reference(unet, x, t, ctx)

    out = slot.call(unet, "w1", x, t, ctx, None, None, plain)
    assert torch.allclose(out, reference(unet, x, t, ctx))
    assert slot.status.backend == "torch" and slot.status.engine_calls == 1 and not plain_calls
    assert changes and changes[-1] == "torch"
    released = []
    slot.acc.release = lambda: released.append(1)
    slot.end_run()
    assert released == [1] and slot.acc is None  # the torch path's module changes are undone per run
    slot.call(unet, "w1", x, t, ctx, None, None, plain)
    assert slot.status.engine_calls == 2 and slot.acc is not None

    kept = slot.acc
    slot.end_run(keep_graphs=True)  # undone as well, graphs kept: the next call redoes the changes
    assert slot.acc is kept and kept.engine.suspended
    slot.call(unet, "w1", x, t, ctx, None, None, plain)
    assert slot.acc is kept and not kept.engine.suspended and slot.status.engine_calls == 3


def test_first_call_at_each_size_says_why_it_waits(unet_and_inputs):
    """The first step at a new batch or image size prepares the kernels for it: the host's progress says so once per
    size (and the build's own stages come first)."""
    from sd_accel.accel.progress import CallbackProgress

    unet, (x, t, ctx, _y) = unet_and_inputs
    stages = []
    slot = EngineSlot("torch", progress=lambda: CallbackProgress(
        lambda stage, fraction, eta: fraction == 0 and stages.append(stage)))  # each stage as it starts
    wide = torch.cat([x, x], dim=-1)
    for inputs in (x, x, wide, x, wide):
        slot.call(unet, "w", inputs, t, ctx, None, None, lambda: reference(unet, inputs, t, ctx))
    first = [s for s in stages if s.startswith("first step")]
    h, w = x.shape[-2] * 8, x.shape[-1] * 8
    assert first == [f"first step at {w}x{h}, batch {x.shape[0]}: preparing the kernels for this size (once per size)",
                     f"first step at {2 * w}x{h}, batch {x.shape[0]}: preparing the kernels for this size (once per "
                     "size)"]


def test_slot_runs_plain_when_the_build_or_a_call_fails(unet_and_inputs, monkeypatch, caplog):
    import sd_accel.accel.engine.backends.torch_fused as torch_fused

    unet, (x, t, ctx, _y) = unet_and_inputs
    expected = reference(unet, x, t, ctx)
    monkeypatch.setattr(torch_fused, "build", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no luck")))
    slot = EngineSlot("torch")
    assert torch.equal(slot.call(unet, "w", x, t, ctx, None, None, lambda: expected), expected)
    assert slot.status.backend == "plain" and any("no luck" in m for m in slot.status.messages)
    monkeypatch.undo()

    slot = EngineSlot("torch")
    slot.call(unet, "w", x, t, ctx, None, None, lambda: expected)

    def broken(*_a, **_k):
        raise ValueError("kernel exploded")

    slot.acc.engine.__class__ = type("Broken", (slot.acc.engine.__class__,), {"__call__": broken})
    for _ in range(2):
        assert torch.equal(slot.call(unet, "w", x, t, ctx, None, None, lambda: expected), expected)
    assert slot.status.plain_calls == 2
    assert sum("kernel exploded" in m for m in slot.status.messages) == 1


class FakeEngine:
    """An engine path (like ONNX Runtime) that bakes weights in: it answers with a marker and counts refits."""

    backend = "onnxruntime"

    def __init__(self, unet):
        self.unet = unet
        self.refits = 0
        self.released = False

    def __call__(self, x, timesteps, context, y=None, control=None, **kwargs):
        return torch.full_like(x, 7.0)

    def release(self):
        self.released = True


def fake_backend(refit: bool) -> types.ModuleType:
    module = types.ModuleType("fake_engine_backend")
    module.builds = []
    module.available = lambda gpu: (True, "")

    def build(unet, options, runtime, progress):
        module.builds.append((options, runtime))
        return FakeEngine(unet)

    module.build = build
    if refit:
        def update_weights(engine, unet):
            engine.refits += 1

        module.update_weights = update_weights
    return module


@pytest.mark.parametrize("refit", [True, False])
def test_engine_path_follows_weight_changes_and_sends_other_shapes_to_torch(unet_and_inputs, monkeypatch, refit):
    import sd_accel.accel.engine.backends
    import sd_accel.accel.plan.policy

    unet, (x, t, ctx, _y) = unet_and_inputs
    backend = fake_backend(refit)
    monkeypatch.setitem(sys.modules, "fake_engine_backend", backend)
    monkeypatch.setitem(sd_accel.accel.engine.backends.BACKENDS, "onnxruntime", "fake_engine_backend")
    monkeypatch.setattr(sd_accel.accel.plan.policy, "probe_packages", lambda: {"onnxruntime": True})
    profile = shape_profile((1, 1, 1), (64, 64, 64), (64, 64, 64))
    # planned for a CPU (a GPU's plan would also ask for ORT's GPU provider), where the fake engine serves calls
    slot = EngineSlot("onnxruntime", None, profile, gpu=GpuInfo("cpu", "cpu"), cache_root="/nowhere")
    plain = lambda: reference(unet, x, t, ctx)  # noqa: E731

    assert (slot.call(unet, "lora-a", x, t, ctx, None, None, plain) == 7).all()
    runtime = backend.builds[0][1]
    assert runtime.profile == {"batch": [1, 2, 2], "height": [64, 64, 64], "width": [64, 64, 64]}
    assert runtime.cache_root == "/nowhere"
    big = torch.randn(2, 4, 8, 16)
    out = slot.call(unet, "lora-a", big, t, torch.randn(2, 77, 32), None, None, plain)
    assert not (out == 7).all()  # out of profile: served by the torch fallback
    assert any("batch 2 at 128x64 px (width x height) is outside the engine's profile" in m
               for m in slot.status.messages)

    first = slot.acc.engine
    slot.call(unet, "lora-b", x, t, ctx, None, None, plain)  # the host's weights changed (a LoRA)
    if refit:
        assert first.refits == 1 and slot.acc.engine is first and len(backend.builds) == 1
    else:
        assert first.released and slot.acc.engine is not first and len(backend.builds) == 2

    slot.end_run()  # engines of other paths stay; the torch fallback is freed and comes back on demand
    assert slot.acc is not None and slot.acc.fallback is None
    slot.call(unet, "lora-b", big, t, torch.randn(2, 77, 32), None, None, plain)
    assert slot.acc.fallback is not None


# ------------------------------------------------------------------------------------------ install.py

@pytest.fixture(scope="module")
def installer():
    sys.path.insert(0, str(H.REPO))
    import install

    return install


def test_install_plans_per_gpu(installer):
    reqs = ["diffusers>=0.30", "filelock>=3.12"]
    have = {"diffusers": True, "filelock": True}
    plan = installer.plan_installs("nvidia", "Linux", have, set(), reqs)
    assert [s.packages for s in plan.steps] == [["triton"]]
    plan = installer.plan_installs("nvidia", "Windows", {"diffusers": True}, {"onnxruntime"}, reqs)
    assert [s.packages for s in plan.steps] == [["filelock>=3.12"], ["triton-windows"], ["onnx", "onnxruntime-gpu"]]
    plan = installer.plan_installs("amd", "Linux", have, {"onnxruntime"}, reqs)
    assert plan.steps == []
    assert any("pytorch-triton-rocm" in n for n in plan.notes) and any("repo.radeon.com" in n for n in plan.notes)
    # Hopper and Blackwell: cuDNN's frontend for fp8 attention, without its CuTe DSL dependencies
    plan = installer.plan_installs("nvidia", "Linux", {**have, "triton": True}, set(), reqs, "hopper")
    assert [(s.packages, s.options) for s in plan.steps] == [(["nvidia-cudnn-frontend"], ["--no-deps"])]
    assert installer.plan_installs("nvidia", "Linux", {**have, "triton": True, "cudnn_frontend": True}, set(), reqs,
                                   "blackwell").steps == []
    assert installer.plan_installs("nvidia", "Linux", {**have, "triton": True}, set(), reqs, "ada").steps == []
    # FlashAttention-4 only when asked, with the CuTe DSL's libraries for torch's CUDA
    assert installer.plan_installs("nvidia", "Linux", {**have, "triton": True, "cudnn_frontend": True},
                                   {"flash-attn-4"}, reqs, "hopper", 13).steps[0].packages == ["flash-attn-4[cu13]"]
    assert installer.plan_installs("nvidia", "Linux", {**have, "triton": True, "cudnn_frontend": True},
                                   {"flash-attn-4"}, reqs, "blackwell", 12).steps[0].packages == ["flash-attn-4"]
    plan = installer.plan_installs("nvidia", "Linux", {**have, "triton": True}, {"flash-attn-4"}, reqs, "ada", 12)
    assert plan.steps == [] and any("Hopper and Blackwell" in n for n in plan.notes)
    have_cpu_ort = {**have, "triton": True, "onnxruntime": True}
    plan = installer.plan_installs("nvidia", "Linux", have_cpu_ort, {"onnxruntime"}, reqs)
    assert plan.steps == [] and any("pip uninstall onnxruntime" in n for n in plan.notes)


def test_install_dry_run_installs_nothing_and_never_fails():
    out = subprocess.run([sys.executable, str(H.REPO / "install.py"), "--dry-run", "--with", "tensorrt,bogus"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[sd-accel] GPU: " in out.stdout and "ignoring unknown extra 'bogus'" in out.stdout
    assert "ignoring unknown extra 'tensorrt'; the extras are: onnxruntime, flash-attn-4, fa3-fwd." in out.stdout  # not offered yet
    assert "running: pip" not in out.stdout
