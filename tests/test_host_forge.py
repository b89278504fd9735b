"""Forge adapter logic that Forge itself exercises only in particular orders (test_forge_server.py runs the rest)."""

from __future__ import annotations

import copy

from sd_accel.accel.hosts.forge import ForgeSession
from sd_accel.accel.hosts.support import EngineSlot


def test_a_forge_clone_of_the_patcher_shares_the_session_and_its_engine():
    """Forge's patcher.clone() deep-copies model_options; an extension that clones after sd-accel (FreeU, PAG) must
    not copy the session, whose engine holds the UNet."""
    session = ForgeSession(EngineSlot(), patcher=None)
    options = {"model_function_wrapper": session.wrapper, "transformer_options": {}}
    cloned = copy.deepcopy(options)
    assert cloned["model_function_wrapper"].__self__ is session
