"""A1111's Lora extension keeps working under sd-accel: the adapter merges the wanted networks into the UNet's
weights itself (the engine never calls the layers' patched forwards), only when they change, and runs the built-in
UNet in the extension's functional mode.

A fake `networks` module does what the real one's network_apply_weights does to the weights (back up, restore, add
each loaded network's delta in place, remember the key), so the sync can be checked layer by layer here and on the
GPU; the real extension's source (A1111_ROOT) is checked to still define what the sync relies on, and
test_a1111_server.py runs the real extension in a real A1111, both modes.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import types
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

from a1111_helpers import a1111_root
from sd_accel.accel.hosts.a1111 import KEY_FIELDS, PATCHED_TYPES, LoraSync, lora_extension
from ldm_unet import tiny_ldm_unet

ROOT = Path(__file__).resolve().parents[1]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


class Network:
    """What network_apply_weights reads of a networks.Network: the key fields, and per layer name a delta."""

    def __init__(self, name: str, unet_multiplier: float = 1.0, te_multiplier: float = 1.0, dyn_dim=None,
                 scale: float = 0.05) -> None:
        self.name, self.dyn_dim, self.scale = name, dyn_dim, scale
        self.te_multiplier, self.unet_multiplier = te_multiplier, unet_multiplier

    def delta(self, layer_name: str, weight: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(f"{self.name}/{layer_name}".encode()))
        d = torch.randn(weight.shape, generator=g) * self.scale * self.unet_multiplier
        return d.to(weight.device, weight.dtype)


def fake_networks() -> types.ModuleType:
    """A stand-in for extensions-builtin/Lora/networks.py with the behaviour of its network_apply_weights and of
    network_forward's restore, on the layers' `weight` (enough for these models)."""
    m = types.ModuleType("networks")
    m.loaded_networks = []
    m.applied_to = []  # every layer network_apply_weights was called on

    def network_apply_weights(self: nn.Module) -> None:
        m.applied_to.append(self)
        layer_name = getattr(self, "network_layer_name", None)
        if layer_name is None:
            return
        current = getattr(self, "network_current_names", ())
        wanted = tuple((x.name, x.te_multiplier, x.unet_multiplier, x.dyn_dim) for x in m.loaded_networks)
        backup = getattr(self, "network_weights_backup", None)
        if backup is None and wanted != ():
            if current != ():
                raise RuntimeError(f"{layer_name} - no backup weights found and current weights are not unchanged")
            backup = self.network_weights_backup = self.weight.to("cpu", copy=True)
        if current != wanted:
            if backup is not None:
                self.weight.copy_(backup)
            for net in m.loaded_networks:
                self.weight.copy_(self.weight + net.delta(layer_name, self.weight))
            self.network_current_names = wanted

    def network_forward_restore(self: nn.Module) -> None:
        """What network_forward does to a layer before computing it: back to the backup, nothing remembered."""
        backup = getattr(self, "network_weights_backup", None)
        if backup is not None:
            self.weight.copy_(backup)
        self.network_current_names, self.network_weights_backup = (), None

    m.network_apply_weights = network_apply_weights
    m.network_forward_restore = network_forward_restore
    return m


def named_unet(seed: int = 0) -> nn.Module:
    """A small ldm UNet whose layers carry the names assign_network_names_to_compvis_modules gives them."""
    unet = tiny_ldm_unet(seed=seed)
    for name, layer in unet.named_modules():
        layer.network_layer_name = f"diffusion_model.{name}".replace(".", "_")
    return unet


def weights(unet: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in unet.state_dict().items()}


def expected(unet: nn.Module, base: dict[str, torch.Tensor], nets: list[Network]) -> dict[str, torch.Tensor]:
    """base plus each network's delta on every weight of a patched layer."""
    out = dict(base)
    for name, layer in unet.named_modules():
        if isinstance(layer, PATCHED_TYPES) and getattr(layer, "weight", None) is not None:
            key = f"{name}.weight"
            for net in nets:
                out[key] = out[key] + net.delta(layer.network_layer_name, out[key])
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.fixture
def networks(monkeypatch) -> types.ModuleType:
    m = fake_networks()
    monkeypatch.setitem(sys.modules, "networks", m)
    return m


def test_host_module_imports_without_a1111():
    code = ("import sys, sd_accel.accel.hosts.a1111; "
            "loaded = {'modules', 'ldm', 'networks', 'gradio'} & set(sys.modules); assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_without_the_lora_extension_the_engine_serves_and_nothing_changes(monkeypatch):
    unet = named_unet()
    base = weights(unet)
    monkeypatch.delitem(sys.modules, "networks", raising=False)
    assert lora_extension() is None and LoraSync().sync(unet, functional=False)
    # A `networks` module without network_apply_weights (another host's Lora extension) is not A1111's.
    monkeypatch.setitem(sys.modules, "networks", types.ModuleType("networks"))
    sys.modules["networks"].loaded_networks = [Network("a")]
    assert lora_extension() is None and LoraSync().sync(unet, functional=True)
    assert same(weights(unet), base)


def test_networks_are_applied_once_per_change_of_the_wanted_key(networks):
    unet = named_unet()
    base = weights(unet)
    patched = [m for m in unet.modules() if isinstance(m, PATCHED_TYPES)]
    lora = LoraSync()

    networks.loaded_networks[:] = [Network("a")]
    assert lora.sync(unet, functional=False)  # (a) the first call applies, on every patched layer and only those
    assert [id(m) for m in networks.applied_to] == [id(m) for m in patched]
    want_a = expected(unet, base, [Network("a")])
    assert same(weights(unet), want_a)

    networks.applied_to.clear()
    for _ in range(3):  # (b) an unchanged key: no layer is visited
        assert lora.sync(unet, functional=False)
    assert networks.applied_to == [] and same(weights(unet), want_a)

    networks.loaded_networks[0].unet_multiplier = 0.5  # (c) a new multiplier: applied again, from the backup
    assert lora.sync(unet, functional=False) and len(networks.applied_to) == len(patched)
    assert same(weights(unet), expected(unet, base, [Network("a", unet_multiplier=0.5)]))

    networks.loaded_networks[:] = [Network("a", unet_multiplier=0.5), Network("b", dyn_dim=4)]
    assert lora.sync(unet, functional=False)
    assert same(weights(unet), expected(unet, base, [Network("a", unet_multiplier=0.5), Network("b")]))

    networks.loaded_networks.clear()  # no network wanted any more: the original weights come back
    assert lora.sync(unet, functional=False)
    assert same(weights(unet), base)


def test_weights_merged_before_sd_accel_was_chosen_are_brought_in_line(networks):
    """The built-in UNet merged network a; then sd-accel was chosen and the next prompt has no LoRA."""
    unet = named_unet()
    base = weights(unet)
    networks.loaded_networks[:] = [Network("a")]
    for layer in unet.modules():
        if isinstance(layer, PATCHED_TYPES):
            networks.network_apply_weights(layer)
    networks.loaded_networks.clear()
    assert LoraSync().sync(unet, functional=False)
    assert same(weights(unet), base)


def test_functional_mode_with_networks_runs_the_plain_model(networks):
    unet = named_unet()
    base = weights(unet)
    lora = LoraSync()
    assert lora.sync(unet, functional=True)  # (d) nothing loaded: nothing for the functional mode to add
    networks.loaded_networks[:] = [Network("a")]
    assert lora.sync(unet, functional=False)
    networks.applied_to.clear()
    assert not lora.sync(unet, functional=True)  # (d) the plain model must run...
    assert networks.applied_to == []
    for layer in unet.modules():  # ...and its network_forward puts every layer it runs back to the backup
        if isinstance(layer, PATCHED_TYPES):
            networks.network_forward_restore(layer)
    assert same(weights(unet), base)
    assert lora.sync(unet, functional=False)  # the option turned off again: the same key is merged anew
    assert same(weights(unet), expected(unet, base, [Network("a")]))


@gpu
def test_torch_path_graphs_and_packed_weights_follow_the_networks_in_place(networks):
    """The bug this fixes: after the first capture the engine kept the weights it started with. With the sync the
    in-place update reaches the replayed graph, its fused kernels and packed projections without a new capture."""
    from sd_accel.accel.engine.backends import torch_fused
    from sd_accel.accel.models.spec import CanonicalUNet
    from sd_accel.accel.plan.device import detect
    from sd_accel.accel.plan.policy import choose

    unet = named_unet(seed=7).to("cuda", torch.float16)
    canonical = CanonicalUNet(unet)
    engine = torch_fused.build(canonical, choose(detect(), "torch").torch)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 4, 16, 16, generator=g).to("cuda", torch.float16)
    t = torch.tensor([10.0, 500.0], device="cuda")
    ctx = torch.randn(2, 77, canonical.spec.context_dim, generator=g).to("cuda", torch.float16)
    lora = LoraSync()

    def plain() -> torch.Tensor:
        engine.suspend()
        with torch.inference_mode():
            return canonical(x, t, ctx)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert lora.sync(unet, functional=False)
    engine(x, t, ctx)  # a new shape's first call runs plain; the second captures
    base = engine(x, t, ctx)
    assert engine.graphs.captures == 1

    networks.loaded_networks[:] = [Network("a", scale=0.02)]
    assert torch.equal(engine(x, t, ctx), base)  # unsynced, the graph computes the old weights
    for multiplier in (1.0, 0.5):
        networks.loaded_networks[0].unet_multiplier = multiplier
        assert lora.sync(unet, functional=False)
        out = engine(x, t, ctx)
        assert rel(out, plain()) <= 1e-2 and rel(out, base) > 5e-2
    networks.loaded_networks.clear()
    assert lora.sync(unet, functional=False)
    assert rel(engine(x, t, ctx), base) <= 1e-3
    assert engine.graphs.captures == 1
    engine.release()


def _a1111_lora_dir() -> Path:
    root = a1111_root()
    if root is None:
        pytest.skip("set A1111_ROOT to an AUTOMATIC1111 stable-diffusion-webui checkout to check its Lora extension")
    return root / "extensions-builtin" / "Lora"


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_a1111_networks_module_still_defines_what_the_adapter_uses():
    lora_dir = _a1111_lora_dir()
    tree = _parse(lora_dir / "networks.py")
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"network_apply_weights", "network_forward"} <= functions.keys()
    module_names = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    assert "loaded_networks" in module_names

    # network_apply_weights re-merges a layer when this key changes; LoraSync must compute the same one.
    wanted = next(n.value for n in ast.walk(functions["network_apply_weights"])
                  if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "wanted_names"
                                                       for t in n.targets))
    generator = next(n for n in ast.walk(wanted) if isinstance(n, ast.GeneratorExp))
    assert isinstance(generator.generators[0].iter, ast.Name) and generator.generators[0].iter.id == "loaded_networks"
    assert isinstance(generator.elt, ast.Tuple)
    assert tuple(e.attr for e in generator.elt.elts if isinstance(e, ast.Attribute)) == KEY_FIELDS

    # The functional mode is the lora_functional option, read in the patched forwards.
    assert any(isinstance(n, ast.Attribute) and n.attr == "lora_functional" for n in ast.walk(tree))


def test_a1111_lora_patches_cover_the_layer_types_the_adapter_visits():
    lora_dir = _a1111_lora_dir()
    patched = set()
    for n in ast.walk(_parse(lora_dir / "lora_patches.py")):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "patch"
                and len(n.args) >= 3 and isinstance(n.args[2], ast.Constant) and n.args[2].value == "forward"):
            patched.add(n.args[1].attr)
    assert patched == {t.__name__ for t in PATCHED_TYPES}

    # The extension's scripts import it as the top-level module `networks`: the name looked up in sys.modules.
    script = _parse(lora_dir / "scripts" / "lora_script.py")
    assert any(isinstance(n, ast.Import) and any(a.name == "networks" and a.asname is None for a in n.names)
               for n in script.body)
    assert any(isinstance(n, ast.Constant) and n.value == "lora_functional" for n in ast.walk(script))
