"""Tokens where users look (issue 14): what the model server says it prefilled and reused.

The wire: the additive ``usage`` op adds one request's counts to its queue's running totals in
``status`` (``tokens``, absent until a report), is answered ``ok`` echoing its keys, and is logged
as one ``usage`` event tied to the grant (``seq``) the session holds; bad counts are an error
reply that changes nothing.  ``Client.usage`` sends it.

The proxy reads each response's own accounting as it streams past: llama.cpp ``timings``,
OpenAI chat ``usage`` (``cached_tokens``), Responses ``usage`` and Anthropic ``message_start`` /
``cache_read_input_tokens``, whatever the chunking; a JSON body too; it reports them before the
slot can go.

``llmqueue report`` shows prefilled and reused tokens per queue and per session, the prefill of
the first request after each switch, and the tokens saved against prefilling every prompt afresh.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict

import pytest

import llmqueue as lq
from tests.harness import short_tmpdir, started, wait_for
from tests.test_handover import log_lines
from tests.stub import USAGE, StubEndpoint
from tests.test_report import BASE, line, report, write

K = "http://127.0.0.1:8001/v1"


def usage(session: str, prefilled: Any = 10, reused: Any = 30, key: str = K) -> Dict[str, Any]:
    return {"op": "usage", "queueKey": key, "sessionKey": session, "prefilled": prefilled, "reused": reused}


# -- the wire -----------------------------------------------------------------------------------------


def test_usage_adds_to_the_queues_running_totals_and_is_answered_ok_echoing_its_keys() -> None:
    for d in started():
        p = d.peer()
        assert p.ask({"op": "acquire", "queueKey": K, "sessionKey": "A"})["op"] == "granted"
        assert "tokens" not in d.queue(K)  # additive: absent until a report
        # The reply also says what a switch costs there, as learned so far: nobody came back yet.
        assert p.ask(usage("A", 100, 0)) == {"op": "ok", "queueKey": K, "sessionKey": "A", "switchCost": "unknown"}
        assert p.ask(usage("A", 20, 90)) == {"op": "ok", "queueKey": K, "sessionKey": "A", "switchCost": "unknown"}
        assert p.ask({"op": "usage", "queueKey": K, "sessionKey": "A", "reused": 5})["op"] == "ok"
        assert d.queue(K)["tokens"] == {"prefilled": 120, "reused": 95, "requests": 3}
        # A session that holds nothing there may report too (the proxy reports before it lets go,
        # but a Client user may be late); it counts, untied to a grant.
        assert p.ask(usage("B", 7, 0))["op"] == "ok"
        assert d.queue(K)["tokens"]["requests"] == 4
        assert [h["sessionKey"] for h in d.queue(K)["holders"]] == ["A"]


@pytest.mark.parametrize("bad", [
    {"prefilled": -1}, {"prefilled": 1.5}, {"prefilled": True}, {"reused": "3"}, {"prefilled": None},
    {"prefilled": 1 << 60}, {"queueKey": None}, {"prefilled": None, "reused": None},
])
def test_a_bad_usage_is_an_error_reply_that_changes_nothing(bad: Dict[str, Any]) -> None:
    for d in started():
        p = d.peer()
        assert p.ask({"op": "acquire", "queueKey": K, "sessionKey": "A"})["op"] == "granted"
        message = {k: v for k, v in dict(usage("A"), **bad).items() if v is not None}
        if bad == {"prefilled": None}:
            message = {k: v for k, v in usage("A").items() if k not in ("prefilled", "reused")}
        reply = p.ask(message)
        assert reply["op"] == "error", (bad, reply)
        q = d.queue(K)
        assert "tokens" not in q and [h["sessionKey"] for h in q["holders"]] == ["A"]
        assert p.ask({"op": "renew", "queueKey": K, "sessionKey": "A"})["granted"] is True


def test_usage_is_logged_tied_to_the_grant_the_session_holds() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        p = d.peer()
        granted = p.ask({"op": "acquire", "queueKey": K, "sessionKey": "A"})
        assert p.ask(usage("A", 11, 22))["op"] == "ok"
        assert p.ask({"op": "release", "queueKey": K, "sessionKey": "A"})["op"] == "ok"
        assert p.ask(usage("A", 3, 4))["op"] == "ok"
        wait_for(lambda: sum(1 for e in log_lines(log) if e["event"] == "usage") == 2)
        held, late = [e for e in log_lines(log) if e["event"] == "usage"]
        assert (held["sessionKey"], held["prefilled"], held["reused"], held["seq"]) == ("A", 11, 22, granted["seq"])
        assert held["queueKey"] == K and "ts" in held
        assert "seq" not in late and (late["prefilled"], late["reused"]) == (3, 4)


def test_client_usage_reports_and_never_raises_without_a_daemon() -> None:
    for d in started():
        client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
        try:
            session = client.session(K, "S", "parent")
            with session.run():
                client.usage(K, "S", 50, 150)
                session.usage(5, 15)
            wait_for(lambda: d.queue(K).get("tokens") == {"prefilled": 55, "reused": 165, "requests": 2})
        finally:
            client.close()
    gone = lq.Client(short_tmpdir(), autostart=False)
    try:
        gone.usage(K, "S", 1, 2)  # nobody to tell: nothing happens
    finally:
        gone.close()


# -- reading a response's accounting ------------------------------------------------------------------


def sse(*objs: Any) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


LLAMA = sse({"choices": [{"delta": {"content": "hi"}}]},
            {"choices": [{"delta": {}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 1000, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 900}},
             "timings": {"prompt_n": 120, "cache_n": 880, "predicted_n": 5}})
OPENAI = sse({"choices": [{"delta": {"content": "hi"}}]},
             {"choices": [], "usage": {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 900}}})
RESPONSES = (b"event: response.created\ndata: " + json.dumps({"type": "response.created", "response": {}}).encode()
             + b"\n\nevent: response.completed\ndata: "
             + json.dumps({"type": "response.completed", "response": {"usage": {
                 "input_tokens": 1000, "input_tokens_details": {"cached_tokens": 700}, "output_tokens": 9}}}).encode()
             + b"\n\n")
ANTHROPIC = (b"event: message_start\ndata: " + json.dumps({"type": "message_start", "message": {"usage": {
    "input_tokens": 40, "cache_creation_input_tokens": 60, "cache_read_input_tokens": 900, "output_tokens": 1}}}).encode()
    + b"\n\nevent: message_delta\ndata: "
    + json.dumps({"type": "message_delta", "usage": {"output_tokens": 12}}).encode() + b"\n\n")


@pytest.mark.parametrize("stream,want", [(LLAMA, (120, 880)), (OPENAI, (100, 900)), (RESPONSES, (300, 700)),
                                         (ANTHROPIC, (100, 900))], ids=["llama", "openai", "responses", "anthropic"])
def test_the_scanner_reads_each_formats_accounting_whatever_the_chunking(stream: bytes, want: Any) -> None:
    for size in (1, 2, 7, 64, len(stream)):
        scanner = lq.UsageScanner("text/event-stream; charset=utf-8")
        for i in range(0, len(stream), size):
            scanner.feed(stream[i:i + size])
        assert scanner.result() == want, size
    crlf = lq.UsageScanner("text/event-stream")
    crlf.feed(stream.replace(b"\n", b"\r\n"))
    assert crlf.result() == want


def test_the_scanner_reads_a_json_body_and_says_nothing_when_the_response_does() -> None:
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 10}, "timings": {"prompt_n": 4, "cache_n": 6}})
    scanner = lq.UsageScanner("application/json")
    for ch in body.encode():
        scanner.feed(bytes([ch]))
    assert scanner.result() == (4, 6)
    for kind, data in [("text/event-stream", sse({"choices": [{"delta": {"content": "x"}}]})),
                       ("application/json", b'{"object": "list", "data": []}'),
                       ("text/plain", b'{"usage": {"prompt_tokens": 3}}'),
                       ("application/json", b"not json"),
                       ("text/event-stream", b'data: {"usage": {"prompt_tokens": -3}}\n\n')]:
        s = lq.UsageScanner(kind)
        s.feed(data)
        assert s.result() is None, (kind, data)
    huge = lq.UsageScanner("application/json")
    huge.feed(b'{"pad": "' + b"x" * lq.UsageScanner.MAX_JSON + b'", "usage": {"prompt_tokens": 3}}')
    assert huge.result() is None  # past 4 MiB the body is not kept


def test_token_counts_prefers_the_servers_own_timings() -> None:
    assert lq.token_counts({"prompt_n": 5, "cache_n": 7}, {"prompt_tokens": 100}) == (5, 7)
    assert lq.token_counts({"prompt_n": 5}, {}) == (5, 0)
    assert lq.token_counts(None, {"prompt_tokens": 100}) == (100, 0)
    assert lq.token_counts(None, {"input_tokens": 3, "cache_read_input_tokens": 0}) == (3, 0)
    assert lq.token_counts(None, {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 30}}) == (0, 30)
    assert lq.token_counts(None, {"output_tokens": 3}) is None


# -- through the proxy ------------------------------------------------------------------------------


def test_the_proxy_reports_every_formats_tokens_to_the_log_and_status(stub: StubEndpoint) -> None:
    from tests.test_proxy import RunningProxy

    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        p = RunningProxy(stub.base, d.agent_dir, grace_ms=200)
        try:
            import http.client

            body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
            for path in ("/s/a/parent/v1/chat/completions", "/s/a/parent/v1/responses",
                         "/s/b/child/v1/messages?beta=true"):
                conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=30)
                conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                assert response.status == 200 and len(re.findall(rb"tok\d", response.read())) == 6
                conn.close()
            fresh = USAGE["prompt"] - USAGE["cached"]
            wait_for(lambda: d.queue(stub.base).get("tokens") == {
                "prefilled": 3 * fresh, "reused": 3 * USAGE["cached"], "requests": 3})
            wait_for(lambda: sum(1 for e in log_lines(log) if e["event"] == "usage") == 3)
            events = [e for e in log_lines(log) if e["event"] == "usage"]
            assert [e["sessionKey"] for e in events] == ["a", "a", "b"]
            assert all("seq" in e for e in events)  # reported while the slot was held
        finally:
            p.close()


# -- the report ---------------------------------------------------------------------------------------


def test_the_report_shows_tokens_per_queue_and_session_and_the_prefill_after_each_switch() -> None:
    r = report(write([
        line(0, "grant", sessionKey="A", role="parent", seq=1),
        line(1, "usage", sessionKey="A", prefilled=1000, reused=0, seq=1),
        line(2, "queued", sessionKey="B", role="child"),
        line(3, "usage", sessionKey="A", prefilled=50, reused=1000, seq=1),
        line(4, "release", sessionKey="A", role="parent", reason="release"),
        line(4, "grant", sessionKey="B", role="child", seq=2),
        line(4, "switch", sessionKey="B", role="child", seq=2),
        line(5, "usage", sessionKey="B", prefilled=800, reused=0, seq=2),
        line(6, "usage", sessionKey="B", prefilled=40, reused=800, seq=2),
        line(7, "queued", sessionKey="A", role="parent"),
        line(8, "release", sessionKey="B", role="child", reason="release"),
        line(8, "grant", sessionKey="A", role="parent", seq=3),
        line(8, "switch", sessionKey="A", role="parent", seq=3),
        line(9, "usage", sessionKey="A", prefilled=1090, reused=0, seq=3),  # evicted: all of it again
        line(10, "usage", sessionKey="A", prefilled=5, reused=5),  # late, held nothing
        line(11, "usage", sessionKey="A", prefilled=-5, reused=5),  # garbage: skipped
    ]))
    t = r["queues"]["http://gpu:8001/v1"]["tokens"]
    assert (t["requests"], t["prefilled"], t["reused"], t["saved"]) == (6, 2985, 1805, 1805)
    assert t["reusedShare"] == round(1805 / 4790, 4)
    assert t["afterSwitch"] == {"requests": 2, "prefilled": 1890, "meanPrefilled": 945}
    assert t["bySession"] == {"A": {"requests": 4, "prefilled": 2145, "reused": 1005},
                              "B": {"requests": 2, "prefilled": 840, "reused": 800}}
    text = lq.format_report(r)
    assert "tokens: 6 requests prefilled 2,985 and reused 1,805 (38% of prompt tokens)" in text
    assert "after a switch: 2 requests prefilled 1,890 (945 each)" in text
    assert "tokens by session (prefilled/reused): A 2,145/1,005, B 840/800" in text
    # A log with no usage events has no token figures.
    assert "tokens" not in report(write([line(0, "grant", sessionKey="A", role="parent", seq=1)]))["queues"][
        "http://gpu:8001/v1"]


def test_the_report_adds_up_where_the_servers_time_went() -> None:
    """Issue 33: prefill, of it the first request's after each switch, and decode, as the server
    timed them (``prefillMs``, ``decodeMs`` on the usage lines), beside the dead time."""
    r = report(write([
        line(0, "grant", sessionKey="A", role="parent", seq=1),
        line(1, "usage", sessionKey="A", prefilled=1000, reused=0, seq=1, prefillMs=2000.0, decoded=50, decodeMs=1000.0),
        line(2, "queued", sessionKey="B", role="child"),
        line(3, "release", sessionKey="A", role="parent", reason="release"),
        line(3, "grant", sessionKey="B", role="child", seq=2),
        line(3, "switch", sessionKey="B", role="child", seq=2),
        line(4, "usage", sessionKey="B", prefilled=800, reused=0, seq=2, prefillMs=1600.0, decoded=20, decodeMs=400.0),
        line(5, "usage", sessionKey="B", prefilled=40, reused=800, seq=2, prefillMs=80.0),
        line(6, "usage", sessionKey="B", prefilled=40, reused=840, seq=2),  # untimed: counted as such
        line(7, "usage", sessionKey="B", prefilled=40, reused=880, seq=2, prefillMs=1e400, decodeMs=-1),  # garbage
    ]))
    q = r["queues"]["http://gpu:8001/v1"]
    assert q["serverMs"] == {"timed": 3, "prefill": 3680, "prefillAfterSwitch": 1600, "decode": 1400}
    text = lq.format_report(r)
    assert ("server time, as it timed 3 of 5 requests: prefill 3.7s (after a switch 1.6s), "
            "decode 1.4s") in text
    # No timings, no such figures.
    plain = report(write([line(0, "grant", sessionKey="A", role="parent", seq=1),
                          line(1, "usage", sessionKey="A", prefilled=10, reused=0, seq=1)]))
    assert "serverMs" not in plain["queues"]["http://gpu:8001/v1"]


def test_the_report_window_cuts_the_tokens_too() -> None:
    path = write([
        line(0, "grant", sessionKey="A", role="parent", seq=1),
        line(1, "usage", sessionKey="A", prefilled=10, reused=0, seq=1),
        line(50, "usage", sessionKey="A", prefilled=20, reused=0, seq=1),
        line(60, "release", sessionKey="A", role="parent", reason="release"),
    ])
    assert report(path)["queues"]["http://gpu:8001/v1"]["tokens"]["prefilled"] == 30
    t = report(path, since=BASE + 30)["queues"]["http://gpu:8001/v1"]["tokens"]
    assert (t["requests"], t["prefilled"]) == (1, 20)


def test_status_shows_the_running_totals_for_people_and_prometheus() -> None:
    import subprocess
    import sys

    from tests.harness import MODULE

    for d in started():
        p = d.peer()
        assert p.ask({"op": "acquire", "queueKey": K, "sessionKey": "A"})["op"] == "granted"
        assert p.ask(usage("A", 1200, 34_000))["op"] == "ok"
        table = subprocess.run([sys.executable, MODULE, "status", "--agent-dir", d.agent_dir],
                               capture_output=True, text=True, timeout=30)
        assert table.returncode == 0 and "tokens: prefilled 1,200  reused 34,000  over 1 requests" in table.stdout
        prom = subprocess.run([sys.executable, MODULE, "status", "--format", "prometheus", "--agent-dir",
                               d.agent_dir], capture_output=True, text=True, timeout=30)
        assert "# TYPE llmqueue_prefilled_tokens_total counter" in prom.stdout
        assert f'llmqueue_prefilled_tokens_total{{queue="{K}"}} 1200' in prom.stdout
        assert f'llmqueue_reused_tokens_total{{queue="{K}"}} 34000' in prom.stdout


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_non_streamed_answers_pass_byte_for_byte_and_are_counted(stub: StubEndpoint, path: str) -> None:
    import http.client

    from tests.test_proxy import RunningProxy

    for d in started():
        p = RunningProxy(stub.base, d.agent_dir, grace_ms=200)
        try:
            body = json.dumps({"model": "m", "stream": False, "user": "whole",
                               "messages": [{"role": "user", "content": "hi"}]})
            conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=30)
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            got = response.read()
            conn.close()
            rec = stub.record("whole")
            assert response.status == 200 and rec is not None and got == rec["sent"]
            wait_for(lambda: d.queue(stub.base).get("tokens") == {
                "prefilled": USAGE["prompt"] - USAGE["cached"], "reused": USAGE["cached"], "requests": 1})
        finally:
            p.close()
