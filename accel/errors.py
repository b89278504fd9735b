"""Errors that reach users: each names the problem and what to do about it."""

from __future__ import annotations


class AccelError(Exception):
    """A problem the user can act on. `fix` says what to do."""

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} {fix}".strip())


class UnsupportedModel(AccelError):
    pass


class BadInput(AccelError):
    pass


class BackendUnavailable(AccelError):
    pass
