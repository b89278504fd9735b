"""`bench --comfy-attention`: ComfyUI's attention for the whole bench process, as ComfyUI's flags choose it, the eager
rows named after it, and the fp32 reference kept on exact attention. Imports neither torch nor ComfyUI until used."""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Iterator

# --comfy-attention: ComfyUI's flag that chooses its attention for the whole host (the attribute comfy/cli_args.py
# parses it into), and the package that attention needs
COMFY_ATTENTION = {"sage": ("use_sage_attention", "sageattention"), "flash": ("use_flash_attention", "flash_attn"),
                   "split": ("use_split_cross_attention", None), "quad": ("use_quad_cross_attention", None),
                   "pytorch": ("use_pytorch_cross_attention", None)}


def use_comfy_attention(name: str) -> None:
    """ComfyUI's attention `name` for the whole process, as its flag (--use-sage-attention, ...) chooses it: set in
    its parsed arguments before comfy.ldm.modules.attention is first imported (the models are built after this), whose
    own start-up then picks the function and the modules that import it (Flux's math, MMDiT) take it. ValueError when
    its package is not importable."""
    flag, package = COMFY_ATTENTION[name]
    if package:
        try:
            importlib.import_module(package)
        except ImportError as e:
            raise ValueError(f"--comfy-attention {name} needs the {package} package, which does not import here "
                             f"({e}); install it (pip install {package}) or choose another.") from None
    import comfy.cli_args

    setattr(comfy.cli_args.args, flag, True)


def eager_variant(host: tuple[str, str] | None) -> str:
    """The eager row's name: ComfyUI's classes run the attention its start-up chose (its PyTorch one on a GPU unless
    --comfy-attention says otherwise)."""
    attention = sys.modules.get("comfy.ldm.modules.attention") if host and host[0] == "comfyui" else None
    chosen = getattr(attention, "optimized_attention", None)
    if chosen is None or chosen is attention.attention_pytorch:
        return "eager (SDPA)"
    return f"eager (ComfyUI's {chosen.__name__.removeprefix('attention_')} attention)"


@contextlib.contextmanager
def exact_attention() -> Iterator[None]:
    """The fp32 reference with ComfyUI's PyTorch attention wherever its start-up put another (sage quantizes q and k to
    8 bits): every row's error is against exact attention."""
    attention = sys.modules.get("comfy.ldm.modules.attention")
    chosen = getattr(attention, "optimized_attention", None)
    if chosen is None or chosen is attention.attention_pytorch:
        yield
        return
    places = [(m, n) for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("comfy.")
              for n in ("optimized_attention", "optimized_attention_masked") if getattr(m, n, None) is chosen]
    for m, n in places:
        setattr(m, n, attention.attention_pytorch)
    try:
        yield
    finally:
        for m, n in places:
            setattr(m, n, chosen)
