"""The kernels' errors. Each names the problem and what to do about it; sd-accel's engine raises the same classes
(accel/errors.py), so one except clause catches a bad input whether a kernel or the engine found it."""

from __future__ import annotations


class Error(Exception):
    """A problem the caller can act on. `fix` says what to do."""

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} {fix}".strip())


class BadInput(Error):
    pass


class Unavailable(Error):
    """The kernel cannot run here (no Triton, or a device Triton does not drive)."""
