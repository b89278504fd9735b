"""sd-accel: one package, `sd_accel`, whatever its folder is called.

ComfyUI imports this folder as a package named after the folder (custom_nodes/sd-accel gives "sd-accel"); A1111 and
Forge load scripts/sd_accel.py by path; install.py runs as a script; the CLI, a pip install and the tests import
`sd_accel`. Under any name but `sd_accel`, this file loads its folder as the package `sd_accel` (nothing is added to
sys.path) and hands over that package's nodes, so one process holds one copy of the engine and its kernels.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

NAME = "sd_accel"
ROOT = os.path.dirname(os.path.abspath(__file__))


def load(root: str = ROOT) -> ModuleType:
    """The package `sd_accel` from the folder `root`, loaded unless it already is. A copy from another folder
    (a second checkout, a pip install) is refused with what to do: two copies would patch the same models."""
    package = sys.modules.get(NAME)
    if package is None:
        spec = importlib.util.spec_from_file_location(NAME, os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        package = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = package
        try:
            spec.loader.exec_module(package)
        except BaseException:
            sys.modules.pop(NAME, None)
            raise
    where = os.path.dirname(os.path.abspath(package.__file__))
    if os.path.normcase(os.path.realpath(where)) != os.path.normcase(os.path.realpath(root)):
        raise ImportError(f"sd-accel is loaded from {where} already, and this copy is {root}: two copies cannot run "
                          "in one process. Keep one (remove the other from custom_nodes or extensions, or "
                          "`pip uninstall sd-accel`), then restart.")
    return package


if __name__ == NAME:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
else:
    _package = load()
    NODE_CLASS_MAPPINGS = _package.NODE_CLASS_MAPPINGS
    NODE_DISPLAY_NAME_MAPPINGS = _package.NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
