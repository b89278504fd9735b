"""What a host adapter needs to serve its UNet calls through an engine, host-agnostic: a shape profile, an
EngineSlot that builds on the first call with the real shapes and keeps the engine in step with the host's
weights, and the status a host shows its user.

The host decides, per call, whether the engine may serve it at all (it alone knows its patches and
hooks); everything after that decision lives here, so the ComfyUI and A1111 adapters stay thin.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import AccelError, BadInput, is_interrupt

log = logging.getLogger("sd-accel")

LATENT_SCALE = 8  # SD VAEs: one latent pixel per 8x8 image pixels


@dataclass(frozen=True)
class ShapeProfile:
    """min / opt / max of the image batch and of the image height and width in pixels.

    The UNet batch is up to twice the image batch: hosts run the positive and the negative prompt together.
    """

    batch: tuple[int, int, int]
    height: tuple[int, int, int]
    width: tuple[int, int, int]

    def options(self) -> dict[str, list[int]]:
        """The profile as a backend option (UNet batch, pixels), the form the engine cache keys on."""
        b = self.batch
        return {"batch": [b[0], 2 * b[1], 2 * b[2]], "height": list(self.height), "width": list(self.width)}

    def contains(self, latent_shape: tuple[int, ...]) -> bool:
        n, h, w = latent_shape[0], latent_shape[-2] * LATENT_SCALE, latent_shape[-1] * LATENT_SCALE
        return (self.batch[0] <= n <= 2 * self.batch[2] and self.height[0] <= h <= self.height[2]
                and self.width[0] <= w <= self.width[2])

    def describe(self) -> str:
        return (f"batch {self.batch[0]}-{self.batch[2]}, height {self.height[0]}-{self.height[2]}, "
                f"width {self.width[0]}-{self.width[2]} px")


def shape_profile(batch: tuple[int, int, int], height: tuple[int, int, int],
                  width: tuple[int, int, int]) -> ShapeProfile:
    """A checked ShapeProfile; BadInput naming the first problem (min > opt > max, sizes not multiples of 8)."""
    for name, values in (("batch", batch), ("height", height), ("width", width)):
        lo, opt, hi = (int(v) for v in values)
        if lo < 1:
            raise BadInput(f"the profile's min {name} is {lo}.", f"Set min {name} to 1 or more.")
        if not lo <= opt <= hi:
            raise BadInput(f"the profile's {name} has min {lo}, opt {opt}, max {hi}; they must rise in that order.",
                           f"Set min {name} <= opt {name} <= max {name}.")
        if name != "batch":
            odd = [v for v in (lo, opt, hi) if v % LATENT_SCALE]
            if odd:
                raise BadInput(f"the profile's {name} {odd[0]} is not a multiple of {LATENT_SCALE}.",
                               f"Use {name}s that are multiples of {LATENT_SCALE} (64 for the fastest engines).")
    as_ints = lambda t: tuple(int(v) for v in t)  # noqa: E731
    return ShapeProfile(as_ints(batch), as_ints(height), as_ints(width))


@dataclass
class SlotStatus:
    """What the host shows: the path that serves calls, where its engine came from, what was said, and how
    many calls each way went."""

    backend: str = "not built yet"  # torch | onnxruntime | plain | "not built yet"
    source: str = ""  # "built in 2.1 s", "loaded from the cache ...", why there is no engine
    plan: str = ""  # Plan.summary() of the last build
    messages: list[str] = field(default_factory=list)  # each message once, in the order said
    engine_calls: int = 0
    plain_calls: int = 0
    devices: int = 1  # the devices a call may be spread over (accel/parallel/spread.py)
    spread_calls: int = 0  # engine calls served over all of them
    layout: str = ""  # how the last spread call was laid out over them, in words
    one_device: str = ""  # why the last engine call ran on one device when there are several


class _Collect(logging.Handler):
    """Keeps what the engine layer says (warnings and up) so the host can show it on its UI."""

    def __init__(self, sink: Callable[[str], None]) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.sink(msg[len("sd-accel: "):] if msg.startswith("sd-accel: ") else msg)


def transformer_patches(transformer_options: dict) -> list[str]:
    """The per-step patches a ComfyUI-style transformer_options carries (ComfyUI's and Forge's): a call that carries
    any must run on the host's own forward, which applies them; an engine or CUDA graph would not. rope_options
    (ComfyUI 0.33's ScaleROPE, LongCat-Image) scale and shift the positions the model's own forward computes."""
    names = sorted(k for k, v in transformer_options.get("patches", {}).items() if v)
    names += sorted(f"{k} replace" for k, v in transformer_options.get("patches_replace", {}).items() if v)
    return names + (["rope_options"] if transformer_options.get("rope_options") else [])


def refit(acc) -> str | None:
    """Bring an AcceleratedUNet's engine that bakes weights in (ONNX Runtime) to its module's current weights (a
    LoRA merged or removed). None when it did; else why not: its backend has no refit, or the refit failed."""
    from ..engine import backends

    update = getattr(backends.load(acc.backend), "update_weights", None)
    if update is None:
        return f"the {acc.backend} path cannot refit its engine"
    try:
        update(acc.engine, acc.unet)
    except AccelError as e:
        return f"refitting the {acc.backend} engine failed ({e})"
    return None


class EngineSlot:
    """One host model's engine: built on the first call it may serve, with that call's real shapes; rebuilt
    (or refitted) when the host's weights key changes on a path that bakes weights in; and never the reason a
    call fails: whatever the engine cannot serve runs on the torch path or on the host's plain call.

    preference and options go to accel.accelerate; profile bounds the shapes an engine path serves (calls
    outside it go to the torch path). progress() makes the Progress a build reports to. on_change(status)
    is called whenever the status changes (a build, a new message).
    """

    def __init__(self, preference: str | None = None, options: dict | None = None,
                 profile: ShapeProfile | None = None, progress: Callable[[], Any] | None = None,
                 on_change: Callable[[SlotStatus], None] | None = None, gpu=None,
                 cache_root: str | None = None) -> None:
        self.preference = preference
        self.options = dict(options or {})
        self.cache_root = cache_root
        self.profile = profile
        self.progress = progress
        self.on_change = on_change
        self.gpu = gpu
        self.status = SlotStatus()
        self.acc = None  # accel.accelerate.AcceleratedUNet
        self._module: torch.nn.Module | None = None
        self._weights_key: Any = None
        self._told: set[str] = set()
        self._failed: str | None = None  # a build that failed for this module: not retried every call
        self._broken = False  # the engine failed on a call: the rest of this run goes to the plain model
        self._sizes: set[tuple[int, ...]] = set()  # (batch, latent height, latent width) the engine has served
        self.spread = None  # accel.parallel.spread.Spread: engine calls over several devices (use_spread)

    def use_spread(self, spread) -> None:
        """Spread this slot's engine calls over spread.devices from now on (the torch path with the options that
        spreading needs: accel/parallel/spread.py SPREAD_OPTIONS)."""
        from ..parallel.spread import SPREAD_OPTIONS

        self.spread = spread
        self.options.update(SPREAD_OPTIONS)
        self.status.devices = len(spread.devices)
        self.release()

    # -- messages

    def tell(self, key: str, message: str) -> None:
        """Say `message` once (console and status) under `key`."""
        if key in self._told:
            return
        self._told.add(key)
        log.warning("sd-accel: %s", message)
        self._note(message)

    def _note(self, message: str) -> None:
        if message not in self.status.messages:
            self.status.messages.append(message)
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.status)

    # -- serving calls

    def run_plain(self, key: str, message: str, plain: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run the host's own call, saying why once (nothing to say when message is empty)."""
        if message:
            self.tell(key, message)
        self.status.plain_calls += 1
        return plain()

    def call(self, module: torch.nn.Module, weights_key: Any, x: torch.Tensor, timesteps: torch.Tensor,
             context: torch.Tensor, y: torch.Tensor | None, control: dict | None,
             plain: Callable[[], torch.Tensor], guidance: torch.Tensor | None = None) -> torch.Tensor:
        """Serve one canonical call through the engine for `module`, or through plain() when it cannot. guidance:
        Flux-dev's guidance input (diffusion transformers only)."""
        if self._broken:
            return self.run_plain("broken", "", plain)
        collect = _Collect(self._note)
        log.addHandler(collect)
        try:
            try:
                acc = self._engine_for(module, weights_key, x.dtype)
            except Exception as e:
                if is_interrupt(e):
                    raise
                self._failed = f"building the engine failed ({type(e).__name__}: {e})"
                self.status.backend, self.status.source, acc = "plain", self._failed, None
                self._changed()
            if acc is None:
                return self.run_plain("no-engine", f"no engine: {self.status.source}; the plain model runs.", plain)
            runner = acc
            if acc.backend != "torch" and self.profile is not None and not self.profile.contains(tuple(x.shape)):
                self.tell("profile", (
                    f"a call of batch {x.shape[0]} at {x.shape[-1] * LATENT_SCALE}x{x.shape[-2] * LATENT_SCALE} px "
                    f"(width x height) is outside the engine's profile ({self.profile.describe()}); such calls run "
                    "on the torch path. Widen the profile on the node to cover it."))
                runner = acc.fallback or acc.unet
            extra = {"guidance": guidance} if guidance is not None else {}

            def run() -> torch.Tensor:
                out = self._spread(module, weights_key, runner, acc, x, timesteps, context, y, control, guidance)
                return runner(x, timesteps, context, y, control, **extra) if out is None else out

            out = self._first_at_size(x, run)
            self.status.engine_calls += 1
            return out
        except AccelError as e:
            return self.run_plain(f"call:{e.problem}", f"{e} This call runs on the plain model.", plain)
        except Exception as e:  # an engine that breaks mid-run must not take the user's image with it
            if is_interrupt(e):
                raise
            self._broken = True
            # the engine's changes to the module (patched block forwards) go with it: the host's forward runs as
            # the host wrote it
            self.suspend()
            return self.run_plain(f"call:{type(e).__name__}", (
                f"the {self.status.backend} path failed on a call ({type(e).__name__}: {e}); calls run on the "
                "plain model until the next run."), plain)
        finally:
            log.removeHandler(collect)

    def _spread(self, module, weights_key, runner, acc, x, timesteps, context, y, control, guidance):
        """The call over the slot's devices, or None: it runs on this one (the status says why)."""
        if self.spread is None:
            return None
        out = None
        if runner is not acc or acc.backend != "torch":
            self.status.one_device = "calls off the torch path run on one GPU."
        elif control:
            self.status.one_device = "calls with ControlNet inputs run on one GPU."
        else:
            out = self.spread.call(module, weights_key, acc, x, timesteps, context, y, guidance)
            self.status.one_device = self.spread.why_one
        if out is not None:
            self.status.spread_calls += 1
            self.status.layout = self.spread.layout
        return out

    def _first_at_size(self, x: torch.Tensor, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """run(); the first call at a batch and image size shows why it waits (kernels prepared for that size)."""
        size = (x.shape[0], *x.shape[-2:])
        if size in self._sizes or self.progress is None:
            return run()
        self._sizes.add(size)
        progress = self.progress()
        progress.stage(f"first step at {size[2] * LATENT_SCALE}x{size[1] * LATENT_SCALE}, batch {size[0]}: "
                       "preparing the kernels for this size (once per size)")
        out = run()
        progress.done()
        return out

    def _engine_for(self, module: torch.nn.Module, weights_key: Any, fed: torch.dtype):
        if self._module is not module:
            self.release()
            self._module, self._failed = module, None
        if self._failed is not None:
            return None
        if self.acc is not None and weights_key != self._weights_key:
            if self.acc.backend == "torch":
                self.acc.engine.weights_changed()
                self._weights_key = weights_key
            else:
                self._refresh_weights(weights_key)
        if self.acc is None:
            self._build(module, weights_key, fed)
        elif self.acc.fallback is None and self.acc.backend not in ("torch", "off"):
            from ..engine import backends
            from ..plan.options import Runtime
            from ..progress import NullProgress

            self.acc.fallback = backends.load("torch").build(self.acc.unet, self.acc.plan.torch,
                                                             Runtime(gpu=self.acc.gpu), NullProgress())
        return self.acc if self.acc is not None and self.acc.engine is not None else None

    def _build(self, module: torch.nn.Module, weights_key: Any, fed: torch.dtype) -> None:
        """The engine for `module`, fed latents of dtype `fed` (what weights stored in fp8 compute in)."""
        from ..accelerate import accelerate
        from ..models.spec import canonical
        from ..progress import NullProgress

        start = time.perf_counter()
        try:
            acc = accelerate(canonical(module, fed), self.preference, self.options,
                             self.progress() if self.progress else NullProgress(), self.gpu, self.cache_root,
                             self.profile.options() if self.profile is not None else None)
        except AccelError as e:
            self._failed = self.status.source = str(e)
            self.status.backend = "plain"
            self._changed()
            return
        self.acc, self._weights_key = acc, weights_key
        self.status.plan = acc.plan.summary()
        if acc.engine is None:
            self._failed = self.status.source = ("acceleration is off" if acc.plan.backend == "off"
                                                 else "no engine could be built (see the notes)")
            self.status.backend = "plain"
        else:
            if self.status.backend != acc.backend:  # the torch path is prepared again every run: say it once
                log.info("sd-accel: the %s path is ready (%s)", acc.backend,
                         _source(acc.engine, time.perf_counter() - start))
            self.status.backend = acc.backend
            self.status.source = _source(acc.engine, time.perf_counter() - start)
        self._changed()

    def _refresh_weights(self, weights_key: Any) -> None:
        """The host's weights changed (a LoRA applied or removed) on a path that bakes weights into its engine:
        refit when the backend can, else build again (the engine cache keys on the weights)."""
        why = refit(self.acc)
        if why is None:
            self._weights_key = weights_key
            self._note(f"the {self.acc.backend} engine was refitted to the new weights (LoRA).")
            return
        self._note(f"the weights changed (LoRA) and {why}; the {self.acc.backend} engine is built again for them.")
        self.acc.release()
        self.acc = None

    def end_run(self, keep_graphs: bool = False) -> None:
        """The host finished a run (one sampling). The torch path changed the module in place (memory format,
        fused kernels), and the host's other models share that module: undo that now and redo it on the next
        call. With keep_graphs the torch path's CUDA graphs stay for the next run (they replay unless the
        weights moved meanwhile: no warm-up, no capture); without, the torch path is freed. Engines of other
        paths hold no module changes and stay."""
        self._broken = False
        if self.spread is not None:
            self.spread.end_run()
        if self.acc is None:
            return
        if keep_graphs:
            self.acc.suspend()
        elif self.acc.backend == "torch":
            self.acc.release()
            self.acc = None
        elif self.acc.fallback is not None:
            self.acc.fallback.release()
            self.acc.fallback = None

    def suspend(self) -> None:
        """Before the host's own forward runs the module: undo the torch path's changes to it (fused forwards
        that would skip the layers' own, patched forwards), keeping its graphs; the next engine call redoes them."""
        if self.acc is not None:
            self.acc.suspend()

    def release(self) -> None:
        if self.acc is not None:
            self.acc.release()
            self.acc = None
        self._module = None
        self._sizes.clear()


def _source(engine: Any, seconds: float) -> str:
    """Where an engine came from, in words: the engine cache's own account when the backend keeps one."""
    cache_result = getattr(engine, "cache_result", None)
    if cache_result is not None:
        return cache_result.describe()
    if engine.backend == "torch":
        return f"prepared in {seconds:.1f} s; the torch path has no artefact to cache"
    return f"built in {seconds:.1f} s"
