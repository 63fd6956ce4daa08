"""Issue 33, old against new in the simulator, as token counts (the slow suite): the agents of
``bench/agents.py``'s delegate pattern under pressure (the host cache holds about one of their
contexts beside the slot's), straight to the server, through the rules in force, and through the
one cost rule (``holdRule: cost``), each on a fresh simulated server and a fresh daemon.

The figures asserted are the server's own prefill counts, with generous margins: the hand-over
times follow the wall clock, so a loaded machine moves them a little.  Speed is the
benchmark's (``bench/family.py``), not a test's.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))

import family  # noqa: E402


def run(case: family.Case, access: str) -> Dict[str, Any]:
    fig = family.run_case(case, access, f"ci{case.name}")
    assert fig["failed"] == 0, (access, fig)
    return fig


@pytest.mark.slow
def test_under_pressure_the_queue_prefills_less_than_the_server_alone_and_the_cost_rule_least() -> None:
    case = family.Case("cpu", "pressure", "const", 3)
    none, rules, cost = (run(case, a) for a in ("none", "client", "client-cost"))
    # the same conversations: the oracle (what a server that never evicts prefills) is one figure
    assert none["oracle"] == rules["oracle"] == cost["oracle"]
    # the server alone re-prefills about every context at every request (2.5x the oracle here)
    assert none["prefill"] >= 2 * none["oracle"]
    # the rules in force hand the slot over at every gap: about 1.6x the oracle
    assert rules["prefill"] <= 0.8 * none["prefill"]
    # the cost rule pays a re-prefill only where the idle time spent has reached it: about 1.2x
    assert cost["prefill"] <= 1.45 * cost["oracle"]
    assert cost["prefill"] <= 1.1 * rules["prefill"]  # (1.19x against 1.58x measured: a wide margin)
    # and so does a daemon that served these agents before and knows what the server keeps (1.19x;
    # while every waiter's wait counted, two waiters spent a switch's price twice as fast: 1.81x)
    warm = run(case, "client-warm-cost")
    assert warm["oracle"] == cost["oracle"] and warm["prefill"] <= 1.45 * warm["oracle"]


@pytest.mark.slow
def test_where_every_context_fits_nothing_is_prefilled_twice_whoever_decides() -> None:
    case = family.Case("cpu", "fit", "const", 3)
    for access in ("none", "client", "client-cost", "client-warm-cost"):
        fig = run(case, access)
        assert fig["prefill"] <= 1.05 * fig["oracle"], (access, fig)


@pytest.mark.slow
def test_on_four_slots_sharing_a_kv_the_daemons_max_streams_sets_how_many_requests_run_at_once() -> None:
    # llama-server's default set-up at GPU speed (``--slots 4``): the server alone runs the
    # subagents' requests side by side, a daemon at the default maxStreams 1 one at a time, and
    # one named ``client-s4`` (maxStreams 4) side by side again.
    case = family.Case("gpu", "fit", "const", 3)
    overlap = {}
    for access in ("none", "client", "client-s4"):
        fig = family.run_case(case, access, f"ci4{case.name}", slots=4)
        overlap[access] = fig["overlap"]
        assert fig["failed"] == 0 and fig["requests"] == 3 + 3 * 4, (access, fig)
    assert overlap["client"] == 1
    assert overlap["none"] >= 2 and overlap["client-s4"] >= 2
