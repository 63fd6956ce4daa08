"""Issue 6, item 5: security, beyond what ``tests/test_leases.py`` already pins (socket and agent
dir permissions under umask 022, the peer-uid check, a regular file or a symlink to one at the
socket path refused and left untouched, huge ``daemonIdleExitMs`` of 10^12 and 10^18).

Every test runs a real daemon process (``tests.harness.DaemonProc``):

- the socket path taken by something that is not a socket -- a regular file (empty or not), a
  symlink (to a file, to a directory, to a stale socket, dangling), a directory, a FIFO, also
  through ``--socket``: the daemon refuses to start (exit 1), leaves it exactly as it was, and says
  why on stderr (the path, and that it is not a socket); a symlink to a live daemon's socket is a
  daemon already serving: exit 0, left alone, that daemon still serves;
- under umask 000 the created agent dir is 0700 and the socket and its lock file are 0600;
- config values that try to make the daemon misbehave: ``maxStreams`` 2147483647 works (50 sessions
  granted at once); ``maxStreams`` 10^30 or 2^31, ``leaseTtlMs`` past 2^31-1, infinite or
  fractional numbers are path-named errors on stderr and the daemon serves with the defaults (at
  start) or keeps the last good config (on a reload); ``leaseTtlMs`` 2^31-1 is granted as such
  and does not lapse; a ``daemonIdleExitMs`` past the 2^31-1 timer cap (2^31, 2^32+1, 10^30,
  10^300) is clamped, never an immediate exit; a config of 100 KB nesting, NaN, or a 5000-digit
  number is not a crash;
- a ``logFile`` the daemon cannot create or write -- a name with a NUL byte, a name too long, a
  symlink loop, a path under a file, the daemon's own socket, a FIFO nobody reads -- leaves it
  serving every client;
- a config file (or ``models.json``) replaced by a FIFO nobody writes to does not hang the daemon.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest

from tests.fault_tools import acquire_msg, assert_healthy
from tests.harness import DaemonProc, Peer, short_tmpdir, wait_for

K = "http://127.0.0.1:8001/v1"
KEEP = 10**9  # daemonIdleExitMs: resident for the whole test
INT31 = 2**31 - 1
RELOAD_S = 3.0  # one config poll plus the 250 ms debounce, with slack


def granted(reply: Dict[str, Any], key: str, session: str) -> bool:
    return reply.get("op") == "granted" and reply.get("queueKey") == key and reply.get("sessionKey") == session


def snapshot(path: str) -> Tuple[Any, ...]:
    """What must not change about whatever is at ``path`` (not following a symlink)."""
    st = os.lstat(path)
    extra: Any = None
    if stat.S_ISLNK(st.st_mode):
        extra = os.readlink(path)
    elif stat.S_ISDIR(st.st_mode):
        extra = sorted(os.listdir(path))
    elif stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            extra = f.read()
    return st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_uid, extra


# -- 1. a socket path that is not a socket -------------------------------------------------------------


def _plant(kind: str, path: str, elsewhere: str) -> List[str]:
    """Put a ``kind`` of thing at ``path``; the other paths whose state must not change."""
    target = os.path.join(elsewhere, "target")
    if kind == "empty regular file":
        open(path, "w").close()
        return []
    if kind == "regular file":
        with open(path, "w") as f:
            f.write("precious data\n")
        return []
    if kind == "directory":
        os.mkdir(path)
        open(os.path.join(path, "inside"), "w").close()
        return []
    if kind == "fifo":
        os.mkfifo(path)
        return []
    if kind == "symlink to a regular file":
        with open(target, "w") as f:
            f.write("precious data\n")
    elif kind == "symlink to a directory":
        os.mkdir(target)
    elif kind == "symlink to a stale socket":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(target)
        s.close()  # bound, never listening: a crashed daemon's leftover
    elif kind != "dangling symlink":
        raise AssertionError(kind)
    os.symlink(target, path)
    return [target] if os.path.lexists(target) else []


NOT_SOCKETS = ["empty regular file", "regular file", "directory", "fifo", "symlink to a regular file",
               "symlink to a directory", "symlink to a stale socket", "dangling symlink"]


@pytest.mark.parametrize("via", ["agent dir", "--socket"])
@pytest.mark.parametrize("kind", NOT_SOCKETS)
def test_a_non_socket_at_the_socket_path_is_refused_left_untouched_and_the_message_says_why(kind: str, via: str) -> None:
    elsewhere = short_tmpdir()
    try:
        if via == "--socket":
            path = os.path.join(elsewhere, "custom.sock")
            d = DaemonProc(args=("--socket", path))
        else:
            d = DaemonProc()
            path = d.socket_path
        with d:
            others = _plant(kind, path, elsewhere)
            before = [snapshot(p) for p in [path, *others]]
            d.start(wait=False)
            assert d.wait_exit(10.0) == 1, f"the daemon did not refuse a {kind}: {d.stderr()}"
            assert [snapshot(p) for p in [path, *others]] == before, f"the {kind} was changed"
            said = d.stderr()
            assert path in said and "not a socket" in said, f"the refusal does not say why: {said!r}"
            assert "Traceback" not in said, said
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


def test_a_symlink_to_a_live_daemons_socket_is_a_daemon_already_serving_left_alone() -> None:
    with DaemonProc() as first:
        first.start()
        keeper = first.peer()
        assert granted(keeper.ask(acquire_msg(K, "A")), K, "A")
        with DaemonProc() as second:
            os.symlink(first.socket_path, second.socket_path)
            before = snapshot(second.socket_path)
            second.start(wait=False)
            assert second.wait_exit(10.0) == 0, second.stderr()
            assert snapshot(second.socket_path) == before
            assert "already serves" in second.stderr(), second.stderr()
        assert first.alive() and first.holders(K) == ["A"]
        assert keeper.ask({"op": "renew", "queueKey": K, "sessionKey": "A"})["granted"] is True
        assert_healthy(first, {"A"})


def test_under_umask_000_the_agent_dir_is_0700_and_the_socket_and_its_lock_are_0600() -> None:
    parent = short_tmpdir()
    agent_dir = os.path.join(parent, "agent")
    try:
        d = DaemonProc(agent_dir, inject_idle_exit=False, args=("--idle-exit-ms", "never"))
        d.stderr_path = os.path.join(parent, "stderr.txt")  # the agent dir does not exist yet
        with d:
            with open(d.stderr_path, "ab") as err:
                d.proc = subprocess.Popen(d.command(), stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                          preexec_fn=lambda: os.umask(0))
            d.wait_ready()
            assert stat.S_IMODE(os.stat(agent_dir).st_mode) == 0o700
            for path in (d.socket_path, d.socket_path + ".lock"):
                assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600, path
            assert stat.S_ISSOCK(os.lstat(d.socket_path).st_mode)
            assert_healthy(d, set())
    finally:
        shutil.rmtree(parent, ignore_errors=True)


# -- 2. config values that try to make the daemon misbehave ---------------------------------------------


def started_with(config: Any, raw: Optional[str] = None) -> DaemonProc:
    d = DaemonProc(inject_idle_exit=False)
    d.write_config(raw if raw is not None else config)
    return d.start()


def test_max_streams_2147483647_works_and_grants_many_sessions_at_once() -> None:
    with started_with({"defaults": {"daemonIdleExitMs": KEEP, "maxStreams": INT31}}) as d:
        peers = [d.peer() for _ in range(50)]
        for i, p in enumerate(peers):
            assert granted(p.ask(acquire_msg(K, f"s{i}")), K, f"s{i}")
        q = d.queue(K)
        assert q["maxStreams"] == INT31 and len(q["holders"]) == 50 and q["waiting"] == []
        assert d.complaints() == ""
        assert_healthy(d, {f"s{i}" for i in range(50)})


BAD_VALUES: List[Tuple[str, Dict[str, Any], str, str]] = [  # (id, config, path in the error, shown value)
    ("maxStreams 10^30", {"defaults": {"maxStreams": 10**30}}, "defaults.maxStreams", str(10**30)),
    ("maxStreams 2^31", {"defaults": {"maxStreams": 2**31}}, "defaults.maxStreams", str(2**31)),
    ("queue maxStreams 10^30", {"queues": {K: {"maxStreams": 10**30}}}, f"queues.{K}.maxStreams", str(10**30)),
    ("leaseTtlMs 2^31", {"defaults": {"leaseTtlMs": 2**31}}, "defaults.leaseTtlMs", str(2**31)),
    ("leaseTtlMs 10^20", {"queues": {K: {"leaseTtlMs": 10**20}}}, f"queues.{K}.leaseTtlMs", str(10**20)),
    ("leaseTtlMs 1.5e3", {"defaults": {"leaseTtlMs": 1.5e3}}, "defaults.leaseTtlMs", "1500.0"),
    ("idleYieldMs 2^31", {"defaults": {"idleYieldMs": 2**31}}, "defaults.idleYieldMs", str(2**31)),
    ("agingAfterMs 10^30", {"defaults": {"agingAfterMs": 10**30}}, "defaults.agingAfterMs", str(10**30)),
    ("agingAfterSlots 10^30", {"defaults": {"agingAfterSlots": 10**30}}, "defaults.agingAfterSlots", str(10**30)),
    ("maxStreams true", {"defaults": {"maxStreams": True}}, "defaults.maxStreams", "true"),
]


@pytest.mark.parametrize("config,path,shown", [pytest.param(c, p, v, id=i) for i, c, p, v in BAD_VALUES])
def test_an_out_of_range_config_value_is_a_path_named_error_and_the_daemon_serves_with_defaults(
        config: Dict[str, Any], path: str, shown: str) -> None:
    """At start: the error names the path and the value; the daemon serves with the defaults
    (one slot, a 30 s TTL).  On a reload of the same value: rejected, the last good config stays."""
    config = json.loads(json.dumps(config))
    config.setdefault("defaults", {})["daemonIdleExitMs"] = KEEP
    with started_with(config) as d:
        a, b = d.peer(), d.peer()
        reply = a.ask(acquire_msg(K, "A"))
        assert granted(reply, K, "A") and reply["leaseTtlMs"] == 30000, reply
        b.send(acquire_msg(K, "B"))
        wait_for(lambda: d.waiting(K) == ["B"])  # the default maxStreams 1
        said = d.stderr()
        assert any(path in line and shown in line for line in said.splitlines()), said
        assert "Traceback" not in said
        assert_healthy(d, {"A", "B"})
    good = {"defaults": {"daemonIdleExitMs": KEEP}, "queues": {K: {"maxStreams": 3}}}
    with started_with(good) as d:
        p = d.peer()
        assert granted(p.ask(acquire_msg(K, "A")), K, "A")
        bad = json.loads(json.dumps(config))
        bad.setdefault("queues", {}).setdefault(K, {}).setdefault("maxStreams", 5)  # shows if it were applied
        d.write_config(bad)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)  # reload now
        wait_for(lambda: path in d.stderr(), RELOAD_S)
        assert d.queue(K)["maxStreams"] == 3, "a rejected reload replaced the last good config"
        assert d.alive()


def test_lease_ttl_2147483647_is_granted_as_such_and_does_not_lapse() -> None:
    with started_with({"defaults": {"daemonIdleExitMs": KEEP, "leaseTtlMs": INT31}}) as d:
        p = d.peer()
        reply = p.ask(acquire_msg(K, "A"))
        assert granted(reply, K, "A") and reply["leaseTtlMs"] == INT31, reply
        time.sleep(0.3)  # many sweeps
        assert p.ask({"op": "renew", "queueKey": K, "sessionKey": "A"})["granted"] is True
        assert d.holders(K) == ["A"] and d.complaints() == ""
        assert_healthy(d, {"A"})


@pytest.mark.parametrize("huge", [2**31, 2**32 + 1, 10**30, 10**300], ids=["2^31", "2^32+1", "10^30", "10^300"])
def test_a_daemon_idle_exit_past_the_timer_cap_is_clamped_not_an_immediate_exit(huge: int) -> None:
    with started_with({"defaults": {"daemonIdleExitMs": huge}}) as d:
        a = d.peer()
        assert granted(a.ask(acquire_msg(K, "A")), K, "A")
        a.close()
        wait_for(lambda: d.holders(K) == [])  # the last counted client has left
        time.sleep(0.3)
        assert d.alive(), f"exited with {d.proc.poll() if d.proc else None}: {d.stderr()}"
        assert d.complaints() == ""
        assert_healthy(d, set())


@pytest.mark.parametrize("raw,at_start", [
    pytest.param("[" * 102400, 1, id="100 KB of nesting"),
    pytest.param('{"defaults": {"maxStreams": NaN}}', 1, id="NaN"),
    pytest.param('{"defaults": {"leaseTtlMs": Infinity}}', 1, id="Infinity"),
    pytest.param('{"defaults": {"maxStreams": 1e400}}', 1, id="1e400"),
    pytest.param('{"defaults": {"maxStreams": ' + "9" * 5000 + "}}", 1, id="5000 digits"),
    pytest.param('{"defaults": {"maxStreams": 2}, "queues": {"' + "q" * 100000 + '": {}}}', 2, id="100 KB key"),
])
def test_a_config_built_to_break_the_parser_is_not_a_crash(raw: str, at_start: int) -> None:
    """At start the daemon serves: with the defaults (maxStreams 1) when the file is unusable,
    with what it says when it is merely odd (a 100 KB queue name).  Reloaded over a good config
    (maxStreams 4), an unusable file leaves the good one in place."""
    d = DaemonProc(inject_idle_exit=False, args=("--idle-exit-ms", "never"))
    d.write_config(raw)
    with d:
        d.start()
        p = d.peer()
        assert granted(p.ask(acquire_msg(K, "A")), K, "A")
        assert d.queue(K)["maxStreams"] == at_start
        assert "Traceback" not in d.stderr(), d.stderr()
        assert d.proc is not None
        d.write_config({"queues": {K: {"maxStreams": 4}}})
        d.proc.send_signal(signal.SIGHUP)  # reload now
        wait_for(lambda: d.queue(K)["maxStreams"] == 4, RELOAD_S)
        d.write_config(raw)
        d.proc.send_signal(signal.SIGHUP)
        if at_start == 1:
            time.sleep(0.3)  # the SIGHUP reload is immediate
            assert d.queue(K)["maxStreams"] == 4, "an unusable config replaced the last good one"
        else:
            wait_for(lambda: d.queue(K)["maxStreams"] == at_start, RELOAD_S)
        assert "Traceback" not in d.stderr(), d.stderr()
        assert_healthy(d, {"A"})


# -- 3. a logFile the daemon cannot create or write -------------------------------------------------------


def _log_path(kind: str, d: DaemonProc, scratch: str) -> str:
    if kind == "NUL byte":
        return os.path.join(scratch, "events\u0000.log")
    if kind == "name too long":
        return os.path.join(scratch, "x" * 5000 + ".log")
    if kind == "symlink loop":
        loop = os.path.join(scratch, "loop")
        os.symlink(loop, loop)
        return loop
    if kind == "under a file":
        with open(os.path.join(scratch, "plain"), "w") as f:
            f.write("x")
        return os.path.join(scratch, "plain", "events.log")
    if kind == "the daemon's own socket":
        return d.socket_path
    if kind == "under /proc":
        return "/proc/llmqueue-no-such-dir/events.log"
    if kind == "a FIFO nobody reads":
        fifo = os.path.join(scratch, "events.fifo")
        os.mkfifo(fifo)
        return fifo
    raise AssertionError(kind)


LOG_KINDS = ["NUL byte", "name too long", "symlink loop", "under a file", "the daemon's own socket", "under /proc",
             "a FIFO nobody reads"]


@pytest.mark.parametrize("kind", LOG_KINDS)
def test_a_log_file_the_daemon_cannot_create_or_write_leaves_it_serving_every_client(kind: str) -> None:
    """Clients hand a one-slot queue over and over (every hand-over is several events to log);
    every request is answered within its usual time, from every connection."""
    scratch = short_tmpdir()
    unblock: Optional[int] = None
    try:
        with DaemonProc() as d:
            log = _log_path(kind, d, scratch)
            d.write_config({"defaults": {"daemonIdleExitMs": KEEP, "logFile": log}})
            d.start()
            a, b = d.peer(timeout=3.0), d.peer(timeout=3.0)
            try:
                for i in range(5):
                    assert granted(a.ask(acquire_msg(K, f"A{i}")), K, f"A{i}")
                    b.send(acquire_msg(K, f"B{i}"))
                    assert a.ask({"op": "release", "queueKey": K, "sessionKey": f"A{i}"}) == {"op": "ok", "queueKey": K, "sessionKey": f"A{i}"}
                    assert granted(b.recv(), K, f"B{i}")
                    assert b.ask({"op": "release", "queueKey": K, "sessionKey": f"B{i}"}) == {"op": "ok", "queueKey": K, "sessionKey": f"B{i}"}
                with Peer(d.socket_path, timeout=3.0) as c:
                    assert c.ask({"op": "status"})["op"] == "status"
            except (socket.timeout, TimeoutError) as e:
                raise AssertionError(f"the daemon stopped serving with logFile = {kind}: {e!r}") from None
            finally:
                if kind == "a FIFO nobody reads":  # let a blocked daemon go, so it can be stopped
                    unblock = os.open(log, os.O_RDONLY | os.O_NONBLOCK)
            assert d.alive() and "Traceback" not in d.stderr(), d.stderr()
            assert_healthy(d, set())
    finally:
        if unblock is not None:
            os.close(unblock)
        shutil.rmtree(scratch, ignore_errors=True)


# -- 4. a config file that is a FIFO ------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["llm-queue.json", "models.json"])
def test_a_config_file_replaced_by_a_fifo_nobody_writes_to_does_not_hang_the_daemon(which: str) -> None:
    """The daemon re-reads its config and models.json when they change; one of them replaced by
    a FIFO (nobody writing to it) must not block the daemon: clients keep being served."""
    writer: Optional[int] = None
    with DaemonProc() as d:
        d.start()
        a = d.peer(timeout=3.0)
        assert granted(a.ask(acquire_msg(K, "A")), K, "A")
        path = os.path.join(d.agent_dir, which)
        if os.path.exists(path):
            os.unlink(path)
        os.mkfifo(path)
        time.sleep(0.8)  # a poll and the 250 ms debounce: the daemon reads it now
        try:
            with Peer(d.socket_path, timeout=3.0) as b:
                assert b.ask({"op": "status"})["op"] == "status"
                assert a.ask({"op": "renew", "queueKey": K, "sessionKey": "A"})["granted"] is True
        except (socket.timeout, TimeoutError) as e:
            raise AssertionError(f"the daemon hung on a FIFO at {which}: {e!r}") from None
        finally:
            try:  # let a blocked daemon go, so it can be stopped
                writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                os.close(writer)
            except OSError:
                pass
        assert d.alive()
        assert_healthy(d, {"A"})
