"""Build and store: the ONNX export (export.py), ONNX Runtime's fusions and fp16 (ort_optimize.py), the weight map and
refits (weights.py), the engine cache (cache.py), weight fingerprints (fingerprint.py)."""
