import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The checkout is the package `sd_accel` whatever its folder is called (ComfyUI-Manager names it sd-accel): the tests,
# and the command-line runs they start, import it through a link of that name in a temporary folder, so they test
# this checkout and never an installed copy. The hosts' servers are started without it (its folder is in
# SD_ACCEL_TEST_IMPORT_DIR): ComfyUI, A1111 and Forge must load the pack from their own folders unaided.
IMPORT_DIR = tempfile.mkdtemp(prefix="sd-accel-import-")
os.symlink(ROOT, os.path.join(IMPORT_DIR, "sd_accel"))
atexit.register(shutil.rmtree, IMPORT_DIR, ignore_errors=True)
sys.path.insert(0, IMPORT_DIR)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [IMPORT_DIR, os.environ.get("PYTHONPATH")]))
os.environ["SD_ACCEL_TEST_IMPORT_DIR"] = IMPORT_DIR

# Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be chosen before triton is first
# imported. With a GPU they run for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One thread for torch's CPU ops, here and in every process the tests start (the hosts' servers, the several-device
    # workers), unless told otherwise: the tests' models are tiny, where a second thread costs more than it gains, and
    # far more while another process runs beside (a 23x64 linear on our 2-core CI machine: 21 us on one thread, 114 us
    # on two).
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)

# Engines built by tests go to a throw-away cache, never to the user's ~/.cache/sd-accel; it goes when the run ends.
if "SD_ACCEL_CACHE" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="sd-accel-test-cache-")
    os.environ["SD_ACCEL_CACHE"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

# torch.compile's cache (default <tmp>/torchinductor_<user>, kept) goes with the run too, as every temporary folder the
# tests make does.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _INDUCTOR = tempfile.mkdtemp(prefix="sd-accel-test-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR
    atexit.register(shutil.rmtree, _INDUCTOR, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "fp8_products(device): the test needs fp8 matrix products on `device` (its "
                            "DEVICE); on the CPU it skips, saying why, where torch has no row-wise one (2.6 to 2.8)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """fp8_products: the engine runs 16-bit where fp8.supported() says no, so a test of the fp8 products there has
    nothing to test. Only the CPU is asked: its product is what the oldest torch the requirements allow lacks; on a
    GPU these tests run as before, and a GPU that cannot run fp8 products still fails them."""
    mark = item.get_closest_marker("fp8_products")
    if mark is None or torch.device(mark.args[0]).type != "cpu":
        return
    from sd_accel.accel.engine import fp8

    ok, why = fp8.supported(torch.device("cpu"))
    if not ok:
        pytest.skip(f"fp8 products cannot run: {why}")


@pytest.fixture(scope="module")
def pack():
    """The pack loaded as ComfyUI loads it, with ComfyUI importable (tests/comfy_helpers.py)."""
    import comfy_helpers as H

    H.import_comfy()
    return H.load_pack()


@pytest.fixture()
def comfy_pytorch_attention(monkeypatch):
    """ComfyUI's PyTorch attention as its choice for the whole host, as on NVIDIA and AMD GPUs (on the CPU ComfyUI
    picks another)."""
    import comfy_helpers as H

    if H.comfy_unavailable() is not None:
        pytest.skip(H.comfy_unavailable())
    H.import_comfy()
    H.use_comfy_attention("pytorch", monkeypatch.setattr)


@pytest.fixture()
def no_tf32():
    """Float32 products and convolutions in true float32 (TF32 off) for one test, then torch's flags as they were.
    Set and put back by plain attribute access: torch.backends' flag objects keep them behind __getattr__, which
    pytest's monkeypatch (9.2 and later) takes for missing and deletes at teardown."""
    flags = ((torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"))
    before = [getattr(obj, name) for obj, name in flags]
    for obj, name in flags:
        setattr(obj, name, False)
    yield
    for (obj, name), value in zip(flags, before):
        setattr(obj, name, value)


@pytest.fixture()
def host_attention(monkeypatch):
    """accel/engine/host_attention.py with no choice made and nothing said yet in this process."""
    from sd_accel.accel.engine import host_attention

    monkeypatch.setattr(host_attention, "_CHOICES", {})
    monkeypatch.setattr(host_attention, "_SAID", set())
    return host_attention
