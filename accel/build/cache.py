"""The engine cache: build an artefact once per key, share it between processes, never load a bad one.

Layout under the root (see `default_root`):

    <key>/              one complete entry: the artefact file(s) and manifest.json
    <key>.lock          the lock that serialises builders of <key> across processes (empty; never deleted,
                        since deleting a lock file another process waits on would let two builders in)
    .tmp-<key>-<rand>/  a build in progress, or left by a builder that died

An entry is complete only once its manifest is written, and the manifest is written last (temp file,
fsync, os.replace), so an interrupted build leaves nothing that is ever loaded. The manifest holds the
key's parts, each file's size and sha256, and the created and last-used times.

Checking a hit: sizes are checked on every load; the full sha256 on the first load of a file in a
process (the verified (path, mtime, size) is remembered), because hashing a multi-GB engine on every
load would cost seconds each time. A file corrupted in place after that first check, with its size and
mtime unchanged, is only caught by the next process or by `prune()`. Pass verify="always" to hash on
every load.

A cache folder that cannot be written (read-only, full disk) never fails the caller: the artefact is
built in a temporary folder instead and the result says "uncached" and why.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, TypeVar

from ..errors import AccelError, BadInput
from ..progress import NullProgress, Progress

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..plan.device import GpuInfo
    from ..models.spec import UNetSpec

log = logging.getLogger("sd-accel")
T = TypeVar("T")

CACHE_FORMAT = 1  # bump when the layout or the meaning of a part changes: every older entry becomes a miss
DEFAULT_MAX_BYTES = 20 * 10**9
MANIFEST = "manifest.json"
_TMP = ".tmp-"
_CHUNK = 1 << 20
_DISK_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EISDIR}

# Import names whose versions change a backend's artefact. torch exports the ONNX graphs the others build from.
_BACKEND_LIBRARIES = {
    "torch": ("torch", "triton"),
    "onnxruntime": ("torch", "onnx", "onnxruntime"),
}
_ALL_LIBRARIES = ("torch", "triton", "onnx", "onnxruntime")

_verified: set[tuple[str, int, int]] = set()  # (file, mtime_ns, size) whose sha256 matched in this process
_verified_lock = threading.Lock()


# ---------------------------------------------------------------------------------------------- keys

def default_root(host_root: str | os.PathLike | None = None) -> Path:
    """SD_ACCEL_CACHE if set, else the host's folder (ComfyUI / A1111: models/accel), else ~/.cache/sd-accel."""
    env = os.environ.get("SD_ACCEL_CACHE", "").strip()
    if env:
        return Path(env).expanduser()
    if host_root:
        return Path(host_root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join("~", ".cache")
    return Path(base).expanduser() / "sd-accel"


_DISTS: dict[str, list[str]] | None = None  # import name -> distributions, read once per process


def _distributions() -> dict[str, list[str]]:
    global _DISTS
    if _DISTS is None:
        import importlib.metadata as md

        _DISTS = dict(md.packages_distributions())
    return _DISTS


def library_versions(backend: str | None = None) -> dict[str, str]:
    """Installed versions of the libraries a backend's artefacts depend on (all known ones for None).

    Read from package metadata without importing them; the distribution name is kept because
    onnxruntime and onnxruntime-gpu of one version build different things.
    """
    import importlib.metadata as md

    from .. import __version__

    out = {"sd-accel": __version__}
    for module in _BACKEND_LIBRARIES.get(backend or "", _ALL_LIBRARIES):
        found = []
        for dist in sorted(set(_distributions().get(module, []))):
            with contextlib.suppress(md.PackageNotFoundError):
                found.append(f"{dist}=={md.version(dist)}")
        if found:
            out[module] = ",".join(found)
    import torch

    out["torch-gpu-runtime"] = f"cuda {torch.version.cuda}" if torch.version.cuda else (
        f"hip {torch.version.hip}" if getattr(torch.version, "hip", None) else "none")
    return out


def _jsonable(o: Any) -> Any:
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, Path):
        return str(o)
    return str(o).replace("torch.", "")  # torch.dtype, torch.device and the like


def canonical_json(parts: Mapping[str, Any]) -> str:
    """The one JSON text of the parts that the key is a hash of: sorted keys, no spaces, tuples as lists."""
    return json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=_jsonable)


def canonical(parts: Mapping[str, Any]) -> dict:
    """The parts as they read back from a manifest, so that expected and stored parts compare equal."""
    return json.loads(canonical_json(parts))


def cache_key(parts: Mapping[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of the parts."""
    return hashlib.sha256(canonical_json(parts).encode()).hexdigest()


def key_parts(weights: str | nn.Module | Mapping[str, torch.Tensor], *, backend: str,
              spec: UNetSpec | Mapping[str, Any] | None = None, profile: Mapping[str, Any] | None = None,
              dtype: torch.dtype | str = "float16", gpu: GpuInfo | None = None,
              options: Mapping[str, Any] | None = None, versions: Mapping[str, str] | None = None) -> dict:
    """Everything that changes a built artefact, as a JSON-ready dict for `cache_key`.

    weights: a `weights_fingerprint` or the module / state dict to take it from (after LoRA patches are
    merged). profile: the shape profile, e.g. {"batch": [1, 4], "height": [512, 1024], ...}. options: the
    backend options that change what is built. versions: defaults to `library_versions(backend)`.
    """
    if not isinstance(weights, str):
        from .fingerprint import weights_fingerprint

        weights = weights_fingerprint(weights)
    if spec is not None and dataclasses.is_dataclass(spec):
        spec = dataclasses.asdict(spec)
    return canonical({
        "format": CACHE_FORMAT,
        "weights": weights,
        "spec": dict(spec) if spec is not None else None,
        "profile": dict(profile) if profile is not None else None,
        "dtype": str(dtype).replace("torch.", ""),
        "backend": backend,
        "options": dict(options or {}),
        "versions": dict(versions) if versions is not None else library_versions(backend),
        "gpu": None if gpu is None else {"vendor": gpu.vendor, "name": gpu.name, "arch": gpu.arch, "driver": gpu.driver},
    })


def describe_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """What changed between two sets of parts, in words: 'versions.torch 2.10 -> 2.11; gpu.arch sm_89 -> sm_90'."""
    changes = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            changes += [f"{k}.{s} {_short(a.get(s))} -> {_short(b.get(s))}"
                        for s in sorted(set(a) | set(b)) if a.get(s) != b.get(s)]
        else:
            changes.append(f"{k} {_short(a)} -> {_short(b)}")
    return "; ".join(changes)


def _short(v: Any) -> str:
    s = "none" if v is None else (v if isinstance(v, str) else json.dumps(v, sort_keys=True))
    return s[:12] + "..." if len(s) > 40 else s


# ------------------------------------------------------------------------------------------- results

@dataclass
class CacheResult:
    """Where the artefact is and how it got there.

    cached=False: the cache folder could not be used; `path` is a temporary folder removed at exit.
    busy=True (only with wait=False): another process is building this key; nothing was built.
    reason: why the artefact was rebuilt, or why it is uncached or not ready, for the user; "" when clean.
    """

    path: Path
    hit: bool
    reason: str = ""
    cached: bool = True
    busy: bool = False
    key: str = ""
    build_seconds: float = 0.0
    check_seconds: float = 0.0

    def describe(self) -> str:
        if self.busy:
            return self.reason
        what = (f"loaded from the cache ({self.check_seconds:.2f} s to check)" if self.hit
                else f"built in {self.build_seconds:.1f} s" + ("" if self.cached else ", not cached"))
        return what + (f": {self.reason}" if self.reason else "")


@dataclass
class EntryInfo:
    """One folder of the cache as `ls` / `info` see it. problem is "" for a complete, sound entry."""

    key: str
    path: Path
    size: int
    created: float | None = None
    last_used: float | None = None
    parts: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)
    problem: str = ""

    def summary(self) -> str:
        """Model, size, dtype, backend, GPU and the weights it was built from: what tells two entries apart."""
        p = self.parts
        spec, gpu = p.get("spec") or {}, p.get("gpu") or {}
        params = spec.get("num_params")
        words = [spec.get("family"), spec.get("form") and f"({spec['form']} form)",
                 params and f"{params / 1e6:.0f}M params", p.get("dtype"), p.get("backend"),
                 gpu.get("arch") or gpu.get("vendor"), p.get("weights") and f"weights {str(p['weights'])[:8]}"]
        return " ".join(str(w) for w in words if w)


@dataclass
class Cleanup:
    """What clear() / prune() did."""

    removed: list[str] = field(default_factory=list)  # entries removed as incomplete, corrupt, or by clear()
    evicted: list[str] = field(default_factory=list)  # entries removed to stay under the size cap
    temp_removed: int = 0  # leftover build folders removed
    freed_bytes: int = 0
    busy: list[str] = field(default_factory=list)  # entries skipped because a process holds their lock


# ------------------------------------------------------------------------------------------ the cache

def _max_bytes_from_env() -> int:
    raw = os.environ.get("SD_ACCEL_CACHE_MAX_GB", "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        gb = float(raw)
        if gb < 0:
            raise ValueError
    except ValueError:
        log.warning("SD_ACCEL_CACHE_MAX_GB=%r is not a size in GB; using %d GB. Set it to a number such as 20.",
                     raw, DEFAULT_MAX_BYTES // 10**9)
        return DEFAULT_MAX_BYTES
    return int(gb * 10**9)


class _Busy(Exception):
    pass


class EngineCache:
    """A size-capped, multi-process-safe folder of built artefacts, one sub-folder per key.

    max_bytes: the cap (default: SD_ACCEL_CACHE_MAX_GB, else 20 GB); least recently used entries are
    evicted after each insert. verify: "first" (sha256 on the first load of a file in a process) or
    "always".
    """

    def __init__(self, root: str | os.PathLike | None = None, max_bytes: int | None = None, verify: str = "first") -> None:
        if verify not in ("first", "always"):
            raise ValueError(f"verify must be 'first' or 'always', not {verify!r}")
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.max_bytes = _max_bytes_from_env() if max_bytes is None else int(max_bytes)
        self.verify = verify
        self._locks: dict[str, Any] = {}
        self._locks_guard = threading.Lock()

    # -- locking

    def _lock_path(self, key: str) -> Path:
        return self.root / f"{key}.lock"

    def _lock(self, key: str):
        """This instance's (re-entrant) lock object for a key."""
        from filelock import FileLock

        with self._locks_guard:
            if key not in self._locks:
                self._locks[key] = FileLock(str(self._lock_path(key)))
            return self._locks[key]

    def _acquire(self, key: str, wait: bool, progress: Progress):
        """The key's lock, acquired. _Busy when another process holds it and wait is False; OSError when
        the lock file cannot be created (the root is not writable)."""
        from filelock import Timeout

        self.root.mkdir(parents=True, exist_ok=True)
        # filelock treats some permission errors as "held by someone" and would wait forever; find them first.
        os.close(os.open(self._lock_path(key), os.O_RDWR | os.O_CREAT, 0o666))
        lock = self._lock(key)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if not wait:
                raise _Busy from None
            progress.stage("waiting for another process that is building this engine", 1)
            lock.acquire()
        return lock

    def _try_foreign_lock(self, key: str):
        """A fresh lock on the key taken without waiting, or None when anyone (this process included) holds it."""
        from filelock import FileLock, Timeout

        lock = FileLock(str(self._lock_path(key)))
        try:
            lock.acquire(timeout=0)
        except (Timeout, OSError):
            return None
        return lock

    @contextlib.contextmanager
    def hold(self, key: str, wait: bool = True, progress: Progress | None = None) -> Iterator[bool]:
        """Hold the key's lock across several calls (get_or_build, then loading the artefact), so that no
        other process evicts or rebuilds it meanwhile. Yields False when busy and wait is False; yields
        True without a lock when the root cannot be written (get_or_build then runs uncached)."""
        lock = None
        try:
            lock = self._acquire(key, wait, progress or NullProgress())
            held = True
        except _Busy:
            held = False
        except OSError:
            held = True
        try:
            yield held
        finally:
            if lock is not None:
                lock.release()

    # -- the main call

    def entry(self, key: str) -> Path:
        return self.root / key

    def get_or_build(self, key: str, parts: Mapping[str, Any], build: Callable[[Path], None],
                     progress: Progress | None = None, wait: bool = True) -> CacheResult:
        """The sound cached entry for key, or build it: build(folder) writes the artefact file(s) into the
        empty temporary folder it is given; they are checksummed, moved into place, and the manifest written.

        One builder per key across processes; others wait (wait=True) or get a busy result at once.
        Errors from build() propagate, except a full or read-only disk, which gives an uncached result.
        """
        progress = progress or NullProgress()
        parts = canonical(parts)
        if cache_key(parts) != key:
            raise ValueError("key is not cache_key(parts); compute it with cache_key")
        try:
            lock = self._acquire(key, wait, progress)
        except _Busy:
            return self._busy(key)
        except OSError as e:
            return self._read_only(key, parts, build, progress, e)
        try:
            return self._get_or_build_locked(key, parts, build, progress)
        finally:
            lock.release()

    def _busy(self, key: str) -> CacheResult:
        return CacheResult(self.entry(key), hit=False, busy=True, key=key,
                           reason="another process is building this engine; serving through the torch path until it is ready.")

    def _get_or_build_locked(self, key: str, parts: dict, build: Callable[[Path], None], progress: Progress) -> CacheResult:
        t0 = time.perf_counter()
        self._remove_temps(key)  # we hold the lock, so their builder is gone
        problem = self._check(key, parts, progress)
        if problem is None:
            self._touch(key)
            return CacheResult(self.entry(key), hit=True, key=key, check_seconds=time.perf_counter() - t0)
        reason = f"the cached engine was rebuilt because {problem}" if problem else self._explain_miss(parts)
        try:
            if problem:
                self._remove_entry(self.entry(key))
            tmp = self._new_temp(key)
        except OSError as e:
            return self._uncached(key, build, progress, self._disk_message(e))
        t1 = time.perf_counter()
        try:
            build(tmp)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if e.errno not in _DISK_ERRNOS:
                raise
            return self._uncached(key, build, progress, self._disk_message(e))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        build_s = time.perf_counter() - t1
        try:
            self._install(key, parts, tmp, build_s, progress)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            with contextlib.suppress(OSError):
                self._remove_entry(self.entry(key))
            if e.errno not in _DISK_ERRNOS:
                raise
            return self._uncached(key, build, progress, self._disk_message(e))
        self._evict(keep={key})
        return CacheResult(self.entry(key), hit=False, reason=reason, key=key, build_seconds=build_s)

    # -- building and installing

    def _new_temp(self, key: str) -> Path:
        tmp = self.root / f"{_TMP}{key}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def _install(self, key: str, parts: dict, tmp: Path, build_s: float, progress: Progress) -> None:
        files = _scan(tmp)
        if not files:
            raise AccelError("the engine build finished without writing any file, so there is nothing to cache.",
                             "This is a bug in the backend; please report it with the log above.")
        progress.stage("checksumming the built engine", _mib(sum(files.values())))
        digests = {}
        for rel, size in files.items():
            p = tmp / rel
            digests[rel] = {"size": size, "sha256": _sha256(p, progress)}
            _fsync_file(p)
        final = self.entry(key)
        if final.exists():
            self._remove_entry(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        now = time.time()
        manifest = {"format": CACHE_FORMAT, "key": key, "parts": parts, "files": digests,
                    "created": now, "last_used": now, "build_seconds": round(build_s, 3)}
        _write_atomic(final / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        for rel, d in digests.items():  # just hashed: the first load in this process need not hash again
            _remember(final / rel, d["size"])
        progress.done()

    def _uncached(self, key: str, build: Callable[[Path], None], progress: Progress, why: str) -> CacheResult:
        try:
            tmp = Path(tempfile.mkdtemp(prefix="sd-accel-uncached-"))
        except OSError as e:
            raise AccelError(f"{why} The system temporary folder cannot be written either ({e}).",
                             "Free disk space, or set SD_ACCEL_CACHE to a writable folder with room.") from e
        atexit.register(shutil.rmtree, tmp, True)
        t1 = time.perf_counter()
        try:
            build(tmp)
        except OSError as e:
            if e.errno in _DISK_ERRNOS:
                raise AccelError(f"{why} Building in the temporary folder {tmp} failed too ({e}).",
                                 "Free disk space, or set SD_ACCEL_CACHE to a writable folder with room.") from e
            raise
        log.warning("sd-accel: %s", why)
        return CacheResult(tmp, hit=False, cached=False, reason=why, key=key, build_seconds=time.perf_counter() - t1)

    def _disk_message(self, e: OSError) -> str:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            what = f"the disk of cache folder {self.root} is full ({e.strerror})"
            fix = "Free some space (python -m sd_accel cache prune / clear) or set SD_ACCEL_CACHE to a folder on another disk."
        else:
            what = f"cache folder {self.root} is not writable ({e.strerror or e})"
            fix = "Set SD_ACCEL_CACHE to a writable folder."
        return f"{what}; running uncached. {fix}"

    def _read_only(self, key: str, parts: dict, build: Callable[[Path], None], progress: Progress, e: OSError) -> CacheResult:
        """The root cannot be written: a sound existing entry is still used (unlocked, last-used not updated)."""
        t0 = time.perf_counter()
        with contextlib.suppress(OSError):
            if self._check(key, parts, progress) is None:
                return CacheResult(self.entry(key), hit=True, key=key, check_seconds=time.perf_counter() - t0)
        return self._uncached(key, build, progress, self._disk_message(e))

    # -- checking

    def _read_manifest(self, folder: Path) -> dict:
        """The manifest of an entry folder; ValueError saying what is wrong with it."""
        try:
            raw = (folder / MANIFEST).read_bytes()
        except FileNotFoundError:
            raise ValueError("the entry is incomplete (no manifest; its build was interrupted)") from None
        try:
            m = json.loads(raw)
            if not isinstance(m, dict) or not isinstance(m.get("files"), dict) or not isinstance(m.get("parts"), dict):
                raise ValueError("missing fields")
        except ValueError as err:
            raise ValueError(f"its manifest is unreadable ({err})") from None
        if m.get("format") != CACHE_FORMAT:
            raise ValueError(f"it was written in cache format {m.get('format')}, this version reads {CACHE_FORMAT}")
        if m.get("key") != folder.name or cache_key(m["parts"]) != folder.name:
            raise ValueError("its manifest belongs to another key (the folder was copied or edited)")
        return m

    def _check(self, key: str, parts: dict | None, progress: Progress, full: bool | None = None) -> str | None:
        """None when the entry is sound; "" when there is none; else why it cannot be used."""
        folder = self.entry(key)
        if not folder.is_dir():
            return ""
        try:
            m = self._read_manifest(folder)
        except ValueError as err:
            return str(err)
        if parts is not None and m["parts"] != parts:
            return f"its manifest records other settings ({describe_difference(m['parts'], parts)})"
        return self._check_files(folder, m["files"], progress, full)

    def _check_files(self, folder: Path, files: dict, progress: Progress, full: bool | None) -> str | None:
        todo = []
        for rel, d in files.items():
            p = folder / rel
            try:
                st = p.stat()
            except FileNotFoundError:
                return f"its file {rel} is missing"
            if st.st_size != d.get("size"):
                return f"its file {rel} has {st.st_size} bytes where the manifest records {d.get('size')} (truncated or overwritten)"
            must_hash = full if full is not None else (self.verify == "always" or not _seen(p, st))
            if must_hash:
                todo.append((rel, p, st, d))
        if todo:
            progress.stage("verifying the cached engine", _mib(sum(st.st_size for _, _, st, _ in todo)))
        for rel, p, st, d in todo:
            if _sha256(p, progress) != d.get("sha256"):
                return f"its file {rel} does not match its checksum (corrupted on disk)"
            _remember(p, st.st_size, st)
        if todo:
            progress.done()
        return None

    def _explain_miss(self, parts: dict) -> str:
        """Why there is no entry for these parts when one for the same weights and backend exists, in words."""
        best: tuple[int, str] | None = None
        for info in self._entries():
            old = info.parts
            if info.problem or old.get("weights") != parts.get("weights") or old.get("backend") != parts.get("backend"):
                continue
            diff = describe_difference(old, parts)
            n = diff.count(";") + 1
            if best is None or n < best[0]:
                best = (n, diff)
        return "" if best is None else f"a cached engine for this model exists but was built for other settings ({best[1]}); building a new one"

    def _touch(self, key: str) -> None:
        path = self.entry(key) / MANIFEST
        try:
            m = json.loads(path.read_bytes())
            m["last_used"] = time.time()
            _write_atomic(path, json.dumps(m, indent=1, sort_keys=True).encode())
        except OSError as e:  # last-used only orders eviction; a read-only entry still serves
            log.debug("sd-accel: could not update last-used of %s: %s", key, e)

    # -- listing and cleaning

    def _entries(self) -> list[EntryInfo]:
        out = []
        try:
            children = sorted(self.root.iterdir())
        except OSError:
            return out
        for p in children:
            if not p.is_dir() or p.name.startswith(_TMP) or p.name.endswith(".lock"):
                continue
            info = EntryInfo(p.name, p, _du(p))
            try:
                m = self._read_manifest(p)
                info.created, info.last_used = m.get("created"), m.get("last_used")
                info.parts, info.files = m["parts"], m["files"]
                info.problem = self._check_files(p, m["files"], NullProgress(), full=False) or ""
            except ValueError as err:
                info.problem = str(err)
            out.append(info)
        return out

    def ls(self) -> list[EntryInfo]:
        """Every entry, most recently used first; incomplete ones last, with their problem."""
        return sorted(self._entries(), key=lambda e: (bool(e.problem), -(e.last_used or 0)))

    def info(self, key: str) -> EntryInfo:
        """The entry whose key is or starts with `key`; BadInput when none or several match."""
        matches = [e for e in self._entries() if e.key.startswith(key.strip())] if key.strip() else []
        if len(matches) != 1:
            what = "no entry matches" if not matches else f"{len(matches)} entries match"
            raise BadInput(f"{what} key {key!r} in {self.root}.",
                           "Run `python -m sd_accel cache ls` to see the keys (a unique prefix is enough).")
        return matches[0]

    def leftovers(self) -> list[tuple[Path, int]]:
        """Build folders (and their sizes) left by builders that are running or died; prune removes those nobody
        holds."""
        try:
            return [(p, _du(p)) for p in sorted(self.root.iterdir()) if p.is_dir() and p.name.startswith(_TMP)]
        except OSError:
            return []

    def total_bytes(self) -> int:
        return sum(e.size for e in self._entries())

    def discard(self, key: str) -> bool:
        """Remove one entry (waits for its lock). True when it is gone, False when it could not be removed."""
        folder = self.entry(key)
        with self.hold(key):
            try:
                self._remove_entry(folder)
            except OSError:
                pass
            return not folder.exists()

    def clear(self) -> Cleanup:
        """Remove every entry and leftover build folder that no process is using."""
        report = Cleanup()
        report.temp_removed = self._remove_temps(None)
        for e in self._entries():
            if self._remove_unlocked(e):
                report.removed.append(e.key)
                report.freed_bytes += e.size
            else:
                report.busy.append(e.key)
        return report

    def prune(self, verify: bool = True, progress: Progress | None = None) -> Cleanup:
        """Remove incomplete or corrupt entries (verify=True hashes every file) and leftover build
        folders, then evict least recently used entries down to the cap."""
        progress = progress or NullProgress()
        report = Cleanup()
        report.temp_removed = self._remove_temps(None)
        for e in self._entries():
            problem = e.problem or (self._check(e.key, None, progress, full=True) if verify else None) or ""
            if not problem:
                continue
            if self._remove_unlocked(e):
                report.removed.append(e.key)
                report.freed_bytes += e.size
            else:
                report.busy.append(e.key)
        evicted = self._evict(keep=set())
        report.evicted = [e.key for e in evicted]
        report.freed_bytes += sum(e.size for e in evicted)
        return report

    def _evict(self, keep: set[str]) -> list[EntryInfo]:
        """Remove least recently used entries until the total is under the cap, sparing `keep` and locked ones."""
        entries = self._entries()
        total = sum(e.size for e in entries)
        evicted = []
        # Broken entries first (they are never loaded), then by last use.
        for e in sorted(entries, key=lambda e: (not e.problem, e.last_used or 0)):
            if total <= self.max_bytes:
                break
            if e.key in keep:
                continue
            if self._remove_unlocked(e):
                total -= e.size
                evicted.append(e)
                log.info("sd-accel: evicted cached engine %s (%s, %s) to stay under the %s cache cap",
                         e.key[:12], e.summary() or "incomplete", human_bytes(e.size), human_bytes(self.max_bytes))
        return evicted

    def _remove_unlocked(self, e: EntryInfo) -> bool:
        lock = self._try_foreign_lock(e.key)
        if lock is None:
            return False
        try:
            self._remove_entry(e.path)
        finally:
            lock.release()
        return True

    def _remove_entry(self, folder: Path) -> None:
        # The manifest goes first, so a removal cut short leaves an incomplete entry, never a loadable one.
        with contextlib.suppress(FileNotFoundError):
            (folder / MANIFEST).unlink()
        shutil.rmtree(folder, ignore_errors=True)

    def _remove_temps(self, key: str | None) -> int:
        """Remove leftover build folders (of one key, whose lock the caller holds; or of all unlocked keys)."""
        n = 0
        try:
            children = list(self.root.iterdir())
        except OSError:
            return 0
        for p in children:
            if not (p.is_dir() and p.name.startswith(_TMP)):
                continue
            owner = p.name[len(_TMP):].rsplit("-", 1)[0]
            if key is not None:
                if owner == key:
                    shutil.rmtree(p, ignore_errors=True)
                    n += 1
                continue
            lock = self._try_foreign_lock(owner)
            if lock is None:
                continue
            try:
                shutil.rmtree(p, ignore_errors=True)
                n += 1
            finally:
                lock.release()
        return n


# --------------------------------------------------------------------------------- build on first use

def cached_build(cache: EngineCache, parts: Mapping[str, Any], build_artifact: Callable[[Path, Progress], None],
                 load: Callable[[Path], T], progress: Progress | None = None,
                 wait: bool = True) -> tuple[T | None, CacheResult]:
    """Load the artefact for these parts, building and caching it on first use.

    build_artifact(folder, progress) writes the artefact into folder; load(folder) turns it into the
    engine. The key's lock is held while loading, so no other process evicts or rebuilds the entry under
    the loader. A cached artefact that fails to load is discarded and rebuilt once; a freshly built one
    that fails to load raises. With wait=False and another process building, returns (None, busy result).
    """
    progress = progress or NullProgress()
    key = cache_key(parts)

    def build(folder: Path) -> None:
        build_artifact(folder, progress)

    with cache.hold(key, wait, progress) as held:
        if not held:
            return None, cache._busy(key)
        result = cache.get_or_build(key, parts, build, progress)
        try:
            return load(result.path), result
        except Exception as err:
            if not result.hit:
                raise
            why = f"the cached engine failed to load ({type(err).__name__}: {err})"
            log.warning("sd-accel: %s; rebuilding it", why)
            if cache.discard(key):
                result = cache.get_or_build(key, parts, build, progress)
                result.reason = f"{why}, so it was rebuilt"
            else:
                result = cache._uncached(key, build, progress, f"{why} and the cache folder {cache.root} cannot be "
                                         "changed; running uncached. Set SD_ACCEL_CACHE to a writable folder.")
            return load(result.path), result


# ----------------------------------------------------------------------------------------- file helpers

def _scan(folder: Path) -> dict[str, int]:
    """Relative path (with /) -> size of every file under folder."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            p = Path(dirpath) / n
            out[p.relative_to(folder).as_posix()] = p.stat().st_size
    return dict(sorted(out.items()))


def _du(folder: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(folder):
        for n in names:
            with contextlib.suppress(OSError):
                total += (Path(dirpath) / n).stat().st_size
    return total


def _mib(n: int) -> int:
    return max(1, -(-n // _CHUNK))


def _sha256(path: Path, progress: Progress) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            progress.advance(1)
    return h.hexdigest()


def _stamp(path: Path, st: os.stat_result) -> tuple[str, int, int]:
    return (str(path.resolve()), st.st_mtime_ns, st.st_size)


def _seen(path: Path, st: os.stat_result) -> bool:
    with _verified_lock:
        return _stamp(path, st) in _verified


def _remember(path: Path, size: int, st: os.stat_result | None = None) -> None:
    st = st or path.stat()
    if st.st_size == size:
        with _verified_lock:
            _verified.add(_stamp(path, st))


def _fsync_file(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync; the size and checksum checks still catch a torn file
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    if os.name == "nt":
        return  # Windows cannot open a directory for fsync; NTFS journals the rename
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temp file in the same folder, fsync, os.replace: readers see the old or the new file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
