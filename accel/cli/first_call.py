"""`python -m sd_accel bench --first-call`: how long the torch path keeps a user waiting at a new image size, and where
that time goes.

Each model runs in fresh processes, one after another, on seeded weights already loaded (building the weights is not
counted), all with a Triton on-disk cache of their own that starts empty, as on a fresh machine: the first process
compiles every kernel (on a thread pool, before the first step at each size: kernels/ahead.py); the second finds
what the first compiled (a restarted ComfyUI or A1111); the third starts from an empty cache again with the kernels
compiled one after another as the step reaches them (the option parallel_compile off), and the fourth runs the
first's shapes with cuDNN's exhaustive algorithm search on (the option cudnn_benchmark), to show what that costs.
Per shape:

  first   the first output at that size: one plain step with the fused kernels (Triton compiles what it has not
          compiled for these shapes, cuDNN picks its algorithms); nothing is captured yet
  kernels of them, the kernels compiled ahead; `skip run` the step that found them missing (its output thrown
          away), `compile` the wait for them
  second  the second call at that size: the CUDA graph's warm-up and capture (`capture` of it), then the replay
  steady  a step at that size once captured (median)

Triton's compilation is process 1's first minus process 2's (in parallel) and process 3's minus process 2's (in
turn); cuDNN's search is process 4's first minus process 2's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

from ..errors import BadInput

DEFAULT_SHAPES = {
    "sd15": ((512, 512), (512, 768), (768, 768)),
    "sd21": ((768, 768), (768, 1024), (1024, 1024)),
    "sdxl": ((1024, 1024), (832, 1216), (896, 1152)),
    "tiny-sd15": ((64, 64), (64, 96)),
    "tiny-sdxl": ((64, 64), (64, 96)),
}
# (row label, what it is, options, the Triton cache it uses: "a" starts empty and is kept for process 2 and 4, "b"
# starts empty)
PROCESSES = (("1", "empty Triton cache", {}, "a"), ("2", "after process 1", {}, "a"),
             ("3", "empty, compiled in turn", {"parallel_compile": False}, "b"),
             ("4", "with cuDNN search", {"cudnn_benchmark": True}, "a"))


def measure(name: str, shapes: list[tuple[int, int]], options: dict, iters: int) -> dict:
    """In this process: build `name` on the GPU (or the CPU), prepare the torch path, and time each shape's calls."""
    from ...kernels import ahead
    from ..accelerate import accelerate
    from ..models.configs import build_unet, example_inputs
    from ..models.spec import CanonicalUNet
    from .bench import _sync, time_ms

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    unet = CanonicalUNet(build_unet(name, seed=0, device=device, dtype=dtype))
    _sync(device)
    start = time.perf_counter()
    acc = accelerate(unet, preference="torch", options=options)
    _sync(device)
    out = {"model": name, "prepare_s": time.perf_counter() - start, "shapes": []}
    graphs = getattr(acc.engine, "graphs", None)

    def timed(fn: Callable[[], object]) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    with torch.inference_mode():
        for h, w in shapes:
            x, t, ctx, y = example_inputs(unet.unet, batch=2, latent=(h // 8, w // 8), device=device, dtype=dtype)
            call = lambda: acc(x, t, ctx, y)  # noqa: E731
            captured = graphs.capture_s if graphs is not None else 0.0
            before = dataclasses.replace(ahead.totals)
            first = timed(call)
            compiled = ahead.totals
            second = timed(call)
            capture = (graphs.capture_s - captured) if graphs is not None else None
            out["shapes"].append({"shape": f"{h}x{w}", "first_s": first, "kernels": compiled.kernels - before.kernels,
                                  "skipped_run_s": compiled.skipped_run_s - before.skipped_run_s,
                                  "compile_s": compiled.compile_s - before.compile_s, "second_s": second,
                                  "capture_s": capture, "steady_ms": time_ms(call, device, iters)})
    acc.release()
    return out


def check_models(models: list[str]) -> None:
    """BadInput for a model with no first-call shapes (names as bench_first_call takes them, "tiny-" included)."""
    for name in models:
        if name not in DEFAULT_SHAPES:
            full = [n for n in DEFAULT_SHAPES if not n.startswith("tiny-")]
            tiny = [n.removeprefix("tiny-") for n in DEFAULT_SHAPES if n.startswith("tiny-")]
            raise BadInput(f"--first-call: no first-call shapes for {name!r}.",
                           f"Choose --models from {', '.join(full)} (with --tiny: {', '.join(tiny)}).")


def bench_first_call(models: list[str], iters: int = 20, log: Callable[[str], None] = print) -> list[dict]:
    """Rows for each model, process and shape (see the module's docstring), each process a fresh Python."""
    check_models(models)
    rows = []
    for name in models:
        shapes = DEFAULT_SHAPES[name]
        with tempfile.TemporaryDirectory(prefix="sd-accel-triton-") as caches:
            for process, what, options, cache in PROCESSES:
                job = json.dumps({"model": name, "shapes": shapes, "options": options, "iters": iters})
                env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(caches, cache))
                run = subprocess.run([sys.executable, "-m", "sd_accel.accel.cli.first_call", job], capture_output=True,
                                     text=True, env=env)
                if run.returncode != 0:
                    raise RuntimeError(f"the first-call process for {name} failed:\n{run.stderr[-3000:]}")
                result = json.loads(run.stdout.strip().splitlines()[-1])
                log(f"[{name}] process {process} ({what}): prepare {result['prepare_s']:.2f} s")
                for s in result["shapes"]:
                    rows.append({"model": name, "process": f"{process}: {what}", "prepare_s": result["prepare_s"], **s})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'model':<10} {'process':<30} {'shape':<10} {'first s':>8} {'kernels':>8} {'skip run s':>11} "
            f"{'compile s':>10} {'second s':>9} {'capture s':>10} {'steady ms':>10}")
    lines = [head, "-" * len(head)]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        lines.append(f"{r['model']:<10} {r['process']:<30} {r['shape']:<10} {fmt(r['first_s'], '8.2f')} "
                     f"{r['kernels']:>8} {fmt(r['skipped_run_s'], '11.2f')} {fmt(r['compile_s'], '10.2f')} "
                     f"{fmt(r['second_s'], '9.2f')} {fmt(r['capture_s'], '10.2f')} {fmt(r['steady_ms'], '10.2f')}")
    lines.append("first = the first output at that size (a plain step, Triton compiling what it lacks, cuDNN choosing); "
                 "kernels = those compiled ahead, in parallel (skip run = the step that found them, compile = the "
                 "wait); "
                 "second = the next call (graph warm-up and capture, then replay); capture = the part of it in the "
                 "capture; Triton's compilation = process 1 - process 2 (in parallel), process 3 - process 2 "
                 "(in turn); cuDNN's search = process 4 - process 2.")
    return "\n".join(lines)


if __name__ == "__main__":  # one measuring process, started by bench_first_call
    job = json.loads(sys.argv[1])
    print(json.dumps(measure(job["model"], [tuple(s) for s in job["shapes"]], job["options"], job["iters"])))
