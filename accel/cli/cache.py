"""`python -m sd_accel cache ls | info KEY | clear | prune [--root DIR]`: look at and tidy the engine cache."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..build.cache import EngineCache, EntryInfo, default_root, human_bytes
from ..errors import BadInput
from .checks import Parser


def _when(t: float | None) -> str:
    if not t:
        return "-"
    age = time.time() - t
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
    if age < 120:
        return f"{stamp} (just now)"
    for unit, s in (("d", 86400), ("h", 3600), ("min", 60)):
        if age >= s:
            return f"{stamp} ({age / s:.0f} {unit} ago)"
    return stamp


def _ls(cache: EngineCache) -> int:
    entries = cache.ls()
    total = sum(e.size for e in entries)
    print(f"cache: {cache.root}  ({len(entries)} entries, {human_bytes(total)} of {human_bytes(cache.max_bytes)} cap)")
    leftovers = cache.leftovers()
    if leftovers:
        size = sum(n for _, n in leftovers)
        print(f"leftover build folders: {len(leftovers)} ({human_bytes(size)}), from builds running now or interrupted; "
              "`python -m sd_accel cache prune` removes those no process is using")
    if not entries:
        return 0
    print(f"{'KEY':<14}{'SIZE':>10}  {'LAST USED':<30}{'WHAT'}")
    for e in entries:
        what = e.summary() if not e.problem else f"BROKEN: {e.problem} (run prune)"
        print(f"{e.key[:12]:<14}{human_bytes(e.size):>10}  {_when(e.last_used):<30}{what}")
    return 0


def _info(cache: EngineCache, key: str) -> int:
    e: EntryInfo = cache.info(key)
    print(f"key:       {e.key}")
    print(f"folder:    {e.path}")
    print(f"size:      {human_bytes(e.size)} ({e.size} bytes)")
    print(f"created:   {_when(e.created)}")
    print(f"last used: {_when(e.last_used)}")
    print(f"status:    {e.problem or 'complete (sizes match the manifest; prune verifies checksums)'}")
    if e.files:
        print("files:")
        for rel, d in e.files.items():
            print(f"  {rel}  {human_bytes(d.get('size', 0))}  sha256 {d.get('sha256', '?')}")
    if e.parts:
        print("parts:")
        print(json.dumps(e.parts, indent=2, sort_keys=True))
    return 0


def _clear(cache: EngineCache) -> int:
    r = cache.clear()
    print(f"removed {len(r.removed)} entries ({human_bytes(r.freed_bytes)}) and {r.temp_removed} leftover build folders from {cache.root}")
    if r.busy:
        print(f"kept {len(r.busy)} entries in use by another process: {', '.join(k[:12] for k in r.busy)}")
    return 0


def _prune(cache: EngineCache, verify: bool) -> int:
    r = cache.prune(verify=verify)
    print(f"removed {len(r.removed)} incomplete or corrupt entries and {r.temp_removed} leftover build folders; "
          f"evicted {len(r.evicted)} least recently used entries to stay under {human_bytes(cache.max_bytes)}; "
          f"freed {human_bytes(r.freed_bytes)}")
    if r.busy:
        print(f"skipped {len(r.busy)} entries in use by another process: {', '.join(k[:12] for k in r.busy)}")
    print(f"now {human_bytes(cache.total_bytes())} in {cache.root}")
    return 0


def _root(args: argparse.Namespace) -> tuple[Path, str | None]:
    """The cache folder and what named it: --root, SD_ACCEL_CACHE, or None for the default."""
    if getattr(args, "root", None):
        return Path(args.root).expanduser(), "--root"
    return default_root(), ("SD_ACCEL_CACHE" if os.environ.get("SD_ACCEL_CACHE", "").strip() else None)


def _check_root(root: Path, source: str | None, action: str) -> bool:
    """Whether there is a cache folder to look at. BadInput when the folder named is not one this user can use for
    `action`: the listing of a mistyped path would read "0 entries", as if the cache were empty. The default folder
    not there yet is no error for ls, clear and prune (False): a fresh install has built nothing."""
    named = f"the cache folder {root}" + (f" ({source})" if source else "")
    fix = {"--root": "Give --root", "SD_ACCEL_CACHE": "Set SD_ACCEL_CACHE to"}.get(source, "Set SD_ACCEL_CACHE to")
    if root.exists() and not root.is_dir():
        raise BadInput(f"{named} is a file, not a folder.", f"{fix} a folder (a build makes it).")
    if not root.exists():
        if source is None and action != "info":
            return False
        raise BadInput(f"{named} does not exist.",
                       f"{fix} the folder engines are built in (`python -m sd_accel doctor` shows it; a build makes it).")
    need = os.R_OK | os.X_OK | (os.W_OK if action in ("clear", "prune") else 0)
    if not os.access(root, need):
        raise BadInput(f"{named} cannot be {'changed' if need & os.W_OK else 'read'} by this user.",
                       "Run as its owner, or name another folder.")
    return True


def main(argv: list[str], prog: str = "sd-accel cache") -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=argparse.SUPPRESS,
                        help="cache folder (default: SD_ACCEL_CACHE, else ~/.cache/sd-accel)")
    p = Parser(prog=prog, parents=[common],
               description="The engine cache: built engines, their keys, sizes and last use.")
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("ls", parents=[common], help="list the entries, most recently used first")
    i = sub.add_parser("info", parents=[common], help="one entry's files, checksums and key parts")
    i.add_argument("key", help="the key or a unique prefix of it (as `ls` shows)")
    sub.add_parser("clear", parents=[common], help="remove every entry not in use")
    pr = sub.add_parser("prune", parents=[common],
                        help="remove incomplete or corrupt entries and leftovers, then enforce the size cap")
    pr.add_argument("--no-verify", action="store_true", help="check sizes only, not checksums (faster)")
    args = p.parse_args(argv)
    root, source = _root(args)
    try:
        if not _check_root(root, source, args.action):
            print(f"cache: {root} does not exist yet: nothing has been built, so there is nothing to "
                  f"{'list' if args.action == 'ls' else 'remove'}.")
            return 0
        cache = EngineCache(root)
        if args.action == "ls":
            return _ls(cache)
        if args.action == "info":
            return _info(cache, args.key)
        if args.action == "clear":
            return _clear(cache)
        return _prune(cache, verify=not args.no_verify)
    except BadInput as e:  # the user's input: say what is wrong and what to do, as every command does
        print(f"sd-accel: {e}", file=sys.stderr)
        return 2
