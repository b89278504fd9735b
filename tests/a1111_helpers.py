"""AUTOMATIC1111 and Forge for the tests: finding a checkout with its repositories and a Python environment built
from its pins, seeded checkpoints and a LoRA made by A1111's own model classes, and a headless API server on the CPU.

What the tests need, each from the environment (the suite skips A1111's tests, naming what is missing, without):
- A1111_ROOT: an AUTOMATIC1111 checkout (default ../shared/hosts/stable-diffusion-webui beside this repository);
  treated as read-only: the server gets a temporary --data-dir.
- A1111_REPOSITORIES: the folder holding stable-diffusion-stability-ai, generative-models and k-diffusion at the
  commits A1111 pins (default: A1111_ROOT/repositories).
- A1111_PYTHON: a Python with A1111's requirements_versions.txt installed (A1111's pins conflict with this
  project's test pins, so it is a separate environment, as an A1111 user has); .ci/run builds one.
- Forge (tests skip without): FORGE_ROOT, a stable-diffusion-webui-forge checkout with its repositories/
  huggingface_guess, and FORGE_PYTHON, a Python with Forge's requirements_versions.txt installed. Forge finds the
  model type from a checkpoint's tensor shapes, so its tests use a full-size SD1.5 checkpoint (2 GB, built with
  A1111's classes: the A1111 variables above are needed too).
- HF_HOME: an offline Hugging Face cache with openai/clip-vit-large-patch14's config and tokenizer (default
  ../shared/hosts/hf-offline); nothing is downloaded.
"""

from __future__ import annotations

import atexit
import base64
import functools
import io
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from host_server import HostServer

REPO = Path(__file__).resolve().parent.parent
HOSTS = REPO.parent / "shared" / "hosts"
HERE = Path(__file__).resolve().parent / "a1111"
ACCEL_UNET = "sd-accel (fastest path for this GPU)"  # the SD Unet option's label
EXTENSION = "sd-accel"  # the folder name under extensions/ (a clone of the repository's name): no Python identifier
REPOSITORIES = ("stable-diffusion-stability-ai", "generative-models", "k-diffusion")


def _path(var: str, default: Path | None) -> Path | None:
    raw = os.environ.get(var, "").strip()
    return Path(raw) if raw else default


def a1111_root() -> Path | None:
    root = _path("A1111_ROOT", HOSTS / "stable-diffusion-webui")
    return root if root is not None and (root / "modules" / "sd_unet.py").is_file() else None


def repositories(root: Path | None) -> Path | None:
    repos = _path("A1111_REPOSITORIES", root / "repositories" if root else None)
    ldm = repos / REPOSITORIES[0] / "ldm" / "models" / "diffusion" / "ddpm.py" if repos is not None else None
    return repos if ldm is not None and ldm.is_file() else None


def _offline_cache() -> Path | None:
    home = _path("HF_HOME", HOSTS / "hf-offline")
    return home if home is not None and (home / "hub").is_dir() else None


@functools.cache
def _run_folder() -> Path:
    """This test run's folder for the hosts' processes (the copy of the HF cache, their temporary folder), removed
    when the run ends; the servers that use it are stopped by then."""
    folder = Path(tempfile.mkdtemp(prefix="sd-accel-hosts-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "tmp").mkdir()
    return folder


@functools.cache
def hf_home() -> Path | None:
    """A copy of the offline cache for this test run: diffusers writes a version file into HF_HOME on import, and
    the shared cache stays as it is."""
    home = _offline_cache()
    if home is None:
        return None
    copy = _run_folder() / "hf"
    _writable_copy(home, copy)
    return copy


def missing() -> str | None:
    """Why A1111's tests cannot run here, or None."""
    root = a1111_root()
    if root is None:
        return "no AUTOMATIC1111 checkout (set A1111_ROOT)"
    if repositories(root) is None:
        return (f"A1111's repositories ({', '.join(REPOSITORIES)}) are not in {root / 'repositories'} "
                "(set A1111_REPOSITORIES)")
    python = os.environ.get("A1111_PYTHON", "").strip()
    if not python or not Path(python).is_file():
        return "no Python environment with A1111's pinned packages (set A1111_PYTHON)"
    if _offline_cache() is None:
        return "no offline Hugging Face cache with the CLIP tokenizer (set HF_HOME)"
    return None


def forge_missing() -> str | None:
    """Why Forge's tests cannot run here, or None."""
    root = _path("FORGE_ROOT", None)
    if root is None or not (root / "modules_forge").is_dir():
        return "no Forge checkout (set FORGE_ROOT)"
    if not (root / "repositories" / "huggingface_guess" / "huggingface_guess").is_dir():
        return f"Forge's repositories/huggingface_guess is missing in {root}"
    python_ = os.environ.get("FORGE_PYTHON", "").strip()
    if not python_ or not Path(python_).is_file():
        return "no Python environment with Forge's pinned packages (set FORGE_PYTHON)"
    return missing()


def host_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    # The hosts' temporary files go to this run's folder, which goes when the run ends: gradio's upload folder, and
    # <tmp>/gradio, which Forge's built-in ControlNet extension makes at import whatever GRADIO_TEMP_DIR says.
    env.update({"HF_HOME": str(hf_home()), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": str(_run_folder() / "tmp")})
    # The project's test settings are not A1111's: its own interpreter, and Triton's interpreter mode only where
    # a test asks for it. PYTHONPATH goes with the tests' link that makes `sd_accel` importable (tests/conftest.py):
    # the hosts load the pack from extensions/sd-accel by themselves, as they do for a user.
    # PYTHONPYCACHEPREFIX (.ci/run's) goes too: the host reads its environment's own bytecode and writes none.
    for var in ("PYTHONPATH", "SD_ACCEL_TEST_IMPORT_DIR", "TRITON_INTERPRET", "SD_ACCEL_CACHE", "VIRTUAL_ENV",
                "PYTHONPYCACHEPREFIX"):
        env.pop(var, None)
    env.update(extra or {})
    return env


def python() -> str:
    return os.environ["A1111_PYTHON"]


def make_models(models: Path, name: str = "tiny", lora: str = "testlora", arch: str = "tiny",
                device: str = "cpu") -> None:
    """A seeded checkpoint and a LoRA for it, built by A1111's own classes on `device`: arch "tiny" (an SD1.x with
    its config beside it, as A1111 reads one), "sd15" (the full SD1.5 architecture, A1111's v1-inference.yaml) or
    "sdxl" (generative-models' sd_xl_base.yaml, as A1111 reads an SDXL checkpoint)."""
    ckpt_dir, lora_dir = models / "Stable-diffusion", models / "Lora"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    lora_dir.mkdir(parents=True, exist_ok=True)
    repos = repositories(a1111_root())
    config = {"tiny": HERE / "tiny-sd1.yaml", "sd15": a1111_root() / "configs" / "v1-inference.yaml",
              "sdxl": repos / "generative-models" / "configs" / "inference" / "sd_xl_base.yaml"}[arch]
    if arch == "tiny":
        shutil.copy(config, ckpt_dir / f"{name}.yaml")
    env = host_env({"PYTHONPATH": os.pathsep.join(str(repos / r) for r in REPOSITORIES[:2])})
    run = subprocess.run([python(), str(HERE / "make_checkpoint.py"), str(config),
                          str(ckpt_dir / f"{name}.safetensors"), "--lora", str(lora_dir / f"{lora}.safetensors"),
                          "--half", "--device", device], env=env, capture_output=True, text=True, timeout=600)
    if run.returncode:
        raise RuntimeError(f"building the test checkpoint failed:\n{run.stderr[-3000:]}")


def _writable_copy(source: Path, target: Path) -> None:
    def skip(folder: str, names: list[str]) -> set[str]:  # the checkout's own models/ (Forge's) stays behind
        return {n for n in names if n in ("__pycache__", ".git") or (n == "models" and Path(folder) == source)}

    shutil.copytree(source, target, ignore=skip)
    for path in (target, *target.rglob("*")):
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | 0o200)


class Server(HostServer):
    """A1111's (or Forge's) launch.py --nowebui --api on the CPU in full precision (with gpu: on the GPU with the
    host's defaults, fp16), on a loopback port, with this repository as its one extension (besides the built-in ones)
    and `data` as its data folder."""

    probe = "/sdapi/v1/sd-models"

    def __init__(self, data: Path, *flags: str, forge: bool = False, gpu: bool = False,
                 startup_timeout: float = 180) -> None:
        super().__init__()
        self.name = "Forge" if forge else "A1111"
        self.data = data
        (data / "extensions").mkdir(parents=True, exist_ok=True)
        ext = data / "extensions" / EXTENSION
        if not ext.exists():
            # The checkout without its .git: A1111 reads an extension's git remote and prints a traceback for a
            # repository that has none, as a clone made by hand has not.
            ext.mkdir()
            for item in REPO.iterdir():
                if item.name != ".git":
                    (ext / item.name).symlink_to(item, target_is_directory=item.is_dir())
        # Live previews would download A1111's approximate VAE; the CPU needs none.
        config = data / "config.json"
        if not config.exists():
            config.write_text(json.dumps({"live_previews_enable": False}))
        # The hosts write into their own folder (config_states/): each runs from a writable copy, and the checkout
        # stays as it is.
        root = data / "webui"
        if not root.exists():
            _writable_copy(Path(os.environ["FORGE_ROOT"]) if forge else a1111_root(), root)
        if forge:
            cwd = data
            cmd = [os.environ["FORGE_PYTHON"], str(root / "launch.py"), *([] if gpu else ["--always-cpu"])]
        else:
            # A1111 finds its `ldm` repository in the working folder too; the others beside it.
            cwd = repositories(a1111_root()) / REPOSITORIES[0]
            cmd = [python(), str(root / "launch.py"),
                   *([] if gpu else ["--use-cpu", "all", "--no-half", "--precision", "full"])]
        cmd += ["--skip-torch-cuda-test", "--skip-prepare-environment", "--skip-install", "--skip-version-check",
                "--api", "--nowebui", "--server-name", "127.0.0.1", "--port", str(self.port), "--data-dir", str(data),
                *flags]
        self.start(cmd, cwd, host_env({"SD_ACCEL_CACHE": str(data / "accel")}), data / f"server-{self.port}.log",
                   startup_timeout)

    def options(self, **values) -> None:
        self.post("/sdapi/v1/options", values)

    def image(self, path: str, payload: dict):
        """The first image of a txt2img / img2img call, as a float array (H, W, 3) in 0..255."""
        import numpy as np
        from PIL import Image

        out = self.post(path, payload)
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(out["images"][0]))).convert("RGB"), dtype=np.float64)

    def status(self) -> dict:
        return self.get("/sd-accel/status")


def psnr(a, b) -> float:
    import numpy as np

    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * float(np.log10(255.0 ** 2 / mse))


def png_b64(array) -> str:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.clip(array, 0, 255).astype("uint8")).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()
