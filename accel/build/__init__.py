"""Build and store: the ONNX export (export.py), the engine cache (cache.py), weight fingerprints (fingerprint.py)."""
