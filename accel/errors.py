"""Errors that reach users: each names the problem and what to do about it.

The base classes are the kernels' own (kernels/ depends on nothing of ours), so a kernel's bad-input error is the
engine's BadInput too.
"""

from __future__ import annotations

from ..kernels.errors import BadInput
from ..kernels.errors import Error as AccelError
from ..kernels.errors import Unavailable as BackendUnavailable

__all__ = ["AccelError", "BackendUnavailable", "BadInput", "UnsupportedModel", "is_interrupt"]


class UnsupportedModel(AccelError):
    pass


def is_interrupt(e: BaseException) -> bool:
    """A host's 'stop' (ComfyUI's InterruptProcessingException, A1111's interrupt) must pass through."""
    return "Interrupt" in type(e).__name__
