"""The KV-cache simulator (tests/kvsim.py) and the queue in front of it under server faults.

(a) The simulator, driven with plain http.client: a growing conversation reuses its previous
prompt and reply (cache_n) and prefills only the new turn (prompt_n); a second conversation on a
one-slot server evicts the first unless the host cache holds it (then it is restored); the host
cache is LRU-bounded; a context overflow is llama-server's 400; unified KV refuses with 500 while
busy slots leave too little room (and drops idle slots' caches first); timings and usage have
llama-server's shapes; one slot serialises concurrent requests and parallel slots share one
engine; every fault kind as a raw client sees it.

(b) A real daemon (``maxStreams: 1``, ``leaseTtlMs: 30000``) in front of the simulator, through
``llmqueue.Proxy`` and through ``llmqueue.Client`` sessions.  For each fault kind a first agent's
request fails while a second agent is queued behind it: the slot is freed at once (the second
agent streams within a second, far inside the 30 s TTL and the first agent's grace), the second
agent's whole response arrives, the failed agent sees the failure, and a third request streams
fine with no holder or waiter left afterwards.  Through the proxy, a stream the upstream cuts with
a clean close of a close-delimited body cannot be told from a complete one: the session keeps its
slot for its grace, as after any response (pinned); with chunked framing (llama-server's own) the
cut is seen and the slot is freed at once.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, Iterator, List, Optional

import pytest

import llmqueue as lq
from tests.harness import DaemonProc, started, wait_for
from tests.kvsim import ASSISTANT, EXCEED_CONTEXT, FAULT_AFTER, KV_FULL, SERVER_ERROR, KVSim

FAST = 1.0  # "at once": a waiter streams within this long of the failure (TTL 30 s, grace >= 2 s)
TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


# -- helpers ----------------------------------------------------------------------------------------


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def payload(messages: List[Dict[str, Any]], *, stream: bool = True, max_tokens: Optional[int] = 16,
            user: Optional[str] = None, usage: bool = False) -> Dict[str, Any]:
    body: Dict[str, Any] = {"model": "kvsim", "messages": messages, "stream": stream}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if user is not None:
        body["user"] = user
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


class Reply:
    def __init__(self, status: int, headers: Dict[str, str], raw: bytes, error: Optional[BaseException]) -> None:
        self.status = status
        self.headers = headers
        self.raw = raw
        self.error = error  # how the body broke off (IncompleteRead), if it did

    @property
    def chunks(self) -> List[Dict[str, Any]]:
        out = []
        for line in self.raw.split(b"\n"):
            if line.startswith(b"data: {"):
                out.append(json.loads(line[6:]))
        return out

    @property
    def done(self) -> bool:
        return b"data: [DONE]" in self.raw

    @property
    def text(self) -> str:
        if self.headers.get("content-type", "").startswith("application/json"):
            return str(json.loads(self.raw)["choices"][0]["message"]["content"])
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c["choices"])

    def json(self) -> Any:
        return json.loads(self.raw)


def post(port: int, body: Any, path: str = "/v1/chat/completions", headers: Optional[Dict[str, str]] = None,
         timeout: float = 30) -> Reply:
    """One request; the whole response, or as much of it as came before it broke off."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers=dict({"Content-Type": "application/json"}, **(headers or {})))
        response = conn.getresponse()
        hdrs = {k.lower(): v for k, v in response.getheaders()}
        try:
            return Reply(response.status, hdrs, response.read(), None)
        except http.client.IncompleteRead as e:
            return Reply(response.status, hdrs, e.partial, e)
    finally:
        conn.close()


def get(port: int, path: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        assert response.status == 200, (path, response.status)
        return json.loads(response.read())
    finally:
        conn.close()


def record(sim: KVSim, who: str, nth: int = 0) -> Dict[str, Any]:
    with sim.lock:
        found = [r for r in sim.records if r["who"] == who]
    assert len(found) > nth, f"no request {nth} of {who}: {[r['who'] for r in sim.records]}"
    return dict(found[nth])


class Chat:
    """A conversation that appends each reply to its history, as an agent does."""

    def __init__(self, who: str, first: str, system: Optional[str] = None) -> None:
        self.who = who
        self.messages: List[Dict[str, Any]] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        self.messages.append({"role": "user", "content": first})

    def ask(self, sim: KVSim, then: Optional[str] = None, max_tokens: int = 16, stream: bool = True) -> Dict[str, Any]:
        reply = post(sim.port, payload(self.messages, user=self.who, max_tokens=max_tokens, stream=stream))
        assert reply.status == 200 and (reply.done or not stream), reply.raw[-300:]
        self.messages.append({"role": "assistant", "content": reply.text})
        if then is not None:
            self.messages.append({"role": "user", "content": then})
        with sim.lock:
            return dict([r for r in sim.records if r["who"] == self.who][-1])


@pytest.fixture
def sim() -> Iterator[KVSim]:
    with KVSim(prefill_ms=0.05, decode_ms=0.1) as s:
        yield s


# -- (a) the simulator ------------------------------------------------------------------------------


def test_a_growing_conversation_reuses_its_previous_prompt_and_reply(sim: KVSim) -> None:
    chat = Chat("a", words("q", 20), system=words("s", 30))
    first = chat.ask(sim, then=words("r", 9), max_tokens=12)
    assert (first["prompt_tokens"], first["cache_n"], first["prompt_n"]) == (52, 0, 52)
    assert first["predicted_n"] == 12 and first["slot"] == 0
    second = chat.ask(sim, then=words("t", 4), max_tokens=12)
    previous = 52 + 1 + 12  # the prompt, the reply's <|assistant|> header, the reply
    assert second["cache_n"] == previous
    assert second["prompt_n"] == 1 + 9  # only the new turn: <|user|> and its words
    third = chat.ask(sim, max_tokens=5)
    assert third["cache_n"] == second["prompt_tokens"] + 1 + 12 and third["prompt_n"] == 1 + 4
    assert sim.totals() == {"prompt_n": 52 + 10 + 5, "cache_n": 65 + 88, "requests": 3, "failed": 0}
    assert sim.slot_caches() == [third["prompt_tokens"] + 1 + 5]
    assert ASSISTANT == "<|assistant|>"


def test_a_second_conversation_evicts_the_first_on_one_slot(sim: KVSim) -> None:
    a, b = Chat("a", words("a", 40)), Chat("b", words("b", 40))
    a.ask(sim, then="more")
    b.ask(sim, then="more")
    again = a.ask(sim)
    assert again["cache_n"] <= 1  # only the shared <|user|> survives: the whole history re-prefills
    assert again["prompt_n"] >= again["prompt_tokens"] - 1 and again["restored"] == 0
    assert sim.host_cache_sizes() == []


def test_the_host_cache_keeps_an_evicted_conversation_and_restores_it() -> None:
    with KVSim(prefill_ms=0.05, decode_ms=0.1, host_cache_tokens=1000) as sim:
        a, b = Chat("a", words("a", 40)), Chat("b", words("b", 40))
        a.ask(sim, then="more")
        b.ask(sim, then="more")
        assert sim.host_cache_sizes() == [41 + 1 + 16]  # a's cache, saved when b took its slot
        again = a.ask(sim)
        assert again["restored"] == 58 and again["cache_n"] == 58 and again["prompt_n"] == 2
        assert sim.host_cache_sizes() == [58]  # a's entry left the host cache (the slot has it); b's went in
        b_again = b.ask(sim)
        assert b_again["restored"] == 58 and b_again["cache_n"] == 58


def test_the_host_cache_is_lru_bounded_and_never_keeps_an_entry_over_budget() -> None:
    with KVSim(prefill_ms=0.05, decode_ms=0.1, host_cache_tokens=130) as sim:
        chats = {name: Chat(name, words(name, 40)) for name in "ABCD"}  # 41-token prompts, 58-token caches
        for name in "ABCD":
            post(sim.port, payload(chats[name].messages, user=name))
        assert sim.host_cache_sizes() == [58, 58]  # A, B, C saved in turn; A evicted to fit C
        post(sim.port, payload(chats["A"].messages, user="A"))
        assert record(sim, "A", 1)["cache_n"] <= 1  # A was evicted: re-prefilled (D saved, B evicted)
        post(sim.port, payload(chats["C"].messages, user="C"))
        again = record(sim, "C", 1)
        assert again["restored"] == 58 and again["cache_n"] == 40  # the same prompt: one token is evaluated
        big = Chat("E", words("e", 150))
        post(sim.port, payload(big.messages, user="E"))  # saves C's cache: the oldest entry goes
        post(sim.port, payload(chats["B"].messages, user="B"))  # E's 168 tokens are over budget: dropped
        assert sim.host_cache_sizes() == [58, 58]
        post(sim.port, payload(big.messages, user="E"))
        assert record(sim, "E", 1)["cache_n"] <= 1


def test_a_request_over_the_slot_context_is_refused_with_llama_servers_400() -> None:
    with KVSim(slot_ctx=64, prefill_ms=0.05, decode_ms=0.05) as sim:
        fits = post(sim.port, payload([{"role": "user", "content": words("w", 47)}], max_tokens=16))
        assert fits.status == 200 and fits.done  # 48 + 16 == 64
        over = post(sim.port, payload([{"role": "user", "content": words("w", 48)}], max_tokens=16))
        assert over.status == 400 and over.json() == {"error": EXCEED_CONTEXT}
        assert EXCEED_CONTEXT["message"] == "the request exceeds the available context size, try increasing it"
        assert EXCEED_CONTEXT["type"] == "exceed_context_size_error"
        body = payload([{"role": "user", "content": [{"type": "text", "text": words("w", 40)},
                                                    {"type": "text", "text": words("x", 7)}]}], max_tokens=None)
        body["max_completion_tokens"] = 17
        assert post(sim.port, body).status == 400  # content parts and max_completion_tokens count too
        with sim.lock:
            assert [r["status"] for r in sim.records] == [200, 400, 400]
            assert [r["prompt_tokens"] for r in sim.records] == [48, 49, 48]
            assert sim.records[1]["slot"] is None and sim.records[1]["start"] is None
        assert sim.totals()["failed"] == 2


def test_unified_kv_drops_idle_caches_first_and_refuses_with_500_while_busy_slots_fill_it() -> None:
    with KVSim(slots=2, slot_ctx=1000, unified_ctx=400, prefill_ms=0.05, decode_ms=1.0) as sim:
        long = payload([{"role": "system", "content": words("s", 100)}], max_tokens=200, user="A")  # needs 301
        conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(long), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.readline().startswith(b"data: ")  # A is streaming: its slot is busy
        b = payload([{"role": "user", "content": words("b", 49)}], max_tokens=100, user="B")  # needs 150
        refused = post(sim.port, b)
        assert refused.status == 500 and refused.json() == {"error": KV_FULL}
        assert KV_FULL["message"] == "failed to find free space in the KV cache"
        small = post(sim.port, payload([{"role": "user", "content": words("c", 19)}], max_tokens=60, user="C"))
        assert small.status == 200 and small.done  # 301 + 80 fits in 400 beside the busy slot
        rest = response.read()
        conn.close()
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert sorted(sim.slot_caches()) == [20 + 1 + 60, 101 + 1 + 200]
        retried = post(sim.port, b)
        assert retried.status == 200 and retried.done  # A's slot is idle now: its cache was dropped
        assert sorted(sim.slot_caches()) == [0, 50 + 1 + 100]
        assert record(sim, "B", 0)["status"] == 500 and record(sim, "B", 1)["status"] == 200
        exact = post(sim.port, payload([{"role": "system", "content": words("d", 149)}], max_tokens=100))
        assert exact.status == 200  # 150 (B's cache; its reply header is free) + 250 == 400: B's cache stays
        assert sorted(sim.slot_caches()) == [50 + 1 + 100, 150 + 1 + 100]


def test_with_a_host_cache_a_unified_kvs_idle_slots_go_to_it_at_each_requests_start() -> None:
    """llama-server's --cache-idle-slots (on by default): only the running contexts stay in the
    unified KV; the others wait in the host cache, and come back from it."""
    for idle_slots in (True, False):
        with KVSim(slots=2, slot_ctx=1000, unified_ctx=1000, host_cache_tokens=1000, prefill_ms=0.05,
                   decode_ms=1.0, cache_idle_slots=idle_slots) as sim:
            a = payload([{"role": "system", "content": words("a", 99)}], max_tokens=10, user="A")
            b = payload([{"role": "user", "content": words("b", 49)}], max_tokens=10, user="B")  # no common prefix
            assert post(sim.port, a).status == 200
            assert post(sim.port, b).status == 200
            if idle_slots:
                assert sorted(sim.slot_caches()) == [0, 50 + 1 + 10]  # A's went to the host cache
                assert sim.host_cache_sizes() == [100 + 1 + 10]
            else:
                assert sorted(sim.slot_caches()) == [50 + 1 + 10, 100 + 1 + 10]
                assert sim.host_cache_sizes() == []
            assert post(sim.port, a).status == 200
            again = record(sim, "A", 1)
            assert again["prompt_n"] == 1, again  # kept, either way: in its slot, or in the host cache
            assert again["restored"] == (100 + 1 + 10 if idle_slots else 0), (idle_slots, again)


def test_streaming_and_non_streaming_replies_have_llama_servers_shapes(sim: KVSim) -> None:
    messages = [{"role": "user", "content": "hello kv cache"}]
    reply = post(sim.port, payload(messages, max_tokens=5, usage=True, user="s"))
    assert reply.status == 200 and reply.headers["content-type"] == "text/event-stream"
    assert "content-length" not in reply.headers and reply.headers["connection"] == "close"
    chunks = reply.chunks
    assert len(chunks) == 5 + 2
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "g0 "}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[:5]] == [f"g{i} " for i in range(5)]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    final = chunks[5]
    assert final["choices"][0]["finish_reason"] == "length" and set(final["timings"]) == TIMING_KEYS
    assert final["timings"]["prompt_n"] == 4 and final["timings"]["cache_n"] == 0
    assert final["timings"]["predicted_n"] == 5
    assert chunks[6]["choices"] == [] and chunks[6]["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}
    assert reply.raw.rstrip().endswith(b"data: [DONE]")
    no_usage = post(sim.port, payload(messages, max_tokens=5))
    assert len(no_usage.chunks) == 6 and "usage" not in no_usage.chunks[-1]

    plain = post(sim.port, payload(messages, max_tokens=3, stream=False), headers={"X-Agent": "agent-7"})
    assert plain.status == 200 and plain.headers["content-type"] == "application/json"
    body = plain.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "g0 g1 g2"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 3}}  # the same prompt: all but one reused
    assert set(body["timings"]) == TIMING_KEYS and body["timings"]["cache_n"] == 3
    assert post(sim.port, payload(messages, max_tokens=1), path="/chat/completions").done

    assert [r["who"] for r in sim.records] == ["s", "?", "agent-7", "?"]
    rec = record(sim, "agent-7")
    assert rec["headers"]["X-Agent"] == "agent-7" and rec["path"] == "/v1/chat/completions"
    assert rec["arrived"] <= rec["start"] <= rec["first_token"] <= rec["end"] and rec["status"] == 200
    assert get(sim.port, "/health") == {"status": "ok"}
    assert get(sim.port, "/v1/models")["data"][0]["id"] == "kvsim"
    assert get(sim.port, "/slots") == [{"id": 0, "is_processing": False, "n_cache": 4 + 1 + 1, "n_ctx": 4096}]


def test_one_slot_serialises_concurrent_requests_and_parallel_slots_share_one_engine() -> None:
    for slots in (1, 2):
        with KVSim(slots=slots, prefill_ms=0.05, decode_ms=2.0) as sim:
            replies: List[Reply] = []

            def ask(who: str) -> None:
                replies.append(post(sim.port, payload([{"role": "system", "content": who}], max_tokens=60, user=who)))

            threads = [threading.Thread(target=ask, args=(w,)) for w in ("first", "second")]
            began = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            elapsed = time.monotonic() - began
            assert len(replies) == 2 and all(r.status == 200 and r.done for r in replies)
            assert sim.max_overlap() == slots
            one, two = sorted((record(sim, w) for w in ("first", "second")), key=lambda r: r["start"])
            if slots == 1:
                assert one["end"] <= two["start"]  # the second waited in the server's queue
            else:
                assert one["slot"] != two["slot"] and two["start"] < one["end"]
            assert elapsed >= 0.95 * 2 * 60 * 2.0 / 1000  # one GPU: two slots do not double throughput


def test_batched_decode_shares_each_step_among_the_streams_decoding_at_once() -> None:
    # A GPU's batched decode: two streams on two slots decode in shared steps, so the engine takes
    # far fewer steps than the tokens generated; unbatched it takes one per token.
    for batched in (False, True):
        # 10 ms a step: 0.6 s a stream, so the two overlap however late the second thread starts
        with KVSim(slots=2, prefill_ms=0.05, decode_ms=10.0, batched_decode=batched) as sim:
            replies: List[Reply] = []

            def ask(who: str) -> None:
                replies.append(post(sim.port, payload([{"role": "system", "content": who}], max_tokens=60, user=who)))

            threads = [threading.Thread(target=ask, args=(w,)) for w in ("first", "second")]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert len(replies) == 2 and all(r.status == 200 and r.done for r in replies)
            assert all(record(sim, w)["predicted_n"] == 60 for w in ("first", "second"))
            if batched:
                assert sim.decode_steps <= 0.75 * 120  # about 60 shared steps: most tokens rode along
            else:
                assert sim.decode_steps == 120


def test_a_close_fault_truncates_the_stream_and_frees_the_slot(sim: KVSim) -> None:
    sim.inject("close")
    messages = [{"role": "user", "content": "hello"}]
    cut = post(sim.port, payload(messages, user="x"))
    assert cut.status == 200 and cut.error is None  # a close-delimited body: the close ends it
    assert not cut.done and len(cut.chunks) == FAULT_AFTER
    assert cut.headers["connection"] == "close" and "content-length" not in cut.headers
    rec = record(sim, "x")
    assert rec["fault"] == "close" and rec["cut"] and not rec["broken"] and rec["slot"] == 0
    assert get(sim.port, "/slots")[0]["is_processing"] is False
    fine = post(sim.port, payload(messages, user="y"))
    assert fine.status == 200 and fine.done and len(fine.chunks) == 17
    assert sim.totals()["failed"] == 1


def test_a_close_fault_with_chunked_framing_is_a_broken_body() -> None:
    with KVSim(prefill_ms=0.05, decode_ms=0.1, chunked=True) as sim:
        fine = post(sim.port, payload([{"role": "user", "content": "hi"}]))
        assert fine.status == 200 and fine.done and fine.error is None
        assert fine.headers["transfer-encoding"] == "chunked"
        sim.inject("close")
        cut = post(sim.port, payload([{"role": "user", "content": "hi"}]))
        assert isinstance(cut.error, http.client.IncompleteRead) and not cut.done
        assert len(cut.chunks) == FAULT_AFTER


@pytest.mark.parametrize("kind,error", [("500", SERVER_ERROR), ("kv-full", KV_FULL)])
def test_an_error_fault_answers_500_with_a_json_error_and_frees_the_slot(sim: KVSim, kind: str,
                                                                           error: Dict[str, Any]) -> None:
    sim.inject(kind, count=2)
    for who in ("x1", "x2"):
        reply = post(sim.port, payload([{"role": "user", "content": "hello"}], user=who))
        assert reply.status == 500 and reply.json() == {"error": error}
        rec = record(sim, who)
        assert rec["fault"] == kind and rec["status"] == 500 and rec["slot"] == 0
    assert post(sim.port, payload([{"role": "user", "content": "hello"}], user="y")).done
    assert get(sim.port, "/slots")[0]["is_processing"] is False
    assert sim.totals()["failed"] == 2 and sim.totals()["requests"] == 3


def test_a_restart_fault_cuts_every_stream_drops_every_cache_and_keeps_serving() -> None:
    with KVSim(slots=2, prefill_ms=0.05, decode_ms=1.0, host_cache_tokens=1000) as sim:
        warm = Chat("warm", words("w", 30))
        warm.ask(sim)
        long = payload([{"role": "system", "content": words("s", 10)}], max_tokens=2000, user="long")
        conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(long), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.readline().startswith(b"data: ")  # in flight on the other slot
        sim.inject("restart")
        cut = post(sim.port, payload([{"role": "user", "content": "boom"}], user="faulted"))
        assert cut.status == 200 and not cut.done and len(cut.chunks) == FAULT_AFTER
        rest = response.read()  # the other in-flight stream is cut too
        conn.close()
        assert b"[DONE]" not in rest
        wait_for(lambda: record(sim, "long")["cut"], timeout=5)
        assert record(sim, "long")["predicted_n"] < 2000 and record(sim, "faulted")["fault"] == "restart"
        assert sim.slot_caches() == [0, 0] and sim.host_cache_sizes() == []
        again = warm.ask(sim)  # the same port serves; the conversation re-prefills from nothing
        assert again["cache_n"] == 0 and again["prompt_n"] == again["prompt_tokens"]
        sim.restart()  # restart() itself, at rest
        assert sim.slot_caches() == [0, 0] and post(sim.port, payload(warm.messages)).done


def raw_request(port: int, who: str, max_tokens: int) -> socket.socket:
    body = json.dumps(payload([{"role": "user", "content": "bye"}], max_tokens=max_tokens, user=who)).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def test_a_client_hanging_up_mid_stream_or_while_queued_is_recorded_and_frees_its_place() -> None:
    with KVSim(prefill_ms=0.05, decode_ms=2.0) as sim:
        with raw_request(sim.port, "gone", 2000) as s:
            seen = b""
            while b"data: " not in seen:
                seen += s.recv(65536)
            with raw_request(sim.port, "queued", 16) as q:
                wait_for(lambda: any(r["who"] == "queued" for r in sim.records))
                q.shutdown(socket.SHUT_RDWR)  # hangs up while waiting for the busy slot
            wait_for(lambda: record(sim, "queued")["broken"], timeout=5)
            assert record(sim, "queued")["start"] is None  # it left the server queue, never processed
            s.shutdown(socket.SHUT_RDWR)
        wait_for(lambda: record(sim, "gone")["broken"], timeout=5)
        assert not record(sim, "gone")["cut"]
        assert post(sim.port, payload([{"role": "user", "content": "next"}])).done
        assert get(sim.port, "/slots")[0]["is_processing"] is False


# -- (b) the queue in front of it under faults ------------------------------------------------------


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    yield from started(config={"defaults": {"maxStreams": 1, "leaseTtlMs": 30000}})


class RunningProxy:
    def __init__(self, upstream: str, agent_dir: str, grace_ms: int, **kwargs: Any) -> None:
        self.client = lq.Client(agent_dir, autostart=False)
        self.proxy = lq.Proxy(upstream, client=self.client, listen=("127.0.0.1", 0), grace_ms=grace_ms, **kwargs)
        self.thread = threading.Thread(target=self.proxy.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()
        self.port: int = self.proxy.server.server_address[1]

    def close(self) -> None:
        self.proxy.shutdown()
        self.client.close()
        self.thread.join(5)


def gate(daemon: DaemonProc, key: str) -> Any:
    """A raw peer holding the queue's one slot, so agents can be lined up behind it."""
    peer = daemon.peer()
    reply = peer.ask({"op": "acquire", "queueKey": key, "sessionKey": "gate"})
    assert reply["op"] == "granted", reply
    return peer


def spawn(target: Any, *args: Any) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def check_aftermath(sim: KVSim, failed: Dict[str, Any], waiter: Dict[str, Any], at_once: bool,
                    grace_ms: int) -> None:
    """The waiter was granted at once after the failure (or, pinned, once the failed parent
    session's grace parks it: after the parent's handback window at most; at once here, since the
    waiter is a parent too and the queue does not know yet what a switch costs, so the settled
    parent gives way to find out), streamed its whole reply, and the simulator never saw two
    requests at a time."""
    delay = waiter["start"] - failed["end"]
    if at_once:
        assert delay < FAST, f"the waiter started {delay:.2f}s after the failure"
    else:
        kept = min(grace_ms, lq.PARENT_HANDBACK_MS) / 1000
        assert delay < kept + FAST, delay  # nowhere near the grace
    assert waiter["status"] == 200 and waiter["predicted_n"] == 16 and not _failed(waiter)
    assert sim.max_overlap() == 1


def _failed(rec: Dict[str, Any]) -> bool:
    return bool(rec["fault"] or rec["broken"] or rec["cut"] or rec["status"] != 200)


PROXY_CASES = [  # kind, chunked framing, freed at once
    ("close", False, False), ("close", True, True), ("500", False, True), ("kv-full", False, True),
    ("restart", False, False), ("restart", True, True)]


@pytest.mark.parametrize("kind,chunked,at_once", PROXY_CASES,
                         ids=[f"{k}-{'chunked' if c else 'close-delimited'}" for k, c, _ in PROXY_CASES])
def test_proxy_a_fault_frees_the_slot_for_the_queued_agent_and_loses_nothing(
        daemon: DaemonProc, kind: str, chunked: bool, at_once: bool) -> None:
    """Agent a (a named session, so a grace applies to it) is granted first and its request hits
    the fault; agent b waits behind it.  An error status, or a cut the proxy can see (chunked
    framing), lets a's slot go at once -- nowhere near the 30 s TTL or a's 5 s grace.  A clean
    close of a close-delimited body looks complete to the proxy: a's session settles as after
    any response: b (a parent too) gets the slot within a parent's handback window, nowhere near
    a's 2 s grace."""
    grace_ms = 5000 if at_once else 2000
    with KVSim(prefill_ms=0.05, decode_ms=0.2, chunked=chunked) as sim:
        key = sim.base  # the proxy's queue key: its upstream
        # identity=(): b and c name no session by any source, so each is a session of its own
        p = RunningProxy(sim.base, daemon.agent_dir, grace_ms, identity=())
        try:
            holder = gate(daemon, key)
            results: Dict[str, Reply] = {}

            def agent(name: str, path: str) -> None:
                results[name] = post(p.port, payload([{"role": "user", "content": words(name, 30)}], user=name), path)

            ta = spawn(agent, "a", "/s/a/parent/v1/chat/completions")
            wait_for(lambda: daemon.waiting(key) == ["a"])
            tb = spawn(agent, "b", "/v1/chat/completions")  # a session of its own
            wait_for(lambda: len(daemon.waiting(key)) == 2)
            sim.inject(kind)
            assert holder.ask({"op": "release", "queueKey": key, "sessionKey": "gate"})["op"] == "ok"
            ta.join(30)
            tb.join(30)
            a, b = results["a"], results["b"]
            if kind in ("500", "kv-full"):  # the upstream's own status and body
                assert a.status == 500 and a.json() == {"error": SERVER_ERROR if kind == "500" else KV_FULL}
            else:  # a truncated stream: no [DONE]; with chunked framing a broken body too
                assert a.status == 200 and not a.done and len(a.chunks) == FAULT_AFTER
                assert (a.error is not None) == chunked
            assert b.status == 200 and b.done and len(b.chunks) == 17 and b.error is None
            failed, waiter = record(sim, "a"), record(sim, "b")
            assert failed["fault"] == kind
            check_aftermath(sim, failed, waiter, at_once, grace_ms)
            if at_once:
                assert "a" not in daemon.holders(key) and "a" not in p.proxy._sessions  # the dead request let go
            third = post(p.port, payload([{"role": "user", "content": "third"}], user="c"))
            assert third.status == 200 and third.done
            if kind == "restart":
                assert waiter["cache_n"] == 0  # the waiter found a fresh server: every cache dropped
            wait_for(lambda: daemon.holders(key) == [] and daemon.waiting(key) == [], timeout=FAST)
            assert daemon.queue(key)["grants"] == 4  # gate, a, b, c: nobody was granted twice
        finally:
            p.close()


class Truncated(Exception):
    """The agent's stream ended without ``data: [DONE]``."""


def agent_stream(url: str, who: str, messages: List[Dict[str, Any]]) -> str:
    """What an agent does inside ``session.request()``: stream one reply with urllib."""
    req = urllib.request.Request(url + "/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps(payload(messages, user=who)).encode())
    with urllib.request.urlopen(req, timeout=30) as response:
        raw = response.read()
    reply = Reply(200, {}, raw, None)
    if not reply.done:
        raise Truncated(f"{who}: the stream ended after {len(reply.chunks)} chunks without [DONE]")
    return reply.text


CLIENT_CASES = [("close", False), ("close", True), ("500", False), ("kv-full", False), ("restart", False)]


@pytest.mark.parametrize("kind,chunked", CLIENT_CASES,
                         ids=[f"{k}-{'chunked' if c else 'close-delimited'}" for k, c in CLIENT_CASES])
def test_client_sessions_a_fault_surfaces_from_run_and_the_slot_goes_to_the_queued_agent(
        daemon: DaemonProc, kind: str, chunked: bool) -> None:
    """Two agents of one process (one Client), each streaming inside ``with session.run(): with
    session.request():``.  The first's request fails; the exception comes out of ``run()``, the run
    aborts, and its slot goes to the second agent at once (not after its 5 s grace, nor the TTL)."""
    with KVSim(prefill_ms=0.05, decode_ms=0.2, chunked=chunked) as sim, \
            lq.Client(daemon.agent_dir, autostart=False) as client:
        key = sim.url
        holder = gate(daemon, key)
        sessions = {"a": client.session(key, "a", grace_ms=5000), "b": client.session(key, "b", grace_ms=50),
                    "c": client.session(key, "c", grace_ms=50)}
        outcome: Dict[str, Any] = {}

        def agent(name: str) -> None:
            session = sessions[name]
            try:
                with session.run():
                    with session.request():
                        if name == "b":
                            outcome["b-saw"] = (daemon.holders(key), daemon.waiting(key))
                        outcome[name] = agent_stream(key, name, [{"role": "user", "content": words(name, 30)}])
            except Exception as e:  # noqa: BLE001 -- the test inspects what surfaced
                outcome[name] = e

        ta = spawn(agent, "a")
        wait_for(lambda: daemon.waiting(key) == ["a"])
        tb = spawn(agent, "b")
        wait_for(lambda: daemon.waiting(key) == ["a", "b"])
        sim.inject(kind)
        assert holder.ask({"op": "release", "queueKey": key, "sessionKey": "gate"})["op"] == "ok"
        ta.join(30)
        tb.join(30)
        error = outcome["a"]
        if kind in ("500", "kv-full"):
            assert isinstance(error, urllib.error.HTTPError) and error.code == 500
            assert json.loads(error.read()) == {"error": SERVER_ERROR if kind == "500" else KV_FULL}
        elif chunked:
            assert isinstance(error, http.client.IncompleteRead), repr(error)
        else:
            assert isinstance(error, Truncated), repr(error)
        assert sessions["a"].lease is None  # the run aborted: the session let its slot go
        assert outcome["b"] == " ".join(f"g{i}" for i in range(16)) + " "
        failed, waiter = record(sim, "a"), record(sim, "b")
        assert failed["fault"] == kind
        check_aftermath(sim, failed, waiter, True, 5000)
        assert outcome["b-saw"] == (["b"], [])  # while b streamed: b held the slot, nobody waited
        spawn(agent, "c").join(30)
        assert outcome["c"] == outcome["b"]
        wait_for(lambda: daemon.holders(key) == [] and daemon.waiting(key) == [], timeout=FAST)
        assert daemon.queue(key)["grants"] == 4
        retried = Chat("a", words("a", 30))  # the failed agent tries again: it queues and streams
        with sessions["a"].run():
            with sessions["a"].request():
                assert agent_stream(key, "a", retried.messages) == outcome["b"]
        sessions["a"].close()
        wait_for(lambda: daemon.holders(key) == [], timeout=FAST)


def test_a_reply_under_a_grammar_ends_by_itself_one_token_short_of_max_tokens(sim: KVSim) -> None:
    # The benchmark's answers: llama.cpp's grammar ends them, and the response says "stop".
    messages = [{"role": "user", "content": "the answer please"}]
    streamed = post(sim.port, {**payload(messages, max_tokens=5), "grammar": "root ::= [0-9]{4}"})
    final = streamed.chunks[-1]
    assert [c["choices"][0]["delta"].get("content") for c in streamed.chunks[:-1]] == [f"g{i} " for i in range(4)]
    assert final["choices"][0]["finish_reason"] == "stop" and final["timings"]["predicted_n"] == 4
    plain = post(sim.port, {**payload(messages, max_tokens=3, stream=False), "grammar": "root ::= [0-9]{2}"})
    assert plain.json()["choices"][0]["finish_reason"] == "stop"
    assert plain.json()["choices"][0]["message"]["content"] == "g0 g1"
    cut = post(sim.port, payload(messages, max_tokens=3))
    assert cut.chunks[-1]["choices"][0]["finish_reason"] == "length"
