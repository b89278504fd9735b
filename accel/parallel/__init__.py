"""One sample over several processes (GPUs): batch (CFG) parallelism for any model, sequence parallelism for ComfyUI's
diffusion transformers, and the worker processes through which a host spreads its model's calls."""
