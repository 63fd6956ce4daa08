#!/usr/bin/env python3
"""Old against new on a family of workloads, in the KV-cache simulator (issue 33).

    python3 bench/family.py                  # every workload, none / client / client-cost
    python3 bench/family.py --only cpu-pressure-heavy-3 --access none,client,client-cost,proxy,proxy-cost
    python3 bench/family.py --pattern interactive     # a person beside subagents, on the same family
    git show HEAD~1:llmqueue.py > /tmp/old.py
    python3 bench/family.py --old /tmp/old.py --access none,client-cost@old,client-cost
    python3 bench/family.py --slots 4 --access none,client,client-s4   # 4 slots, one KV; maxStreams 4

One table, one run: for each workload, the agents of ``bench/agents.py``'s *delegate* pattern
(a parent makes two requests, parks while its subagents run four requests each, answers once
more) straight to the server (``none``), through the queue on the rules in force (``client``,
``proxy``), and through the queue on issue 33's one rule for an idle slot (``client-cost``,
``proxy-cost``: ``holdRule: cost``).  Each run meets a fresh simulated server (``tests/kvsim.py``)
and a fresh daemon.  Every ratio is against ``none`` on the same workload, in the same run.

The family varies what one benchmark does not: the server's speed (a CPU's prefill, ~500
tokens/s, against a GPU's, 20,000), whether the host cache holds every agent's context (*fit*)
or about two of them (*pressure*), tool times (constant; heavy-tailed; now and then a long test
run), and one, three or six subagents.  The simulator's clock is the wall's: a run takes as long
as it would.  Standard library only, but for ``tests/kvsim.py`` beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Dict, List, NamedTuple, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import agents  # noqa: E402
from tests.kvsim import KVSim  # noqa: E402


class Server(NamedTuple):
    prefill_ms: float  # per prompt token
    decode_ms: float  # per generated token


SERVERS = {"cpu": Server(prefill_ms=2.0, decode_ms=20.0), "gpu": Server(prefill_ms=0.05, decode_ms=10.0)}
BASE = agents.Workload(system_tokens=300, task_tokens=20, reply_tokens=8, tool_tokens=60, tool_s=0.3,
                       children=3, child_requests=4, parent_before=2)
TOOLS: Dict[str, Dict[str, Any]] = {
    "const": {},
    "heavy": {"tool_dist": "heavy"},
    "long": {"tool_dist": "heavy", "long_tool_p": 0.1, "long_tool_s": 2.0},
}


class Case(NamedTuple):
    server: str
    cache: str  # fit / pressure
    tools: str
    children: int

    @property
    def name(self) -> str:
        return f"{self.server}-{self.cache}-{self.tools}-{self.children}"


FAMILY = [Case(*c) for c in (
    ("cpu", "fit", "const", 3), ("cpu", "pressure", "const", 3), ("cpu", "pressure", "heavy", 3),
    ("cpu", "pressure", "long", 3), ("cpu", "fit", "heavy", 3), ("cpu", "pressure", "const", 1),
    ("cpu", "pressure", "const", 6), ("cpu", "fit", "long", 6), ("gpu", "fit", "const", 3),
    ("gpu", "pressure", "const", 3), ("gpu", "pressure", "heavy", 6), ("gpu", "pressure", "long", 3),
)]


def run_case(case: Case, access: str, salt: str, pattern: str = "delegate", slots: int = 1) -> Dict[str, Any]:
    """One run of ``case`` through ``access``.  ``slots`` above 1: llama-server's default set-up,
    that many slots sharing one KV cache (``--kv-unified``), sized to run a request in every slot
    at once (smaller, the server refuses requests: the server alone would fail some), or to hold
    every agent's context where they fit; the host cache beside it as with one slot.  As
    llama-server does by default (``--cache-idle-slots``), each request's start moves the idle
    slots' contexts to the host cache, so the KV holds the running contexts and the host cache
    the others (about one of them under pressure).  A GPU decodes the slots' streams in shared
    steps (batched); a CPU does not gain from it here."""
    wl = BASE._replace(children=case.children, turns=5, think_s=1.5, limit_s=60.0, **TOOLS[case.tools])
    context = wl.context_tokens()
    host = context * (case.children + 2) * 2 if case.cache == "fit" else int(context * 1.2)
    unified = None if slots == 1 else max(slots * (context + wl.reply_tokens), host if case.cache == "fit" else 0)
    server = SERVERS[case.server]
    with KVSim(slots=slots, slot_ctx=4096, host_cache_tokens=host, prefill_ms=server.prefill_ms,
               decode_ms=server.decode_ms, unified_ctx=unified, batched_decode=case.server == "gpu") as sim:
        fig = agents.run_once(pattern, access, sim.url, wl, salt)
        fig["overlap"] = sim.max_overlap()  # the most requests the server ran at once
    fig.pop("request_log", None)
    return fig


def ratio(x: Optional[float], base: Optional[float]) -> str:
    return "-" if x is None or not base else f"{x / base:.2f}x"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--access", default="none,client,client-cost",
                    help="comma list of bench/agents.py accesses (default: none,client,client-cost)")
    ap.add_argument("--only", help="comma list of workload names (default: the whole family)")
    ap.add_argument("--salt", default="fam")
    ap.add_argument("--old", help="an earlier llmqueue.py: an access named ACCESS@old runs its daemon, proxy and "
                                  "Client from it (old against new, in one table, in one run)")
    ap.add_argument("--mid", help="a second earlier llmqueue.py (a step between --old and this one), for the "
                                  "accesses named ACCESS@mid")
    ap.add_argument("--pattern", choices=("delegate", "interactive"), default="delegate",
                    help="interactive: a person's five turns, 1.5 s of thought before each, beside subagents "
                         "running jobs of four requests; adds the person's first-token p50 and the "
                         "subagents' requests (default: delegate)")
    ap.add_argument("--slots", type=int, default=1,
                    help="the server's slots (default 1); above 1 they share one KV cache, and a GPU batches "
                         "their decode: add ACCESS-sN accesses to run the daemon with maxStreams N")
    args = ap.parse_args(argv)
    agents.OLD_MODULE, agents.MID_MODULE = args.old, args.mid
    accesses = args.access.split(",")
    cases = [c for c in FAMILY if not args.only or c.name in args.only.split(",")]
    person = args.pattern == "interactive"
    rows = [["workload", "access", "makespan s", "vs none", "prefill vs oracle", "dead %", "failed"]
            + (["person p50 s", "subagent requests"] if person else [])]
    summary: Dict[str, List[float]] = {a: [] for a in accesses}
    for case in cases:
        base: Optional[float] = None
        for access in accesses:
            fig = run_case(case, access, f"{args.salt}{case.name}", args.pattern, args.slots)
            makespan = fig["makespan_s"]
            if access == "none":
                base = makespan
            elif base:
                summary[access].append(makespan / base)
            dead = fig.get("dead_s")
            rows.append([case.name, access, f"{makespan:.2f}", ratio(makespan, base),
                         ratio(fig["prefill"], fig["oracle"]),
                         "-" if dead is None else f"{100 * dead / makespan:.0f}", str(fig["failed"])]
                        + ([f"{fig['parent_ttft_p50']:.2f}", str(fig["bg_requests"])] if person else []))
            print("  ".join(rows[-1]), file=sys.stderr, flush=True)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, r in enumerate(rows):
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))
    for access, xs in summary.items():
        if xs:
            print(f"{access}: makespan vs none, median {statistics.median(xs):.2f}x, worst {max(xs):.2f}x "
                  f"over {len(xs)} workloads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
