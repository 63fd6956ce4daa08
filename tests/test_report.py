"""``llmqueue report``: figures and a timeline picture from the event log.

A hand-made log whose answers are worked out by hand pins every figure (grants, switches and
switches per hour, time held per tier and per session, waits p50/p95/max per tier, abandoned
waits, idle yields, TTL evictions, over-capacity reloads, utilisation); the reader tolerates a
torn last line, unknown events and rotated files given together; ``--since``/``--until``/
``--queue`` cut the window.  A log written by a real daemon under a scripted workload gives the
figures the workload implies.  The SVG is well-formed XML with one bar per hold in a small case,
its markers where the log puts them, and a bounded size for thousands of holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Any

import pytest

import llmqueue as lq
from tests.harness import MODULE, short_tmpdir, started, wait_for

BASE = 1_790_000_000.0  # 2026-09-21T...Z, a whole second
Q, Q2 = "http://gpu:8001/v1", "zen"


def ts(offset: float) -> str:
    return lq._iso_utc(BASE + offset)


def line(offset: float, event: str, queue: str = Q, **fields: Any) -> str:
    return json.dumps(dict({"event": event, "queueKey": queue, "ts": ts(offset)}, **fields))


HAND_MADE = [
    line(0, "grant", sessionKey="A", role="parent", seq=1),
    line(1, "queued", sessionKey="B", role="child"),
    line(2, "queued", sessionKey="C", role="parent"),
    line(10, "release", sessionKey="A", role="parent", reason="release"),
    line(10, "grant", sessionKey="C", role="parent", seq=2),
    line(10, "switch", sessionKey="C", role="parent", seq=2),
    line(20, "release", sessionKey="C", role="parent", reason="idle"),
    line(20, "grant", sessionKey="B", role="child", seq=3),
    line(20, "switch", sessionKey="B", role="child", seq=3),
    line(25, "evict", sessionKey="B", role="child", reason="ttl"),
    line(30, "queued", sessionKey="D", role="child"),
    line(31, "dequeue", sessionKey="D", role="child", reason="cancel"),
    line(40, "config", reason="over-capacity", holders=2, maxStreams=1),
    line(45, "grant", queue=Q2, sessionKey="Z", role="parent", seq=1),
    line(50, "grant", sessionKey="E", role="parent", seq=4),
    line(60, "release", sessionKey="E", role="parent", reason="release"),
]


def write(lines: list[str], name: str = "events.log", extra: str = "") -> str:
    path = os.path.join(short_tmpdir(), name)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n" + extra)
    return path


def report(*paths: str, **kwargs: Any) -> dict[str, Any]:
    return lq.build_report(lq.read_event_log(list(paths)), **kwargs)


def test_the_figures_of_a_hand_made_log() -> None:
    r = report(write(HAND_MADE))
    assert r["since"] == ts(0) and r["until"] == ts(60)
    q = r["queues"][Q]
    assert q["grants"] == 4 and q["switches"] == 2
    assert q["switchesPerHour"] == 120.0  # 2 switches in 60 s
    assert q["heldMs"] == {"parent": 30_000, "child": 5_000}
    assert q["heldMsBySession"] == {"A": 10_000, "C": 10_000, "E": 10_000, "B": 5_000}
    assert q["waits"]["parent"] == {"count": 1, "p50Ms": 8_000, "p95Ms": 8_000, "maxMs": 8_000}
    assert q["waits"]["child"] == {"count": 1, "p50Ms": 19_000, "p95Ms": 19_000, "maxMs": 19_000}
    assert q["abandonedWaits"] == 1
    assert (q["idleYields"], q["ttlEvictions"], q["overCapacityReloads"]) == (1, 1, 1)
    assert q["utilisation"] == round(35 / 60, 4)  # held 0..25 and 50..60 of 0..60
    assert q["meanHolders"] == round(35 / 60, 3)
    assert r["queues"][Q2]["grants"] == 1
    assert r["queues"][Q2]["heldMs"]["parent"] == 15_000  # still held when the log ends


def test_a_parked_holders_hand_over_counts_as_a_park_yield_not_an_idle_yield() -> None:
    r = report(write([
        line(0, "grant", sessionKey="A", role="parent", seq=1),
        line(1, "queued", sessionKey="B", role="child"),
        line(2, "release", sessionKey="A", role="parent", reason="parked"),
        line(2, "grant", sessionKey="B", role="child", seq=2),
        line(2, "switch", sessionKey="B", role="child", seq=2),
        line(9, "release", sessionKey="B", role="child", reason="release"),
    ]))
    q = r["queues"][Q]
    assert (q["parkYields"], q["idleYields"], q["switches"]) == (1, 0, 1)
    assert q["heldMsBySession"] == {"B": 7_000, "A": 2_000}
    assert "park-yields 1" in lq.format_report(r)


def test_a_hand_over_between_two_requests_counts_as_a_handback() -> None:
    r = report(write([
        line(0, "grant", sessionKey="C", role="child", seq=1),
        line(1, "queued", sessionKey="P", role="parent"),
        line(2, "release", sessionKey="C", role="child", reason="handback"),
        line(2, "grant", sessionKey="P", role="parent", seq=2),
        line(2, "switch", sessionKey="P", role="parent", seq=2),
        line(9, "release", sessionKey="P", role="parent", reason="release"),
    ]))
    q = r["queues"][Q]
    assert (q["handbackYields"], q["parkYields"], q["idleYields"], q["switches"]) == (1, 0, 0, 1)
    assert "handbacks 1" in lq.format_report(r)


def test_percentiles_are_nearest_rank_per_tier() -> None:
    lines = []
    t = 0.0
    for i, wait in enumerate([1, 2, 3, 4, 5, 6, 7, 8, 9, 100]):
        lines += [line(t, "queued", sessionKey=f"s{i}", role="child"),
                  line(t + wait, "grant", sessionKey=f"s{i}", role="child", seq=i + 1),
                  line(t + wait + 0.5, "release", sessionKey=f"s{i}", role="child", reason="release")]
        t += 200
    w = report(write(lines))["queues"][Q]["waits"]["child"]
    assert w == {"count": 10, "p50Ms": 5_000, "p95Ms": 100_000, "maxMs": 100_000}


def test_a_torn_last_line_unknown_events_and_garbage_are_skipped() -> None:
    lines = HAND_MADE[:3] + [line(5, "frobnicate", sessionKey="A"), "not json", "[1, 2]",
                             json.dumps({"event": "grant", "queueKey": Q, "ts": "yesterday"})] + HAND_MADE[3:]
    path = write(lines, extra='{"event":"grant","queueKey":"' + Q + '","ts":"20')  # torn mid-write
    assert report(path) == report(write(HAND_MADE))


def test_rotated_files_given_together_are_read_in_time_order() -> None:
    older, newer = write(HAND_MADE[:7], "events.log.1"), write(HAND_MADE[7:], "events.log")
    assert report(newer, older) == report(write(HAND_MADE))


def test_since_until_and_queue_cut_the_window() -> None:
    path = write(HAND_MADE)
    r = report(path, since=BASE + 15, until=BASE + 55, queue=Q)
    assert list(r["queues"]) == [Q]
    q = r["queues"][Q]
    assert q["grants"] == 2 and q["switches"] == 1  # B at 20 and E at 50
    assert q["heldMs"] == {"parent": 10_000, "child": 5_000}  # C 15..20, E 50..55; B 20..25
    assert q["utilisation"] == round(15 / 40, 4)
    assert q["waits"]["child"]["count"] == 1 and q["waits"]["parent"]["count"] == 0


def test_the_command_prints_text_json_and_an_svg() -> None:
    path = write(HAND_MADE)
    svg = os.path.join(os.path.dirname(path), "t.svg")
    out = subprocess.run([sys.executable, MODULE, "report", path, "--svg", svg], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert f"queue {Q}" in out.stdout and "switches 2 (120.0/h)" in out.stdout
    assert "waits parent: n=1  p50 8.0s" in out.stdout and "utilisation 58.3%" in out.stdout
    ET.parse(svg)
    out = subprocess.run([sys.executable, MODULE, "report", path, "--json", "--since", "45s"],
                         capture_output=True, text=True, timeout=30)
    data = json.loads(out.stdout)
    assert data["since"] == ts(15) and data["queues"][Q]["grants"] == 2
    out = subprocess.run([sys.executable, MODULE, "report", path, "--since", "yesterday-ish"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "ISO-8601" in out.stderr


def svg_elements(svg: str) -> list[ET.Element]:
    """The timeline's own elements (the lanes group: not the legend, not the axis)."""
    root = ET.fromstring(svg)
    (lanes,) = [g for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("id") == "lanes"]
    return list(lanes.iter())


def test_the_svg_is_well_formed_with_one_bar_per_hold_and_its_markers() -> None:
    events = lq.read_event_log([write(HAND_MADE)])
    svg = lq.render_svg(events)
    elements = svg_elements(svg)
    cls = [e.get("class") or "" for e in elements]
    assert sum(c.startswith("hold") for c in cls) == 5  # A, C, B, E, and Z in the other queue
    assert sum(c == "hold parent" for c in cls) == 4 and sum(c == "hold child" for c in cls) == 1
    assert sum(c == "mark switch" for c in cls) == 2
    assert sum(c == "mark idle" for c in cls) == 1 and sum(c == "mark ttl" for c in cls) == 1
    assert sum(c == "wait" for c in cls) == 3  # B, C, and the abandoned D
    lanes = [e.text for e in elements if e.get("class") == "lane"]
    assert lanes == ["A", "B", "C", "D", "E", "Z"]
    assert [e.text for e in elements if e.get("class") == "queue"] == [Q, Q2]


def test_a_day_of_thousands_of_holds_stays_small_and_legible() -> None:
    lines = []
    t = 0.0
    for i in range(6000):  # 6,000 holds over ~20 hours, 80 sessions
        s = f"s{i % 80}"
        lines += [line(t, "grant", sessionKey=s, role="child" if i % 3 else "parent", seq=i + 1),
                  line(t + 9, "release", sessionKey=s, role="child" if i % 3 else "parent", reason="release")]
        t += 12
    events = lq.read_event_log([write(lines)])
    svg = lq.render_svg(events)
    elements = svg_elements(svg)
    lanes = [e.text for e in elements if e.get("class") == "lane"]
    assert len(lanes) == 41 and lanes[-1] == "(+40 more sessions)"  # at most 40 lanes a queue
    bars = sum((e.get("class") or "").startswith("hold") for e in elements)
    assert bars <= 41 * 2 * 1000  # never more than a bar per pixel per lane and tier
    assert len(svg) < 3_000_000


def test_a_real_daemons_log_gives_the_figures_of_its_workload() -> None:
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log, "agingAfterSlots": 0, "agingAfterMs": 0}}):
        a, b, c = d.peer(), d.peer(), d.peer()
        a.ask({"op": "acquire", "queueKey": Q, "sessionKey": "A"})
        b.send({"op": "acquire", "queueKey": Q, "sessionKey": "B", "role": "child"})
        c.send({"op": "acquire", "queueKey": Q, "sessionKey": "C"})
        wait_for(lambda: d.waiting(Q) == ["B", "C"])
        time.sleep(0.2)
        a.ask({"op": "release", "queueKey": Q, "sessionKey": "A"})
        assert c.recv()["sessionKey"] == "C"  # the parent first
        time.sleep(0.1)
        c.ask({"op": "release", "queueKey": Q, "sessionKey": "C"})
        assert b.recv()["sessionKey"] == "B"
        b.ask({"op": "release", "queueKey": Q, "sessionKey": "B"})
        wait_for(lambda: sum(1 for _ in open(log)) >= 10)
    q = report(log)["queues"][Q]
    assert (q["grants"], q["switches"]) == (3, 2)
    assert q["waits"]["parent"]["count"] == 1 and q["waits"]["child"]["count"] == 1
    assert q["waits"]["child"]["p50Ms"] >= q["waits"]["parent"]["p50Ms"] >= 200
    assert q["heldMsBySession"]["A"] >= 200 and set(q["heldMsBySession"]) == {"A", "B", "C"}
    assert 0 < q["utilisation"] <= 1


def test_a_log_spanning_a_regrouping_reload_replays_cleanly() -> None:
    """A reload that merges two queues moves their holder and waiter; the log says so (``move``
    lines), so the report and the history checker follow them instead of losing them."""
    from tests.history import check_history

    log = os.path.join(short_tmpdir(), "events.log")
    a_url, b_url = "http://a:1/v1", "http://b:1/v1"
    for d in started(config={"defaults": {"logFile": log}}):
        s, t, w = d.peer(), d.peer(), d.peer()
        s.ask({"op": "acquire", "queueKey": a_url, "sessionKey": "S"})
        t.ask({"op": "acquire", "queueKey": b_url, "sessionKey": "T"})
        w.send({"op": "acquire", "queueKey": b_url, "sessionKey": "W"})
        wait_for(lambda: d.waiting(b_url) == ["W"])
        d.write_config({"defaults": {"logFile": log, "daemonIdleExitMs": 10**9},
                        "queues": {"g": {"match": [a_url, b_url], "maxStreams": 1}}})
        wait_for(lambda: d.holders("g") == ["S", "T"], timeout=5)
        s.ask({"op": "release", "queueKey": a_url, "sessionKey": "S"})
        t.ask({"op": "release", "queueKey": b_url, "sessionKey": "T"})
        assert w.recv()["sessionKey"] == "W"
        w.ask({"op": "release", "queueKey": b_url, "sessionKey": "W"})
        wait_for(lambda: any('"W"' in l and '"release"' in l for l in open(log)))
    events = [json.loads(l) for l in open(log)]
    assert [e["event"] for e in events].count("move") == 3
    r = report(log)["queues"]
    assert set(r) >= {"g", a_url, b_url}
    assert r["g"]["waits"]["parent"]["count"] == 1 and r[b_url]["abandonedWaits"] == 0
    assert r["g"]["heldMsBySession"].keys() >= {"S", "T", "W"}
    assert check_history(events, [], sweep_ms=20).violations == []
