"""CUDA graphs of a call that several processes run together (accel/engine/graphs.py agreeing): every process runs
the call's collectives as many times as the others, whatever its own graphs are. A capture runs the call twice (the
warm-up, then the replay; the capture itself runs nothing), a plain call or a replay once. Here two GraphCaches in one
process, their capture played on the CPU with that same count, each doing the most either chose."""

from __future__ import annotations

import torch

from sd_accel.accel.engine import graphs


class _Replay:
    def __init__(self, run) -> None:
        self.replay = run


class _CpuGraphs(graphs.GraphCache):
    """A GraphCache whose capture runs the warm-up and records a replay that runs fn again, as a graph's does."""

    def _capture(self, tensors, token):
        static = [t.clone() for t in tensors]
        output = torch.empty_like(self.fn(*static))
        self.captures += 1
        return graphs._Entry(_Replay(lambda: output.copy_(self.fn(*static))), static, output, token)


def _process(max_graphs: int = 4):
    runs = []

    def fn(x):
        runs.append(1)  # one run of the call's collectives
        return x * 2

    return _CpuGraphs(fn, max_graphs=max_graphs), runs


def test_every_process_runs_the_collectives_as_often_as_the_others():
    first, first_runs = _process()
    other, other_runs = _process()
    agreed = []

    def step(x, first_token, other_token):
        """One call on both, each doing the most either chose."""
        n0, n1 = len(first_runs), len(other_runs)
        agreed.append(max(first.choice([x], first_token), other.choice([x], other_token)))
        with graphs.agreeing(lambda mine: agreed[-1]):
            a, b = first([x], first_token), other([x], other_token)
        assert torch.equal(a, x * 2) and torch.equal(b, x * 2)
        return len(first_runs) - n0, len(other_runs) - n1

    x, y = torch.ones(3), torch.ones(5)
    assert step(x, "w", "v") == (1, 1)  # a new shape: plainly
    assert step(x, "w", "v") == (2, 2)  # captured
    assert step(x, "w", "v") == (1, 1)  # replayed
    # one process's weights changed (its graph is stale): both capture again, the other's own graph current
    assert step(x, "w2", "v") == (2, 2) and (first.captures, other.captures) == (2, 2)
    assert step(x, "w2", "v2") == (2, 2) and step(x, "w2", "v2") == (1, 1)
    # one process lost its graphs (freed them) and has not seen the shape since: the other replays, it runs plainly
    other.clear()
    other._seen.clear()
    assert step(x, "w2", "v2") == (1, 1) and other.captures == 3
    assert step(x, "w2", "v2") == (2, 2)  # now it has seen it: both capture
    assert agreed == [graphs.EAGER, graphs.CAPTURE, graphs.REPLAY, graphs.CAPTURE, graphs.CAPTURE, graphs.REPLAY,
                      graphs.REPLAY, graphs.CAPTURE]


def test_alone_a_cache_captures_at_the_second_call_and_replays_after():
    cache, runs = _process(max_graphs=1)
    x, y = torch.ones(3), torch.ones(5)
    for _ in range(3):
        assert torch.equal(cache([x], "w"), x * 2)
    assert (len(runs), cache.captures) == (1 + 2 + 1, 1)
    cache([y], "w"), cache([y], "w")  # the second shape takes the one place
    cache([x], "w")
    assert cache.captures == 3 and len(cache) == 1
