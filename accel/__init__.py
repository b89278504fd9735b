"""sd-accel engine: GPU detection, path policy, accelerated UNet backends, tiled VAE.

Knows nothing of ComfyUI or A1111: it takes torch modules and tensors. Importing it is cheap and
never fails because an optional backend is missing.
"""

__version__ = "0.1.0"
