"""The command line's checks of single option values, as argparse `type=` functions, and the parser that reports a bad
one: a typo stops the command before anything is built or timed (minutes on a GPU), in one line that names the option,
the value and what it accepts, exit code 2, as every sd-accel error is reported."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Callable, NoReturn, Sequence

from ..errors import BadInput


class Parser(argparse.ArgumentParser):
    """argparse with sd-accel's one-line errors, without the usage text (a dozen lines for bench, above the one line
    that matters)."""

    def error(self, message: str) -> NoReturn:
        message = message.removeprefix("argument ")
        if not message.endswith("."):  # argparse's own ("unrecognized arguments: ..."): the checks here end with theirs
            message += f"; `{self.prog} --help` lists the options."
        self.exit(2, f"sd-accel: {message}\n")


def whole(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number from `minimum` (to `maximum`)."""
    span = f"of {minimum} or more" if maximum is None else f"from {minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number {span}.")
        return value
    return parse


def above_zero(text: str) -> float:
    """A finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not above 0: give a positive number, e.g. 4.")
    return value


def names(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of `choices` (what: "a path the bench times"); empty items are dropped."""
    def parse(text: str) -> list[str]:
        items = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in items if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} "
                                             f"not {what}; choose from {', '.join(choices)}.")
        return items
    return parse


def pixel_sides(multiple: int) -> Callable[[str], tuple[int, ...]]:
    """Comma-separated image sides in pixels, each a positive multiple of `multiple`."""
    def parse(text: str) -> tuple[int, ...]:
        for item in text.split(","):
            if not item.strip().isdigit() or not int(item) or int(item) % multiple:
                raise argparse.ArgumentTypeError(f"{item.strip()!r} is not an image side: give pixels, each a multiple "
                                                 f"of {multiple}, comma-separated, e.g. 1024,4096.")
        return tuple(int(item) for item in text.split(","))
    return parse


def video_sizes(text: str) -> str:
    """"WxH,..." with positive sides; each model's own multiple is checked where the models are known."""
    from .video_sizes import parse_video_sizes

    try:
        parse_video_sizes(text)
    except BadInput as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--video-sizes: ")) from None
    return text


def output_file(text: str) -> str:
    """A file this user can write, checked before the work whose results it is to hold: its folder exists and is
    writable, and it is not a folder itself."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name in it, e.g. {path / 'results.json'}.")
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: its folder {folder} {what}. Create the folder, "
                                         "or give a file in one that exists.")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written by this user; give a file in a folder you can "
                                         "write to.")
    return text


def image_file(text: str) -> str:
    """An output_file whose suffix names an image format PIL saves (it picks the format from the suffix)."""
    from PIL import Image

    Image.init()
    if Image.registered_extensions().get(Path(text).suffix.lower()) not in Image.SAVE:
        raise argparse.ArgumentTypeError(f"{text!r} does not end in an image type that can be saved; end it in .png "
                                         "(or .jpg, .webp), e.g. sd-accel-demo.png.")
    return output_file(text)


def backend(text: str) -> str:
    """auto | torch | onnxruntime | off (accel/plan/policy.py check_preference), lower-cased."""
    from ..plan.policy import check_preference

    try:
        return check_preference(text)
    except BadInput as e:
        raise argparse.ArgumentTypeError(str(e)) from None
