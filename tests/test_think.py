"""A person's turn is over: their context stays in use while they think (issue 13, "the
interactive pattern").

A parent that parks at the end of its turn says so (``turn: true`` beside ``parked`` on a keyed
renew; ``Lease.blocking(turn=True)``; a parent ``Session``'s settled run, unless ``background``;
the proxy's person's session after a response that ended the turn, or one to the person's words
that asked for no tool).  Where the queue learned that the server keeps only so many contexts,
that parent's context then counts as in use for as long as its person thinks: 1.5x the longest of
their last three think times (from the turn's end to their next ask) plus 0.2 s,
``THINK_DEFAULT_MS`` while none is known, ``THINK_MAX_MS`` at most.  So a subagent's gap keeps its
slot from a waiter whose run would push the person's context out, and the person's own parked
slot goes only to a waiter whose run evicts no context in use.  Without the field, or where no
bound is known, everything is as before; a connection that closes takes its person's think time
with it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, List, Optional

import pytest

import llmqueue as lq
from tests.harness import short_tmpdir, started, wait_for
from tests.test_contexts import LESSON, K, SOON, T0, granted, sched, taught
from tests.test_handover import client_of, log_lines

AGED = {"agingAfterMs": 0, "agingAfterSlots": 0}


def person_then_a(turn: bool) -> lq.Scheduler:
    """The lesson's queue (two contexts kept), then the person P's turn (its context and A's are
    the two kept), after which A holds while B waits."""
    s = taught()
    s.acquire("p", K, "P", "parent", now=T0)
    s.usage(K, "P", 1000, 0)
    s.acquire("a", K, "A", "child", now=T0 + 1)
    s.acquire("b", K, "B", "child", now=T0 + 2)
    held, events = s.park(K, "P", now=T0 + 10, turn=turn)  # A's context is kept: A goes
    assert not held and granted(events) == ["A"]
    s.usage(K, "A", 10, 1010)  # kept: A's and P's are the two kept, P's the older
    return s


# -- the pure core ------------------------------------------------------------------------------


@pytest.mark.parametrize("turn", [True, False])
def test_core_a_subagents_gap_keeps_its_slot_from_a_waiter_whose_run_would_evict_a_thinking_persons_context(
        turn: bool) -> None:
    s = person_then_a(turn)
    held, events = s.park(K, "A", now=T0 + 100, gap=True)  # B's run would push P's context out
    if turn:
        assert held and events == []
        (q,) = s.status(now=T0 + 100)
        assert [h["sessionKey"] for h in q["holders"]] == ["A"]
        assert [w["sessionKey"] for w in q["waiting"]] == ["B"]
    else:  # P's park was for good: its context is done with
        assert not held and granted(events) == ["B"]


def test_core_a_persons_return_goes_first_and_finds_the_slot_given_back() -> None:
    s = person_then_a(True)
    assert s.park(K, "A", now=T0 + 100, gap=True) == (True, [])
    assert granted(s.acquire("p", K, "P", "parent", now=T0 + 2010)) == ["P"]  # a parent waits: A gives way


def test_core_the_persons_think_time_is_learned_and_the_sweep_looks_again_when_it_is_over() -> None:
    """P thought for 2 s: from its next turn's end its context is in use for 3.2 s (1.5x plus
    0.2 s).  A subagent's gap keeps its slot until then, and the sweep hands it over after."""
    s = taught()
    s.acquire("p", K, "P", "parent", now=T0)
    s.usage(K, "P", 1000, 0)
    assert s.park(K, "P", now=T0 + 10, turn=True) == (True, [])  # nobody waits: kept
    assert s.beat(K, "P", now=T0 + 2010)  # its next turn, 2 s later, on the slot it kept
    s.usage(K, "P", 10, 1000)
    assert s.park(K, "P", now=T0 + 2100, turn=True) == (True, [])
    assert granted(s.acquire("a", K, "A", "child", now=T0 + 2200)) == ["A"]  # A's context is kept
    s.usage(K, "A", 10, 1010)
    s.acquire("b", K, "B", "child", now=T0 + 2300)
    over = T0 + 2100 + 1.5 * 2000 + 200
    assert s.park(K, "A", now=over - 100, gap=True) == (True, [])  # P still thinks
    due = s.next_deadline()
    assert due is not None and over < due <= over + 2
    assert granted(s.sweep(now=due - 2)) == []
    assert granted(s.sweep(now=due)) == ["B"]


def test_core_a_persons_parked_turn_gives_its_slot_only_to_a_waiter_whose_run_evicts_no_context_in_use() -> None:
    """A gave its slot to P in a tool-call gap; P's turn is over while only B waits, whose run
    would push A's context out: P keeps its slot until A is back, and A goes.  A park for good
    (no ``turn``) still goes to B at once."""
    for turn in (True, False):
        s = taught()
        s.acquire("a", K, "A", "child", now=T0)
        s.acquire("p", K, "P", "parent", now=T0 + 1)
        assert granted(s.park(K, "A", now=T0 + 10, gap=True)[1]) == ["P"]  # a parent waits: it goes
        s.usage(K, "P", 1000, 0)
        s.acquire("b", K, "B", "child", now=T0 + 20)
        held, events = s.park(K, "P", now=T0 + 30, turn=turn)
        if not turn:
            assert not held and granted(events) == ["B"]
            continue
        assert held and events == []
        assert granted(s.acquire("a", K, "A", "child", now=T0 + 500)) == ["A"]  # back: its context is kept
        (q,) = s.status(now=T0 + 500)
        assert [w["sessionKey"] for w in q["waiting"]] == ["B"]


def test_core_a_turn_where_no_bound_is_known_changes_nothing() -> None:
    s = sched()  # nothing learned: the server may keep every context
    s.acquire("p", K, "P", "parent", now=T0)
    s.acquire("a", K, "A", "child", now=T0 + 1)
    s.acquire("b", K, "B", "child", now=T0 + 2)
    assert granted(s.park(K, "P", now=T0 + 10, turn=True)[1]) == ["A"]
    assert granted(s.park(K, "A", now=T0 + 20, gap=True)[1]) == ["B"]


def test_core_a_childs_turn_or_one_with_gap_is_no_persons() -> None:
    """``turn`` is a parent's: a subagent's park with it is a park for good, and one with ``gap``
    too is a tool call's gap."""
    s = taught()
    s.acquire("x", K, "X", "child", now=T0)
    s.usage(K, "X", 1000, 0)
    s.park(K, "X", now=T0 + 10, turn=True)  # nobody waits: kept; a child's park for good
    s.release(K, "X", now=T0 + 20)
    s.acquire("a", K, "A", "child", now=T0 + 30)  # A's kept (with X's): granted at once
    s.usage(K, "A", 10, 1010)
    s.acquire("b", K, "B", "child", now=T0 + 40)
    assert granted(s.park(K, "A", now=T0 + 50, gap=True)[1]) == ["B"]  # X's context is done with


def test_core_the_think_time_is_capped_and_a_long_absence_is_none() -> None:
    s = taught()
    s.acquire("p", K, "P", "parent", now=T0)
    s.usage(K, "P", 1000, 0)
    s.park(K, "P", now=T0 + 10, turn=True)
    s.release(K, "P", now=T0 + 20)
    # back after more than THINK_MAX_MS: no think time; the default window holds
    s.acquire("p", K, "P", "parent", now=T0 + 10 + lq.THINK_MAX_MS + 1)
    s.usage(K, "P", 10, 0)
    now = T0 + 10 + lq.THINK_MAX_MS + 100
    s.park(K, "P", now=now, turn=True)
    s.release(K, "P", now=now + 10)
    assert granted(s.acquire("a", K, "A", "child", now=now + 20)) == ["A"]
    s.usage(K, "A", 10, 1010)
    s.acquire("b", K, "B", "child", now=now + 30)
    assert s.park(K, "A", now=now + lq.THINK_DEFAULT_MS - 100, gap=True) == (True, [])
    assert s.beat(K, "A", now=now + lq.THINK_DEFAULT_MS + 50)
    assert granted(s.park(K, "A", now=now + lq.THINK_DEFAULT_MS + 100, gap=True)[1]) == ["B"]


def test_core_a_connection_that_closes_takes_its_persons_think_time_with_it() -> None:
    s = taught()
    s.acquire("p", K, "P", "parent", now=T0)
    s.usage(K, "P", 1000, 0)
    s.park(K, "P", now=T0 + 10, turn=True)  # nobody waits: kept
    assert granted(s.acquire("a", K, "A", "child", now=T0 + 20)) == ["A"]  # its context is kept
    s.disconnect("p", now=T0 + 30)  # the person's program exited
    s.usage(K, "A", 10, 1010)
    s.acquire("b", K, "B", "child", now=T0 + 40)
    assert granted(s.park(K, "A", now=T0 + 50, gap=True)[1]) == ["B"]


def test_core_a_person_parked_again_for_another_reason_thinks_no_longer() -> None:
    """P's turn park, then, still parked, a park for good (it waits on its subagents): nobody
    thinks, so A's gap gives the slot to B.  Parked for a tool call instead, P's context is in
    use as long as the queue's tool calls take (the grace, none known), not a think time."""
    for gap in (False, True):
        s = taught()
        s.acquire("p", K, "P", "parent", now=T0)
        s.usage(K, "P", 1000, 0)
        s.park(K, "P", now=T0 + 10, turn=True)  # nobody waits: kept
        s.park(K, "P", now=T0 + 20, gap=gap)
        assert granted(s.acquire("a", K, "A", "child", now=T0 + 30)) == ["A"]
        s.usage(K, "A", 10, 1010)
        s.acquire("b", K, "B", "child", now=T0 + 40)
        later = T0 + 30 + lq.GRACE_MS + 100 if gap else T0 + 50
        assert granted(s.park(K, "A", now=later, gap=True)[1]) == ["B"]


def test_core_a_long_think_sets_a_window_no_longer_than_the_cap() -> None:
    s = taught()
    s.acquire("p", K, "P", "parent", now=T0)
    s.usage(K, "P", 1000, 0)
    s.park(K, "P", now=T0 + 10, turn=True)
    think = 100_000  # 1.5x plus 0.2 s would be 150.2 s
    assert s.beat(K, "P", now=T0 + 10 + think)
    s.usage(K, "P", 10, 1000)
    now = T0 + 20 + think
    s.park(K, "P", now=now, turn=True)
    assert granted(s.acquire("a", K, "A", "child", now=now + 10)) == ["A"]
    s.usage(K, "A", 10, 1010)
    s.acquire("b", K, "B", "child", now=now + 20)
    assert s.park(K, "A", now=now + lq.THINK_MAX_MS - 100, gap=True) == (True, [])
    assert s.beat(K, "A", now=now + lq.THINK_MAX_MS + 50)
    assert granted(s.park(K, "A", now=now + lq.THINK_MAX_MS + 100, gap=True)[1]) == ["B"]


def test_core_many_waiters_never_push_the_nearer_look_behind_a_persons_long_think() -> None:
    """A person's slot kept for A's context (in its tool call, about 3 s) while P's own think
    window is 30 s: however many subagents queue meanwhile, the sweep looks again when A's
    context is done with, not when P's is."""
    for waiters in range(130):
        s = taught()
        s.acquire("p", K, "P", "parent", now=T0)
        s.usage(K, "P", 1000, 0)
        s.park(K, "P", now=T0 + 10, turn=True)  # thinks: 30 s, none known yet
        assert granted(s.acquire("a", K, "A", "child", now=T0 + 20)) == ["A"]
        s.usage(K, "A", 10, 1010)
        s.acquire("b", K, "B", "child", now=T0 + 30)
        assert s.park(K, "A", now=T0 + 100, gap=True) == (True, [])  # kept for P: a look at ~30 s
        assert granted(s.acquire("p", K, "P", "parent", now=T0 + 1000)) == ["P"]  # P back: A away
        s.usage(K, "P", 10, 1000)
        assert s.park(K, "P", now=T0 + 1500, turn=True) == (True, [])  # kept for A, ~3 s
        for i in range(waiters):
            s.acquire(f"c{i}", K, f"C{i}", "child", now=T0 + 1600 + i)
        got: List[str] = []
        while not got:  # a look may find nothing due yet (a stale one's, lazily dropped)
            due = s.next_deadline()
            assert due is not None and due <= T0 + 1000 + lq.GRACE_MS + 2, waiters
            got = granted(s.sweep(now=due))
        assert got == ["B"]


def p_handed_its_slot_to_p2_at_its_last_request(turn_park: bool, role: str = "parent",
                                                 background: bool = False,
                                                 conn: Optional[str] = None) -> lq.Scheduler:
    """The person P's last request ended while another parent, P2, waited: P's handback gave P2
    the slot.  Then P's run settled, and with ``turn_park`` its turn park came from a session that
    holds no slot (on ``conn``).  P2's and P's contexts are the two kept, and the subagent N
    waits.  ``role``, ``background``: what P was when it held (a person's parent by default)."""
    s = taught()
    s.acquire("p", K, "P", role, now=T0, background=background)
    s.usage(K, "P", 1000, 0)
    s.acquire("p2", K, "P2", "parent", now=T0 + 5)
    held, events = s.handback(K, "P", now=T0 + 10)
    assert not held and granted(events) == ["P2"]
    if turn_park:
        assert s.park(K, "P", now=T0 + 20, turn=True, conn=conn) == (False, [])
    s.usage(K, "P2", 1000, 0)
    s.acquire("n", K, "N", "child", now=T0 + 30)
    return s


@pytest.mark.parametrize("turn_park", [True, False])
def test_core_a_turn_park_from_a_session_that_lost_its_slot_keeps_its_context_in_use_while_the_person_thinks(
        turn_park: bool) -> None:
    """Without the turn park, P's context counts as in use for a tool call's time (none known:
    the grace), as any context given up in a gap.  With it, for as long as a person thinks
    (``THINK_DEFAULT_MS``, none known), from P's last request's end: P2's gap keeps its slot from
    N, whose run would push P's context out, and the sweep hands it over once the think is over."""
    s = p_handed_its_slot_to_p2_at_its_last_request(turn_park)
    later = T0 + 10 + lq.GRACE_MS + 100  # past a tool call's time, well within a think time
    held, events = s.park(K, "P2", now=later, gap=True)
    if not turn_park:
        assert not held and granted(events) == ["N"]
        return
    assert held and events == []
    (q,) = s.status(now=later)
    assert [h["sessionKey"] for h in q["holders"]] == ["P2"]
    due = s.next_deadline()
    assert due is not None and due <= T0 + 10 + lq.THINK_DEFAULT_MS + 1
    assert granted(s.sweep(now=T0 + 10 + lq.THINK_DEFAULT_MS + 1)) == ["N"]


def test_core_a_turn_park_after_the_gap_kept_a_waiter_out_looks_again_when_the_shorter_think_ends() -> None:
    """P's person thinks briefly (0.1 s, so a think lasts 1.5 x 0.1 s + 0.2 s), while a tool call
    lasts the grace (none known).  P handed its slot to P2, whose gap kept it from N for P's
    context in use, as a tool call's; then P's turn park came: P's context is in use only while
    P's person thinks, and the sweep hands the slot to N when that is over, not at the grace."""
    s = taught()
    s.acquire("p", K, "P", "parent", now=T0 - 5000)
    s.park(K, "P", now=T0 - 4900, turn=True)
    s.acquire("p", K, "P", "parent", now=T0 - 4800)  # thought 0.1 s
    s.release(K, "P", now=T0 - 4700)
    assert granted(s.acquire("p", K, "P", "parent", now=T0)) == ["P"]
    s.usage(K, "P", 1000, 0)
    s.acquire("p2", K, "P2", "parent", now=T0 + 5)
    assert granted(s.handback(K, "P", now=T0 + 10)[1]) == ["P2"]
    s.usage(K, "P2", 1000, 0)
    s.acquire("n", K, "N", "child", now=T0 + 20)
    assert s.park(K, "P2", now=T0 + 30, gap=True) == (True, [])  # kept for P's context, a tool call's
    assert s.park(K, "P", now=T0 + 40, turn=True) == (False, [])
    due = s.next_deadline()
    think_over = T0 + 10 + 1.5 * 100 + 200
    assert due is not None and think_over < due <= think_over + 2
    assert granted(s.sweep(now=due)) == ["N"]


def test_core_a_connection_that_closes_takes_the_think_time_of_a_person_that_lost_its_slot() -> None:
    """P's turn park came, on the connection ``p``, while P held no slot; then P's program exited:
    nobody thinks, and P2's gap hands its slot to N."""
    s = p_handed_its_slot_to_p2_at_its_last_request(True, conn="p")
    s.disconnect("p", now=T0 + 25)
    later = T0 + 10 + lq.GRACE_MS + 100
    assert granted(s.park(K, "P2", now=later, gap=True)[1]) == ["N"]


def test_core_a_turn_park_from_a_session_that_gave_no_slot_up_in_a_gap_changes_nothing() -> None:
    """A session that never held, or whose run was over for good (its release), says nothing by
    a turn park: its context is no person's to keep."""
    s = p_handed_its_slot_to_p2_at_its_last_request(False)
    s.release(K, "P", now=T0 + 25)  # P's run is over: its context is done with
    assert s.park(K, "P", now=T0 + 40, turn=True) == (False, [])
    assert granted(s.park(K, "P2", now=T0 + 50, gap=True)[1]) == ["N"]
    # X's context is on the server (its usage came in), one of the two kept, but X never held here
    s = taught()
    s.usage(K, "X", 1000, 0)
    assert granted(s.acquire("p2", K, "P2", "parent", now=T0)) == ["P2"]
    s.usage(K, "P2", 1000, 0)
    s.acquire("n", K, "N", "child", now=T0 + 30)
    assert s.park(K, "X", now=T0 + 40, turn=True) == (False, [])
    assert granted(s.park(K, "P2", now=T0 + 50, gap=True)[1]) == ["N"]


def test_core_a_background_parents_turn_park_is_no_persons_turn() -> None:
    """A parent with no person behind it (its acquire said ``background``) has no turn to end: its
    ``turn`` park is a park for good, and A's gap hands its slot to B, as after a subagent's."""
    s = taught()
    s.acquire("p", K, "P", "parent", now=T0, background=True)
    s.usage(K, "P", 1000, 0)
    s.park(K, "P", now=T0 + 10, turn=True)
    assert granted(s.acquire("a", K, "A", "child", now=T0 + 20)) == ["A"]
    s.usage(K, "A", 1000, 0)
    s.acquire("b", K, "B", "child", now=T0 + 30)
    assert granted(s.park(K, "A", now=T0 + 40, gap=True)[1]) == ["B"]


@pytest.mark.parametrize("role,background", [("child", False), ("parent", True)])
def test_core_a_turn_park_from_a_subagent_or_background_parent_that_lost_its_slot_changes_nothing(
        role: str, background: bool) -> None:
    """A turn is a person's: a parked holder's ``turn`` counts only for a parent with a person
    behind it, and so does one from a session that lost its slot.  A subagent (or a background
    parent) that handed its slot to P2 says nothing by it: its context is in use for a tool call's
    time only, and its next request's wait is no think time of the queue's person."""
    s = p_handed_its_slot_to_p2_at_its_last_request(True, role, background)
    later = T0 + 10 + lq.GRACE_MS + 100  # past a tool call's time, well within a think time
    assert granted(s.park(K, "P2", now=later, gap=True)[1]) == ["N"]


@pytest.mark.parametrize("role,background", [("child", False), ("parent", True)])
def test_core_turn_parks_from_a_subagent_that_lost_its_slot_teach_the_queue_no_think_time(
        role: str, background: bool) -> None:
    """The person H thought 3 s, so H's context is kept 1.5 x 3 s + 0.2 s while H thinks.  A
    subagent S (or a background parent) that hands its slot to a parent at every request's end,
    and sends a turn park each time, is back 0.1 s later: those are its tool calls, not a person's
    think times, and H's context is kept as long as before."""
    s = taught()
    s.acquire("h", K, "H", "parent", now=T0)
    s.usage(K, "H", 1000, 0)
    s.park(K, "H", now=T0 + 10, turn=True)
    assert granted(s.acquire("h", K, "H", "parent", now=T0 + 3010)) == ["H"]  # thought 3 s
    s.release(K, "H", now=T0 + 3020)
    for i in range(lq.KEPT_SAMPLES + 2):
        t = T0 + 10_000 * (i + 1)
        assert granted(s.acquire("s", K, "S", role, now=t, background=background)) == ["S"]
        s.acquire("x", K, "X", "parent", now=t + 1)
        assert granted(s.handback(K, "S", now=t + 2)[1]) == ["X"]
        assert s.park(K, "S", now=t + 3, turn=True) == (False, [])
        s.acquire("s", K, "S", role, now=t + 100, background=background)  # its tool call is over
        assert granted(s.release(K, "X", now=t + 200)) == ["S"]
        s.release(K, "S", now=t + 300)
    t = T0 + 100_000
    assert granted(s.acquire("h", K, "H", "parent", now=t)) == ["H"]
    s.usage(K, "H", 10, 1000)
    s.park(K, "H", now=t + 10, turn=True)  # H thinks
    assert granted(s.acquire("a", K, "A", "child", now=t + 20)) == ["A"]
    s.usage(K, "A", 10, 1010)
    s.acquire("b", K, "B", "child", now=t + 30)
    assert s.park(K, "A", now=t + 10 + 4000, gap=True) == (True, [])  # B's run would push H's out


# -- the socket -----------------------------------------------------------------------------------


def teach(p: Any) -> None:
    for who, prefilled, reused in LESSON:
        assert p.ask({"op": "usage", "queueKey": K, "sessionKey": who, "prefilled": prefilled,
                      "reused": reused})["op"] == "ok"


@pytest.mark.parametrize("background", [False, True])
def test_a_turn_over_the_socket_keeps_the_persons_context_from_a_subagents_rotation(background: bool) -> None:
    """P's turn park keeps its context from the subagents' rotation: A's gap keeps its slot from
    B.  A parent whose acquire said ``background`` has no person behind it: its ``turn`` park is
    a park for good, and A's gap hands the slot to B at once."""
    for d in started(config={"defaults": AGED}):
        t = d.peer()
        teach(t)
        p, a, b = d.peer(), d.peer(), d.peer()
        acquire = {"op": "acquire", "queueKey": K, "sessionKey": "P"}
        if background:
            acquire["background"] = True
        assert p.ask(acquire)["op"] == "granted"
        t.ask({"op": "usage", "queueKey": K, "sessionKey": "P", "prefilled": 1000, "reused": 0})
        a.send({"op": "acquire", "queueKey": K, "sessionKey": "A", "role": "child"})
        wait_for(lambda: d.waiting(K) == ["A"])
        reply = p.ask({"op": "renew", "queueKey": K, "sessionKey": "P", "parked": True, "turn": True})
        assert reply == {"op": "ok", "queueKey": K, "sessionKey": "P", "granted": False}
        assert a.recv(SOON)["op"] == "granted"
        t.ask({"op": "usage", "queueKey": K, "sessionKey": "A", "prefilled": 10, "reused": 1010})
        b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "role": "child"})
        wait_for(lambda: d.waiting(K) == ["B"])
        reply = a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True, "gap": True})
        if background:  # no person thinks: P's context is done with, and B's run evicts it
            assert reply["granted"] is False
            assert b.recv(SOON)["op"] == "granted" and d.holders(K) == ["B"]
            continue
        assert reply["granted"] is True  # kept: B's run would push the person's context out
        assert b.silent(0.3) and d.holders(K) == ["A"]
        p.send({"op": "acquire", "queueKey": K, "sessionKey": "P"})  # the person's next turn
        assert p.recv(SOON)["op"] == "granted" and d.waiting(K) == ["B"]


@pytest.mark.parametrize("person", [True, False])
def test_a_first_ambiguous_eviction_over_the_socket_keeps_the_persons_context_as_if_two_fit(person: bool) -> None:
    """The queue saw returns kept after one other session, then A evicted after three others:
    two or three contexts fit.  For a thinking person's context it takes two, so a subagent's
    run that would push it out waits (with three taken, B's run would evict only D's, and B
    went).  A subagent's context in its tool call goes by three: B goes."""
    for d in started(config={"defaults": AGED}):
        t = d.peer()
        for who, prefilled, reused in LESSON[:4] + (("C", 1000, 0), ("D", 1000, 0), ("A", 1020, 0)):
            assert t.ask({"op": "usage", "queueKey": K, "sessionKey": who, "prefilled": prefilled,
                          "reused": reused})["op"] == "ok"
        p, a, b = d.peer(), d.peer(), d.peer()
        x = "P" if person else "X"
        reply = p.ask({"op": "acquire", "queueKey": K, "sessionKey": x, "role": "parent" if person else "child"})
        assert reply["op"] == "granted"
        t.ask({"op": "usage", "queueKey": K, "sessionKey": x, "prefilled": 1000, "reused": 0})
        a.send({"op": "acquire", "queueKey": K, "sessionKey": "A", "role": "child"})
        wait_for(lambda: d.waiting(K) == ["A"])
        p.ask({"op": "renew", "queueKey": K, "sessionKey": x, "parked": True, "turn": person, "gap": not person})
        assert a.recv(SOON)["op"] == "granted"  # A's run pushes D's context out, not P's
        t.ask({"op": "usage", "queueKey": K, "sessionKey": "A", "prefilled": 10, "reused": 1020})
        (q,) = [q for q in t.ask({"op": "status"})["queues"] if q["queueKey"] == K]
        assert q["affinity"]["contexts"] == 3 and q["affinity"]["contextsAtLeast"] == 2
        b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "role": "child"})
        wait_for(lambda: d.waiting(K) == ["B"])
        reply = a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True, "gap": True})
        if person:
            assert reply["granted"] is True  # kept: B's run would push the person's context out
            assert b.silent(0.3) and d.holders(K) == ["A"]
        else:
            assert reply["granted"] is False and b.recv(SOON)["op"] == "granted"


def test_a_bad_turn_field_is_an_error_reply_that_changes_nothing() -> None:
    for d in started():
        a, b = d.peer(), d.peer()
        assert a.ask({"op": "acquire", "queueKey": K, "sessionKey": "A"})["op"] == "granted"
        b.send({"op": "acquire", "queueKey": K, "sessionKey": "B"})
        wait_for(lambda: d.waiting(K) == ["B"])
        for bad in ("yes", 1, [True], {"a": 1}):
            reply = a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True, "turn": bad})
            assert reply["op"] == "error" and "turn must be true or false" in reply["reason"]
        assert d.holders(K) == ["A"] and d.waiting(K) == ["B"]


# -- Client ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("person", [True, False])
def test_a_persons_settle_hands_a_waiter_the_slot_at_once_and_an_agents_keeps_its_handback_window(
        person: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A person answers next: their session's settle parks (with ``turn``) at once, as the
    proxy's does for a response that ended the turn, so a waiting subagent does not idle through
    the parent's handback window (250 ms of every turn, 10% of the interactive run where
    contexts fit).  A parent with no person behind it (``background``), which a tool or a child's
    answer may wake again at once, keeps the window.  The window is made 5 s here to tell them
    apart."""
    monkeypatch.setattr(lq, "PARENT_HANDBACK_MS", 5000)
    for d in started():
        with client_of(d) as client:
            main = client.session(K, "P", "parent", grace_ms=10_000)
            main.background = not person
            sub = d.peer()
            with main.run():
                with main.request():
                    sub.send({"op": "acquire", "queueKey": K, "sessionKey": "S", "role": "child"})
                    wait_for(lambda: d.waiting(K) == ["S"])
            if person:
                assert sub.recv(SOON)["op"] == "granted"
            else:
                assert sub.silent(SOON) and d.holders(K) == ["P"]
            main.close()


@pytest.mark.parametrize("background", [False, True])
def test_a_parent_sessions_settled_run_is_a_turn_over_unless_no_person_is_behind_it(background: bool) -> None:
    """A parent ``Session``'s run settles: it parks with ``turn`` (at once: a person answers next),
    so A, whose context is kept, gets the slot, and A's gap then keeps it from B.  A session
    marked ``background`` parks for good: A's gap gives the slot to B."""
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": dict(AGED, logFile=log)}):
        teach(d.peer())
        with client_of(d) as client:
            client.status()  # connected: usage goes out only then
            person = client.session(K, "P", "parent", grace_ms=10_000)
            person.background = background
            a, b = d.peer(), d.peer()
            with person.run():
                with person.request():
                    client.usage(K, "P", 1000, 0)
                    wait_for(lambda: len([e for e in log_lines(log) if e["event"] == "usage"]) == len(LESSON) + 1)
            a.send({"op": "acquire", "queueKey": K, "sessionKey": "A", "role": "child"})
            assert a.recv(SOON + 1)["op"] == "granted"  # after the parent's handback window
            a.ask({"op": "usage", "queueKey": K, "sessionKey": "A", "prefilled": 10, "reused": 1010})
            b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "role": "child"})
            wait_for(lambda: d.waiting(K) == ["B"])
            reply = a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True, "gap": True})
            assert reply["granted"] is not background
            if background:
                assert b.recv(SOON)["op"] == "granted"
            else:
                assert b.silent(0.3) and d.holders(K) == ["A"]
            person.close()


def test_a_lease_parked_for_a_turn_says_so_and_a_gap_wins() -> None:
    sent: List[Any] = []
    for d in started(config={"defaults": AGED}):
        teach(d.peer())
        with client_of(d) as client:
            lease = client.acquire(K, "P", "parent", activity=True)  # nobody waits: parks keep it
            original = client._send_beat

            def spy(lease_: Any, message: Any, **kw: Any) -> Any:
                sent.append(dict(message))
                return original(lease_, message, **kw)

            client._send_beat = spy  # type: ignore[method-assign]
            with lease.blocking(turn=True):
                wait_for(lambda: any(m.get("parked") for m in sent))
                with lease.blocking():  # still parked, now waiting on another agent: said again
                    wait_for(lambda: sum(1 for m in sent if m.get("parked")) >= 2)
            with lease.blocking(gap=True, turn=True):
                wait_for(lambda: sum(1 for m in sent if m.get("parked")) >= 3)
            lease.release()
    parks = [m for m in sent if m.get("parked")]
    assert parks[0].get("turn") is True and "gap" not in parks[0]
    assert "turn" not in parks[1] and "gap" not in parks[1]
    assert parks[2].get("gap") is True and "turn" not in parks[2]


# -- a run that ended after it handed its slot to a parent ----------------------------------------


def a_handed_back_then_the_persons_turn() -> lq.Scheduler:
    """A's request ended while the person P waited: A handed its slot over between two requests
    (so its context counts as in use for a tool call's length), P's turn ran and is over, and B
    waits.  B's run would push A's context out (P's and A's are the two kept)."""
    s = taught()
    s.acquire("a", K, "A2", "child", now=T0)
    s.usage(K, "A2", 1000, 0)
    s.acquire("p", K, "P", "parent", now=T0 + 5)
    held, events = s.handback(K, "A2", now=T0 + 100)
    assert not held and granted(events) == ["P"]
    s.usage(K, "P", 1000, 0)
    s.acquire("b", K, "B2", "child", now=T0 + 150)
    assert s.park(K, "P", now=T0 + 300, turn=True) == (True, [])  # A2 may come back from a tool call
    return s


@pytest.mark.parametrize("how", ["park", "release"])
def test_core_a_run_that_ended_after_handing_its_slot_back_frees_its_context_at_once(how: str) -> None:
    # The end of A2's run (its Session settles: a park for good, or its release) says its context
    # is done with, though it holds no slot: the person's parked turn hands over to B2 at once,
    # instead of keeping the slot idle for as long as tool calls take.
    s = a_handed_back_then_the_persons_turn()
    if how == "park":
        held, events = s.park(K, "A2", now=T0 + 400)
        assert not held
    else:
        events = s.release(K, "A2", now=T0 + 400)
    assert granted(events) == ["B2"]


def test_core_a_gap_park_of_a_session_that_handed_its_slot_back_changes_nothing() -> None:
    s = a_handed_back_then_the_persons_turn()
    assert s.park(K, "A2", now=T0 + 400, gap=True) == (False, [])  # its run goes on: still away
    assert granted(s.sweep(now=T0 + 450)) == []


def b2_waits_behind_p(d: Any, p: Any, b: Any) -> None:
    """P, granted after A2, has its usage counted, and B2 (a subagent on peer ``b``) queues."""
    p.ask({"op": "usage", "queueKey": K, "sessionKey": "P", "prefilled": 1000, "reused": 0})
    b.send({"op": "acquire", "queueKey": K, "sessionKey": "B2", "role": "child"})
    wait_for(lambda: d.waiting(K) == ["B2"])


def test_a_subagent_session_whose_run_ends_after_handing_its_slot_to_a_parent_frees_its_context_at_once() -> None:
    """A2 (a ``Client`` subagent session) hands its slot to the waiting person P at its
    request's end, and its run ends there.  Its settle says so, so when P's turn is over B2 gets
    the slot at once; before, A2's context counted as in use for as long as a tool call takes
    (the 3 s grace, none being known), and the slot stood idle meanwhile."""
    for d in started(config={"defaults": AGED}):
        teach(d.peer())
        p, b = d.peer(), d.peer()
        with client_of(d) as client:
            client.status()  # connected: usage goes out only then
            a2 = client.session(K, "A2", "child", grace_ms=10_000)
            with a2.run():
                with a2.request():
                    client.usage(K, "A2", 1000, 0)
                    p.send({"op": "acquire", "queueKey": K, "sessionKey": "P", "role": "parent"})
                    wait_for(lambda: d.waiting(K) == ["P"])
                assert p.recv(SOON)["op"] == "granted"  # handed back at the request's end
            b2_waits_behind_p(d, p, b)
            sent = time.monotonic()
            reply = p.ask({"op": "renew", "queueKey": K, "sessionKey": "P", "parked": True, "turn": True})
            if reply["granted"]:  # A2's settle had not arrived yet: it comes at once
                assert b.recv(SOON)["op"] == "granted"
            assert time.monotonic() - sent < SOON and d.holders(K) == ["B2"]


def test_a_subagent_session_that_learns_only_after_its_settle_that_its_slot_was_handed_over_releases_at_once() -> None:
    """The race CI found: A2's request ends (its handback renew hands the slot to P) and its
    run settles before the reply saying so reaches the client.  The settle parks for good a
    lease it still thinks held; the reply then marks it lost, and no park goes out for a slot
    not held.  The settle must still say the run is over when it learns the loss, not after the
    grace (10 s here): B2 gets the slot when P's turn is over.  To order the race, the client's
    beat thread is kept busy (a ``call_later`` that waits) and its reader held back (its lock
    taken) until the settle is done."""
    for d in started(config={"defaults": AGED}):
        teach(d.peer())
        p, b = d.peer(), d.peer()
        with client_of(d) as client:
            client.status()  # connected: usage goes out only then
            a2 = client.session(K, "A2", "child", grace_ms=10_000)
            beats_stalled, beats_go = threading.Event(), threading.Event()
            reader_held = False
            try:
                with a2.run():
                    with a2.request():
                        client.usage(K, "A2", 1000, 0)
                        p.send({"op": "acquire", "queueKey": K, "sessionKey": "P", "role": "parent"})
                        wait_for(lambda: d.waiting(K) == ["P"])
                        client.call_later(0.0, lambda: (beats_stalled.set(), beats_go.wait(SOON * 5)) and None)
                        assert beats_stalled.wait(SOON)
                        reader_held = client._cv.acquire()  # the handback's reply waits for the settle
                    assert p.recv(SOON)["op"] == "granted"  # handed back at the request's end
                    lease = a2.lease
                    assert lease is not None and not lease.lost  # not learned yet
            finally:
                if reader_held:
                    client._cv.release()  # settled (parked for good) first; now the loss is learned
            wait_for(lambda: lease.lost)
            beats_go.set()  # the beat thread finds no held lease to park
            b2_waits_behind_p(d, p, b)
            p.send({"op": "renew", "queueKey": K, "sessionKey": "P", "parked": True, "turn": True})
            assert b.recv(SOON)["op"] == "granted"
            assert d.holders(K) == ["B2"]


def test_a_persons_session_whose_slot_went_to_another_parent_at_its_turns_end_keeps_its_context_in_use() -> None:
    """P1 (a person's ``Client`` session) ends its turn while another parent, P2, waits: the
    slot goes to P2 at P1's request's end.  P1's person reads the answer and comes back, so its
    context stays in use, as a context given up in a gap: when P2 parks for a tool call, the
    subagent N, whose run would evict P1's context, does not get the slot at once.  (A settle
    that released a lost lease at once said P1's context was done with, and N went: found by
    review.)"""
    for d in started(config={"defaults": AGED}):
        teach(d.peer())
        p2, n = d.peer(), d.peer()
        with client_of(d) as client:
            client.status()  # connected: usage goes out only then
            p1 = client.session(K, "P1", "parent", spare=False)
            with p1.run():
                with p1.request():
                    client.usage(K, "P1", 1000, 0)
                    p2.send({"op": "acquire", "queueKey": K, "sessionKey": "P2", "role": "parent"})
                    wait_for(lambda: d.waiting(K) == ["P2"])
            assert p2.recv(SOON)["op"] == "granted"
            wait_for(lambda: p1.lease is None or p1.lease.lost)  # the loss is learned
            p2.ask({"op": "usage", "queueKey": K, "sessionKey": "P2", "prefilled": 1000, "reused": 0})
            n.send({"op": "acquire", "queueKey": K, "sessionKey": "N", "role": "child"})
            wait_for(lambda: d.waiting(K) == ["N"])
            time.sleep(0.2)  # a release on the loss would be in by now
            assert p2.ask({"op": "renew", "queueKey": K, "sessionKey": "P2", "parked": True,
                           "gap": True})["granted"] is True
            assert n.silent(0.3) and d.holders(K) == ["P2"]


@pytest.mark.parametrize("learned", ["before", "after"])
def test_a_persons_session_whose_slot_went_to_another_parent_at_its_last_request_keeps_its_context_while_they_think(
        learned: str) -> None:
    """As above, but past a tool call's time: the daemon learned that tool calls take about
    0.1 s (a subagent T's gap), so a context given up in a gap counts as in use for 0.35 s.  P1's
    settle says that its person's turn is over though its slot is gone (a ``turn`` park), so its
    context counts as in use while they think (30 s, none known): 0.6 s after P1's request ended,
    P2's gap still keeps its slot from N.  (Before, P1's context was done with after 0.35 s, N
    went, and P1's next turn re-prefilled.)  ``learned``: the client learns the loss before its
    run settles, or only after (its beat thread and reader held back, as in the race above), when
    the park it would send for a slot held no longer goes out."""
    for d in started(config={"defaults": AGED}):
        teach(d.peer())
        t, p2, n = d.peer(), d.peer(), d.peer()
        assert t.ask({"op": "acquire", "queueKey": K, "sessionKey": "T", "role": "child"})["op"] == "granted"
        t.ask({"op": "renew", "queueKey": K, "sessionKey": "T", "handback": True, "busy": False})
        time.sleep(0.1)  # T's tool call
        t.ask({"op": "renew", "queueKey": K, "sessionKey": "T", "busy": True})
        assert t.ask({"op": "release", "queueKey": K, "sessionKey": "T"})["op"] == "ok"
        with client_of(d) as client:
            client.status()  # connected: usage goes out only then
            p1 = client.session(K, "P1", "parent", spare=False)
            beats_stalled, beats_go = threading.Event(), threading.Event()
            reader_held = False
            try:
                with p1.run():
                    with p1.request():
                        client.usage(K, "P1", 1000, 0)
                        p2.send({"op": "acquire", "queueKey": K, "sessionKey": "P2", "role": "parent"})
                        wait_for(lambda: d.waiting(K) == ["P2"])
                        if learned == "after":
                            client.call_later(0.0, lambda: (beats_stalled.set(), beats_go.wait(SOON * 5)) and None)
                            assert beats_stalled.wait(SOON)
                            reader_held = client._cv.acquire()  # the handback's reply waits for the settle
                    ended = time.monotonic()
                    assert p2.recv(SOON)["op"] == "granted"  # handed over at the request's end
                    lease = p1.lease
                    assert lease is not None
                    if learned == "before":
                        wait_for(lambda: lease.lost)
                    else:
                        assert not lease.lost
            finally:
                if reader_held:
                    client._cv.release()
            wait_for(lambda: lease.lost)
            beats_go.set()
            p2.ask({"op": "usage", "queueKey": K, "sessionKey": "P2", "prefilled": 1000, "reused": 0})
            n.send({"op": "acquire", "queueKey": K, "sessionKey": "N", "role": "child"})
            wait_for(lambda: d.waiting(K) == ["N"])
            time.sleep(max(0.0, ended + 0.6 - time.monotonic()))  # past the tool call's 0.35 s
            assert p2.ask({"op": "renew", "queueKey": K, "sessionKey": "P2", "parked": True,
                           "gap": True})["granted"] is True
            assert n.silent(0.3) and d.holders(K) == ["P2"]


@pytest.mark.parametrize("role", ["parent", "child", "background"])
def test_over_the_socket_a_turn_park_without_a_slot_is_a_persons_parents_only(role: str) -> None:
    """Raw peers: S handed its slot to P2 at its request's end, then said its turn is over (a
    ``turn`` park, holding no slot).  A person's parent's context stays in use while its person
    thinks: 0.6 s later, past the tool call's 0.35 s, P2's gap still keeps its slot from N.  A
    subagent, or a parent whose acquire said ``background``, has no person: its context was in
    use for a tool call's time, and N gets the slot."""
    for d in started(config={"defaults": AGED}):
        teach(d.peer())
        t, sp, p2, n = d.peer(), d.peer(), d.peer(), d.peer()
        assert t.ask({"op": "acquire", "queueKey": K, "sessionKey": "T", "role": "child"})["op"] == "granted"
        t.ask({"op": "renew", "queueKey": K, "sessionKey": "T", "handback": True, "busy": False})
        time.sleep(0.1)  # T's tool call: tool calls take about 0.1 s here
        t.ask({"op": "renew", "queueKey": K, "sessionKey": "T", "busy": True})
        assert t.ask({"op": "release", "queueKey": K, "sessionKey": "T"})["op"] == "ok"
        acquire = {"op": "acquire", "queueKey": K, "sessionKey": "S", "role": role}
        if role == "background":
            acquire.update(role="parent", background=True)
        assert sp.ask(acquire)["op"] == "granted"
        sp.ask({"op": "usage", "queueKey": K, "sessionKey": "S", "prefilled": 1000, "reused": 0})
        p2.send({"op": "acquire", "queueKey": K, "sessionKey": "P2", "role": "parent"})
        wait_for(lambda: d.waiting(K) == ["P2"])
        sp.ask({"op": "renew", "queueKey": K, "sessionKey": "S", "handback": True, "busy": False})
        ended = time.monotonic()
        assert p2.recv(SOON)["op"] == "granted"
        assert sp.ask({"op": "renew", "queueKey": K, "sessionKey": "S", "parked": True,
                       "turn": True}) == {"op": "ok", "queueKey": K, "sessionKey": "S", "granted": False}
        p2.ask({"op": "usage", "queueKey": K, "sessionKey": "P2", "prefilled": 1000, "reused": 0})
        n.send({"op": "acquire", "queueKey": K, "sessionKey": "N", "role": "child"})
        wait_for(lambda: d.waiting(K) == ["N"])
        time.sleep(max(0.0, ended + 0.6 - time.monotonic()))
        reply = p2.ask({"op": "renew", "queueKey": K, "sessionKey": "P2", "parked": True, "gap": True})
        if role == "parent":
            assert reply["granted"] is True
            assert n.silent(0.3) and d.holders(K) == ["P2"]
        else:
            assert reply["granted"] is False
            assert n.recv(SOON)["op"] == "granted"


@pytest.mark.parametrize("how", ["park", "gap", "release"])
def test_over_the_socket_a_session_that_handed_its_slot_back_frees_its_context_when_its_run_is_over(how: str) -> None:
    """The daemon side, with raw peers: A2 handed its slot to P between two requests (a
    ``handback`` renew), P's turn is over and B2 waits.  A2's release, or its park for good,
    though it holds no slot, ends its run: B2 gets the slot at once.  A ``gap`` park does not
    (its run goes on after a tool call): B2 waits."""
    for d in started(config={"defaults": AGED}):
        teach(d.peer())
        a2, p, b = d.peer(), d.peer(), d.peer()
        assert a2.ask({"op": "acquire", "queueKey": K, "sessionKey": "A2", "role": "child"})["op"] == "granted"
        a2.ask({"op": "usage", "queueKey": K, "sessionKey": "A2", "prefilled": 1000, "reused": 0})
        p.send({"op": "acquire", "queueKey": K, "sessionKey": "P", "role": "parent"})
        wait_for(lambda: d.waiting(K) == ["P"])
        a2.ask({"op": "renew", "queueKey": K, "sessionKey": "A2", "handback": True, "busy": False})
        assert p.recv(SOON)["op"] == "granted"
        p.ask({"op": "usage", "queueKey": K, "sessionKey": "P", "prefilled": 1000, "reused": 0})
        b.send({"op": "acquire", "queueKey": K, "sessionKey": "B2", "role": "child"})
        wait_for(lambda: d.waiting(K) == ["B2"])
        assert p.ask({"op": "renew", "queueKey": K, "sessionKey": "P", "parked": True, "turn": True})["granted"]
        if how == "release":
            assert a2.ask({"op": "release", "queueKey": K, "sessionKey": "A2"})["op"] == "ok"
        else:
            message = {"op": "renew", "queueKey": K, "sessionKey": "A2", "parked": True}
            reply = a2.ask({**message, "gap": True} if how == "gap" else message)
            assert reply["granted"] is False
        if how == "gap":
            assert b.silent(0.3) and d.holders(K) == ["P"]
        else:
            assert b.recv(SOON)["op"] == "granted"
