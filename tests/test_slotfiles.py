"""llama.cpp's slot files at a switch (issue 13, item 4): no context is prefilled twice.

Where the model server is a one-slot llama-server started with ``--slot-save-path``, the client
side (``SlotStore``, used by ``Session`` and the proxy) saves the slot's context to a file right
before another session's request runs on it, and restores a session's own file right before its
request after a switch.  The store finds out by itself: ``GET /props`` (one slot), then a save
(a 501 means no slot files); anything else turns it off, and it never fails a request.  Where it
works, a switch costs milliseconds, so a subagent hands its slot over at every tool call to a
waiter, as where the server keeps contexts itself.

Pinned: the file ring (pure), the store against the KV-cache simulator (which models the slots
API), a server without slot files, with two slots, or gone, a failed restore, and the effect on
prefilled tokens and dead time of the benchmark's delegate workload through the proxy and
through ``Client`` sessions.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import urllib.request
from typing import Any, Dict, Iterator, List

import pytest

import llmqueue as lq
from tests.harness import ROOT, DaemonProc, short_tmpdir, started, wait_for
from tests.kvsim import KVSim

sys.path.insert(0, os.path.join(ROOT, "bench"))
import agents  # noqa: E402

# -- the file ring (pure) --------------------------------------------------------------------------


def test_each_session_keeps_its_own_file_and_the_least_recently_used_gives_its_up() -> None:
    ring = lq.SlotFiles("p", capacity=2)
    a = ring.name_for("a")
    b = ring.name_for("b")
    assert {a, b} == {"p-0.bin", "p-1.bin"}
    assert ring.name_for("a") == a  # saved again: the same file
    assert ring.saved("a") == a and ring.saved("b") == b
    ring.saved("a")  # a used last: b is the least recent
    c = ring.name_for("c")
    assert c == b and ring.saved("b") is None and ring.saved("c") == c


def test_the_file_about_to_be_restored_is_never_the_one_given_away() -> None:
    ring = lq.SlotFiles("p", capacity=2)
    ring.name_for("a")
    ring.name_for("b")
    ring.saved("b")  # a is the least recent, but a is the one coming back
    name = ring.name_for("c", keep="a")
    assert ring.saved("a") is not None and ring.saved("b") is None and name != ring.saved("a")
    ring.forget("a")
    assert ring.saved("a") is None


# -- the store against the simulator -----------------------------------------------------------------


@pytest.fixture
def logged() -> Iterator[DaemonProc]:
    log = os.path.join(short_tmpdir(), "events.log")
    yield from started(config={"defaults": {"logFile": log}})



def chat(sim: KVSim, words: List[str]) -> Dict[str, Any]:
    body = json.dumps({"messages": [{"role": "user", "content": " ".join(words)}], "max_tokens": 4}).encode()
    req = urllib.request.Request(sim.url + "/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        timings: Dict[str, Any] = json.loads(r.read())["timings"]
        return timings


A = [f"a{i}" for i in range(200)]
B = [f"b{i}" for i in range(300)]


def test_a_session_back_after_a_switch_finds_its_whole_context() -> None:
    with KVSim(slots=1, slot_files=True) as sim:
        store = lq.SlotStore(sim.url)
        store.switch_to("a")
        assert store.active  # one slot, and a save works
        assert chat(sim, A)["prompt_n"] == 201  # <|user|> and the words
        store.switch_to("b")  # a's context is saved before b's request evicts it
        assert chat(sim, B)["prompt_n"] == 300  # the shared <|user|> is reused
        store.switch_to("a")  # b's saved, a's restored
        again = chat(sim, A + ["more"])
        assert again["cache_n"] >= 201 and again["prompt_n"] <= 6, again  # the reply and "more"
        store.switch_to("a")  # no switch: nothing to do
        with sim.lock:
            actions = list(sim.slot_actions)
        assert [act for act, _, _ in actions] == ["save", "save", "save", "restore"]  # the probe's first
        (_, probe, empty), (_, a_file, a_n), (_, b_file, b_n), (_, back, back_n) = actions
        assert empty == 0 and a_n > 201 and b_n > 301 and (back, back_n) == (a_file, a_n)
        assert len({probe, a_file, b_file}) == 3
        assert (store.saves, store.restores, store.failures) == (2, 1, 0)


def test_a_context_nobody_can_claim_back_is_never_saved_but_the_one_it_evicts_is() -> None:
    with KVSim(slots=1, slot_files=True) as sim:
        store = lq.SlotStore(sim.url)
        store.switch_to("a")
        chat(sim, A)
        store.switch_to(None)  # a session of its own: a's context is saved before it runs
        chat(sim, B)
        store.switch_to("a")  # the slot holds the anonymous context: not saved; a's restored
        again = chat(sim, A + ["more"])
        assert again["cache_n"] >= 201, again
        with sim.lock:
            actions = [act for act, _, _ in sim.slot_actions]
        assert actions == ["save", "save", "restore"]  # the probe's, a's, a's back


def test_the_proxy_never_saves_a_request_that_named_no_session(logged: DaemonProc) -> None:
    with KVSim(slots=1, slot_files=True) as sim:
        client = lq.Client(logged.agent_dir, autostart=False, fail_open=False)
        proxy = lq.Proxy(sim.base, client=client, listen=("127.0.0.1", 0), identity=())
        threading.Thread(target=proxy.serve_forever, args=(0.02,), daemon=True).start()
        try:
            named = agents.stream_chat(proxy.url + "/s/a/child/v1", [{"role": "user", "content": " ".join(A)}], 4)
            anon = agents.stream_chat(proxy.url + "/v1", [{"role": "user", "content": " ".join(B)}], 4)
            back = agents.stream_chat(proxy.url + "/s/a/child/v1", [{"role": "user", "content": " ".join(A)},
                                                                   {"role": "assistant", "content": named.text}], 4)
        finally:
            proxy.shutdown()
            client.close()
        assert named.ok and anon.ok and back.ok
        assert back.cache_n is not None and back.cache_n >= 201, back  # a's context, restored
        with sim.lock:
            actions = [act for act, _, _ in sim.slot_actions]
        assert actions == ["save", "save", "restore"]  # the probe's, a's before the anonymous one, a's back


def test_without_slot_files_the_store_turns_itself_off_after_one_look() -> None:
    with KVSim(slots=1) as sim:
        store = lq.SlotStore(sim.url)
        for who in ("a", "b", "a"):
            store.switch_to(who)
            chat(sim, A if who == "a" else B)
        assert not store.active and store.saves == 0
        assert not store.cheap_within(10.0)


def test_a_server_with_more_than_one_slot_is_left_alone() -> None:
    with KVSim(slots=2, slot_files=True) as sim:
        store = lq.SlotStore(sim.url)
        for who in ("a", "b", "a"):
            store.switch_to(who)
        assert not store.active
        with sim.lock:
            assert sim.slot_actions == []  # not even the probe's save


def test_a_server_that_is_gone_or_not_llama_cpp_costs_a_switch_nothing() -> None:
    store = lq.SlotStore("http://127.0.0.1:9/v1", timeout=2.0)  # nothing listens on port 9
    store.switch_to("a")
    store.switch_to("b")
    assert not store.active
    with pytest.raises(ValueError):
        lq.SlotStore("unix:///nowhere")


def test_a_failed_restore_costs_the_request_nothing_but_its_prefill() -> None:
    with KVSim(slots=1, slot_files=True) as sim:
        store = lq.SlotStore(sim.url)
        store.switch_to("a")
        chat(sim, A)
        store.switch_to("b")
        chat(sim, B)
        with sim._cv:
            sim._files.clear()  # the server's disk lost the files
        store.switch_to("a")
        assert store.failures == 1
        again = chat(sim, A)
        assert again["prompt_n"] >= 199  # prefilled, as without the store
        store.switch_to("b")  # a saved again, b (saved at the failed switch) restored
        store.switch_to("a")
        assert (store.restores, store.failures) == (2, 1)  # both came back


def test_the_proxy_takes_a_count_of_files_and_refuses_anything_else() -> None:
    import subprocess

    client = lq.Client(short_tmpdir(), autostart=False)
    try:
        for bad in (True, -1, 1.5):
            with pytest.raises(ValueError):
                lq.Proxy("http://127.0.0.1:9", client=client, listen=("127.0.0.1", 0), slot_files=bad)  # type: ignore[arg-type]
        off = lq.Proxy("http://127.0.0.1:9", client=client, listen=("127.0.0.1", 0), slot_files=0)
        assert off.slots is None
        off.server.server_close()  # never served: shutdown() would wait for serve_forever
        two = lq.Proxy("http://127.0.0.1:9", client=client, listen=("127.0.0.1", 0), slot_files=2)
        assert two.slots is not None and two.slots.files.capacity == 2
        two.server.server_close()
    finally:
        client.close()
    cli = subprocess.run([sys.executable, os.path.join(ROOT, "llmqueue.py"), "proxy", "--upstream",
                          "http://127.0.0.1:9", "--slot-files", "-1"], capture_output=True, text=True, timeout=30)
    assert cli.returncode == 2 and "--slot-files" in cli.stderr


def test_a_switch_is_worth_it_only_when_a_save_and_restore_fit_the_gap_with_room() -> None:
    with KVSim(slots=1, slot_files=True) as sim:
        store = lq.SlotStore(sim.url)
        store.switch_to("a")
        store.switch_to("b")
        assert store.cheap_within(4 * store.switch_s + 0.001)
        store.switch_s = 1.0  # as a big context on a slow disk
        assert not store.cheap_within(2.0) and store.cheap_within(4.0)


# -- what it buys: the benchmark's delegate workload, no host cache ---------------------------------

WORKLOAD = agents.Workload(system_tokens=300, task_tokens=20, reply_tokens=8, tool_tokens=60, tool_s=0.3,
                           children=3, child_requests=3, parent_before=2)


def figures(d: DaemonProc, result: agents.RunResult) -> Dict[str, float]:
    assert all(r.ok for r in result.records), [r.error for r in result.records if not r.ok]
    with open(d.config_path) as f:
        log = json.load(f)["defaults"]["logFile"]
    events = wait_for(lambda: os.path.exists(log) and lq.read_event_log([log]))
    fig = agents.figures(result, None)
    dead, _ = agents.dead_time(events, result.records)
    return {"ratio": fig["prefill"] / fig["oracle"], "dead": dead}


def delegate_through_proxy(d: DaemonProc, slot_files: bool) -> Dict[str, float]:
    with KVSim(slots=1, host_cache_tokens=0, prefill_ms=0.05, decode_ms=0.3, slot_files=slot_files) as sim:
        client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
        proxy = lq.Proxy(sim.base, client=client, listen=("127.0.0.1", 0))  # the default grace
        threading.Thread(target=proxy.serve_forever, args=(0.02,), daemon=True).start()
        try:
            access = agents.ProxyAccess(sim.url, proxy.url, named=True)
            result = agents.delegate(access, WORKLOAD, salt="zuzzuz")
        finally:
            proxy.shutdown()
            client.close()
        assert proxy.slots is not None and proxy.slots.active is slot_files
        return figures(d, result)


def delegate_through_client(d: DaemonProc, slot_files: bool, prefill_ms: float = 0.05) -> Dict[str, float]:
    with KVSim(slots=1, host_cache_tokens=0, prefill_ms=prefill_ms, decode_ms=0.3, slot_files=slot_files) as sim:
        client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
        try:
            access = agents.ClientAccess(sim.url, client)
            result = agents.delegate(access, WORKLOAD, salt="zuzzuz")
            access.close()
        finally:
            client.close()
        return figures(d, result)


def test_sim_through_the_proxy_slot_files_keep_every_context_and_nobody_stands_behind_a_tool_call(
        logged: DaemonProc) -> None:
    got = delegate_through_proxy(logged, slot_files=True)
    assert got["ratio"] <= 1.05, got  # the parent came back to its own context, restored
    # 6 tool calls of 0.3 s with others waiting: held across them, that is 1.8 s or more.
    assert got["dead"] < 0.6, got


def test_sim_through_the_proxy_without_slot_files_the_parent_prefills_again(logged: DaemonProc) -> None:
    got = delegate_through_proxy(logged, slot_files=False)
    assert got["ratio"] >= 1.1, got  # what the store saves: the parent's re-prefill


def test_sim_through_client_sessions_slot_files_keep_every_context_and_nobody_stands_behind_a_tool_call(
        logged: DaemonProc) -> None:
    got = delegate_through_client(logged, slot_files=True)
    assert got["ratio"] <= 1.05, got
    assert got["dead"] < 0.6, got


def test_sim_through_client_sessions_without_slot_files_the_parent_prefills_again(logged: DaemonProc) -> None:
    # a CPU's prefill (2 ms a token): a switch would cost a context's re-prefill, more than the tool
    # calls it saves (at a GPU's, the cost rule's bound hands the gaps over instead)
    got = delegate_through_client(logged, slot_files=False, prefill_ms=2.0)
    assert got["ratio"] >= 1.1, got
    assert got["dead"] >= 0.8, got  # held across 4 tool calls of 0.3 s: a switch would cost a prefill
