"""What the queue buys, pinned in token counts: the benchmark's agents (bench/agents.py) against
the KV-cache simulator (tests/kvsim.py), no real model server.

The *pressure* workload: one slot, and a host cache that holds about one more agent's context, so
that the slot and the host cache together hold about two of the four agents' contexts.  Pinned:
- without the queue, the subagents' requests interleave at the server and evict each other: the
  server prefills at least 2x the oracle (what a server that never evicts would prefill);
- through the queue no two requests are ever in the server at once (its own waiting line
  included);
- where switches are known to re-prefill (``switchCost: dear``), each subagent holds the slot
  through its tool calls (``Client`` sessions, and the proxy with named sessions): at most 1.3x
  the oracle;
- on the default config a fresh queue does not know that yet.  Its first holder gives way at its
  first tool call to find out, and the rotation shows how many contexts the server keeps (two),
  at the price of re-prefills: still less than the server alone.  The next run on the same
  queue, the same session names on new conversations, rotates among that many: at most 1.3x the
  oracle.  (Holding the slot 2 s before the first
  probe saved some of those re-prefills, but idled the slot for 12-29% of a run where every
  context fit: seconds matter more than tokens, and the bound is learned once.)
``Client`` sessions run on the default config and the default 3 s grace: a parent parked on its
subagents hands its slot over at once, and a settled subagent hands over to the next at once, so
the slot held while someone waited and nothing streamed (dead time, from the daemon's own event
log) stays under a second; under the seed's policy the parked parent alone kept the slot for its
30 s idle-yield window.  The proxy's 3 s grace is shortened here (a subagent's grace bridges its
tool calls, and would make the test wait).  Also pinned: the benchmark's own figures (the oracle,
dead time) on hand-made inputs.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any, Iterator, List

import pytest

import llmqueue as lq
from tests.harness import ROOT, DaemonProc, short_tmpdir, started, wait_for
from tests.kvsim import KVSim

sys.path.insert(0, os.path.join(ROOT, "bench"))
import agents  # noqa: E402

WORKLOAD = agents.Workload(system_tokens=300, task_tokens=20, reply_tokens=8, tool_tokens=60, tool_s=0.05,
                           children=3, child_requests=4, parent_before=2)
CONTEXT = WORKLOAD.context_tokens()


# A server slow enough that re-prefilling the contexts in use (about 0.2 s each) costs more than a
# run's tool calls idle the slot (0.05 s each): holding through them is then the right call in
# seconds too.  (On a faster one, the cost rule's bound hands a gap over once its price is spent.)
PREFILL_MS = 0.5


@pytest.fixture
def sim() -> Iterator[KVSim]:
    s = KVSim(slots=1, slot_ctx=4096, host_cache_tokens=int(CONTEXT * 1.2), prefill_ms=PREFILL_MS, decode_ms=0.3)
    yield s
    s.close()


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    log = os.path.join(short_tmpdir(), "events.log")
    yield from started(config={"defaults": {"logFile": log}})  # otherwise the default config


def overlaps(sim: KVSim) -> int:
    """The most requests the server had at once, counting its own waiting line."""
    with sim.lock:
        spans = [(r["arrived"], r["end"]) for r in sim.records if r["end"] is not None]
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = cur = 0
    for _, step in edges:
        cur += step
        most = max(most, cur)
    return most


def run_delegate(access: agents.Access, salt: str = "zuzzuz", workload: agents.Workload = WORKLOAD) -> agents.RunResult:
    result = agents.delegate(access, workload, salt=salt)
    access.close()
    assert all(r.ok for r in result.records), [r.error for r in result.records if not r.ok]
    assert len(result.records) == workload.parent_before + 1 + workload.children * workload.child_requests
    return result


def prefill_ratio(result: agents.RunResult) -> float:
    fig = agents.figures(result, None)
    assert fig["oracle"] > 0
    return float(fig["prefill"]) / fig["oracle"]


def test_without_the_queue_the_pressure_workload_prefills_at_least_twice_the_oracle(sim: KVSim) -> None:
    result = run_delegate(agents.Access(sim.url))
    assert prefill_ratio(result) >= 2.0
    assert overlaps(sim) >= 2  # the subagents' requests met at the server
    assert sim.totals()["prompt_n"] == agents.figures(result, None)["prefill"]  # the server's own count


def client_run(sim: KVSim, daemon: DaemonProc, salt: str = "zuzzuz") -> agents.RunResult:
    client = lq.Client(daemon.agent_dir, autostart=False, fail_open=False)
    try:
        return run_delegate(agents.ClientAccess(sim.url, client), salt)  # the default 3 s grace
    finally:
        client.close()


def test_where_switches_are_dear_client_sessions_prefill_at_most_1_3x_the_oracle(sim: KVSim) -> None:
    for d in started(config={"defaults": {"switchCost": "dear"}}):
        assert prefill_ratio(client_run(sim, d)) <= 1.3
        assert overlaps(sim) == 1


def test_a_fresh_queue_learns_how_many_contexts_fit_and_its_next_run_prefills_at_most_1_3x(
        sim: KVSim, daemon: DaemonProc) -> None:
    with KVSim(slots=1, slot_ctx=4096, host_cache_tokens=int(CONTEXT * 1.2), prefill_ms=PREFILL_MS, decode_ms=0.3) as alone:
        without = prefill_ratio(run_delegate(agents.Access(alone.url)))
    first = prefill_ratio(client_run(sim, daemon))
    assert first < without
    (q,) = daemon.status()
    assert q["affinity"]["contexts"] == 2  # the slot's, and the one more the host cache holds
    # New conversations, the same queue and the same session names: each agent's first prompt is
    # shorter than its last one, a new conversation and no eviction, so the lesson stands.
    # (Taken for evictions, they taught a bound of one context and dear switches: 1.35x.)
    second = prefill_ratio(client_run(sim, daemon, salt="another"))
    (q,) = daemon.status()
    assert q["affinity"]["contexts"] == 2 and q["affinity"]["switchCost"] == "cheap"
    assert second <= 1.3  # 1.19x: the parent's own context, evicted while three subagents ran
    assert overlaps(sim) == 1


def test_on_a_queue_that_knows_its_bound_a_subagent_whose_run_ends_waits_for_a_context_in_its_tool_call(
        sim: KVSim, daemon: DaemonProc) -> None:
    """The third run on one queue: where a subagent's run ends while another is in its tool call
    and the next waiter's run would evict that one's context, the slot waits for it (1.19x; given
    to the next waiter at once, the same runs prefill 1.85x, 1.42x, 1.42x)."""
    ratios = [prefill_ratio(client_run(sim, daemon, salt=f"warm{i}")) for i in range(3)]
    assert ratios[2] <= 1.3, ratios
    assert overlaps(sim) == 1


def test_client_sessions_never_overlap_and_dead_time_is_under_a_second(sim: KVSim, daemon: DaemonProc) -> None:
    result = client_run(sim, daemon)
    assert overlaps(sim) == 1
    with open(daemon.config_path) as f:
        log = json.load(f)["defaults"]["logFile"]
    events = wait_for(lambda: os.path.exists(log) and lq.read_event_log([log]))
    dead, _ = agents.dead_time(events, result.records)
    assert dead < 1.0, f"the slot was held {dead:.2f} s while someone waited and nothing streamed"
    # The daemon's own figure (the sessions say busy around each request) agrees with the
    # benchmark's (the agents' own request times against the log's holds and waits).
    reported = sum(q["deadMs"] for q in lq.build_report(events)["queues"].values()) / 1000.0
    assert abs(reported - dead) <= 0.25 + 0.25 * dead, (reported, dead)
    assert any(e["event"] == "release" and e.get("reason") == "parked" for e in events)


def run_delegate_through_proxy(sim: KVSim, daemon: DaemonProc, named: bool, grace_ms: int) -> agents.RunResult:
    client = lq.Client(daemon.agent_dir, autostart=False, fail_open=False)
    proxy = lq.Proxy(sim.base, client=client, listen=("127.0.0.1", 0), grace_ms=grace_ms)
    thread = threading.Thread(target=proxy.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        return run_delegate(agents.ProxyAccess(sim.url, proxy.url, named=named))
    finally:
        proxy.shutdown()
        client.close()


def test_where_switches_are_dear_the_proxy_with_named_sessions_prefills_at_most_1_3x_the_oracle(sim: KVSim) -> None:
    for d in started(config={"defaults": {"switchCost": "dear"}}):
        result = run_delegate_through_proxy(sim, d, named=True, grace_ms=100)
        assert prefill_ratio(result) <= 1.3
        assert overlaps(sim) == 1


def test_proxy_with_no_session_names_prefills_what_named_sessions_prefill(sim: KVSim, daemon: DaemonProc) -> None:
    """Issue 14: the agents name nothing; the proxy keys each by its conversation, and holds its
    slot across its tool calls.  On a fresh queue: at most 1.5x the oracle.  That is the parent's
    own context, evicted while its subagents run (1.19x, as named sessions where switches are
    dear, above), plus at most the one eviction that teaches the queue how many contexts the
    server keeps, as for ``Client`` sessions on a fresh queue (1.35x: whether it comes depends on
    how the subagents' first requests and tool calls interleave, so on the machine's load)."""
    result = run_delegate_through_proxy(sim, daemon, named=False, grace_ms=1000)
    assert prefill_ratio(result) <= 1.5
    assert overlaps(sim) == 1


def test_an_agents_answer_ends_its_turn_as_a_real_models_does_and_every_other_reply_is_cut(sim: KVSim) -> None:
    # A job's last reply and the parent's answer after its subagents carry a grammar, so the
    # server ends them ("stop"); every reply followed by a tool call is cut at max_tokens.
    def endings(workload: agents.Workload, salt: str) -> List[Any]:
        seen: List[Any] = []
        real = agents.stream_chat

        def spy(*args: Any, **kw: Any) -> agents.Reply:
            reply = real(*args, **kw)
            seen.append((kw.get("final", False), reply.finish))
            return reply

        agents.stream_chat = spy  # type: ignore[assignment]
        try:
            result = agents.delegate(agents.Access(sim.url), workload, salt=salt)
        finally:
            agents.stream_chat = real  # type: ignore[assignment]
        assert all(r.ok for r in result.records)
        return seen

    answered = endings(WORKLOAD, "zuzzuz")
    assert answered.count((True, "stop")) == WORKLOAD.children + 1  # each subagent's last, the parent's answer
    assert answered.count((False, "length")) == len(answered) - WORKLOAD.children - 1
    cut = endings(WORKLOAD._replace(final_stop=False), "cutcut")  # --cut-answers
    assert len(cut) == len(answered) and {finish for _, finish in cut} == {"length"}


# -- the benchmark's own figures -----------------------------------------------------------------


def rec(session: str, ask: float, end: float, prompt_n: int = 0, cache_n: int = 0, ok: bool = True,
        conversation: str = "", completion_n: int = 0) -> agents.Record:
    return agents.Record(session, session, conversation or session, "child", ask, ask, end, ok, 200 if ok else 500,
                         prompt_n if ok else None, cache_n if ok else None, "" if ok else "x", completion_n)


def test_the_oracle_is_each_conversations_first_prompt_plus_what_each_later_request_adds() -> None:
    records = [rec("a", 0, 1, prompt_n=100), rec("b", 1, 2, prompt_n=50),
               rec("a", 2, 3, prompt_n=130, cache_n=0, completion_n=8),  # re-prefilled: 130 in all, 30 new
               rec("a", 3, 4, prompt_n=10, cache_n=140),  # 150 in all: 20 new, 8 of them its own reply
               rec("b", 4, 5, ok=False)]  # a failed request adds nothing
    assert agents.oracle_prefill(records) == 100 + 50 + 30 + 12


def test_dead_time_is_a_hold_with_nothing_in_flight_while_someone_waits() -> None:
    t0 = 1_800_000_000.0

    def ev(t: float, event: str, session: str, **extra: Any) -> dict[str, Any]:
        return {"event": event, "queueKey": "q", "sessionKey": session, "role": "child", "t": t0 + t, **extra}

    events = [ev(0, "grant", "a"), ev(2, "queued", "b"), ev(6, "release", "a"),
              ev(6, "grant", "b"), ev(7, "release", "b")]
    # a streams 0-3 and 5-6: idle 3-5, and b waits 2-6: 2 s dead.  b streams its whole hold.
    records: List[agents.Record] = [rec("a", t0 + 0, t0 + 3), rec("a", t0 + 5, t0 + 6), rec("b", t0 + 6, t0 + 7)]
    total, per = agents.dead_time(events, records)
    assert total == pytest.approx(2.0)
    assert per == {"a": pytest.approx(2.0)}
    # Nobody waiting: an idle holder costs nothing.
    quiet = [ev(0, "grant", "a"), ev(6, "release", "a")]
    assert agents.dead_time(quiet, records[:2])[0] == 0.0
    # The proxy's own session keys are the agents whose token counts their usage events carry.
    counted = [rec("a", t0 + 0, t0 + 3, prompt_n=300), rec("a", t0 + 5, t0 + 6, prompt_n=20, cache_n=300),
               rec("b", t0 + 6, t0 + 7, prompt_n=250)]
    renamed = [dict(e, sessionKey="conv:1" if e["sessionKey"] == "a" else "conv:2") for e in events]
    renamed += [ev(3, "usage", "conv:1", prefilled=300, reused=0), ev(7, "usage", "conv:2", prefilled=250, reused=0)]
    assert agents.session_aliases(renamed, counted) == {"conv:1": "a", "conv:2": "b"}
    assert agents.dead_time(renamed, counted)[0] == pytest.approx(2.0)


def test_proxy_with_no_session_names_puts_a_persons_turns_ahead_of_the_background() -> None:
    """The interactive pattern with nothing named: once the person has answered the model in
    their own words (their second turn), each later turn is served next, so at most the one
    background request already at the server when they asked goes before it; and the person
    does not keep the slot while they think, so the background runs between their turns.  All
    parents, as before, the person queued behind every background job that asked first."""
    wl = WORKLOAD._replace(turns=5, think_s=1.5, limit_s=60.0)
    config = {"defaults": {"agingAfterSlots": 0, "agingAfterMs": 0, "parentStreams": 0}}
    for d in started(config=config):
        # requests of about 0.2 s: the background keeps a line at the server's one slot
        with KVSim(slots=1, slot_ctx=4096, prefill_ms=0.05, decode_ms=25) as sim:
            client = lq.Client(d.agent_dir, autostart=False, fail_open=False)
            proxy = lq.Proxy(sim.base, client=client, listen=("127.0.0.1", 0), grace_ms=1000)
            threading.Thread(target=proxy.serve_forever, args=(0.02,), daemon=True).start()
            try:
                access = agents.ProxyAccess(sim.url, proxy.url, named=False)
                result = agents.interactive(access, wl, salt="zuzzuz")
                access.close()
            finally:
                proxy.shutdown()
                client.close()
            assert overlaps(sim) == 1
        assert not result.limit_hit and all(r.ok for r in result.records)
        turns = sorted((r for r in result.records if r.role == "parent"), key=lambda r: r.ask)
        background = [r for r in result.records if r.role == "child"]
        assert len(turns) == wl.turns and len(background) >= wl.turns
        for turn, after in zip(turns[2:], turns[3:] + [None]):
            assert turn.first is not None
            before = [r for r in background if r.first is not None and turn.ask < r.first < turn.first]
            assert len(before) <= 1, (turn, before)
            if after is not None:  # while the person thought
                assert any(turn.end < r.first < after.ask for r in background if r.first is not None)


def test_repeated_rounds_take_each_ratio_against_the_none_of_their_own_round() -> None:
    """``--repeat``: a slow spell that slows one round's ``none`` and queued runs alike leaves
    that round's ratio alone; the medians table gives the median of the rounds' ratios."""
    rows: List[Any] = []
    for rnd, (none, queued) in enumerate([(10.0, 11.0), (20.0, 21.0), (11.0, 10.0)]):
        for access, makespan, dead in (("none", none, None), ("client", queued, queued / 10)):
            rows.append({"pattern": "delegate", "setup": "1slot-cache", "workload": "fit", "access": access,
                         "round": rnd, "makespan_s": makespan, "prefill": 120, "oracle": 100, "dead_s": dead,
                         "parent_ttft_p50": 0.5 if access == "none" else 1.0})
    (none_row, client) = agents.medians(rows)
    assert none_row["access"] == "none" and none_row["vs_none"] == 1.0 and none_row["dead_pct"] is None
    assert client["rounds"] == 3 and client["makespan_s"] == 11.0
    assert client["vs_none"] == pytest.approx(1.05)  # the median of 1.10, 1.05 and 0.91
    assert client["vs_none_range"] == pytest.approx((10 / 11, 1.1))
    assert client["vs_oracle"] == pytest.approx(1.2) and client["dead_pct"] == pytest.approx(10.0)
    assert client["parent_ratio"] == pytest.approx(2.0)
    assert "1.05x (0.91x-1.10x)" in agents.medians_table(rows)


def test_the_table_gives_the_subagents_requests_per_second_of_the_persons_turns() -> None:
    """The person's turns end sooner with the queue, so the subagents' count compares spans of
    different lengths: the table also gives their requests per second of the span, against
    ``none``'s of the same round."""
    rows: List[Any] = []
    for access, count, span in (("none", 24, 48.0), ("client", 12, 16.0)):
        rows.append({"pattern": "interactive", "setup": "1slot-cache", "workload": "pressure", "access": access,
                     "round": 0, "makespan_s": span, "prefill": 100, "oracle": 100, "reused": 0,
                     "dead_s": None if access == "none" else 1.0, "failed": 0, "limit_hit": False,
                     "parent_ttft_p50": 0.2, "parent_ttft_p95": 0.4, "child_ttft_p50": 0.5,
                     "parent_alone_p50": None, "bg_requests": count, "parent_span_s": span})
    lines = agents.table(rows).splitlines()
    assert lines[0].endswith("bg requests  bg per s")
    assert lines[2].endswith("24 (1.00x)   0.50 (1.00x)")
    assert lines[3].endswith("12 (0.50x)   0.75 (1.50x)")  # half the count, 1.5x the rate
