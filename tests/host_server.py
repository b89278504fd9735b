"""A host's headless server for the tests (ComfyUI's main.py, A1111's and Forge's launch.py): a process on a
loopback port with its output in a log file, JSON over HTTP, and a bounded wait for it to answer."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from sd_accel.accel.parallel.rendezvous import free_port


class HostServer:
    """Started by start(); `probe` is a GET path that answers once the host is up."""

    name = "the server"
    probe = "/"

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, cmd: list[str], cwd: Path, env: dict, log_path: Path, timeout: float) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            with contextlib.suppress(OSError):
                if self.get(self.probe) is not None:
                    return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} did not answer within {timeout:.0f} s:\n{self.log()[-4000:]}")

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, payload: dict, timeout: float = 300):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"POST {path} -> {e.code}: {e.read().decode(errors='replace')[:2000]}\n"
                               f"{self.log()[-3000:]}") from None

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self._log.close()
