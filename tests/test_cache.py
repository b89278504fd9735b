"""The engine cache on real files and real processes: one build per key, nothing half-written is ever loaded,
corruption and foreign entries are rebuilt with a reason, LRU eviction, uncached fallback, the CLI."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from sd_accel.accel.build.cache import (MANIFEST, EngineCache, cache_key, cached_build, default_root, key_parts,
                                        library_versions)
from sd_accel.accel.plan.device import GpuInfo
from sd_accel.accel.errors import BadInput
from sd_accel.accel.build.fingerprint import weights_fingerprint

WORKER = Path(__file__).with_name("_cache_worker.py")
H100 = GpuInfo(vendor="nvidia", family="hopper", name="NVIDIA H100", arch="sm_90", device="cuda:0", driver="580.1")


def parts(weights: str = "a" * 64, **over) -> dict:
    kw = dict(backend="test", dtype="float16", gpu=H100, versions={"lib": "1.0"},
              profile={"batch": (1, 2), "height": (512, 1024)})
    kw.update(over)
    return key_parts(weights, **kw)


class Writer:
    """A build callback that writes engine.bin and counts its calls."""

    def __init__(self, data: bytes = b"x" * 1000) -> None:
        self.data, self.calls = data, 0

    def __call__(self, folder: Path) -> None:
        self.calls += 1
        (folder / "sub").mkdir()
        (folder / "engine.bin").write_bytes(self.data)
        (folder / "sub" / "weights.dat").write_bytes(b"w" * 10)


def build_once(cache: EngineCache, p: dict, data: bytes = b"x" * 1000):
    w = Writer(data)
    return cache.get_or_build(cache_key(p), p, w), w


def worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ------------------------------------------------------------------------------------------------ keys

def test_key_is_canonical_and_holds_every_part():
    a = parts()
    assert cache_key(a) == cache_key(json.loads(json.dumps(a))) == cache_key(parts(profile={"height": [512, 1024], "batch": [1, 2]}))
    assert len(cache_key(a)) == 64
    others = [parts(weights="b" * 64), parts(dtype=torch.bfloat16), parts(backend="other"), parts(versions={"lib": "1.1"}),
              parts(gpu=GpuInfo("nvidia", "ada", arch="sm_89", driver="580.1")), parts(gpu=GpuInfo("nvidia", "hopper", name="NVIDIA H100", arch="sm_90", driver="590.0")),
              parts(profile={"batch": (1, 4)}), parts(options={"opt_level": 5})]
    keys = {cache_key(o) for o in others} | {cache_key(a)}
    assert len(keys) == len(others) + 1
    assert parts(dtype=torch.float16) == a  # torch dtypes and their names give one key
    v = library_versions("onnxruntime")
    assert v["torch"].startswith("torch==") and "onnxruntime" in v and "sd-accel" in v and "tensorrt" not in v


def test_fingerprint_changes_with_lora_and_not_with_reloading(tmp_path):
    from safetensors.torch import load_file, save_file

    from sd_accel.accel.models.configs import build_unet
    from sd_accel.accel.models.spec import inspect_unet

    unet = build_unet("tiny-sd15")
    spec = inspect_unet(unet)
    sd = {k: v.contiguous() for k, v in unet.state_dict().items()}
    save_file(sd, str(tmp_path / "unet.safetensors"))
    reloaded = load_file(str(tmp_path / "unet.safetensors"))
    base = cache_key(parts(unet, spec=spec))
    assert cache_key(parts(reloaded, spec=spec)) == base
    assert weights_fingerprint(unet) == weights_fingerprint(reloaded) == weights_fingerprint(unet.to(memory_format=torch.channels_last))

    # A LoRA merged into one attention projection: W += up @ down (rank 4), small relative to W.
    name = next(k for k in reloaded if k.endswith("attn2.to_k.weight"))
    w = reloaded[name]
    g = torch.Generator().manual_seed(0)
    patched = dict(reloaded)
    patched[name] = w + 1e-3 * (torch.randn(w.shape[0], 4, generator=g) @ torch.randn(4, w.shape[1], generator=g))
    assert cache_key(parts(patched, spec=spec)) != base
    assert weights_fingerprint({**reloaded, name: w.half()}) != weights_fingerprint(reloaded)
    with pytest.raises(BadInput, match="meta device"):
        weights_fingerprint({"w": torch.empty(4, 4, device="meta")})


# ------------------------------------------------------------------------------------- build and hit

def test_build_then_hit_with_manifest(tmp_path):
    cache = EngineCache(tmp_path)
    p = parts()
    r1, w1 = build_once(cache, p)
    assert (r1.hit, r1.cached, r1.reason, w1.calls) == (False, True, "", 1)
    m = json.loads((r1.path / MANIFEST).read_text())
    assert m["parts"] == p and m["key"] == cache_key(p) == r1.path.name
    assert m["files"]["engine.bin"]["size"] == 1000 and m["files"]["sub/weights.dat"]["size"] == 10
    assert len(m["files"]["engine.bin"]["sha256"]) == 64
    first_used = m["last_used"]
    r2, w2 = build_once(EngineCache(tmp_path), p)
    assert (r2.hit, r2.reason, w2.calls, r2.path) == (True, "", 0, r1.path)
    assert (r2.path / "engine.bin").read_bytes() == b"x" * 1000
    assert json.loads((r1.path / MANIFEST).read_text())["last_used"] > first_used
    assert [e.key for e in cache.ls()] == [cache_key(p)] and not list(tmp_path.glob(".tmp-*"))
    with pytest.raises(ValueError, match="cache_key"):
        cache.get_or_build("0" * 64, p, Writer())


def test_two_processes_build_once_and_a_third_is_told_busy(tmp_path, monkeypatch):
    root, log = tmp_path / "cache", tmp_path / "builds.log"
    first = worker("build", str(root), str(log), "2.5")
    deadline = time.time() + 30
    while not (log.exists() and log.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    assert log.read_text(), "the first worker never started building"
    second = worker("build", str(root), str(log), "2.5")

    # Meanwhile this process does not wait: it is told another process is building.
    monkeypatch.syspath_prepend(str(WORKER.parent))
    from _cache_worker import PARTS

    t0 = time.perf_counter()
    busy = EngineCache(root).get_or_build(cache_key(PARTS), PARTS, Writer(), wait=False)
    obj, busy2 = cached_build(EngineCache(root), PARTS, lambda f, p: None, lambda f: "loaded", wait=False)
    assert busy.busy and not busy.hit and "another process is building" in busy.reason
    assert obj is None and busy2.busy and time.perf_counter() - t0 < 2

    outs = []
    for proc in (first, second):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outs.append(json.loads(out))
    assert all(o["ok"] for o in outs)
    assert sorted(o["hit"] for o in outs) == [False, True]
    assert len(log.read_text().splitlines()) == 1  # built once
    assert [e.key for e in EngineCache(root).ls()] == [cache_key(PARTS)]


def test_builder_killed_mid_write_leaves_nothing_loadable(tmp_path, monkeypatch):
    root, ready = tmp_path / "cache", tmp_path / "ready"
    proc = worker("killme", str(root), str(ready))
    deadline = time.time() + 30
    while not ready.exists() and time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=30)
    proc.stdout.close(), proc.stderr.close()

    monkeypatch.syspath_prepend(str(WORKER.parent))
    from _cache_worker import CONTENT, PARTS

    key = cache_key(PARTS)
    cache = EngineCache(root)
    assert list(root.glob(f".tmp-{key}-*")), "the killed builder should have left its temp folder"
    assert cache.ls() == [] and not (root / key).exists()
    r, w = build_once(cache, PARTS, CONTENT)
    assert (r.hit, w.calls) == (False, 1)
    assert (r.path / "engine.bin").read_bytes() == CONTENT and not list(root.glob(".tmp-*"))

    # Died after moving the files into place but before the manifest: incomplete, rebuilt with the reason.
    (r.path / MANIFEST).unlink()
    assert "incomplete" in cache.ls()[0].problem
    r2, w2 = build_once(cache, PARTS, CONTENT)
    assert (r2.hit, w2.calls) == (False, 1) and "incomplete" in r2.reason


def test_flipped_or_truncated_bytes_are_rebuilt_with_a_reason(tmp_path):
    p = parts()
    r, _ = build_once(EngineCache(tmp_path), p)
    f = r.path / "engine.bin"

    def flip(keep_mtime: bool) -> None:
        st = f.stat()
        data = bytearray(f.read_bytes())
        data[500] ^= 0xFF
        f.write_bytes(bytes(data))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns if keep_mtime else st.st_mtime_ns + 10**9))

    # Silent corruption (same size and mtime): a cache that hashes on every load catches it.
    flip(keep_mtime=True)
    r2, w2 = build_once(EngineCache(tmp_path, verify="always"), p)
    assert (r2.hit, w2.calls) == (False, 1) and "checksum" in r2.reason and f.read_bytes() == b"x" * 1000
    # A file rewritten in place (new mtime) is hashed again even in the default "first load" mode.
    flip(keep_mtime=False)
    r3, w3 = build_once(EngineCache(tmp_path), p)
    assert (r3.hit, w3.calls) == (False, 1) and "checksum" in r3.reason
    # Sizes are checked on every load.
    f.write_bytes(b"x" * 10)
    r4, w4 = build_once(EngineCache(tmp_path), p)
    assert (r4.hit, w4.calls) == (False, 1) and "truncated" in r4.reason
    r5, w5 = build_once(EngineCache(tmp_path), p)
    assert (r5.hit, w5.calls, r5.reason) == (True, 0, "")


def test_version_gpu_or_foreign_manifest_is_a_miss(tmp_path):
    cache = EngineCache(tmp_path)
    build_once(cache, parts())
    r, w = build_once(cache, parts(versions={"lib": "2.0"}))
    assert (r.hit, w.calls) == (False, 1) and "versions.lib 1.0 -> 2.0" in r.reason
    r, w = build_once(cache, parts(gpu=GpuInfo("nvidia", "ada", name="RTX 4090", arch="sm_89", driver="580.1")))
    assert (r.hit, w.calls) == (False, 1) and "gpu.arch sm_90 -> sm_89" in r.reason

    # An entry whose manifest was edited (or copied from elsewhere) under this key is not trusted.
    p = parts()
    man = cache.entry(cache_key(p)) / MANIFEST
    m = json.loads(man.read_text())
    m["parts"]["dtype"] = "float32"
    man.write_text(json.dumps(m))
    r, w = build_once(cache, p)
    assert (r.hit, w.calls) == (False, 1) and "another key" in r.reason
    assert len(cache.ls()) == 3


def test_lru_eviction_keeps_recent_and_locked_entries(tmp_path):
    from filelock import FileLock

    data = b"x" * 10_000
    cache = EngineCache(tmp_path, max_bytes=25_000)  # room for two entries of about 11 kB (files and manifest)
    a, b, c, d = (parts(weights=ch * 64) for ch in "abcd")
    for x in (a, b):
        build_once(cache, x, data)
    assert build_once(cache, a)[0].hit  # a is now the most recently used
    build_once(cache, c, data)
    assert {e.key for e in cache.ls()} == {cache_key(a), cache_key(c)}
    assert cache.total_bytes() <= 25_000

    # An entry whose lock another holder has is never evicted, even when least recently used.
    with FileLock(str(tmp_path / f"{cache_key(a)}.lock")):
        build_once(cache, d, data)
    assert {e.key for e in cache.ls()} == {cache_key(a), cache_key(d)}
    # The entry just built stays even when it alone exceeds the cap.
    small = EngineCache(tmp_path, max_bytes=100)
    r, _ = build_once(small, parts(weights="e" * 64))
    assert [e.key for e in small.ls()] == [r.key]


def test_env_root_and_cap(tmp_path, monkeypatch):
    monkeypatch.delenv("SD_ACCEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "sd-accel"
    assert default_root(tmp_path / "models" / "accel") == tmp_path / "models" / "accel"
    monkeypatch.setenv("SD_ACCEL_CACHE", str(tmp_path / "env"))
    assert default_root(tmp_path / "models" / "accel") == tmp_path / "env"
    monkeypatch.setenv("SD_ACCEL_CACHE_MAX_GB", "1.5")
    assert EngineCache().max_bytes == 1_500_000_000 and EngineCache().root == tmp_path / "env"
    monkeypatch.setenv("SD_ACCEL_CACHE_MAX_GB", "lots")
    assert EngineCache().max_bytes == 20 * 10**9


# ------------------------------------------------------------------------------- unwritable and full

def test_unwritable_root_runs_uncached_with_a_message(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cache = EngineCache(blocker / "cache")  # mkdir fails for every user, root included
    r, w = build_once(cache, parts())
    assert (r.hit, r.cached, w.calls) == (False, False, 1)
    assert "is not writable" in r.reason and "SD_ACCEL_CACHE" in r.reason and str(blocker / "cache") in r.reason
    assert (r.path / "engine.bin").read_bytes() == b"x" * 1000 and not r.path.is_relative_to(blocker)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="chmod does not stop root from writing")
def test_read_only_folder_runs_uncached(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        r, w = build_once(EngineCache(root), parts())
    finally:
        root.chmod(0o755)
    assert (r.cached, w.calls) == (False, 1) and "is not writable" in r.reason


def test_existing_entry_still_serves_when_locks_cannot_be_written(tmp_path):
    p = parts()
    build_once(EngineCache(tmp_path), p)
    lock = tmp_path / f"{cache_key(p)}.lock"
    lock.unlink()
    lock.mkdir()  # the lock file cannot be created, as on a read-only mount
    r, w = build_once(EngineCache(tmp_path), p)
    assert (r.hit, r.cached, w.calls) == (True, True, 0)


def test_full_disk_during_build_runs_uncached(tmp_path):
    root = tmp_path / "cache"
    calls = []

    def build(folder: Path) -> None:
        calls.append(folder)
        if root in folder.parents:
            raise OSError(errno.ENOSPC, "No space left on device")
        (folder / "engine.bin").write_bytes(b"ok")

    p = parts()
    r = EngineCache(root).get_or_build(cache_key(p), p, build)
    assert (r.hit, r.cached, len(calls)) == (False, False, 2)
    assert "is full" in r.reason and (r.path / "engine.bin").read_bytes() == b"ok"
    assert not list(root.glob(".tmp-*")) and EngineCache(root).ls() == []


# ------------------------------------------------------------------------------- build on first use

def test_cached_build_builds_loads_and_rebuilds_a_bad_artefact(tmp_path):
    stages = []

    class Rec:
        def stage(self, name, total=1):
            stages.append(name)

        def advance(self, n=1):
            pass

        def done(self):
            pass

    builds = []

    def build_artifact(folder: Path, progress) -> None:
        progress.stage("exporting", 2)
        progress.advance(2)
        builds.append(folder)
        (folder / "engine.bin").write_text("engine v1")

    def load(folder: Path) -> str:
        text = (folder / "engine.bin").read_text()
        if text != "engine v1":
            raise RuntimeError("deserialization failed")
        return text

    p = parts()
    eng, r = cached_build(EngineCache(tmp_path), p, build_artifact, load, Rec())
    assert (eng, r.hit, len(builds)) == ("engine v1", False, 1) and stages[:2] == ["exporting", "checksumming the built engine"]
    eng, r = cached_build(EngineCache(tmp_path), p, build_artifact, load, Rec())
    assert (eng, r.hit, len(builds)) == ("engine v1", True, 1)

    # Same size, valid manifest checksum, but the loader rejects it (e.g. built by an incompatible runtime).
    f = r.path / "engine.bin"
    f.write_text("engine v2")
    man = json.loads((r.path / MANIFEST).read_text())
    man["files"]["engine.bin"]["sha256"] = hashlib.sha256(b"engine v2").hexdigest()
    (r.path / MANIFEST).write_text(json.dumps(man))
    eng, r = cached_build(EngineCache(tmp_path), p, build_artifact, load)
    assert (eng, r.hit, len(builds)) == ("engine v1", False, 2) and "failed to load" in r.reason

    # A freshly built artefact that does not load is the builder's fault: it raises.
    with pytest.raises(RuntimeError, match="deserialization"):
        cached_build(EngineCache(tmp_path), parts(weights="f" * 64), lambda f, pr: (f / "engine.bin").write_text("bad"), load)


# ------------------------------------------------------------------------------------------------ CLI

def cli(*args: str) -> tuple[int, str]:
    from sd_accel.accel.cli.cache import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(list(args))
    return rc, buf.getvalue()


def test_cli_ls_info_prune_clear(tmp_path, capsys):
    root = str(tmp_path)
    cache = EngineCache(tmp_path)
    a, _ = build_once(cache, parts(weights="a" * 64), b"x" * 2_500_000)
    b, _ = build_once(cache, parts(weights="b" * 64))
    (tmp_path / f".tmp-{'c' * 64}-deadbeef").mkdir()  # a dead builder's leftovers
    broken = tmp_path / ("d" * 64)
    broken.mkdir()
    (broken / "engine.bin").write_bytes(b"half")

    rc, out = cli("ls", "--root", root)
    assert rc == 0 and a.key[:12] in out and b.key[:12] in out and "2.5 MB" in out and "BROKEN" in out
    assert "float16 test sm_90" in out and "just now" in out
    assert "weights aaaaaaaa" in out and "weights bbbbbbbb" in out  # entries of two checkpoints tell apart
    assert "leftover build folders: 1" in out and "cache prune" in out
    rc, out = cli("info", a.key[:10], "--root", root)
    assert rc == 0 and a.key in out and "engine.bin" in out and '"arch": "sm_90"' in out
    rc = cli("info", "zz", "--root", root)[0]
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("sd-accel: ") and "cache ls" in err  # bad input: the CLI's exit code 2

    rc, out = cli("prune", "--root", root)
    assert rc == 0 and "removed 1 incomplete or corrupt entries and 1 leftover build folders" in out
    assert not broken.exists() and not list(tmp_path.glob(".tmp-*")) and len(cache.ls()) == 2

    from sd_accel.accel.cli.main import main as accel_main

    assert accel_main(["cache", "clear", "--root", root]) == 0
    assert "removed 2 entries" in capsys.readouterr().out and cache.ls() == []
