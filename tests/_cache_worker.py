"""A second process for tests/test_cache.py: builds or loads one cache entry, or dies while building it.

    python tests/_cache_worker.py build ROOT LOG SLEEP     cached_build; prints the result as JSON
    python tests/_cache_worker.py killme ROOT READY        writes half a file, touches READY, sleeps
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sd_accel.accel.build.cache import EngineCache, cache_key, cached_build, key_parts  # noqa: E402

PARTS = key_parts("0" * 64, backend="test", dtype="float16", versions={"lib": "1.0"})
CONTENT = bytes(range(256)) * 64  # 16 KiB


def build(root: str, log: str, sleep: float) -> None:
    def build_artifact(folder: Path, progress) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(sleep)
        (folder / "engine.bin").write_bytes(CONTENT)

    def load(folder: Path) -> bool:
        return (folder / "engine.bin").read_bytes() == CONTENT

    ok, result = cached_build(EngineCache(root), PARTS, build_artifact, load)
    print(json.dumps({"ok": ok, "hit": result.hit, "reason": result.reason, "path": str(result.path)}))


def killme(root: str, ready: str) -> None:
    def build_artifact(folder: Path) -> None:
        with open(folder / "engine.bin", "wb") as f:
            f.write(CONTENT[: len(CONTENT) // 2])
            f.flush()
            os.fsync(f.fileno())
        Path(ready).touch()
        time.sleep(60)

    EngineCache(root).get_or_build(cache_key(PARTS), PARTS, build_artifact)


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    else:
        killme(sys.argv[2], sys.argv[3])
