"""``maxStreams: "auto"`` (issue 33, "How many at once"): a queue runs as many requests at once as
its server runs without one pushing another's context out.

The facts are the server's own: how many slots it has and the tokens one slot may hold
(llama.cpp's ``/props``: ``total_slots`` and ``default_generation_settings.n_ctx``), carried by
the ``usage`` op's additive ``slots`` and ``slotContext``, and the contexts' sizes, from the usage
reports.  The number is the slots, and no more than the contexts of the largest size seen (grown
by the most one grew between two requests) that one slot's tokens hold: on llama-server's unified
KV a slot may take all of it, so that many running contexts fit.  Until the server's figures and
a context's size are known it is one stream.  A rise grants the waiters at once; a fall preempts
nobody.  ``status`` shows the number as ``maxStreams`` and what it went by as ``streamsAuto``;
the log's usage line carries ``maxStreams`` when it changed.  A fixed ``maxStreams`` ignores the
figures.  The proxy asks its upstream's ``/props`` and reports them with every usage.

The usage op's additive ``decoded`` and ``decodeMs`` are logged with how many requests ran at once.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict

import pytest

import llmqueue as lq
from tests.harness import short_tmpdir, started, wait_for
from tests.kvsim import KVSim
from tests.test_handover import log_lines
from tests.test_proxy import chat_all, open_proxy

K = "http://127.0.0.1:8001/v1"


def usage(session: str, tokens: int, **server: int) -> Dict[str, Any]:
    msg: Dict[str, Any] = {"op": "usage", "queueKey": K, "sessionKey": session, "prefilled": tokens, "reused": 0}
    msg.update(server)
    return msg


def acquire(session: str) -> Dict[str, Any]:
    return {"op": "acquire", "queueKey": K, "sessionKey": session}


# -- config ------------------------------------------------------------------------------------------


def test_auto_is_a_valid_max_streams_that_starts_at_one_and_a_number_overrides_it() -> None:
    cfg, errors, _ = lq.validate_config({"defaults": {"maxStreams": "auto"},
                                         "queues": {"fixed": {"match": ["http://h:2/v1"], "maxStreams": 2}}})
    assert not errors
    assert cfg.defaults.streams_auto and cfg.defaults.max_streams == 1
    assert not cfg.queues[0].policy.streams_auto and cfg.queues[0].policy.max_streams == 2


@pytest.mark.parametrize("bad", ["Auto", "many", "2", ""])
def test_a_max_streams_word_other_than_auto_names_both_forms(bad: str) -> None:
    _, errors, _ = lq.validate_config({"queues": {"zen": {"maxStreams": bad}}})
    assert errors == [f'queues.zen.maxStreams must be a positive integer or "auto" (got "{bad}")']


# -- the wire ----------------------------------------------------------------------------------------


def test_auto_runs_one_stream_until_the_server_and_a_context_are_known_then_grants_its_waiters() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"maxStreams": "auto", "logFile": log}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        b.send(acquire("B"))
        assert b.silent()  # nothing known: one stream
        q = d.queue(K)
        assert q["maxStreams"] == 1 and q["streamsAuto"] == {}
        # a context's size, but not the server's; the reply says the queue wants them
        assert a.ask(usage("A", 1000)) == {"op": "ok", "queueKey": K, "sessionKey": "A", "switchCost": "unknown",
                                           "streams": "auto"}
        assert b.silent() and d.queue(K)["streamsAuto"] == {"context": 1000}
        # 4 slots of 8,000 tokens: 8 contexts of 1,000 fit in one, so every slot runs
        a.send(usage("A", 1000, slots=4, slotContext=8000))
        assert b.recv()["op"] == "granted"  # at once, before the report's own reply
        assert a.recv()["op"] == "ok"
        q = d.queue(K)
        assert q["maxStreams"] == 4
        assert q["streamsAuto"] == {"slots": 4, "slotContext": 8000, "context": 1000}
        assert [h["sessionKey"] for h in q["holders"]] == ["A", "B"]
        wait_for(lambda: any(e.get("maxStreams") == 4 for e in log_lines(log) if e["event"] == "usage"))


def test_auto_counts_a_contexts_growth_and_a_fall_preempts_nobody() -> None:
    for d in started(config={"defaults": {"maxStreams": "auto"}}):
        a, b, c = d.peer(), d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        a.ask(usage("A", 1000, slots=4, slotContext=8000))
        assert b.ask(acquire("B"))["op"] == "granted"
        a.ask(usage("A", 1500, slots=4, slotContext=8000))  # grew by 500: 2,000 a context
        assert d.queue(K)["maxStreams"] == 4
        a.ask(usage("A", 3000, slots=4, slotContext=8000))  # grew by 1,500: 4,500 a context, one fits
        q = d.queue(K)
        assert q["maxStreams"] == 1 and q["streamsAuto"]["context"] == 4500
        assert [h["sessionKey"] for h in q["holders"]] == ["A", "B"]  # nobody preempted
        c.send(acquire("C"))
        assert c.silent()
        assert a.ask({"op": "release", "queueKey": K, "sessionKey": "A"})["op"] == "ok"
        assert c.silent()  # B still holds the one stream
        assert b.ask({"op": "release", "queueKey": K, "sessionKey": "B"})["op"] == "ok"
        assert c.recv()["op"] == "granted"


def test_auto_is_at_most_the_servers_slots() -> None:
    for d in started(config={"defaults": {"maxStreams": "auto"}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        a.ask(usage("A", 100, slots=1, slotContext=100000))
        assert d.queue(K)["maxStreams"] == 1
        b.send(acquire("B"))
        assert b.silent()


def test_a_fixed_max_streams_ignores_the_servers_figures() -> None:
    for d in started(config={"defaults": {"maxStreams": 1}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        assert "streams" not in a.ask(usage("A", 100, slots=4, slotContext=100000))
        b.send(acquire("B"))
        assert b.silent()
        q = d.queue(K)
        assert q["maxStreams"] == 1 and "streamsAuto" not in q


@pytest.mark.parametrize("bad", [{"slots": 0}, {"slots": -1}, {"slots": "4"}, {"slots": True},
                                 {"slots": 1.5}, {"slots": 5000}, {"slotContext": 0}, {"slotContext": 1 << 60}])
def test_bad_server_figures_are_an_error_reply_that_changes_nothing(bad: Dict[str, Any]) -> None:
    for d in started(config={"defaults": {"maxStreams": "auto"}}):
        a = d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        figures: Dict[str, Any] = dict({"slots": 4, "slotContext": 8000}, **bad)
        reply = a.ask(usage("A", 1000, **figures))
        assert reply["op"] == "error" and next(iter(bad)) in reply["reason"], reply
        q = d.queue(K)
        assert q["maxStreams"] == 1 and q["streamsAuto"] == {} and "tokens" not in q
        assert a.ask({"op": "renew", "queueKey": K, "sessionKey": "A"})["granted"] is True


def test_status_for_people_says_what_auto_went_by() -> None:
    text = lq.format_status([{"queueKey": K, "maxStreams": 3, "holders": [], "waiting": [],
                              "streamsAuto": {"slots": 4, "slotContext": 8192, "context": 2500}}])
    assert "0/3 (auto: 4 slots of 8,192 tokens, contexts up to 2,500)" in text
    text = lq.format_status([{"queueKey": K, "maxStreams": 1, "holders": [], "waiting": [], "streamsAuto": {}}])
    assert "0/1 (auto: the server's slots not known yet)" in text


# -- how fast the server decoded, alone and side by side ---------------------------------------------
#
# A usage report's ``decoded`` and ``decodeMs`` (llama.cpp's ``timings.predicted_n`` and
# ``predicted_ms``) go to the log's usage line with ``atOnce``: the mean of the queue's requests in
# flight at once over the request's time, its own included (only where that is more than one).
# ``llmqueue report`` adds the times up.  Nothing decides by them: two rules that priced running
# side by side by them lost on the simulator (bench/RESULTS.md).


def timed(session: str, tokens: int, decoded: int, decode_ms: float, **server: int) -> Dict[str, Any]:
    msg = usage(session, tokens, **server)
    msg.update(decoded=decoded, decodeMs=decode_ms)
    return msg


def busy(peer: Any, session: str, flag: bool) -> None:
    assert peer.ask({"op": "renew", "queueKey": K, "sessionKey": session, "busy": flag})["granted"] is True


def usage_lines(log: str, session: str, count: int) -> list[Dict[str, Any]]:
    wait_for(lambda: len([e for e in log_lines(log) if e["event"] == "usage" and e["sessionKey"] == session]) >= count)
    return [e for e in log_lines(log) if e["event"] == "usage" and e["sessionKey"] == session]


def test_the_log_says_how_fast_the_server_decoded_and_how_many_requests_ran_at_once() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"maxStreams": "auto", "logFile": log}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        assert a.ask(timed("A", 1000, 100, 1000.0, slots=4, slotContext=8000))["op"] == "ok"  # alone
        busy(a, "A", False)
        assert b.ask(acquire("B"))["op"] == "granted"
        busy(a, "A", True)  # A's next request, wholly beside B's
        assert a.ask(timed("A", 1000, 100, 2000.0))["op"] == "ok"
        busy(b, "B", False)
        busy(b, "B", True)  # B's next request, wholly beside A's
        assert b.ask(timed("B", 1000, 100, 2000.0))["op"] == "ok"
        first, second = usage_lines(log, "A", 2)
        assert (first["decoded"], first["decodeMs"]) == (100, 1000.0) and "atOnce" not in first
        assert (second["decoded"], second["decodeMs"], second["atOnce"]) == (100, 2000.0, 2)
        assert usage_lines(log, "B", 1)[0]["atOnce"] == 2


def test_a_request_that_ran_alone_is_logged_alone_once_the_other_has_ended() -> None:
    """A request's decode counts as beside another only for the time they were in flight at once."""
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"maxStreams": 2, "logFile": log}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        busy(a, "A", False)
        assert b.ask(acquire("B"))["op"] == "granted"
        assert b.ask({"op": "release", "queueKey": K, "sessionKey": "B"})["op"] == "ok"
        busy(a, "A", True)
        a.ask(timed("A", 1000, 100, 3000.0))
        assert "atOnce" not in usage_lines(log, "A", 1)[0]


@pytest.mark.parametrize("bad", [{"decodeMs": -1}, {"decodeMs": "5"}, {"decodeMs": True}, {"decodeMs": 1e12},
                                 {"decoded": -1}, {"decoded": 1.5}, {"decoded": "9"}, {"decoded": False}])
def test_bad_decode_figures_are_an_error_reply_that_changes_nothing(bad: Dict[str, Any]) -> None:
    for d in started(config={"defaults": {"maxStreams": "auto"}}):
        a = d.peer()
        assert a.ask(acquire("A"))["op"] == "granted"
        msg = timed("A", 1000, 100, 1000.0, slots=4, slotContext=8000)
        msg.update(bad)
        reply = a.ask(msg)
        assert reply["op"] == "error" and next(iter(bad)) in reply["reason"], reply
        q = d.queue(K)
        assert q["maxStreams"] == 1 and q["streamsAuto"] == {} and "tokens" not in q
        assert a.ask({"op": "renew", "queueKey": K, "sessionKey": "A"})["granted"] is True


# -- through the proxy -------------------------------------------------------------------------------


def test_through_the_proxy_auto_learns_the_servers_slots_and_runs_requests_side_by_side() -> None:
    with KVSim(slots=3, slot_ctx=4096, decode_ms=10.0) as sim:
        for d in started(config={"defaults": {"maxStreams": "auto"}}):
            for p in open_proxy(sim.base, d.agent_dir, identity=("user",)):
                assert chat_all(p.port, "first")[0] == 200  # one stream: its report's reply says auto
                wait_for(lambda: p.client.streams_auto(lq.normalize_url(sim.base)))
                q = d.queue(lq.normalize_url(sim.base))
                assert q["maxStreams"] == 1 and "slots" not in q["streamsAuto"]
                assert chat_all(p.port, "first")[0] == 200  # this report carries the server's /props
                # the report goes as the response ends, beside it: it may reach the daemon just after
                wait_for(lambda: "slots" in d.queue(lq.normalize_url(sim.base))["streamsAuto"])
                q = d.queue(lq.normalize_url(sim.base))
                assert q["streamsAuto"]["slots"] == 3 and q["streamsAuto"]["slotContext"] == 4096
                assert q["maxStreams"] == 3
                statuses = []
                threads = [threading.Thread(target=lambda who=who: statuses.append(chat_all(p.port, who)[0]))
                           for who in ("a", "b", "c")]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                assert statuses == [200, 200, 200]
                assert sim.max_overlap() >= 2  # side by side, as the server alone would run them


def test_the_proxy_and_a_client_session_report_the_servers_decode_timings() -> None:
    """The server's own ``timings.predicted_n`` and ``predicted_ms`` reach the daemon as ``decoded``
    and ``decodeMs``: through the proxy, and from ``Session.report``."""
    log = os.path.join(short_tmpdir(), "events.log")
    with KVSim(decode_ms=5.0) as sim:
        key = lq.normalize_url(sim.base)
        for d in started(config={"defaults": {"maxStreams": "auto", "logFile": log}}):
            for p in open_proxy(sim.base, d.agent_dir, identity=("user",)):
                assert chat_all(p.port, "first")[0] == 200
                wait_for(lambda: any(e["event"] == "usage" for e in log_lines(log)))
                line = next(e for e in log_lines(log) if e["event"] == "usage")
                record = sim.records[-1]
                assert line["decoded"] == record["predicted_n"] > 0
                assert line["decodeMs"] >= record["predicted_n"] * 5.0 * 0.9
            client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
            try:
                session = client.session(key, "S")
                with session.run(), session.request():
                    session.report({"timings": {"prompt_n": 500, "cache_n": 0, "prompt_ms": 100.0,
                                                "predicted_n": 40, "predicted_ms": 800.0}})
                    wait_for(lambda: any(e.get("sessionKey") == "S" for e in log_lines(log) if e["event"] == "usage"))
                line = next(e for e in log_lines(log) if e["event"] == "usage" and e.get("sessionKey") == "S")
                assert (line["decoded"], line["decodeMs"]) == (40, 800.0)
            finally:
                client.close()


def test_a_client_sessions_report_carries_the_servers_figures_once_the_daemon_says_auto() -> None:
    with KVSim(slots=2, slot_ctx=3000) as sim:
        key = lq.normalize_url(sim.base)
        for d in started(config={"defaults": {"maxStreams": "auto"}}):
            client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
            try:
                session = client.session(key, "A")
                last = {"timings": {"prompt_n": 500, "cache_n": 0, "prompt_ms": 100.0}}
                with session.run(), session.request():
                    session.report(last)  # the reply says auto: the next report carries them
                    wait_for(lambda: client.streams_auto(key))
                    assert "slots" not in d.queue(key)["streamsAuto"]
                    session.report({"timings": {"prompt_n": 20, "cache_n": 500, "prompt_ms": 10.0}})
                    wait_for(lambda: "slots" in d.queue(key)["streamsAuto"])
                q = d.queue(key)
                assert q["streamsAuto"] == {"slots": 2, "slotContext": 3000, "context": 540}
                assert q["maxStreams"] == 2  # two of 540 fit in 3,000 tokens; the server has two slots
            finally:
                client.close()
