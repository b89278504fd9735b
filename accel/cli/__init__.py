"""python -m sd_accel: doctor, demo, bench (UNet, VAE, kernels, profile), cache (main.py routes them)."""
