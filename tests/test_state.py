"""What a switch costs outlives the daemon (issue 13, item 4): the agent dir's state file.

A daemon exits as soon as its last client leaves (``daemonIdleExitMs: 0``), so without a memory
every session of agents would meet a daemon that does not know yet whether the server keeps
contexts, and would hold slots across tool calls until someone came back after a switch.  The
daemon writes each queue's latest returns (the share of their context sessions back on the slot
found kept) to ``llm-queue-state.json`` in the agent dir whenever one comes, atomically, and a
new daemon starts from it.  A queue last heard of more than a week ago is forgotten; a file that
is not what it should be is ignored; a state file that cannot be written costs nothing else.

Pinned through the socket (status, the usage reply), ``Client`` (a subagent of the next daemon
hands over at once), and the pure encode/decode.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Dict

import llmqueue as lq
from tests.harness import DaemonProc, short_tmpdir, wait_for
from tests.test_affinity import hand_over_delay, SOON
from tests.test_handover import client_of

K = "http://127.0.0.1:8001/v1"


def usage(session: str, prefilled: int, reused: int) -> Dict[str, Any]:
    return {"op": "usage", "queueKey": K, "sessionKey": session, "prefilled": prefilled, "reused": reused}


def learn(d: DaemonProc, kept: bool) -> None:
    p = d.peer()
    for session in ("A", "B"):
        assert p.ask(usage(session, 1000, 0))["op"] == "ok"
    for session in ("A", "B"):
        reply = p.ask(usage(session, *((10, 1000) if kept else (1010, 0))))  # evicted: all of it again
    assert reply["switchCost"] == ("cheap" if kept else "dear")


def state_of(agent_dir: str) -> Dict[str, Any]:
    with open(os.path.join(agent_dir, lq.STATE_FILE)) as f:
        state: Dict[str, Any] = json.load(f)
        return state


def test_a_new_daemon_knows_what_the_last_one_learned() -> None:
    agent_dir = short_tmpdir()
    try:
        with DaemonProc(agent_dir) as d:
            d.start()
            assert not os.path.exists(os.path.join(agent_dir, lq.STATE_FILE))  # nothing learned yet
            learn(d, kept=True)
            state = wait_for(lambda: os.path.exists(os.path.join(agent_dir, lq.STATE_FILE)) and state_of(agent_dir))
            assert state["affinity"][K]["kept"] == [1.0, 1.0]
            assert abs(state["affinity"][K]["at"] - time.time()) < 60
            assert oct(os.stat(os.path.join(agent_dir, lq.STATE_FILE)).st_mode & 0o777) == "0o600"
        with DaemonProc(agent_dir) as d:
            d.start()
            p = d.peer()
            assert p.ask({"op": "acquire", "queueKey": K, "sessionKey": "C"})["op"] == "granted"
            assert d.queue(K)["affinity"] == {"switchCost": "cheap", "returns": 0, "kept": 1.0}
            assert p.ask(usage("C", 500, 0))["switchCost"] == "cheap"  # its very first report
            # What it learns now goes on top: one eviction, and switches are dear (and saved so).
            p.ask(usage("D", 500, 0))
            assert p.ask(usage("C", 510, 0))["switchCost"] == "dear"  # its 500 and 10 more, all prefilled
            wait_for(lambda: state_of(agent_dir)["affinity"][K]["kept"] == [1.0, 1.0, 0.0])
        with DaemonProc(agent_dir) as d:
            d.start()
            assert d.peer().ask(usage("E", 5, 0))["switchCost"] == "dear"
    finally:
        shutil.rmtree(agent_dir, ignore_errors=True)


def test_a_subagent_of_the_next_daemon_hands_over_at_once_where_switches_were_cheap() -> None:
    agent_dir = short_tmpdir()
    try:
        with DaemonProc(agent_dir) as d:
            d.start()
            learn(d, kept=True)
            wait_for(lambda: os.path.exists(os.path.join(agent_dir, lq.STATE_FILE)))
        with DaemonProc(agent_dir) as d:
            d.start()
            with client_of(d) as client:
                client.status()
                client.usage(K, "parent", 1000, 0)  # the first report's reply says what was learned
                wait_for(lambda: client.switch_cost(K) == "cheap")
                assert hand_over_delay(d, client) < SOON  # not the 4 s grace of a first gap
    finally:
        shutil.rmtree(agent_dir, ignore_errors=True)


def test_a_state_file_that_is_not_what_it_should_be_is_ignored_and_then_replaced() -> None:
    now = time.time()
    for text in ("not json", "[1, 2]", json.dumps({"version": 2, "affinity": {K: {"kept": [1.0], "at": now}}}),
                 json.dumps({"version": 1, "affinity": {K: {"kept": [1.0, 1.0], "at": "yesterday"}}}),
                 json.dumps({"version": 1, "affinity": {K: {"kept": [2.0, True, "x"], "at": now}}}),
                 json.dumps({"version": 1, "affinity": {K: {"kept": [1.0, 1.0], "at": now - 8 * 86400}}}),
                 "\xff\xfe"):
        agent_dir = short_tmpdir()
        try:
            with open(os.path.join(agent_dir, lq.STATE_FILE), "w", encoding="latin-1") as f:
                f.write(text)
            with DaemonProc(agent_dir) as d:
                d.start()
                p = d.peer()
                assert p.ask(usage("A", 1000, 0))["switchCost"] == "unknown", text
                learn(d, kept=False)
                wait_for(lambda: state_of(agent_dir)["affinity"][K]["kept"] == [0.0, 0.0])
        finally:
            shutil.rmtree(agent_dir, ignore_errors=True)


def test_a_state_file_that_cannot_be_written_costs_nothing_else() -> None:
    agent_dir = short_tmpdir()
    try:
        os.mkdir(os.path.join(agent_dir, lq.STATE_FILE))  # a directory where the file would go
        with DaemonProc(agent_dir) as d:
            d.start()
            learn(d, kept=True)  # two returns: two writes tried
            p = d.peer()
            assert p.ask({"op": "acquire", "queueKey": K, "sessionKey": "A"})["op"] == "granted"
            assert d.queue(K)["affinity"]["switchCost"] == "cheap"
            assert d.stderr().count("cannot write") == 1, d.stderr()  # said once, not at every return
            assert not [n for n in os.listdir(agent_dir) if n.endswith(".tmp")]
    finally:
        shutil.rmtree(agent_dir, ignore_errors=True)


# -- pure ------------------------------------------------------------------------------------------


def test_the_state_round_trips_and_a_queue_too_old_or_from_the_future_is_dropped() -> None:
    now = 1_800_000_000.0
    data = lq.encode_state({"a": [1.0, 0.5], "b": [0.25]}, {"a": now - 10, "b": now - 8 * 86400})
    kept, at, depths = lq.decode_state(data, now)
    assert kept == {"a": [1.0, 0.5]} and at == {"a": now - 10} and depths == {"a": ([], None)}
    assert lq.decode_state(lq.encode_state({"a": [1.0]}, {"a": now + 3600}), now) == ({}, {}, {})
    many = lq.encode_state({"a": [1.0] * 3 + [0.0] * 3}, {"a": now})
    assert lq.decode_state(many, now)[0] == {"a": [1.0, 0.0, 0.0, 0.0]}  # the latest KEPT_SAMPLES


def test_what_a_daemon_learns_itself_outweighs_what_it_was_seeded_with() -> None:
    s = lq.Scheduler()
    s.seed_affinity({K: [1.0, 1.0, 1.0, 1.0]})
    assert s.usage(K, "A", 1000, 0).switch_cost == "cheap"
    s.usage(K, "B", 1000, 0)
    assert s.usage(K, "A", 1010, 0).switch_cost == "dear"  # its own eviction, newer than the seed
    assert s.affinity_kept() == {K: [1.0, 1.0, 1.0, 0.0]}


def test_the_tokens_the_server_keeps_outlive_the_daemon() -> None:
    """Issue 33: what the server keeps, learned in tokens from the returns, is in the state file,
    and the next daemon prices a switch by it before anyone comes back (the cost rule's price: the
    rules in force are bounded by the most a switch can cost, whatever was kept)."""
    agent_dir = short_tmpdir()
    try:
        with DaemonProc(agent_dir) as d:
            d.start()
            # A (1,000) back after B (1,000); B back after A (now 1,010): each time the host cache
            # kept the one that came back beside the slot's, so it keeps 1,000 tokens at least
            learn(d, kept=True)
            wait_for(lambda: os.path.exists(os.path.join(agent_dir, lq.STATE_FILE))
                     and state_of(agent_dir)["affinity"][K].get("hostRoom") == 1000)
        log = os.path.join(agent_dir, "events.log")
        with DaemonProc(agent_dir, config={"defaults": {"holdRule": "cost", "logFile": log}}) as d:
            d.start()
            a, w = d.peer(), d.peer()
            assert a.ask({"op": "acquire", "queueKey": K, "sessionKey": "A", "activity": True})["op"] == "granted"
            assert a.ask(usage("A", 500, 0))["op"] == "ok"
            assert a.ask({"op": "usage", "queueKey": K, "sessionKey": "W", "prefilled": 500, "reused": 0})["op"] == "ok"
            assert a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "busy": False})["busy"] is False
            w.send({"op": "acquire", "queueKey": K, "sessionKey": "W"})
            assert w.recv(5.0)["op"] == "granted"
            # W's context in the slot and A's (500) in the 1,000 the host cache kept: the switch is
            # free, so at once
            (release,) = wait_for(lambda: [e for e in lq.read_event_log([log])
                                           if e["event"] == "release" and e["sessionKey"] == "A"])
            assert release["switchTokens"] == 0 and release["rule"] == "hand over", release
            assert release["idleMs"] < 1000, release  # not the 1 s A's 500 tokens cost at the assumed rate
    finally:
        shutil.rmtree(agent_dir, ignore_errors=True)


def test_the_tokens_kept_round_trip_and_a_bad_entry_is_left_out() -> None:
    now = 1_800_000_000.0
    data = lq.encode_state({"a": [1.0], "b": [0.0], "c": [1.0]}, {"a": now, "b": now, "c": now},
                           rooms={"a": (3000, None), "b": (None, 5000), "c": (None, None)})
    assert lq.decode_rooms(data, now) == {"a": (3000, None), "b": (None, 5000)}
    bad = json.dumps({"version": 1, "affinity": {
        "a": {"kept": [1.0], "at": now, "hostRoom": "many"},
        "b": {"kept": [1.0], "at": now, "hostRoom": 5000, "hostRoomCap": 4000},  # bounds that disagree
        "c": {"kept": [1.0], "at": now - 8 * 86400, "hostRoom": 100},  # too old
        "d": {"kept": [1.0], "at": now, "hostRoomCap": 100},
        # an older daemon's room counted the slot's context too: not read, learned afresh
        "e": {"kept": [1.0], "at": now, "room": 3000, "roomCap": 4000}}}).encode()
    assert lq.decode_rooms(bad, now) == {"d": (None, 100)}
    assert lq.decode_rooms(b"\xff", now) == {} and lq.decode_rooms(b"[]", now) == {}
