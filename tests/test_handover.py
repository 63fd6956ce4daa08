"""Handing the slot over without waiting (issue 13, first part): a parked holder, and a settled
subagent, give their slot to a waiter at once.

Through a real socket: a keyed ``renew`` with ``parked: true`` hands the holder's slot to a queued
waiter at once (long before the idle-yield window), or to the first waiter to come while it stays
parked; a parked holder nobody needs keeps its slot; an activity beat un-parks it; its reply says
``granted: false`` once the slot is gone; the yield is logged as a ``release`` with reason
``parked`` and counted as ``parkYields`` in ``status``; a bad ``parked`` is an error reply that
changes nothing.  A client that never sends ``parked`` keeps the seed's behaviour (the idle-yield
suites in test_leases.py).

Through ``Client``: ``session.blocking()`` and a blocking tool park the lease (a waiting session is
granted at once, and the parked session queues again at its next request); a parked session that
nobody needed resumes switch-free; a settled subagent hands over at once and keeps its slot
through the grace only while nobody waits; a settled parent with no person behind it keeps its
slot for ``PARENT_HANDBACK_MS`` (a follow-up run starts switch-free), then hands over (a person's
parent hands over at once: test_think).

Handing back: a child holder's keyed beat reply says ``parentWaiting: true`` while a parent
waits; an ``acquire`` with ``resume: true`` queues a child ahead of the other children; a child
``Session`` hands its slot back at a request boundary -- when its request ends, or at its next
request (after at least one request on the grant, never mid-request) -- and is granted again
right after the parent, ahead of another child.  Through the proxy: a subagent session hands back
to a waiting parent at its next request, and a settled parent session hands over after its
handback window, not its grace.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any, Dict, Iterator, List

import llmqueue as lq
from tests.harness import DaemonProc, short_tmpdir, started, wait_for

K = "http://127.0.0.1:8001/v1"
SOON = 1.0  # "at once", on a loaded machine: far below the 30 s idle-yield window


def acquire(session: str, role: str = "parent") -> Dict[str, Any]:
    return {"op": "acquire", "queueKey": K, "sessionKey": session, "role": role, "activity": True}


def park(session: str) -> Dict[str, Any]:
    return {"op": "renew", "queueKey": K, "sessionKey": session, "parked": True}


def beat(session: str) -> Dict[str, Any]:
    return {"op": "renew", "queueKey": K, "sessionKey": session}


def log_lines(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# -- the wire ---------------------------------------------------------------------------------------


def test_a_parked_holder_hands_its_slot_to_a_queued_waiter_at_once() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        b.send(acquire("B", "child"))
        wait_for(lambda: d.waiting(K) == ["B"])
        sent = time.monotonic()
        a.send(park("A"))
        assert b.recv(SOON)["op"] == "granted"
        assert time.monotonic() - sent < SOON
        assert a.recv(SOON) == {"op": "ok", "queueKey": K, "sessionKey": "A", "granted": False}
        q = d.queue(K)
        assert [h["sessionKey"] for h in q["holders"]] == ["B"] and q["parkYields"] == 1 and q["idleYields"] == 0
        assert a.ask(beat("A"))["granted"] is False  # it learns, and queues again
        # The log line is written after the replies: wait for the line itself.
        releases = wait_for(lambda: [e for e in log_lines(log) if e["event"] == "release"])
        assert [(e["sessionKey"], e["reason"]) for e in releases] == [("A", "parked")]


def test_a_parked_holder_nobody_needs_keeps_its_slot_until_a_waiter_comes() -> None:
    for d in started():
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        assert a.ask(park("A")) == {"op": "ok", "queueKey": K, "sessionKey": "A", "granted": True}
        time.sleep(0.3)
        assert d.holders(K) == ["A"] and d.queue(K)["switches"] == 0  # no switch, no re-prefill
        b.send(acquire("B"))
        assert b.recv(SOON)["op"] == "granted"  # arrives while A is parked: granted at once
        assert d.holders(K) == ["B"]


def test_an_activity_beat_unparks_the_holder() -> None:
    for d in started():
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        a.ask(park("A"))
        assert a.ask(beat("A"))["granted"] is True  # work resumed
        b.send(acquire("B"))
        assert b.silent(0.3)
        assert d.holders(K) == ["A"] and d.waiting(K) == ["B"]


def test_a_bad_parked_field_is_an_error_reply_that_changes_nothing() -> None:
    for d in started():
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        b.send(acquire("B"))
        wait_for(lambda: d.waiting(K) == ["B"])
        reply = a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": "yes"})
        assert reply["op"] == "error" and "parked must be true or false" in reply["reason"]
        assert b.silent(0.2)
        assert d.holders(K) == ["A"] and d.waiting(K) == ["B"]
        assert a.ask(park("A"))["granted"] is False  # the connection still works
        assert b.recv(SOON)["op"] == "granted"


# -- through Client ---------------------------------------------------------------------------------


class Asker(threading.Thread):
    """Acquires ``session`` in a thread of its own; the thread ends when it is granted."""

    def __init__(self, client: lq.Client, session: str, role: str = "parent") -> None:
        super().__init__(daemon=True)
        self.client, self.session, self.role = client, session, role
        self.lease: Any = None
        self.start()

    def run(self) -> None:
        try:
            self.lease = self.client.acquire(K, self.session, self.role, timeout=20)
        except lq.LLMQueueError:
            pass  # the test closed the client while this one still waited


def grant_after(client: lq.Client, session: str, role: str = "parent") -> Asker:
    return Asker(client, session, role)


@contextlib.contextmanager
def client_of(d: DaemonProc) -> Iterator[lq.Client]:
    """A Client on the test daemon (never starting one, never failing open), closed afterwards."""
    client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
    try:
        yield client
    finally:
        client.close()


def test_blocking_hands_the_slot_to_a_waiting_session_at_once_and_the_next_request_queues_again() -> None:
    for d in started():  # the default idle-yield window: 30 s
        with client_of(d) as client:
            # spare=False: a parent that comes back while its subagent holds would otherwise
            # stream beside it on a spare stream (test_spare.py); here it queues again
            parent = client.session(K, "parent", "parent", spare=False)
            with parent.run():
                other = grant_after(client, "sub1", "child")
                wait_for(lambda: d.waiting(K) == ["sub1"])
                sent = time.monotonic()
                with parent.tool("subagent"):  # a blocking tool: parked
                    other.join(SOON + 1.0)
                    assert not other.is_alive() and time.monotonic() - sent < SOON
                    assert d.holders(K) == ["sub1"]
                    assert d.queue(K)["parkYields"] == 1
                    releaser = threading.Timer(0.3, lambda: other.lease.release())
                    releaser.start()
                with parent.request(timeout=10) as lease:  # queues again, granted when sub1 lets go
                    assert lease.held and d.holders(K) == ["parent"]


def test_a_parked_session_nobody_needs_resumes_switch_free() -> None:
    for d in started():
        with client_of(d) as client:
            s = client.session(K, "solo", "parent")
            with s.run() as lease:
                with s.blocking():
                    time.sleep(0.3)
                    assert d.holders(K) == ["solo"]
                with s.request():
                    assert lease.held and not lease.lost
            assert d.queue(K)["switches"] == 0 and d.queue(K)["grants"] == 1


def test_a_settled_subagent_hands_over_at_once_and_keeps_its_slot_only_while_nobody_waits() -> None:
    for d in started():
        with client_of(d) as client:
            child = client.session(K, "sub1", "child", grace_ms=3000)
            with child.run():
                pass
            time.sleep(0.3)
            assert d.holders(K) == ["sub1"]  # nobody waits: kept through the grace
            with child.run():  # the next run within the grace: switch-free
                pass
            assert d.queue(K)["grants"] == 1
            sent = time.monotonic()
            other = grant_after(client, "sub2", "child")
            other.join(SOON + 1.0)
            assert not other.is_alive() and time.monotonic() - sent < SOON  # not after the 3 s grace
            assert d.holders(K) == ["sub2"]


def test_a_settled_parent_keeps_its_slot_for_the_handback_window_then_hands_over() -> None:
    """A parent with no person behind it (``background``: an agent a tool or a child's answer
    wakes again); a person's parent parks at once (test_think)."""
    for d in started():
        with client_of(d) as client:
            parent = client.session(K, "main", "parent", grace_ms=5000)
            parent.background = True
            with parent.run():
                pass
            sent = time.monotonic()
            other = grant_after(client, "sub1", "child")
            other.join(5.0)
            waited = time.monotonic() - sent
            assert not other.is_alive()
            window = lq.PARENT_HANDBACK_MS / 1000.0
            assert window * 0.8 <= waited <= window + SOON, f"handed over after {waited:.2f} s"


def test_a_parent_whose_next_run_starts_within_the_window_keeps_its_slot_switch_free() -> None:
    for d in started():
        with client_of(d) as client:
            parent = client.session(K, "main", "parent")
            parent.background = True  # an agent, woken again by a tool or a child's answer
            with parent.run():
                pass
            other = grant_after(client, "sub1", "child")
            wait_for(lambda: d.waiting(K) == ["sub1"])
            with parent.run():  # woken again at once: same grant
                time.sleep(lq.PARENT_HANDBACK_MS / 1000.0 + 0.3)
                assert d.holders(K) == ["main"] and other.is_alive()
            assert d.queue(K)["grants"] == 1


# -- handing back to a waiting parent --------------------------------------------------------------


def test_a_childs_beat_reply_says_a_parent_waits_and_resume_queues_it_ahead_of_other_children() -> None:
    for d in started():
        c, b, p = d.peer(), d.peer(), d.peer()
        assert c.ask(acquire("C", "child"))["op"] == "granted"
        b.send(acquire("B", "child"))
        wait_for(lambda: d.waiting(K) == ["B"])
        assert "parentWaiting" not in c.ask(beat("C"))  # additive: absent while no parent waits
        p.send(acquire("P", "parent"))
        wait_for(lambda: d.waiting(K) == ["B", "P"])
        assert c.ask(beat("C")) == {"op": "ok", "queueKey": K, "sessionKey": "C", "granted": True,
                                    "parentWaiting": True}
        # The hand back: release, then queue again with resume, back to back.
        c.send({"op": "release", "queueKey": K, "sessionKey": "C"})
        c.send({**acquire("C", "child"), "resume": True})
        assert p.recv(SOON)["op"] == "granted"
        assert c.recv(SOON) == {"op": "ok", "queueKey": K, "sessionKey": "C"}
        wait_for(lambda: sorted(d.waiting(K)) == ["B", "C"])
        assert p.ask({"op": "release", "queueKey": K, "sessionKey": "P"}) == {"op": "ok", "queueKey": K, "sessionKey": "P"}
        assert c.recv(SOON)["op"] == "granted"  # ahead of B, which queued first
        assert b.silent(0.1)
        reply = c.ask({**acquire("X"), "resume": 1})
        assert reply["op"] == "error" and "resume must be true or false" in reply["reason"]


def test_a_parent_that_comes_during_a_childs_tool_call_gets_the_slot_at_once_and_the_child_is_next() -> None:
    # Between two requests the child's slot goes to a parent at once (the gap is its request
    # boundary); another child waiting keeps it no less than before (its tool-gap window).
    # dear: sub1 keeps its slot from sub2 by its window (where the cost is unknown, its first gap
    # gives sub2 the slot at once, to find out what a switch costs)
    for d in started(config={"defaults": {"switchCost": "dear"}}):
        with client_of(d) as client:
            child = client.session(K, "sub1", "child", grace_ms=5000)
            with child.run():
                with child.request():
                    pass  # its first request on this grant
                other = grant_after(client, "sub2", "child")
                wait_for(lambda: d.waiting(K) == ["sub2"])
                time.sleep(0.2)
                assert d.holders(K) == ["sub1"]  # a child waiting: kept through the window
                sent = time.monotonic()
                parent = grant_after(client, "main", "parent")
                parent.join(SOON)
                assert not parent.is_alive() and time.monotonic() - sent < SOON  # not after the 5 s grace
                assert d.holders(K) == ["main"] and d.queue(K)["handbackYields"] == 1
                releaser = threading.Timer(0.3, lambda: parent.lease.release())
                releaser.start()
                with child.request(timeout=10) as lease:  # queues again ahead of sub2
                    assert lease.held and d.holders(K) == ["sub1"]
                    assert other.is_alive()


# -- the proxy gets the same policy -----------------------------------------------------------------


class _Proxy:
    def __init__(self, upstream: str, agent_dir: str, grace_ms: int = 3000) -> None:
        self.client = lq.Client(agent_dir, autostart=False, fail_open=False)
        self.proxy = lq.Proxy(upstream, client=self.client, listen=("127.0.0.1", 0), grace_ms=grace_ms)
        self.thread = threading.Thread(target=self.proxy.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def ask(self, session: str, role: str, who: str) -> threading.Thread:
        from tests.test_kvsim import payload, post

        port = self.proxy.server.server_address[1]
        body = payload([{"role": "user", "content": f"{who} hello"}], user=who)
        t = threading.Thread(target=post, args=(port, body, f"/s/{session}/{role}/v1/chat/completions"), daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self.proxy.shutdown()
        self.client.close()


def test_proxy_a_subagent_between_requests_hands_its_slot_to_a_parent_at_once() -> None:
    from tests.kvsim import KVSim
    from tests.test_kvsim import record

    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        # a server slow enough that a switch costs more than the handback window (3 tokens, 0.45 s):
        # where it costs less, the slot goes once its price is spent, whoever waits
        with KVSim(prefill_ms=150, decode_ms=2.0) as sim:
            p = _Proxy(sim.base, d.agent_dir)
            try:
                p.ask("sub", "child", "sub-1").join(10)  # sub holds through its grace now
                wait_for(lambda: d.holders(sim.base) == ["sub"])
                time.sleep(0.2)
                assert d.holders(sim.base) == ["sub"]  # nobody waits: kept, switch-free
                sent = time.monotonic()
                parent = p.ask("main", "parent", "main-1")
                parent.join(10)
                assert time.monotonic() - sent < SOON + 0.5  # at once, not after sub's 3 s grace
                second = p.ask("sub", "child", "sub-2")  # queues again, and streams after
                second.join(10)
                first, after = record(sim, "main-1"), record(sim, "sub-2")
                assert first["end"] <= after["start"], "the parent went first"
                # sub's slot went by its handback, as the parent queued.  (The parent's own, at its
                # request's end with sub waiting, is the bound's to decide: it goes at once where
                # the queue's timed tool call, sub's, outlasts a switch, and that is timing.)
                releases = [e for e in log_lines(log) if e["event"] == "release"]
                assert (releases[0]["sessionKey"], releases[0]["reason"]) == ("sub", "handback")
            finally:
                p.close()


def test_proxy_a_settled_parent_hands_over_after_its_handback_window_not_its_grace() -> None:
    from tests.kvsim import KVSim
    from tests.test_kvsim import record

    for d in started():
        with KVSim(prefill_ms=150, decode_ms=0.5) as sim:  # a switch dearer than the window, as above
            p = _Proxy(sim.base, d.agent_dir, grace_ms=5000)
            try:
                p.ask("main", "parent", "main-1").join(10)
                child = p.ask("sub", "child", "sub-1")
                child.join(10)
                waited = record(sim, "sub-1")["start"] - record(sim, "main-1")["end"]
                window = lq.PARENT_HANDBACK_MS / 1000
                assert window * 0.8 <= waited < window + SOON, f"the child waited {waited:.2f} s"
            finally:
                p.close()


def test_a_child_whose_request_ends_while_a_parent_waits_gives_the_slot_back_before_its_tool_call() -> None:
    for d in started():
        with client_of(d) as client:
            child = client.session(K, "sub1", "child")
            with child.run():
                with child.request():
                    parent = grant_after(client, "main", "parent")  # arrives mid-request
                    wait_for(lambda: d.waiting(K) == ["main"])
                    time.sleep(0.2)
                    assert d.holders(K) == ["sub1"]  # never taken mid-request
                ended = time.monotonic()
                parent.join(SOON)  # at the request's end, not after the tool call below
                assert not parent.is_alive() and time.monotonic() - ended < SOON
                assert d.holders(K) == ["main"]
                other = grant_after(client, "sub2", "child")
                wait_for(lambda: sorted(d.waiting(K)) == ["sub2"])
                threading.Timer(0.3, lambda: parent.lease.release()).start()
                with child.request(timeout=10) as lease:  # queues again, ahead of sub2
                    assert lease.held and d.holders(K) == ["sub1"] and other.is_alive()


def test_a_quick_second_run_in_the_grace_still_parks_when_it_settles() -> None:
    # The second run can start and settle before the client's beat thread wakes at all: the
    # run's own beat (``ensure``) un-parked the slot on the daemon, so settling must park it again.
    for d in started():
        with client_of(d) as client:
            child = client.session(K, "sub1", "child", grace_ms=5000)
            with child.run():
                pass
            wait_for(lambda: d.queue(K)["holders"] != [])
            time.sleep(0.3)  # the first settle's parked beat has gone out
            cv = client._cv
            wake = cv.notify_all
            cv.notify_all = lambda: None  # type: ignore[method-assign]  # the beat thread sleeps on
            try:
                with child.run():
                    pass
            finally:
                del cv.notify_all
                with cv:
                    wake()
            sent = time.monotonic()
            other = grant_after(client, "sub2", "child")
            other.join(SOON + 1.0)
            assert not other.is_alive() and time.monotonic() - sent < SOON  # not after the 5 s grace


def test_a_long_tool_call_hands_the_slot_to_a_waiter_after_the_window_not_at_the_runs_end() -> None:
    # Between two requests of a run the slot is kept while nobody waits; while someone does, for
    # the whole grace until a gap is known, then for 1.5x the session's longest recent gap + 0.2 s.
    # dear: sub1 keeps its slot from sub2 by its window (where the cost is unknown, its first gap
    # gives sub2 the slot at once, to find out what a switch costs)
    for d in started(config={"defaults": {"switchCost": "dear"}}):
        with client_of(d) as client:
            s = client.session(K, "sub1", "child", grace_ms=4000)
            with s.run():
                with s.request():
                    pass
                time.sleep(0.3)  # a short tool, nobody waits: kept, and its gap is learned
                assert d.holders(K) == ["sub1"]
                with s.request():
                    pass
                assert d.queue(K)["grants"] == 1  # switch-free
                sent = time.monotonic()
                other = grant_after(client, "sub2", "child")  # comes during a long tool
                other.join(5.0)
                waited = time.monotonic() - sent
                # the window: 1.5 x 0.3 + 0.2 = 0.65 s after the request's end (a loaded machine
                # stretches the gap a little), far below the 4 s grace and the run's end
                assert not other.is_alive() and 0.3 < waited < 2.5
                assert d.holders(K) == ["sub2"]
                other.lease.release()
                with s.request() as lease:  # the tool is done: it queues again, then streams
                    assert lease.held and d.holders(K) == ["sub1"]
            assert d.queue(K)["grants"] == 3


def test_before_its_first_gap_a_session_keeps_the_slot_for_the_grace_while_someone_waits() -> None:
    # dear: sub1 keeps its slot from sub2 by its window (where the cost is unknown, its first gap
    # gives sub2 the slot at once, to find out what a switch costs)
    for d in started(config={"defaults": {"switchCost": "dear"}}):
        with client_of(d) as client:
            s = client.session(K, "sub1", "child", grace_ms=1500)
            with s.run():
                with s.request():
                    pass
                sent = time.monotonic()
                other = grant_after(client, "sub2", "child")
                time.sleep(1.0)
                assert other.is_alive() and d.holders(K) == ["sub1"]  # inside the grace: kept
                other.join(5.0)
                assert not other.is_alive() and time.monotonic() - sent < 1.5 + SOON
                other.lease.release()
