"""The checkout is one package, `sd_accel`, whatever its folder is called. ComfyUI loads it from custom_nodes/sd-accel
(no Python identifier) without touching sys.path or leaving top-level modules named accel, kernels or nodes behind, and
refuses a second copy; the tests collect in such a folder; a pip install ships every module; no source imports the
generic names or edits sys.path; and the hosts' test servers load the pack without the tests' import link."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import a1111_helpers as a1
import comfy_server
from comfy_helpers import PACK_NAME, REPO

GENERIC = ("accel", "kernels", "nodes")  # the package's folders: never importable as top-level names
OUTSIDE = ("tests", "scripts")  # folders of the checkout that are not part of the package `sd_accel`
NODES = {"SDAccelAcceleratedUNet", "SDAccelInfo", "SDAccelTiledVAEDecode", "SDAccelTiledVAEEncode"}


def _walk(root: Path | None = None):
    """(folder relative to root, its file names) for the checkout's source folders: no hidden folders, bytecode,
    build outputs or virtual environments."""
    root = root or REPO
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__" and not d.endswith(".egg-info")
                         and not (rel == Path(".") and d in ("build", "dist"))
                         and not (Path(folder, d) / "pyvenv.cfg").exists())
        yield rel, files


def _sources() -> list[Path]:
    """The .py files outside tests/, relative to the checkout."""
    return [rel / f for rel, files in _walk() if rel.parts[:1] != ("tests",)
            for f in sorted(files) if f.endswith(".py")]


def _clean_env() -> dict:
    """This process's environment without PYTHONPATH (conftest puts the tests' `sd_accel` link there)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SD_ACCEL_TEST_IMPORT_DIR")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # nothing written into the checkout or the copies
    return env


def _copy_pack(target: Path) -> Path:
    shutil.copytree(REPO, target, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "*.egg-info"))
    return target


@pytest.fixture(scope="module")
def pack_copy(tmp_path_factory) -> Path:
    """The checkout copied to <tmp>/custom_nodes/sd-accel, as ComfyUI-Manager installs it."""
    return _copy_pack(tmp_path_factory.mktemp("comfyui") / "custom_nodes" / PACK_NAME)


# ComfyUI's load_custom_node: the folder imported as a package named after the folder, nothing put on sys.path. Then
# what a run of the node imports (every module of the package, the kernels and backends it loads by name), then a
# second copy of the pack from another folder.
_LOAD_LIKE_COMFYUI = r"""
import importlib, importlib.util, json, pkgutil, sys
from pathlib import Path

import torch  # loaded by the host before any custom node

pack_dir, other_dir = Path(sys.argv[1]), Path(sys.argv[2])
GENERIC = %r


def load_custom_node(name, folder):
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


path_before = list(sys.path)
pack = load_custom_node(pack_dir.name, pack_dir)
import sd_accel
from sd_accel.accel.engine import backends
from sd_accel.accel.engine.fusions.base import kernel_module

optional_missing, failed = {}, {}
for info in pkgutil.walk_packages(sd_accel.__path__, "sd_accel."):
    if info.name in ("sd_accel.__main__", "sd_accel.install"):  # the command line and the installer script
        continue
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as e:
        root = (e.name or "").split(".")[0]
        (failed if root in ("sd_accel", *GENERIC) else optional_missing)[info.name] = repr(e)
    except Exception as e:
        failed[info.name] = repr(e)
kernels = {n: kernel_module(n).__name__ for n in ("groupnorm", "geglu", "layernorm", "upsample", "attention")}
engines = {n: backends.load(n).__name__ for n in backends.BACKENDS}

result = {
    "nodes": sorted(pack.NODE_CLASS_MAPPINGS),
    "node_modules": sorted({c.__module__ for c in pack.NODE_CLASS_MAPPINGS.values()}),
    "same_mappings": pack.NODE_CLASS_MAPPINGS is sd_accel.NODE_CLASS_MAPPINGS,
    "web": pack.WEB_DIRECTORY,
    "sd_accel_file": sd_accel.__file__,
    "imported": sum(m.startswith("sd_accel.") for m in sys.modules),
    "optional_missing": optional_missing, "failed": failed, "kernels": kernels, "engines": engines,
    "generic": sorted(m for m in sys.modules if m.split(".")[0] in GENERIC),
    "path_changed": sys.path != path_before,
    "path_added": [p for p in sys.path if p not in path_before],
}
try:
    load_custom_node("ComfyUI-" + other_dir.name, other_dir)
except ImportError as e:
    result["second_copy_error"] = str(e)
result["sd_accel_file_after_second"] = sys.modules["sd_accel"].__file__
print("RESULT " + json.dumps(result))
"""


def test_pack_loads_as_comfyui_loads_custom_nodes_sd_accel_and_refuses_a_second_copy(pack_copy, tmp_path):
    other = _copy_pack(tmp_path / "other" / "custom_nodes" / "sd-accel-2")
    run = subprocess.run([sys.executable, "-c", _LOAD_LIKE_COMFYUI % (GENERIC,), str(pack_copy), str(other)],
                         cwd=pack_copy.parent.parent, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    r = json.loads(next(ln for ln in run.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])

    assert set(r["nodes"]) == NODES and r["same_mappings"] and r["web"] == "./web"
    assert all(m.startswith("sd_accel.nodes.") for m in r["node_modules"]), r["node_modules"]
    assert Path(r["sd_accel_file"]).resolve() == (pack_copy / "__init__.py").resolve()  # the copy, not the checkout
    assert r["failed"] == {} and r["imported"] > 40, r
    assert r["kernels"] == {n: f"sd_accel.kernels.{n}" for n in r["kernels"]}
    assert r["engines"]["torch"] == "sd_accel.accel.engine.backends.torch_fused"
    assert all(m.startswith("sd_accel.accel.engine.backends.") for m in r["engines"].values()), r["engines"]
    assert r["generic"] == [], f"top-level modules with the package's folder names: {r['generic']}"
    # Triton 3.0 imports setuptools, whose vendored packages then join sys.path: theirs, not the pack's doing
    ours = [p for p in r["path_added"] if not p.replace("\\", "/").endswith("setuptools/_vendor")]
    assert not ours and (r["path_added"] or not r["path_changed"]), \
        f"sys.path changed by loading the pack: added {r['path_added']}"

    message = r.get("second_copy_error", "")
    assert "two copies cannot run" in message and "Keep one" in message, message
    assert str(pack_copy) in message and str(other) in message  # where each copy is, so the user can remove one
    assert r["sd_accel_file_after_second"] == r["sd_accel_file"]  # the first copy keeps running


def _collected(output: str) -> dict[str, int]:
    """Tests collected per file, from `pytest --collect-only` with -q (node ids) or -qq (`file: count`)."""
    counts: dict[str, int] = {}
    for line in output.splitlines():
        if m := re.match(r"^(\S+\.py)::", line):
            counts[m[1]] = counts.get(m[1], 0) + 1
        elif m := re.match(r"^(\S+\.py): (\d+)$", line):
            counts[m[1]] = counts.get(m[1], 0) + int(m[2])
    return counts


def test_tests_collect_and_run_in_a_checkout_named_sd_accel_with_a_dash(pack_copy):
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    procs = [subprocess.Popen([*cmd, "--collect-only", "-q"], cwd=cwd, env=_clean_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for cwd in (pack_copy, REPO)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for cwd, p, out in zip((pack_copy, REPO), procs, outputs):
        assert p.returncode == 0, f"collecting in {cwd}:\n{out[-4000:]}"
    in_copy, in_checkout = map(_collected, outputs)
    assert sum(in_copy.values()) > 100 and "tests/test_layout.py" in in_copy, outputs[0][-3000:]
    assert in_copy == in_checkout
    # Running a test also imports the checkout's root __init__.py (pytest sets up the package it lies in).
    one = subprocess.run([*cmd, "-q", "tests/test_layout.py::test_pyproject_ships_every_package_folder"],
                         cwd=pack_copy, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout[-4000:] + one.stderr[-2000:]  # 5 if nothing ran


def test_pyproject_ships_every_package_folder():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"sd_accel": "."}
    packages, unshipped = set(), []
    for rel, files in _walk():
        if rel.parts[:1] in [(d,) for d in OUTSIDE]:
            continue
        if "__init__.py" in files:
            packages.add(".".join(("sd_accel", *rel.parts)))
        elif rel != Path(".") and any(f.endswith(".py") for f in files):
            unshipped.append(str(rel))  # a namespace folder: imports from a checkout, missing from a pip install
    assert not unshipped, f"folders with modules but no __init__.py: {unshipped}"
    assert {"sd_accel", "sd_accel.accel", "sd_accel.kernels", "sd_accel.nodes"} <= packages
    listed = config["packages"]
    assert not packages - set(listed), f"package folders missing from pyproject.toml: {sorted(packages - set(listed))}"
    assert not set(listed) - packages, f"listed but no package folder: {sorted(set(listed) - packages)}"
    assert len(listed) == len(set(listed)), listed


def _sys_aliases(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound to the sys module (`import sys as x`) and to sys.path (`from sys import path as p`)."""
    modules, paths = {"sys"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "sys"}
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and not node.level:
            paths |= {a.asname or a.name for a in node.names if a.name == "path"}
    return modules, paths


def _is_sys_path(node: ast.AST, modules: set[str], paths: set[str], items: bool = False) -> bool:
    """Whether `node` is sys.path (or, with items, an item or slice of it: `sys.path[:] = ...`)."""
    if items and isinstance(node, ast.Subscript):
        node = node.value
    return (isinstance(node, ast.Name) and node.id in paths) or (
        isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
        and node.value.id in modules)


def _module_string(call: ast.Call) -> str | None:
    """The leading text of importlib.import_module(...)'s or __import__(...)'s first argument."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        arg = arg.values[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def test_sources_import_only_through_sd_accel_and_never_edit_sys_path():
    generic, escapes, path_edits = [], [], []
    for rel in _sources():
        tree = ast.parse((REPO / rel).read_text(), str(rel))
        modules, paths = _sys_aliases(tree)
        in_kernels = rel.parts[0] == "kernels"
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', '?')}"
            names: list[str] = []  # absolute module names imported here
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0:
                    names = [node.module or ""]
                elif in_kernels and node.level >= 2:
                    escapes.append(f"{where} {'.' * node.level}{node.module or ''}")
            elif isinstance(node, ast.Call) and (text := _module_string(node)) is not None:
                if not text.startswith("."):
                    names = [text]
                elif in_kernels and text.startswith(".."):
                    escapes.append(f"{where} {text}")
            generic += [f"{where} {n}" for n in names if n.split(".")[0] in GENERIC]
            if in_kernels:
                escapes += [f"{where} {n}" for n in names if n.split(".")[0] == "sd_accel"]

            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if _is_sys_path(node.func.value, modules, paths) and node.func.attr not in ("index", "count", "copy"):
                    path_edits.append(f"{where} .{node.func.attr}()")
                if node.func.attr == "addsitedir":
                    path_edits.append(f"{where} site.addsitedir()")
            targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            path_edits += [f"{where} assignment" for t in targets if _is_sys_path(t, modules, paths, items=True)]
    assert not generic, f"imports of the package's folders as top-level modules: {generic}"
    assert not escapes, f"kernels/ imports from the project outside kernels/: {escapes}"
    assert not path_edits, f"sys.path edited outside tests/: {path_edits}"


def test_host_servers_load_the_pack_without_the_tests_import_link(tmp_path):
    # ComfyUI imports custom_nodes/sd-accel as the module "sd-accel": a name no `import` statement can spell.
    assert PACK_NAME == "sd-accel" and not PACK_NAME.isidentifier() and a1.EXTENSION == PACK_NAME
    link = Path(os.environ["SD_ACCEL_TEST_IMPORT_DIR"])
    assert (link / "sd_accel").resolve() == REPO and str(link) in os.environ["PYTHONPATH"].split(os.pathsep)

    for host, env in (("ComfyUI", comfy_server.server_env(tmp_path)), ("A1111 and Forge", a1.host_env())):
        assert "SD_ACCEL_TEST_IMPORT_DIR" not in env, host
        helpers = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                   if p and ((Path(p) / "sd_accel").exists() or Path(p).resolve() == REPO)]
        assert not helpers, f"{host}'s server gets {helpers} on PYTHONPATH: `sd_accel` would import without the host"
