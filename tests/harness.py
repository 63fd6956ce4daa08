"""The daemon socket seam for the suites: start a real daemon process on a temporary agent dir,
talk to it through raw JSON-line peers, and clean everything up afterwards.

Not a suite.  ``start_daemon`` injects ``daemonIdleExitMs: 1000000000`` into a config that
omits it, so suites that reuse one daemon across connection gaps are not exited by the
production default of 0; the idle-exit suites set the field explicitly.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator, Optional, Union

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = os.path.join(ROOT, "llmqueue.py")
QUEUE_KEY = "http://127.0.0.1:8001/v1"
SWEEP_MS = 20  # a short tick, so a TTL-bound test costs milliseconds beyond its TTL


_MADE: list[tuple[int, str]] = []  # short_tmpdir's dirs, removed when the process that made them exits


@atexit.register
def _remove_made() -> None:
    for pid, path in _MADE:
        if pid == os.getpid():  # not a forked copy's: the maker's exit removes them
            shutil.rmtree(path, ignore_errors=True)


def short_tmpdir(prefix: str = "lq", keep: bool = False) -> str:
    """A temporary dir with a short path: unix socket paths are limited to ~108 bytes.  It is
    removed when the test process exits, unless ``keep`` (a suite that keeps its artifacts after
    a failure, and removes them itself after a success)."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    if not keep:
        _MADE.append((os.getpid(), path))
    return path


def wait_for(predicate: Any, timeout: float = 5.0, interval: float = 0.005) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test past ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {predicate}")
        time.sleep(interval)


def same_server(key: str) -> str:
    """The queueKey ``status`` shows for ``key``: a server's URL in its one form (with or without
    ``/v1``, one queue), any other key as it is."""
    import llmqueue

    return llmqueue.normalize_url(key)


class Peer:
    """A raw client: one unix-socket connection speaking newline-delimited JSON."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.buf = b""
        self.timeout = timeout

    def send(self, message: Union[dict[str, Any], bytes, str]) -> None:
        if isinstance(message, dict):
            data = json.dumps(message).encode() + b"\n"
        elif isinstance(message, str):
            data = message.encode()
        else:
            data = message
        self.sock.sendall(data)

    def recv(self, timeout: Optional[float] = None) -> dict[str, Any]:
        """The next reply line, parsed; fails the test if none arrives within ``timeout``."""
        self.sock.settimeout(self.timeout if timeout is None else timeout)
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        reply = json.loads(line)
        assert isinstance(reply, dict), line
        return reply

    def ask(self, message: Union[dict[str, Any], bytes, str], timeout: Optional[float] = None) -> dict[str, Any]:
        self.send(message)
        return self.recv(timeout)

    def silent(self, wait: float = 0.15) -> bool:
        """True when nothing arrives within ``wait`` seconds (and the connection stays open)."""
        if b"\n" in self.buf:
            return False
        self.sock.settimeout(wait)
        try:
            chunk = self.sock.recv(1 << 20)
        except socket.timeout:
            return True
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        self.buf += chunk
        return False

    def closed_by_daemon(self, timeout: float = 5.0) -> bool:
        """True when the daemon closes this connection within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(1 << 20)
            except socket.timeout:
                return False
            except ConnectionResetError:
                return True
            if not chunk:
                return True
            self.buf += chunk
        return False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class DaemonProc:
    """A real daemon process on its own agent dir."""

    def __init__(self, agent_dir: Optional[str] = None, *, config: Optional[dict[str, Any]] = None,
                 sweep_ms: int = SWEEP_MS, args: tuple[str, ...] = (), models: Optional[dict[str, Any]] = None,
                 inject_idle_exit: bool = True, env: Optional[dict[str, str]] = None) -> None:
        self.agent_dir = agent_dir or short_tmpdir()
        self.owns_dir = agent_dir is None
        self.socket_path = os.path.join(self.agent_dir, "llm-queue.sock")
        self.config_path = os.path.join(self.agent_dir, "llm-queue.json")
        self.stderr_path = os.path.join(self.agent_dir, f"stderr-{time.monotonic_ns()}.txt")
        self.sweep_ms = sweep_ms
        self.args = args
        self.env = env
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.peers: list[Peer] = []
        if config is not None or inject_idle_exit:
            cfg = json.loads(json.dumps(config or {}))
            if inject_idle_exit:
                cfg.setdefault("defaults", {}).setdefault("daemonIdleExitMs", 10**9)
            self.write_config(cfg)
        if models is not None:
            with open(os.path.join(self.agent_dir, "models.json"), "w") as f:
                json.dump(models, f)

    def write_config(self, config: Union[dict[str, Any], str], path: Optional[str] = None) -> None:
        """Replace the config the way an editor's atomic save does: write a temp file, rename."""
        path = path or self.config_path
        text = config if isinstance(config, str) else json.dumps(config)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    def command(self) -> list[str]:
        """The daemon as a client starts it (llmqueue.daemon_command: ``python -S``, through an
        import); the suites that pin ``python3 llmqueue.py`` itself run the script directly."""
        import llmqueue

        return [*llmqueue.daemon_command(self.agent_dir)[:-2], *self.flags()]

    def flags(self) -> list[str]:
        """The daemon's command-line flags."""
        return ["--agent-dir", self.agent_dir, "--sweep-ms", str(self.sweep_ms), *self.args]

    def start(self, wait: bool = True) -> DaemonProc:
        env = dict(self.env if self.env is not None else os.environ)
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # hundreds of daemon starts: use the bytecode cache
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                         env=env)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}: {self.stderr()}")
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(self.socket_path)
                return True
            except OSError:
                return False

        wait_for(ready, timeout)

    def peer(self, timeout: float = 5.0) -> Peer:
        p = Peer(self.socket_path, timeout)
        self.peers.append(p)
        return p

    def status(self) -> list[dict[str, Any]]:
        with Peer(self.socket_path) as p:
            reply = p.ask({"op": "status"})
        assert reply["op"] == "status", reply
        queues = reply["queues"]
        assert isinstance(queues, list)
        return queues

    def queue(self, key: str) -> dict[str, Any]:
        for q in self.status():
            if q["queueKey"] == same_server(key):
                return q
        raise AssertionError(f"no queue {key} in status")

    def holders(self, key: str) -> list[str]:
        """The queue's holders, in grant order; none while the queue does not exist yet."""
        for q in self.status():
            if q["queueKey"] == same_server(key):
                return [h["sessionKey"] for h in q["holders"]]
        return []

    def waiting(self, key: str) -> list[str]:
        """The queue's waiters, in enqueue order; none while the queue does not exist yet."""
        for q in self.status():
            if q["queueKey"] == same_server(key):
                return [w["sessionKey"] for w in q["waiting"]]
        return []

    def stderr(self) -> str:
        try:
            with open(self.stderr_path) as f:
                return f.read()
        except OSError:
            return ""

    def complaints(self) -> str:
        """stderr less the daemon's own lifetime lines (serving, exiting for idleness): what it
        had to say about something wrong."""
        return "".join(line for line in self.stderr().splitlines(keepends=True)
                       if not line.startswith(("llmqueue: serving on ", "llmqueue: no client for a while")))

    def wait_exit(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        for p in self.peers:
            p.close()
        self.peers.clear()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.owns_dir:
            shutil.rmtree(self.agent_dir, ignore_errors=True)

    def __enter__(self) -> DaemonProc:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def started(**kwargs: Any) -> Iterator[DaemonProc]:
    """A fixture body: a started daemon, stopped and cleaned up afterwards."""
    d = DaemonProc(**kwargs)
    try:
        d.start()
        yield d
    finally:
        d.stop()
