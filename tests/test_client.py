"""The client contract: ``Client``, ``Lease``, ``Session`` and the ``status`` / ``run`` commands.

Against a real daemon (started by the harness, or by the client itself on demand): autostart,
acquire and release, beats on the lease's own terms (keyed while active, paused inside
``blocking()`` with the bare heartbeat keeping the TTL), ``granted: false`` marking a lease lost
and ``ensure()`` re-queueing, Session grace and abort, fail-open and fail-closed, the queue-wait
warning, position reports, and many threads sharing one Client.

Against a scripted fake daemon (a unix socket whose replies the test writes): reply matching
(a grant for someone else is dropped, never buffered), beat periods taken from the granted
terms (and from the client's own config when the daemon sends none), and ``close()`` sending
``bye``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

import pytest

import llmqueue as lq
from tests.harness import MODULE, QUEUE_KEY, DaemonProc, Peer, short_tmpdir, started, wait_for

K = QUEUE_KEY


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    yield from started()


def client_for(d: DaemonProc, **kwargs: Any) -> lq.Client:
    return lq.Client(d.agent_dir, autostart=False, **kwargs)


# -- a scripted fake daemon ---------------------------------------------------------------------


class FakeDaemon:
    """A unix socket that records every request line and answers through ``reply(msg, send)``."""

    def __init__(self, reply: Callable[[dict[str, Any], Callable[[dict[str, Any]], None]], None]) -> None:
        self.dir = short_tmpdir()
        self.path = os.path.join(self.dir, "llm-queue.sock")
        self.reply = reply
        self.lines: list[tuple[float, dict[str, Any]]] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.conns: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            t = threading.Thread(target=self._talk, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _talk(self, conn: socket.socket) -> None:
        buf = b""

        def send(obj: dict[str, Any]) -> None:
            try:
                conn.sendall(json.dumps(obj).encode() + b"\n")
            except OSError:
                pass

        while True:
            try:
                chunk = conn.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)  # the client sends nothing else: a failure here is a finding
                self.lines.append((time.monotonic(), msg))
                self.reply(msg, send)

    def ops(self, op: str) -> list[tuple[float, dict[str, Any]]]:
        return [(t, m) for t, m in self.lines if m.get("op") == op]

    def close(self) -> None:
        """Wake every thread blocked on a socket (shutdown) and wait for it before closing: a
        socket closed under a blocked thread frees its descriptor number for the next test's
        sockets, and that thread could then read their bytes."""
        for s in [self.listener, *self.conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in [self.thread, *self.threads]:
            t.join(5)
        self.listener.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def fake_factory() -> Iterator[Callable[..., FakeDaemon]]:
    made: list[FakeDaemon] = []

    def make(reply: Callable[[dict[str, Any], Callable[[dict[str, Any]], None]], None]) -> FakeDaemon:
        f = FakeDaemon(reply)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def granting(terms: Optional[dict[str, int]] = None) -> Callable[[dict[str, Any], Callable[[dict[str, Any]], None]], None]:
    """A fake daemon that grants every acquire at once with ``terms`` and answers renews."""
    def reply(msg: dict[str, Any], send: Callable[[dict[str, Any]], None]) -> None:
        if msg["op"] == "acquire":
            send(dict({"op": "granted", "queueKey": msg["queueKey"], "sessionKey": msg["sessionKey"]}, **(terms or {})))
        elif msg["op"] == "renew":
            if "queueKey" in msg:
                send({"op": "ok", "queueKey": msg["queueKey"], "sessionKey": msg["sessionKey"], "granted": True})
            else:
                send({"op": "ok"})
        elif msg["op"] == "status":
            send({"op": "status", "queues": []})
    return reply


# -- acquire and reply matching -------------------------------------------------------------------


def test_acquire_returns_a_lease_with_the_terms_of_the_granted_reply(daemon: DaemonProc) -> None:
    with client_for(daemon) as c:
        lease = c.acquire(K, "A")
        assert lease.held and lease.queued and lease.seq == 1
        assert lease.terms == lq.LeaseTerms(30000, 30000)
        assert daemon.holders(K) == ["A"]
        lease.release()
        wait_for(lambda: daemon.holders(K) == [])


def test_a_grant_for_another_session_is_dropped_never_buffered(fake_factory: Callable[..., FakeDaemon]) -> None:
    """The client resolves acquire only on a granted reply naming its own queueKey and
    sessionKey; a stray grant and a release's ok are dropped, not kept for a later request."""
    def reply(msg: dict[str, Any], send: Callable[[dict[str, Any]], None]) -> None:
        if msg["op"] == "acquire" and msg["sessionKey"] == "A":
            send({"op": "ok"})
            send({"op": "granted", "queueKey": K, "sessionKey": "B", "leaseTtlMs": 30000, "idleYieldMs": 0})
            send({"op": "granted", "queueKey": "http://elsewhere/v1", "sessionKey": "A"})
            time.sleep(0.2)
            send({"op": "granted", "queueKey": K, "sessionKey": "A", "leaseTtlMs": 30000, "idleYieldMs": 0})
    fake = fake_factory(reply)
    with lq.Client(fake.dir, autostart=False) as c:
        started_at = time.monotonic()
        lease = c.acquire(K, "A")
        assert time.monotonic() - started_at >= 0.2  # the stray grant did not resolve it
        assert lease.session_key == "A" and lease.held
        outcome: list[Any] = []

        def late() -> None:
            try:
                outcome.append(c.acquire(K, "B", timeout=0.5))
            except TimeoutError as e:
                outcome.append(e)

        t = threading.Thread(target=late, daemon=True)
        t.start()
        t.join(2)
        # B's stray grant arrived before B asked: it was not buffered for it.
        assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError)


def test_beats_follow_the_granted_terms_not_the_clients_config(fake_factory: Callable[..., FakeDaemon]) -> None:
    fake = fake_factory(granting({"leaseTtlMs": 1200, "idleYieldMs": 0}))
    with open(os.path.join(fake.dir, "llm-queue.json"), "w") as f:
        json.dump({"defaults": {"leaseTtlMs": 30000, "idleYieldMs": 30000}}, f)
    with lq.Client(fake.dir, autostart=False) as c:
        lease = c.acquire(K, "A")
        assert lease.terms == lq.LeaseTerms(1200, 0) and lease.terms.refresh_period_ms() == 400
        time.sleep(1.5)
        beats = [t for t, m in fake.ops("renew") if m.get("sessionKey") == "A"]
        assert 2 <= len(beats) <= 5, beats  # every ~400 ms, not every 10 s (the config's copy)


def test_a_daemon_that_sends_no_terms_leaves_the_clients_config_as_fallback(
        fake_factory: Callable[..., FakeDaemon]) -> None:
    fake = fake_factory(granting(None))
    with open(os.path.join(fake.dir, "llm-queue.json"), "w") as f:
        json.dump({"defaults": {"leaseTtlMs": 1500, "idleYieldMs": 600}}, f)
    with lq.Client(fake.dir, autostart=False) as c:
        lease = c.acquire(K, "A")
        assert lease.terms == lq.LeaseTerms(1500, 600)
        assert lease.terms.refresh_period_ms() == 300  # min(500, 600 / 2)


def test_close_says_bye(fake_factory: Callable[..., FakeDaemon]) -> None:
    fake = fake_factory(granting({"leaseTtlMs": 30000, "idleYieldMs": 0}))
    c = lq.Client(fake.dir, autostart=False)
    c.acquire(K, "A")
    c.close()
    wait_for(lambda: fake.ops("bye"))


# -- leases on their terms ---------------------------------------------------------------------------


def test_a_held_lease_is_kept_alive_by_beats_past_several_ttls() -> None:
    for d in started(config={"defaults": {"leaseTtlMs": 1000, "idleYieldMs": 300}}):
        with client_for(d) as c:
            lease = c.acquire(K, "A")
            with d.peer() as waiter:
                waiter.send({"op": "acquire", "queueKey": K, "sessionKey": "W"})
                time.sleep(2.5)  # 2.5 TTLs and 8 idle windows, with a waiter queued
                assert d.holders(K) == ["A"] and lease.held and lease.beat()
                lease.release()
                assert waiter.recv()["sessionKey"] == "W"


def test_inside_blocking_the_keyed_beat_pauses_and_the_bare_heartbeat_keeps_the_ttl() -> None:
    for d in started(config={"defaults": {"leaseTtlMs": 1000, "idleYieldMs": 400}}):
        with client_for(d) as c:
            lease = c.acquire(K, "A")
            with lease.blocking():
                time.sleep(1.3)  # past the TTL: only the bare heartbeat keeps it
                assert d.holders(K) == ["A"]  # no waiter: a lone holder is never yielded
                with d.peer() as waiter:
                    waiter.send({"op": "acquire", "queueKey": K, "sessionKey": "W"})
                    assert waiter.recv(timeout=3)["sessionKey"] == "W"  # idle: yielded to the waiter
            assert lease.beat() is False
            assert lease.lost and not lease.held


def test_a_lost_lease_requeues_before_it_streams() -> None:
    # W (a raw peer that never beats) must hold through the check: a TTL it outlives on a loaded
    # machine would hand the slot to A before A is ever seen waiting.
    for d in started(config={"defaults": {"leaseTtlMs": 10000, "idleYieldMs": 300}}):
        with client_for(d) as c:
            lease = c.acquire(K, "A")
            with d.peer() as waiter:
                with lease.blocking():  # parked: the keyed beat pauses, the slot goes idle
                    waiter.send({"op": "acquire", "queueKey": K, "sessionKey": "W"})
                    waiter.recv(timeout=3)
                done: list[lq.Lease] = []
                # The next request's beat learns the slot is gone, and queues before streaming.
                t = threading.Thread(target=lambda: done.append(lease.ensure()), daemon=True)
                t.start()
                wait_for(lambda: d.waiting(K) == ["A"])
                assert not done
                waiter.ask({"op": "release", "queueKey": K, "sessionKey": "W"})
                t.join(5)
            assert done and lease.held and d.holders(K) == ["A"]


def test_a_beat_is_answered_by_its_own_reply_not_by_an_earlier_renews(
        fake_factory: Callable[..., FakeDaemon]) -> None:
    """Replies to keyed renews come in the order the renews went out.  The park mark's reply
    (still held, when it was sent) arrives late, after the slot went to a waiter and the next
    request's beat asked again: that beat must get its own answer (lost) and queue again, not
    the park's stale ``granted: true``, or the request streams on a slot it no longer holds."""
    held = {"A": True}
    deferred: list[dict[str, Any]] = []
    state: dict[str, Any] = {"park": None, "timer": None}

    def flush(send: Callable[[dict[str, Any]], None]) -> None:
        send(state["park"])
        time.sleep(0.3)  # the stale reply alone, for a while: no later one marks the lease lost meanwhile
        for m in deferred:
            send(m)
        deferred.clear()
        state["park"] = False  # answered: later renews are answered at once

    def reply(msg: dict[str, Any], send: Callable[[dict[str, Any]], None]) -> None:
        if msg["op"] == "acquire":
            held["A"] = True
            send({"op": "granted", "queueKey": K, "sessionKey": "A", "leaseTtlMs": 30000, "idleYieldMs": 30000})
        elif msg["op"] == "renew" and "queueKey" in msg:
            answer = {"op": "ok", "queueKey": K, "sessionKey": "A", "granted": held["A"]}
            if msg.get("parked") and state["park"] is None:
                state["park"] = answer  # the park's reply is slow to come
                held["A"] = False  # and meanwhile a waiter took the parked slot
            elif state["park"]:
                deferred.append(answer)
                if state["timer"] is None:  # every beat sent at the unpark is in before the park's reply
                    state["timer"] = threading.Timer(0.3, flush, (send,))
                    state["timer"].start()
            else:
                send(answer)
        elif msg["op"] == "renew":
            send({"op": "ok"})
    fake = fake_factory(reply)
    with lq.Client(fake.dir, autostart=False) as c:
        lease = c.acquire(K, "A")
        with lease.blocking():
            wait_for(lambda: any(m.get("parked") for _, m in fake.ops("renew")))
        lease.ensure(timeout=5)
        assert len(fake.ops("acquire")) == 2  # it learned the slot was gone, and queued again
        assert lease.held


# -- sessions: turn-based affinity --------------------------------------------------------------------


def test_session_releases_three_seconds_after_the_run_settles_and_a_rerun_in_the_grace_is_switch_free(
        daemon: DaemonProc) -> None:
    with client_for(daemon) as c:
        s = c.session(K, "S")
        with s.run() as first:
            pass
        settled = time.monotonic()
        time.sleep(0.5)
        assert daemon.holders(K) == ["S"]  # held through the grace
        with s.run() as second:
            assert second is first
        assert daemon.queue(K)["switches"] == 0 and daemon.queue(K)["grants"] == 1
        wait_for(lambda: daemon.holders(K) == [], timeout=6)
        assert time.monotonic() - settled >= 3.0  # the grace counts from the last settle


def test_session_close_releases_at_once(daemon: DaemonProc) -> None:
    with client_for(daemon) as c:
        s = c.session(K, "S")
        with s.run():
            pass
        s.close()
        wait_for(lambda: daemon.holders(K) == [], timeout=1)


def test_session_abort_drops_a_queued_request_and_its_acquire_raises_cancelled(daemon: DaemonProc) -> None:
    with client_for(daemon) as c, daemon.peer() as holder:
        holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})
        s = c.session(K, "S", role="child")
        errors: list[BaseException] = []

        def run() -> None:
            try:
                with s.run():
                    pass
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        wait_for(lambda: daemon.waiting(K) == ["S"])
        s.abort()
        t.join(5)
        assert errors and isinstance(errors[0], lq.Cancelled)
        wait_for(lambda: daemon.waiting(K) == [])


def test_session_abort_releases_a_held_slot_at_once_and_an_error_in_the_run_aborts(daemon: DaemonProc) -> None:
    with client_for(daemon) as c:
        s = c.session(K, "S")
        s.start()
        s.abort()
        wait_for(lambda: daemon.holders(K) == [], timeout=1)
        with pytest.raises(ZeroDivisionError):
            with s.run():
                1 / 0
        wait_for(lambda: daemon.holders(K) == [], timeout=1)


def test_session_tool_pauses_the_beat_only_for_blocking_tools() -> None:
    for d in started(config={"defaults": {"blockingTools": ["wait_for_child"]}}):
        with client_for(d) as c:
            s = c.session(K, "S")
            with s.run() as lease:
                with s.tool("wait_for_child"):
                    assert lease._blocking == 1
                with s.tool("read_file"):
                    assert lease._blocking == 0
            s.close()


# -- fail-open ----------------------------------------------------------------------------------------


def test_no_daemon_fail_open_goes_ahead_unqueued_with_one_warning() -> None:
    d = short_tmpdir()
    warnings: list[str] = []
    c = lq.Client(d, autostart=False, on_warning=warnings.append)
    first = c.acquire(K, "A")
    second = c.acquire(K, "B")
    assert not first.queued and not second.queued
    assert len(warnings) == 1 and "unqueued" in warnings[0]
    first.release()  # a no-op, and no error
    c.close()


def test_no_daemon_fail_closed_raises() -> None:
    c = lq.Client(short_tmpdir(), autostart=False, fail_open=False)
    with pytest.raises(lq.DaemonUnavailable):
        c.acquire(K, "A")
    c.close()


def test_fail_open_is_read_from_the_config() -> None:
    d = short_tmpdir()
    with open(os.path.join(d, "llm-queue.json"), "w") as f:
        json.dump({"defaults": {"failOpen": False}}, f)
    for dm in started(agent_dir=d, config={"defaults": {"failOpen": False}}):
        c = client_for(dm)
        c.acquire(K, "A").release()
        assert c.fail_open is False
        c.close()


def test_a_daemon_that_dies_mid_wait_releases_the_waiter_to_its_work(daemon: DaemonProc) -> None:
    with client_for(daemon, on_warning=lambda m: None) as c, daemon.peer() as holder:
        holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})
        got: list[lq.Lease] = []
        t = threading.Thread(target=lambda: got.append(c.acquire(K, "W")), daemon=True)
        t.start()
        wait_for(lambda: daemon.waiting(K) == ["W"])
        assert daemon.proc is not None
        daemon.proc.kill()
        t.join(5)
        assert got and not got[0].queued


def test_a_daemon_that_dies_mid_wait_with_fail_closed_raises(daemon: DaemonProc) -> None:
    with client_for(daemon, fail_open=False) as c, daemon.peer() as holder:
        holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                c.acquire(K, "W")
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        wait_for(lambda: daemon.waiting(K) == ["W"])
        assert daemon.proc is not None
        daemon.proc.kill()
        t.join(5)
        assert errors and isinstance(errors[0], lq.DaemonUnavailable)


# -- autostart ------------------------------------------------------------------------------------


def test_the_first_acquire_starts_a_daemon_and_racing_clients_share_one() -> None:
    d = short_tmpdir()
    with open(os.path.join(d, "llm-queue.json"), "w") as f:
        json.dump({"defaults": {"daemonIdleExitMs": 200}}, f)
    clients = [lq.Client(d) for _ in range(4)]
    leases: list[lq.Lease] = []
    lock = threading.Lock()

    def go(c: lq.Client, n: int) -> None:
        lease = c.acquire(K, f"s{n}", timeout=20)
        with lock:
            leases.append(lease)
        time.sleep(0.05)
        lease.release()

    threads = [threading.Thread(target=go, args=(c, n)) for n, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert len(leases) == 4 and all(l.queued for l in leases)  # all queued through one daemon
        seqs = sorted(l.seq or 0 for l in leases)
        assert seqs == [1, 2, 3, 4]  # one queue, one daemon: grant numbers 1..4
    finally:
        for c in clients:
            c.close()
    wait_for(lambda: not os.path.exists(os.path.join(d, "llm-queue.sock")), timeout=20)  # it idle-exits


# -- waiting: warning and position --------------------------------------------------------------------


def test_a_parent_waiting_past_queue_timeout_is_warned_once_and_stays_queued() -> None:
    for d in started(config={"defaults": {"queueTimeoutMs": 200}}):
        warnings: list[str] = []
        with client_for(d, on_warning=warnings.append) as c, d.peer() as holder:
            holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})
            got: list[lq.Lease] = []
            t = threading.Thread(target=lambda: got.append(c.acquire(K, "P")), daemon=True)
            t.start()
            time.sleep(0.6)
            assert len(warnings) == 1 and "P" in warnings[0]
            assert d.waiting(K) == ["P"] and not got  # still queued, not passed through
            holder.ask({"op": "release", "queueKey": K, "sessionKey": "H"})
            t.join(5)
            assert got and got[0].held


def test_a_child_is_never_warned_and_never_passes_through() -> None:
    for d in started(config={"defaults": {"queueTimeoutMs": 100}}):
        warnings: list[str] = []
        with client_for(d, on_warning=warnings.append) as c, d.peer() as holder:
            holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})
            t = threading.Thread(target=lambda: c.acquire(K, "C", role="child"), daemon=True)
            t.start()
            time.sleep(0.5)
            assert warnings == [] and d.waiting(K) == ["C"]
            holder.ask({"op": "release", "queueKey": K, "sessionKey": "H"})
            t.join(5)


def test_position_is_reported_at_300_ms_and_then_every_2_s(daemon: DaemonProc) -> None:
    seen: list[tuple[float, int]] = []
    start = time.monotonic()
    with client_for(daemon, on_position=lambda lease, pos: seen.append((time.monotonic() - start, pos))) as c, \
            daemon.peer() as holder, daemon.peer() as ahead:
        holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})
        ahead.send({"op": "acquire", "queueKey": K, "sessionKey": "X"})
        wait_for(lambda: daemon.waiting(K) == ["X"])
        start = time.monotonic()
        t = threading.Thread(target=lambda: c.acquire(K, "P"), daemon=True)
        t.start()
        time.sleep(2.6)
        assert [p for _, p in seen] == [2, 2]
        assert 0.25 <= seen[0][0] <= 0.6 and 2.1 <= seen[1][0] <= 2.6
        ahead.close()
        holder.ask({"op": "release", "queueKey": K, "sessionKey": "H"})
        t.join(5)


# -- many threads, one client ------------------------------------------------------------------------


def test_threads_sharing_one_client_never_overlap(daemon: DaemonProc) -> None:
    intervals: list[tuple[float, float]] = []
    lock = threading.Lock()
    with client_for(daemon) as c:
        def work(n: int) -> None:
            for _ in range(10):
                with c.acquire(K, f"t{n}", role="child" if n % 2 else "parent", timeout=30):
                    a = time.monotonic()
                    time.sleep(0.002)
                    b = time.monotonic()
                    with lock:
                        intervals.append((a, b))
        threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert len(intervals) == 60
    intervals.sort()
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(intervals, intervals[1:]))


# -- the commands ---------------------------------------------------------------------------------


def default_sigint() -> None:
    """In the child before exec: Ctrl-C as a terminal delivers it, whatever this process inherited
    (a job started in the background, as CI may be, has SIGINT ignored, and Python then never
    raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(*args: str, timeout: float = 30, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, MODULE, *args], capture_output=True, text=True, timeout=timeout, **kwargs)


def test_status_never_starts_a_daemon() -> None:
    d = short_tmpdir()
    out = run_cli("status", "--agent-dir", d)
    assert out.returncode == 1 and "no daemon" in out.stderr
    time.sleep(0.2)
    assert not os.path.exists(os.path.join(d, "llm-queue.sock"))


def test_status_shows_slots_depth_switches_and_people(daemon: DaemonProc) -> None:
    a, b, c2 = daemon.peer(), daemon.peer(), daemon.peer()
    a.ask({"op": "acquire", "queueKey": K, "sessionKey": "A", "group": "team"})
    b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "role": "child"})
    c2.send({"op": "acquire", "queueKey": K, "sessionKey": "C"})
    wait_for(lambda: len(daemon.waiting(K)) == 2)
    out = run_cli("status", "--agent-dir", daemon.agent_dir)
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert lines[0] == f"{K}  1/1  waiting: 1 parent, 1 child  switches: 0"
    assert lines[1].startswith("  grants 1  queued 2  idle-yields 0  park-yields 0  handbacks 0  ttl-evictions 0  "
                               "longest wait: parent ")
    assert lines[2:] == ["  holds  A parent [team]", "  waits  B child", "  waits  C parent"]


def test_status_counters_in_the_reply_and_in_prometheus_format() -> None:
    """Additive status fields: grants, queued, idle yields, TTL evictions, and the current
    longest wait per tier; ``--format prometheus`` prints them as text exposition."""
    for d in started(config={"defaults": {"leaseTtlMs": 1000, "idleYieldMs": 200}}):
        a, b, c2 = d.peer(), d.peer(), d.peer()
        a.ask({"op": "acquire", "queueKey": K, "sessionKey": "A", "activity": True})
        b.send({"op": "acquire", "queueKey": K, "sessionKey": "B", "role": "child"})
        assert b.recv(timeout=3)["sessionKey"] == "B"  # A went idle: yielded to B
        c2.send({"op": "acquire", "queueKey": K, "sessionKey": "C"})  # B never beats: evicted
        assert c2.recv(timeout=4)["sessionKey"] == "C"
        waiter = d.peer()
        waiter.send({"op": "acquire", "queueKey": K, "sessionKey": "W", "role": "child"})
        time.sleep(0.3)
        q = d.queue(K)
        assert (q["grants"], q["switches"], q["queued"], q["idleYields"], q["ttlEvictions"]) == (3, 2, 3, 1, 1)
        assert q["longestWaitMs"]["parent"] == 0 and 250 <= q["longestWaitMs"]["child"] <= 5000
        out = run_cli("status", "--format", "prometheus", "--agent-dir", d.agent_dir)
        assert out.returncode == 0
        text = out.stdout
        assert "# TYPE llmqueue_grants_total counter" in text
        assert f'llmqueue_grants_total{{queue="{K}"}} 3' in text
        assert f'llmqueue_idle_yields_total{{queue="{K}"}} 1' in text
        assert f'llmqueue_park_yields_total{{queue="{K}"}} 0' in text
        assert f'llmqueue_handback_yields_total{{queue="{K}"}} 0' in text
        assert f'llmqueue_ttl_evictions_total{{queue="{K}"}} 1' in text
        assert f'llmqueue_waiting{{queue="{K}",role="child"}} 1' in text
        assert f'llmqueue_max_streams{{queue="{K}"}} 1' in text


def test_status_watch_redraws_in_place_until_interrupted(daemon: DaemonProc) -> None:
    proc = subprocess.Popen([sys.executable, MODULE, "status", "--watch", "0.1", "--agent-dir", daemon.agent_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint)
    assert proc.stdout is not None
    seen = b""
    deadline = time.monotonic() + 20
    while seen.count(b"\x1b[H\x1b[2J") < 3 and time.monotonic() < deadline:
        seen += os.read(proc.stdout.fileno(), 65536)  # three redraws, however slow the start
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert seen.count(b"\x1b[H\x1b[2J") >= 3


def test_run_holds_the_slot_while_the_command_runs_and_exits_with_its_status(daemon: DaemonProc) -> None:
    script = ("import json,socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]);"
              "s.sendall(b'{\"op\":\"status\"}\\n'); print(s.recv(65536).decode()); sys.exit(7)")
    out = run_cli("run", "--agent-dir", daemon.agent_dir, "--queue", K, "--session", "R", "--group", "g",
                  "--", sys.executable, "-c", script, daemon.socket_path)
    assert out.returncode == 7, out.stderr
    reply = json.loads(out.stdout)
    (q,) = [q for q in reply["queues"] if q["queueKey"] == K]
    assert q["holders"] == [{"sessionKey": "R", "role": "parent", "group": "g"}]
    wait_for(lambda: daemon.holders(K) == [])


def test_run_waits_for_the_slot_and_ctrl_c_while_queued_cancels_cleanly(daemon: DaemonProc) -> None:
    with daemon.peer() as holder:
        holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})
        proc = subprocess.Popen([sys.executable, MODULE, "run", "--agent-dir", daemon.agent_dir, "--queue", K,
                                 "--session", "R", "--", "true"], stderr=subprocess.PIPE, text=True,
                                preexec_fn=default_sigint)
        wait_for(lambda: daemon.waiting(K) == ["R"])
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 130 and "cancelled" in err
        wait_for(lambda: daemon.waiting(K) == [])
        assert daemon.holders(K) == ["H"]


def test_run_forwards_signals_to_the_command_and_releases_when_it_exits(daemon: DaemonProc) -> None:
    proc = subprocess.Popen([sys.executable, MODULE, "run", "--agent-dir", daemon.agent_dir, "--queue", K,
                             "--session", "R", "--", "sleep", "30"])
    wait_for(lambda: daemon.holders(K) == ["R"])
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 128 + signal.SIGTERM
    wait_for(lambda: daemon.holders(K) == [])


def test_run_fail_closed_exits_75_without_running_the_command() -> None:
    d = short_tmpdir()
    marker = os.path.join(d, "ran")
    env = dict(os.environ)
    out = run_cli("run", "--agent-dir", os.path.join(d, "nowhere", "x" * 80), "--queue", K, "--fail-closed",
                  "--", "touch", marker, env=env)
    assert out.returncode == 75 and not os.path.exists(marker), out.stderr


def test_run_fail_open_runs_the_command_unqueued_with_a_warning() -> None:
    d = short_tmpdir()
    marker = os.path.join(d, "ran")
    out = run_cli("run", "--agent-dir", os.path.join(d, "nowhere", "x" * 80), "--queue", K, "--", "touch", marker)
    assert out.returncode == 0 and os.path.exists(marker)
    assert "unqueued" in out.stderr


# -- review findings: shared sessions, races, the idle-exit instant ----------------------------------


def test_acquires_without_a_session_key_are_sessions_of_their_own(daemon: DaemonProc) -> None:
    """Two threads of one Client that name no session must not share one slot."""
    with client_for(daemon) as c:
        first = c.acquire(K)
        got: list[lq.Lease] = []
        t = threading.Thread(target=lambda: got.append(c.acquire(K)), daemon=True)
        t.start()
        wait_for(lambda: len(daemon.waiting(K)) == 1)
        assert not got and first.session_key not in daemon.waiting(K)
        first.release()
        t.join(5)
        assert got and got[0].session_key != first.session_key


def test_two_leases_of_one_session_release_the_slot_only_when_both_let_go(daemon: DaemonProc) -> None:
    with client_for(daemon) as c:
        one = c.acquire(K, "S")
        two = c.acquire(K, "S")  # the same session from another thread: re-granted, one slot
        one.release()
        assert daemon.holders(K) == ["S"] and two.held and two.beat()
        two.release()
        wait_for(lambda: daemon.holders(K) == [])


def test_a_lost_slot_marks_every_lease_of_the_session_lost_and_ensure_requeues(daemon: DaemonProc) -> None:
    with client_for(daemon) as c, daemon.peer() as other:
        one = c.acquire(K, "S")
        two = c.acquire(K, "S")
        other.send({"op": "cancel", "queueKey": K, "sessionKey": "S"})  # the slot is gone
        other.ask({"op": "acquire", "queueKey": K, "sessionKey": "O"})
        assert one.beat() is False
        assert one.lost and two.lost
        done: list[lq.Lease] = []
        t = threading.Thread(target=lambda: done.append(two.ensure()), daemon=True)
        t.start()
        wait_for(lambda: daemon.waiting(K) == ["S"])  # queued again before streaming
        other.ask({"op": "release", "queueKey": K, "sessionKey": "O"})
        t.join(5)
        assert done and two.held


def test_ensure_learns_a_lost_slot_from_its_own_beat(daemon: DaemonProc) -> None:
    """Even before the background beat noticed, the request's own beat sees the slot is gone."""
    with client_for(daemon) as c, daemon.peer() as other:
        lease = c.acquire(K, "S")
        other.send({"op": "cancel", "queueKey": K, "sessionKey": "S"})
        other.ask({"op": "acquire", "queueKey": K, "sessionKey": "O"})
        assert not lease.lost  # no beat has told it yet
        done: list[lq.Lease] = []
        t = threading.Thread(target=lambda: done.append(lease.ensure()), daemon=True)
        t.start()
        wait_for(lambda: daemon.waiting(K) == ["S"])
        assert not done
        other.ask({"op": "release", "queueKey": K, "sessionKey": "O"})
        t.join(5)
        assert done and lease.held


def test_a_cancel_that_races_the_grant_wins(fake_factory: Callable[..., FakeDaemon]) -> None:
    """An abort that lands after the daemon granted but before the acquire returned: the
    acquire raises Cancelled, and the slot is given back (a second cancel reaches the daemon)."""
    gate = threading.Event()

    def reply(msg: dict[str, Any], send: Callable[[dict[str, Any]], None]) -> None:
        if msg["op"] == "acquire":
            def later() -> None:
                gate.wait(5)
                send({"op": "granted", "queueKey": msg["queueKey"], "sessionKey": msg["sessionKey"],
                      "leaseTtlMs": 30000, "idleYieldMs": 0})
            threading.Thread(target=later, daemon=True).start()
    fake = fake_factory(reply)
    with lq.Client(fake.dir, autostart=False) as c:
        errors: list[BaseException] = []

        def go() -> None:
            try:
                c.acquire(K, "S")
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=go, daemon=True)
        t.start()
        wait_for(lambda: fake.ops("acquire"))
        c.cancel(K, "S")
        gate.set()
        t.join(5)
        assert errors and isinstance(errors[0], lq.Cancelled)
        wait_for(lambda: len(fake.ops("cancel")) >= 1)


def test_a_closed_client_refuses_new_requests() -> None:
    c = lq.Client(short_tmpdir(), autostart=False)
    c.close()
    with pytest.raises(lq.LLMQueueError, match="closed"):
        c.acquire(K, "A")


def check_idle_exit_instant(threads: int, rounds: int) -> None:
    """Clients come and go against a daemon with daemonIdleExitMs 0: each one's connect may land
    in the very instant the daemon exits for the previous one.  None of them may run unqueued:
    a connection that dies before it ever answered is asked again, on a fresh daemon."""
    d = short_tmpdir()
    with open(os.path.join(d, "llm-queue.json"), "w") as f:
        json.dump({"defaults": {"daemonIdleExitMs": 0}}, f)
    unqueued: list[str] = []
    errors: list[BaseException] = []

    def churn(n: int) -> None:
        try:
            for i in range(rounds):
                with lq.Client(d, on_warning=unqueued.append) as c:
                    lease = c.acquire(f"http://127.0.0.1:9/{n}", f"s{n}-{i}", timeout=30)
                    if not lease.queued:
                        unqueued.append(f"s{n}-{i}")
                    lease.release()
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=churn, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not errors, errors
    assert unqueued == []
    # Every daemon exits: at once when its last client leaves, or, one spawned by a client that
    # found another daemon first (the race this test provokes), after the spec's floor for a
    # daemon whose spawner never connects.
    wait_for(lambda: not os.path.exists(os.path.join(d, "llm-queue.sock")),
             timeout=lq.NO_CLIENT_EXIT_FLOOR_MS / 1000.0 + 10.0)


def test_a_fresh_connection_greets_and_asks_in_one_read_so_an_idle_exit_cannot_fall_between() -> None:
    """A daemon with daemonIdleExitMs 0 handles what it has read, then exits if no counted request
    was among it.  If the client's greeting (a bare renew) and its acquire arrived in two reads,
    the daemon could answer the greeting and exit before the acquire came: the client, having
    heard an answer, would then run unqueued (fail-open).  They must arrive together."""
    d = short_tmpdir()
    path = os.path.join(d, "llm-queue.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    first_reads: list[list[str]] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:  # one read, as soon as anything arrives: what one write of the client holds
                    chunk = conn.recv(65536)
                except OSError:
                    continue
                msgs = [json.loads(line) for line in chunk.splitlines() if line.strip()]
                first_reads.append([m["op"] for m in msgs])
                out = b""
                for m in msgs:
                    if m["op"] == "renew":
                        out += json.dumps({"op": "ok"}).encode() + b"\n"
                    elif m["op"] == "acquire":
                        out += json.dumps({"op": "granted", "queueKey": m["queueKey"],
                                           "sessionKey": m["sessionKey"]}).encode() + b"\n"
                conn.sendall(out)
                if "acquire" in [m["op"] for m in msgs]:
                    time.sleep(1.0)  # counted: stays a moment, long enough to be heard
                # else: nothing counted was read, so it exits idle at once (the close)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    warnings: list[str] = []
    try:
        with lq.Client(d, autostart=False, on_warning=warnings.append) as c:
            lease = c.acquire(K, "A", timeout=10)
            assert lease.queued, warnings
            assert first_reads[0] == ["renew", "acquire"]
    finally:
        listener.close()
        t.join(5)


class ExitingDaemons(FakeDaemon):
    """A FakeDaemon whose first ``silent`` connections are closed unread, as daemons do that exit
    idle in the very instant a client connects; later ones are served (renew: ok, acquire:
    granted)."""

    def __init__(self, silent: int) -> None:
        self.silent = silent
        self.accepted = 0
        super().__init__(self._answer)

    @staticmethod
    def _answer(m: dict[str, Any], send: Callable[[dict[str, Any]], None]) -> None:
        if m["op"] == "acquire":
            send({"op": "granted", "queueKey": m["queueKey"], "sessionKey": m["sessionKey"]})
        else:
            send({"op": "ok"})

    def _talk(self, conn: socket.socket) -> None:
        self.accepted += 1
        if self.accepted <= self.silent:
            conn.close()
            return
        super()._talk(conn)


def test_a_client_asks_again_however_many_daemons_exit_as_it_connects() -> None:
    """Under churn, several daemons in a row may each exit idle the instant this client connects.
    Each such connection dies before answering anything, which proves no daemon ever took the
    request: the client asks again, and is queued, not let through unqueued."""
    fake = ExitingDaemons(silent=6)
    warnings: list[str] = []
    try:
        with lq.Client(fake.dir, autostart=False, on_warning=warnings.append) as c:
            lease = c.acquire(K, "A", timeout=10)
            assert lease.queued, warnings
            assert fake.accepted == 7
            lease.release()
    finally:
        fake.close()


def test_a_client_whose_every_connection_dies_unanswered_goes_ahead_unqueued() -> None:
    """Asking again is bounded by the time a daemon is given to start (``spawn_timeout``): a
    socket that only ever closes unanswered lets the request through (fail-open), with a warning."""
    fake = ExitingDaemons(silent=10**9)
    warnings: list[str] = []
    got: list[lq.Lease] = []
    try:
        c = lq.Client(fake.dir, autostart=False, spawn_timeout=0.5, on_warning=warnings.append)
        t = threading.Thread(target=lambda: got.append(c.acquire(K, "A")), daemon=True)
        t.start()
        t.join(30)
        assert got and not got[0].queued
        assert warnings and "proceeding unqueued" in warnings[0]
        assert fake.accepted > 3  # it did ask again, more than the old fixed count
        c.close()
    finally:
        fake.close()


def test_a_client_arriving_as_the_daemon_idle_exits_is_still_queued() -> None:
    check_idle_exit_instant(threads=3, rounds=6)


@pytest.mark.slow
def test_a_client_arriving_as_the_daemon_idle_exits_is_still_queued_stress() -> None:
    check_idle_exit_instant(threads=6, rounds=40)


# -- second review: shared sessions under timeouts, spellings, the launcher, close ---------------------


def test_a_timed_out_acquire_does_not_strand_another_threads_wait_for_the_same_session(daemon: DaemonProc) -> None:
    with client_for(daemon) as c, daemon.peer() as holder:
        holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})
        got: list[lq.Lease] = []
        patient = threading.Thread(target=lambda: got.append(c.acquire(K, "S")), daemon=True)
        patient.start()
        wait_for(lambda: daemon.waiting(K) == ["S"])
        with pytest.raises(TimeoutError):
            c.acquire(K, "S", timeout=0.3)  # the same session, an impatient thread
        assert daemon.waiting(K) == ["S"]  # the shared request stays queued
        holder.ask({"op": "release", "queueKey": K, "sessionKey": "H"})
        patient.join(5)
        assert got and got[0].held


def test_two_spellings_of_one_queue_in_one_session_share_one_count(daemon: DaemonProc) -> None:
    """The daemon counts a session's slot by its queue; so does the client, whatever spelling."""
    with client_for(daemon) as c, daemon.peer() as other:
        one = c.acquire(K + "/", "S")
        two = c.acquire(K, "S")
        one.release()
        other.send({"op": "acquire", "queueKey": K, "sessionKey": "T"})
        assert other.silent(0.3)  # S still holds it for `two`
        assert daemon.holders(K) == ["S"] and two.beat()
        two.release()
        assert other.recv()["sessionKey"] == "T"


def test_the_spawned_daemon_never_imports_from_the_callers_directory() -> None:
    d = short_tmpdir()
    project = short_tmpdir()
    with open(os.path.join(project, "json.py"), "w") as f:
        f.write("raise SystemExit('the daemon imported the caller json.py')\n")
    with open(os.path.join(d, "llm-queue.json"), "w") as f:
        json.dump({"defaults": {"daemonIdleExitMs": 100}}, f)
    here = os.getcwd()
    os.chdir(project)
    try:
        with lq.Client(d) as c:
            lease = c.acquire(K, "S", timeout=20)
            assert lease.queued  # a real daemon started and served it
            lease.release()
    finally:
        os.chdir(here)


def test_a_daemon_that_cannot_start_is_not_spawned_again_and_again() -> None:
    d = short_tmpdir()
    with open(os.path.join(d, "llm-queue.sock"), "w") as f:
        f.write("not a socket")  # every daemon refuses this path and exits 1
    c = lq.Client(d, spawn_timeout=2.0, on_warning=lambda m: None)
    try:
        lease = c.acquire(K, "S")
        assert not lease.queued
        assert len(c._spawned) + sum(1 for p in c._spawned if p.poll() is not None) <= 3
    finally:
        c.close()
        for p in c._spawned:
            p.wait(5)


def test_a_waiter_interrupted_by_close_raises_instead_of_running_unqueued(daemon: DaemonProc) -> None:
    c = client_for(daemon, on_warning=lambda m: None)
    with daemon.peer() as holder:
        holder.ask({"op": "acquire", "queueKey": K, "sessionKey": "H"})
        outcome: list[Any] = []

        def wait() -> None:
            try:
                outcome.append(c.acquire(K, "W"))
            except BaseException as e:
                outcome.append(e)

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        wait_for(lambda: daemon.waiting(K) == ["W"])
        c.close()
        t.join(5)
        assert len(outcome) == 1 and isinstance(outcome[0], lq.LLMQueueError), outcome


def test_cancel_bookkeeping_stays_bounded() -> None:
    c = lq.Client(short_tmpdir(), autostart=False, on_warning=lambda m: None)
    for i in range(3000):
        c.cancel(K, f"s{i}")
    assert len(c._cancels) <= 1100
    c.close()
