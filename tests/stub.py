"""A stub OpenAI-compatible model server for the suites: a slow streaming
``/v1/chat/completions`` on 127.0.0.1 (random port) that records every request.  Not a suite.
``/v1/responses`` and ``/v1/messages`` stream in their own formats (Responses events, Anthropic
Messages events); every stream ends with the usage in ``USAGE``, and with the finish reason an ``X-Finish`` header
names (``stop``, the default; ``tool_calls``; ``length``), in the format's own words.  A body
with ``"stream": false`` gets one JSON answer in the path's format (kept as ``sent``).

- ``user`` in the request body (or an ``X-Who`` header) names the caller in the records; a
  ``slow-*`` user keeps streaming until ``let_slow_finish()``; a body that is not JSON is kept
  as ``raw``;
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


USAGE = {"prompt": 40, "cached": 30}  # what every stub response says it prefilled and reused


def _sse(event: Optional[str], data: dict[str, Any]) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def _opening(kind: str) -> bytes:
    if kind == "responses":
        return _sse("response.created", {"type": "response.created", "sequence_number": 0, "response": {
            "id": "resp_stub", "object": "response", "created_at": 0, "model": "stub", "status": "in_progress",
            "output": [], "parallel_tool_calls": False, "tool_choice": "auto", "tools": []}})
    if kind == "messages":
        return (_sse("message_start", {"type": "message_start", "message": {
            "id": "msg_stub", "type": "message", "role": "assistant", "model": "stub", "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": USAGE["prompt"] - USAGE["cached"], "output_tokens": 0,
                      "cache_read_input_tokens": USAGE["cached"], "cache_creation_input_tokens": 0}}})
            + _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}}))
    return b""


def _delta(kind: str, text: str) -> bytes:
    if kind == "responses":
        return _sse("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 1,
                                                   "item_id": "msg_1", "output_index": 0, "content_index": 0,
                                                   "delta": text, "logprobs": []})
    if kind == "messages":
        return _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "text_delta", "text": text}})
    chunk = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": "stub",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return _sse(None, chunk)


def _closing(kind: str, n: int, finish: str = "stop") -> bytes:
    prompt, cached = USAGE["prompt"], USAGE["cached"]
    if kind == "responses":
        output = [{"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "bash", "arguments": "{}",
                   "status": "completed"}] if finish == "tool_calls" else []
        done = "response.incomplete" if finish == "length" else "response.completed"
        return _sse(done, {"type": done, "sequence_number": 2, "response": {
            "id": "resp_stub", "object": "response", "created_at": 0, "model": "stub",
            "status": "incomplete" if finish == "length" else "completed",
            "output": output, "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": prompt, "output_tokens": n, "total_tokens": prompt + n,
                      "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens_details": {"reasoning_tokens": 0}}}})
    if kind == "messages":
        reason = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}[finish]
        return (_sse("content_block_stop", {"type": "content_block_stop", "index": 0})
                + _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None},
                                         "usage": {"output_tokens": n}})
                + _sse("message_stop", {"type": "message_stop"}))
    final = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": "stub",
             "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
             "usage": {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                       "prompt_tokens_details": {"cached_tokens": cached}},
             "timings": {"prompt_n": prompt - cached, "cache_n": cached, "predicted_n": n, "prompt_ms": 12.5}}
    return _sse(None, final) + b"data: [DONE]\n\n"


def _whole(path: str, n: int) -> bytes:
    """A non-streamed answer: chat completion, Response, or Anthropic Message, with its usage."""
    prompt, cached = USAGE["prompt"], USAGE["cached"]
    text = "".join(f"tok{i} " for i in range(n))
    if path.endswith("/responses"):
        obj: dict[str, Any] = {"id": "resp_stub", "object": "response", "status": "completed", "model": "stub",
                               "output": [{"type": "message", "role": "assistant",
                                           "content": [{"type": "output_text", "text": text}]}],
                               "usage": {"input_tokens": prompt, "output_tokens": n,
                                         "input_tokens_details": {"cached_tokens": cached}}}
    elif path.endswith("/messages"):
        obj = {"id": "msg_stub", "type": "message", "role": "assistant", "model": "stub",
               "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
               "usage": {"input_tokens": prompt - cached, "cache_read_input_tokens": cached, "output_tokens": n}}
    else:
        obj = {"id": "chatcmpl-stub", "object": "chat.completion", "model": "stub",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                         "prompt_tokens_details": {"cached_tokens": cached}}}
    return json.dumps(obj, indent=1).encode()


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
                self._json(rec, 200, json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}).encode())

            def do_HEAD(self) -> None:  # Claude Code's ``HEAD /`` before each run
                rec = stub._record("head", self)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                rec["end"] = time.monotonic()

            def _json(self, rec: dict[str, Any], status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                rec["end"] = time.monotonic()

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                rec = stub._record(self.headers.get("X-Who") or body.get("user", "?"), self)
                rec["body"] = body
                rec["raw"] = raw
                if rec["who"] == "fail-500":
                    self._json(rec, 500, json.dumps({"error": {"message": "stub says no"}}).encode())
                    return
                if body.get("stream") is False:  # one JSON body, in the path's format
                    rec["sent"] = _whole(self.path.split("?")[0], chunks)
                    self._json(rec, 200, rec["sent"])
                    return
                slow = rec["who"].startswith("slow")
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                kind = ("responses" if self.path.split("?")[0].endswith("/responses")
                        else "messages" if self.path.split("?")[0].endswith("/messages") else "chat")
                try:
                    self.wfile.write(_opening(kind))
                    i = 0
                    while i < chunks or (slow and not stub.slow_done.is_set() and i < 2000):
                        self.wfile.write(_delta(kind, f"tok{i} "))
                        i += 1
                        self.wfile.flush()
                        rec["chunks"] = i
                        time.sleep(gap)
                    self.wfile.write(_closing(kind, i, self.headers.get("X-Finish") or "stop"))
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
