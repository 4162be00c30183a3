"""The graph-after-uses policy shared by the host batches and the screen's steps (launcher.ReplayedIssue), and the
plan cache that closes what it drops (gpu/buffers.py), with a recording stand-in for CUDA's graphs: no GPU."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from tinyknn.gpu import buffers as buffers_module, launcher, plan


class FakeGraph:
    """A CapturedGraph that records: captured from one call of `issue`, launched, closed."""

    made: list["FakeGraph"] = []

    def __init__(self, stream, issue):
        self.stream, self.launches, self.closed = stream, 0, False
        issue()                         # capture runs the issue once, as stream capture records it
        FakeGraph.made.append(self)

    def launch(self, stream):
        assert stream is self.stream and not self.closed
        self.launches += 1

    def close(self):
        self.closed = True


@pytest.fixture
def graphs(monkeypatch):
    FakeGraph.made = []
    monkeypatch.setattr(launcher, "CapturedGraph", FakeGraph)
    return FakeGraph.made


def test_issued_until_the_second_use_then_replayed(graphs):
    issued = []
    entry, stream = launcher.ReplayedIssue(), object()
    for _ in range(4):
        entry.replay(stream, issued.append)
    assert issued == [stream, stream]           # the first use issues; the second is captured (one issue)
    assert len(graphs) == 1 and graphs[0].launches == 3 and entry.uses == 4
    entry.close()
    assert graphs[0].closed and entry.graph is None
    entry.close()                               # closing twice is harmless


def test_without_graphs_every_use_issues(graphs):
    issued = []
    entry = launcher.ReplayedIssue()
    for _ in range(3):
        entry.replay("stream", issued.append, use_graphs=False)
    assert issued == ["stream"] * 3 and graphs == [] and entry.graph is None


def test_a_captured_graph_is_not_launched_while_graphs_are_off(graphs):
    issued = []
    entry = launcher.ReplayedIssue()
    entry.replay("stream", issued.append)
    entry.replay("stream", issued.append)       # captured
    entry.replay("stream", issued.append, use_graphs=False)
    assert issued == ["stream"] * 3 and graphs[0].launches == 1


def test_a_capture_replays_from_the_next_use(graphs):
    """A rebuilt batch given its graph back (gpu/row_ops.py) replays it at once, without issuing again."""
    issued = []
    entry = launcher.ReplayedIssue()
    entry.capture("stream", issued.append)
    entry.replay("stream", issued.append)
    assert issued == ["stream"] and graphs[0].launches == 1


class PlanCache(buffers_module.Buffers):
    """Buffers' plan cache alone: no buffers, no device."""

    def __init__(self):
        self._plans, self._plan_generation = OrderedDict(), 0


def test_the_plan_cache_closes_what_it_evicts_and_forgets(graphs):
    cache = PlanCache()
    steps = [launcher.ReplayedIssue() for _ in range(3)]
    for number, entry in enumerate(steps):
        entry.replay("stream", lambda stream: None)
        entry.replay("stream", lambda stream: None)
        cache._plans[("screen", number)] = entry
    cache._plans["plain"] = object()            # a plan without graphs: dropped, nothing to close
    cache._evict_plans(2)
    assert list(cache._plans) == [("screen", 2), "plain"]
    assert [graph.closed for graph in graphs] == [True, True, False]
    assert cache._plan_generation == 0          # no host batch was dropped
    cache._forget_plans()
    assert cache._plans == {} and all(graph.closed for graph in graphs)


def test_dropping_a_host_batch_moves_the_plan_generation(graphs):
    cache = PlanCache()
    batch = plan.HostBatch.__new__(plan.HostBatch)   # the policy's state only: its launches are not needed here
    cache._plans["batch"] = batch
    cache._plans["later"] = object()
    cache._evict_plans(1)
    assert cache._plan_generation == 1 and list(cache._plans) == ["later"]
