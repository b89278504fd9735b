"""What the host adapters (nodes/, scripts/) share: one engine slot per host model, A1111's LoRA sync, Forge's
model function wrapper."""
