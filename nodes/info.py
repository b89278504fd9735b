"""Accel Info: the detected GPU, the plan and its reasons, the engine cache, and (given a model from an
Accelerated UNet node) the path that model runs on, as a STRING output and as text on the node."""

from __future__ import annotations

import sys

from .accelerated_unet import BACKENDS, Session, session_of
from .comfy_ui import CATEGORY, cache_root, current_prompt, on_prompt
from .gpus import gpus_line


def cache_state(root: str) -> str:
    from pathlib import Path

    from ..accel.build.cache import EngineCache, human_bytes

    if not Path(root).is_dir():
        return f"engine cache: {root} (empty: nothing built yet)"
    try:
        entries = EngineCache(root).ls()
    except OSError as e:
        return f"engine cache: {root} cannot be read ({e})"
    size = sum(e.size for e in entries)
    lines = [f"engine cache: {root}, {len(entries)} engine(s), {human_bytes(size)}"]
    for e in entries[:10]:
        lines.append(f"- {e.key[:12]} {e.summary()} {human_bytes(e.size)}" + (f" ({e.problem})" if e.problem else ""))
    if len(entries) > 10:
        lines.append(f"- ... and {len(entries) - 10} more (python -m sd_accel cache ls)")
    return "\n".join(lines)


def report(backend: str = "auto", model=None) -> str:
    """What ran, how fast and what to do next first (model_state), then the machine: GPU, packages, plan, cache,
    settings and versions."""
    from ..accel.errors import AccelError
    from ..accel.plan.device import describe, detect
    from ..accel.plan.policy import choose, probe_packages

    session = session_of(model) if model is not None else None
    if model is None:
        lines = ["model: none connected", ("next: connect the MODEL output of an Accelerated UNet node to see the "
                                           "path it runs on and this run's calls")]
    elif session is None:
        lines = ["model: not accelerated (it does not come from an Accelerated UNet node)",
                 "next: put an Accelerated UNet node between the model's loader and its sampler"]
    else:
        lines = [model_state(session, on_cpu=_runs_on_cpu(model))]
    gpu = detect()
    installed = probe_packages()
    lines.append(f"GPU: {describe(gpu)}")
    lines += [f"- {n}" for n in gpu.notes]
    names = ("triton", "onnxruntime", "onnxruntime_gpu", "flash_attn")
    lines.append("packages: " + ", ".join(f"{k} {'yes' if installed.get(k) else 'no'}" for k in names))
    if session is not None and session.slot.status.plan:
        lines.append(session.slot.status.plan)  # the plan the model's engine was built with
    else:
        try:
            lines.append(f"plan for backend={backend}:\n" + choose(gpu, backend, installed).summary())
        except AccelError as e:
            lines.append(f"plan for backend={backend}: {e}")
    lines.append(cache_state(cache_root()))
    lines += settings_lines()
    return "\n".join(lines)


def settings_lines() -> list[str]:
    """The SD_ACCEL_* settings in force and the versions, as `doctor` shows them, with the ComfyUI version."""
    import torch

    from ..accel import __version__, settings_line

    comfyui = getattr(sys.modules.get("comfyui_version"), "__version__", "unknown")
    return [settings_line(), f"versions: sd-accel {__version__}, torch {torch.__version__}, ComfyUI {comfyui}"]


def _runs_on_cpu(model) -> bool:
    """Where ComfyUI runs the model (its --cpu runs it there on a machine with a GPU too)."""
    import torch

    return torch.device(model.load_device).type == "cpu"


def model_state(session: Session, on_cpu: bool) -> str:
    """A model from an Accelerated UNet node: what ran (the path and the calls of this prompt's run), how fast (the
    run's time in the sampler), what to do next, and what the node said."""
    status = session.slot.status
    plain_torch = on_cpu and status.backend in ("torch", "not built yet")
    if plain_torch:
        head = ("model: through an Accelerated UNet node, on the CPU: the torch path runs the plain model there, "
                "so nothing is sped up and no speed-up is claimed")
    elif status.backend == "plain":
        head = "model: through an Accelerated UNet node, but the plain model runs (the notes say why)"
    else:
        head = "model: accelerated"
    engine, plain, spread = session.run_calls()
    counts = (f"{engine} on the torch path (the plain model's computation on the CPU), {plain} on ComfyUI's own "
              "forward" if plain_torch else f"{engine} accelerated, {plain} on the plain model")
    prompt = current_prompt()
    reused = session.sampled and prompt is not None and session.prompt != prompt
    if not session.sampled:
        calls = "calls: none yet: the model has not sampled"
    elif reused:
        calls = ("calls this run: none: the model did not sample in this run (ComfyUI reused its sampler's cached "
                 f"output); its last run: {counts}")
    else:
        calls = f"calls this run: {counts}"
    lines = [head, f"path: {status.backend}" + (f" ({status.source})" if status.source else ""), calls]
    gpus = gpus_line(status, spread, engine) if session.sampled else ""
    if gpus:
        lines.append(gpus)
    if session.sampled and engine + plain:
        seconds = session.sampling_seconds
        # ComfyUI's outer sample loads the model first: its time is in the run's
        lines.append(f"speed: {'the last' if reused else 'this'} run's sampling took {seconds:.2f} s for "
                     f"{engine + plain} calls, loading the model and any new size's first call included"
                     + (" (the CPU: the plain model's speed)" if plain_torch else ""))
    lines.append("next: " + _next(status.backend, plain_torch, session.sampled, reused, engine, plain))
    lines += [f"note: {m}" for m in status.messages]
    return "\n".join(lines)


def _next(backend: str, plain_torch: bool, sampled: bool, reused: bool, engine: int, plain: int) -> str:
    if not sampled:
        return "queue a prompt in which a sampler uses this model"
    if plain_torch:
        return "run ComfyUI on a GPU (without --cpu) for the speed-up"
    if backend == "plain":
        return "the notes below say why the plain model runs and what would let the node serve the calls"
    if plain and not reused:
        return (f"{plain} call(s) ran on the plain model: the notes below say which patches or inputs sent them "
                "there; without those the engine serves every call")
    if reused:
        return "nothing: change the seed or a setting for the sampler to run again"
    return "nothing: the engine served every call of this run"


def _is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)


def _node_class(node: dict) -> type | None:
    # ComfyUI's own `nodes` module, its node registry, loaded before any custom node. Taken from sys.modules, not
    # imported by that name, which is also this pack's folder of nodes.
    return sys.modules["nodes"].NODE_CLASS_MAPPINGS.get(node.get("class_type"))


def samplers_of(prompt: dict, me: str) -> list[list]:
    """Links to what this prompt computes last, on each branch, from the model that Accel Info `me` reports on:
    the samplers and what follows them. Only nodes that ComfyUI runs (on the way to an output node) count, and none
    that needs the report of any Accel Info node: two reports that each waited for the other would never run."""
    source = prompt.get(me, {}).get("inputs", {}).get("model")
    if not _is_link(source):
        return []
    children: dict[str, set[str]] = {}
    parents: dict[str, set[str]] = {}
    for node_id, node in prompt.items():
        for value in node.get("inputs", {}).values():
            if _is_link(value) and str(value[0]) in prompt:
                children.setdefault(str(value[0]), set()).add(node_id)
                parents.setdefault(node_id, set()).add(str(value[0]))

    def reach(start: set[str], edges: dict[str, set[str]]) -> set[str]:
        seen, todo = set(), list(start)
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    def node_class(node_id: str) -> type | None:
        return _node_class(prompt[node_id])

    infos = {n for n in prompt if node_class(n) is AccelInfo}
    reports = reach(infos, children) | infos
    outputs = {n for n in prompt if n != me and getattr(node_class(n), "OUTPUT_NODE", False)}
    runs = outputs | reach(outputs, parents)
    users = {n for n in reach({str(source[0])}, children) - reports
             if n in runs and getattr(node_class(n), "RETURN_TYPES", ())}
    return [[n, 0] for n in sorted(users) if not reach({n}, children) & users]


WAIT = "wait_"  # the inputs wait_for_samplers adds; Accel Info declares none by that name


def wait_for_samplers(request: dict) -> dict:
    """ComfyUI's handler of each request posted to /prompt: links every Accel Info node that has a model and no
    `after` to that model's samplers (samplers_of) through inputs it does not declare, which ComfyUI runs before the
    node and hands to it unnamed. ComfyUI orders nodes only by their links, so without them the report could run
    before the model samples. The node itself waits, not a copy of it made by node expansion after the samplers ran:
    ComfyUI files a node's text under the id of the node that returned it, the copy's, not the node's own."""
    prompt = request.get("prompt")
    if not isinstance(prompt, dict):
        return request
    mine = [n for n, node in prompt.items()
            if _node_class(node) is AccelInfo and "after" not in node.get("inputs", {})]
    for node_id in mine:  # a prompt posted again from the history has the links already
        inputs = prompt[node_id].get("inputs", {})
        for name in [k for k in inputs if k.startswith(WAIT)]:
            del inputs[name]
    waits = {node_id: samplers_of(prompt, node_id) for node_id in mine}
    for node_id, links in waits.items():
        prompt[node_id].setdefault("inputs", {}).update({f"{WAIT}{i}": link for i, link in enumerate(links, 1)})
    return request


class AccelInfo:
    CATEGORY = CATEGORY
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("info",)
    FUNCTION = "info"
    OUTPUT_NODE = True
    DESCRIPTION = ("Shows the detected GPU, the acceleration plan and its reasons, the engine cache, and the path "
                   "a connected model runs on, with the calls of this run (it waits for the samplers of the "
                   "connected model).")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {"backend": (BACKENDS, {"default": "auto", "tooltip": (
                    "The backend whose plan is shown when no model from an Accelerated UNet node is connected "
                    "(auto: the one that node would choose).")})},
                "optional": {"model": ("MODEL", {"tooltip": "A model from an Accelerated UNet node: shows its "
                                                 "path and how the calls of this run went."}),
                             "after": ("LATENT", {"tooltip": "The sampler's output, to report after it. Without "
                                                  "it, the report waits for every sampler of the connected "
                                                  "model in this workflow."})}}

    @classmethod
    def IS_CHANGED(cls, **_kwargs) -> float:
        return float("nan")  # the cache and the model's state change between runs: always report afresh

    def info(self, backend: str, model=None, after=None, **_waited) -> dict:
        """_waited: the links wait_for_samplers added, which only order the node after the samplers."""
        text = report(backend, model)
        return {"ui": {"text": [text]}, "result": (text,)}


# ComfyUI loads custom nodes after it starts its server: the handler is in place before the first prompt.
on_prompt(wait_for_samplers)
