"""The engines: backends/ (torch, onnxruntime), fusions/ (module patches that call ../../kernels, in one declared
order), the attention kernels' choice (attention.py), per-shape CUDA/HIP graphs (graphs.py)."""
