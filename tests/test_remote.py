"""The proxy's remote path (issue 14): ``--allow-remote`` serves a client on another host.

The other host is a network namespace joined to this one by a veth pair, so the request really
crosses an interface that is not loopback.  It needs root and ``ip netns``; elsewhere the test is
skipped with the reason.  Pinned: a non-loopback listen address is refused without
``allow_remote``; with it, a client in the other namespace streams through the proxy, queued under
the session its URL names.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
from typing import Iterator, Tuple

import pytest

import llmqueue as lq
from tests.harness import DaemonProc, started
from tests.stub import StubEndpoint


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture
def namespace() -> Iterator[Tuple[str, str, str]]:
    """(namespace, this side's address, its side's address), torn down afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("no ip(8) here: the remote path needs a network namespace")
    if os.geteuid() != 0:
        pytest.skip("not root: creating a network namespace needs root")
    tag = f"{os.getpid() % 100000}"
    ns, host_if, ns_if = f"lqns{tag}", f"lqh{tag}", f"lqn{tag}"
    octet = os.getpid() % 250 + 1
    here, there = f"10.213.{octet}.1", f"10.213.{octet}.2"
    made = _ip("netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(f"ip netns add failed here: {made.stderr.strip()}")
    try:
        for args in (("link", "add", host_if, "type", "veth", "peer", "name", ns_if),
                     ("link", "set", ns_if, "netns", ns),
                     ("addr", "add", f"{here}/30", "dev", host_if),
                     ("link", "set", host_if, "up"),
                     ("netns", "exec", ns, "ip", "addr", "add", f"{there}/30", "dev", ns_if),
                     ("netns", "exec", ns, "ip", "link", "set", ns_if, "up"),
                     ("netns", "exec", ns, "ip", "link", "set", "lo", "up")):
            done = _ip(*args)
            if done.returncode != 0:
                pytest.skip(f"ip {' '.join(args)} failed here: {done.stderr.strip()}")
        yield ns, here, there
    finally:
        _ip("netns", "del", ns)
        _ip("link", "del", host_if)  # gone with the namespace already, unless that failed


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    yield from started()


CLIENT = textwrap.dedent("""
    import http.client, json, sys
    conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=20)
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    conn.request("POST", "/s/far/parent/v1/chat/completions", body=body,
                 headers={"Content-Type": "application/json", "X-Who": "remote"})
    r = conn.getresponse()
    print(r.status, r.read().count(b"data: "))
""")


def test_a_client_in_another_network_namespace_is_served_only_with_allow_remote(
        namespace: Tuple[str, str, str], stub: StubEndpoint, daemon: DaemonProc) -> None:
    ns, here, _ = namespace
    client = lq.Client(daemon.agent_dir, autostart=False)
    try:
        with pytest.raises(ValueError, match="not a loopback address"):
            lq.Proxy(stub.base, client=client, listen=(here, 0))
        proxy = lq.Proxy(stub.base, client=client, listen=(here, 0), allow_remote=True, grace_ms=5000)
        thread = threading.Thread(target=proxy.serve_forever, args=(0.02,), daemon=True)
        thread.start()
        try:
            port = str(proxy.server.server_address[1])
            out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, here, port],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            status, events = out.stdout.split()
            assert status == "200" and int(events) >= 7  # 6 tokens, the final chunk, [DONE]
            rec = stub.record("remote")
            assert rec is not None and rec["path"] == "/v1/chat/completions"
            assert daemon.holders(stub.base) == ["far"]  # queued under the session its URL names
            assert rec["headers"].get("X-Forwarded-For") is None  # forwarded unchanged
        finally:
            proxy.shutdown()
    finally:
        client.close()
