"""Dead time is visible (issue 13, item 5): the time a slot was held with no request of its holder
in flight while someone waited for it.

A client says when a request is in flight with ``busy`` on a keyed ``renew`` (additive; the reply
echoes it): ``false`` at a request's end starts an idle spell, ``true`` at the next request's
start ends it.  A park starts one too (an activity beat that un-parks ends it), and a silent
flagged holder's spell runs from its last activity to its idle yield.  The part of a spell during
which someone waited (from the oldest waiter's arrival) is dead time: ``status`` counts it per
queue (``deadMs``) and per session (``deadMsBySession``), the log has a ``dead`` event at each
spell's end, ``llmqueue report`` prints it per queue and session, and the SVG marks it on the
holder's bar.  ``Client`` sessions and the proxy say ``busy`` around every request.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict

import pytest

import llmqueue as lq
from tests.harness import short_tmpdir, started, wait_for
from tests.test_handover import client_of, grant_after, log_lines

K = "http://127.0.0.1:8001/v1"


def acquire(session: str, role: str = "parent") -> Dict[str, Any]:
    return {"op": "acquire", "queueKey": K, "sessionKey": session, "role": role, "activity": True}


def busy(session: str, flag: Any) -> Dict[str, Any]:
    return {"op": "renew", "queueKey": K, "sessionKey": session, "busy": flag}


def test_an_idle_spell_while_someone_waits_is_dead_time_from_the_waiters_arrival() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        assert a.ask(busy("A", False)) == {"op": "ok", "queueKey": K, "sessionKey": "A", "granted": True,
                                           "busy": False}
        time.sleep(0.4)  # idle, but nobody waits: not dead
        b.send(acquire("B"))
        wait_for(lambda: d.waiting(K) == ["B"])
        time.sleep(0.3)
        assert a.ask(busy("A", True))["busy"] is True
        q = d.queue(K)
        assert 250 <= q["deadMs"] < 400 + 2000  # from B's arrival: not the 0.7 s of the whole spell
        assert set(q["deadMsBySession"]) == {"A"} and q["deadMsBySession"]["A"] == q["deadMs"]
        time.sleep(0.3)  # a request in flight while B waits: not dead
        a.send({"op": "release", "queueKey": K, "sessionKey": "A"})
        assert b.recv(2.0)["op"] == "granted"
        assert d.queue(K)["deadMs"] == q["deadMs"]
        spells = wait_for(lambda: [e for e in log_lines(log) if e["event"] == "dead"])
        assert [(e["sessionKey"], e["role"]) for e in spells] == [("A", "parent")]
        assert abs(spells[0]["ms"] - q["deadMs"]) <= 1


def test_an_idle_holder_nobody_waits_for_has_no_dead_time() -> None:
    for d in started():
        a = d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        a.ask(busy("A", False))
        time.sleep(0.3)
        a.ask(busy("A", True))
        a.send({"op": "release", "queueKey": K, "sessionKey": "A"})
        assert a.recv(2.0)["op"] == "ok"
        assert d.queue(K)["deadMs"] == 0 and "deadMsBySession" not in d.queue(K)


def test_an_idle_spell_ended_by_the_release_counts_until_the_waiter_is_granted() -> None:
    for d in started():
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        b.send(acquire("B"))
        wait_for(lambda: d.waiting(K) == ["B"])
        a.ask(busy("A", False))
        time.sleep(0.3)
        a.send({"op": "release", "queueKey": K, "sessionKey": "A"})
        assert b.recv(2.0)["op"] == "granted"
        assert 250 <= d.queue(K)["deadMs"] < 300 + 2000


def test_a_park_hands_over_at_once_so_it_costs_no_dead_time() -> None:
    for d in started():
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        b.send(acquire("B"))
        wait_for(lambda: d.waiting(K) == ["B"])
        a.send({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True})
        assert b.recv(2.0)["op"] == "granted"
        assert d.queue(K)["deadMs"] < 100


def test_a_silent_holder_is_dead_from_its_last_activity_to_its_idle_yield() -> None:
    for d in started(config={"defaults": {"idleYieldMs": 600}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        b.send(acquire("B"))  # waits from the start: the whole idle window is dead
        assert b.recv(5.0)["op"] == "granted"
        assert 500 <= d.queue(K)["deadMs"] < 600 + 2000


@pytest.mark.parametrize("bad", ["yes", 1, 0, None])
def test_a_bad_busy_is_an_error_reply_that_changes_nothing(bad: Any) -> None:
    for d in started():
        a = d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        line = busy("A", bad)
        if bad is None:
            # an explicit null is absent: a plain activity beat
            assert a.ask(line) == {"op": "ok", "queueKey": K, "sessionKey": "A", "granted": True}
            continue
        reply = a.ask(line)
        assert reply["op"] == "error" and "busy must be true or false" in reply["reason"]
        # it names what it refuses, so a client matching keyed replies in order stays in step
        assert {k: v for k, v in reply.items() if k != "reason"} == {
            "op": "error", "request": "renew", "queueKey": K, "sessionKey": "A"}
        assert d.holders(K) == ["A"] and d.queue(K)["deadMs"] == 0


def test_a_refused_renew_answers_its_own_beat_in_the_client_not_the_next_one() -> None:
    """A ``Client`` matches the replies to a session's keyed renews in the order it sent them.  A
    renew the daemon refuses (a client's bug: here a ``busy`` of the wrong type) takes its own
    place in that order, so the beat sent after it gets its own answer, not the refusal."""
    for d in started():
        with client_of(d) as client:
            lease = client.acquire(K, "A", "parent")
            bad = client._send_beat(lease, busy("A", "yes"))
            good = client._send_beat(lease, busy("A", False))
            assert good.event.wait(5.0) and bad.event.wait(5.0)
            assert bad.reply is not None and bad.reply["op"] == "error"
            assert good.reply == {"op": "ok", "queueKey": K, "sessionKey": "A", "granted": True, "busy": False}
            assert lease.held and not lease.lost
            lease.release()


def test_client_sessions_say_busy_so_a_tool_gap_someone_waits_through_shows_in_status_report_and_svg() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    # switches re-prefill here (``dear``): sub1 keeps its slot through the tool call, and sub2
    # waits through it (where the cost is unknown, sub1 would give way at its first gap to find out)
    for d in started(config={"defaults": {"logFile": log, "switchCost": "dear"}}):
        with client_of(d) as client:
            s = client.session(K, "sub1", "child", grace_ms=1500)
            with s.run():
                with s.request():
                    other = grant_after(client, "sub2", "child")
                    wait_for(lambda: d.waiting(K) == ["sub2"])
                time.sleep(0.5)  # a tool call; sub2 waits (before its first gap, the window is the grace)
                with s.request():
                    pass
                assert d.queue(K)["deadMsBySession"]["sub1"] >= 400
            other.join(5.0)
            other.lease.release()
        events = wait_for(lambda: [e for e in lq.read_event_log([log]) if e["event"] == "dead"] and
                          lq.read_event_log([log]))
        report = lq.build_report(events)
        r = report["queues"][K]
        assert r["deadMs"] >= 400 and set(r["deadMsBySession"]) == {"sub1"}
        text = lq.format_report(report)
        assert "dead time: " in text and "sub1" in text.split("dead time: ")[1].splitlines()[0]
        svg = lq.render_svg(events)
        assert svg.count('class="dead"') >= 2  # the legend's swatch, and the mark on sub1's bar


def test_a_frozen_holder_is_dead_from_its_last_heartbeat_to_its_eviction() -> None:
    for d in started(config={"defaults": {"leaseTtlMs": 1000}}, sweep_ms=50):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"  # and never beats again
        b.send(acquire("B"))
        assert b.recv(5.0)["op"] == "granted"
        assert d.queue(K)["ttlEvictions"] == 1
        assert 900 <= d.queue(K)["deadMs"] < 1000 + 2000
