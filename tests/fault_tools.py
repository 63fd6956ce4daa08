"""Shared pieces of the reliability suites (``test_fuzz``, ``test_faults``, ``test_security``).
Not a suite.

- ``assert_healthy``: the invariants checked after every attack -- the daemon process is alive,
  ``status`` is consistent (no holder or waiter that is not a live session the test created, no
  queue over ``maxStreams``, no session both holding and waiting), and a brand-new client is
  granted at once on a fresh key.
- ``cpu_seconds``/``rss_bytes``: a process's CPU time and memory, from ``/proc``.
- ``peer_pid``: the pid of the process serving a unix socket (``SO_PEERCRED``), so a daemon a
  ``Client`` spawned can be stopped by its pid.
- ``stop_pid``/``ChildProc``: stop processes by pid, SIGSTOPped ones included (SIGCONT, then kill).
- ``LimitedDaemon``: a daemon started under a given ``RLIMIT_NOFILE`` (soft and hard).
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Set

from tests.harness import ROOT, DaemonProc, Peer, wait_for

_fresh = itertools.count(1)


def acquire_msg(key: str, session: str, **extra: Any) -> Dict[str, Any]:
    return dict({"op": "acquire", "queueKey": key, "sessionKey": session}, **extra)


def everyone(queues: List[Dict[str, Any]]) -> Set[str]:
    """Every session that holds or waits anywhere."""
    return {x["sessionKey"] for q in queues for x in q["holders"] + q["waiting"]}


def status_problems(queues: List[Dict[str, Any]], allowed: Optional[Iterable[str]]) -> List[str]:
    """What is inconsistent in a ``status`` reply: a queue over its maxStreams, a session listed
    twice or both holding and waiting in one queue, or (when ``allowed`` is given) a holder or
    waiter that is not one of the ``allowed`` sessions."""
    problems: List[str] = []
    ok = None if allowed is None else set(allowed)
    for q in queues:
        holders = [h["sessionKey"] for h in q["holders"]]
        waiting = [w["sessionKey"] for w in q["waiting"]]
        if q["maxStreams"] is not None and len(holders) > q["maxStreams"]:
            problems.append(f"{q['queueKey']}: {len(holders)} holders > maxStreams {q['maxStreams']}")
        if len(set(holders)) != len(holders) or len(set(waiting)) != len(waiting):
            problems.append(f"{q['queueKey']}: a session listed twice: {holders} / {waiting}")
        if set(holders) & set(waiting):
            problems.append(f"{q['queueKey']}: holding and waiting at once: {set(holders) & set(waiting)}")
        if ok is not None:
            stray = (set(holders) | set(waiting)) - ok
            if stray:
                problems.append(f"{q['queueKey']}: holders/waiters that are no live session of the test: {sorted(stray)}")
    return problems


def fresh_client_granted_at_once(socket_path: str) -> None:
    """A brand-new connection acquiring a brand-new key gets ``granted`` as its first reply (a
    queued acquire would get no reply at all), and lets it go again (``bye``; a following
    ``status`` on the same connection fences it)."""
    key = f"http://127.0.0.1:8001/fresh-{os.getpid()}-{next(_fresh)}"
    with Peer(socket_path) as p:
        reply = p.ask(acquire_msg(key, "fresh-client"), timeout=5.0)
        assert reply.get("op") == "granted" and reply.get("queueKey") == key \
            and reply.get("sessionKey") == "fresh-client", f"a new client was not granted at once: {reply}"
        p.send({"op": "bye"})
        assert p.ask({"op": "status"})["op"] == "status"


def assert_healthy(d: DaemonProc, allowed: Optional[Iterable[str]] = None) -> List[Dict[str, Any]]:
    """The post-attack invariants.  ``allowed``: the sessions that may hold or wait (the live
    sessions the test created); None skips that check.  Returns the status queues."""
    assert d.alive(), f"the daemon died: exit {d.proc.returncode if d.proc else None}: {d.stderr()[-2000:]}"
    queues = d.status()
    problems = status_problems(queues, allowed)
    assert not problems, problems
    fresh_client_granted_at_once(d.socket_path)
    assert d.alive()
    return queues


# -- processes ----------------------------------------------------------------------------------


def _stat_fields(pid: int) -> List[str]:
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return text[text.rindex(")") + 2:].split()  # fields from the 3rd (state) on


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far."""
    fields = _stat_fields(pid)
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime: fields 14 and 15


def proc_state(pid: int) -> str:
    return _stat_fields(pid)[0]


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def peer_pid(socket_path: str) -> Optional[int]:
    """The pid of the process listening on ``socket_path`` (SO_PEERCRED), or None if nobody does."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(2.0)
        s.connect(socket_path)
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", creds)[0])
    except OSError:
        return None
    finally:
        s.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return proc_state(pid) != "Z"
    except OSError:
        return False


def stop_pid(pid: Optional[int], timeout: float = 5.0) -> None:
    """Stop one process by pid: SIGCONT (in case it is stopped), SIGTERM, then SIGKILL."""
    if pid is None or pid <= 1 or pid == os.getpid():
        return
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.02)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class ChildProc:
    """A child Python process running ``script`` (with the repository on ``sys.path``), whose
    stdout lines can be awaited; always stopped by pid on exit, SIGSTOPped or not."""

    def __init__(self, script: str, *args: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.pid = self.proc.pid
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self._pumper = threading.Thread(target=self._pump, daemon=True)
        self._pumper.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode().strip())
        self.lines.put(None)  # end of output

    def expect_line(self, wanted: str, timeout: float = 10.0) -> None:
        """Wait for the next stdout line and check it is ``wanted``."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child said nothing within {timeout}s (wanted {wanted!r})") from None
        if line != wanted:
            err = b""
            if self.proc.poll() is not None and self.proc.stderr is not None:
                err = self.proc.stderr.read()
            raise AssertionError(f"child said {line!r}, wanted {wanted!r}; stderr: {err.decode()[-2000:]}")

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        self._pumper.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self) -> ChildProc:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class LimitedDaemon(DaemonProc):
    """A daemon whose RLIMIT_NOFILE is ``nofile`` for both the soft and the hard limit (the daemon
    raises its soft limit to the hard one at start, so both must be low)."""

    def __init__(self, nofile: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nofile = nofile

    def start(self, wait: bool = True) -> LimitedDaemon:
        import resource

        limit = self.nofile

        def lower() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                         env=self.env, preexec_fn=lower)
        if wait:
            self.wait_ready()
        return self


def wait_gone(d: DaemonProc, sessions: Iterable[str], timeout: float = 5.0) -> None:
    """Wait until none of ``sessions`` holds or waits anywhere."""
    gone = set(sessions)
    wait_for(lambda: not (everyone(d.status()) & gone), timeout)

