"""ComfyUI's headless server for the tests: main.py --cpu with this pack and tests/comfy_helpers.py (the test nodes)
as its custom nodes. Apart from comfy_helpers, which ComfyUI itself loads as a custom node and so imports nothing
from the tests."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from comfy_helpers import PACK_NAME, REPO, comfy_root, stub_packages
from host_server import HostServer


def server_env(base: Path) -> dict:
    """The server's environment: this process's, less the tests' link that makes `sd_accel` importable
    (tests/conftest.py), so ComfyUI loads the pack from custom_nodes/sd-accel by itself, as it does for a user."""
    env = dict(os.environ)
    own = env.pop("SD_ACCEL_TEST_IMPORT_DIR", None)
    paths = [str(stub_packages() or ""), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p and p != own)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # nothing written into the checkout
    env["SD_ACCEL_CACHE"] = str(base / "models" / "accel")
    return env


class Server(HostServer):
    """ComfyUI's main.py --cpu on a loopback port, with this pack and the test nodes as its only custom nodes."""

    name = "ComfyUI"
    probe = "/system_stats"

    def __init__(self, base: Path, startup_timeout: float = 120, front_end: Path | None = None) -> None:
        super().__init__()
        self.base = base
        custom = base / "custom_nodes"
        custom.mkdir(parents=True, exist_ok=True)
        (custom / PACK_NAME).symlink_to(REPO, target_is_directory=True)
        (custom / "sd_accel_test_nodes.py").symlink_to(Path(__file__).resolve().parent / "comfy_helpers.py")
        env = server_env(base)
        # The tests talk to the API only: an empty web root stands in for the browser front end, so the server
        # starts without the comfyui-frontend-package wheel (it exits when that is missing and no root is given).
        # front_end: a front end's static files, for a browser (tests/ui/check_node_ui.py).
        if front_end is None:
            front_end = base / "front_end"
            front_end.mkdir(exist_ok=True)
        cmd = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
               "--base-directory", str(base), "--disable-auto-launch", "--disable-api-nodes",
               "--database-url", "sqlite:///:memory:", "--disable-metadata", "--front-end-root", str(front_end)]
        self.start(cmd, comfy_root(), env, base / "server.log", startup_timeout)

    def run(self, prompt: dict, timeout: float = 120) -> dict:
        """Queue an API-format workflow and wait for it; its history entry (outputs and status)."""
        prompt_id = self.post("/prompt", {"prompt": prompt, "client_id": "sd-accel-tests"})["prompt_id"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None or entry and entry.get("outputs"):
                status = entry.get("status", {})
                # ComfyUI files a prompt that stopped on a dependency cycle as a success, with the error among its
                # messages only.
                errors = [m for m in status.get("messages", []) if m[0] == "execution_error"]
                if status.get("status_str") == "error" or errors:
                    raise RuntimeError(f"workflow failed: {json.dumps(status.get('messages'))[:3000]}")
                return entry
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited while running:\n{self.log()[-4000:]}")
            time.sleep(0.25)
        raise TimeoutError(f"workflow did not finish in {timeout:.0f} s:\n{self.log()[-4000:]}")
