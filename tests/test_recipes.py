"""Use it with your agent (issue 34): one recipe per tool, through a real proxy and daemon.

Each recipe points a tool at the proxy by the base URL it gives that tool: Claude Code's
``ANTHROPIC_BASE_URL=http://127.0.0.1:PORT``, and opencode's, codex's and pi's
``http://127.0.0.1:PORT/v1``; the tool appends its own path.  A request shaped as the tool's
captured main request (``tests/captures``: its method, its path, its headers, a body with its
keys) then goes through the proxy to the stub upstream, and while it streams ``status`` shows
it holding the slot in the session and tier the tool meant:

- Claude Code: ``session:<X-Claude-Code-Session-Id>``, a parent; its subagent (with
  ``x-claude-code-agent-id``) ``agent:<that id>``, a child;
- codex: ``session:<session-id>``, a parent; its subagent (with ``x-openai-subagent``)
  ``agent:<thread-id>``, a child;
- opencode: ``session:<x-session-id>``, a parent; its subagent (with ``x-parent-session-id``)
  ``agent:<x-session-id>``, a child;
- pi's chat completions name nothing: ``conv:<the conversation's fingerprint>``, a parent.

The upstream gets each request at the path the tool used, with the captured headers and the
body byte for byte, and streams its answer back whole.

pi's captured requests 19 and 20 (``tests/captures/bodies``: the first turn of a tool-calling
run, and the turn that sends the tool's output back) are one conversation, so they land in one
session, both in ``proxy_identity`` and through the proxy (one grant, no switch).  pi moves
Anthropic's ``cache_control`` marker to the newest message at every request, so the fingerprint
must not see cache annotations: it is pinned unchanged wherever they are added or moved in an
Anthropic body's ``system`` and ``messages`` content blocks.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import urllib.parse
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import pytest

import llmqueue as lq
from tests.harness import DaemonProc, started
from tests.stub import StubEndpoint
from tests.test_proxy import RunningProxy

CAPTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "captures")


class Recipe(NamedTuple):
    base: str  # the base URL the recipe gives the tool, after http://127.0.0.1:PORT
    call: str  # what the tool appends to its base URL for a model call


RECIPES: Dict[str, Recipe] = {
    "claude": Recipe("", "/v1/messages?beta=true"),  # ANTHROPIC_BASE_URL=http://127.0.0.1:PORT
    "codex": Recipe("/v1", "/responses"),
    "opencode": Recipe("/v1", "/chat/completions"),
    "pi": Recipe("/v1", "/chat/completions"),
}

def readme_bases() -> Dict[str, str]:
    """The base URL each tool's recipe in README.md's "Use it with your agent" gives it, after
    the proxy's address: a wrong README recipe fails these tests, not only a wrong table here."""
    import re

    with open(os.path.join(os.path.dirname(CAPTURES), "..", "README.md")) as f:
        text = f.read()
    section = text[text.index("## Use it with your agent"):text.index("\n## ", text.index("## Use it with your agent") + 3)]
    found = {
        "claude": re.findall(r"ANTHROPIC_BASE_URL=(\S+)", section),
        "opencode": re.findall(r'"baseURL":\s*"([^"]+)"', section),
        "codex": re.findall(r'base_url\s*=\s*"([^"]+)"', section),
        "pi": re.findall(r'"baseUrl":\s*"([^"]+)"', section),
    }
    out = {}
    for tool, urls in found.items():
        assert len(urls) == 1, (tool, urls)
        assert urls[0].startswith("http://127.0.0.1:8787"), (tool, urls)
        out[tool] = urls[0][len("http://127.0.0.1:8787"):]
    return out


def test_the_readme_gives_each_tool_the_base_url_tested_here() -> None:
    assert readme_bases() == {tool: recipe.base for tool, recipe in RECIPES.items()}


# The body fields' placeholder values (the captures hold the keys, not the values); the rest are {}.
PLACEHOLDERS: Dict[str, Any] = {
    "tools": [], "tool_choice": "auto", "parallel_tool_calls": False, "include": [], "store": False,
    "max_tokens": 256, "max_completion_tokens": 256, "max_output_tokens": 256,
    "stream_options": {"include_usage": True},
}

# The last event of a whole stream, in each format the stub speaks.
STREAM_END = {"/messages": b"event: message_stop", "/responses": b"event: response.completed",
              "/chat/completions": b"data: [DONE]"}


# -- the captures -----------------------------------------------------------------------------------


def rows(tool: str) -> List[Dict[str, Any]]:
    """The captured requests of one tool (``tests/captures/<tool>.jsonl``)."""
    with open(os.path.join(CAPTURES, f"{tool}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def header_map(cap: Dict[str, Any]) -> Dict[str, str]:
    return {k.lower(): v for k, v in cap["headers"]}


def first(tool: str, label: str, where: Callable[[Dict[str, Any]], bool], what: str) -> Dict[str, Any]:
    found = [cap for cap in rows(tool) if cap["label"] == label and where(cap)]
    assert found, f"no {what} in {tool}'s capture {label}"
    return found[0]


def main_row(tool: str, label: str) -> Dict[str, Any]:
    """A run's main request: its first with ``tools`` in the body (opencode's first request of a
    run asks for the session's title, with no tools)."""
    return first(tool, label, lambda cap: "tools" in cap["body_keys"], "main request")


def subagent_row(tool: str, label: str, marker: str) -> Dict[str, Any]:
    """A subagent's request: the run's first that carries the tool's subagent header ``marker``."""
    return first(tool, label, lambda cap: marker in header_map(cap), f"request with {marker}")


def recipe_body(cap: Dict[str, Any]) -> bytes:
    """A body with exactly the captured keys, in their order: the captured id fields as they
    were, a conversation of the request's own, placeholders for the rest."""
    talk = f"the task of {cap['label']} #{cap['n']}"
    body: Dict[str, Any] = {key: copy.deepcopy(PLACEHOLDERS.get(key, {})) for key in cap["body_keys"]}
    body.update(copy.deepcopy(cap["body_id_fields"]))
    body.update(model="stub", stream=cap["stream"])
    if "messages" in body:
        user = {"role": "user", "content": talk}
        if "system" in body:  # Anthropic Messages
            body["system"] = [{"type": "text", "text": "system prompt"}]
            body["messages"] = [user]
        else:
            body["messages"] = [{"role": "system", "content": "system prompt"}, user]
    if "input" in body:  # Responses
        body["input"] = [{"role": "developer", "content": [{"type": "input_text", "text": "system prompt"}]},
                         {"role": "user", "content": [{"type": "input_text", "text": talk}]}]
    assert list(body) == cap["body_keys"]
    return json.dumps(body).encode()


# -- a daemon, the stub upstream, and the proxy in front of it -------------------------------------


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    yield from started(config={"defaults": {"agingAfterSlots": 0, "agingAfterMs": 0}})


@pytest.fixture
def proxy(stub: StubEndpoint, daemon: DaemonProc) -> Iterator[RunningProxy]:
    p = RunningProxy(stub.base, daemon.agent_dir, grace_ms=10_000)
    yield p
    p.close()


def queue_of(daemon: DaemonProc, stub: StubEndpoint) -> Dict[str, Any]:
    """The daemon's one queue: the stub's, however the proxy spells its key (the server's root
    and its ``/v1`` base URL are one server, so one queue)."""
    queues = daemon.status()
    assert len(queues) == 1, [q["queueKey"] for q in queues]
    assert queues[0]["queueKey"] in (stub.base, stub.url), queues[0]["queueKey"]
    return queues[0]


def holders(daemon: DaemonProc, stub: StubEndpoint) -> List[Tuple[str, str]]:
    return [(h["sessionKey"], h["role"]) for h in queue_of(daemon, stub)["holders"]]


def through_the_recipe(stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy, tool: str,
                       cap: Dict[str, Any], want: Tuple[str, str], body: Optional[bytes] = None) -> None:
    """Send ``cap``'s request the way ``tool`` sends it from the recipe's base URL; while it
    streams, it holds the slot as ``want`` (session, tier); the upstream gets it unchanged."""
    recipe = RECIPES[tool]
    url = urllib.parse.urlsplit(f"http://127.0.0.1:{proxy.port}{recipe.base}{recipe.call}")
    path = url.path + (f"?{url.query}" if url.query else "")
    assert (cap["method"], path) == ("POST", cap["path"]), "the recipe's base URL leads the tool elsewhere"
    raw = body if body is not None else recipe_body(cap)
    who = f"slow-{cap['label']}-{cap['n']}"
    headers = dict(cap["headers"], **{"X-Who": who})
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        conn.request(cap["method"], path, body=raw, headers=headers)
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().strip()  # the answer streams: the request holds its slot
        assert holders(daemon, stub) == [want]
        assert queue_of(daemon, stub)["waiting"] == []
        stub.let_slow_finish()
        rest = response.read()
    finally:
        stub.let_slow_finish()
        conn.close()
    assert STREAM_END[next(end for end in STREAM_END if path.split("?")[0].endswith(end))] in rest
    rec = stub.record(who)
    assert rec is not None and (rec["method"], rec["path"]) == (cap["method"], cap["path"])
    got = {k.lower(): v for k, v in rec["headers"].items()}
    assert {k: got.get(k) for k in header_map(cap)} == header_map(cap)  # every captured header, as sent
    assert rec["raw"] == raw


# -- one recipe per tool ------------------------------------------------------------------------------


@pytest.mark.parametrize("agent", ["main", "subagent"])
def test_claude_code(agent: str, stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy) -> None:
    if agent == "main":
        cap = main_row("claude", "claude-run1")
        want = ("session:" + header_map(cap)["x-claude-code-session-id"], "parent")
    else:
        cap = subagent_row("claude", "claude-subagent", "x-claude-code-agent-id")
        h = header_map(cap)
        assert h["x-claude-code-agent-id"] != h["x-claude-code-session-id"]  # it carries its parent's too
        want = ("agent:" + h["x-claude-code-agent-id"], "child")
    through_the_recipe(stub, daemon, proxy, "claude", cap, want)


@pytest.mark.parametrize("agent", ["main", "subagent"])
def test_codex(agent: str, stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy) -> None:
    if agent == "main":
        cap = main_row("codex", "codex-run1")
        want = ("session:" + header_map(cap)["session-id"], "parent")
    else:
        cap = subagent_row("codex", "codex-subagent", "x-openai-subagent")
        h = header_map(cap)
        assert h["thread-id"] != h["session-id"]  # its own thread, in its parent's session
        want = ("agent:" + h["thread-id"], "child")
    through_the_recipe(stub, daemon, proxy, "codex", cap, want)


@pytest.mark.parametrize("agent", ["main", "subagent"])
def test_opencode(agent: str, stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy) -> None:
    if agent == "main":
        cap = main_row("opencode", "oc-capchat-run1")
        want = ("session:" + header_map(cap)["x-session-id"], "parent")
    else:
        cap = subagent_row("opencode", "oc-capchat-subagent", "x-parent-session-id")
        h = header_map(cap)
        assert h["x-session-id"] != h["x-parent-session-id"]
        want = ("agent:" + h["x-session-id"], "child")
    through_the_recipe(stub, daemon, proxy, "opencode", cap, want)


def test_pi(stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy) -> None:
    cap = main_row("pi", "pi-capchat-run1")
    named = {"session_id", "session-id", "x-session-id", "x-session-affinity", "x-claude-code-session-id"}
    assert not named & set(header_map(cap))  # pi's chat completions name no session
    body = recipe_body(cap)
    fingerprint = lq.conversation_fingerprint(json.loads(body))
    assert fingerprint is not None
    through_the_recipe(stub, daemon, proxy, "pi", cap, ("conv:" + fingerprint, "parent"), body)


# -- pi's requests 19 and 20: one conversation -------------------------------------------------------


def pi_request(n: int) -> Tuple[Dict[str, Any], bytes]:
    """pi's captured request ``n``: its row, and its whole body (``bodies/pi-00NN.json``)."""
    (cap,) = [c for c in rows("pi") if c["n"] == n]
    with open(os.path.join(CAPTURES, "bodies", f"pi-{n:04d}.json"), "rb") as f:
        body = f.read()
    assert list(json.loads(body)) == cap["body_keys"]
    return cap, body


def test_pis_requests_19_and_20_are_one_conversation() -> None:
    (cap19, body19), (cap20, body20) = pi_request(19), pi_request(20)
    # The same first turn, its cache marker moved on: on the user's words in 19, on the tool's output in 20.
    turn19, turn20 = json.loads(body19)["messages"], json.loads(body20)["messages"]
    assert "cache_control" in turn19[0]["content"][0] and "cache_control" not in turn20[0]["content"][0]
    assert "cache_control" in turn20[-1]["content"][-1] and turn20[-1]["content"][-1]["type"] == "tool_result"
    first_turn = lq.proxy_identity(header_map(cap19), body19)
    tool_output = lq.proxy_identity(header_map(cap20), body20)
    assert first_turn.session is not None and first_turn.session.startswith("conv:") and first_turn.role is None
    assert tool_output.session == first_turn.session


def test_pis_requests_19_and_20_land_in_one_session_through_the_proxy(
        stub: StubEndpoint, daemon: DaemonProc, proxy: RunningProxy) -> None:
    sessions: List[List[Tuple[str, str]]] = []  # the holders after each response
    # 19 is answered with a tool call, as it was; 20 sends the tool's output back.
    for n, finish in ((19, "tool_calls"), (20, "stop")):
        cap, body = pi_request(n)
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        try:
            conn.request(cap["method"], cap["path"], body=body,
                         headers=dict(cap["headers"], **{"X-Who": f"pi-{n}", "X-Finish": finish}))
            response = conn.getresponse()
            assert response.status == 200 and STREAM_END["/messages"] in response.read()
        finally:
            conn.close()
        rec = stub.record(f"pi-{n}")
        assert rec is not None and (rec["path"], rec["raw"]) == (cap["path"], body)
        sessions.append(holders(daemon, stub))
    fingerprint = lq.conversation_fingerprint(json.loads(pi_request(19)[1]))
    assert sessions[0] == [("conv:" + str(fingerprint), "parent")]
    assert sessions[1] == sessions[0], "request 20 is not in request 19's session"
    q = queue_of(daemon, stub)
    assert (q["grants"], q["switches"]) == (1, 0)  # one lease served both: no switch, no re-prefill


def test_the_fingerprint_of_an_anthropic_body_ignores_cache_control_wherever_it_is() -> None:
    def conversation(turns: int) -> Dict[str, Any]:
        messages: List[Dict[str, Any]] = [{"role": "user", "content": [
            {"type": "text", "text": "fix the failing test"}, {"type": "text", "text": "it is in tests/"}]}]
        for i in range(turns):
            messages += [
                {"role": "assistant", "content": [{"type": "text", "text": f"running {i}"},
                                                  {"type": "tool_use", "id": f"t{i}", "name": "bash",
                                                   "input": {"command": "pytest"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                              "content": [{"type": "text", "text": f"{i} failed"}]}]},
            ]
        return {"model": "m", "max_tokens": 64, "stream": True, "messages": messages,
                "system": [{"type": "text", "text": "You are a coding agent."},
                           {"type": "text", "text": "Be brief."}]}

    def blocks(body: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Every content block of ``system`` and ``messages``, nested ones (a tool result's) too."""
        out: List[Dict[str, Any]] = list(body["system"])
        for m in body["messages"]:
            for block in m["content"]:
                out.append(block)
                if isinstance(block.get("content"), list):
                    out += block["content"]
        return out

    def marked(body: Dict[str, Any], where: Callable[[int, int], bool], ttl: bool = False) -> Dict[str, Any]:
        """``body`` with a cache_control on each block ``where(index, count)`` picks."""
        body = copy.deepcopy(body)
        found = blocks(body)
        for i, block in enumerate(found):
            if where(i, len(found)):
                block["cache_control"] = dict({"type": "ephemeral"}, **({"ttl": "1h"} if ttl else {}))
        return body

    def as_pi(body: Dict[str, Any]) -> Dict[str, Any]:
        """pi's markers: on the last system block and on the newest message's last block."""
        body = copy.deepcopy(body)
        for block in (body["system"][-1], body["messages"][-1]["content"][-1]):
            block["cache_control"] = {"type": "ephemeral"}
        return body

    def fp(body: Dict[str, Any]) -> Optional[str]:
        return lq.conversation_fingerprint(body)

    for turns in (0, 2):
        plain = conversation(turns)
        want = fp(plain)
        assert want is not None
        count = len(blocks(plain))
        for at in range(count):  # on any one block, system or messages
            assert fp(marked(plain, lambda i, n: i == at)) == want, (turns, at)
            assert fp(marked(plain, lambda i, n: i == at, ttl=True)) == want, (turns, at)
        assert fp(marked(plain, lambda i, n: True)) == want, turns  # on every block
        assert fp(as_pi(plain)) == want, turns
    # The marker moves to the newest message as the conversation grows (pi's requests 19 and 20):
    # still one conversation.
    assert fp(as_pi(conversation(0))) == fp(as_pi(conversation(1))) == fp(as_pi(conversation(2)))
    # Not by reading less: other words are another conversation, marked alike or not.
    other = conversation(0)
    other["messages"][0]["content"][0]["text"] = "fix the failing build"
    assert fp(marked(other, lambda i, n: i == 2)) != fp(marked(conversation(0), lambda i, n: i == 2))
    other = conversation(0)
    other["system"][1]["text"] = "Be thorough."
    assert fp(other) != fp(conversation(0))
