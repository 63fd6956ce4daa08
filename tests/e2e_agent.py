"""A stand-in agent for the end-to-end test: one streaming chat request to an OpenAI-compatible
endpoint, made either through ``llmqueue.Session`` (mode ``session``) or bare (mode ``plain``,
for use under ``llmqueue run``).  Not a suite.

    python e2e_agent.py session AGENT_DIR QUEUE_KEY SESSION ROLE URL
    python e2e_agent.py plain URL SESSION
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stream(url: str, who: str) -> int:
    body = json.dumps({"model": "stub", "stream": True, "user": who,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(url + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    chunks = 0
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunks += 1
    return chunks


def main() -> int:
    mode = sys.argv[1]
    if mode == "plain":
        url, who = sys.argv[2], sys.argv[3]
        return 0 if stream(url, who) > 0 else 1
    agent_dir, key, session, role, url = sys.argv[2:7]
    import llmqueue

    client = llmqueue.Client(agent_dir, autostart=False)
    s = client.session(key, session, role=role)
    with s.run():
        with s.request():
            ok = stream(url, session) > 0
    s.close()
    client.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
