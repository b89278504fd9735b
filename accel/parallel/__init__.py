"""One sample over several processes (GPUs): sequence parallelism for the video and image transformers."""
