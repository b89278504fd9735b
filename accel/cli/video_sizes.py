"""--video-sizes: "WxH,..." in pixels, each side a multiple of what the model or VAE needs."""

from __future__ import annotations

from ..errors import BadInput


def parse_video_sizes(text: str, multiple: int = 1, what: str = "", why: str = "") -> list[tuple[int, int]]:
    """(width, height) of each "WxH" in text; BadInput naming the item where a side is no positive multiple of
    `multiple`. what: the end of "is not a video size ..." ("wan21 decodes"); why: said after the multiple."""
    sizes = []
    for item in text.split(","):
        w, _, h = item.strip().partition("x")
        if not (w.isdigit() and h.isdigit()) or not int(w) * int(h) or int(w) % multiple or int(h) % multiple:
            each = f", each a multiple of {multiple}{why}" if multiple > 1 else ""
            raise BadInput(f"--video-sizes: {item.strip()!r} is not a video size{' ' + what if what else ''}.",
                           f"Give width x height in pixels{each}, e.g. 832x480,1280x720.")
        sizes.append((int(w), int(h)))
    return sizes
