"""A simulated llama.cpp ``llama-server``: an OpenAI-compatible chat endpoint whose slots keep a
KV cache, for the suites and the benchmark.  Not a suite.  Standard library only.

What it models (a deliberately small but faithful picture of llama-server's slots):

- **Tokens.**  A chat prompt is rendered from ``messages``: for each message the word
  ``<|ROLE|>`` and then the words of its content (a string, or a list of ``{"type": "text",
  "text": ...}`` parts).  One word is one token, so word counts are token counts.  The reply is
  ``max_tokens`` (default 16; ``max_completion_tokens`` is accepted too) words ``g0 g1 ...``:
  deterministic, so a client that appends the reply to its history sends a reproducible prompt.
  It is cut there (``finish_reason: "length"``), except under a ``grammar`` (llama.cpp's field,
  which the benchmark gives an agent's answers): the sim reads no grammar, and ends such a reply
  by itself one token short of ``max_tokens`` (``"stop"``), where the end of text would come.
- **Slots.**  ``slots`` slots, each with a KV cache: the tokens it last processed, that is the
  prompt, then ``<|assistant|>`` (the chat template's generation header, which the next prompt
  renders before this reply) and the generated words.  The header is free: it counts in no
  ``*_n`` figure and in neither budget, so a growing conversation reuses exactly its previous
  prompt and reply.  A request whose prompt plus ``max_tokens`` exceeds ``slot_ctx`` is
  refused (400, llama-server's ``exceed_context_size_error``).
- **The server queue.**  When every slot is busy a request waits, first come first served, for a
  free slot.  Among idle slots it takes the one whose cache shares the longest common prefix
  (LCP) with its prompt, when that is above 0 (a shared first ``<|user|>`` is enough: there is
  no similarity threshold), else the least recently used one.  A client that hangs up while
  waiting leaves the queue.
- **Host cache** (``--cache-ram``): when a slot is about to be reused for a prompt that shares
  less with its cache than the cache's length, that cache is saved to the host cache (LRU,
  ``host_cache_tokens`` tokens in all, 0 = off; the oldest entries go until it fits; an entry
  larger than the budget is not kept; entries that are a prefix of the new one are dropped as
  subsumed).  Then the host-cache entry sharing the longest prefix with the prompt, when longer
  than what the slot's own cache shares, is restored into the slot (``restore_ms`` per restored
  token) and *removed* from the host cache: the slot holds it now, and it is saved again when
  the slot is next reused.
- **Cost.**  ``cache_n`` is the LCP used, but at least one prompt token is always evaluated (as
  llama.cpp does); ``prompt_n = len(prompt) - cache_n`` costs ``prefill_ms`` a token and each
  generated token ``decode_ms``.  One compute engine (one GPU) serves every slot: a global lock
  is held for each unit of work (a prefill chunk of 32 tokens, one decoded token) while its cost
  is slept, so parallel slots share the throughput instead of each getting a whole GPU.  The
  ``timings`` a reply reports are measured wall-clock times, engine waits included.
  ``batched_decode=True`` (a GPU's batched decode): the streams decoding at once share each
  decode step, so a step of N streams costs ``decode_ms`` as one does (a step carries every
  stream in its decode phase, as llama-server's loop decodes every active slot; a stream that
  starts decoding during a step rides the next one).  ``decode_steps`` counts the steps.
- **Unified KV** (``unified_ctx``, like ``--kv-unified -c N``): the slots' caches together hold
  at most ``unified_ctx`` tokens (a busy slot counts its whole reservation, prompt plus
  ``max_tokens``).  A request that needs more room first drops idle slots' caches, least
  recently used first (saved to the host cache when on); if busy slots still leave too little,
  it is refused with 500 ``failed to find free space in the KV cache``.  A slot's context is
  then at most ``unified_ctx`` too.  With a host cache, as llama-server's ``--cache-idle-slots``
  (on by default) does, each request's start saves every idle slot to the host cache and clears
  it (``cache_idle_slots=False``: idle slots keep their caches until room is needed), so only
  the running contexts stay in the KV and the host cache keeps the rest.
- **Responses**: ``POST /v1/chat/completions`` (and ``/chat/completions``), streaming (SSE, one
  chunk per token, a final chunk with its ``finish_reason`` and llama-server's
  ``timings``, a usage chunk when ``stream_options.include_usage``, then ``[DONE]``) or not (a
  ``chat.completion`` with ``usage`` and ``timings``).  A stream's headers go out when its slot
  starts.  Streams are written with ``Connection: close`` and no length, so a cut is a truncated
  stream; ``chunked=True`` frames them with chunked transfer encoding instead, as llama-server's
  HTTP library does, so a cut is also a broken HTTP body (no terminating chunk).  A slot is
  released just before the last bytes of its response go out.  ``GET /v1/models``, ``/health`` and
  ``/slots`` answer as llama-server's do; ``GET /props`` gives ``total_slots``.
- **Slot files** (``slot_files=True``, like ``--slot-save-path``): ``POST /slots/ID?action=save``
  with ``{"filename": NAME}`` keeps a copy of the slot's cache under NAME (waiting until the
  slot is idle, as llama-server defers it); ``action=restore`` puts a saved copy back into the
  slot (``restore_ms`` a token; a missing file is a 400 and clears the slot, as llama-server's
  failed restore does).  Both answer llama-server's bodies (``n_saved``/``n_restored`` and
  ``timings``).  Without ``slot_files`` both answer 501 ``not_supported_error``.  Every action
  is recorded in ``slot_actions`` as ``(action, filename, tokens)``; tokens is -1 for a failure.
- **Faults on demand**: ``inject(kind, count)`` makes the next ``count`` completion requests fail
  after taking a slot: ``"close"`` streams a few tokens and shuts the connection down (no
  ``[DONE]``); ``"500"`` and ``"kv-full"`` answer 500 with llama-server's error bodies;
  ``"restart"`` streams a few tokens and then acts as ``restart()``: every cache (slots and
  host) is dropped and every in-flight or queued request is cut, while the same port keeps
  serving.  A faulted request frees its slot.

Every completion request leaves a record in ``records`` (guard with ``lock``): ``who`` (the
body's ``user``, else the ``X-Agent`` header, else ``"?"``), ``path``, ``headers``, ``arrived``
and ``start`` (its slot started) / ``first_token`` / ``end`` (its slot was released, or its
refusal or cut went out) as ``time.monotonic()``, None until reached; ``slot``, ``prompt_tokens``, ``prompt_n``, ``cache_n``, ``restored``,
``predicted_n``, ``status`` (the HTTP status sent), ``broken`` (the client went away), ``cut``
(the server cut it: a fault or a restart) and ``fault`` (the injected kind, or None).
``max_overlap()`` is the most requests between ``start`` and ``end`` at one instant; ``totals()``
sums ``prompt_n`` and ``cache_n`` and counts the requests and the failed ones (an error status,
a fault, a cut, a client gone).
"""

from __future__ import annotations

import collections
import json
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Deque, Dict, List, Optional, Set, Tuple, Type

ASSISTANT = "<|assistant|>"
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
FAULTS = ("close", "500", "kv-full", "restart")
DEFAULT_MAX_TOKENS = 16
PREFILL_CHUNK = 32  # tokens per unit of prefill work on the engine
FAULT_AFTER = 3  # tokens streamed before a "close" or "restart" fault cuts the stream
MODEL = "kvsim"

EXCEED_CONTEXT = {"code": 400, "message": "the request exceeds the available context size, try increasing it",
                  "type": "exceed_context_size_error"}
KV_FULL = {"code": 500, "message": "failed to find free space in the KV cache", "type": "server_error"}
SERVER_ERROR = {"code": 500, "message": "simulated internal server error", "type": "server_error"}


def render(messages: Any) -> List[str]:
    """The prompt's tokens: ``<|ROLE|>`` and the content's words, message by message."""
    tokens: List[str] = []
    if not isinstance(messages, list):
        return tokens
    for message in messages:
        if not isinstance(message, dict):
            continue
        tokens.append(f"<|{message.get('role', 'user')}|>")
        content = message.get("content")
        if isinstance(content, str):
            tokens.extend(content.split())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    tokens.extend(part["text"].split())
    return tokens


def common_prefix(a: List[str], b: List[str]) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (slice compares run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Cut(Exception):
    """The server cuts this request: an injected fault, a restart, or close()."""


class _Gone(Exception):
    """The client went away."""


class _Refused(Exception):
    def __init__(self, status: int, error: Dict[str, Any]) -> None:
        super().__init__(error["message"])
        self.status = status
        self.error = error


class _Slot:
    def __init__(self, slot_id: int) -> None:
        self.id = slot_id
        self.cache: List[str] = []
        self.owner: Optional[Dict[str, Any]] = None  # the record of the request it processes
        self.reserved = 0  # a busy slot's budget: prompt + max_tokens
        self.header = 0  # 1 while the cache holds its last reply's free <|assistant|> header
        self.used = 0  # LRU tick of its last assignment

    def occupancy(self) -> int:
        """What the slot takes of a unified KV budget."""
        return self.reserved if self.owner is not None else len(self.cache) - self.header


class _Grant:
    def __init__(self, slot: _Slot, cache_n: int, restored: int) -> None:
        self.slot = slot
        self.cache_n = cache_n
        self.restored = restored


def _peer_gone(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class KVSim:
    """The simulated server, listening on 127.0.0.1 (``port`` 0: a random one) from construction
    until ``close()``.  ``url`` is the OpenAI base URL, ``base`` the server's root."""

    def __init__(self, slots: int = 1, slot_ctx: int = 4096, host_cache_tokens: int = 0,
                 prefill_ms: float = 0.2, decode_ms: float = 1.0, restore_ms: float = 0.0,
                 unified_ctx: Optional[int] = None, port: int = 0, *, chunked: bool = False,
                 slot_files: bool = False, batched_decode: bool = False, cache_idle_slots: bool = True) -> None:
        if slots < 1:
            raise ValueError("slots must be at least 1")
        self.slot_ctx = slot_ctx if unified_ctx is None else min(slot_ctx, unified_ctx)
        self.host_cache_tokens = host_cache_tokens
        self.prefill_ms = prefill_ms
        self.decode_ms = decode_ms
        self.restore_ms = restore_ms
        self.unified_ctx = unified_ctx
        # llama-server's --cache-idle-slots, on by default: with a unified KV and a host cache,
        # a task's start saves every idle slot to the host cache and clears it
        self.cache_idle_slots = cache_idle_slots and unified_ctx is not None and host_cache_tokens > 0
        self.chunked = chunked
        self.slot_files = slot_files
        self._files: Dict[str, tuple] = {}  # filename -> (cache, header): the slot files on "disk"
        self.slot_actions: List[tuple] = []  # (action, filename, tokens): guard with lock
        self.records: List[Dict[str, Any]] = []
        self.lock = threading.Lock()
        self._cv = threading.Condition()  # guards the slots, the server queue, the host cache, faults
        self._engine = threading.Lock()  # the one GPU
        self.batched_decode = batched_decode
        self._step_cv = threading.Condition()  # batched decode: the step being taken, and the steps taken
        self._stepping = False
        self._decoding: Dict[int, Tuple[int, int]] = {}  # per stream decoding: tokens made, tokens asked for
        self.decode_steps = 0
        self._slots = [_Slot(i) for i in range(slots)]
        self._waiting: Deque[object] = collections.deque()  # the server queue's tickets, FIFO
        self._host: List[List[str]] = []  # least recently used first
        self._host_tokens = 0
        self._faults: Deque[str] = collections.deque()
        self._conns: Set[socket.socket] = set()  # connections of requests being served or queued
        self._epoch = 0  # bumped by every restart: a queued request of an older epoch is cut
        self._tick = 0
        self._active = 0
        self._max_overlap = 0
        self._closed = False
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _make_handler(self))
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="kvsim",
                                        daemon=True)
        self._thread.start()

    # -- the public API ---------------------------------------------------------------------------

    def inject(self, kind: str, count: int = 1) -> None:
        """The next ``count`` completion requests fail as ``kind`` (one of FAULTS)."""
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r} (one of {', '.join(FAULTS)})")
        with self._cv:
            self._faults.extend([kind] * count)

    def max_overlap(self) -> int:
        """The most completion requests in their slots (prefill or decode) at one instant."""
        with self._cv:
            return self._max_overlap

    def totals(self) -> Dict[str, int]:
        with self.lock:
            records = list(self.records)
        return {"prompt_n": sum(r["prompt_n"] for r in records),
                "cache_n": sum(r["cache_n"] for r in records),
                "requests": len(records),
                "failed": sum(1 for r in records if _failed(r))}

    def host_cache_sizes(self) -> List[int]:
        """The host cache's entries, in tokens, least recently used first."""
        with self._cv:
            return [len(e) for e in self._host]

    def slot_caches(self) -> List[int]:
        """Each slot's cache, in tokens."""
        with self._cv:
            return [len(s.cache) for s in self._slots]

    def slot_action(self, slot_id: int, action: str, filename: Any) -> tuple:
        """``POST /slots/ID?action=...``: (status, body)."""
        if not self.slot_files:
            return 501, {"error": {"code": 501, "type": "not_supported_error", "message":
                                   "This server does not support slots action. Start it with `--slot-save-path`"}}
        if action not in ("save", "restore"):
            return 400, {"error": {"code": 400, "type": "invalid_request_error", "message": "Invalid action"}}
        if (not isinstance(filename, str) or not filename or "/" in filename or filename.startswith(".")):
            return 400, {"error": {"code": 400, "type": "invalid_request_error", "message": "Invalid filename"}}
        if not 0 <= slot_id < len(self._slots):
            return 400, {"error": {"code": 400, "type": "invalid_request_error", "message": "Invalid slot ID"}}
        slot = self._slots[slot_id]
        with self._cv:
            while slot.owner is not None and not self._closed:  # deferred until the slot is idle
                self._cv.wait(0.05)
            if action == "save":
                self._files[filename] = (list(slot.cache), slot.header)
                n = len(slot.cache)
            else:
                saved = self._files.get(filename)
                if saved is None:
                    slot.cache, slot.header = [], 0
                    n = -1
                else:
                    slot.cache, slot.header = list(saved[0]), saved[1]
                    n = len(slot.cache)
        with self.lock:
            self.slot_actions.append((action, filename, n))
        if n < 0:
            return 400, {"error": {"code": 400, "type": "invalid_request_error", "message":
                                   "Unable to restore slot: No available space in KV cache or invalid slot save file"}}
        if action == "restore" and self.restore_ms > 0:
            with self._engine:
                time.sleep(self.restore_ms * n / 1000.0)
        if action == "save":
            return 200, {"id_slot": slot_id, "filename": filename, "n_saved": n, "n_written": 64 * n,
                         "timings": {"save_ms": 0.1}}
        return 200, {"id_slot": slot_id, "filename": filename, "n_restored": n, "n_read": 64 * n,
                     "timings": {"restore_ms": self.restore_ms * n}}

    def restart(self) -> None:
        """As a server restart: every cache dropped, every in-flight or queued request cut; the
        same port goes on serving."""
        with self._cv:
            self._epoch += 1
            for slot in self._slots:
                slot.cache = []
                slot.owner = None
                slot.reserved = 0
                slot.header = 0
            self._host = []
            self._host_tokens = 0
            self._active = 0
            self._cv.notify_all()
            conns = list(self._conns)
        for conn in conns:
            _shut(conn)

    def close(self) -> None:
        with self._cv:
            self._closed = True
        self.restart()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)

    def __enter__(self) -> KVSim:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the model ---------------------------------------------------------------------------------

    def _take_fault(self) -> Optional[str]:
        with self._cv:
            return self._faults.popleft() if self._faults else None

    def _track(self, conn: socket.socket, on: bool) -> None:
        with self._cv:
            if on:
                self._conns.add(conn)
            else:
                self._conns.discard(conn)

    def _acquire(self, rec: Dict[str, Any], prompt: List[str], need: int, conn: socket.socket) -> _Grant:
        """Wait for a slot (FIFO), choose one, make room, restore from the host cache."""
        ticket = object()
        with self._cv:
            epoch = self._epoch
            self._waiting.append(ticket)
            try:
                while True:
                    if self._epoch != epoch or self._closed:
                        raise _Cut()
                    if self._waiting[0] is ticket and any(s.owner is None for s in self._slots):
                        break
                    self._cv.wait(0.05)
                    if _peer_gone(conn):
                        raise _Gone()
            finally:
                self._waiting.remove(ticket)
                self._cv.notify_all()
            slot = self._choose(prompt)
            if self.unified_ctx is not None:
                self._make_room(slot, need)
            lcp = common_prefix(slot.cache, prompt)
            restored = 0
            best, best_lcp = -1, lcp
            if self.host_cache_tokens > 0:
                for i, held in enumerate(self._host):
                    n = common_prefix(held, prompt)
                    if n > best_lcp:
                        best, best_lcp = i, n
            entry = self._pop_host(best) if best >= 0 else None
            if lcp < len(slot.cache):
                self._save(slot.cache)
            if entry is not None:
                slot.cache, lcp, restored = entry, best_lcp, len(entry)
            cache_n = min(lcp, max(0, len(prompt) - 1))
            slot.cache = slot.cache[:cache_n]
            slot.header = 0
            slot.owner = rec
            slot.reserved = need
            if self.cache_idle_slots:
                for idle in self._slots:
                    if idle.owner is None and idle.cache:
                        self._save(idle.cache)
                        idle.cache = []
                        idle.header = 0
            self._tick += 1
            slot.used = self._tick
            self._active += 1
            self._max_overlap = max(self._max_overlap, self._active)
        with self.lock:
            rec.update(start=time.monotonic(), slot=slot.id, cache_n=cache_n, prompt_n=len(prompt) - cache_n,
                       restored=restored)
        return _Grant(slot, cache_n, restored)

    def _choose(self, prompt: List[str]) -> _Slot:
        idle = [s for s in self._slots if s.owner is None]
        scored = [(common_prefix(s.cache, prompt), s) for s in idle]
        best = max(n for n, _ in scored)
        if best > 0:
            return min((s for n, s in scored if n == best), key=lambda s: (s.used, s.id))
        return min(idle, key=lambda s: (s.used, s.id))

    def _make_room(self, slot: _Slot, need: int) -> None:
        assert self.unified_ctx is not None

        def others() -> int:
            return sum(s.occupancy() for s in self._slots if s is not slot)

        if others() + need <= self.unified_ctx:
            return
        for idle in sorted((s for s in self._slots if s is not slot and s.owner is None and s.cache),
                           key=lambda s: s.used):
            self._save(idle.cache)
            idle.cache = []
            idle.header = 0
            if others() + need <= self.unified_ctx:
                return
        raise _Refused(500, KV_FULL)

    def _pop_host(self, i: int) -> List[str]:
        entry = self._host.pop(i)
        self._host_tokens -= len(entry)
        return entry

    def _save(self, tokens: List[str]) -> None:
        budget = self.host_cache_tokens
        if budget <= 0 or not tokens or len(tokens) > budget:
            return
        for i in reversed(range(len(self._host))):  # entries the new one contains are subsumed
            if common_prefix(self._host[i], tokens) == len(self._host[i]):
                self._pop_host(i)
        self._host.append(list(tokens))
        self._host_tokens += len(tokens)
        while self._host_tokens > budget:
            self._pop_host(0)

    def _compute(self, grant: _Grant, rec: Dict[str, Any], ms: float) -> None:
        """One unit of work on the engine; a request whose slot was taken away (restart) is cut."""
        with self._engine:
            if grant.slot.owner is not rec:
                raise _Cut()
            if ms > 0:
                time.sleep(ms / 1000.0)

    def _decode(self, grant: _Grant, rec: Dict[str, Any]) -> None:
        """One generated token.  Unbatched, a unit of work of its own.  Batched, as llama-server's
        loop decodes every active slot in one step: a step gives a token to each stream in its
        decode phase when the step began (generation runs ahead of what the stream has sent), and
        a stream that needs one it has not got yet takes the next step itself, if none runs."""
        if not self.batched_decode:
            self._compute(grant, rec, self.decode_ms)
            with self._step_cv:
                self.decode_steps += 1
            return
        key = id(rec)
        with self._step_cv:
            made, asked = self._decoding.get(key, (0, 0))
            asked += 1
            self._decoding[key] = (made, asked)
            while self._decoding[key][0] < asked:
                if not self._stepping:
                    break
                self._step_cv.wait()
            else:
                if grant.slot.owner is not rec:
                    raise _Cut()
                return
            self._stepping = True
            riders = list(self._decoding)
        try:
            self._compute(grant, rec, self.decode_ms)
        finally:
            with self._step_cv:
                self._stepping = False
                self.decode_steps += 1
                for other in riders:
                    if other in self._decoding:
                        made, asked = self._decoding[other]
                        self._decoding[other] = (made + 1, asked)
                self._step_cv.notify_all()

    def _decoded(self, rec: Dict[str, Any]) -> None:
        """A stream's decode phase ends: later steps carry it no more."""
        with self._step_cv:
            self._decoding.pop(id(rec), None)

    def _extend(self, grant: _Grant, rec: Dict[str, Any], tokens: List[str], header: bool = False) -> None:
        with self._cv:
            slot = grant.slot
            if slot.owner is rec:
                if header:
                    slot.header = 1
                room = self.slot_ctx + slot.header - len(slot.cache)
                slot.cache.extend(tokens[:max(0, room)])

    def _release(self, grant: _Grant, rec: Dict[str, Any]) -> None:
        """The request's processing ends: its slot is free (its ``end`` is now)."""
        self._decoded(rec)
        with self._cv:
            if grant.slot.owner is rec:
                grant.slot.owner = None
                grant.slot.reserved = 0
                self._active -= 1
            self._cv.notify_all()
        self._end(rec)

    def _end(self, rec: Dict[str, Any], **fields: Any) -> None:
        """Record ``fields`` and, the first time, the request's end."""
        with self.lock:
            rec.update(fields)
            if rec["end"] is None:
                rec["end"] = time.monotonic()

    def _owns(self, grant: _Grant, rec: Dict[str, Any]) -> bool:
        with self._cv:
            return grant.slot.owner is rec

    def _record(self, handler: BaseHTTPRequestHandler, who: str) -> Dict[str, Any]:
        rec: Dict[str, Any] = {
            "who": who, "path": handler.path, "headers": dict(handler.headers.items()),
            "arrived": time.monotonic(), "start": None, "first_token": None, "end": None, "slot": None,
            "prompt_tokens": 0, "prompt_n": 0, "cache_n": 0, "restored": 0, "predicted_n": 0,
            "max_tokens": None, "stream": False, "status": None, "broken": False, "cut": False, "fault": None}
        with self.lock:
            self.records.append(rec)
        return rec

    def _set(self, rec: Dict[str, Any], **fields: Any) -> None:
        with self.lock:
            rec.update(fields)

    def _slots_json(self) -> List[Dict[str, Any]]:
        with self._cv:
            return [{"id": s.id, "is_processing": s.owner is not None, "n_cache": len(s.cache),
                     "n_ctx": self.slot_ctx} for s in self._slots]


def _failed(rec: Dict[str, Any]) -> bool:
    return bool(rec["fault"] or rec["broken"] or rec["cut"] or (rec["status"] or 0) >= 400
                or (rec["status"] is None and rec["end"] is not None))


def _timings(cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> Dict[str, Any]:
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": 1000.0 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0}


def _usage(cache_n: int, prompt_n: int, predicted_n: int) -> Dict[str, Any]:
    return {"prompt_tokens": prompt_n + cache_n, "completion_tokens": predicted_n,
            "total_tokens": prompt_n + cache_n + predicted_n,
            "prompt_tokens_details": {"cached_tokens": cache_n}}


def _make_handler(sim: KVSim) -> Type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "kvsim/1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _json(self, status: int, obj: Any, rec: Optional[Dict[str, Any]] = None) -> None:
            body = json.dumps(obj).encode()
            if rec is not None:  # recorded before the client can see the response
                sim._end(rec, status=status)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, error: Dict[str, Any], rec: Optional[Dict[str, Any]] = None) -> None:
            self._json(status, {"error": error}, rec)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/health", "/v1/health"):
                self._json(200, {"status": "ok"})
            elif path in ("/v1/models", "/models"):
                self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                             "owned_by": "llamacpp"}]})
            elif path == "/slots":
                self._json(200, sim._slots_json())
            elif path == "/props":
                self._json(200, {"total_slots": len(sim._slots), "model_alias": MODEL,
                                 "default_generation_settings": {"n_ctx": sim.slot_ctx}})
            else:
                self._error(404, {"code": 404, "message": "File Not Found", "type": "not_found_error"})

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length > 0 else b""
            if path.startswith("/slots/"):
                query = urllib.parse.parse_qs(self.path.split("?", 1)[1] if "?" in self.path else "")
                try:
                    slot_id = int(path[len("/slots/"):])
                    filename = json.loads(raw or b"{}").get("filename")
                except (ValueError, AttributeError):
                    slot_id, filename = -1, None
                status, obj = sim.slot_action(slot_id, (query.get("action") or [""])[0], filename)
                self._json(status, obj)
                return
            if path not in CHAT_PATHS:
                self._error(404, {"code": 404, "message": "File Not Found", "type": "not_found_error"})
                return
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = None
            user = body.get("user") if isinstance(body, dict) else None
            rec = sim._record(self, user if isinstance(user, str) else self.headers.get("X-Agent") or "?")
            if not isinstance(body, dict):
                self._error(400, {"code": 400, "message": "invalid JSON body", "type": "invalid_request_error"}, rec)
                return
            max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
            if max_tokens is None:
                max_tokens = DEFAULT_MAX_TOKENS
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
                self._error(400, {"code": 400, "message": "max_tokens must be a non-negative integer",
                                  "type": "invalid_request_error"}, rec)
                return
            prompt = render(body.get("messages"))
            stream = bool(body.get("stream"))
            options = body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            sim._set(rec, prompt_tokens=len(prompt), max_tokens=max_tokens, stream=stream)
            need = len(prompt) + max_tokens
            if need > sim.slot_ctx:
                self._error(400, EXCEED_CONTEXT, rec)
                return
            fault = sim._take_fault()
            sim._set(rec, fault=fault)
            sim._track(self.connection, True)
            try:
                self._complete(rec, body, prompt, max_tokens, stream, usage, fault)
            finally:
                sim._track(self.connection, False)

        def _cut(self, rec: Dict[str, Any]) -> None:
            """Shut the connection down with no more bytes: a truncated stream."""
            sim._end(rec, cut=True)
            self.close_connection = True
            _shut(self.connection)

        def _complete(self, rec: Dict[str, Any], body: Dict[str, Any], prompt: List[str], max_tokens: int,
                      stream: bool, usage: bool, fault: Optional[str]) -> None:
            need = len(prompt) + max_tokens
            try:
                grant = sim._acquire(rec, prompt, need, self.connection)
            except _Refused as e:
                self._error(e.status, e.error, rec)
                return
            except _Cut:
                self._cut(rec)
                return
            except _Gone:
                sim._end(rec, broken=True)
                self.close_connection = True
                return
            # The slot is released before the last bytes go out (as llama-server frees a slot when
            # its task ends), so a client that reacts to the end never finds its request in a slot.
            try:
                if fault in ("500", "kv-full"):
                    sim._release(grant, rec)
                    self._error(500, SERVER_ERROR if fault == "500" else KV_FULL, rec)
                    return
                self._generate(rec, grant, body, prompt, max_tokens, stream, usage, fault)
            except _Cut:
                sim._release(grant, rec)
                self._cut(rec)
            except OSError:
                owned = sim._owns(grant, rec)
                sim._release(grant, rec)
                if owned:
                    sim._end(rec, broken=True)  # the client went away
                    self.close_connection = True
                else:
                    self._cut(rec)  # a restart shut the connection down under us
            finally:
                sim._release(grant, rec)

        def _send(self, data: bytes) -> None:
            if sim.chunked:
                data = b"%x\r\n%s\r\n" % (len(data), data)
            self.wfile.write(data)

        def _event(self, obj: Any) -> None:
            self._send(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def _generate(self, rec: Dict[str, Any], grant: _Grant, body: Dict[str, Any], prompt: List[str],
                      max_tokens: int, stream: bool, usage: bool, fault: Optional[str]) -> None:
            model = body.get("model") if isinstance(body.get("model"), str) else MODEL
            cid = f"chatcmpl-kvsim-{id(rec):x}"
            created = int(time.time())
            t0 = time.monotonic()
            if stream:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                if sim.chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                sim._set(rec, status=200)
                self.end_headers()
            if grant.restored and sim.restore_ms > 0:
                sim._compute(grant, rec, grant.restored * sim.restore_ms)
            for i in range(grant.cache_n, len(prompt), PREFILL_CHUNK):
                part = prompt[i:i + PREFILL_CHUNK]
                sim._compute(grant, rec, len(part) * sim.prefill_ms)
                sim._extend(grant, rec, part)
            sim._extend(grant, rec, [ASSISTANT], header=True)
            t1 = time.monotonic()
            cut_at = min(FAULT_AFTER, max(0, max_tokens - 1)) if fault in ("close", "restart") else -1
            ends = "grammar" in body  # it ends by itself, where its grammar is done: one token short
            words: List[str] = []
            for i in range(max(0, max_tokens - 1) if ends else max_tokens):
                if i == cut_at:
                    break
                sim._decode(grant, rec)
                word = f"g{i}"
                sim._extend(grant, rec, [word])
                words.append(word)
                sim._set(rec, predicted_n=len(words))
                if i == 0:
                    sim._set(rec, first_token=time.monotonic())
                if stream:
                    delta: Dict[str, Any] = {"content": word + " "}
                    if i == 0:
                        delta = {"role": "assistant", "content": word + " "}
                    self._event({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                 "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            if fault == "restart":
                sim.restart()
                raise _Cut()
            if fault == "close":
                raise _Cut()
            t2 = time.monotonic()
            timings = _timings(grant.cache_n, len(prompt) - grant.cache_n, (t1 - t0) * 1000.0, len(words),
                               (t2 - t1) * 1000.0)
            used = _usage(grant.cache_n, len(prompt) - grant.cache_n, len(words))
            sim._release(grant, rec)
            if stream:
                self._event({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": [{"index": 0, "delta": {}, "finish_reason": "stop" if ends else "length"}],
                             "timings": timings})
                if usage:
                    self._event({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                 "choices": [], "usage": used})
                self._send(b"data: [DONE]\n\n")
                if sim.chunked:
                    self.wfile.write(b"0\r\n\r\n")
            else:
                self._json(200, {"id": cid, "object": "chat.completion", "created": created, "model": model,
                                 "choices": [{"index": 0, "finish_reason": "stop" if ends else "length",
                                              "message": {"role": "assistant", "content": " ".join(words)}}],
                                 "usage": used, "timings": timings}, rec)

    return Handler


__all__ = ["KVSim", "render", "common_prefix", "FAULTS", "ASSISTANT"]
