"""A parent with no person behind it (issue 13, "affinity that fits the server"): ``acquire``
with ``background: true`` (additive).

The proxy sends it for a conversation that names nothing (its fingerprint) while no person is in
sight, from its second request on (its opening request may be a person's first words): every
such agent is a parent then, and the contexts rule of tool-call gaps applied to children only.  On a warm queue that knows how many contexts the server keeps, each gap then went
to the next agent in turn, and each run evicted the context of the one after it.

A background parent keeps its tier (it goes before the children, FIFO among parents), but where
the contexts kept are bounded it is one of the children for the gap rule: a holder parked in a
tool-call gap keeps its slot rather than give it to one whose run would evict a context still
in use, and a waiting child or background parent whose context is kept goes first.  Whenever a
parent with a person behind it (one acquired without ``background``) waits, the order stands, as
before: a person never waits behind an idle slot.  An acquire without the field, for the same
waiter, clears it.  A child holder's beat replies say ``parentWaiting`` only for a person's
parent: a background one gets the slot at the child's gaps, as the contexts kept allow.
``status`` lists a background parent's waiter with ``background: true``.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Dict, Iterator, List, Optional

import pytest

import llmqueue as lq
from tests.harness import DaemonProc, short_tmpdir, started, wait_for
from tests.kvsim import KVSim
from tests.stub import StubEndpoint
from tests.test_contexts import LESSON, K, T0, granted, taught, teach
from tests.test_handover import client_of
from tests.test_person import chat, post
from tests.test_proxy import RunningProxy
from tests.test_proxy_hold import post as post_bytes

SOON = 1.0


def bg(s: lq.Scheduler, who: str, now: float, role: str = "parent", background: bool = True) -> List[lq.Event]:
    return s.acquire(who.lower(), K, who, role, now=now, background=background)


def kept_for_c(ms_per_token: Optional[float] = None) -> lq.Scheduler:
    """The lesson's queue (the server keeps two contexts: A's and C's), with background parents: C
    gave its slot to A in a tool-call gap (A's context is kept), then B queued (its run would
    evict C's context, in use)."""
    s = taught(ms_per_token)
    bg(s, "C", T0)
    bg(s, "A", T0)
    assert granted(s.park(K, "C", now=T0 + 10, gap=True)[1]) == ["A"]
    bg(s, "B", T0 + 20)
    return s


def waiting(s: lq.Scheduler, now: float) -> List[Dict[str, Any]]:
    (q,) = s.status(now=now)
    return list(q["waiting"])


# -- the pure core --------------------------------------------------------------------------------


def test_core_a_background_parent_waits_for_a_context_in_use_as_a_child_does() -> None:
    s = kept_for_c()
    assert s.park(K, "A", now=T0 + 30, gap=True) == (True, [])  # kept: B's run would evict C's
    assert waiting(s, T0 + 30) == [{"sessionKey": "B", "role": "parent", "group": None, "background": True}]
    assert granted(bg(s, "C", T0 + 500)) == ["C"]  # back from its tool call: its context is kept, it goes
    assert [w["sessionKey"] for w in waiting(s, T0 + 500)] == ["B"]


def test_core_a_background_parents_park_for_good_waits_for_a_context_in_use_as_a_childs_does() -> None:
    """A background parent's run ends (the proxy saw its answer say ``stop``: a park for good)
    while C is in a tool call and B waits, B's run evicting C's context.  As for a child's park
    for good, A's slot waits for C, and C's return takes it.  Before, a parent's park for good
    was never kept: B went, the server saved A's finished context and pushed C's out, and C
    prefilled its whole context again (the benchmark's proxy-anon runs, 1.77x the oracle)."""
    s = kept_for_c()
    assert s.park(K, "A", now=T0 + 30) == (True, [])  # for good: kept for C all the same
    back = bg(s, "C", T0 + 500)
    assert granted(back) == ["C"]
    assert [e.reason for e in back if isinstance(e, lq.Released)] == ["parked"]
    assert [w["sessionKey"] for w in waiting(s, T0 + 500)] == ["B"]
    # a server that prefills C's context in 5 s, past the tool calls (where it re-prefills it
    # sooner, the cost rule's bound lets B go once A's slot has idled that long)
    s = kept_for_c(ms_per_token=5.0)
    assert s.park(K, "A", now=T0 + 30) == (True, [])
    due = s.next_deadline()  # C not back once the queue's tool calls are over: B goes
    assert due is not None and T0 + 10 + lq.GRACE_MS < due <= T0 + 10 + lq.GRACE_MS + 2
    assert granted(s.sweep(now=due)) == ["B"]


def test_core_a_park_kept_for_a_context_in_use_with_no_end_in_sight_lets_the_waiter_go_once_it_aged() -> None:
    """The context A's slot is kept for is C's, a person's parent streaming on the spare stream:
    in use as long as C holds, with no time the sweep could look again at.  N, kept out, still
    goes once it has waited ``agingAfterMs`` (an aged waiter goes whatever it costs): nobody
    starves behind an idle slot.  Before, nothing looked again, and N waited for as long as C
    held (found by review: 300 s and more)."""
    s = taught(agingAfterMs=60_000, agingAfterSlots=3)
    s.acquire("k1", K, "K1", "child", now=T0)
    s.acquire("c", K, "C", "parent", now=T0 + 1, spare=True)  # a person's parent, beside K1
    bg(s, "A", T0 + 2)
    assert granted(s.release(K, "K1", now=T0 + 3)) == ["A"]
    assert s.park(K, "A", now=T0 + 10) == (True, [])  # for good: it waits on its subagent N
    assert granted(s.acquire("n", K, "N", "child", now=T0 + 20)) == []  # N's run would evict C's
    now, got = T0 + 20, []
    while not got and now < T0 + 300_000:  # the holders beat; the sweep runs at each deadline
        due = s.next_deadline()
        assert due is not None
        now = due
        for who in ("c", "a", "n"):
            s.renew(who, now=now)
        got = granted(s.sweep(now=now))
    assert got == ["N"] and now <= T0 + 20 + 60_000 + 1


def test_core_a_persons_parents_park_for_good_is_never_kept_for_a_context() -> None:
    s = taught()
    bg(s, "C", T0)
    bg(s, "A", T0, background=False)  # a person's parent holds
    assert granted(s.park(K, "C", now=T0 + 10, gap=True)[1]) == ["A"]
    bg(s, "B", T0 + 20)
    held, events = s.park(K, "A", now=T0 + 30)  # it waits on its subagents: they go
    assert not held and granted(events) == ["B"]


def test_core_without_background_a_parent_goes_first_whatever_its_run_evicts() -> None:
    s = taught()
    bg(s, "C", T0)
    bg(s, "A", T0)
    assert granted(s.park(K, "C", now=T0 + 10, gap=True)[1]) == ["A"]
    bg(s, "B", T0 + 20, background=False)  # a person's parent
    held, events = s.park(K, "A", now=T0 + 30, gap=True)
    assert not held and granted(events) == ["B"]


def test_core_a_person_queued_behind_a_background_parent_is_never_kept_waiting_for_a_context() -> None:
    s = kept_for_c()
    bg(s, "P", T0 + 25, background=False)  # a person, behind B
    held, events = s.park(K, "A", now=T0 + 30, gap=True)
    assert not held and granted(events) == ["B"]  # the order stands: B, then the person


def test_core_an_acquire_without_background_clears_it_for_the_waiter() -> None:
    s = kept_for_c()
    bg(s, "B", T0 + 25, background=False)  # B's own request again, a person's now
    assert waiting(s, T0 + 25) == [{"sessionKey": "B", "role": "parent", "group": None}]
    held, events = s.park(K, "A", now=T0 + 30, gap=True)
    assert not held and granted(events) == ["B"]
    s = kept_for_c()
    bg(s, "B", T0 + 25)  # said again: nothing changes
    assert s.park(K, "A", now=T0 + 30, gap=True) == (True, [])
    assert granted(bg(s, "B", T0 + 40, background=False)) == ["B"]  # A parked, kept for C: B goes now


def test_core_a_waiter_whose_context_is_kept_goes_before_a_background_parent_that_would_evict() -> None:
    for tier in ("parent", "child"):
        s = taught()
        bg(s, "A", T0)  # holds
        bg(s, "B", T0)  # first in line, but its context is gone: its run evicts C's
        bg(s, "C", T0 + 1, role=tier)  # kept, and in use: a background parent, or a child
        held, events = s.park(K, "A", now=T0 + 10, gap=True)
        assert not held and granted(events) == ["C"], tier
        assert [w["sessionKey"] for w in waiting(s, T0 + 10)] == ["B"]


def test_core_where_no_bound_is_known_or_switches_are_dear_a_background_parent_goes_as_any_parent() -> None:
    s = lq.Scheduler()
    for who, prefilled, reused in LESSON[:4]:  # kept returns only: cheap, no bound
        s.usage(K, who, prefilled, reused)
    bg(s, "A", T0)
    bg(s, "B", T0)
    held, events = s.park(K, "A", now=T0 + 10, gap=True)
    assert not held and granted(events) == ["B"]
    cfg, errors, _ = lq.validate_config({"defaults": {"switchCost": "dear"}})
    assert not errors
    s = lq.Scheduler(lq.Addressing(cfg))
    bg(s, "A", T0)
    bg(s, "B", T0)
    assert s.park(K, "A", now=T0 + 10)[1] and s.status(now=T0 + 10)[0]["holders"][0]["sessionKey"] == "B"


def test_core_a_background_parent_past_aging_goes_first_whatever_it_costs() -> None:
    cfg, errors, _ = lq.validate_config({"defaults": {"agingAfterMs": 500, "agingAfterSlots": 0}})
    assert not errors
    s = lq.Scheduler(lq.Addressing(cfg))
    for who, prefilled, reused in LESSON:
        s.usage(K, who, prefilled, reused)
    bg(s, "C", T0)
    bg(s, "A", T0)
    assert granted(s.park(K, "C", now=T0 + 10, gap=True)[1]) == ["A"]
    bg(s, "B", T0 + 20)
    assert s.park(K, "A", now=T0 + 30, gap=True) == (True, [])
    assert granted(s.acquire("d", K, "D", "child", now=T0 + 20 + 500)) == ["B"]  # B has waited 500 ms


# -- the wire -------------------------------------------------------------------------------------


def a_holds_c_in_a_tool_call_b_waits(d: DaemonProc, a_background: bool) -> Any:
    """Over the socket, the lesson taught: background parent C gave its slot to parent A in a
    tool-call gap (A's context is kept), then background parent B queued (its run would evict
    C's context, in use).  Returns the peers of C, A and B."""
    p, c, a, b = d.peer(), d.peer(), d.peer(), d.peer()
    teach(p)
    assert c.ask({"op": "acquire", "queueKey": K, "sessionKey": "C", "role": "parent",
                  "background": True})["op"] == "granted"
    a.send({"op": "acquire", "queueKey": K, "sessionKey": "A", "role": "parent", "background": a_background})
    wait_for(lambda: d.waiting(K) == ["A"])
    c.ask({"op": "renew", "queueKey": K, "sessionKey": "C", "parked": True, "gap": True})
    assert a.recv(SOON)["op"] == "granted"  # A's context is kept
    b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "role": "parent", "background": True})
    wait_for(lambda: d.waiting(K) == ["B"])
    return c, a, b


def test_over_the_socket_a_background_parent_is_kept_waiting_for_a_context_in_use_and_a_person_is_not() -> None:
    for d in started(config={"defaults": {"agingAfterMs": 0, "agingAfterSlots": 0}}):
        c, a, b = a_holds_c_in_a_tool_call_b_waits(d, a_background=True)
        assert d.queue(K)["waiting"] == [{"sessionKey": "B", "role": "parent", "group": None, "background": True}]
        reply = a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True, "gap": True})
        assert reply["granted"] is True  # kept: B's run would evict C's context, in use
        assert b.silent(0.3) and d.holders(K) == ["A"]
        b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "role": "parent"})  # a person's now
        assert b.recv(SOON)["op"] == "granted"
        assert d.holders(K) == ["B"]


@pytest.mark.parametrize("background", [True, False])
def test_over_the_socket_a_background_parents_park_for_good_is_kept_for_a_context_in_use(background: bool) -> None:
    """A (a parent) holds, C is in a tool call (its context kept and in use), B waits and its
    run would evict C's.  A's run ends: a park for good.  A background A keeps the slot for C,
    and C's return takes it; a person's A gives it to B at once."""
    for d in started(config={"defaults": {"agingAfterMs": 0, "agingAfterSlots": 0}}):
        c, a, b = a_holds_c_in_a_tool_call_b_waits(d, a_background=background)
        reply = a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True})
        if not background:
            assert reply["granted"] is False and b.recv(SOON)["op"] == "granted"
            continue
        assert reply["granted"] is True and b.silent(0.3) and d.holders(K) == ["A"]
        assert c.ask({"op": "acquire", "queueKey": K, "sessionKey": "C", "role": "parent",
                      "background": True})["op"] == "granted"
        assert d.holders(K) == ["C"] and d.waiting(K) == ["B"]


def test_over_the_socket_a_slot_kept_for_a_context_with_no_end_in_sight_goes_once_the_waiter_aged() -> None:
    """The core case above through the socket, with ``agingAfterMs`` 500: N, kept out for the
    context of C (a person's parent on the spare stream), is granted once it has waited 500 ms."""
    for d in started(config={"defaults": {"agingAfterMs": 500, "agingAfterSlots": 3}}):
        p, k1, c, a, n = (d.peer() for _ in range(5))
        teach(p)
        assert k1.ask({"op": "acquire", "queueKey": K, "sessionKey": "K1", "role": "child"})["op"] == "granted"
        assert c.ask({"op": "acquire", "queueKey": K, "sessionKey": "C", "role": "parent",
                      "spare": True})["op"] == "granted"
        a.send({"op": "acquire", "queueKey": K, "sessionKey": "A", "role": "parent", "background": True})
        wait_for(lambda: d.waiting(K) == ["A"])
        k1.ask({"op": "release", "queueKey": K, "sessionKey": "K1"})
        assert a.recv(SOON)["op"] == "granted"
        assert a.ask({"op": "renew", "queueKey": K, "sessionKey": "A", "parked": True})["granted"] is True
        n.send({"op": "acquire", "queueKey": K, "sessionKey": "N", "role": "child"})
        assert n.silent(0.2)  # kept out: its run would evict C's context
        assert n.recv(0.5 + 2.0)["op"] == "granted"  # aged: it goes whatever it costs


def test_a_bad_background_field_is_an_error_reply_that_changes_nothing() -> None:
    for d in started():
        a, b = d.peer(), d.peer()
        assert a.ask({"op": "acquire", "queueKey": K, "sessionKey": "A"})["op"] == "granted"
        for bad in ("yes", 1, [True], {}):
            reply = b.ask({"op": "acquire", "queueKey": K, "sessionKey": "B", "background": bad})
            assert reply["op"] == "error" and "background must be true or false" in reply["reason"]
        assert d.holders(K) == ["A"] and d.waiting(K) == []
        b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "background": False})
        wait_for(lambda: d.waiting(K) == ["B"])
        assert "background" not in d.queue(K)["waiting"][0]


def test_a_childs_beats_say_parent_waiting_only_for_a_persons_parent() -> None:
    for d in started(config={"defaults": {"agingAfterMs": 0, "agingAfterSlots": 0, "parentStreams": 0}}):
        c, b, p = d.peer(), d.peer(), d.peer()
        assert c.ask({"op": "acquire", "queueKey": K, "sessionKey": "C", "role": "child"})["op"] == "granted"
        b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "role": "parent", "background": True})
        wait_for(lambda: d.waiting(K) == ["B"])
        beat = {"op": "renew", "queueKey": K, "sessionKey": "C", "activity": True}
        assert "parentWaiting" not in c.ask(beat)
        p.send({"op": "acquire", "queueKey": K, "sessionKey": "P", "role": "parent"})
        wait_for(lambda: d.waiting(K) == ["B", "P"])
        assert c.ask(beat)["parentWaiting"] is True


# -- Client ---------------------------------------------------------------------------------------


def test_a_client_lease_and_a_session_say_background_on_every_acquire() -> None:
    for d in started():
        holder = d.peer()
        assert holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})["op"] == "granted"
        with client_of(d) as client:
            got: List[lq.Lease] = []
            t = threading.Thread(target=lambda: got.append(client.acquire(K, "B", background=True)))
            t.start()
            wait_for(lambda: d.waiting(K) == ["B"])
            assert d.queue(K)["waiting"][0].get("background") is True
            holder.ask({"op": "release", "queueKey": K, "sessionKey": "H"})
            t.join(5)
            (lease,) = got
            lease.release()
            assert holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})["op"] == "granted"
            session = client.session(K, "S")
            session.background = True
            t = threading.Thread(target=session.start)
            t.start()
            wait_for(lambda: d.waiting(K) == ["S"])
            assert d.queue(K)["waiting"][0].get("background") is True
            holder.ask({"op": "release", "queueKey": K, "sessionKey": "H"})
            t.join(5)
            lease = session.lease
            assert lease is not None and lease.background is True
            session.background = False  # said to the lease it holds too: its next acquire
            assert lease.background is False
            lease.release()
            assert holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})["op"] == "granted"
            t = threading.Thread(target=session.start)
            t.start()
            wait_for(lambda: d.waiting(K) == ["S"])
            assert "background" not in d.queue(K)["waiting"][0]
            holder.ask({"op": "release", "queueKey": K, "sessionKey": "H"})
            t.join(5)
            session.close()


# -- the proxy ------------------------------------------------------------------------------------


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    yield from started(config={"defaults": {"agingAfterSlots": 0, "agingAfterMs": 0, "parentStreams": 0}})


def queued_entry(stub: StubEndpoint, daemon: DaemonProc, before: List[Dict[str, Any]], body: Dict[str, Any],
                 headers: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Through the proxy: the ``before`` requests one after another, then a job's slow request
    holds the slot while ``body`` queues (sent with ``headers``): its entry in ``status``."""
    p = RunningProxy(stub.base, daemon.agent_dir, grace_ms=3000)
    try:
        for i, earlier in enumerate(before):
            post(p.port, earlier, f"E{i}")
        j = threading.Thread(target=post, args=(p.port, chat("job J"), "slow-J0"))
        j.start()
        wait_for(lambda: stub.started("slow-J0"))
        k = threading.Thread(target=post_bytes, args=(p.port, json.dumps(body).encode(), "K0"),
                             kwargs={"headers": headers or {}})
        k.start()
        wait_for(lambda: len(daemon.queue(stub.base).get("waiting", [])) == 1)
        (entry,) = daemon.queue(stub.base)["waiting"]
        stub.let_slow_finish()
        for t in (j, k):
            t.join(30)
        return dict(entry)
    finally:
        p.close()


def test_the_proxy_says_background_for_a_conversation_with_nothing_named_while_no_person_is_in_sight(
        stub: StubEndpoint, daemon: DaemonProc) -> None:
    entry = queued_entry(stub, daemon, [], chat("job K", "tool"))
    assert entry["role"] == "parent" and entry.get("background") is True


def test_the_proxy_never_says_background_for_a_conversations_opening_request(
        stub: StubEndpoint, daemon: DaemonProc) -> None:
    entry = queued_entry(stub, daemon, [], chat("job K"))  # it may be a person's first words
    assert entry["role"] == "parent" and "background" not in entry


def test_the_proxy_never_says_background_for_a_session_the_request_names(
        stub: StubEndpoint, daemon: DaemonProc) -> None:
    entry = queued_entry(stub, daemon, [], chat("job K", "tool"), {"X-Session-Id": "ses_named"})
    assert entry["role"] == "parent" and "background" not in entry  # a person may be behind it


def test_the_proxy_never_says_background_for_a_persons_turn(stub: StubEndpoint, daemon: DaemonProc) -> None:
    entry = queued_entry(stub, daemon, [chat("person"), chat("person", "person")],
                         chat("person", "person", "person"))
    assert entry["role"] == "parent" and "background" not in entry


# -- what it buys, in the KV-cache simulator ------------------------------------------------------


@pytest.mark.parametrize("answers", ["stop", "cut"])
def test_agents_with_nothing_named_on_a_warm_queue_prefill_less_than_the_server_alone(answers: str) -> None:
    """Three runs of the benchmark's delegate workload through the proxy, with nothing named, on
    one daemon.  The first teaches the queue a bound on the contexts the server keeps; the next
    ones rotate among that many.  When every such agent was a plain parent, the second and third
    prefilled 2.47x the oracle, past the server alone.  Now each stays below the server alone,
    and the third, on a bound learned, at most 1.5x (measured 1.35x).  The rest is each agent's
    opening request, which goes as any parent's (a person's first words look the same) and may
    evict a context in use.

    ``stop``: each job's last reply says ``stop``, as the benchmark's agents' answers do, so the
    proxy parks such an agent for good at its run's end.  That park kept nobody's slot (a
    parent's), so a waiter whose run evicted a context in a tool call went at once: the third
    run prefilled 1.58x.  ``cut`` (``--cut-answers``): no response says a run is over."""
    from tests.test_agents_sim import CONTEXT, PREFILL_MS, WORKLOAD, prefill_ratio, run_delegate
    import agents

    workload = WORKLOAD._replace(final_stop=answers == "stop")

    with KVSim(slots=1, slot_ctx=4096, host_cache_tokens=int(CONTEXT * 1.2), prefill_ms=PREFILL_MS, decode_ms=0.3) as alone:
        without = prefill_ratio(run_delegate(agents.Access(alone.url), workload=workload))
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        with KVSim(slots=1, slot_ctx=4096, host_cache_tokens=int(CONTEXT * 1.2), prefill_ms=PREFILL_MS,
                   decode_ms=0.3) as sim:
            client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
            proxy = lq.Proxy(sim.base, client=client, listen=("127.0.0.1", 0), grace_ms=1000)
            thread = threading.Thread(target=proxy.serve_forever, args=(0.02,), daemon=True)
            thread.start()
            try:
                ratios = [prefill_ratio(run_delegate(agents.ProxyAccess(sim.url, proxy.url, named=False), salt, workload))
                          for salt in ("first", "second", "third")]
            finally:
                proxy.shutdown()
                client.close()
        assert max(ratios[1:]) < without and ratios[2] <= 1.5, (ratios, without)
        assert d.status()[0]["affinity"]["contexts"] is not None  # it learned a bound


def test_a_request_continues_a_conversation_after_a_reply_of_the_model() -> None:
    assert not lq.continues(chat("job"))  # its opening: a person's first words look the same
    assert lq.continues(chat("job", "tool")) and lq.continues(chat("job", "person"))
    assert lq.continues({"model": "m", "input": "go on", "previous_response_id": "resp_1"})
    assert lq.continues({"model": "m", "input": [{"role": "user", "content": "go"},
                                                 {"type": "function_call", "name": "ls", "call_id": "c1"},
                                                 {"type": "function_call_output", "call_id": "c1", "output": "x"}]})
    assert not lq.continues({"model": "m", "input": [{"role": "user", "content": "go"}]})
    assert not lq.continues({"model": "m", "input": "go"}) and not lq.continues({"model": "m"})


def test_core_a_holder_between_two_requests_yields_to_a_background_parent_only_as_the_contexts_allow() -> None:
    """A ``handback`` holder (between two requests, not parked) gives a parent its slot where
    switches are cheap; to a background parent only where that evicts no context in use."""
    for background in (True, False):
        s = kept_for_c()
        if not background:
            bg(s, "B", T0 + 25, background=False)  # B's own request again, a person's now
        held, events = s.handback(K, "A", now=T0 + 30)
        if background:
            assert held and events == [], "B's run would evict C's context, in use"
        else:
            assert not held and granted(events) == ["B"]
