"""Command line: `python -m sd_accel {doctor,demo,bench,cache}`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

from ..errors import AccelError, BadInput
from ..progress import keep_logs_off_bars
from . import checks

# torch.compile's modes (its `mode` argument; "default" is None)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# --paths: a backend, or a backend and one of bench.py's VARIANTS; the fp8 ones for diffusion transformers (DIT_PATHS)
PATHS = ("torch", "torch-compile", "torch-cudnn-search", "torch-fp8", "torch-int8", "torch-fp8weights", "onnxruntime",
         "onnxruntime-graph", "onnxruntime-refit")


def _doctor_info(backend: str | None) -> dict:
    """What `doctor` reports, as data: the text and the --json form are both made from it."""
    from dataclasses import asdict

    import torch

    from .. import __version__
    from ..build.cache import default_root
    from ..plan.device import describe, detect
    from ..plan.policy import choose, probe_packages

    from ..engine import flash3, flash4, fp8_attention

    gpu = detect()
    installed = probe_packages()
    plan = choose(gpu, backend, installed)
    fp8_ok, fp8_why = fp8_attention.available(torch.device(gpu.device))
    fa4_ok, fa4_why = flash4.available(torch.device(gpu.device))
    fa3_ok, fa3_why = flash3.available(torch.device(gpu.device))
    if fa3_ok:
        fa3_ok, fa3_why = flash3.runs(torch.device(gpu.device))
    return {
        "gpu": {"description": describe(gpu), **asdict(gpu)},
        "family": gpu.family,
        "packages": installed,
        "plan": {**asdict(plan), "summary": plan.summary()},
        "fp8_attention": {"available": fp8_ok, "why": fp8_why},
        "flash_attention_4": {"available": fa4_ok, "why": fa4_why},
        "flash_attention_3": {"available": fa3_ok, "why": fa3_why},
        "cache": str(default_root()),
        "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SD_ACCEL_")},
        "versions": {"sd-accel": __version__, "torch": torch.__version__},
    }


def _doctor(args: argparse.Namespace) -> int:
    from .. import settings_line

    info = _doctor_info(args.backend)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    print(info["gpu"]["description"])
    for note in info["gpu"]["notes"]:
        print(f"  note: {note}")
    print("packages: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in info["packages"].items()))
    print(info["plan"]["summary"])
    fp8 = info["fp8_attention"]
    print("fp8 attention (precision fp8, fp8 weights): " + (f"yes, {fp8['why']}" if fp8["available"] else
                                                             f"no, {fp8['why']}; 16-bit attention"))
    fa4 = info["flash_attention_4"]
    print("transformers' 16-bit attention: " + (f"FlashAttention-4, {fa4['why']}" if fa4["available"] else
                                                f"PyTorch's SDPA; FlashAttention-4: no, {fa4['why']}"))
    fa3 = info["flash_attention_3"]
    print("FlashAttention-3 (16-bit and fp8 attention, where timed faster): " + (
        f"yes, {fa3['why']}" if fa3["available"] else f"no, {fa3['why']}"))
    print(f"cache: {info['cache']}")
    print(settings_line())
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    return 0


def _host(args: argparse.Namespace) -> tuple[str, str] | None:
    """--comfyui / --a1111 / --forge DIR: whose UNet class the bench builds."""
    return next(((host, getattr(args, host)) for host in ("comfyui", "a1111", "forge") if getattr(args, host)), None)


def _video_vaes(args: argparse.Namespace) -> list[str]:
    """With --vae: the video VAEs --models names (wan21, wan22; their tiny layouts with --tiny)."""
    from ..models.configs import COMFY_VIDEO_VAE_CONFIGS

    names = [f"tiny-{m}" if args.tiny else m for m in (args.models or "").split(",") if m]
    return [m for m in names if m in COMFY_VIDEO_VAE_CONFIGS] if args.vae else []


def _models(args: argparse.Namespace) -> list[str]:
    """--models, or the bench's default: sd15,sdxl; with --gpus wan21-14b."""
    return [m.strip() for m in (args.models or ("wan21-14b" if args.gpus else "sd15,sdxl")).split(",") if m.strip()]


def _times_models(args: argparse.Namespace) -> bool:
    """Whether the UNet and transformer rows (bench.run) are timed: unless another part was asked for alone."""
    return not args.gpus and (not (args.kernels or args.vae or args.first_call) or args.unet)


def _check_bench(args: argparse.Namespace) -> None:
    """What one option's type cannot check alone (the options together, the names --models gives each part that
    runs), before the first part starts: a bad name found after the baseline is timed costs minutes. BadInput."""
    if args.comfy_attention and not args.comfyui:
        raise BadInput("--comfy-attention chooses ComfyUI's attention.", "Pass --comfyui DIR.")
    if args.comfy_attention and args.gpus:  # the ranks are fresh processes, which would not see the choice
        raise BadInput("--comfy-attention does not reach the --gpus ranks.", "Leave one of them out.")
    models = _models(args)
    videos = _video_vaes(args)
    if videos and not args.comfyui:
        raise BadInput("--vae --models wan21/wan22 builds ComfyUI's Wan VAEs.", "Pass --comfyui DIR.")
    if videos and args.video_sizes:
        from .vae_bench import video_sizes

        for name in videos:
            video_sizes(name, args.video_sizes)
    if args.vae and args.models and not (args.gpus or args.first_call or args.unet):
        from ..models.configs import COMFY_VIDEO_VAE_CONFIGS

        full = [n for n in COMFY_VIDEO_VAE_CONFIGS if not n.startswith("tiny-")]
        for name in models:
            if name not in full:  # else the image VAE's bench would run, as if --models were not given
                raise BadInput(f"--vae --models: {name!r} is not a video VAE.",
                               f"Choose from {', '.join(full)}, or leave --models out for SD's VAE.")
    if args.first_call:
        from .first_call import check_models

        check_models([f"tiny-{m}" for m in models] if args.tiny else models)
    if args.gpus:
        from .parallel_bench import check

        check(models, args.gpus, args.video_sizes, args.tiny, args.comfyui, args.profile)
    elif _times_models(args):
        from .bench import model_names

        model_names(models, args.tiny, _host(args))


def _host_process(args: argparse.Namespace) -> int | None:
    """With --comfyui/--a1111/--forge, the host's modules import by their own top-level names (comfy, ldm, backend),
    as the host's start-up arranges: when its folders are not on this process's import path, the bench runs again in
    a process started with them on PYTHONPATH, and that process's exit code is returned. None: run here."""
    host = _host(args)
    if host is None or ((args.kernels or args.vae or args.first_call) and not (args.unet or args.gpus)
                        and not _video_vaes(args)):
        return None
    from ..models.configs import host_import_paths, off_import_path

    missing = [str(p) for p in off_import_path(host_import_paths(*host))]
    if not missing:
        return None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*missing, *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.call([sys.executable, "-m", "sd_accel", *args.argv], env=env)


def _bench(args: argparse.Namespace) -> int:
    _check_bench(args)
    try:
        rerun = _host_process(args)
    except ValueError as e:  # a folder that is not the host's checkout
        print(f"sd-accel bench: {e}", file=sys.stderr)
        return 2
    if rerun is not None:
        return rerun
    if args.comfy_attention:
        from .comfy_attention import use_comfy_attention

        try:
            use_comfy_attention(args.comfy_attention)
        except ValueError as e:
            print(f"sd-accel bench: {e}", file=sys.stderr)
            return 2
    if args.iters is None:
        args.iters = 5 if args.gpus else 20
    models = _models(args)
    out: dict = {}
    # With --json, stdout is the JSON alone (for a pipe); the tables go to stderr.
    say = sys.stderr if args.json else sys.stdout
    if args.kernels:
        from .kernel_bench import bench_kernels

        from .attention_bench import bench_dit_attention
        from .attention_bench import table as attention_table

        out["kernels"] = bench_kernels()
        for r in out["kernels"]:
            print(r, file=say)
        out["dit_attention"] = bench_dit_attention()
        print(attention_table(out["dit_attention"]), file=say)
    if args.vae and _video_vaes(args):
        from .vae_bench import bench_video_vae, video_table

        out["video_vae"] = bench_video_vae(_video_vaes(args), args.comfyui, args.video_sizes, args.tiny)
        print(video_table(out["video_vae"]), file=say)
    elif args.vae:
        from .vae_bench import bench_vae
        from .vae_bench import table as vae_table

        out["vae"] = bench_vae(tiny=args.tiny, sizes=args.vae_sizes, memory_gb=args.vae_memory_gb)
        print(vae_table(out["vae"]), file=say)
    if args.first_call:
        from .first_call import bench_first_call
        from .first_call import table as first_call_table

        try:
            out["first_call"] = bench_first_call([f"tiny-{m}" for m in models] if args.tiny else models, args.iters,
                                                 log=(lambda s: print(s, file=sys.stderr)))
        except RuntimeError as e:  # a measuring process failed: its own error output, no stack trace of ours
            print(f"sd-accel bench: {e}", file=sys.stderr)
            return 1
        print(first_call_table(out["first_call"]), file=say)
    if args.gpus:
        from .parallel_bench import as_dicts, bench_parallel, precisions
        from .parallel_bench import table as parallel_table

        try:
            rows = bench_parallel(models, args.gpus, args.video_sizes, args.iters, args.tiny, args.comfyui,
                                  log=(lambda s: print(s, file=sys.stderr, flush=True)), profile=args.profile,
                                  precisions=precisions(args.paths))
        except RuntimeError as e:  # a rank failed: its own message, no stack trace
            print(f"sd-accel bench: {e}", file=sys.stderr)
            return 1
        from . import bench, timing

        cpu, load = timing.host_cpu(), timing.load()
        out["parallel"] = as_dicts(rows)
        out["host"] = {"cpu": cpu, "load": load}
        print(parallel_table(rows, bench.host_line(cpu, load)), file=say)
    elif _times_models(args):
        from . import bench, timing

        modes = [] if args.no_compile or args.tiny else args.compile_modes
        paths = [p for p in args.paths if not (p.endswith("-compile") and (args.no_compile or args.tiny))]
        rows = bench.run(models, args.tiny, args.iters, modes, paths,
                         log=(lambda s: print(s, file=sys.stderr)), profile=args.profile, host=_host(args))
        cpu, load = timing.host_cpu(), timing.load()
        out["unet"] = bench.as_dicts(rows)
        out["host"] = {"cpu": cpu, "load": load}
        print(bench.table(rows, bench.host_line(cpu, load)), file=say)
    code = 0
    if args.json_file:
        try:
            with open(args.json_file, "w") as f:
                json.dump(out, f, indent=1, default=str)
        except OSError as e:  # writable when checked before the run, and no longer (a full disk): nothing is lost
            print(f"sd-accel: --json-file {args.json_file} could not be written ({e.strerror}); the results follow "
                  "on stdout.", file=sys.stderr)
            args.json, code = True, 1
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    return code


def _demo(args: argparse.Namespace) -> int:
    from .demo import main

    return main(args)


def prog_name() -> str:
    """The command as the user typed it: `python -m sd_accel` (the package's __main__.py), else the console script
    (`sd-accel`) that pip installs."""
    if os.path.basename(sys.argv[0]) == "__main__.py":
        return f"python -m {__package__.split('.')[0]}"
    return "sd-accel"


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # a reader that is gone shows here, not as a traceback in Python's flush at exit
        return code
    except BrokenPipeError:
        # The reader stopped early (`doctor --json | head`): what it did not read is not wanted. Later writes, and
        # the flush at exit, go nowhere instead of raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None) -> int:
    prog = prog_name()
    p = checks.Parser(prog=prog,
                      description="sd-accel: fast diffusion models (SD UNets, Flux, SD3.5) and VAE.")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("doctor", help="the GPU, its family, the installed backends, the chosen plan and why, the "
                                      "cache folder, the SD_ACCEL_* settings and the versions")
    d.add_argument("--backend", type=checks.backend,
                   help="auto|torch|onnxruntime|off (default: SD_ACCEL_BACKEND or auto)")
    d.add_argument("--json", action="store_true", help="print the same information as JSON")
    d.set_defaults(fn=_doctor)
    b = sub.add_parser("bench", help="time the baselines and each sd-accel path on SD UNets and diffusion transformers")
    b.add_argument("--models",
                   help="comma-separated: sd15, sd21, sdxl (fp16, batch 2); flux-dev, flux-schnell (bf16, batch 1), "
                        "sd35-large, sd35-medium, chroma (bf16, batch 2; chroma with --comfyui only); wan21-14b, "
                        "wan21-1.3b (832x480, 81 frames), wan22-5b (1280x704, 121 frames), qwen-image (1328x1328) "
                        "(bf16, batch 2, --comfyui only), flux2-dev (1024x1024, bf16, batch 1; flux2-dev-10l: 2 of "
                        "its 8 double and 8 of its 48 single blocks; --comfyui with ComfyUI 0.33 or later), "
                        "z-image (1024x1024, bf16, batch 1: Z-Image-Turbo runs at "
                        "CFG 1; --comfyui with ComfyUI 0.33 or later), hunyuan-video15 (HunyuanVideo 1.5 480p: 848x480, "
                        "33 frames, bf16, batch 2; --comfyui with ComfyUI 0.33 or later), ltx2 (LTX-2: 768x512, 97 "
                        "frames with their audio, bf16, batch 2; ltx2-8l: its first 8 of 48 blocks; --comfyui with "
                        "ComfyUI 0.33 or later), with their FLOP count and floor (default: sd15,sdxl; with "
                        "--gpus: wan21-14b); with --vae: wan21, wan22 (ComfyUI's Wan VAEs, --comfyui only): their "
                        "untiled decode against the tiled one within half its memory, at --video-sizes (default "
                        "832x480,1280x720), 81 frames (wan22: 121)")
    b.add_argument("--paths", default="torch,torch-compile,onnxruntime", metavar="PATH,...",
                   type=checks.names(PATHS, "a path the bench times"),
                   help="sd-accel paths to time (torch-compile: the torch path with regional torch.compile; "
                        "torch-cudnn-search: with cuDNN's exhaustive algorithm search; onnxruntime-graph: ONNX "
                        "Runtime with its CUDA graph; onnxruntime-refit: ONNX Runtime, then another checkpoint of the model "
                        "built from its cached graph (a second row); for Flux and SD3.5 (with --gpus every model): torch-fp8: fp8 matrix products "
                        "(precision fp8), torch-int8: int8 ones (precision int8), torch-fp8weights: the weights "
                        "stored in fp8 as ComfyUI loads them, its own "
                        "forward and the torch path on them, with --comfyui)")
    b.add_argument("--iters", type=checks.whole(1),
                   help="timed runs per variant (default 20, with --gpus 5): each row's median and min-max are "
                        "reported; each row after eager is timed interleaved with eager (eager, the row, alternately, "
                        "--iters of each), its speed-up the ratio of the medians, at least 5 of each on a GPU (a "
                        "smaller --iters is raised to 5 there; with --gpus each layout alternates with the 1-GPU call in its own "
                        "processes)")
    b.add_argument("--tiny", action="store_true", help="tiny configs on the CPU, in seconds")
    b.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines (minutes each)")
    b.add_argument("--compile-modes", default="default,reduce-overhead", metavar="MODE,...",
                   type=checks.names(COMPILE_MODES, "a mode of torch.compile"),
                   help="the torch.compile baselines' modes: " + ", ".join(COMPILE_MODES) + " (default: "
                        "default,reduce-overhead)")
    b.add_argument("--kernels", action="store_true",
                   help="micro-benchmark the Triton kernels (GB/s; TFLOP/s for the GEMM and attention ones) and the "
                        "DiTs' attention at Flux's, SD3.5's, Qwen-Image's and Wan's shapes: bf16 cuDNN, fp8 cuDNN, "
                        "FlashAttention-4, SageAttention (those installed)")
    b.add_argument("--vae", action="store_true", help="tiled against untiled VAE decode")
    b.add_argument("--vae-sizes", metavar="PX,...", type=checks.pixel_sides(8),
                   help="with --vae: image sides, multiples of 8 (default 512,1024,2048,4096,8192)")
    b.add_argument("--vae-memory-gb", type=checks.above_zero, default=4.0, metavar="GB",
                   help="with --vae: also time the tiled decode limited to this much GPU memory (default 4)")
    b.add_argument("--first-call", action="store_true",
                   help="the wait for the first output at new image sizes, per stage, in fresh processes (Triton's "
                        "cache empty, then warm; kernels compiled in parallel and in turn; with cuDNN's exhaustive "
                        "search for comparison)")
    b.add_argument("--gpus", metavar="N,...",
                   help="multi-GPU: one step of each --models transformer (ComfyUI's class, --comfyui DIR) in N "
                        "processes for each N (1 always, first: the baseline), one GPU each through NCCL, in every "
                        "layout that divides N: CFG (the CFG batch over 2 GPUs), sequence (Ulysses), CFG x sequence; "
                        "ms per step, speed-up over the 1-GPU call timed alternately with the layout in the same processes, peak memory, distance from the 1-GPU output (and the "
                        "1-GPU output's bf16 noise, the yardstick); with --paths torch-fp8 (or torch,torch-fp8) under "
                        "precision fp8 (too), each row naming the fp8 attention kernel that served it; with "
                        "torch-int8 under precision int8. With --tiny: "
                        "tiny models in processes on the CPU (gloo)")
    b.add_argument("--video-sizes", metavar="WxH,...", type=checks.video_sizes,
                   help="with --gpus, or --vae --models wan21/wan22: Wan's video sizes in pixels (default 832x480; "
                        "with --vae 832x480,1280x720; frames as in the model's native clip: 81 for Wan 2.1)")
    b.add_argument("--unet", action="store_true", help="with --kernels/--vae/--first-call: time the UNets too")
    b.add_argument("--profile", action="store_true",
                   help="GPU kernel time per step by operator class, kernel launches per step and the top kernels "
                        "(with --gpus: each row's, rank 0's, collectives apart)")
    hosts = b.add_mutually_exclusive_group()
    hosts.add_argument("--comfyui", metavar="DIR",
                       help="build the models with ComfyUI's own classes from this ComfyUI checkout (UNetModel for "
                            "sd15 and sdxl, Flux and MMDiT for the transformers, whose fused kernels cover this form) "
                            "instead of diffusers'")
    hosts.add_argument("--a1111", metavar="DIR",
                       help="build them with A1111's own classes (ldm for sd15, sgm for sdxl) from A1111's "
                            "repositories folder; the eager baseline's attention is PyTorch SDPA, as A1111's default")
    hosts.add_argument("--forge", metavar="DIR", help="build them with Forge's own UNet class from this Forge checkout")
    from .comfy_attention import COMFY_ATTENTION

    b.add_argument("--comfy-attention", choices=sorted(COMFY_ATTENTION),
                   help="with --comfyui: ComfyUI's attention for the whole process, as its flags choose it "
                        "(--use-sage-attention, --use-flash-attention, --use-split-cross-attention, ...): the eager "
                        "rows run it, and the torch path's fused blocks time it against their own attention per shape "
                        "and run the faster; the fp32 reference keeps exact attention (sage: the sageattention "
                        "package)")
    b.add_argument("--json", action="store_true",
                   help="print the results as JSON on stdout (the tables and progress go to stderr)")
    b.add_argument("--json-file", metavar="FILE", type=checks.output_file,
                   help="also write the results as JSON to FILE (its folder must exist)")
    b.set_defaults(fn=_bench)
    m = sub.add_parser("demo", help="detect, plan, build, sample plain and accelerated, compare, save a PNG")
    m.add_argument("--checkpoint", help="a .safetensors SD1.x/SD2.x/SDXL checkpoint (default: random weights)")
    m.add_argument("--backend", type=checks.backend, help="auto|torch|onnxruntime|off")
    m.add_argument("--steps", type=int, default=None, help="sampling steps (default 20 on a GPU, 8 on the CPU)")
    m.add_argument("--size", type=int, default=None, help="image side in pixels (default 512 on a GPU, 128 on the CPU)")
    m.add_argument("--out", default="sd-accel-demo.png", type=checks.image_file, help="where to save the image")
    m.add_argument("--seed", type=checks.whole(0, 2**64 - 1), default=0, help="seed of the weights, the "
                   "conditioning and the noise")
    m.set_defaults(fn=_demo)
    sub.add_parser("cache", help="the engine cache: ls | info KEY | clear | prune [--root DIR]")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cache"]:  # its own parser owns every argument after the word, -h included
        from .cache import main as cache_main

        return cache_main(argv[1:], prog=f"{prog} cache")
    args = p.parse_args(argv)
    args.argv = list(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    keep_logs_off_bars(logging.getLogger("sd-accel"))
    try:
        return args.fn(args)
    except AccelError as e:  # the user's input: say what is wrong and what to do, no stack trace
        print(f"sd-accel: {e}", file=sys.stderr)
        return 2

