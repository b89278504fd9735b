"""Lets PyPI's torchvision 0.28.0 import beside the CPU build of torch 2.13.0, in the A1111/Forge test environments
that tests/a1111/make-env builds (it copies this file into their site-packages, with a .pth that calls install()).

That torchvision's compiled ops (_C.so) are linked against torch's CUDA libraries, so beside the CPU torch they do not
load, and torchvision then reports that it has no ops, as it does wherever its build does not match torch. But its
_meta_registrations.py registers fake kernels for torchvision::nms and torchvision::qnms without asking whether the ops
exist ("operator torchvision::nms does not exist" ends the import). Where the ops did not load, this defines those two
schemas (torchvision's own, from its C++), without kernels: calling them fails, as any torchvision op does there.

Nothing is imported at start-up but this file: a finder on sys.meta_path waits for torchvision._meta_registrations (by
then torchvision.extension has tried to load the ops) and acts once, so plain `python` and pip do not import torch.
"""

from __future__ import annotations

import sys

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_library = None  # the torch.library.Library that holds the schemas: it must live as long as the process


def define_missing_schemas() -> list[str]:
    """Defines each of SCHEMAS that torchvision's ops left undefined; returns their names."""
    global _library
    import torch

    missing = [name for name in SCHEMAS if not torch._C._jit_get_schemas_for_operator(f"torchvision::{name}")]
    if missing:
        if _library is None:
            _library = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            _library.define(SCHEMAS[name])
    return missing


class _Finder:
    """Finds nothing (None: the next finder imports the module); the first time torchvision._meta_registrations is
    looked for, defines what it needs."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision._meta_registrations":
            uninstall()
            extension = sys.modules.get("torchvision.extension")
            if extension is not None and not extension._has_ops():
                define_missing_schemas()


_finder = _Finder()


def install() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
