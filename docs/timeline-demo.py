"""The scripted workload behind docs/timeline.svg: a parent and three subagents sharing one GPU
(maxStreams 1), with tool calls between requests, the parent parked on a subagent (its slot
handed over at once), and a client that dies holding the slot (evicted when its TTL lapses).

    python3 docs/timeline-demo.py /tmp/demo.log
    python3 llmqueue.py report /tmp/demo.log --svg docs/timeline.svg
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import llmqueue as lq  # noqa: E402

KEY = "http://127.0.0.1:8080/v1"


def agent(agent_dir: str, name: str, role: str, turns: int, think: float, work: float, rng: random.Random) -> None:
    client = lq.Client(agent_dir, autostart=False)
    session = client.session(KEY, name, role=role, grace_ms=400)
    for turn in range(turns):
        with session.run():
            for i in range(rng.randint(1, 3)):
                if i:
                    time.sleep(work * rng.uniform(0.3, 0.8))  # a tool call: the slot kept, nothing in flight
                with session.request():
                    time.sleep(work * rng.uniform(0.5, 1.5))  # streaming
            if name == "main" and turn == 2:
                with session.blocking():  # waits on a subagent: the slot goes idle
                    time.sleep(2.5)
        time.sleep(think * rng.uniform(0.5, 1.5))
    session.close()
    client.close()


def crashed(agent_dir: str) -> None:
    """Acquires, then never beats and never lets go: a frozen client."""
    time.sleep(3)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(os.path.join(agent_dir, "llm-queue.sock"))
        s.sendall(json.dumps({"op": "acquire", "queueKey": KEY, "sessionKey": "crashed", "role": "child"}).encode()
                  + b"\n")
        time.sleep(8)


def main() -> None:
    log = sys.argv[1] if len(sys.argv) > 1 else "timeline-demo.log"
    if os.path.exists(log):
        os.unlink(log)
    agent_dir = tempfile.mkdtemp(prefix="lqdemo", dir="/tmp")
    with open(os.path.join(agent_dir, "llm-queue.json"), "w") as f:
        json.dump({"defaults": {"maxStreams": 1, "leaseTtlMs": 1000, "idleYieldMs": 1500, "agingAfterSlots": 2,
                                "agingAfterMs": 4000, "logFile": os.path.abspath(log)}}, f)
    daemon = subprocess.Popen([sys.executable, os.path.join(ROOT, "llmqueue.py"), "--agent-dir", agent_dir,
                               "--sweep-ms", "50", "--idle-exit-ms", "never"])
    try:
        time.sleep(0.5)
        rng = random.Random(7)
        threads = [threading.Thread(target=agent, args=(agent_dir, "main", "parent", 6, 0.8, 0.4, rng))]
        threads += [threading.Thread(target=agent, args=(agent_dir, f"sub{n}", "child", 4, 0.6, 0.5, rng))
                    for n in (1, 2, 3)]
        threads.append(threading.Thread(target=crashed, args=(agent_dir,)))
        for t in threads:
            t.start()
            time.sleep(0.2)
        for t in threads:
            t.join()
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(agent_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
