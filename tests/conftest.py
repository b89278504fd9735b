import atexit
import os
import shutil
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen before triton is first
# imported. With a GPU they run for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines built by tests go to a throw-away cache, never to the user's ~/.cache/sd-accel; it goes when the run ends.
if "SD_ACCEL_CACHE" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="sd-accel-test-cache-")
    os.environ["SD_ACCEL_CACHE"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
