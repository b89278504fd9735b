"""sd-accel's engine. Knows nothing of ComfyUI, A1111 or Forge: it takes torch modules and tensors.

A host's call goes hosts/ (what the adapters share) -> models/ (what the model is) -> plan/ (detect the GPU, choose
a backend and its options) -> accelerate.py (build, and fall back instead of failing) -> build/ (export, engine
cache) -> engine/ (backends, fusions, attention, graphs) -> the kernels in ../kernels. vae/ is the tiled VAE, cli/
the command line. Importing it is cheap and never fails because an optional backend is missing.
"""

__version__ = "0.1.0"


def settings_line() -> str:
    """The SD_ACCEL_* settings in force, in one line (doctor, Accel Info)."""
    import os

    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("SD_ACCEL_")}
    return "settings: " + (", ".join(f"{k}={v}" for k, v in settings.items()) if settings
                           else "no SD_ACCEL_* variable set; defaults in force")
