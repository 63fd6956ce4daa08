"""``llmqueue proxy``: any OpenAI-compatible client queued through a loopback reverse proxy.

A stub streaming upstream on loopback (tests/stub.py), a real daemon, and the Proxy running in
this process on a random port (one test runs the command itself).  Pinned: two sessions never
overlap at the upstream with ``maxStreams: 1``; a parent overtakes queued children; streaming is
real (the first chunk arrives before the upstream finishes); a session's second request within
the grace is switch-free; a hang-up closes the upstream request and frees the slot at once; an
unreachable upstream is a 502 naming it, an upstream error is passed through, and both free the
slot; a daemon that is down means fail-open (forward, one warning) or, fail-closed, a 503;
requests are forwarded unchanged less hop-by-hop headers, with the session prefix stripped; the
official ``openai`` package streams a chat completion through it.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterator, Optional

import pytest

import llmqueue as lq
from tests.harness import MODULE, DaemonProc, short_tmpdir, started, wait_for
from tests.stub import StubEndpoint


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    yield from started(config={"defaults": {"agingAfterSlots": 0, "agingAfterMs": 0}})


class RunningProxy:
    def __init__(self, upstream: str, agent_dir: str, **kwargs: Any) -> None:
        self.warnings: list[str] = []
        fail_open = kwargs.pop("fail_open", None)
        self.client = lq.Client(agent_dir, autostart=False, fail_open=fail_open, on_warning=self.warnings.append)
        self.proxy = lq.Proxy(upstream, client=self.client, listen=("127.0.0.1", 0), **kwargs)
        self.thread = threading.Thread(target=self.proxy.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()
        self.port = self.proxy.server.server_address[1]

    def close(self) -> None:
        self.proxy.shutdown()
        self.client.close()


def open_proxy(upstream: str, agent_dir: str, **kwargs: Any) -> Iterator[RunningProxy]:
    p = RunningProxy(upstream, agent_dir, **kwargs)
    try:
        yield p
    finally:
        p.close()


def chat(port: int, who: str, path: str = "/v1/chat/completions", headers: Optional[dict[str, str]] = None,
         method: str = "POST") -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Start a streaming chat request through the proxy; the caller reads the response."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps({"model": "stub", "stream": True, "user": who, "messages": []})
    conn.request(method, path, body=body, headers=dict({"Content-Type": "application/json"}, **(headers or {})))
    return conn, conn.getresponse()


def chat_all(port: int, who: str, path: str = "/v1/chat/completions", **kwargs: Any) -> tuple[int, bytes]:
    conn, response = chat(port, who, path, **kwargs)
    try:
        return response.status, response.read()
    finally:
        conn.close()


def chats(stub: StubEndpoint) -> list[dict[str, Any]]:
    """The upstream's records but the proxy's one look at ``/props`` (its SlotStore's probe)."""
    return [r for r in stub.records if r["path"].split("?")[0] != "/props"]


def spans(stub: StubEndpoint) -> list[tuple[float, float, str]]:
    with stub.lock:
        return sorted((r["start"], r["end"] or time.monotonic(), r["who"]) for r in chats(stub))


def assert_no_overlap(stub: StubEndpoint) -> None:
    ordered = spans(stub)
    for (s1, e1, a), (s2, _, b) in zip(ordered, ordered[1:]):
        assert e1 <= s2, f"{a} streamed until {e1:.3f} but {b} started at {s2:.3f}"


def test_two_sessions_never_overlap_at_the_upstream(stub: StubEndpoint, daemon: DaemonProc) -> None:
    for p in open_proxy(stub.base, daemon.agent_dir, grace_ms=50):
        errors: list[BaseException] = []

        def agent(name: str, by_path: bool) -> None:
            try:
                for i in range(4):
                    if by_path:
                        status, _ = chat_all(p.port, f"{name}-{i}", f"/s/{name}/parent/v1/chat/completions")
                    else:
                        status, _ = chat_all(p.port, f"{name}-{i}", headers={"X-LLMQueue-Session": name})
                    assert status == 200
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=agent, args=("a", True)), threading.Thread(target=agent, args=("b", False))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert len(chats(stub)) == 8
        assert_no_overlap(stub)


def test_a_parent_overtakes_queued_children(stub: StubEndpoint, daemon: DaemonProc) -> None:
    for p in open_proxy(stub.base, daemon.agent_dir, grace_ms=50):
        results: dict[str, int] = {}

        def go(who: str, path: str) -> None:
            results[who] = chat_all(p.port, who, path)[0]

        threads = [threading.Thread(target=go, args=("slow-H", "/s/H/parent/v1/chat/completions"))]
        threads[0].start()
        wait_for(lambda: stub.started("slow-H"))
        for who, session, role in (("C1", "c1", "child"), ("C2", "c2", "child"), ("P1", "p1", "parent")):
            t = threading.Thread(target=go, args=(who, f"/s/{session}/{role}/v1/chat/completions"))
            t.start()
            threads.append(t)
            wait_for(lambda: session in daemon.waiting(stub.base))
        stub.let_slow_finish()
        for t in threads:
            t.join(30)
        assert results == {"slow-H": 200, "C1": 200, "C2": 200, "P1": 200}
        assert [w for _, _, w in spans(stub)] == ["slow-H", "P1", "C1", "C2"]
        assert_no_overlap(stub)


def test_the_first_chunk_reaches_the_client_before_the_upstream_finishes(stub: StubEndpoint, daemon: DaemonProc) -> None:
    for p in open_proxy(stub.base, daemon.agent_dir):
        conn, response = chat(p.port, "slow-stream", headers={"X-LLMQueue-Session": "s"})
        try:
            assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
            first = response.readline()
            assert first.startswith(b"data: ")
            rec = stub.record("slow-stream")
            assert rec is not None and rec["end"] is None  # the upstream is still streaming
            stub.let_slow_finish()
            rest = response.read()
            assert rest.rstrip().endswith(b"data: [DONE]")
        finally:
            conn.close()


def test_a_sessions_second_request_within_the_grace_is_switch_free(stub: StubEndpoint, daemon: DaemonProc) -> None:
    for p in open_proxy(stub.base, daemon.agent_dir, grace_ms=1500):
        assert chat_all(p.port, "one", "/s/main/parent/v1/chat/completions")[0] == 200
        assert daemon.holders(stub.base) == ["main"]  # kept through the grace
        before = daemon.queue(stub.base)
        assert chat_all(p.port, "two", "/s/main/parent/v1/chat/completions")[0] == 200
        after = daemon.queue(stub.base)
        assert after["switches"] == before["switches"] == 0
        assert after["grants"] == before["grants"] == 1  # the same lease served both requests
        wait_for(lambda: daemon.holders(stub.base) == [], timeout=6)  # released after the grace


def test_a_request_naming_no_session_is_a_session_of_its_own_released_at_once(
        stub: StubEndpoint, daemon: DaemonProc) -> None:
    # identity=(): nothing but the path and headers names a session (test_identity.py has the rest)
    for p in open_proxy(stub.base, daemon.agent_dir, grace_ms=10_000, identity=()):
        assert chat_all(p.port, "anon")[0] == 200
        wait_for(lambda: daemon.holders(stub.base) == [], timeout=1)
        assert chat_all(p.port, "anon2")[0] == 200
        assert daemon.queue(stub.base)["grants"] == 2


def test_a_client_hanging_up_mid_stream_closes_the_upstream_and_frees_the_slot_at_once(
        stub: StubEndpoint, daemon: DaemonProc) -> None:
    for p in open_proxy(stub.base, daemon.agent_dir, grace_ms=10_000):
        conn, response = chat(p.port, "slow-gone", "/s/gone/parent/v1/chat/completions")
        assert response.readline().startswith(b"data: ")
        wait_for(lambda: daemon.holders(stub.base) == ["gone"])
        conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
        conn.close()
        wait_for(lambda: daemon.holders(stub.base) == [], timeout=2)  # not after the 10 s grace
        wait_for(lambda: (stub.record("slow-gone") or {}).get("broken"), timeout=5)  # upstream closed


def test_an_unreachable_upstream_is_a_502_naming_it_and_frees_the_slot(daemon: DaemonProc) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    for p in open_proxy(dead, daemon.agent_dir, grace_ms=10_000):
        status, body = chat_all(p.port, "x", "/s/x/parent/v1/chat/completions")
        assert status == 502
        error = json.loads(body)["error"]
        assert error["upstream"] == dead and dead in error["message"]
        wait_for(lambda: daemon.holders(dead) == [], timeout=1)


def test_an_upstream_error_is_passed_through_and_frees_the_slot(stub: StubEndpoint, daemon: DaemonProc) -> None:
    for p in open_proxy(stub.base, daemon.agent_dir, grace_ms=10_000):
        status, body = chat_all(p.port, "fail-500", "/s/e/parent/v1/chat/completions")
        assert status == 500 and json.loads(body) == {"error": {"message": "stub says no"}}
        wait_for(lambda: daemon.holders(stub.base) == [], timeout=1)


def test_daemon_down_fail_open_forwards_unqueued_with_one_warning(stub: StubEndpoint) -> None:
    for p in open_proxy(stub.base, short_tmpdir()):
        assert chat_all(p.port, "a")[0] == 200
        assert chat_all(p.port, "b")[0] == 200
        assert len(p.warnings) == 1 and "unqueued" in p.warnings[0]
        assert [r["who"] for r in chats(stub)] == ["a", "b"]


def test_daemon_down_fail_closed_is_a_503(stub: StubEndpoint) -> None:
    for p in open_proxy(stub.base, short_tmpdir(), fail_open=False):
        status, body = chat_all(p.port, "a")
        assert status == 503 and json.loads(body)["error"]["type"] == "llmqueue_unavailable"
        assert chats(stub) == []  # the request never reached the upstream (only a look at its /props)


def test_requests_are_forwarded_unchanged_less_hop_by_hop_headers(stub: StubEndpoint, daemon: DaemonProc) -> None:
    for p in open_proxy(stub.base, daemon.agent_dir):
        status, _ = chat_all(p.port, "h", "/s/sess/child/v1/chat/completions?trace=1&x=%2F",
                             headers={"Authorization": "Bearer k", "X-Custom": "yes", "Keep-Alive": "timeout=5",
                                      "Connection": "keep-alive, X-Drop-Me", "X-Drop-Me": "1", "TE": "trailers",
                                      "X-LLMQueue-Role": "child"})
        assert status == 200
        rec = stub.record("h")
        assert rec is not None
        assert rec["path"] == "/v1/chat/completions?trace=1&x=%2F"  # prefix stripped, query kept
        headers = {k.lower(): v for k, v in rec["headers"].items()}
        assert headers["authorization"] == "Bearer k" and headers["x-custom"] == "yes"
        assert headers["content-type"] == "application/json"
        assert headers["host"] == stub.base.split("://")[1]
        for gone in ("keep-alive", "te", "x-drop-me", "x-llmqueue-role"):
            assert gone not in headers, gone
        assert rec["body"]["user"] == "h"
        status, body = chat_all(p.port, "g", "/s/sess/child/v1/models", method="GET")
        assert status == 200 and json.loads(body)["object"] == "list"


def test_the_official_openai_package_streams_through_the_proxy(stub: StubEndpoint, daemon: DaemonProc) -> None:
    openai = pytest.importorskip("openai", reason="the openai package is a test extra of the main run")
    for p in open_proxy(stub.base, daemon.agent_dir):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{p.port}/s/main/parent/v1", api_key="unused")
        stream = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}],
                                                stream=True, user="openai")
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
        assert text.split() == [f"tok{i}" for i in range(6)]
        assert daemon.holders(stub.base) == ["main"]


def test_the_command_refuses_a_non_loopback_listen_address_without_allow_remote() -> None:
    out = subprocess.run([sys.executable, MODULE, "proxy", "--agent-dir", short_tmpdir(), "--upstream",
                          "http://127.0.0.1:9/v1", "--listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "loopback" in out.stderr


def test_the_command_serves_and_exits_cleanly_on_sigterm(stub: StubEndpoint, daemon: DaemonProc) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, MODULE, "proxy", "--agent-dir", daemon.agent_dir, "--upstream", stub.base,
                             "--listen", f"127.0.0.1:{port}"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        banner = proc.stderr.readline()
        assert f"http://127.0.0.1:{port}" in banner and stub.base in banner
        assert chat_all(port, "cli", "/s/cli/parent/v1/chat/completions")[0] == 200
        assert daemon.holders(stub.base) == ["cli"]
        proc.terminate()
        assert proc.wait(10) == 0
        wait_for(lambda: daemon.holders(stub.base) == [], timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_client_hanging_up_while_queued_leaves_the_queue_and_is_never_forwarded(
        stub: StubEndpoint, daemon: DaemonProc) -> None:
    for p in open_proxy(stub.base, daemon.agent_dir, grace_ms=50):
        holder = threading.Thread(target=chat_all, args=(p.port, "slow-H", "/s/H/parent/v1/chat/completions"))
        holder.start()
        wait_for(lambda: stub.started("slow-H"))
        conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=30)
        body = json.dumps({"model": "stub", "stream": True, "user": "esc-me", "messages": []})
        conn.request("POST", "/s/esc/child/v1/chat/completions", body=body,
                     headers={"Content-Type": "application/json"})
        wait_for(lambda: daemon.waiting(stub.base) == ["esc"])
        conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
        conn.close()
        wait_for(lambda: daemon.waiting(stub.base) == [], timeout=3)  # it left the queue
        stub.let_slow_finish()
        holder.join(10)
        time.sleep(0.3)
        assert not stub.started("esc-me")  # and its request never reached the upstream


def test_named_sessions_are_forgotten_after_their_grace(stub: StubEndpoint, daemon: DaemonProc) -> None:
    for p in open_proxy(stub.base, daemon.agent_dir, grace_ms=100):
        for i in range(5):
            assert chat_all(p.port, f"u{i}", f"/s/sess{i}/parent/v1/chat/completions")[0] == 200
        wait_for(lambda: not p.proxy._sessions, timeout=5)


def test_a_response_that_ends_as_the_next_request_of_its_session_begins_never_parks_the_live_one(
        stub: StubEndpoint, daemon: DaemonProc) -> None:
    """The end of a response and the next request of the same session run in two threads.  If
    the end decided "the session's last request" and settled after the next one had begun and was
    streaming, it would park a live holder and a waiter would stream beside it.  Here the end is
    held up (its hold rule sleeps) while the next request starts and a waiter queues."""
    class SlowEnd(lq.Proxy):
        def hold_window(self, ps: Any, ending: Optional[str]) -> Optional[float]:
            if ps.session.session_key == "a" and not getattr(self, "held_up", False):
                self.held_up = True
                time.sleep(0.6)  # the next request begins meanwhile
            return 0.0  # hand over at once

    client = lq.Client(daemon.agent_dir, autostart=False, fail_open=False)
    proxy = SlowEnd(stub.base, client=client, listen=("127.0.0.1", 0), slot_files=0)
    threading.Thread(target=proxy.serve_forever, args=(0.02,), daemon=True).start()
    port = proxy.server.server_address[1]
    try:
        assert chat_all(port, "a-1", "/s/a/child/v1/chat/completions")[0] == 200
        second = threading.Thread(target=chat_all, args=(port, "slow-a-2", "/s/a/child/v1/chat/completions"))
        second.start()
        wait_for(lambda: any(r["who"] == "slow-a-2" for r in chats(stub)))
        other = threading.Thread(target=chat_all, args=(port, "b-1", "/s/b/child/v1/chat/completions"))
        other.start()
        wait_for(lambda: daemon.waiting(proxy.queue_key) == ["b"])
        time.sleep(1.0)  # the held-up end has run by now
        assert daemon.holders(proxy.queue_key) == ["a"]  # a streams: its slot was never parked away
        assert not any(r["who"] == "b-1" for r in chats(stub))
        stub.let_slow_finish()
        second.join(10)
        other.join(10)
        assert_no_overlap(stub)
    finally:
        stub.let_slow_finish()
        proxy.shutdown()
        client.close()
