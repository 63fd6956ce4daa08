"""Who is asking, behind the proxy (issue 14): the identity and tier rules.

``proxy_identity`` is pure, so its precedence is pinned here rule by rule: the explicit path or
``X-LLMQueue-*`` headers, then a subagent's own id, then the tool's session id, then
``prompt_cache_key``, then ``user``, then a fingerprint of the conversation's stable prefix; the
tier is child when a subagent marker is present.  Per-install and per-device ids never become
the key.  Each source can be turned off.  A body that is not JSON, is compressed or is huge is
read for nothing (its header ids still count).

The captured requests of four agent CLIs (``tests/captures``: their headers and body id fields)
are replayed: each run and each concurrent session gets a key of its own, a continued or resumed
run keeps its key, and a subagent is a child keyed by its own id.  The captures are fixtures of
the repository: a missing one fails, never skips.

Through a real proxy and daemon: the derived session and tier are what ``status`` shows; a
conversation with no ids at all keeps one session across its requests (switch-free); a request
whose conversation was already seen under a header id continues that session; an unreadable body
is forwarded byte for byte as a session of its own; ``--identity none`` brings back the seed's
rule (a request naming no session is a session of its own).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

import llmqueue as lq
from tests.harness import DaemonProc, started, wait_for
from tests.stub import StubEndpoint

CAPTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "captures")
CAPTURED = ["claude.jsonl", "codex.jsonl", "opencode.jsonl", "pi.jsonl"]  # one file per tool
CLAUDE_SID = "ba46ab05-6d53-4894-ad12-5f7e254ffb4f"
DEVICE = "9334438b6f608996d70b06b748b7ee5ede8bad858f669228ddb3aa7a07ba8281"


def chat_body(system: str = "you are terse", first: str = "fix the bug", more: int = 0, **extra: Any) -> bytes:
    messages: List[Dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    for i in range(more):
        messages += [{"role": "assistant", "content": f"reply {i}"}, {"role": "tool", "content": f"tool out {i}"}]
    return json.dumps(dict({"model": "m", "stream": True, "messages": messages}, **extra)).encode()


def ident(headers: Optional[Dict[str, str]] = None, body: bytes = b"", **kwargs: Any) -> lq.Identity:
    return lq.proxy_identity({k.lower(): v for k, v in (headers or {}).items()}, body, **kwargs)


def claude_metadata(session_id: str) -> Dict[str, Any]:
    return {"user_id": json.dumps({"device_id": DEVICE, "account_uuid": "", "session_id": session_id})}


# -- precedence, rule by rule -----------------------------------------------------------------------


def test_the_explicit_path_or_header_session_wins_over_every_id_the_tool_sends() -> None:
    headers = {"X-Claude-Code-Session-Id": CLAUDE_SID, "x-claude-code-agent-id": "a1"}
    got = ident(headers, chat_body(user="u", prompt_cache_key="k"), session="mine", role="parent")
    assert (got.session, got.role, got.source) == ("mine", "parent", "explicit")
    # An explicit session with no explicit role: the marker still makes it a child.
    assert ident(headers, b"", session="mine").role == "child"


def test_a_subagents_own_id_comes_before_the_session_id_it_shares_with_its_parent() -> None:
    claude = ident({"X-Claude-Code-Session-Id": CLAUDE_SID, "x-claude-code-agent-id": "ad591655d9c0fde35"})
    assert (claude.session, claude.role, claude.source) == ("agent:ad591655d9c0fde35", "child", "agent")
    codex = ident({"session-id": "P", "thread-id": "C", "x-openai-subagent": "collab_spawn",
                   "x-codex-parent-thread-id": "P"}, chat_body(prompt_cache_key="P"))
    assert (codex.session, codex.role) == ("agent:C", "child")
    opencode = ident({"x-session-id": "ses_child", "x-session-affinity": "ses_child", "x-parent-session-id": "ses_p"})
    assert (opencode.session, opencode.role) == ("agent:ses_child", "child")


def test_the_tools_session_id_names_a_parent_session() -> None:
    for name in ("X-Claude-Code-Session-Id", "x-session-id", "session-id", "session_id", "x-session-affinity"):
        got = ident({name: "S1"}, chat_body(user="u", prompt_cache_key="k"))
        assert (got.session, got.role, got.source) == ("session:S1", None, "session"), name


def test_claude_codes_metadata_user_id_gives_its_session_id_never_its_device_id() -> None:
    got = ident({}, chat_body(metadata=claude_metadata(CLAUDE_SID)))
    assert (got.session, got.source) == ("session:" + CLAUDE_SID, "session")
    # With the session source off, the JSON user_id is no user: the conversation names it.
    off = ident({}, chat_body(metadata=claude_metadata(CLAUDE_SID)), sources=("cache-key", "user", "fingerprint"))
    assert off.source == "fingerprint" and DEVICE not in (off.session or "")


def test_per_install_ids_never_become_the_key() -> None:
    turn = json.dumps({"installation_id": "INSTALL", "session_id": "S", "thread_id": "S"})
    body = chat_body(client_metadata={"x-codex-installation-id": "INSTALL", "x-codex-turn-metadata": turn})
    for sources in (lq.IDENTITY_SOURCES, ("cache-key", "user", "fingerprint"), ("user",)):
        got = ident({"x-codex-turn-metadata": turn}, body, sources=sources)
        assert "INSTALL" not in (got.session or ""), (sources, got)


def test_prompt_cache_key_then_user_then_the_fingerprint() -> None:
    body = chat_body(prompt_cache_key="K", user="U")
    assert ident({}, body).session == "cache:K"
    assert ident({}, body, sources=("user", "fingerprint")).session == "user:U"
    fp = ident({}, body, sources=("fingerprint",))
    assert fp.source == "fingerprint" and fp.session == "conv:" + str(fp.conversation)
    assert ident({}, body, sources=()) == lq.Identity(None, None, "none")  # nothing read
    # Anthropic: a plain metadata.user_id is a user.
    anth = json.dumps({"model": "m", "system": "s", "metadata": {"user_id": "alice"},
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert ident({}, anth).session == "user:alice"


def test_each_source_can_be_turned_off() -> None:
    headers = {"x-claude-code-agent-id": "A", "X-Claude-Code-Session-Id": "S"}
    assert ident(headers, chat_body(), sources=("session", "fingerprint")).source == "fingerprint"  # no agent
    assert ident({"x-session-id": "S"}, chat_body(prompt_cache_key="K"), sources=("cache-key",)).session == "cache:K"
    assert ident({}, chat_body(prompt_cache_key="K", user="U"), sources=("user",)).session == "user:U"
    assert ident({}, chat_body(), sources=("agent", "session", "cache-key", "user")).session is None


def test_a_marked_subagent_with_no_id_of_its_own_is_keyed_by_its_conversation_not_its_parents_session() -> None:
    body = json.dumps({"model": "m", "metadata": claude_metadata(CLAUDE_SID),
                       "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_is_subagent=true;"},
                                  {"type": "text", "text": "You are a subagent."}],
                       "messages": [{"role": "user", "content": "search the tree"}]}).encode()
    got = ident({"X-Claude-Code-Session-Id": CLAUDE_SID}, body)
    assert got.role == "child" and got.source == "fingerprint" and CLAUDE_SID not in (got.session or "")
    # The marker counts only in the first system block, not anywhere in the conversation.
    talk = json.dumps({"model": "m", "system": [{"type": "text", "text": "You are Claude Code."}],
                       "messages": [{"role": "user", "content": "what does cc_is_subagent=true mean?"}]}).encode()
    parent = ident({"X-Claude-Code-Session-Id": CLAUDE_SID}, talk)
    assert (parent.session, parent.role) == ("session:" + CLAUDE_SID, None)


# -- the fingerprint ----------------------------------------------------------------------------------


def test_the_fingerprint_stays_while_a_conversation_grows_and_differs_between_conversations() -> None:
    def fp(body: bytes) -> Optional[str]:
        return ident({}, body, sources=("fingerprint",)).session

    first = fp(chat_body())
    assert first is not None and first == fp(chat_body(more=3))
    assert first != fp(chat_body(system="another agent"))
    assert first != fp(chat_body(first="another task"))
    assert first != fp(chat_body().replace(b'"model": "m"', b'"model": "other"'))

    def responses(instructions: str, items: Any) -> bytes:
        return json.dumps({"model": "m", "instructions": instructions, "input": items, "stream": True}).encode()

    r1 = fp(responses("be brief", [{"role": "user", "content": [{"type": "input_text", "text": "go"}]}]))
    r2 = fp(responses("be brief", [{"role": "user", "content": [{"type": "input_text", "text": "go"}]},
                                   {"type": "function_call_output", "call_id": "c", "output": "ok"}]))
    assert r1 is not None and r1 == r2 and r1 != fp(responses("be long", "go"))
    assert fp(responses("be brief", "go")) == fp(responses("be brief", "go"))

    def messages(system: Any, n: int) -> bytes:
        msgs = [{"role": "user", "content": "task"}] + [{"role": "assistant", "content": "r"}] * n
        return json.dumps({"model": "m", "system": system, "messages": msgs}).encode()

    a = fp(messages([{"type": "text", "text": "sys"}], 0))
    assert a is not None and a == fp(messages([{"type": "text", "text": "sys"}], 4)) and a != fp(messages("other", 0))


def test_a_body_that_cannot_be_read_is_anonymous_but_header_ids_still_count() -> None:
    body = chat_body(user="U")
    for label, raw, headers in [
        ("not json", b"model=m&prompt=hi", {}),
        ("not an object", b'["m"]', {}),
        ("bad utf-8", b'{"user": "\xff\xfe"}', {}),
        ("deep", b'{"a":' * 100_000, {}),
        ("compressed", gzip.compress(body), {"Content-Encoding": "gzip"}),
        ("huge", body[:-1] + b', "pad": "' + b"x" * lq.MAX_IDENTITY_BODY + b'"}', {}),
    ]:
        got = ident(headers, raw)
        assert got.session is None and got.source == "none", label
        assert ident(dict(headers, **{"x-session-id": "S"}), raw).session == "session:S", label


# -- the captured tools ---------------------------------------------------------------------------


def captures() -> List[Dict[str, Any]]:
    """Every captured request: the rows of ``tests/captures/*.jsonl`` (not its ``bodies/``)."""
    names = sorted(name for name in os.listdir(CAPTURES) if name.endswith(".jsonl"))
    assert names == CAPTURED, f"the captures in {CAPTURES} are {names}, not {CAPTURED}"
    out: List[Dict[str, Any]] = []
    for name in names:
        with open(os.path.join(CAPTURES, name)) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def replay_body(cap: Dict[str, Any]) -> bytes:
    """A body with the capture's keys: its id fields as captured, a conversation of the label's
    own (a run's requests share it), the rest placeholders."""
    body: Dict[str, Any] = {k: None for k in cap["body_keys"]}
    body.update(cap.get("body_id_fields") or {})
    body["model"] = "m"
    body["stream"] = cap.get("stream", True)
    talk = f"the task of {cap['label']}"
    if "messages" in body:
        body["messages"] = [{"role": "user", "content": talk}]
        if "system" in body:
            body["system"] = [{"type": "text", "text": "system prompt"}]
        else:
            body["messages"].insert(0, {"role": "system", "content": "system prompt"})
    if "input" in body:
        body["instructions"] = "system prompt"
        body["input"] = [{"role": "user", "content": [{"type": "input_text", "text": talk}]}]
    for k, v in list(body.items()):
        if v is None:
            body[k] = {}
    return json.dumps(body).encode()


def expected(cap: Dict[str, Any]) -> Tuple[str, Optional[str]]:
    h = {k.lower(): v for k, v in cap["headers"]}
    if cap["tool"] == "claude":
        if "x-claude-code-agent-id" in h:
            return "agent:" + h["x-claude-code-agent-id"], "child"
        return "session:" + h["x-claude-code-session-id"], None
    if cap["tool"] == "codex":
        if "x-openai-subagent" in h:
            return "agent:" + h["thread-id"], "child"
        return "session:" + h["session-id"], None
    if cap["tool"] == "opencode":
        if "x-parent-session-id" in h:
            return "agent:" + h["x-session-id"], "child"
        return "session:" + h["x-session-id"], None
    assert cap["tool"] == "pi"
    if "session_id" in h:
        return "session:" + h["session_id"], None
    return "conv:", None  # chat completions and messages: nothing but the conversation


def test_every_captured_request_gets_the_session_and_tier_its_tool_meant() -> None:
    caps = captures()
    assert {c["tool"] for c in caps} == {"claude", "codex", "opencode", "pi"}
    keys: Dict[str, set[str]] = {}
    for cap in caps:
        got = ident({k: v for k, v in cap["headers"]}, replay_body(cap))
        want, role = expected(cap)
        assert got.session is not None and got.session.startswith(want) and got.role == role, (cap["label"], got)
        for leak in (DEVICE, "9f59c4da-97f5-496a-93d8-cfa73aa60caf"):  # the device and the installation
            assert leak not in got.session
        keys.setdefault(cap["label"], set()).add(got.session)
    # Two runs of one tool, and two concurrent sessions, never share a key.
    # (pi's chat and messages requests carry no id: their conversations, not captured, tell them
    # apart, as the fingerprint tests above pin.)
    for tool in ("claude", "codex", "oc-capchat", "oc-capresp", "pi-capresp"):
        assert not keys[f"{tool}-run1"] & keys[f"{tool}-run2"], tool
    for tool in ("claude", "codex", "oc-capchat", "pi-capresp"):
        assert len(keys[f"{tool}-concurrent"]) == 2, tool
    # A continued or resumed run keeps its key.
    assert keys["claude-continue"] <= keys["claude-toolcall"]
    assert keys["codex-resume"] <= keys["codex-toolcall"]
    assert keys["oc-capchat-continue"] <= keys["oc-capchat-subagent"]
    assert keys["pi-capresp-continue"] <= keys["pi-capresp-toolcall"]
    # Every request of one run is one session (a subagent's are its own).
    assert len(keys["oc-capresp-toolcall"]) == 1 and len(keys["pi-capresp-toolcall"]) == 1


# -- through the proxy ------------------------------------------------------------------------------


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    yield from started(config={"defaults": {"agingAfterSlots": 0, "agingAfterMs": 0}})


@pytest.fixture
def proxy(stub: StubEndpoint, daemon: DaemonProc) -> Iterator[Any]:
    from tests.test_proxy import RunningProxy

    lines: List[str] = []
    p = RunningProxy(stub.base, daemon.agent_dir, grace_ms=10_000, log=lines.append)
    p.lines = lines  # type: ignore[attr-defined]
    yield p
    p.close()


def post(port: int, body: bytes, headers: Optional[Dict[str, str]] = None,
         path: str = "/v1/chat/completions") -> Tuple[int, bytes]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=dict({"Content-Type": "application/json"}, **(headers or {})))
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def holders(d: DaemonProc, key: str) -> List[Tuple[str, str]]:
    return [(h["sessionKey"], h["role"]) for h in d.queue(key).get("holders", [])]


def test_the_proxy_queues_a_subagent_by_its_own_id_as_a_child(
        stub: StubEndpoint, daemon: DaemonProc, proxy: Any) -> None:
    headers = {"X-Claude-Code-Session-Id": CLAUDE_SID, "x-claude-code-agent-id": "ad591655d9c0fde35", "X-Who": "c"}
    assert post(proxy.port, chat_body(), headers, "/v1/messages?beta=true")[0] == 200
    assert holders(daemon, stub.base) == [("agent:ad591655d9c0fde35", "child")]  # held through the grace
    assert any("agent:ad591655d9c0fde35 as child, from agent" in line for line in proxy.lines)
    rec = stub.record("c")
    assert rec is not None and rec["path"] == "/v1/messages?beta=true"
    assert {k.lower() for k in rec["headers"]} >= {"x-claude-code-session-id", "x-claude-code-agent-id"}


def test_a_conversation_with_no_ids_keeps_one_session_across_its_requests(
        stub: StubEndpoint, daemon: DaemonProc, proxy: Any) -> None:
    for i in range(3):
        assert post(proxy.port, chat_body(more=i), {"X-Who": f"r{i}"})[0] == 200
    q = daemon.queue(stub.base)
    assert q["grants"] == 1 and q["switches"] == 0  # one session, kept across its requests
    (session, role), = holders(daemon, stub.base)
    assert session.startswith("conv:") and role == "parent"
    assert post(proxy.port, chat_body(system="another agent"), {"X-Who": "other"})[0] == 200
    assert daemon.queue(stub.base)["grants"] == 2  # another conversation, another session


def test_a_conversation_seen_under_a_session_id_continues_that_session(
        stub: StubEndpoint, daemon: DaemonProc, proxy: Any) -> None:
    assert post(proxy.port, chat_body(), {"x-session-id": "ses_1"})[0] == 200
    assert post(proxy.port, chat_body(more=1))[0] == 200  # the same conversation, no header this time
    assert daemon.queue(stub.base)["grants"] == 1
    assert holders(daemon, stub.base) == [("session:ses_1", "parent")]
    assert any("session:ses_1 as parent, from conversation" in line for line in proxy.lines)


def test_an_unreadable_body_is_forwarded_byte_for_byte_as_a_session_of_its_own(
        stub: StubEndpoint, daemon: DaemonProc, proxy: Any) -> None:
    raw = b"model=m&prompt=\xff\xfe not json"
    assert post(proxy.port, raw, {"X-Who": "raw", "Content-Type": "text/plain"})[0] == 200
    rec = stub.record("raw")
    assert rec is not None and rec["raw"] == raw
    wait_for(lambda: holders(daemon, stub.base) == [], timeout=2)  # released at once, not after the grace
    packed = gzip.compress(chat_body())
    assert post(proxy.port, packed, {"X-Who": "gz", "Content-Encoding": "gzip"})[0] == 200
    rec = stub.record("gz")
    assert rec is not None and rec["raw"] == packed
    wait_for(lambda: holders(daemon, stub.base) == [], timeout=2)


def test_identity_none_brings_back_a_session_of_its_own_per_request(stub: StubEndpoint, daemon: DaemonProc) -> None:
    from tests.test_proxy import RunningProxy

    p = RunningProxy(stub.base, daemon.agent_dir, grace_ms=10_000, identity=())
    try:
        assert post(p.port, chat_body(user="u"), {"x-session-id": "S"})[0] == 200
        wait_for(lambda: holders(daemon, stub.base) == [], timeout=2)
        assert post(p.port, chat_body(user="u"), {"x-session-id": "S"})[0] == 200
        assert daemon.queue(stub.base)["grants"] == 2
    finally:
        p.close()
    client = lq.Client(daemon.agent_dir, autostart=False)
    try:
        with pytest.raises(ValueError, match="unknown identity source 'device'"):
            lq.Proxy(stub.base, client=client, listen=("127.0.0.1", 0), identity=("device",))
    finally:
        client.close()


def test_the_command_line_takes_an_identity_list() -> None:
    assert lq._identity_arg("session, fingerprint") == ("session", "fingerprint")
    assert lq._identity_arg("none") == ()
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="unknown source 'device_id'"):
        lq._identity_arg("session,device_id")


def test_concurrent_requests_of_two_tools_sessions_never_overlap_upstream(
        stub: StubEndpoint, daemon: DaemonProc, proxy: Any) -> None:
    from tests.test_proxy import assert_no_overlap

    errors: List[BaseException] = []

    def agent(n: int) -> None:
        try:
            for i in range(2):
                status, _ = post(proxy.port, chat_body(first=f"task {n}", more=i), {"X-Who": f"a{n}-{i}"})
                assert status == 200
        except BaseException as e:  # noqa: B902
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert_no_overlap(stub)


# -- real client packages -----------------------------------------------------------------------------


def test_the_openai_package_chat_and_responses_streams_are_queued_under_the_ids_they_send(
        stub: StubEndpoint, daemon: DaemonProc, proxy: Any) -> None:
    openai = pytest.importorskip("openai", reason="the openai package is a test extra")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, user="alice")
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.split() == [f"tok{i}" for i in range(6)]
    assert holders(daemon, stub.base) == [("user:alice", "parent")]
    events = list(client.responses.create(model="stub", input="hi", prompt_cache_key="thread-7", stream=True,
                                          extra_headers={"x-openai-subagent": "collab_spawn", "thread-id": "T7",
                                                         "session-id": "P"}))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas).split() == [f"tok{i}" for i in range(6)]
    assert events[-1].type == "response.completed" and events[-1].response.usage.input_tokens == 40
    # codex's subagent: its own thread id, not the parent's session id or cache key; a child
    assert any("session agent:T7 as child, from agent" in line for line in proxy.lines)


def test_the_anthropic_package_messages_stream_is_queued_under_claude_codes_ids(
        stub: StubEndpoint, daemon: DaemonProc, proxy: Any) -> None:
    anthropic = pytest.importorskip("anthropic", reason="the anthropic package is a test extra")
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{proxy.port}", api_key="unused", max_retries=0)
    with client.messages.stream(model="stub", max_tokens=32, system="you are terse",
                                messages=[{"role": "user", "content": "hi"}],
                                metadata={"user_id": json.dumps({"device_id": DEVICE, "session_id": "S9"})}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text.split() == [f"tok{i}" for i in range(6)] and final.stop_reason == "end_turn"
    assert holders(daemon, stub.base) == [("session:S9", "parent")]
    with client.messages.stream(model="stub", max_tokens=32, messages=[{"role": "user", "content": "look"}],
                                extra_headers={"X-Claude-Code-Session-Id": "S9",
                                               "x-claude-code-agent-id": "A1"}) as s:
        assert "".join(s.text_stream).split()[0] == "tok0"
    assert any("agent:A1 as child, from agent" in line for line in proxy.lines)
