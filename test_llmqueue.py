"""The core of llmqueue, pinned in memory, and the wire protocol, pinned through a real socket.

In memory (no sockets, no sleeps; ``now`` is a plain number that starts at a large odd offset,
so code that reads the real clock by mistake is caught): the scheduler's tiers, FIFO, aging,
fifo policy, switch counting, duplicate acquires, cancel, role, disconnect, passthrough, and a
hypothesis property test over random operation sequences.  ``parse_request`` on bad input.

Through a real daemon process on a temporary agent dir: every op of the protocol table with its
exact reply shape, the error replies (the connection stays usable), reply matching (replies echo
the key the client sent), framing (the 100 KB line cap, a character split across writes), and ten
clients hammering one ``maxStreams: 1`` queue without ever overlapping.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Iterator, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llmqueue as lq
from tests.harness import QUEUE_KEY, DaemonProc, Peer, started, wait_for

T0 = 7_777_777.0  # "now" starts far from zero: a stray real clock read would be obvious
K = "http://gpu:8001/v1"


def make(config: Optional[dict[str, Any]] = None, catalog: Optional[dict[str, str]] = None) -> lq.Scheduler:
    cfg = lq.Config()
    if config is not None:
        cfg, errors, _ = lq.validate_config(config)
        assert not errors, errors
    return lq.Scheduler(lq.Addressing(cfg, catalog))


def one(config_defaults: dict[str, Any]) -> lq.Scheduler:
    return make({"defaults": config_defaults})


def granted(events: list[lq.Event]) -> list[str]:
    return [e.holder.session for e in events if isinstance(e, lq.Granted)]


def holders(s: lq.Scheduler, key: str = K) -> list[str]:
    return [l.session for l in s.holders(key)]


def waiters(s: lq.Scheduler, key: str = K) -> list[str]:
    return [w.session for w in s.waiters(key)]


def fill(s: lq.Scheduler, sessions: list[tuple[str, str]], now: float = T0, key: str = K) -> None:
    for i, (session, role) in enumerate(sessions):
        s.acquire(session, key, session, role, now=now + i)


def drain(s: lq.Scheduler, now: float, key: str = K) -> list[str]:
    """Release holders one by one and return the order in which waiters were granted."""
    order = []
    while True:
        hs = holders(s, key)
        if not hs:
            return order
        events = s.release(key, hs[0], now=now)
        order += granted(events)
        now += 1


# -- the scheduler: grants, tiers, FIFO --------------------------------------------------------


def test_direct_grant_into_a_free_slot_is_a_grant_not_a_switch() -> None:
    s = make()
    events = s.acquire("c1", K, "A", "parent", now=T0)
    assert len(events) == 1 and isinstance(events[0], lq.Granted)
    g = events[0]
    assert g.new and not g.switch and g.targets == (("c1", K),) and g.holder.seq == 1
    assert s.status()[0]["switches"] == 0


def test_a_full_queue_parks_the_acquire_and_grants_it_on_release_as_a_switch() -> None:
    s = make()
    s.acquire("c1", K, "A", now=T0)
    events = s.acquire("c2", K, "B", now=T0 + 1)
    assert [type(e) for e in events] == [lq.Queued]
    events = s.release(K, "A", now=T0 + 2)
    assert [type(e) for e in events] == [lq.Released, lq.Granted]
    g = events[1]
    assert isinstance(g, lq.Granted) and g.switch and g.holder.session == "B" and g.holder.seq == 2
    assert s.status()[0]["switches"] == 1


def test_parents_are_granted_before_children_and_fifo_within_a_tier() -> None:
    s = one({"agingAfterSlots": 0, "agingAfterMs": 0})
    s.acquire("h", K, "H", "parent", now=T0)
    fill(s, [("c1", "child"), ("p1", "parent"), ("c2", "child"), ("p2", "parent")], T0 + 1)
    assert drain(s, T0 + 100) == ["p1", "p2", "c1", "c2"]


def test_max_streams_counts_slots() -> None:
    s = one({"maxStreams": 3})
    fill(s, [(f"s{i}", "parent") for i in range(5)])
    assert holders(s) == ["s0", "s1", "s2"] and waiters(s) == ["s3", "s4"]


def test_a_child_aged_by_time_jumps_the_parents() -> None:
    s = one({"agingAfterMs": 1000, "agingAfterSlots": 0})
    s.acquire("h", K, "H", "parent", now=T0)
    s.acquire("c", K, "C", "child", now=T0 + 1)
    s.acquire("p", K, "P", "parent", now=T0 + 2)
    assert granted(s.release(K, "H", now=T0 + 500)) == ["P"]  # not aged yet: the parent first
    s2 = one({"agingAfterMs": 1000, "agingAfterSlots": 0})
    s2.acquire("h", K, "H", "parent", now=T0)
    s2.acquire("c", K, "C", "child", now=T0 + 1)
    s2.acquire("p", K, "P", "parent", now=T0 + 2)
    assert granted(s2.release(K, "H", now=T0 + 1001)) == ["C"]  # waited agingAfterMs: it jumps


def test_a_child_aged_by_slots_jumps_after_that_many_parents_in_a_row() -> None:
    s = one({"agingAfterSlots": 2, "agingAfterMs": 0})
    s.acquire("h", K, "H", "parent", now=T0)
    s.acquire("c", K, "C", "child", now=T0 + 1)
    fill(s, [(f"p{i}", "parent") for i in range(4)], T0 + 2)
    # Two parents are granted while C waits, then C, then the rest.
    assert drain(s, T0 + 10) == ["p0", "p1", "C", "p2", "p3"]


def test_slot_aging_counts_only_parents_granted_while_the_child_waited() -> None:
    s = one({"agingAfterSlots": 2, "agingAfterMs": 0})
    for i in range(5):  # a streak of direct parent grants with nobody waiting
        s.acquire(f"x{i}", K, f"X{i}", "parent", now=T0 + i)
        s.release(K, f"X{i}", now=T0 + i)
    s.acquire("h", K, "H", "parent", now=T0 + 10)
    s.acquire("c", K, "C", "child", now=T0 + 11)
    s.acquire("p", K, "P", "parent", now=T0 + 12)
    assert granted(s.release(K, "H", now=T0 + 13)) == ["P"]


def test_slot_aging_restarts_after_a_child_is_granted() -> None:
    s = one({"agingAfterSlots": 1, "agingAfterMs": 0})
    s.acquire("h", K, "H", "parent", now=T0)
    fill(s, [("c1", "child"), ("c2", "child"), ("p1", "parent"), ("p2", "parent")], T0 + 1)
    # p1 (C1 has seen 0 parents), then C1 (aged by 1), then p2 (the streak restarted), then C2.
    assert drain(s, T0 + 10) == ["p1", "c1", "p2", "c2"]


def test_fifo_policy_ignores_tiers() -> None:
    s = one({"policy": "fifo"})
    s.acquire("h", K, "H", "parent", now=T0)
    fill(s, [("c1", "child"), ("p1", "parent"), ("c2", "child")], T0 + 1)
    assert drain(s, T0 + 10) == ["c1", "p1", "c2"]


def test_a_holder_that_acquires_again_is_regranted_without_a_second_slot() -> None:
    s = one({"maxStreams": 2})
    s.acquire("c1", K, "A", now=T0)
    events = s.acquire("c1", K, "A", now=T0 + 1)
    assert len(events) == 1 and isinstance(events[0], lq.Granted) and not events[0].new
    assert holders(s) == ["A"]
    assert s.status()[0]["grants"] == 1


def test_a_waiter_that_acquires_again_is_not_queued_twice_and_every_asker_is_answered() -> None:
    s = make()
    s.acquire("c0", K, "H", now=T0)
    s.acquire("c1", K, "A", now=T0 + 1)
    assert s.acquire("c1", K, "A", now=T0 + 2) == []
    assert s.acquire("c2", K + "/", "A", now=T0 + 3) == []  # another connection, same session
    assert waiters(s) == ["A"]
    events = s.release(K, "H", now=T0 + 4)
    g = [e for e in events if isinstance(e, lq.Granted)]
    assert len(g) == 1 and g[0].targets == (("c1", K), ("c2", K + "/"))


def test_release_of_a_session_that_holds_nothing_changes_nothing() -> None:
    s = make()
    s.acquire("c1", K, "A", now=T0)
    s.acquire("c2", K, "B", now=T0)
    assert s.release(K, "B", now=T0 + 1) == []  # B waits; release is for holders
    assert s.release("http://other/v1", "A", now=T0 + 1) == []
    assert holders(s) == ["A"] and waiters(s) == ["B"]


def test_cancel_drops_a_waiter_and_releases_a_holder() -> None:
    s = make()
    s.acquire("c1", K, "A", now=T0)
    s.acquire("c2", K, "B", now=T0)
    s.acquire("c3", K, "C", now=T0)
    events = s.cancel(K, "B", now=T0 + 1)
    assert [(type(e), e.reason) for e in events] == [(lq.Dequeued, "cancel")]  # type: ignore[union-attr]
    assert waiters(s) == ["C"]
    events = s.cancel(K, "A", now=T0 + 2)
    assert isinstance(events[0], lq.Released) and events[0].reason == "cancel"
    assert granted(events) == ["C"]


def test_role_retiers_a_waiter_in_place_and_never_a_holder() -> None:
    s = one({"agingAfterSlots": 0, "agingAfterMs": 0})
    s.acquire("h", K, "H", "child", now=T0)
    fill(s, [("p1", "parent"), ("c1", "child"), ("p2", "parent")], T0 + 1)
    assert s.set_role("c1", "parent", now=T0 + 5) == []
    assert s.set_role("H", "parent", now=T0 + 5) == []
    assert s.holders(K)[0].role == lq.CHILD  # the holder keeps the tier it was granted with
    assert [w.role for w in s.waiters(K)] == [lq.PARENT] * 3
    # The promoted waiter keeps its enqueue order among the parents: p1, c1, p2.
    assert drain(s, T0 + 10) == ["p1", "c1", "p2"]
    s.acquire("h", K, "H", "parent", now=T0 + 20)
    fill(s, [("a", "parent"), ("b", "parent")], T0 + 21)
    s.set_role("a", "child", now=T0 + 30)
    assert drain(s, T0 + 40) == ["b", "a"]


def test_disconnect_drops_the_connections_waiters_before_releasing_its_slots() -> None:
    s = make()
    s.acquire("c1", K, "A", now=T0)
    s.acquire("c1", K, "A2", now=T0 + 1)  # the same connection also waits
    s.acquire("c2", K, "B", now=T0 + 2)
    events = s.disconnect("c1", now=T0 + 3)
    assert [type(e) for e in events] == [lq.Dequeued, lq.Released, lq.Granted]
    assert events[0].reason == events[1].reason == "disconnect"  # type: ignore[union-attr]
    assert granted(events) == ["B"] and waiters(s) == []


def test_a_waiter_whose_connection_is_gone_is_never_granted() -> None:
    """Liveness is checked at grant time: a waiter whose every asker has gone is dropped (a
    dequeue, reason disconnect) and the slot goes to the next waiter."""
    dead = {"c2"}
    s = lq.Scheduler(alive=lambda conn: conn not in dead)
    s.acquire("c1", K, "A", now=T0)
    s.acquire("c2", K, "B", now=T0 + 1)
    s.acquire("c3", K, "C", now=T0 + 2)
    events = s.release(K, "A", now=T0 + 3)
    assert [type(e) for e in events] == [lq.Released, lq.Dequeued, lq.Granted]
    assert events[1].reason == "disconnect" and granted(events) == ["C"]  # type: ignore[union-attr]
    assert s.disconnect("c2", now=T0 + 4) == []  # nothing of it is left to clean up


def test_a_lease_lives_while_any_connection_that_acquired_it_lives() -> None:
    s = make()
    s.acquire("c1", K, "A", now=T0)
    s.acquire("c2", K, "A", now=T0 + 1)
    assert s.disconnect("c1", now=T0 + 2) == []
    assert holders(s) == ["A"]
    assert [type(e) for e in s.disconnect("c2", now=T0 + 3)] == [lq.Released]


def test_passthrough_grants_everyone_at_once() -> None:
    s = make({"queues": {K: {"enabled": False}}})
    fill(s, [(f"s{i}", "child") for i in range(10)])
    assert len(holders(s)) == 10 and waiters(s) == []
    st = s.status()[0]
    assert st["maxStreams"] is None and st["switches"] == 0


def test_status_lists_holders_in_grant_order_and_waiters_in_enqueue_order() -> None:
    s = one({"maxStreams": 2})
    s.acquire("c", K, "A", "child", "g1", now=T0)
    s.acquire("c", K, "B", "parent", now=T0 + 1)
    s.acquire("c", K, "C", "child", "g2", now=T0 + 2)
    s.acquire("c", K, "D", "parent", now=T0 + 3)
    (q,) = s.status()
    assert q["queueKey"] == K and q["maxStreams"] == 2
    assert q["holders"] == [{"sessionKey": "A", "role": "child", "group": "g1"},
                            {"sessionKey": "B", "role": "parent", "group": None}]
    assert q["waiting"] == [{"sessionKey": "C", "role": "child", "group": "g2"},
                            {"sessionKey": "D", "role": "parent", "group": None}]


def test_queues_are_independent() -> None:
    s = make()
    s.acquire("c", K, "A", now=T0)
    events = s.acquire("c", "http://other:9/v1", "A", now=T0)
    assert granted(events) == ["A"]


def test_grant_sequence_numbers_increase_per_queue() -> None:
    s = make()
    seqs = []
    for i in range(5):
        seqs.append(s.acquire("c", K, f"S{i}", now=T0 + i)[0].holder.seq)  # type: ignore[union-attr]
        s.release(K, f"S{i}", now=T0 + i)
    assert seqs == [1, 2, 3, 4, 5]


# -- the scheduler: property test ----------------------------------------------------------------

SESSIONS = ["s0", "s1", "s2", "s3", "s4", "s5"]
CONNS = ["c0", "c1", "c2"]
op_strategy = st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(CONNS), st.sampled_from(SESSIONS), st.sampled_from(lq.ROLES)),
    st.tuples(st.just("release"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("cancel"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("role"), st.sampled_from(SESSIONS), st.sampled_from(lq.ROLES)),
    st.tuples(st.just("disconnect"), st.sampled_from(CONNS)),
    st.tuples(st.just("park"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("beat"), st.sampled_from(SESSIONS)),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3), st.lists(op_strategy, max_size=60))
def test_property_slots_never_exceed_max_and_no_waiter_is_lost_or_duplicated(
        max_streams: int, ops: list[tuple[Any, ...]]) -> None:
    """Whatever the sequence of acquire/release/cancel/role/disconnect/park/beat: holders never
    exceed maxStreams, a full queue's every pending acquire is waiting exactly once, neither a
    free slot nor a parked holder ever coexists with a waiter, and (aging off) grants follow
    tier then FIFO."""
    s = one({"maxStreams": max_streams, "agingAfterSlots": 0, "agingAfterMs": 0})
    pending: dict[str, set[str]] = {}  # session -> connections waiting for its grant
    held: set[str] = set()
    tier: dict[str, str] = {}
    enq: dict[str, int] = {}
    order = 0
    now = T0
    parked: set[str] = set()
    for op in ops:
        now += 1
        if op[0] == "park":
            still, events = s.park(K, op[1], now=now)
            if op[1] in held:
                parked.add(op[1])
            else:
                assert (still, events) == (False, [])
        elif op[0] == "beat":
            assert s.beat(K, op[1], now=now) == (op[1] in held)
            parked.discard(op[1])
            events = []
        elif op[0] == "acquire":
            _, conn, session, role = op
            events = s.acquire(conn, K, session, role, now=now)
            parked.discard(session)  # a holder's own acquire is activity: it un-parks
            if session not in held:
                if session not in pending:
                    order += 1
                    enq[session] = order
                    tier[session] = role
                pending.setdefault(session, set()).add(conn)
        elif op[0] == "release":
            events = s.release(K, op[1], now=now)
        elif op[0] == "cancel":
            events = s.cancel(K, op[1], now=now)
            pending.pop(op[1], None)
        elif op[0] == "role":
            events = s.set_role(op[1], op[2], now=now)
            if op[1] in pending:
                tier[op[1]] = op[2]
        else:
            events = s.disconnect(op[1], now=now)
            for session in list(pending):
                pending[session].discard(op[1])
                if not pending[session]:
                    del pending[session]
        grants = [e for e in events if isinstance(e, lq.Granted) and e.new]
        for e in events:
            if isinstance(e, (lq.Released, lq.Evicted)):
                held.discard(e.holder.session)
                parked.discard(e.holder.session)
                if isinstance(e, lq.Released) and e.reason == "parked":
                    assert e.holder.parked
        for g in grants:
            session = g.holder.session
            if g.switch:  # a waiter granted: it must be the best-placed pending one
                best = min(pending, key=lambda x: (lq.ROLES.index(tier[x]), enq[x]))
                assert session == best, (session, best, pending)
            assert session not in held
            held.add(session)
            pending.pop(session, None)
        hs, ws = holders(s), waiters(s)
        assert len(hs) <= max_streams
        assert set(hs) == held
        assert sorted(ws) == sorted(pending) and len(ws) == len(set(ws))
        assert not (ws and len(hs) < max_streams)
        assert not (ws and parked), (ws, parked)


# -- the scheduler: leases, the sweep, idle yield --------------------------------------------------


def test_a_lapsed_lease_is_evicted_whether_or_not_anyone_waits() -> None:
    s = one({"leaseTtlMs": 1000})
    s.acquire("c", K, "A", now=T0)
    assert s.next_deadline() == T0 + 1000
    assert s.sweep(now=T0 + 999) == []
    events = s.sweep(now=T0 + 1000)
    assert [type(e) for e in events] == [lq.Evicted] and holders(s) == []


def test_eviction_grants_the_next_waiter() -> None:
    s = one({"leaseTtlMs": 1000})
    s.acquire("c", K, "A", now=T0)
    s.acquire("c2", K, "B", now=T0 + 10)
    events = s.sweep(now=T0 + 1000)
    assert [type(e) for e in events] == [lq.Evicted, lq.Granted] and holders(s) == ["B"]


def test_heartbeats_keep_a_lease_alive_past_many_ttls() -> None:
    s = one({"leaseTtlMs": 1000})
    s.acquire("c", K, "A", now=T0)
    s.acquire("c2", K, "B", now=T0)
    for t in range(500, 10_000, 500):
        assert s.renew("c", now=T0 + t) == 1
        assert s.sweep(now=T0 + t) == []
    assert holders(s) == ["A"]


def test_a_bare_renew_refreshes_only_the_connections_own_leases() -> None:
    s = one({"leaseTtlMs": 1000, "maxStreams": 2})
    s.acquire("c1", K, "A", now=T0)
    s.acquire("c2", K, "B", now=T0)
    s.renew("c1", now=T0 + 900)
    assert [e.holder.session for e in s.sweep(now=T0 + 1000)] == ["B"]  # type: ignore[union-attr]


def test_a_keyed_beat_says_whether_the_slot_is_still_held() -> None:
    s = one({"leaseTtlMs": 1000})
    s.acquire("c", K, "A", now=T0)
    assert s.beat(K, "A", now=T0 + 500) is True
    s.sweep(now=T0 + 1500)
    assert s.beat(K, "A", now=T0 + 1600) is False
    assert s.beat(K, "nobody", now=T0) is False


def test_idle_yield_needs_a_flag_a_window_and_a_waiter() -> None:
    s = one({"idleYieldMs": 100, "maxStreams": 1})
    s.acquire("c1", K, "A", activity=True, now=T0)
    assert s.sweep(now=T0 + 500) == []  # a lone holder is never disturbed
    s.renew("c1", now=T0 + 500)  # a bare heartbeat is not activity
    events = s.acquire("c2", K, "B", now=T0 + 600)
    assert [type(e) for e in events] == [lq.Queued]
    events = s.sweep(now=T0 + 600)
    assert [type(e) for e in events] == [lq.Released, lq.Granted]
    assert events[0].reason == "idle"  # type: ignore[union-attr]
    assert s.beat(K, "A", now=T0 + 601) is False  # the yielded client learns on its next beat


def test_an_unflagged_lease_is_never_yielded() -> None:
    s = one({"idleYieldMs": 100})
    s.acquire("c1", K, "A", activity=False, now=T0)
    s.acquire("c2", K, "B", now=T0 + 1)
    for t in range(0, 2000, 100):
        s.renew("c1", now=T0 + t)
        assert s.sweep(now=T0 + t) == []


def test_idle_yield_off_when_the_window_is_zero() -> None:
    s = one({"idleYieldMs": 0})
    s.acquire("c1", K, "A", activity=True, now=T0)
    s.acquire("c2", K, "B", now=T0 + 1)
    s.renew("c1", now=T0 + 20_000)
    assert s.sweep(now=T0 + 25_000) == []


def test_a_keyed_beat_keeps_an_active_holder_from_yielding() -> None:
    s = one({"idleYieldMs": 100})
    s.acquire("c1", K, "A", activity=True, now=T0)
    s.acquire("c2", K, "B", now=T0 + 1)
    for t in range(50, 1000, 50):
        assert s.beat(K, "A", now=T0 + t)
        assert s.sweep(now=T0 + t) == []
    # An idle candidate that speaks again is no longer yieldable.
    s2 = one({"idleYieldMs": 100})
    s2.acquire("c1", K, "A", activity=True, now=T0)
    s2.sweep(now=T0 + 200)  # idle, but nobody waits
    s2.beat(K, "A", now=T0 + 250)
    s2.acquire("c2", K, "B", now=T0 + 260)
    assert s2.sweep(now=T0 + 300) == []
    assert [type(e) for e in s2.sweep(now=T0 + 350)] == [lq.Released, lq.Granted]


# -- the scheduler: parking (a holder waiting on another agent) ---------------------------------


def test_a_parked_holder_hands_its_slot_to_a_queued_waiter_at_once() -> None:
    s = one({"idleYieldMs": 30_000})
    s.acquire("c1", K, "A", activity=True, now=T0)
    s.acquire("c2", K, "B", "child", now=T0 + 1)
    held, events = s.park(K, "A", now=T0 + 2)  # long before the idle window
    assert held is False
    assert [type(e) for e in events] == [lq.Released, lq.Granted]
    assert events[0].reason == "parked"  # type: ignore[union-attr]
    assert events[1].switch and holders(s) == ["B"]  # type: ignore[union-attr]
    assert s.beat(K, "A", now=T0 + 3) is False  # it learns on its next beat, and queues again
    assert s.status()[0]["parkYields"] == 1 and s.status()[0]["idleYields"] == 0


def test_a_parked_holder_nobody_needs_keeps_its_slot_until_a_waiter_comes() -> None:
    s = one({"idleYieldMs": 30_000})
    s.acquire("c1", K, "A", activity=True, now=T0)
    assert s.park(K, "A", now=T0 + 1) == (True, [])  # no switch, no re-prefill
    assert s.sweep(now=T0 + 5000) == []
    events = s.acquire("c2", K, "B", now=T0 + 6000)  # arrives while A is still parked
    assert [type(e) for e in events] == [lq.Queued, lq.Released, lq.Granted]
    assert events[1].reason == "parked" and holders(s) == ["B"]  # type: ignore[union-attr]


def test_an_activity_beat_unparks_and_a_later_waiter_waits() -> None:
    s = one({"idleYieldMs": 30_000})
    s.acquire("c1", K, "A", activity=True, now=T0)
    s.park(K, "A", now=T0 + 1)
    assert s.beat(K, "A", now=T0 + 2) is True  # work resumed
    assert [type(e) for e in s.acquire("c2", K, "B", now=T0 + 3)] == [lq.Queued]
    assert holders(s) == ["A"] and waiters(s) == ["B"]
    assert s.sweep(now=T0 + 29_000) == []  # only the idle window still applies, as before


def test_a_bare_heartbeat_keeps_a_parked_lease_alive_and_parked() -> None:
    s = one({"leaseTtlMs": 1000, "idleYieldMs": 30_000})
    s.acquire("c1", K, "A", activity=True, now=T0)
    s.park(K, "A", now=T0 + 1)
    for t in range(300, 3000, 300):
        s.renew("c1", now=T0 + t)
        assert s.sweep(now=T0 + t) == []
    assert holders(s) == ["A"]
    assert granted(s.acquire("c2", K, "B", now=T0 + 3000)) == ["B"]


def test_parking_a_session_that_holds_nothing_says_not_held() -> None:
    s = one({})
    assert s.park(K, "nobody", now=T0) == (False, [])
    s.acquire("c1", K, "A", now=T0)
    assert s.park("http://elsewhere:1/v1", "A", now=T0) == (False, [])


def test_parked_holders_yield_oldest_parked_first_and_only_into_room() -> None:
    s = one({"maxStreams": 2, "idleYieldMs": 30_000})
    s.acquire("c1", K, "A", activity=True, now=T0)
    s.acquire("c2", K, "B", activity=True, now=T0 + 1)
    s.park(K, "B", now=T0 + 2)
    s.park(K, "A", now=T0 + 3)
    events = s.acquire("c3", K, "W", now=T0 + 4)
    assert [(type(e).__name__, e.holder.session) for e in events[1:]] == [  # type: ignore[union-attr]
        ("Released", "B"), ("Granted", "W")]
    assert holders(s) == ["A", "W"]  # one waiter takes one slot: A stays parked, holding
    # Over capacity after a reload: a yield would grant nobody, so nobody yields.
    cfg, _, _ = lq.validate_config({"defaults": {"maxStreams": 1, "idleYieldMs": 30_000}})
    s.reconfigure(lq.Addressing(cfg), now=T0 + 5)
    s.park(K, "W", now=T0 + 6)
    assert [type(e) for e in s.acquire("c4", K, "X", now=T0 + 7)] == [lq.Queued]
    assert holders(s) == ["A", "W"] and waiters(s) == ["X"]
    events = s.release(K, "A", now=T0 + 8)  # back at capacity, with W still parked: X gets W's slot
    assert [(type(e).__name__, e.holder.session) for e in events] == [  # type: ignore[union-attr]
        ("Released", "A"), ("Released", "W"), ("Granted", "X")]


def test_a_reload_keeps_a_holder_parked() -> None:
    s = one({"idleYieldMs": 30_000})
    s.acquire("c1", K, "A", activity=True, now=T0)
    s.park(K, "A", now=T0 + 1)
    cfg, _, _ = lq.validate_config({"defaults": {"leaseTtlMs": 60_000}})
    s.reconfigure(lq.Addressing(cfg), now=T0 + 2)
    assert granted(s.acquire("c2", K, "B", now=T0 + 3)) == ["B"]


def test_the_sweep_has_no_deadline_without_leases() -> None:
    s = make()
    assert s.next_deadline() is None
    s.acquire("c", K, "A", now=T0)
    s.release(K, "A", now=T0)
    s.sweep(now=T0 + 10**6)
    assert s.next_deadline() is None


# -- the scheduler: reload -----------------------------------------------------------------------


def test_a_shortened_ttl_applies_at_the_next_grant_and_a_lengthened_one_at_once() -> None:
    s = one({"leaseTtlMs": 10_000})
    s.acquire("c", K, "A", now=T0)
    cfg, _, _ = lq.validate_config({"defaults": {"leaseTtlMs": 2000}})
    s.reconfigure(lq.Addressing(cfg), now=T0 + 1)
    s.renew("c", now=T0 + 100)
    assert s.holders(K)[0].terms.ttl_ms == 10_000  # never shortened while held
    assert s.sweep(now=T0 + 100 + 9_999) == []
    s.release(K, "A", now=T0 + 200)
    assert s.acquire("c", K, "B", now=T0 + 300)[0].holder.terms.ttl_ms == 2000  # type: ignore[union-attr]
    cfg, _, _ = lq.validate_config({"defaults": {"leaseTtlMs": 50_000}})
    s.reconfigure(lq.Addressing(cfg), now=T0 + 400)
    assert s.holders(K)[0].terms.ttl_ms == 50_000  # lengthened at once
    assert s.sweep(now=T0 + 300 + 49_999) == []


def test_the_idle_window_is_fixed_at_grant() -> None:
    s = one({"idleYieldMs": 100})
    s.acquire("c1", K, "A", activity=True, now=T0)
    cfg, _, _ = lq.validate_config({"defaults": {"idleYieldMs": 60_000}})
    s.reconfigure(lq.Addressing(cfg), now=T0 + 1)
    s.acquire("c2", K, "B", now=T0 + 2)
    events = s.sweep(now=T0 + 150)
    assert [type(e) for e in events] == [lq.Released, lq.Granted]
    assert events[1].holder.terms.idle_yield_ms == 60_000  # type: ignore[union-attr]


def test_a_widened_queue_grants_its_waiters_at_once() -> None:
    s = make()
    fill(s, [("A", "parent"), ("B", "parent"), ("C", "child")])
    cfg, _, _ = lq.validate_config({"defaults": {"maxStreams": 3}})
    events = s.reconfigure(lq.Addressing(cfg), now=T0 + 10)
    assert granted(events) == ["B", "C"] and holders(s) == ["A", "B", "C"]


def test_merging_two_endpoints_into_a_group_keeps_both_holders_over_capacity() -> None:
    a, b = "http://gpu:8001/v1", "http://gpu:8002/v1"
    s = make()
    s.acquire("c1", a, "A", now=T0)
    s.acquire("c2", b, "B", now=T0 + 1)
    s.acquire("c3", a, "W", now=T0 + 2)
    cfg, errors, _ = lq.validate_config({"queues": {"one-gpu": {"match": [a, b], "maxStreams": 1}}})
    assert not errors
    events = s.reconfigure(lq.Addressing(cfg), now=T0 + 3)
    assert events[-1] == lq.OverCapacity("one-gpu", 2, 1)
    moves = [(e.source, e.queue_key, e.who.session) for e in events if isinstance(e, lq.Moved)]
    assert moves == [(a, "one-gpu", "A"), (b, "one-gpu", "B"), (a, "one-gpu", "W")]  # logged: replays follow
    assert holders(s, "one-gpu") == ["A", "B"] and waiters(s, "one-gpu") == ["W"]
    assert holders(s, a) == ["A", "B"]  # a member key now names the group
    assert granted(s.release(a, "A", now=T0 + 4)) == []  # still at capacity: no grant
    assert granted(s.release(b, "B", now=T0 + 5)) == ["W"]


# -- the wire protocol ----------------------------------------------------------------------------


@pytest.mark.parametrize("line, reason", [
    (b"\xff\xfe", "invalid UTF-8"),
    (b"nope", "invalid JSON"),
    (b"[" * 100_000, "nested too deeply"),
    (b"1" * 5000, "must be a JSON object"),
    (b'{"op":"acquire","queueKey":' + b"7" * 5000 + b"}", "queueKey must be a non-empty string"),
    (b'{"op":"status","x":NaN}', "invalid JSON"),
    (b'[{"op":"status"}]', "must be a JSON object"),
    (b'"status"', "must be a JSON object"),
    (b"{}", "missing op"),
    (b'{"op":null}', "missing op"),
    (b'{"op":"stauts"}', "did you mean status"),
    (b'{"op":1}', "op must be a string"),
    (b'{"op":"frobnicate"}', "unknown op"),
    (b'{"op":"acquire"}', "acquire requires queueKey"),
    (b'{"op":"release","sessionKey":"s"}', "release requires queueKey"),
    (b'{"op":"cancel"}', "cancel requires queueKey"),
    (b'{"op":"acquire","queueKey":5}', "queueKey must be a non-empty string"),
    (b'{"op":"acquire","queueKey":""}', "queueKey must be a non-empty string"),
    (b'{"op":"acquire","queueKey":"k","sessionKey":[]}', "sessionKey must be"),
    (b'{"op":"acquire","queueKey":"k","role":"boss"}', "role must be parent or child"),
    (b'{"op":"acquire","queueKey":"k","group":7}', "group must be"),
    (b'{"op":"acquire","queueKey":"k","activity":"yes"}', "activity must be"),
    (b'{"op":"acquire","queueKey":"k","activity":1}', "activity must be"),
    (b'{"op":"role","sessionKey":"s"}', "role requires role"),
    (b'{"op":"renew","sessionKey":"s"}', "requires queueKey"),
])
def test_parse_request_rejects_bad_input_with_one_error(line: bytes, reason: str) -> None:
    with pytest.raises(lq.ProtocolError, match=reason):
        lq.parse_request(line)


def test_parse_request_ignores_unknown_fields() -> None:
    req = lq.parse_request(b'{"op":"acquire","queueKey":"k","sessionKey":"s","future":{"x":1}}')
    assert req == lq.Request("acquire", "k", "s")
    huge = b'{"op":"status","future":' + b"9" * 10_000 + b"}"  # past Python's int digit limit
    assert lq.parse_request(huge) == lq.Request("status")


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_parse_request_on_any_bytes_returns_a_request_or_raises_protocol_error(data: bytes) -> None:
    try:
        assert isinstance(lq.parse_request(data), lq.Request)
    except lq.ProtocolError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(lq.OPS + ("x",)), st.dictionaries(
    st.sampled_from(["queueKey", "sessionKey", "role", "group", "activity", "other"]), json_values))
def test_parse_request_on_any_json_object_returns_a_request_or_raises_protocol_error(
        op: str, fields: dict[str, Any]) -> None:
    try:
        req = lq.parse_request(json.dumps(dict(fields, op=op)))
    except lq.ProtocolError:
        return
    assert req.op == op
    if op in ("acquire", "release", "cancel"):
        assert isinstance(req.queue_key, str) and req.queue_key


# -- through a real socket ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared() -> Iterator[DaemonProc]:
    """One daemon for the protocol tests; each test uses its own queue keys."""
    yield from started()


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    return f"http://127.0.0.1:8001/{request.node.name}/v1"  # a server's URL in the form status shows


def test_socket_acquire_is_granted_with_the_lease_terms(shared: DaemonProc, key: str) -> None:
    with shared.peer() as p:
        reply = p.ask({"op": "acquire", "queueKey": key, "sessionKey": "A", "role": "parent"})
        assert reply == {"op": "granted", "queueKey": key, "sessionKey": "A",
                         "leaseTtlMs": 30000, "idleYieldMs": 30000, "seq": 1}


def test_socket_a_queued_acquire_stays_unanswered_until_release(shared: DaemonProc, key: str) -> None:
    a, b = shared.peer(), shared.peer()
    assert a.ask({"op": "acquire", "queueKey": key, "sessionKey": "A"})["op"] == "granted"
    b.send({"op": "acquire", "queueKey": key, "sessionKey": "B", "role": "child", "group": "g"})
    assert b.silent()
    assert a.ask({"op": "release", "queueKey": key, "sessionKey": "A"}) == {"op": "ok", "queueKey": key, "sessionKey": "A"}
    assert b.recv()["sessionKey"] == "B"
    assert shared.queue(key)["switches"] == 1


def test_socket_status_reports_queues_holders_and_waiters(shared: DaemonProc, key: str) -> None:
    a, b = shared.peer(), shared.peer()
    a.ask({"op": "acquire", "queueKey": key, "sessionKey": "A", "group": "main"})
    b.send({"op": "acquire", "queueKey": key, "sessionKey": "B", "role": "child"})
    wait_for(lambda: shared.waiting(key) == ["B"])
    reply = a.ask({"op": "status"})
    assert reply["op"] == "status"
    (q,) = [q for q in reply["queues"] if q["queueKey"] == key]
    assert {k: q[k] for k in ("queueKey", "maxStreams", "switches", "holders", "waiting")} == {
        "queueKey": key, "maxStreams": 1, "switches": 0,
        "holders": [{"sessionKey": "A", "role": "parent", "group": "main"}],
        "waiting": [{"sessionKey": "B", "role": "child", "group": None}],
    }


def test_socket_keyless_requests_are_refused_and_hold_nothing(shared: DaemonProc) -> None:
    with shared.peer() as p:
        for op in ("acquire", "release", "cancel"):
            assert p.ask({"op": op, "sessionKey": "s"}) == {"op": "error", "reason": f"{op} requires queueKey",
                                                            "request": op, "sessionKey": "s"}
        assert all(h["sessionKey"] != "s" for q in shared.status() for h in q["holders"])


def test_socket_bad_input_gets_an_error_and_the_connection_stays_usable(shared: DaemonProc, key: str) -> None:
    with shared.peer() as p:
        p.send(b"not json\n[1,2]\n\"str\"\n{\"op\":\"nope\"}\n{\"op\":\"acquire\",\"queueKey\":3}\n\xff\xfe\n")
        for _ in range(6):
            reply = p.recv()
            assert reply["op"] == "error" and reply["reason"]
        assert p.ask({"op": "acquire", "queueKey": key, "sessionKey": "A"})["op"] == "granted"


def test_socket_cancel_and_role_send_no_reply(shared: DaemonProc, key: str) -> None:
    a, b = shared.peer(), shared.peer()
    a.ask({"op": "acquire", "queueKey": key, "sessionKey": "A"})
    b.send({"op": "acquire", "queueKey": key, "sessionKey": "B", "role": "child"})
    b.send({"op": "role", "sessionKey": "B", "role": "parent"})
    assert b.silent()
    wait_for(lambda: shared.queue(key)["waiting"] == [{"sessionKey": "B", "role": "parent", "group": None}])
    b.send({"op": "cancel", "queueKey": key, "sessionKey": "B"})
    assert b.silent()
    wait_for(lambda: shared.waiting(key) == [])
    a.send({"op": "cancel", "queueKey": key, "sessionKey": "A"})  # a granted slot is released
    assert a.silent()
    wait_for(lambda: shared.holders(key) == [])


def test_socket_role_never_retiers_a_holder(shared: DaemonProc, key: str) -> None:
    with shared.peer() as a:
        a.ask({"op": "acquire", "queueKey": key, "sessionKey": "A", "role": "child"})
        a.send({"op": "role", "sessionKey": "A", "role": "parent"})
        assert shared.queue(key)["holders"][0]["role"] == "child"


def test_socket_renew_bare_and_keyed(shared: DaemonProc, key: str) -> None:
    with shared.peer() as p:
        assert p.ask({"op": "renew"}) == {"op": "ok"}
        p.ask({"op": "acquire", "queueKey": key, "sessionKey": "A"})
        assert p.ask({"op": "renew"}) == {"op": "ok"}
        assert p.ask({"op": "renew", "queueKey": key, "sessionKey": "A"}) == {
            "op": "ok", "queueKey": key, "sessionKey": "A", "granted": True}
        p.ask({"op": "release", "queueKey": key, "sessionKey": "A"})
        assert p.ask({"op": "renew", "queueKey": key, "sessionKey": "A"}) == {
            "op": "ok", "queueKey": key, "sessionKey": "A", "granted": False}


def test_socket_disconnect_releases_the_slot_and_drops_queued_requests(shared: DaemonProc, key: str) -> None:
    a, b, c = shared.peer(), shared.peer(), shared.peer()
    a.ask({"op": "acquire", "queueKey": key, "sessionKey": "A"})
    b.send({"op": "acquire", "queueKey": key, "sessionKey": "B"})
    c.send({"op": "acquire", "queueKey": key, "sessionKey": "C"})
    wait_for(lambda: shared.waiting(key) == ["B", "C"])
    b.close()  # a queued client that disconnects is dropped from the queue
    wait_for(lambda: shared.waiting(key) == ["C"])
    a.close()  # a disconnect that held a slot releases it
    assert c.recv()["sessionKey"] == "C"


def test_socket_bye_releases_at_once_though_the_socket_stays_open(shared: DaemonProc, key: str) -> None:
    a, b = shared.peer(), shared.peer()
    a.ask({"op": "acquire", "queueKey": key, "sessionKey": "A"})
    b.send({"op": "acquire", "queueKey": key, "sessionKey": "B"})
    a.send({"op": "bye"})
    assert b.recv()["sessionKey"] == "B"
    assert a.silent()
    assert a.ask({"op": "status"})["op"] == "status"  # still a usable connection


def test_socket_a_duplicate_acquire_is_regranted_without_a_second_slot(shared: DaemonProc, key: str) -> None:
    with shared.peer() as p:
        first = p.ask({"op": "acquire", "queueKey": key, "sessionKey": "A"})
        again = p.ask({"op": "acquire", "queueKey": key, "sessionKey": "A"})
        assert first == again and again["op"] == "granted"
        assert shared.holders(key) == ["A"] and shared.queue(key)["grants"] == 1


def test_socket_a_missing_session_key_is_the_connections_own_session(shared: DaemonProc, key: str) -> None:
    a, b = shared.peer(), shared.peer()
    ga = a.ask({"op": "acquire", "queueKey": key})
    assert ga["op"] == "granted" and ga["sessionKey"]
    b.send({"op": "acquire", "queueKey": key})
    assert b.silent()  # another connection is another session
    assert a.ask({"op": "release", "queueKey": key}) == {"op": "ok", "queueKey": key}  # echoes what it sent
    gb = b.recv()
    assert gb["op"] == "granted" and gb["sessionKey"] != ga["sessionKey"]


def test_socket_replies_echo_the_key_the_client_sent(shared: DaemonProc) -> None:
    base = "http://127.0.0.1:8001/echo"
    with shared.peer() as p:
        for asked in (base + "/", "HTTP://127.0.0.1:8001/echo//"):
            reply = p.ask({"op": "acquire", "queueKey": asked, "sessionKey": "A"})
            assert reply["queueKey"] == asked
        assert shared.holders(base) == ["A"]  # one queue: trailing slashes and case normalised
        assert p.ask({"op": "renew", "queueKey": base + "/", "sessionKey": "A"})["queueKey"] == base + "/"


def test_socket_a_line_of_exactly_the_cap_is_served_and_one_byte_more_disconnects(shared: DaemonProc) -> None:
    head = b'{"op":"status","pad":"'
    tail = b'"}'
    exact = head + b"x" * (lq.MAX_LINE_BYTES - len(head) - len(tail)) + tail
    assert len(exact) == lq.MAX_LINE_BYTES
    other = shared.peer()
    with shared.peer() as p:
        p.send(exact + b"\n")
        assert p.recv()["op"] == "status"
        p.send(head + b"x" * (lq.MAX_LINE_BYTES - len(head) - len(tail) + 1) + tail + b"\n")
        assert p.closed_by_daemon()
    with shared.peer() as p:
        p.send(b"x" * (lq.MAX_LINE_BYTES + 1))  # no newline at all
        assert p.closed_by_daemon()
    assert other.ask({"op": "status"})["op"] == "status"  # nobody else noticed


def test_socket_a_character_split_across_writes_decodes_whole(shared: DaemonProc) -> None:
    session = "sess-\u00e9\u4e2d\U0001f600"
    key = "http://127.0.0.1:8001/utf8"
    data = json.dumps({"op": "acquire", "queueKey": key, "sessionKey": session}, ensure_ascii=False).encode()
    with shared.peer() as p:
        cut = data.index("\U0001f600".encode()) + 2  # inside the 4-byte character
        p.send(data[:cut])
        time.sleep(0.05)
        p.send(data[cut:] + b"\n")
        assert p.recv()["sessionKey"] == session


def test_socket_many_messages_in_one_write_are_each_answered(shared: DaemonProc) -> None:
    with shared.peer() as p:
        p.send(b'{"op":"renew"}\n' * 2000)
        for _ in range(2000):
            assert p.recv() == {"op": "ok"}


def test_socket_one_byte_per_write_is_served(shared: DaemonProc) -> None:
    with shared.peer() as p:
        for byte in b'{"op":"renew"}\n':
            p.send(bytes([byte]))
        assert p.recv() == {"op": "ok"}


def test_socket_ten_clients_hammering_one_slot_never_overlap(shared: DaemonProc) -> None:
    key = "http://127.0.0.1:8001/hammer"
    intervals: list[tuple[float, float, str]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client(n: int) -> None:
        try:
            with Peer(shared.socket_path) as p:
                for i in range(15):
                    g = p.ask({"op": "acquire", "queueKey": key, "sessionKey": f"s{n}",
                               "role": "parent" if n % 2 else "child"}, timeout=30)
                    assert g["op"] == "granted"
                    start = time.monotonic()
                    time.sleep(0.001)
                    end = time.monotonic()
                    with lock:
                        intervals.append((start, end, f"s{n}"))
                    assert p.ask({"op": "release", "queueKey": key, "sessionKey": f"s{n}"}) == {"op": "ok", "queueKey": key, "sessionKey": f"s{n}"}
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(intervals) == 150
    intervals.sort()
    for (s1, e1, a), (s2, e2, b) in zip(intervals, intervals[1:]):
        assert e1 <= s2, f"{a} held until {e1} but {b} started at {s2}"
    assert shared.holders(key) == []


def test_socket_an_acquire_on_a_passthrough_queue_is_granted_at_once() -> None:
    for d in started(config={"queues": {QUEUE_KEY: {"enabled": False}}}):
        peers = [d.peer() for _ in range(3)]
        for i, p in enumerate(peers):
            assert p.ask({"op": "acquire", "queueKey": QUEUE_KEY, "sessionKey": f"s{i}"})["op"] == "granted"
        q = d.queue(QUEUE_KEY)
        assert q["maxStreams"] is None and len(q["holders"]) == 3


def test_socket_the_daemon_exits_cleanly_on_sigterm_and_unlinks_its_socket() -> None:
    d = DaemonProc()
    try:
        d.start()
        assert d.proc is not None
        d.proc.terminate()
        assert d.wait_exit() == 0
        assert not os.path.exists(d.socket_path)
    finally:
        d.stop()


def test_socket_a_raw_client_can_use_the_command_line_status() -> None:
    import subprocess
    import sys
    for d in started():
        with d.peer() as p:
            p.ask({"op": "acquire", "queueKey": QUEUE_KEY, "sessionKey": "A", "group": "g"})
            out = subprocess.run([sys.executable, "llmqueue.py", "status", "--agent-dir", d.agent_dir],
                                 capture_output=True, text=True, cwd=os.path.dirname(lq.__file__), timeout=30)
            assert out.returncode == 0, out.stderr
            assert QUEUE_KEY in out.stdout and "1/1" in out.stdout and "A parent [g]" in out.stdout
            out = subprocess.run([sys.executable, "llmqueue.py", "status", "--json", "--agent-dir", d.agent_dir],
                                 capture_output=True, text=True, cwd=os.path.dirname(lq.__file__), timeout=30)
            assert json.loads(out.stdout)["op"] == "status"


def test_status_command_without_a_daemon_says_so_and_exits_1(tmp_path: Any) -> None:
    assert lq.main(["status", "--socket", str(tmp_path / "none.sock")]) == 1


def test_in_process_daemon_runs_in_a_thread_and_stops() -> None:
    from tests.harness import short_tmpdir
    d = lq.Daemon(short_tmpdir(), sweep_ms=20, idle_exit_ms=-1)
    d.bind()
    t = threading.Thread(target=d.serve_forever)
    t.start()
    try:
        with Peer(d.socket_path) as p:
            assert p.ask({"op": "acquire", "queueKey": K, "sessionKey": "A"})["op"] == "granted"
    finally:
        d.stop()
        t.join(5)
    assert not t.is_alive() and not os.path.exists(d.socket_path)


def test_readme_and_ci_run_the_same_test_command() -> None:
    root = os.path.dirname(os.path.abspath(lq.__file__))
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(root, ".ci", "run")) as f:
        ci = f.read()
    command = "python3 -m pip install -e '.[test]' && python3 -m pytest"
    assert command in readme
    assert command in ci


# -- the scheduler: reloads that merge and split ----------------------------------------------------

A, B = "http://gpu:8001/v1", "http://gpu:8002/v1"
CONFIGS = [
    {},
    {"queues": {"g": {"match": [A, B], "maxStreams": 1}}},
    {"queues": {"g": {"match": [A], "maxStreams": 1}}},
    {"queues": {"g": {"match": [A, B], "maxStreams": 2}}, "defaults": {"maxStreams": 2}},
    {"defaults": {"maxStreams": 2}},
]
KEYS = [A, A + "/", B, "g"]


def addressing(i: int) -> lq.Addressing:
    cfg, errors, _ = lq.validate_config(CONFIGS[i])
    assert not errors
    return lq.Addressing(cfg)


reload_ops = st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(CONNS), st.sampled_from(KEYS), st.sampled_from(SESSIONS[:3]),
              st.sampled_from(lq.ROLES)),
    st.tuples(st.just("release"), st.sampled_from(KEYS), st.sampled_from(SESSIONS[:3])),
    st.tuples(st.just("cancel"), st.sampled_from(KEYS), st.sampled_from(SESSIONS[:3])),
    st.tuples(st.just("disconnect"), st.sampled_from(CONNS)),
    st.tuples(st.just("park"), st.sampled_from(KEYS), st.sampled_from(SESSIONS[:3])),
    st.tuples(st.just("reload"), st.integers(0, len(CONFIGS) - 1)),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(reload_ops, max_size=50))
def test_property_reloads_never_lose_a_lease_or_an_asker(ops: list[tuple[Any, ...]]) -> None:
    check_reloads(ops)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None)
@given(st.lists(reload_ops, max_size=60))
def test_property_reloads_never_lose_a_lease_or_an_asker_long_campaign(ops: list[tuple[Any, ...]]) -> None:
    check_reloads(ops)


def check_reloads(ops: list[tuple[Any, ...]]) -> None:
    """Random requests interleaved with reloads that merge, split and widen queues: every lease
    the scheduler holds is one a Granted event created and no Released/Evicted event ended;
    every asker of a queued request is answered, dequeued, or still waits -- in the queue its
    own key now leads to; over capacity only ever drains; a free slot never has a waiter."""
    s = lq.Scheduler(addressing(0))
    leases: set[int] = set()  # ids of live Holder objects, from events alone
    askers: set[tuple[str, str, str]] = set()  # (conn, key, session) waiting for an answer
    cap: dict[str, int] = {}
    now = T0
    for op in ops:
        now += 1
        if op[0] == "acquire":
            _, conn, key, session, role = op
            events = s.acquire(conn, key, session, role, now=now)
            if any(isinstance(e, lq.Queued) for e in events) or (
                    not events and any(w.session == session for w in s.waiters(key))):
                askers.add((conn, key, session))
        elif op[0] == "release":
            events = s.release(op[1], op[2], now=now)
        elif op[0] == "cancel":
            events = s.cancel(op[1], op[2], now=now)
        elif op[0] == "disconnect":
            events = s.disconnect(op[1], now=now)
        elif op[0] == "park":
            events = s.park(op[1], op[2], now=now)[1]
        else:
            events = s.reconfigure(addressing(op[1]), now=now)
        for e in events:
            if isinstance(e, lq.Granted):
                if e.new:
                    assert id(e.holder) not in leases
                    leases.add(id(e.holder))
                for conn, key in e.targets:
                    askers.discard((conn, key, e.holder.session))
            elif isinstance(e, (lq.Released, lq.Evicted)):
                leases.remove(id(e.holder))
            elif isinstance(e, lq.Dequeued) and e.reason != "merged":
                for conn, key in e.waiter.targets:
                    askers.discard((conn, key, e.waiter.session))
        if op[0] == "cancel":
            askers = {a for a in askers if not (a[2] == op[2] and s.addressing.address_endpoint(a[1])[0]
                                               == s.addressing.address_endpoint(op[1])[0])}
        if op[0] == "disconnect":
            askers = {a for a in askers if a[0] != op[1]}
        held = {id(h) for key in s.queue_keys() for h in s._queues[key].all_holders()}
        assert held == leases
        waiting = set()
        for qkey in s.queue_keys():
            q = s._queues[qkey]
            for w in q.waiting.values():
                for conn, key in w.targets:
                    assert s.addressing.address_endpoint(key)[0] == qkey, (key, qkey)
                    waiting.add((conn, key, w.session))
            limit = q.policy.max_streams
            if limit is not None:
                if op[0] == "reload":
                    cap[qkey] = max(limit, q.held())
                assert q.held() <= cap.get(qkey, limit)
                cap[qkey] = max(limit, q.held())
                assert not (q.waiting and q.held() < limit)
            assert q.dead[0] >= 0 and q.dead[1] >= 0
        assert waiting == askers


def test_merge_then_split_keeps_both_of_a_sessions_leases_and_counts_them() -> None:
    s = lq.Scheduler(addressing(0))
    s.acquire("ca", A, "S", now=T0)
    s.acquire("cb", B, "S", now=T0 + 1)  # one session streaming on both servers
    events = s.reconfigure(addressing(1), now=T0 + 2)
    assert lq.OverCapacity("g", 2, 1) in events  # both streams live in a one-slot group
    assert [h.session for h in s.holders("g")] == ["S", "S"]
    s.reconfigure(addressing(0), now=T0 + 3)
    assert [h.session for h in s.holders(A)] == ["S"] and [h.session for h in s.holders(B)] == ["S"]
    assert granted(s.acquire("ct", B, "T", now=T0 + 4)) == []  # B is still taken by S's stream


def test_a_merged_request_is_answered_per_key_after_a_split() -> None:
    s = lq.Scheduler(addressing(0))
    s.acquire("ch", A, "U", now=T0)
    s.acquire("cu", B, "V", now=T0)
    s.acquire("ca", A, "S", now=T0 + 1)  # S waits on A ...
    s.acquire("cb", B, "S", now=T0 + 2)  # ... and on B, from another connection
    s.reconfigure(addressing(1), now=T0 + 3)  # one request in the merged group
    assert [w.session for w in s.waiters("g")] == ["S"]
    s.reconfigure(addressing(0), now=T0 + 4)  # split again: each asker waits where its key leads
    assert [w.session for w in s.waiters(A)] == ["S"] and [w.session for w in s.waiters(B)] == ["S"]
    events = s.release(A, "U", now=T0 + 5)
    g = [e for e in events if isinstance(e, lq.Granted)]
    assert len(g) == 1 and g[0].targets == (("ca", A),)  # connection b is not told it holds B
    assert [w.session for w in s.waiters(B)] == ["S"]


def test_a_reload_keeps_slot_aging_progress_of_waiters_that_did_not_move() -> None:
    def run(reload_between: bool) -> list[str]:
        s = one({"agingAfterSlots": 2, "agingAfterMs": 0})
        s.acquire("h", K, "H", "parent", now=T0)
        s.acquire("c", K, "C", "child", now=T0 + 1)
        fill(s, [("p1", "parent"), ("p2", "parent"), ("p3", "parent")], T0 + 2)
        order = []
        for i in range(3):
            holder = holders(s)[0]
            order += granted(s.release(K, holder, now=T0 + 10 + i))
            if reload_between:
                cfg, _, _ = lq.validate_config({"defaults": {"agingAfterSlots": 2, "agingAfterMs": 0,
                                                             "logFile": f"/tmp/x{i}"}})
                s.reconfigure(lq.Addressing(cfg), now=T0 + 10 + i)
        return order
    assert run(True) == run(False) == ["p1", "p2", "C"]


def test_lazy_heaps_stay_compact_under_churn() -> None:
    s = one({"leaseTtlMs": 600_000})
    for i in range(5000):
        s.acquire("c", K, f"S{i}", now=T0 + i)
        s.release(K, f"S{i}", now=T0 + i)
    assert len(s._ttl_heap) <= 64 + 2 and len(s._idle_heap) <= 64 + 2


def test_empty_unconfigured_queues_are_forgotten_past_a_bound_and_configured_ones_kept() -> None:
    s = make({"queues": {"http://kept/v1": {"maxStreams": 2}}})
    s.acquire("c", "http://kept/v1", "A", now=T0)
    s.release("http://kept/v1", "A", now=T0)
    for i in range(lq.MAX_QUEUES * 3):
        key = f"http://peer-chosen/{i}"
        s.acquire("c", key, "A", now=T0 + i)
        s.release(key, "A", now=T0 + i)
    assert len(s.queue_keys()) <= lq.MAX_QUEUES
    assert "http://kept/v1" in s.queue_keys()


def test_many_spellings_of_one_request_are_each_answered_once() -> None:
    s = make()
    s.acquire("c0", K, "H", now=T0)
    spellings = [K + "/" * i for i in range(1, 200)]
    for key in spellings + spellings:
        s.acquire("c1", key, "S", now=T0 + 1)
    (w,) = s.waiters(K)
    assert list(w.targets) == [("c1", k) for k in spellings]
    events = s.release(K, "H", now=T0 + 2)
    assert [e.targets for e in events if isinstance(e, lq.Granted)] == [tuple(("c1", k) for k in spellings)]


def test_a_pipelining_peer_is_served_in_slices_and_others_get_their_turn() -> None:
    """A peer that writes thousands of requests at once is handled LINES_PER_TURN per loop
    turn; a request from another peer that arrives meanwhile is answered before the flood is
    through (checked in-process, by the turn each line was handled in)."""
    from tests.harness import short_tmpdir
    d = lq.Daemon(short_tmpdir(), sweep_ms=20, idle_exit_ms=-1)
    handled: list[tuple[int, str]] = []
    turns = [0]
    original_turn, original_line = d._turn, d._handle_line

    def turn() -> None:
        turns[0] += 1
        original_turn()

    def line(c: Any, data: bytes) -> None:
        handled.append((turns[0], "flood" if b"flood" in data else "other"))
        original_line(c, data)

    d._turn = turn  # type: ignore[method-assign]
    d._handle_line = line  # type: ignore[method-assign]
    d.bind()
    t = threading.Thread(target=d.serve_forever, daemon=True)
    t.start()
    try:
        flood, other = Peer(d.socket_path, timeout=60), Peer(d.socket_path)
        n = 200 * lq.LINES_PER_TURN  # ~1.3 MB: the sender blocks on the daemon's back-pressure
        sender = threading.Thread(target=flood.send, args=(b'{"op":"renew","flood":1}\n' * n,), daemon=True)
        sender.start()
        wait_for(lambda: len(handled) > lq.LINES_PER_TURN)  # the daemon is into the flood
        assert other.ask({"op": "renew"}) == {"op": "ok"}
        for _ in range(n):
            flood.recv()
        sender.join(10)
        per_turn: dict[int, int] = {}
        for turn_no, who in handled:
            if who == "flood":
                per_turn[turn_no] = per_turn.get(turn_no, 0) + 1
        assert max(per_turn.values()) <= lq.LINES_PER_TURN
        other_at = [i for i, (_, who) in enumerate(handled) if who == "other"][0]
        assert other_at < len(handled) - 1  # served before the flood's last line
        flood.close()
        other.close()
    finally:
        d.stop()
        t.join(5)


def test_grant_numbers_only_grow_per_queue_even_when_a_queue_is_forgotten_and_made_again() -> None:
    s = make()
    seen: dict[str, list[int]] = {}
    for i in range(lq.MAX_QUEUES * 2 + 10):
        key = f"http://q/{i % (lq.MAX_QUEUES + 5)}"  # more keys than are kept: some are forgotten
        g = s.acquire("c", key, "A", now=T0 + i)[0]
        assert isinstance(g, lq.Granted)
        seen.setdefault(key, []).append(g.holder.seq)
        s.release(key, "A", now=T0 + i)
    assert all(seqs == sorted(seqs) and len(set(seqs)) == len(seqs) for seqs in seen.values())
