"""sd-accel's engine. Knows nothing of ComfyUI, A1111 or Forge: it takes torch modules and tensors.

A host's call goes hosts/ (what the adapters share) -> models/ (what the model is) -> plan/ (detect the GPU, choose
a backend and its options) -> accelerate.py (build, and fall back instead of failing) -> build/ (export, engine
cache) -> engine/ (backends, fusions, attention, graphs) -> the kernels in ../kernels. vae/ is the tiled VAE, cli/
the command line. Importing it is cheap and never fails because an optional backend is missing.
"""

__version__ = "0.1.0"
