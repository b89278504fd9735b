"""The ONNX Runtime path: export -> ORT transformer fusions -> fp16 (GPU) -> session on the GPU's provider.

Providers: NVIDIA -> CUDA; AMD -> MIGraphX (ONNX Runtime 1.23 removed its ROCm provider; an older build that has
it is used when present); Windows -> DirectML; no GPU -> CPU. CUDA and CPU sessions read and write torch tensors
in place through IOBinding (no host copy per step); MIGraphX and DirectML get host copies of the (small) inputs.

Host-side work and CUDA graphs. With dynamic axes every Reshape/Expand/Resize is fed by a small shape-computing
subgraph (Shape -> Gather -> Unsqueeze -> Concat, 99 nodes in tiny-sd15 after ORT's own optimizations). ORT's
CUDA provider prefers the CPU for such integer work, and Memcpy nodes go wherever it meets GPU tensors: the likely
source of the 66 Memcpy nodes measured on SD1.5, which cost a synchronisation each and make ORT refuse CUDA
graphs (option `inspect` counts both in each session's graph on the GPU). `static_shapes` (implied by
`cuda_graph`) opens one session per input shape with every named dimension fixed
(SessionOptions.add_free_dimension_override_by_name); ORT then constant-folds the shape subgraphs away (0 left,
tested on the CPU). Each such session holds its own copy of the weights, so at most `max_sessions` are kept
(least recently used goes first).
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ...build.export import OnnxUNetInfo, control_input_names, export_model, model_info, save_model
from ...build.ort_optimize import host_side_nodes, optimized_model
from ...build.weights import (WeightMap, refitted, refreshed_initializers, weight_map, weight_map_path,
                              write_initializers)
from ...errors import BackendUnavailable
from ...models.spec import CanonicalUNet
from ...plan.options import OrtOptions, Runtime
from ...progress import NullProgress, Progress

log = logging.getLogger("sd-accel")

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
MIGRAPHX = "MIGraphXExecutionProvider"
ROCM = "ROCMExecutionProvider"
DML = "DmlExecutionProvider"

# Execution provider -> the fusion profile of build/ort_optimize.py the model is optimized with.
PROFILE = {CUDA: "cuda", CPU: "cpu", DML: "dml", MIGRAPHX: "migraphx", ROCM: "cpu"}
# Providers whose sessions take torch tensors through IOBinding, and the ORT device type they are bound as.
BINDING = {CUDA: "cuda", CPU: "cpu"}


def _install_hint(gpu, system: str) -> str:
    if gpu.vendor == "nvidia":
        return "pip install onnxruntime-gpu"
    if gpu.vendor == "amd" and system != "Windows":
        return "pip install onnxruntime-migraphx (AMD's ROCm build, see rocm.docs.amd.com)"
    if system == "Windows" and gpu.vendor != "cpu":
        return "pip install onnxruntime-directml"
    return "pip install onnxruntime"


def choose_provider(gpu, providers: list[str], system: str | None = None) -> str:
    """The execution provider for `gpu` among the installed `providers`; BackendUnavailable saying what to
    install when none fits."""
    system = system or platform.system()
    if gpu.vendor == "cpu":
        return CPU
    if gpu.vendor == "nvidia" and CUDA in providers:
        return CUDA
    if gpu.vendor == "amd" and system != "Windows":
        for p in (MIGRAPHX, ROCM):
            if p in providers:
                return p
    if system == "Windows" and DML in providers:
        return DML
    gpu_kinds = {CUDA, MIGRAPHX, ROCM, DML, "TensorrtExecutionProvider", "OpenVINOExecutionProvider",
                 "CoreMLExecutionProvider"}
    if gpu.vendor in ("nvidia", "amd") and not gpu_kinds & set(providers):
        raise BackendUnavailable(
            f"only the CPU build of onnxruntime is installed, which cannot use the {gpu.vendor.upper()} GPU.",
            f"pip uninstall onnxruntime && {_install_hint(gpu, system)}")
    raise BackendUnavailable(
        f"onnxruntime has no execution provider for this {gpu.vendor} device (installed: {', '.join(providers)}).",
        "The torch path runs on it." if gpu.vendor not in ("nvidia", "amd") else _install_hint(gpu, system))


def available(gpu) -> tuple[bool, str]:
    try:
        import onnxruntime as ort
    except ImportError:
        return False, f"onnxruntime is not installed: {_install_hint(gpu, platform.system())}"
    try:
        provider = choose_provider(gpu, ort.get_available_providers())
    except BackendUnavailable as e:
        return False, str(e)
    return True, f"onnxruntime {ort.__version__} with {provider}"


def _device_index(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


def provider_options(provider: str, gpu, options: OrtOptions, stream: int = 0) -> dict[str, str]:
    """Options of the execution provider. CUDA runs on torch's stream (`stream`), so that the tensors it reads
    are ready and the ones it writes are seen in order, without a synchronisation."""
    index = _device_index(gpu.device)
    # Device 0 is every provider's default. ORT >= 1.26 looks for a plugin EP device whenever device_id is given and
    # logs a warning at each session when it finds none ("No registered plugin EP device found"), so 0 is left out.
    device = {"device_id": str(index)} if index else {}
    if provider == CUDA:
        opts = {**device, "cudnn_conv_algo_search": options.conv_algo_search,
                "cudnn_conv_use_max_workspace": "1", "arena_extend_strategy": "kSameAsRequested",
                "enable_cuda_graph": "1" if options.cuda_graph else "0"}
        for name in ("prefer_nhwc", "fuse_conv_bias"):
            if getattr(options, name):
                opts[name] = "1"
        if stream:
            opts["user_compute_stream"] = str(stream)
        return opts
    if provider in (MIGRAPHX, ROCM, DML):
        return device
    return {}


def _ort_version() -> str:
    import onnxruntime as ort

    return ort.__version__


def open_session(path: Path, providers: list, session_options=None):
    """An InferenceSession on `providers` (the first is the one wanted), or BackendUnavailable naming the
    cause: an opset this onnxruntime cannot run, an operator without a kernel on the provider, or a provider
    that could not start (ORT then silently falls back to the CPU, which is refused here)."""
    import onnxruntime as ort

    wanted = providers[0][0] if isinstance(providers[0], tuple) else providers[0]
    try:
        session = ort.InferenceSession(str(path), sess_options=session_options, providers=providers)
    except Exception as e:
        text = str(e).split("\n")[0]
        if "opset" in text.lower() or "ir version" in text.lower():
            raise BackendUnavailable(
                f"onnxruntime {_ort_version()} cannot run this model's ONNX version ({text[-300:]}).",
                "pip install -U onnxruntime-gpu (or onnxruntime), or build with a lower 'opset' option.") from e
        if "NOT_IMPLEMENTED" in text or "Could not find an implementation" in text:
            raise BackendUnavailable(
                f"{wanted} of onnxruntime {_ort_version()} has no kernel for an operator of this model "
                f"({text[-300:]}).",
                "The model was optimized for another provider: delete it from the cache so it is rebuilt.") from e
        raise BackendUnavailable(f"onnxruntime could not create a {wanted} session ({text[-400:]}).",
                                 "The call runs on the torch path.") from e
    if wanted not in session.get_providers():
        fix = ("Install the onnxruntime-gpu build made for your CUDA major version (pip install onnxruntime-gpu) "
               "and its cuDNN; importing torch first lets it use torch's CUDA libraries."
               if wanted == CUDA else f"Check that the {wanted} libraries are installed.")
        raise BackendUnavailable(f"onnxruntime could not start {wanted} and fell back to the CPU.", fix)
    return session


def _gpu(runtime: Runtime):
    if runtime.gpu is not None:
        return runtime.gpu
    from ...plan import device

    return device.detect()


def build_model(unet: CanonicalUNet, folder: Path, options: OrtOptions | None = None, progress: Progress | None = None,
                provider: str | None = None) -> Path:
    """Export and optimize `unet` for `provider` into `folder`; returns the path of the model to serve
    (`unet.<profile>.onnx`, with `<that>.weights.json`, its weight map, when `refit`). The fp32 export is never
    written (for SDXL it would be 10 GB). provider: the execution provider it is for; by default the one chosen
    for the detected GPU."""
    options = options or OrtOptions()
    progress = progress or NullProgress()
    if provider is None:
        provider = _provider(options, _gpu(Runtime()))
    fp16 = options.fp16 if options.fp16 is not None else provider != CPU
    profile = PROFILE[provider]
    # The model stays in memory from export to the optimized file: only the result is written.
    model = export_model(unet, Path(folder), opset=options.opset, control=options.control,
                         progress=progress, name="unet.export.onnx")
    model = optimized_model(model, fp16=fp16, provider=profile, progress=progress)
    out = Path(folder) / f"unet.{profile}{'.fp16' if fp16 else ''}.onnx"
    wmap = None
    if options.refit:
        progress.stage("weight map", total=1)
        wmap = weight_map(model, unet)  # before saving: saving to external data empties the model's tensors
        progress.advance()
        progress.done()
    # With a weight map, the weights go to a file of their own: a refit writes them there at their offsets.
    save_model(model, out, external=True if wmap is not None else None)
    if wmap is not None:
        wmap.save(weight_map_path(out))
    return out


def update_weights(engine: "OrtEngine", unet: CanonicalUNet) -> bool:
    """Serve `unet`'s current weights (e.g. with a LoRA merged) without exporting and fusing again: the
    initializers made of changed parameters are recomputed (see build/weights.py weight_map), written into a copy of
    the optimized model in a temporary folder, and the sessions reopened on it. Returns whether the weights
    differ from the built ones. BackendUnavailable when the engine has no weight map or the new weights cannot
    be placed (then rebuild).

    A file rather than SessionOptions.add_initializer: ORT's CPU layout optimizer (NCHWc) reads convolution
    weights from the model file and ignores such overrides."""
    if engine.weight_map is None:
        raise BackendUnavailable("this ONNX Runtime engine was built without a weight map (option refit=False).",
                                 "Rebuild it to change its weights.")
    values = refreshed_initializers(engine.weight_map, unet)
    if not values:
        if engine.path != engine.base_path:
            engine.use_model(engine.base_path)
        return False
    engine.use_model(write_initializers(engine.base_path, values, engine.scratch() / engine.base_path.name))
    return True


def load(path: Path, options: OrtOptions | None = None, runtime: Runtime | None = None,
         progress: Progress | None = None) -> "OrtEngine":
    """An Engine serving an already built model file (from build_model, e.g. out of the cache)."""
    options = options or OrtOptions()
    gpu = _gpu(runtime or Runtime())
    provider = _provider(options, gpu)
    progress = progress or NullProgress()
    progress.stage("session", total=1)
    engine = OrtEngine(Path(path), provider, gpu, options)
    progress.advance()
    progress.done()
    return engine


def build(unet: CanonicalUNet, options: OrtOptions | None = None, runtime: Runtime | None = None,
          progress: Progress | None = None) -> "OrtEngine":
    """Export -> fusions -> fp16 (GPU) -> session. Progress stages: export, fusion, fp16, session.

    With runtime.folder the model files go there; otherwise they are built once into the engine cache
    (runtime.cache_root, SD_ACCEL_CACHE or ~/.cache/sd-accel) and loaded from it by later calls and processes. The
    engine's `cache_result` says which happened."""
    options = options or OrtOptions()
    runtime = runtime or Runtime()
    runtime = dataclasses.replace(runtime, gpu=_gpu(runtime))
    provider = _provider(options, runtime.gpu)
    if runtime.folder is None:
        return _build_cached(unet, options, runtime, progress, provider)
    path = build_model(unet, Path(runtime.folder), options, progress, provider)
    return load(path, options, runtime, progress)


def _provider(options: OrtOptions, gpu) -> str:
    """The execution provider options.provider names (it must be installed), else the best one for `gpu`."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise BackendUnavailable("onnxruntime is not installed.", _install_hint(gpu, platform.system())) from e
    providers = ort.get_available_providers()
    if options.provider is None:
        return choose_provider(gpu, providers)
    if options.provider not in providers:
        raise BackendUnavailable(f"the onnxruntime option provider is {options.provider!r}, which this onnxruntime "
                                 f"does not have.", f"Use one of: {', '.join(providers)}, or leave it unset.")
    return options.provider


# Options that change the built model files (the others only change how sessions are opened).
_BUILD_OPTIONS = ("fp16", "opset", "control", "refit")


def _build_cached(unet: CanonicalUNet, options: OrtOptions, runtime: Runtime, progress: Progress | None,
                  provider: str) -> "OrtEngine":
    from ...build.cache import EngineCache, cached_build, default_root, key_parts

    fp16 = options.fp16 if options.fp16 is not None else provider != CPU
    parts = key_parts(unet.unet, backend="onnxruntime", spec=unet.spec, profile=runtime.profile,
                      dtype="float16" if fp16 else "float32", gpu=runtime.gpu,
                      options={"provider": provider, "profile": runtime.profile,
                               **{k: getattr(options, k) for k in _BUILD_OPTIONS}})
    cache = EngineCache(default_root(runtime.cache_root))

    def build_into(folder: Path, prog: Progress) -> None:
        donor = _same_graph(cache, parts) if options.refit else None
        if donor is not None:
            try:
                prog.stage("refit", total=1)
                refitted(donor, unet, folder / donor.name)
                prog.advance()
                prog.done()
                log.info("sd-accel: onnxruntime model of the same architecture found in the cache (%s): its graph "
                         "takes these weights, no export needed", donor.parent.name[:12])
                return
            except (BackendUnavailable, OSError) as e:
                log.info("sd-accel: the cached graph of %s cannot take these weights (%s); exporting",
                         donor.parent.name[:12], e)
        build_model(unet, folder, options, prog, provider)

    def load_from(folder: Path) -> "OrtEngine":
        models = sorted(p for p in Path(folder).glob("unet.*.onnx"))
        if not models:
            raise BackendUnavailable(f"the cache entry {folder} holds no model file.", "It will be rebuilt.")
        return load(models[0], options, runtime, progress)

    engine, result = cached_build(cache, parts, build_into, load_from, progress)
    engine.cache_result = result
    log.info("sd-accel: onnxruntime engine %s", result.describe())
    return engine


def _same_graph(cache, parts: dict) -> Path | None:
    """The model file of a sound cache entry built with everything as `parts` says but the weights (the same
    architecture, shape profile, options, library versions and GPU), that has a weight map: a second checkpoint of
    a known model is built from its graph by putting the new weights in (seconds), not by exporting and optimizing
    again (minutes)."""
    same = {k: v for k, v in parts.items() if k != "weights"}
    for entry in cache.ls():
        if entry.problem or {k: v for k, v in entry.parts.items() if k != "weights"} != same:
            continue
        models = [m for m in sorted(entry.path.glob("unet.*.onnx")) if weight_map_path(m).exists()]
        if models:
            return models[0]
    return None


_NUMPY = {torch.float16: "float16", torch.float32: "float32"}


def _run_options(provider: str):
    """On CUDA, ORT runs on torch's stream (provider_options), so the stream orders everything after a run and
    ORT's wait for the GPU at the end of each run only kept the host from queueing the next step: the GPU
    idled between steps, and no CUDA graph hides that."""
    import onnxruntime as ort

    ro = ort.RunOptions()
    if provider == CUDA:
        ro.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return ro


class OrtEngine:
    backend = "onnxruntime"

    def __init__(self, path: Path, provider: str, gpu, options: OrtOptions) -> None:
        self.path = self.base_path = path
        self._scratch: Path | None = None  # the model with refreshed weights, inspected session graphs
        self.host_nodes: dict[tuple, dict[str, int]] = {}  # per session (option inspect): see host_side_nodes
        self.info: OnnxUNetInfo = model_info(path)
        self.provider = provider
        self.options = options
        self.device = torch.device(gpu.device if provider != CPU else "cpu")
        self.dtype = torch.float16 if self.info.float16 else torch.float32
        self._gpu = gpu
        self._stream = 0
        if provider == CUDA:
            self._stream = torch.cuda.current_stream(self.device).cuda_stream
        self._static = options.static_shapes or options.cuda_graph
        self._run_options = _run_options(provider)
        self._released = False
        self._sessions: OrderedDict[tuple, Any] = OrderedDict()
        self._graph_io: dict[tuple, tuple] = {}  # per shape: (IOBinding, input buffers, output buffer)
        wmap = weight_map_path(path)
        self.weight_map: WeightMap | None = WeightMap.load(wmap) if wmap.exists() else None
        self.reopen()

    def scratch(self) -> Path:
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="sd-accel-ort-engine-"))
        return self._scratch

    def use_model(self, path: Path) -> None:
        """Serve another file of the same graph (the one with refreshed weights)."""
        self.path = path
        self.reopen()

    def reopen(self) -> None:
        """Drops the sessions and opens them again (static-shape ones on their next call)."""
        self._graph_io.clear()
        self._sessions.clear()
        if not self._static:
            self._sessions[()] = self._open({})

    # Sessions

    def _session_options(self, dims: dict[str, int], inspect: Path | None = None):
        import onnxruntime as ort

        so = ort.SessionOptions()
        if inspect is not None:
            so.optimized_model_filepath = str(inspect)
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                        inspect.name + ".data")
        for name, value in dims.items():
            so.add_free_dimension_override_by_name(name, int(value))
        if self.provider == DML:  # DirectML's documented requirements
            so.enable_mem_pattern = False
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        return so

    def _open(self, dims: dict[str, int]):
        opts = provider_options(self.provider, self._gpu, self.options, self._stream)
        providers = [(self.provider, opts)] + ([CPU] if self.provider != CPU else [])
        inspect = self.scratch() / f"session-{len(self.host_nodes)}.onnx" if self.options.inspect else None
        session = open_session(self.path, providers, self._session_options(dims, inspect))
        if inspect is not None:
            self.host_nodes[tuple(sorted(dims.items()))] = host_side_nodes(inspect)
            log.info("sd-accel: onnxruntime session %s: %s", dims or "dynamic", self.host_nodes)
        return session

    def _session(self, feeds: dict[str, torch.Tensor]):
        if not self._static:
            return (), self._sessions[()]
        key = tuple((k, tuple(v.shape)) for k, v in feeds.items())
        if key in self._sessions:
            self._sessions.move_to_end(key)
            return key, self._sessions[key]
        while len(self._sessions) >= self.options.max_sessions:
            old, _ = self._sessions.popitem(last=False)
            self._graph_io.pop(old, None)
        session = self._open(self._dims(feeds))
        self._sessions[key] = session
        return key, session

    def _dims(self, feeds: dict[str, torch.Tensor]) -> dict[str, int]:
        """Every named (dynamic) dimension of the model's inputs, valued from this call's tensors."""
        import onnx

        model = onnx.load(str(self.path), load_external_data=False)
        dims: dict[str, int] = {}
        for i in model.graph.input:
            for axis, d in enumerate(i.type.tensor_type.shape.dim):
                if d.dim_param and i.name in feeds:
                    dims[d.dim_param] = int(feeds[i.name].shape[axis])
        return dims

    # Calls

    def _feeds(self, x, timesteps, context, y, control) -> dict[str, torch.Tensor]:
        info = self.info
        if x.dim() != 4 or x.shape[1] != info.in_channels:
            raise BackendUnavailable(f"the ONNX model takes latents of shape (batch, {info.in_channels}, h, w), "
                                     f"not {tuple(x.shape)}.", "The call runs on the torch path.")
        h, w = x.shape[-2:]
        if h % info.size_multiple or w % info.size_multiple:
            raise BackendUnavailable(
                f"latent size {h}x{w} is not a multiple of {info.size_multiple}, which the exported model needs.",
                "The call runs on the torch path; use image sizes that are multiples of "
                f"{8 * info.size_multiple} pixels to stay on ONNX Runtime.")
        if info.has_y != (y is not None):
            raise BackendUnavailable("the conditioning y was " + ("not given" if info.has_y else "given") +
                                     " but the ONNX model was exported " + ("with" if info.has_y else "without") +
                                     " it.", "The call runs on the torch path.")
        b = x.shape[0]
        if timesteps.dim() == 0 or timesteps.numel() == 1:
            timesteps = timesteps.reshape(1).expand(b)
        dev, dt = self.device, self.dtype
        feeds = {"x": x.to(dev, dt), "timesteps": timesteps.to(dev, torch.float32), "context": context.to(dev, dt)}
        if y is not None:
            feeds["y"] = y.to(dev, dt)
        feeds.update(self._control_feeds(control, feeds))
        return {k: v.contiguous() for k, v in feeds.items()}

    def _control_feeds(self, control: dict | None, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        info = self.info
        given = {k: v for k, v in (control or {}).items() if v and any(t is not None for t in v)}
        if given and not info.has_control:
            raise BackendUnavailable("ControlNet residuals were given but the ONNX model was exported without "
                                     "control inputs.", "The call runs on the torch path; rebuild with the "
                                     "option control=True to run ControlNet on ONNX Runtime.")
        if set(given) - {"output", "middle"}:
            raise BackendUnavailable(f"control residuals {sorted(set(given) - {'output', 'middle'})} are not "
                                     "inputs of the ONNX model.", "The call runs on the torch path.")
        if not info.has_control:
            return {}
        outputs = list(given.get("output") or [None] * info.control_outputs)
        if len(outputs) != info.control_outputs:
            raise BackendUnavailable(f"{len(outputs)} ControlNet skip residuals were given; the ONNX model takes "
                                     f"{info.control_outputs}.", "The call runs on the torch path.")
        middle = list(given.get("middle") or [None])[:1] if info.control_middle else []
        tensors = outputs + middle
        names = control_input_names(info.control_outputs, info.control_middle)
        if any(t is None for t in tensors):
            shapes = self._control_shapes(feeds["x"].shape)
        out = {}
        for i, (name, t) in enumerate(zip(names, tensors)):
            out[name] = t.to(self.device, self.dtype) if t is not None else \
                torch.zeros(shapes[i], device=self.device, dtype=self.dtype)
        return out

    def _control_shapes(self, x_shape: torch.Size) -> list[tuple[int, ...]]:
        """Residual shapes for a latent shape, from the channel counts and downscale factors at export."""
        import onnx

        model = onnx.load(str(self.path), load_external_data=False)
        inputs = {i.name: i.type.tensor_type.shape.dim for i in model.graph.input}
        meta = {p.key: p.value for p in model.metadata_props}
        b, _, h, w = x_shape
        shapes = []
        for name in control_input_names(self.info.control_outputs, self.info.control_middle):
            factor = int(meta[f"sd_accel.{name}_factor"])
            shapes.append((b, inputs[name][1].dim_value, -(-h // factor), -(-w // factor)))
        return shapes

    def __call__(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                 y: torch.Tensor | None = None, control: dict | None = None, **kwargs: Any) -> torch.Tensor:
        if kwargs:
            raise BackendUnavailable(f"UNet arguments {sorted(kwargs)} are not inputs of the ONNX model.",
                                     "The call runs on the torch path.")
        if self._released:
            raise BackendUnavailable("this ONNX Runtime engine was released.", "Build it again.")
        feeds = self._feeds(x, timesteps, context, y, control)
        b, _, h, w = feeds["x"].shape
        try:
            key, session = self._session(feeds)
            if self.provider not in BINDING:
                out = session.run(["eps"], {k: v.cpu().numpy() for k, v in feeds.items()})[0]
                result = torch.from_numpy(out)
            elif self.options.cuda_graph and self.provider == CUDA:
                result = self._run_graph(key, session, feeds, (b, self.info.out_channels, h, w))
            else:
                result = self._run_bound(session, feeds, (b, self.info.out_channels, h, w))
        except BackendUnavailable:
            raise
        except Exception as e:
            raise BackendUnavailable(f"onnxruntime failed on this call ({type(e).__name__}: {str(e)[:300]}).",
                                     "The call runs on the torch path.") from e
        return result.to(device=x.device, dtype=x.dtype)

    def _bind(self, session, feeds: dict[str, torch.Tensor], out: torch.Tensor):
        import numpy as np

        kind = BINDING[self.provider]
        index = self.device.index or 0
        binding = session.io_binding()
        for name, t in feeds.items():
            binding.bind_input(name, kind, index, getattr(np, _NUMPY[t.dtype]), list(t.shape), t.data_ptr())
        binding.bind_output("eps", kind, index, getattr(np, _NUMPY[out.dtype]), list(out.shape), out.data_ptr())
        return binding

    def _sync_in(self) -> bool:
        """Whether the caller's stream is not the one ORT runs on (then both sides synchronise)."""
        if self.provider != CUDA:
            return False
        current = torch.cuda.current_stream(self.device)
        if current.cuda_stream == self._stream:
            return False
        current.synchronize()
        return True

    def _sync_out(self, other_stream: bool) -> None:
        if other_stream:
            torch.cuda.ExternalStream(self._stream, device=self.device).synchronize()

    def _run(self, session, binding) -> None:
        other = self._sync_in()
        session.run_with_iobinding(binding, self._run_options)
        self._sync_out(other)

    def _run_bound(self, session, feeds: dict[str, torch.Tensor], out_shape: tuple) -> torch.Tensor:
        out = torch.empty(out_shape, device=self.device, dtype=self.dtype)
        self._run(session, self._bind(session, feeds, out))
        return out

    def _run_graph(self, key: tuple, session, feeds: dict[str, torch.Tensor], out_shape: tuple) -> torch.Tensor:
        """CUDA graphs replay fixed addresses: the inputs are copied into buffers bound once per shape."""
        if key not in self._graph_io:
            buffers = {k: torch.empty_like(v) for k, v in feeds.items()}
            out = torch.empty(out_shape, device=self.device, dtype=self.dtype)
            self._graph_io[key] = (self._bind(session, buffers, out), buffers, out)
        binding, buffers, out = self._graph_io[key]
        for k, v in feeds.items():
            buffers[k].copy_(v)
        self._run(session, binding)
        return out.clone()

    def release(self) -> None:
        """Drops the sessions and the scratch copy with refreshed weights; the built model stays where it was."""
        self._graph_io.clear()
        self._sessions.clear()
        self._released = True
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        self._scratch = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
