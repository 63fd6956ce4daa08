"""How long a proxy session keeps its slot after a response (issues 13 and 14): by how the
response ended, and by the session's own tool calls.

The response's own words decide first (read as it streams, in each format): a response that
ended the agent's turn (``stop``, ``end_turn``, a completed Response with no tool call) hands the
slot to a waiter at once; one that asked for a tool (``tool_calls``, ``tool_use``, a
``function_call`` item) keeps it through the grace, since the agent comes right back.  A response
that says neither (cut at ``max_tokens``) keeps it as long as the session's own tool calls take:
the whole grace before its first gap is known, then 1.5x its longest recent gap plus 0.2 s (at
least ``PARENT_HANDBACK_MS``), and a new session starts from its peers' recent gaps; a parent
named by its path keeps its handback window.  Whatever the
window, a holder nobody waits for keeps its slot through the grace.  Those windows are kept
from a waiting subagent; a waiting parent gets the slot at the end of the response, whatever it
said, unless the queue knows that a switch re-prefills there (``switchCost: dear``): then a
parent holder keeps its window from a parent too.

Those windows are the rules in force.  The cost rule bounds them: a slot someone waits for is
kept no longer than a switch could cost at worst (re-prefilling the largest contexts still in use
that fill the room it makes, at the server's own rate).  So the stub says here that each agent's context is 40k tokens (50 s to
prefill again at its rate), far past any window; with its usual 40 tokens the slot goes at 50 ms.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest

import llmqueue as lq
from tests.harness import DaemonProc, started, wait_for
import tests.stub as stub_module
from tests.stub import StubEndpoint, _closing, _delta, _opening
from tests.test_proxy import RunningProxy

GRACE_MS = 3000
SOON = 1.0  # "at once", on a loaded machine: far below the 3 s grace


@pytest.mark.parametrize("kind", ["chat", "responses", "messages"])
@pytest.mark.parametrize("finish,want", [("stop", "turn"), ("tool_calls", "tool"), ("length", None)])
def test_the_scanner_reads_how_each_format_says_a_response_ended(kind: str, finish: str, want: Optional[str]) -> None:
    stream = _opening(kind) + _delta(kind, "a ") + _delta(kind, "b ") + _closing(kind, 2, finish)
    for size in (1, 5, len(stream)):
        scanner = lq.UsageScanner("text/event-stream")
        for i in range(0, len(stream), size):
            scanner.feed(stream[i:i + size])
        scanner.result()
        assert scanner.ending == want, (kind, finish, size)


def test_endings_of_non_streamed_bodies_and_chunks_that_say_nothing() -> None:
    assert lq._ending({"choices": [{"finish_reason": "tool_calls", "message": {}}]}) == "tool"
    assert lq._ending({"choices": [{"finish_reason": None, "delta": {"content": "x"}}]}) is None
    assert lq._ending({"type": "message", "stop_reason": "tool_use"}) == "tool"
    assert lq._ending({"type": "message", "stop_reason": "max_tokens"}) is None
    assert lq._ending({"object": "response", "status": "completed", "output": [{"type": "message"}]}) == "turn"
    assert lq._ending({"object": "response", "status": "incomplete", "output": []}) is None
    scanner = lq.UsageScanner("application/json")
    scanner.feed(json.dumps({"choices": [{"finish_reason": "stop"}], "usage": {"prompt_tokens": 3}}).encode())
    assert scanner.result() == (3, 0) and scanner.ending == "turn"


# -- through the proxy ------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def large_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stub response reports a 40k-token prompt, 10 tokens of it prefilled in 12.5 ms."""
    monkeypatch.setitem(stub_module.USAGE, "prompt", 40_000)
    monkeypatch.setitem(stub_module.USAGE, "cached", 39_990)


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    yield from started(config={"defaults": {"agingAfterSlots": 0, "agingAfterMs": 0}})


@pytest.fixture
def proxy(stub: StubEndpoint, daemon: DaemonProc) -> Iterator[RunningProxy]:
    p = RunningProxy(stub.base, daemon.agent_dir, grace_ms=GRACE_MS)
    yield p
    p.close()


def body(agent: str, turn: int = 0) -> bytes:
    messages: List[Dict[str, str]] = [{"role": "system", "content": f"you are {agent}"},
                                      {"role": "user", "content": "go"}]
    for i in range(turn):  # an agent at work: its tool's output, not a person's words (a person's session)
        messages += [{"role": "assistant", "content": "ok"}, {"role": "tool", "content": f"tool output {i}"}]
    return json.dumps({"model": "m", "stream": True, "messages": messages}).encode()


def post(port: int, data: bytes, who: str, finish: str = "stop", path: str = "/v1/chat/completions",
         headers: Optional[Dict[str, str]] = None) -> float:
    """One request through the proxy (with ``headers`` too); returns when its response ended
    (monotonic)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=data, headers=dict({"Content-Type": "application/json", "X-Who": who,
                                                            "X-Finish": finish}, **(headers or {})))
        response = conn.getresponse()
        assert response.status == 200
        response.read()
        return time.monotonic()
    finally:
        conn.close()


def handover_after(stub: StubEndpoint, daemon: DaemonProc, p: RunningProxy, finish: str,
                   warmup: Sequence[float] = (), path: str = "/v1/chat/completions",
                   waiter: str = "/s/B/child/v1/chat/completions", held_s: float = 0.0) -> float:
    """Agent A (a conversation with no ids: a parent by default) makes ``len(warmup)`` requests
    with those gaps after them, then one more that ends with ``finish`` while agent B waits (a
    subagent named by its path, unless ``waiter`` says otherwise): the seconds from that
    response's end to B's request reaching the upstream.  ``held_s``: how long the last response
    streams after B came."""
    turn = 0
    for gap in warmup:
        post(p.port, body("A", turn), f"A{turn}", "length", path)
        turn += 1
        time.sleep(gap)
    ended: List[float] = []
    a = threading.Thread(target=lambda: ended.append(post(p.port, body("A", turn), "slow-A", finish, path)))
    a.start()
    wait_for(lambda: stub.started("slow-A"))
    b = threading.Thread(target=post, args=(p.port, body("B"), "B", "stop", waiter))
    b.start()
    wait_for(lambda: len(daemon.waiting(stub.base)) == 1)
    time.sleep(held_s)
    stub.let_slow_finish()
    a.join(30)
    b.join(30)
    rec = stub.record("B")
    assert rec is not None and ended
    return float(rec["start"]) - ended[0]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_response_that_ends_the_turn_hands_the_slot_to_a_waiter_at_once(
        stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy, path: str) -> None:
    assert handover_after(stub, daemon, proxy, "stop", path=path) < SOON


def test_a_response_that_asks_for_a_tool_keeps_the_slot_through_the_grace(
        stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy) -> None:
    waited = handover_after(stub, daemon, proxy, "tool_calls")
    assert GRACE_MS / 1000 - 0.5 < waited < GRACE_MS / 1000 + 3


def test_where_a_switch_costs_less_than_the_grace_the_slot_goes_once_that_is_spent(
        stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A response that asks for a tool keeps the slot through the grace, by the rules; but where the
    server re-prefills the whole context in 50 ms (40 tokens at 1.25 ms), keeping it 3 s idle for
    a waiter is pure loss: it goes once that much idle time is spent."""
    monkeypatch.setitem(stub_module.USAGE, "prompt", 40)
    monkeypatch.setitem(stub_module.USAGE, "cached", 30)
    waited = handover_after(stub, daemon, proxy, "tool_calls")
    assert waited < SOON  # not the 3 s grace


def test_a_request_that_starts_while_the_slot_idles_is_a_stream_the_bound_never_takes(
        stub: StubEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live stream is never preempted.  Where switches are dear, A keeps its slot through a tool
    call's grace while B waits (no hand-back), and the bound hands it over once A has idled 3 s
    (A's 2,400 tokens at 1.25 ms).  A's next request starts before that: it is in flight for the
    daemon from the beat that found the slot still held, whatever becomes of the messages after
    it, so B reaches the server only once A's stream is over.  (Were it so only from a busy mark
    sent after that beat, the bound could fall between the two: two requests at a server that runs
    one.)"""
    monkeypatch.setitem(stub_module.USAGE, "prompt", 2400)
    monkeypatch.setitem(stub_module.USAGE, "cached", 2390)
    for d in started(config={"defaults": {"agingAfterSlots": 0, "agingAfterMs": 0, "switchCost": "dear"}}):
        p = RunningProxy(stub.base, d.agent_dir, grace_ms=2 * GRACE_MS)  # a grace past the bound
        try:
            post(p.port, body("A"), "A0", "tool_calls")
            wait_for(lambda: p.proxy.client.switch_cost(p.proxy.queue_key) == "dear")
            post(p.port, body("A", 1), "A1", "tool_calls")  # its end, known dear: the slot kept, idle
            b = threading.Thread(target=post, args=(p.port, body("B"), "B", "stop", "/v1/chat/completions"))
            b.start()
            wait_for(lambda: len(d.waiting(stub.base)) == 1)
            marked = lq.Session._mark
            monkeypatch.setattr(lq.Session, "_mark", lambda self, lease, busy: None if busy else marked(self, lease, busy))
            ended: List[float] = []
            a = threading.Thread(target=lambda: ended.append(post(p.port, body("A", 2), "slow-A2", "tool_calls")))
            a.start()
            wait_for(lambda: stub.started("slow-A2"))
            assert len(d.waiting(stub.base)) == 1  # the request began before the bound
            time.sleep(4.0)  # streaming, past the bound's 3 s
            assert not stub.started("B")
            stub.let_slow_finish()
            a.join(30)
            b.join(30)
            rec = stub.record("B")
            assert rec is not None and ended and rec["start"] >= ended[0] - 0.5
        finally:
            p.close()


def test_a_response_that_says_neither_keeps_the_whole_grace_before_the_first_gap_is_known(
        stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy) -> None:
    waited = handover_after(stub, daemon, proxy, "length")
    assert GRACE_MS / 1000 - 0.5 < waited < GRACE_MS / 1000 + 3


def test_then_as_long_as_the_sessions_own_tool_calls_take(
        stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy) -> None:
    # Gaps of 0.2 s: a window of 1.5 x 0.2 + 0.2 = 0.5 s, far below the 3 s grace.
    waited = handover_after(stub, daemon, proxy, "length", warmup=[0.2, 0.2])
    assert 0.3 < waited < 2.0  # far below the 3 s grace, however loaded the machine


def test_a_new_session_starts_from_its_peers_recent_gaps(
        stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy) -> None:
    for turn in range(3):  # another agent's tool calls: 0.2 s each
        post(proxy.port, body("W", turn), f"W{turn}", "length")
        time.sleep(0.2)
    wait_for(lambda: daemon.holders(stub.base) == [], timeout=GRACE_MS / 1000 + 3)
    waited = handover_after(stub, daemon, proxy, "length")  # A: no gap of its own yet
    assert 0.3 < waited < 2.0


def test_a_persons_think_time_is_no_peer_tool_call(
        stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy) -> None:
    """As above, and then a person (a parent named by its path) thinks 1.5 s between turns: a new
    session still starts from the agents' 0.2 s tool calls, not a window of 2.45 s."""
    for turn in range(3):
        post(proxy.port, body("W", turn), f"W{turn}", "length")
        time.sleep(0.2)
    for turn in range(2):
        post(proxy.port, body("P", turn), f"P{turn}", "length", "/s/main/parent/v1/chat/completions")
        time.sleep(1.5)
    wait_for(lambda: daemon.holders(stub.base) == [], timeout=GRACE_MS / 1000 + 3)
    waited = handover_after(stub, daemon, proxy, "length")  # A: no gap of its own yet
    assert 0.3 < waited < 1.8


def test_a_parent_named_by_its_path_keeps_its_handback_window(
        stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy) -> None:
    waited = handover_after(stub, daemon, proxy, "length", path="/s/main/parent/v1/chat/completions")
    assert waited < lq.PARENT_HANDBACK_MS / 1000 + SOON


@pytest.mark.parametrize("finish", ["tool_calls", "length"])
def test_a_waiting_parent_gets_the_slot_when_the_response_ends_whatever_it_said(
        stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy, finish: str) -> None:
    # Two agents with nothing named: both parents.  The holder's window (the grace, for a tool
    # call) would keep the other behind an idle slot for its tool call: it hands over at once,
    # however short its run so far (the switch cost is unknown: this is how the queue finds out).
    waited = handover_after(stub, daemon, proxy, finish, waiter="/v1/chat/completions")
    assert waited < SOON
    assert daemon.queue(stub.base)["handbackYields"] == 1


def test_where_switches_are_dear_a_parent_keeps_its_window_from_a_waiting_parent_too(stub: StubEndpoint) -> None:
    for d in started(config={"defaults": {"agingAfterSlots": 0, "agingAfterMs": 0, "switchCost": "dear"}}):
        p = RunningProxy(stub.base, d.agent_dir, grace_ms=GRACE_MS)
        try:
            # one request first: its usage report's reply tells the proxy what a switch costs
            waited = handover_after(stub, d, p, "tool_calls", warmup=[0.3], waiter="/v1/chat/completions")
            assert p.proxy.client.switch_cost(p.proxy.queue_key) == "dear"
            assert GRACE_MS / 1000 - 0.5 < waited < GRACE_MS / 1000 + 3  # a re-prefill saved
            assert d.queue(stub.base)["handbackYields"] == 0
        finally:
            p.close()


def test_a_holder_nobody_waits_for_keeps_its_slot_through_the_grace(
        stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy) -> None:
    post(proxy.port, body("A"), "A0", "stop")  # ended its turn, but nobody waits
    time.sleep(0.5)
    (holder,) = daemon.holders(stub.base)
    assert holder.startswith("conv:")
    post(proxy.port, body("A", 1), "A1", "stop")  # its next turn within the grace: switch-free
    q = daemon.queue(stub.base)
    assert q["grants"] == 1 and q["switches"] == 0
    wait_for(lambda: daemon.holders(stub.base) == [], timeout=GRACE_MS / 1000 + 3)
