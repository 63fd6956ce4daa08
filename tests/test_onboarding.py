"""A new user's first minutes (issue 34): one queue per server whatever the form of its URL, only
model calls take a slot, two identical conversations never share a grant, and a command line that
says what to do.

Pinned through the socket, the proxy and the command line:

- a server named with or without ``/v1``, with or without a trailing slash, is one queue: a holder
  from one form (a raw peer, ``llmqueue run``, the proxy, a models.json provider) holds back a
  waiter from another; a config entry keyed by either form applies;
- ``--upstream .../v1`` forwards ``/v1/chat/completions`` to ``/v1/chat/completions``;
- ``HEAD /``, ``GET /v1/models``, ``/health``, ``/props`` and token counting pass through while
  the slot is held, with no slot, no switch and no count;
- two concurrent requests of one fingerprint-keyed conversation never run under one grant;
- ``--verbose`` lines carry the time, the response status and the duration;
- messages that name the problem and the fix: ``--help`` lists the subcommands, a typo gets
  "did you mean", ``run`` without ``--``, a taken ``--listen`` address, ``--fail-closed``, an
  agent dir that cannot be made, ``report`` with no log or a missing one;
- ``--version`` on every subcommand; ``LLMQUEUE_DIR`` before ``PI_CODING_AGENT_DIR``;
- ``proxy --log FILE`` makes its queue report-ready with no config file.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

import llmqueue as lq
from tests.harness import MODULE, DaemonProc, Peer, short_tmpdir, started, wait_for
from tests.stub import StubEndpoint
from tests.test_proxy import RunningProxy

SERVER = "http://127.0.0.1:8080"


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    yield from started(config={"defaults": {"agingAfterSlots": 0, "agingAfterMs": 0}})


def run_cli(*args: str, timeout: float = 30, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, MODULE, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kwargs)


def acquire(d: DaemonProc, key: str, session: str) -> Peer:
    p = d.peer()
    p.send({"op": "acquire", "queueKey": key, "sessionKey": session, "role": "parent"})
    return p


# -- one server, one queue ------------------------------------------------------------------------

FORMS = [SERVER, SERVER + "/", SERVER + "/v1", SERVER + "/v1/"]


@pytest.mark.parametrize("holder_form,waiter_form", [
    (a, b) for a in FORMS for b in FORMS if a != b and (a.rstrip("/").endswith("/v1") != b.rstrip("/").endswith("/v1")
                                                         or a.endswith("/") != b.endswith("/"))])
def test_a_holder_under_one_form_of_a_servers_url_holds_back_a_waiter_under_another(
        daemon: DaemonProc, holder_form: str, waiter_form: str) -> None:
    a = acquire(daemon, holder_form, "A")
    granted = a.recv()
    assert granted["op"] == "granted" and granted["queueKey"] == holder_form  # the key it asked with
    b = acquire(daemon, waiter_form, "B")
    assert b.silent(0.2)  # one queue: B waits behind A
    assert daemon.waiting(SERVER) == ["B"]
    a.send({"op": "release", "queueKey": holder_form, "sessionKey": "A"})
    reply = b.recv()
    assert reply["op"] == "granted" and reply["queueKey"] == waiter_form
    assert [q["queueKey"] for q in daemon.status()] == [SERVER + "/v1"]  # shown in one form


@pytest.mark.parametrize("entry_form", [SERVER, SERVER + "/v1"])
def test_a_config_entry_keyed_by_either_form_applies_to_both(entry_form: str) -> None:
    for d in started(config={"queues": {entry_form: {"maxStreams": 2}}}):
        a, b, c = acquire(d, SERVER, "A"), acquire(d, SERVER + "/v1/", "B"), acquire(d, SERVER + "/v1", "C")
        assert a.recv()["op"] == "granted" and b.recv()["op"] == "granted"  # two slots, from the entry
        assert c.silent(0.2)


def test_a_models_json_provider_with_v1_and_a_client_without_it_share_a_queue() -> None:
    """pi's catalog keys its providers' baseUrl with ``/v1``; a script names the bare server."""
    for d in started(models={"providers": {"llama": {"baseUrl": SERVER + "/v1", "models": []}}}):
        a = acquire(d, "llama", "A")
        assert a.recv()["op"] == "granted"
        b = acquire(d, SERVER, "B")
        assert b.silent(0.2) and d.waiting(SERVER) == ["B"]


def test_llmqueue_run_on_the_bare_server_holds_back_the_proxy_on_its_v1_url(
        stub: StubEndpoint, daemon: DaemonProc) -> None:
    """The issue's case: a ``run`` job held the slot, and a request through the proxy did not wait."""
    marker = os.path.join(daemon.agent_dir, "go")
    job = subprocess.Popen([sys.executable, MODULE, "run", "--agent-dir", daemon.agent_dir, "--queue", stub.base,
                            "--session", "job", "--", sys.executable, "-c",
                            f"import os, time\nwhile not os.path.exists({marker!r}): time.sleep(0.01)"],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: daemon.holders(stub.base) == ["job"], 10)
        p = RunningProxy(stub.url, daemon.agent_dir)  # the upstream as its OpenAI base URL
        try:
            done: List[int] = []
            t = threading.Thread(target=lambda: done.append(post(p.port, chat_body("hello"))[0]))
            t.start()
            wait_for(lambda: len(daemon.waiting(stub.base)) == 1)
            assert not done and not [r for r in stub.records if r["path"] != "/props"]  # it waits for the job
            open(marker, "w").close()
            t.join(30)
            assert done == [200]
            assert [r["path"] for r in stub.records if r["path"] != "/props"] == ["/v1/chat/completions"]
        finally:
            p.close()
    finally:
        open(marker, "w").close()
        assert job.wait(30) == 0, job.stderr.read() if job.stderr else ""
        if job.stderr:
            job.stderr.close()


# -- the proxy ------------------------------------------------------------------------------------


def chat_body(first: str, who: Optional[str] = None) -> bytes:
    """A conversation's opening request; ``who`` (the body's ``user``) names the stub's record and
    keys the proxy's session by it, else the conversation's fingerprint does."""
    body: Dict[str, Any] = {"model": "m", "stream": True,
                            "messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": first}]}
    if who is not None:
        body["user"] = who
    return json.dumps(body).encode()


def post(port: int, body: bytes, path: str = "/v1/chat/completions", headers: Optional[Dict[str, str]] = None,
         method: str = "POST") -> Tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body or None,
                     headers=dict({"Content-Type": "application/json"}, **(headers or {})))
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_an_upstream_given_as_its_v1_url_is_the_servers_root_plus_v1(stub: StubEndpoint, daemon: DaemonProc) -> None:
    """A path that names /v1 goes there once; the server's own paths (llama.cpp's, Ollama's,
    ``HEAD /``) go to its root; an OpenAI path sent without /v1 goes under it."""
    p = RunningProxy(stub.url, daemon.agent_dir, identity=(), slot_files=0)
    try:
        assert post(p.port, chat_body("hi"))[0] == 200
        assert post(p.port, b"", "/v1/models", method="GET")[0] == 200
        assert post(p.port, b"", "/health", method="GET")[0] == 200
        assert post(p.port, b"", "/props", method="GET")[0] == 200
        assert post(p.port, b"", "/", method="HEAD")[0] == 200
        assert post(p.port, chat_body("native"), "/completion")[0] == 200
        assert post(p.port, chat_body("ollama"), "/api/chat")[0] == 200
        assert post(p.port, chat_body("bare"), "/chat/completions")[0] == 200
    finally:
        p.close()
    paths = [r["path"] for r in stub.records]
    assert paths == ["/v1/chat/completions", "/v1/models", "/health", "/props", "/", "/completion", "/api/chat",
                     "/v1/chat/completions"], paths
    assert lq.Proxy.upstream_path(p.proxy, "/v1?x=1") == "/v1?x=1"


def test_requests_that_are_no_model_call_pass_straight_through_while_the_slot_is_held(
        stub: StubEndpoint, daemon: DaemonProc) -> None:
    """``HEAD /`` (Claude Code, before each run), the model list, health, props and token counting
    neither wait for the slot nor take one, nor count as a switch."""
    p = RunningProxy(stub.base, daemon.agent_dir, grace_ms=50)
    try:
        holder = threading.Thread(target=post, args=(p.port, chat_body("hold", "slow-H"), "/s/H/parent/v1/chat/completions"))
        holder.start()
        wait_for(lambda: stub.started("slow-H"))
        before = daemon.queue(stub.base)
        for method, path in [("HEAD", "/"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/props"),
                             ("POST", "/v1/messages/count_tokens")]:
            body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}' if method == "POST" else b""
            status, _ = post(p.port, body, path, {"X-Who": "counting"}, method=method)
            assert status == 200, (method, path)
            assert daemon.waiting(stub.base) == [] and daemon.holders(stub.base) == ["H"], (method, path)
        after = daemon.queue(stub.base)
        assert (after["switches"], after["grants"]) == (before["switches"], before["grants"])
        assert not stub.record("slow-H")["end"]  # all of it while H streamed
        stub.let_slow_finish()
        holder.join(30)
    finally:
        p.close()
    assert lq.model_call("POST", "/v1/chat/completions") and lq.model_call("POST", "/v1/messages?beta=true")
    assert lq.model_call("POST", "/v1/responses") and lq.model_call("POST", "/api/chat")
    assert not lq.model_call("GET", "/v1/chat/completions") and not lq.model_call("POST", "/tokenize")


def test_two_identical_conversations_with_nothing_named_never_share_a_grant(
        stub: StubEndpoint, daemon: DaemonProc) -> None:
    """Two runs of one prompt in one folder fingerprint alike: the second concurrent request is a
    session of its own, so it waits on a one-slot server instead of running beside the first."""
    p = RunningProxy(stub.base, daemon.agent_dir, grace_ms=50)
    try:
        body = chat_body("the same task")  # nothing named: the fingerprint keys both
        first = threading.Thread(target=post, args=(p.port, body, "/v1/chat/completions", {"X-Who": "slow-1"}))
        first.start()
        wait_for(lambda: stub.started("slow-1"))
        done: List[int] = []
        second = threading.Thread(target=lambda: done.append(
            post(p.port, body, "/v1/chat/completions", {"X-Who": "two"})[0]))
        second.start()
        wait_for(lambda: len(daemon.waiting(stub.base)) == 1)
        (holder,) = daemon.holders(stub.base)
        assert holder.startswith("conv:") and daemon.waiting(stub.base)[0] != holder
        assert not stub.started("two")  # not on the server beside the first
        stub.let_slow_finish()
        first.join(30)
        second.join(30)
        assert done == [200]
        one, two = stub.record("slow-1"), stub.record("two")
        assert one is not None and two is not None and one["end"] <= two["start"]
    finally:
        p.close()


def test_verbose_lines_carry_the_time_the_status_and_the_duration(stub: StubEndpoint, daemon: DaemonProc) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, MODULE, "proxy", "--agent-dir", daemon.agent_dir, "--upstream", stub.base,
                             "--listen", f"127.0.0.1:{port}", "--verbose"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def up() -> bool:
            try:
                return post(port, b"", "/health", method="GET")[0] == 200
            except OSError:
                return False

        wait_for(up, 10)
        assert post(port, chat_body("hi"))[0] == 200
        assert post(port, b"", "/v1/nothing-here", method="GET")[0] == 200  # the stub answers every GET
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    stamp = r"^\d\d:\d\d:\d\d\.\d{3} "
    assert re.search(stamp + r"POST /v1/chat/completions -> 200 in \d+\.\d\d s, session ", err, re.M), err
    assert re.search(stamp + r"GET /health -> 200 in \d+\.\d\d s, passed through", err, re.M), err


def test_a_taken_listen_address_is_named_with_the_flag_that_picks_another(daemon: DaemonProc) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run_cli("proxy", "--agent-dir", daemon.agent_dir, "--upstream", SERVER, "--listen", f"127.0.0.1:{port}")
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: the address is in use" in out.stderr, out.stderr
    assert "--listen" in out.stderr


# -- the command line -----------------------------------------------------------------------------


def test_help_lists_the_subcommands() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for name in ("proxy", "run", "status", "report", "check-config", "daemon"):
        assert re.search(rf"^  {name}\s+\S", out.stdout, re.M), (name, out.stdout)


@pytest.mark.parametrize("typo,meant", [("stauts", "status"), ("prxy", "proxy"), ("reprot", "report")])
def test_an_unknown_subcommand_gets_did_you_mean(typo: str, meant: str) -> None:
    out = run_cli(typo)
    assert out.returncode == 2
    assert f"unknown command '{typo}' (did you mean {meant}?)" in out.stderr, out.stderr


@pytest.mark.parametrize("command", ["daemon", "status", "run", "proxy", "report", "check-config"])
def test_every_subcommand_tells_its_version(command: str) -> None:
    out = run_cli(command, "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"llmqueue {lq.__version__}", out
    assert run_cli("--version").stdout.strip() == f"llmqueue {lq.__version__}"


def test_run_without_the_double_dash_shows_where_the_command_goes() -> None:
    out = run_cli("run", "--queue", SERVER, "echo", "hi")
    assert out.returncode == 2
    assert f"put the command after --: llmqueue run --queue {SERVER} -- echo hi" in out.stderr, out.stderr


def test_fail_closed_says_the_command_was_not_run_and_why_it_exits_75() -> None:
    d = short_tmpdir()
    blocker = os.path.join(d, "a-file")
    open(blocker, "w").close()
    marker = os.path.join(d, "ran")
    out = run_cli("run", "--agent-dir", os.path.join(blocker, "agent"), "--queue", SERVER, "--fail-closed",
                  "--", "touch", marker)
    assert out.returncode == 75 and not os.path.exists(marker)
    assert "the command was not run" in out.stderr and "75" in out.stderr, out.stderr
    # the agent dir that cannot be made is named, with the way out
    assert f"cannot create or write {os.path.join(blocker, 'agent')}" in out.stderr, out.stderr
    assert "--agent-dir" in out.stderr and "LLMQUEUE_DIR" in out.stderr


def test_llmqueue_dir_comes_before_pis_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PI_CODING_AGENT_DIR", "/pi/dir")
    monkeypatch.setenv("LLMQUEUE_DIR", "/lq/dir")
    assert lq.default_agent_dir() == "/lq/dir"
    monkeypatch.delenv("LLMQUEUE_DIR")
    assert lq.default_agent_dir() == "/pi/dir"
    monkeypatch.delenv("PI_CODING_AGENT_DIR")
    assert lq.default_agent_dir() == os.path.join(os.path.expanduser("~"), ".pi", "agent")


def test_a_daemon_found_through_llmqueue_dir_serves_the_cli() -> None:
    for d in started():
        env = dict(os.environ, LLMQUEUE_DIR=d.agent_dir, PI_CODING_AGENT_DIR="/nonexistent")
        out = run_cli("status", "--json", env=env)
        assert out.returncode == 0 and json.loads(out.stdout)["op"] == "status", out.stderr


# -- report ---------------------------------------------------------------------------------------


def test_report_with_no_log_says_how_to_turn_one_on() -> None:
    d = short_tmpdir()
    out = run_cli("report", "--agent-dir", d)
    assert out.returncode == 1
    assert "no event log" in out.stderr and "logFile" in out.stderr and "--log FILE" in out.stderr, out.stderr


def test_report_of_a_missing_file_names_the_path_and_the_setting() -> None:
    missing = os.path.join(short_tmpdir(), "gone.log")
    out = run_cli("report", missing)
    assert out.returncode == 1
    assert f"{missing}: no such file" in out.stderr and "logFile" in out.stderr, out.stderr


def test_proxy_log_makes_its_queue_report_ready_with_no_config_file(stub: StubEndpoint) -> None:
    agent_dir = short_tmpdir()
    log = os.path.join(agent_dir, "events.log")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, MODULE, "proxy", "--agent-dir", agent_dir, "--upstream", stub.base,
                             "--listen", f"127.0.0.1:{port}", "--log", log],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def answered() -> bool:
            try:
                return post(port, chat_body("hi"))[0] == 200
            except OSError:
                return False

        wait_for(answered, 10)
        assert not os.path.exists(os.path.join(agent_dir, "llm-queue.json"))
        wait_for(lambda: os.path.exists(log) and '"event":"grant"' in open(log).read(), 10)
        out = run_cli("report", "--agent-dir", agent_dir, "--json")  # no file named: the daemon's
        assert out.returncode == 0, out.stderr
        (queue,) = json.loads(out.stdout)["queues"].values()
        assert queue["grants"] >= 1
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
        sock = os.path.join(agent_dir, "llm-queue.sock")
        wait_for(lambda: not os.path.exists(sock), 10)  # the daemon it started exits with it
    assert "logs to" not in err, err


# -- what the one key per server leaves behind from before ---------------------------------------


def test_two_config_entries_for_one_server_warn_that_only_the_first_applies() -> None:
    _, errors, warnings = lq.validate_config({"queues": {SERVER: {"maxStreams": 2}, SERVER + "/v1": {"maxStreams": 1}}})
    assert errors == []
    assert warnings == [f"queues.{SERVER}/v1 names the same server as queues.{SERVER} ({SERVER}/v1): "
                        "only the first applies"]
    owner, policy = lq.Addressing(lq.validate_config({"queues": {SERVER: {"maxStreams": 2}}})[0]).address_endpoint(
        SERVER + "/v1/")
    assert (owner, policy.max_streams) == (SERVER + "/v1", 2)


def test_a_log_from_before_names_the_server_in_either_form_and_report_finds_it_by_either() -> None:
    events = [{"event": "grant", "queueKey": SERVER, "sessionKey": "A", "role": "parent", "seq": 1,
               "ts": "2026-12-01T10:00:00.000Z"},
              {"event": "release", "queueKey": SERVER, "sessionKey": "A", "role": "parent", "reason": "release",
               "ts": "2026-12-01T10:00:01.000Z"},
              {"event": "grant", "queueKey": SERVER + "/v1", "sessionKey": "B", "role": "parent", "seq": 2,
               "ts": "2026-12-06T10:00:00.000Z"},
              {"event": "release", "queueKey": SERVER + "/v1", "sessionKey": "B", "role": "parent",
               "reason": "release", "ts": "2026-12-06T10:00:01.000Z"}]
    path = os.path.join(short_tmpdir(), "old.log")
    with open(path, "w") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events))
    report = lq.build_report(lq.read_event_log([path]))
    assert list(report["queues"]) == [SERVER + "/v1"] and report["queues"][SERVER + "/v1"]["grants"] == 2
    for form in (SERVER, SERVER + "/v1/"):
        assert list(lq.build_report(lq.read_event_log([path]), queue=form)["queues"]) == [SERVER + "/v1"]
        assert "<svg" in lq.render_svg(lq.read_event_log([path]), queue=form)


def test_a_state_file_from_before_is_found_under_the_one_key() -> None:
    wall = time.time()
    raw = json.dumps({"version": 1, "affinity": {
        SERVER: {"kept": [0.1], "at": wall - 100},
        SERVER + "/v1": {"kept": [0.9, 0.95], "at": wall - 10}}}).encode()
    kept, at, _ = lq.decode_state(raw, wall)
    assert kept == {SERVER + "/v1": [0.9, 0.95]} and at == {SERVER + "/v1": wall - 10}  # the latest stands


def test_slot_files_keep_the_name_they_had_for_a_servers_root() -> None:
    import hashlib

    root = lq.SlotStore(SERVER).files.prefix
    assert root == lq.SlotStore(SERVER + "/v1/").files.prefix
    assert root == "llmqueue-" + hashlib.sha1(SERVER.encode()).hexdigest()[:10]  # the name files had


def test_a_config_that_says_fail_closed_holds_with_no_daemon_to_ask() -> None:
    """``failOpen: false`` in the config is read before any daemon answers: with none to be had,
    the command is not run (it used to be read only after a connection succeeded)."""
    d = short_tmpdir()
    with open(os.path.join(d, "llm-queue.json"), "w") as f:
        json.dump({"defaults": {"failOpen": False}}, f)
    marker = os.path.join(d, "ran")
    blocker = os.path.join(d, "a-file")
    open(blocker, "w").close()
    out = run_cli("run", "--agent-dir", d, "--socket", os.path.join(blocker, "s.sock"), "--queue", SERVER,
                  "--", "touch", marker)
    assert out.returncode == 75 and not os.path.exists(marker), out.stderr
    assert 'set "failOpen": true' in out.stderr, out.stderr


def test_a_client_warns_once_of_a_config_of_bad_json_that_its_daemon_cannot_show_it() -> None:
    d = short_tmpdir()
    with open(os.path.join(d, "llm-queue.json"), "w") as f:
        f.write('{"defaults": {"maxStreams": 2,}}')
    marker = os.path.join(d, "ran")
    out = run_cli("run", "--agent-dir", d, "--queue", SERVER, "--", "touch", marker)
    assert out.returncode == 0 and os.path.exists(marker), out.stderr
    assert out.stderr.count("not valid JSON") == 1 and "check-config" in out.stderr, out.stderr


def test_the_daemon_starts_without_importing_typing_or_argparse() -> None:
    """A cold start pays for what it imports (bench row 7): typing is for the checker, and the
    commands import argparse when they run."""
    code = ("import sys, llmqueue; print(sorted({'typing', 'argparse'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(lq.__file__)))
    assert out.stdout.strip() == "[]"


def test_the_modules_records_are_named_tuples_with_their_defaults_and_methods() -> None:
    """``class X(NamedTuple)`` is built without typing at run time: the fields, the defaults,
    ``_replace`` and the body's methods are all there."""
    policy = lq.QueuePolicy(max_streams=2)
    assert isinstance(policy, tuple) and policy.max_streams == 2
    assert policy.policy == "priority-aging" and policy.lease_ttl_ms == 30000  # the defaults
    assert policy._replace(max_streams=3).max_streams == 3
    terms = lq.LeaseTerms.of(policy)
    assert terms == (30000, 30000) and terms.grown(40000) == (40000, 30000)  # a classmethod, a method
    assert terms.refresh_period_ms() == 10000.0
    assert (lq.LeaseTerms.__doc__ or "").startswith("The TTL and the idle-yield window")
