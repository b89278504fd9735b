"""ComfyUI entry: ComfyUI imports this folder as a package named after it and reads the mappings below.

The engine (accel/, kernels/) is imported by its top-level names, as A1111 and the CLI import it, so this
folder goes on sys.path. It goes at the end: ComfyUI's own top-level modules (nodes, utils, ...) and other
packs' packages keep their names.
"""

import os
import sys

_ROOT = os.path.dirname(os.path.abspath(__file__))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


def _check_engine_origin() -> None:
    """A different package named `accel` earlier on sys.path would run instead of ours: say so plainly."""
    import accel

    where = os.path.dirname(os.path.dirname(os.path.abspath(accel.__file__)))
    if os.path.normcase(where) != os.path.normcase(_ROOT):
        raise ImportError(f"sd-accel: the module `accel` was loaded from {where}, not from this pack ({_ROOT}); "
                          "another package named accel shadows it. Uninstall that package or remove it from "
                          "PYTHONPATH, then restart ComfyUI.")


_check_engine_origin()

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
