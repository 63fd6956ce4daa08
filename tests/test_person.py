"""A person's conversation among agents with nothing named (issue 13): the proxy tells a person's
turn from an agent's by the request itself.

An agent at work sends its tools' outputs back (a ``tool`` message, a ``tool_result`` block, a
``function_call_output`` item); only a person answers the model in their own words.  So a
conversation in which a request continues with a user's own message, after a reply of the model,
is a person's: a parent, with a person's handback window.  While a person's conversation is in
use, every other conversation with nothing named is background work: a child, behind the person
at every request boundary.  With no person in sight, every such conversation gets the proxy's
default tier, as before (as a parent, its acquires say ``background``: tests/test_background.py).  A role named by path, header or a subagent marker
always wins.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

import llmqueue as lq
from tests.harness import DaemonProc, started, wait_for
from tests.stub import StubEndpoint
from tests.test_proxy import RunningProxy
from tests.test_proxy_hold import post as post_bytes


def chat(system: str, *turns: str) -> Dict[str, Any]:
    """A chat-completions body: the system prompt and first message, then after each reply of the
    model a message of that kind: ``person`` (the user's words) or ``tool`` (a tool's output)."""
    messages: List[Dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": "go"}]
    for i, kind in enumerate(turns):
        messages.append({"role": "assistant", "content": f"reply {i}"})
        messages.append({"role": "user", "content": f"and now {i}"} if kind == "person"
                        else {"role": "tool", "tool_call_id": f"c{i}", "content": f"output {i}"})
    return {"model": "m", "stream": True, "messages": messages}


# -- what a person's turn is, in each format -----------------------------------------------------------


def test_chat_completions_a_users_words_after_a_reply_are_a_persons_and_a_tools_output_is_not() -> None:
    assert not lq.person_turn(chat("s"))  # a conversation's first request: nobody answered yet
    assert not lq.person_turn(chat("s", "tool"))
    assert not lq.person_turn(chat("s", "person", "tool"))  # only the last message counts
    assert lq.person_turn(chat("s", "person"))
    assert lq.person_turn(chat("s", "tool", "tool", "person"))
    parts = chat("s", "person")
    parts["messages"][-1]["content"] = [{"type": "text", "text": "and now"}]
    assert lq.person_turn(parts)


def test_anthropic_messages_a_tool_result_block_is_a_tools_output() -> None:
    body: Dict[str, Any] = {"model": "m", "system": "s", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}
    assert not lq.person_turn(body)
    body["messages"] += [{"role": "assistant", "content": [{"type": "text", "text": "done"}]},
                         {"role": "user", "content": [{"type": "text", "text": "thanks, now the docs"}]}]
    assert lq.person_turn(body)


def test_responses_a_function_call_output_is_a_tools_output_and_a_previous_response_continues() -> None:
    tool: Dict[str, Any] = {"model": "m", "instructions": "s", "input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}
    assert not lq.person_turn(tool)
    spoke = dict(tool, input=tool["input"] + [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "now the docs"}]}])
    assert lq.person_turn(spoke)
    assert not lq.person_turn({"model": "m", "input": "go"})  # a first request, as a string
    assert not lq.person_turn({"model": "m", "input": [{"role": "user", "content": "go"}]})
    assert lq.person_turn({"model": "m", "previous_response_id": "resp_1",
                           "input": [{"role": "user", "content": "now the docs"}]})


def test_a_marked_subagent_is_never_a_person() -> None:
    body = json.dumps(chat("s", "person")).encode()
    assert lq.proxy_identity({}, body).person
    marked = lq.proxy_identity({"x-claude-code-agent-id": "a1"}, body)
    assert not marked.person and marked.role == "child"


# -- the proxy's tiers ----------------------------------------------------------------------------------


@pytest.fixture
def bare_proxy() -> Iterator[lq.Proxy]:
    with tempfile.TemporaryDirectory(prefix="lqp-") as d:
        client = lq.Client(d, autostart=False)
        proxy = lq.Proxy("http://127.0.0.1:9", client=client, listen=("127.0.0.1", 0))
        try:
            yield proxy
        finally:
            proxy.server.server_close()
            client.close()


def tier_of(proxy: lq.Proxy, body: Dict[str, Any], headers: Optional[Dict[str, str]] = None,
            role: Optional[str] = None, session: Optional[str] = None) -> Tuple[str, bool]:
    ident = proxy.identify(headers or {}, json.dumps(body).encode(), session, role)
    return proxy.tier(ident, role)


def test_with_no_person_in_sight_every_unnamed_conversation_gets_the_default_tier(bare_proxy: lq.Proxy) -> None:
    assert tier_of(bare_proxy, chat("agent a", "tool", "tool")) == ("parent", False)
    assert tier_of(bare_proxy, chat("agent b")) == ("parent", False)


def test_once_a_person_spoke_their_conversation_is_a_parent_and_the_others_children(bare_proxy: lq.Proxy) -> None:
    assert tier_of(bare_proxy, chat("person")) == ("parent", False)  # a first turn says nothing yet
    assert tier_of(bare_proxy, chat("person", "person")) == ("parent", True)
    assert tier_of(bare_proxy, chat("person", "person", "tool")) == ("parent", True)  # still theirs
    assert tier_of(bare_proxy, chat("job 1", "tool")) == ("child", False)
    assert tier_of(bare_proxy, chat("job 2")) == ("child", False)
    # a role the request names, by its path or headers or a subagent's marker, wins
    assert tier_of(bare_proxy, chat("job 3"), role="parent") == ("parent", True)
    assert tier_of(bare_proxy, chat("job 4"), {"x-claude-code-agent-id": "a9"}) == ("child", False)
    # so does a session the tool names: only conversations with nothing named are told apart
    assert tier_of(bare_proxy, chat("job 5"), {"x-session-id": "ses_1"}) == ("parent", False)


def test_the_others_are_children_only_while_the_person_is_around(
        bare_proxy: lq.Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lq, "PERSON_AWAY_S", 0.3)
    assert tier_of(bare_proxy, chat("person", "person")) == ("parent", True)
    assert tier_of(bare_proxy, chat("job")) == ("child", False)
    time.sleep(0.5)
    assert tier_of(bare_proxy, chat("job", "tool")) == ("parent", False)  # the person left
    assert tier_of(bare_proxy, chat("person", "person", "person")) == ("parent", True)  # and came back


# -- through the proxy --------------------------------------------------------------------------------


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    # no spare stream: the person waits for the one slot, and the order is the scheduler's
    yield from started(config={"defaults": {"agingAfterSlots": 0, "agingAfterMs": 0, "parentStreams": 0}})


def post(port: int, body: Dict[str, Any], who: str, finish: str = "stop") -> float:
    """One request through the proxy, with nothing named; returns when its response ended."""
    return post_bytes(port, json.dumps(body).encode(), who, finish)


def roles(daemon: DaemonProc, key: str, what: str) -> List[str]:
    return [str(entry["role"]) for entry in daemon.queue(key).get(what, [])]


def test_a_persons_turn_goes_ahead_of_background_work_that_queued_first(
        stub: StubEndpoint, daemon: DaemonProc) -> None:
    p = RunningProxy(stub.base, daemon.agent_dir, grace_ms=3000)
    try:
        post(p.port, chat("person"), "P0")
        post(p.port, chat("job J"), "J0")  # nobody has spoken yet: a parent, as before
        post(p.port, chat("person", "person"), "P1")  # a person's words: the person's session
        # J's next request, after that: background now, though its session was a parent's
        j = threading.Thread(target=post, args=(p.port, chat("job J", "tool"), "slow-J1"))
        j.start()
        wait_for(lambda: stub.started("slow-J1"))
        assert roles(daemon, stub.base, "holders") == ["child"]
        k = threading.Thread(target=post, args=(p.port, chat("job K"), "K0"))  # another job: a child
        k.start()
        wait_for(lambda: roles(daemon, stub.base, "waiting") == ["child"])
        person = threading.Thread(target=post, args=(p.port, chat("person", "person", "person"), "P2"))
        person.start()
        wait_for(lambda: sorted(roles(daemon, stub.base, "waiting")) == ["child", "parent"])
        stub.let_slow_finish()
        for t in (j, k, person):
            t.join(30)
        p2, k0 = stub.record("P2"), stub.record("K0")
        assert p2 is not None and k0 is not None
        assert p2["start"] < k0["start"]  # the person first, though the job queued before them
    finally:
        p.close()


def test_background_queued_before_the_person_first_spoke_goes_behind_them_at_once(
        stub: StubEndpoint, daemon: DaemonProc) -> None:
    p = RunningProxy(stub.base, daemon.agent_dir, grace_ms=3000)
    try:
        post(p.port, chat("person"), "P0")
        j = threading.Thread(target=post, args=(p.port, chat("job J"), "slow-J0"))
        j.start()
        wait_for(lambda: stub.started("slow-J0"))
        k = threading.Thread(target=post, args=(p.port, chat("job K"), "K0"))
        k.start()
        wait_for(lambda: roles(daemon, stub.base, "waiting") == ["parent"])  # nobody spoke yet
        person = threading.Thread(target=post, args=(p.port, chat("person", "person"), "P1"))
        person.start()
        # K queued before the person's words, as a parent: it is a child now, in its place
        wait_for(lambda: sorted(roles(daemon, stub.base, "waiting")) == ["child", "parent"])
        stub.let_slow_finish()
        for t in (j, k, person):
            t.join(30)
        p1, k0 = stub.record("P1"), stub.record("K0")
        assert p1 is not None and k0 is not None and p1["start"] < k0["start"]
    finally:
        p.close()


def test_a_session_re_tiered_while_queued_moves_to_its_new_tier_in_place(daemon: DaemonProc) -> None:
    key = "http://127.0.0.1:9/v1"
    with lq.Client(daemon.agent_dir, autostart=False, fail_open=False) as client:
        holder = client.session(key, "holder", "parent")
        holder.start()
        queued = client.session(key, "bg", "child")
        t = threading.Thread(target=queued.start, kwargs={"timeout": 20})
        t.start()
        wait_for(lambda: roles(daemon, key, "waiting") == ["child"])
        queued.set_role("parent")
        wait_for(lambda: roles(daemon, key, "waiting") == ["parent"])
        with pytest.raises(ValueError):
            queued.set_role("boss")
        holder.close()
        t.join(10)
        assert roles(daemon, key, "holders") == ["parent"]  # granted in the tier it was moved to
        assert queued.lease is not None and queued.lease.role == "parent"
        queued.close()
