"""The weight map of an optimized ONNX UNet, and refits: new weights (another checkpoint of the architecture, a LoRA
merged into the module) written into the optimized graph without exporting and fusing again."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ..errors import BackendUnavailable
from ..models.spec import CanonicalUNet
from .export import _load, save_model
from .ort_optimize import to_float16

# Weight map: which module parameters each initializer of the optimized graph is made of, so that new weights
# (LoRA merged into the module) can replace the initializers without exporting and fusing again. The graph
# holds each parameter as is, transposed (MatMul), in NHWC (NhwcConv), reshaped, or packed with its siblings
# (Q/K/V of self attention, K/V of cross attention), in fp32 or fp16. Initializers are matched to parameters
# by the digest of their bytes under each of these transforms.


def _digest(a) -> str:
    import numpy as np

    return hashlib.blake2b(np.ascontiguousarray(a).data, digest_size=16).hexdigest()


def _transform(kind: str, arrays: list, heads: int):
    import numpy as np

    if kind == "same":
        return arrays[0]
    if kind == "t":
        return arrays[0].T
    if kind == "nhwc":
        return arrays[0].transpose(0, 2, 3, 1)
    ws = [a.T for a in arrays]  # Linear weights as MatMul holds them: (in, out)
    if kind == "stacked":  # Attention (CPU): [q | k | v]
        return np.stack(ws, axis=1)
    c, out = ws[0].shape  # packed for MultiHeadAttention: q/k/v interleaved per head
    return np.dstack([w.reshape(c, heads, out // heads) for w in ws]).reshape(c, -1)


def _as(a, dtype: str):
    import numpy as np

    return to_float16(a) if dtype == "float16" else np.asarray(a, dtype)


def _candidates(module: nn.Module, params: dict) -> Iterator[tuple[str, tuple[str, ...], int]]:
    for name, p in params.items():
        yield "same", (name,), 0
        if p.dim() == 2:
            yield "t", (name,), 0
        if p.dim() == 4:
            yield "nhwc", (name,), 0
    for prefix, m in module.named_modules():
        heads = getattr(m, "heads", None)
        if not (heads and all(isinstance(getattr(m, k, None), nn.Linear) for k in ("to_q", "to_k", "to_v"))):
            continue
        q, k, v = (f"{prefix}.{p}.weight" for p in ("to_q", "to_k", "to_v"))
        if params[q].shape == params[k].shape == params[v].shape:
            yield "stacked", (q, k, v), heads
            yield "packed", (q, k, v), heads
        if params[k].shape == params[v].shape:
            yield "packed", (k, v), heads


@dataclass
class WeightMap:
    """initializer -> the ways it is made of parameters (several when equal bytes make it ambiguous)."""

    sources: dict[str, list[tuple[str, list[str], int]]]
    dtypes: dict[str, str]
    shapes: dict[str, list[int]]
    digests: dict[str, str]  # parameter -> digest of its fp32 bytes when the map was made
    unmapped: list[str] = field(default_factory=list)  # parameters found in no initializer

    def save(self, path: Path) -> Path:
        Path(path).write_text(json.dumps(self.__dict__))
        return Path(path)

    @classmethod
    def load(cls, path: Path) -> "WeightMap":
        return cls(**json.loads(Path(path).read_text()))


def _fp32(t: torch.Tensor):
    """One parameter as fp32 numpy, made when needed: all of SDXL's at once would be 10 GB of host memory."""
    return t.detach().float().cpu().numpy()


def weight_map(model_or_path, unet: CanonicalUNet) -> WeightMap:
    """Map the optimized graph's initializers to `unet`'s parameters; `unet` must hold the weights it was
    exported with."""
    import numpy as np
    from onnx import numpy_helper

    model = _load(model_or_path, external=True)
    arrays = [(init.name, numpy_helper.to_array(init)) for init in model.graph.initializer]
    arrays = [(name, a) for name, a in arrays if a.dtype.kind == "f" and a.size > 1]
    by_digest: dict[str, list[str]] = {}
    with _pool() as pool:
        for (name, _), digest in zip(arrays, pool.map(lambda item: _digest(item[1]), arrays)):
            by_digest.setdefault(digest, []).append(name)
    dtypes = {name: str(a.dtype) for name, a in arrays}
    shapes = {name: list(a.shape) for name, a in arrays}
    del arrays
    sizes = {(dtypes[n], int(np.prod(shapes[n]))) for n in dtypes}
    params = dict(unet.unet.named_parameters())

    def digests(candidate: tuple[str, tuple[str, ...], int]) -> list[tuple[str, str]]:
        """(dtype, digest) of the candidate's value in each dtype an initializer of its size has."""
        kind, names, heads = candidate
        numel = sum(params[n].numel() for n in names)
        wanted = sorted(d for d in set(dtypes.values()) if (d, numel) in sizes)  # none of that size: skip
        if not wanted:
            return []
        value = _transform(kind, [_fp32(params[n]) for n in names], heads)
        return [(dtype, _digest(_as(value, dtype))) for dtype in wanted]

    candidates = list(_candidates(unet.unet, params))
    sources: dict[str, list[tuple[str, list[str], int]]] = {}
    used: set[str] = set()
    with _pool() as pool:
        for (kind, names, heads), found in zip(candidates, pool.map(digests, candidates)):
            for dtype, digest in found:
                for init in by_digest.get(digest, []):
                    if dtypes[init] == dtype:
                        sources.setdefault(init, []).append((kind, list(names), heads))
                        used.update(names)
    return WeightMap(sources, {k: dtypes[k] for k in sources}, {k: shapes[k] for k in sources},
                     parameter_digests(unet), sorted(set(params) - used))


def refitted(model_path: Path, unet: CanonicalUNet, out: Path) -> Path:
    """The optimized model at `model_path` (with its weight map beside it) carrying `unet`'s weights, saved to `out`
    with a weight map for those weights: another checkpoint of the same architecture, without exporting and
    optimizing again. BackendUnavailable where the map cannot place the weights (then export again)."""
    wmap = WeightMap.load(weight_map_path(model_path))
    digests = parameter_digests(unet)
    write_initializers(model_path, refreshed_initializers(wmap, unet, digests), out)
    wmap.digests = {n: digests[n] for n in wmap.digests}
    wmap.save(weight_map_path(out))
    return out


def _pool() -> ThreadPoolExecutor:
    # numpy's passes, the hashing and torch's copies to the host all run outside the GIL
    return ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="sd-accel-weights")


def parameter_digests(unet: CanonicalUNet) -> dict[str, str]:
    """The digest of each parameter's fp32 bytes, as a weight map records them."""
    params = list(unet.unet.named_parameters())
    with _pool() as pool:
        return dict(zip((n for n, _ in params), pool.map(lambda p: _digest(_fp32(p)), (p for _, p in params))))


def write_initializers(model_path: Path, values: dict, out: Path) -> Path:
    """A copy of the model at `model_path` with `values` (initializer name -> array of its dtype and size) in place of
    those initializers, saved as `out` (a file of the same name in another folder). Weights kept in the model's
    external data file (as build_model saves a model with a weight map) are written straight into a copy of that
    file at their offsets, with only the small graph file parsed; a model holding them inline is loaded and saved
    whole (slower: the whole protobuf goes through Python)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model_path, out = Path(model_path), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(model_path), load_external_data=False)
    external: dict[str, tuple[int, int]] = {}
    data = model_path.with_name(model_path.name + ".data")
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            where = {e.key: e.value for e in init.external_data}
            if where.get("location") != data.name:
                external = {}
                break
            external[init.name] = (int(where.get("offset", 0)), int(where["length"]))
    def set_inline(model, skip: dict) -> None:
        for init in model.graph.initializer:
            if init.name in values and init.name not in skip:
                init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))

    if not external or out.name != model_path.name:
        model = onnx.load(str(model_path), load_external_data=True)
        set_inline(model, {})
        return save_model(model, out, external=True)
    set_inline(model, external)
    target = out.with_name(out.name + ".data")
    for stale in (out, target):
        if stale.exists():
            stale.unlink()
    with open(data, "rb") as src, open(target, "wb") as dst:
        for name, (offset, length) in sorted(external.items(), key=lambda kv: kv[1][0]):
            if name in values:
                chunk = memoryview(np.ascontiguousarray(values[name])).cast("B")
            else:
                src.seek(offset)
                chunk = src.read(length)
            if len(chunk) != length:
                raise BackendUnavailable(f"the initializer {name} would change size ({length} -> {len(chunk)} bytes).",
                                         "Rebuild the engine (export and optimize again) for these weights.")
            dst.seek(offset)
            dst.write(chunk)
    onnx.save_model(model, str(out))
    return out


def weight_map_path(model_path: Path) -> Path:
    """Where the weight map of a model file lives: beside it."""
    return Path(model_path).with_name(Path(model_path).name + ".weights.json")


def refreshed_initializers(wmap: WeightMap, unet: CanonicalUNet, digests: dict[str, str] | None = None) -> dict:
    """New values of the initializers made of parameters that changed since the map was made ({} when none
    did). BackendUnavailable when a changed parameter is in no initializer, or an initializer's sources
    (equal at export) now disagree: then only a new export gives the right graph. digests: the parameters'
    digests, when the caller has them already."""
    import numpy as np

    params = dict(unet.unet.named_parameters())
    digests = digests if digests is not None else parameter_digests(unet)
    changed = {n for n in params if wmap.digests.get(n) != digests[n]}
    if not changed:
        return {}
    unknown = sorted(changed & set(wmap.unmapped) | changed - set(wmap.digests))
    if unknown:
        raise BackendUnavailable(f"changed weights {unknown[:3]} have no counterpart in the optimized ONNX graph.",
                                 "Rebuild the engine (export and optimize again) for these weights.")

    def value(init: str, sources: list) -> np.ndarray:
        # Bytes, not shapes, are compared: a 1x1 convolution is the same tensor in NCHW and NHWC.
        values = [np.ascontiguousarray(_as(_transform(kind, [_fp32(params[n]) for n in names], heads),
                                           wmap.dtypes[init])).reshape(wmap.shapes[init])
                  for kind, names, heads in sources]
        if any(not np.array_equal(v, values[0]) for v in values[1:]):
            raise BackendUnavailable(f"the initializer {init} was shared by weights that now differ.",
                                     "Rebuild the engine (export and optimize again) for these weights.")
        return values[0]

    todo = [(init, sources) for init, sources in wmap.sources.items()
            if any(changed & set(names) for _, names, _ in sources)]
    with _pool() as pool:
        return dict(zip((init for init, _ in todo), pool.map(lambda job: value(*job), todo)))
