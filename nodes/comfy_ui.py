"""What the nodes share about ComfyUI itself: its progress bar, messages to the front-end (web/sd_accel.js),
and where the engine cache lives. ComfyUI is imported inside functions, so this module imports anywhere.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from ..accel.progress import CallbackProgress, keep_logs_off_bars

log = logging.getLogger("sd-accel")
keep_logs_off_bars(log)  # ComfyUI's samplers draw tqdm bars on its console while the engine logs

CATEGORY = "sd-accel"
STATUS_EVENT = "sd-accel.status"  # web/sd_accel.js listens for it


def publish(node_id: str | None, payload: dict[str, Any]) -> None:
    """Send a status update for one node to the front-end. Silent when no ComfyUI server runs (tests, scripts):
    the server module is taken from sys.modules, never imported, since importing it starts nothing useful."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None or node_id is None:
        return
    try:
        instance.send_sync(STATUS_EVENT, {"node": str(node_id), **payload})
    except Exception as e:  # a closed socket must not fail a run
        log.debug("sd-accel: could not send status to the UI: %s", e)


def on_prompt(handler: Callable[[dict], dict]) -> None:
    """Have ComfyUI's server pass each request posted to /prompt through handler before it validates the prompt.
    Nothing without a server (tests, scripts)."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is not None:
        instance.add_on_prompt_handler(handler)


def current_prompt() -> str | None:
    """The id of the prompt ComfyUI's server is running; None without a server (tests, scripts)."""
    server = sys.modules.get("server")
    return getattr(getattr(getattr(server, "PromptServer", None), "instance", None), "last_prompt_id", None)


def node_progress(node_id: str | None, what: str = "build") -> CallbackProgress:
    """A Progress that drives ComfyUI's progress bar on the node and the stage text of web/sd_accel.js."""
    import comfy.utils

    try:
        bar = comfy.utils.ProgressBar(100, node_id=node_id)
    except TypeError:  # ComfyUI before node_id existed: the bar shows on the running node
        bar = comfy.utils.ProgressBar(100)

    def report(stage: str, fraction: float, eta: float | None) -> None:
        bar.update_absolute(int(round(100 * fraction)), 100)
        publish(node_id, {"kind": what, "stage": stage, "fraction": fraction, "eta": eta})

    return CallbackProgress(report)


def cache_root() -> str:
    """The engine cache folder: SD_ACCEL_CACHE, else ComfyUI's models/accel (DESIGN.md)."""
    from ..accel.build.cache import default_root

    try:
        import folder_paths

        host = os.path.join(folder_paths.models_dir, "accel")
    except ImportError:
        host = None
    return str(default_root(host))


def say(node_id: str | None, message: str) -> str:
    """One message for the console and the node; returns it for the node's text."""
    log.warning("sd-accel: %s", message)
    publish(node_id, {"kind": "message", "message": message})
    return message
