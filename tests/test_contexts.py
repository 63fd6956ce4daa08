"""Where the server keeps only so many contexts (issue 13, "affinity that fits the server"): the
queue learns how many, and rotates the slot only among that many sessions.

A return's depth is how many other sessions reported usage since the session's own last report.
A return evicted at depth 1 (one other session ran) makes switches dear, as before.  One evicted
only deeper bounds how many contexts the server keeps (``contexts``, in ``status``'s
``affinity``): at most the depth; a return kept at depth d says at least d + 1, the later of two
that disagree winning.  Switches stay cheap within that bound.  The depth goes to the log's
``usage`` lines and the report uses it; the state file carries depths and contexts (additive).

A holder that parks between two requests, for a tool call, says so (``gap: true`` on the parked
renew; ``Lease.blocking(gap=True)``, and a ``Session``'s own gap parks and the proxy's do it).
Where the contexts are bounded, its slot goes to the waiter the queue would grant only if that
waiter's run pushes out no context still in use (a holder's, a waiter's, or one that gave way
in a tool-call gap no longer ago than the queue's tool calls take).  Otherwise a waiting child
whose context is kept goes instead, the one that waited longest; with none, the holder keeps the
slot.  A parent (whenever one waits), and a child past ``agingAfterMs``, goes first whatever it
costs, and on ``fifo`` queues the order stands; a parent that says ``background`` (no person
behind it) counts as a child here unless a parent without it waits (tests/test_background.py).
A child's park without ``gap`` (a run settled, a blocking tool) follows the same rule with its
own context counted as done with: its slot goes to the next waiter unless that one's run would evict
another context still in use, then to a waiting child whose context is kept, else it waits for
the one in use (at most as long as the queue's tool calls take).  Every park where the bound is
not known goes to the next waiter, as before, and so does a parent's park for good.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Dict, List, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llmqueue as lq
from tests.harness import short_tmpdir, started, wait_for
from tests.test_handover import client_of, log_lines

K = "http://127.0.0.1:8001/v1"
SOON = 1.0
T0 = 1000.0

# Children A and B came back after each other to kept contexts (cheap), then C came, and A came
# back after B and C to an evicted one: the server keeps two contexts.  The last to report were
# A, then C (the two kept), then B (evicted).
LESSON = (("A", 1000, 0), ("B", 1000, 0), ("A", 10, 1000), ("B", 10, 1010), ("C", 1000, 0), ("A", 1010, 0))


def sched(**defaults: Any) -> lq.Scheduler:
    cfg, errors, _ = lq.validate_config({"defaults": dict({"agingAfterMs": 0, "agingAfterSlots": 0}, **defaults)})
    assert not errors, errors
    return lq.Scheduler(lq.Addressing(cfg))


def taught(ms_per_token: Optional[float] = None, **defaults: Any) -> lq.Scheduler:
    """The lesson's queue; ``ms_per_token``: its server's prefill rate, timed (else assumed)."""
    s = sched(**defaults)
    for who, prefilled, reused in LESSON:
        s.usage(K, who, prefilled, reused, prefill_ms=None if ms_per_token is None else ms_per_token * prefilled)
    return s


def kept_for_c(**defaults: Any) -> lq.Scheduler:
    """The lesson's queue: C gave its slot to A in a tool-call gap (A's context is kept), then B
    queued, and A's own gap kept the slot, since B's run would evict C's context."""
    s = taught(**defaults)
    s.acquire("c", K, "C", "child", now=T0)
    s.acquire("a", K, "A", "child", now=T0)
    assert granted(s.park(K, "C", now=T0 + 10, gap=True)[1]) == ["A"]
    s.acquire("b", K, "B", "child", now=T0 + 20)
    assert s.park(K, "A", now=T0 + 30, gap=True) == (True, [])
    return s


def granted(events: List[lq.Event]) -> List[str]:
    return [e.holder.session for e in events if isinstance(e, lq.Granted)]


def affinity(s: lq.Scheduler) -> Dict[str, Any]:
    """The queue's ``affinity`` in ``status`` (which lists a queue once someone used it)."""
    if not [q for q in s.status(now=T0) if q["queueKey"] == K]:
        s.acquire("z", K, "Z", now=T0)
        s.release(K, "Z", now=T0)
    (q,) = [q for q in s.status(now=T0) if q["queueKey"] == K]
    return dict(q["affinity"])


# -- the pure core ------------------------------------------------------------------------------


def test_core_an_eviction_after_two_others_bounds_the_contexts_and_switches_stay_cheap() -> None:
    assert lq.switch_cost([1.0, 1.0, 0.0], "auto", ["A", "B", "A"], [1, 1, 2]) == "cheap"
    assert lq.switch_cost([1.0, 1.0, 0.0], "auto", ["A", "B", "A"], [1, 1, 1]) == "dear"
    assert lq.switch_cost([1.0, 1.0, 0.0], "auto", ["A", "B", "A"]) == "dear"  # no depths: each at 1
    assert lq.switch_cost([0.0, 0.0], "auto", ["A", "B"], [2, 3]) == "unknown"  # nothing kept yet
    assert lq.learned_contexts([1.0, 1.0], [1, 3]) is None  # nothing evicted: no bound
    assert lq.learned_contexts([1.0, 1.0, 0.0], [1, 1, 2]) == 2
    assert lq.learned_contexts([0.0, 0.0], [3, 2]) == 2
    assert lq.learned_contexts([0.0, 1.0], [2, 2]) == 3  # kept after two others, later: the later wins
    assert lq.learned_contexts([1.0], [1], 2) == 2  # a kept return within the bound changes nothing
    # with the bound known, one session's kept return is enough: the bound is what a second one shows
    assert lq.switch_cost([1.0, 0.0], "auto", ["A", "B"], [1, 2]) == "cheap"
    assert lq.switch_cost([1.0, 1.0], "auto", ["A", "A"], [1, 1], 2) == "cheap"
    assert lq.switch_cost([1.0, 1.0], "auto", ["A", "A"], [1, 1]) == "unknown"


OPEN = LESSON[:4] + (("C", 1000, 0), ("D", 1000, 0), ("A", 1020, 0))  # kept after one other, then
# A evicted after B, C and D: two or three contexts fit (on a real llama-server, two)


def open_bound(**defaults: Any) -> lq.Scheduler:
    s = sched(**defaults)
    for who, prefilled, reused in OPEN:
        s.usage(K, who, prefilled, reused)
    return s


def test_core_an_eviction_that_leaves_the_bound_open_shows_its_lower_end_too() -> None:
    """Returns kept after one other say two contexts fit at least; an eviction after three others
    says three at most.  The bound stays three, and ``status`` shows it open down to two, until
    a return settles it.  The lower end is over every return, not the latest few."""
    assert lq.contexts_floor([1.0, 1.0, 0.0], [1, 1, 3], 3) == 2
    assert lq.contexts_floor([1.0, 0.0], [2, 4], 4) == 3
    assert lq.contexts_floor([0.0], [3], 3) == 0  # nothing kept: no lower end
    assert lq.contexts_floor([1.0], [5], 3) == 3  # never above the bound learned since (contexts shrank)
    assert lq.contexts_floor([1.0], [1], None, 4) == 4  # one known before stands
    assert lq.learned_contexts([1.0, 1.0, 0.0], [1, 1, 3]) == 3  # the bound itself is what was shown
    s = open_bound()
    assert affinity(s)["contexts"] == 3 and affinity(s)["contextsAtLeast"] == 2
    s.usage(K, "C", 10, 1000)  # kept after D and A: three fit
    assert affinity(s)["contexts"] == 3 and "contextsAtLeast" not in affinity(s)
    s = sched()
    size = {"A": 1000, "B": 1000, "C": 1000}
    for who in "ABC":
        s.usage(K, who, 1000, 0)
    for who in "ABABABAB":  # A and B each kept after two others first, then after one, four times over
        s.usage(K, who, 10, size[who])
        size[who] += 10
    s.usage(K, "D", 1000, 0)
    s.usage(K, "E", 1000, 0)
    assert s.usage(K, "C", 1010, 0).depth == 4  # evicted after B, A, D and E
    assert affinity(s)["contexts"] == 4 and affinity(s)["contextsAtLeast"] == 3


@pytest.mark.parametrize("person", [True, False])
def test_core_an_open_bound_keeps_a_thinking_persons_context_by_its_lower_end_and_a_subagents_by_the_bound(
        person: bool) -> None:
    """Where two or three contexts fit, a waiter whose run would push out the third most recent
    waits if that is a thinking person's (three fitting, it is not pushed out; two, it is).  A
    subagent's context in its tool call goes by the bound: kept by the lower end, a third
    subagent waited behind an idle slot where three fit, with no return that could tell."""
    s = open_bound(leaseTtlMs=120_000, idleYieldMs=90_000)  # no lease ends before the look
    x = "P" if person else "X"
    assert granted(s.acquire("x", K, x, "parent" if person else "child", now=T0)) == [x]
    # a slow server (40 ms a token): a switch would cost more than the think time (the cost
    # rule's bound on the rules: a slot is kept no longer than a switch could cost at worst)
    s.usage(K, x, 1000, 0, prefill_ms=40_000)
    s.acquire("f", K, "F", "child", now=T0 + 10)
    held, events = s.park(K, x, now=T0 + 100, turn=person, gap=not person)  # F evicts D's, done with
    assert not held and granted(events) == ["F"]
    s.usage(K, "F", 1000, 0)
    s.acquire("g", K, "G", "child", now=T0 + 200)
    held, events = s.park(K, "F", now=T0 + 300, gap=True)  # G's run: the person's context, if two fit
    if not person:
        assert not held and granted(events) == ["G"]
        return
    assert held and events == []
    due = s.next_deadline()  # the person's think time (none known yet), from its turn's end
    assert due is not None and T0 + 100 + lq.THINK_DEFAULT_MS <= due <= T0 + 100 + lq.THINK_DEFAULT_MS + 2
    assert granted(s.sweep(now=due - 2)) == []
    assert granted(s.sweep(now=due)) == ["G"]


def test_core_an_open_bound_gives_the_slot_to_no_waiter_whose_run_would_push_a_thinking_persons_context_out(
        ) -> None:
    """The waiter kept out may be passed for one whose context is kept, but not for one kept
    only by the bound's upper end: two fitting, its run pushes the thinking person's out (seen
    on a real llama-server: the subagent granted instead re-prefilled, and the person's next turn
    too)."""
    s = open_bound(leaseTtlMs=120_000, idleYieldMs=90_000)
    s.acquire("p", K, "P", "parent", now=T0)
    s.usage(K, "P", 1000, 0)
    s.acquire("f", K, "F", "child", now=T0 + 10)
    assert granted(s.park(K, "P", now=T0 + 100, turn=True)[1]) == ["F"]
    s.usage(K, "F", 1000, 0)  # F, P, A the latest: A's kept if three fit, gone if two
    s.acquire("z", K, "Z", "child", now=T0 + 200)  # first in line: its run would evict A's, in use
    s.acquire("a", K, "A", "child", now=T0 + 210)
    held, events = s.park(K, "F", now=T0 + 300, gap=True)
    assert held and events == []
    assert granted(s.acquire("p", K, "P", "parent", now=T0 + 2000)) == ["P"]  # the person's next turn


def test_core_the_depth_of_each_return_goes_with_its_usage_and_the_bound_shows_in_status() -> None:
    s = sched()
    depths = [s.usage(K, who, prefilled, reused).depth for who, prefilled, reused in LESSON]
    assert depths == [None, None, 1, 1, None, 2]  # only returns have one
    assert affinity(s) == {"switchCost": "cheap", "returns": 3, "kept": 0.667, "contexts": 2}
    assert s.usage(K, "C", 10, 1000).depth == 1 and affinity(s)["contexts"] == 2  # kept within it
    assert s.usage(K, "B", 10, 1010).depth == 2 and affinity(s)["contexts"] == 3  # kept past it


def test_core_a_session_whose_prompt_shrank_started_a_new_conversation_and_is_no_return() -> None:
    """A conversation's prompt only grows, so a session that reports a shorter prompt than its
    last (a subagent named as before, on its next task) started over: its few reused tokens are
    no eviction, and what the queue learned stands."""
    s = taught()
    before = affinity(s)
    assert before == {"switchCost": "cheap", "returns": 3, "kept": 0.667, "contexts": 2}
    for who in ("C", "B", "A"):  # each one's next task: a fresh prompt, shorter than its last
        used = s.usage(K, who, 600, 2)
        assert used.kept is None and used.depth is None
    assert affinity(s) == before
    # ...and its next request is a return as any other: C's 602, kept after B and A
    back = s.usage(K, "C", 10, 602)
    assert back.kept == 1.0 and back.depth == 2 and affinity(s)["returns"] == 4


def test_core_a_gap_park_gives_the_slot_to_a_waiter_whose_context_is_kept_before_one_that_would_evict() -> None:
    s = taught()
    s.acquire("a", K, "A", "child", now=T0)
    s.acquire("b", K, "B", "child", now=T0)  # first in line, but its context is gone: its run evicts C's
    s.acquire("c", K, "C", "child", now=T0 + 1)  # kept, and in use
    held, events = s.park(K, "A", now=T0 + 10, gap=True)
    assert not held and granted(events) == ["C"]
    (q,) = s.status(now=T0 + 10)
    assert [w["sessionKey"] for w in q["waiting"]] == ["B"] and q["parkYields"] == 1


def test_core_a_gap_park_keeps_the_slot_while_the_only_waiter_would_evict_a_context_in_use() -> None:
    s = taught()
    s.acquire("c", K, "C", "child", now=T0)
    s.acquire("a", K, "A", "child", now=T0)
    held, events = s.park(K, "C", now=T0 + 10, gap=True)  # A's context is kept: A goes
    assert not held and granted(events) == ["A"]
    s.acquire("b", K, "B", "child", now=T0 + 20)
    held, events = s.park(K, "A", now=T0 + 30, gap=True)  # B's run would evict C's, and C comes back
    assert held and events == []
    events = s.acquire("c", K, "C", "child", now=T0 + 500)  # back from its tool call: it goes first
    assert granted(events) == ["C"]
    (q,) = s.status(now=T0 + 500)
    assert [w["sessionKey"] for w in q["waiting"]] == ["B"]


def test_core_a_context_given_up_in_a_gap_is_in_use_only_as_long_as_the_queues_tool_calls_take() -> None:
    s = kept_for_c()
    # no tool call is known on the queue: C's counts as in use for the grace, then as done with
    later = T0 + 10 + lq.GRACE_MS + 1
    events = s.acquire("d", K, "D", "child", now=later)  # any event of the queue looks again
    assert granted(events) == ["B"]


def test_core_a_persons_think_time_is_no_tool_call_and_does_not_lengthen_the_in_use_window() -> None:
    """The queue's tool calls take as long as its agents' gaps say: a child's 500 ms one makes a
    context given up in a gap in use for 950 ms (1.5x plus 0.2 s).  Where subagents are named, a
    parent that kept its slot through 2 s between its turns (a person's think time) adds nothing
    (counted, it would make the window the whole grace, and a holder keep its slot for a context
    long done with).  Where none is named, every agent is a parent, and its gaps count."""
    for person in (False, True):
        s = taught()
        s.acquire("x", K, "X", "child", now=T0)
        s.park(K, "X", now=T0 + 100, gap=True)  # nobody waits: kept
        assert s.beat(K, "X", now=T0 + 600)  # back from a 500 ms tool call
        s.release(K, "X", now=T0 + 700)
        if person:
            s.acquire("p", K, "P", "parent", now=T0 + 800)
            s.park(K, "P", now=T0 + 900, gap=True)  # the person thinks; nobody waits: kept
            assert s.beat(K, "P", now=T0 + 2900)  # the next turn
            s.release(K, "P", now=T0 + 3000)
        assert_in_use_for_950_ms(s, T0 + 4000)
    s = taught()
    s.acquire("x", K, "X", "parent", now=T0)
    s.park(K, "X", now=T0 + 100, gap=True)
    assert s.beat(K, "X", now=T0 + 600)  # an agent with nothing named: a 500 ms tool call
    s.release(K, "X", now=T0 + 700)
    s.acquire("c", K, "C", "parent", now=T0 + 4000, background=True)
    s.acquire("a", K, "A", "parent", now=T0 + 4000, background=True)
    assert granted(s.park(K, "C", now=T0 + 4010, gap=True)[1]) == ["A"]
    s.acquire("b", K, "B", "parent", now=T0 + 4020, background=True)
    assert s.park(K, "A", now=T0 + 4030, gap=True) == (True, [])
    assert granted(s.acquire("e", K, "E", "parent", now=T0 + 4010 + 960, background=True)) == ["B"]


def test_core_a_subagent_back_from_the_tool_call_it_gave_its_slot_up_for_tells_how_long_tool_calls_take() -> None:
    """Where every holder gives way at its gaps, nobody keeps a slot through one: the time from a
    child's hand-over in a gap to its next acquire is its tool call, and the queue's tool calls
    take that long (a context given up in a gap is in use for 1.5x plus 0.2 s, no longer the
    whole grace).  Not a person's where subagents are named: a parent that gave way between turns
    thought meanwhile.  Where none is named, every agent is a parent, and its gaps are what there
    is: they count."""
    for person in (False, True):
        s = taught()
        who, role = ("P", "parent") if person else ("X", "child")
        s.acquire("x", K, who, role, now=T0)
        s.acquire("y", K, "Y", "child", now=T0 + 50)
        assert granted(s.park(K, who, now=T0 + 100, gap=True)[1]) == ["Y"]  # gave way in its gap
        s.acquire("x", K, who, role, now=T0 + 600)  # back 500 ms later: queued behind Y
        s.release(K, "Y", now=T0 + 650)
        s.release(K, who, now=T0 + 700)
        if person:  # a person's gap may be think time, no tool call: the grace still
            t = T0 + 4000
            s.acquire("c", K, "C", "child", now=t)
            s.acquire("a", K, "A", "child", now=t)
            assert granted(s.park(K, "C", now=t + 10, gap=True)[1]) == ["A"]
            s.acquire("b", K, "B", "child", now=t + 20)
            assert s.park(K, "A", now=t + 30, gap=True) == (True, [])
            assert granted(s.acquire("e", K, "E", "child", now=t + 10 + 960)) == []  # C's in use
            assert granted(s.acquire("f", K, "F", "child", now=t + 10 + lq.GRACE_MS + 1)) == ["B"]
        else:
            assert_in_use_for_950_ms(s, T0 + 4000)
    s = taught()  # nothing named: parents only
    s.acquire("x", K, "X", "parent", now=T0)
    s.acquire("y", K, "Y", "parent", now=T0 + 50)
    assert granted(s.park(K, "X", now=T0 + 100, gap=True)[1]) == ["Y"]
    s.acquire("x", K, "X", "parent", now=T0 + 600)
    s.release(K, "Y", now=T0 + 650)
    s.release(K, "X", now=T0 + 700)
    assert_in_use_for_950_ms(s, T0 + 4000)


def assert_in_use_for_950_ms(s: lq.Scheduler, t: float, ms: float = 950) -> None:
    """C gives its slot to A in a tool-call gap at ``t + 10``; A's own gap keeps it from B, whose
    run would evict C's context, for as long as C's counts as in use: 950 ms (or ``ms``)."""
    s.acquire("c", K, "C", "child", now=t)
    s.acquire("a", K, "A", "child", now=t)
    assert granted(s.park(K, "C", now=t + 10, gap=True)[1]) == ["A"]  # C in its tool call
    s.acquire("b", K, "B", "child", now=t + 20)
    assert s.park(K, "A", now=t + 30, gap=True) == (True, [])  # kept: B's run would evict C's
    assert granted(s.acquire("d", K, "D", "child", now=t + 10 + ms - 10)) == []  # C's still in use
    assert granted(s.acquire("e", K, "E", "child", now=t + 10 + ms + 10)) == ["B"]  # done with


def test_core_a_tool_call_is_measured_from_its_gaps_start_however_late_the_hand_over() -> None:
    """The slot may change hands late in a gap (a parent came, or a context it was kept for is
    done with): the tool call runs from the holder's last request's end to its next acquire.  A
    child that handed back 900 ms into a 1,400 ms tool call: in use for 2,300 ms (1.5x plus
    0.2 s), not 950.  One kept 3 s for another's context, back 270 ms after the hand-over, was
    away past the grace: no tool call (counted, its 3.27 s would outweigh the 500 ms ones after
    it, and every context given up in a gap would count as in use for the whole grace)."""
    s = taught()
    s.acquire("x", K, "X", "child", now=T0)
    assert s.handback(K, "X", now=T0 + 100) == (True, [])  # its request ended; nobody waits
    assert granted(s.acquire("p", K, "P", "parent", now=T0 + 1000)) == ["P"]  # a parent takes it
    s.acquire("x", K, "X", "child", now=T0 + 1500)  # back: its tool call took 1,400 ms
    s.release(K, "P", now=T0 + 1600)
    s.release(K, "X", now=T0 + 1700)
    assert_in_use_for_950_ms(s, T0 + 5000, ms=2300)
    s = kept_for_c()  # A parked in its gap at T0 + 30, kept from B while C's context is in use
    assert granted(s.sweep(now=T0 + 10 + lq.GRACE_MS + 2)) == ["B"]  # C's done with: B goes
    s.acquire("a", K, "A", "child", now=T0 + 3300)  # 3.27 s since its gap began
    s.release(K, "B", now=T0 + 3400)
    s.release(K, "A", now=T0 + 3500)
    s.acquire("x", K, "X", "child", now=T0 + 4000)
    s.acquire("y", K, "Y", "child", now=T0 + 4050)
    assert granted(s.park(K, "X", now=T0 + 4100, gap=True)[1]) == ["Y"]
    s.acquire("x", K, "X", "child", now=T0 + 4600)  # a 500 ms tool call
    s.release(K, "Y", now=T0 + 4700)
    s.release(K, "X", now=T0 + 4800)
    assert_in_use_for_950_ms(s, T0 + 8000)


def test_core_the_sweep_looks_again_once_the_context_a_gap_was_kept_for_is_done_with() -> None:
    s = kept_for_c()
    due = s.next_deadline()
    assert due is not None and T0 + 10 + lq.GRACE_MS < due <= T0 + 10 + lq.GRACE_MS + 2
    assert granted(s.sweep(now=due - 2)) == []
    assert granted(s.sweep(now=due)) == ["B"]


def test_core_a_parents_park_for_good_is_never_kept_for_a_context_in_use() -> None:
    """As above, but the one whose run settles is a parent: a person's settle is never kept past
    its own rule (measured: kept for a subagent's context, a person's settles idled the slot for
    31% of an interactive run while the subagents waited)."""
    s = taught()
    s.acquire("c", K, "C", "child", now=T0)
    s.acquire("a", K, "A", "parent", now=T0)
    assert granted(s.park(K, "C", now=T0 + 10, gap=True)[1]) == ["A"]  # C in its tool call
    s.acquire("b", K, "B", "child", now=T0 + 20)
    held, events = s.park(K, "A", now=T0 + 30)
    assert not held and granted(events) == ["B"]


def test_core_a_probe_in_a_handback_gap_evicts_no_context_in_use_either() -> None:
    s = sched()
    for who in "ABCA":  # A came back after B and C to an evicted context: two fit, nothing kept yet
        s.usage(K, who, 1000, 0)
    assert affinity(s)["switchCost"] == "unknown" and affinity(s)["contexts"] == 2
    s.acquire("a", K, "A", "child", now=T0)
    s.acquire("b", K, "B", "child", now=T0)  # first in line: its run would evict C's context
    s.acquire("c", K, "C", "child", now=T0 + 1)
    held, events = s.handback(K, "A", now=T0 + 10)  # a probe, to find out: to C, whose context is kept
    assert not held and granted(events) == ["C"]
    assert [e.reason for e in events if isinstance(e, lq.Released)] == ["handback"]


def test_core_a_park_for_good_gives_its_slot_first_to_a_waiter_whose_context_is_kept() -> None:
    s = taught()
    s.acquire("a", K, "A", "child", now=T0)
    s.acquire("b", K, "B", "child", now=T0)
    s.acquire("c", K, "C", "child", now=T0 + 1)
    held, events = s.park(K, "A", now=T0 + 10)  # its run settled (or it waits on other agents)
    assert not held and granted(events) == ["C"]  # B's run would have evicted C's context
    s = taught()
    s.acquire("a", K, "A", "child", now=T0)
    s.acquire("b", K, "B", "child", now=T0)
    held, events = s.park(K, "A", now=T0 + 10)  # B evicts C's, which is no longer in use: B goes
    assert not held and granted(events) == ["B"]


def test_core_a_park_for_good_waits_for_a_context_in_its_tool_call_as_long_as_the_tool_calls_take() -> None:
    """A's run settles while C is in a tool call and B waits: B's run would evict C's context,
    which C needs back within its tool call.  A's slot waits for C (its context is done with, not
    C's): C's return takes it, or, with C not back once the queue's tool calls are over, B does."""
    s = taught()
    s.acquire("c", K, "C", "child", now=T0)
    s.acquire("a", K, "A", "child", now=T0)
    assert granted(s.park(K, "C", now=T0 + 10, gap=True)[1]) == ["A"]  # C in its tool call
    s.acquire("b", K, "B", "child", now=T0 + 20)
    assert s.park(K, "A", now=T0 + 30) == (True, [])  # for good: kept for C all the same
    back = s.acquire("c", K, "C", "child", now=T0 + 500)
    assert granted(back) == ["C"]
    assert [e.reason for e in back if isinstance(e, lq.Released)] == ["parked"]
    s = taught()
    s.acquire("c", K, "C", "child", now=T0)
    s.acquire("a", K, "A", "child", now=T0)
    s.park(K, "C", now=T0 + 10, gap=True)
    s.acquire("b", K, "B", "child", now=T0 + 20)
    assert s.park(K, "A", now=T0 + 30) == (True, [])
    # B goes when C's tool calls are over (``GRACE_MS`` from its gap, none timed yet), or sooner
    # once A's slot has idled what a switch could cost at worst: C's 1,000 tokens, at the assumed
    # rate, 2 s (the cost rule's bound on the rules)
    bound = T0 + 30 + 1000 * 1000.0 / lq.ASSUMED_PREFILL_TPS
    assert bound < T0 + 10 + lq.GRACE_MS
    due = s.next_exact()
    assert due is not None and bound - 2 <= due <= bound
    assert granted(s.sweep(now=due - 2)) == []
    assert granted(s.sweep(now=due)) == ["B"]
    slow = taught(ms_per_token=5.0)  # a server that prefills C's context in 5 s: the tool calls' end comes first
    slow.acquire("c", K, "C", "child", now=T0)
    slow.acquire("a", K, "A", "child", now=T0)
    slow.park(K, "C", now=T0 + 10, gap=True)
    slow.acquire("b", K, "B", "child", now=T0 + 20)
    assert slow.park(K, "A", now=T0 + 30) == (True, [])
    due = slow.next_deadline()
    assert due is not None and T0 + 10 + lq.GRACE_MS < due <= T0 + 10 + lq.GRACE_MS + 2
    assert granted(slow.sweep(now=due - 2)) == []
    assert granted(slow.sweep(now=due)) == ["B"]


def test_core_any_park_where_no_bound_is_known_goes_to_the_next_waiter() -> None:
    s = sched()
    for who, prefilled, reused in LESSON[:4] + (("C", 1000, 0),):  # cheap, nothing evicted yet
        s.usage(K, who, prefilled, reused)
    assert "contexts" not in affinity(s) and affinity(s)["switchCost"] == "cheap"
    s.acquire("a", K, "A", "child", now=T0)
    s.acquire("b", K, "B", "child", now=T0)
    s.acquire("c", K, "C", "child", now=T0 + 1)
    held, events = s.park(K, "A", now=T0 + 10, gap=True)
    assert not held and granted(events) == ["B"]


def test_core_where_switches_are_dear_a_gap_park_still_goes_to_the_next_waiter() -> None:
    # a session's window ran out before it parked: the spec's park, whatever the gap
    s = sched()
    for who, prefilled, reused in (("A", 1000, 0), ("B", 1000, 0), ("A", 1000, 0)):
        s.usage(K, who, prefilled, reused)
    assert affinity(s)["switchCost"] == "dear" and affinity(s)["contexts"] == 1
    s.acquire("a", K, "A", "child", now=T0)
    s.acquire("c", K, "C", "child", now=T0)
    held, events = s.park(K, "A", now=T0 + 10, gap=True)
    assert not held and granted(events) == ["C"]


def test_core_a_parent_and_an_aged_child_go_first_whatever_their_run_evicts() -> None:
    for last in ("parent", "aged"):
        s = kept_for_c(agingAfterMs=500)
        if last == "parent":
            assert granted(s.acquire("p", K, "P", "parent", now=T0 + 40)) == ["P"]
        else:  # B has waited its agingAfterMs
            assert granted(s.acquire("d", K, "D", "child", now=T0 + 20 + 500)) == ["B"]


def test_core_the_bound_and_the_depths_go_to_a_later_daemon_and_an_old_state_file_means_depth_1() -> None:
    s = taught()
    kept, depths = s.affinity_kept(), s.affinity_depths()
    assert kept == {K: [1.0, 1.0, 0.0]} and depths == {K: ([1, 1, 2], 2)}
    now = 1_800_000_000.0
    back, at, deep = lq.decode_state(lq.encode_state(kept, {K: now - 5}, depths), now)
    assert back == kept and deep == depths and at == {K: now - 5}
    later = lq.Scheduler()
    later.seed_affinity(back, deep)
    assert affinity(later)["switchCost"] == "cheap" and affinity(later)["contexts"] == 2
    # a state file of an older daemon has no depths: its eviction was a dear switch
    old = json.dumps({"version": 1, "affinity": {K: {"kept": [1.0, 1.0, 0.0], "at": now - 5}}}).encode()
    back, at, deep = lq.decode_state(old, now)
    assert deep == {K: ([], None)}
    older = lq.Scheduler()
    older.seed_affinity(back, deep)
    assert affinity(older)["switchCost"] == "dear"
    # malformed depths and contexts are dropped, the kept shares stay
    bad = json.dumps({"version": 1, "affinity": {K: {"kept": [1.0, 0.0], "at": now - 5, "depths": [1, "x"],
                                                     "contexts": -3}}}).encode()
    assert lq.decode_state(bad, now) == ({K: [1.0, 0.0]}, {K: now - 5}, {K: ([], None)})


# -- the wire -------------------------------------------------------------------------------------


def teach(peer: Any) -> None:
    for who, prefilled, reused in LESSON:
        assert peer.ask({"op": "usage", "queueKey": K, "sessionKey": who, "prefilled": prefilled,
                         "reused": reused})["op"] == "ok"


def held_for_c(d: Any) -> Any:
    """Over the socket: the lesson taught, C gave its slot to A in a tool-call gap; returns C's peer."""
    p, c = d.peer(), d.peer()
    teach(p)
    assert c.ask({"op": "acquire", "queueKey": K, "sessionKey": "C", "role": "child"})["op"] == "granted"
    assert d.queue(K)["affinity"] == {"switchCost": "cheap", "returns": 3, "kept": 0.667, "contexts": 2}
    c.ask({"op": "renew", "queueKey": K, "sessionKey": "C", "parked": True, "gap": True})
    return c


def test_a_gap_park_over_the_socket_keeps_the_slot_from_a_waiter_that_would_evict_a_context_in_use() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log, "agingAfterMs": 0, "agingAfterSlots": 0}}):
        c = held_for_c(d)
        a, b = d.peer(), d.peer()
        assert a.ask({"op": "acquire", "queueKey": K, "sessionKey": "A", "role": "child"})["op"] == "granted"
        b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "role": "child"})
        wait_for(lambda: d.waiting(K) == ["B"])
        reply = a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True, "gap": True})
        assert reply == {"op": "ok", "queueKey": K, "sessionKey": "A", "granted": True}  # kept: C comes back
        assert b.silent(0.3) and d.holders(K) == ["A"]
        reply = a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True})  # for good now:
        assert reply["granted"] is True and b.silent(0.3)  # A's context is done with, C's is not
        c.send({"op": "acquire", "queueKey": K, "sessionKey": "C", "role": "child"})  # back: C's
        assert c.recv(SOON)["op"] == "granted" and d.waiting(K) == ["B"]
        depths = [e.get("depth") for e in log_lines(log) if e["event"] == "usage"]
        assert depths == [None, None, 1, 1, None, 2]


def test_a_client_session_named_as_before_on_a_new_task_is_no_return_over_the_socket() -> None:
    """``Client.usage`` for a session whose prompt is shorter than its last: no ``kept`` in the
    log's usage line, and the queue's ``affinity`` (the switch cost, the bound) stays as taught."""
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        p = d.peer()
        teach(p)
        assert p.ask({"op": "acquire", "queueKey": K, "sessionKey": "Z"})["op"] == "granted"  # listed in status
        taught_as = {"switchCost": "cheap", "returns": 3, "kept": 0.667, "contexts": 2}
        assert d.queue(K)["affinity"] == taught_as
        with client_of(d) as client:
            client.status()  # connected: usage is never sent without a connection (it never blocks)
            for who in ("C", "B", "A"):  # each one's next task
                client.usage(K, who, 600, 2)
            wait_for(lambda: len([e for e in log_lines(log) if e["event"] == "usage"]) == len(LESSON) + 3)
            assert d.queue(K)["affinity"] == taught_as
            # the replies come back on their own (usage never blocks): the last one says cheap
            wait_for(lambda: client.switch_cost(K) == "cheap")
        fresh = [e for e in log_lines(log) if e["event"] == "usage"][len(LESSON):]
        assert [("kept" in e, "depth" in e) for e in fresh] == [(False, False)] * 3


def test_a_report_of_one_count_alone_is_a_return_whatever_its_size() -> None:
    """The usage op takes either count alone.  ``reused`` alone is no whole prompt, so it cannot
    say that the prompt is shorter: it is a return as before (C's 5 tokens of its 1,000, after
    A: an eviction after one other, so switches are dear)."""
    for d in started():
        p = d.peer()
        teach(p)
        reply = p.ask({"op": "usage", "queueKey": K, "sessionKey": "C", "reused": 5})
        assert reply["op"] == "ok" and reply["switchCost"] == "dear"


def test_a_bad_gap_field_is_an_error_reply_that_changes_nothing() -> None:
    for d in started():
        a, b = d.peer(), d.peer()
        assert a.ask({"op": "acquire", "queueKey": K, "sessionKey": "A"})["op"] == "granted"
        b.send({"op": "acquire", "queueKey": K, "sessionKey": "B"})
        wait_for(lambda: d.waiting(K) == ["B"])
        for bad in ("yes", 1, [True]):
            reply = a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True, "gap": bad})
            assert reply["op"] == "error" and "gap must be true or false" in reply["reason"]
        assert d.holders(K) == ["A"] and d.waiting(K) == ["B"]


# -- Client ---------------------------------------------------------------------------------------


def test_a_sessions_own_gap_park_says_gap_and_keeps_the_slot_for_a_context_in_use() -> None:
    for d in started(config={"defaults": {"agingAfterMs": 0, "agingAfterSlots": 0}}):
        held_for_c(d)
        with client_of(d) as client:
            client.status()  # connected: a usage report goes out only then
            client.usage(K, "A", 10, 1010)  # A's own report: its reply tells the client "cheap"
            wait_for(lambda: client.switch_cost(K) == "cheap")
            a = client.session(K, "A", "child", grace_ms=5000)
            b = d.peer()
            with a.run():
                with a.request():
                    b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "role": "child"})
                    wait_for(lambda: d.waiting(K) == ["B"])
                # its gap: cheap, so it parks at once, saying gap: B's run would evict C's context
                assert b.silent(0.5) and d.holders(K) == ["A"]


def test_a_blocking_lease_says_gap_only_when_asked() -> None:
    """C's is the oldest context kept, and B's run would evict it: parked for a tool call, C keeps
    its slot (its context is in use); parked for good, B is granted."""
    for gap, holds in ((True, ["C"]), (False, ["B"])):
        for d in started(config={"defaults": {"agingAfterMs": 0, "agingAfterSlots": 0}}):
            with client_of(d) as client:
                client.status()
                for who, prefilled, reused in LESSON:
                    client.usage(K, who, prefilled, reused)
                b = d.peer()
                lease = client.acquire(K, "C", "child", activity=True)
                wait_for(lambda: d.queue(K).get("affinity", {}).get("contexts") == 2)
                b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "role": "child"})
                wait_for(lambda: d.waiting(K) == ["B"])
                with lease.blocking(gap=gap):
                    wait_for(lambda: d.queue(K)["parkYields"] == (not gap) and d.holders(K) == holds,
                             timeout=SOON + 1)
                    time.sleep(0.3)
                    assert d.holders(K) == holds
                lease.release()


def test_a_gap_park_that_becomes_a_park_for_good_is_sent_again() -> None:
    """A lease parked for a tool call (kept: B's run would evict its own context, C's) that then
    blocks on another agent as well is parked for good: the client says so again, and B is granted."""
    for d in started(config={"defaults": {"agingAfterMs": 0, "agingAfterSlots": 0}}):
        teach(d.peer())
        with client_of(d) as client:
            lease = client.acquire(K, "C", "child", activity=True)
            b = d.peer()
            b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "role": "child"})
            wait_for(lambda: d.waiting(K) == ["B"])
            with lease.blocking(gap=True):
                assert b.silent(0.5) and d.holders(K) == ["C"]  # parked, and kept for its own context
                with lease.blocking():  # now it waits on another agent too: for good
                    assert b.recv(SOON + 1)["op"] == "granted"
                    assert d.holders(K) == ["B"]
            lease.release()


# -- the pure core, whatever happens ----------------------------------------------------------------

SESSIONS = ["s0", "s1", "s2", "s3", "s4"]
CONNS = ["c0", "c1", "c2"]
op_strategy = st.one_of(
    # "background": a parent with no person behind it (tests/test_background.py)
    st.tuples(st.just("acquire"), st.sampled_from(CONNS), st.sampled_from(SESSIONS),
              st.sampled_from(lq.ROLES + ("background",))),
    st.tuples(st.just("release"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("cancel"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("disconnect"), st.sampled_from(CONNS)),
    st.tuples(st.just("park"), st.sampled_from(SESSIONS), st.booleans()),
    st.tuples(st.just("beat"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("usage"), st.sampled_from(SESSIONS), st.booleans()),
    st.tuples(st.just("wait"), st.integers(1, 5000)),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 2), st.booleans(), st.lists(op_strategy, max_size=60))
def test_property_the_rotation_among_kept_contexts_never_loses_a_waiter_or_overfills_a_slot(
        max_streams: int, lesson: bool, ops: List[Any]) -> None:
    """From a fresh queue, or one taught the lesson (s0, s1, s2 for A, B, C).  With usage reports (kept or evicted contexts) and gap parks among the operations: holders
    never exceed maxStreams, every pending acquire waits exactly once, a free slot never
    coexists with a waiter, nor does a holder parked without ``gap`` unless the contexts are
    bounded and one that gave way in a gap is still in its tool call (the grace at most); a grant
    out of tier-then-FIFO order goes only to a child or a background parent, while only such
    wait, in the hand-over of a parked holder."""
    s = sched(maxStreams=max_streams)
    if lesson:
        for who, prefilled, reused in LESSON:
            s.usage(K, {"A": "s0", "B": "s1", "C": "s2"}[who], prefilled, reused)
    pending: Dict[str, set] = {}
    held: set = set()
    tier: Dict[str, str] = {}
    background: Dict[str, bool] = {}  # of a waiter: cleared by an acquire without it
    enq: Dict[str, int] = {}
    order = 0
    now = T0
    parked: Dict[str, bool] = {}  # holder -> parked in a gap
    away: Dict[str, float] = {}  # gave its slot up in a gap park, and when
    prompt: Dict[str, int] = {}  # each session's prompt so far, in tokens
    if lesson:
        for who, prefilled, reused in LESSON:
            prompt[{"A": "s0", "B": "s1", "C": "s2"}[who]] = prefilled + reused
    for op in ops:
        now += 1
        if op[0] == "wait":
            now += op[1]
            continue
        if op[0] == "usage":  # a prompt grows by 10 a request: kept, or all of it prefilled again
            size = prompt.get(op[1], 990)
            s.usage(K, op[1], 10, size) if op[2] else s.usage(K, op[1], size + 10, 0)
            prompt[op[1]] = size + 10
            continue
        if op[0] == "park":
            still, events = s.park(K, op[1], now=now, gap=op[2])
            if op[1] in held:
                parked[op[1]] = op[2]
            else:
                assert (still, events) == (False, [])
        elif op[0] == "beat":
            assert s.beat(K, op[1], now=now) == (op[1] in held)
            parked.pop(op[1], None)
            events = []
        elif op[0] == "acquire":
            _, conn, session, role = op
            said = role == "background"
            role = "parent" if said else role
            if session not in held:  # before the acquire, whose grant may come at once
                if session not in pending:
                    order += 1
                    enq[session] = order
                    tier[session] = role
                    background[session] = said
                background[session] = background[session] and said
                pending.setdefault(session, set()).add(conn)
            events = s.acquire(conn, K, session, role, now=now, background=said)
            parked.pop(session, None)
            away.pop(session, None)
        elif op[0] == "release":
            events = s.release(K, op[1], now=now)
        elif op[0] == "cancel":
            events = s.cancel(K, op[1], now=now)
            pending.pop(op[1], None)
        else:
            events = s.disconnect(op[1], now=now)
            for session in list(pending):
                pending[session].discard(op[1])
                if not pending[session]:
                    del pending[session]
        park_yield = any(isinstance(e, lq.Released) and e.reason == "parked" for e in events)
        for e in events:
            if isinstance(e, (lq.Released, lq.Evicted)):
                held.discard(e.holder.session)
                if isinstance(e, lq.Released) and e.reason == "parked" and parked.get(e.holder.session):
                    away[e.holder.session] = now
                parked.pop(e.holder.session, None)
        for g in [e for e in events if isinstance(e, lq.Granted) and e.new]:
            session = g.holder.session
            if g.switch:
                best = min(pending, key=lambda x: (lq.ROLES.index(tier[x]), enq[x]))
                # out of order only a child or a background parent, while only such wait, where a
                # park handed over
                def unwatched(x: str) -> bool:
                    return tier[x] == "child" or background[x]
                assert session == best or park_yield and all(unwatched(x) for x in pending), \
                    (session, best, pending)
            assert session not in held
            held.add(session)
            pending.pop(session, None)
        (q,) = s.status(now=now) or [{"holders": [], "waiting": []}]
        hs = [h["sessionKey"] for h in q["holders"]]
        ws = [w["sessionKey"] for w in q["waiting"]]
        assert len(hs) <= max_streams and set(hs) == held
        assert sorted(ws) == sorted(pending) and len(ws) == len(set(ws))
        assert not (ws and len(hs) < max_streams)
        if ws and any(not gap for gap in parked.values()):  # a park for good kept for a context in use
            assert affinity(s).get("contexts") is not None, (ws, parked)
            assert any(now - t <= lq.GRACE_MS for x, t in away.items() if x not in held), (ws, parked, away)


def test_core_while_a_parent_waits_and_on_fifo_queues_the_contexts_change_no_order() -> None:
    s = kept_for_c()  # A keeps its slot in its gap: B's run would evict C's context
    s.acquire("p", K, "P", "parent", now=T0 + 40)
    (q,) = s.status(now=T0 + 40)
    assert [h["sessionKey"] for h in q["holders"]] == ["P"]  # the parent got it
    s = taught(policy="fifo")
    s.acquire("a", K, "A", "child", now=T0)
    s.acquire("b", K, "B", "child", now=T0)
    s.acquire("c", K, "C", "child", now=T0 + 1)
    assert granted(s.park(K, "A", now=T0 + 10, gap=True)[1]) == ["B"]  # fifo: the order stands


def test_core_on_a_queue_of_more_streams_an_eviction_is_no_bound() -> None:
    s = sched(maxStreams=2)
    for who, prefilled, reused in LESSON:
        s.usage(K, who, prefilled, reused)
    assert affinity(s)["switchCost"] == "dear" and affinity(s)["contexts"] == 1
