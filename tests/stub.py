"""A stub OpenAI-compatible model server for the suites: a slow streaming
``/v1/chat/completions`` on 127.0.0.1 (random port) that records every request.  Not a suite.

- ``user`` in the request body names the caller in the records; a ``slow-*`` user keeps streaming
  until ``let_slow_finish()``;
- ``user: "fail-500"`` answers 500 with a JSON error body;
- each record holds who, method, path (with query), the headers, and start/end (monotonic), and
  ``broken`` when the client went away mid-stream.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional


class StubEndpoint:
    def __init__(self, chunks: int = 6, gap: float = 0.03) -> None:
        self.records: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.slow_done = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                rec = stub._record("get", self)
                body = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                rec["end"] = time.monotonic()

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw or b"{}")
                rec = stub._record(body.get("user", "?"), self)
                rec["body"] = body
                if rec["who"] == "fail-500":
                    payload = json.dumps({"error": {"message": "stub says no"}}).encode()
                    self.send_response(500)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    rec["end"] = time.monotonic()
                    return
                slow = rec["who"].startswith("slow")
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    i = 0
                    while i < chunks or (slow and not stub.slow_done.is_set() and i < 2000):
                        chunk = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0,
                                 "model": "stub",
                                 "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]}
                        i += 1
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                        rec["chunks"] = i
                        time.sleep(gap)
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except OSError:
                    rec["broken"] = True
                rec["end"] = time.monotonic()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _record(self, who: str, handler: BaseHTTPRequestHandler) -> dict[str, Any]:
        rec: dict[str, Any] = {"who": who, "method": handler.command, "path": handler.path,
                               "headers": dict(handler.headers.items()), "start": time.monotonic(),
                               "end": None, "chunks": 0}
        with self.lock:
            self.records.append(rec)
        return rec

    def let_slow_finish(self) -> None:
        self.slow_done.set()

    def started(self, who: str) -> bool:
        return self.record(who) is not None

    def record(self, who: str) -> Optional[dict[str, Any]]:
        with self.lock:
            for r in self.records:
                if r["who"] == who:
                    return r
        return None

    def close(self) -> None:
        self.slow_done.set()
        self.server.shutdown()
        self.server.server_close()
