"""Affinity that fits the server (issue 13, item 4): the queue learns what a switch costs.

A session that reports usage after another session reported on the same queue has come back
after a switch: the share of its previous prompt the server served from its cache (``reused`` /
the previous prompt's tokens) says whether the server kept its context meanwhile.  The mean of
the last ``KEPT_SAMPLES`` such returns decides: at least ``KEPT_CHEAP``, switches are ``cheap``
(a large host cache, a slot per agent); below it, ``dear``; before any return, ``unknown``.  A
queue's ``switchCost`` setting (``cheap``, ``dear``) says it instead of learning (``auto``).

Pinned through the pure core, the socket (the usage reply's ``switchCost``, ``status``'s
``affinity``, the log's ``kept``, the report's line), ``Client`` (a subagent session hands over
at once at the end of each request while someone waits, where switches are cheap, and keeps
its tool-gap window where they are dear or unknown), the proxy's hold rule, and the KV-cache
simulator (the effect on prefilled tokens and on the time a waiter stands behind a tool call).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Dict, Iterator, List

import pytest

import llmqueue as lq
from tests.harness import ROOT, DaemonProc, short_tmpdir, started, wait_for
from tests.kvsim import KVSim
from tests.test_handover import client_of, grant_after, log_lines

sys.path.insert(0, os.path.join(ROOT, "bench"))
import agents  # noqa: E402

K = "http://127.0.0.1:8001/v1"
SOON = 1.0  # "at once", on a loaded machine


def usage(session: str, prefilled: int, reused: int, key: str = K) -> Dict[str, Any]:
    return {"op": "usage", "queueKey": key, "sessionKey": session, "prefilled": prefilled, "reused": reused}


# -- the pure core ------------------------------------------------------------------------------


def test_cheap_takes_the_latest_returns_all_kept_and_one_eviction_among_them_is_dear() -> None:
    assert lq.switch_cost([]) == "unknown"
    assert lq.switch_cost([1.0]) == "unknown"  # one return is not yet a pattern
    assert lq.switch_cost([0.0]) == "dear"  # but one eviction is a cost already paid
    assert lq.switch_cost([1.0, 0.9, 0.8]) == "cheap"
    assert lq.switch_cost([1.0, 1.0, 1.0, 0.7]) == "dear"  # the mean (0.93) does not hide it
    # only the latest KEPT_SAMPLES count: a server whose cache grew is learned again
    assert lq.switch_cost([0.0] * 10 + [1.0] * lq.KEPT_SAMPLES) == "cheap"
    assert lq.switch_cost([0.0] + [1.0] * (lq.KEPT_SAMPLES - 1)) == "dear"  # still among the latest
    assert lq.switch_cost([1.0] * 10 + [0.0] * lq.KEPT_SAMPLES) == "dear"
    assert lq.switch_cost([1.0], "dear") == "dear" and lq.switch_cost([0.0], "cheap") == "cheap"
    assert lq.switch_cost([], "cheap") == "cheap"


def test_a_return_after_another_sessions_report_is_sampled_and_a_report_in_a_row_is_not() -> None:
    s = lq.Scheduler()
    first = s.usage(K, "A", 1000, 0)
    assert first.kept is None and first.switch_cost == "unknown"
    again = s.usage(K, "A", 50, 1000)  # no switch in between: says nothing about switches
    assert again.kept is None and again.switch_cost == "unknown"
    assert s.usage(K, "B", 800, 0).kept is None  # a new session: nothing to keep
    back = s.usage(K, "A", 60, 1050)  # A's previous prompt was 1,050 tokens: all of it kept
    assert back.kept == 1.0 and back.switch_cost == "unknown"  # one return
    again = s.usage(K, "B", 20, 800)  # B's 800, kept too
    assert again.kept == 1.0 and again.switch_cost == "cheap"
    evicted = s.usage(K, "A", 1200, 4)  # A's 1,110 were evicted meanwhile
    assert evicted.kept == pytest.approx(4 / 1110) and evicted.switch_cost == "dear"
    # Queues learn apart: another endpoint's sessions tell nothing about this one.
    assert s.usage("http://127.0.0.1:8002/v1", "C", 10, 0).switch_cost == "unknown"


def test_cheap_takes_two_sessions_back_to_their_contexts_one_coming_back_twice_is_not_enough() -> None:
    # One session that keeps coming back after a single other shows only that the server keeps
    # two contexts: a third agent in the rotation may still be evicted.
    assert lq.switch_cost([1.0, 1.0], "auto", ["A", "A"]) == "unknown"
    assert lq.switch_cost([1.0, 1.0], "auto", ["A", "B"]) == "cheap"
    assert lq.switch_cost([1.0, 0.0], "auto", ["A", "A"]) == "dear"  # an eviction is enough
    s = lq.Scheduler()
    s.usage(K, "A", 1000, 0)
    s.usage(K, "B", 1000, 0)
    assert s.usage(K, "A", 10, 1000).kept == 1.0  # A back after B
    s.usage(K, "C", 1000, 0)
    back = s.usage(K, "A", 10, 1010)  # A back after C: two returns, one session
    assert back.kept == 1.0 and back.switch_cost == "unknown"
    assert s.affinity_kept() == {K: [1.0]}  # a later daemon does not know yet either
    assert s.usage(K, "B", 10, 1000).switch_cost == "cheap"  # B back too
    assert s.affinity_kept() == {K: [1.0, 1.0, 1.0]}
    log = os.path.join(short_tmpdir(), "events.log")  # the report reads the same rule off a log
    with open(log, "w") as f:
        for i, who in enumerate("AAB"):
            f.write(json.dumps({"event": "usage", "queueKey": K, "sessionKey": who, "prefilled": 10,
                                "reused": 1000, "kept": 1.0, "ts": f"2026-12-01T00:00:0{i}.000Z"}) + "\n")
    events = lq.read_event_log([log])
    assert lq.build_report(events[:2])["queues"][K]["tokens"]["returns"]["switchCost"] == "unknown"
    assert lq.build_report(events)["queues"][K]["tokens"]["returns"]["switchCost"] == "cheap"


def test_a_queues_setting_wins_over_what_it_learned() -> None:
    config, errors, _ = lq.validate_config({"queues": {K: {"switchCost": "dear"}}})
    assert errors == []
    s = lq.Scheduler(lq.Addressing(config))
    s.usage(K, "A", 1000, 0)
    s.usage(K, "B", 1000, 0)
    assert s.usage(K, "A", 10, 1000).switch_cost == "dear"


def test_a_bad_switch_cost_is_a_config_error_named_by_its_path() -> None:
    _, errors, _ = lq.validate_config({"defaults": {"switchCost": "free"}})
    assert errors == ['defaults.switchCost must be one of auto, cheap, dear (got "free")']


# -- the wire -------------------------------------------------------------------------------------


def test_the_usage_reply_status_and_log_say_what_a_switch_costs() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        p = d.peer()
        assert "affinity" not in d.queue(K) if d.status() else True  # additive: absent until a report
        assert p.ask(usage("A", 1000, 0))["switchCost"] == "unknown"
        assert p.ask(usage("B", 1000, 0))["switchCost"] == "unknown"
        assert p.ask(usage("A", 20, 1000)) == {"op": "ok", "queueKey": K, "sessionKey": "A", "switchCost": "unknown"}
        assert p.ask(usage("B", 20, 1000))["switchCost"] == "cheap"  # two returns, both kept
        assert p.ask({"op": "acquire", "queueKey": K, "sessionKey": "B"})["op"] == "granted"
        assert d.queue(K)["affinity"] == {"switchCost": "cheap", "returns": 2, "kept": 1.0}
        assert p.ask(usage("A", 1020, 0))["switchCost"] == "dear"  # A's 1,020 all gone
        # and the server keeps one context: A's own went after one other (additive: once one went)
        assert d.queue(K)["affinity"] == {"switchCost": "dear", "returns": 3, "kept": 0.667, "contexts": 1}
        lines = wait_for(lambda: [e for e in log_lines(log) if e["event"] == "usage"][4:] or None)
        kept = [e.get("kept") for e in log_lines(log) if e["event"] == "usage"]
        assert kept == [None, None, 1.0, 1.0, 0.0] and lines
        # each return's depth: how many other sessions reported since its own last report
        assert [e.get("depth") for e in log_lines(log) if e["event"] == "usage"] == [None, None, 1, 1, 1]
        report = lq.build_report(lq.read_event_log([log]))
        assert report["queues"][K]["tokens"]["returns"] == {"requests": 3, "meanKept": 0.667, "switchCost": "dear"}
        assert "back after a switch: 3 requests found 67% of their context kept: switches are dear" in \
            lq.format_report(report)


def test_a_configured_switch_cost_shows_in_status_before_any_report() -> None:
    for d in started(config={"queues": {K: {"switchCost": "cheap"}}}):
        p = d.peer()
        assert p.ask({"op": "acquire", "queueKey": K, "sessionKey": "A"})["op"] == "granted"
        assert d.queue(K)["affinity"] == {"switchCost": "cheap", "returns": 0, "kept": None}
        assert p.ask(usage("A", 5, 0))["switchCost"] == "cheap"


# -- Client sessions --------------------------------------------------------------------------------


def teach(client: lq.Client, kept: bool, key: str = K) -> None:
    """Two other sessions take turns: the second of A's reports finds its context kept or not."""
    client.status()  # connected (usage is never sent without a connection: it never blocks)
    client.usage(key, "teach-A", 1000, 0)
    client.usage(key, "teach-B", 1000, 0)
    # kept: only what came since is prefilled; evicted: all of it again (a prompt only grows)
    client.usage(key, "teach-A", *((10, 1000) if kept else (1010, 0)))
    client.usage(key, "teach-B", *((10, 1000) if kept else (1010, 0)))
    want = "cheap" if kept else "dear"
    wait_for(lambda: client.switch_cost(key) == want)


def hand_over_delay(d: DaemonProc, client: lq.Client) -> float:
    """A subagent session makes a request while another waits: the seconds from the request's
    end to the waiter's grant, the session staying in its run (a tool call) meanwhile."""
    s = client.session(K, "sub1", "child", grace_ms=4000)
    with s.run():
        with s.request():
            other = grant_after(client, "sub2", "child")
            wait_for(lambda: d.waiting(K) == ["sub2"])
        ended = time.monotonic()
        other.join(6.0)
        waited = time.monotonic() - ended
        assert not other.is_alive()
        other.lease.release()
    return waited


def test_where_switches_are_cheap_a_subagent_hands_over_at_the_end_of_each_request() -> None:
    for d in started():
        with client_of(d) as client:
            teach(client, kept=True)
            assert hand_over_delay(d, client) < SOON  # not the 4 s grace a first gap would keep


def test_where_switches_are_dear_it_keeps_its_slot_across_the_tool_call() -> None:
    for d in started():
        with client_of(d) as client:
            teach(client, kept=False)
            assert hand_over_delay(d, client) > 3.0  # before its first gap: the whole 4 s grace


def test_a_subagent_in_its_gap_hands_over_as_soon_as_the_queue_learns_that_switches_are_cheap() -> None:
    # The usage reply that says so comes after the gap began (a report of another session, or
    # the session's own, sent after its request): its window no longer keeps the waiter waiting.
    for d in started():
        with client_of(d) as client:
            teach(client, kept=False)  # an eviction: dear, and nobody gives way to find out
            s = client.session(K, "sub1", "child", grace_ms=4000)
            with s.run():
                with s.request():
                    other = grant_after(client, "sub2", "child")
                    wait_for(lambda: d.waiting(K) == ["sub2"])
                time.sleep(0.3)
                assert other.is_alive()  # its first gap: the whole 4 s grace, where switches are dear
                for name in ("teach-A", "teach-B", "teach-A"):  # returns that found their context kept...
                    client.usage(K, name, 10, 1000)
                wait_for(lambda: d.queue(K)["affinity"]["returns"] == 5)
                assert client.switch_cost(K) == "dear" and other.is_alive()
                client.usage(K, "teach-B", 10, 1000)  # ...the fourth in a row: cheap
                told = time.monotonic()
                other.join(SOON + 0.5)
                assert not other.is_alive() and time.monotonic() - told < SOON
                other.lease.release()


def test_a_client_knows_nothing_before_a_report() -> None:
    c = lq.Client(short_tmpdir(), autostart=False)
    try:
        assert c.switch_cost(K) == "unknown"
    finally:
        c.close()


# -- the proxy --------------------------------------------------------------------------------------


def test_the_proxy_hands_over_after_a_tool_call_where_switches_are_cheap_but_a_named_parent_keeps_its_rule(
) -> None:
    for d in started():
        with client_of(d) as client:
            proxy = lq.Proxy("http://127.0.0.1:9", client=client, listen=("127.0.0.1", 0), grace_ms=3000)
            threading.Thread(target=proxy.serve_forever, args=(0.02,), daemon=True).start()
            try:
                sub = proxy.begin("sub", "child")
                proxy.end("sub", ok=True, ending="length")
                parent = proxy.begin("main", "parent", interactive=True)
                proxy.end("main", ok=True, ending="length")
                assert proxy.hold_window(sub, "tool") == 3.0  # unknown: kept through the grace
                teach(client, kept=True, key=proxy.queue_key)
                assert proxy.hold_window(sub, "tool") == 0.0
                assert proxy.hold_window(sub, None) == 0.0
                assert proxy.hold_window(parent, "tool") == 3.0  # the person's session keeps its rule
                assert proxy.hold_window(parent, None) is None
            finally:
                proxy.shutdown()


def test_a_proxy_session_holding_after_a_response_hands_over_once_the_queue_learns_switches_are_cheap() -> None:
    for d in started():
        with client_of(d) as client:
            proxy = lq.Proxy("http://127.0.0.1:9", client=client, listen=("127.0.0.1", 0), grace_ms=4000)
            threading.Thread(target=proxy.serve_forever, args=(0.02,), daemon=True).start()
            try:
                # dear so far (an unknown cost would give the slot to W at once, to find out)
                teach(client, kept=False, key=proxy.queue_key)
                proxy.begin("sub", "child")
                w = d.peer()
                w.send({"op": "acquire", "queueKey": proxy.queue_key, "sessionKey": "W", "role": "child"})
                wait_for(lambda: d.waiting(proxy.queue_key) == ["W"])
                proxy.end("sub", ok=True, ending="tool")  # a tool call: held through the grace
                assert w.silent(0.3)
                for _ in range(2):  # four returns in a row that found their contexts kept: cheap
                    client.usage(proxy.queue_key, "teach-A", 10, 1000)
                    client.usage(proxy.queue_key, "teach-B", 10, 1000)
                wait_for(lambda: client.switch_cost(proxy.queue_key) == "cheap")
                told = time.monotonic()
                assert w.recv(SOON)["op"] == "granted" and time.monotonic() - told < SOON
            finally:
                proxy.shutdown()


# -- what it buys, in the KV-cache simulator ---------------------------------------------------------


def subagents_take_turns(sim: KVSim, d: DaemonProc, kept_before: bool, tool_s: float = 0.4) -> Dict[str, float]:
    """Two subagents, each a run of 3 requests with ``tool_s`` tool calls between them, at once;
    before them the queue learns from another pair of sessions.  The simulator's prefill, and how
    long the slot was held while the other waited and nothing streamed (from the daemon's log)."""
    with client_of(d) as client:
        access = agents.ClientAccess(sim.url, client)
        work = agents.Workload(system_tokens=300, task_tokens=20, reply_tokens=8, tool_tokens=60, tool_s=tool_s,
                               children=2, child_requests=3, parent_before=0)
        # the lesson: two throwaway conversations through the same server and queue
        lock = threading.Lock()
        lesson: List[agents.Record] = []
        teachers = [agents.Agent(f"t{i}", "child", work, "teach", 0, lesson, lock) for i in range(2)]
        for agent in teachers + teachers:
            agent.requests(access, 1)
        want = "cheap" if kept_before else "dear"
        wait_for(lambda: client.switch_cost(access.queue_key) == want, timeout=10)
        before = sim.totals()["prompt_n"]
        result: List[agents.Record] = []
        runners = [agents.Agent(f"s{i}", "child", work, "run", 0, result, lock) for i in range(2)]

        def job(agent: agents.Agent) -> None:
            agent.requests(access, work.child_requests)

        threads = [threading.Thread(target=job, args=(a,)) for a in runners]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(r.ok for r in result) and len(result) == 6
    with open(d.config_path) as f:
        log = json.load(f)["defaults"]["logFile"]
    events = wait_for(lambda: os.path.exists(log) and lq.read_event_log([log]))
    dead, _ = agents.dead_time(events, result)
    oracle = agents.figures(agents.RunResult(result, 0.0, 0.0, 0.0), None)["oracle"]
    return {"prefill": sim.totals()["prompt_n"] - before, "oracle": oracle, "dead": dead}


@pytest.fixture
def logged() -> Iterator[DaemonProc]:
    log = os.path.join(short_tmpdir(), "events.log")
    yield from started(config={"defaults": {"logFile": log}})


def test_sim_where_the_server_keeps_every_context_subagents_take_turns_at_tool_calls_for_free(
        logged: DaemonProc) -> None:
    sim = KVSim(slots=1, slot_ctx=4096, host_cache_tokens=20000, prefill_ms=0.05, decode_ms=0.3)
    try:
        got = subagents_take_turns(sim, logged, kept_before=True)
    finally:
        sim.close()
    assert got["prefill"] <= 1.1 * got["oracle"], got  # every switch restored from the host cache
    # Nobody stood behind a tool call: 4 tool calls of 0.4 s, one each side, would be 0.8 s or more.
    assert got["dead"] < 0.4, got


def test_sim_where_it_keeps_none_subagents_hold_their_slot_across_tool_calls(logged: DaemonProc) -> None:
    # a server slow enough that a context's re-prefill (0.4 s) costs more than a run's tool calls
    # idle the slot (two of 0.1 s): where it costs less, the cost rule's bound hands a gap over
    sim = KVSim(slots=1, slot_ctx=4096, host_cache_tokens=0, prefill_ms=1.0, decode_ms=0.3)
    try:
        got = subagents_take_turns(sim, logged, kept_before=False, tool_s=0.1)
    finally:
        sim.close()
    assert got["prefill"] <= 1.1 * got["oracle"], got  # no context prefilled twice
