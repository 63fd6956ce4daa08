"""Leases and the daemon's lifetime (issue 3), pinned through a real socket against a real daemon.

Every test starts its own daemon process (``tests.harness.DaemonProc``, ``--sweep-ms 20``) and
asserts what the specification says (``daemon-protocol.md``: "Leases and session switches", "The
Lease's terms", the idle-exit bullet of "Client contract"; ``python-port.md`` for the security and
signal decisions):

- TTL: a silent holder whose socket stays open is evicted within ``leaseTtlMs + sweepMs`` (not
  before the TTL) and the waiter is granted; bare renews keep a lease past several TTLs; a keyed
  renew refreshes and answers ``granted``; a lapsed lease is never reported as a holder.
- Idle-yield: only an activity-flagged holder, only with a waiter, only past its window; keyed
  beats keep it, bare renews do not; ``idleYieldMs: 0`` disables; the terms ride on ``granted``.
- Lease terms across a hot-reload: a shortened TTL applies at the next grant, a lengthened one at
  once; a changed idle-yield window applies at the next grant only.
- Idle-exit: counted connections, ``bye``, status-only observers, the relaunch grace, the clamp,
  ``--idle-exit-ms``, and (slow) the 30 s no-client floor.
- Socket ownership: a second daemon, a stale socket, a non-socket at the path, the start race,
  permissions, the peer-uid check (as another user via ``setpriv``), SIGTERM/SIGINT.

Timing bounds are measured from the client's side: a lower bound from the moment the request that
started the clock was sent, an upper bound from the moment its reply arrived, plus ``MARGIN`` for a
loaded machine.  Timer tests cost the TTL (1000 ms, the minimum) or the window plus tens of ms.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest

from tests.harness import MODULE, QUEUE_KEY, SWEEP_MS, DaemonProc, Peer, short_tmpdir, started, wait_for

K = QUEUE_KEY
K2 = "http://127.0.0.1:8002/v1"
PROBE = "http://127.0.0.1:8999/reload-probe"  # a queue whose maxStreams says which config is live

TTL_MS = 1000  # the spec's minimum leaseTtlMs
TTL = TTL_MS / 1000.0
SWEEP = SWEEP_MS / 1000.0
IDLE_MS = 200  # a small idle-yield window
IDLE = IDLE_MS / 1000.0
MARGIN = 0.5  # slack on every upper bound, for a loaded machine
AT_ONCE = 1.5  # "exits at once": process teardown included, on a loaded machine
RELOAD_TIMEOUT = 5.0  # the 250 ms debounce plus the poll, with plenty of slack


# -- helpers -----------------------------------------------------------------------------------


def acquire(key: str, session: str, **extra: Any) -> Dict[str, Any]:
    return dict({"op": "acquire", "queueKey": key, "sessionKey": session}, **extra)


def beat(key: str, session: str) -> Dict[str, Any]:
    return {"op": "renew", "queueKey": key, "sessionKey": session}


BARE_RENEW: Dict[str, Any] = {"op": "renew"}


def timed_ask(p: Peer, message: Dict[str, Any]) -> Tuple[Dict[str, Any], float, float]:
    """The reply, the time just before the request was sent and the time its reply arrived."""
    sent = time.monotonic()
    reply = p.ask(message)
    return reply, sent, time.monotonic()


def granted_to(p: Peer, key: str, session: str, timeout: float) -> float:
    """Wait for this peer's ``granted`` reply; the time it arrived."""
    reply = p.recv(timeout)
    assert reply["op"] == "granted" and reply["queueKey"] == key and reply["sessionKey"] == session, reply
    return time.monotonic()


def await_grants(peers: Dict[str, Peer], timeout: float) -> Dict[str, Tuple[Dict[str, Any], float]]:
    """Wait for one ``granted`` reply on each of several peers at once; each reply and the time
    it arrived."""
    got: Dict[str, Tuple[Dict[str, Any], float]] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(peers):
        assert time.monotonic() < deadline, f"no grant for {sorted(set(peers) - set(got))} within {timeout}s"
        for session, p in peers.items():
            if session not in got and not p.silent(0.002):
                reply = p.recv(0.5)
                got[session] = (reply, time.monotonic())
                assert reply["op"] == "granted" and reply["sessionKey"] == session, reply
    return got


def queued(d: DaemonProc, key: str, p: Peer, session: str, **extra: Any) -> None:
    """Send an acquire that must queue, and wait until status shows it waiting."""
    p.send(acquire(key, session, **extra))
    wait_for(lambda: session in d.waiting(key))


def with_probe(config: Dict[str, Any], generation: int) -> Dict[str, Any]:
    """``config`` plus the probe queue at ``maxStreams: generation``; its TTL is long so the probe
    holder outlives every test."""
    cfg: Dict[str, Any] = json.loads(json.dumps(config))
    cfg.setdefault("queues", {})[PROBE] = {"maxStreams": generation, "leaseTtlMs": 600000}
    return cfg


def hold_probe(d: DaemonProc) -> Peer:
    """Keep the probe queue alive (a holder) so status always lists it."""
    p = d.peer()
    assert p.ask(acquire(PROBE, "probe"))["op"] == "granted"
    return p


def reload(d: DaemonProc, config: Dict[str, Any], generation: int, keep: Optional[Any] = None) -> None:
    """Write ``config`` atomically and wait until the daemon has loaded it (the probe queue's
    maxStreams moves to ``generation``).  ``keep()`` runs on every poll (e.g. a heartbeat)."""
    d.write_config(with_probe(config, generation))

    def loaded() -> bool:
        if keep is not None:
            keep()
        return bool(d.queue(PROBE)["maxStreams"] == generation)

    wait_for(loaded, RELOAD_TIMEOUT, interval=0.05)


def exits_within(d: DaemonProc, timeout: float) -> Tuple[int, float]:
    """Wait for the daemon process to exit; its exit code and the time it was seen gone."""
    assert d.proc is not None
    code = d.proc.wait(timeout)
    return code, time.monotonic()


def stays_alive(d: DaemonProc, seconds: float) -> bool:
    """True when the daemon is still running ``seconds`` from now and still answers status."""
    time.sleep(seconds)
    if not d.alive():
        return False
    d.status()  # fails the test if it does not answer
    return True


COUNTED_OPS: List[Tuple[str, Dict[str, Any], bool]] = [  # (name, request, answered)
    ("acquire", acquire(K, "s"), True),
    ("renew", dict(BARE_RENEW), True),
    ("role", {"op": "role", "sessionKey": "s", "role": "child"}, False),
    ("cancel", {"op": "cancel", "queueKey": K, "sessionKey": "s"}, False),
]


# -- 1. TTL -------------------------------------------------------------------------------------

TTL_CONFIG: Dict[str, Any] = {"defaults": {"leaseTtlMs": TTL_MS}}


def test_ttl_a_silent_holder_is_evicted_within_ttl_plus_sweep_whether_or_not_anyone_waits() -> None:
    """TTL eviction is unconditional: a holder that keeps its socket open but stops beating is
    evicted no earlier than leaseTtlMs and no later than leaseTtlMs + sweepMs (+ margin) after its
    last heartbeat.  With a waiter, the waiter is granted then; with nobody waiting, status stops
    listing it then, a later bare renew does not bring it back, and its keyed renew says
    granted: false."""
    for d in started(config=TTL_CONFIG):
        a, b, z = d.peer(), d.peer(), d.peer()
        reply, a_sent, a_got = timed_ask(a, acquire(K, "A"))
        assert reply["op"] == "granted" and reply["leaseTtlMs"] == TTL_MS
        reply, z_sent, z_got = timed_ask(z, acquire(K2, "Z"))  # nobody will wait for Z's slot
        assert reply["op"] == "granted"
        queued(d, K, b, "B")
        t_b: Optional[float] = None
        seen: List[Tuple[float, float, List[str]]] = []  # (sent, answered, K2's holders)
        deadline = a_got + TTL + SWEEP + MARGIN + 1.0
        while t_b is None or not seen or seen[-1][2]:
            assert time.monotonic() < deadline, f"not evicted: B granted at {t_b}, K2 holders {seen[-1:]}"
            if t_b is None and not b.silent(0.01):
                t_b = granted_to(b, K, "B", timeout=0.5)
            s0 = time.monotonic()
            hs = d.holders(K2)
            seen.append((s0, time.monotonic(), hs))
        assert t_b - a_sent >= TTL, f"evicted {t_b - a_sent:.3f}s after the grant, before the TTL"
        assert t_b - a_got <= TTL + SWEEP + MARGIN, f"evicted only {t_b - a_got:.3f}s after the last heartbeat"
        for s0, r0, hs in seen:
            if r0 < z_sent + TTL:
                assert hs == ["Z"], f"no holder {r0 - z_sent:.3f}s after the grant, before the TTL"
            if s0 > z_got + TTL + SWEEP + MARGIN:
                assert hs == [], f"lapsed lease still reported {s0 - z_got:.3f}s after its last heartbeat"
        assert d.holders(K) == ["B"]
        # neither socket was closed: both are still usable, and learn their slot is gone
        assert a.ask(beat(K, "A")) == {"op": "ok", "queueKey": K, "sessionKey": "A", "granted": False}
        assert z.ask(BARE_RENEW) == {"op": "ok"}
        assert d.holders(K2) == []
        assert z.ask(beat(K2, "Z")) == {"op": "ok", "queueKey": K2, "sessionKey": "Z", "granted": False}


def test_ttl_bare_and_keyed_renews_keep_leases_alive_past_several_ttls() -> None:
    """Renewing keeps a lease past its TTL: a holder sending bare renews (answered ``{"op":"ok"}``)
    and one sending keyed renews (answered granted: true) each keep the slot for 3 TTLs while a
    waiter waits; a silent control holder in the same daemon is evicted meanwhile (so the 1000 ms
    TTL really is in force)."""
    k3 = "http://127.0.0.1:8003/v1"
    for d in started(config=TTL_CONFIG):
        bare, keyed, ctl = d.peer(), d.peer(), d.peer()
        w_bare, w_keyed, w_ctl = d.peer(), d.peer(), d.peer()
        assert bare.ask(acquire(K, "BARE"))["op"] == "granted"
        assert keyed.ask(acquire(K2, "KEYED"))["op"] == "granted"
        assert ctl.ask(acquire(k3, "CTL"))["op"] == "granted"
        queued(d, K, w_bare, "W1")
        queued(d, K2, w_keyed, "W2")
        queued(d, k3, w_ctl, "W3")
        end = time.monotonic() + 3 * TTL
        while time.monotonic() < end:
            assert bare.ask(BARE_RENEW) == {"op": "ok"}
            assert keyed.ask(beat(K2, "KEYED")) == {"op": "ok", "queueKey": K2, "sessionKey": "KEYED",
                                                     "granted": True}
            assert w_bare.silent(0.2) and w_keyed.silent(0.001), "a waiter was granted though its holder renews"
        assert d.holders(K) == ["BARE"] and d.waiting(K) == ["W1"]
        assert d.holders(K2) == ["KEYED"] and d.waiting(K2) == ["W2"]
        assert bare.ask(beat(K, "BARE"))["granted"] is True
        assert w_ctl.recv(0.1)["sessionKey"] == "W3"  # the silent control lapsed long ago


# -- 2. idle-yield ------------------------------------------------------------------------------

IDLE_CONFIG: Dict[str, Any] = {"defaults": {"idleYieldMs": IDLE_MS}}


def test_idle_yield_a_silent_flagged_holder_yields_to_a_waiter_not_before_its_window() -> None:
    """An activity-flagged holder silent past idleYieldMs loses the slot to a queued waiter: not
    before the window, within window + sweep (+ margin)."""
    for d in started(config=IDLE_CONFIG):
        a, b = d.peer(), d.peer()
        reply, sent, got = timed_ask(a, acquire(K, "A", activity=True))
        assert reply["op"] == "granted"
        b.send(acquire(K, "B"))
        t_b = granted_to(b, K, "B", timeout=IDLE + SWEEP + MARGIN + 1.0)
        assert t_b - sent >= IDLE, f"yielded {t_b - sent:.3f}s after the grant, inside the window"
        assert t_b - got <= IDLE + SWEEP + MARGIN
        assert d.holders(K) == ["B"] and d.queue(K)["switches"] == 1


def test_idle_yield_a_lone_flagged_holder_is_never_disturbed_and_yields_once_a_waiter_comes() -> None:
    """A lone holder is never disturbed: silent for 3 windows with nobody waiting it keeps the
    slot; the moment a waiter queues, the long-idle holder yields to it."""
    for d in started(config=IDLE_CONFIG):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire(K, "A", activity=True))["op"] == "granted"
        time.sleep(3 * IDLE)
        assert d.holders(K) == ["A"]
        sent = time.monotonic()
        b.send(acquire(K, "B"))
        t_b = granted_to(b, K, "B", timeout=SWEEP + MARGIN + 1.0)
        assert t_b - sent <= SWEEP + MARGIN
        assert d.holders(K) == ["B"]


def test_idle_yield_an_unflagged_holder_is_never_yielded() -> None:
    """A lease acquired without ``activity: true`` (an old client), or with ``activity: false``,
    keeps the slot through many idle windows with a waiter queued; a flagged control in the same
    daemon is yielded (so the window really is in force)."""
    for d in started(config=IDLE_CONFIG):
        omitted, false, ctl = d.peer(), d.peer(), d.peer()
        w1, w2, w3 = d.peer(), d.peer(), d.peer()
        k3 = "http://127.0.0.1:8003/v1"
        assert omitted.ask(acquire(K, "OLD"))["op"] == "granted"
        assert false.ask(acquire(K2, "OFF", activity=False))["op"] == "granted"
        assert ctl.ask(acquire(k3, "CTL", activity=True))["op"] == "granted"
        w1.send(acquire(K, "W1"))
        w2.send(acquire(K2, "W2"))
        w3.send(acquire(k3, "W3"))
        assert w3.recv(IDLE + SWEEP + MARGIN + 1.0)["sessionKey"] == "W3"  # the control yields
        assert w1.silent(2 * IDLE) and w2.silent(0.01)  # OLD and OFF: silent 3 windows by now
        assert d.holders(K) == ["OLD"] and d.holders(K2) == ["OFF"]
        assert d.waiting(K) == ["W1"] and d.waiting(K2) == ["W2"]


def test_idle_yield_keyed_beats_keep_a_flagged_holder_with_a_waiter_queued() -> None:
    """Keyed renews are activity: a flagged holder beating inside its window keeps the slot for 3
    windows with a waiter queued; once it stops beating it yields."""
    for d in started(config=IDLE_CONFIG):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire(K, "A", activity=True))["op"] == "granted"
        queued(d, K, b, "B")
        end = time.monotonic() + 3 * IDLE
        while True:
            reply, sent, got = timed_ask(a, beat(K, "A"))
            assert reply["granted"] is True, "yielded although it beat inside its window"
            if time.monotonic() > end:
                break
            assert b.silent(IDLE / 4)
        assert d.holders(K) == ["A"]
        t_b = granted_to(b, K, "B", timeout=IDLE + SWEEP + MARGIN + 1.0)
        assert t_b - sent >= IDLE and t_b - got <= IDLE + SWEEP + MARGIN


def test_idle_yield_bare_renews_are_not_activity() -> None:
    """A bare renew keeps the TTL but is not activity: a flagged holder that only bare-renews is
    still yielded once its window passes with a waiter queued."""
    for d in started(config=IDLE_CONFIG):
        a, b = d.peer(), d.peer()
        reply, sent, got = timed_ask(a, acquire(K, "A", activity=True))
        assert reply["op"] == "granted"
        b.send(acquire(K, "B"))
        deadline = got + IDLE + SWEEP + MARGIN
        while time.monotonic() < deadline + 1.0:
            assert a.ask(BARE_RENEW) == {"op": "ok"}
            if not b.silent(IDLE / 8):
                break
        t_b = granted_to(b, K, "B", timeout=0.01)
        assert t_b - sent >= IDLE and t_b - got <= IDLE + SWEEP + MARGIN + 0.1
        assert a.ask(beat(K, "A"))["granted"] is False


def test_idle_yield_a_zero_window_disables_it() -> None:
    """``idleYieldMs: 0`` disables idle-yield: a flagged, silent holder with a waiter keeps the
    slot (its grant says idleYieldMs 0); a queue of the same daemon with a 200 ms window yields."""
    config = {"defaults": {"idleYieldMs": IDLE_MS}, "queues": {K: {"idleYieldMs": 0}}}
    for d in started(config=config):
        a, b, ctl, ctl_waiter = d.peer(), d.peer(), d.peer(), d.peer()
        assert a.ask(acquire(K, "A", activity=True))["idleYieldMs"] == 0
        assert ctl.ask(acquire(K2, "CTL", activity=True))["idleYieldMs"] == IDLE_MS
        b.send(acquire(K, "B"))
        ctl_waiter.send(acquire(K2, "CTLW"))
        assert ctl_waiter.recv(IDLE + SWEEP + MARGIN + 1.0)["sessionKey"] == "CTLW"
        assert b.silent(2 * IDLE)  # A: silent for 3 windows by now
        assert d.holders(K) == ["A"] and d.waiting(K) == ["B"]


def test_idle_yield_the_yielded_clients_next_keyed_renew_says_granted_false_and_it_can_requeue() -> None:
    """The yielded client learns on its next beat: granted: false, on a socket that stays open;
    it re-queues behind the new holder and is granted when that one releases."""
    for d in started(config=IDLE_CONFIG):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire(K, "A", activity=True))["op"] == "granted"
        b.send(acquire(K, "B"))
        granted_to(b, K, "B", timeout=IDLE + SWEEP + MARGIN + 1.0)
        assert a.ask(beat(K, "A")) == {"op": "ok", "queueKey": K, "sessionKey": "A", "granted": False}
        queued(d, K, a, "A", activity=True)
        assert a.silent(0.05)
        assert b.ask({"op": "release", "queueKey": K, "sessionKey": "B"}) == {"op": "ok", "queueKey": K, "sessionKey": "B"}
        granted_to(a, K, "A", timeout=2.0)
        assert a.ask(beat(K, "A"))["granted"] is True


def test_granted_replies_carry_the_lease_terms() -> None:
    """The ``granted`` reply carries the lease's terms, leaseTtlMs and idleYieldMs, resolved per
    queue: for a direct grant and for a queued waiter's grant (a switch) alike."""
    config = {"defaults": {"leaseTtlMs": 4321, "idleYieldMs": 1234},
              "queues": {K2: {"leaseTtlMs": 2000, "idleYieldMs": 0}}}
    for d in started(config=config):
        a, b, c = d.peer(), d.peer(), d.peer()
        ga = a.ask(acquire(K, "A", activity=True))
        assert {k: ga[k] for k in ("op", "queueKey", "sessionKey", "leaseTtlMs", "idleYieldMs")} == {
            "op": "granted", "queueKey": K, "sessionKey": "A", "leaseTtlMs": 4321, "idleYieldMs": 1234}
        gc = c.ask(acquire(K2, "C"))
        assert (gc["op"], gc["leaseTtlMs"], gc["idleYieldMs"]) == ("granted", 2000, 0)
        queued(d, K, b, "B")
        a.ask({"op": "release", "queueKey": K, "sessionKey": "A"})
        gb = b.recv()
        assert (gb["op"], gb["sessionKey"], gb["leaseTtlMs"], gb["idleYieldMs"]) == ("granted", "B", 4321, 1234)


# -- 3. lease terms across a config change --------------------------------------------------------


def test_terms_across_a_reload_a_shortened_ttl_applies_at_the_next_grant_and_a_lengthened_one_at_once() -> None:
    """#104, one reload: queue K's leaseTtlMs 1500 -> 1000 (shortened), K2's 1000 -> 1500
    (lengthened).  A policy edit never shortens a held lease: K's holder, refreshed after the
    reload, still lives 1500 ms past that heartbeat; the next grant on K carries 1000 and lapses
    within 1000 ms + sweep.  A lengthened TTL applies at once: K2's holder, granted under 1000,
    lives 1500 ms past its heartbeat without being granted again; the next grant carries 1500."""
    long_ms = 1500
    long = long_ms / 1000.0
    before = {"defaults": {"leaseTtlMs": long_ms}, "queues": {K2: {"leaseTtlMs": TTL_MS}}}
    after = {"defaults": {"leaseTtlMs": TTL_MS}, "queues": {K2: {"leaseTtlMs": long_ms}}}
    for d in started(config=with_probe(before, 1)):
        hold_probe(d)
        shortened, shortened_waiter, shortened_next = d.peer(), d.peer(), d.peer()
        lengthened, lengthened_waiter = d.peer(), d.peer()
        assert shortened.ask(acquire(K, "S"))["leaseTtlMs"] == long_ms
        assert lengthened.ask(acquire(K2, "L"))["leaseTtlMs"] == TTL_MS
        queued(d, K, shortened_waiter, "SW")
        queued(d, K2, lengthened_waiter, "LW")

        def heartbeat() -> None:
            assert shortened.ask(BARE_RENEW) == {"op": "ok"} and lengthened.ask(BARE_RENEW) == {"op": "ok"}

        reload(d, after, 2, keep=heartbeat)
        assert d.holders(K) == ["S"] and d.holders(K2) == ["L"]
        _, s_sent, s_got = timed_ask(shortened, BARE_RENEW)  # a refresh under the shorter queue TTL
        _, l_sent, l_got = timed_ask(lengthened, BARE_RENEW)
        grants = await_grants({"SW": shortened_waiter, "LW": lengthened_waiter}, long + SWEEP + MARGIN + 1.0)

        sw, t_sw = grants["SW"]
        assert t_sw - s_sent >= long, (
            f"the held lease lapsed {t_sw - s_sent:.3f}s after its last heartbeat: the shortened TTL shrank it")
        assert t_sw - s_got <= long + SWEEP + MARGIN
        assert sw["leaseTtlMs"] == TTL_MS  # the next grant is under the new, shorter TTL
        lw, t_lw = grants["LW"]
        assert t_lw - l_sent >= long, (
            f"the held lease lapsed {t_lw - l_sent:.3f}s after its last heartbeat: the lengthened TTL did not apply")
        assert t_lw - l_got <= long + SWEEP + MARGIN
        assert lw["leaseTtlMs"] == long_ms

        shortened_next.send(acquire(K, "SN"))  # SW, silent since its grant, lapses under 1000 ms
        t_next = granted_to(shortened_next, K, "SN", timeout=long + SWEEP + MARGIN + 1.0)
        assert t_next - t_sw <= TTL + SWEEP + MARGIN, f"SW's lease lived {t_next - t_sw:.3f}s: not 1000 ms"


def test_terms_a_changed_idle_window_applies_at_the_next_grant_only() -> None:
    """#105, one reload: K's idleYieldMs 200 -> 0 (disabled), K2's 200 -> 5000 (lengthened), K3's
    30000 -> 200 (shortened).  Each flagged holder keeps the window it was granted under: K's and
    K2's still yield 200 ms after their last beat, K3's is not yielded through 3 new windows with a
    waiter queued.  The next grant on each queue carries the new window and lives by it."""
    k3 = "http://127.0.0.1:8003/v1"
    before = {"defaults": {"idleYieldMs": IDLE_MS}, "queues": {k3: {"idleYieldMs": 30000}}}
    after = {"defaults": {"idleYieldMs": IDLE_MS},
             "queues": {K: {"idleYieldMs": 0}, K2: {"idleYieldMs": 5000}, k3: {"idleYieldMs": IDLE_MS}}}
    for d in started(config=with_probe(before, 1)):
        hold_probe(d)
        a1, a2, a3, b1, b2, b3, c1, c2, c3 = (d.peer() for _ in range(9))
        assert a1.ask(acquire(K, "A1", activity=True))["idleYieldMs"] == IDLE_MS
        assert a2.ask(acquire(K2, "A2", activity=True))["idleYieldMs"] == IDLE_MS
        assert a3.ask(acquire(k3, "A3", activity=True))["idleYieldMs"] == 30000
        reload(d, after, 2)  # lone holders: nothing yields yet
        _, sent1, got1 = timed_ask(a1, beat(K, "A1"))
        _, sent2, got2 = timed_ask(a2, beat(K2, "A2"))
        for p, key, session in ((b1, K, "B1"), (b2, K2, "B2"), (b3, k3, "B3")):
            p.send(acquire(key, session, activity=True))
        grants = await_grants({"B1": b1, "B2": b2}, IDLE + SWEEP + MARGIN + 1.0)
        for (reply, t), sent, got, window in ((grants["B1"], sent1, got1, 0), (grants["B2"], sent2, got2, 5000)):
            assert t - sent >= IDLE and t - got <= IDLE + SWEEP + MARGIN, (
                f"{reply['sessionKey']}: the held lease did not keep its 200 ms window ({t - sent:.3f}s)")
            assert reply["idleYieldMs"] == window
        assert a1.ask(beat(K, "A1"))["granted"] is False and a2.ask(beat(K2, "A2"))["granted"] is False
        c1.send(acquire(K, "C1"))
        c2.send(acquire(K2, "C2"))
        assert b3.silent(3 * IDLE), "K3's held lease was yielded under the shortened window"
        assert c1.silent(0.001) and c2.silent(0.001), "a next grant was yielded under the old 200 ms window"
        assert d.holders(K) == ["B1"] and d.holders(K2) == ["B2"] and d.holders(k3) == ["A3"]
        assert a3.ask({"op": "release", "queueKey": k3, "sessionKey": "A3"}) == {"op": "ok", "queueKey": k3, "sessionKey": "A3"}
        gb3 = b3.recv()
        t_b3 = time.monotonic()
        assert gb3["op"] == "granted" and gb3["idleYieldMs"] == IDLE_MS
        c3.send(acquire(k3, "C3"))
        t_c3 = granted_to(c3, k3, "C3", timeout=IDLE + SWEEP + MARGIN + 1.0)
        assert t_c3 - t_b3 <= IDLE + SWEEP + MARGIN


# -- 4. idle-exit -----------------------------------------------------------------------------------


def gone_at_once(d: DaemonProc, since: float) -> None:
    code, seen = exits_within(d, AT_ONCE + 2.0)
    assert code == 0, d.stderr()
    assert seen - since <= AT_ONCE, f"exited {seen - since:.3f}s after its last client left: not at once"
    assert not os.path.exists(d.socket_path), "the socket was left behind"
    # Issue 34: a daemon run by hand says when it serves and why it left, one line each.
    lines = d.stderr().splitlines()
    assert lines[0].startswith(f"llmqueue: serving on {d.socket_path}; it exits"), lines
    assert "clients start it on demand" in lines[0], lines
    assert lines[-1].startswith("llmqueue: no client for a while: exiting"), lines


@pytest.mark.parametrize("name, op, answered", COUNTED_OPS, ids=[n for n, _, _ in COUNTED_OPS])
def test_idle_exit_by_default_the_daemon_exits_at_once_when_its_last_counted_client_disconnects(
        name: str, op: Dict[str, Any], answered: bool) -> None:
    """Production default (daemonIdleExitMs 0): a connection is counted from its first
    acquire/renew/role/cancel; while it lives the daemon serves; when it closes the daemon exits
    at once, exit code 0, socket unlinked."""
    d = DaemonProc(inject_idle_exit=False)
    with d:
        d.start()
        p = d.peer()
        assert p.ask({"op": "status"})["op"] == "status"  # not counted yet
        if answered:
            assert p.ask(op)["op"] in ("granted", "ok")
        else:
            p.send(op)
        assert p.ask({"op": "status"})["op"] == "status"  # the op was processed: counted now
        assert stays_alive(d, 0.1), "the daemon exited while a counted client was connected"
        p.close()
        gone_at_once(d, time.monotonic())


def test_idle_exit_bye_arms_the_exit_without_closing_the_socket() -> None:
    """``bye`` makes the connection uncounted at the word: with another counted client left the
    daemon stays; when the last counted client says bye the daemon exits (0, socket unlinked)
    though no socket was closed."""
    for d in started(config={"defaults": {"daemonIdleExitMs": 0}}):
        a, b = d.peer(), d.peer()
        assert a.ask(acquire(K, "A"))["op"] == "granted"
        assert b.ask(BARE_RENEW) == {"op": "ok"}
        a.send({"op": "bye"})
        assert b.ask({"op": "status"})["op"] == "status"
        assert d.holders(K) == []  # bye released A's lease
        assert stays_alive(d, 0.3), "one bye exited the daemon though another counted client lives"
        b.send({"op": "bye"})
        gone_at_once(d, time.monotonic())


def test_idle_exit_a_status_only_connection_never_keeps_the_daemon_alive() -> None:
    """A status-only connection (an observer) is never counted: the counted client leaving exits
    the daemon at once though the observer is still connected (and it sees the daemon go)."""
    for d in started(config={"defaults": {"daemonIdleExitMs": 0}}):
        observer = d.peer()
        assert observer.ask({"op": "status"})["op"] == "status"
        a = d.peer()
        assert a.ask(acquire(K, "A"))["op"] == "granted"
        assert observer.ask({"op": "status"})["op"] == "status"
        a.close()
        gone_at_once(d, time.monotonic())
        assert observer.closed_by_daemon(1.0)


def test_idle_exit_a_counted_reconnect_within_the_grace_cancels_the_exit() -> None:
    """daemonIdleExitMs > 0 is a relaunch grace: a counted reconnect within it cancels the pending
    exit (the daemon outlives 2 graces); when that client leaves, the daemon exits one grace later
    (not before), exit code 0."""
    grace_ms = 250
    grace = grace_ms / 1000.0
    for d in started(config={"defaults": {"daemonIdleExitMs": grace_ms}}):
        a = d.peer()
        assert a.ask(acquire(K, "A"))["op"] == "granted"
        a.close()
        b = d.peer()
        assert b.ask(BARE_RENEW) == {"op": "ok"}
        assert stays_alive(d, 2 * grace), "the pending exit was not cancelled by the counted reconnect"
        left = time.monotonic()
        b.close()
        code, seen = exits_within(d, grace + AT_ONCE + 2.0)
        assert code == 0
        assert seen - left >= grace, f"exited {seen - left:.3f}s after the last client, inside the grace"
        assert seen - left <= grace + AT_ONCE
        assert not os.path.exists(d.socket_path)


@pytest.mark.parametrize("huge", [10**12, 10**18])
def test_idle_exit_a_huge_delay_is_clamped_not_overflowed(huge: int) -> None:
    """A daemonIdleExitMs past the 2^31-1 timer cap is clamped (~24.8 days), not overflowed into
    an immediate exit or a crash: after the last client leaves the daemon keeps serving."""
    for d in started(config={"defaults": {"daemonIdleExitMs": huge}}):
        a = d.peer()
        assert a.ask(acquire(K, "A"))["op"] == "granted"
        a.close()
        assert stays_alive(d, 0.3), f"exited with code {d.proc.poll() if d.proc else None}: {d.stderr()}"
        with d.peer() as b:
            assert b.ask(acquire(K, "B"))["op"] == "granted"


def test_idle_exit_the_command_line_overrides_the_config_to_exit_at_once() -> None:
    """--idle-exit-ms 0 beats a config daemonIdleExitMs of 10^9: the daemon exits at once."""
    d = DaemonProc(config={"defaults": {"daemonIdleExitMs": 10**9}}, args=("--idle-exit-ms", "0"))
    with d:
        d.start()
        a = d.peer()
        assert a.ask(acquire(K, "A"))["op"] == "granted"
        a.close()
        gone_at_once(d, time.monotonic())


def test_idle_exit_the_command_line_overrides_the_config_to_stay() -> None:
    """--idle-exit-ms 600000 beats a config daemonIdleExitMs of 0: the daemon stays after its last
    client leaves."""
    d = DaemonProc(config={"defaults": {"daemonIdleExitMs": 0}}, args=("--idle-exit-ms", "600000"))
    with d:
        d.start()
        a = d.peer()
        assert a.ask(acquire(K, "A"))["op"] == "granted"
        a.close()
        assert stays_alive(d, 0.3), "the config's 0 won over --idle-exit-ms"


@pytest.mark.slow
def test_idle_exit_a_daemon_that_never_gets_a_client_exits_after_the_30s_floor() -> None:
    """A daemon started with no client (production default daemonIdleExitMs 0) exits after
    max(daemonIdleExitMs, 30 s): not before 30 s, soon after; status-only observers polling it
    meanwhile do not keep it alive.  Exit code 0, socket unlinked."""
    d = DaemonProc(inject_idle_exit=False)
    with d:
        before = time.monotonic()
        d.start()
        ready = time.monotonic()
        assert d.proc is not None
        while d.proc.poll() is None and time.monotonic() < ready + 40:
            try:
                with Peer(d.socket_path, timeout=2.0) as p:
                    p.ask({"op": "status"})
            except OSError:
                pass
            time.sleep(1.0)
        code, seen = exits_within(d, 10.0)
        assert code == 0
        assert seen - before >= 30.0, f"exited {seen - before:.1f}s after start: the 30 s floor was not kept"
        assert seen - ready <= 30.0 + 1.0 + 2 * MARGIN + 1.0  # + the last observer's 1 s nap
        assert not os.path.exists(d.socket_path)


# -- 5. socket ownership ---------------------------------------------------------------------------


def test_socket_a_second_daemon_on_a_live_socket_exits_0_at_once_and_leaves_the_first_serving() -> None:
    """A second daemon on a live socket exits 0 at once without touching it: the first keeps the
    same socket file and its clients are still served."""
    for d in started():
        a = d.peer()
        assert a.ask(acquire(K, "A"))["op"] == "granted"
        inode = os.stat(d.socket_path).st_ino
        second = DaemonProc(d.agent_dir)
        with second:
            started_at = time.monotonic()
            second.start(wait=False)
            code, seen = exits_within(second, 10.0)
            assert code == 0, second.stderr()
            assert seen - started_at <= 3.0, "the second daemon lingered"
        assert d.alive() and os.stat(d.socket_path).st_ino == inode
        assert a.ask(beat(K, "A"))["granted"] is True
        with d.peer() as b:
            assert b.ask(acquire(K2, "B"))["op"] == "granted"
        assert d.holders(K) == ["A"]


def test_socket_a_stale_socket_file_is_reclaimed() -> None:
    """A socket file that nobody listens on (a crashed daemon's leftover) is reclaimed: the new
    daemon serves on that path."""
    d = DaemonProc()
    with d:
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(d.socket_path)
        stale.close()  # bound, never listening, file left behind
        assert stat.S_ISSOCK(os.lstat(d.socket_path).st_mode)
        d.start()
        with d.peer() as p:
            assert p.ask(acquire(K, "A"))["op"] == "granted"
        assert d.alive()


@pytest.mark.parametrize("kind", ["regular file", "symlink"])
def test_socket_a_non_socket_at_the_socket_path_is_refused_and_left_untouched(kind: str) -> None:
    """A regular file, or a symlink (here to a regular file), at the socket path is never replaced:
    the daemon exits non-zero and the file (and the link's target) are untouched."""
    d = DaemonProc()
    target_dir = short_tmpdir()
    try:
        with d:
            target = os.path.join(target_dir, "precious")
            with open(target, "w") as f:
                f.write("precious data\n")
            if kind == "symlink":
                os.symlink(target, d.socket_path)
            else:
                shutil.copyfile(target, d.socket_path)
            before = os.lstat(d.socket_path)
            d.start(wait=False)
            code, _ = exits_within(d, 10.0)
            assert code != 0, "the daemon did not refuse a non-socket at its socket path"
            after = os.lstat(d.socket_path)
            assert (after.st_ino, after.st_mode, after.st_mtime_ns) == (before.st_ino, before.st_mode, before.st_mtime_ns)
            if kind == "symlink":
                assert os.readlink(d.socket_path) == target
            else:
                with open(d.socket_path) as f:
                    assert f.read() == "precious data\n"
            with open(target) as f:
                assert f.read() == "precious data\n"
    finally:
        shutil.rmtree(target_dir, ignore_errors=True)


RACER = r"""
import os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import llmqueue
sys.stdout.write("ready\n"); sys.stdout.flush()
os.dup2(2, 1)
os.read(0, 1)  # the starting gun: stdin reaches EOF for every racer at the same instant
sys.exit(llmqueue.main(sys.argv[2:]))
"""


class Racer(DaemonProc):
    """A daemon whose interpreter start-up is done before the race: it imports llmqueue, says
    ready, and runs the ``llmqueue`` entry point (``main``) when the starting gun fires."""

    def spawn(self, gun: int) -> None:
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", RACER, MODULE, *self.flags()],
                                         stdin=gun, stdout=subprocess.PIPE, stderr=err)

    def on_your_marks(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        assert self.proc.stdout.readline() == b"ready\n", self.stderr()
        self.proc.stdout.close()


def test_socket_two_daemons_started_at_the_same_instant_end_with_exactly_one_serving() -> None:
    """The start race, 5 rounds: two daemons released at the same instant on one agent dir end
    with exactly one alive and serving the socket; the other exits 0.  Stopping the survivor
    removes the socket (it was serving its own)."""
    for _ in range(5):
        first = Racer()
        second = Racer(first.agent_dir)
        with first, second:
            gun_r, gun_w = os.pipe()
            try:
                first.spawn(gun_r)
                second.spawn(gun_r)
                first.on_your_marks()
                second.on_your_marks()
            finally:
                os.close(gun_r)
                os.close(gun_w)  # fire
            wait_for(lambda: not first.alive() or not second.alive(), timeout=10.0)
            loser, winner = (first, second) if not first.alive() else (second, first)
            assert loser.proc is not None and loser.proc.returncode == 0, loser.stderr()
            time.sleep(0.05)
            assert winner.alive(), f"no daemon survived the race: {winner.stderr()}"
            with Peer(winner.socket_path) as p:
                assert p.ask(acquire(K, "A"))["op"] == "granted"
            assert winner.alive() and not loser.alive()
            assert winner.proc is not None
            winner.proc.send_signal(signal.SIGTERM)
            assert winner.wait_exit() == 0
            assert not os.path.exists(winner.socket_path), "the survivor was not serving its own socket"


def test_socket_a_missing_agent_dir_is_created_0700_and_the_socket_is_0600() -> None:
    """A missing agent dir is created 0700 (whatever the umask); the socket is 0600."""
    parent = short_tmpdir()
    agent_dir = os.path.join(parent, "agent")
    old_umask = os.umask(0o022)
    try:
        d = DaemonProc(agent_dir, inject_idle_exit=False)
        d.stderr_path = os.path.join(parent, "stderr.txt")  # the agent dir does not exist yet
        with d:
            d.start()
            assert stat.S_IMODE(os.stat(agent_dir).st_mode) == 0o700
            st = os.lstat(d.socket_path)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    finally:
        os.umask(old_umask)
        shutil.rmtree(parent, ignore_errors=True)


NOBODY = 65534
INTRUDER = r"""
import json, socket, sys
path, key, patience = sys.argv[1], sys.argv[2], float(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(path)
except OSError as e:
    print("connect-failed", e.errno); sys.exit(0)
s.settimeout(patience)  # first, say nothing: a peer refused at accept sees EOF right away
try:
    early = s.recv(65536)
except socket.timeout:
    early = None
except OSError:
    early = b""
if early is not None:
    print("closed" if not early else "unexpected " + early.decode()); sys.exit(0)
s.settimeout(3.0)
try:
    s.sendall(json.dumps({"op": "acquire", "queueKey": key, "sessionKey": "intruder"}).encode() + b"\n")
    data = s.recv(65536)
except socket.timeout:
    print("open"); sys.exit(0)
except OSError:
    data = b""
print("served " + data.decode().strip() if data else "closed after a request")
"""


def interpreter_for(uid: int) -> Optional[List[str]]:
    """A setpriv command line running a Python that ``uid`` can execute, or None."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    for python in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if not python:
            continue
        cmd = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", python]
        try:
            out = subprocess.run(cmd + ["-c", "import os; print(os.getuid())"],
                                 capture_output=True, text=True, timeout=30)
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip() == str(uid):
            return cmd
    return None


def test_socket_a_peer_of_another_uid_is_disconnected_at_accept() -> None:
    """SO_PEERCRED: a peer whose uid is neither the daemon's nor root is closed at accept, before
    any reply, and holds nothing.  The dir and socket are opened to everyone for the test, so the
    connect itself succeeds and only the daemon's check stands in the way; the same client as root
    is served (control)."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another user (setpriv --reuid)")
    cmd = interpreter_for(NOBODY)
    if cmd is None:
        pytest.skip("setpriv is unavailable, or no Python is executable as uid 65534")
    for d in started():
        os.chmod(d.agent_dir, 0o755)
        os.chmod(d.socket_path, 0o666)
        out = subprocess.run(cmd + ["-c", INTRUDER, d.socket_path, K, "3.0"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "closed", f"uid {NOBODY} was not disconnected at accept: {out.stdout!r}"
        everyone = [w["sessionKey"] for q in d.status() for w in q["holders"] + q["waiting"]]
        assert "intruder" not in everyone, "the other user's acquire was served"
        control = subprocess.run([sys.executable, "-c", INTRUDER, d.socket_path, K, "0.05"],
                                 capture_output=True, text=True, timeout=30)
        assert control.stdout.startswith("served "), control.stdout + control.stderr
        assert json.loads(control.stdout[len("served "):])["op"] == "granted"
        assert d.alive()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_socket_sigterm_and_sigint_exit_0_and_unlink_the_socket(signum: int) -> None:
    """SIGTERM and SIGINT stop the daemon cleanly, even with a holder connected: exit code 0 and
    the socket file removed."""
    for d in started():
        a = d.peer()
        assert a.ask(acquire(K, "A"))["op"] == "granted"
        assert d.proc is not None
        d.proc.send_signal(signum)
        code, _ = exits_within(d, 10.0)
        assert code == 0, d.stderr()
        assert not os.path.exists(d.socket_path)
        assert a.closed_by_daemon(1.0)


def test_an_idle_daemon_wakes_only_for_the_config_poll() -> None:
    """Issue 3: with nothing due -- no waiters, and a held lease whose TTL is far off -- the loop
    sleeps until the next timer; at the default flags that is the 1 s config poll, so the daemon
    wakes about once a second, never on a fixed short interval for the sweep."""
    import llmqueue as lq

    d = lq.Daemon(short_tmpdir(), idle_exit_ms=-1)  # default --sweep-ms 1000
    turns: list[float] = []
    original = d._turn

    def counting() -> None:
        original()
        turns.append(time.monotonic())

    d._turn = counting  # type: ignore[method-assign]
    d.bind()
    t = threading.Thread(target=d.serve_forever, daemon=True)
    t.start()
    try:
        with Peer(d.socket_path) as p:
            assert p.ask({"op": "acquire", "queueKey": "http://127.0.0.1:9/v1", "sessionKey": "A"})["op"] == "granted"
            quiet_from = time.monotonic()
            time.sleep(3.2)
            woken = [x for x in turns if x > quiet_from]
            assert 2 <= len(woken) <= 4, woken  # ~1 per second: the poll, nothing else
    finally:
        d.stop()
        t.join(5)


def test_idle_exit_a_reload_that_shortens_the_delay_applies_to_a_pending_exit() -> None:
    """The last client left with daemonIdleExitMs 10^9 pending; an edit to 0 exits at once."""
    with DaemonProc(config={"defaults": {"daemonIdleExitMs": 10**9}}, inject_idle_exit=False) as d:
        d.start()
        with d.peer() as p:
            p.ask(acquire(K, "A"))
        time.sleep(0.3)
        assert d.alive()
        d.write_config({"defaults": {"daemonIdleExitMs": 0}})
        assert d.wait_exit(timeout=RELOAD_TIMEOUT) == 0
        assert not os.path.exists(d.socket_path)


def test_idle_exit_rearming_never_piles_up_stale_timers() -> None:
    """Every counted client that leaves re-arms the exit; the timer heap stays small."""
    import llmqueue as lq

    d = lq.Daemon(short_tmpdir(), sweep_ms=20, idle_exit_ms=600_000)
    d.bind()
    t = threading.Thread(target=d.serve_forever, daemon=True)
    t.start()
    try:
        for i in range(300):
            with Peer(d.socket_path) as p:
                assert p.ask({"op": "renew"}) == {"op": "ok"}  # counted, then gone
        with Peer(d.socket_path) as p:
            p.ask({"op": "status"})
        assert len(d._timer_heap) <= 2 * len(d._timers) + 17
    finally:
        d.stop()
        t.join(5)


def test_idle_exit_waits_for_requests_already_received_but_not_yet_handled() -> None:
    """The last counted client leaves while another peer's acquire sits behind a long run of
    input the daemon is still working through: it is served, not dropped with the daemon."""
    with DaemonProc(config={"defaults": {"daemonIdleExitMs": 0}}, inject_idle_exit=False) as d:
        d.start()
        a, b = d.peer(), d.peer(timeout=30)
        a.ask(acquire(K, "A"))
        sender = threading.Thread(target=b.send, args=(b"\n" * 400_000 + json.dumps(acquire(K, "B")).encode() + b"\n",),
                                  daemon=True)
        sender.start()
        time.sleep(0.05)
        a.send({"op": "bye"})
        assert b.recv()["op"] == "granted"
        sender.join(10)
