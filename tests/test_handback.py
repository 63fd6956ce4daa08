"""Between two requests, the slot goes to a waiting parent at once (issue 13, "yield at the request
boundary to a waiting parent", widened to the whole gap).

Through a real socket: a keyed ``renew`` with ``handback: true`` says the holder is between two
requests of its run.  Its slot goes at once to a parent the queue would grant next -- one queued
now, or the first to come while the gap lasts.  A child holder always gives way; a parent holder
where switches are cheap, or, where the queue does not know yet, at its first gap (a probe,
however short its run so far), and never where they are dear.  To a child, a slot goes in a gap
only while the cost is unknown, to find it out: a child holder gives way at its first gap, one
such hand-over at a time.  The one that gave way (a
parent or a child, if it reported usage, so that its return can tell) queues again ahead of its
tier (``resume``), and the next holder's gap gives it the slot back at once, so its return shows
what the server kept (otherwise the holder's own window, ended by a park, decides).  ``resume``
is honoured only for that one and for a child that gave its slot to a parent, and only on the
session's next acquire: two sessions never take turns ahead of a third.  The yield is logged as a
``release`` with reason ``handback`` and counted as ``handbackYields`` in ``status``; the reply
echoes ``busy``; an activity beat without the field ends the gap; a parked holder stays parked;
a bad value is an error reply that changes nothing.  In the pure scheduler: a child due by aging
is no parent, a re-tier to parent of a waiting child takes the slot, a spare stream goes only to
a parent that can take it, and a child gives way to a child only while the cost is unknown.

Through ``Client``: a parent's session hands over between its requests to a waiting parent (two
parents take turns request by request), unless the queue knows that a switch re-prefills there
(``switchCost: dear``), where it keeps its tool-gap window; a child's session is next after the
parent it handed back to, ahead of the other children; while the cost is unknown, a child's
session gives way to another at its first gap and gets the slot back at the other's first request
boundary.  Through the proxy, two agents with
nothing named (both parents, the way a tool that marks nothing is seen): one of them no longer
waits behind the other's tool calls, and the simulated server shows they took turns.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, List

import llmqueue as lq
from tests.harness import short_tmpdir, started, wait_for
from tests.test_handover import Asker, acquire, beat, client_of, log_lines

K = "http://127.0.0.1:8001/v1"
SOON = 1.0  # "at once", on a loaded machine: far below any window or grace here
T0 = 1000.0
HELD_MS = 2000  # a while into a hold: no share of it is waited for (a probe comes at the first gap)


def gap(session: str, **more: Any) -> Dict[str, Any]:
    return {"op": "renew", "queueKey": K, "sessionKey": session, "handback": True, **more}


# -- the wire ---------------------------------------------------------------------------------------


def test_a_holder_between_requests_hands_its_slot_to_a_waiting_parent_at_once() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        c, p = d.peer(), d.peer()
        assert c.ask(acquire("C", "child"))["op"] == "granted"
        p.send(acquire("P"))
        wait_for(lambda: d.waiting(K) == ["P"])
        sent = time.monotonic()
        c.send(gap("C", busy=False))
        assert p.recv(SOON)["op"] == "granted"
        assert time.monotonic() - sent < SOON
        assert c.recv(SOON) == {"op": "ok", "queueKey": K, "sessionKey": "C", "granted": False, "busy": False}
        q = d.queue(K)
        assert [h["sessionKey"] for h in q["holders"]] == ["P"]
        assert q["handbackYields"] == 1 and q["parkYields"] == 0 and q["idleYields"] == 0
        releases = wait_for(lambda: [e for e in log_lines(log) if e["event"] == "release"])
        assert [(e["sessionKey"], e["reason"]) for e in releases] == [("C", "handback")]


def test_a_parent_that_comes_during_the_gap_is_granted_at_once() -> None:
    for d in started(config={"defaults": {"switchCost": "cheap"}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        assert a.ask(gap("A")) == {"op": "ok", "queueKey": K, "sessionKey": "A", "granted": True}
        time.sleep(0.2)
        assert d.holders(K) == ["A"] and d.queue(K)["switches"] == 0  # nobody waits: kept
        b.send(acquire("B"))  # a parent: the two take turns at request boundaries
        assert b.recv(SOON)["op"] == "granted"
        assert d.holders(K) == ["B"] and d.queue(K)["handbackYields"] == 1
        assert a.ask(beat("A"))["granted"] is False  # it learns, and queues again


def test_a_child_never_takes_a_slot_in_a_handback_gap() -> None:
    for d in started():
        a, c = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        c.send(acquire("C", "child"))
        wait_for(lambda: d.waiting(K) == ["C"])
        assert a.ask(gap("A"))["granted"] is True
        assert c.silent(0.3)  # the holder's own window decides for children: it parks when it lapses
        assert d.holders(K) == ["A"] and d.waiting(K) == ["C"]
        a.send({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True})
        assert c.recv(SOON)["op"] == "granted"


def test_a_parent_holder_gives_way_to_a_parent_at_its_first_gap_while_switch_costs_are_unknown() -> None:
    for d in started():
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        b.send(acquire("B"))
        wait_for(lambda: d.waiting(K) == ["B"])
        sent = time.monotonic()
        a.send(gap("A"))  # its first request ended, a moment after its grant: B's turn (a probe)
        assert b.recv(SOON)["op"] == "granted" and time.monotonic() - sent < SOON
        assert a.recv(SOON)["granted"] is False and d.queue(K)["handbackYields"] == 1


def test_the_parent_that_gave_way_to_find_out_is_given_the_slot_back_at_the_next_gap() -> None:
    for d in started(config={"defaults": {"agingAfterMs": 0, "agingAfterSlots": 0}}):
        a, b, c = d.peer(), d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        b.send(acquire("B"))
        c.send(acquire("C"))
        wait_for(lambda: d.waiting(K) == ["B", "C"])
        a.ask({"op": "usage", "queueKey": K, "sessionKey": "A", "prefilled": 1000, "reused": 0})
        time.sleep(HELD_MS / 1000)
        a.send(gap("A"))  # its first gap: B's turn, to find out what a switch costs
        assert b.recv(SOON)["op"] == "granted"
        a.recv(SOON)  # the renew's ok
        a.send({**acquire("A"), "resume": True})  # after its tool call
        wait_for(lambda: sorted(d.waiting(K)) == ["A", "C"])
        b.ask(beat("B"))  # B's request...
        sent = time.monotonic()
        b.send(gap("B"))  # ...ended: A is back at once, ahead of C
        assert a.recv(SOON)["op"] == "granted" and time.monotonic() - sent < SOON and c.silent(0.2)
        b.recv(SOON)
        b.send({**acquire("B"), "resume": True})  # B only gave the slot back: it earned no priority
        wait_for(lambda: sorted(d.waiting(K)) == ["B", "C"])
        a.ask({"op": "release", "queueKey": K, "sessionKey": "A"})
        assert c.recv(SOON)["op"] == "granted" and b.silent(0.2)
        assert d.queue(K)["handbackYields"] == 2


def test_where_switches_are_dear_a_parent_holder_never_gives_way_in_a_gap() -> None:
    for d in started(config={"defaults": {"switchCost": "dear"}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        b.send(acquire("B"))
        wait_for(lambda: d.waiting(K) == ["B"])
        time.sleep(HELD_MS / 1000)
        assert a.ask(gap("A"))["granted"] is True
        assert b.silent(0.3) and d.holders(K) == ["A"]  # its window (a park) decides: a re-prefill saved
        a.ask({"op": "release", "queueKey": K, "sessionKey": "A"})
        assert b.recv(SOON)["op"] == "granted"


def test_an_activity_beat_ends_the_gap_and_a_repeated_handback_keeps_it() -> None:
    for d in started():
        a, b, c = d.peer(), d.peer(), d.peer()
        assert a.ask(acquire("A", "child"))["op"] == "granted"
        assert a.ask(gap("A"))["granted"] is True
        assert a.ask(gap("A"))["granted"] is True  # the gap goes on
        b.send(acquire("B"))
        assert b.recv(SOON)["op"] == "granted"  # so a parent that comes takes the slot
        b.ask({"op": "release", "queueKey": K, "sessionKey": "B"})
        assert a.ask(acquire("A", "child"))["op"] == "granted"
        assert a.ask(gap("A"))["granted"] is True
        assert a.ask(beat("A"))["granted"] is True  # the next request began: the gap is over
        c.send(acquire("C"))
        assert c.silent(0.3)  # never taken from a holder at work
        assert d.holders(K) == ["A"] and d.waiting(K) == ["C"]


def test_a_parked_holder_stays_parked_through_a_handback_renew() -> None:
    for d in started():
        a, c = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        assert a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True})["granted"] is True
        assert a.ask(gap("A"))["granted"] is True
        c.send(acquire("C", "child"))
        assert c.recv(SOON)["op"] == "granted"  # parked: the slot goes to anyone
        q = d.queue(K)
        assert q["parkYields"] == 1 and q["handbackYields"] == 0


def test_a_bad_handback_field_is_an_error_reply_that_changes_nothing() -> None:
    for d in started():
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A", "child"))["op"] == "granted"
        b.send(acquire("B"))
        wait_for(lambda: d.waiting(K) == ["B"])
        reply = a.ask(gap("A", handback="yes"))
        assert reply["op"] == "error" and "handback must be true or false" in reply["reason"]
        assert b.silent(0.2)
        assert d.holders(K) == ["A"] and d.waiting(K) == ["B"]
        assert a.ask(gap("A"))["granted"] is False  # the connection still works
        assert b.recv(SOON)["op"] == "granted"


def test_a_handback_renew_for_a_slot_not_held_says_so() -> None:
    for d in started():
        a = d.peer()
        assert a.ask(gap("nobody")) == {"op": "ok", "queueKey": K, "sessionKey": "nobody", "granted": False}
        assert d.holders(K) == []


# -- the pure scheduler -----------------------------------------------------------------------------


def sched(**defaults: Any) -> lq.Scheduler:
    cfg, errors, _ = lq.validate_config({"defaults": defaults})
    assert not errors, errors
    return lq.Scheduler(lq.Addressing(cfg))


def granted(events: List[lq.Event]) -> List[str]:
    return [e.holder.session for e in events if isinstance(e, lq.Granted)]


def released(events: List[lq.Event]) -> List[tuple[str, str]]:
    return [(e.holder.session, e.reason) for e in events if isinstance(e, lq.Released)]


def test_core_a_child_due_by_aging_is_next_so_a_handback_holder_keeps_its_slot() -> None:
    # ``dear``: no probe either (which would give the slot to C to find out what a switch costs)
    s = sched(agingAfterMs=500, agingAfterSlots=0, switchCost="dear")
    s.acquire("h", K, "H", "child", now=T0)
    s.acquire("c", K, "C", "child", now=T0)
    s.acquire("p", K, "P", "parent", now=T0 + 1000)  # the child C has waited past its aging
    held, events = s.handback(K, "H", now=T0 + 1000)
    # C would be next, and C is no parent
    assert held and events == []
    (q,) = s.status(now=T0 + 1000)
    assert [w["sessionKey"] for w in q["waiting"]] == ["C", "P"] and q["handbackYields"] == 0


def test_core_a_waiting_child_re_tiered_to_parent_takes_a_handback_slot() -> None:
    s = sched(agingAfterMs=0, agingAfterSlots=0, switchCost="dear")  # no probe to C while a child
    s.acquire("h", K, "H", "child", now=T0)
    s.acquire("c", K, "C", "child", now=T0)
    held, events = s.handback(K, "H", now=T0 + 1000)
    assert held and events == []
    events = s.set_role("C", "parent", now=T0 + 2000)
    assert released(events) == [("H", "handback")] and granted(events) == ["C"]


def test_core_the_switch_cost_decides_whether_a_parent_holder_gives_way_to_a_parent() -> None:
    later = HELD_MS
    for cost, held_ms, gives in [("auto", 1, True), ("auto", later, True), ("cheap", 1, True),
                                 ("dear", 10 * later, False)]:
        s = sched(agingAfterMs=0, agingAfterSlots=0, switchCost=cost)
        s.acquire("h", K, "H", "parent", now=T0)
        s.acquire("b", K, "B", "parent", now=T0)
        held, events = s.handback(K, "H", now=T0 + held_ms)
        assert (released(events) == [("H", "handback")]) is gives and held is not gives, (cost, held_ms)


def test_core_while_the_cost_is_unknown_a_parent_gives_way_to_a_parent_once_per_return() -> None:
    # One switch at a time finds out what a switch costs: after a parent gave way to a parent,
    # the next one waits until a session has come back and said what it found kept.
    later = HELD_MS
    s = sched(agingAfterMs=0, agingAfterSlots=0)
    s.acquire("a", K, "A", "parent", now=T0)
    s.usage(K, "A", 1000, 0)
    s.acquire("b", K, "B", "parent", now=T0)
    s.acquire("c", K, "C", "parent", now=T0)
    held, events = s.handback(K, "A", now=T0 + later)
    assert not held and released(events) == [("A", "handback")] and granted(events) == ["B"]
    s.acquire("a", K, "A", "parent", now=T0 + later)  # A queues again, behind C
    s.usage(K, "B", 1000, 0)  # B's first request: nobody came back yet
    held, events = s.handback(K, "B", now=T0 + 3 * later)
    assert held and events == []  # the last probe has not come back
    s.beat(K, "B", now=T0 + 3 * later, busy=True)  # B's next request
    s.usage(K, "A", 10, 1000)  # A's return, reported (its context was kept): the cost is still unknown
    (q,) = s.status(now=T0 + 3 * later)
    assert q["affinity"]["switchCost"] == "unknown" and q["affinity"]["returns"] == 1
    held, events = s.handback(K, "B", now=T0 + 3 * later)
    assert not held and granted(events) == ["C"]  # a return came since: the next probe


def probed() -> lq.Scheduler:
    """Parents A, B and C, the cost unknown: A gave way to B at its first gap."""
    s = sched(agingAfterMs=0, agingAfterSlots=0)
    for name in "ABC":
        s.acquire(name.lower(), K, name, "parent", now=T0)
    held, events = s.handback(K, "A", now=T0 + HELD_MS)
    assert not held and granted(events) == ["B"]
    return s


def test_core_a_probe_that_never_comes_back_holds_up_the_next_one_only_for_probe_again_ms() -> None:
    # The one that gave way queued again (after its tool call) but is not back on the slot yet:
    # the next probe waits PROBE_AGAIN_MS at most.
    later, again = HELD_MS, lq.PROBE_AGAIN_MS
    s = probed()
    s.acquire("a", K, "A", "parent", now=T0 + later + 500)  # behind C
    held, events = s.handback(K, "B", now=T0 + later + again - 1)
    assert held and events == []
    s.beat(K, "B", now=T0 + later + again, busy=True)
    held, events = s.handback(K, "B", now=T0 + later + again)
    assert not held and granted(events) == ["C"]


def test_core_a_probe_that_does_not_queue_again_holds_up_the_next_one_for_the_grace_while_no_gap_is_known() -> None:
    # A's last response of its run looked like a tool call's: it never queues again, so its
    # return will not come, and the next probe waits the grace at most (B's first gap: the queue
    # has not seen how long its tool calls take).
    later, grace = HELD_MS, lq.GRACE_MS
    s = probed()
    held, events = s.handback(K, "B", now=T0 + later + grace - 1)
    assert held and events == []
    s.beat(K, "B", now=T0 + later + grace, busy=True)
    held, events = s.handback(K, "B", now=T0 + later + grace)
    assert not held and granted(events) == ["C"]


def test_core_a_probe_that_does_not_queue_again_holds_up_the_next_one_as_long_as_the_queues_gaps_last() -> None:
    # The queue sees how long its holders' tool calls take (a handback gap, to the next request):
    # the one that gave way would be back by then.  A 1.6 s tool call: 1.5x the longest plus
    # 0.2 s, like a session's own tool-gap window, which is short of the grace.
    later, grace = HELD_MS, lq.GRACE_MS
    s = probed()  # A gave way, and never queues again
    probed_at = T0 + later
    window = 1.5 * 1600 + 200
    assert later < window < grace
    held, events = s.handback(K, "B", now=probed_at + 100)
    assert held and events == []
    s.beat(K, "B", now=probed_at + 1700, busy=True)  # B's tool call took 1.6 s
    held, events = s.handback(K, "B", now=probed_at + later)  # A's return is not
    assert held and events == []
    s.beat(K, "B", now=probed_at + window - 1, busy=True)
    held, events = s.handback(K, "B", now=probed_at + window - 1)
    assert held and events == []
    s.beat(K, "B", now=probed_at + window + 1, busy=True)
    held, events = s.handback(K, "B", now=probed_at + window + 1)  # A would be back by now: it probes on
    assert not held and granted(events) == ["C"]


def test_core_a_tool_call_that_outlasted_its_window_counts_among_the_queues_gaps() -> None:
    # A lone holder's gap that ended in a park (its window passed, nobody waited, so it kept the
    # slot) was a tool call all the same: the absent prober is waited for that long too.
    later, grace = HELD_MS, lq.GRACE_MS
    s = sched(agingAfterMs=0, agingAfterSlots=0)
    s.acquire("a", K, "A", "parent", now=T0)
    for start in (T0 + 100, T0 + 700):  # two half-second tool calls
        s.handback(K, "A", now=start)
        s.beat(K, "A", now=start + 500, busy=True)
    s.handback(K, "A", now=T0 + 1300)
    held, events = s.park(K, "A", now=T0 + 2250)  # its window (0.95 s) passed: parked
    assert held and events == []  # nobody waits: it keeps the slot
    s.beat(K, "A", now=T0 + 3300, busy=True)  # a 2 s tool call, then its next request
    for name in "BC":
        s.acquire(name.lower(), K, name, "parent", now=T0 + 3400)
    held, events = s.handback(K, "A", now=T0 + 3500)  # it gives way to find out
    assert not held and granted(events) == ["B"]
    probed_at = T0 + 3500
    s.beat(K, "B", now=probed_at + later, busy=True)
    held, events = s.handback(K, "B", now=probed_at + later)  # inside 1.5 x 2 s + 0.2 s
    assert held and events == []
    s.beat(K, "B", now=probed_at + grace, busy=True)
    held, events = s.handback(K, "B", now=probed_at + grace)  # the window is the grace at most
    assert not held and granted(events) == ["C"]


def test_core_a_long_gap_of_the_queue_lets_an_absent_prober_hold_up_the_next_probe_for_the_grace() -> None:
    # The window is the queue's longest recent gap's (a slow tool call): within the grace.
    grace = lq.GRACE_MS
    s = sched(agingAfterMs=0, agingAfterSlots=0)
    s.acquire("a", K, "A", "parent", now=T0)
    s.handback(K, "A", now=T0 + 100)  # alone on the queue: it keeps its slot
    s.beat(K, "A", now=T0 + 100 + grace, busy=True)  # a 3 s tool call: the window is the grace
    for name in "BC":
        s.acquire(name.lower(), K, name, "parent", now=T0 + 100 + grace)
    start = T0 + 200 + grace
    held, events = s.handback(K, "A", now=start)
    assert granted(events) == ["B"]
    s.beat(K, "B", now=start + grace - 1, busy=True)
    held, events = s.handback(K, "B", now=start + grace - 1)
    assert held and events == []
    s.beat(K, "B", now=start + grace, busy=True)
    held, events = s.handback(K, "B", now=start + grace)
    assert not held and granted(events) == ["C"]


def test_core_once_a_context_was_found_kept_a_probe_that_did_not_queue_again_holds_up_no_other() -> None:
    # Through the proxy a run's last response looks like a tool call's: the one that gave way may
    # have ended.  While nothing says switches are dear, the next holder's gap probes on.
    s = sched(agingAfterMs=0, agingAfterSlots=0)
    s.usage(K, "X", 1000, 0)
    s.usage(K, "Y", 1000, 0)
    s.usage(K, "X", 10, 1000)  # one return, its context kept
    for name in "ABC":
        s.acquire(name.lower(), K, name, "child", now=T0)
    s.usage(K, "A", 1000, 0)
    held, events = s.handback(K, "A", now=T0 + 1)  # a context was found kept: no return awaited
    assert not held and granted(events) == ["B"]
    held, events = s.handback(K, "B", now=T0 + 500)  # A did not queue again
    assert not held and granted(events) == ["C"]


def test_core_while_the_cost_is_unknown_a_child_gives_way_to_a_child_at_its_first_gap_and_gets_it_back() -> None:
    # Subagents that never come back mid-run never teach the queue what a switch costs: one of
    # them gives way at its first request boundary, and the next gives it back at its own first
    # boundary, so the first one's return (what the server kept) tells.
    later = HELD_MS
    s = sched(agingAfterMs=0, agingAfterSlots=0)
    s.acquire("a", K, "A", "child", now=T0)
    s.usage(K, "A", 1000, 0)
    s.acquire("b", K, "B", "child", now=T0)
    s.acquire("c", K, "C", "child", now=T0)
    held, events = s.handback(K, "A", now=T0 + later)
    assert not held and released(events) == [("A", "handback")] and granted(events) == ["B"]
    s.acquire("a", K, "A", "child", now=T0 + later + 500, resume=True)  # after its tool call: ahead of C
    s.usage(K, "B", 1000, 0)
    held, events = s.handback(K, "B", now=T0 + later + 600)  # B's first gap, 0.1 s after its grant
    assert not held and granted(events) == ["A"]  # A is back at once
    s.usage(K, "A", 10, 1000)  # and found its context kept
    (q,) = s.status(now=T0 + later + 700)
    assert q["affinity"]["returns"] == 1 and q["handbackYields"] == 2
    assert [w["sessionKey"] for w in q["waiting"]] == ["C"]
    s.acquire("b", K, "B", "child", now=T0 + later + 750, resume=True)  # B only gave it back: behind C
    # a return came since the last probe (A's): the next may go at once (A was granted 100 ms ago)
    held, events = s.handback(K, "A", now=T0 + later + 800)
    assert not held and granted(events) == ["C"]


def test_core_resume_is_honoured_only_where_it_was_earned() -> None:
    # Two sessions that hand the slot to each other never take turns ahead of a third: only a
    # child that gave its slot to a parent, or the holder that gave way in a probe, queues ahead.
    s = sched(agingAfterMs=0, agingAfterSlots=0, switchCost="cheap")
    s.acquire("c", K, "C", "child", now=T0)
    s.acquire("a", K, "A", "child", now=T0)
    s.acquire("b", K, "B", "child", now=T0 + 1)
    assert granted(s.release(K, "C", now=T0 + 2)) == ["A"]
    s.acquire("c", K, "C", "child", now=T0 + 3, resume=True)  # it gave its slot to a child: behind B
    s.acquire("p", K, "P", "parent", now=T0 + 4)
    held, events = s.handback(K, "A", now=T0 + 5)  # A's gap: its slot goes to the parent
    assert not held and granted(events) == ["P"]
    s.acquire("a", K, "A", "child", now=T0 + 6, resume=True)  # A gave its slot to a parent: first
    assert granted(s.release(K, "P", now=T0 + 7)) == ["A"]
    s.acquire("x", K, "X", "parent", now=T0 + 8)
    assert granted(s.release(K, "A", now=T0 + 9)) == ["X"]  # a hand-back at a request boundary
    s.acquire("a", K, "A", "child", now=T0 + 10, resume=True)  # next after the parent again
    assert granted(s.release(K, "X", now=T0 + 11)) == ["A"]
    assert granted(s.release(K, "A", now=T0 + 12)) == ["B"]  # B, then C: in the order they queued
    assert granted(s.release(K, "B", now=T0 + 13)) == ["C"]


def test_core_an_earned_place_is_for_the_next_acquire_only() -> None:
    s = sched(agingAfterMs=0, agingAfterSlots=0, switchCost="dear")
    s.acquire("a", K, "A", "child", now=T0)
    s.acquire("p", K, "P", "parent", now=T0)
    assert granted(s.release(K, "A", now=T0 + 1)) == ["P"]  # A gave its slot to a parent: earned
    s.release(K, "P", now=T0 + 2)
    s.acquire("a", K, "A", "child", now=T0 + 3)  # into a free slot: the earned place is used up
    s.acquire("b", K, "B", "child", now=T0 + 4)
    assert granted(s.release(K, "A", now=T0 + 5)) == ["B"]  # to a child: nothing earned
    s.acquire("c", K, "C", "child", now=T0 + 6)
    s.acquire("a", K, "A", "child", now=T0 + 7, resume=True)
    assert granted(s.release(K, "B", now=T0 + 8)) == ["C"]


def test_core_a_cancel_or_a_slot_that_goes_to_an_aged_child_earns_no_place() -> None:
    s = sched(agingAfterMs=0, agingAfterSlots=0, switchCost="dear")
    s.acquire("a", K, "A", "child", now=T0)
    s.acquire("b", K, "B", "child", now=T0)
    s.acquire("p", K, "P", "parent", now=T0)
    assert granted(s.cancel(K, "A", now=T0 + 1)) == ["P"]  # Esc, while a parent waits
    s.acquire("a", K, "A", "child", now=T0 + 2, resume=True)
    assert granted(s.release(K, "P", now=T0 + 3)) == ["B"]
    s = sched(agingAfterMs=500, agingAfterSlots=0, switchCost="dear")
    s.acquire("a", K, "A", "child", now=T0)
    s.acquire("c", K, "C", "child", now=T0)
    s.acquire("e", K, "E", "child", now=T0 + 900)
    s.acquire("p", K, "P", "parent", now=T0 + 1000)
    assert granted(s.release(K, "A", now=T0 + 1000)) == ["C"]  # C waited past its aging: not to the parent
    s.acquire("a", K, "A", "child", now=T0 + 1001, resume=True)
    assert granted(s.release(K, "C", now=T0 + 1002)) == ["P"]
    assert granted(s.release(K, "P", now=T0 + 1003)) == ["E"]  # E queued before A came back


def test_core_the_slot_given_back_to_the_one_that_gave_way_earns_the_giver_nothing() -> None:
    # B worked here before, so its first request on the slot is a return that answers A's probe;
    # B's gap then gives the slot back to A, which is no probe of B's own.
    later = HELD_MS
    s = sched(agingAfterMs=0, agingAfterSlots=0)
    s.usage(K, "B", 1000, 0)
    s.acquire("a", K, "A", "child", now=T0)
    s.usage(K, "A", 1000, 0)
    s.acquire("b", K, "B", "child", now=T0)
    s.acquire("c", K, "C", "child", now=T0)
    held, events = s.handback(K, "A", now=T0 + later)
    assert granted(events) == ["B"]
    s.acquire("a", K, "A", "child", now=T0 + later + 100, resume=True)
    s.usage(K, "B", 10, 1000)  # B's return
    held, events = s.handback(K, "B", now=T0 + later + 200)
    assert not held and granted(events) == ["A"]  # A back, ahead of C
    s.acquire("b", K, "B", "child", now=T0 + later + 300, resume=True)  # behind C
    assert granted(s.release(K, "A", now=T0 + later + 400)) == ["C"]


def test_core_a_session_whose_return_cannot_tell_earns_no_place_by_giving_way() -> None:
    # It never reported usage: its return would show nothing, so it queues again as anyone does.
    later = HELD_MS
    s = probed()
    s.acquire("a", K, "A", "parent", now=T0 + later + 100, resume=True)
    assert granted(s.release(K, "B", now=T0 + later + 200)) == ["C"]


def test_core_a_parent_that_gave_way_to_find_out_comes_back_at_once_ahead_of_the_other_parents() -> None:
    # Agents with nothing named are all parents: the one that gave way must come back, or its
    # return never tells, and the others wait out whole runs meanwhile.
    later = HELD_MS
    s = sched(agingAfterMs=0, agingAfterSlots=0)
    for name in "ABC":
        s.acquire(name.lower(), K, name, "parent", now=T0)
    s.usage(K, "A", 1000, 0)
    held, events = s.handback(K, "A", now=T0 + later)  # the probe
    assert not held and granted(events) == ["B"]
    s.acquire("a", K, "A", "parent", now=T0 + later + 500, resume=True)  # after its tool call
    s.usage(K, "B", 1000, 0)
    held, events = s.handback(K, "B", now=T0 + later + 600)  # B's first gap
    assert not held and granted(events) == ["A"]  # A is back at once, ahead of C who waited longer
    s.acquire("b", K, "B", "parent", now=T0 + later + 700, resume=True)  # B only gave it back: behind C
    s.usage(K, "A", 10, 1000)  # A's return: its context was kept
    (q,) = s.status(now=T0 + later + 800)
    assert q["affinity"]["returns"] == 1 and q["handbackYields"] == 2
    assert granted(s.release(K, "A", now=T0 + later + 900)) == ["C"]


def test_core_a_child_gives_way_to_a_child_in_a_gap_only_while_the_cost_is_unknown() -> None:
    for cost, gives in [("auto", True), ("dear", False), ("cheap", True)]:
        # (where switches are cheap, a switch is free: the cost rule's bound hands it over at once)
        s = sched(agingAfterMs=0, agingAfterSlots=0, switchCost=cost)
        s.acquire("a", K, "A", "child", now=T0)
        s.acquire("b", K, "B", "child", now=T0)
        held, events = s.handback(K, "A", now=T0 + 10 * HELD_MS)
        assert (granted(events) == ["B"]) is gives and held is not gives, cost


def test_core_a_spare_stream_in_a_gap_goes_only_to_a_parent_that_can_take_it() -> None:
    s = sched(agingAfterMs=0, agingAfterSlots=0)
    s.acquire("c", K, "C", "child", now=T0)
    assert s.acquire("p", K, "P", "parent", now=T0, spare=True)[0].holder.spare  # on the spare stream
    held, events = s.handback(K, "P", now=T0 + 3000)  # a probe
    assert held and events == []  # nobody waits
    assert granted(s.acquire("d", K, "D", "child", now=T0 + 3000)) == []  # a child: P keeps its stream
    events = s.acquire("q", K, "Q", "parent", now=T0 + 3000, spare=True)
    assert released(events) == [("P", "handback")] and granted(events) == ["Q"]
    (q,) = s.status(now=T0 + 3000)
    assert [(h["sessionKey"], h.get("spare", False)) for h in q["holders"]] == [("C", False), ("Q", True)]


def test_core_dead_time_in_a_gap_counts_only_while_someone_waits() -> None:
    s = sched(agingAfterMs=0, agingAfterSlots=0)
    s.acquire("h", K, "H", "parent", now=T0)
    s.handback(K, "H", now=T0 + 1000)
    s.acquire("c", K, "C", "child", now=T0 + 2000)  # a child: H keeps its slot through its gap
    s.beat(K, "H", now=T0 + 2500, busy=True)  # H's next request: its gap had a child waiting 0.5 s
    (q,) = s.status(now=T0 + 3000)
    assert q["deadMs"] == 500 and q["handbackYields"] == 0


# -- through Client ---------------------------------------------------------------------------------


def test_a_parent_session_hands_over_between_its_requests_to_a_waiting_parent() -> None:
    for d in started(config={"defaults": {"switchCost": "cheap"}}):
        with client_of(d) as client:
            s = client.session(K, "main", "parent", grace_ms=5000, spare=False)
            with s.run():
                with s.request():
                    pass
                sent = time.monotonic()
                other = Asker(client, "other")  # another parent, during main's tool call
                other.join(SOON + 0.5)
                assert not other.is_alive() and time.monotonic() - sent < SOON  # not the 5 s window
                assert d.holders(K) == ["other"] and d.queue(K)["handbackYields"] == 1
                threading.Timer(0.3, lambda: other.lease.release()).start()
                with s.request(timeout=10) as lease:  # queues again, and streams after the other
                    assert lease.held and d.holders(K) == ["main"]


def test_a_parent_session_keeps_its_window_from_a_child_between_its_requests() -> None:
    for d in started():
        with client_of(d) as client:
            s = client.session(K, "main", "parent", grace_ms=1500, spare=False)
            with s.run():
                with s.request():
                    pass
                child = Asker(client, "sub", "child")
                time.sleep(0.8)
                assert child.is_alive() and d.holders(K) == ["main"]  # inside its window: kept
                with s.request() as lease:  # its tool call came back in time: switch-free
                    assert lease.held
                assert d.queue(K)["grants"] == 1
            child.join(5.0)


def test_where_switches_are_dear_a_parent_session_keeps_its_window_from_a_parent_too() -> None:
    for d in started(config={"defaults": {"switchCost": "dear"}}):
        with client_of(d) as client:
            s = client.session(K, "main", "parent", grace_ms=3000, spare=False)
            with s.run():
                with s.request():
                    pass
                # its reply says what a switch costs here: 20k tokens, 40 s at the assumed rate, far
                # past the window (a small context would be handed over once its re-prefill is spent)
                s.usage(20_000, 0)
                wait_for(lambda: client.switch_cost(K) == "dear")
                time.sleep(0.5)  # a tool call: its window is 1.5 x 0.5 + 0.2 = 0.95 s
                with s.request():
                    time.sleep(HELD_MS / 1000)  # a long request: only dear keeps it now
                sent = time.monotonic()
                other = Asker(client, "other")
                time.sleep(0.5)
                assert other.is_alive() and d.holders(K) == ["main"]  # a re-prefill saved
                other.join(5.0)
                assert not other.is_alive() and time.monotonic() - sent < 0.95 + SOON  # after the window
                assert d.queue(K)["handbackYields"] == 0


def test_a_child_session_handed_back_in_its_gap_is_next_after_the_parent_ahead_of_other_children() -> None:
    # ``dear``: sub1 keeps its slot from sub2 (no probe), and still hands it back to a parent
    for d in started(config={"defaults": {"switchCost": "dear"}}):
        with client_of(d) as client:
            child = client.session(K, "sub1", "child", grace_ms=5000)
            with child.run():
                with child.request():
                    pass
                other = Asker(client, "sub2", "child")
                wait_for(lambda: d.waiting(K) == ["sub2"])
                parent = Asker(client, "main")
                parent.join(SOON + 0.5)
                assert not parent.is_alive() and d.holders(K) == ["main"]
                threading.Timer(0.3, lambda: parent.lease.release()).start()
                with child.request(timeout=10) as lease:
                    assert lease.held and d.holders(K) == ["sub1"] and other.is_alive()


def test_a_child_session_gives_way_to_a_child_at_its_first_gap_while_the_cost_is_unknown() -> None:
    for d in started(config={"defaults": {"agingAfterMs": 0, "agingAfterSlots": 0}}):
        with client_of(d) as client:
            a = client.session(K, "sub1", "child", grace_ms=5000)
            b = client.session(K, "sub2", "child", grace_ms=5000)
            b_in = threading.Event()

            def run_b() -> None:
                with b.run():  # queued behind sub1
                    with b.request():
                        b_in.set()
                        b.usage(1000, 0)
                    time.sleep(1.5)  # its tool call: sub1 comes back at this boundary

            with a.run():
                t = threading.Thread(target=run_b, daemon=True)
                with a.request():
                    a.usage(1000, 0)
                    t.start()
                    wait_for(lambda: d.waiting(K) == ["sub2"])
                assert b_in.wait(SOON + 0.5)  # sub2 gets the slot at sub1's first boundary
                assert d.queue(K)["handbackYields"] == 1
                with a.request(timeout=10) as lease:  # queued again; back at sub2's first boundary
                    assert lease.held and d.holders(K) == ["sub1"]
                    assert t.is_alive()  # sub2 is still in its tool call
                assert d.queue(K)["handbackYields"] == 2
            t.join(10)


def test_a_parent_session_that_gave_way_to_find_out_is_back_at_the_next_gap_ahead_of_other_parents() -> None:
    for d in started(config={"defaults": {"agingAfterMs": 0, "agingAfterSlots": 0}}):
        with client_of(d) as client:
            a = client.session(K, "A", "parent", grace_ms=5000, spare=False)
            b, c = d.peer(), d.peer()
            with a.run():
                b.send(acquire("B"))
                c.send(acquire("C"))
                wait_for(lambda: d.waiting(K) == ["B", "C"])
                with a.request():
                    a.usage(1000, 0)
                    time.sleep(HELD_MS / 1000)
                assert b.recv(SOON + 0.5)["op"] == "granted"  # its first gap: a probe
                b_usage = {"op": "usage", "queueKey": K, "sessionKey": "B", "prefilled": 1000, "reused": 0}
                threading.Timer(0.3, lambda: (b.ask(beat("B")), b.ask(b_usage), b.send(gap("B")))).start()
                with a.request(timeout=10) as lease:  # queued again: back at B's next gap, before C
                    assert lease.held and d.holders(K) == ["A"] and sorted(d.waiting(K)) == ["C"]
                    a.usage(10, 1000)  # its return: what the server kept
            wait_for(lambda: d.queue(K)["affinity"]["returns"] == 1)


# -- through the proxy, nothing named ----------------------------------------------------------------


def test_proxy_two_agents_with_nothing_named_take_turns_instead_of_waiting_out_each_others_tool_calls() -> None:
    from tests.kvsim import KVSim
    from tests.test_kvsim import payload, post, record

    for d in started():
        with KVSim(prefill_ms=0.05, decode_ms=2.0) as sim:
            client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
            proxy = lq.Proxy(sim.base, client=client, listen=("127.0.0.1", 0), grace_ms=3000)
            threading.Thread(target=proxy.serve_forever, args=(0.02,), daemon=True).start()
            port = proxy.server.server_address[1]
            try:
                def agent(name: str, turns: int, tool_s: float) -> None:
                    messages = [{"role": "system", "content": f"you are {name}"},
                                {"role": "user", "content": "go"}]
                    for turn in range(turns):
                        post(port, payload(messages, max_tokens=8), headers={"X-Agent": f"{name}-{turn}"})
                        messages = messages + [{"role": "assistant", "content": "ok"},  # a tool's output:
                                               {"role": "tool", "content": f"tool output {turn}"}]  # no person here
                        time.sleep(tool_s)

                a = threading.Thread(target=agent, args=("A", 6, 0.6))  # about 3 s of tool calls
                a.start()
                wait_for(lambda: any(r["who"] == "A-0" and r["end"] for r in sim.records), timeout=10)
                b = threading.Thread(target=agent, args=("B", 1, 0.0))
                b.start()
                a.join(30)
                b.join(30)
                first_b = record(sim, "B-0")
                last_a = record(sim, "A-5")
                # B's one request went between A's, in one of A's first gaps, not after A's whole
                # run (and its grace)
                assert first_b["end"] <= last_a["start"]
                assert first_b["start"] - record(sim, "A-0")["end"] < 2.0  # a tool call of A's, and margin
                assert d.queue(sim.base)["handbackYields"] >= 1
            finally:
                proxy.shutdown()
                client.close()
