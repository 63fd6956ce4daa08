"""The tracer bullet: real client processes against a stub OpenAI-compatible endpoint.

A stub HTTP server on 127.0.0.1 (random port) streams chat completions slowly and records the
start and end of every request.  Real processes -- agents using ``llmqueue.Session`` and commands
under ``llmqueue run`` -- queue on one ``maxStreams: 1`` endpoint.  Pinned: requests never overlap
at the endpoint; queued parents are served ahead of queued children; a client killed with SIGKILL
mid-stream gives its slot back (its socket closes) well within its TTL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest

from tests.harness import MODULE, DaemonProc, started, wait_for
from tests.stub import StubEndpoint

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e_agent.py")


@pytest.fixture
def stub() -> Iterator[StubEndpoint]:
    s = StubEndpoint()
    yield s
    s.close()


def agent(d: DaemonProc, stub: StubEndpoint, session: str, role: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, AGENT, "session", d.agent_dir, stub.url, session, role, stub.url])


def runner(d: DaemonProc, stub: StubEndpoint, session: str, role: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, MODULE, "run", "--agent-dir", d.agent_dir, "--queue", stub.url,
                             "--session", session, "--role", role, "--",
                             sys.executable, AGENT, "plain", stub.url, session])


def test_real_processes_never_overlap_parents_go_first_and_a_killed_client_frees_its_slot(
        stub: StubEndpoint) -> None:
    config = {"defaults": {"maxStreams": 1, "leaseTtlMs": 1000, "agingAfterSlots": 0, "agingAfterMs": 0}}
    for d in started(config=config):
        procs: dict[str, subprocess.Popen[bytes]] = {}
        # Phase 1: a parent streams; two children then two parents queue behind it.
        procs["slow-H"] = agent(d, stub, "slow-H", "parent")
        wait_for(lambda: stub.started("slow-H"), timeout=20)
        for name, role, make in (("C1", "child", agent), ("C2", "child", runner),
                                 ("P1", "parent", runner), ("P2", "parent", agent)):
            procs[name] = make(d, stub, name, role)
            wait_for(lambda: name in d.waiting(stub.url), timeout=20)
        stub.let_slow_finish()
        for name in ("slow-H", "C1", "C2", "P1", "P2"):
            assert procs[name].wait(60) == 0, name
        order = [r["who"] for r in sorted(stub.records, key=lambda r: r["start"])]
        assert order == ["slow-H", "P1", "P2", "C1", "C2"]

        # Phase 2: a holder is killed mid-stream; the waiter behind it gets the slot at once.
        stub.slow_done.clear()
        procs["slow-K"] = agent(d, stub, "slow-K", "parent")
        wait_for(lambda: stub.started("slow-K"), timeout=20)
        procs["W"] = agent(d, stub, "W", "child")
        wait_for(lambda: "W" in d.waiting(stub.url), timeout=20)
        procs["slow-K"].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        procs["slow-K"].wait(10)
        assert procs["W"].wait(60) == 0
        w = [r for r in stub.records if r["who"] == "W"][0]
        assert w["start"] - killed_at < 1.0  # within its TTL (in fact at once: its socket closed)

        # Zero overlap at the endpoint; the killed stream counts as ended when it was killed.
        spans = []
        for r in stub.records:
            end = killed_at if r["who"] == "slow-K" else r["end"]
            spans.append((r["start"], end, r["who"]))
        spans.sort()
        for (s1, e1, a), (s2, e2, b) in zip(spans, spans[1:]):
            assert e1 <= s2, f"{a} streamed until {e1:.3f} but {b} started at {s2:.3f}"
        q = d.queue(stub.url)
        assert q["holders"] == [] and q["waiting"] == []
