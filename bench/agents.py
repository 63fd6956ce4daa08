#!/usr/bin/env python3
"""What the queue exists for, measured: several coding agents sharing one real model server.

    python3 bench/agents.py --llama-server PATH --quick    # a few minutes: the small model
    python3 bench/agents.py --llama-server PATH            # every set-up, both patterns
    python3 bench/agents.py --upstream http://127.0.0.1:8080   # your own running server
    python3 bench/agents.py ... --json out.json            # also write every figure and request

Each **agent** owns a conversation: a system prompt of its own (``--system-tokens``), a task,
then streamed requests that grow it with the reply and a tool's output between requests.

**Patterns.**
- *delegate*: a parent makes two requests, parks in a blocking tool (``subagent``) while
  ``--children`` subagents run four requests each, concurrently, then answers once more.
- *interactive*: a parent with think time between turns, like a person typing, while background
  subagents run long jobs (a job: four requests).  Only the parent's latency matters; the
  background's throughput is reported beside it (requests completed while the parent worked).

**How the agents reach the server** (``--access``):
- ``none``: straight to the server (the baseline every ratio is against);
- ``client``: ``llmqueue.Client`` sessions used as an agent uses them: ``run()`` around a run,
  ``request()`` before each model request, ``tool(name)`` around each tool (``subagent`` is a
  blocking tool);
- ``proxy``: ``llmqueue proxy`` with the session and tier in the base URL (``/s/NAME/ROLE/v1``);
- ``proxy-anon``: the proxy with no session names (what a tool that only takes a base URL gets);
- ``client-warm``, ``proxy-warm``, ``proxy-anon-warm``: ``client``, ``proxy`` and ``proxy-anon``
  with a daemon that served agents on
  this server before (``lesson``: the same agents' run, once, with conversations of their own)
  and exited, as a daemon does when its last client leaves: the run's daemon starts from the
  agent dir's state file (what a switch costs there, learned);
- ``client-again``, ``proxy-again``: ``client`` and ``proxy`` on a daemon (and proxy) that is
  still up after it served the same agents' run, under the same session names, with
  conversations of their own (a subagent named as before starts its next task);
- ``ACCESS-sN`` (``client-s4``, ``proxy-cost-s2``): ACCESS with the daemon's ``maxStreams`` at N;
  ``ACCESS-sauto`` (``proxy-sauto``): at ``"auto"``, from the server's ``/props`` (the proxy asks).
Every queued run gets a fresh daemon with the **default config** (only ``logFile`` set, for the
dead-time figure, and what the access's name says) on a temporary agent dir.

**Server set-ups** (``--llama-server PATH``: the benchmark starts the server for every run, so
every run meets empty caches; it writes its own random-weight model, see below):
- ``1slot-nocache``: one slot, llama.cpp's host prompt cache off (``--cache-ram 0``);
- ``1slot-cache``: one slot with llama.cpp's host prompt cache;
- ``nslot-unified``: one slot per agent, sharing one unified KV cache (``--kv-unified``);
- ``1slot-save``: ``1slot-cache`` plus ``--slot-save-path``: at a switch the queue's client side
  (``llmqueue.SlotStore``, in the proxy and in the ``client`` access's sessions) saves the
  outgoing context to a file and restores the returning one's.
Each with two workloads: ``fit`` (the slot holds one agent's context and the host cache, or the
unified KV, holds them all) and ``pressure`` (the host cache, or the unified KV, holds about two
agents' contexts).  With ``--upstream`` the server is yours: one set-up, ``upstream``, one
workload, ``as-is``; every prompt starts with a fresh random word, so caches left by earlier
runs never help a later one.

**The model.**  With ``--llama-server``, a llama-architecture GGUF with random weights is written
with ``gguf`` (llama.cpp's own Python writer) and numpy, with a vocabulary built here: ``<unk>``,
``<s>``, ``</s>``, the 256 byte tokens, and one token for every word the agents say (a word is
one token, so ``--system-tokens`` is a token count).  Random weights speak gibberish, but
tokenizing, prefill, caching and streaming are real.  ``pip install '.[bench]'`` brings both.

**Figures**, from the server's own accounting (llama.cpp's ``timings.prompt_n``/``cache_n``, else
``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``):
- prefilled and reused tokens; the *oracle* prefill: what a server that never evicts would
  prefill, each conversation's first prompt once plus what each later request adds;
- makespan: from the first request to the last agent's end;
- time to first token per tier, from the moment the agent asks (any wait for the slot included);
- dead time: a slot held while someone waited for it and the holder had no request in flight
  (from the daemon's event log and the agents' own request times; the proxy's anonymous
  sessions hold only while their request is in flight);
- failed requests.
Every run's figure is printed with its ratio against ``none`` in the same set-up, in one table.
``--repeat N`` runs every access N times, in rounds (each round runs the access list once, so
that a slow spell of the machine meets every access alike): each row's ratio is against the
``none`` of its own round, and a second table gives per access the median over the rounds, of
the figures and of those ratios, with their range.

The module under test stays standard library only; so is this file, but for the model writer.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from typing import Any, Callable, ContextManager, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = os.path.join(ROOT, "llmqueue.py")
OLD_MODULE: Optional[str] = None  # --old: an earlier llmqueue.py, for the accesses named ACCESS@old
MID_MODULE: Optional[str] = None  # --mid: a second one (a step between old and new), for ACCESS@mid
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
import llmqueue  # noqa: E402

_LIBRARIES: Dict[str, Any] = {}


def library() -> Any:
    """The llmqueue module the run's ``Client`` comes from: ``MODULE``'s, so an ``ACCESS@old`` run
    uses the earlier library as well as its daemon and proxy (old against new, client side too)."""
    if os.path.samefile(MODULE, llmqueue.__file__):
        return llmqueue
    lib = _LIBRARIES.get(MODULE)
    if lib is None:
        import importlib.util
        spec = importlib.util.spec_from_file_location(f"llmqueue_earlier_{len(_LIBRARIES)}", MODULE)
        assert spec is not None and spec.loader is not None
        lib = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = lib  # its NamedTuples and dataclasses look their module up
        spec.loader.exec_module(lib)
        _LIBRARIES[MODULE] = lib
    return lib

now = time.time  # wall clock: the daemon's event log is in wall time, and so is every figure here

# =================================================================================================
# Words and the model
# =================================================================================================

CONSONANTS = "bcdfghjklmnprstvz"
VOWELS = "aeiou"
# Every word the agents say: consonant-vowel-consonant, one token each in the model's vocabulary.
WORDS = [a + v + b for a in CONSONANTS for v in VOWELS for b in CONSONANTS]


def vocabulary() -> Tuple[List[str], List[float], List[int]]:
    """The model's tokens, scores and types (llama's SentencePiece model, as llama.cpp reads it).

    Pieces merge pairwise by score, so each word ``▁bak`` is reachable as ``▁`` + ``b`` ->
    ``▁b`` -> ``▁ba`` -> ``▁bak``: every prefix of every word is in the vocabulary, the longer
    ones scoring higher."""
    normal, unknown, control, byte = 1, 2, 3, 6
    tokens = ["<unk>", "<s>", "</s>"]
    types = [unknown, control, control]
    tokens += [f"<0x{i:02X}>" for i in range(256)]
    types += [byte] * 256
    pieces = ["\u2581"] + sorted(set(CONSONANTS + VOWELS))
    for w in WORDS:
        for n in range(1, len(w) + 1):
            pieces.append("\u2581" + w[:n])
    seen: Dict[str, None] = {}
    for p in pieces:
        seen.setdefault(p, None)
    for p in seen:
        tokens.append(p)
        types.append(normal)
    scores = [0.0] * len(tokens)
    for i, t in enumerate(tokens):
        if types[i] == normal:
            scores[i] = float(len(t))  # longer pieces win every merge
    return tokens, scores, types


class ModelSize(NamedTuple):
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int

    def kv_bytes_per_token(self) -> int:
        return self.n_layer * 2 * self.n_embd * 2  # K and V, f16, every layer (no GQA)


MODEL_SIZES = {
    "tiny": ModelSize(n_embd=256, n_layer=4, n_head=4, n_ff=768),  # for a smoke run: prefill is nearly free
    "small": ModelSize(n_embd=512, n_layer=8, n_head=8, n_ff=1408),  # ~1.5k tokens/s of prefill on 2 cores
}


def write_model(path: str, size: ModelSize, ctx: int = 32768, seed: int = 0) -> None:
    """A random-weight llama GGUF at ``path`` (``gguf`` and numpy: the ``bench`` extra)."""
    try:
        import gguf
        import numpy as np
    except ImportError as e:
        raise SystemExit(f"bench/agents.py: writing the model needs gguf and numpy "
                         f"(pip install '.[bench]'): {e}")
    tokens, scores, types = vocabulary()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("llmqueue-bench-random")
    w.add_context_length(ctx)
    w.add_embedding_length(size.n_embd)
    w.add_block_count(size.n_layer)
    w.add_feed_forward_length(size.n_ff)
    w.add_head_count(size.n_head)
    w.add_head_count_kv(size.n_head)
    w.add_rope_dimension_count(size.n_embd // size.n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)  # mostly f16
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    # A ChatML template: llama-server renders the agents' messages with it.
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def mat(rows: int, cols: int) -> Any:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    n_e, f, v = size.n_embd, size.n_ff, len(tokens)
    w.add_tensor("token_embd.weight", mat(v, n_e))
    w.add_tensor("output_norm.weight", np.ones(n_e, dtype=np.float32))
    w.add_tensor("output.weight", mat(v, n_e))
    for i in range(size.n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_e, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + name + ".weight", mat(n_e, n_e))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_e, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", mat(f, n_e))
        w.add_tensor(p + "ffn_up.weight", mat(f, n_e))
        w.add_tensor(p + "ffn_down.weight", mat(n_e, f))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# =================================================================================================
# One streamed request
# =================================================================================================


class Reply(NamedTuple):
    ok: bool
    status: int
    text: str
    first: Optional[float]  # wall time of the first content chunk
    end: float
    prompt_n: Optional[int]  # tokens the server prefilled for this request
    cache_n: Optional[int]  # tokens it reused from a cache
    error: str
    completion_n: Optional[int] = None  # tokens it generated
    finish: Optional[str] = None  # its finish_reason: "stop" for an answer, "length" when cut
    prompt_ms: Optional[float] = None  # how long the server took to prefill (llama.cpp's timings.prompt_ms)
    decode_ms: Optional[float] = None  # how long it took to generate completion_n (timings.predicted_ms)


def v1_base(url: str) -> str:
    """``http://h:p`` or ``http://h:p/v1`` -> ``http://h:p/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def server_root(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def stream_chat(base: str, messages: List[Dict[str, str]], max_tokens: int,
                headers: Optional[Dict[str, str]] = None, timeout: float = 600.0, final: bool = False) -> Reply:
    """POST ``base``/chat/completions with ``stream: true`` and read the SSE stream to its end.

    A ``final`` reply ends the agent's turn the way a real model's answer does: llama.cpp's
    ``grammar`` makes it ``max_tokens`` digits (one byte token each, so the count is exact), after
    which only the end of text may follow, and the response says ``finish_reason: stop``.  Any
    other reply is cut at ``max_tokens`` (``length``), as random weights never end by themselves:
    neither a tool call nor an answer, by the response's own account."""
    u = urllib.parse.urlsplit(base)
    fields: Dict[str, Any] = {"model": "bench", "messages": messages, "stream": True, "max_tokens": max_tokens,
                              "temperature": 0, "ignore_eos": True, "cache_prompt": True,
                              "stream_options": {"include_usage": True}}
    if final:
        fields.update(grammar=f"root ::= [0-9]{{{max_tokens}}}", ignore_eos=False, max_tokens=max_tokens + 1)
    body = json.dumps(fields).encode()
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
    first: Optional[float] = None
    parts: List[str] = []
    timings: Dict[str, Any] = {}
    usage: Dict[str, Any] = {}
    finish: Optional[str] = None
    try:
        conn.request("POST", u.path.rstrip("/") + "/chat/completions", body=body,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            err = resp.read()[:300].decode("utf-8", "replace")
            return Reply(False, resp.status, "", None, now(), None, None, err)
        done = False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                obj = json.loads(data)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            if "error" in obj:
                return Reply(False, resp.status, "", first, now(), None, None, str(obj["error"])[:300])
            if isinstance(obj.get("timings"), dict):
                timings = obj["timings"]
            if isinstance(obj.get("usage"), dict):
                usage = obj["usage"]
            for choice in obj.get("choices") or ():
                if choice.get("finish_reason") is not None:
                    finish = str(choice["finish_reason"])
                content = (choice.get("delta") or {}).get("content")
                if content is not None:
                    if first is None:
                        first = now()
                    parts.append(content)
        if not done:
            return Reply(False, resp.status, "", first, now(), None, None, "the stream broke off")
    except (OSError, http.client.HTTPException) as e:
        return Reply(False, 0, "", first, now(), None, None, f"{type(e).__name__}: {e}")
    finally:
        conn.close()
    prompt_n, cache_n = _accounting(timings, usage)
    completion = timings.get("predicted_n", usage.get("completion_tokens"))
    prompt_ms = timings.get("prompt_ms")
    decode_ms = timings.get("predicted_ms")
    return Reply(True, 200, "".join(parts), first, now(), prompt_n, cache_n, "",
                 completion if isinstance(completion, int) else None, finish,
                 float(prompt_ms) if isinstance(prompt_ms, (int, float)) else None,
                 float(decode_ms) if isinstance(decode_ms, (int, float)) else None)


def _accounting(timings: Dict[str, Any], usage: Dict[str, Any]) -> Tuple[Optional[int], Optional[int]]:
    """(prefilled, reused) from llama.cpp's timings, else from OpenAI usage."""
    if isinstance(timings.get("prompt_n"), int):
        cache = timings.get("cache_n")
        return timings["prompt_n"], cache if isinstance(cache, int) else 0
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int):
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        cached = cached if isinstance(cached, int) else 0
        return prompt - cached, cached
    return None, None


# =================================================================================================
# How agents reach the server
# =================================================================================================


class Access:
    """How an agent reaches the server, and how it tells the queue about its run (no-ops here:
    the server alone)."""

    name = "none"

    def __init__(self, upstream: str) -> None:
        self.upstream = v1_base(upstream)

    def base(self, agent: "Agent") -> str:
        return self.upstream

    def run(self, agent: "Agent") -> ContextManager[Any]:
        return contextlib.nullcontext()

    def request(self, agent: "Agent") -> ContextManager[Any]:
        return contextlib.nullcontext()

    def tool(self, agent: "Agent", name: str) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def reported(self, agent: "Agent", reply: "Reply") -> None:
        """A request's reply came back (the server's token counts in it)."""

    def close(self) -> None:
        pass


class ClientAccess(Access):
    """``llmqueue.Client`` sessions, one per agent, used as an agent uses them."""

    name = "client"

    def __init__(self, upstream: str, client: llmqueue.Client, queue_key: Optional[str] = None,
                 grace_ms: int = llmqueue.GRACE_MS, slot_files: bool = True) -> None:
        super().__init__(upstream)
        self.client = client
        self.queue_key = queue_key or self.upstream
        self.grace_ms = grace_ms
        # As a careful user would: llama.cpp's slot files at a switch (off by itself where the
        # server has none, after one look).
        self.slots = sys.modules[type(client).__module__].SlotStore(self.upstream) if slot_files else None
        self.sessions: Dict[str, llmqueue.Session] = {}
        self.lock = threading.Lock()

    def _session(self, agent: "Agent") -> llmqueue.Session:
        with self.lock:
            s = self.sessions.get(agent.session)
            if s is None:
                s = self.sessions[agent.session] = self.client.session(
                    self.queue_key, agent.session, agent.role, grace_ms=self.grace_ms, slots=self.slots)
            return s

    def run(self, agent: "Agent") -> ContextManager[Any]:
        return self._session(agent).run()

    def request(self, agent: "Agent") -> ContextManager[Any]:
        return self._session(agent).request()

    def tool(self, agent: "Agent", name: str) -> ContextManager[Any]:
        return self._session(agent).tool(name)  # type: ignore[no-any-return]

    def reported(self, agent: "Agent", reply: "Reply") -> None:
        if reply.prompt_n is not None:  # as Session.report would: the server's counts and times
            decode = None
            if reply.completion_n is not None and reply.decode_ms is not None:
                decode = (reply.completion_n, reply.decode_ms)
            self.client.usage(self.queue_key, agent.session, reply.prompt_n, reply.cache_n or 0,
                              prefill_ms=reply.prompt_ms, server=self.client.server_figures(self.queue_key),
                              decode=decode)

    def close(self) -> None:
        with self.lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for s in sessions:
            s.close()


class ProxyAccess(Access):
    """Through ``llmqueue proxy`` at ``proxy_url``: named (``/s/NAME/ROLE/v1``) or anonymous."""

    def __init__(self, upstream: str, proxy_url: str, named: bool) -> None:
        super().__init__(upstream)
        self.proxy = proxy_url.rstrip("/")
        self.named = named
        self.name = "proxy" if named else "proxy-anon"

    def base(self, agent: "Agent") -> str:
        if self.named:
            return f"{self.proxy}/s/{urllib.parse.quote(agent.session, safe='')}/{agent.role}/v1"
        return self.proxy + "/v1"


# =================================================================================================
# Agents and patterns
# =================================================================================================


class Workload(NamedTuple):
    """The agents' sizes (tokens are words) and times (seconds)."""

    system_tokens: int = 1500
    task_tokens: int = 40
    reply_tokens: int = 32
    tool_tokens: int = 150
    tool_s: float = 0.5
    children: int = 3
    child_requests: int = 4
    parent_before: int = 2  # delegate: the parent's requests before it parks
    turns: int = 6  # interactive: the parent's turns
    think_s: float = 2.0  # interactive: the person's think time before each turn
    limit_s: float = 300.0  # interactive: the run's time limit (a starved parent must not hang the run)
    final_stop: bool = True  # an agent's answer ends with finish_reason "stop" (see stream_chat)
    # tool times: "const" (every tool call takes ``tool_s``), or "heavy": a Pareto tail (shape
    # 1.5) with mean ``tool_s``, most calls short and a few long; and, either way, with chance
    # ``long_tool_p``, a long tool (a test run) of ``long_tool_s`` to 6x that
    tool_dist: str = "const"
    long_tool_p: float = 0.0
    long_tool_s: float = 5.0

    def tool_time(self, rng: random.Random) -> float:
        """One tool call's length, drawn from the agent's own random stream (reproducible)."""
        if self.long_tool_p > 0 and rng.random() < self.long_tool_p:
            return self.long_tool_s * rng.uniform(1.0, 6.0)
        if self.tool_dist == "heavy":
            return self.tool_s * rng.paretovariate(1.5) / 3.0
        return self.tool_s

    def context_tokens(self) -> int:
        """About the largest context one agent reaches (a child's, at its last request)."""
        return (self.system_tokens + self.task_tokens + 8
                + self.child_requests * (self.reply_tokens + self.tool_tokens + 8))


class Record(NamedTuple):
    agent: str
    session: str
    conversation: str
    role: str
    ask: float
    first: Optional[float]
    end: float
    ok: bool
    status: int
    prompt_n: Optional[int]
    cache_n: Optional[int]
    error: str
    completion_n: Optional[int] = None


class Agent:
    """One conversation: a system prompt of its own, then requests that grow it with each reply
    and a tool's output."""

    def __init__(self, name: str, role: str, workload: Workload, salt: str, seed: int,
                 records: List[Record], lock: threading.Lock, session: Optional[str] = None,
                 conversation: Optional[str] = None) -> None:
        self.name = name
        self.role = role
        self.session = session or name
        self.conversation = conversation or name
        self.workload = workload
        self.rng = random.Random(f"{salt}/{seed}/{self.conversation}")
        self.records = records
        self.lock = lock
        # A system prompt of the conversation's own: no two conversations share a prefix beyond the
        # chat template's, so the oracle (each conversation's first prompt once) is exact.
        system = " ".join([salt] + self.rng.choices(WORDS, k=workload.system_tokens))
        self.messages: List[Dict[str, str]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": self.words(workload.task_tokens)},
        ]

    def words(self, n: int) -> str:
        return " ".join(self.rng.choices(WORDS, k=n))

    def ask(self, access: Access, asked: Optional[float] = None, final: bool = False) -> Reply:
        """One model request, through ``access.request()``; ``asked`` is when the agent asked (the
        start of its run, for a run's first request).  ``final``: the reply is the agent's answer
        (a job's last, or a person's turn), and says so when the workload's ``final_stop`` is on."""
        asked = now() if asked is None else asked
        with access.request(self):
            reply = stream_chat(access.base(self), self.messages, self.workload.reply_tokens,
                                headers={"X-Agent": self.name}, final=final and self.workload.final_stop)
            access.reported(self, reply)
        with self.lock:
            self.records.append(Record(self.name, self.session, self.conversation, self.role, asked, reply.first,
                                       reply.end, reply.ok, reply.status, reply.prompt_n, reply.cache_n,
                                       reply.error, reply.completion_n))
        self.messages.append({"role": "assistant", "content": reply.text if reply.ok else ""})
        return reply

    def tool(self, access: Access, name: str = "bash", output: Optional[str] = None,
             work: Optional[Callable[[], None]] = None) -> None:
        """A tool call: ``work`` (or ``tool_s`` of sleep), then its output joins the conversation."""
        with access.tool(self, name):
            if work is not None:
                work()
            else:
                time.sleep(self.workload.tool_time(self.rng))
        # a tool's output, as agents send it (a person's words are a user message)
        self.messages.append({"role": "tool", "content": output or self.words(self.workload.tool_tokens)})

    def requests(self, access: Access, n: int, stop: Optional[threading.Event] = None) -> None:
        """A run of ``n`` requests with a tool call between each two."""
        asked = now()
        with access.run(self):
            for i in range(n):
                if stop is not None and stop.is_set():
                    return
                self.ask(access, asked if i == 0 else None, final=i == n - 1)
                if i < n - 1:
                    self.tool(access)


class RunResult(NamedTuple):
    records: List[Record]
    start: float
    end: float
    parent_end: float  # interactive: when the parent's last turn ended
    limit_hit: bool = False  # interactive: the time limit stopped the run before the parent was done


def delegate(access: Access, wl: Workload, salt: str, seed: int = 0) -> RunResult:
    """A parent works, parks in ``subagent`` while ``children`` subagents run, then resumes."""
    records: List[Record] = []
    lock = threading.Lock()
    parent = Agent("parent", "parent", wl, salt, seed, records, lock)
    children = [Agent(f"sub{i + 1}", "child", wl, salt, seed, records, lock) for i in range(wl.children)]
    errors: List[BaseException] = []

    def child_run(agent: Agent) -> None:
        try:
            agent.requests(access, wl.child_requests)
        except BaseException as e:  # noqa: B902 -- reported by the parent
            errors.append(e)

    def subagents() -> None:
        threads = [threading.Thread(target=child_run, args=(c,), daemon=True) for c in children]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    start = now()
    with access.run(parent):
        for i in range(wl.parent_before):
            parent.ask(access, start if i == 0 else None)
            parent.tool(access)
        parent.tool(access, "subagent", work=subagents)
        parent.ask(access, final=True)
    end = now()
    if errors:
        raise errors[0]
    return RunResult(records, start, end, end)


def interactive(access: Access, wl: Workload, salt: str, seed: int = 0, background: bool = True) -> RunResult:
    """A person's turns with think time between them, while background subagents run long jobs
    (``child_requests`` requests each, every job a subagent session of its own) until the person
    is done, or until ``limit_s``: then the background stops and the turns left are not taken."""
    records: List[Record] = []
    lock = threading.Lock()
    stop = threading.Event()
    errors: List[BaseException] = []

    def worker(i: int) -> None:
        job = 0
        try:
            while not stop.is_set():
                job += 1
                name = f"bg{i + 1}"
                agent = Agent(name, "child", wl, salt, seed, records, lock, session=f"{name}-job{job}",
                              conversation=f"{name}-job{job}")
                agent.requests(access, wl.child_requests, stop)
        except BaseException as e:  # noqa: B902
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True)
               for i in range(wl.children if background else 0)]
    start = now()
    limit = threading.Timer(wl.limit_s, stop.set)
    limit.daemon = True
    limit.start()
    for t in threads:
        t.start()
    parent = Agent("parent", "parent", wl, salt, seed, records, lock)
    limit_hit = False
    for turn in range(wl.turns):
        if stop.wait(wl.think_s):
            limit_hit = True
            break
        asked = now()
        with access.run(parent):
            parent.ask(access, asked, final=True)
        parent.messages.append({"role": "user", "content": parent.words(wl.task_tokens)})
    limit_hit = limit_hit or stop.is_set()
    parent_end = now()
    limit.cancel()
    stop.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return RunResult(records, start, now(), parent_end, limit_hit)


PATTERNS: Dict[str, Callable[..., RunResult]] = {"delegate": delegate, "interactive": interactive}


# =================================================================================================
# Figures
# =================================================================================================


def pct(xs: Sequence[float], p: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p
    lo, hi = int(math.floor(k)), int(math.ceil(k))
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def oracle_prefill(records: Sequence[Record]) -> int:
    """What a server that never evicts would prefill: each conversation's first prompt once,
    plus what each later request adds (from the server's own token counts).  The reply the
    server generated is in its cache already, so it is not counted as added."""
    last: Dict[str, int] = {}
    total = 0
    for r in sorted(records, key=lambda r: r.ask):
        if not r.ok or r.prompt_n is None:
            continue
        size = r.prompt_n + (r.cache_n or 0)
        total += max(0, size - last.get(r.conversation, 0))
        last[r.conversation] = size + (r.completion_n or 0)
    return total


Interval = Tuple[float, float]


def _union(spans: Sequence[Interval]) -> List[Interval]:
    out: List[Interval] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _intersect(xs: Sequence[Interval], ys: Sequence[Interval]) -> List[Interval]:
    out: List[Interval] = []
    i = j = 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(xs: Sequence[Interval], ys: Sequence[Interval]) -> List[Interval]:
    out: List[Interval] = []
    for a, b in xs:
        cur = a
        for c, d in ys:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


def _measure(xs: Sequence[Interval]) -> float:
    return sum(b - a for a, b in xs)


def session_aliases(events: List[Dict[str, Any]], records: Sequence[Record]) -> Dict[str, str]:
    """The log's session keys that no agent uses (the proxy's own, like ``conv:...``) -> the
    agent session whose request reported the same token counts within 2 s of the ``usage``."""
    known = {r.session for r in records}
    by_counts: Dict[Tuple[Optional[int], Optional[int]], List[Record]] = {}
    for r in records:
        by_counts.setdefault((r.prompt_n, r.cache_n), []).append(r)
    aliases: Dict[str, str] = {}
    for e in events:
        if e.get("event") != "usage" or e.get("sessionKey") in known or e.get("sessionKey") in aliases:
            continue
        near = [r for r in by_counts.get((e.get("prefilled"), e.get("reused")), []) if abs(r.end - e["t"]) < 2.0]
        if len(near) == 1:
            aliases[str(e["sessionKey"])] = near[0].session
    return aliases


def dead_time(events: List[Dict[str, Any]], records: Sequence[Record]) -> Tuple[float, Dict[str, float]]:
    """Seconds a slot was held while someone else waited for it and its holder had no request
    in flight: (total, per session).  Holds and waits come from the daemon's event log; a
    holder's requests from the agents' own records.  A session the proxy named itself (``conv:``,
    from the conversation) is the agent whose request's token counts its ``usage`` events carry;
    a session no agent is known by holds only while its one request is in flight: never dead."""
    busy: Dict[str, List[Interval]] = {}
    for r in records:
        busy.setdefault(r.session, []).append((r.ask, r.end))
    busy = {k: _union(v) for k, v in busy.items()}
    for alias, session in session_aliases(events, records).items():
        busy.setdefault(alias, busy.get(session, []))
    total = 0.0
    per_session: Dict[str, float] = {}
    for q in llmqueue.replay(events).values():
        for h in q["holds"]:
            if h.session not in busy:
                continue
            # a parent's spare stream was of use to no child: only a waiting parent makes it dead
            others = _union([(w.start, w.end) for w in q["waits"]
                             if w.session != h.session and (not h.spare or w.role == "parent")])
            idle = _subtract([(h.start, h.end)], busy[h.session])
            dead = _measure(_intersect(idle, others))
            if dead > 0:
                total += dead
                per_session[h.session] = per_session.get(h.session, 0.0) + dead
    return total, per_session


def figures(result: RunResult, events: Optional[List[Dict[str, Any]]]) -> Dict[str, Any]:
    recs = result.records
    ok = [r for r in recs if r.ok]
    counted = [r for r in ok if r.prompt_n is not None]

    def ttft(role: str, until: Optional[float] = None) -> List[float]:
        return [r.first - r.ask for r in ok if r.role == role and r.first is not None
                and (until is None or r.end <= until)]

    parent, child = ttft("parent"), ttft("child")
    dead, dead_per = dead_time(events, recs) if events is not None else (0.0, {})
    makespan = result.end - result.start
    return {
        "makespan_s": makespan,
        "prefill": sum(r.prompt_n or 0 for r in counted),
        "reused": sum(r.cache_n or 0 for r in counted),
        "oracle": oracle_prefill(recs),
        "requests": len(recs),
        "failed": len(recs) - len(ok),
        "errors": sorted({r.error for r in recs if not r.ok})[:5],
        "parent_ttft_p50": pct(parent, 0.5), "parent_ttft_p95": pct(parent, 0.95),
        "child_ttft_p50": pct(child, 0.5), "child_ttft_p95": pct(child, 0.95),
        "dead_s": dead if events is not None else None,
        "dead_per_session": dead_per,
        "bg_requests": sum(1 for r in ok if r.role == "child" and r.end <= result.parent_end),
        "parent_span_s": result.parent_end - result.start,
        "parent_requests": sum(1 for r in ok if r.role == "parent"),
        "limit_hit": result.limit_hit,
    }


# =================================================================================================
# Processes: the queue, the proxy, llama-server
# =================================================================================================


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: "Optional[subprocess.Popen[bytes]]", timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s")
        time.sleep(0.1)


def stop_process(proc: "subprocess.Popen[bytes]", timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Queue:
    """A fresh daemon (default config, plus ``logFile``) on a temporary agent dir, and for the
    proxy modes ``llmqueue proxy`` in front of the upstream, each its own process."""

    def __init__(self, upstream: str, proxy: bool, teach: Optional[Tuple[str, "Workload", str]] = None,
                 defaults: Optional[Dict[str, Any]] = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="lqagents-", dir="/tmp")
        self.log = os.path.join(self.dir, "events.log")
        with open(os.path.join(self.dir, "llm-queue.json"), "w") as f:
            json.dump({"defaults": dict(defaults or {}, logFile=self.log)}, f)
        self.procs: List["subprocess.Popen[bytes]"] = []
        env = dict(os.environ)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        if teach is not None:
            # A daemon that served agents on this server before, and exited: what it learned of
            # switch costs is in the agent dir's state file when the run's own daemon starts.
            earlier = self._start_daemon(env)
            client = library().Client(self.dir, fail_open=False)
            try:
                # on the queue the run uses: the proxy's is its upstream, the server's root
                access = ClientAccess(upstream, client, queue_key=server_root(upstream) if proxy else None)
                lesson(access, *teach)
                access.close()
            finally:
                client.close()
                stop_process(earlier)
            os.unlink(self.log)  # the run's log is the run's own
        self.daemon = self._start_daemon(env)
        self.procs.append(self.daemon)
        self.proxy_url: Optional[str] = None
        if proxy:
            port = free_port()
            p = subprocess.Popen([sys.executable, MODULE, "proxy", "--agent-dir", self.dir, "--upstream",
                                  server_root(upstream), "--listen", f"127.0.0.1:{port}"],
                                 stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            self.procs.append(p)
            self.proxy_url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 15
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if p.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("llmqueue proxy did not start")
                    time.sleep(0.05)

    def _start_daemon(self, env: Dict[str, str]) -> "subprocess.Popen[bytes]":
        sock = os.path.join(self.dir, "llm-queue.sock")
        daemon = subprocess.Popen([sys.executable, MODULE, "--agent-dir", self.dir, "--idle-exit-ms", "never"],
                                  stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 15
        while not os.path.exists(sock):
            if daemon.poll() is not None or time.monotonic() > deadline:
                stop_process(daemon)
                raise RuntimeError("the llmqueue daemon did not start")
            time.sleep(0.02)
        return daemon

    def events(self) -> List[Dict[str, Any]]:
        return llmqueue.read_event_log([self.log]) if os.path.exists(self.log) else []

    def close(self) -> None:
        for p in reversed(self.procs):
            stop_process(p)
        shutil.rmtree(self.dir, ignore_errors=True)


class Setup(NamedTuple):
    name: str
    slots: int  # 0: one per agent
    host_cache: bool
    unified: bool
    slot_files: bool = False  # --slot-save-path: the queue parks contexts there at a switch


SETUPS = {
    "1slot-nocache": Setup("1slot-nocache", 1, False, False),
    "1slot-cache": Setup("1slot-cache", 1, True, False),
    "nslot-unified": Setup("nslot-unified", 0, True, True),
    "1slot-save": Setup("1slot-save", 1, True, False, slot_files=True),
}


def llama_args(setup: Setup, pressure: bool, wl: Workload, size: ModelSize) -> List[str]:
    """llama-server flags for a set-up: ``fit`` gives every agent's context room, ``pressure``
    room for about two (in the host cache, or in the unified KV)."""
    agents = wl.children + 1
    ctx = wl.context_tokens() + wl.reply_tokens + 64
    per_slot = 1 << max(10, (int(ctx * 1.25) - 1).bit_length())  # a power of two above it
    mib = 1024 * 1024
    args: List[str] = []
    if setup.unified:
        total = per_slot * agents if not pressure else int(ctx * 2.2)
        args += ["-np", str(agents), "--kv-unified", "-c", str(total)]
    else:
        args += ["-np", "1", "-c", str(per_slot)]
    if not setup.host_cache:
        args += ["--cache-ram", "0"]
    elif pressure:
        args += ["--cache-ram", str(max(1, math.ceil(2 * ctx * size.kv_bytes_per_token() / mib)))]
    else:
        args += ["--cache-ram", str(max(64, math.ceil(agents * 3 * ctx * size.kv_bytes_per_token() / mib)))]
    return args


class LlamaServer:
    """``llama-server`` on a free loopback port, for one run."""

    def __init__(self, binary: str, model: str, args: List[str], threads: int, log_path: str,
                 slot_files: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # slot files go to a directory of the run's own, removed with the server
        self.slot_dir = tempfile.mkdtemp(prefix="lqagents-slots-") if slot_files else None
        if self.slot_dir is not None:
            args = args + ["--slot-save-path", self.slot_dir + os.sep]
        self.argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                     "--no-webui", "--metrics"] + args
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        try:
            wait_http(self.url + "/health", self.proc, 120, "llama-server")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        stop_process(self.proc)
        self.log.close()
        if self.slot_dir is not None:
            shutil.rmtree(self.slot_dir, ignore_errors=True)


# =================================================================================================
# Runs and the table
# =================================================================================================

ACCESS = ("none", "client", "proxy", "proxy-anon", "client-warm", "proxy-warm", "proxy-anon-warm", "client-again",
          "proxy-again", "client-cost", "proxy-cost", "proxy-anon-cost", "client-warm-cost", "proxy-warm-cost")
# The accesses whose daemon runs issue 33's one rule for an idle slot (``holdRule: cost``), beside
# the same accesses on the rules in force: old against new, in one table, in one run.
COST = "-cost"


STREAMS = re.compile(r"(.*)-s([1-9][0-9]*|auto)")  # ``ACCESS-sN``: the daemon's ``maxStreams`` is N (or auto)


def known(name: str) -> bool:
    """An access of ``ACCESS``, or one with its daemon's ``maxStreams`` set (``ACCESS-sN``)."""
    streams = STREAMS.fullmatch(name)
    return (streams.group(1) if streams else name) in ACCESS


def lesson(access: Access, pattern: str, wl: Workload, salt: str) -> None:
    """What a daemon that served your agents before knows: the same agents' run, once, the day
    before (the run's pattern and workload, conversations of their own).  Until December 2026 the
    lesson was as many agents as the run has taking turns, two requests each, so that each came
    back after all the others; their contexts were the size of a run's first requests, and a
    server that kept three of those kept only two of a run's grown ones."""
    PATTERNS[pattern](access, wl, "lesson" + salt)


def run_once(pattern: str, access_name: str, upstream: str, wl: Workload, salt: str,
             background: bool = True, keep_log: Optional[str] = None) -> Dict[str, Any]:
    """One run of ``pattern`` through ``access_name`` against ``upstream``: its figures.
    ``keep_log``: copy the daemon's event log there (for ``llmqueue report``).  ``ACCESS@old``: the
    daemon, proxy and ``Client`` run from ``OLD_MODULE`` (old against new, in one table, in one run)."""
    global MODULE
    name, _, which = access_name.partition("@")
    if which:
        earlier = {"old": OLD_MODULE, "mid": MID_MODULE}.get(which)
        if earlier is None:
            raise SystemExit(f"{access_name}: give --old PATH (or --mid PATH), and name it ACCESS@old (ACCESS@mid)")
        new, MODULE = MODULE, earlier
        try:
            return run_once(pattern, name, upstream, wl, salt, background, keep_log)
        finally:
            MODULE = new
    defaults: Dict[str, Any] = {}
    streams = STREAMS.fullmatch(access_name)
    if streams:  # the daemon's ``maxStreams`` (default 1)
        n = streams.group(2)
        access_name, defaults["maxStreams"] = streams.group(1), n if n == "auto" else int(n)
    cost = access_name.endswith(COST)
    if cost:
        access_name = access_name[:-len(COST)]
        defaults["holdRule"] = "cost"
    warm = access_name.endswith("-warm")
    queue = (Queue(upstream, proxy=access_name.startswith("proxy"), teach=(pattern, wl, salt) if warm else None,
                   defaults=defaults or None)
             if access_name != "none" else None)
    client: Optional[llmqueue.Client] = None
    access: Access
    try:
        if queue is None:
            access = Access(upstream)
        elif access_name in ("client", "client-warm", "client-again"):
            client = library().Client(queue.dir, fail_open=False)
            access = ClientAccess(upstream, client)
        else:
            assert queue.proxy_url is not None
            access = ProxyAccess(upstream, queue.proxy_url,
                                 named=access_name in ("proxy", "proxy-warm", "proxy-again"))
        fn = PATTERNS[pattern]
        if access_name.endswith("-again"):
            # the same daemon (and proxy) served the same agents' run before, under the same
            # session names, with conversations of their own; the run's log is the run's own
            if pattern == "interactive":
                fn(access, wl, "before" + salt, background=background)
            else:
                fn(access, wl, "before" + salt)
            # the earlier run's sessions settle (their grace) and its last lines reach the log:
            # a lease carried over would have no grant in the run's own log
            time.sleep(llmqueue.GRACE_MS / 1000.0 + 0.5)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(queue.log)
        result = fn(access, wl, salt, background=background) if pattern == "interactive" else fn(access, wl, salt)
        access.close()
        if client is not None:
            client.close()
            client = None
        time.sleep(0.3)  # the last release reaches the log
        fig = figures(result, queue.events() if queue is not None else None)
        fig["request_log"] = [r._asdict() for r in result.records]
        return fig
    finally:
        if client is not None:
            client.close()
        if queue is not None:
            if keep_log is not None and os.path.exists(queue.log):
                shutil.copyfile(queue.log, keep_log)
            queue.close()


def fmt_s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def fmt_x(x: Optional[float], base: Optional[float]) -> str:
    if x is None or base is None or base <= 0:
        return ""
    return f" ({x / base:.2f}x)"


def _case(r: Dict[str, Any]) -> Tuple[str, str, str]:
    return r["pattern"], r["setup"], r["workload"]


def _baselines(rows: List[Dict[str, Any]]) -> Dict[Tuple[Any, ...], Dict[str, Any]]:
    """Each round's ``none`` row, per pattern, set-up and workload."""
    return {_case(r) + (r.get("round", 0),): r for r in rows if r["access"] == "none" and "error" not in r}


def _lines(lines: List[List[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for k, line in enumerate(lines):
        out.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def medians(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per pattern, set-up, workload and access, over its rounds (rows with ``round``): how many
    ran, and the median and range of the makespan, of its ratio against the ``none`` of the same
    round, of the prefill against the oracle, of the dead share of the makespan (%), and of the
    parent's ttft p50 (against its idle p50 in the interactive pattern, else against ``none``'s)."""
    base = _baselines(rows)
    groups: Dict[Tuple[str, str, str, str], List[Dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r:
            groups.setdefault(_case(r) + (r["access"],), []).append(r)
    out: List[Dict[str, Any]] = []
    for key, runs in groups.items():
        ratio: List[float] = []
        parent: List[float] = []
        for r in runs:
            b = base.get(_case(r) + (r.get("round", 0),))
            if b is not None and b["makespan_s"] > 0:
                ratio.append(r["makespan_s"] / b["makespan_s"])
            p50 = r.get("parent_ttft_p50")
            against = r.get("parent_alone_p50") if r["pattern"] == "interactive" else (b or {}).get("parent_ttft_p50")
            if p50 is not None and against:
                parent.append(p50 / against)
        figures_of = {
            "makespan_s": [r["makespan_s"] for r in runs],
            "vs_none": ratio,
            "vs_oracle": [r["prefill"] / r["oracle"] for r in runs if r.get("oracle")],
            "dead_pct": [100 * r["dead_s"] / r["makespan_s"] for r in runs
                         if r.get("dead_s") is not None and r["makespan_s"] > 0],
            "parent_ratio": parent,
        }
        row: Dict[str, Any] = dict(zip(("pattern", "setup", "workload", "access"), key), rounds=len(runs))
        for name, values in figures_of.items():
            row[name] = _median(values)
            row[name + "_range"] = (min(values), max(values)) if values else None
        out.append(row)
    return out


def medians_table(rows: List[Dict[str, Any]]) -> str:
    head = ["pattern", "set-up", "workload", "access", "rounds", "makespan s", "vs none (range)",
            "prefill vs oracle", "dead % of makespan", "parent ttft p50 vs none / idle"]
    lines = [head]

    def with_range(m: Dict[str, Any], name: str, fmt: str) -> str:
        value, span = m[name], m[name + "_range"]
        if value is None:
            return "-"
        text = fmt.format(value)
        return text + (f" ({fmt.format(span[0])}-{fmt.format(span[1])})" if m["rounds"] > 1 else "")

    for m in medians(rows):
        lines.append([m["pattern"], m["setup"], m["workload"], m["access"], str(m["rounds"]),
                      with_range(m, "makespan_s", "{:.1f}"), with_range(m, "vs_none", "{:.2f}x"),
                      with_range(m, "vs_oracle", "{:.2f}x"),
                      with_range(m, "dead_pct", "{:.0f}"), with_range(m, "parent_ratio", "{:.2f}x")])
    return _lines(lines)


def table(rows: List[Dict[str, Any]]) -> str:
    head = ["pattern", "set-up", "workload", "access", "makespan s", "prefilled tok", "vs oracle",
            "reused tok", "parent ttft p50/p95 s", "child ttft p50 s", "dead s (% of makespan)", "failed",
            "bg requests", "bg per s"]
    lines = [head]
    base = _baselines(rows)

    def per_s(r: Dict[str, Any]) -> Optional[float]:
        """The subagents' requests per second of the person's turns: the person ends sooner with
        the queue, so the count alone compares spans of different lengths."""
        count, span = r.get("bg_requests"), r.get("parent_span_s")
        return count / span if count is not None and span else None

    for r in rows:
        b = base.get(_case(r) + (r.get("round", 0),), {})
        if "error" in r:  # in the last column, so it widens no other
            lines.append([r["pattern"], r["setup"], r["workload"], r["access"]] + [""] * (len(head) - 5)
                         + ["error: " + r["error"][:80]])
            continue
        interactive = r["pattern"] == "interactive"
        dead = "-" if r["dead_s"] is None else f"{r['dead_s']:.2f} ({100 * r['dead_s'] / r['makespan_s']:.0f}%)"
        alone = r.get("parent_alone_p50")
        parent = f"{fmt_s(r['parent_ttft_p50'])} / {fmt_s(r['parent_ttft_p95'])}"
        if interactive and r["limit_hit"]:
            parent += f" (limit {r['parent_span_s']:.0f} s hit, {r['parent_requests']} answered)"
        elif interactive and alone:
            parent += f" ({r['parent_ttft_p50'] / alone:.2f}x idle)" if r["parent_ttft_p50"] else ""
        else:
            parent += fmt_x(r["parent_ttft_p50"], b.get("parent_ttft_p50"))
        lines.append([
            r["pattern"], r["setup"], r["workload"], r["access"],
            f"{r['makespan_s']:.1f}" + ("" if interactive else fmt_x(r["makespan_s"], b.get("makespan_s"))),
            f"{r['prefill']:,}" + fmt_x(r["prefill"], b.get("prefill")),
            f"{r['prefill'] / r['oracle']:.2f}x" if r["oracle"] else "-",
            f"{r['reused']:,}",
            parent,
            fmt_s(r["child_ttft_p50"]) + fmt_x(r["child_ttft_p50"], b.get("child_ttft_p50")),
            dead,
            str(r["failed"]),
            (f"{r['bg_requests']}" + fmt_x(r["bg_requests"], b.get("bg_requests")))
            if interactive and known(r["access"].partition("@")[0]) else "",
            (f"{per_s(r):.2f}" + fmt_x(per_s(r), per_s(b) if b else None))
            if interactive and known(r["access"].partition("@")[0]) and per_s(r) is not None else "",
        ])
    return _lines(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/agents.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--llama-server", metavar="PATH", help="a llama-server binary: started for every run")
    where.add_argument("--upstream", metavar="URL", help="an OpenAI-compatible server already running")
    ap.add_argument("--quick", action="store_true",
                    help="the small model, set-up 1slot-cache, both workloads, both patterns: a few minutes")
    ap.add_argument("--patterns", default=None, help="comma list of delegate,interactive (default: both)")
    ap.add_argument("--setups", default=None, help="comma list of " + ",".join(SETUPS))
    ap.add_argument("--workloads", default=None, help="comma list of fit,pressure (default: both)")
    ap.add_argument("--access", default=",".join(ACCESS), help="comma list of " + ",".join(ACCESS))
    ap.add_argument("--model", metavar="GGUF", help="use this model instead of writing a random one")
    ap.add_argument("--model-size", choices=sorted(MODEL_SIZES), default=None,
                    help="the random model's size (default: small)")
    ap.add_argument("--system-tokens", type=int, default=None, help="each agent's system prompt, in tokens")
    ap.add_argument("--children", type=int, default=3, help="subagents (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server threads (default 2)")
    ap.add_argument("--json", metavar="FILE", help="write every figure and request here")
    ap.add_argument("--keep-logs", metavar="DIR", help="keep each queued run's event log here (llmqueue report)")
    ap.add_argument("--cut-answers", action="store_true",
                    help="cut every reply at its length, answers too (finish_reason length): as before "
                         "December 2026, when no response said that the agent's turn was over")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--old", metavar="PATH", help="an earlier llmqueue.py: an access named ACCESS@old runs its "
                                                  "daemon, proxy and Client from it (e.g. client-cost@old)")
    ap.add_argument("--mid", metavar="PATH", help="a second earlier llmqueue.py (a step between --old and "
                                                  "this one): an access named ACCESS@mid runs from it")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run every access N times, in rounds, and add a table of medians (default 1)")
    args = ap.parse_args(argv)
    global OLD_MODULE, MID_MODULE
    OLD_MODULE, MID_MODULE = args.old, args.mid
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.keep_logs:
        os.makedirs(args.keep_logs, exist_ok=True)

    size = MODEL_SIZES[args.model_size or "small"]
    wl = Workload(children=args.children, final_stop=not args.cut_answers)
    if args.quick:
        wl = wl._replace(system_tokens=1000, tool_tokens=100, tool_s=0.3, turns=4, think_s=1.5, limit_s=90.0)
    if args.system_tokens:
        wl = wl._replace(system_tokens=args.system_tokens)
    patterns = (args.patterns or "delegate,interactive").split(",")
    access_names = args.access.split(",")
    for a in access_names:
        name, _, which = a.partition("@")
        if not known(name) or which not in ("", "old", "mid"):
            ap.error(f"unknown access {a!r}")
        if which and not getattr(args, which):
            ap.error(f"{a}: give --{which} PATH (an earlier llmqueue.py)")
    for p in patterns:
        if p not in PATTERNS:
            ap.error(f"unknown pattern {p!r}")
    if args.upstream:
        plans: List[Tuple[Optional[Setup], str]] = [(None, "as-is")]
    else:
        setups = (args.setups or ("1slot-cache" if args.quick else ",".join(SETUPS))).split(",")
        workloads = (args.workloads or "fit,pressure").split(",")
        for s in setups:
            if s not in SETUPS:
                ap.error(f"unknown set-up {s!r}")
        plans = [(SETUPS[s], w) for s in setups for w in workloads]
    tmp = tempfile.mkdtemp(prefix="lqagents-model-")
    model = args.model
    if args.llama_server and not model:
        model = os.path.join(tmp, "model.gguf")
        print(f"writing a random-weight model ({size.n_embd} wide, {size.n_layer} layers, "
              f"{len(vocabulary()[0]):,} tokens) to {model}", file=sys.stderr)
        write_model(model, size)
    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # so every server, daemon and proxy of the run is stopped

    signal.signal(signal.SIGTERM, interrupted)
    rows: List[Dict[str, Any]] = []
    rng = random.Random(args.seed)
    started = time.monotonic()
    try:
        for setup, workload in plans:
            for pattern, rnd in ((p, k) for p in patterns for k in range(args.repeat)):
                runs = [(a, True) for a in access_names]
                if pattern == "interactive":
                    runs.insert(0, ("none", False))  # the parent alone on an idle server
                alone: Optional[float] = None
                for access_name, background in runs:
                    salt = rng.choice(WORDS) + rng.choice(WORDS)
                    label = access_name if background else "idle (parent alone)"
                    row: Dict[str, Any] = {"pattern": pattern, "setup": setup.name if setup else "upstream",
                                           "workload": workload, "access": label, "round": rnd}
                    of = f" (round {rnd + 1} of {args.repeat})" if args.repeat > 1 else ""
                    print(f"[{time.monotonic() - started:6.0f} s] {pattern} / {row['setup']} / {workload} / "
                          f"{label}{of} ...", file=sys.stderr, flush=True)
                    server: Optional[LlamaServer] = None
                    try:
                        if setup is not None:
                            server = LlamaServer(args.llama_server, model or "", llama_args(
                                setup, workload == "pressure", wl, size), args.threads,
                                os.path.join(tmp, "llama-server.log"), slot_files=setup.slot_files)
                            upstream = server.url
                        else:
                            upstream = args.upstream
                        suffix = f"-{rnd + 1}" if args.repeat > 1 else ""
                        keep = (os.path.join(args.keep_logs, f"{pattern}-{row['setup']}-{workload}-{label}{suffix}.log")
                                if args.keep_logs and access_name != "none" else None)
                        row.update(run_once(pattern, access_name, upstream, wl, salt, background, keep))
                        if server is not None:
                            row["server_args"] = server.argv[server.argv.index("--metrics") + 1:]
                    except Exception as e:  # noqa: BLE001 -- one failed run is a row, not the end
                        row["error"] = f"{type(e).__name__}: {e}"
                    finally:
                        if server is not None:
                            server.close()
                    if not background:
                        alone = row.get("parent_ttft_p50")
                    row["parent_alone_p50"] = alone
                    rows.append(row)
    except KeyboardInterrupt:
        print("interrupted: the table so far", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"agents: parent + {wl.children} subagents; system prompt {wl.system_tokens} tokens, replies "
          f"{wl.reply_tokens}, tool outputs {wl.tool_tokens} tokens after {wl.tool_s:g} s; "
          "model " + ("the server's own" if args.upstream else args.model if args.model
                      else f"random llama, {size.n_embd} wide, {size.n_layer} layers"))
    print(table(rows))
    if args.repeat > 1:
        print(f"\nmedians over {args.repeat} rounds (each ratio against the none of its own round):")
        print(medians_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": wl._asdict(), "model": size._asdict(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
