"""A parent's spare stream (issue 13, the interactive target): a parent that asks while subagents
hold every slot streams beside them at once, on a server that runs more than one request at a time.

The rule (``parentStreams``, per queue, default 1): beyond its ``maxStreams``, a queue has that many
spare streams, for parents only, and only for an ``acquire`` that says ``spare: true`` (additive: a
client that never sends it gets the seed's behaviour, a parent waiting for a slot).  A parent takes
one only when subagents hold every slot and no parent waits ahead of it.  Children never do, and a parent
on a spare stream never keeps a child out of a slot of ``maxStreams``.  A spare stream's holder
yields (parked, idle) only to a parent that can take it.  ``status`` shows ``parentStreams`` and
marks the holder ``spare``; the log's grant line says ``spare: true``.

The client side: a ``Session`` of a parent asks for one unless its SlotStore knows the server
has one slot (where it would buy nothing, and a concurrent request would cross the slot files).
Through the proxy on a simulated two-slot llama-server, the parent's request streams while a
subagent's does; on a one-slot one, it does not.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from hypothesis import given, settings
from hypothesis import strategies as st

import llmqueue as lq
from tests.harness import ROOT, short_tmpdir, started, wait_for
from tests.kvsim import KVSim

sys.path.insert(0, os.path.join(ROOT, "bench"))
import agents  # noqa: E402

K = "http://127.0.0.1:8001/v1"
SOON = 1.0
T0 = 1000.0


def acquire(session: str, role: str = "parent", spare: Optional[bool] = True) -> Dict[str, Any]:
    msg: Dict[str, Any] = {"op": "acquire", "queueKey": K, "sessionKey": session, "role": role, "activity": True}
    if spare is not None:
        msg["spare"] = spare
    return msg


def log_lines(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def sched(**defaults: Any) -> lq.Scheduler:
    cfg, errors, _ = lq.validate_config({"defaults": defaults})
    assert not errors, errors
    return lq.Scheduler(lq.Addressing(cfg))


def names(events: List[lq.Event]) -> List[str]:
    return [e.holder.session for e in events if isinstance(e, lq.Granted)]


# -- the wire ---------------------------------------------------------------------------------------


def test_a_parent_asking_for_a_spare_stream_is_granted_beside_a_child_and_status_and_log_say_so() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        c, p = d.peer(), d.peer()
        assert c.ask(acquire("C", "child"))["op"] == "granted"
        reply = p.ask(acquire("P"))
        assert reply["op"] == "granted" and reply["sessionKey"] == "P" and reply["spare"] is True
        assert "spare" not in c.ask(acquire("C", "child"))  # a re-grant of a slot of maxStreams
        q = d.queue(K)
        assert q["maxStreams"] == 1 and q["parentStreams"] == 1
        assert q["holders"] == [{"sessionKey": "C", "role": "child", "group": None},
                                {"sessionKey": "P", "role": "parent", "group": None, "spare": True}]
        shown = lq.format_status(d.status())
        assert f"{K}  1/1 +1 spare" in shown and "holds  P parent (spare stream)" in shown
        grants = wait_for(lambda: [e for e in log_lines(log) if e["event"] == "grant"][1:])
        assert grants[0]["sessionKey"] == "P" and grants[0]["spare"] is True
        first = [e for e in log_lines(log) if e["event"] == "grant"][0]
        assert "spare" not in first  # C's slot is one of maxStreams


def test_a_parent_that_does_not_ask_for_one_waits_as_the_spec_says() -> None:
    for d in started():
        c, p, p2 = d.peer(), d.peer(), d.peer()
        assert c.ask(acquire("C", "child"))["op"] == "granted"
        p.send(acquire("P", spare=None))
        p2.send(acquire("P2", spare=False))
        assert p.silent(0.3) and p2.silent(0.05)
        assert d.waiting(K) == ["P", "P2"]
        c.ask({"op": "release", "queueKey": K, "sessionKey": "C"})
        assert p.recv(SOON)["op"] == "granted"


def test_a_parent_waits_for_another_parent_as_the_spec_says() -> None:
    for d in started():
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        b.send(acquire("B"))
        assert b.silent(0.3)  # spare streams are for waiting on subagents only
        assert d.waiting(K) == ["B"]


def test_a_child_never_takes_a_spare_stream() -> None:
    for d in started():
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A", "child"))["op"] == "granted"
        b.send(acquire("B", "child", spare=True))
        assert b.silent(0.3)
        assert d.waiting(K) == ["B"]


def test_only_parent_streams_spare_streams_and_a_freed_one_goes_to_the_next_parent() -> None:
    for d in started():
        c, p1, p2 = d.peer(), d.peer(), d.peer()
        assert c.ask(acquire("C", "child"))["op"] == "granted"
        assert p1.ask(acquire("P1"))["op"] == "granted"
        p2.send(acquire("P2"))
        assert p2.silent(0.3)
        assert d.waiting(K) == ["P2"]
        p1.ask({"op": "release", "queueKey": K, "sessionKey": "P1"})
        assert p2.recv(SOON)["op"] == "granted"
        assert [h.get("spare", False) for h in d.queue(K)["holders"]] == [False, True]


def test_parent_streams_zero_turns_it_off() -> None:
    for d in started(config={"defaults": {"parentStreams": 0}}):
        c, p = d.peer(), d.peer()
        assert c.ask(acquire("C", "child"))["op"] == "granted"
        p.send(acquire("P"))
        assert p.silent(0.3)
        assert d.waiting(K) == ["P"] and d.queue(K)["parentStreams"] == 0


def test_a_parent_on_a_spare_stream_never_keeps_a_child_out_of_a_slot() -> None:
    for d in started():
        c1, p, c2 = d.peer(), d.peer(), d.peer()
        assert c1.ask(acquire("C1", "child"))["op"] == "granted"
        assert p.ask(acquire("P"))["op"] == "granted"
        c2.send(acquire("C2", "child"))
        assert c2.silent(0.3)
        c1.ask({"op": "release", "queueKey": K, "sessionKey": "C1"})
        assert c2.recv(SOON)["op"] == "granted"  # P's spare stream is not one of maxStreams
        assert sorted(d.holders(K)) == ["C2", "P"]


def test_a_parked_spare_holder_yields_only_to_a_parent_that_can_take_the_stream() -> None:
    for d in started():
        c1, p, c2, p2 = d.peer(), d.peer(), d.peer(), d.peer()
        assert c1.ask(acquire("C1", "child"))["op"] == "granted"
        assert p.ask(acquire("P"))["op"] == "granted"
        c2.send(acquire("C2", "child"))
        wait_for(lambda: d.waiting(K) == ["C2"])
        park = {"op": "renew", "queueKey": K, "sessionKey": "P", "parked": True}
        assert p.ask(park)["granted"] is True  # its stream is of no use to C2: it keeps it
        assert sorted(d.holders(K)) == ["C1", "P"] and d.queue(K)["parkYields"] == 0
        p2.send(acquire("P2"))
        assert p2.recv(SOON)["op"] == "granted"  # a parent that can take it: it goes at once
        assert p.ask({"op": "renew", "queueKey": K, "sessionKey": "P"})["granted"] is False  # it learns
        assert d.waiting(K) == ["C2"] and d.queue(K)["parkYields"] == 1


def test_a_parent_that_asks_for_a_spare_stream_waits_behind_a_parent_queued_ahead() -> None:
    for d in started():
        c, old, new = d.peer(), d.peer(), d.peer()
        assert c.ask(acquire("C", "child"))["op"] == "granted"
        old.send(acquire("OLD", spare=None))  # an old client: it waits for a slot
        wait_for(lambda: d.waiting(K) == ["OLD"])
        new.send(acquire("NEW"))
        assert new.silent(0.3)  # FIFO within the tier
        c.ask({"op": "release", "queueKey": K, "sessionKey": "C"})
        assert old.recv(SOON)["op"] == "granted"
        assert new.silent(0.3)  # and a parent holds now: it waits for it, as the spec says
        assert d.waiting(K) == ["NEW"]


def test_over_the_socket_a_cancel_or_a_re_tier_ahead_hands_the_spare_stream_to_the_next_parent() -> None:
    for d in started():
        c, old, new = d.peer(), d.peer(), d.peer()
        assert c.ask(acquire("C", "child"))["op"] == "granted"
        old.send(acquire("OLD", spare=None))
        wait_for(lambda: d.waiting(K) == ["OLD"])
        new.send(acquire("NEW"))
        assert new.silent(0.3)
        old.send({"op": "role", "sessionKey": "OLD", "role": "child"})
        assert new.recv(SOON)["spare"] is True  # OLD is a child now: NEW heads the parents
        new.ask({"op": "release", "queueKey": K, "sessionKey": "NEW"})
        new.send(acquire("NEW2"))  # OLD (a child) waits too, but cannot take the stream
        assert new.recv(SOON)["spare"] is True
        p3 = d.peer()
        p3.send(acquire("P3", spare=None))
        wait_for(lambda: d.waiting(K) == ["OLD", "P3"])
        p4 = d.peer()
        p4.send(acquire("P4"))
        assert p4.silent(0.3)
        new.ask({"op": "release", "queueKey": K, "sessionKey": "NEW2"})
        assert p4.silent(0.3)  # P3, an old client, heads the parents
        p3.send({"op": "cancel", "queueKey": K, "sessionKey": "P3"})
        assert p4.recv(SOON)["spare"] is True


def test_a_bad_spare_field_is_an_error_reply_that_changes_nothing() -> None:
    for d in started():
        c, p = d.peer(), d.peer()
        assert c.ask(acquire("C", "child"))["op"] == "granted"
        bad = dict(acquire("P"), spare="yes")
        assert p.ask(bad) == {"op": "error", "reason": "spare must be true or false (got \"yes\")",
                              "request": "acquire", "queueKey": K, "sessionKey": "P"}
        assert d.holders(K) == ["C"] and d.waiting(K) == []
        assert p.ask(acquire("P"))["op"] == "granted"  # the connection still works


def test_lowering_parent_streams_on_reload_keeps_the_holder_and_logs_over_capacity() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        c, p = d.peer(), d.peer()
        assert c.ask(acquire("C", "child"))["op"] == "granted"
        assert p.ask(acquire("P"))["op"] == "granted"
        d.write_config({"defaults": {"logFile": log, "parentStreams": 0}})
        lines = wait_for(lambda: [e for e in log_lines(log) if e.get("reason") == "over-capacity"], timeout=10)
        assert lines[0]["holders"] == 2 and lines[0]["maxStreams"] == 1
        assert sorted(d.holders(K)) == ["C", "P"]  # nobody loses a slot
        p.ask({"op": "release", "queueKey": K, "sessionKey": "P"})
        p2 = d.peer()
        p2.send(acquire("P2"))
        assert p2.silent(0.3)  # no spare stream any more


def test_parent_streams_is_validated() -> None:
    _, errors, _ = lq.validate_config({"defaults": {"parentStreams": -1}, "queues": {K: {"parentStreams": "2"}}})
    assert any("defaults.parentStreams" in e for e in errors)
    assert any(f"queues.{K}.parentStreams" in e for e in errors)
    cfg, errors, _ = lq.validate_config({"queues": {K: {"parentStreams": 2}}})
    assert not errors
    assert lq.Addressing(cfg).address_endpoint(K)[1].parent_streams == 2
    assert lq.Addressing(lq.Config()).address_endpoint(K)[1].parent_streams == 1


# -- the core ---------------------------------------------------------------------------------------


def test_an_idle_spare_holder_costs_no_dead_time_to_a_child_that_could_not_use_it() -> None:
    s = sched()  # the core's clock is in milliseconds
    s.acquire("c", K, "C1", "child", now=T0)
    s.acquire("p", K, "P", "parent", now=T0, spare=True)
    s.beat(K, "P", now=T0, busy=False)
    s.acquire("c2", K, "C2", "child", now=T0 + 1000)
    s.beat(K, "P", now=T0 + 5000, busy=True)
    assert s.status()[0]["deadMs"] == 0
    s.beat(K, "C1", now=T0 + 5000, busy=False)
    s.beat(K, "C1", now=T0 + 7000, busy=True)
    assert s.status()[0]["deadMs"] == 2000  # C1's slot was C2's to use


def test_an_idle_spare_holder_is_not_idle_yielded_to_a_child() -> None:
    s = sched(idleYieldMs=1000)
    s.acquire("c", K, "C1", "child", now=T0, activity=True)
    s.acquire("p", K, "P", "parent", now=T0, activity=True, spare=True)
    s.acquire("c2", K, "C2", "child", now=T0, activity=True)
    s.beat(K, "C1", now=T0 + 1500)  # C1 is active
    events = s.sweep(now=T0 + 2000)
    assert names(events) == [] and sorted(h.session for h in s.holders(K)) == ["C1", "P"]
    s.acquire("p2", K, "P2", "parent", now=T0 + 2000, activity=True, spare=True)
    events = s.sweep(now=T0 + 2100)
    assert names(events) == ["P2"]  # now the idle spare stream goes to a parent that can use it
    assert [e.reason for e in events if isinstance(e, lq.Released)] == ["idle"]


def test_a_re_tier_that_makes_a_spare_asker_the_head_parent_grants_it() -> None:
    s = sched()
    s.acquire("a", K, "A", "child", now=T0)
    s.acquire("b", K, "B", "parent", now=T0 + 1)  # an old client, waiting for a slot
    s.acquire("c", K, "C", "parent", now=T0 + 2, spare=True)  # behind B
    assert [w.session for w in s.waiters(K)] == ["B", "C"]
    assert names(s.set_role("B", "child", now=T0 + 3)) == ["C"]


def test_a_cancel_that_makes_a_spare_asker_the_head_parent_grants_it() -> None:
    s = sched()
    s.acquire("c", K, "C", "child", now=T0)
    s.acquire("o", K, "OLD", "parent", now=T0 + 1)  # an old client, ahead
    s.acquire("n", K, "NEW", "parent", now=T0 + 2, spare=True)
    assert names(s.cancel(K, "OLD", now=T0 + 3)) == ["NEW"]
    assert [h.spare for h in s.holders(K)] == [False, True]


def test_a_parked_spare_holder_yields_to_a_parent_a_re_tier_puts_at_the_head() -> None:
    s = sched()
    s.acquire("c", K, "C", "child", now=T0)
    s.acquire("p", K, "P1", "parent", now=T0, spare=True)
    s.park(K, "P1", now=T0 + 1)
    s.acquire("o", K, "OLD", "parent", now=T0 + 2)  # cannot take a spare stream: P1 keeps it
    s.acquire("n", K, "NEW", "parent", now=T0 + 3, spare=True)
    assert sorted(h.session for h in s.holders(K)) == ["C", "P1"]
    events = s.set_role("OLD", "child", now=T0 + 4)
    assert names(events) == ["NEW"] and [e.reason for e in events if isinstance(e, lq.Released)] == ["parked"]


def test_an_idle_spare_holder_yields_to_a_parent_a_re_tier_puts_at_the_head() -> None:
    s = sched(idleYieldMs=1000)
    s.acquire("c", K, "C", "child", now=T0, activity=True)
    s.acquire("p", K, "P1", "parent", now=T0, activity=True, spare=True)
    s.acquire("o", K, "OLD", "parent", now=T0 + 1)
    s.acquire("n", K, "NEW", "parent", now=T0 + 2, spare=True)
    s.beat(K, "C", now=T0 + 1500)
    assert names(s.sweep(now=T0 + 1500)) == []  # P1 is idle, but OLD heads the parents
    s.set_role("OLD", "child", now=T0 + 1600)
    assert s.next_deadline() is not None and s.next_deadline() <= T0 + 1600  # looked at again at once
    assert names(s.sweep(now=T0 + 1600)) == ["NEW"]


def test_a_spare_holders_idle_time_is_not_dead_while_the_waiting_parent_could_not_take_its_stream() -> None:
    s = sched()
    s.acquire("c", K, "C", "child", now=T0)
    s.acquire("p1", K, "P1", "parent", now=T0, spare=True)  # on the spare stream
    s.release(K, "C", now=T0 + 1)
    s.acquire("p2", K, "P2", "parent", now=T0 + 2)  # a slot of maxStreams: a parent holds it now
    s.beat(K, "P1", now=T0 + 10, busy=False)
    s.acquire("p3", K, "P3", "parent", now=T0 + 1000, spare=True)  # waits: a parent holds a slot
    s.beat(K, "P1", now=T0 + 6000, busy=True)
    assert s.status()[0]["deadMs"] == 0
    assert names(s.release(K, "P1", now=T0 + 6001)) == []  # indeed nobody could have used it


SESSIONS = ["s0", "s1", "s2", "s3", "s4"]
spare_ops = st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(SESSIONS), st.sampled_from(lq.ROLES), st.booleans()),
    st.tuples(st.just("release"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("cancel"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("park"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("beat"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("role"), st.sampled_from(SESSIONS), st.sampled_from(lq.ROLES)),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 2), st.integers(0, 2), st.lists(spare_ops, max_size=50))
def test_property_spare_streams_are_parents_only_bounded_and_never_idle_while_a_parent_could_use_one(
        max_streams: int, parent_streams: int, ops: List[Any]) -> None:
    """Whatever the sequence: slots of maxStreams never exceed it, spare streams never exceed
    parentStreams and are held by parents that asked for one, no waiter is lost, no waiter waits
    beside a free slot, and no parent that asked for a spare stream heads the parents' queue while
    one is free."""
    s = sched(maxStreams=max_streams, parentStreams=parent_streams, agingAfterSlots=0, agingAfterMs=0)
    asked: Dict[str, bool] = {}
    pending: set[str] = set()
    now = T0
    for op in ops:
        now += 1000
        if op[0] == "acquire":
            _, session, role, spare = op
            held = any(h.session == session for h in s.holders(K))
            events = s.acquire(session, K, session, role, now=now, spare=spare)
            if not held and session not in pending:
                asked[session] = spare
                pending.add(session)
        elif op[0] == "release":
            events = s.release(K, op[1], now=now)
        elif op[0] == "cancel":
            events = s.cancel(K, op[1], now=now)
            pending.discard(op[1])
        elif op[0] == "park":
            events = s.park(K, op[1], now=now)[1]
        elif op[0] == "beat":
            s.beat(K, op[1], now=now)
            events = []
        else:
            events = s.set_role(op[1], op[2], now=now)
        for e in events:
            if isinstance(e, lq.Granted) and e.new:
                pending.discard(e.holder.session)
                if e.holder.spare:
                    assert e.holder.role == lq.PARENT and asked[e.holder.session]
        hs = s.holders(K)
        regular = [h for h in hs if not h.spare]
        spares = [h for h in hs if h.spare]
        assert len(regular) <= max_streams and len(spares) <= parent_streams
        ws = s.waiters(K)
        assert {w.session for w in ws} == pending
        assert not (ws and len(regular) < max_streams)
        head = min((w for w in ws if w.role == lq.PARENT), key=lambda w: w.seq, default=None)
        children_hold = all(h.role == lq.CHILD for h in regular)
        assert not (head is not None and head.spare and len(spares) < parent_streams and children_hold)
        q = s._find(K)  # None until the queue was first asked for
        assert not (q is not None and ws and any(h.parked and q.frees_for_waiter(h) for h in hs))


# -- the client and the proxy -----------------------------------------------------------------------


def test_a_parent_session_streams_beside_a_subagent_session() -> None:
    for d in started():
        client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
        try:
            child = client.session(K, "C", "child")
            parent = client.session(K, "P", "parent")
            with child.run():
                with child.request():
                    t = time.monotonic()
                    with parent.run():
                        with parent.request():
                            assert time.monotonic() - t < SOON
                            assert sorted(d.holders(K)) == ["C", "P"]
            old = client.session(K, "OLD", "parent", spare=False)
            with child.run(), child.request():
                done = threading.Event()

                def ask() -> None:
                    with old.run(), old.request():
                        done.set()
                threading.Thread(target=ask, daemon=True).start()
                assert not done.wait(0.3)  # spare=False: it waits for the subagent
                assert d.waiting(K) == ["OLD"]
            assert done.wait(10)
        finally:
            client.close()


def _parent_beside_a_streaming_child(sim: KVSim, d: Any) -> tuple[float, bool]:
    """Through the proxy: a subagent's long request, and a parent's while it streams.  (The
    parent's time to its first token, whether the daemon ever had it wait.)"""
    client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
    proxy = lq.Proxy(sim.base, client=client, listen=("127.0.0.1", 0), identity=())
    threading.Thread(target=proxy.serve_forever, args=(0.02,), daemon=True).start()
    waited: List[bool] = []
    try:
        child = threading.Thread(target=agents.stream_chat, args=(
            proxy.url + "/s/c/child/v1", [{"role": "user", "content": " ".join(["c"] * 100)}], 150))
        child.start()
        wait_for(lambda: sim.max_overlap() == 1 and d.holders(proxy.queue_key) == ["c"])
        watch = threading.Event()

        def look() -> None:
            while not watch.is_set():
                waited.append(d.waiting(proxy.queue_key) == ["p"])
                time.sleep(0.02)
        threading.Thread(target=look, daemon=True).start()
        start = agents.now()
        reply = agents.stream_chat(proxy.url + "/s/p/parent/v1", [{"role": "user", "content": "p p p"}], 2)
        watch.set()
        child.join(30)
        assert reply.ok
        return reply.first - start if reply.first is not None else float("inf"), any(waited)
    finally:
        proxy.shutdown()
        client.close()


def test_through_the_proxy_a_parent_streams_beside_a_subagent_on_a_two_slot_server() -> None:
    with KVSim(slots=2, decode_ms=10.0) as sim:
        for d in started():
            ttft, waited = _parent_beside_a_streaming_child(sim, d)
            assert sim.max_overlap() == 2 and not waited
            assert ttft < 1.0  # the child's request streams for 1.5 s: it did not wait for it


def test_through_the_proxy_a_parent_waits_for_the_subagent_on_a_one_slot_server() -> None:
    for files in (False, True):
        with KVSim(slots=1, decode_ms=10.0, slot_files=files) as sim:
            for d in started():
                _, waited = _parent_beside_a_streaming_child(sim, d)
                assert sim.max_overlap() == 1 and waited, files  # the slot files never cross


def test_a_client_session_asks_for_a_spare_stream_unless_its_slot_store_knows_one_slot() -> None:
    with KVSim(slots=1, slot_files=True) as one, KVSim(slots=2) as two:
        for d in started():
            client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
            try:
                c = client.session(K, "C", "child")
                with c.run(), c.request():
                    for store, spare in ((lq.SlotStore(one.base), False), (lq.SlotStore(two.base), True),
                                         (None, True)):
                        p = client.session(K, "P", "parent", slots=store)
                        done = threading.Event()

                        def ask() -> None:
                            with p.run(), p.request():
                                done.set()
                            p.close()
                        threading.Thread(target=ask, daemon=True).start()
                        assert done.wait(SOON * 3) is spare, store
                        if not spare:
                            assert d.waiting(K) == ["P"]
                            c.lease.release()  # type: ignore[union-attr]
                            assert done.wait(10)
                            c.start()
            finally:
                client.close()


def test_a_server_whose_props_do_not_say_is_asked_once_and_taken_to_run_several(stub: Any) -> None:
    store = lq.SlotStore(stub.base)
    assert [store.total_slots() for _ in range(3)] == [None, None, None]
    assert [r["path"] for r in stub.records] == ["/props"]  # it answered: never asked again
    gone = lq.SlotStore("http://127.0.0.1:9")
    t = time.monotonic()
    assert gone.total_slots() is None and time.monotonic() - t < 5.0
    with KVSim(slots=4) as sim:
        assert lq.SlotStore(sim.base).total_slots() == 4


def test_a_server_busy_or_locked_is_asked_again_later(monkeypatch: Any) -> None:
    import http.server

    answers = [503, 401, 200]
    seen: List[str] = []

    class Props(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            seen.append(self.path)
            status = answers.pop(0)
            body = json.dumps({"total_slots": 1} if status == 200 else {"error": "loading"}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Props)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(lq, "SLOT_RETRY_S", 0.0)
        store = lq.SlotStore(f"http://127.0.0.1:{server.server_address[1]}")
        assert [store.total_slots() for _ in range(3)] == [None, None, 1]  # loading, locked, then it says
        assert store.total_slots() == 1 and seen == ["/props"] * 3
    finally:
        server.shutdown()
        server.server_close()



def test_a_parent_re_tiered_to_child_ages_from_its_re_tier_not_from_the_parents_it_queued_among() -> None:
    """Behind the proxy with nothing named, every agent is a parent until a person speaks; the
    others then go behind the person as children.  One that waited as a parent while three
    parents ahead of it were granted had not waited behind parents as a child: it must not count
    as aged by slots and go before the person (it did, in the benchmark's interactive
    proxy-anon runs: the person's second turn waited a whole subagent request)."""
    s = sched(agingAfterSlots=3, agingAfterMs=0)
    s.acquire("h", K, "H", "parent", now=T0)
    for i, who in enumerate(("A1", "A2", "A3", "B")):
        s.acquire(who.lower(), K, who, "parent", now=T0 + 1 + i)
    for i, who in enumerate(("H", "A1", "A2")):  # A1, A2, A3 granted while B waits, a parent
        assert names(s.release(K, who, now=T0 + 10 + i)) == [f"A{i + 1}"]
    s.set_role("B", "child", now=T0 + 20)  # a person spoke: B is background now
    s.acquire("p", K, "P", "parent", now=T0 + 21)
    assert names(s.release(K, "A3", now=T0 + 30)) == ["P"]
    for i, who in enumerate(("X", "Y", "Z")):  # as a child it ages as any child does
        s.acquire(who.lower(), K, who, "parent", now=T0 + 31 + i)
    assert names(s.release(K, "P", now=T0 + 40)) == ["X"]
    assert names(s.release(K, "X", now=T0 + 41)) == ["Y"]
    assert names(s.release(K, "Y", now=T0 + 42)) == ["B"]  # three parents (P, X, Y) went ahead of it


def test_over_the_socket_a_waiter_re_tiered_to_child_does_not_go_before_the_person_as_aged() -> None:
    """The same through the socket, with the ``role`` op the proxy sends when a person speaks."""
    for d in started(config={"defaults": {"agingAfterSlots": 3, "agingAfterMs": 0}}):
        h, a1, a2, a3, b, p = (d.peer() for _ in range(6))
        assert h.ask({"op": "acquire", "queueKey": K, "sessionKey": "H", "role": "parent"})["op"] == "granted"
        for peer, who in ((a1, "A1"), (a2, "A2"), (a3, "A3"), (b, "B")):
            peer.send({"op": "acquire", "queueKey": K, "sessionKey": who, "role": "parent"})
            wait_for(lambda: who in d.waiting(K))
        for peer, who, nxt in ((h, "H", a1), (a1, "A1", a2), (a2, "A2", a3)):
            peer.ask({"op": "release", "queueKey": K, "sessionKey": who})
            assert nxt.recv(SOON)["op"] == "granted"
        b.send({"op": "role", "sessionKey": "B", "role": "child"})
        wait_for(lambda: d.queue(K)["waiting"] == [{"sessionKey": "B", "role": "child", "group": None}])
        p.send({"op": "acquire", "queueKey": K, "sessionKey": "P", "role": "parent"})
        wait_for(lambda: sorted(d.waiting(K)) == ["B", "P"])
        a3.ask({"op": "release", "queueKey": K, "sessionKey": "A3"})
        assert p.recv(SOON)["op"] == "granted" and b.silent(0.2)


def test_a_waiter_re_tiered_to_child_ahead_of_a_waiting_child_takes_over_its_aging_count() -> None:
    """A re-tier must not reset the child tier's slot aging: W, re-tiered to child, queued before
    C, so it heads the children; three parents went while C waited, so the children's head goes
    next -- W, and C's count starts again after it, as for any child granted (found by review:
    W's fresh count made C wait nine parents instead of six)."""
    s = sched(agingAfterSlots=3, agingAfterMs=0)
    s.acquire("h", K, "H", "parent", now=T0)
    for i, who in enumerate(("P1", "P2", "P3", "W")):
        s.acquire(who.lower(), K, who, "parent", now=T0 + 1 + i)
    s.acquire("c", K, "C", "child", now=T0 + 6)
    for i in range(4, 10):
        s.acquire(f"p{i}", K, f"P{i}", "parent", now=T0 + 7 + i)
    order, holder = [], "H"
    for step in range(8):
        if step == 3:
            s.set_role("W", "child", now=T0 + 30)
        (holder,) = names(s.release(K, holder, now=T0 + 31 + step))
        order.append(holder)
    assert order == ["P1", "P2", "P3", "W", "P4", "P5", "P6", "C"]
