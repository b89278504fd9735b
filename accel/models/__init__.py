"""What the model is: the UNet spec and the canonical call (spec.py), published configs with seeded weights
(configs.py), .safetensors checkpoints (checkpoint.py)."""
