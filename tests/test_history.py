"""Issue 6, item 3 pinned: the history checker (``tests/history.py``) catches every rule it claims.

Hand-made histories (event-log lines and client transcripts written out by hand, times in ms from
an arbitrary epoch), each breaking one rule -- (a) capacity, (b) tier/FIFO/aging order, (c) TTL
bounds, (d) double holds and ``seq``, (e) waiters -- and each beside its legal twin, so a test
fails both when the checker misses the violation and when it flags a legal history.  Then one
real daemon history (``tests.harness.DaemonProc``, transcripts by ``TracedPeer``): clean as
recorded, and caught once a line of it is tampered with.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Sequence

import pytest

from tests.harness import DaemonProc, wait_for
from tests.history import (QueueSpec, Report, TracedPeer, TranscriptFile, check_history, load_log,
                           load_transcripts, parse_ts, record, specs_from_config)

Q = "http://gpu:8001/v1"
EPOCH = 1_764_000_000_000.0  # ms: 2025-11-24T16:00:00Z, a round second
TTL = 1000
SWEEP = 20
MARGIN = 100.0
SPEC = QueueSpec(max_streams=1, lease_ttl_ms=TTL, aging_after_slots=3, aging_after_ms=500, idle_yield_ms=0)


def iso(ms: float) -> str:
    """The daemon's ``ts``: wall time floored to the millisecond."""
    whole, frac = divmod(int(EPOCH + ms), 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{frac:03d}Z"


class H:
    """A hand-made history: log lines and transcript records, times in ms after EPOCH."""

    def __init__(self) -> None:
        self.log: List[Dict[str, Any]] = []
        self.tx: List[Dict[str, Any]] = []

    # -- the daemon's log -------------------------------------------------------------------------

    def ev(self, t: float, event: str, session: Optional[str] = None, role: str = "parent", *,
           queue: str = Q, **extra: Any) -> H:
        line: Dict[str, Any] = {"event": event, "queueKey": queue}
        if session is not None:
            line.update(sessionKey=session, role=role)
        line.update(extra)
        line["ts"] = iso(t)
        self.log.append(line)
        return self

    def grant(self, t: float, session: str, seq: int, role: str = "parent", *, switch: bool = False,
              queue: str = Q) -> H:
        self.ev(t, "grant", session, role, queue=queue, seq=seq)
        if switch:
            self.ev(t, "switch", session, role, queue=queue, seq=seq)
        return self

    # -- the clients' transcripts -----------------------------------------------------------------

    def send(self, conn: str, t: float, **msg: Any) -> H:
        self.tx.append(record(conn, "send", msg, t=(EPOCH + t) / 1000.0))
        return self

    def recv(self, conn: str, t: float, **msg: Any) -> H:
        self.tx.append(record(conn, "recv", msg, t=(EPOCH + t) / 1000.0))
        return self

    def close(self, conn: str, t: float, by: Optional[float] = None) -> H:
        rec = record(conn, "close", t=(EPOCH + t) / 1000.0)
        if by is not None:
            rec["by"] = (EPOCH + by) / 1000.0
        self.tx.append(rec)
        return self

    def granted(self, conn: str, t: float, session: str, seq: int, queue: str = Q) -> H:
        return self.recv(conn, t, op="granted", queueKey=queue, sessionKey=session, leaseTtlMs=TTL,
                         idleYieldMs=0, seq=seq)

    def beat(self, conn: str, t: float, session: str, held: bool = True, queue: str = Q) -> H:
        """A keyed renew sent at ``t``, answered 1 ms later."""
        self.send(conn, t, op="renew", queueKey=queue, sessionKey=session)
        return self.recv(conn, t + 1, op="ok", queueKey=queue, sessionKey=session, granted=held)

    def check(self, spec: QueueSpec = SPEC, final_status: Optional[Sequence[Dict[str, Any]]] = None,
              policies: Optional[Dict[str, QueueSpec]] = None) -> Report:
        return check_history(self.log, self.tx, policies=policies or {Q: spec}, sweep_ms=SWEEP,
                             margin_ms=MARGIN, final_status=final_status)


def rules(report: Report) -> List[str]:
    return sorted(v.rule for v in report.violations)


def clean(report: Report) -> None:
    report.assert_clean()


# =================================================================================================
# A clean history
# =================================================================================================


def clean_history() -> H:
    """A holds and releases to parent C, who jumped child B; C releases to B, who freezes and is
    evicted on time; D cancels its wait, E's connection closes while it waits."""
    h = H()
    h.send("a", 0, op="acquire", queueKey=Q, sessionKey="A", role="parent")
    h.grant(1, "A", 1).granted("a", 2, "A", 1).beat("a", 3, "A")
    h.send("b", 10, op="acquire", queueKey=Q, sessionKey="B", role="child").ev(11, "queued", "B", "child")
    h.send("c", 20, op="acquire", queueKey=Q, sessionKey="C", role="parent").ev(21, "queued", "C")
    h.send("a", 100, op="release", queueKey=Q, sessionKey="A")
    h.ev(101, "release", "A", reason="release").grant(101, "C", 2, switch=True)
    h.recv("a", 102, op="ok").granted("c", 102, "C", 2)
    h.send("c", 200, op="release", queueKey=Q, sessionKey="C")
    h.ev(201, "release", "C", reason="release").grant(201, "B", 3, "child", switch=True)
    h.recv("c", 202, op="ok").granted("b", 202, "B", 3).beat("b", 203, "B")  # then B freezes
    h.send("d", 300, op="acquire", queueKey=Q, sessionKey="D", role="parent").ev(301, "queued", "D")
    h.send("d", 400, op="cancel", queueKey=Q, sessionKey="D").ev(401, "dequeue", "D", reason="cancel")
    h.send("e", 500, op="acquire", queueKey=Q, sessionKey="E", role="child").ev(501, "queued", "E", "child")
    h.close("e", 600).ev(601, "dequeue", "E", "child", reason="disconnect")
    h.ev(1215, "evict", "B", "child", reason="ttl")  # B's last beat at 203: due 1203, swept by 1223
    return h


EMPTY_STATUS = [{"queueKey": Q, "maxStreams": 1, "holders": [], "waiting": []}]


def test_a_clean_history_has_no_violations_and_counts_what_it_replayed() -> None:
    report = clean_history().check(final_status=EMPTY_STATUS)
    clean(report)
    assert report.stats["grants replayed"] == 3 and report.stats["switches replayed"] == 2
    assert report.stats["ttl evictions checked against beats"] == 1
    assert report.stats["dequeues (cancel)"] == 1 and report.stats["dequeues (disconnect)"] == 1
    assert report.waiting_at_end == {Q: []} and report.holding_at_end == {Q: []}
    assert [(h.session, h.seq) for h in sorted(report.holds, key=lambda h: h.start)] == [
        ("A", 1), ("C", 2), ("B", 3)]
    assert report.max_client_holds == {Q: 1}


# =================================================================================================
# (a) capacity
# =================================================================================================


def test_capacity_a_grant_while_max_streams_are_held_is_flagged() -> None:
    h = H().grant(0, "A", 1).grant(5, "B", 2)
    assert rules(h.check()) == ["capacity"]
    assert rules(h.check(SPEC._replace(max_streams=2))) == []


def test_capacity_an_over_capacity_reload_excuses_its_holders_but_not_a_grant_before_the_drain() -> None:
    h = H().grant(0, "A", 1).grant(1, "B", 2)
    h.ev(50, "config", reason="over-capacity", holders=2, maxStreams=1)
    h.ev(60, "release", "A", reason="release")
    legal = H()
    legal.log = h.log + H().ev(70, "release", "B", reason="release").grant(80, "C", 3).log
    assert rules(legal.check(SPEC._replace(max_streams=2))) == []
    early = H()
    early.log = h.log + H().grant(70, "C", 3).log  # B still holds: 1/1
    report = early.check(SPEC._replace(max_streams=2))
    assert rules(report) == ["capacity"] and "C granted with 1 holders" in report.violations[0].message


def test_capacity_a_parents_spare_stream_counts_against_parent_streams_and_only_beside_children() -> None:
    def spare(h: H, t: float, session: str, seq: int, role: str = "parent") -> H:
        return h.ev(t, "grant", session, role, seq=seq, spare=True)
    assert rules(spare(H().grant(0, "C", 1, "child"), 5, "P", 2).check()) == []
    assert rules(spare(H().grant(0, "A", 1), 5, "P", 2).check()) == ["capacity"]  # beside a parent
    assert rules(spare(H().grant(0, "C", 1, "child"), 5, "D", 2, "child").check()) == ["capacity"]
    two = spare(spare(H().grant(0, "C", 1, "child"), 5, "P", 2), 6, "Q", 3)
    assert rules(two.check()) == ["capacity"]
    assert rules(two.check(SPEC._replace(parent_streams=2))) == []
    assert rules(spare(H().grant(0, "C", 1, "child"), 5, "P", 2).check(SPEC._replace(parent_streams=0))) == [
        "capacity"]


def test_order_a_spare_stream_granted_while_only_children_wait_is_no_queue_jump() -> None:
    h = H().grant(0, "C", 1, "child").ev(1, "queued", "D", "child")
    assert rules(H.ev(h, 5, "grant", "P", seq=2, spare=True).check()) == []
    h = H().grant(0, "C", 1, "child").ev(1, "queued", "OLD")
    assert rules(H.ev(h, 5, "grant", "P", seq=2, spare=True).check()) == ["order"]


def test_order_a_spare_stream_granted_while_the_only_parent_waiting_was_demoted_is_no_queue_jump() -> None:
    """P1 queued as a parent, then its own role request made it a child: a spare stream granted
    straight to a new parent P2 jumped no one (a child cannot take it).  Found by the soak in CI."""
    h = H().grant(0, "C", 1, "child").send("p1", 9, op="acquire", queueKey=Q, sessionKey="P1")
    h.ev(10, "queued", "P1")
    h.send("p1", 300, op="role", sessionKey="P1", role="child").send("p1", 300, op="renew").recv("p1", 302, op="ok")
    demoted = H()
    demoted.tx = h.tx
    demoted.log = h.log + H().ev(600, "grant", "P2", seq=2, spare=True).log
    assert rules(demoted.check()) == []
    unheard = H()  # without the transcript, P1 is still a parent: P2 jumped it
    unheard.log = demoted.log
    assert rules(unheard.check()) == ["order"]
    straddling = H()  # the role request still in flight at the grant: either tier, no violation
    straddling.log = h.log + H().ev(320, "grant", "P2", seq=2, spare=True).log
    straddling.tx = [r for r in h.tx if r["dir"] != "recv"]
    assert rules(straddling.check()) == []


def test_capacity_a_spare_holds_overlap_with_a_childs_is_no_violation_client_side() -> None:
    h = H()
    h.send("c", 0, op="acquire", queueKey=Q, sessionKey="C", role="child")
    h.grant(1, "C", 1, "child").granted("c", 2, "C", 1).beat("c", 3, "C")
    h.send("p", 10, op="acquire", queueKey=Q, sessionKey="P", role="parent", spare=True)
    h.ev(11, "grant", "P", seq=2, spare=True).granted("p", 12, "P", 2).beat("p", 13, "P")
    h.send("c", 100, op="release", queueKey=Q, sessionKey="C").ev(101, "release", "C", "child", reason="release")
    h.send("p", 100, op="release", queueKey=Q, sessionKey="P").ev(101, "release", "P", reason="release")
    report = h.check()
    clean(report)
    assert report.max_client_holds == {Q: 2}


def test_capacity_client_holds_that_overlap_beyond_max_streams_are_flagged_from_transcripts_alone() -> None:
    h = H()
    for conn, seq in (("a", 1), ("b", 2)):
        h.send(conn, 0, op="acquire", queueKey=Q, sessionKey=conn.upper())
        h.granted(conn, 10 * seq, conn.upper(), seq).beat(conn, 10 * seq + 1, conn.upper())
    h.send("a", 100, op="release", queueKey=Q, sessionKey="A").send("b", 100, op="release", queueKey=Q, sessionKey="B")
    report = check_history([], h.tx, policies={Q: SPEC}, sweep_ms=SWEEP, margin_ms=MARGIN)
    assert rules(report) == ["capacity"] and report.max_client_holds == {Q: 2}


def test_capacity_a_client_hold_ends_where_its_proof_ends_so_a_frozen_holder_does_not_overlap() -> None:
    """A holds from 10, beats at 11, then goes silent: it can prove the slot only until 11 + TTL.
    B's grant at 1100 does not overlap it, whatever A believed."""
    h = H()
    h.send("a", 0, op="acquire", queueKey=Q, sessionKey="A").granted("a", 10, "A", 1).beat("a", 11, "A")
    h.send("b", 5, op="acquire", queueKey=Q, sessionKey="B").granted("b", 1100, "B", 2).beat("b", 1101, "B")
    h.send("a", 1500, op="release", queueKey=Q, sessionKey="A").send("b", 1500, op="release", queueKey=Q, sessionKey="B")
    report = check_history([], h.tx, policies={Q: SPEC}, sweep_ms=SWEEP, margin_ms=MARGIN)
    clean(report)
    a = next(x for x in report.holds if x.session == "A")
    assert (a.start, a.end) == (EPOCH + 10, EPOCH + 11 + TTL)


def test_capacity_a_granted_reply_that_arrives_after_a_fenced_cancel_is_stale_not_a_hold() -> None:
    """A cancels and fences it with a bare renew; a grant sent before the cancel took effect
    arrives first: the cancel freed that slot, so it is no hold (and no violation)."""
    h = H()
    h.send("a", 0, op="acquire", queueKey=Q, sessionKey="A")
    h.send("a", 50, op="cancel", queueKey=Q, sessionKey="A").send("a", 51, op="renew")
    h.granted("a", 52, "A", 1).recv("a", 53, op="ok")
    h.send("b", 0, op="acquire", queueKey=Q, sessionKey="B").granted("b", 60, "B", 2).beat("b", 61, "B")
    h.send("b", 200, op="release", queueKey=Q, sessionKey="B")
    report = check_history([], h.tx, policies={Q: SPEC}, sweep_ms=SWEEP, margin_ms=MARGIN)
    clean(report)
    assert [x.session for x in report.holds] == ["B"]


# =================================================================================================
# (b) order
# =================================================================================================


def full_queue() -> H:
    """X holds; waiters queue in the order given by each test."""
    return H().grant(0, "X", 1)


def test_order_a_parent_granted_ahead_of_an_older_parent_is_flagged() -> None:
    h = full_queue().ev(10, "queued", "P1").ev(20, "queued", "P2").ev(30, "release", "X", reason="release")
    bad = H()
    bad.log = h.log + H().grant(30, "P2", 2, switch=True).log
    good = H()
    good.log = h.log + H().grant(30, "P1", 2, switch=True).log
    assert rules(bad.check()) == ["order"] and rules(good.check()) == []


def test_order_a_parent_goes_before_an_older_child_and_a_child_before_parents_needs_aging() -> None:
    h = full_queue().ev(10, "queued", "C1", "child").ev(20, "queued", "P1").ev(30, "release", "X", reason="release")
    parent_first = H()
    parent_first.log = h.log + H().grant(30, "P1", 2, switch=True).log
    assert rules(parent_first.check()) == []
    child_first = H()
    child_first.log = h.log + H().grant(30, "C1", 2, "child", switch=True).log
    report = child_first.check()
    assert rules(report) == ["order"] and "without aging" in report.violations[0].message


def test_order_a_child_that_waited_aging_after_ms_may_jump_the_parents() -> None:
    h = full_queue().ev(10, "queued", "C1", "child").ev(20, "queued", "P1")
    h.ev(10 + 500, "release", "X", reason="release").grant(510, "C1", 2, "child", switch=True)
    report = h.check()
    assert rules(report) == [] and report.stats["aging jumps"] == 1
    # Well short of agingAfterMs (beyond the timing margin): a jump without aging.
    early = full_queue().ev(10, "queued", "C1", "child").ev(20, "queued", "P1")
    early.ev(300, "release", "X", reason="release").grant(300, "C1", 2, "child", switch=True)
    assert rules(early.check()) == ["order"]


def test_order_a_child_that_saw_aging_after_slots_parent_grants_in_a_row_may_jump() -> None:
    spec = SPEC._replace(max_streams=1, aging_after_ms=0)
    h = full_queue().ev(10, "queued", "C1", "child")
    for i, p in enumerate(("P1", "P2", "P3", "P4")):
        h.ev(20 + i, "queued", p)
    seq = 1
    holder = "X"
    for i, p in enumerate(("P1", "P2")):  # two parents in a row: not yet
        seq += 1
        h.ev(100 + i * 10, "release", holder, reason="release").grant(100 + i * 10, p, seq, switch=True)
        holder = p
    two = H()
    two.log = h.log + H().ev(200, "release", holder, reason="release").grant(200, "C1", seq + 1, "child", switch=True).log
    assert rules(two.check(spec)) == ["order"]
    seq += 1
    h.ev(130, "release", holder, reason="release").grant(130, "P3", seq, switch=True)  # the third
    h.ev(200, "release", "P3", reason="release").grant(200, "C1", seq + 1, "child", switch=True)
    assert rules(h.check(spec)) == []


def test_order_a_parent_granted_while_the_oldest_child_was_due_by_slot_aging_is_flagged() -> None:
    spec = SPEC._replace(aging_after_ms=0)
    h = full_queue().ev(10, "queued", "C1", "child")
    for i, p in enumerate(("P1", "P2", "P3", "P4")):
        h.ev(20 + i, "queued", p)
    holder = "X"
    for i, p in enumerate(("P1", "P2", "P3", "P4")):
        h.ev(100 + i * 10, "release", holder, reason="release").grant(100 + i * 10, p, i + 2, switch=True)
        holder = p
    report = h.check(spec)
    assert rules(report) == ["order"] and "P4" in report.violations[0].message and "due by aging" in (
        report.violations[0].message)


def test_order_an_aged_child_must_still_be_the_oldest_child() -> None:
    h = full_queue().ev(10, "queued", "C1", "child").ev(11, "queued", "C2", "child").ev(20, "queued", "P1")
    h.ev(900, "release", "X", reason="release").grant(900, "C2", 2, "child", switch=True)
    report = h.check()
    assert rules(report) == ["order"] and "older child C1" in report.violations[0].message


def test_order_fifo_grants_in_enqueue_order_whatever_the_tier() -> None:
    spec = SPEC._replace(policy="fifo")
    h = full_queue().ev(10, "queued", "C1", "child").ev(20, "queued", "P1").ev(30, "release", "X", reason="release")
    child_first = H()
    child_first.log = h.log + H().grant(30, "C1", 2, "child", switch=True).log
    parent_first = H()
    parent_first.log = h.log + H().grant(30, "P1", 2, switch=True).log
    assert rules(child_first.check(spec)) == [] and rules(parent_first.check(spec)) == ["order"]


def test_order_a_direct_grant_while_someone_waits_is_a_queue_jump() -> None:
    h = full_queue().ev(10, "queued", "W").ev(20, "release", "X", reason="release").grant(20, "Z", 2)
    report = h.check()
    assert "order" in rules(report) and any("straight into a free slot" in v.message for v in report.violations)


def test_order_a_role_request_retiers_a_waiter_and_a_straddling_one_allows_both_tiers() -> None:
    """P1 was demoted to child by its own role request (fenced by a renew's reply), so the newer
    parent P2 goes first; a role request still in flight at the grant leaves both tiers possible."""
    h = full_queue().send("p1", 9, op="acquire", queueKey=Q, sessionKey="P1").ev(10, "queued", "P1")
    h.send("p2", 14, op="acquire", queueKey=Q, sessionKey="P2").ev(15, "queued", "P2")
    h.send("p1", 300, op="role", sessionKey="P1", role="child").send("p1", 300, op="renew").recv("p1", 302, op="ok")
    h.ev(600, "release", "X", reason="release")
    demoted = H()
    demoted.tx = h.tx
    demoted.log = h.log + H().grant(600, "P2", 2, switch=True).log
    assert rules(demoted.check(SPEC._replace(aging_after_slots=0, aging_after_ms=0))) == []
    unheard = H()  # without the transcript, P1 is still a parent: P2 went ahead of it
    unheard.log = demoted.log
    assert rules(unheard.check(SPEC._replace(aging_after_slots=0, aging_after_ms=0))) == ["order"]
    straddling = H()  # sent 20 ms before the grant, no reply yet: either tier may have been seen
    straddling.log = h.log[:-1] + H().ev(320, "release", "X", reason="release").grant(320, "P1", 2, switch=True).log
    straddling.tx = [r for r in h.tx if r["dir"] != "recv"]
    assert rules(straddling.check(SPEC._replace(aging_after_slots=0, aging_after_ms=0))) == []


def test_order_a_grant_line_whose_role_is_not_the_waiters_tier_is_flagged() -> None:
    h = full_queue().ev(10, "queued", "C1", "child").ev(20, "release", "X", reason="release")
    h.grant(20, "C1", 2, "parent", switch=True)
    assert rules(h.check()) == ["order"]


# =================================================================================================
# (c) TTL
# =================================================================================================


def frozen_holder(evict_at: float, beats: Sequence[float] = (3,)) -> H:
    """A is granted at 1 (reply at 2), beats at ``beats``, then goes silent until evicted."""
    h = H().send("a", 0, op="acquire", queueKey=Q, sessionKey="A").grant(1, "A", 1).granted("a", 2, "A", 1)
    for t in beats:
        h.beat("a", t, "A")
    return h.ev(evict_at, "evict", "A", reason="ttl")


def test_ttl_an_eviction_inside_last_beat_plus_ttl_plus_sweep_is_accepted() -> None:
    for evict_at in (403 + TTL - 1, 403 + TTL + SWEEP + MARGIN):  # the bounds, ts granularity and margin included
        clean(frozen_holder(evict_at, beats=(3, 203, 403)).check())


def test_ttl_an_eviction_before_the_last_certain_beat_plus_ttl_is_flagged() -> None:
    """Beats at 3, 203, 403 (each answered granted:true): an eviction at 1100 ignored two of them."""
    report = frozen_holder(1100, beats=(3, 203, 403)).check()
    assert rules(report) == ["ttl"] and "before its TTL lapsed" in report.violations[0].message


def test_ttl_an_eviction_later_than_ttl_plus_sweep_plus_margin_is_flagged() -> None:
    report = frozen_holder(403 + 1 + TTL + SWEEP + MARGIN + 5, beats=(3, 203, 403)).check()
    assert rules(report) == ["ttl"] and "past last beat + TTL + sweep" in report.violations[0].message


def test_ttl_a_bare_renew_sent_just_before_the_eviction_may_not_have_arrived_so_it_is_not_held_against_it() -> None:
    h = frozen_holder(1004, beats=(3,))
    h.send("a", 1000, op="renew")  # 4 ms before the sweep: maybe still on the wire
    clean(h.check())
    early = frozen_holder(1004, beats=(3,))
    early.send("a", 500, op="renew").recv("a", 501, op="ok")  # surely had: the eviction came too soon
    assert rules(early.check()) == ["ttl"]


def test_ttl_a_lease_still_answered_held_long_after_its_ttl_lapsed_is_a_missed_eviction() -> None:
    h = H().send("a", 0, op="acquire", queueKey=Q, sessionKey="A").grant(1, "A", 1).granted("a", 2, "A", 1)
    h.beat("a", 3, "A").beat("a", 3 + TTL + SWEEP + MARGIN + 50, "A")  # silent for TTL + sweep + margin, still held
    h.send("a", 1500, op="release", queueKey=Q, sessionKey="A").ev(1501, "release", "A", reason="release")
    report = h.check()
    assert rules(report) == ["ttl"] and "sweep missed it" in report.violations[0].message
    on_time = H().send("a", 0, op="acquire", queueKey=Q, sessionKey="A").grant(1, "A", 1).granted("a", 2, "A", 1)
    on_time.beat("a", 3, "A").beat("a", 3 + TTL - 10, "A").send("a", 1500, op="release", queueKey=Q, sessionKey="A")
    on_time.ev(1501, "release", "A", reason="release")
    clean(on_time.check())


def test_ttl_without_a_transcript_only_the_grant_bounds_the_eviction_from_below() -> None:
    h = H().grant(1000, "A", 1).ev(1000 + TTL - MARGIN - 5, "evict", "A", reason="ttl")
    report = h.check()
    assert rules(report) == ["ttl"] and report.stats["ttl evictions checked against beats"] == 0
    late = H().grant(1000, "A", 1).ev(1000 + 10 * TTL, "evict", "A", reason="ttl")  # nothing to bound it above
    clean(late.check())


def test_ttl_a_keyed_beat_answered_false_while_the_log_shows_the_lease_is_an_inconsistency() -> None:
    h = H().send("a", 0, op="acquire", queueKey=Q, sessionKey="A").grant(1, "A", 1).granted("a", 2, "A", 1)
    h.beat("a", 50, "A", held=False).send("a", 300, op="release", queueKey=Q, sessionKey="A")
    h.ev(301, "release", "A", reason="release")
    assert rules(h.check()) == ["consistency"]
    near = H().send("a", 0, op="acquire", queueKey=Q, sessionKey="A").grant(1, "A", 1).granted("a", 2, "A", 1)
    near.beat("a", 250, "A", held=False).ev(301, "release", "A", reason="release")  # within the margin: either order
    clean(near.check())


# =================================================================================================
# (d) double holds and seq
# =================================================================================================


def test_double_hold_a_grant_to_a_session_that_already_holds_is_flagged() -> None:
    h = H().grant(0, "A", 1).grant(10, "A", 2)
    assert rules(h.check(SPEC._replace(max_streams=5))) == ["double-hold"]


def test_double_hold_a_queued_line_for_a_holder_is_flagged() -> None:
    h = H().grant(0, "A", 1).ev(10, "queued", "A")
    assert "double-hold" in rules(h.check())


def test_seq_a_grant_seq_that_does_not_increase_is_flagged() -> None:
    spec = SPEC._replace(max_streams=5)
    assert rules(H().grant(0, "A", 1).grant(1, "B", 2).grant(2, "C", 2).check(spec)) == ["seq"]
    assert rules(H().grant(0, "A", 3).grant(1, "B", 2).check(spec)) == ["seq"]
    assert rules(H().grant(0, "A", 1).grant(1, "B", 7).check(spec)) == []  # gaps are fine: other queues' grants
    assert rules(H().ev(0, "grant", "A").check(spec)) == ["seq"]  # no seq at all


def test_seq_is_per_queue() -> None:
    other = "http://gpu:8002/v1"
    h = H().grant(0, "A", 1).grant(1, "B", 1, queue=other).grant(2, "C", 2, queue=other)
    assert rules(h.check(policies={Q: SPEC, other: SPEC._replace(max_streams=2)})) == []


def test_double_hold_a_client_granted_a_new_seq_while_it_holds_an_older_one_is_flagged() -> None:
    h = H().send("a", 0, op="acquire", queueKey=Q, sessionKey="A").granted("a", 1, "A", 1).beat("a", 2, "A")
    h.send("b", 5, op="acquire", queueKey=Q, sessionKey="A").granted("b", 6, "A", 2)
    report = check_history([], h.tx, policies={Q: SPEC._replace(max_streams=3)}, sweep_ms=SWEEP, margin_ms=MARGIN)
    assert rules(report) == ["double-hold"]
    regrant = H().send("a", 0, op="acquire", queueKey=Q, sessionKey="A").granted("a", 1, "A", 1).beat("a", 2, "A")
    regrant.send("b", 5, op="acquire", queueKey=Q, sessionKey="A").granted("b", 6, "A", 1)  # the same lease
    clean(check_history([], regrant.tx, policies={Q: SPEC}, sweep_ms=SWEEP, margin_ms=MARGIN))


# =================================================================================================
# (e) waiters
# =================================================================================================


def waiting_w() -> H:
    return full_queue().send("w", 9, op="acquire", queueKey=Q, sessionKey="W").ev(10, "queued", "W")


def test_waiter_dequeued_as_cancelled_without_its_cancel_is_flagged() -> None:
    bad = waiting_w().ev(100, "dequeue", "W", reason="cancel")
    report = bad.check()  # and, as its client still waits: a vanished waiter
    assert set(rules(report)) == {"waiter"} and any("sent no cancel" in v.message for v in report.violations)
    good = waiting_w().send("w", 99, op="cancel", queueKey=Q, sessionKey="W").ev(100, "dequeue", "W", reason="cancel")
    assert rules(good.check()) == []


def test_waiter_dequeued_as_disconnected_while_its_connection_is_open_is_flagged() -> None:
    bad = waiting_w().ev(100, "dequeue", "W", reason="disconnect")
    report = bad.check()
    assert set(rules(report)) == {"waiter"} and any("none of its connections closed" in v.message
                                                    for v in report.violations)
    good = waiting_w().close("w", 99).ev(100, "dequeue", "W", reason="disconnect")
    assert rules(good.check()) == []
    bye = waiting_w().send("w", 99, op="bye").ev(100, "dequeue", "W", reason="disconnect")
    assert rules(bye.check()) == []


def test_a_daemon_kept_off_the_cpu_logs_the_enqueue_after_the_close_and_that_is_no_violation() -> None:
    """The acquire and the hang-up are read in one late turn (past the margin): the waiter is
    logged queued, then dequeued, both after the close.  The close came during its life, which
    began when its acquire was sent.  A close before that acquire still does not count."""
    late = (full_queue().send("w", 9, op="acquire", queueKey=Q, sessionKey="W").close("w", 20)
            .ev(400, "queued", "W").ev(400, "dequeue", "W", reason="disconnect"))
    assert rules(late.check()) == []
    before = (full_queue().send("old", 2, op="acquire", queueKey=Q, sessionKey="W").close("old", 5)
              .send("w", 9, op="acquire", queueKey=Q, sessionKey="W")
              .ev(400, "queued", "W").ev(400, "dequeue", "W", reason="disconnect"))
    assert "waiter" in rules(before.check())


def test_a_late_turn_that_reads_a_close_and_the_reconnect_s_acquire_dequeues_the_old_waiter() -> None:
    """The client waits on ``w``, drops it and asks again on ``w2`` at once; a daemon kept off the
    CPU logs the first waiter queued and dequeued after both, then the second queued.  The close
    answers for the dequeue.  A second dequeue has no close left to answer for it."""
    late = (full_queue().send("w", 9, op="acquire", queueKey=Q, sessionKey="W").close("w", 20)
            .send("w2", 30, op="acquire", queueKey=Q, sessionKey="W")
            .ev(400, "queued", "W").ev(400, "dequeue", "W", reason="disconnect").ev(401, "queued", "W"))
    clean(late.check())
    twice = (full_queue().send("w", 9, op="acquire", queueKey=Q, sessionKey="W").close("w", 20)
             .send("w2", 30, op="acquire", queueKey=Q, sessionKey="W")
             .ev(400, "queued", "W").ev(400, "dequeue", "W", reason="disconnect").ev(401, "queued", "W")
             .ev(500, "dequeue", "W", reason="disconnect"))
    report = twice.check()
    assert "waiter" in rules(report) and any("none of its connections closed" in v.message
                                             for v in report.violations)


def test_a_close_before_a_grant_the_client_saw_does_not_answer_for_a_later_dequeue() -> None:
    """``old`` closes while ``w`` also waits for the session (no dequeue: ``w`` still asks); the
    session is granted, released, and queued again on ``w``; a dequeue as disconnected then, with
    ``w`` open, is flagged: the old close belonged to the life that ended in the grant."""
    h = (full_queue().send("old", 5, op="acquire", queueKey=Q, sessionKey="W")
         .send("w", 8, op="acquire", queueKey=Q, sessionKey="W").ev(10, "queued", "W").close("old", 20)
         .ev(100, "release", "X", reason="release").grant(100, "W", 2, switch=True).granted("w", 101, "W", 2)
         .send("w", 150, op="release", queueKey=Q, sessionKey="W").ev(151, "release", "W", reason="release")
         .send("w", 300, op="acquire", queueKey=Q, sessionKey="W").ev(301, "queued", "W")
         .ev(600, "dequeue", "W", reason="disconnect"))
    report = h.check()
    assert any("none of its connections closed" in v.message for v in report.violations)


def test_waiter_still_waiting_at_the_end_is_reported_and_must_be_in_the_final_status() -> None:
    h = waiting_w()
    listed = [{"queueKey": Q, "holders": [{"sessionKey": "X"}], "waiting": [{"sessionKey": "W"}]}]
    report = h.check(final_status=listed)
    assert rules(report) == [] and report.waiting_at_end == {Q: ["W"]}
    vanished = [{"queueKey": Q, "holders": [{"sessionKey": "X"}], "waiting": []}]
    report = h.check(final_status=vanished)
    assert rules(report) == ["waiter"] and "vanished" in report.violations[0].message
    unknown = [{"queueKey": Q, "holders": [{"sessionKey": "X"}], "waiting": [{"sessionKey": "W"}, {"sessionKey": "V"}]}]
    assert rules(h.check(final_status=unknown)) == ["waiter"]


def test_waiter_an_acquire_its_client_still_waits_on_must_be_waiting_or_held_by_the_log() -> None:
    h = full_queue().send("w", 9, op="acquire", queueKey=Q, sessionKey="W")  # the log never queued it
    report = h.check()
    assert rules(report) == ["waiter"] and report.pending_acquires == [("w", Q, "W")]
    clean(waiting_w().check())
    h.close("w", 50)  # a client that went away no longer waits
    assert rules(h.check()) == []


def test_waiter_granted_after_its_connection_closed_is_a_dead_waiter() -> None:
    h = waiting_w().close("w", 50).ev(400, "release", "X", reason="release").grant(400, "W", 2, switch=True)
    h.ev(400, "release", "W", reason="disconnect")
    report = h.check()
    assert rules(report) == ["waiter"] and "dead waiter" in report.violations[0].message
    racing = waiting_w().close("w", 350).ev(400, "release", "X", reason="release").grant(400, "W", 2, switch=True)
    racing.ev(400, "release", "W", reason="disconnect")  # closed within the margin: maybe not seen yet
    clean(racing.check())
    reconnected = waiting_w().close("w", 50).send("w2", 60, op="acquire", queueKey=Q, sessionKey="W")
    reconnected.ev(400, "release", "X", reason="release").grant(400, "W", 2, switch=True)
    clean(reconnected.check())


def test_a_killed_client_is_a_dead_waiter_only_once_it_was_certainly_reaped() -> None:
    """The killer reads the clock before the kill; a process that dies slowly on a loaded machine
    keeps its sockets until it is reaped, and the record's ``by`` says when that was."""
    slow = waiting_w().close("w", 50, by=390).ev(400, "release", "X", reason="release").grant(400, "W", 2, switch=True)
    slow.ev(400, "release", "W", reason="disconnect")
    clean(slow.check())
    dead = waiting_w().close("w", 50, by=150).ev(400, "release", "X", reason="release").grant(400, "W", 2, switch=True)
    dead.ev(400, "release", "W", reason="disconnect")
    report = dead.check()
    assert rules(report) == ["waiter"] and "dead waiter" in report.violations[0].message


def test_waiter_queued_twice_is_flagged() -> None:
    assert "waiter" in rules(waiting_w().ev(20, "queued", "W").check())


# =================================================================================================
# consistency of the log and the transcripts
# =================================================================================================


@pytest.mark.parametrize("lines,needle", [
    pytest.param([("release", "A")], "holds nothing", id="release-of-a-non-holder"),
    pytest.param([("evict", "A")], "holds nothing", id="evict-of-a-non-holder"),
    pytest.param([("dequeue", "A")], "waits for nothing", id="dequeue-of-a-non-waiter"),
    pytest.param([("switch", "A")], "does not follow the grant of a waiter", id="switch-without-grant"),
])
def test_consistency_a_log_line_about_someone_not_there_is_flagged(lines: List[Any], needle: str) -> None:
    h = H()
    for event, session in lines:
        h.ev(0, event, session, reason="ttl" if event == "evict" else "release", seq=1)
    report = h.check()
    assert rules(report) == ["consistency"] and needle in report.violations[0].message


def test_consistency_a_waiters_grant_without_its_switch_line_is_flagged() -> None:
    h = full_queue().ev(10, "queued", "W").ev(20, "release", "X", reason="release").grant(20, "W", 2)
    assert rules(h.check()) == ["consistency"]


def test_consistency_a_granted_reply_whose_seq_no_grant_line_has_is_flagged() -> None:
    h = H().send("a", 0, op="acquire", queueKey=Q, sessionKey="A").grant(1, "A", 1).granted("a", 2, "A", 9)
    assert rules(h.check()) == ["consistency"]


def test_consistency_a_ts_that_goes_backwards_is_flagged() -> None:
    h = H().grant(10, "A", 1).ev(5, "release", "A", reason="release")
    assert rules(h.check()) == ["consistency"]


def test_consistency_final_status_holders_differ_from_the_replay() -> None:
    h = H().grant(0, "A", 1)
    assert rules(h.check(final_status=[{"queueKey": Q, "holders": [], "waiting": []}])) == ["consistency"]


# =================================================================================================
# inputs
# =================================================================================================


def test_parse_ts_reads_the_daemons_iso_milliseconds_as_epoch_ms() -> None:
    assert parse_ts(iso(1234.0)) == EPOCH + 1234.0
    assert parse_ts("1970-01-01T00:00:01.005Z") == 1005.0


def test_transcript_files_survive_a_torn_last_line_and_specs_come_from_a_config(tmp_path: Any) -> None:
    path = str(tmp_path / "t.jsonl")
    f = TranscriptFile(path)
    f.write(record("c", "send", {"op": "status"}, t=1.0))
    f.close()
    with open(path, "a") as g:
        g.write('{"conn": "c", "t": 2.0, "dir": "re')  # killed mid-write
    assert load_transcripts([path]) == [{"conn": "c", "t": 1.0, "dir": "send", "msg": {"op": "status"}}]
    default, specs = specs_from_config({"defaults": {"leaseTtlMs": 2000, "maxStreams": 2},
                                        "queues": {Q: {"policy": "fifo"}, "off": {"enabled": False}}})
    assert default == QueueSpec(max_streams=2, lease_ttl_ms=2000)
    assert specs[Q] == QueueSpec(max_streams=2, policy="fifo", lease_ttl_ms=2000)
    assert specs["off"].max_streams is None


# =================================================================================================
# a real daemon's history
# =================================================================================================


def record_real_history(tmp_path: Any) -> Dict[str, Any]:
    """A holds; child B and parent C queue; A releases to C (tier), C to B; D is granted and
    freezes until the TTL reclaims it (the socket stays open); E cancels; F disconnects."""
    log_file = str(tmp_path / "events.log")
    config = {"defaults": {"logFile": log_file, "leaseTtlMs": TTL},
              "queues": {Q: {"maxStreams": 1, "idleYieldMs": 0}}}
    tx: List[Dict[str, Any]] = []
    with DaemonProc(config=config) as d:
        d.start()

        def peer(name: str) -> TracedPeer:
            return TracedPeer(d.peer(), name, tx)

        def acquire(p: TracedPeer, session: str, role: str = "parent") -> None:
            p.send({"op": "acquire", "queueKey": Q, "sessionKey": session, "role": role})

        def release(p: TracedPeer, session: str) -> None:
            assert p.ask({"op": "release", "queueKey": Q, "sessionKey": session})["op"] == "ok"

        a, b, c, dd, e, f = (peer(n) for n in "abcdef")
        acquire(a, "A")
        assert a.recv()["op"] == "granted"
        acquire(b, "B", "child")
        wait_for(lambda: d.waiting(Q) == ["B"])
        acquire(c, "C")
        wait_for(lambda: d.waiting(Q) == ["B", "C"])
        release(a, "A")
        assert c.recv()["sessionKey"] == "C"
        release(c, "C")
        assert b.recv()["sessionKey"] == "B"
        acquire(dd, "D")
        wait_for(lambda: d.waiting(Q) == ["D"])
        acquire(e, "E")
        wait_for(lambda: d.waiting(Q) == ["D", "E"])
        e.send({"op": "cancel", "queueKey": Q, "sessionKey": "E"})
        acquire(f, "F", "child")
        wait_for(lambda: d.waiting(Q) == ["D", "F"])
        f.close()
        wait_for(lambda: d.waiting(Q) == ["D"])
        release(b, "B")
        assert dd.recv()["sessionKey"] == "D"
        assert dd.ask({"op": "renew", "queueKey": Q, "sessionKey": "D"})["granted"] is True
        # D now goes silent; its lease lapses and the sweep evicts it.
        wait_for(lambda: d.holders(Q) == [], timeout=TTL / 1000.0 + 3)
        assert dd.ask({"op": "renew", "queueKey": Q, "sessionKey": "D"})["granted"] is False
        status = d.status()

        def logged_evict() -> Optional[List[Dict[str, Any]]]:
            got = load_log(log_file)
            return got if any(x["event"] == "evict" for x in got) else None

        lines = wait_for(logged_evict)
    return {"log": lines, "tx": tx, "status": status, "spec": specs_from_config(config)}


def check_real(h: Dict[str, Any], log: Optional[List[Dict[str, Any]]] = None) -> Report:
    default, specs = h["spec"]
    return check_history(h["log"] if log is None else log, h["tx"], policies=specs, default=default,
                         sweep_ms=SWEEP, margin_ms=MARGIN, final_status=h["status"])


def test_a_real_daemon_history_is_clean_and_each_tampered_line_is_caught(tmp_path: Any) -> None:
    h = record_real_history(tmp_path)
    report = check_real(h)
    clean(report)
    assert report.stats["ttl evictions checked against beats"] == 1 and report.stats["switches replayed"] == 3
    log: List[Dict[str, Any]] = h["log"]

    def tampered(edit: Any) -> List[str]:
        copy = json.loads(json.dumps(log))
        edit(copy)
        return rules(check_real(h, copy))

    def index(lines: List[Dict[str, Any]], event: str, session: str) -> int:
        return next(i for i, x in enumerate(lines) if x["event"] == event and x.get("sessionKey") == session)

    def drop_release_of_a(lines: List[Dict[str, Any]]) -> None:
        del lines[index(lines, "release", "A")]

    def evict_early(lines: List[Dict[str, Any]]) -> None:
        ev = lines[index(lines, "evict", "D")]
        ev["ts"] = iso(parse_ts(ev["ts"]) - EPOCH - 500)

    def repeat_seq(lines: List[Dict[str, Any]]) -> None:
        lines[index(lines, "grant", "B")]["seq"] = lines[index(lines, "grant", "C")]["seq"]
        lines[index(lines, "switch", "B")]["seq"] = lines[index(lines, "grant", "C")]["seq"]

    def child_first(lines: List[Dict[str, Any]]) -> None:
        lines[index(lines, "queued", "B")]["role"] = "parent"  # B was queued first: as a parent it goes first

    def lose_cancel(lines: List[Dict[str, Any]]) -> None:
        lines[index(lines, "dequeue", "E")]["reason"] = "disconnect"

    assert "capacity" in tampered(drop_release_of_a)
    assert tampered(evict_early) == ["ttl"]
    assert "seq" in tampered(repeat_seq)
    assert "order" in tampered(child_first)
    assert tampered(lose_cancel) == ["waiter"]
