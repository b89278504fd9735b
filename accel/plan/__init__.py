"""Detect the GPU (device.py), then choose a backend and its options for it (policy.py, options.py), with the
reasons in words."""
