"""One rule for an idle slot, in the server's own seconds (issue 33): the cost model.  It decides
where ``holdRule`` is ``cost``; by default it bounds the rules in force at the most a switch can
cost (the largest contexts still in use, but the waiter's, that fill the room a switch makes);
either way ``status`` shows it and it is logged.

An idle holder that someone waits for is kept while the idle time spent is below what a switch
would cost: the re-prefill of the contexts still in use that the waiter's run pushes out of what
the server keeps, priced at the server's own prefill rate (``prefillMs`` on the usage op, from
llama.cpp's ``timings.prompt_ms`` or the time to a stream's first token), or at the assumed rate
until one is reported.  Nothing known of the contexts' sizes: the seed's rule, keep it.

Pinned in the pure core (``hold_cost``, ``HoldCost``): each input's effect, and the guarantee
that the rule never keeps an idle slot past its switch's cost (ski rental: at most twice the
hindsight's best).  Through the socket: ``prefillMs`` is accepted and checked; ``status`` shows
both sides for an idle holder with a waiter, and ``llmqueue status`` says them in words; the log's
dead spells and hand-overs carry the figures; the proxy reports the server's prefill time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import llmqueue as lq
from tests.harness import MODULE, ROOT, short_tmpdir, started, wait_for
from tests.stub import StubEndpoint

K = "http://127.0.0.1:8001/v1"
ASSUMED_MS = 1000.0 / lq.ASSUMED_PREFILL_TPS  # ms per token before the server reports a time


def record(*reports: tuple, room: Optional[int] = None, cap: Optional[int] = None) -> lq._Affinity:
    """A switch record from usage reports: (session, prefilled, reused[, prefill_ms]); ``room``:
    the tokens the server was seen to keep, ``cap``: to lose."""
    a = lq._Affinity()
    for session, prefilled, reused, *ms in reports:
        a.report(session, prefilled, reused)
        a.timed(prefilled, ms[0] if ms else None)
    if room is not None:
        a.room = room
    a.room_cap = cap
    return a


def never(session: str) -> bool:
    return False


def always(session: str) -> bool:
    return True


# -- the pure core ---------------------------------------------------------------------------------


def test_with_no_context_size_known_the_seeds_rule_stands_keep_the_slot() -> None:
    for a in (None, record(("X", 100, 0))):
        cost = lq.hold_cost(a, "auto", "H", "W", always, idle_ms=60_000)
        assert cost.tokens is None and cost.switch_ms is None and not cost.hand_over
        assert cost.explain().startswith("keeping: no context sizes reported")


def test_where_the_server_keeps_every_context_the_slot_is_handed_over_at_once() -> None:
    cost = lq.hold_cost(record(("H", 4000, 0)), "cheap", "H", "W", always, idle_ms=0)
    assert (cost.tokens, cost.switch_ms, cost.hand_over) == (0, 0.0, True)
    assert cost.explain().startswith("handing over: switching re-prefills nothing")


def test_not_knowing_what_the_server_keeps_the_holders_context_is_priced_at_the_assumed_rate() -> None:
    a = record(("H", 4200, 0))
    keep = lq.hold_cost(a, "auto", "H", "W", always, idle_ms=1000)
    assert keep.tokens == 4200 and keep.switch_ms == pytest.approx(4200 * ASSUMED_MS) and not keep.measured
    assert not keep.hand_over
    assert keep.explain() == (f"keeping: switching would re-prefill 4.2k tokens, about {4200 * ASSUMED_MS / 1000:.1f} s, "
                              f"at an assumed {lq.ASSUMED_PREFILL_TPS:.0f} tokens/s (what the server keeps is not known "
                              "yet: the holder's context is assumed pushed out); idle 1.0 s so far")
    assert lq.hold_cost(a, "auto", "H", "W", always, idle_ms=4200 * ASSUMED_MS).hand_over


def test_the_servers_own_prefill_time_prices_the_switch() -> None:
    """A GPU that prefills 20k tokens/s re-prefills 4k tokens in 0.2 s: the slot is kept that long,
    not a CPU's seconds."""
    a = record(("H", 4000, 0, 200.0), ("X", 6000, 0, 300.0))  # 0.05 ms a token
    cost = lq.hold_cost(a, "auto", "H", "W", always, idle_ms=150)
    assert cost.measured and cost.switch_ms == pytest.approx(200.0) and not cost.hand_over
    assert lq.hold_cost(a, "auto", "H", "W", always, idle_ms=200).hand_over
    slow = record(("H", 4000, 0, 40_000.0))  # a slow CPU: 10 ms a token
    assert lq.hold_cost(slow, "auto", "H", "W", always, idle_ms=30_000).switch_ms == pytest.approx(40_000)


def test_where_the_server_keeps_so_many_tokens_only_contexts_in_use_that_the_waiters_run_pushes_out_count() -> None:
    """The server keeps the latest context whole in its slot (H's, the holder's) and the others in
    a host cache of ``room`` tokens, the most recently used first: here P (5,000) of 6,500, and not
    W (3,000) behind it.  W's run puts H's context in front of P's (6,000: kept); H, back, puts
    W's there (8,000): P is pushed out, which costs P's re-prefill if P is in use."""
    a = record(("W", 3000, 0), ("P", 5000, 0), ("H", 1000, 0), room=6500, cap=7000)
    in_use = lq.hold_cost(a, "auto", "H", "W", lambda s: s in ("H", "P"), idle_ms=0)
    assert in_use.tokens == 5000 and "seen to keep 6.5k tokens of contexts beside its slot's and lost 7.0k" in in_use.why
    done = lq.hold_cost(a, "auto", "H", "W", lambda s: s == "H", idle_ms=0)
    assert done.tokens == 0 and done.hand_over  # P is done with: nothing to re-prefill
    # a waiter whose context is kept pushes nothing out: P's run, and H's return, leave W as lost as it was
    assert lq.hold_cost(a, "auto", "H", "P", always, idle_ms=0).tokens == 0
    # a holder's context larger than the host cache is lost once it leaves the slot
    big = record(("W", 3000, 0), ("H", 4000, 0), room=3500, cap=3600)
    assert lq.hold_cost(big, "auto", "H", "W", always, idle_ms=0).tokens == 4000
    # room for every context in use: the switch is free
    assert lq.hold_cost(record(("W", 3000, 0), ("H", 1000, 0), room=4000), "auto", "H", "W", always, 0).hand_over
    # the larger of the two contexts swapped goes in front: W's (3,000) pushes P (2,000) out of
    # 4,500; a waiter never seen counts as the middle of the known sizes (2,000), and does not
    mid = record(("W", 3000, 0), ("P", 2000, 0), ("H", 1000, 0), room=4500, cap=4600)
    assert lq.hold_cost(mid, "auto", "H", "W", always, idle_ms=0).tokens == 2000
    assert lq.hold_cost(mid, "auto", "H", "N", always, idle_ms=0).tokens == 0
    # the queue's switchCost, where someone set it, stands: dear prices the holder's context
    assert lq.hold_cost(record(("W", 3000, 0), ("H", 1000, 0), room=4000), "dear", "H", "W", always, 0).tokens == 1000


def test_a_room_seen_only_as_kept_prices_growth_past_it_by_its_chance_not_as_an_eviction() -> None:
    """Contexts grow with every request, so the next switch nearly always needs a little more than
    the server was seen to keep.  Until it was seen to lose one, twice the room is kept with the
    chance 1/2 (scale-free): P, pushed from 5,000 to 8,000 tokens back, is lost with the chance
    1 - 6,500/8,000, and the price is that share of its re-prefill."""
    a = record(("W", 3000, 0), ("P", 5000, 0), ("H", 1000, 0), room=6500)
    cost = lq.hold_cost(a, "auto", "H", "W", always, idle_ms=0)
    assert cost.tokens == round(5000 * (1 - 6500 / 8000))
    assert cost.switch_ms == pytest.approx(5000 * (1 - 6500 / 8000) * ASSUMED_MS)
    # a little growth past the room: a little price, where a room taken as exact priced it whole
    grown = record(("W", 3000, 0), ("H", 4000, 0), room=3900)
    assert lq.hold_cost(grown, "auto", "H", "W", always, 0).tokens == round(4000 * (1 - 3900 / 4000))
    # once the server was seen to lose a context, nothing past the room seen is counted on
    assert lq.hold_cost(record(("W", 3000, 0), ("H", 4000, 0), room=3900, cap=8000),
                        "auto", "H", "W", always, 0).tokens == 4000


@given(room=st.integers(1, 10**6), cap=st.one_of(st.none(), st.integers(1, 10**6)),
       a=st.integers(0, 3 * 10**6), b=st.integers(0, 3 * 10**6))
def test_the_chance_a_server_keeps_tokens_falls_with_them_from_sure_at_the_room(
        room: int, cap: Optional[int], a: int, b: int) -> None:
    lo, hi = min(a, b), max(a, b)
    p_lo, p_hi = lq.kept_chance(lo, room, cap), lq.kept_chance(hi, room, cap)
    assert 0.0 <= p_hi <= p_lo <= 1.0
    assert lq.kept_chance(room, room, cap) == 1.0
    assert lq.kept_chance(room + 1, room, cap) == (0.0 if cap is not None else room / (room + 1))


def test_a_switch_prices_every_run_before_the_holder_is_back() -> None:
    """A holder that hands over queues again behind whoever waits (``then``): each of their runs
    puts another context in front of its own.  H (2,500) beside W's run alone is kept in a host
    cache of 4,000; behind W's and X's, the cache holds W's and H's and not X's, which is then
    pushed out before its own run, and H's once X's run puts W's in front."""
    a = record(("W", 2000, 0), ("X", 2000, 0), ("H", 2500, 0), room=4000, cap=4100)
    assert lq.hold_cost(a, "auto", "H", "W", always, idle_ms=0, then=()).tokens == 2000  # X's, behind H's and W's
    behind = lq.hold_cost(a, "auto", "H", "W", always, idle_ms=0, then=("X",))
    assert behind.tokens == 2500 + 2000
    assert "the runs before the holder's return" in behind.why
    # a holder done with its context (not in use) costs nothing of its own
    assert lq.hold_cost(a, "auto", "H", "W", lambda s: s != "H", idle_ms=0, then=("X",)).tokens == 2000
    # where everything fits, nothing
    assert lq.hold_cost(record(("W", 2000, 0), ("X", 2000, 0), ("H", 2500, 0), room=7000, cap=9000),
                        "auto", "H", "W", always, idle_ms=0, then=("X",)).tokens == 0


def test_what_the_server_keeps_is_learned_in_tokens_from_the_returns() -> None:
    """A session back on the slot after others ran: the slot held the last of them, and its host
    cache its context and the others' since, in tokens: kept (the cache holds at least that) or
    not (it holds less).  The later of two that disagree wins."""
    a = record(("A", 1000, 0), ("B", 2000, 0))
    assert a.room is None and a.room_cap is None  # no return yet: nothing known
    a.report("A", 100, 1000)  # A back, all 1,000 kept, after B's 2,000 (in the slot)
    assert (a.room, a.room_cap) == (1000, None)
    a.report("C", 4000, 0)
    a.report("B", 2100, 0)  # B (2,000) back after A (1,100) and C (4,000, in the slot): evicted
    assert (a.room, a.room_cap) == (1000, 3100)
    a.report("D", 500, 0)
    a.report("A", 100, 1100)  # A (1,100) back after C, B (2,100) and D (in the slot): kept
    assert (a.room, a.room_cap) == (7200, None)  # it kept more than the eviction said: that cap goes
    a.report("D", 1500, 0)  # D (500) evicted behind A (1,200, in the slot) alone: less than the room said
    assert (a.room, a.room_cap) == (None, 500)
    # a shorter prompt is a new conversation: it tells nothing
    b = record(("A", 1000, 0), ("B", 2000, 0))
    b.report("A", 10, 0)
    assert (b.room, b.room_cap) == (None, None)


@given(tokens=st.integers(0, 10**6), ms_per_token=st.floats(0.001, 100.0),
       idle=st.floats(0, 10**7), more=st.floats(0, 10**7))
def test_the_rule_never_keeps_an_idle_slot_past_its_switch_cost(tokens: int, ms_per_token: float,
                                                                 idle: float, more: float) -> None:
    """Ski rental: the verdict turns to hand over exactly when the idle time reaches the switch's
    cost, and stays so; a free switch is handed over at once."""
    a = record(("H", tokens, 0, tokens * ms_per_token) if tokens else ("H", 0, 0))
    cost = lq.hold_cost(a, "auto", "H", "W", always, idle)
    assert cost.switch_ms is not None
    assert cost.hand_over == (idle >= cost.switch_ms)
    if cost.hand_over:
        assert lq.hold_cost(a, "auto", "H", "W", always, idle + more).hand_over
    if tokens == 0:
        assert cost.hand_over


def release_of(log: str, session: str) -> Dict[str, Any]:
    """The one ``release`` line of ``session`` in the event log, once it is written."""
    (release,) = wait_for(lambda: [e for e in lq.read_event_log([log])
                                   if e["event"] == "release" and e["sessionKey"] == session])
    return dict(release)


def _granted_to(events: List[Any], session: str) -> bool:
    return any(isinstance(e, lq.Granted) and e.holder.session == session for e in events)


def worst_switch(sizes: Dict[str, int], holder: str, waiter: str, in_use: List[str]) -> int:
    """The most one switch can push out of a server's cache, as the bound prices it: the waiter's
    context comes in and the holder's is put aside, so room is made for the larger of the two
    (a waiter never reported counts as the largest context seen), and a server drops whole
    contexts, so the dearest ones still in use (not the waiter's) count until they fill it.  A
    holder never reported, done with its context, counts as the largest seen too."""
    largest = max(sizes.values())
    swapped = max(sizes.get(holder, largest), sizes.get(waiter, largest))
    tokens = 0
    for size in sorted((sizes[s] for s in in_use if s != waiter), reverse=True):
        if tokens >= swapped:
            break
        tokens += size
    return tokens


def test_the_most_a_switch_can_cost_is_the_largest_contexts_in_use_filling_the_room_it_makes() -> None:
    """Six subagents of 1,000 to 1,500 tokens, all in use: a switch from H (1,200) to W (1,000)
    makes room for 1,200 tokens, so at worst it pushes out the largest context in use but W's
    (1,500), not all five of the others.  A waiter whose context is larger makes more room."""
    a = record(("H", 1200, 0, 120.0), ("W", 1000, 0, 100.0), ("A", 1500, 0, 150.0), ("B", 1100, 0, 110.0),
               ("C", 1000, 0, 100.0), ("D", 1000, 0, 100.0), ("BIG", 2000, 0, 200.0))
    in_use = {"H", "W", "A", "B", "C", "D"}.__contains__
    cost = lq.hold_cost(a, "rules", "H", "W", in_use, 0.0)
    assert cost.tokens == 1500 and cost.switch_ms == pytest.approx(150.0)
    cost = lq.hold_cost(a, "rules", "H", "A", in_use, 0.0)  # room for A's 1,500: two contexts go
    assert cost.tokens == 1200 + 1100
    cost = lq.hold_cost(a, "rules", "H", "NEW", in_use, 0.0)  # never reported: the largest seen, 2,000
    assert cost.tokens == 1500 + 1200
    assert lq.hold_cost(a, "rules", "H", "W", never, 0.0).tokens == 0  # nothing in use: free
    # a holder that never reported, done with the slot (it took it and made no request): the
    # room counts it as the largest seen; one still in use cannot be priced, and the rules decide
    assert lq.hold_cost(a, "rules", "NEW", "W", in_use, 0.0).tokens == 1500 + 1200
    assert lq.hold_cost(a, "rules", "NEW", "W", always, 0.0).switch_ms is None
    assert lq.hold_cost(lq._Affinity(), "rules", "NEW", "W", in_use, 0.0).switch_ms is None  # none seen


@given(role=st.sampled_from(["parent", "child"]), waiter_role=st.sampled_from(["parent", "child"]),
       how=st.sampled_from(["busy", "gap", "turn", "handback", "done"]),
       tokens=st.one_of(st.none(), st.integers(0, 40_000)),
       other=st.integers(0, 20_000), waiter_tokens=st.one_of(st.none(), st.integers(1, 40_000)),
       ms_per_token=st.floats(0.01, 1.0), waiter_after=st.floats(0, 5_000),
       switch=st.sampled_from(["auto", "dear"]))
def test_under_the_default_rules_an_idle_slot_goes_once_it_idled_what_a_switch_could_cost_at_worst(
        role: str, waiter_role: str, how: str, tokens: Optional[int], other: int, waiter_tokens: Optional[int],
        ms_per_token: float, waiter_after: float, switch: str) -> None:
    """The bound the cost rule puts on the rules in force (``holdRule: rules``, the default): however
    a holder went idle (a ``busy: false`` beat, a park for a tool call or a person's turn, a
    handback between two requests, a park for good), whatever its role and the waiter's, the waiter
    is granted no later than the idle time reaches what the dearest switch would cost
    (``worst_switch``): of the contexts still in use but the waiter's (the holder's, not where it
    parked for good: it is done with it; another waiter's behind), the largest, until they fill
    the room the switch makes, at the server's rate, timed to the millisecond, not to the sweep's
    next tick.  Where that is nothing, at once.  Ski rental against the dearest switch; the rules
    hand over sooner where they know more.  A holder that never reported its context (``tokens``
    None: it took the slot and made no request) and parked for good is bounded so too, where
    others did (one still in use is not: its size is not known, and the rules alone decide)."""
    assume(tokens is not None or how == "done" and (other or waiter_tokens is not None))
    config, errors, _ = lq.validate_config({"defaults": {"switchCost": switch}})
    assert errors == []
    s = lq.Scheduler(lq.Addressing(config))
    assert _granted_to(s.acquire("h", K, "H", role, activity=True, now=0.0), "H")
    sizes: Dict[str, int] = {}
    if tokens is not None:
        s.usage(K, "H", tokens, 0, True, tokens * ms_per_token if tokens else None, now=0.0)
        sizes["H"] = tokens
    if other:
        s.usage(K, "O", other, 0, True, other * ms_per_token, now=0.0)
        sizes["O"] = other
    if waiter_tokens is not None:
        s.usage(K, "W", waiter_tokens, 0, True, waiter_tokens * ms_per_token, now=0.0)
        sizes["W"] = waiter_tokens
    idle_at = 10.0
    if how == "busy":
        assert s.beat(K, "H", now=idle_at, busy=False)
    elif how == "handback":
        assert s.handback(K, "H", now=idle_at)[0]
    else:
        assert s.park(K, "H", now=idle_at, gap=how == "gap", turn=how == "turn")[0]
    came = idle_at + waiter_after
    in_use = [] if how == "done" or tokens is None else ["H"]
    now = came
    granted = _granted_to(s.acquire("w", K, "W", waiter_role, activity=True, now=came), "W")
    if granted:  # at once (the rules' own hand-over, or nothing in use to lose)
        return
    if other:
        s.acquire("o", K, "O", waiter_role, activity=True, now=came)  # behind W: its context in use
        in_use.append("O")
    # the waiters count idle time from the first one's arrival
    bound = came + worst_switch(sizes, "H", "W", in_use) * ms_per_token
    while not granted:
        due = s.next_exact()
        assert due is not None and due <= bound + 1e-6, (due, bound)
        now = max(now, due)
        granted = _granted_to(s.sweep(now=now), "W")
    assert now <= bound + 1e-6
    if how == "busy" and switch == "dear":  # the rules alone keep it to the idle-yield: the bound decides
        assert now >= min(bound, idle_at + lq.QueuePolicy(max_streams=1).idle_yield_ms) - 1e-6


def test_a_queue_left_over_capacity_drains_its_idle_holders_by_the_bound_too() -> None:
    """A reload lowers ``maxStreams`` from 2 to 1 while A and B hold, both idle, and W waits.  No
    stream is preempted, but an idle slot is no stream: each goes once it has idled what a switch
    could cost at worst (W never reported, so it counts as the largest context seen, B's 3,000
    tokens: room for it pushes out B's at most, at 1 ms a token), so W is granted when the later
    of them has, not when both happen to release.  (Before, W waited for both to end their runs.)"""
    def addressing(streams: int) -> lq.Addressing:
        config, errors, _ = lq.validate_config({"defaults": {"maxStreams": streams, "switchCost": "dear"}})
        assert errors == []
        return lq.Addressing(config)

    s = lq.Scheduler(addressing(2))
    for who, tokens in (("A", 1000), ("B", 3000)):
        assert _granted_to(s.acquire(who.lower(), K, who, "child", activity=True, now=0.0), who)
        s.usage(K, who, tokens, 0, True, float(tokens), now=0.0)
        assert s.beat(K, who, now=10.0, busy=False)
    s.reconfigure(addressing(1), now=20.0)
    assert not _granted_to(s.acquire("w", K, "W", "child", activity=True, now=30.0), "W")
    bound = 30.0 + 3000.0  # each holder's bound alike: B's context, the largest in use
    now = 30.0
    granted = False
    while not granted:
        due = s.next_exact()
        assert due is not None and due <= bound + 1e-6, (due, bound)
        now = max(now, due)
        granted = _granted_to(s.sweep(now=now), "W")
    assert now == pytest.approx(bound)
    (q,) = s.status(now=now)
    assert [h["sessionKey"] for h in q["holders"]] == ["W"]


# -- through the socket ----------------------------------------------------------------------------


def acquire(session: str) -> Dict[str, Any]:
    return {"op": "acquire", "queueKey": K, "sessionKey": session, "role": "parent", "activity": True}


def busy(session: str, flag: bool) -> Dict[str, Any]:
    return {"op": "renew", "queueKey": K, "sessionKey": session, "busy": flag}


@pytest.mark.parametrize("value", [-1, "12", True, 1e12, None])
def test_a_bad_prefill_time_is_refused_by_name_and_costs_nothing(value: Any) -> None:
    for d in started():
        p = d.peer()
        msg = {"op": "usage", "queueKey": K, "sessionKey": "A", "prefilled": 10, "prefillMs": value}
        reply = p.ask(msg)
        if value is None:
            assert reply["op"] == "ok"
            continue
        assert reply["op"] == "error" and "prefillMs must be a duration in milliseconds" in reply["reason"]
        assert p.ask({"op": "acquire", "queueKey": K, "sessionKey": "A"})["op"] == "granted"


def test_status_and_the_log_show_both_sides_for_an_idle_holder_that_someone_waits_for() -> None:
    """On the default config (the rules in force, bounded by the cost rule): an idle holder whose
    waiter came keeps its slot while its idle time is below what a switch could cost at worst (here
    A's own context, the one context in use), and it goes then; ``status`` and the log say both
    sides, and the report adds up the dead time past the switch's price."""
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        # the server prefilled A's 2,000 tokens in 1 s: 0.5 ms a token, measured
        assert a.ask({"op": "usage", "queueKey": K, "sessionKey": "A", "prefilled": 2000, "reused": 0,
                      "prefillMs": 1000})["op"] == "ok"
        assert a.ask(busy("A", False))["busy"] is False
        assert d.queue(K).get("holds") is None  # idle, but nobody waits
        came = time.monotonic()
        b.send(acquire("B"))
        wait_for(lambda: d.waiting(K) == ["B"])
        (hold,) = d.queue(K)["holds"]
        assert {k: hold[k] for k in ("sessionKey", "switchTokens", "switchMs", "measured", "rule")} == {
            "sessionKey": "A", "switchTokens": 2000, "switchMs": 1000, "measured": True, "rule": "keep"}
        assert hold["explain"].startswith("keeping: switching would re-prefill 2.0k tokens, about 1.0 s (")
        out = subprocess.run([sys.executable, MODULE, "status", "--agent-dir", d.agent_dir],
                             capture_output=True, text=True, timeout=30)
        assert "  idle   A: keeping: switching would re-prefill 2.0k tokens, about 1.0 s" in out.stdout, out.stdout
        assert b.recv(10.0)["op"] == "granted"  # once A's idle time reached the switch's cost
        assert time.monotonic() - came >= 1.0 - 0.05
        assert d.holders(K) == ["B"]
        release = release_of(log, "A")
        assert release["reason"] == "idle" and release["rule"] == "hand over"
        assert (release["switchTokens"], release["switchMs"]) == (2000, 1000) and release["idleMs"] >= 1000
        (dead,) = wait_for(lambda: [e for e in lq.read_event_log([log]) if e["event"] == "dead"])
        assert dead["sessionKey"] == "A" and dead["switchTokens"] == 2000 and dead["switchMs"] == 1000
        assert dead["rule"] == "hand over" and dead["idleMs"] >= 1000
        # the report adds up the dead time past what the switch would have cost: the rule's saving
        (figures,) = lq.build_report(lq.read_event_log([log]))["queues"].values()
        assert figures["deadPricedMs"] == dead["ms"]
        assert figures["deadPastSwitchMs"] == max(0, dead["ms"] - 1000)
        assert "of it past what a switch would have cost" in lq.format_report(lq.build_report(lq.read_event_log([log])))
        usage = [e for e in lq.read_event_log([log]) if e["event"] == "usage"]
        assert usage[0]["prefillMs"] == 1000


def a_stream_begun_while_the_slot_idles(late: str) -> None:
    """Where switches are dear, a parent's ``Client`` session keeps its slot between two requests
    (busy: false, no hand-back), and the bound hands it to a waiting B once it has idled 3 s (A's
    6,000 tokens at 0.5 ms).  A's next request starts before that, and streams for 4 s while a
    message about the slot comes late: ``"mark"``, the request's separate busy mark never comes;
    ``"park"``, a park the beat thread had decided on just before the request goes out only after
    the request's beat.  The slot stays A's throughout, and is B's once A's run is over."""
    for d in started(config={"defaults": {"switchCost": "dear"}}):
        b = d.peer()
        client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
        try:
            session = client.session(K, "A", spare=False)
            with session.run():
                with session.request():
                    session.usage(6000, 0, prefill_ms=3000.0)
                wait_for(lambda: client.switch_cost(K) == "dear")
                with session.request():  # its end, known dear: the slot kept, idle
                    pass
                b.send(acquire("B"))
                wait_for(lambda: d.waiting(K) == ["B"])
                marked = session._mark
                lease = session.lease
                assert lease is not None
                if late == "mark":
                    session._mark = lambda lease, busy: None if busy else marked(lease, busy)  # type: ignore[method-assign]
                else:
                    with client._cv:  # the beat thread decides to park the slot ...
                        lease._parked, lease._parked_gap = True, True
                    park = client._beat_action(lease, parked=True, gap=True)
                with session.request():
                    if late == "park":
                        park()  # ... and its park goes out only now
                    assert d.waiting(K) == ["B"]  # the request began before the bound
                    began = time.monotonic()
                    while time.monotonic() - began < 4.0:  # streaming, past the bound's 3 s
                        assert d.holders(K) == ["A"]
                        time.sleep(0.1)
                session._mark = marked  # type: ignore[method-assign]
            assert b.recv(10.0)["op"] == "granted"  # the run over, B's turn
        finally:
            client.close()


def test_a_request_that_starts_on_an_idle_slot_is_a_stream_at_once_so_the_bound_never_takes_it() -> None:
    """A live stream is never preempted: a ``Client`` session's request is in flight for the daemon
    from the beat that found the slot still held, whatever becomes of the messages after it.  (Were
    it so only from a busy mark sent after that beat, the bound could fall between the two and hand
    the slot over under the stream: two requests at a server that runs one.)"""
    a_stream_begun_while_the_slot_idles("mark")


def test_a_park_decided_before_a_request_began_never_reaches_the_daemon_after_it() -> None:
    """A live stream is never preempted: a park the client's beat thread decided on while the
    session paused is not sent once a request has begun (its beat un-parked the slot); sent after
    that beat, it would tell the daemon that a streaming holder idles, and the slot would go."""
    a_stream_begun_while_the_slot_idles("park")


def test_through_the_socket_a_queue_left_over_capacity_drains_its_idle_holders_by_the_bound() -> None:
    """A reload lowers ``maxStreams`` from 2 to 1 while A and B hold, idle, and C then waits.  Each
    idle holder goes once it has idled what a switch could cost at worst (C, never reported, counts
    as the largest context seen, and room for it pushes out one context in use: 2,000 tokens at
    0.5 ms, 1 s), though one release alone frees no slot: C is granted then, and
    not at the 30 s idle-yield (neither A nor B ever releases)."""
    log = os.path.join(short_tmpdir(), "events.log")
    defaults = {"logFile": log, "daemonIdleExitMs": 10**9}
    for d in started(config={"defaults": dict(defaults, maxStreams=2)}):
        peers = {"A": d.peer(), "B": d.peer()}
        for who, p in peers.items():
            assert p.ask(dict(acquire(who), role="child"))["op"] == "granted"
            assert p.ask({"op": "usage", "queueKey": K, "sessionKey": who, "prefilled": 2000, "reused": 0,
                          "prefillMs": 1000})["op"] == "ok"
            assert p.ask(busy(who, False))["busy"] is False
        d.write_config({"defaults": dict(defaults, maxStreams=1)})
        wait_for(lambda: d.queue(K)["maxStreams"] == 1, 10.0)
        c = d.peer()
        came = time.monotonic()
        c.send(dict(acquire("C"), role="child"))
        wait_for(lambda: d.waiting(K) == ["C"])
        assert c.recv(10.0)["op"] == "granted"
        assert time.monotonic() - came >= 1.0 - 0.05
        assert d.holders(K) == ["C"]
        def released() -> List[Dict[str, Any]]:
            return [e for e in lq.read_event_log([log]) if e["event"] == "release" and e["sessionKey"] in "AB"]

        releases = wait_for(lambda: len(released()) == 2 and released())
        assert sorted((e["sessionKey"], e["reason"], e["switchTokens"]) for e in releases) == [
            ("A", "idle", 2000), ("B", "idle", 2000)]


def test_a_hand_over_in_the_log_carries_the_rule_at_that_moment() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log, "switchCost": "cheap"}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        a.ask({"op": "usage", "queueKey": K, "sessionKey": "A", "prefilled": 500, "reused": 0})
        b.send(acquire("B"))
        wait_for(lambda: d.waiting(K) == ["B"])
        a.send({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True})  # waits on another agent
        assert b.recv(5.0)["op"] == "granted"
        release = release_of(log, "A")
        assert release["reason"] == "parked"
        assert (release["switchTokens"], release["switchMs"], release["rule"]) == (0, 0, "hand over")


def test_the_proxy_reports_the_servers_own_prefill_time(stub: StubEndpoint) -> None:
    from tests.test_proxy import RunningProxy, chat_all

    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        p = RunningProxy(stub.base, d.agent_dir, grace_ms=50)
        try:
            assert chat_all(p.port, "A")[0] == 200  # llama.cpp's timings: prompt_ms 12.5
            assert chat_all(p.port, "B", "/v1/messages")[0] == 200  # no timings: the first byte's time
            # the proxy reports after the response's last byte: wait for it before closing the proxy
            usage = wait_for(lambda: [e for e in lq.read_event_log([log]) if e["event"] == "usage"][:2]
                             if len([e for e in lq.read_event_log([log]) if e["event"] == "usage"]) >= 2 else None)
        finally:
            p.close()
        assert usage[0]["prefillMs"] == 12.5
        assert 0 <= usage[1]["prefillMs"] < 30_000


def test_a_session_reports_a_responses_own_accounting_in_one_call() -> None:
    for d in started():
        holder = d.peer()
        assert holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})["op"] == "granted"  # the queue exists
        client = lq.Client(d.agent_dir, autostart=False)
        try:
            client.status()  # connected (a session at work is)
            session = client.session(K, "A")
            final_chunk = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                           "timings": {"prompt_n": 900, "cache_n": 100, "prompt_ms": 450.0}}
            assert session.report(final_chunk) == (900, 100)
            assert session.report({"choices": []}) is None
            wait_for(lambda: d.queue(K).get("tokens", {}).get("prefilled") == 900)
        finally:
            client.close()


# -- holdRule: cost (issue 33's second step: the rule decides, on a queue that asks for it) --------


def cost_scheduler(**policy: Any) -> lq.Scheduler:
    cfg, errors, _ = lq.validate_config({"defaults": dict({"holdRule": "cost"}, **policy)})
    assert errors == []
    return lq.Scheduler(lq.Addressing(cfg))


def granted(events: List[Any]) -> List[str]:
    return [e.holder.session for e in events if isinstance(e, lq.Granted) and e.new]


def released(events: List[Any]) -> List[tuple]:
    return [(e.holder.session, e.reason) for e in events if isinstance(e, lq.Released)]


def test_the_readmes_first_example_streams_and_reports_the_servers_own_counts() -> None:
    """Issue 33: reporting takes one call, and the README's first Python example shows it.  Run
    as written against a stub server (its address for the README's): it streams, and the daemon
    has the response's own counts (the stub's last chunk: 40 prompt tokens, 30 of them cached)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    start = readme.index("```python", readme.index("## Queueing from Python")) + len("```python\n")
    example = readme[start:readme.index("```", start)]
    assert "session.report(chunk)" in example
    stub = StubEndpoint()
    agent_dir = short_tmpdir()
    try:
        code = (example.replace('"http://127.0.0.1:8080/v1"', repr(stub.url))
                + "\nprint()\nprint(json.dumps(client.status()))\nclient.close()\n")
        env = dict(os.environ, LLMQUEUE_DIR=agent_dir, PYTHONPATH=ROOT)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert "tok0" in run.stdout
        (queue,) = json.loads(run.stdout.strip().splitlines()[-1])
        assert queue["tokens"] == {"prefilled": 10, "reused": 30, "requests": 1}, queue
    finally:
        subprocess.run([sys.executable, MODULE, "stop", "--agent-dir", agent_dir], capture_output=True, timeout=30)
        shutil.rmtree(agent_dir, ignore_errors=True)
        stub.close()


def test_hold_rule_is_a_checked_config_field_and_rules_stay_the_default() -> None:
    assert lq.DEFAULT_POLICY.hold_rule == "rules"
    _, errors, _ = lq.validate_config({"defaults": {"holdRule": "seconds"}})
    assert errors == ['defaults.holdRule must be one of rules, cost (got "seconds")']


def test_under_the_cost_rule_an_idle_holder_hands_over_when_its_idle_time_reaches_the_switch_cost() -> None:
    s = cost_scheduler()
    assert granted(s.acquire("a", K, "A", now=0.0)) == ["A"]
    s.usage(K, "A", 2000, 0, prefill_ms=1000.0)  # 2,000 tokens at 0.5 ms each: a switch costs 1 s
    assert s.beat(K, "A", now=100.0, busy=False)  # its request ended: a tool call, say
    events = s.acquire("b", K, "B", now=300.0)
    assert granted(events) == [] and released(events) == []  # kept: idle 0 s of B's wait so far
    due = s.next_deadline()
    assert due is not None and due <= 300.0 + 1000.0  # the sweep looks again by then
    assert not granted(s.sweep(now=1299.0))
    events = s.sweep(now=1300.0)  # B has waited 1 s: what the switch costs
    assert released(events) == [("A", "idle")] and granted(events) == ["B"]
    (release,) = [e for e in events if isinstance(e, lq.Released)]
    assert release.cost is not None and release.cost.switch_ms == pytest.approx(1000.0)
    assert not s.beat(K, "A", now=1400.0)  # A learns at its next beat, and queues again


def test_under_the_cost_rule_a_holder_back_before_the_switch_cost_keeps_its_slot() -> None:
    s = cost_scheduler()
    s.acquire("a", K, "A", now=0.0)
    s.usage(K, "A", 2000, 0, prefill_ms=1000.0)
    s.beat(K, "A", now=100.0, busy=False)
    s.acquire("b", K, "B", now=100.0)
    assert s.beat(K, "A", now=900.0, busy=True)  # back after 0.8 s: the re-prefill was saved
    assert granted(s.sweep(now=5000.0)) == []
    assert [h.session for h in s.holders(K)] == ["A"]


def test_under_the_cost_rule_a_context_given_up_in_a_gap_is_needed_until_it_comes_back_or_is_done() -> None:
    """Not guessed from how long tool calls took: needed until its session comes back, says it is
    done (a release), or a lease's TTL has passed (what a client that died may cost)."""
    s = cost_scheduler(leaseTtlMs=30_000)
    s.acquire("a", K, "A", now=0.0)
    s.usage(K, "A", 2000, 0, prefill_ms=1000.0)
    s.beat(K, "A", now=100.0, busy=False)
    s.acquire("b", K, "B", now=100.0)
    assert granted(s.sweep(now=1100.0)) == ["B"]  # A gave its slot up in its gap
    q = s._queues[K]
    assert q.needed("A", 20_000.0)  # a tool call of 20 s: still needed
    assert not q.needed("A", 1100.0 + 30_001)  # past a TTL: a client that died costs no more
    s.release(K, "A", now=21_000.0)  # its run is over
    assert not q.needed("A", 21_001.0)
    assert q.needed("B", 21_001.0)  # the holder's, of course


def test_under_the_cost_rule_a_release_that_frees_a_context_hands_the_slot_over_at_once() -> None:
    """W holds idle, X waits, and X's run would push out P's context, which P gave up in a tool
    call: kept for it.  P's run ends (a release): nothing needed is pushed out now, so the slot
    goes then, not at the deadline set while P's context counted."""
    s = cost_scheduler(leaseTtlMs=30_000)
    s.usage(K, "X", 1000, 0, prefill_ms=1000.0)
    s.acquire("p", K, "P", role="child", now=0.0)
    s.usage(K, "P", 2000, 0, prefill_ms=2000.0)
    s.beat(K, "P", now=100.0, busy=False)  # P in a tool call
    s.acquire("w", K, "W", role="child", now=100.0)
    assert granted(s.sweep(now=2100.0)) == ["W"]  # P's 2 s switch paid for by W's wait
    s.usage(K, "W", 1000, 0, prefill_ms=1000.0)
    # the host cache keeps P's beside W's in the slot, and not W's and P's once X's run is in the slot
    s._affinity_of(K).room, s._affinity_of(K).room_cap = 2500, 2600
    s.beat(K, "W", now=2200.0, busy=False)
    s.acquire("x", K, "X", role="child", now=2200.0)
    ((_, hold),) = s.holds(s._queues[K], 2200.0)
    assert hold.tokens == 2000 and not hold.hand_over
    events = s.release(K, "P", now=2300.0)  # P is done: its context is needed no more
    assert granted(events) == ["X"] and released(events) == [("W", "idle")]


@given(switch=st.floats(0, 1e6), before=st.floats(0, 1e6), idle=st.floats(0, 1e6), more=st.floats(0, 1e6),
       behind=st.floats(0, 1e5))
def test_the_threshold_is_the_switch_and_the_persons_wait_and_the_rent_counts_toward_it(
        switch: float, before: float, idle: float, more: float, behind: float) -> None:
    """The guarantee with every term: hand over exactly when the idle time spent in all (earlier
    gaps and this one) reaches the switch's cost plus a person's wait, and stay so as the spell
    goes on."""
    cost = lq.HoldCost(idle, 100, switch, True, "", before_ms=before, behind_ms=behind)
    assert cost.threshold_ms == switch + behind
    assert cost.hand_over == (before + idle >= switch + behind)
    if cost.hand_over:
        assert cost._replace(idle_ms=idle + more).hand_over


def test_under_the_cost_rule_a_free_switch_is_handed_over_at_once() -> None:
    s = cost_scheduler(switchCost="cheap")
    s.acquire("a", K, "A", now=0.0)
    s.usage(K, "A", 2000, 0)
    s.beat(K, "A", now=10.0, busy=False)
    events = s.acquire("b", K, "B", now=20.0)
    assert granted(events) == ["B"] and released(events) == [("A", "idle")]


def test_under_the_cost_rule_with_no_context_size_known_the_seeds_rule_keeps_the_slot() -> None:
    s = cost_scheduler()
    s.acquire("a", K, "A", now=0.0)  # no usage reported
    s.beat(K, "A", now=10.0, busy=False)
    s.acquire("b", K, "B", now=20.0)
    assert granted(s.sweep(now=20_000.0)) == []  # well short of the idle-yield (30 s)
    assert [h.session for h in s.holders(K)] == ["A"]


def test_under_the_cost_rule_the_specs_own_hand_overs_stand() -> None:
    # a holder parked on another agent (a blocking tool) yields at once, whatever it would cost
    s = cost_scheduler()
    s.acquire("a", K, "A", now=0.0)
    s.usage(K, "A", 2000, 0, prefill_ms=1000.0)
    s.acquire("b", K, "B", role="child", now=10.0)
    held, events = s.park(K, "A", now=20.0)
    assert not held and granted(events) == ["B"] and released(events) == [("A", "parked")]
    # a subagent between two requests yields to a waiting parent at once
    s = cost_scheduler()
    s.acquire("c", K, "C", role="child", now=0.0)
    s.usage(K, "C", 2000, 0, prefill_ms=1000.0)
    s.acquire("p", K, "P", now=10.0)
    held, events = s.handback(K, "C", now=20.0)
    assert not held and granted(events) == ["P"] and released(events) == [("C", "handback")]


def test_under_the_cost_rule_the_spec_order_picks_who_goes_next() -> None:
    s = cost_scheduler(switchCost="cheap")
    s.acquire("a", K, "A", now=0.0)
    s.usage(K, "A", 100, 0)
    s.acquire("c", K, "C", role="child", now=1.0)
    s.acquire("p", K, "P", now=2.0)
    events: List[Any] = []
    s.beat(K, "A", now=3.0, busy=False)
    events += s.sweep(now=3.0)
    assert granted(events) == ["P"]  # the parent before the child that came first


def test_under_the_cost_rule_the_hand_over_is_due_to_the_millisecond() -> None:
    s = cost_scheduler()
    s.acquire("a", K, "A", now=0.0)
    s.usage(K, "A", 2000, 0, prefill_ms=1000.0)
    s.beat(K, "A", now=100.0, busy=False)
    s.acquire("b", K, "B", now=250.0)
    assert s.next_exact() == pytest.approx(1250.0)  # B's wait reaches the switch's 1 s then
    s.beat(K, "A", now=300.0, busy=True)  # A is back: nothing due
    s.sweep(now=1250.0)
    assert s.next_exact() is None and [h.session for h in s.holders(K)] == ["A"]


@pytest.mark.parametrize("waiters", [1, 2, 6])
def test_under_the_cost_rule_an_idle_second_counts_once_however_many_wait(waiters: int) -> None:
    """The idle side is the server's time: one second idle is one second, for one waiter or six
    (the re-prefill it saves would delay every one of them as long)."""
    s = cost_scheduler()
    s.acquire("a", K, "A", now=0.0)
    s.usage(K, "A", 2000, 0, prefill_ms=1000.0)  # a switch costs 1 s
    s.beat(K, "A", now=100.0, busy=False)
    for i in range(waiters):
        s.acquire(f"w{i}", K, f"W{i}", now=100.0)
    due = s.next_exact()
    assert due == pytest.approx(1100.0)
    assert not granted(s.sweep(now=1099.0))
    events = s.sweep(now=1100.0)
    assert released(events) == [("A", "idle")] and granted(events) == ["W0"]
    (release,) = [e for e in events if isinstance(e, lq.Released)]
    assert release.cost is not None and release.cost.idle_ms == pytest.approx(1000.0)
    assert release.cost.fields()["waitedMs"] == 1000


def test_under_the_cost_rule_the_waiting_spent_adds_up_over_the_holders_gaps() -> None:
    """The rent is paid across gaps: a holder whose every tool call is shorter than the switch's
    cost keeps a waiter out no longer than that cost, in all."""
    s = cost_scheduler()
    s.acquire("a", K, "A", now=0.0)
    s.usage(K, "A", 2000, 0, prefill_ms=1000.0)  # a switch costs 1 s
    s.beat(K, "A", now=100.0, busy=False)
    s.acquire("b", K, "B", now=100.0)
    assert s.beat(K, "A", now=700.0, busy=True)  # back after 0.6 s of B's wait: kept
    s.beat(K, "A", now=800.0, busy=False)  # its next gap: 0.4 s of the switch's cost is left
    while True:  # the sweep's looks before then (some were set in the first gap) hand nothing over
        due = s.next_exact()
        assert due is not None
        if due >= 1199.0:
            break
        assert not granted(s.sweep(now=due))
    assert due == pytest.approx(1200.0)
    assert not granted(s.sweep(now=1199.0))
    events = s.sweep(now=1200.0)
    assert released(events) == [("A", "idle")] and granted(events) == ["B"]
    (release,) = [e for e in events if isinstance(e, lq.Released)]
    assert release.cost is not None and release.cost.before_ms == pytest.approx(600.0)
    assert release.cost.spent_ms == pytest.approx(1000.0)
    assert release.cost.fields()["waitedBeforeMs"] == 600
    assert "0.6 s more in earlier gaps" in release.cost.explain()
    # Nothing is known yet of what the server keeps, so the rent is the queue's: A's 1 s paid for
    # one switch, and B's slot goes at once too, to A, whose return tells.
    s.usage(K, "B", 2000, 0, prefill_ms=1000.0)
    s.acquire("a", K, "A", now=1300.0)
    s.beat(K, "B", now=1400.0, busy=False)
    assert granted(s.sweep(now=1400.0)) == ["A"]
    s.usage(K, "A", 100, 2000)  # A's context was kept beside B's: the server keeps 2,000 tokens at least
    assert s._affinity_of(K).room == 2000
    # from here on each holder's rent starts from nothing
    s.acquire("c", K, "C", now=1500.0)
    s.beat(K, "A", now=1600.0, busy=False)
    ((_, hold),) = s.holds(s._queues[K], 1600.0)
    assert hold.before_ms == 0.0 and hold.switch_ms is not None and not hold.hand_over
    due = 1600.0 + hold.switch_ms
    assert not granted(s.sweep(now=due - 1.0))
    assert granted(s.sweep(now=due)) == ["C"]


def test_under_the_cost_rule_while_nothing_is_known_of_what_the_server_keeps_the_rent_is_the_queues() -> None:
    """Holders whose tenures each idle less than a switch would otherwise keep every slot through
    every gap, and never find out that switches were free: while no return has told what the
    server keeps, every holder's idle while someone waited adds up, and once it reaches a switch's
    cost the switch is made.  Within a holder's tenure this is the rule as ever; across tenures it
    spends at most one switch's worth of idle before a switch that finds out."""
    s = cost_scheduler()
    s.acquire("a", K, "A", role="child", now=0.0)
    s.usage(K, "A", 2000, 0, prefill_ms=1000.0)  # a switch costs 1 s
    s.acquire("b", K, "B", role="child", now=0.0)
    s.beat(K, "A", now=100.0, busy=False)
    assert s.beat(K, "A", now=700.0, busy=True)  # 0.6 s of B's wait: kept
    assert granted(s.release(K, "A", now=800.0)) == ["B"]  # A's run is over
    s.usage(K, "B", 2000, 0, prefill_ms=1000.0)
    s.acquire("c", K, "C", role="child", now=900.0)
    s.beat(K, "B", now=1000.0, busy=False)
    ((_, hold),) = s.holds(s._queues[K], 1000.0)
    assert hold.before_ms == pytest.approx(600.0) and not hold.hand_over  # A's idle, not B's own
    assert not granted(s.sweep(now=1399.0))
    events = s.sweep(now=1400.0)  # 0.4 s more: the queue's idle reached the switch's 1 s
    assert released(events) == [("B", "idle")] and granted(events) == ["C"]


def person_after_a_subagent(turn: bool, spare: bool = False, **policy: Any) -> lq.Scheduler:
    """A subagent's request took 2 s and it is done; then P (a person's parent, a 2,000-token
    context: a switch costs 1 s) made a request of 0.5 s and is idle from 3.5 s: its turn over
    (``turn``, a park), or between two requests (``busy: false``).  ``spare``: P's acquire asks
    for a spare stream when subagents hold every slot."""
    s = cost_scheduler(**policy)
    s.acquire("c", K, "C", role="child", now=0.0)
    s.beat(K, "C", now=2000.0, busy=False)
    s.release(K, "C", now=2100.0)
    s.acquire("p", K, "P", now=3000.0, spare=spare)
    s.usage(K, "P", 2000, 0, prefill_ms=1000.0)
    if turn:
        held, _ = s.park(K, "P", now=3500.0, turn=True)
        assert held
    else:
        s.beat(K, "P", now=3500.0, busy=False)
    return s


def test_under_the_cost_rule_a_thinking_persons_wait_counts_as_much_as_the_servers_idle() -> None:
    """A person between turns, a subagent waiting: handed over, the person comes back to the
    subagent's request in flight and waits for it (the median of the subagents' request times
    here).  A second of their wait counts as much as a second of the server's idle: the slot
    goes once the idle time spent reaches the switch's cost plus that wait, however many wait."""
    s = person_after_a_subagent(turn=True)
    s.acquire("w", K, "W", role="child", now=3500.0)
    (hold,) = [c for _, c in s.holds(s._queues[K], 4000.0)]
    assert hold.behind_ms == pytest.approx(2000.0)  # the subagents' requests (the person's took 0.5 s)
    assert hold.threshold_ms == pytest.approx(3000.0)
    assert "a person would wait about" in hold.explain() and hold.fields()["personWaitMs"] > 0
    assert not granted(s.sweep(now=3500.0 + hold.threshold_ms - 1))
    assert granted(s.sweep(now=3500.0 + hold.threshold_ms)) == ["W"]
    # two subagents waiting: the same threshold, and the same moment
    s = person_after_a_subagent(turn=True)
    s.acquire("w", K, "W", role="child", now=3500.0)
    s.acquire("v", K, "V", role="child", now=3500.0)
    (hold,) = [c for _, c in s.holds(s._queues[K], 3500.0)]
    assert hold.threshold_ms == pytest.approx(3000.0)
    assert not granted(s.sweep(now=6499.0))
    assert granted(s.sweep(now=6500.0)) == ["W"]
    # the same slot idle between a parent's requests (no person's turn over): the switch's cost alone
    s = person_after_a_subagent(turn=False)
    s.acquire("w", K, "W", role="child", now=3500.0)
    (hold,) = [c for _, c in s.holds(s._queues[K], 3500.0)]
    assert hold.behind_ms == 0 and hold.threshold_ms == pytest.approx(1000.0)


def test_under_the_cost_rule_a_person_who_would_take_a_spare_stream_waits_behind_no_request() -> None:
    """A person whose session asks for a spare stream comes back to one beside the subagent's
    request, not to a wait behind it: the switch costs their context alone, as between requests.
    With no spare stream to take (``parentStreams: 0``), or with none asked for, the wait counts."""
    s = person_after_a_subagent(turn=True, spare=True)
    s.acquire("w", K, "W", role="child", now=3500.0)
    (hold,) = [c for _, c in s.holds(s._queues[K], 3500.0)]
    assert hold.behind_ms == 0 and hold.threshold_ms == pytest.approx(1000.0)
    assert not granted(s.sweep(now=4499.0))
    assert granted(s.sweep(now=4500.0)) == ["W"]
    events = s.acquire("p", K, "P", now=5000.0, spare=True)  # the next turn: on the spare stream
    assert granted(events) == ["P"] and s._queues[K].holders["P"].spare
    for spare, policy in ((True, {"parentStreams": 0}), (False, {})):
        s = person_after_a_subagent(turn=True, spare=spare, **policy)
        s.acquire("w", K, "W", role="child", now=3500.0)
        (hold,) = [c for _, c in s.holds(s._queues[K], 3500.0)]
        assert hold.behind_ms == pytest.approx(2000.0), (spare, policy)


@pytest.mark.parametrize("thought_ms,at_once", [(5000.0, True), (1000.0, False)])
def test_under_the_cost_rule_a_persons_measured_thoughts_decide_at_once_when_theirs_outlasts_the_switch(
        thought_ms: float, at_once: bool) -> None:
    """Where the queue has timed a person's thoughts, keeping the slot through the next one costs
    the server what is left of it, as they usually go.  Longer than the switch and the wait
    behind a request (3 s here): handed over at the turn's end.  Shorter: kept, and the idle
    spent still bounds it (the rule's guarantee does not rest on the measurement)."""
    s = person_after_a_subagent(turn=True)  # P's turn over at 3.5 s; nobody waits: kept
    back = 3500.0 + thought_ms
    s.acquire("p", K, "P", now=back)  # the person is back: their thought is timed
    s.beat(K, "P", now=back, busy=True)
    s.acquire("w", K, "W", role="child", now=back + 100)
    held, events = s.park(K, "P", now=back + 500, turn=True)  # the next turn is over
    (hold,) = [c for _, c in s.holds(s._queues[K], back + 500)] or [None]
    if at_once:
        assert granted(events) == ["W"] and not held
        return
    assert hold is not None and hold.ahead_ms == pytest.approx(thought_ms) and not hold.hand_over
    assert hold.fields()["thinkAheadMs"] == round(thought_ms)
    assert "thinks about 1.0 s more, as they usually do" in hold.explain()
    due = back + 500 + hold.threshold_ms
    assert not granted(s.sweep(now=due - 1))
    assert granted(s.sweep(now=due)) == ["W"]


@pytest.mark.parametrize("prefill_ms,at_once", [(50.0, True), (1000.0, False)])
def test_a_tool_call_timed_longer_than_the_switch_hands_the_slot_over_at_once(prefill_ms: float, at_once: bool) -> None:
    """Under the default rules, with switches dear (the rules alone would keep the slot through
    the gap): subagent A's tool calls took 300 ms three times, so when it is between two requests
    again and W waits, keeping costs about 300 ms of idle.  Where a switch costs less (A's
    1,000-token context at 50 ms), the slot goes to W at once: at least half of A's gaps would
    have outlasted the switch anyway.  Where it costs more (1 s), it is kept, and goes once the
    idle spent reaches the switch's cost, as ever."""
    config, errors, _ = lq.validate_config({"defaults": {"switchCost": "dear"}})
    assert errors == []
    s = lq.Scheduler(lq.Addressing(config))
    assert granted(s.acquire("a", K, "A", "child", activity=True, now=0.0)) == ["A"]
    s.usage(K, "A", 1000, 0, True, prefill_ms, now=0.0)
    t = 100.0
    for _ in range(3):  # a request's end, a 300 ms tool call, the next request
        assert s.handback(K, "A", now=t)[0]
        assert s.beat(K, "A", now=t + 300, busy=True)
        t += 400
    assert s.handback(K, "A", now=t)[0]
    events = s.acquire("w", K, "W", "child", activity=True, now=t + 10)
    if at_once:
        assert granted(events) == ["W"]
        return
    assert granted(events) == []
    (hold,) = [c for _, c in s.holds(s._queues[K], t + 10)]
    assert hold.ahead == "gap" and hold.ahead_ms == pytest.approx(290.0) and not hold.hand_over
    assert hold.fields()["gapAheadMs"] == 290 and "thinkAheadMs" not in hold.fields()
    assert "its tool calls usually last about 0.3 s more" in hold.explain()
    assert not granted(s.sweep(now=t + 10 + 999))
    assert granted(s.sweep(now=t + 10 + 1000)) == ["W"]


def test_status_and_the_log_show_a_thinking_persons_wait_through_the_socket() -> None:
    """A subagent's request took about 0.3 s; then a person's parent (a 2,000-token context, 1 s to
    re-prefill) ends its turn and a subagent waits: ``status`` and the hand-over's log line carry
    the wait the person would come back to, and the slot goes once the idle time reaches both."""
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log, "holdRule": "cost"}}):
        c, p, w = d.peer(), d.peer(), d.peer()
        child = {"op": "acquire", "queueKey": K, "sessionKey": "C", "role": "child", "activity": True}
        assert c.ask(child)["op"] == "granted"
        time.sleep(0.3)  # its request
        assert c.ask({"op": "release", "queueKey": K, "sessionKey": "C"})["op"] == "ok"
        assert p.ask(acquire("P"))["op"] == "granted"
        assert p.ask({"op": "usage", "queueKey": K, "sessionKey": "P", "prefilled": 2000, "reused": 0,
                      "prefillMs": 1000})["op"] == "ok"
        p.send({"op": "renew", "queueKey": K, "sessionKey": "P", "parked": True, "turn": True})  # its turn is over
        w.send(dict(child, sessionKey="W"))
        wait_for(lambda: d.waiting(K) == ["W"])
        (hold,) = d.queue(K)["holds"]
        assert hold["rule"] == "keep" and hold["switchMs"] == 1000
        assert 250 <= hold["personWaitMs"] <= 3000, hold  # the subagent's request, as the daemon timed it
        assert "a person would wait about" in hold["explain"], hold
        assert w.recv(10.0)["op"] == "granted"  # idle past the switch and the person's wait
        release = release_of(log, "P")
        assert release["rule"] == "hand over" and release["personWaitMs"] == hold["personWaitMs"]
        assert release["waitedMs"] >= 1000 + release["personWaitMs"]


def test_status_and_the_log_show_a_persons_measured_thought_through_the_socket() -> None:
    """A person thought about 0.4 s between two turns (the daemon timed it).  At the end of the
    next turn, with a subagent waiting, ``status`` shows what is left of the thought as they
    usually go, beside the switch's price (3 s, longer: kept), and the hand-over's log line
    carries it."""
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log, "holdRule": "cost"}}):
        p, w = d.peer(), d.peer()
        assert p.ask(acquire("P"))["op"] == "granted"
        assert p.ask({"op": "usage", "queueKey": K, "sessionKey": "P", "prefilled": 2000, "reused": 0,
                      "prefillMs": 3000})["op"] == "ok"
        turn_over = {"op": "renew", "queueKey": K, "sessionKey": "P", "parked": True, "turn": True}
        assert p.ask(turn_over)["op"] == "ok"
        time.sleep(0.4)  # the person thinks; nobody waits, so the slot is kept
        assert p.ask(acquire("P"))["op"] == "granted"  # back: the thought is timed
        assert p.ask(turn_over)["op"] == "ok"
        w.send({"op": "acquire", "queueKey": K, "sessionKey": "W", "role": "child", "activity": True})
        wait_for(lambda: d.waiting(K) == ["W"])
        (hold,) = d.queue(K)["holds"]
        assert hold["rule"] == "keep" and hold["switchMs"] == 3000, hold
        # the thought (0.4 s, more on a loaded machine), less the moment since this turn ended
        assert isinstance(hold["thinkAheadMs"], int) and hold["thinkAheadMs"] <= 2000, hold
        assert "thinks about" in hold["explain"] and "as they usually do" in hold["explain"], hold
        assert w.recv(10.0)["op"] == "granted"
        release = release_of(log, "P")
        assert release["rule"] == "hand over" and "thinkAheadMs" in release, release


def test_status_and_the_log_show_a_timed_tool_call_through_the_socket() -> None:
    """Subagent A's tool calls took about 0.2 s three times (the daemon timed them, from each
    handback to the next request).  Between two requests again, with W waiting and a switch
    dearer (1 s), ``status`` shows what is left of the tool call as they usually go, beside the
    switch's price, and the hand-over's log line carries it."""
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log, "switchCost": "dear"}}):
        a, w = d.peer(), d.peer()
        assert a.ask(dict(acquire("A"), role="child"))["op"] == "granted"
        assert a.ask({"op": "usage", "queueKey": K, "sessionKey": "A", "prefilled": 1000, "reused": 0,
                      "prefillMs": 1000})["op"] == "ok"
        handback = {"op": "renew", "queueKey": K, "sessionKey": "A", "handback": True}
        for _ in range(3):
            assert a.ask(handback)["op"] == "ok"
            time.sleep(0.2)  # the tool call
            assert a.ask(busy("A", True))["granted"] is True
        assert a.ask(handback)["op"] == "ok"
        w.send({"op": "acquire", "queueKey": K, "sessionKey": "W", "role": "child", "activity": True})
        wait_for(lambda: d.waiting(K) == ["W"])
        (hold,) = d.queue(K)["holds"]
        assert hold["rule"] == "keep" and hold["switchMs"] == 1000, hold
        # the tool calls (0.2 s, more on a loaded machine), less the moment since this one began
        assert isinstance(hold["gapAheadMs"], int) and hold["gapAheadMs"] <= 1000, hold
        assert "its tool calls usually last about" in hold["explain"], hold
        assert w.recv(10.0)["op"] == "granted"
        release = release_of(log, "A")
        assert release["rule"] == "hand over" and "gapAheadMs" in release, release
        assert release["waitedMs"] >= 1000


@pytest.mark.parametrize("sweep_ms", [20, 10_000])
def test_through_the_socket_a_cost_rule_queue_hands_an_idle_slot_over_once_the_switch_cost_is_spent(
        sweep_ms: int) -> None:
    """The guarantee, with real timers: never kept past the switch's cost (and a generous margin
    for a loaded machine), and not handed over long before it.  Kept to the millisecond, not to
    the sweep's tick: with a tick of 10 s, a 0.6 s switch cost is not rounded up to it."""
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"holdRule": "cost", "logFile": log}}, sweep_ms=sweep_ms):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        # 2,000 tokens prefilled in 0.6 s: a switch costs 0.6 s of the server's time
        a.ask({"op": "usage", "queueKey": K, "sessionKey": "A", "prefilled": 2000, "reused": 0, "prefillMs": 600})
        assert a.ask(busy("A", False))["busy"] is False
        asked = time.monotonic()
        b.send(acquire("B"))
        assert b.silent(0.3)  # half the switch's cost: kept
        reply = b.recv(5.0)
        waited = time.monotonic() - asked
        assert reply["op"] == "granted" and reply["sessionKey"] == "B"
        assert 0.5 <= waited < 0.6 + 3.0, waited  # not at the sweep's next tick, up to 10 s on
        assert a.ask({"op": "renew", "queueKey": K, "sessionKey": "A"})["granted"] is False  # A learns it
        release = release_of(log, "A")
        assert release["reason"] == "idle" and release["rule"] == "hand over" and release["switchMs"] == 600


@given(tokens=st.integers(100, 5000), ms=st.floats(10, 50_000), since=st.floats(1, 1e6),
       arrivals=st.lists(st.floats(0, 3000), min_size=1, max_size=6))
def test_under_the_cost_rule_the_sweep_at_the_due_time_hands_over(tokens: int, ms: float, since: float,
                                                                  arrivals: List[float]) -> None:
    """The guarantee through the sweep: at the deadline the core gives, the waiters have spent the
    switch's cost and the slot goes (the deadline's rounding never leaves it looking again forever)."""
    s = cost_scheduler()
    s.acquire("a", K, "A", now=0.0)
    s.usage(K, "A", tokens, 0, prefill_ms=ms)
    s.beat(K, "A", now=since, busy=False)
    t = since
    for i, gap in enumerate(arrivals):
        t += gap
        s.acquire(f"c{i}", K, f"W{i}", now=t)
    due = s.next_exact()
    if not [h for h in s.holders(K) if h.session == "A"]:
        return  # handed over already, as a waiter came
    assert due is not None
    s.sweep(now=max(due, t))  # (past A's TTL the sweep evicts it instead: the slot goes either way)
    assert [h.session for h in s.holders(K)] == ["W0"]
