#!/usr/bin/env python3
"""llmqueue: serialise many coding-agent sessions onto one local model server.

One daemon owns a unix socket, speaks newline-delimited JSON, and hands out leased slots per
endpoint: interactive sessions (tier ``parent``) first, subagents (tier ``child``) behind them,
with aging so nobody starves, no preemption of a live stream, and self-healing when a client dies
(its lease's TTL lapses) or idles (an activity-flagged holder yields to a waiter).

The module reads top to bottom in dependency order:

1. constants and limits, errors;
2. the pure core -- config validation, addressing, lease terms, the scheduler -- which never
   touches a socket, a file or a clock: every decision takes ``now`` and returns events;
3. the wire protocol (request parsing, reply encoding);
4. the daemon: a single-threaded ``selectors`` loop with a timer heap and mtime polling;
5. the client library (``Client``, ``Lease``, ``Session``) and the proxy built on it;
6. reading the event log (``llmqueue report``);
7. the command line and ``main()``.

Standard library only; CPython 3.8 to 3.13.  Copy this one file anywhere and run it.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import json
import os
import re
import selectors
import signal
import socket
import stat
import struct
import sys
import threading
import time
from collections import OrderedDict, deque, namedtuple
from json.encoder import encode_basestring_ascii as _json_str  # the C string encoder

TYPE_CHECKING = False
if TYPE_CHECKING:  # for the checker only: the daemon starts without typing (and argparse)
    import argparse
    from typing import (IO, Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple,
                        Union)
else:
    class _NamedTupleMeta(type):
        """``class X(NamedTuple)`` at run time: ``collections.namedtuple`` of its annotated
        fields and their defaults, with the body's methods.  typing's own checks each annotation
        (a compile apiece, with postponed annotations) and costs a fifth of a cold start."""

        def __new__(mcls, name, bases, ns):
            if not bases:
                return super().__new__(mcls, name, bases, ns)
            fields = tuple(ns.get("__annotations__", ()))
            cls = namedtuple(name, fields, defaults=[ns[f] for f in fields if f in ns],
                             module=ns.get("__module__"))
            for key, value in ns.items():
                if key not in fields and key not in ("__module__", "__classcell__"):
                    setattr(cls, key, value)
            return cls

    class NamedTuple(metaclass=_NamedTupleMeta):
        pass

__version__ = "0.1.0"

__all__ = [
    "AlreadyRunning",
    "Addressing",
    "Cancelled",
    "Client",
    "Config",
    "Daemon",
    "DaemonError",
    "Dequeued",
    "DaemonUnavailable",
    "Evicted",
    "Granted",
    "Holder",
    "Proxy",
    "Lease",
    "LeaseTerms",
    "Moved",
    "LLMQueueError",
    "OverCapacity",
    "ProtocolError",
    "QueuePolicy",
    "Queued",
    "Released",
    "Scheduler",
    "Session",
    "Waiter",
    "daemon_command",
    "load_catalog",
    "load_config",
    "main",
    "normalize_url",
    "parse_request",
    "validate_config",
]

# =================================================================================================
# Constants and limits
#
# Every limit is named here with the reason it exists.  Durations are milliseconds throughout,
# measured on the monotonic clock; wall time appears only in the event log's ``ts``.
# =================================================================================================

SCHEMA_VERSION = 1  # spec: the newest llm-queue.json schemaVersion this module understands

MAX_LINE_BYTES = 100 * 1024  # spec: framing -- a peer that sends more without a newline is cut off
# A peer that stops reading its replies is cut off once this much is queued for it, so its unsent
# output stays bounded and the loop never blocks on it.  Large enough for a status reply that
# lists tens of thousands of waiters.
MAX_OUTPUT_BYTES = 8 * 1024 * 1024
RECV_BYTES = 256 * 1024  # one recv per readable turn per peer
ACCEPTS_PER_TURN = 64  # redis: a fixed number of accepts per turn keeps a connect storm fair
LINES_PER_TURN = 256  # requests handled per peer per turn: a pipelining peer yields to the rest
ACCEPT_PAUSE_MS = 100.0  # out of descriptors: stop accepting this long instead of spinning

MIN_LEASE_TTL_MS = 1000  # spec: leaseTtlMs minimum
# A shorter idle-yield window would have clients beating every few milliseconds (the beat runs at
# half the window): 0 turns idle-yield off, anything else is at least this.
MIN_IDLE_YIELD_MS = 100
BEAT_FLOOR_MS = 250.0  # spec: the keyed beat runs at leaseTtlMs / 3, never faster than this
NO_CLIENT_EXIT_FLOOR_MS = 30000  # spec: a daemon whose spawner never connects does not linger
MAX_TIMER_MS = 2**31 - 1  # spec: the idle-exit delay is clamped to setTimeout's cap (~24.8 days)
MAX_CONFIG_INT = 2**31 - 1  # no config number needs more; larger ones are typos, refused by name
CONFIG_DEBOUNCE_MS = 250.0  # spec: hot-reload debounce -- an editor's save settles first
CONFIG_POLL_MS = 1000.0  # the config stat poll; an idle daemon wakes at most this often
DEFAULT_SWEEP_MS = 1000  # spec: --sweep-ms default
GRACE_MS = 3000  # spec: a client releases this long after its run settles
# A settled parent with no person behind it (``background``) keeps its slot this long even while
# someone waits (a follow-up run of the same agent, woken by a tool or a child's answer, starts
# switch-free), then parks for the rest of its grace.  A person's parent parks at once: a person's
# next turn comes later than this, and a waiting subagent should not idle through the person's
# think time (measured on the interactive workload: a 1 s window spent half of a 2 s think time
# idle, and the background got a quarter of its requests done; this one, 10% of the run where
# contexts fit).
PARENT_HANDBACK_MS = 250
# Between two of its requests, a holder's slot goes to a waiting parent where switches are cheap
# (two agents with nothing named, both parents, take turns instead of one waiting out the other's
# whole run).  While the queue does not know yet what a switch costs, a holder gives way at its
# first gap to find it out (a probe, to a parent or to a child), one probe at a time.  The one that
# gave way queues again ahead of its tier and is given the slot back at the next gap, whoever
# holds it, so its return shows what the server kept.  There is no share to hold first: measured
# on a real llama-server, a first holder that kept the slot 2 s before it asked idled 12-29% of a
# run whose contexts all fit (1.3x llama.cpp alone), and where only two of four fit, asking at the
# first gap finished sooner too (0.69-0.76x against 0.72-0.93x), at the price of the re-prefills
# that show the bound (see ``_Affinity.contexts``).
# One probe at a time: the next waits until a session has come back (and said what it found
# kept), or this long, since the one that gave way may not come back.  One that has not queued
# again is waited for only as long as the queue's tool calls take (its holders' recent gaps, as
# a session's own tool-gap window reckons them), within the grace: by then it went on to other
# work, or its run had ended (the proxy cannot tell a run's last response from a tool call).
PROBE_AGAIN_MS = 10_000

ROLES = ("parent", "child")  # wire names of the tiers, in grant order
PARENT, CHILD = 0, 1
REQUEST_SAMPLES = 16  # the recent request times per tier whose median a person's wait is priced at
POLICIES = ("priority-aging", "fifo")
# What a switch of the slot costs on the queue's server: "auto" learns it from the usage op (a
# session back on the slot after another finds its context kept, or not); "cheap" (the server
# keeps every context: a large host cache, a slot per agent) or "dear" says it.
SWITCH_COSTS = ("auto", "cheap", "dear")
# Who decides when an idle slot someone waits for is handed over: "rules", the rules this queue
# grew one trace at a time (the default, until the cost rule has beaten them on every workload),
# bounded by the cost rule at the most a switch can cost; "cost", issue 33's one rule
# (``HoldCost``): hand over once the idle time reaches the switch's cost.
HOLD_RULES = ("rules", "cost")
KEPT_CHEAP = 0.8  # the share of its context each session back after a switch must find kept
KEPT_SAMPLES = 4  # the most recent returns that must all have (at least 2 of them)
# A return's depth: how many other sessions used the slot since the session's own last request.
# One evicted at depth 1 (a single other session ran) is a dear switch; one evicted deeper only
# bounds how many contexts the server keeps (``_Affinity.contexts``).  Counted this far at most.
MAX_DEPTH = 64
# A person's turn is over (a parent's park with ``turn``): its context stays in use while the
# person thinks, so where the server keeps only so many contexts the subagents share the rest
# and the person's next turn finds its context kept.  For as long as the queue's recent think
# times say (1.5x the longest of the last three, plus 0.2 s), this long while none is known yet,
# and never longer than the cap: a person that walked away costs the subagents that long at most.
# Measured on a real llama-server whose host cache holds two contexts, a person beside three
# subagents: without it every turn re-prefilled the person's whole conversation.
THINK_DEFAULT_MS = 30_000
THINK_MAX_MS = 120_000
# Issue 33's cost model (computed beside the rules in force, shown in status and logged): the
# server's prefill rate where it has reported no prefill time yet.  The order of a CPU's (the
# project's 2-core llama-server prefills ~540 tokens/s); it prices a switch only until the
# server's own timings (``prefillMs`` on the usage op) replace it, from the first report.
ASSUMED_PREFILL_TPS = 500.0
RATE_SAMPLES = 8  # the latest reports with a prefill time that make a queue's measured rate
MAX_PREFILL_MS = 86_400_000.0  # a day: a reported prefill time past this is no time
MAX_SERVER_SLOTS = 4096  # a server that says it runs more requests at once than this says nothing
STATE_FILE = "llm-queue-state.json"  # in the agent dir: what a switch costs, learned, for the next daemon
STATE_KEEP_S = 7 * 24 * 3600.0  # a queue's learned switch cost older than this is forgotten

DEFAULT_BLOCKING_TOOLS = (
    "subagent",
    "subagent_wait",
    "bg_wait",
    "ask_user",
    "contact_supervisor",
    "intercom",
)

# =================================================================================================
# Errors
#
# One root.  A peer's fault (ProtocolError) costs that peer an error reply and nothing else; a
# daemon that cannot serve raises DaemonError, a client that cannot reach one DaemonUnavailable.
# A bad config file is not an exception: validation returns every violation, and the daemon keeps
# the last good config.  A bug of ours is none of these and fails loudly.
# =================================================================================================


class LLMQueueError(Exception):
    """The root of every error this module raises on purpose."""


class ProtocolError(LLMQueueError):
    """A request that cannot be served as sent: the peer gets ``{"op":"error","reason":...}``."""


class DaemonError(LLMQueueError):
    """The daemon cannot serve: the socket path is unusable, or the agent dir cannot be made."""


class AlreadyRunning(DaemonError):
    """Another daemon already serves this socket; a second one leaves it alone and exits 0."""


# =================================================================================================
# Config
#
# ``validate_config`` is one pure function: it takes the parsed JSON value and returns the
# Config together with every violation, each named by its path, never only the first.  Unknown
# keys are warnings.  A config with any error is not used at all: the daemon serves with defaults
# at startup and keeps the last good config on a reload.
# =================================================================================================


class QueuePolicy(NamedTuple):
    """The resolved policy of one queue: defaults overlaid with its own entry."""

    max_streams: Optional[int]  # None: passthrough (``enabled: false``), every acquire granted
    policy: str = "priority-aging"
    lease_ttl_ms: int = 30000
    aging_after_slots: int = 3
    aging_after_ms: int = 60000
    idle_yield_ms: int = 30000
    switch_cost: str = "auto"
    parent_streams: int = 1  # spare streams beyond max_streams, for parents that ask for one
    hold_rule: str = "rules"  # who decides an idle slot's hand-over: "rules" (today's), "cost" (issue 33)
    # ``maxStreams: "auto"``: ``max_streams`` is what the server is known to run at once
    # (``Scheduler._auto_streams``), 1 until its usage reports say
    streams_auto: bool = False


DEFAULT_POLICY = QueuePolicy(max_streams=1)

# The wire name of each queue-policy field, its attribute, and its rule.
_POLICY_FIELDS: Dict[str, Tuple[str, str]] = {
    "maxStreams": ("max_streams", "streams"),
    "policy": ("policy", "policy"),
    "leaseTtlMs": ("lease_ttl_ms", "ttl"),
    "agingAfterSlots": ("aging_after_slots", "nonneg"),
    "agingAfterMs": ("aging_after_ms", "nonneg"),
    "idleYieldMs": ("idle_yield_ms", "idle"),
    "switchCost": ("switch_cost", "switch"),
    "parentStreams": ("parent_streams", "nonneg"),
    "holdRule": ("hold_rule", "hold"),
}
_CLIENT_FIELDS = ("failOpen", "queueTimeoutMs", "blockingTools")
_DAEMON_FIELDS = ("daemonIdleExitMs", "logFile")
_ENTRY_ONLY_FIELDS = ("enabled", "match")


class QueueEntry(NamedTuple):
    """One entry of ``queues``: an endpoint URL, a provider name, or (with ``match``) a group."""

    name: str
    policy: QueuePolicy  # already overlaid on defaults; max_streams None when disabled
    enabled: bool = True
    match: Optional[Tuple[str, ...]] = None


class Config(NamedTuple):
    """A validated llm-queue.json.  ``Config()`` is the all-defaults config of a missing file."""

    defaults: QueuePolicy = DEFAULT_POLICY
    queues: Tuple[QueueEntry, ...] = ()  # in file order: "first group that names it" needs it
    fail_open: bool = True
    queue_timeout_ms: int = 60000
    blocking_tools: Tuple[str, ...] = DEFAULT_BLOCKING_TOOLS
    daemon_idle_exit_ms: int = 0
    log_file: Optional[str] = None
    schema_version: int = SCHEMA_VERSION


def _show(value: Any) -> str:
    """A config value as the user wrote it, for error messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_field(path: str, rule: str, value: Any, errors: list[str]) -> bool:
    """Append a path-named message to ``errors`` unless ``value`` obeys ``rule``."""
    got = f"(got {_show(value)})"
    if rule == "streams":
        if value != "auto" and (not _is_int(value) or not 1 <= value <= MAX_CONFIG_INT):
            also = ' or "auto"' if isinstance(value, str) else ""  # the spec's words for a number
            errors.append(f"{path} must be a positive integer{also} {got}")
            return False
    elif rule == "nonneg":
        if not _is_int(value) or not 0 <= value <= MAX_CONFIG_INT:
            errors.append(f"{path} must be a non-negative integer {got}")
            return False
    elif rule == "ttl":
        if not _is_int(value) or not MIN_LEASE_TTL_MS <= value <= MAX_CONFIG_INT:
            errors.append(f"{path} must be an integer of at least {MIN_LEASE_TTL_MS} {got}")
            return False
    elif rule == "idle":
        if not _is_int(value) or not (value == 0 or MIN_IDLE_YIELD_MS <= value <= MAX_CONFIG_INT):
            errors.append(f"{path} must be 0 (off) or an integer of at least {MIN_IDLE_YIELD_MS} {got}")
            return False
    elif rule == "switch":
        if value not in SWITCH_COSTS:
            errors.append(f"{path} must be one of {', '.join(SWITCH_COSTS)} {got}")
            return False
    elif rule == "hold":
        if value not in HOLD_RULES:
            errors.append(f"{path} must be one of {', '.join(HOLD_RULES)} {got}")
            return False
    elif rule == "policy":
        if value not in POLICIES:
            errors.append(f"{path} must be one of {', '.join(POLICIES)} {got}")
            return False
    elif rule == "bool":
        if not isinstance(value, bool):
            errors.append(f"{path} must be true or false {got}")
            return False
    elif rule == "any-nonneg":  # clamped where it is used, so any size is accepted
        if not _is_int(value) or value < 0:
            errors.append(f"{path} must be a non-negative integer {got}")
            return False
    elif rule == "path":
        if value is not None and (not isinstance(value, str) or not value):
            errors.append(f"{path} must be a file path or null {got}")
            return False
    elif rule == "names":
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            errors.append(f"{path} must be a list of non-empty strings {got}")
            return False
    elif rule == "match":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(v, str) and v for v in value)
        ):
            errors.append(f"{path} must be a non-empty list of endpoint URLs or provider names {got}")
            return False
    else:  # pragma: no cover - a rule name we forgot to implement is our bug
        raise AssertionError(rule)
    return True


def _overlay(base: QueuePolicy, path: str, obj: dict[str, Any], errors: list[str]) -> QueuePolicy:
    """``base`` with the valid queue-policy fields of ``obj`` applied."""
    changes: dict[str, Any] = {}
    for wire, (attr, rule) in _POLICY_FIELDS.items():
        if wire in obj and _check_field(f"{path}.{wire}", rule, obj[wire], errors):
            changes[attr] = obj[wire]
            if rule == "streams":  # "auto" starts at one stream
                changes["streams_auto"] = obj[wire] == "auto"
                changes[attr] = 1 if obj[wire] == "auto" else obj[wire]
    return base._replace(**changes)


def _did_you_mean(word: str, known: Sequence[str]) -> str:
    """`` (did you mean X?)`` for the known name closest to a typo (case aside), else ''."""
    import difflib

    by_lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]}?)" if close else ""


def _unknown_field(path: str, key: str, known: Sequence[str]) -> str:
    return f"{path} is not a config field and is ignored{_did_you_mean(key, known)}"


_DEFAULTS_KNOWN = tuple(_POLICY_FIELDS) + _CLIENT_FIELDS + _DAEMON_FIELDS
_ENTRY_KNOWN = tuple(_POLICY_FIELDS) + _ENTRY_ONLY_FIELDS


def validate_config(raw: Any) -> tuple[Config, list[str], list[str]]:
    """Validate a parsed llm-queue.json.  Returns ``(config, errors, warnings)``.

    Every violation is reported, each named by its path.  When ``errors`` is non-empty the
    returned config must not be used (it holds whatever was valid, for check-config's report).
    """
    errors: list[str] = []
    warnings: list[str] = []
    if not isinstance(raw, dict):
        return Config(), [f"the config must be a JSON object (got {_show(raw)})"], []
    for key in raw:
        if key not in ("schemaVersion", "defaults", "queues"):
            warnings.append(_unknown_field(key, key, ("schemaVersion", "defaults", "queues")))

    schema = raw.get("schemaVersion", SCHEMA_VERSION)
    if not _is_int(schema) or schema < 1:
        errors.append(f"schemaVersion must be a positive integer (got {_show(schema)})")
        schema = SCHEMA_VERSION
    elif schema > SCHEMA_VERSION:
        errors.append(
            f"schemaVersion {schema} is newer than this llmqueue understands "
            f"({SCHEMA_VERSION}): upgrade llmqueue"
        )

    defaults_raw = raw.get("defaults", {})
    fields: dict[str, Any] = {}
    defaults = DEFAULT_POLICY
    if not isinstance(defaults_raw, dict):
        errors.append(f"defaults must be an object (got {_show(defaults_raw)})")
    else:
        defaults = _overlay(DEFAULT_POLICY, "defaults", defaults_raw, errors)
        for key, value in defaults_raw.items():
            path = f"defaults.{key}"
            if key in _POLICY_FIELDS:
                continue
            if key == "failOpen":
                if _check_field(path, "bool", value, errors):
                    fields["fail_open"] = value
            elif key == "queueTimeoutMs":
                if _check_field(path, "nonneg", value, errors):
                    fields["queue_timeout_ms"] = value
            elif key == "blockingTools":
                if _check_field(path, "names", value, errors):
                    fields["blocking_tools"] = tuple(value)
            elif key == "daemonIdleExitMs":
                if _check_field(path, "any-nonneg", value, errors):
                    fields["daemon_idle_exit_ms"] = value
            elif key == "logFile":
                if _check_field(path, "path", value, errors):
                    fields["log_file"] = value
            elif key in _ENTRY_ONLY_FIELDS:
                warnings.append(f"{path} is ignored: it is valid on queue entries only")
            else:
                warnings.append(_unknown_field(path, key, _DEFAULTS_KNOWN))

    entries: list[QueueEntry] = []
    queues_raw = raw.get("queues", {})
    if not isinstance(queues_raw, dict):
        errors.append(f"queues must be an object (got {_show(queues_raw)})")
        queues_raw = {}
    for name, entry in queues_raw.items():
        path = f"queues.{name}"
        if not name:
            errors.append("queues has an entry with an empty name")
            continue
        if not isinstance(entry, dict):
            errors.append(f"{path} must be an object (got {_show(entry)})")
            continue
        policy = _overlay(defaults, path, entry, errors)
        enabled = True
        match: Optional[Tuple[str, ...]] = None
        if "enabled" in entry and _check_field(f"{path}.enabled", "bool", entry["enabled"], errors):
            enabled = entry["enabled"]
        if "match" in entry and _check_field(f"{path}.match", "match", entry["match"], errors):
            match = tuple(entry["match"])
        for key in entry:
            if key in _CLIENT_FIELDS or key in _DAEMON_FIELDS:
                warnings.append(f"{path}.{key} is ignored: it is valid in defaults only")
            elif key not in _POLICY_FIELDS and key not in _ENTRY_ONLY_FIELDS:
                warnings.append(_unknown_field(f"{path}.{key}", key, _ENTRY_KNOWN))
        if not enabled:
            policy = policy._replace(max_streams=None)
        entries.append(QueueEntry(name, policy, enabled, match))

    servers: dict[str, str] = {}
    for entry in entries:  # two spellings of one server (with and without /v1) are one queue
        if entry.match is None and _is_url(entry.name):
            first = servers.setdefault(normalize_url(entry.name), entry.name)
            if first != entry.name:
                warnings.append(f"queues.{entry.name} names the same server as queues.{first} "
                                f"({normalize_url(entry.name)}): only the first applies")
    config = Config(defaults=defaults, queues=tuple(entries), schema_version=schema, **fields)
    return config, errors, warnings


class ConfigLoad(NamedTuple):
    """What reading the config file found.  ``state`` is one of:

    ``ok`` (``config`` is valid), ``missing`` (no file: all defaults, no error), ``torn`` (not
    valid JSON, e.g. half-written: keep the last good config, silently on a reload), ``invalid``
    (``errors`` lists every violation: keep the last good config), ``unreadable`` (the file or its
    directory cannot be read: keep the last good config, ``errors`` says why).
    """

    state: str
    config: Config
    errors: Tuple[str, ...] = ()
    warnings: Tuple[str, ...] = ()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_int(digits: str) -> Any:
    """JSON integers, without Python's 4300-digit conversion limit failing the whole document:
    a number that long is kept as a float, so an unknown field holding one is still ignored and
    a known field holding one is refused by name."""
    return int(digits) if len(digits) <= 4000 else float(digits)


MAX_CONFIG_BYTES = 4 * 1024 * 1024  # llm-queue.json and models.json: far more than any real one


def _read_small_file(path: str) -> bytes:
    """A regular file's bytes, read without ever blocking the daemon: a FIFO or a device at the
    path (``/dev/zero`` behind a symlink) is refused as unreadable, and so is a huge file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise OSError(errno.EFBIG, f"larger than {MAX_CONFIG_BYTES} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_CONFIG_BYTES:
                raise OSError(errno.EFBIG, f"larger than {MAX_CONFIG_BYTES} bytes")
            chunks.append(chunk)
    finally:
        os.close(fd)


if TYPE_CHECKING:  # per queue: its returns' depths, the contexts learned
    Depths = Dict[str, Tuple[List[int], Optional[int]]]


if TYPE_CHECKING:  # per queue: the tokens the server keeps (at least, below)
    Rooms = Dict[str, Tuple[Optional[int], Optional[int]]]


def encode_state(kept: dict[str, list[float]], at: dict[str, float], depths: Optional[Depths] = None,
                 rooms: Optional[Rooms] = None) -> bytes:
    """The agent dir's state file: per queue, its latest returns' kept shares and when the
    last of them came (epoch seconds), and (additive) each return's depth, the number of
    contexts the server was found to keep, and the tokens its host cache keeps beside the slot's
    context (``hostRoom``, at least; ``hostRoomCap``, fewer than; an older daemon's ``room`` and
    ``roomCap`` counted the slot's too, and are not read)."""
    queues: dict[str, dict[str, Any]] = {}
    for key, shares in kept.items():
        entry: dict[str, Any] = {"kept": [round(k, 4) for k in shares], "at": round(at.get(key, 0.0), 3)}
        deep, contexts = (depths or {}).get(key, ([], None))
        if len(deep) == len(shares):
            entry["depths"] = list(deep)
        if contexts is not None:
            entry["contexts"] = contexts
        room, cap = (rooms or {}).get(key, (None, None))
        if room is not None:
            entry["hostRoom"] = room
        if cap is not None:
            entry["hostRoomCap"] = cap
        queues[key] = entry
    return json.dumps({"version": 1, "affinity": queues}, sort_keys=True).encode() + b"\n"


def decode_state(raw: bytes, wall: float) -> tuple[dict[str, list[float]], dict[str, float], Depths]:
    """The state file's queues (kept shares, and when; the depths and contexts where it has
    them), leniently: anything malformed is skipped, and so is a queue last heard of more than
    ``STATE_KEEP_S`` before ``wall``."""
    kept: dict[str, list[float]] = {}
    at: dict[str, float] = {}
    depths: Depths = {}
    try:
        obj = _DECODER.decode(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return kept, at, depths
    queues = obj.get("affinity") if isinstance(obj, dict) and obj.get("version") == 1 else None
    if not isinstance(queues, dict):
        return kept, at, depths
    for key, entry in list(queues.items())[:4096]:
        if not isinstance(entry, dict):
            continue
        shares, when = entry.get("kept"), entry.get("at")
        if (not isinstance(shares, list) or not isinstance(when, (int, float)) or isinstance(when, bool)
                or not wall - STATE_KEEP_S <= when <= wall + 60.0):
            continue
        good = [float(s) for s in shares[-KEPT_SAMPLES:]
                if isinstance(s, (int, float)) and not isinstance(s, bool) and 0.0 <= s <= 1.0]
        # a file from before one key named both forms of a server: the latest of the two stands
        key = normalize_url(key)
        if good and at.get(key, float("-inf")) <= when:
            kept[key] = good
            at[key] = float(when)
            deep, contexts = entry.get("depths"), _count(entry.get("contexts"))
            counts = [d for d in (_count(d) for d in deep[-KEPT_SAMPLES:]) if d is not None and 1 <= d <= MAX_DEPTH] \
                if isinstance(deep, list) else []
            whole = len(good) == len(shares[-KEPT_SAMPLES:])  # each depth still goes with its share
            depths[key] = (counts if whole and len(counts) == len(good) else [],
                           contexts if contexts is not None and 1 <= contexts <= MAX_DEPTH else None)
    return kept, at, depths


def decode_rooms(raw: bytes, wall: float) -> Rooms:
    """The state file's ``hostRoom`` and ``hostRoomCap`` per queue (``encode_state``), for the queues
    ``decode_state`` takes; anything malformed is left out."""
    kept, _, _ = decode_state(raw, wall)
    rooms: Rooms = {}
    try:
        queues = _DECODER.decode(raw.decode("utf-8")).get("affinity")
        for key, entry in queues.items():
            if normalize_url(key) in kept and isinstance(entry, dict):
                room, cap = _count(entry.get("hostRoom")), _count(entry.get("hostRoomCap"))
                if (room, cap) != (None, None) and (room is None or cap is None or room < cap):
                    rooms[normalize_url(key)] = (room, cap)
    except (ValueError, UnicodeDecodeError, RecursionError, AttributeError):
        pass
    return rooms


def load_config(path: str) -> ConfigLoad:
    """Read and validate the config file at ``path`` (file I/O; validation stays pure)."""
    try:
        data = _read_small_file(path)
    except FileNotFoundError:
        if os.path.isdir(os.path.dirname(path) or "."):
            return ConfigLoad("missing", Config())
        return ConfigLoad("unreadable", Config(), (f"{os.path.dirname(path)}: directory is gone",))
    except OSError as e:
        return ConfigLoad("unreadable", Config(), (f"{path}: {e.strerror or e}",))
    try:
        raw = json.loads(data.decode("utf-8"), parse_constant=_reject_constant, parse_int=_parse_int)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return ConfigLoad("torn", Config(), (f"{path}: not valid JSON ({e})",))
    config, errors, warnings = validate_config(raw)
    return ConfigLoad("invalid" if errors else "ok", config, tuple(errors), tuple(warnings))


def config_log_path(config_path: str, log_file: Optional[str]) -> Optional[str]:
    """The config's ``logFile`` as a path: relative to the config's folder, ``~`` expanded."""
    if not log_file:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(config_path)), os.path.expanduser(log_file))


def load_catalog(path: Optional[str]) -> dict[str, str]:
    """pi's models.json as ``{provider name: baseUrl}``; a missing or broken file is empty."""
    return read_catalog(path)[1]


def read_catalog(path: Optional[str]) -> tuple[str, dict[str, str]]:
    """models.json with how it read: ``ok``, ``missing``, ``torn`` (not valid JSON, e.g. half
    written) or ``unreadable``.  On a reload only ``ok`` and ``missing`` replace the catalog in
    use: a torn file must not split an endpoint's queue in two for a moment."""
    if not path:
        return "missing", {}
    try:
        raw = json.loads(_read_small_file(path).decode("utf-8"))
    except FileNotFoundError:
        return "missing", {}
    except OSError:
        return "unreadable", {}
    except (ValueError, RecursionError):
        return "torn", {}
    providers = raw.get("providers") if isinstance(raw, dict) else None
    if not isinstance(providers, dict):
        return "ok", {}
    catalog: dict[str, str] = {}
    for name, provider in providers.items():
        if isinstance(provider, dict):
            url = provider.get("baseUrl")
            if isinstance(url, str) and url:
                catalog[name] = url
    return "ok", catalog


# =================================================================================================
# Addressing (the spec's ADR 0005)
#
# A queueKey is an endpoint URL, a provider name or a group name; this section is the one place
# that decides which queue owns it and which policy governs that queue, for the daemon and for
# clients alike.  Rules, in order:
#   - a group's own name is its queue;
#   - a provider named exactly by an enabled group's ``match`` belongs to that group (split);
#   - an endpoint URL named by an enabled group's ``match`` belongs to the first such group
#     (merge); a provider follows its endpoint there;
#   - otherwise an endpoint is its own queue (keyed by its normalised URL); a provider's key
#     resolves to its baseUrl through models.json.  The endpoint's policy comes from the entry
#     keyed by its URL, else from the first provider-name entry that resolves to it;
#   - a key that names nothing known is a queue of its own (with its entry's policy, if any).
# A disabled group does not re-key its members.  URLs are compared after normalisation.
# =================================================================================================

_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _is_url(key: str) -> bool:
    return "://" in key


def normalize_url(url: str) -> str:
    """An endpoint URL in the form queues compare: scheme and host lower-cased, the scheme's
    default port dropped, trailing slashes removed, and the path ending in ``/v1``: a server's
    root and its OpenAI base URL are one server, so ``http://h:8080``, ``http://h:8080/`` and
    ``http://h:8080/v1/`` are all ``http://h:8080/v1`` (one queue, whichever form a client,
    ``llmqueue run``, the proxy or models.json names).  The path, query and user info keep their
    case.  A key that is not a URL is returned unchanged."""
    if not _is_url(url):
        return url
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    cut = len(rest)
    for sep in "/?#":
        i = rest.find(sep)
        if i >= 0:
            cut = min(cut, i)
    authority, tail = rest[:cut], rest[cut:]
    userinfo, at, hostport = authority.rpartition("@")
    host, colon, port = hostport.rpartition(":") if not hostport.endswith("]") else (hostport, "", "")
    if not colon or not port.isdigit():
        host, port = hostport, ""
    host = host.lower()
    if port and _DEFAULT_PORTS.get(scheme) == port:
        port = ""
    authority = f"{userinfo}{at}{host}{':' + port if port else ''}"
    tail = tail.partition("#")[0]  # a fragment never reaches the server
    path, qmark, query = tail.partition("?")
    path = path.rstrip("/")
    if scheme in ("http", "https") and not path.lower().endswith("/v1"):
        path += "/v1"
    return f"{scheme}://{authority}{path}{qmark}{query}"


class Addressing:
    """The addressing rules over one config and one models.json catalog.

    Built once per (re)load; every lookup is a few dict probes.
    """

    def __init__(self, config: Config = Config(), catalog: Optional[dict[str, str]] = None) -> None:
        self.config = config
        self.catalog = dict(catalog or {})
        self._groups: dict[str, QueueEntry] = {}
        self._url_group: dict[str, QueueEntry] = {}
        self._provider_group: dict[str, QueueEntry] = {}
        self._endpoint_entry: dict[str, QueueEntry] = {}
        self._named_entry: dict[str, QueueEntry] = {}
        self._cache: dict[str, tuple[str, QueuePolicy]] = {}
        for entry in config.queues:
            if entry.match is None:
                continue
            self._groups.setdefault(entry.name, entry)
            if not entry.enabled:
                continue  # spec: a disabled group does not re-key its members
            for member in entry.match:
                if _is_url(member):
                    self._url_group.setdefault(normalize_url(member), entry)
                else:
                    self._provider_group.setdefault(member, entry)
        providers_by_url: list[tuple[str, QueueEntry]] = []
        for entry in config.queues:
            if entry.match is not None or entry.name in self._groups:
                continue
            if _is_url(entry.name):
                self._endpoint_entry.setdefault(normalize_url(entry.name), entry)
            else:
                self._named_entry.setdefault(entry.name, entry)
                url = self.catalog.get(entry.name)
                if url:
                    providers_by_url.append((normalize_url(url), entry))
        for url, entry in providers_by_url:  # a baseUrl key wins over a provider-name key
            self._endpoint_entry.setdefault(url, entry)

    def configured(self, owner: str) -> bool:
        """Does the config name the queue ``owner`` (a group, or an entry for the endpoint)?"""
        return owner in self._groups or owner in self._endpoint_entry or owner in self._named_entry

    def address_endpoint(self, key: str) -> tuple[str, QueuePolicy]:
        """The queue that owns ``key`` (as a raw client names it) and that queue's policy."""
        hit = self._cache.get(key)
        if hit is None:
            hit = self._resolve(key)
            if len(self._cache) >= 4096:  # bounded: keys are chosen by peers
                self._cache.clear()
            self._cache[key] = hit
        return hit

    def _resolve(self, key: str) -> tuple[str, QueuePolicy]:
        group = self._groups.get(key)
        if group is not None:
            return group.name, group.policy
        if _is_url(key):
            return self._endpoint(normalize_url(key))
        group = self._provider_group.get(key)
        if group is not None:
            return group.name, group.policy
        url = self.catalog.get(key)
        if url:
            return self._endpoint(normalize_url(url), self._named_entry.get(key))
        entry = self._named_entry.get(key)
        return key, entry.policy if entry else self.config.defaults

    def _endpoint(self, url: str, fallback: Optional[QueueEntry] = None) -> tuple[str, QueuePolicy]:
        group = self._url_group.get(url)
        if group is not None:
            return group.name, group.policy
        entry = self._endpoint_entry.get(url) or fallback
        return url, entry.policy if entry else self.config.defaults

    def address_model(self, provider: Optional[str], base_url: Optional[str]) -> str:
        """The key a client that knows its model (provider and baseUrl) queues under: the group
        naming the provider exactly, else the group naming its endpoint, else the endpoint."""
        if provider:
            group = self._provider_group.get(provider)
            if group is not None:
                return group.name
            if not base_url:
                base_url = self.catalog.get(provider)
        if base_url:
            return self._endpoint(normalize_url(base_url))[0]
        return provider or ""


# =================================================================================================
# Lease terms (the spec's ADR 0009)
#
# The one place that owns a lease's terms: their shape, the refresh period they imply, their wire
# encoding, and the growth rule.  The daemon writes terms through it and the client reads them
# through it.  A held lease's TTL only ever grows; its idle-yield window is fixed at grant.
# =================================================================================================


class LeaseTerms(NamedTuple):
    """The TTL and the idle-yield window a lease is held under."""

    ttl_ms: int
    idle_yield_ms: int

    @classmethod
    def of(cls, policy: QueuePolicy) -> LeaseTerms:
        return cls(policy.lease_ttl_ms, policy.idle_yield_ms)

    def refresh_period_ms(self) -> float:
        """How often a live client refreshes the lease: ``ttl / 3`` (floor 250 ms), and at most
        half the idle-yield window, so the lease neither lapses nor yields between beats."""
        period = max(self.ttl_ms / 3.0, BEAT_FLOOR_MS)
        if self.idle_yield_ms > 0:
            period = min(period, self.idle_yield_ms / 2.0)
        return period

    def grown(self, queue_ttl_ms: int) -> LeaseTerms:
        """The terms after a refresh under a queue whose TTL is now ``queue_ttl_ms``: the longer
        TTL wins, so a policy edit never shortens a lease that is already held."""
        if queue_ttl_ms <= self.ttl_ms:
            return self
        return self._replace(ttl_ms=queue_ttl_ms)

    def to_wire(self) -> dict[str, int]:
        """The terms' fields in a ``granted`` reply."""
        return {"leaseTtlMs": self.ttl_ms, "idleYieldMs": self.idle_yield_ms}

    def wire_json(self) -> str:
        """``to_wire()`` as the JSON members the daemon splices into its ``granted`` reply."""
        return f'"leaseTtlMs":{self.ttl_ms},"idleYieldMs":{self.idle_yield_ms}'

    @classmethod
    def from_wire(cls, reply: dict[str, Any], fallback: LeaseTerms) -> LeaseTerms:
        """The terms a ``granted`` reply carries; ``fallback`` (the client's own copy of the
        config) for a daemon that sends none, field by field."""
        ttl: Any = reply.get("leaseTtlMs")
        idle: Any = reply.get("idleYieldMs")
        return cls(
            int(ttl) if _is_int(ttl) and ttl >= MIN_LEASE_TTL_MS else fallback.ttl_ms,
            int(idle) if _is_int(idle) and idle >= 0 else fallback.idle_yield_ms,
        )


# =================================================================================================
# The scheduler
#
# Sans-I/O: no sockets, no files, no clock.  Every mutator takes ``now`` (monotonic milliseconds)
# and returns the events that happened, in order; the daemon turns the same event objects into
# replies and log lines, so the two cannot disagree.  Rules that hold inside:
#   - a queue never grants past ``maxStreams``; a lowered limit never preempts (over-capacity);
#     ``"auto"`` is the server's slots, as many as its KV holds running contexts of the largest
#     size seen (``_auto_streams``), one until its usage reports say (opt-in: see its caveat);
#   - after every call, a queue with a free slot has no waiters;
#   - waiters are ordered by (tier, sequence number taken at enqueue); aging picks the oldest
#     child ahead of parents, it never rewrites a tier; ``fifo`` ignores tiers;
#   - a grant of a queued waiter is a Switch; a direct grant into a free slot is not;
#   - a holder is only ever removed by release, cancel, disconnect, TTL lapse, idle yield, or
#     -- when it said it is parked (waiting on another agent) -- by a waiter's arrival;
#   - one rule for an idle slot (issue 33, ``HoldCost``): a holder with nothing in flight that
#     someone waits for keeps its slot while the server's time it idled so (its idle spells over
#     its tenure, once however many wait) is below what a switch costs, and hands it over then: at
#     most twice the hindsight's best (ski rental).  A switch costs the re-prefill, at the server's
#     measured rate, of the contexts still in use that the runs before the holder's return push
#     out of what the server keeps (the slot holds the latest context whole; its host cache, of a
#     size in tokens learned from the returns, the others: each by its chance), and, for a person
#     between turns, the wait behind a subagent's request they would come back to.  While no
#     return has told what the server keeps, the idle the queue spends so adds up across holders:
#     once it reaches one switch's cost the switch is made, and the returns that follow tell.
#     Where such idle was timed before (a person's thoughts; the queue's tool calls between two
#     requests) and what is left of this one, as they usually go (the median), is longer than the
#     switch, it goes at once: then at least half of them would have been handed over anyway, and
#     the idle is saved.
#     Nothing known of the contexts' sizes: kept, to the idle-yield.  It decides where
#     ``holdRule`` is ``cost``.  Elsewhere (the default) the rules below decide, and it bounds
#     them at the most a switch can cost: a switch makes room for the larger of the two contexts
#     it swaps, and a server drops whole contexts, so the largest still in use (not the waiter's)
#     that fill that room are re-prefilled, whatever the server was seen to keep.
# Costs: every operation is O(log n) in waiters and holders (heaps with lazy deletion), except
# ``status`` (linear in what it reports) and ``reconfigure`` (a rebuild).
# =================================================================================================

if TYPE_CHECKING:
    Conn = Any  # an opaque, hashable connection identity chosen by the caller
    Target = Tuple[Any, str]  # (connection, the queueKey that connection asked with)

# A resumed waiter's enqueue number is taken this far below the usual ones: ahead of its tier.
RESUME_AHEAD = 1 << 62
# Empty queues that no config entry names are forgotten (oldest first, with their counters) once
# there are more queues than this: queue keys are chosen by peers, so they must not pile up.
MAX_QUEUES = 1024


def _who_json(session: str, role: int, group: Optional[str], spare: bool = False, background: bool = False) -> str:
    """A holder's or waiter's entry in a status reply, encoded once (``spare``, additive: a
    holder on a parent's spare stream; ``background``, additive: a parent waiting with no
    person behind it, ``Scheduler.acquire``)."""
    tail = (',"spare":true' if spare else "") + (',"background":true' if background else "")
    return (f'{{"sessionKey":{_json_str(session)},"role":"{ROLES[role]}",'
            f'"group":{"null" if group is None else _json_str(group)}{tail}}}')


class Holder:
    """A Holder: a session's lease on one slot -- who holds it, on which terms, and since when.
    ``conns`` are the connections that acquired it; the lease lives while any of them does."""

    __slots__ = (
        "queue", "session", "role", "group", "activity", "terms", "seq", "key",
        "granted_at", "last_beat", "last_activity", "conns", "held", "parked", "json",
        "idle_since", "dead_ms", "spare", "handback", "gap", "turn", "background", "rent_ms", "busy_since",
        "asks_spare", "shared_ms", "mark", "at_once",
    )

    def __init__(self, queue: _Queue, session: str, role: int, group: Optional[str], activity: bool,
                 terms: LeaseTerms, seq: int, key: str, now: float, spare: bool = False,
                 background: bool = False, asks_spare: bool = False) -> None:
        self.queue = queue
        self.session = session
        self.role = role
        self.group = group
        self.activity = activity
        self.terms = terms
        self.seq = seq  # grant number, daemon-wide: strictly increasing per queue, a fencing token
        self.key = key  # the queueKey it was granted for; re-addressed on reload
        self.granted_at = now
        self.last_beat = now
        self.last_activity = now
        self.conns: set[Any] = set()
        self.held = True
        self.parked = False  # its client waits on another agent: the slot goes to any waiter at once
        # Between two requests of its run (``handback``): the slot goes at once to a parent the
        # queue would grant next, and to a child only while the queue's switch cost is unknown
        # (``Scheduler._refill``).  A parked holder yields to anyone anyway.
        self.handback = False
        # Parked between two requests of its run, for a tool call (the park's ``gap``): it comes
        # back, so where the server keeps only so many contexts its slot goes only to a waiter
        # whose run evicts no context still in use (``Scheduler._gap_target``).
        self.gap = False
        # A parent parked at the end of its turn (the park's ``turn``): a person answers next, and
        # its context is in use meanwhile (``_Queue.thinking``), so its slot goes, as a gap's
        # does, only to a waiter whose run evicts no context in use.
        self.turn = False
        self.spare = spare  # on one of the queue's spare streams (parents only), not one of max_streams
        # its acquire asked for a spare stream: where subagents hold every slot, it streams beside them
        self.asks_spare = asks_spare
        # A parent with no person behind it (its acquire said ``background``): its park for good
        # keeps the slot for a context in use, as a child's does (``Scheduler._refill``).
        self.background = background and role == PARENT
        self.json = _who_json(session, role, group, spare)  # its entry in status replies
        # Dead time: since when it has had no request in flight (``busy: false``, or parked), and
        # the time it held the slot so while someone waited for it.
        self.idle_since: Optional[float] = None
        self.dead_ms = 0.0
        # The server's time its closed idle spells cost while someone waited, added up over its
        # whole tenure: the rent issue 33's rule weighs against one switch (``HoldCost.before_ms``).
        self.rent_ms = 0.0
        self.busy_since: Optional[float] = now  # its request in flight began then (None: none is)
        # The other requests of its queue in flight beside its own, summed over the time (ms),
        # up to ``mark`` (``Scheduler._flight``); and its last request's mean of requests in
        # flight at once, its own included: a usage report's decode went at that.
        self.shared_ms = 0.0
        self.mark = now
        self.at_once = 1.0

    @property
    def expires_at(self) -> float:
        return self.last_beat + self.terms.ttl_ms

    @property
    def idle_at(self) -> Optional[float]:
        """When this lease becomes yieldable, or None when it never does (unflagged or off)."""
        if not self.activity or self.terms.idle_yield_ms <= 0:
            return None
        return self.last_activity + self.terms.idle_yield_ms

    def running_at_once(self) -> float:
        """The mean of its queue's requests in flight at once over its own request in flight, its
        own included, up to its ``mark`` (1 while none ran beside it, or none is in flight)."""
        if self.busy_since is None or self.mark <= self.busy_since:
            return 1.0
        return 1.0 + self.shared_ms / (self.mark - self.busy_since)

    @property
    def for_good(self) -> bool:
        """Parked with its run waiting on another agent (not for a tool call's gap, nor at a
        person's turn's end): done with its context until it comes back."""
        return self.parked and not (self.gap or self.turn)

    @property
    def persons(self) -> bool:
        """Whether a person is behind it: a parent, not ``background``.  Only such a one's turn
        can be over (``Scheduler.park``'s ``turn``)."""
        return self.role == PARENT and not self.background

    def __repr__(self) -> str:
        return f"<Holder {self.queue.key} {self.session} {ROLES[self.role]} seq={self.seq}>"


class Waiter:
    """A queued ``acquire``: a session waiting for a slot, with every (connection, key) that
    asked for it -- each is answered, with its own key, when the slot comes."""

    __slots__ = (
        "queue", "session", "role", "group", "activity", "seq", "key",
        "enqueued_at", "parent_mark", "targets", "version", "live", "json", "spare", "background",
    )

    def __init__(self, queue: _Queue, session: str, role: int, group: Optional[str], activity: bool,
                 seq: int, key: str, now: float, spare: bool = False, background: bool = False) -> None:
        self.queue = queue
        self.session = session
        self.role = role
        self.group = group
        self.activity = activity
        self.seq = seq  # scheduler-wide enqueue order: FIFO within a tier, across merges too
        self.key = key
        self.enqueued_at = now
        self.parent_mark = queue.parent_grants  # parent grants seen at enqueue, for slot aging
        self.targets: dict[Target, None] = {}  # ordered, and O(1) to test
        self.version = 0  # bumped on re-tier and on a move: heap entries of older versions are dead
        self.live = True
        self.spare = spare  # it asked for a spare stream: it takes one as a parent, when children hold every slot
        # a parent with no person behind it (``acquire`` with ``background``): it may wait for a
        # context in use as a child does (``Scheduler._gap_target``); only ever cleared
        self.background = background
        self.json = _who_json(session, role, group, background=background and role == PARENT)  # redone on re-tier

    def __repr__(self) -> str:
        return f"<Waiter {self.queue.key} {self.session} {ROLES[self.role]} seq={self.seq}>"


class Granted(NamedTuple):
    """A session holds a slot.  ``new`` is false for a re-grant to a session that already held
    it (no slot taken, nothing logged); ``switch`` marks the grant of a queued waiter."""

    queue_key: str
    holder: Holder
    targets: Tuple[Target, ...]
    new: bool = True
    switch: bool = False


class Queued(NamedTuple):
    """An acquire parked as a waiter."""

    queue_key: str
    waiter: Waiter


class Dequeued(NamedTuple):
    """A waiter left its queue without a grant: ``reason`` is cancel, disconnect (its
    connection closed, noticed at grant time at the latest), or merged (a reload folded it into
    the same session's request or slot in another queue)."""

    queue_key: str
    waiter: Waiter
    reason: str


class Released(NamedTuple):
    """A slot returned: ``reason`` is release, cancel, disconnect, idle (an idle yield), parked
    (a parked holder handed over to a waiter) or handback (a holder between two requests handed
    over to a waiting parent, or, while the switch cost is unknown, to a child)."""

    queue_key: str
    holder: Holder
    reason: str
    cost: Optional[HoldCost] = None  # a hand-over to a waiter (parked, handback): issue 33's rule then


class Evicted(NamedTuple):
    """A lapsed lease reclaimed by the sweep (``reason`` ttl, the only eviction)."""

    queue_key: str
    holder: Holder
    reason: str = "ttl"


class Moved(NamedTuple):
    """A reload moved a holder's slot or a waiting request from queue ``source`` to queue
    ``queue_key`` (logged, so a replay of the log follows it)."""

    queue_key: str
    source: str
    who: Union[Holder, Waiter]


class OverCapacity(NamedTuple):
    """A reload left more holders than the queue's new ``maxStreams``; they keep their slots."""

    queue_key: str
    holders: int
    max_streams: int


class Usage(NamedTuple):
    """A request's prompt tokens as its model server counted them (the additive ``usage`` op):
    ``prefilled`` computed afresh, ``reused`` served from the server's cache.  ``seq`` is the
    grant the session held the queue's slot under when it reported (None: it held none)."""

    queue_key: str
    session: str
    prefilled: int
    reused: int
    seq: Optional[int]
    kept: Optional[float] = None  # back on the slot after another session: the share of its context kept
    switch_cost: str = "unknown"  # the queue's switches as of this report: cheap, dear, unknown
    depth: Optional[int] = None  # with ``kept``: how many other sessions had used the slot meanwhile
    prefill_ms: Optional[float] = None  # how long the server took to prefill ``prefilled`` (``prefillMs``)
    streams: Optional[int] = None  # ``maxStreams: "auto"``: the queue's streams, when this report changed them
    decode_ms: Optional[float] = None  # how long the server took to decode ``decoded`` tokens (``decodeMs``)
    decoded: int = 0
    at_once: Optional[float] = None  # the queue's requests in flight at once with this one, on the mean


def switch_cost(kept: Sequence[float], setting: str = "auto", sessions: Optional[Sequence[str]] = None,
                depths: Optional[Sequence[int]] = None, contexts: Optional[int] = None) -> str:
    """What a switch costs on a queue: its ``switchCost`` setting, or (``auto``) learned from the
    share of their context that sessions back on the slot after another found kept (the server's
    own counts): ``cheap`` when each of the most recent ``KEPT_SAMPLES`` kept at least
    ``KEPT_CHEAP`` (and at least two sessions came back: ``sessions`` names who came back, each
    return in turn; without it every return counts as another session's), ``dear`` when one of
    them did not, ``unknown`` before any session came back.  One eviction among them is enough
    for ``dear``: a server that keeps most contexts but not all (a host cache that holds two
    agents of four) evicts more once the queue hands over at every tool call, so ``cheap`` must
    be earned in a row.  Two sessions, because one that keeps coming back after a single other
    only shows that the server keeps two contexts.

    ``depths`` (each return's depth, in turn; without it every return is at depth 1): an
    eviction deeper than 1 (after two or more other sessions) is no dear switch, since one other
    session did not evict it; it bounds how many contexts the server keeps
    (``learned_contexts``, or ``contexts`` as known), and with that bound switches stay cheap,
    one session's kept return being enough then: the bound is what a second session would have
    shown."""
    if setting != "auto":
        return setting
    recent = list(kept)[-KEPT_SAMPLES:]
    if not recent:
        return "unknown"
    deep = list(depths)[-KEPT_SAMPLES:] if depths is not None else [1] * len(recent)  # one per return
    if any(k < KEPT_CHEAP and d <= 1 for k, d in zip(recent, deep)):
        return "dear"
    back = list(sessions)[-KEPT_SAMPLES:] if sessions is not None else [str(i) for i in range(len(recent))]
    who = len({s for s, k in zip(back[-len(recent):], recent) if k >= KEPT_CHEAP})
    if contexts is None:
        contexts = learned_contexts(recent, deep)
    return "cheap" if who >= 2 or who and contexts is not None and contexts >= 2 else "unknown"


def learned_contexts(kept: Sequence[float], depths: Sequence[int], contexts: Optional[int] = None) -> Optional[int]:
    """How many contexts the server keeps, as the returns show it, from ``contexts`` known before:
    None while no return was evicted; an eviction at depth d says at most d (the session's own and
    d - 1 others'), and a return kept at depth d at least d + 1, the later of two that disagree
    winning (contexts grow, and sizes differ)."""
    for share, depth in zip(kept, depths):
        if share < KEPT_CHEAP:
            contexts = depth if contexts is None else min(contexts, depth)
        elif contexts is not None and contexts <= depth:
            contexts = min(MAX_DEPTH, depth + 1)
    return contexts


def contexts_floor(kept: Sequence[float], depths: Sequence[int], contexts: Optional[int], floor: int = 0) -> int:
    """The fewest contexts the server keeps, as the returns show it, from ``floor`` known before: a
    return kept at depth d says at least d + 1.  Never above ``contexts``, the bound learned after
    them (``learned_contexts``: where the two disagree, contexts shrank since)."""
    for share, depth in zip(kept, depths):
        if share >= KEPT_CHEAP:
            floor = max(floor, min(MAX_DEPTH, depth + 1))
    return floor if contexts is None else min(floor, contexts)


class _Affinity:
    """A queue's switch record, from its usage reports: who reported last, each session's last
    prompt (its size in tokens, in the order they reported: the last is the most recent), and the
    share kept by each return after a switch, and at what depth."""

    __slots__ = ("last", "prompts", "kept", "back", "depths", "contexts", "floor", "returns", "probed",
                 "probed_at", "prober", "rates", "room", "room_cap", "growth")

    def __init__(self) -> None:
        self.last: Optional[str] = None
        self.prompts: OrderedDict[str, int] = OrderedDict()
        self.kept: deque[float] = deque(maxlen=KEPT_SAMPLES)
        self.back: deque[str] = deque(maxlen=KEPT_SAMPLES)  # who came back, for each of ``kept``
        self.depths: deque[int] = deque(maxlen=KEPT_SAMPLES)  # and after how many others
        # how many contexts the server keeps (``learned_contexts``), over every return: None while
        # none was evicted
        self.contexts: Optional[int] = None
        # how many it keeps at least (``contexts_floor``), over every return: 0 while none was kept
        self.floor = 0
        self.returns = 0
        # ``returns`` when a holder last gave way in a gap while the cost was unknown (a probe), and
        # when: the next probe waits for a return since, so that one switch at a time finds it
        # out, or for ``PROBE_AGAIN_MS`` (the one that gave way may never come back)
        self.probed = -1
        self.probed_at = 0.0
        self.prober: Optional[str] = None  # the session that gave way then: its return tells
        # the server's prefill, as it timed it: (tokens, ms) of the latest reports that said both
        self.rates: deque[tuple[int, float]] = deque(maxlen=RATE_SAMPLES)
        # What the server keeps beside its slot's context (the latest), in tokens, as the returns
        # show it (``learn_room``): at least ``room`` (None: no return was kept yet), fewer than
        # ``room_cap`` (None: none evicted).
        self.room: Optional[int] = None
        self.room_cap: Optional[int] = None
        # the most a conversation's prompt grew from one request to its next (its reply and
        # what came since): what a running context may still take up
        self.growth = 0

    def learn_room(self, tokens: int, kept: bool) -> None:
        """A return after a switch: the session's context and every other one reported since but
        the latest (in the slot) came to ``tokens`` in all, and the server kept it (it keeps at
        least that many beside the slot's) or not (fewer).
        Where the two bounds disagree, the later return wins: contexts grow, and a server's cache
        is shared with what the queue does not see."""
        if kept:
            self.room = max(self.room or 0, tokens)
            if self.room_cap is not None and self.room_cap <= self.room:
                self.room_cap = None
        else:
            self.room_cap = tokens if self.room_cap is None else min(self.room_cap, tokens)
            if self.room is not None and self.room >= self.room_cap:
                self.room = None

    def since(self, session: str) -> Optional[int]:
        """The tokens of the contexts reported since ``session``'s own last report, each at its
        latest size (None: more than ``MAX_DEPTH`` of them, or ``session`` never reported)."""
        total = 0
        for depth, other in enumerate(reversed(self.prompts)):
            if other == session:
                return total
            if depth == MAX_DEPTH:
                return None
            total += self.prompts[other]
        return None

    def timed(self, prefilled: int, prefill_ms: Optional[float]) -> None:
        """A report's prefill time (``prefillMs``): how fast the server prefills, measured."""
        if prefill_ms is not None and prefilled > 0:
            self.rates.append((prefilled, prefill_ms))

    def ms_per_token(self) -> Optional[float]:
        """The server's prefill time per token over its latest timed reports (None: none yet).
        Each report's fixed overhead counts in: a slightly dearer switch, never a cheaper one."""
        tokens = sum(t for t, _ in self.rates)
        return sum(ms for _, ms in self.rates) / tokens if tokens else None

    def report(self, session: str, prefilled: int, reused: int,
               one_slot: bool = True, whole: bool = True) -> tuple[Optional[float], int]:
        """One request's counts; the share of its previous prompt it found kept, when another
        session reported in between (it came back after a switch) and its prompt is no shorter
        than its previous one (the same conversation), else None; and how many other sessions
        reported since its own last report (its depth).  ``whole``: the two counts are the whole
        prompt (both were given); a report of one of them alone cannot say it is shorter."""
        depth = self.depth(session) if one_slot else 1
        others = self.since(session) if one_slot else None
        before = self.prompts.pop(session, None)
        kept = None
        # A conversation's prompt only grows (its last prompt, the reply, what came since), so a
        # shorter one is a new conversation under the same session name (a subagent's next task,
        # or a compacted history): it tells nothing of what the server kept.
        if (before and self.last is not None and self.last != session
                and (prefilled + reused >= before or not whole)):
            kept = min(1.0, reused / before)
            self.kept.append(kept)
            self.back.append(session)
            self.depths.append(depth)
            self.contexts = learned_contexts([kept], [depth], self.contexts)
            self.floor = contexts_floor([kept], [depth], self.contexts, self.floor)
            self.returns += 1
            if others is not None and whole:
                # the context that ran last is in the slot: the host cache held the rest
                self.learn_room(before + others - self.prompts[self.last], kept >= KEPT_CHEAP)
        if before and whole and prefilled + reused > before:
            self.growth = max(self.growth, prefilled + reused - before)
        self.prompts[session] = prefilled + reused
        while len(self.prompts) > 1024:
            self.prompts.popitem(last=False)
        self.last = session
        return kept, depth

    def depth(self, session: str) -> int:
        """How many other sessions reported since ``session`` last did (``MAX_DEPTH`` at most, and
        for one never seen)."""
        for depth, other in enumerate(reversed(self.prompts)):
            if other == session or depth == MAX_DEPTH:
                return depth
        return MAX_DEPTH

    def resident(self, room: Optional[int] = None) -> list[str]:
        """The sessions whose contexts the server keeps, as far as the learned bound tells: the
        ``contexts`` (or ``room``) that reported most recently, the latest first (all of them
        while unbounded, up to ``MAX_DEPTH``)."""
        if room is None:
            room = self.contexts if self.contexts is not None else MAX_DEPTH
        return list(itertools.islice(reversed(self.prompts), room))

    def unsettled(self) -> Optional[int]:
        """Where the returns leave the bound open (kept after one other, then evicted after three:
        two or three contexts fit), the lower end: a person's context between turns is kept as
        if that were all (on a real llama-server the first eviction came after three others where
        two fit, and the bound of three let a subagent push the thinking person's context out).
        Subagents' contexts in their tool calls go by the bound itself: kept by the lower end, a
        third subagent waited behind an idle slot until it aged, where three fit, and with no
        return that could have told."""
        if self.contexts is not None and 2 <= self.floor < self.contexts:
            return self.floor
        return None

    def cost(self, setting: str = "auto") -> str:
        return switch_cost(self.kept, setting, self.back, self.depths, self.contexts)

    def saved(self) -> list[float]:
        """The returns a later daemon starts from (it cannot tell who came back): all of them
        where they decide the cost, else only the latest, so that it too does not know yet."""
        return list(self.kept) if self.cost() != "unknown" else list(self.kept)[-1:]

    def saved_depths(self) -> tuple[list[int], Optional[int]]:
        """The depths of ``saved()``'s returns, and the contexts learned."""
        depths = list(self.depths)
        return (depths if self.cost() != "unknown" else depths[-1:]), self.contexts


class HoldCost(NamedTuple):
    """Issue 33's rule for an idle slot that someone waits for, in the server's own time: handing
    it over makes the server re-prefill ``tokens`` of contexts still in use, which the waiter's run
    pushes out of what the server keeps (the holder's own, or another's), for ``switch_ms``;
    keeping it costs the server's time: ``idle_ms``, the slot's idle time while someone waited,
    plus ``before_ms``, what the holder's earlier idle spells of the same tenure cost so (the rent
    is paid across gaps: a holder whose every tool call is shorter than the switch's cost keeps a
    waiter out no longer than that cost in all).  While nothing is known of what the server keeps
    (no return after a switch told it), ``before_ms`` is the queue's: every holder's idle while
    someone waited since the queue began, so the rent adds up across tenures until one switch is
    bought, whose return tells; without it, holders whose tenures each idle less than a switch
    would keep every slot through every gap and never find out that switches were free.  Both
    sides are seconds of the one server, and each delays everyone queued behind it alike, so an
    idle second counts once however many wait (counted per waiter, five waiting would spend a
    switch's price five times as fast, and six subagents hand the slot round a room too small for
    them).  The rule (ski rental): hand over
    once the idle time spent reaches the switch's cost, and at once where the switch is free.
    Whatever the gaps, that spends at most twice what the best choice in hindsight would have.
    ``switch_ms`` None: nothing is known of the contexts' sizes (no usage reported), and the
    seed's rule stands: the slot is kept to the idle-yield.  ``measured``: priced at the server's
    own prefill rate, else at ``ASSUMED_PREFILL_TPS``.  For a person between turns and a subagent
    waiting, the switch also costs the person's wait behind its request (``behind_ms``; none where
    their session takes a spare stream beside it, ``parentStreams``): a second
    of a person's wait counts as much as a second of the whole server's, more than any one
    agent's share of it.  The threshold is ``threshold_ms``.  Where the holder's idle was timed
    before, ``ahead_ms`` is what is left of this one as it usually goes (the median, less what it
    has lasted): a person's thought between turns, or a tool call between two requests (the
    queue's recent ones, ``ahead`` says which).  Keeping costs the server that much idle, so
    where it is longer than the threshold the slot goes at once: with the median past the
    switch's cost, at least half the gaps would have been handed over anyway, each now without
    the idle, and one that proves short costs the switch.  The idle spent still bounds the keep
    where the measure is wrong.  It decides where the queue's
    ``holdRule`` is ``cost``.  Elsewhere the rules in force decide, and it bounds them, priced at
    the most a switch can cost (``hold_cost``'s ``rules``).  Either way ``status`` shows it, and
    the log's hand-overs and dead spells carry it."""

    idle_ms: float
    tokens: Optional[int]
    switch_ms: Optional[float]
    measured: bool
    why: str
    before_ms: float = 0.0
    behind_ms: float = 0.0  # a person between turns: how long they would wait behind the waiter's request
    # how much longer the holder's idle will last, as the measured ones say (the median, less
    # what this one has lasted): a person's thought ("think") or a tool call ("gap"); None: not measured
    ahead_ms: Optional[float] = None
    ahead: str = "think"

    @property
    def spent_ms(self) -> float:
        return self.before_ms + self.idle_ms

    @property
    def threshold_ms(self) -> Optional[float]:
        """The idle time to spend before the slot goes: the switch's cost, and a person's wait."""
        return None if self.switch_ms is None else self.switch_ms + self.behind_ms

    @property
    def hand_over(self) -> bool:
        """The idle time spent reached the threshold; or the idle still ahead, where it is
        measured, is longer than the threshold, so keeping costs more than switching now."""
        threshold = self.threshold_ms
        return threshold is not None and (self.spent_ms >= threshold
                                          or self.ahead_ms is not None and self.ahead_ms > threshold)

    def fields(self) -> dict[str, Any]:
        """The figures for a log line or a status entry."""
        out: dict[str, Any] = {"idleMs": round(self.idle_ms), "waitedMs": round(self.spent_ms),
                               "switchTokens": self.tokens,
                               "switchMs": None if self.switch_ms is None else round(self.switch_ms),
                               "measured": self.measured, "rule": "hand over" if self.hand_over else "keep"}
        if self.before_ms:
            out["waitedBeforeMs"] = round(self.before_ms)
        if self.behind_ms:
            out["personWaitMs"] = round(self.behind_ms)
        if self.ahead_ms is not None:
            out["thinkAheadMs" if self.ahead == "think" else "gapAheadMs"] = round(self.ahead_ms)
        return out

    def explain(self) -> str:
        """The two sides, in a person's words."""
        idle = f"idle {self.idle_ms / 1000:.1f} s so far"
        if self.before_ms:
            idle += f", {self.before_ms / 1000:.1f} s more in earlier gaps"
        if self.switch_ms is None:
            return f"keeping: {self.why}; {idle}"
        if self.ahead_ms is not None and self.ahead == "gap":
            idle = (f"its tool calls usually last about {max(0.0, self.ahead_ms) / 1000:.1f} s more; "
                    f"{idle}")
        person = []
        if self.ahead_ms is not None and self.ahead == "think":
            person.append(f"thinks about {max(0.0, self.ahead_ms) / 1000:.1f} s more, as they usually do")
        if self.behind_ms:
            person.append(f"would wait about {self.behind_ms / 1000:.1f} s behind the waiter's request")
        if person:
            idle = f"a person {' and '.join(person)}; {idle}"
        verdict = "handing over" if self.hand_over else "keeping"
        if self.tokens == 0:
            return f"{verdict}: switching re-prefills nothing ({self.why}); {idle}"
        price = "" if self.measured else f", at an assumed {ASSUMED_PREFILL_TPS:.0f} tokens/s"
        return (f"{verdict}: switching would re-prefill {_tokens(self.tokens or 0)} tokens, about "
                f"{self.switch_ms / 1000:.1f} s{price} ({self.why}); {idle}")


def _tokens(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def _median(values: Iterable[float]) -> float:
    """The middle of ``values`` (of an even count, the upper of the two); not empty."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def kept_chance(tokens: float, room: int, cap: Optional[int]) -> float:
    """The chance that a server seen to keep ``room`` tokens of contexts keeps ``tokens``.  Up to
    the room it surely does.  Past it, until the server was seen to lose a context (``cap`` None),
    the prior is scale-free (Pareto, index 1): it keeps ``tokens`` with the chance ``room /
    tokens``, so the growth of a context or two by a request prices a little of a re-prefill, not
    all of it, and a switch that shows more was kept can happen.  Once it lost one, its limit is
    near the room seen, and nothing past that is counted on.  No constant: twice the room seen is
    as likely kept on a GPU as on a CPU."""
    if tokens <= room:
        return 1.0
    return room / tokens if cap is None else 0.0


def hold_cost(affinity: Optional[_Affinity], setting: str, holder: str, waiter: Optional[str],
              in_use: Callable[[str], bool], idle_ms: float, then: Sequence[str] = ()) -> HoldCost:
    """What handing ``holder``'s idle slot to ``waiter`` costs (``HoldCost``), from the queue's
    switch record: each session's context size (its last prompt), what the server keeps, in
    tokens, as the returns showed it (``_Affinity.room`` and ``room_cap``), and its prefill rate.
    The server keeps the latest context whole in its slot, and the others in a host cache of so
    many tokens, the most recently used that fit (llama-server's ``--cache-ram``; the simulator's
    host cache): a run takes its context out of the cache into the slot, and puts the slot's in
    front.  The waiter's run, then those of ``then`` (who else runs before the holder is back: it
    queues behind them), put the holder's context in front and then theirs (one never seen counts
    as the median context); a context behind them is pushed out once it, the ones ahead of it and
    the larger of the two in front no longer fit, and the holder's once it and those after the
    waiter's do not.  Each needed context is priced at its re-prefill times the chance that the
    switch pushes it out (``kept_chance``
    before, less after), so a room known only as a lower bound prices a little growth past it a
    little, not as a whole eviction.  ``in_use``: whether a session's context will be needed
    again.  ``setting``: the queue's ``switchCost``, where a person said it (``cheap``: free;
    ``dear``: the holder's context); or ``rules``, the bound on the rules in force (``holdRule:
    rules``): the most a switch can cost, whatever the server was seen to keep.  The waiter's
    context comes in and the holder's is put aside, so the server makes room for the larger of
    the two (one never reported counts as the largest context seen; a holder still in use that
    never reported leaves the rules alone, as where nothing is known): a paged KV frees that
    many tokens, llama-server's host cache drops whole entries until it fits the holder's.  At
    worst that pushes out the largest contexts still in use but the waiter's (of the latest
    ``MAX_DEPTH`` reported), one after another until they fill the room.  (Priced at every
    context in use instead, the bound kept six subagents' slot idle through gaps five contexts
    long, where one switch pushes out one.)  Pure."""
    rate = affinity.ms_per_token() if affinity is not None else None
    measured = rate is not None
    per_token = rate if rate is not None else 1000.0 / ASSUMED_PREFILL_TPS
    if setting == "cheap":
        return HoldCost(idle_ms, 0, 0.0, measured, "switchCost is cheap")
    prompts = affinity.prompts if affinity is not None else {}
    if holder not in prompts and not (setting == "rules" and prompts and not in_use(holder)):
        # a holder done with its context needs no size of its own to bound the rules: the room
        # counts it as the largest seen; one still in use that never reported cannot be priced
        return HoldCost(idle_ms, None, None, False, "no context sizes reported, so a switch is dear")
    room = affinity.room if affinity is not None and setting == "auto" else None
    if setting == "rules":  # the most a switch can cost, whatever the server keeps
        latest = list(itertools.islice(reversed(prompts), MAX_DEPTH))  # older ones are long gone anyway
        # the switch brings the waiter's context in and puts the holder's aside: room for the larger
        # of the two is made, whole contexts out at a time (one never reported may be the largest seen)
        largest = max(prompts[s] for s in latest)
        swapped = max(prompts.get(holder, largest), prompts.get(waiter or "", largest))
        tokens = 0.0
        for size in sorted((prompts[s] for s in latest if s != waiter and in_use(s)), reverse=True):
            if tokens >= swapped:
                break
            tokens += size  # the dearest contexts in use first
        why = ("the most a switch can cost: the largest contexts still in use but the waiter's, until "
               "they fill the room it makes")
    elif affinity is None or room is None:  # no return was kept: nothing says it keeps more than the waiter's
        tokens = float(prompts[holder])
        why = ("switchCost is dear" if setting == "dear" else
               "what the server keeps is not known yet: the holder's context is assumed pushed out")
    else:
        cap = affinity.room_cap
        recent = list(itertools.islice(reversed(prompts), MAX_DEPTH))  # the latest first: in the slot
        median = _median(prompts[s] for s in recent)
        first = prompts.get(waiter, median) if waiter is not None else 0
        slot = recent[0]  # the holder's, as a rule: the context that ran last
        incoming = [first] + [prompts.get(s, median) for s in then]
        lead, larger, held = sum(incoming[:-1]), max(prompts[slot], incoming[-1]), prompts[slot]
        tokens = held * (1.0 - kept_chance(lead + held, room, cap)) if in_use(slot) else 0.0
        order = {s: i for i, s in enumerate(then)}  # each runs after the waiter and those before it
        ahead = staying = 0  # the cache's entries ahead of this one: all; those that do not run
        for session in recent[1:]:
            size = prompts[session]
            if session != waiter and in_use(session):
                # in front of it at the worst: the holder's and the earlier runs' (one in the slot)
                i = order.get(session)
                front = lead + larger if i is None else held + sum(incoming[:i])
                chance = kept_chance(ahead + size, room, cap) - kept_chance(front + staying + size, room, cap)
                tokens += size * max(0.0, chance)
            ahead += size
            if session != waiter and session not in order:
                staying += size
        bound = f" and lost {_tokens(cap)}" if cap is not None else ""
        why = (f"the server was seen to keep {_tokens(room)} tokens of contexts beside its slot's{bound}: "
               f"the contexts still in use that the runs before the holder's return would push out, "
               f"each by its chance")
    return HoldCost(idle_ms, round(tokens), tokens * per_token, measured, why)


class Dead(NamedTuple):
    """A holder's dead spell, at its end: ``ms`` of it the slot was held with no request of the
    holder in flight (it said ``busy: false``, or parked, or went silent until an idle yield
    or a TTL eviction) while someone waited for the queue."""

    queue_key: str
    session: str
    role: int
    ms: float
    cost: Optional[HoldCost] = None  # issue 33's rule at the spell's end: what a hand-over would have cost


if TYPE_CHECKING:
    Event = Union[Granted, Queued, Dequeued, Released, Evicted, Moved, OverCapacity, Usage, Dead]


class _Queue:
    """One slot set: its holders in grant order, its waiters in enqueue order, and per tier a
    heap of waiters for the pick.  ``extra`` holds the rare second lease of a session already in
    ``holders``: a reload that merges two queues a session held in keeps both of its streams.
    ``spares`` counts the holders on spare streams: beyond ``max_streams``, up to
    ``parent_streams`` of them, for parents that asked for one (``acquire`` with ``spare``)."""

    __slots__ = (
        "key", "policy", "configured", "holders", "extra", "waiting", "heaps", "dead", "switches",
        "grants", "parent_grants", "child_mark", "idle", "parked", "queued", "idle_yields", "park_yields",
        "handback_yields", "evictions", "dead_ms", "dead_by_session", "spares", "parents", "resumers",
        "gaps", "named_children", "away", "thinking", "thinks", "people", "requests", "blind_ms",
    )

    def __init__(self, key: str, policy: QueuePolicy, configured: bool) -> None:
        self.key = key
        self.policy = policy
        self.configured = configured  # named by the config: never forgotten while empty
        self.holders: dict[str, Holder] = {}
        self.extra: list[Holder] = []
        self.spares = 0
        self.parents = 0  # parents holding a slot of max_streams (not a spare stream)
        self.waiting: dict[str, Waiter] = {}
        self.heaps: tuple[list[tuple[int, int, Waiter]], list[tuple[int, int, Waiter]]] = ([], [])
        self.dead = [0, 0]  # dead entries per heap, for compaction
        self.switches = 0
        self.grants = 0
        self.parent_grants = 0  # parent grants ever; a child's slot-aging counts from its mark
        self.child_mark = 0  # parent_grants at the last child grant: "in a row" restarts there
        self.idle: OrderedDict[Holder, None] = OrderedDict()  # holders idle past their window
        # holders parked (or in a handback gap: ``Holder.handback``), in parking order
        self.parked: OrderedDict[Holder, None] = OrderedDict()
        self.queued = 0  # counters for status: acquires that had to wait, idle yields, TTL evictions
        self.idle_yields = 0
        self.park_yields = 0
        self.handback_yields = 0  # slots holders between two requests handed over (``handback``)
        self.evictions = 0
        self.dead_ms = 0.0  # held with no request in flight while someone waited (closed spells)
        # the idle spent while someone waited as long as nothing is known of what the server
        # keeps (``Scheduler._blind``): the rent toward one switch whose return tells
        self.blind_ms = 0.0
        # how long its holders' requests took, latest last, per tier (a holder's busy spells):
        # what a person back from their thought waits behind one (``Scheduler._hold_cost``)
        self.requests: tuple[deque[float], deque[float]] = (deque(maxlen=REQUEST_SAMPLES),
                                                             deque(maxlen=REQUEST_SAMPLES))
        self.dead_by_session: OrderedDict[str, float] = OrderedDict()  # the same, the last 64 sessions
        # sessions whose next acquire with ``resume`` queues ahead of their tier: a child that
        # gave its slot to a parent (its context is the warmest), and the holder that gave way in
        # a probe (its return tells what a switch costs); the last 1024 of them
        self.resumers: OrderedDict[str, None] = OrderedDict()
        # its holders' last gaps (ms), each from the end of a request (a handback gap, or a park) to
        # the holder's next one: how long its tool calls take
        self.gaps: deque[float] = deque(maxlen=8)
        # a subagent asked here: from then on the tool calls are measured on the subagents, since
        # a parent's gaps may be a person's think time (where none is named, every agent is a
        # parent, and theirs are what there is)
        self.named_children = False
        # sessions that gave their slot up in a tool-call gap (a ``gap`` park) and have not queued
        # again: when, and when the gap began (their last request's end).  Their contexts are
        # still in use for a while (``in_use``); from the gap's start to the next acquire is a
        # tool call (``tool_call``)
        self.away: OrderedDict[str, tuple[float, float, bool]] = OrderedDict()
        # parents whose turn is over (a park with ``turn``) and that have not come back: since
        # when (their last request's end).  Their contexts are in use while their person thinks
        # (``think_ms``); from then to their next acquire is a think time (``thinks``)
        self.thinking: OrderedDict[str, float] = OrderedDict()
        self.thinks: deque[float] = deque(maxlen=3)
        # the parents waiting with a person behind them (not ``background``), oldest first: a
        # heap beside the parents' own, its dead entries dropped lazily as there (``person_waits``)
        self.people: list[tuple[int, int, Waiter]] = []

    def held(self) -> int:
        return len(self.holders) + len(self.extra)

    def has_room(self) -> bool:
        """A free slot of ``max_streams`` (spare streams do not count against them)."""
        limit = self.policy.max_streams
        return limit is None or self.held() - self.spares < limit

    def over_capacity(self) -> bool:
        """More slots of ``max_streams`` held than it allows (a reload lowered it, or ``"auto"``'s
        streams fell): the overrun drains as the holders give theirs up."""
        limit = self.policy.max_streams
        return limit is not None and self.held() - self.spares > limit

    def spare_room(self, leaving: bool = False) -> bool:
        """A spare stream a parent may take: one is free, and subagents hold every slot of
        ``max_streams`` (a parent waits for another parent, as the spec says).  ``leaving``: once
        the parent holding a slot of them has given it up."""
        return self.spares < self.policy.parent_streams and self.parents <= leaving

    def frees_for_waiter(self, holder: Holder) -> bool:
        """Whether ``holder``'s slot, given up, would go to a waiter: a spare stream only to the
        head parent, when it asked for one; a slot of ``max_streams`` to anyone (while the queue
        is not left over capacity by a reload)."""
        limit = self.policy.max_streams
        if limit is None:
            return True
        if holder.spare:
            w = self.head(PARENT)
            return w is not None and w.spare and self.spares <= self.policy.parent_streams and not self.parents
        return not self.over_capacity()

    def empty(self) -> bool:
        return not self.holders and not self.extra and not self.waiting

    def all_holders(self) -> list[Holder]:
        return list(self.holders.values()) + self.extra

    def holder_for(self, key: str, session: str) -> Optional[Holder]:
        """The session's lease here; of two (after a merge), the one granted for ``key``."""
        holder = self.holders.get(session)
        if holder is not None and self.extra:
            for other in self.extra:
                if other.session == session and other.key == key:
                    return other
        return holder

    def tool_call_ms(self) -> float:
        """How long the queue's tool calls take, as a session's own tool-gap window reckons them
        from the holders' recent gaps (``tool_gap_window``); the grace while none is known."""
        return 1000.0 * tool_gap_window([g / 1000.0 for g in self.gaps], GRACE_MS / 1000.0)

    def tool_call(self, ms: float, role: int) -> None:
        """A holder's gap of ``ms`` ended in its next request: a tool call's length, if no longer
        than the grace (a longer one was none).  Not a person's think time where subagents are
        named: a person that kept the slot through 2 s of thought made every context given up in
        a gap count as in use for the whole grace, and the slot was kept idle for contexts long
        done with.  Where none is named, every agent is a parent, and its gaps are what there is."""
        if ms <= GRACE_MS and (role == CHILD or not self.named_children):
            self.gaps.append(ms)

    def think_ms(self) -> float:
        """How long a person's context stays in use after their turn: 1.5x the longest of the
        queue's recent think times (its people's, one window for all) plus 0.2 s, ``THINK_DEFAULT_MS`` while none is known, at most
        ``THINK_MAX_MS``."""
        if not self.thinks:
            return float(THINK_DEFAULT_MS)
        return min(float(THINK_MAX_MS), 1.5 * max(self.thinks) + 200.0)

    def in_use(self, session: str, now: float) -> bool:
        """Whether ``session``'s context is still in use here: it holds, waits, gave way in a
        tool-call gap no longer ago than the queue's tool calls take, or ended its turn no longer
        ago than its person thinks."""
        if session in self.holders or session in self.waiting:
            return True
        away = self.away.get(session)
        if away is not None and now - away[0] <= self.tool_call_ms():
            return True
        since = self.thinking.get(session)
        return since is not None and now - since <= self.think_ms()

    def needed(self, session: str, now: float) -> bool:
        """Issue 33's rule: whether ``session``'s context will be needed again.  It holds or
        waits; or it gave its slot up between two requests and has neither come back nor said it
        is done (a release) since; or its person's turn is over and they have not come back (a
        release does not end a person's thought: their client lets the slot go after its grace).
        Either no longer ago than a lease's TTL, what a client that died may cost (a tool call's
        or a person's time is not guessed)."""
        if session in self.holders or session in self.waiting:
            return True
        ttl = self.policy.lease_ttl_ms
        away = self.away.get(session)
        since = self.thinking.get(session)
        return (away is not None and now - away[0] <= ttl) or (since is not None and now - since <= ttl)

    def in_use_until(self, session: str) -> Optional[float]:
        """When a context given up in a gap, or a person's between turns, stops being in use."""
        away = self.away.get(session)
        since = self.thinking.get(session)
        ends = [t for t in (away[0] + self.tool_call_ms() if away else None,
                            since + self.think_ms() if since is not None else None) if t is not None]
        return max(ends) if ends else None

    def turn_over(self, session: str, since: float) -> None:
        """A parent's turn ended at ``since``: its person thinks from then."""
        self.thinking.pop(session, None)
        self.thinking[session] = since
        while len(self.thinking) > 64:
            self.thinking.popitem(last=False)

    def turn_begins(self, session: str, now: float) -> None:
        """``session`` is back (it asks, or works again): a person's think time ends, if it was
        thinking, and counts (a longer one than ``THINK_MAX_MS`` was no think time)."""
        since = self.thinking.pop(session, None)
        if since is not None and now - since <= THINK_MAX_MS:
            self.thinks.append(max(0.0, now - since))

    def went_away(self, session: str, now: float, gap_began: Optional[float] = None,
                  person: bool = False) -> None:
        """``session`` gave its slot up between two requests, at ``now``, its gap having begun at
        ``gap_began``; ``person``: a parent with a person behind it, whose turn may be over."""
        self.away.pop(session, None)
        self.away[session] = (now, now if gap_began is None else min(gap_began, now), person)
        while len(self.away) > 64:
            self.away.popitem(last=False)

    def came_back(self, session: str) -> Optional[float]:
        """``session`` holds or waits again: no longer away.  When the gap it gave its slot up in
        began, if it was away."""
        away = self.away.pop(session, None)
        return away[1] if away is not None else None

    def may_resume(self, session: str) -> None:
        self.resumers.pop(session, None)
        self.resumers[session] = None
        while len(self.resumers) > 1024:
            self.resumers.popitem(last=False)

    def reset(self) -> None:
        self.holders, self.extra, self.waiting = {}, [], {}
        self.spares = self.parents = 0
        self.heaps, self.dead = ([], []), [0, 0]
        self.people = []
        self.idle = OrderedDict()
        self.parked = OrderedDict()

    def push(self, w: Waiter) -> None:
        heapq.heappush(self.heaps[w.role], (w.seq, w.version, w))
        if w.role == PARENT and not w.background:
            self.push_person(w)

    def push_person(self, w: Waiter) -> None:
        people = self.people
        heapq.heappush(people, (w.seq, w.version, w))
        if len(people) > 2 * len(self.waiting) + 64:  # mostly dead entries: keep the living
            people[:] = [e for e in people if self._person(e)]
            heapq.heapify(people)

    def _person(self, entry: tuple[int, int, Waiter]) -> bool:
        return self._current(PARENT, entry[1], entry[2]) and not entry[2].background

    def person_waits(self) -> bool:
        """Whether a parent with a person behind it (one not ``background``) waits here."""
        people = self.people
        while people and not self._person(people[0]):
            heapq.heappop(people)
        return bool(people)

    def oldest_wait(self) -> Optional[float]:
        """When the longest-waiting live waiter, of either tier, queued (None: nobody waits)."""
        heads = [w.enqueued_at for w in (self.head(PARENT), self.head(CHILD)) if w is not None]
        return min(heads) if heads else None

    def head(self, tier: int) -> Optional[Waiter]:
        """The oldest live waiter of ``tier``, dropping dead heap entries on the way."""
        heap = self.heaps[tier]
        while heap:
            _, version, w = heap[0]
            if self._current(tier, version, w):
                return w
            heapq.heappop(heap)
            self.dead[tier] -= 1
        return None

    def _current(self, tier: int, version: int, w: Waiter) -> bool:
        return w.live and w.version == version and w.role == tier and w.queue is self

    def bury(self, tier: int) -> None:
        """One heap entry of ``tier`` went dead (call after the waiter changed); compact when
        the dead outnumber the living."""
        self.dead[tier] += 1
        heap = self.heaps[tier]
        if self.dead[tier] > 64 and self.dead[tier] * 2 > len(heap):
            live = [e for e in heap if self._current(tier, e[1], e[2])]
            heapq.heapify(live)
            heap[:] = live
            self.dead[tier] = 0


class Scheduler:
    """Every queue's holders and waiters, and the decisions on them.

    The caller owns I/O and the clock: it passes ``now`` (monotonic ms) into every call and
    applies the returned events.  ``next_deadline()`` says when ``sweep`` next has work.
    ``alive(conn)`` is asked at grant time whether a waiting connection is still there.
    """

    def __init__(self, addressing: Optional[Addressing] = None,
                 alive: Optional[Callable[[Any], bool]] = None) -> None:
        self.addressing = addressing or Addressing()
        # A waiter whose connection already closed is never granted (the caller knows sockets).
        self.alive: Callable[[Any], bool] = alive or (lambda conn: True)
        self._queues: dict[str, _Queue] = {}
        # queue key -> [prefilled, reused, reports]: the running token totals (usage op), kept
        # apart from the queues, which are forgotten when empty; the oldest keys go past 4096
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()
        self._affinity: OrderedDict[str, _Affinity] = OrderedDict()  # the same, for switch costs
        # the same, for what each server said of itself: (slots, tokens a slot holds)
        self._servers: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._spells: list[Dead] = []  # dead spells ended, not yet taken (``take_dead``)
        self._forgettable: OrderedDict[str, None] = OrderedDict()  # empty, unconfigured queues
        self._seq = 0  # waiter enqueue order, scheduler-wide
        # Grant numbers, scheduler-wide: so per queue they only grow, even for a queue that was
        # forgotten and made again, or that a reload assembled from others.
        self._grant_seq = 0
        self._conn_leases: dict[Any, set[Holder]] = {}
        self._conn_waiters: dict[Any, set[Waiter]] = {}
        # the people whose turn a connection ended (``park`` with ``turn``): when it closes, nobody
        # comes back to their contexts
        self._conn_thinkers: dict[Any, set[tuple[_Queue, str]]] = {}
        self._session_waiters: dict[str, set[Waiter]] = {}
        self._held = 0  # live holders, to keep the lazy heaps compact
        self._ttl_heap: list[tuple[float, int, Holder]] = []
        self._idle_heap: list[tuple[float, int, Holder]] = []
        # when a queue whose holder kept its slot in a tool-call gap may hand it over after all
        self._gap_heap: list[tuple[float, int, _Queue]] = []
        self._idle_due: set[_Queue] = set()  # queues with idle holders that just got a waiter
        # ``holdRule: cost``: when a queue's idle holder will have spent its switch's cost.  Kept
        # to the millisecond (``next_exact``), not to the sweep's tick: on a fast server a switch
        # costs milliseconds, and a tick of a second would idle the slot for it
        self._cost_heap: list[tuple[float, int, _Queue]] = []
        self._tick = 0  # heap tie-breaker, and a version: it moves whenever a deadline may have

    # -- addressing -------------------------------------------------------------------------------

    def _queue_for(self, key: str) -> _Queue:
        owner, policy = self.addressing.address_endpoint(key)
        q = self._queues.get(owner)
        if q is None:
            q = self._queues[owner] = _Queue(owner, self._policy_for(owner, policy), self.addressing.configured(owner))
        elif self._forgettable:
            self._forgettable.pop(owner, None)
        return q

    def _find(self, key: str) -> Optional[_Queue]:
        return self._queues.get(self.addressing.address_endpoint(key)[0])

    # -- requests ---------------------------------------------------------------------------------

    def acquire(self, conn: Conn, key: str, session: str, role: str = "parent",
                group: Optional[str] = None, activity: bool = False, *, now: float,
                resume: bool = False, spare: bool = False, background: bool = False) -> list[Event]:
        """A session asks for a slot of the queue ``key`` names.  Granted at once when a slot is
        free (or the queue is passthrough); otherwise queued by tier.  A session that already
        holds is re-granted without a second slot; one already waiting is not queued twice.
        ``resume``: a session that just gave its slot up queues ahead of the others of its tier,
        where it earned that: a child that handed its slot to a parent (its context is the
        warmest), or a holder that gave way to find out what a switch costs (its return tells).
        Otherwise, and on ``fifo`` queues, it is ignored.
        ``spare``: a parent that finds every slot held by children takes one of the queue's
        spare streams (``parent_streams``) when one is free and no parent waits ahead of it, so
        it streams beside the children instead of waiting for them; children never use those.
        ``background``: a parent with no person behind it (the proxy's conversation that names
        nothing, while no person is in sight): in its tier as any parent, but where the contexts
        kept are bounded it may wait, as a child does, for a context still in use
        (``_gap_target``).  An acquire without it, for the same waiter, clears it."""
        tier = ROLES.index(role)
        q = self._queue_for(key)
        if tier == CHILD:
            q.named_children = True
        earned = session in q.resumers  # used by this acquire, or lost: earned for the next one only
        q.resumers.pop(session, None)
        began = q.came_back(session)  # back: it holds or waits from here
        q.turn_begins(session, now)  # a person's next turn: their think time ends
        if began is not None:
            # back from the tool call it gave its slot up for, from its last request's end (a
            # hand-over may come late in the gap).  Where every holder gives way at its gaps
            # nobody keeps a slot through one, and these are the only tool calls the queue sees
            # (without them a context given up in a gap counted as in use for the whole grace,
            # and a holder at its run's end kept the slot idle for it)
            q.tool_call(now - began, tier)
        holder = q.holder_for(key, session)
        if holder is not None:
            self._attach(holder, conn)
            self._refresh(holder, now, activity=True)
            holder.background = holder.background and background  # a person is behind it now
            holder.asks_spare = spare
            return [Granted(q.key, holder, ((conn, key),), new=False)]
        w = q.waiting.get(session)
        if w is not None:
            if (conn, key) not in w.targets:
                w.targets[(conn, key)] = None
                self._conn_waiters.setdefault(conn, set()).add(w)
            cleared: list[Event] = []
            if w.background and not background:  # a person is behind it now
                w.background = False
                w.json = _who_json(w.session, w.role, w.group)
                if w.role == PARENT:
                    q.push_person(w)
                    self._refill(q, now, cleared)  # a holder kept for a context in use may yield to it now
            return cleared
        room = q.has_room()
        if room or spare and tier == PARENT and q.spare_room() and q.head(PARENT) is None:
            holder = self._grant(q, session, tier, group, activity, key, now, spare=not room,
                                 background=background, asks_spare=spare)
            self._attach(holder, conn)
            return [Granted(q.key, holder, ((conn, key),))]
        self._seq += 1
        seq = self._seq
        if resume and earned and q.policy.policy != "fifo":
            seq -= RESUME_AHEAD  # ahead of its tier queued the usual way, FIFO among resumers
        w = Waiter(q, session, tier, group, activity, seq, key, now, spare, background)
        w.targets[(conn, key)] = None
        q.queued += 1
        self._enqueue(q, w)
        events: list[Event] = [Queued(q.key, w)]
        self._refill(q, now, events)  # a parked holder needs no slot while it waits: it goes now
        return events

    def release(self, key: str, session: str, *, now: float, reason: str = "release") -> list[Event]:
        """The session's slot returns to its queue.  One that holds none changes nothing, except
        that a session that gave its slot up between two requests is done with its context now
        (``_done_with``)."""
        q = self._find(key)
        holder = q.holder_for(key, session) if q else None
        if q is None:
            return []
        if holder is None:
            return self._done_with(q, session, now)
        events: list[Event] = []
        if reason == "release" and holder.role == CHILD and q.frees_for_waiter(holder):
            nxt = self._pick(q, now)
            if nxt is not None and nxt.role == PARENT:  # a hand-back at a request boundary
                q.may_resume(session)  # next after the parent, ahead of the other children
        self._drop_lease(holder, Released(q.key, holder, reason), events, now)
        self._refill(q, now, events)
        self._settle(q)
        return events

    def cancel(self, key: str, session: str, *, now: float) -> list[Event]:
        """Esc: drop the session's queued request and release a slot it already holds."""
        q = self._find(key)
        if q is None:
            return []
        events: list[Event] = []
        w = q.waiting.get(session)
        if w is not None:
            self._drop_waiter(w)
            events.append(Dequeued(q.key, w, "cancel"))
            self._heads_changed(q, now, events)
            self._settle(q)
        return events + self.release(key, session, now=now, reason="cancel")

    def _heads_changed(self, q: _Queue, now: float, events: list[Event]) -> None:
        """A waiter left or changed tier: the parent heading the queue may be another one now,
        one that can take a free spare stream, or one a parked or idle spare holder yields to."""
        self._refill(q, now, events)
        if q.idle and q.waiting:
            self._idle_due.add(q)

    def set_role(self, session: str, role: str, *, now: float) -> list[Event]:
        """Re-tier the session's live waiters in place (their enqueue order is kept); one made a
        child ages by slots from here (the parents granted before did not pass it as a child, so
        it does not go before a person as aged).  A holder keeps the tier it was granted with.
        No slot is freed, but a parent that asked for a spare stream may now head the parents and
        take one."""
        tier = ROLES.index(role)
        events: list[Event] = []
        for w in list(self._session_waiters.get(session, ())):
            if w.role != tier:
                head = w.queue.head(CHILD)
                old, w.role = w.role, tier
                w.json = _who_json(w.session, tier, w.group, background=w.background and tier == PARENT)
                w.version += 1
                w.queue.bury(old)
                w.queue.push(w)
                if tier == CHILD:
                    # The parents granted while it waited as one did not pass a child: its slot
                    # aging starts now, unless it heads the children now, ahead of one that has
                    # aged so far (that one's count goes on, the tier's head's)
                    ahead = head is not None and w.queue.head(CHILD) is w
                    w.parent_mark = head.parent_mark if head is not None and ahead else w.queue.parent_grants
                self._heads_changed(w.queue, now, events)
        return events

    def renew(self, conn: Conn, *, now: float) -> int:
        """A bare heartbeat: refresh the TTL of every lease the connection holds; their count."""
        leases = self._conn_leases.get(conn, ())
        for holder in leases:
            self._refresh(holder, now, activity=False)
        return len(leases)

    def usage(self, key: str, session: str, prefilled: int, reused: int, whole: bool = True,
              prefill_ms: Optional[float] = None, *, slots: Optional[int] = None,
              slot_context: Optional[int] = None, decoded: int = 0, decode_ms: Optional[float] = None,
              now: Optional[float] = None) -> Usage:
        """A request's token counts (the additive ``usage`` op): added to the queue's running
        totals (``status``), and logged tied to the grant the session holds there, if any.
        ``whole``: both counts were given, so together they are the whole prompt.  ``prefill_ms``:
        how long the server took to prefill ``prefilled`` (its own timing): its prefill rate.
        ``slots`` and ``slot_context``: how many requests the server runs at once and the tokens
        one may hold (llama.cpp's ``/props``), for ``maxStreams: "auto"``; a report that changes
        the queue's streams says so (``Usage.streams``): ``refill`` then grants its waiters.
        ``decoded`` and ``decode_ms``: the tokens the server generated and how long it took,
        logged with the mean of the queue's requests in flight at once beside it (up to ``now``)."""
        resolved = self.addressing.address_endpoint(key)[0]
        q = self._queues.get(resolved)
        holder = q.holder_for(key, session) if q else None
        totals = self._tokens.pop(resolved, None) or [0, 0, 0]
        totals[0] += prefilled
        totals[1] += reused
        totals[2] += 1
        self._tokens[resolved] = totals
        while len(self._tokens) > 4096:
            self._tokens.popitem(last=False)
        affinity = self._affinity_of(resolved)
        # on a queue of more than one stream, the sessions in between need not have used this
        # session's slot: an eviction there tells no bound, and counts as after one other
        policy = q.policy if q else self.addressing.address_endpoint(key)[1]
        one_slot = policy.max_streams == 1 and not (q and q.spares)
        kept, depth = affinity.report(session, prefilled, reused, one_slot, whole)
        affinity.timed(prefilled, prefill_ms)
        at_once: Optional[float] = None  # of its request in flight, else of the one that ended last
        if holder is not None and q is not None:
            if holder.busy_since is not None and now is not None:
                self._flight(q, now)
            at_once = holder.running_at_once() if holder.busy_since is not None else holder.at_once
        if slots is not None and slot_context is not None:
            self._servers.pop(resolved, None)
            self._servers[resolved] = (slots, slot_context)
            while len(self._servers) > 4096:
                self._servers.popitem(last=False)
        streams = None
        if q is not None and q.policy.streams_auto:
            streams = self._auto_streams(resolved)
            if streams == q.policy.max_streams:
                streams = None
            else:
                q.policy = q.policy._replace(max_streams=streams)
        setting = policy.switch_cost
        return Usage(resolved, session, prefilled, reused, holder.seq if holder else None, kept,
                     affinity.cost(setting), depth if kept is not None else None, prefill_ms, streams,
                     decode_ms if decoded else None, decoded, at_once)

    def _auto_streams(self, key: str) -> int:
        """``maxStreams: "auto"``: how many requests queue ``key``'s server runs at once, every
        one with room for its context: its slots, and no more than the contexts of the largest
        size seen (grown by the most one grew in a request) that one slot's tokens hold.  On
        llama-server's unified KV (its default with several slots) one slot may take all of
        it, so this is how many running contexts fit; where each slot has its own share, it
        errs on one stream.  One while the server's figures or the contexts' sizes are unknown.
        It does not see the host cache, where llama-server keeps the contexts waiting through a
        tool call: where that is short, they are prefilled again (bench/RESULTS.md).  Two rules
        that also priced side by side by the server's decode times lost (bench/RESULTS.md)."""
        server = self._servers.get(key)
        affinity = self._affinity.get(key)
        if server is None or affinity is None or not affinity.prompts:
            return 1
        slots, tokens = server
        need = max(affinity.prompts.values()) + affinity.growth
        return max(1, min(slots, tokens // max(1, need)))

    def _auto_figures(self, key: str) -> dict[str, Any]:
        """What ``_auto_streams`` went by, for ``status``: the server's slots and tokens per slot
        (once a usage report said), and the largest context seen with its growth (once sized)."""
        figures: dict[str, Any] = {}
        server = self._servers.get(key)
        if server is not None:
            figures["slots"], figures["slotContext"] = server
        affinity = self._affinity.get(key)
        if affinity is not None and affinity.prompts:
            figures["context"] = max(affinity.prompts.values()) + affinity.growth
        return figures

    def _policy_for(self, key: str, policy: QueuePolicy) -> QueuePolicy:
        """``policy`` as queue ``key`` runs it: with ``maxStreams: "auto"``, its streams now."""
        if policy.streams_auto:
            return policy._replace(max_streams=self._auto_streams(key))
        return policy

    def refill(self, key: str, *, now: float) -> list[Event]:
        """Grant queue ``key``'s waiters into the streams it has free (after ``usage`` raised
        ``maxStreams: "auto"``)."""
        q = self._find(key)
        events: list[Event] = []
        if q is not None:
            self._refill(q, now, events)
            self._settle(q)
        return events

    def _affinity_of(self, key: str) -> _Affinity:
        """The switch record of queue ``key``, made if new, as the most recently used."""
        affinity = self._affinity.pop(key, None) or _Affinity()
        self._affinity[key] = affinity
        while len(self._affinity) > 4096:
            self._affinity.popitem(last=False)
        return affinity

    def affinity_kept(self) -> dict[str, list[float]]:
        """Each queue's latest returns (the share of its context each found kept): what a
        switch costs there, learned, to carry into a later daemon (``seed_affinity``)."""
        return {key: a.saved() for key, a in self._affinity.items() if a.kept}

    def affinity_depths(self) -> dict[str, tuple[list[int], Optional[int]]]:
        """The depths of ``affinity_kept()``'s returns, per queue, and the contexts learned there."""
        return {key: a.saved_depths() for key, a in self._affinity.items() if a.kept}

    def affinity_rooms(self) -> Rooms:
        """The tokens the server keeps, per queue of ``affinity_kept()``: at least, and fewer than."""
        return {key: (a.room, a.room_cap) for key, a in self._affinity.items() if a.kept}

    def seed_affinity(self, kept: dict[str, list[float]],
                      depths: Optional[dict[str, tuple[list[int], Optional[int]]]] = None,
                      rooms: Optional[Rooms] = None) -> None:
        """What an earlier daemon learned (``affinity_kept``, ``affinity_depths`` and
        ``affinity_rooms``): each queue's returns, older than any of its own, so a switch cost is
        known before anyone comes back.  A return of unknown depth counts at depth 1 (an eviction
        there: a dear switch)."""
        for key, shares in kept.items():
            affinity = self._affinity.pop(key, None) or _Affinity()
            if affinity.room is None and affinity.room_cap is None:  # its own returns are later: they win
                affinity.room, affinity.room_cap = (rooms or {}).get(key, (None, None))
            own, own_back, own_depths = list(affinity.kept), list(affinity.back), list(affinity.depths)
            seeded = list(shares)[-KEPT_SAMPLES:]
            known, contexts = (depths or {}).get(key, ([], None))
            deep = list(known)[len(known) - len(seeded):] if len(known) >= len(seeded) else [1] * len(seeded)
            affinity.kept.clear()
            affinity.kept.extend(seeded + own)  # the latest KEPT_SAMPLES stay
            affinity.back.clear()  # who came back then is not known: one session each
            affinity.back.extend([f"\x00earlier-{i}" for i in range(len(seeded))] + own_back)
            affinity.depths.clear()
            affinity.depths.extend(deep + own_depths)
            if affinity.contexts is None:  # its own returns are later: they win
                affinity.contexts = learned_contexts(seeded, deep, contexts)
                affinity.floor = contexts_floor(seeded, deep, affinity.contexts, affinity.floor)
            self._affinity[key] = affinity
        while len(self._affinity) > 4096:
            self._affinity.popitem(last=False)

    def parent_waits(self, key: str, session: str) -> bool:
        """Whether the session holds a child's slot there while a parent waits: a hint, in its
        beat replies, to hand the slot back at its next request boundary (cooperative: the
        daemon never takes a live holder's slot).  Only for a parent with a person behind it: a
        ``background`` one gets the slot at the child's gaps, as the contexts kept allow."""
        q = self._find(key)
        holder = q.holder_for(key, session) if q else None
        return holder is not None and holder.role == CHILD and q is not None and q.person_waits()

    def beat(self, key: str, session: str, *, now: float, busy: Optional[bool] = None) -> bool:
        """A keyed activity beat: refresh that lease's TTL and activity.  False means the session
        holds no slot there (released, yielded, evicted): the client must re-queue.  ``busy``
        (additive): whether a request of the holder is in flight; False starts an idle spell,
        the time of which someone waits is dead time (``status``, the log's ``dead`` events)."""
        q = self._find(key)
        holder = q.holder_for(key, session) if q else None
        if holder is None:
            return False
        self._refresh(holder, now, activity=True)
        if busy is True:
            self._busy(holder, now)
        elif busy is False:
            self._idle(holder, now)
            owner = holder.queue
            if owner.waiting:  # the sweep weighs its slot now
                self._weigh_at(owner, now)
        return True

    def park(self, key: str, session: str, *, now: float, gap: bool = False,
             turn: bool = False, conn: Optional[Conn] = None) -> tuple[bool, list[Event]]:
        """A keyed beat that says the holder waits on another agent (``parked``): its TTL is
        refreshed, and its slot goes to a waiter at once -- one queued now, or the first to come
        while it stays parked.  A parked holder nobody needs keeps its slot (no switch); its next
        activity beat un-parks it.  ``gap`` (additive): it parked between two requests of its run,
        for a tool call, and comes back; where the queue learned that the server keeps only so many
        contexts, its slot goes only to a waiter whose run evicts none still in use
        (``_gap_target``).  ``turn`` (additive, a person's parent's: a subagent's, or a
        ``background`` parent's, is a plain park): its turn is over and a person answers next; its
        context is in use while the person thinks (``_Queue.think_ms``), so its slot goes, as a
        gap's does, only to a waiter whose run evicts no context in use, and the subagents' gaps
        keep theirs from a waiter whose run would evict it.  A ``turn`` park of a session that holds
        no slot, since it gave it up at its last request's end (a handback to a parent), held as a
        person's parent, says the same: its person thinks from that request's end (``conn``: whose
        closing takes the think time with it).  Returns (still held, events)."""
        q = self._find(key)
        holder = q.holder_for(key, session) if q else None
        if q is None:
            return False, []
        if holder is None:  # a park for good of one that handed its slot over: its run is over
            if turn and not gap:
                self._thinks_away(q, session, now, conn)
                return False, []
            return False, [] if gap else self._done_with(q, session, now)
        self._refresh(holder, now, activity=False)
        holder.parked = True
        holder.gap = gap
        holder.turn = turn and not gap and holder.persons
        holder.handback = False
        if holder.turn:
            q.turn_over(session, holder.idle_since if holder.idle_since is not None else now)
            for c in holder.conns:
                self._thinker_on(c, q, session)
        else:  # parked again for another reason (waiting on its subagents, a tool call): no person's
            q.thinking.pop(session, None)
        return self._step_aside(q, holder, now)

    def _thinker_on(self, conn: Conn, q: _Queue, session: str) -> None:
        """``session``'s person thinks, and ``conn`` closing takes that with it."""
        people = self._conn_thinkers.setdefault(conn, set())
        people.add((q, session))
        if len(people) > 64:  # those back or forgotten are nobody's to clear
            people.difference_update([e for e in people if e[1] not in e[0].thinking])

    def _thinks_away(self, q: _Queue, session: str, now: float, conn: Optional[Conn]) -> None:
        """A person's turn is over, but its session gave its slot up at its last request's end (a
        handback to a parent), so its context counted as in use only for as long as a tool call
        takes: it counts so while the person thinks, from that request's end, as a held parent's
        turn park does.  From then to its next acquire is a think time, not a tool call.  A session
        not away (it never held, or its run was over for good), no person's parent when it held (a
        subagent, or a parent with no person behind it: a turn is a person's), or already
        thinking: nothing.  The person may think for less than a tool call takes: the sweep looks
        again then, for a waiter kept out."""
        away = q.away.get(session)
        if away is None or not away[2] or session in q.thinking:
            return
        q.came_back(session)
        q.turn_over(session, away[1])
        if conn is not None:
            self._thinker_on(conn, q, session)
        if q.waiting:
            self._recheck_gap(q, now)

    def _done_with(self, q: _Queue, session: str, now: float) -> list[Event]:
        """``session`` holds no slot and says its run is over (it releases, or parks for good):
        if it gave its slot up between two requests (``_Queue.away``: a handback to a parent at
        its last request's end, say), its context is done with from now, not in use for as long
        as tool calls take, and a waiter kept out for it may go."""
        if session not in q.away or session in q.waiting:
            return []
        q.came_back(session)
        events: list[Event] = []
        if q.waiting:  # a switch may be free now
            self._refill(q, now, events)
            self._settle(q)
        return events

    def _step_aside(self, q: _Queue, holder: Holder, now: float) -> tuple[bool, list[Event]]:
        """A holder that parked, or began a handback gap: its idle spell starts, and it hands its
        slot over now if a waiter may have it (``_refill``).  Returns (still held, events)."""
        q.parked[holder] = None
        self._idle(holder, now)
        events: list[Event] = []
        self._refill(q, now, events)
        return holder.held, events

    def handback(self, key: str, session: str, *, now: float) -> tuple[bool, list[Event]]:
        """A keyed activity beat that says the holder is between two requests of its run (the
        ``handback`` field of ``renew``): no request of it is in flight, and its slot goes at once
        to a parent the queue would grant next -- one queued now, or the first to come while the
        gap lasts -- but to a child only while the queue does not know what a switch costs, to
        find it out (``_refill``); otherwise the holder's own window decides that, by parking.
        Its next activity beat without the field ends the gap.  A parked holder stays parked.
        Returns (still held, events)."""
        q = self._find(key)
        holder = q.holder_for(key, session) if q else None
        if q is None or holder is None:
            return False, []
        if holder.parked:  # it yields to anyone already
            self._refresh(holder, now, activity=False)
            return True, []
        if holder.handback:  # the gap goes on: an activity beat that keeps it (and its idle spell)
            holder.handback = False
            self._refresh(holder, now, activity=True)
            holder.handback = True
            return True, []
        self._refresh(holder, now, activity=True)
        holder.handback = True
        return self._step_aside(q, holder, now)

    def disconnect(self, conn: Conn, *, now: float, reason: str = "disconnect") -> list[Event]:
        """The connection is gone: drop what it queued, then release what it held."""
        events: list[Event] = []
        touched: list[_Queue] = []
        for w in self._conn_waiters.pop(conn, ()):
            for target in [t for t in w.targets if t[0] == conn]:
                del w.targets[target]
            if not w.targets and w.live:
                self._drop_waiter(w)
                events.append(Dequeued(w.queue.key, w, "disconnect"))
                touched.append(w.queue)
        for q, session in self._conn_thinkers.pop(conn, ()):  # its people are gone with it
            q.thinking.pop(session, None)
        for holder in self._conn_leases.pop(conn, ()):
            holder.conns.discard(conn)
            if not holder.conns and holder.held:
                touched.append(holder.queue)
                self._drop_lease(holder, Released(holder.queue.key, holder, reason), events, now)
        for q in touched:
            self._heads_changed(q, now, events)
        for q in touched:
            self._settle(q)
        return events

    # -- the sweep --------------------------------------------------------------------------------

    @property
    def deadline_version(self) -> tuple[int, int, int]:
        """Changes whenever ``next_deadline`` may have: the caller re-asks only then."""
        return (self._tick, len(self._idle_due),
                len(self._ttl_heap) + len(self._idle_heap) + len(self._gap_heap) + len(self._cost_heap))

    def next_deadline(self) -> Optional[float]:
        """The earliest ``now`` at which ``sweep`` may have work, or None when it has none."""
        if self._idle_due:
            return float("-inf")
        times = [h[0][0] for h in (self._ttl_heap, self._idle_heap, self._gap_heap, self._cost_heap) if h]
        return min(times) if times else None

    def next_exact(self) -> Optional[float]:
        """The earliest deadline that must be kept to the millisecond, not to the next sweep
        tick: a hand-over's (``holdRule: cost``), or a look again at a slot kept for a context in
        use (``_recheck_gap``).  A tick is the spec's grain for reclaiming dead clients; a slot
        someone waits for must not idle to the next one.  None when there is none."""
        times = [h[0][0] for h in (self._cost_heap, self._gap_heap) if h]
        return min(times) if times else None

    def _weigh_at(self, q: _Queue, when: float) -> None:
        """``holdRule: cost``: look at ``q``'s idle holders again at ``when`` (``_cost_refill``)."""
        self._look_at(self._cost_heap, q, when)

    def _look_at(self, heap: list[tuple[float, int, _Queue]], q: _Queue, when: float) -> None:
        """Push a look again at ``q`` at ``when`` onto ``heap`` (its stale entries dropped lazily).
        One entry per queue is enough, its earliest: each look sets the next one (a person's
        think time may end long after a tool call's, so the latest could skip the nearer); past
        twice the queues, the heap is compacted to that."""
        self._tick += 1
        heapq.heappush(heap, (when, self._tick, q))
        if len(heap) > 2 * len(self._queues) + 64:
            earliest: dict[int, tuple[float, int, _Queue]] = {}
            for entry in heap:
                earliest[id(entry[2])] = min(earliest.get(id(entry[2]), entry), entry)
            heap[:] = list(earliest.values())
            heapq.heapify(heap)

    def sweep(self, *, now: float) -> list[Event]:
        """Two passes.  TTL eviction, unconditional: a lapsed lease is a dead client.  Idle
        yield, gated: an activity-flagged holder silent past its window loses the slot, but only
        to a waiter.  Cost follows what is due, not how many leases exist.  And a queue whose
        holder kept its slot in a tool-call gap for a context in use looks again once that
        context is done with (``_recheck_gap``)."""
        events: list[Event] = []
        touched: list[_Queue] = []
        heap = self._ttl_heap
        while heap and heap[0][0] <= now:
            _, _, holder = heapq.heappop(heap)
            if not holder.held:
                continue
            if holder.expires_at > now:  # refreshed since: look again when it is due
                self._push(heap, holder.expires_at, holder)
                continue
            q = holder.queue
            q.evictions += 1
            # a frozen or dead client: nothing of it was in flight since its last heartbeat
            holder.idle_since = min(holder.idle_since or holder.last_beat, holder.last_beat)
            self._drop_lease(holder, Evicted(q.key, holder), events, now)
            self._refill(q, now, events)
            touched.append(q)
        heap = self._idle_heap
        while heap and heap[0][0] <= now:
            _, _, holder = heapq.heappop(heap)
            idle_at = holder.idle_at
            if not holder.held or idle_at is None or holder in holder.queue.idle:
                continue
            if idle_at > now:
                self._push(heap, idle_at, holder)
                continue
            holder.queue.idle[holder] = None
            self._idle_due.add(holder.queue)
        gaps = self._gap_heap
        while gaps and gaps[0][0] <= now:
            _, _, q = heapq.heappop(gaps)
            if q.waiting and q.parked and self._queues.get(q.key) is q:
                self._refill(q, now, events)  # a context it was kept for may be done with now
                touched.append(q)
        weigh = self._cost_heap
        due: list[_Queue] = []
        while weigh and weigh[0][0] <= now:  # taken first: what the refills push waits for a later sweep
            _, _, q = heapq.heappop(weigh)
            if q not in due:
                due.append(q)
        for q in due:
            if q.waiting and self._queues.get(q.key) is q:
                self._refill(q, now, events)  # an idle holder may have spent its switch's cost
                touched.append(q)
        for q in sorted(self._idle_due, key=lambda q: q.key):
            while q.waiting and q.idle:
                # a spare stream's idle holder yields only to a parent that can take the stream
                idler = next((h for h in q.idle if not h.spare or q.frees_for_waiter(h)), None)
                if idler is None:
                    break
                q.idle_yields += 1
                idler.idle_since = min(idler.idle_since or idler.last_activity, idler.last_activity)
                self._drop_lease(idler, Released(q.key, idler, "idle"), events, now)
                self._refill(q, now, events)  # and a parked holder that can hand over now does
            touched.append(q)
        self._idle_due.clear()
        for q in touched:
            self._settle(q)
        return events

    # -- reload -----------------------------------------------------------------------------------

    def reconfigure(self, addressing: Addressing, *, now: float) -> list[Event]:
        """Apply a reloaded config: re-address every holder and every waiting request through
        the new groups, so they move with their queue, re-apply policy, grant into widened
        queues, and report every queue left over capacity.  No holder loses its slot, and each
        asker of a waiting request stays queued where its own key now leads."""
        self.addressing = addressing
        old = self._queues
        holders = sorted((h for q in old.values() for h in q.all_holders()), key=lambda h: (h.granted_at, h.seq))
        waiters = sorted((w for q in old.values() for w in q.waiting.values()), key=lambda w: w.seq)
        self._queues = {}
        self._forgettable.clear()
        for q in old.values():  # a queue that keeps its key keeps its counters
            owner, policy = addressing.address_endpoint(q.key)
            if owner == q.key:
                q.policy = self._policy_for(owner, policy)
                q.configured = addressing.configured(owner)
                q.reset()
                self._queues[q.key] = q
        self._idle_due.clear()
        events: list[Event] = []
        for h in holders:
            q = self._queue_for(h.key)
            if h.queue.key != q.key:
                events.append(Moved(q.key, h.queue.key, h))
            h.queue = q
            h.terms = h.terms.grown(q.policy.lease_ttl_ms)  # a longer TTL applies at once
            if h.session in q.holders:
                q.extra.append(h)  # the same session held in two queues that merged: both stay
            else:
                q.holders[h.session] = h
            if h.spare:
                q.spares += 1
            elif h.role == PARENT:
                q.parents += 1
            if h.parked or h.handback:
                q.parked[h] = None
            if h.idle_at is not None:
                self._push(self._idle_heap, h.idle_at, h)
        for w in waiters:
            self._unlink_waiter(w)
            source = w.queue.key
            groups: dict[_Queue, list[Target]] = {}
            for target in w.targets:
                groups.setdefault(self._queue_for(target[1]), []).append(target)
            for i, (q, targets) in enumerate(groups.items()):
                mine = w if i == 0 else Waiter(q, w.session, w.role, w.group, w.activity, w.seq, targets[0][1],
                                               w.enqueued_at, w.spare, w.background)
                mine.targets = dict.fromkeys(targets)
                mine.key = targets[0][1]
                holding = q.holders.get(w.session)
                waiting = q.waiting.get(w.session)
                if holding is not None:  # it waits where it now holds: answer it, switch-free
                    mine.live = False
                    for conn, _ in targets:
                        self._attach(holding, conn)
                    events.append(Dequeued(source, mine, "merged"))  # logged where it waited
                    events.append(Granted(q.key, holding, tuple(targets), new=False))
                elif waiting is not None:  # it already waits there: one request, every asker
                    mine.live = False
                    for target in targets:
                        waiting.targets.setdefault(target, None)
                        self._conn_waiters.setdefault(target[0], set()).add(waiting)
                    events.append(Dequeued(source, mine, "merged"))
                else:
                    if q.key != source:
                        events.append(Moved(q.key, source, mine))
                    if mine.queue is not q:
                        mine.parent_mark = q.parent_grants  # slot aging restarts in a new queue
                    mine.queue = q
                    mine.version += 1
                    q.waiting[w.session] = mine
                    q.push(mine)
                    self._link_waiter(mine)
        for q in list(self._queues.values()):
            self._refill(q, now, events)
            limit = q.policy.max_streams
            if limit is not None and (q.over_capacity() or q.spares > q.policy.parent_streams):
                events.append(OverCapacity(q.key, q.held(), limit))
            self._settle(q)
        self._compact()
        return events

    # -- reading ----------------------------------------------------------------------------------

    def status(self, now: Optional[float] = None) -> list[dict[str, Any]]:
        """Every queue as ``status`` reports it: holders in grant order, waiters in enqueue order,
        and (additive) counters: grants, queued, idle yields, TTL evictions, and -- given ``now``
        -- the current longest wait per tier in ms."""
        queues: list[dict[str, Any]] = json.loads(self.status_json(now))
        return queues

    def status_json(self, now: Optional[float] = None) -> str:
        """``status`` as the JSON array the daemon sends: joined from each holder's and waiter's
        own encoded entry, so a reply at a depth of thousands costs little more than the copy."""
        parts = []
        for q in self._queues.values():
            head: dict[str, Any] = {
                "queueKey": q.key,
                "maxStreams": q.policy.max_streams,
                "parentStreams": q.policy.parent_streams,  # additive: parents' spare streams
                "switches": q.switches,
                "grants": q.grants,
                "queued": q.queued,
                "idleYields": q.idle_yields,
                "parkYields": q.park_yields,
                "handbackYields": q.handback_yields,  # additive: holders between requests, to a parent
                "ttlEvictions": q.evictions,
                "deadMs": round(q.dead_ms),
            }
            if q.dead_by_session:  # additive: which sessions held it so
                head["deadMsBySession"] = {s: round(ms) for s, ms in q.dead_by_session.items()}
            if q.policy.streams_auto:  # additive: ``maxStreams`` is "auto", and what it went by
                head["streamsAuto"] = self._auto_figures(q.key)
            tokens = self._tokens.get(q.key)
            if tokens is not None:  # additive: only once a usage op reported for the queue
                head["tokens"] = {"prefilled": tokens[0], "reused": tokens[1], "requests": tokens[2]}
            affinity = self._affinity.get(q.key)
            if affinity is not None or q.policy.switch_cost != "auto":  # additive, likewise
                kept = list(affinity.kept) if affinity else []
                cost = affinity.cost(q.policy.switch_cost) if affinity else switch_cost([], q.policy.switch_cost)
                head["affinity"] = {"switchCost": cost,
                                    "returns": affinity.returns if affinity else 0,
                                    "kept": round(sum(kept) / len(kept), 3) if kept else None}
                if affinity is not None and affinity.contexts is not None:  # additive: once one was evicted
                    head["affinity"]["contexts"] = affinity.contexts
                    if affinity.unsettled() is not None:  # additive: the bound is open down to it
                        head["affinity"]["contextsAtLeast"] = affinity.floor
            if now is not None:
                oldest = [q.head(tier) for tier in (PARENT, CHILD)]
                head["longestWaitMs"] = {
                    ROLES[tier]: (round(now - w.enqueued_at) if w is not None else 0)
                    for tier, w in enumerate(oldest)
                }
                holds = self.holds(q, now)
                if holds:  # additive: each idle slot someone waits for, and issue 33's rule for it
                    head["holds"] = [dict(sessionKey=h.session, explain=cost.explain(), **cost.fields())
                                     for h, cost in holds]
            holders = ",".join([h.json for h in q.holders.values()] + [h.json for h in q.extra])
            waiting = ",".join([w.json for w in q.waiting.values()])
            parts.append(f'{json.dumps(head, separators=(",", ":"))[:-1]},'
                         f'"holders":[{holders}],"waiting":[{waiting}]}}')
        return "[" + ",".join(parts) + "]"

    def holders(self, key: str) -> list[Holder]:
        q = self._find(key)
        return q.all_holders() if q else []

    def waiters(self, key: str) -> list[Waiter]:
        q = self._find(key)
        return list(q.waiting.values()) if q else []

    def queue_keys(self) -> list[str]:
        return list(self._queues)

    # -- internals --------------------------------------------------------------------------------

    def _push(self, heap: list[tuple[float, int, Holder]], when: float, holder: Holder) -> None:
        self._tick += 1
        heapq.heappush(heap, (when, self._tick, holder))
        if len(heap) > 2 * self._held + 64:
            self._compact()

    def _compact(self) -> None:
        """Rebuild both lazy heaps from the live holders: stale entries (released holders,
        refreshed deadlines, duplicates) never outnumber the living for long."""
        holders = [h for q in self._queues.values() for h in q.all_holders()]
        self._held = len(holders)
        # In place: a sweep in progress holds these very lists.
        self._ttl_heap[:] = [(h.expires_at, i, h) for i, h in enumerate(holders)]
        self._idle_heap[:] = [(h.idle_at, i, h) for i, h in enumerate(holders)
                              if h.idle_at is not None and h not in h.queue.idle]
        heapq.heapify(self._ttl_heap)
        heapq.heapify(self._idle_heap)

    def _grant(self, q: _Queue, session: str, tier: int, group: Optional[str], activity: bool,
               key: str, now: float, spare: bool = False, background: bool = False,
               asks_spare: bool = False) -> Holder:
        self._grant_seq += 1
        q.grants += 1
        if tier == CHILD:
            q.child_mark = q.parent_grants
        elif not spare:  # a spare stream took no child's slot: it does not age the children
            q.parent_grants += 1
        holder = Holder(q, session, tier, group, activity, LeaseTerms.of(q.policy), self._grant_seq, key, now,
                        spare, background, asks_spare)
        if spare:
            q.spares += 1
        elif tier == PARENT:
            q.parents += 1
        self._flight(q, now)  # before it joins the requests in flight
        q.holders[session] = holder
        self._held += 1
        self._push(self._ttl_heap, holder.expires_at, holder)
        idle_at = holder.idle_at
        if idle_at is not None:
            self._push(self._idle_heap, idle_at, holder)
        return holder

    def _attach(self, holder: Holder, conn: Conn) -> None:
        holder.conns.add(conn)
        self._conn_leases.setdefault(conn, set()).add(holder)

    def _refresh(self, holder: Holder, now: float, *, activity: bool) -> None:
        holder.terms = holder.terms.grown(holder.queue.policy.lease_ttl_ms)
        holder.last_beat = now
        if activity:
            holder.last_activity = now
            q = holder.queue
            if holder.parked or holder.handback:  # work resumed
                if holder.turn:  # a person's next turn, on the slot it kept: no tool call
                    q.turn_begins(holder.session, now)
                elif holder.idle_since is not None:  # a gap's that ended in a park too
                    q.tool_call(now - holder.idle_since, holder.role)
                holder.parked = holder.handback = holder.gap = holder.turn = False
                q.parked.pop(holder, None)
                self._busy(holder, now)
            if holder in q.idle:  # it spoke: no longer yieldable until its window passes again
                del q.idle[holder]
                idle_at = holder.idle_at
                if idle_at is not None:
                    self._push(self._idle_heap, idle_at, holder)

    def _enqueue(self, q: _Queue, w: Waiter) -> None:
        q.waiting[w.session] = w
        q.push(w)
        self._link_waiter(w)
        if q.idle:
            self._idle_due.add(q)

    def _link_waiter(self, w: Waiter) -> None:
        self._session_waiters.setdefault(w.session, set()).add(w)
        for conn, _ in w.targets:
            self._conn_waiters.setdefault(conn, set()).add(w)

    def _unlink_waiter(self, w: Waiter) -> None:
        peers = self._session_waiters.get(w.session)
        if peers is not None:
            peers.discard(w)
            if not peers:
                del self._session_waiters[w.session]
        for conn, _ in w.targets:
            mine = self._conn_waiters.get(conn)
            if mine is not None:
                mine.discard(w)
                if not mine:
                    del self._conn_waiters[conn]

    def _drop_waiter(self, w: Waiter) -> None:
        w.live = False
        q = w.queue
        if q.waiting.get(w.session) is w:
            del q.waiting[w.session]
            q.bury(w.role)
        self._unlink_waiter(w)

    def _idle(self, holder: Holder, now: float) -> None:
        """The holder has no request in flight from ``now`` (it said so, or it parked)."""
        if holder.idle_since is None:
            holder.idle_since = now
        if holder.busy_since is not None:
            holder.queue.requests[holder.role].append(now - holder.busy_since)
            self._flight(holder.queue, now)
            holder.at_once = holder.running_at_once()
            holder.busy_since = None

    @staticmethod
    def _flight(q: _Queue, now: float) -> None:
        """Before the queue's requests in flight change at ``now``: each of them ran beside the
        others since its ``mark``."""
        if len(q.holders) <= 1 and not q.extra:  # alone: nothing shared (the common case)
            for h in q.holders.values():
                h.mark = now
            return
        flying = [h for h in q.all_holders() if h.busy_since is not None]
        for h in flying:
            h.shared_ms += (now - h.mark) * (len(flying) - 1)
            h.mark = now

    def _busy(self, holder: Holder, now: float) -> None:
        """The holder's idle spell ends at ``now``: the part of it during which someone waited
        for the queue (since the oldest waiter now queued came) is dead time, its and the
        queue's.  A waiter that came and went inside the spell is not seen: a bound from below."""
        since = holder.idle_since
        if since is None:
            return
        holder.idle_since = None
        self._flight(holder.queue, now)
        holder.busy_since = holder.mark = now
        holder.shared_ms = 0.0
        q = holder.queue
        # who could have used the slot: anyone for a slot of max_streams, a parent that asked for
        # one for a spare stream
        if holder.spare:  # only the head parent could have used it, and only if it may take it
            head = q.head(PARENT)
            first = head.enqueued_at if head is not None and q.frees_for_waiter(holder) else None
        else:
            first = q.oldest_wait()
        if first is None:
            return
        dead = now - max(since, first)
        if dead > 0:
            cost = self._hold_cost(q, holder, now, since)
            if cost is not None:
                holder.rent_ms += cost.spent_ms - cost.before_ms
                if self._blind(q):
                    q.blind_ms += cost.idle_ms
            holder.dead_ms += dead
            q.dead_ms += dead
            q.dead_by_session[holder.session] = q.dead_by_session.pop(holder.session, 0.0) + dead
            while len(q.dead_by_session) > 64:
                q.dead_by_session.popitem(last=False)
            if dead >= 1 and len(self._spells) < 4096:  # the caller drains them after every call
                self._spells.append(Dead(q.key, holder.session, holder.role, dead, cost))

    def _hold_cost(self, q: _Queue, holder: Holder, now: float,
                   since: Optional[float] = None) -> Optional[HoldCost]:
        """Issue 33's rule for ``holder``'s slot, idle since ``since`` (its idle spell's start),
        toward the waiter the queue would grant next; None while nobody waits or it is not idle."""
        since = holder.idle_since if since is None else since
        nxt = self._pick(q, now)
        first = q.oldest_wait()
        if since is None or nxt is None or first is None:
            return None
        idle = max(0.0, now - max(since, first))
        setting = q.policy.switch_cost
        done = holder.for_good  # done with its context
        if q.policy.hold_rule == "rules" and setting != "cheap":
            setting = "rules"  # the rules' bound: the most a switch can cost, whatever the room seen
        affinity = self._affinity.get(q.key)
        then: list[str] = []
        if setting == "auto" and not done and affinity is not None and affinity.room is not None:
            # back, it queues behind whoever waits in its tier or above (a scan of the waiters:
            # only where a known room prices their runs)
            then = [w.session for w in heapq.nsmallest(MAX_DEPTH, (w for w in q.waiting.values()
                                                                   if w.role <= holder.role and w is not nxt),
                                                       key=lambda w: (w.role, w.seq))]
        cost = hold_cost(affinity, setting, holder.session, nxt.session,
                         lambda session: q.needed(session, now) and not (done and session == holder.session),
                         idle, then)
        if holder.turn and holder.persons and nxt.role == CHILD and not (
                holder.asks_spare and q.spare_room(leaving=True) and q.head(PARENT) is None):
            # a person thinks: handed over, they come back to a subagent's request in flight, and
            # wait for it (a subagent yields to them at its next request's end); unless they take
            # a spare stream beside it then (their session asks for one, and one is free)
            times = q.requests[CHILD] or q.requests[PARENT]
            if times:
                cost = cost._replace(behind_ms=_median(times))
        thinking = q.thinking.get(holder.session)
        if holder.turn and thinking is not None and q.thinks:
            # a person whose thoughts were measured: keeping costs the server what is left of this
            # one, as they usually go (``HoldCost.ahead_ms``)
            cost = cost._replace(ahead_ms=_median(q.thinks) - (now - thinking))
        elif not holder.turn and not done and q.gaps:
            # between two requests, its tool call timed as the queue's recent ones go: keeping
            # costs the server what is left of it (``HoldCost.ahead_ms``)
            cost = cost._replace(ahead_ms=_median(q.gaps) - (now - since), ahead="gap")
        return cost._replace(before_ms=max(holder.rent_ms, q.blind_ms) if self._blind(q) else holder.rent_ms)

    def _blind(self, q: _Queue) -> bool:
        """``holdRule: cost`` knows nothing yet of what the server keeps: no return after a switch
        told it (``_Affinity.room``), nor a daemon before (the state file)."""
        if q.policy.hold_rule != "cost" or q.policy.switch_cost != "auto":
            return False
        a = self._affinity.get(q.key)
        return a is None or a.room is None and a.room_cap is None

    def holds(self, q: _Queue, now: float) -> list[tuple[Holder, HoldCost]]:
        """Each idle holder of ``q`` that someone waits for, with issue 33's rule for its slot."""
        if not q.waiting:
            return []
        out = []
        for holder in q.all_holders():
            if holder.idle_since is not None and q.frees_for_waiter(holder):
                cost = self._hold_cost(q, holder, now)
                if cost is not None:
                    out.append((holder, cost))
        return out

    def take_dead(self) -> list[Event]:
        """The dead spells that ended since the last call (for the event log)."""
        spells, self._spells = self._spells, []
        return list(spells)

    def _drop_lease(self, holder: Holder, event: Event, events: list[Event], now: float) -> None:
        if isinstance(event, Released) and event.reason == "release" and holder.busy_since is not None:
            holder.queue.requests[holder.role].append(now - holder.busy_since)  # a request's end
        self._flight(holder.queue, now)
        self._busy(holder, now)  # before a waiter is granted: it waited until now
        holder.held = False
        self._held -= 1
        q = holder.queue
        if holder.spare:
            q.spares -= 1
        elif holder.role == PARENT:
            q.parents -= 1
        if q.holders.get(holder.session) is holder:
            del q.holders[holder.session]
            for i, other in enumerate(q.extra):  # a merged twin takes its place
                if other.session == holder.session:
                    q.holders[holder.session] = q.extra.pop(i)
                    break
        elif holder in q.extra:
            q.extra.remove(holder)
        q.idle.pop(holder, None)
        q.parked.pop(holder, None)
        for conn in holder.conns:
            mine = self._conn_leases.get(conn)
            if mine is not None:
                mine.discard(holder)
                if not mine:
                    del self._conn_leases[conn]
        holder.conns = set()
        events.append(event)

    def _settle(self, q: _Queue) -> None:
        """An emptied queue that no config names may be forgotten once too many pile up."""
        if not q.empty() or q.configured:
            return
        self._forgettable[q.key] = None
        self._forgettable.move_to_end(q.key)
        while len(self._queues) > MAX_QUEUES and self._forgettable:
            key, _ = self._forgettable.popitem(last=False)
            gone = self._queues.get(key)
            if gone is not None and gone.empty() and not gone.configured:
                del self._queues[key]
                self._idle_due.discard(gone)

    def _refill(self, q: _Queue, now: float, events: list[Event]) -> None:
        """Grant waiters into free slots, then parked holders hand their slots to waiters,
        oldest parked first, while that grants someone (a queue left over capacity by a reload
        gains nothing from a yield); then the cost rule's bound (``_cost_refill``)."""
        if q.policy.hold_rule == "cost":
            self._cost_refill(q, now, events)
            return
        self._fill(q, now, events)
        cost: Optional[str] = None
        probe = False  # while the cost is unknown: no hand-over since the last one waits for a return
        awaited: Optional[str] = None  # the one that gave way last, its return come or not
        prober: Optional[str] = None  # the session that gave way last, while its return is awaited
        while q.waiting and q.parked:
            nxt = self._pick(q, now)
            # whom a holder between two requests (parked for a tool call, or in a handback gap)
            # gives its slot to, where the contexts kept are bounded (None: it keeps it)
            gap_target = self._gap_target(q, nxt, now)
            # a handback holder yields to a parent (to a background one only evicting no context in use)
            to_parent = nxt is not None and nxt.role == PARENT and (not nxt.background or gap_target is not None)
            if cost is None and any(h.handback for h in q.parked):
                affinity = self._affinity.get(q.key)
                cost = affinity.cost(q.policy.switch_cost) if affinity else switch_cost((), q.policy.switch_cost)
                probe, prober = self._probe(q, affinity, now)
                awaited = affinity.prober if affinity is not None else None  # answered or not

            def gives_way(h: Holder) -> bool:
                if h.parked and (h.gap or h.turn):  # its context in use: a tool call's, a person's
                    return gap_target is not None
                if h.parked and (h.role == CHILD or h.background):
                    # for good: its context is done with, not one still in use (a background
                    # parent's as a child's: where every agent is a parent, as behind the proxy
                    # with nothing named, each run's end would evict the next one's context)
                    return self._gap_target(q, nxt, now, done=h.session) is not None
                if h.parked:  # a person's parent's for good: never kept (their settle has its own rule)
                    return True
                # while the cost is unknown: a probe (one at a time), or the slot back at once to
                # the one that gave way last, whose return is awaited
                finds_out = cost == "unknown" and nxt is not None and (probe or nxt.session == prober)
                if not to_parent and not h.spare:  # a spare stream only goes to a parent anyway
                    # a child's slot to a child: only to find out, and evicting no context in use
                    return h.role == CHILD and finds_out and gap_target is not None
                return h.role == CHILD or cost == "cheap" or finds_out

            holder = next((h for h in q.parked if gives_way(h) and q.frees_for_waiter(h)), None)
            if holder is None:
                if gap_target is None or any(h.parked and not h.gap and (h.role == CHILD or h.background)
                                           for h in q.parked):
                    self._recheck_gap(q, now, nxt)  # kept for a context in use: look again when it is done with
                break
            if holder.gap or holder.turn or not holder.parked and not to_parent:
                target = gap_target
            elif holder.parked:  # a park for good: a waiter whose context is kept goes first
                target = self._gap_target(q, nxt, now, done=holder.session) or nxt
            else:
                target = nxt
            if holder.gap or not holder.parked:  # between two requests: its context is in use meanwhile
                q.went_away(holder.session, now, holder.idle_since, holder.persons)
            else:
                q.came_back(holder.session)  # for good: done with, not away
            if holder.parked:
                q.park_yields += 1
            else:
                q.handback_yields += 1
                if holder.role == CHILD and to_parent:
                    q.may_resume(holder.session)  # next after the parent, ahead of the other children
                elif cost == "unknown" and nxt is not None and nxt.session != awaited:
                    # a probe (not the slot given back to the last one): one at a time
                    record = self._affinity_of(q.key)
                    record.probed, record.probed_at, record.prober = record.returns, now, holder.session
                    probe, prober = False, holder.session
                    awaited = holder.session
                    if holder.session in record.prompts:  # its return can tell: it queues again first
                        q.may_resume(holder.session)
            self._drop_lease(holder, Released(q.key, holder, "parked" if holder.parked else "handback",
                                              self._hold_cost(q, holder, now)), events, now)
            if target is not None and target is not nxt and target.live and q.has_room():
                self._grant_waiter(q, target, now, events)  # a waiter whose context is kept goes first
            self._fill(q, now, events)
        self._cost_refill(q, now, events, bound=True)

    def _cost_refill(self, q: _Queue, now: float, events: list[Event], bound: bool = False) -> None:
        """``holdRule: cost``: waiters into free slots in the spec's order, then each idle
        holder someone waits for goes by issue 33's rule (``HoldCost``): its slot is handed over
        once its idle time reaches what the switch costs (at once where that is nothing), and
        the sweep looks again when it will.  The spec's own hand-overs stay as they are: a holder
        parked on another agent (a blocking tool) yields at once, and a subagent between two
        requests to a waiting parent.  With nothing known of the contexts' sizes, the seed's rule:
        an idle holder keeps its slot, to the idle-yield.  ``bound``: the same, as the bound on the
        rules in force (``holdRule: rules``), after they had their say: no hand-over of the spec's
        at once (the rules make those), each priced at the most a switch can cost, and an idle
        holder of a queue left over capacity goes too, though its slot grants nobody by itself."""
        self._fill(q, now, events)
        while q.waiting:
            nxt = self._pick(q, now)
            due: Optional[float] = None
            chosen: Optional[tuple[Holder, Optional[HoldCost]]] = None
            # left over capacity (a reload, or ``"auto"``'s streams fell): an idle holder's slot
            # frees nobody's by itself, but each one kept keeps the waiters out as surely
            over = bound and q.over_capacity()
            for holder in q.all_holders():
                if holder.idle_since is None or not (q.frees_for_waiter(holder) or over and not holder.spare):
                    continue
                if not bound and holder.for_good:
                    chosen = (holder, self._hold_cost(q, holder, now))  # spec: it waits on another agent
                    break
                if not bound and holder.handback and holder.role == CHILD and nxt is not None and nxt.role == PARENT:
                    chosen = (holder, self._hold_cost(q, holder, now))  # spec: a child yields to a parent
                    break
                cost = self._hold_cost(q, holder, now)
                if cost is None or cost.switch_ms is None:
                    continue  # nothing known: kept, to the idle-yield
                if cost.hand_over:
                    chosen = (holder, cost)
                    break
                # when the idle time spent reaches the threshold, someone waiting on from now
                first = q.oldest_wait()
                began = max(holder.idle_since, now if first is None else first)
                at = began + (cost.threshold_ms or 0.0) - cost.before_ms
                if at <= now + 1e-6:  # due already, but for rounding: a look again now would find the same
                    chosen = (holder, cost)
                    break
                due = at if due is None else min(due, at)
            if chosen is None:
                if due is not None:
                    self._weigh_at(q, due)
                return
            holder, cost = chosen
            if holder.for_good:
                q.park_yields += 1
                q.came_back(holder.session)
                reason = "parked"
            else:  # between two requests: its context is in use meanwhile, and it queues again
                q.went_away(holder.session, now, holder.idle_since, holder.persons)
                if holder.parked:
                    q.park_yields += 1
                    reason = "parked"
                elif holder.handback:
                    q.handback_yields += 1
                    if holder.role == CHILD:
                        q.may_resume(holder.session)  # next after the parent, ahead of the other children
                    reason = "handback"
                else:
                    q.idle_yields += 1
                    reason = "idle"
            self._drop_lease(holder, Released(q.key, holder, reason, cost), events, now)
            self._fill(q, now, events)

    def _recheck_gap(self, q: _Queue, now: float, nxt: Optional[Waiter] = None) -> None:
        """A holder between two requests kept its slot from a waiter whose run would evict the
        context of a session that gave way in a tool-call gap, or of a person between turns: that
        one is in use only so long (``_Queue.in_use``), so the sweep looks again then.  (A holder
        or a waiter in use gives an event of its own when that changes.)  And at the latest when
        ``nxt``, the waiter kept out, has waited ``agingAfterMs``: it goes then whatever it costs
        (``_gap_target``), so a context in use with no end in sight (a holder's, on another
        stream) never keeps it waiting for longer."""
        affinity = self._affinity.get(q.key)
        resident = affinity.resident() if affinity is not None else []
        low = affinity.unsettled() if affinity is not None else None
        near = affinity.resident(low) if affinity is not None and low is not None else []
        ends = [q.in_use_until(kept[-1]) for kept in (resident, near) if kept]  # and a person's
        times = [until + 1.0 for until in ends if until is not None]
        if nxt is not None and q.policy.aging_after_ms > 0:
            times.append(nxt.enqueued_at + q.policy.aging_after_ms)
        times = [t for t in times if t > now]  # an away context past its time is in use no longer
        if not times:
            return
        self._look_at(self._gap_heap, q, min(times))

    def _gap_target(self, q: _Queue, nxt: Optional[Waiter], now: float,
                    done: Optional[str] = None) -> Optional[Waiter]:
        """Whom a holder parked in a tool-call gap gives its slot to: ``nxt``, the waiter the queue
        would grant, unless the queue learned that switches are cheap only because the server
        keeps the contexts of so many sessions (``_Affinity.contexts``: a return was evicted after
        two or more others ran), and ``nxt``'s run would push out the context of one still in
        use (``_Queue.in_use``).  A waiting child whose context is kept then goes instead, the
        one that waited longest; with none, the holder keeps its slot, as where switches are
        dear.  A parent with a person behind it, and a child aged past ``agingAfterMs``, goes
        first whatever it costs.  A ``background`` parent (no person behind it) is one of the
        children here, unless a person's parent waits too: it waits for a context in use, and a
        waiting child or background parent whose context is kept goes before it.
        ``done``: a session whose context counts as no longer in use (a holder that parked for
        good: its run settled, or it waits on other agents).  Where the returns leave the bound
        open (``_Affinity.unsettled``), a person's context between turns is kept as if only its
        lower end fit."""
        if nxt is None or q.policy.switch_cost != "auto" or q.policy.policy == "fifo":
            return nxt
        if nxt.role == PARENT and not nxt.background or q.person_waits():
            return nxt  # a person waits: it goes, or a child aged past it
        if nxt.role == CHILD and q.head(PARENT) is not None:
            return nxt  # a parent waits, background: a child goes only aged past it
        affinity = self._affinity.get(q.key)
        if affinity is None or affinity.contexts is None or affinity.contexts < 2 or affinity.cost() == "dear":
            return nxt
        if q.policy.aging_after_ms > 0 and now - nxt.enqueued_at >= q.policy.aging_after_ms:
            return nxt
        resident = affinity.resident()  # the latest first
        low = affinity.unsettled()  # the bound is open: a person's context kept as if low were all
        near = affinity.resident(low) if low is not None else []

        def spares_person(w: Waiter) -> bool:
            return low is None or not self._pushes_out(q, w, near, low, done, now, person=True)

        if not self._pushes_out(q, nxt, resident, affinity.contexts, done, now) and spares_person(nxt):
            return nxt
        kept = [w for w in (q.waiting.get(s) for s in resident)
                if w is not None and (w.role == CHILD or w.background) and spares_person(w)]
        return min(kept, key=lambda w: (w.role, w.seq)) if kept else None  # by tier, then age

    @staticmethod
    def _pushes_out(q: _Queue, nxt: Waiter, resident: list[str], room: int, done: Optional[str], now: float,
                    person: bool = False) -> bool:
        """Whether ``nxt``'s run pushes out a context still in use (with ``person``: a person's
        between turns), the server keeping ``room`` contexts, ``resident`` those it keeps, the
        latest first.  Not when its context is kept, or there is room for it, or the one it
        evicts is done with (``done``)."""
        if nxt.session in resident or len(resident) < room or resident[-1] == done:
            return False
        last = resident[-1]
        if person:
            since = q.thinking.get(last)
            return since is not None and now - since <= q.think_ms()
        return q.in_use(last, now)

    @staticmethod
    def _probe(q: _Queue, affinity: Optional[_Affinity], now: float) -> tuple[bool, Optional[str]]:
        """While a queue's switch cost is unknown: whether a holder may give way to find it out
        (a probe), and the session that gave way last if its return is still awaited.  A probe
        waits for that return: ``PROBE_AGAIN_MS`` at most, and while the one that gave way has not
        queued again (it went on to other work, or its run ended: the proxy cannot tell a run's
        last response from a tool call) as long as the queue's tool calls take (``q.gaps``, the
        grace while none is known), and not at all once a session came back to a kept context
        (so far the answer looks cheap)."""
        if affinity is None or affinity.returns > affinity.probed:
            return True, None
        since = now - affinity.probed_at
        back = affinity.prober is not None and affinity.prober in q.waiting
        if since >= PROBE_AGAIN_MS or not back and (since >= q.tool_call_ms() or affinity.kept):
            return True, None
        return False, affinity.prober

    def _pick(self, q: _Queue, now: float) -> Optional[Waiter]:
        parent, child = q.head(PARENT), q.head(CHILD)
        if parent is None or child is None:
            return parent or child
        p = q.policy
        if p.policy == "fifo":
            return parent if parent.seq < child.seq else child
        if p.aging_after_ms > 0 and now - child.enqueued_at >= p.aging_after_ms:
            return child  # aged by time: the longest-waiting child jumps the queue
        if p.aging_after_slots > 0 and (
            q.parent_grants - max(child.parent_mark, q.child_mark) >= p.aging_after_slots
        ):
            return child  # aged by slots: that many parents were granted in a row while it waited
        return parent

    def _fill(self, q: _Queue, now: float, events: list[Event]) -> None:
        """Grant waiters into free slots, by tier and age, until the queue is full or empty;
        then the head parent into a spare stream, if it asked for one and one is free."""
        while q.waiting:
            spare = not q.has_room()
            if spare:
                head = q.head(PARENT)
                if head is None or not head.spare or not q.spare_room():
                    return
                w: Optional[Waiter] = head
            else:
                w = self._pick(q, now)
            if w is None:  # pragma: no cover - waiting and the heaps always agree
                raise AssertionError(f"{q.key}: waiters without heap entries")
            self._grant_waiter(q, w, now, events, spare)

    def _grant_waiter(self, q: _Queue, w: Waiter, now: float, events: list[Event], spare: bool = False) -> None:
        """Grant waiter ``w`` a slot (a spare stream with ``spare``), unless everyone who asked for
        it has gone: it is dropped then."""
        alive = {conn: self.alive(conn) for conn in {t[0] for t in w.targets}}
        targets = tuple(t for t in w.targets if alive[t[0]])
        self._drop_waiter(w)
        if not targets:  # everyone who asked has gone: never grant a dead waiter
            events.append(Dequeued(q.key, w, "disconnect"))
            return
        holder = self._grant(q, w.session, w.role, w.group, w.activity, targets[0][1], now, spare, w.background,
                             w.spare)
        for conn, _ in targets:
            self._attach(holder, conn)
        q.switches += 1
        events.append(Granted(q.key, holder, targets, new=True, switch=True))


# =================================================================================================
# The wire protocol
#
# One JSON object per line.  ``parse_request`` turns a line into a Request or raises the one
# ProtocolError, whatever the bytes: invalid UTF-8, invalid JSON, nesting deep enough to blow the
# parser's stack, numbers too long to convert, a value that is not an object, an unknown op, a
# field of the wrong type.  Unknown extra fields are ignored (forward compatibility).
# =================================================================================================

OPS = ("acquire", "release", "cancel", "role", "renew", "status", "bye", "usage")
_KEYED_OPS = ("acquire", "release", "cancel", "usage")  # spec: a keyless one would hold an unnamed slot
MAX_TOKENS = 1 << 53  # a usage count past this is no count
# Ops that make a connection count for idle-exit: they touch queue state.  status never does.
_COUNTED_OPS = ("acquire", "renew", "role", "cancel")


class Request(NamedTuple):
    """A parsed, type-checked request.  Absent optional fields are None (``activity`` False)."""

    op: str
    queue_key: Optional[str] = None
    session_key: Optional[str] = None
    role: Optional[str] = None
    group: Optional[str] = None
    activity: bool = False
    parked: bool = False  # additive, on a keyed renew: the holder waits on another agent
    resume: bool = False  # additive, on acquire: queue ahead of the tier, where earned (Scheduler.acquire)
    prefilled: Optional[int] = None  # additive, the usage op: prompt tokens the server computed
    reused: Optional[int] = None  # ... and those it served from its cache
    busy: Optional[bool] = None  # additive, on a keyed renew: whether a request is in flight
    spare: bool = False  # additive, on acquire: a parent may take a spare stream when every slot is held
    handback: bool = False  # additive, on a keyed renew: between two requests (see Scheduler.handback)
    gap: bool = False  # additive, with ``parked``: parked for a tool call between two requests (Scheduler.park)
    background: bool = False  # additive, on acquire: a parent with no person behind it (Scheduler.acquire)
    turn: bool = False  # additive, with ``parked``: a parent's turn is over, a person answers next (Scheduler.park)
    prefill_ms: Optional[float] = None  # additive, the usage op: how long the server took to prefill ``prefilled``
    slots: Optional[int] = None  # additive, the usage op: requests the server runs at once (its ``/props``)
    slot_context: Optional[int] = None  # ... and the tokens one of them may hold
    decode_ms: Optional[float] = None  # additive, the usage op: how long the server took to decode ``decoded``
    decoded: Optional[int] = None  # ... the tokens it generated


def _text_field(msg: dict[str, Any], name: str) -> Optional[str]:
    value = msg.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{name} must be a non-empty string (got {_show(value)})")
    return value


# One decoder for every request (json.loads would build a new one per call).
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_int=_parse_int)
# Requests repeat byte for byte (every bare renew, a session's acquire, release and beats), and a
# Request is immutable: parse each distinct line once.  Bounded in entries and in line length,
# because peers choose the bytes: at most ~512 x 256 bytes of lines.
_PARSED: dict[bytes, Request] = {}
_PARSED_MAX = 512
_PARSED_LINE_MAX = 256


def parse_request(line: Union[bytes, str]) -> Request:
    """One request line (without its newline) as a Request; raises ProtocolError on anything
    that is not a valid request, and nothing else."""
    if isinstance(line, bytes) and len(line) <= _PARSED_LINE_MAX:
        hit = _PARSED.get(line)
        if hit is not None:
            return hit
        req = _parse_request(line)
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        _PARSED[line] = req
        return req
    return _parse_request(line)


def _parse_request(line: Union[bytes, str]) -> Request:
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
    except UnicodeDecodeError:
        raise ProtocolError("invalid UTF-8") from None
    try:
        msg = _DECODER.decode(text)
    except RecursionError:
        raise ProtocolError("invalid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and ints past the digit limit
        raise ProtocolError(f"invalid JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"a request must be a JSON object (got {type(msg).__name__})")
    op = msg.get("op")
    if op is None:
        raise ProtocolError(f"missing op: every request names one ({', '.join(OPS)})")
    if not isinstance(op, str):
        raise ProtocolError(f"op must be a string (got {_show(op)})")
    if op not in OPS:
        raise ProtocolError(f"unknown op: {_show(op)}{_did_you_mean(op, OPS)}")
    queue_key = _text_field(msg, "queueKey")
    session_key = _text_field(msg, "sessionKey")
    group = msg.get("group")
    if group is not None and not isinstance(group, str):
        raise ProtocolError(f"group must be a string or null (got {_show(group)})")
    role = msg.get("role")
    if role is not None and role not in ROLES:
        raise ProtocolError(f"role must be parent or child (got {_show(role)})")
    activity = msg.get("activity")
    if activity is not None and not isinstance(activity, bool):
        raise ProtocolError(f"activity must be true or false (got {_show(activity)})")
    parked = msg.get("parked")
    if parked is not None and not isinstance(parked, bool):
        raise ProtocolError(f"parked must be true or false (got {_show(parked)})")
    resume = msg.get("resume")
    if resume is not None and not isinstance(resume, bool):
        raise ProtocolError(f"resume must be true or false (got {_show(resume)})")
    busy = msg.get("busy")
    if busy is not None and not isinstance(busy, bool):
        raise ProtocolError(f"busy must be true or false (got {_show(busy)})")
    spare = msg.get("spare")
    if spare is not None and not isinstance(spare, bool):
        raise ProtocolError(f"spare must be true or false (got {_show(spare)})")
    handback = msg.get("handback")
    if handback is not None and not isinstance(handback, bool):
        raise ProtocolError(f"handback must be true or false (got {_show(handback)})")
    gap = msg.get("gap")
    if gap is not None and not isinstance(gap, bool):
        raise ProtocolError(f"gap must be true or false (got {_show(gap)})")
    background = msg.get("background")
    if background is not None and not isinstance(background, bool):
        raise ProtocolError(f"background must be true or false (got {_show(background)})")
    turn = msg.get("turn")
    if turn is not None and not isinstance(turn, bool):
        raise ProtocolError(f"turn must be true or false (got {_show(turn)})")
    if op in _KEYED_OPS and queue_key is None:
        raise ProtocolError(f"{op} requires queueKey")
    if op == "role" and role is None:
        raise ProtocolError("role requires role (parent or child)")
    if op == "renew" and queue_key is None and session_key is not None:
        raise ProtocolError("a keyed renew requires queueKey")
    counts: list[Optional[int]] = []
    for name in ("prefilled", "reused"):
        value = msg.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not 0 <= value <= MAX_TOKENS):
            raise ProtocolError(f"{name} must be a token count, a non-negative integer (got {_show(value)})")
        counts.append(value)
    if op == "usage" and counts == [None, None]:
        raise ProtocolError("usage requires prefilled or reused")
    prefill_ms = msg.get("prefillMs")
    if prefill_ms is not None and (not isinstance(prefill_ms, (int, float)) or isinstance(prefill_ms, bool)
                                   or not 0 <= prefill_ms <= MAX_PREFILL_MS):
        raise ProtocolError(f"prefillMs must be a duration in milliseconds, 0 to {MAX_PREFILL_MS:.0f} "
                            f"(got {_show(prefill_ms)})")
    decode_ms = msg.get("decodeMs")
    if decode_ms is not None and (not isinstance(decode_ms, (int, float)) or isinstance(decode_ms, bool)
                                  or not 0 <= decode_ms <= MAX_PREFILL_MS):
        raise ProtocolError(f"decodeMs must be a duration in milliseconds, 0 to {MAX_PREFILL_MS:.0f} "
                            f"(got {_show(decode_ms)})")
    decoded = msg.get("decoded")
    if decoded is not None and (not _is_int(decoded) or not 0 <= decoded <= MAX_TOKENS):
        raise ProtocolError(f"decoded must be a token count, a non-negative integer (got {_show(decoded)})")
    server: list[Optional[int]] = []
    for name, top in (("slots", MAX_SERVER_SLOTS), ("slotContext", MAX_TOKENS)):
        value = msg.get(name)
        if value is not None and (not _is_int(value) or not 1 <= value <= top):
            raise ProtocolError(f"{name} must be a positive integer, the server's own figure (got {_show(value)})")
        server.append(value)
    return Request(op, queue_key, session_key, role, group, bool(activity), bool(parked), bool(resume),
                   counts[0], counts[1], busy, bool(spare), bool(handback), bool(gap), bool(background),
                   bool(turn), None if prefill_ms is None else float(prefill_ms), server[0], server[1],
                   None if decode_ms is None else float(decode_ms), decoded)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def encode_error(reason: str, line: Union[bytes, str]) -> bytes:
    """The reply to a request refused as sent.  Where the line is a JSON object, it names what
    it answers: ``request`` (the op asked for) and ``queueKey``/``sessionKey``, each where it was
    a string, so a client that matches keyed replies in order knows which one this answers."""
    reply: dict[str, Any] = {"op": "error", "reason": reason}
    try:
        msg = _DECODER.decode(line.decode("utf-8") if isinstance(line, bytes) else line)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return _line(reply)
    if isinstance(msg, dict):
        for name, field in (("request", "op"), ("queueKey", "queueKey"), ("sessionKey", "sessionKey")):
            if isinstance(msg.get(field), str):
                reply[name] = msg[field]
    return _line(reply)


_OK = b'{"op":"ok"}\n'


def encode_granted(key: str, holder: Holder) -> bytes:
    """The ``granted`` reply: the key the client asked with, its session, the lease's terms, and
    the per-queue grant sequence number, and (additive) ``spare: true`` on a parent's spare
    stream.  (Built by hand: it is on every handoff's path.)"""
    spare = ',"spare":true' if holder.spare else ""
    return (f'{{"op":"granted","queueKey":{_json_str(key)},"sessionKey":{_json_str(holder.session)},'
            f'{holder.terms.wire_json()},"seq":{holder.seq}{spare}}}\n').encode()


def encode_released(key: str, session: Optional[str]) -> bytes:
    """The ``ok`` reply to ``release``: it echoes the queueKey (and the sessionKey) the client
    sent, as every keyed reply does (additive: the seed's reply was a bare ``ok``)."""
    if session is None:
        return f'{{"op":"ok","queueKey":{_json_str(key)}}}\n'.encode()
    return f'{{"op":"ok","queueKey":{_json_str(key)},"sessionKey":{_json_str(session)}}}\n'.encode()


def encode_usage(key: str, session: Optional[str], cost: str, auto: bool = False) -> bytes:
    """The ``ok`` reply to ``usage``: the keys echoed, and (additive) ``switchCost``, what a
    switch costs on the queue as learned so far (``cheap``, ``dear``, ``unknown``); ``streams:
    "auto"`` where the queue's ``maxStreams`` is, so the reporter adds the server's figures."""
    more = ',"streams":"auto"' if auto else ""
    return encode_released(key, session)[:-2] + f',"switchCost":{_json_str(cost)}{more}}}\n'.encode()


def encode_beat(key: str, session: str, granted: bool, parent_waiting: bool = False,
                busy: Optional[bool] = None) -> bytes:
    """The reply to a keyed ``renew``; ``parentWaiting`` (additive, only when true): a child's
    slot is wanted by a parent; ``busy`` (additive) echoes the renew's own."""
    hint = ',"parentWaiting":true' if parent_waiting else ""
    if busy is not None:
        hint += ',"busy":true' if busy else ',"busy":false'
    return (f'{{"op":"ok","queueKey":{_json_str(key)},"sessionKey":{_json_str(session)},'
            f'"granted":{"true" if granted else "false"}{hint}}}\n').encode()


def _event_record(event: Event) -> list[dict[str, Any]]:
    """The event log lines of one scheduler event (without ``ts``)."""
    if isinstance(event, OverCapacity):
        return [{"event": "config", "queueKey": event.queue_key, "reason": "over-capacity",
                 "holders": event.holders, "maxStreams": event.max_streams}]
    if isinstance(event, Queued):
        w = event.waiter
        return [{"event": "queued", "queueKey": event.queue_key, "sessionKey": w.session,
                 "role": ROLES[w.role]}]
    if isinstance(event, Dequeued):
        w = event.waiter
        return [{"event": "dequeue", "queueKey": event.queue_key, "sessionKey": w.session,
                 "role": ROLES[w.role], "reason": event.reason}]
    if isinstance(event, Moved):
        who = event.who
        return [{"event": "move", "queueKey": event.queue_key, "from": event.source, "sessionKey": who.session,
                 "role": ROLES[who.role], "what": "holder" if isinstance(who, Holder) else "waiter"}]
    if isinstance(event, Dead):
        dead = {"event": "dead", "queueKey": event.queue_key, "sessionKey": event.session,
                "role": ROLES[event.role], "ms": round(event.ms)}
        if event.cost is not None:  # additive: what issue 33's rule would have spent of it
            dead.update(event.cost.fields())
        return [dead]
    if isinstance(event, Usage):
        line: dict[str, Any] = {"event": "usage", "queueKey": event.queue_key, "sessionKey": event.session,
                                "prefilled": event.prefilled, "reused": event.reused}
        if event.seq is not None:
            line["seq"] = event.seq
        if event.kept is not None:
            line["kept"] = round(event.kept, 3)
        if event.depth is not None:
            line["depth"] = event.depth
        if event.prefill_ms is not None:
            line["prefillMs"] = round(event.prefill_ms, 1)
        if event.streams is not None:  # ``maxStreams: "auto"`` changed with this report
            line["maxStreams"] = event.streams
        if event.decode_ms is not None:  # additive: the server's decode, and how many ran at once
            line["decoded"], line["decodeMs"] = event.decoded, round(event.decode_ms, 1)
        if event.at_once is not None and event.at_once > 1:
            line["atOnce"] = round(event.at_once, 2)
        return [line]
    holder = event.holder
    base: dict[str, Any] = {"queueKey": event.queue_key, "sessionKey": holder.session, "role": ROLES[holder.role]}
    if isinstance(event, Granted):
        if not event.new:
            return []
        lines = [dict(event="grant", seq=holder.seq, **base)]
        if holder.spare:
            lines[0]["spare"] = True  # additive: on a parent's spare stream, beside max_streams
        if event.switch:
            lines.append(dict(event="switch", seq=holder.seq, **base))
        return lines
    if isinstance(event, Released):
        released = dict(event="release", reason=event.reason, **base)
        if event.cost is not None:  # additive: issue 33's rule at this hand-over
            released.update(event.cost.fields())
        return [released]
    return [dict(event="evict", reason=event.reason, **base)]


def _iso_utc(wall: float) -> str:
    """Wall time as an ISO-8601 UTC timestamp with milliseconds: 2026-11-29T15:44:01.123Z."""
    whole = int(wall)
    ms = int((wall - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{ms:03d}Z"


# =================================================================================================
# The daemon
#
# One thread, one ``selectors`` loop, no locks.  Each turn: sleep until the earliest timer, read
# the clock once, handle accepts and reads (each line: parse, one scheduler call, replies), write
# what is pending, run due timers (sweep, config poll, debounce, idle-exit), append log lines.
# Sockets are non-blocking; a peer's unsent output is bounded; a peer never blocks the loop.
# =================================================================================================


def default_agent_dir() -> str:
    """``$LLMQUEUE_DIR``, else pi's rule: ``$PI_CODING_AGENT_DIR``, else ``~/.pi/agent``.  (pi is
    the coding-agent CLI whose directory the queue first lived in; nothing of pi is needed.)"""
    return (os.environ.get("LLMQUEUE_DIR") or os.environ.get("PI_CODING_AGENT_DIR")
            or os.path.join(os.path.expanduser("~"), ".pi", "agent"))


def _peer_uid(sock: socket.socket) -> Optional[int]:
    """The connecting process's uid (SO_PEERCRED), or None where the platform cannot say."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
    except OSError:
        return None
    return int(struct.unpack("3i", creds)[1])


class _Conn:
    """One client connection: its buffers and whether it counts toward idle-exit."""

    __slots__ = ("sock", "inbuf", "out", "counted", "anon", "closing", "writing", "dirty", "backlogged")

    def __init__(self, sock: socket.socket, number: int) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.out = bytearray()
        self.counted = False
        self.anon = f"~conn-{number}"  # the session of requests that name none
        self.closing = False
        self.writing = False
        self.dirty = False
        self.backlogged = False  # complete lines left over from its last turn


_LISTENER = "listener"
_WAKE = "wake"


class Daemon:
    """The queue daemon: owns the socket, the scheduler and the config watch.

    ``Daemon(agent_dir).serve_forever()`` serves until ``stop()`` (thread-safe), a signal, or the
    idle-exit; a host process can run ``serve_forever`` in a thread.  ``idle_exit_ms`` overrides
    the config's ``daemonIdleExitMs``; a negative value never exits for idleness.
    """

    def __init__(self, agent_dir: Optional[str] = None, *, socket_path: Optional[str] = None,
                 config_path: Optional[str] = None, models_json: Optional[str] = None,
                 sweep_ms: int = DEFAULT_SWEEP_MS, idle_exit_ms: Optional[int] = None,
                 stderr: Optional[IO[str]] = None, log_file: Optional[str] = None) -> None:
        if sweep_ms < 1:
            raise ValueError("sweep_ms must be at least 1")
        self.agent_dir = agent_dir or default_agent_dir()
        self.socket_path = socket_path or os.path.join(self.agent_dir, "llm-queue.sock")
        self.config_path = config_path or os.path.join(self.agent_dir, "llm-queue.json")
        self.models_json = models_json or os.path.join(self.agent_dir, "models.json")
        self.state_path = os.path.join(self.agent_dir, STATE_FILE)  # what a switch costs, learned
        self._state_at: dict[str, float] = {}  # per queue: when its last return came (epoch s)
        self._state_note: Optional[str] = None
        self.sweep_ms = sweep_ms
        self.idle_exit_ms = idle_exit_ms
        self.log_file = os.path.abspath(os.path.expanduser(log_file)) if log_file else None  # over the config's
        self._stderr = stderr
        self.announce = False  # say on stderr when it starts serving and when it exits for idleness
        self.exit_reason: Optional[str] = None
        self._stopping = False
        self._listener: Optional[socket.socket] = None
        self._sock_ino: Optional[int] = None
        self._lock_fd: Optional[int] = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._conns: set[_Conn] = set()
        self._conn_numbers = 0
        self._counted = 0
        self._dirty: list[_Conn] = []
        self._doomed: list[_Conn] = []
        self._backlog: list[_Conn] = []
        self._starved = False  # out of descriptors, accepts paused
        self._sweep_version: Any = None
        self._idle_since = 0.0  # when the last counted client left (or the daemon started)
        self._ever_counted = False
        self._timers: dict[str, float] = {}
        self._timer_heap: list[tuple[float, str]] = []
        self._origin = self._now = time.monotonic() * 1000.0
        self._log_lines: list[dict[str, Any]] = []
        self._reload_now = False
        self._watch_sig: Any = None
        self._pending_sig: Any = None
        self._watch_note: Optional[str] = None
        self._config_errors: list[str] = []  # why the config file on disk is not the one served
        self.config = Config()
        self.catalog: dict[str, str] = {}
        self.scheduler = Scheduler()

    # -- lifetime ---------------------------------------------------------------------------------

    def _say(self, text: str) -> None:
        """A line for a person on stderr; discarded when the daemon runs detached."""
        try:
            out = self._stderr or sys.stderr
            out.write(f"llmqueue: {text}\n")
            out.flush()
        except (OSError, ValueError, AttributeError):
            pass

    def _socket_alive(self) -> bool:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(self.socket_path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except socket.timeout:
            return True  # a live daemon with a full backlog
        except OSError as e:
            raise DaemonError(f"cannot probe {self.socket_path}: {e.strerror or e}") from None
        finally:
            probe.close()
        return True

    def bind(self) -> None:
        """Take the socket: exit quietly (AlreadyRunning) if a live daemon serves it, reclaim a
        stale socket file, refuse to replace anything that is not a socket.  A lock file beside
        the socket serialises daemons that start at the same instant."""
        if self._listener is not None:
            return
        import fcntl  # unix only, like the socket itself; imported here to keep startup lean

        directory = os.path.dirname(os.path.abspath(self.socket_path))
        if not os.path.isdir(directory):
            try:
                os.makedirs(directory, mode=0o700)
                os.chmod(directory, 0o700)
            except OSError as e:
                raise DaemonError(f"cannot create {directory}: {e.strerror or e}") from None
        try:
            lock_fd = os.open(self.socket_path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise DaemonError(f"cannot open {self.socket_path}.lock: {e.strerror or e}") from None
        try:
            deadline = time.monotonic() + 5.0
            while True:
                if self._socket_alive():
                    raise AlreadyRunning(f"a daemon already serves {self.socket_path}")
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        raise DaemonError(f"cannot lock {self.socket_path}.lock: {e}") from None
                if time.monotonic() > deadline:
                    raise DaemonError(f"another daemon holds {self.socket_path}.lock but does not serve")
                time.sleep(0.02)  # another daemon is starting or exiting: let it finish
            if self._socket_alive():
                raise AlreadyRunning(f"a daemon already serves {self.socket_path}")
            try:
                st = os.lstat(self.socket_path)
            except FileNotFoundError:
                pass
            else:
                if not stat.S_ISSOCK(st.st_mode):
                    raise DaemonError(f"{self.socket_path} exists and is not a socket; refusing to replace it")
                os.unlink(self.socket_path)  # stale: nobody listens on it
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(self.socket_path)
                os.chmod(self.socket_path, 0o600)  # before listen: nobody can connect yet
                listener.listen(4096)
            except OSError as e:
                listener.close()
                raise DaemonError(f"cannot listen on {self.socket_path}: {e.strerror or e}") from None
            listener.setblocking(False)
        except BaseException:
            os.close(lock_fd)
            raise
        self._lock_fd = lock_fd
        self._listener = listener
        self._sock_ino = os.stat(self.socket_path).st_ino

    def stop(self) -> None:
        """Ask the loop to finish (from any thread); serve_forever then cleans up and returns."""
        self._stopping = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def serve_forever(self, *, install_signals: Optional[bool] = None) -> None:
        """Serve until stopped.  Signals (SIGTERM/SIGINT stop, SIGHUP reloads) are handled when
        running in the main thread, unless ``install_signals`` is False."""
        if install_signals is None:
            install_signals = threading.current_thread() is threading.main_thread()
        # Before the socket listens: a SIGTERM that follows the first connect must stop cleanly.
        restore = self._install_signals() if install_signals else None
        try:
            self.bind()
            self._start()
            if self.announce:
                self._say(f"serving on {self.socket_path}; {self._lifetime()}")
            while not self._stopping:
                self._turn()
            if self.announce and self.exit_reason == "idle":
                self._say("no client for a while: exiting (the next client starts a daemon again)")
        finally:
            if restore is not None:
                restore()
            self._shutdown()

    def _lifetime(self) -> str:
        """How long this daemon stays, in a person's words."""
        delay = self._idle_exit_delay()
        if delay is None:
            return "it stays until stopped (Ctrl-C)"
        after = f"{delay / 1000:g} s after its last client leaves" if delay else "when its last client leaves"
        if delay < NO_CLIENT_EXIT_FLOOR_MS:
            after += f" (after {NO_CLIENT_EXIT_FLOOR_MS // 1000} s if none comes)"
        return f"it exits {after}; clients start it on demand, and --idle-exit-ms never keeps it running"

    def _install_signals(self) -> Callable[[], None]:
        def on_stop(signum: int, frame: Any) -> None:
            self.exit_reason = self.exit_reason or signal.Signals(signum).name
            self._stopping = True

        def on_hup(signum: int, frame: Any) -> None:
            self._reload_now = True

        old = {s: signal.signal(s, h) for s, h in
               ((signal.SIGTERM, on_stop), (signal.SIGINT, on_stop), (signal.SIGHUP, on_hup))}
        old_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)

        def restore() -> None:
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                signal.signal(s, h)

        return restore

    def _start(self) -> None:
        assert self._listener is not None
        self._now = self._origin = time.monotonic() * 1000.0
        self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._load_config(startup=True)
        self._load_state()
        self._arm("poll", self._now + self._poll_ms())
        self._idle_since = self._now
        self._arm_exit()

    def _shutdown(self) -> None:
        if self._listener is not None:
            # The path goes first: a client connecting from now on finds no daemon and starts a
            # fresh one, instead of reaching a listener that is about to close.
            try:
                if os.stat(self.socket_path).st_ino == self._sock_ino:
                    os.unlink(self.socket_path)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        for c in list(self._conns):
            try:
                c.sock.close()
            except OSError:
                pass
        self._conns.clear()
        self._flush_log()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # never unlinked: a waiter may hold this very inode
            self._lock_fd = None

    # -- the loop ---------------------------------------------------------------------------------

    def _turn(self) -> None:
        nxt = self._next_timer()
        timeout = None if nxt is None else max(0.0, (nxt - self._now) / 1000.0)
        ready = self._sel.select(0.0 if self._backlog else timeout)
        self._now = time.monotonic() * 1000.0  # the one clock read of this turn
        backlog, self._backlog = self._backlog, []  # peers left over from earlier turns
        for key, mask in ready:
            data = key.data
            if data is _LISTENER:
                self._accept()
            elif data is _WAKE:
                self._drain_wake()
            else:
                c: _Conn = data
                if mask & selectors.EVENT_READ and not c.closing and not c.backlogged:
                    self._read(c)
                if mask & selectors.EVENT_WRITE and not c.closing:
                    self._write(c)
                self._settle()
        for c in backlog:
            c.backlogged = False
            if not c.closing:
                self._drain(c)
                self._settle()
        if self._reload_now:
            self._reload_now = False
            self._load_config()
            self._settle()
        nxt = self._next_timer()
        if nxt is not None and nxt <= self._now:
            self._run_timers()
            self._settle()
        self._arm_sweep()
        if self._log_lines:
            self._flush_log()

    def _settle(self) -> None:
        """Write what is pending, in the order it became pending, and close doomed peers."""
        while self._dirty or self._doomed:
            dirty, self._dirty = self._dirty, []
            for c in dirty:
                c.dirty = False
                if not c.closing:
                    self._write(c)
            while self._doomed:
                self._close(self._doomed.pop())

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: a listener that stays readable would spin the loop.
                    # Stop accepting for a while; existing clients are served meanwhile.
                    self._sel.unregister(self._listener)
                    self._arm("accept", self._now + ACCEPT_PAUSE_MS)
                    if not self._starved:  # said once per episode, not every 100 ms
                        self._say(f"out of file descriptors ({e.strerror}); pausing accepts")
                    self._starved = True
                    return
                continue  # ECONNABORTED and the like: that peer is gone already
            if self._starved:
                self._starved = False
                self._say("accepting again")
            uid = _peer_uid(sock)
            if uid is not None and uid not in (0, os.getuid()):
                sock.close()  # security: only our own user (or root) may queue
                continue
            sock.setblocking(False)
            self._conn_numbers += 1
            c = _Conn(sock, self._conn_numbers)
            self._conns.add(c)
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._doom(c)
            return
        if not c.inbuf and len(data) <= MAX_LINE_BYTES + 1 and data.find(b"\n") == len(data) - 1:
            self._handle_line(c, data[:-1])  # the common case: exactly one whole request
            return
        c.inbuf += data
        if data.find(b"\n") < 0:  # no new complete line: only the partial one grew
            if len(c.inbuf) > MAX_LINE_BYTES:
                self._doom(c)
            return
        self._drain(c)

    def _drain(self, c: _Conn) -> None:
        """Handle up to LINES_PER_TURN complete lines of the peer's input.  A peer with more
        waits for the next turn (and is not read from meanwhile: the kernel pushes back)."""
        buf = c.inbuf
        start = 0
        for _ in range(LINES_PER_TURN):
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            if nl - start > MAX_LINE_BYTES:
                self._doom(c)
                return
            self._handle_line(c, bytes(buf[start:nl]))
            start = nl + 1
            if c.closing:
                return
            if self._dirty and self._dirty[0] is not c:
                self._settle()  # a handoff to another peer goes out before our next request
                if c.closing:
                    return  # that write found this peer gone: its remaining lines die with it
        del buf[:start]
        if buf.find(b"\n") >= 0:
            if not c.backlogged:
                c.backlogged = True
                self._backlog.append(c)
        elif len(buf) > MAX_LINE_BYTES:
            self._doom(c)

    def _handle_line(self, c: _Conn, line: bytes) -> None:
        if c.closing:
            return  # a closed peer's leftover requests must not take slots or queue
        req = _PARSED.get(line)  # the common case: a line seen before, parsed once
        if req is None:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line.strip():
                return
            try:
                req = parse_request(line)
            except ProtocolError as e:
                self._send(c, encode_error(str(e), line))
                return
        op = req.op
        now = self._now
        sched = self.scheduler
        session = req.session_key or c.anon
        if op in _COUNTED_OPS:
            self._count(c)
        if op == "acquire":
            assert req.queue_key is not None
            self._apply(sched.acquire(c, req.queue_key, session, req.role or "parent", req.group,
                                      req.activity, now=now, resume=req.resume, spare=req.spare,
                                      background=req.background))
        elif op == "release":
            assert req.queue_key is not None
            self._apply(sched.release(req.queue_key, session, now=now))
            # After the waiter's grant: the handoff goes out first.
            self._send(c, encode_released(req.queue_key, req.session_key))
        elif op == "renew":
            if req.queue_key is None:
                sched.renew(c, now=now)
                self._send(c, _OK)
            elif req.parked:
                granted, events = sched.park(req.queue_key, session, now=now, gap=req.gap, turn=req.turn,
                                             conn=c)
                self._apply(events)  # the handoff goes out first
                self._send(c, encode_beat(req.queue_key, session, granted))
            elif req.handback:
                granted, events = sched.handback(req.queue_key, session, now=now)
                self._apply(events)  # the handoff goes out first
                self._send(c, encode_beat(req.queue_key, session, granted, busy=req.busy))
            else:
                granted = sched.beat(req.queue_key, session, now=now, busy=req.busy)
                self._send(c, encode_beat(req.queue_key, session, granted,
                                          granted and sched.parent_waits(req.queue_key, session), req.busy))
        elif op == "cancel":
            assert req.queue_key is not None
            self._apply(sched.cancel(req.queue_key, session, now=now))
        elif op == "role":
            assert req.role is not None
            self._apply(sched.set_role(session, req.role, now=now))
        elif op == "usage":
            assert req.queue_key is not None
            used = sched.usage(req.queue_key, session, req.prefilled or 0, req.reused or 0,
                               req.prefilled is not None and req.reused is not None, req.prefill_ms,
                               slots=req.slots, slot_context=req.slot_context, decoded=req.decoded or 0,
                               decode_ms=req.decode_ms, now=now)
            self._apply([used])
            if used.streams:  # ``maxStreams: "auto"`` rose: its waiters go now, before the reply
                self._apply(sched.refill(req.queue_key, now=now))
            self._send(c, encode_usage(req.queue_key, req.session_key, used.switch_cost,
                                       sched.addressing.address_endpoint(req.queue_key)[1].streams_auto))
        elif op == "status":
            tail = b"}\n"
            if self.log_path:  # additive: where ``llmqueue report`` finds the events
                tail = b',"logFile":' + json.dumps(self.log_path).encode() + tail
            if self._config_errors:  # additive: what is wrong with the config the daemon is not serving
                tail = b',"configErrors":' + json.dumps(self._config_errors).encode() + tail
            self._send(c, b'{"op":"status","queues":' + sched.status_json(now).encode() + tail)
        elif op == "bye":  # spec (#63): disconnected now, though the socket stays open
            self._apply(sched.disconnect(c, now=now))
            self._uncount(c)
        if sched._spells:
            self._apply([])  # a beat's busy ended a dead spell: logged like any event

    def _apply(self, events: list[Event]) -> None:
        """Replies and log lines from the same events, so the two cannot disagree.  Dead spells
        that ended in the same call are logged first: they end while their holder still holds."""
        spells = self.scheduler.take_dead() if self.scheduler._spells else None
        logging = self.log_path is not None
        if spells and logging:
            for spell in spells:
                self._log_lines.extend(_event_record(spell))
        learned = False
        for event in events:
            if isinstance(event, Granted):
                for conn, key in event.targets:
                    if not conn.closing:
                        self._send(conn, encode_granted(key, event.holder))
            elif isinstance(event, Usage) and event.kept is not None:
                self._state_at[event.queue_key] = time.time()
                learned = True
            if logging:
                self._log_lines.extend(_event_record(event))
        if learned:
            self._save_state()

    def _load_state(self) -> None:
        """What earlier daemons learned of switch costs (the agent dir's state file), if any."""
        try:
            raw = _read_small_file(self.state_path)
        except OSError:
            return  # none yet (or unusable): learn afresh
        kept, self._state_at, depths = decode_state(raw, time.time())
        self.scheduler.seed_affinity(kept, depths, decode_rooms(raw, time.time()))

    def _save_state(self) -> None:
        """Write what was learned, atomically (a temporary file renamed over the state file), so
        the next daemon starts from it.  A failure is said once and costs nothing else."""
        kept = self.scheduler.affinity_kept()
        data = encode_state(kept, {k: self._state_at.get(k, 0.0) for k in kept}, self.scheduler.affinity_depths(),
                            self.scheduler.affinity_rooms())
        tmp = f"{self.state_path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, self.state_path)
        except OSError as e:
            note = f"cannot write {self.state_path}: {e.strerror or e}"
            if note != self._state_note:
                self._state_note = note
                self._say(note)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def _send(self, c: _Conn, data: bytes) -> None:
        if c.closing:
            return
        if len(c.out) > MAX_OUTPUT_BYTES:
            self._doom(c)  # it stopped reading: bounded output, then disconnected
            return
        c.out += data
        if not c.dirty:
            c.dirty = True
            self._dirty.append(c)

    def _write(self, c: _Conn) -> None:
        if c.out:
            try:
                sent = c.sock.send(c.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._doom(c)
                return
            del c.out[:sent]
        want = bool(c.out)
        if want != c.writing:
            c.writing = want
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self._sel.modify(c.sock, events, c)

    def _alive(self, c: _Conn) -> bool:
        """Is this waiting peer still there?  Asked at grant time: its end-of-file may be queued
        behind the event that freed the slot, in this very turn."""
        if c.closing:
            return False
        try:
            if c.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return True
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            pass
        self._doom(c)
        return False

    def _doom(self, c: _Conn) -> None:
        if not c.closing:
            c.closing = True
            self._doomed.append(c)

    def _close(self, c: _Conn) -> None:
        if c not in self._conns:
            return
        self._conns.discard(c)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()
        self._apply(self.scheduler.disconnect(c, now=self._now))
        self._uncount(c)

    # -- idle-exit --------------------------------------------------------------------------------

    def _idle_exit_delay(self) -> Optional[float]:
        ms = self.idle_exit_ms if self.idle_exit_ms is not None else self.config.daemon_idle_exit_ms
        if ms < 0:
            return None
        return float(min(ms, MAX_TIMER_MS))

    def _count(self, c: _Conn) -> None:
        if not c.counted:
            c.counted = True
            self._counted += 1
            self._ever_counted = True
            self._disarm("exit")  # a counted (re)connect cancels a pending exit

    def _uncount(self, c: _Conn) -> None:
        if c.counted:
            c.counted = False
            self._counted -= 1
            if self._counted == 0:
                self._idle_since = self._now
                self._arm_exit()

    def _arm_exit(self) -> None:
        """With no counted client, exit ``daemonIdleExitMs`` after the last one left; a daemon
        that never had one waits at least 30 s.  Re-armed when a reload changes the delay."""
        delay = self._idle_exit_delay()
        if self._counted or delay is None:
            self._disarm("exit")
            return
        if not self._ever_counted:  # spec: a daemon whose spawner never connects does not linger
            delay = max(delay, float(NO_CLIENT_EXIT_FLOOR_MS))
        self._arm("exit", self._idle_since + delay)

    def _exit_now(self) -> bool:
        """Is it safe to exit for idleness?  Not while a connection is arriving or a peer has
        sent something not yet read: that client would find a daemon that vanishes under it."""
        assert self._listener is not None
        if self._starved or self._backlog or any(c.inbuf for c in self._conns if not c.closing):
            return False  # requests received but not handled yet, or connections being refused
        import select

        try:
            ready = select.poll()  # needs no descriptor of its own: safe when we are out of them
            ready.register(self._listener, select.POLLIN)
            for c in self._conns:
                if not c.closing:
                    ready.register(c.sock, select.POLLIN)
            return not ready.poll(0)
        except (OSError, ValueError, AttributeError):
            return True

    # -- timers -----------------------------------------------------------------------------------

    def _arm(self, name: str, when: float) -> None:
        if self._timers.get(name) != when:
            self._timers[name] = when
            heap = self._timer_heap
            heapq.heappush(heap, (when, name))
            if len(heap) > 2 * len(self._timers) + 16:  # drop the stale entries of re-armed timers
                heap[:] = [(t, n) for n, t in self._timers.items()]
                heapq.heapify(heap)

    def _disarm(self, name: str) -> None:
        self._timers.pop(name, None)

    def _next_timer(self) -> Optional[float]:
        heap = self._timer_heap
        while heap and self._timers.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # lazy deletion: re-armed or disarmed since
        return heap[0][0] if heap else None

    def _run_timers(self) -> None:
        while True:
            when = self._next_timer()
            if when is None or when > self._now:
                return
            _, name = heapq.heappop(self._timer_heap)
            del self._timers[name]
            if name == "sweep":
                self._apply(self.scheduler.sweep(now=self._now))
            elif name == "poll":
                self._poll_config()
                self._arm("poll", self._grid(self._now, self._poll_ms()))
            elif name == "debounce":
                self._debounced()
            elif name == "exit":
                if self._exit_now():
                    self.exit_reason = "idle"
                    self._stopping = True
                else:  # look again after the next turn's input (or the accept pause)
                    self._arm("exit", self._now + (ACCEPT_PAUSE_MS if self._starved else 1.0))
            elif name == "accept" and self._listener is not None:
                self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)

    def _grid(self, at: float, step: float) -> float:
        """The first tick of a ``step`` grid (from daemon start) after ``at``."""
        n = (at - self._origin) // step + 1
        return self._origin + n * step

    def _arm_sweep(self) -> None:
        """Arm the sweep for the first sweep tick at or after the scheduler's next deadline;
        with nothing due (no leases) the sweep sleeps.  Skipped when nothing moved."""
        version = self.scheduler.deadline_version
        if version == self._sweep_version and ("sweep" in self._timers or version[2] == 0):
            return
        self._sweep_version = version
        due = self.scheduler.next_deadline()
        if due is None:
            self._disarm("sweep")
            return
        at = max(due, self._now)
        tick = self._grid(at, self.sweep_ms)
        if tick - self.sweep_ms >= at:  # ``at`` fell exactly on a tick
            tick -= self.sweep_ms
        exact = self.scheduler.next_exact()
        if exact is not None and exact < tick:
            tick = max(exact, self._now)  # a hand-over priced in milliseconds is kept to them
        self._arm("sweep", tick)

    def _poll_ms(self) -> float:
        return float(min(self.sweep_ms, CONFIG_POLL_MS))

    # -- config -----------------------------------------------------------------------------------

    def _watch_signature(self) -> Any:
        sig: list[Any] = []
        for path in (self.config_path, self.models_json):
            try:
                st = os.stat(path)
                sig.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError as e:
                sig.append(e.errno)
        return tuple(sig)

    def _poll_config(self) -> None:
        sig = self._watch_signature()
        if sig != self._watch_sig and "debounce" not in self._timers:
            self._pending_sig = sig
            self._arm("debounce", self._now + CONFIG_DEBOUNCE_MS)

    def _debounced(self) -> None:
        sig = self._watch_signature()
        if sig != self._pending_sig:  # still being written: wait for it to settle
            self._pending_sig = sig
            self._arm("debounce", self._now + CONFIG_DEBOUNCE_MS)
            return
        self._load_config()

    def _load_config(self, startup: bool = False) -> None:
        self._watch_sig = self._watch_signature()
        self._pending_sig = self._watch_sig
        load = load_config(self.config_path)
        catalog_state, catalog = read_catalog(self.models_json)
        if catalog_state not in ("ok", "missing") and not startup:
            catalog = self.catalog  # half-written or unreadable: keep the catalog in use
        if load.state == "unreadable":
            note = "; ".join(load.errors)
            self._config_errors = [f"config unreadable ({note}); "
                                   f"{'serving with defaults' if startup else 'keeping the last good config'}"]
            if note != self._watch_note:  # say it once, not every poll
                keeping = "serving with defaults" if startup else "keeping the last good config"
                self._say(f"config unreadable ({note}); {keeping}")
            self._watch_note = note
            if os.path.exists(self.config_path):
                self._watch_sig = None  # the file is there but would not read: try again next poll
            if not startup:
                return
        elif self._watch_note is not None:
            self._say(f"{self.config_path}: readable again")
            self._watch_note = None
        if load.state in ("torn", "invalid"):
            # The last good config stays (spec).  A half-written file settled through the
            # debounce before this read, so bad JSON here is the file as saved: say so, once per
            # edit, and in ``status`` until a good one is read.
            keeping = "serving with defaults" if startup else "keeping the last good config"
            self._config_errors = [e if e.startswith(self.config_path) else f"{self.config_path}: {e}"
                                   for e in load.errors] + [f"the file is rejected; {keeping}"]
        elif load.state in ("ok", "missing"):
            self._config_errors = []
        if load.state == "torn":
            self._say(f"{load.errors[0]}; {keeping} (fix the file; it is read again when saved)")
            if not startup:
                return
        for warning in load.warnings:
            self._say(f"{self.config_path}: warning: {warning}")
        if load.state == "invalid":
            for error in load.errors:
                self._say(f"{self.config_path}: {error}")
            self._say(f"config rejected; {keeping}")
            if not startup:
                return
        config = load.config if load.state in ("ok", "missing") else Config()
        if not startup and config == self.config and catalog == self.catalog:
            return
        self.config = config
        self.catalog = catalog
        addressing = Addressing(config, catalog)
        if startup:
            self.scheduler = Scheduler(addressing, alive=self._alive)
        else:
            self._apply(self.scheduler.reconfigure(addressing, now=self._now))
            if "exit" in self._timers:
                self._arm_exit()  # a changed daemonIdleExitMs applies to a pending exit

    # -- the event log ----------------------------------------------------------------------------

    @property
    def log_path(self) -> Optional[str]:
        """The event log's path: ``--log-file``, else the config's ``logFile`` (relative to the
        config's folder); None when there is none."""
        if self.log_file or not self.config.log_file:
            return self.log_file
        return config_log_path(self.config_path, self.config.log_file)

    def _flush_log(self) -> None:
        """Append this turn's event lines.  Best effort: every failure is swallowed, because
        observability must never become an availability risk."""
        if not self._log_lines:
            return
        lines, self._log_lines = self._log_lines, []
        path = self.log_path
        if not path:
            return
        ts = _iso_utc(time.time())
        data = "".join(json.dumps(dict(line, ts=ts), separators=(",", ":")) + "\n" for line in lines).encode()
        try:
            # Never block the loop on the log: a FIFO or a device there is refused, not opened
            # for a write that waits for a reader.
            fd = os.open(path,
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
        except (OSError, ValueError):
            return
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                while data:
                    data = data[os.write(fd, data):]
        except OSError:
            pass
        finally:
            os.close(fd)


# =================================================================================================
# The client
#
# ``Client`` is one persistent connection per process, safe to share between threads.  A reader
# thread matches replies to the requests waiting for them (a ``granted`` by its queueKey and
# sessionKey; replies nobody waits for are dropped, never buffered); a beat thread refreshes held
# leases on their own terms; every blocking call waits on its own event.  It starts the daemon on
# demand, and when the daemon cannot be had it lets the work through unqueued (fail-open) unless
# told otherwise.  ``Session`` adds turn-based affinity on top: hold the slot for a whole run.
# =================================================================================================


SPAWN_BACKOFF_S = 10.0  # a daemon that would not start is not spawned again for this long


class DaemonUnavailable(LLMQueueError):
    """The daemon cannot be reached (or died mid-wait) and ``failOpen`` is off."""


class Cancelled(LLMQueueError):
    """A queued acquire was cancelled (an abort) before it was granted."""


class _Pending:
    """One request waiting for its reply."""

    __slots__ = ("event", "reply", "dead", "silent", "cancelled")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply: Optional[dict[str, Any]] = None
        self.dead = False  # the connection went away first
        self.silent = False  # ... and had never answered anything: the daemon was exiting
        self.cancelled = False

    def resolve(self, reply: Optional[dict[str, Any]] = None, *, dead: bool = False,
                silent: bool = False, cancelled: bool = False) -> None:
        self.reply = reply
        self.dead = dead
        self.silent = silent
        self.cancelled = cancelled
        self.event.set()


class Lease:
    """A slot held through a ``Client``: its queue, session, tier and terms.

    While held, the client beats it at its terms' refresh period, except inside
    ``with lease.blocking():``: then the lease is *parked* (one keyed beat says so, and only the
    connection's bare heartbeat keeps it alive), so the daemon hands the slot to a waiter at
    once, and keeps it for us when nobody waits.  ``lost``
    becomes true when a beat learns the slot is gone; ``ensure()`` queues again.  A lease with
    ``queued`` false was let through unqueued because the daemon could not be had (fail-open).
    """

    def __init__(self, client: Client, queue_key: str, session_key: str, role: str,
                 group: Optional[str], activity: bool, spare: bool = False) -> None:
        self.client = client
        self.queue_key = queue_key
        self.session_key = session_key
        self.role = role
        self.group = group
        self.activity = activity
        self.spare = spare and role == "parent"  # may take a parent's spare stream when every slot is held
        # a parent with no person behind it: its acquires say so (``Client.acquire``)
        self.background = False
        self.terms = LeaseTerms.of(DEFAULT_POLICY)
        self.seq: Optional[int] = None
        self.queued = False
        self.lost = False
        self.released = False
        self._blocking = 0
        self._gap_blocking = 0  # of them, the pauses for a tool call between two requests
        self._parked_gap = False  # the daemon was told the pause is a tool call's (``gap``)
        self._turn_blocking = 0  # of them, the pauses at the end of a person's turn (``turn``)
        self._parked_turn = False  # the daemon was told the pause is the end of a turn
        self._next_beat = 0.0
        self._parked = False  # the daemon was told this pause (a parked beat went out)
        self._parent_waiting = False  # the last beat reply said a parent waits for this child's slot
        self._resume = False  # the next acquire asks to queue ahead of its tier (the daemon decides)
        # Between two requests, the daemon told so (a ``handback`` renew went out): a waiting
        # parent gets the slot at once.  Its beats say so too, until the next request's.
        self._handback = False
        # Called (on the beat thread) when a beat reply says the slot is gone: a settled run's
        # release, so the daemon hears at once that the run is over (``Session.settle``).
        self._on_lost: Optional[Callable[[], None]] = None

    def _set_role(self, role: str) -> None:
        """The tier of this lease's next grant (its session was re-tiered); only a parent's
        lease may take a spare stream."""
        self.role = role
        self.spare = self.spare and role == "parent"

    @property
    def held(self) -> bool:
        """True while the daemon holds the slot for us, as far as the last beat knows."""
        return self.queued and not self.lost and not self.released

    def release(self) -> None:
        """Give the slot back now."""
        self.client._finish(self, "release")

    def cancel(self) -> None:
        """Esc: give the slot back now (the daemon's ``cancel``: a holder is released)."""
        self.client._finish(self, "cancel")

    def beat(self, timeout: float = 5.0, busy: bool = False) -> bool:
        """A keyed activity beat now; returns whether the slot is still held.  ``busy``: a
        request starts on it, in the same message (``busy: true``), so no idle-slot hand-over can
        fall between the beat's "still held" and the request."""
        return self.client._beat(self, timeout, busy)

    def ensure(self, timeout: Optional[float] = None, busy: bool = False) -> Lease:
        """Before each request: this request's keyed beat, and if the slot is gone (yielded,
        evicted, the daemon restarted) queue again and wait for it -- a lost lease never streams
        unqueued.  A lease let through unqueued (fail-open) tries to queue again too.  ``busy``:
        the beat also says the request is in flight (a fresh grant is, from the start)."""
        if self.released:
            raise LLMQueueError(f"{self.session_key}: the lease on {self.queue_key} was released")
        handed, self._handback = self._handback, False  # this beat ends the gap
        if self.held and not self.beat(busy=busy):
            self.lost = True
        if self.lost and handed:
            # it gave way in the gap: to a parent (a child queues next after it), or to find out
            # what a switch costs (its return tells); the daemon knows which, and may refuse
            self._resume = True
        if self.lost or not self.queued:
            self.client._reacquire(self, timeout)
        return self

    def blocking(self, gap: bool = False, turn: bool = False) -> _Blocking:
        """A context in which the lease is parked (the run waits on another agent): its keyed
        beat pauses, and a waiter gets the slot at once.  Leaving it resumes the beat at once;
        a slot handed over meanwhile shows as ``lost``, and ``ensure()`` queues again.  ``gap``:
        parked for a tool call between two requests of the run, which comes back; the park says
        so (the renew's ``gap``), and where the server keeps only so many contexts the daemon
        gives the slot only to a waiter whose run evicts none still in use.  ``turn`` (a
        parent's): parked at the end of its turn, a person answers next; the park says so (the
        renew's ``turn``), and the daemon counts its context in use while the person thinks."""
        return _Blocking(self, gap, turn)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "lost" if self.lost else "released" if self.released else "unqueued"
        return f"<Lease {self.queue_key} {self.session_key} {self.role} {state}>"


class _Blocking:
    def __init__(self, lease: Lease, gap: bool = False, turn: bool = False) -> None:
        self.lease = lease
        self.gap = gap
        self.turn = turn and not gap

    def __enter__(self) -> Lease:
        with self.lease.client._cv:
            self.lease._blocking += 1
            self.lease._gap_blocking += self.gap
            self.lease._turn_blocking += self.turn
            self.lease.client._cv.notify_all()
        return self.lease

    def __exit__(self, *exc: Any) -> None:
        client = self.lease.client
        with client._cv:
            self.lease._blocking -= 1
            self.lease._gap_blocking -= self.gap
            self.lease._turn_blocking -= self.turn
            self.lease._next_beat = 0.0  # work resumes: beat at once
            client._cv.notify_all()


def _default_warning(message: str) -> None:
    import logging

    logging.getLogger("llmqueue").warning("%s", message)


def daemon_command(agent_dir: str) -> list[str]:
    """The command that starts a daemon for ``agent_dir``: this interpreter with ``-S`` (the daemon
    needs no site-packages), loading this module through an import -- a script is compiled afresh
    on every start, an imported module loads from its __pycache__."""
    here = os.path.abspath(__file__)
    # sys.path[0] is the module's own directory, as for ``python llmqueue.py``: with -c it would be
    # the current directory, where a stray json.py of the caller's project could shadow ours.
    launcher = ("import sys; sys.path[0] = sys.argv.pop(1); "
                "sys.exit(__import__(sys.argv.pop(1)).main(sys.argv[1:]))")
    return [sys.executable or "python3", "-S", "-c", launcher, os.path.dirname(here),
            os.path.splitext(os.path.basename(here))[0], "--agent-dir", agent_dir]


class Client:
    """A connection to the llmqueue daemon, shared by every thread of a process.

    ``fail_open`` and ``queue_timeout_ms`` default to the config's ``failOpen`` and
    ``queueTimeoutMs`` (read once, at the first connect).  ``on_warning(message)`` hears the
    fail-open and queue-wait warnings (default: the ``logging`` module); ``on_position(lease,
    position)`` hears a waiting acquire's place in its queue (1 is next), polled at 300 ms and
    then every 2 s.
    """

    def __init__(self, agent_dir: Optional[str] = None, *, socket_path: Optional[str] = None,
                 config_path: Optional[str] = None, models_json: Optional[str] = None,
                 autostart: bool = True, fail_open: Optional[bool] = None,
                 queue_timeout_ms: Optional[int] = None,
                 on_warning: Optional[Callable[[str], None]] = None,
                 on_position: Optional[Callable[[Lease, int], None]] = None,
                 spawn_timeout: float = 5.0, log_file: Optional[str] = None) -> None:
        self.agent_dir = agent_dir or default_agent_dir()
        # the event log of a daemon this client starts (its --log-file); a running one keeps its own
        self.log_file = os.path.abspath(os.path.expanduser(log_file)) if log_file else None
        self._paths = (socket_path, config_path, models_json)
        self.socket_path = socket_path or os.path.join(self.agent_dir, "llm-queue.sock")
        self.config_path = config_path or os.path.join(self.agent_dir, "llm-queue.json")
        self.models_json = models_json or os.path.join(self.agent_dir, "models.json")
        self.autostart = autostart
        self._fail_open = fail_open
        self._queue_timeout_ms = queue_timeout_ms
        self.on_warning = on_warning or _default_warning
        self.on_position = on_position
        self.spawn_timeout = spawn_timeout
        self.config = Config()
        self.addressing = Addressing()
        self._config_read = False
        self._cv = threading.Condition(threading.RLock())  # guards everything below
        self._send_lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._generation = 0
        self._acquires: dict[tuple[str, str], list[_Pending]] = {}
        self._beats: dict[tuple[str, str], list[_Pending]] = {}
        self._statuses: list[_Pending] = []
        # Every Lease object per (queue, session): several threads may hold the same session's
        # slot; the daemon's slot goes back when the last of them is released.
        self._leases: dict[tuple[str, str], list[Lease]] = {}
        self._recent_gaps: deque[float] = deque(maxlen=8)  # its sessions' tool gaps: a new one's first guess
        self._switch_costs: OrderedDict[str, str] = OrderedDict()  # per queue key, from usage replies
        self._streams_auto: OrderedDict[str, None] = OrderedDict()  # the same: queues of maxStreams "auto"
        self._props: OrderedDict[str, Optional[SlotStore]] = OrderedDict()  # their servers' /props, per queue key
        # per queue key, per session: a subagent's gap park, run at once should the queue learn
        # meanwhile that switches are cheap (the usage reply that says so comes after the gap began)
        self._when_cheap: OrderedDict[str, dict[str, Callable[[], None]]] = OrderedDict()
        self._cancels: dict[tuple[str, str], int] = {}  # cancel generation per (queue, session)
        self._heard = False  # the current connection has delivered a reply
        self._greeted = -1  # the connection generation that was sent its opening renew
        self._later: list[tuple[float, int, Callable[[], None]]] = []
        self._later_seq = 0
        self._next_bare = 0.0
        self._worker: Optional[threading.Thread] = None
        self._warned_unreachable = False
        self._closed = False
        self._spawned: list[Any] = []
        self._spawn_backoff_until = 0.0
        self._sessions_made = 0

    # -- configuration ------------------------------------------------------------------------

    @property
    def fail_open(self) -> bool:
        if self._fail_open is not None:
            return self._fail_open
        if not self._config_read:  # no daemon answered yet: the config still says
            self._read_config()
        return self.config.fail_open

    @property
    def queue_timeout_ms(self) -> int:
        return self.config.queue_timeout_ms if self._queue_timeout_ms is None else self._queue_timeout_ms

    def _read_config(self) -> None:
        """The client's own copy of the config: failOpen and queueTimeoutMs (read once), and the
        addressing and default terms it falls back on when a daemon sends none."""
        load = load_config(self.config_path)
        config = load.config if load.state in ("ok", "missing") else Config()
        if not self._config_read:
            self.config = config
            self._config_read = True
            if load.state in ("torn", "invalid"):  # once: its daemon's stderr may reach nobody
                self.on_warning(f"llmqueue: {'; '.join(load.errors)}; this client uses the defaults "
                                "(`llmqueue check-config` lists every error)")
        self.addressing = Addressing(config, load_catalog(self.models_json))

    # -- the connection -----------------------------------------------------------------------

    def _owner(self, queue_key: str, session_key: str) -> tuple[str, str]:
        """The (queue, session) the daemon counts a slot by: two spellings of one queue are one."""
        return self.addressing.address_endpoint(queue_key)[0], session_key

    def _try_connect(self) -> Optional[socket.socket]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            return None
        except OSError as e:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to {self.socket_path}: {e.strerror or e}"
                                    f"{self._why_no_daemon()}") from None
        return sock

    def _spawn(self) -> None:
        """Start a daemon detached: its own session, stdio to /dev/null, this interpreter with
        ``-S`` (it needs no site-packages), this agent dir.  Two clients racing here are fine:
        the daemon resolves the race itself."""
        import subprocess

        command = daemon_command(self.agent_dir)
        for flag, value in zip(("--socket", "--config", "--models-json", "--log-file"),
                               self._paths + (self.log_file,)):
            if value:
                command += [flag, value]
        for proc in self._spawned:
            proc.poll()  # reap a daemon we started that has since exited
        self._spawned = [p for p in self._spawned if p.returncode is None]
        try:
            self._spawned.append(subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True, cwd="/"))
        except OSError:
            pass  # the connect below reports the daemon as unreachable

    def _why_no_daemon(self) -> str:
        """What stands in the way of a daemon, when it can be seen from here: an agent dir that
        cannot be made or written, or a daemon we started that failed."""
        folder = os.path.dirname(self.socket_path) or "."
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if not os.access(folder, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            way = ("pass a --socket in a directory you can write" if self._paths[0] else
                   "pass --agent-dir, or set LLMQUEUE_DIR, to a directory you can write")
            return f" (cannot create or write {folder}: {e.strerror or e}; {way})"
        failed = [p.returncode for p in self._spawned if p.poll() not in (None, 0)]
        if failed:
            return (f" (the daemon it started exited with status {failed[-1]}: run "
                    f"'python3 {os.path.abspath(__file__)} --agent-dir {self.agent_dir}' to see why)")
        return ""

    def _connect(self) -> socket.socket:
        """The live connection, made (and the daemon started) if need be.  Holds ``_cv``."""
        if self._sock is not None:
            return self._sock
        if self._closed:
            raise LLMQueueError("the client is closed")
        sock = self._try_connect()
        # After a spawn that never answered, do not stall every request on another one for a
        # while: fail fast (and open) until the back-off has passed.
        if sock is None and self.autostart and time.monotonic() >= self._spawn_backoff_until:
            self._spawn()
            deadline = time.monotonic() + self.spawn_timeout
            pause = 0.005
            respawn_at = 0.0
            while sock is None and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
                sock = self._try_connect()
                now = time.monotonic()
                if (sock is None and now >= respawn_at and self._spawned
                        and all(p.poll() == 0 for p in self._spawned)):
                    # Ours gave way (exit 0) to a daemon that has since gone too (an idle-exit):
                    # start another; the daemons settle between themselves which one serves.  A
                    # daemon that failed (a bad socket path, say) is not started again.
                    respawn_at = now + 0.2
                    self._spawn()
        if sock is None:
            self._spawn_backoff_until = time.monotonic() + SPAWN_BACKOFF_S
            raise DaemonUnavailable(f"no daemon answers on {self.socket_path}{self._why_no_daemon()}")
        self._read_config()
        self._sock = sock
        self._heard = False
        self._generation += 1
        reader = threading.Thread(target=self._read_loop, args=(sock, self._generation),
                                  name="llmqueue-reader", daemon=True)
        reader.start()
        return sock

    def _send(self, *messages: dict[str, Any], connect: bool = True, generation: Optional[int] = None,
              then: Optional[Callable[[], None]] = None, still: Optional[Callable[[], bool]] = None) -> None:
        """Send requests (in one write); raises DaemonUnavailable when there is no daemon to send it to, or
        (given ``generation``) when the connection is no longer the one the caller expects.  ``then``
        runs (holding ``_cv``) just before the write, in the order of the writes: what waits for
        the reply takes its place in the order of the replies.  ``still`` (asked holding ``_cv``,
        in that order too): whether the message still says what is so; if not, nothing is sent."""
        with self._send_lock:
            with self._cv:
                sock = self._connect() if connect else self._sock
                if sock is None or (generation is not None and generation != self._generation):
                    raise DaemonUnavailable("not connected")
                live = self._generation
                if still is not None and not still():
                    return
                if then is not None:
                    then()
            try:
                sock.sendall(b"".join(_line(m) for m in messages))
                return
            except OSError as e:
                why = e.strerror or str(e)
        self._connection_lost(sock, live)  # what waits on it is let go
        raise DaemonUnavailable(f"the daemon went away: {why}")

    def _read_loop(self, sock: socket.socket, generation: int) -> None:
        buf = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    try:
                        reply = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(reply, dict):
                        self._dispatch(reply)
        except OSError:
            pass
        self._connection_lost(sock, generation)

    def _dispatch(self, reply: dict[str, Any]) -> None:
        op = reply.get("op")
        key: tuple[str, str] = (str(reply.get("queueKey")), str(reply.get("sessionKey")))
        with self._cv:
            self._heard = True
            if op == "granted":
                for pending in self._acquires.pop(key, ()):
                    pending.resolve(reply)
            elif op == "ok" and "granted" in reply:
                hint = reply.get("parentWaiting") is True
                for lease in self._leases.get(self._owner(*key), ()):
                    lease._parent_waiting = hint
                if reply.get("granted") is False:
                    for lease in self._leases.get(self._owner(*key), ()):
                        if lease.queued:
                            lease.lost = True
                            self._lost_now(lease)
                self._answer_beat(key, reply)
            elif op == "status":
                if self._statuses:
                    self._statuses.pop(0).resolve(reply)
            elif op == "ok" and reply.get("switchCost") in ("cheap", "dear", "unknown"):
                cost = str(reply["switchCost"])
                if reply.get("streams") == "auto":
                    self._streams_auto[key[0]] = None
                    while len(self._streams_auto) > 1024:
                        self._streams_auto.popitem(last=False)
                else:
                    self._streams_auto.pop(key[0], None)
                was = self._switch_costs.pop(key[0], None)
                self._switch_costs[key[0]] = cost
                while len(self._switch_costs) > 1024:
                    self._switch_costs.popitem(last=False)
                if cost == "cheap" and was != "cheap":  # a subagent in a gap keeps nobody waiting now
                    for park in self._when_cheap.pop(key[0], {}).values():
                        self.call_later(0.0, park)
            elif op == "error" and reply.get("request") == "renew":
                self._answer_beat(key, reply)  # a keyed renew refused (a client's bug): that one's
            # anything else (a release's ok, a bare renew's ok, another error) has nobody waiting

    def _answer_beat(self, key: tuple[str, str], reply: dict[str, Any]) -> None:
        """A reply to a keyed renew answers the session's oldest beat still waiting (under ``_cv``)."""
        waiting = self._beats.get(key)
        if waiting:
            waiting.pop(0).resolve(reply)
            if not waiting:
                del self._beats[key]

    def _connection_lost(self, sock: socket.socket, generation: int) -> None:
        """The daemon is gone: whoever waits is released, and every held slot is lost (the next
        ``ensure`` queues again on a fresh daemon)."""
        with self._cv:
            if generation != self._generation or self._sock is None:
                return
            self._sock = None
            silent = not self._heard
            for waiting in list(self._acquires.values()) + list(self._beats.values()) + [self._statuses]:
                for pending in waiting:
                    pending.resolve(dead=True, silent=silent)
            self._acquires.clear()
            self._beats.clear()
            self._statuses = []
            for group in self._leases.values():
                for lease in group:
                    if lease.queued:
                        lease.lost = True
            self._cv.notify_all()
        try:
            sock.close()
        except OSError:
            pass

    def _unreachable(self, lease: Lease, why: str) -> Lease:
        """Fail-open: the work goes ahead unqueued, with one warning; or fail closed."""
        if not self.fail_open:
            raise DaemonUnavailable(f"{why}; failOpen is off, so {lease.queue_key} is not served")
        if not self._warned_unreachable:
            self._warned_unreachable = True
            self.on_warning(f"llmqueue: {why}; proceeding unqueued (failOpen)")
        lease.queued = False
        lease.lost = False
        return lease

    # -- requests -----------------------------------------------------------------------------

    def acquire(self, queue_key: str, session_key: Optional[str] = None, role: str = "parent",
                group: Optional[str] = None, activity: bool = True,
                timeout: Optional[float] = None, spare: bool = False, background: bool = False) -> Lease:
        """Wait for a slot of ``queue_key`` and return the Lease.  ``timeout`` (seconds) cancels
        the request and raises TimeoutError; another thread's ``cancel`` raises Cancelled.
        ``spare``: a parent that finds every slot held by others streams at once on one of the
        queue's spare streams (``parentStreams``, 1 by default) if one is free; for a server
        that runs more than one request at a time.  ``background``: a parent with no person
        behind it (the proxy's unnamed conversations while no person is in sight): where the
        server keeps only so many contexts it may wait, as a child does, for one still in use.
        ``Lease.background`` says it for the lease's later acquires."""
        if not isinstance(queue_key, str) or not queue_key:
            raise ValueError("queue_key must be a non-empty string")
        if role not in ROLES:
            raise ValueError(f"role must be parent or child (got {role!r})")
        if not session_key:  # a session of its own: threads never share a slot by accident
            with self._cv:
                self._sessions_made += 1
                session_key = f"pid{os.getpid()}-{self._sessions_made}"
        lease = Lease(self, queue_key, session_key, role, group, activity, spare)
        lease.background = background
        self._wait_for_grant(lease, timeout)
        return lease

    def _when_lost(self, lease: Lease, callback: Callable[[], None]) -> None:
        """``callback`` runs (on the beat thread) once a beat reply says the lease's slot is
        gone, or soon if it is gone already; the lease's next ``ensure`` forgets it."""
        with self._cv:
            lease._on_lost = callback
            if lease.lost:
                self._lost_now(lease)

    def _lost_now(self, lease: Lease) -> None:
        callback, lease._on_lost = lease._on_lost, None
        if callback is not None:
            self.call_later(0.0, callback)

    def _reacquire(self, lease: Lease, timeout: Optional[float]) -> None:
        lease._on_lost = None
        lease.lost = False
        self._wait_for_grant(lease, timeout)

    def _give_back(self, lease: Lease) -> None:
        """A child at a request boundary while a parent waits: the slot goes to the parent now,
        and the lease's next acquire (at its next request) queues ahead of the other children."""
        lease.lost = True
        lease._parent_waiting = False
        lease._resume = True  # until the next grant
        self._quietly({"op": "release", "queueKey": lease.queue_key, "sessionKey": lease.session_key})

    def _wait_for_grant(self, lease: Lease, timeout: Optional[float]) -> None:
        with self._cv:
            cancels = self._cancels.get(self._owner(lease.queue_key, lease.session_key), 0)
        start = time.monotonic()
        pause = 0.005
        while True:
            left = None if timeout is None else max(0.0, start + timeout - time.monotonic())
            pending = self._request_grant(lease, left)
            if pending is None:
                return  # let through unqueued (fail-open)
            # A connection that died before it ever answered met a daemon in the act of exiting
            # (idle-exit), so no daemon took the request: ask again, which reaches or starts a
            # fresh one.  Under churn several may exit in a row; ask for as long as a daemon is
            # given to start, then go ahead unqueued.
            if not (pending.dead and pending.silent and time.monotonic() - start < self.spawn_timeout):
                lease._resume = False  # answered: a hand-back's priority is used once
                self._take_grant(lease, pending, cancels)
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def _request_grant(self, lease: Lease, timeout: Optional[float]) -> Optional[_Pending]:
        """Send the acquire and wait for its answer (a grant, a cancel, or a dead connection)."""
        key = (lease.queue_key, lease.session_key)
        pending = _Pending()
        try:
            with self._cv:
                self._connect()
                self._acquires.setdefault(key, []).append(pending)
                generation = self._generation
                greet = self._greeted != generation
                self._greeted = generation
            if greet:
                with self._cv:
                    self._heard = False  # from here on: has this connection answered anything?
                # A fresh connection opens with a bare renew: its immediate ok proves the daemon
                # is serving, so a connection that dies before any reply at all can only be one
                # that met a daemon in the very act of exiting (and is asked again), never a
                # daemon that died while we waited (which lets the waiter go: fail-open).
            # On the connection it was registered on: if that one dies first, the pending is
            # released (dead) with it, never silently re-sent elsewhere.
            message = {"op": "acquire", "queueKey": lease.queue_key, "sessionKey": lease.session_key,
                       "role": lease.role, "group": lease.group, "activity": lease.activity}
            if lease._resume:
                message["resume"] = True
            if lease.spare:
                message["spare"] = True
            if lease.background and lease.role == "parent":
                message["background"] = True
            # The greeting and the acquire go in one write, so the daemon reads them in one turn:
            # it can never answer the greeting and then exit idle before the acquire arrives.
            greeting = [{"op": "renew"}] if greet else []
            self._send(*greeting, message, connect=False, generation=generation)
        except DaemonUnavailable as e:
            if pending.dead:
                return pending  # the connection broke under the send: the caller may ask again
            with self._cv:
                mine = self._acquires.get(key, [])
                if pending in mine:
                    mine.remove(pending)
                    if not mine:
                        del self._acquires[key]
            self._unreachable(lease, str(e))
            return None
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        warn_at = None
        if lease.role == "parent" and self.queue_timeout_ms > 0:  # a child's wait is unlimited
            warn_at = start + self.queue_timeout_ms / 1000.0
        poll_at = start + 0.3 if self.on_position is not None else None
        try:
            while True:
                due = [t for t in (deadline, warn_at, poll_at) if t is not None]
                wait = None if not due else max(0.0, min(due) - time.monotonic())
                if pending.event.wait(wait):
                    break
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"no slot of {lease.queue_key} within {timeout} s")
                if warn_at is not None and now >= warn_at:
                    warn_at = None  # warned once; it stays queued
                    self.on_warning(f"llmqueue: {lease.session_key} has waited {self.queue_timeout_ms} ms "
                                    f"for {lease.queue_key}; still queued")
                if poll_at is not None and now >= poll_at:
                    poll_at = now + 2.0
                    position = self._position(lease)
                    if position is not None and self.on_position is not None:
                        self.on_position(lease, position)
        except BaseException:
            # Ctrl-C, a timeout, a failing callback: the request must not stay queued -- unless
            # another thread still waits for, or holds, this session's slot (they share it).
            owner = self._owner(lease.queue_key, lease.session_key)
            with self._cv:
                mine = self._acquires.get(key, [])
                if pending in mine:
                    mine.remove(pending)
                    if not mine:
                        del self._acquires[key]
                shared = bool(self._leases.get(owner)) or any(
                    self._owner(*asked) == owner for asked in self._acquires)
            if not shared:  # cancel drops the waiter, and releases the slot if the grant won the race
                self._quietly({"op": "cancel", "queueKey": lease.queue_key, "sessionKey": lease.session_key})
            raise
        return pending

    def _take_grant(self, lease: Lease, pending: _Pending, cancels: int) -> None:
        key = self._owner(lease.queue_key, lease.session_key)
        with self._cv:
            if self._closed:
                raise LLMQueueError(f"the client was closed while {lease.session_key} waited")
            cancelled = pending.cancelled or self._cancels.get(key, 0) != cancels
        if cancelled:
            if pending.reply is not None:  # granted, but an abort came first: give it back
                self._quietly({"op": "cancel", "queueKey": lease.queue_key, "sessionKey": lease.session_key})
            raise Cancelled(f"{lease.session_key}: cancelled while queued for {lease.queue_key}")
        if pending.dead or pending.reply is None:
            self._unreachable(lease, f"the daemon went away while {lease.session_key} waited")
            return
        fallback = LeaseTerms.of(self.addressing.address_endpoint(lease.queue_key)[1])
        lease.terms = LeaseTerms.from_wire(pending.reply, fallback)
        seq = pending.reply.get("seq")
        lease.seq = seq if _is_int(seq) else None
        lease.queued = True
        lease.lost = False
        lease.released = False
        with self._cv:
            if self._closed:
                raise LLMQueueError(f"the client was closed while {lease.session_key} waited")
            raced = self._cancels.get(key, 0) != cancels  # an abort raced the grant to here
            if raced:
                lease.released = True
            else:
                lease._next_beat = time.monotonic() + lease.terms.refresh_period_ms() / 1000.0
                group = self._leases.setdefault(key, [])
                if lease not in group:
                    group.append(lease)
                self._start_worker()
                self._cv.notify_all()
        if raced:  # sent outside the lock: a send never waits while holding it
            self._quietly({"op": "cancel", "queueKey": lease.queue_key, "sessionKey": lease.session_key})
            raise Cancelled(f"{lease.session_key}: cancelled while queued for {lease.queue_key}")

    def _quietly(self, message: dict[str, Any]) -> None:
        try:
            self._send(message, connect=False)
        except DaemonUnavailable:
            pass

    def cancel(self, queue_key: str, session_key: str) -> None:
        """Esc for a session: its queued acquire (in any thread) raises Cancelled, and a slot it
        holds is released.  The daemon does both at once."""
        key = self._owner(queue_key, session_key)
        with self._cv:
            if len(self._cancels) > 1024:  # forget the sessions nothing waits on or holds any more
                busy = {self._owner(*k) for k in self._acquires} | set(self._leases)
                self._cancels = {k: v for k, v in self._cancels.items() if k in busy}
            self._cancels[key] = self._cancels.get(key, 0) + 1
            for asked, pendings in list(self._acquires.items()):
                if self._owner(*asked) == key:
                    del self._acquires[asked]
                    for pending in pendings:
                        pending.resolve(cancelled=True)
            for lease in self._leases.pop(key, ()):
                lease.released = True
        self._quietly({"op": "cancel", "queueKey": queue_key, "sessionKey": session_key})

    def _finish(self, lease: Lease, op: str) -> None:
        """``release``: the slot goes back when the last Lease of its session lets go.
        ``cancel``: it goes back now, for every Lease of the session."""
        if op == "cancel":
            if not lease.released:
                self.cancel(lease.queue_key, lease.session_key)
                lease.released = True
            return
        key = self._owner(lease.queue_key, lease.session_key)
        with self._cv:
            if lease.released:
                return
            lease.released = True
            group = self._leases.get(key, [])
            if lease in group:
                group.remove(lease)
            if group:
                return  # another Lease of this session still uses the slot
            self._leases.pop(key, None)
        if lease.queued:
            self._quietly({"op": op, "queueKey": lease.queue_key, "sessionKey": lease.session_key})

    def _beat(self, lease: Lease, timeout: float, busy: bool = False) -> bool:
        if not lease.held:
            return False
        with self._cv:
            if self._sock is None:
                lease.lost = True
                return False
            for user in self._leases.get(self._owner(lease.queue_key, lease.session_key), ()):
                user._parked = False  # an activity beat un-parks the slot: a later pause parks it again
        message: dict[str, Any] = {"op": "renew", "queueKey": lease.queue_key, "sessionKey": lease.session_key}
        if lease._handback:
            message["handback"] = True  # still between two requests: the beat keeps the gap
        if busy:
            message["busy"] = True
        try:
            pending = self._send_beat(lease, message)
        except DaemonUnavailable:
            return False
        if not pending.event.wait(timeout) or pending.reply is None or "granted" not in pending.reply:
            return lease.held  # no answer (or a refusal): as far as we know
        return pending.reply.get("granted") is True

    def _send_beat(self, lease: Lease, message: dict[str, Any],
                   still: Optional[Callable[[], bool]] = None) -> _Pending:
        """Send a keyed renew, and return its place in the order of their replies.  The daemon
        answers in the order the renews went out, so each one takes its place as it is sent, the
        background beats' and the busy marks' too: otherwise a late reply to an earlier renew (a
        park mark's \"still held\") would answer a later beat."""
        key = (lease.queue_key, lease.session_key)
        pending = _Pending()
        self._send(message, connect=False, then=lambda: self._beats.setdefault(key, []).append(pending),
                   still=still)
        return pending

    def usage(self, queue_key: str, session_key: str, prefilled: int, reused: int = 0,
              prefill_ms: Optional[float] = None, server: Optional[tuple[int, int]] = None,
              decode: Optional[tuple[int, float]] = None) -> None:
        """Report one request's prompt tokens as the model server counted them: ``prefilled``
        computed afresh, ``reused`` served from its cache (llama.cpp's ``timings.prompt_n`` and
        ``cache_n``; OpenAI's ``prompt_tokens`` less ``cached_tokens``, and ``cached_tokens``).
        ``prefill_ms``: how long the prefill took (llama.cpp's ``timings.prompt_ms``, else the
        time to the stream's first token): the server's prefill rate, which prices a switch.
        ``server``: how many requests the server runs at once and the tokens one may hold
        (llama.cpp's ``/props``: ``total_slots`` and ``default_generation_settings.n_ctx``), which
        a queue of ``maxStreams: "auto"`` goes by.  ``decode``: the tokens the server generated
        and the milliseconds that took (llama.cpp's ``timings.predicted_n`` and ``predicted_ms``),
        logged with how many requests ran at once (``llmqueue report`` adds them up).
        They go to the event log (``llmqueue report``) and the queue's totals in ``status``.
        Never blocks, never raises for a daemon that is gone."""
        message: dict[str, Any] = {"op": "usage", "queueKey": queue_key, "sessionKey": session_key,
                                   "prefilled": int(prefilled), "reused": int(reused)}
        if prefill_ms is not None and 0 <= prefill_ms <= MAX_PREFILL_MS:
            message["prefillMs"] = round(float(prefill_ms), 3)
        if server is not None and 0 < server[0] <= MAX_SERVER_SLOTS and 0 < server[1] <= MAX_TOKENS:
            message["slots"], message["slotContext"] = int(server[0]), int(server[1])
        if decode is not None and 0 <= decode[0] <= MAX_TOKENS and 0 <= decode[1] <= MAX_PREFILL_MS:
            message["decoded"], message["decodeMs"] = int(decode[0]), round(float(decode[1]), 3)
        self._quietly(message)

    def _park_when_cheap(self, queue_key: str, session_key: str, park: Callable[[], None]) -> None:
        """Run ``park`` (a session's gap park, void once the gap is over) as soon as a usage reply
        says that switches of ``queue_key``'s slot are cheap."""
        with self._cv:
            if self._switch_costs.get(queue_key) == "cheap":  # the reply came meanwhile
                self.call_later(0.0, park)
                return
            parks = self._when_cheap.pop(queue_key, None) or {}
            parks.pop(session_key, None)
            parks[session_key] = park  # its latest gap's
            while len(parks) > 256:
                del parks[next(iter(parks))]
            self._when_cheap[queue_key] = parks
            while len(self._when_cheap) > 1024:
                self._when_cheap.popitem(last=False)

    def _gap_over(self, queue_key: str, session_key: str) -> None:
        """The session's gap ended: its park is void, and is forgotten."""
        with self._cv:
            parks = self._when_cheap.get(queue_key)
            if parks is not None:
                parks.pop(session_key, None)
                if not parks:
                    del self._when_cheap[queue_key]

    def streams_auto(self, queue_key: str) -> bool:
        """Whether the daemon said, answering a usage report, that ``queue_key``'s ``maxStreams``
        is ``"auto"``: its reports should then carry the server's figures (``usage``'s ``server``)."""
        with self._cv:
            return queue_key in self._streams_auto

    def server_figures(self, queue_key: str) -> Optional[tuple[int, int]]:
        """The server's slots and the tokens one slot holds (its ``/props``), for a queue whose
        ``maxStreams`` the daemon said is ``"auto"``; None elsewhere, or where the queue key is
        no server URL or its server does not say.  The server is asked once (``SlotStore``)."""
        if not self.streams_auto(queue_key):
            return None
        with self._cv:
            if queue_key not in self._props:
                try:
                    self._props[queue_key] = SlotStore(queue_key, 1)
                except ValueError:  # a provider's name, not a URL
                    self._props[queue_key] = None
                while len(self._props) > 64:
                    self._props.popitem(last=False)
            store = self._props[queue_key]
        return store.figures() if store is not None else None

    def switch_cost(self, queue_key: str) -> str:
        """What a switch of ``queue_key``'s slot costs, as the daemon last answered a usage report
        for it: ``cheap`` (the server keeps the contexts of sessions that step away), ``dear``
        (it re-prefills them), or ``unknown`` (no report yet, or no session came back yet)."""
        with self._cv:
            return self._switch_costs.get(queue_key, "unknown")

    def status(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The daemon's ``status`` queues (starting the daemon if need be)."""
        queues = self.status_reply(timeout).get("queues")
        return queues if isinstance(queues, list) else []

    def status_reply(self, timeout: float = 5.0) -> dict[str, Any]:
        """The daemon's whole ``status`` reply (starting the daemon if need be): its queues, and
        where it logs (``logFile``) and what is wrong with its config (``configErrors``), if so."""
        pending = _Pending()
        with self._cv:
            self._connect()
            self._statuses.append(pending)
        self._send({"op": "status"})
        if not pending.event.wait(timeout) or pending.reply is None:
            raise DaemonUnavailable("no status reply from the daemon")
        return pending.reply

    def _position(self, lease: Lease) -> Optional[int]:
        """Where the session waits (1 is next), in enqueue order, as ``status`` shows it: in the
        queue that owns the key it asked with (a group's name for a member key)."""
        try:
            queues = self.status(timeout=2.0)
        except DaemonUnavailable:
            return None
        owner = self.addressing.address_endpoint(lease.queue_key)[0]
        ranked = sorted(queues, key=lambda q: q.get("queueKey") not in (owner, lease.queue_key))
        for q in ranked:
            for i, w in enumerate(q.get("waiting") or []):
                if isinstance(w, dict) and w.get("sessionKey") == lease.session_key:
                    return i + 1
        return None

    def session(self, queue_key: str, session_key: Optional[str] = None, role: str = "parent",
                group: Optional[str] = None, grace_ms: int = GRACE_MS,
                yield_on_settle: Optional[bool] = None, slots: Optional[SlotStore] = None,
                spare: Optional[bool] = None) -> Session:
        """A Session: turn-based affinity for one agent session on one queue.  ``slots``: the
        model server's SlotStore (one per server, shared by the sessions), to park contexts in
        llama.cpp's slot files at a switch.  ``spare``: whether a parent streams beside the
        subagents on a spare stream rather than wait for them (None: yes, unless ``slots`` knows
        the server runs one request at a time)."""
        return Session(self, queue_key, session_key, role, group, grace_ms, yield_on_settle, slots, spare)

    def close(self) -> None:
        """Say ``bye`` (everything this process holds or queued is let go now) and disconnect.
        A closed client raises LLMQueueError on any further request."""
        with self._cv:
            if self._closed:
                return
            self._closed = True  # first: a racing acquire must not reconnect behind our back
            sock = self._sock
            for group in self._leases.values():
                for lease in group:
                    lease.released = True
            self._leases.clear()
            self._cv.notify_all()
        if sock is not None:
            self._quietly({"op": "bye"})
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._connection_lost(sock, self._generation)
        for proc in self._spawned:
            proc.poll()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the beat thread ----------------------------------------------------------------------

    def call_later(self, delay: float, callback: Callable[[], None]) -> Callable[[], None]:
        """Run ``callback`` on the beat thread after ``delay`` seconds; returns a canceller."""
        entry_box: list[Any] = []

        def run() -> None:
            if entry_box:
                callback()

        with self._cv:
            self._later_seq += 1
            entry = (time.monotonic() + delay, self._later_seq, run)
            entry_box.append(entry)
            heapq.heappush(self._later, entry)
            self._start_worker()
            self._cv.notify_all()

        def cancel() -> None:
            with self._cv:
                entry_box.clear()

        return cancel

    def _start_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="llmqueue-beat", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        """Keyed beats for held leases not inside ``blocking()``, each at its terms' period;
        one bare heartbeat for the connection at the smallest period of the paused ones; and
        the delayed calls (a Session's grace release)."""
        while True:
            actions: list[Callable[[], None]] = []
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                wake = now + 60.0
                paused_period: Optional[float] = None
                for group in self._leases.values():
                    held = [lease for lease in group if lease.held]
                    if not held:
                        continue
                    period = min(lease.terms.refresh_period_ms() for lease in held) / 1000.0
                    active = [lease for lease in held if not lease._blocking]
                    if not active:  # every user of the slot waits on another agent: parked
                        paused_period = period if paused_period is None else min(paused_period, period)
                        gap = all(lease._gap_blocking == lease._blocking for lease in held)
                        turn = all(lease._turn_blocking == lease._blocking for lease in held)
                        if ((not held[0]._parked or held[0]._parked_gap != gap or held[0]._parked_turn != turn)
                                and any(lease.activity for lease in held)):
                            for lease in held:  # a park, or the same park for another reason
                                lease._parked, lease._parked_gap, lease._parked_turn = True, gap, turn
                            actions.append(self._beat_action(held[0], parked=True, gap=gap, turn=turn))
                        continue
                    for lease in held:
                        lease._parked = False  # its activity beat un-parks it
                    if all(lease._handback for lease in active):
                        # between two requests (a handback renew said so): a keyed beat would end
                        # the gap, so the bare heartbeat keeps the lease until the next request's
                        paused_period = period if paused_period is None else min(paused_period, period)
                        continue
                    if min(lease._next_beat for lease in active) <= now:  # one beat per session
                        for lease in active:
                            lease._next_beat = now + period
                        actions.append(self._beat_action(active[0]))
                    wake = min(wake, min(lease._next_beat for lease in active))
                if paused_period is not None:
                    if self._next_bare <= now:
                        self._next_bare = now + paused_period
                        actions.append(lambda: self._quietly({"op": "renew"}))
                    wake = min(wake, self._next_bare)
                while self._later and self._later[0][0] <= now:
                    actions.append(heapq.heappop(self._later)[2])
                if self._later:
                    wake = min(wake, self._later[0][0])
                if not actions:
                    self._cv.wait(max(0.0, wake - now))
                    continue
            for action in actions:
                try:
                    action()
                except Exception as e:  # a failing callback must not stop the beats
                    self.on_warning(f"llmqueue: background call failed: {e!r}")

    def _beat_action(self, lease: Lease, parked: bool = False, gap: bool = False,
                     turn: bool = False) -> Callable[[], None]:
        message: dict[str, Any] = {"op": "renew", "queueKey": lease.queue_key, "sessionKey": lease.session_key}
        if parked:
            message["parked"] = True  # additive: an older daemon ignores it (and idle-yields later)
            if gap:
                message["gap"] = True  # additive, likewise: parked for a tool call, it comes back
            elif turn:
                message["turn"] = True  # additive, likewise: a person's turn is over

        def send() -> None:
            try:
                # its reply answers nobody, in its turn; a park only while the lease is still
                # parked: a request that began since (its beat un-parked it) is streaming, and a
                # park that reached the daemon after that beat would idle a live holder
                self._send_beat(lease, message, still=(lambda: lease._parked) if parked else None)
            except DaemonUnavailable:
                pass

        return send

    def _turn_over(self, lease: Lease) -> None:
        """A person's turn is over, but the lease's slot was handed over at its last request's
        end: a ``turn`` park all the same, so the daemon counts its context in use while the
        person thinks.  Its reply (``granted: false``) takes its place among the beats'."""
        if lease.queued and not lease.released:
            try:
                self._send_beat(lease, {"op": "renew", "queueKey": lease.queue_key,
                                        "sessionKey": lease.session_key, "parked": True, "turn": True})
            except DaemonUnavailable:
                pass

    def _hand_back(self, lease: Lease) -> None:
        """The lease's request ended and its run goes on: tell the daemon (a keyed ``renew`` with
        ``handback`` and ``busy: false``), so a parent that waits, or comes while the gap lasts,
        gets the slot at once.  Its reply (``busy`` echoed) takes its place among the beats'."""
        if lease.queued and not lease.released and not lease.lost:
            lease._handback = True
            try:
                self._send_beat(lease, {"op": "renew", "queueKey": lease.queue_key,
                                        "sessionKey": lease.session_key, "handback": True, "busy": False})
            except DaemonUnavailable:
                pass


class Session:
    """Turn-based affinity for one agent session on one queue (the spec's client contract).

    ``with session.run():`` acquires when the run starts (or keeps the slot still held from the
    previous run's grace: switch-free) and, when the run settles, releases ``grace_ms`` (3 s)
    later; an exception out of the run aborts it (the slot is let go at once).  Inside a run,
    ``with session.request():`` makes sure the slot is still held before each model request
    (re-queueing if it was lost), and ``with session.blocking():`` or ``session.tool(name)``
    parks the lease while the run waits on another agent: a waiter gets the slot at once, and
    the next ``request()`` queues again.  A settled run is parked through its grace the same
    way (a subagent at once, a parent after ``PARENT_HANDBACK_MS``), so the grace keeps the slot
    switch-free only while nobody waits.  A subagent's ``request()`` hands the slot back when a
    parent waits (never mid-stream, and only after one request on the grant) and queues again
    ahead of the other subagents.  ``abort()`` cancels from any thread (a queued acquire raises
    Cancelled); ``close()`` releases at once (shutdown).
    """

    def __init__(self, client: Client, queue_key: str, session_key: Optional[str] = None,
                 role: str = "parent", group: Optional[str] = None, grace_ms: int = GRACE_MS,
                 yield_on_settle: Optional[bool] = None, slots: Optional[SlotStore] = None,
                 spare: Optional[bool] = None) -> None:
        import uuid

        self.client = client
        self.slots = slots  # llama.cpp's slot files: a switch saves the context it would evict
        self.spare = spare  # a parent's spare stream beside the subagents; None: unless one slot
        self._background = False
        self.queue_key = queue_key
        self.session_key = session_key or str(uuid.uuid4())
        self.slot_key: Optional[str] = self.session_key  # None: its context is never saved
        self.role = role
        self.group = group
        self.grace_ms = grace_ms
        # A settled run parks through its grace: its slot goes to a waiter (at once for a
        # subagent, whose work is done; after PARENT_HANDBACK_MS for a parent), and the grace
        # keeps it switch-free only while nobody waits.
        self.yield_on_settle = True if yield_on_settle is None else yield_on_settle  # False: never parks
        self.lease: Optional[Lease] = None
        self._served: Optional[int] = None  # the grant (its seq) this session has made a request on
        self._settled: Optional[_Blocking] = None  # the parked grace of a settled run
        self._cancel_grace: Optional[Callable[[], None]] = None
        self._turn = 0  # bumped by every start/abort/close: a grace release from before is void
        # Between two requests of a run (a tool call), the slot is kept while nobody waits, and
        # for ``tool_gap_window`` of the session's own recent gaps while someone does: then it
        # parks, so a long tool (a test suite, a build) never keeps others waiting behind it.
        self._gap_turn = 0  # bumped at every request boundary: a gap park from before is void
        self._request_end: Optional[float] = None
        self._gaps: deque[float] = deque(maxlen=3)
        self._lock = threading.Lock()

    @property
    def background(self) -> bool:
        """A parent with no person behind it: its acquires say so, from the next one
        (``Client.acquire``'s ``background``)."""
        return self._background

    @background.setter
    def background(self, value: bool) -> None:
        self._background = value
        lease = self.lease
        if lease is not None:
            lease.background = value

    def _call_off_grace(self) -> None:
        self._turn += 1
        if self.lease is not None:
            self.lease._on_lost = None  # the settled run's release-on-loss (``settle``) is void
        if self._cancel_grace is not None:
            self._cancel_grace()
            self._cancel_grace = None
        self._unpark()

    def _unpark(self) -> None:
        if self._settled is not None:
            self._settled.__exit__(None, None, None)
            self._settled = None

    def start(self, timeout: Optional[float] = None, busy: bool = False) -> Lease:
        """The run starts: hold the slot (a pending grace release is called off).  ``busy``: a
        request starts on it (``Lease.ensure``)."""
        with self._lock:
            self._call_off_grace()
            lease = self.lease
        if lease is not None and not lease.released:
            return lease.ensure(timeout, busy=busy)
        spare = self.spare
        if spare is None:  # where the server runs one request at a time, a spare stream buys nothing
            spare = self.role == "parent" and (self.slots is None or self.slots.total_slots() != 1)
        lease = self.client.acquire(self.queue_key, self.session_key, self.role, self.group,
                                    activity=True, timeout=timeout, spare=spare, background=self.background)
        with self._lock:
            self.lease = lease
            if lease.role != self.role:  # re-tiered while it queued (``set_role``): its next grant
                lease._set_role(self.role)
        return lease

    def settle(self, park_after: Optional[float] = None, gap: bool = False,
               person: Optional[bool] = None) -> None:
        """The run settled: release after the grace, unless the next run starts first.
        ``park_after`` (seconds, at most the grace): keep the slot that long whoever waits, then
        park for the rest of the grace (at once, should a usage reply say meanwhile that switches
        are cheap: a waiter going first costs it no prefill); None: the session's own rule (a subagent
        parks at once, and so does a person's parent, since a person answers next; a parent with no
        person behind it after ``PARENT_HANDBACK_MS``; with ``yield_on_settle`` off it never parks).
        ``gap``: the run may go on after a tool call (the proxy cannot tell), so its park says so
        (``Lease.blocking``).  ``person``: a person answers next (the run's end is their turn
        over), so its park says so (``turn``) and the daemon counts the context in use while the
        person thinks; None: so for a parent, unless ``background`` (no person behind it) or
        ``gap``."""
        if person is None:
            person = self.role == "parent" and not self._background and not gap
        with self._lock:
            lease = self.lease
            if lease is None or lease.released or self._cancel_grace is not None:
                return
            # handed over at its last request's end (to a parent, say), and the run is over for
            # sure (a gap's settle may go on after a tool call, and a person answers a turn: the
            # context stays in use, as one given up in a gap, for as long as tool calls take)
            if lease.lost and not gap and not person:
                # nothing to keep: say now that the run is over, so its context is done with (the
                # release goes out under the lock: a run that starts now queues after it)
                self.lease = None
                lease.release()
                return
            if lease.lost and person:
                # its person's turn is over all the same: said so, the context counts as in use
                # while they think, not only for as long as a tool call takes
                self.client._turn_over(lease)
        with self._lock:
            if self.lease is not lease or lease.released or self._cancel_grace is not None:
                return  # another thread settled it, or a run began, meanwhile
            turn = self._turn
            self._gap_turn += 1  # the last gap's park is void: the settled run's rule decides
            self.client._gap_over(self.queue_key, self.session_key)
            self._request_end = None
            never = park_after is None and not self.yield_on_settle
            # a subagent's work is done; a person answers next, seconds from now at the soonest
            # (the proxy's rule for a response that ended the turn): nothing to keep it for
            at_once = (park_after is None and (self.role == "child" or person)
                       or park_after is not None and park_after <= 0)
            # Kept for a while (the window below): a parent that waits gets it at once meanwhile.
            # Said before the gap's park ends, so no beat of the old gap goes out after it.
            handback = not never and not at_once and self._hands_back_in_gaps()
            lease._handback = handback
            self._unpark()  # a gap's park: the settled run's own rule decides from here

            def release() -> None:
                with self._lock:
                    if self._turn != turn:  # a run started (or ended) since: not ours to release
                        return
                    self._cancel_grace = None
                    self._unpark()
                    if self.lease is lease:
                        self.lease = None
                    lease.release()  # under the lock: a run that starts now queues after it

            self._cancel_grace = self.client.call_later(self.grace_ms / 1000.0, release)
            if not gap and not person:
                # handed over before it settled, the reply saying so still on its way (a park
                # goes out only for a slot held): the run is over, said when the loss is learned
                self.client._when_lost(lease, release)
            elif person and not lease.lost:
                # likewise for a person's turn: said when the loss is learned, unless its turn
                # park went out while the slot was held

                def turn_over() -> None:
                    with self._lock:
                        if self._turn == turn and not lease.released and not (lease._parked and lease._parked_turn):
                            self.client._turn_over(lease)

                self.client._when_lost(lease, turn_over)
            if never:
                return
            if at_once:
                self._settled = lease.blocking(gap=gap, turn=person)
                self._settled.__enter__()
                return
            if handback:
                self.client._hand_back(lease)

            def park() -> None:
                with self._lock:
                    if self._turn == turn and self._settled is None and not lease.released:
                        lease._handback = False  # parked from here: a loss now is no hand-back
                        self._settled = lease.blocking(gap=gap, turn=person)
                        self._settled.__enter__()

            if park_after is None:
                park_after = PARENT_HANDBACK_MS / 1000.0
            elif park_after > 0:  # the proxy's window: none at all where switches are cheap
                self.client._park_when_cheap(self.queue_key, self.session_key, park)
            if park_after < self.grace_ms / 1000.0:
                self.client.call_later(park_after, park)

    def abort(self) -> None:
        """Esc: a queued request is dropped (its acquire raises Cancelled), a held slot released."""
        with self._lock:
            self._call_off_grace()
            self.lease = None
        self.client.cancel(self.queue_key, self.session_key)

    def close(self) -> None:
        """Shutdown: release at once, no grace."""
        with self._lock:
            self._call_off_grace()
            lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()

    def run(self, timeout: Optional[float] = None) -> _Run:
        return _Run(self, timeout)

    def _before_request(self, timeout: Optional[float], may_hand_back: bool = True,
                        starts_run: bool = False) -> Lease:
        """A request boundary: hold the slot (queueing again if it was lost), and hand it back
        first when a parent waits for this child's slot.  ``starts_run``: the request is a run
        of its own (the proxy's), so a pending grace release is called off first."""
        with self._lock:
            if starts_run:
                self._call_off_grace()
            self._gap_turn += 1
            if self._request_end is not None:
                gap = time.monotonic() - self._request_end
                if gap <= self.grace_ms / 1000.0:  # a longer one was no typical tool call
                    self._gaps.append(gap)
                    self.client._recent_gaps.append(gap)
                self._request_end = None
            if self._cancel_grace is None:
                self._unpark()  # the gap is over (a slot handed over meanwhile shows as lost)
        self.client._gap_over(self.queue_key, self.session_key)
        lease = self.lease
        if lease is None or lease.released:
            lease = self.start(timeout, busy=True)
            self._mark(lease, True)  # a grant is busy from the start; a slot still held says so
        else:
            # Its beat says the request is in flight, in the same message: no idle hand-over can
            # come between "still held" and the request (a slot lost meanwhile is queued for
            # again, and a fresh grant is busy).  Its reply also says whether a parent waits.
            lease.ensure(timeout, busy=True)
            if (may_hand_back and self.role == "child" and lease.held and lease._parent_waiting
                    and lease.seq is not None and self._served == lease.seq):
                # A parent waits, and this grant has served us at least once: the slot goes to
                # the parent now, never mid-stream, and we queue again ahead of the children.
                self.client._give_back(lease)
                lease.ensure(timeout)
        self._served = lease.seq
        if self.slots is not None and lease.queued:  # held (not failed open): never mid-stream
            self.slots.switch_to(self.slot_key)
        return lease

    def _mark(self, lease: Lease, busy: bool) -> None:
        """Tell the daemon whether a request is in flight on the slot (a keyed renew with
        ``busy``): the time it is held with none while someone waits is dead time."""
        if lease.queued and not lease.released:
            try:
                self.client._send_beat(lease, {"op": "renew", "queueKey": lease.queue_key,
                                               "sessionKey": lease.session_key, "busy": busy})
            except DaemonUnavailable:
                pass

    def _after_request(self) -> None:
        """A subagent's request ended (nothing of it streams now): one beat asks whether a parent
        waits, and if one does the slot goes to it here, instead of after the tool call that
        follows.  The next request queues again, ahead of the other subagents."""
        lease = self.lease
        if lease is None or not lease.held or lease.released:
            return
        if self._hands_back_in_gaps():
            self.client._hand_back(lease)  # a parent that waits, or comes meanwhile, goes first
        else:
            self._mark(lease, False)
        with self._lock:
            self._gap_turn += 1
            token = self._gap_turn
            self._request_end = time.monotonic()
            window = tool_gap_window(tuple(self._gaps) or tuple(self.client._recent_gaps),
                                     self.grace_ms / 1000.0)
            if self.role == "child" and (self.client.switch_cost(self.queue_key) == "cheap" or
                                         self.slots is not None and self.slots.cheap_within(window)):
                window = 0.0  # our context is kept (by the server, or in a slot file): a waiter loses nothing

        def park() -> None:
            with self._lock:
                if (self._gap_turn == token and self._settled is None and self.lease is lease
                        and lease.held and not lease.released):
                    lease._handback = False  # parked from here: a loss now is no hand-back
                    self._settled = lease.blocking(gap=True)
                    self._settled.__enter__()

        self.client.call_later(window, park)
        if window > 0 and self.role == "child":
            self.client._park_when_cheap(self.queue_key, self.session_key, park)

    def _hands_back_in_gaps(self) -> bool:
        """Whether, between two requests (after one, and when a run settles), the slot goes at
        once to a parent that waits: a subagent's always (it would hand back at its next request
        anyway), a parent's unless the queue learned that a switch re-prefills there (``dear``):
        two parents then take turns request by request, where holding the slot through one's tool
        call would keep the other waiting behind an idle slot."""
        return self.role == "child" or self.client.switch_cost(self.queue_key) != "dear"

    def request(self, timeout: Optional[float] = None) -> _Request:
        return _Request(self, timeout)

    def set_role(self, role: str) -> None:
        """Re-tier the session (the ``role`` op): a request of it that is queued moves to that
        tier in place (its place in the order kept), and its next grant is taken in it.  A slot it
        holds keeps the tier it was granted with, as the spec has it."""
        if role not in ROLES:
            raise ValueError(f"role must be parent or child (got {role!r})")
        with self._lock:
            if role == self.role:
                return
            self.role = role
            if self.lease is not None:
                self.lease._set_role(role)
        self.client._quietly({"op": "role", "sessionKey": self.session_key, "role": role})

    def usage(self, prefilled: int, reused: int = 0, prefill_ms: Optional[float] = None,
              server: Optional[tuple[int, int]] = None, decode: Optional[tuple[int, float]] = None) -> None:
        """Report one of this session's requests' prompt tokens (``Client.usage``)."""
        self.client.usage(self.queue_key, self.session_key, prefilled, reused, prefill_ms, server, decode)

    def report(self, response: Any) -> Optional[tuple[int, int]]:
        """Report a response's own accounting, so the daemon knows what a switch costs: pass the
        parsed JSON of a whole response, or a stream's last chunk (llama.cpp's carries
        ``timings``; OpenAI's ``usage`` comes with ``stream_options: {"include_usage": true}``;
        Anthropic's and Responses' final events carry theirs).  Returns (prefilled, reused), or
        None when it said nothing of them (then nothing is sent)."""
        if hasattr(response, "model_dump"):  # an openai / anthropic package object
            response = response.model_dump()
        if not isinstance(response, dict):
            return None
        scanner = UsageScanner("application/json")
        scanner.feed(json.dumps(response, default=str).encode())
        counts = scanner.result()
        if counts is not None:
            self.usage(*counts, prefill_ms=scanner.prefill_ms(0.0),
                       server=self.client.server_figures(self.queue_key),  # None unless "auto"
                       decode=scanner.decode())
        return counts

    def blocking(self) -> _Blocking:
        if self.lease is None:
            raise LLMQueueError("blocking() outside a run")
        return self.lease.blocking()

    def tool(self, name: str) -> Any:
        """A context for running tool ``name``: blocking when the config lists it in
        ``blockingTools``, otherwise the beat goes on."""
        import contextlib

        if name in self.client.config.blocking_tools and self.lease is not None:
            return self.lease.blocking()
        return contextlib.nullcontext()


class _Run:
    def __init__(self, session: Session, timeout: Optional[float]) -> None:
        self.session = session
        self.timeout = timeout

    def __enter__(self) -> Lease:
        return self.session.start(self.timeout)

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.session.settle()
        else:
            self.session.abort()


class _Request:
    def __init__(self, session: Session, timeout: Optional[float]) -> None:
        self.session = session
        self.timeout = timeout

    def __enter__(self) -> Lease:
        return self.session._before_request(self.timeout)

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.session._after_request()


# =================================================================================================
# The proxy
#
# ``llmqueue proxy`` brings the queue to any OpenAI-compatible client (curl, the ``openai``
# package, an editor with a base-URL setting): a loopback HTTP/1.1 reverse proxy in front of the
# model server that holds a slot for each request's session while the response streams.  It is a
# client process, so threads are fine here: one per connection, one shared Client.
# =================================================================================================

DEFAULT_PROXY_PORT = 8787  # the documented default: http://127.0.0.1:8787
# After a person's last words in a conversation with nothing named, the proxy's other unnamed
# conversations stay background (subagents) this long: a person reads and thinks for minutes.
PERSON_AWAY_S = 600.0
# RFC 9110 7.6.1: connection-specific fields are never forwarded.  ``expect`` is answered here
# (the body is read before the slot is taken), and ``host`` is the upstream's own.
_HOP_BY_HOP = frozenset((
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade", "expect", "host",
))
SESSION_HEADER = "X-LLMQueue-Session"
ROLE_HEADER = "X-LLMQueue-Role"


def _split_session_path(path: str) -> tuple[Optional[str], Optional[str], str]:
    """``/s/SESSION/ROLE/rest?q`` -> (SESSION, ROLE, ``/rest?q``); other paths are unchanged.
    For clients that can only set a base URL: ``http://127.0.0.1:8787/s/main/parent/v1``."""
    if not path.startswith("/s/"):
        return None, None, path
    parts = path.split("/", 4)  # "", "s", SESSION, ROLE, rest
    if len(parts) < 4 or not parts[2] or not parts[3]:
        return None, None, path
    role = parts[3].split("?", 1)[0]
    rest = parts[4] if len(parts) > 4 else ""
    if "?" in parts[3]:
        rest = "?" + parts[3].split("?", 1)[1]
    import urllib.parse

    return urllib.parse.unquote(parts[2]), role, "/" + rest


# -- what takes a slot -------------------------------------------------------------------------------
#
# Only a model call takes a slot: a POST that makes the server prefill and decode.  Everything else
# (``HEAD /``, which Claude Code sends before each run, ``GET /v1/models``, ``/health``, ``/props``,
# token counting) passes straight through, with no slot, no switch and no count.

_MODEL_CALL_PATHS = (
    "/chat/completions", "/completions", "/responses", "/responses/compact",  # OpenAI
    "/messages",  # Anthropic Messages (``/messages/count_tokens`` is no model call)
    "/completion", "/infill",  # llama.cpp's own
    "/api/chat", "/api/generate",  # Ollama's own
)


def model_call(method: str, path: str) -> bool:
    """Whether a request through the proxy is a model call, which queues for a slot."""
    return method == "POST" and path.split("?", 1)[0].rstrip("/").endswith(_MODEL_CALL_PATHS)


# -- who is asking ----------------------------------------------------------------------------------
#
# Agent CLIs already say who they are, in headers and body fields of their own.  The proxy keys a
# request's session by the most specific id it finds (a subagent's own id before its tool's
# session id, that before a cache key, a user, and last a fingerprint of the conversation), so a
# tool that names nothing still gets one session per conversation.  Per-install and per-device ids
# (codex's installation_id, Claude Code's device_id) are never read: they would merge every
# session on the machine.  Pure: headers and body in, an Identity out.

IDENTITY_SOURCES = ("agent", "session", "cache-key", "user", "fingerprint")
MAX_IDENTITY_BODY = 16 << 20  # a larger body is forwarded untouched; its body fields are not read
# A subagent's marker: the request is a child's.  Claude Code and codex keep the parent's session
# id on a subagent's requests, so a marked request is never keyed by a session-level id.
_SUBAGENT_HEADERS = ("x-claude-code-agent-id", "x-openai-subagent", "x-codex-parent-thread-id",
                     "x-parent-session-id")
_SUBAGENT_BODY_MARK = b"cc_is_subagent=true"  # Claude Code: in a subagent's first system block
# (marker header present, the header holding the subagent's own id)
_AGENT_ID_HEADERS = (("x-claude-code-agent-id", "x-claude-code-agent-id"),
                     ("x-openai-subagent", "thread-id"), ("x-codex-parent-thread-id", "thread-id"),
                     ("x-parent-session-id", "x-session-id"))
_SESSION_ID_HEADERS = ("x-claude-code-session-id", "x-session-id", "session-id", "session_id",
                       "x-session-affinity")


class Identity(NamedTuple):
    """What the proxy derived for a request: ``session`` None is anonymous (a session of its own);
    ``role`` None is the proxy's default tier; ``source`` names the rule that decided."""

    session: Optional[str]
    role: Optional[str]
    source: str
    conversation: Optional[str] = None  # the fingerprint, when the body was read
    person: bool = False  # the request carries a person's words (``person_turn``)
    continued: bool = False  # the request goes on after a reply of the model (``continues``)
    length: int = 0  # its conversation's length (``conversation_length``), when the body was read


# Fields a client sets afresh on each request of one conversation, which say nothing of its
# content: Anthropic's cache breakpoint moves to the newest message at every request (pi does so).
_VOLATILE_FIELDS = ("cache_control",)


def _without_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in _VOLATILE_FIELDS}
    if isinstance(value, list):
        return [_without_volatile(v) for v in value]
    return value


def _text_of(content: Any) -> Any:
    """A message's content as the fingerprint sees it: a string (text parts alone are their
    text: a string and the same words in one ``text`` block are one conversation), or its parts'
    JSON less the volatile fields (``cache_control``)."""
    if isinstance(content, str):
        return content
    content = _without_volatile(content)
    if isinstance(content, list) and content and all(
            isinstance(part, dict) and part.get("type") in ("text", "input_text") and set(part) <= {"type", "text"}
            and isinstance(part.get("text"), str) for part in content):
        return "\n".join(part["text"] for part in content)
    return json.dumps(content, sort_keys=True, default=str)


def conversation_fingerprint(body: dict[str, Any]) -> Optional[str]:
    """A hash of the conversation's stable prefix: the model, the system prompt and the first
    user message (chat completions' ``messages``, Responses' ``instructions``/``input``, Anthropic
    Messages' ``system``/``messages``); None when the body holds no conversation."""
    import hashlib

    system: list[Any] = []
    first: Any = None
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict):
                continue
            if m.get("role") in ("system", "developer") and first is None:
                system.append(_text_of(m.get("content")))
            elif m.get("role") == "user":
                first = _text_of(m.get("content"))
                break
        if "system" in body:
            system.insert(0, _text_of(body["system"]))
    elif "input" in body:
        items = body["input"]
        if "instructions" in body:
            system.append(_text_of(body["instructions"]))
        if isinstance(items, str):
            first = items
        elif isinstance(items, list):
            for m in items:
                if isinstance(m, dict) and m.get("role") in ("system", "developer"):
                    system.append(_text_of(m.get("content")))
                elif isinstance(m, dict) and m.get("role", "user") == "user":
                    first = _text_of(m.get("content"))
                    break
    if first is None and not system:
        return None
    blob = json.dumps([body.get("model"), system, first], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def conversation_length(body: Optional[dict[str, Any]]) -> int:
    """How many messages (chat, Anthropic) or input items (Responses) a request carries: a
    conversation's next request is longer than its last, which it answers."""
    if body is None:
        return 0
    items = body.get("messages")
    if not isinstance(items, list):
        items = body.get("input")
    return len(items) if isinstance(items, list) else 0


_TOOL_OUTPUTS = ("tool_result", "function_call_output", "custom_tool_call_output", "mcp_tool_result")
_MODEL_OUTPUTS = ("function_call", "custom_tool_call", "reasoning")  # Responses items the model wrote


def continues(body: dict[str, Any]) -> bool:
    """Whether the request goes on after a reply of the model: an ``assistant`` message in it
    (chat completions, Anthropic Messages, Responses ``input`` items), an output item of the model
    (Responses), or a Response it names by ``previous_response_id``.  A conversation's opening
    request has none: a person's first words, or an agent's task, look the same."""
    if body.get("previous_response_id"):
        return True
    items = body.get("messages")
    if not isinstance(items, list):
        items = body.get("input")
    if not isinstance(items, list):
        return False
    return any(isinstance(m, dict) and (m.get("role") == "assistant" or m.get("type") in _MODEL_OUTPUTS)
               for m in items)


def person_turn(body: dict[str, Any]) -> bool:
    """Whether the request continues a conversation with a person's words: its last message is
    the user's own (not a tool's output: a ``tool`` message, a ``tool_result`` block, a
    ``function_call_output`` item), after a reply of the model (an ``assistant`` message, or a
    Response it names by ``previous_response_id``).  An agent at work sends its tools' outputs;
    only a person answers the model in its own words."""
    items = body.get("messages")
    if not isinstance(items, list):
        items = body.get("input")
    if not isinstance(items, list) or not items:
        return False
    last = items[-1]
    if not isinstance(last, dict) or last.get("role") != "user" or last.get("type", "message") != "message":
        return False
    content = last.get("content")
    if isinstance(content, list) and any(isinstance(part, dict) and part.get("type") in _TOOL_OUTPUTS
                                         for part in content):
        return False
    return bool(body.get("previous_response_id")) or any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in items[:-1])


def _json_body(body: bytes, headers: dict[str, str]) -> Optional[dict[str, Any]]:
    """The body as a JSON object, or None: compressed, huge, not JSON, not an object."""
    if headers.get("content-encoding", "identity").strip().lower() not in ("", "identity"):
        return None
    if not body or len(body) > MAX_IDENTITY_BODY or body.lstrip()[:1] != b"{":
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return parsed if isinstance(parsed, dict) else None


def _user_id_session(body: dict[str, Any]) -> Optional[str]:
    """Claude Code's ``metadata.user_id`` is a JSON string holding ``session_id`` (and a per-device
    ``device_id``, never read)."""
    meta = body.get("metadata")
    raw = meta.get("user_id") if isinstance(meta, dict) else None
    if not isinstance(raw, str) or not raw.startswith("{"):
        return None
    try:
        inner = json.loads(raw)
    except ValueError:
        return None
    sid = inner.get("session_id") if isinstance(inner, dict) else None
    return sid if isinstance(sid, str) and sid else None


def _first_system_block(body: dict[str, Any]) -> str:
    system = body.get("system")
    if isinstance(system, str):
        return system
    if isinstance(system, list) and system:
        block = system[0]
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            return str(block["text"])
        if isinstance(block, str):
            return block
    return ""


def proxy_identity(headers: dict[str, str], body: bytes, *, session: Optional[str] = None,
                   role: Optional[str] = None, sources: Tuple[str, ...] = IDENTITY_SOURCES) -> Identity:
    """A request's session and tier.  ``headers`` are lower-cased names; ``session`` and ``role``
    are what the ``/s/SESSION/ROLE`` path or the ``X-LLMQueue-*`` headers said (they win).  The
    rest, most specific first, each source on only when named in ``sources``:

    - ``agent``: a subagent's own id, when a subagent marker is present: Claude Code's
      ``x-claude-code-agent-id``, codex's ``thread-id`` (with ``x-openai-subagent`` or
      ``x-codex-parent-thread-id``), opencode's ``x-session-id`` (with ``x-parent-session-id``);
    - ``session``: the tool's session id: ``x-claude-code-session-id``, ``x-session-id``,
      ``session-id``, ``session_id``, ``x-session-affinity``, or the ``session_id`` inside Claude
      Code's ``metadata.user_id``; never for a marked (subagent) request, which carries its
      parent's;
    - ``cache-key``: the body's ``prompt_cache_key``;
    - ``user``: the body's ``user`` (OpenAI), or a plain ``metadata.user_id`` (Anthropic);
    - ``fingerprint``: the conversation's stable prefix (``conversation_fingerprint``).

    The tier: the explicit role, else child when a subagent marker is present (a header above, or
    ``cc_is_subagent=true`` in Claude Code's first system block), else None (the default)."""
    marked = any(h in headers for h in _SUBAGENT_HEADERS)
    parsed: Optional[dict[str, Any]] = None
    need_body = bool({"session", "cache-key", "user", "fingerprint"} & set(sources))
    if need_body:
        parsed = _json_body(body, headers)
    if not marked and parsed is not None and _SUBAGENT_BODY_MARK in body:
        marked = _SUBAGENT_BODY_MARK.decode() in _first_system_block(parsed)
    conversation = conversation_fingerprint(parsed) if parsed is not None else None
    tier = role if role is not None else ("child" if marked else None)
    person = parsed is not None and not marked and person_turn(parsed)
    continued = parsed is not None and continues(parsed)
    length = conversation_length(parsed)

    def found(key: str, source: str) -> Identity:
        return Identity(key, tier, source, conversation, person, continued, length)

    if session:
        return found(session, "explicit")
    if marked and "agent" in sources:
        for mark, id_header in _AGENT_ID_HEADERS:
            if mark in headers and headers.get(id_header):
                return found("agent:" + headers[id_header], "agent")
    if not marked and "session" in sources:
        for name in _SESSION_ID_HEADERS:
            if headers.get(name):
                return found("session:" + headers[name], "session")
        sid = _user_id_session(parsed) if parsed is not None else None
        if sid:
            return found("session:" + sid, "session")
    if parsed is not None and not marked:  # a subagent with no id of its own: its fingerprint
        key = parsed.get("prompt_cache_key")
        if "cache-key" in sources and isinstance(key, str) and key:
            return found("cache:" + key, "cache-key")
        user = parsed.get("user")
        meta = parsed.get("metadata")
        if isinstance(meta, dict) and not isinstance(user, str) and isinstance(meta.get("user_id"), str):
            if not str(meta["user_id"]).startswith("{"):
                user = meta["user_id"]
        if "user" in sources and isinstance(user, str) and user:
            return found("user:" + user, "user")
    if "fingerprint" in sources and conversation is not None:
        return found("conv:" + conversation, "fingerprint")
    return Identity(None, tier, "none", conversation, person, length=length)


# -- what the server says it prefilled -------------------------------------------------------------


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def token_counts(timings: Optional[dict[str, Any]], usage: dict[str, Any]) -> Optional[tuple[int, int]]:
    """(prefilled, reused) prompt tokens from a response's own accounting, or None: llama.cpp's
    ``timings`` (``prompt_n``, ``cache_n``) first, else the ``usage`` of OpenAI chat completions
    (``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``), of Anthropic Messages
    (``input_tokens`` + ``cache_creation_input_tokens``, and ``cache_read_input_tokens``), or of
    Responses (``input_tokens`` and ``input_tokens_details.cached_tokens``)."""
    if timings is not None and _count(timings.get("prompt_n")) is not None:
        return int(timings["prompt_n"]), _count(timings.get("cache_n")) or 0
    prompt = _count(usage.get("prompt_tokens"))
    if prompt is not None:
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        return max(0, prompt - (cached or 0)), cached or 0
    read, created = _count(usage.get("cache_read_input_tokens")), _count(usage.get("cache_creation_input_tokens"))
    fresh = _count(usage.get("input_tokens"))
    if read is not None or created is not None:
        return (fresh or 0) + (created or 0), read or 0
    if fresh is not None:
        details = usage.get("input_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        return max(0, fresh - (cached or 0)), cached or 0
    return None


_NO_FINISH = re.compile(rb'"finish_reason"\s*:\s*null')
_TOOL_ITEMS = ("function_call", "custom_tool_call", "local_shell_call", "mcp_call", "computer_call")


def _ending(obj: dict[str, Any]) -> Optional[str]:
    """How a response (or its last event) ended, by its own account: ``tool`` when the model
    asked for a tool (its agent comes right back with the output), ``turn`` when it ended its
    turn (its agent now waits on a person, or on its parent), None when it says neither (cut at
    ``max_tokens``, say)."""
    choices = obj.get("choices")
    if isinstance(choices, list):  # chat completions
        for choice in choices:
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if reason in ("tool_calls", "function_call"):
                return "tool"
            if reason == "stop":
                return "turn"
    reason = obj.get("stop_reason")  # Anthropic Messages: the message, or a message_delta's delta
    if reason is None and isinstance(obj.get("delta"), dict):
        reason = obj["delta"].get("stop_reason")
    if reason == "tool_use":
        return "tool"
    if reason in ("end_turn", "stop_sequence"):
        return "turn"
    response = obj.get("response") if obj.get("type") == "response.completed" else (
        obj if obj.get("object") == "response" and obj.get("status") == "completed" else None)
    if isinstance(response, dict):  # Responses
        output = response.get("output")
        items = output if isinstance(output, list) else []
        if any(isinstance(i, dict) and i.get("type") in _TOOL_ITEMS for i in items):
            return "tool"
        return "turn"
    return None


class UsageScanner:
    """A response's token accounting, read as the response streams past (it is never held): of
    an event stream, only the ``data:`` lines that name ``usage`` or ``timings`` are parsed; a
    JSON body is kept up to 4 MiB and parsed at the end."""

    MAX_LINE = 1 << 20
    MAX_JSON = 4 << 20

    def __init__(self, content_type: str) -> None:
        kind = content_type.lower()
        self.sse = "text/event-stream" in kind
        self.json = not self.sse and "json" in kind
        self._partial = b""
        self._body = bytearray()
        self.timings: Optional[dict[str, Any]] = None
        self.usage: dict[str, Any] = {}
        self.ending: Optional[str] = None  # "tool": it asked for a tool; "turn": it ended the turn
        self.first_data: Optional[float] = None  # monotonic: when the body's first bytes came

    def feed(self, data: bytes) -> None:
        if self.first_data is None and data:
            self.first_data = time.monotonic()
        if self.sse:
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()
            if len(self._partial) > self.MAX_LINE:
                self._partial = b""  # no accounting line is that long: drop it, keep reading
            for line in lines:
                self._line(line)
        elif self.json:
            if len(self._body) + len(data) > self.MAX_JSON:
                self.json, self._body = False, bytearray()
            else:
                self._body += data

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        if (b'"usage"' in line or b'"timings"' in line or b"response.completed" in line
                or b"response.incomplete" in line or b'stop_reason"' in line
                or b'finish_reason"' in line and not _NO_FINISH.search(line)):
            self._take(line[5:])

    def _take(self, raw: bytes) -> None:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            return
        if not isinstance(obj, dict):
            return
        if isinstance(obj.get("timings"), dict):
            self.timings = obj["timings"]
        ending = _ending(obj)
        if ending is not None:
            self.ending = ending
        for holder in (obj, obj.get("response"), obj.get("message")):  # chat, Responses, Anthropic
            usage = holder.get("usage") if isinstance(holder, dict) else None
            if isinstance(usage, dict):
                self.usage.update({k: v for k, v in usage.items() if v is not None})

    def result(self) -> Optional[tuple[int, int]]:
        """(prefilled, reused), or None when the response said nothing of them."""
        if self.sse and self._partial:
            self._line(self._partial.rstrip(b"\r"))
            self._partial = b""
        if self.json and self._body:
            self._take(bytes(self._body))
            self._body = bytearray()
        return token_counts(self.timings, self.usage)

    def decode(self) -> Optional[tuple[int, float]]:
        """The tokens the server generated and how long that took (ms), by its own ``timings``
        (llama.cpp's ``predicted_n`` and ``predicted_ms``); None where it does not say."""
        if self.timings is None:
            return None
        n, ms = _count(self.timings.get("predicted_n")), self.timings.get("predicted_ms")
        if n is None or not isinstance(ms, (int, float)) or isinstance(ms, bool) or not 0 <= ms <= MAX_PREFILL_MS:
            return None
        return n, float(ms)

    def prefill_ms(self, sent: float) -> Optional[float]:
        """How long the server took to prefill the prompt: its own ``timings.prompt_ms``
        (llama.cpp), else, of a stream, the time from ``sent`` (monotonic, when the request went
        upstream) to its first bytes; None for a whole body, whose first bytes come at its end."""
        ms = self.timings.get("prompt_ms") if self.timings is not None else None
        if isinstance(ms, (int, float)) and not isinstance(ms, bool) and 0 <= ms <= MAX_PREFILL_MS:
            return float(ms)
        if self.sse and self.first_data is not None:
            return min(MAX_PREFILL_MS, max(0.0, (self.first_data - sent) * 1000.0))
        return None


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tool_gap_window(gaps: Sequence[float], grace_s: float) -> float:
    """How long (seconds) a session keeps its slot between two of its requests while someone
    waits, before it parks: as long as its own tool calls take, 1.5x its longest recent gap plus
    0.2 s, within ``PARENT_HANDBACK_MS`` and the grace.  A session with no gap yet is given its
    peers' recent ones; with none known at all, the whole grace."""
    if not gaps:
        return grace_s
    return min(grace_s, max(PARENT_HANDBACK_MS / 1000.0, 1.5 * max(gaps) + 0.2))


SLOT_FILES = 8  # contexts a SlotStore keeps on the server's disk, one file each, least recently used out
SLOT_REPROBE_S = 600.0  # a store that found the server without slot files asks again this much later
SLOT_RETRY_S = 10.0  # a store that could not reach the server tries again this much later


class SlotFiles:
    """Which saved context each file name holds: a ring of ``capacity`` names (``PREFIX-N.bin``),
    so the server's disk holds at most that many, the least recently used going first.  Pure."""

    def __init__(self, prefix: str, capacity: int = SLOT_FILES) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.prefix = prefix
        self.capacity = capacity
        self._names: OrderedDict[str, str] = OrderedDict()  # session -> file, least recent first

    def saved(self, session: str) -> Optional[str]:
        """The file holding ``session``'s context, or None (never saved, or its name reused)."""
        name = self._names.get(session)
        if name is not None:
            self._names.move_to_end(session)
        return name

    def name_for(self, session: str, keep: Optional[str] = None) -> str:
        """The file to save ``session`` into: its own, else a free name, else the least recently
        used session's (which is forgotten), never ``keep``'s."""
        name = self._names.get(session)
        if name is None:
            used = set(self._names.values())
            free = [i for i in range(self.capacity) if f"{self.prefix}-{i}.bin" not in used]
            if free:
                name = f"{self.prefix}-{free[0]}.bin"
            else:
                victim = next((s for s in self._names if s != keep), None)
                if victim is None:  # capacity 1 and keep holds it: keep loses it
                    victim = next(iter(self._names))
                name = self._names.pop(victim)
        self._names[session] = name
        self._names.move_to_end(session)
        return name

    def forget(self, session: str) -> None:
        self._names.pop(session, None)


class SlotStore:
    """llama.cpp's slot files at a switch, so no context is prefilled twice.

    ``switch_to(session)`` goes right before each of a session's requests, while it holds the
    slot.  When another session's request ran on the slot last, that session's context (still in
    the slot) is saved to a file on the server (``POST /slots/0?action=save``), and then this
    session's own, if it was saved at an earlier switch, is put back (``action=restore``): its
    request then reuses all of it, whatever ran in between.  A save and a restore take
    milliseconds where a prefill of the same context takes seconds.

    Needs llama-server started with ``--slot-save-path DIR`` and one slot (``-np 1``).  Anything
    else (another server, no ``/props``, ``total_slots`` above 1, a 501 for the slots action)
    turns the store off, quietly, and it asks again ``SLOT_REPROBE_S`` later.  It never fails a
    request: an error costs at most the re-prefill that would have happened without it.  The
    server's disk holds at most ``files`` contexts (``SlotFiles``).

    ``active``: the server takes slot files (the last save worked).  ``switch_s``: what the last
    switch's save and restore took, wall clock.  One store per server and process; it is safe
    from any thread (a switch holds its lock)."""

    def __init__(self, server: str, files: int = SLOT_FILES, timeout: float = 60.0,
                 log: Optional[Callable[[str], None]] = None) -> None:
        import hashlib
        import urllib.parse

        parsed = urllib.parse.urlsplit(server)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"a slot store needs an http(s) URL (got {server!r})")
        path = parsed.path.rstrip("/")
        if path.endswith("/v1"):  # the OpenAI base URL: the slots API is at the server's root
            path = path[:-3]
        self._target = parsed
        self._root = path
        self.timeout = timeout
        self.log = log or (lambda message: None)
        # named by the server's root, as before one key named both forms (files already there stay ours)
        tag = hashlib.sha1(normalize_url(server)[:-3].encode()).hexdigest()[:10]
        self.files = SlotFiles(f"llmqueue-{tag}", files)
        self._lock = threading.Lock()
        self._last: Optional[str] = None  # whose request ran on the slot last (as far as we know)
        self._probed = False
        self._off_until = 0.0  # monotonic: off (no slot files there) until then
        self._total: Optional[int] = None  # the server's slot count, once its /props said
        self._slot_context: Optional[int] = None  # and the tokens one slot holds (its n_ctx)
        self._total_asked = float("-inf")  # monotonic: when /props was last asked for it
        self.active = False
        self.switch_s = 0.0
        self.saves = self.restores = self.failures = 0

    def _call(self, method: str, path: str, body: Optional[dict[str, Any]] = None,
              timeout: Optional[float] = None) -> tuple[int, Any]:
        import http.client

        cls = http.client.HTTPSConnection if self._target.scheme == "https" else http.client.HTTPConnection
        conn = cls(self._target.hostname or "", self._target.port, timeout=timeout or self.timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, self._root + path, body=data,
                         headers={"Content-Type": "application/json"} if data is not None else {})
            response = conn.getresponse()
            raw = response.read(1 << 20)
            try:
                obj = json.loads(raw) if raw else None
            except ValueError:
                obj = None
            return response.status, obj
        finally:
            conn.close()

    def _off(self, for_s: float = SLOT_REPROBE_S, why: str = "the server takes no slot files") -> None:
        self.log(f"slot files: off for {for_s:.0f} s ({why})")
        self.active = False
        self._probed = False
        self._off_until = time.monotonic() + for_s

    def _props_slots(self, props: Any) -> Optional[int]:
        total = props.get("total_slots") if isinstance(props, dict) else None
        if isinstance(total, int) and not isinstance(total, bool) and 0 < total <= MAX_SERVER_SLOTS:
            self._total = total
            settings = props.get("default_generation_settings")
            n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
            if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and 0 < n_ctx <= MAX_TOKENS:
                self._slot_context = n_ctx
            return total
        return None

    def figures(self) -> Optional[tuple[int, int]]:
        """The server's slots and the tokens one slot holds, as its ``/props`` says
        (``total_slots``, ``default_generation_settings.n_ctx``), or None where it does not:
        what ``maxStreams: "auto"`` goes by (the ``usage`` op's ``slots`` and ``slotContext``)."""
        total = self.total_slots()
        if total is None or self._slot_context is None:
            return None
        return total, self._slot_context

    def total_slots(self) -> Optional[int]:
        """How many requests the server runs at once, as its ``/props`` says (``total_slots``),
        or None when it does not say (not llama.cpp).  Asked once; again at most every
        ``SLOT_RETRY_S`` only while the server could not be reached."""
        if self._total is not None or time.monotonic() - self._total_asked < SLOT_RETRY_S:
            return self._total  # known (or asked lately): never behind a switch's lock
        with self._lock:
            now = time.monotonic()
            if self._total is None and now - self._total_asked >= SLOT_RETRY_S:
                self._total_asked = now
                try:  # on a queue's path: a server that does not answer at once is asked later
                    status, props = self._call("GET", "/props", timeout=min(self.timeout, 5.0))
                    if self._props_slots(props if status == 200 else None) is None and status in (200, 404, 405, 501):
                        self._total_asked = float("inf")  # no /props that says: never asked again
                except Exception:  # OSError, http.client.HTTPException: unknown for now
                    pass
            return self._total

    def _probe(self) -> bool:
        """One slot and slot files there?  Saves the slot as it is (whatever is in it) to find out."""
        self._probed = True
        status, props = self._call("GET", "/props")
        if status != 200 or self._props_slots(props) != 1:
            return False
        status, _ = self._call("POST", "/slots/0?action=save", {"filename": f"{self.files.prefix}-probe.bin"})
        return status == 200

    def switch_to(self, session: Optional[str]) -> None:
        """``session``'s request is about to run on the slot: save the previous session's
        context and bring back this one's, when the slot changed hands since.  None: a request
        whose context nobody can claim back (a session of its own), so it is never saved."""
        with self._lock:
            prev, self._last = self._last, session
            start = time.monotonic()
            if start < self._off_until:
                return
            try:
                if not self._probed:
                    if not self._probe():
                        self._off()
                        return
                    self.active = True
                    self.log("slot files: on (one slot, and a save works)")
                if prev == session:
                    return  # the slot holds this session's context (or nobody's we could name)
                own = self.files.saved(session) if session is not None else None
                restored = False
                if prev is not None:  # the slot holds prev's context: keep it before it goes
                    name = self.files.name_for(prev, keep=session)
                    status, _ = self._call("POST", "/slots/0?action=save", {"filename": name})
                    if status in (404, 405, 501):  # no slots API there after all
                        self.files.forget(prev)
                        self._off()
                        return
                    if status == 200:
                        self.saves += 1
                        self.active = True
                    else:
                        self.files.forget(prev)
                        self.failures += 1
                        self.active = False
                if own is not None and session is not None:
                    status, _ = self._call("POST", "/slots/0?action=restore", {"filename": own})
                    if status == 200:
                        self.restores += 1
                        restored = True
                    else:  # llama.cpp cleared the slot: the request prefills, as without us
                        self.files.forget(session)
                        self.failures += 1
                self.switch_s = time.monotonic() - start
                did = ([f"{prev} saved"] if prev is not None else []) + ([f"{session} restored"] if restored else [])
                if did:
                    self.log(f"slot files: {', '.join(did)} ({1000 * self.switch_s:.0f} ms)")
            except Exception as e:  # OSError, http.client.HTTPException: never the request's problem
                self.failures += 1
                self._off(SLOT_RETRY_S, f"{type(e).__name__}: {e}")

    def cheap_within(self, window_s: float) -> bool:
        """A switch is worth it inside a gap of ``window_s``: the store works, and a save and a
        restore (twice: out and back) take at most half of it."""
        return self.active and 4 * self.switch_s <= window_s


# The first segments of OpenAI paths a client with a base URL of ``.../v1`` sends without ``/v1``.
_OPENAI_RELATIVE = frozenset(("/chat", "/completions", "/responses", "/models", "/embeddings", "/messages",
                              "/moderations", "/audio", "/images"))


class _ProxySession:
    """A queue Session plus how many of its requests are in flight, and the gaps between its
    requests (its agent's tool calls), which set how long it keeps the slot after a response."""

    def __init__(self, session: Session, own: bool, interactive: bool) -> None:
        self.session = session
        self.own = own  # a request that named no session is a session of its own
        self.interactive = interactive  # a parent by its path or headers: a person's session
        self.inflight = 0
        # the conversation length (messages, or Responses items) of each request in flight: a
        # request of a fingerprint-keyed session no longer than one in flight is no continuation
        # of it (that one has not answered yet), but an identical conversation of its own
        self.lengths: list[int] = []
        self.starting = threading.Lock()
        self.last_end: Optional[float] = None  # when its last response ended (monotonic)
        self.gaps: deque[float] = deque(maxlen=3)  # its last gaps, response end to next request

    def set_role(self, role: str) -> None:
        """Re-tier the session (``Session.set_role``), with the settle rule of the proxy's sessions
        in that tier: a subagent's never parks at settle (its grace keeps its context across the
        tool call), a parent's follows its own rule."""
        self.session.yield_on_settle = role == "parent"
        self.session.set_role(role)


class Proxy:
    """The reverse proxy: forwards every request to ``upstream`` unchanged (less hop-by-hop
    headers), streaming the response back as it arrives, while the request's session holds a
    slot of ``queue_key``.  A session keeps the slot across its consecutive requests and lets it
    go ``grace_ms`` after its last response ends; a hang-up or an upstream failure lets it go at
    once."""

    def __init__(self, upstream: str, *, client: Client, listen: tuple[str, int] = ("127.0.0.1", DEFAULT_PROXY_PORT),
                 queue_key: Optional[str] = None, role: str = "parent", grace_ms: int = GRACE_MS,
                 allow_remote: bool = False, log: Optional[Callable[[str], None]] = None,
                 identity: Tuple[str, ...] = IDENTITY_SOURCES, slot_files: int = SLOT_FILES) -> None:
        import urllib.parse
        from http.server import ThreadingHTTPServer

        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"--upstream must be an http(s) URL (got {upstream!r})")
        if not allow_remote and not _is_loopback(listen[0]):
            raise ValueError(f"refusing to listen on {listen[0]}, which is not a loopback address "
                             "(pass --allow-remote to expose the proxy)")
        if role not in ROLES:
            raise ValueError(f"role must be parent or child (got {role!r})")
        unknown = [s for s in identity if s not in IDENTITY_SOURCES]
        if unknown:
            raise ValueError(f"unknown identity source {unknown[0]!r} (known: {', '.join(IDENTITY_SOURCES)})")
        self.identity = tuple(identity)
        # conversation fingerprint -> the session it was first seen in: a later request of that
        # conversation that names less continues it (bounded: the oldest are forgotten)
        self._conversations: OrderedDict[str, str] = OrderedDict()
        # conversations with nothing named in which a person spoke -> when last seen (monotonic)
        self._people: OrderedDict[str, float] = OrderedDict()
        self.upstream = upstream
        self._target = parsed
        # A client's paths start at the server's root (``/v1/chat/completions``), so an upstream
        # given as the OpenAI base URL (``http://h:8080/v1``) is the same server: not ``/v1/v1``.
        self._base = parsed.path.rstrip("/")
        # llama.cpp's slot files at a switch (it turns itself off where the server has none)
        if isinstance(slot_files, bool) or not isinstance(slot_files, int) or slot_files < 0:
            raise ValueError(f"slot_files must be a count of files, 0 for none (got {slot_files!r})")
        self.slots: Optional[SlotStore] = SlotStore(upstream, slot_files, log=log) if slot_files else None
        # what the server says of itself (its /props), for the daemon's ``maxStreams: "auto"``
        self.props = self.slots or SlotStore(upstream, 1, log=log)
        self.queue_key = queue_key or normalize_url(upstream)
        self.role = role
        self.grace_ms = grace_ms
        self.client = client
        self.log = log or (lambda message: None)
        self._sessions: dict[str, _ProxySession] = {}
        self._recent_gaps: deque[float] = deque(maxlen=8)  # every session's: a new one's first guess
        self._lock = threading.Lock()
        handler = _make_proxy_handler(self)
        self.server = ThreadingHTTPServer(listen, handler)
        self.server.daemon_threads = True

    def upstream_path(self, path: str) -> str:
        """The upstream's path for a request's ``path``: the upstream URL's path, then the
        request's.  An upstream given as its OpenAI base URL (``.../v1``) is the server's root
        plus ``/v1``: a request that names ``/v1`` itself, or a path of the server's own
        (llama.cpp's ``/completion``, ``/props``, Ollama's ``/api/chat``, ``HEAD /``), goes to the
        root; an OpenAI path without it (``/chat/completions``) goes under ``/v1``."""
        base = self._base
        if not base.lower().endswith("/v1"):
            return base + path
        root = base[:-3]
        first = "/" + path.lstrip("/").split("?", 1)[0].split("/", 1)[0]
        return (base if first in _OPENAI_RELATIVE else root) + path

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until ``shutdown()`` (from another thread), which waits up to ``poll_interval``."""
        self.server.serve_forever(poll_interval=poll_interval)

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for ps in sessions:
            ps.session.close()

    # -- sessions -----------------------------------------------------------------------------

    def identify(self, headers: dict[str, str], body: bytes, session: Optional[str] = None,
                 role: Optional[str] = None) -> Identity:
        """The request's identity (``proxy_identity`` under this proxy's sources), continuing the
        session its conversation was seen in when it names less than it did."""
        ident = proxy_identity(headers, body, session=session, role=role, sources=self.identity)
        conv = ident.conversation
        if conv is None:
            return ident
        with self._lock:
            if ident.source in ("fingerprint", "none"):
                seen = self._conversations.get(conv)
                if seen is not None:
                    self._conversations.move_to_end(conv)
                    return ident._replace(session=seen, source="conversation")
            elif ident.session is not None:
                self._conversations[conv] = ident.session
                self._conversations.move_to_end(conv)
                while len(self._conversations) > 4096:
                    self._conversations.popitem(last=False)
        return ident

    def tier(self, ident: Identity, named: Optional[str] = None) -> tuple[str, bool]:
        """A request's (role, interactive).  ``named``: the role its path or headers said; a
        parent named so is a person's session (interactive).  Otherwise its marker's (a subagent
        is a child).  A conversation with nothing named (its fingerprint) is a person's once a
        person spoke in it (``person_turn``): a parent, interactive; while one is (a request of
        it within ``PERSON_AWAY_S``), every other such conversation is background: a child.  With
        no person in sight, the proxy's default role, as for a session named without a role."""
        if named is not None:
            return named, named == "parent"
        if ident.role is not None:
            return ident.role, False
        key = ident.session
        if key is None or not key.startswith("conv:"):
            return self.role, False
        now = time.monotonic()
        behind: list[_ProxySession] = []
        with self._lock:
            people = self._people
            while people and now - next(iter(people.values())) > PERSON_AWAY_S:
                people.popitem(last=False)  # oldest seen first
            if not (ident.person or key in people):
                return ("child" if people else self.role), False
            if not people:  # the first person in sight: the others' queued requests go behind now
                behind = [ps for k, ps in self._sessions.items()
                          if k != key and k.startswith("conv:") and ps.session.role != "child" and not ps.interactive]
            people.pop(key, None)
            people[key] = now
            while len(people) > 256:
                people.popitem(last=False)
        for ps in behind:
            ps.set_role("child")
        return "parent", True

    def unattended(self, ident: Identity, named: Optional[str], role: str) -> bool:
        """Whether a request (tiered ``role`` by ``tier``) is a parent with no person behind it: a
        conversation with nothing named (its fingerprint), while no person is in sight, that goes
        on after a reply of the model (``continues``) with something other than a person's words:
        an agent's loop.  Its acquires say ``background``: where the server keeps only so many
        contexts, it waits for one still in use as a child does (else every agent, a parent, goes
        first in turn, and each evicts the next one's context).  A conversation's opening request
        is never one: a person's first words look like an agent's task, and a person must not
        wait for agents' contexts."""
        key = ident.session
        if named is not None or ident.role is not None or role != "parent" or not ident.continued:
            return False
        if key is None or not key.startswith("conv:"):
            return False
        with self._lock:
            return not self._people

    def hold_window(self, ps: _ProxySession, ending: Optional[str]) -> Optional[float]:
        """How long (seconds) a session keeps its slot after a response before it parks, that
        is hands it to a waiter (it keeps it while nobody waits, up to the grace):

        - the response ended the agent's turn: no time (its agent waits on a person or a parent);
        - it asked for a tool: the grace (the agent comes right back, its context still warm);
        - otherwise, for a parent named so by its path or headers: its own rule (a person's
          session, ``PARENT_HANDBACK_MS``);
        - otherwise: as long as the session's own tool calls take, 1.5x its longest recent gap
          plus 0.2 s, within ``PARENT_HANDBACK_MS`` and the grace (before its first gap: its
          peers' recent gaps, or the whole grace when none is known).

        Except that where switches are cheap (the daemon learned that sessions back on the slot
        find their context kept, or the server takes slot files and a save and restore fit the
        window with room, ``SlotStore.cheap_within``), only a named parent keeps its slot: any
        other hands over at once, since a waiter going first costs it no prefill."""
        grace = self.grace_ms / 1000.0
        if ending == "turn":
            return 0.0
        window = grace if ending == "tool" else tool_gap_window(tuple(ps.gaps) or tuple(self._recent_gaps), grace)
        if not ps.interactive and (self.client.switch_cost(self.queue_key) == "cheap" or
                                   self.slots is not None and self.slots.cheap_within(window)):
            return 0.0
        if ending == "tool":
            return grace
        if ps.interactive:
            return None
        return window

    def begin(self, session_key: Optional[str], role: str,
              client_sock: Optional[socket.socket] = None, interactive: bool = False,
              background: bool = False, length: int = 0) -> _ProxySession:
        """Hold the slot for a request of ``session_key`` (a fresh session when None).  While it
        waits, ``client_sock`` is watched: an HTTP client that hangs up leaves the queue
        (Cancelled), as a socket client that disconnects would.  ``background``: a parent with
        no person behind it (``unattended``), from this request's acquire on.  ``length``: the
        request's conversation length (``conversation_length``)."""
        import uuid

        with self._lock:
            busy = self._sessions.get(session_key or "")
            if (session_key is not None and session_key.startswith("conv:") and busy is not None
                    and busy.lengths and length <= max(busy.lengths)):
                # Two identical conversations with nothing named (two runs of one prompt): one
                # grant must never cover both on the server, so the second is a session of its own.
                # (A continuation is longer than the request it follows: it holds its answer.)
                session_key = None
            own = session_key is None
            key = session_key or f"proxy-{uuid.uuid4()}"
            ps = self._sessions.get(key)
            if ps is None:
                # A proxy session settles after every response: a subagent's grace is what keeps
                # its context across the tool call before its next request, so it never parks
                # at settle (it still hands back to a waiting parent at its next request).
                ps = self._sessions[key] = _ProxySession(
                    self.client.session(self.queue_key, key, role, grace_ms=self.grace_ms,
                                        yield_on_settle=None if role == "parent" else False,
                                        slots=self.slots), own,
                    interactive and role == "parent")
                if own:  # nobody can ask for this context back by name: never worth a file
                    ps.session.slot_key = None
            retier = ps.session.role != role
            ps.interactive = interactive and role == "parent"
            ps.session.background = background  # from its next acquire
            ps.inflight += 1
            ps.lengths.append(length)
            if ps.inflight == 1 and ps.last_end is not None:
                gap = time.monotonic() - ps.last_end
                if gap <= self.grace_ms / 1000.0:  # a longer one let the slot go: no tool call
                    ps.gaps.append(gap)
                    if not ps.interactive:  # a person's think time tells nothing of the agents' tool calls
                        self._recent_gaps.append(gap)
        if retier:  # a person spoke in it, or in another: the session changes tier from here
            ps.set_role(role)
        waiting = threading.Event()
        if client_sock is not None:
            threading.Thread(target=self._watch_hangup, args=(client_sock, waiting, key),
                             name="llmqueue-proxy-watch", daemon=True).start()
        try:
            with ps.starting:  # concurrent requests of one session share one acquire
                with self._lock:
                    alone = ps.inflight == 1  # nothing of this session streams: a boundary
                ps.session._before_request(None, may_hand_back=alone, starts_run=True)
        except BaseException:
            self.end(key, ok=False, length=length)
            raise
        finally:
            waiting.set()
        return ps

    def _watch_hangup(self, sock: socket.socket, done: threading.Event, key: str) -> None:
        while not done.wait(0.1):
            try:
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    continue  # the client sent more (a pipelined request): still there
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                pass
            with self._lock:  # end of file: the client is gone
                ps = self._sessions.get(key)
                alone = ps is not None and ps.inflight == 1
            if alone and ps is not None and not done.is_set():
                ps.session.abort()  # its only request: leave the queue now
            return

    def end(self, key: str, *, ok: bool, ending: Optional[str] = None, person: bool = False,
            length: int = 0) -> None:
        """A request of ``key`` is over: the session settles (grace, parking after its
        ``hold_window``) after its last request, or lets go at once after a failure or when it
        was a session of its own.  ``ending``: how the response said it ended (``_ending``).
        ``person``: the request carried a person's words (``person_turn``).  In a person's
        session, a response that ended the turn, or one to a person's words that asked for no
        tool (cut at ``max_tokens``, say: shown to the person), leaves the next turn to the
        person: the park says so (``Session.settle``'s ``person``)."""
        with self._lock:
            ps = self._sessions.get(key)
            if ps is None:
                return
            ps.inflight -= 1
            if length in ps.lengths:
                ps.lengths.remove(length)
            last = ps.inflight <= 0
            if last:
                ps.last_end = time.monotonic()
            if last and (ps.own or not ok):
                del self._sessions[key]
        if not last:
            return
        if ps.own:
            ps.session.close()
            return
        # A request of the session may have begun since `last` was decided, and may be streaming
        # on the slot already: settling now would park a live holder.  Its begin() holds
        # `starting` while it makes sure of the slot, so the check and the settle go under it.
        with ps.starting:
            with self._lock:
                if ps.inflight > 0:
                    return  # that request holds the slot now; its own end settles
            if ok:
                lease = ps.session.lease
                if lease is not None and lease.held:
                    ps.session._mark(lease, False)  # nothing of the session streams now
                # a response that did not end the run for sure is a tool call's gap: it comes back
                turn = ps.interactive and (ending == "turn" or ending is None and person)
                ps.session.settle(park_after=self.hold_window(ps, ending), gap=ending != "turn" and not turn,
                                  person=turn)
                # Forget the session once its grace has let the slot go (and no request came).
                self.client.call_later(self.grace_ms / 1000.0 + 1.0, lambda: self._forget(key, ps))
            else:
                ps.session.abort()  # cancel: released at once

    def _forget(self, key: str, ps: _ProxySession) -> None:
        with self._lock:
            if self._sessions.get(key) is ps and ps.inflight <= 0 and ps.session.lease is None:
                del self._sessions[key]


def _make_proxy_handler(proxy: Proxy) -> Any:
    import http.client
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = f"llmqueue-proxy/{__version__}"

        def log_message(self, format: str, *args: Any) -> None:
            proxy.log(f"{self.address_string()} {format % args}")

        def send_response_only(self, code: int, message: Optional[str] = None) -> None:
            self._status = code
            super().send_response_only(code, message)

        def _error(self, status: int, kind: str, message: str) -> None:
            body = json.dumps({"error": {"message": message, "type": kind, "upstream": proxy.upstream}}).encode()
            self.send_response_only(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _read_body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                body = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return bytes(body)
                    body += self.rfile.read(size)
                    self.rfile.readline()
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length > 0 else b""

        def _forward(self) -> None:
            session, role, path = _split_session_path(self.path)
            session = self.headers.get(SESSION_HEADER) or session
            role = self.headers.get(ROLE_HEADER) or role
            if role is not None and role not in ROLES:
                self._error(400, "llmqueue_bad_role", f"role must be parent or child (got {role!r})")
                return
            try:
                body = self._read_body()
            except ValueError:
                self._error(400, "llmqueue_bad_request", "unreadable request body")
                self.close_connection = True
                return
            self._status = 0
            started = time.monotonic()
            if not model_call(self.command, path):  # no slot, no switch, no count
                self._relay(path, body)
                proxy.log(f"{self.command} {path} -> {self._status or 'no answer'} in "
                          f"{time.monotonic() - started:.2f} s, passed through (no model call: no slot)")
                return
            ident = proxy.identify({k.lower(): v for k, v in self.headers.items()}, body, session, role)
            named = role
            role, interactive = proxy.tier(ident, named)
            background = proxy.unattended(ident, named, role)
            whose = " (a person's session)" if interactive else " (no person in sight)" if background else ""
            proxy.log(f"{self.command} {path}: session {ident.session or '(its own)'} as {role}{whose}, "
                      f"from {ident.source}")
            length = ident.length
            try:
                ps = proxy.begin(ident.session, role, self.connection, interactive, background, length)
            except DaemonUnavailable as e:
                self._error(503, "llmqueue_unavailable", f"the llmqueue daemon is unavailable: {e}")
                proxy.log(f"{self.command} {path} -> 503 in {time.monotonic() - started:.2f} s: no daemon")
                return
            except Cancelled:
                self.close_connection = True  # the client hung up while queued
                proxy.log(f"{self.command} {path} -> no answer in {time.monotonic() - started:.2f} s: "
                          "the client hung up while queued")
                return
            key = ps.session.session_key
            ok = False
            self._scanner: Optional[UsageScanner] = None
            try:
                ok = self._relay(path, body)
                counts = self._scanner.result() if self._scanner is not None else None
                if counts is not None:  # before the slot can go: the log ties it to this grant
                    proxy.client.usage(proxy.queue_key, key, *counts,
                                       prefill_ms=self._scanner.prefill_ms(self._sent) if self._scanner else None,
                                       server=proxy.props.figures() if proxy.client.streams_auto(proxy.queue_key)
                                       else None, decode=self._scanner.decode() if self._scanner else None)
            finally:
                proxy.end(key, ok=ok, ending=self._scanner.ending if self._scanner is not None else None,
                          person=ident.person, length=length)
                proxy.log(f"{self.command} {path} -> {self._status or 'no answer'} in "
                          f"{time.monotonic() - started:.2f} s, session {key}")

        def _relay(self, path: str, body: bytes) -> bool:
            """Forward one request and stream its response back; True when it completed well."""
            target = proxy._target
            cls = http.client.HTTPSConnection if target.scheme == "https" else http.client.HTTPConnection
            upstream = cls(target.hostname or "", target.port, timeout=30)
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in _HOP_BY_HOP and not k.lower().startswith("x-llmqueue-")}
            for name in (self.headers.get("Connection") or "").split(","):
                headers.pop(name.strip(), None)  # fields the Connection header names are hop-by-hop too
            headers["Host"] = target.netloc
            if body or self.command in ("POST", "PUT", "PATCH"):
                headers["Content-Length"] = str(len(body))
            self._sent = time.monotonic()
            try:
                upstream.request(self.command, proxy.upstream_path(path), body=body or None, headers=headers)
                if upstream.sock is not None:
                    upstream.sock.settimeout(None)  # a stream may pause for as long as it likes
                response = upstream.getresponse()
            except (OSError, http.client.HTTPException) as e:
                upstream.close()
                self._error(502, "llmqueue_upstream_unreachable",
                            f"upstream {proxy.upstream} is unreachable: {e}")
                return False
            try:
                return self._stream(response) and response.status < 400
            except OSError:  # the client hung up mid-stream: close the upstream request too
                self.close_connection = True
                return False
            finally:
                upstream.close()

        def _stream(self, response: http.client.HTTPResponse) -> bool:
            self.send_response_only(response.status, response.reason)
            for k, v in response.getheaders():
                if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            no_body = self.command == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200
            length = response.getheader("Content-Length")
            chunked = False
            if no_body:
                if length is not None:
                    self.send_header("Content-Length", length)
            elif length is not None and response.getheader("Transfer-Encoding") is None:
                self.send_header("Content-Length", length)
            elif self.request_version == "HTTP/1.1":
                self.send_header("Transfer-Encoding", "chunked")
                chunked = True
            else:
                self.close_connection = True
            self.end_headers()
            self.wfile.flush()
            if no_body:
                return True
            scanner = self._scanner = UsageScanner(response.getheader("Content-Type") or "")
            while True:
                try:
                    data = response.read1(65536)
                except (OSError, http.client.HTTPException):
                    self.close_connection = True
                    return False  # the upstream broke off mid-stream
                if not data:
                    break
                if chunked:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                else:
                    self.wfile.write(data)
                self.wfile.flush()
                scanner.feed(data)  # after the client has it: the scan never delays a token
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
            return True

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _forward

    return Handler


# =================================================================================================
# Reading the event log
#
# ``llmqueue report`` turns the daemon's event log into figures per queue and a timeline
# picture.  Reading is forgiving: a torn last line, lines that are not JSON, and events it does
# not know are skipped; rotated files given together are merged in time order.  The figures and
# the picture come from the same replay.
# =================================================================================================


class Hold(NamedTuple):
    """One session's time in a slot, as the log tells it."""

    session: str
    role: str
    start: float  # epoch seconds
    end: float
    how: str  # release reason, "ttl" for an eviction, or "open" (still held when the log ends)
    switch: bool  # granted from the waiting list (a switch)
    spare: bool = False  # on a parent's spare stream (its grant line said so)


class Wait(NamedTuple):
    session: str
    role: str
    start: float
    end: float
    granted: bool  # False: it left without a grant (cancel, disconnect) or still waits


_MINUTE_CACHE: dict[str, float] = {}


def _epoch(ts: Any) -> Optional[float]:
    """``2026-11-29T15:44:01.123Z`` as epoch seconds; None when it is not such a timestamp.
    Hand-parsed with the minute cached: a report reads 100,000 of these in a blink."""
    if not isinstance(ts, str) or len(ts) < 19 or ts[10] != "T":
        return None
    minute = _MINUTE_CACHE.get(ts[:16])
    try:
        if minute is None:
            import calendar

            minute = float(calendar.timegm((int(ts[:4]), int(ts[5:7]), int(ts[8:10]),
                                            int(ts[11:13]), int(ts[14:16]), 0)))
            if len(_MINUTE_CACHE) > 100_000:
                _MINUTE_CACHE.clear()
            _MINUTE_CACHE[ts[:16]] = minute
        return minute + float(ts[17:-1] if ts[-1] == "Z" else ts[17:])
    except ValueError:
        return None


def _log_records(text: str) -> list[Any]:
    """The JSON values of a log's lines.  One parse of the whole file when every line is whole;
    line by line, skipping the torn or garbled ones, when not."""
    lines = [line for line in text.split("\n") if line.strip()]
    try:
        records = json.loads("[" + ",".join(lines) + "]")
        if isinstance(records, list) and len(records) == len(lines):
            return records
    except (ValueError, RecursionError):
        pass
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except (ValueError, RecursionError):
            continue  # a torn line (the last one of a live log) or garbage
    return out


def read_event_log(paths: List[str]) -> list[dict[str, Any]]:
    """Every usable event of the given log files, in time order, each with ``t`` (epoch s)."""
    events: list[dict[str, Any]] = []
    for path in paths:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
        minutes, keep = _MINUTE_CACHE, events.append
        for event in _log_records(text):
            try:
                ts = event["ts"]
                minute = minutes.get(ts[:16]) if ts.__class__ is str else None
                if minute is not None and ts[16] == ":":  # the common case, inline: a known minute
                    t: Optional[float] = minute + float(ts[17:-1] if ts[-1] == "Z" else ts[17:])
                else:
                    t = _epoch(ts)
                if t is None or event["event"].__class__ is not str or event["queueKey"].__class__ is not str:
                    continue
            except (TypeError, KeyError, AttributeError, ValueError, IndexError):
                continue  # not an object, or not an event of ours
            event["t"] = t
            keep(event)
    events.sort(key=lambda e: e["t"])  # stable: same-ts events keep their file order
    return events


def _percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(-(-p * len(ordered) // 100)) - 1))  # nearest rank
    return ordered[rank]


def _parse_when(text: str, end: float) -> float:
    """``--since``/``--until``: an ISO-8601 UTC time, or a duration before the log's end (``90m``)."""
    from datetime import datetime, timezone

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text and text[-1] in units and text[:-1].replace(".", "", 1).isdigit():
        return end - float(text[:-1]) * units[text[-1]]
    try:
        when = datetime.fromisoformat(text[:-1] if text.endswith("Z") else text)
    except ValueError:
        raise ValueError(f"not an ISO-8601 time or a duration like 90m: {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def _log_ms(value: Any) -> Optional[float]:
    """A duration a log line gives, or None where it gives none the daemon could have written."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_PREFILL_MS
    return float(value) if ok else None


def replay(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per queue: its holds, waits and point events (switches, idle yields, evictions,
    over-capacity reloads), replayed from the log."""
    queues: dict[str, dict[str, Any]] = {}
    end = events[-1]["t"] if events else 0.0
    for e in events:
        key = normalize_url(e["queueKey"])  # a log from before one key named both forms of a server
        q = queues.get(key)
        if q is None:
            q = queues[key] = {"holds": [], "waits": [], "open": {}, "waiting": {}, "switches": [],
                               "idle": [], "parked": [], "handback": [], "evictions": [], "config": [], "grants": [],
                               "sessions": {}, "usage": [], "switch_seqs": set(), "kept": [], "dead": [],
                               "past_switch": [], "timed": []}
        kind, t = e["event"], e["t"]
        if kind == "config":
            q["config"].append(t)
            continue
        session = e.get("sessionKey")
        if session is None:
            continue
        if kind == "grant":  # the branches in order of how often they come
            role = e.get("role") or "parent"
            q["sessions"].setdefault(session, None)  # lanes in order of first appearance
            q["grants"].append(t)
            queued = q["waiting"].pop(session, None)
            if queued is not None:
                q["waits"].append(Wait(session, role, queued[0], t, True))
            q["open"][session] = (t, role, queued is not None, e.get("spare") is True)
            continue
        if kind == "switch":
            q["switches"].append((t, session))
            q["switch_seqs"].add(e.get("seq"))
            continue
        if kind == "dead":
            ms = e.get("ms")
            if isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0:
                q["dead"].append((t, session, float(ms)))
                switch = e.get("switchMs")  # issue 33's rule: it would have kept the slot this long
                if isinstance(switch, (int, float)) and not isinstance(switch, bool) and switch >= 0:
                    q["past_switch"].append((t, max(0.0, float(ms) - float(switch)), float(ms)))
            continue
        if kind == "usage":
            prefilled, reused = e.get("prefilled"), e.get("reused")
            if _count(prefilled) is not None and _count(reused) is not None:
                q["usage"].append((t, session, prefilled, reused, e.get("seq")))
                q["timed"].append((t, e.get("seq"), _log_ms(e.get("prefillMs")), _log_ms(e.get("decodeMs"))))
            kept, depth = e.get("kept"), _count(e.get("depth"))
            if isinstance(kept, (int, float)) and not isinstance(kept, bool) and 0 <= kept <= 1:
                q["kept"].append((t, float(kept), session, depth if depth is not None and depth >= 1 else 1))
            continue
        if kind == "release" or kind == "evict":
            reason = e.get("reason") or kind
            if kind == "release" and reason == "idle":
                q["idle"].append(t)
            elif kind == "release" and reason == "parked":
                q["parked"].append(t)
            elif kind == "release" and reason == "handback":
                q["handback"].append(t)
            if kind == "evict":
                q["evictions"].append(t)
            held = q["open"].pop(session, None)
            if held is not None:
                q["holds"].append(Hold(session, held[1], held[0], t, reason, held[2], held[3]))
            continue
        role = e.get("role") or "parent"
        if kind == "queued":
            q["sessions"].setdefault(session, None)
            q["waiting"][session] = (t, role)
        elif kind == "dequeue" and session in q["waiting"]:
            start, was = q["waiting"].pop(session)
            if e.get("reason") != "merged":  # merged: it went on waiting (or holding) elsewhere
                q["waits"].append(Wait(session, was, start, t, False))
        elif kind == "move":  # a reload moved it from another queue
            src = queues.get(str(e.get("from")))
            if src is not None and e.get("what") == "holder" and session in src["open"]:
                start, was, switch, spare = src["open"].pop(session)
                src["holds"].append(Hold(session, was, start, t, "moved", switch, spare))
                q["open"][session] = (t, role, False, spare)
            elif src is not None and session in src["waiting"]:
                q["waiting"][session] = src["waiting"].pop(session)
        # any other event: unknown to this version, skipped
    for q in queues.values():
        for session, (start, role, switch, spare) in q.pop("open").items():
            q["holds"].append(Hold(session, role, start, end, "open", switch, spare))
        for session, (start, role) in q.pop("waiting").items():
            q["waits"].append(Wait(session, role, start, end, False))
        q["holds"].sort(key=lambda h: h.start)
    return queues


def build_report(events: list[dict[str, Any]], since: Optional[float] = None, until: Optional[float] = None,
                 queue: Optional[str] = None) -> dict[str, Any]:
    """The figures of ``llmqueue report``: per queue, grants, switches (and per hour), time held
    per tier and per session, waits per tier (p50/p95/max), idle yields, TTL evictions,
    over-capacity reloads, utilisation (share of the window with a slot held), and where the
    server timed its requests, its prefill (after switches too) and decode (``serverMs``)."""
    if not events:
        return {"since": None, "until": None, "queues": {}}
    start = since if since is not None else events[0]["t"]
    stop = until if until is not None else events[-1]["t"]
    span = max(stop - start, 1e-9)
    out: dict[str, Any] = {"since": _iso_utc(start), "until": _iso_utc(stop), "queues": {}}
    import bisect

    def count(times: list[float]) -> int:  # times are in log order, which is time order
        return bisect.bisect_right(times, stop) - bisect.bisect_left(times, start)

    for key, q in replay(events).items():
        if queue is not None and key != normalize_url(queue):
            continue

        def inside(t: float) -> bool:
            return start <= t <= stop

        held_tier = {role: 0.0 for role in ROLES}
        held_session: dict[str, float] = {}
        edges: list[tuple[float, int]] = []
        for h in q["holds"]:
            a, b = max(h.start, start), min(h.end, stop)
            if b < a or (b == a and not start <= h.start <= stop):
                continue  # outside the window (a hold shorter than the log's ms still counts)
            held_tier[h.role] = held_tier.get(h.role, 0.0) + (b - a)
            held_session[h.session] = held_session.get(h.session, 0.0) + (b - a)
            edges += [(a, 1), (b, -1)]
        busy = 0.0
        depth = 0
        last = start
        for t, step in sorted(edges):
            if depth > 0:
                busy += t - last
            depth += step
            last = t
        waits: dict[str, dict[str, Any]] = {}
        for role in ROLES:
            done = [(w.end - w.start) * 1000 for w in q["waits"] if w.role == role and w.granted and inside(w.end)]
            waits[role] = {"count": len(done), "p50Ms": round(_percentile(done, 50)),
                           "p95Ms": round(_percentile(done, 95)), "maxMs": round(max(done, default=0.0))}
        switches = count([t for t, _ in q["switches"]])
        tokens = _token_figures([u for u in q["usage"] if inside(u[0])], q["switch_seqs"])
        if tokens is not None:
            returns = [(k, s, d) for t, k, s, d in q["kept"] if inside(t)]
            kept = [k for k, _, _ in returns]
            tokens["returns"] = {"requests": len(kept),
                                 "meanKept": round(sum(kept) / len(kept), 3) if kept else None,
                                 "switchCost": switch_cost(kept, "auto", [s for _, s, _ in returns],
                                                           [d for _, _, d in returns])}
        dead_session: dict[str, float] = {}
        for t, session, ms in q["dead"]:
            if inside(t):
                dead_session[session] = dead_session.get(session, 0.0) + ms
        out["queues"][key] = {
            "grants": count(q["grants"]),
            "switches": switches,
            "switchesPerHour": round(switches / span * 3600, 2),
            "heldMs": {role: round(v * 1000) for role, v in held_tier.items()},
            "heldMsBySession": {s: round(v * 1000) for s, v in
                                sorted(held_session.items(), key=lambda kv: -kv[1])},
            "waits": waits,
            "abandonedWaits": sum(1 for w in q["waits"] if not w.granted and w.end < stop and inside(w.end)),
            "idleYields": count(q["idle"]),
            "parkYields": count(q["parked"]),
            "handbackYields": count(q["handback"]),
            "ttlEvictions": count(q["evictions"]),
            "overCapacityReloads": count(q["config"]),
            "utilisation": round(busy / span, 4),
            "meanHolders": round(sum(held_tier.values()) / span, 3),
            # held with no request in flight while someone waited (clients that say ``busy``),
            # from the log's ``dead`` events, each counted at its spell's end
            "deadMs": round(sum(dead_session.values())),
            "deadMsBySession": {s: round(ms) for s, ms in sorted(dead_session.items(), key=lambda kv: -kv[1])},
        }
        priced = [(past, ms) for t, past, ms in q["past_switch"] if inside(t)]
        if priced:  # additive: the dead time past what a switch would have cost (issue 33's rule)
            out["queues"][key]["deadPastSwitchMs"] = round(sum(past for past, _ in priced))
            out["queues"][key]["deadPricedMs"] = round(sum(ms for _, ms in priced))
        if tokens is not None:
            out["queues"][key]["tokens"] = tokens
        timed = [u for u in q["timed"] if inside(u[0])]
        if any(p is not None or d is not None for _, _, p, d in timed):
            # additive (issue 33): where the server's time went, as it timed it
            firsts: set[Any] = set()
            after = 0.0
            for _, seq, p, _ in timed:
                if seq is not None and seq not in firsts:
                    firsts.add(seq)
                    if seq in q["switch_seqs"]:
                        after += p or 0.0
            out["queues"][key]["serverMs"] = {
                "timed": sum(1 for _, _, p, d in timed if p is not None or d is not None),
                "prefill": round(sum(p or 0.0 for _, _, p, _ in timed)), "prefillAfterSwitch": round(after),
                "decode": round(sum(d or 0.0 for _, _, _, d in timed))}
    return out


def _token_figures(usage: list[tuple[float, str, int, int, Any]], switch_seqs: set[Any]) -> Optional[dict[str, Any]]:
    """Prefilled and reused prompt tokens (from ``usage`` events): in all, per session, and for
    the first request after each switch, whose prefill is the switch's price.  ``saved`` is what
    the server did not prefill again, against requests that would have prefilled everything."""
    if not usage:
        return None
    by_session: dict[str, dict[str, int]] = {}
    seen: set[Any] = set()
    after = [0, 0]
    for _, session, prefilled, reused, seq in usage:
        s = by_session.setdefault(session, {"requests": 0, "prefilled": 0, "reused": 0})
        s["requests"] += 1
        s["prefilled"] += prefilled
        s["reused"] += reused
        if seq is not None and seq not in seen:
            seen.add(seq)
            if seq in switch_seqs:
                after[0] += 1
                after[1] += prefilled
    prefilled = sum(s["prefilled"] for s in by_session.values())
    reused = sum(s["reused"] for s in by_session.values())
    return {"requests": len(usage), "prefilled": prefilled, "reused": reused, "saved": reused,
            "reusedShare": round(reused / (prefilled + reused), 4) if prefilled + reused else 0.0,
            "afterSwitch": {"requests": after[0], "prefilled": after[1],
                            "meanPrefilled": round(after[1] / after[0]) if after[0] else 0},
            "bySession": dict(sorted(by_session.items(), key=lambda kv: -kv[1]["prefilled"]))}


def _duration(ms: float) -> str:
    s = ms / 1000.0
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _by_session(ms_by_session: dict[str, Any]) -> str:
    """The first 8 sessions of a per-session duration figure, and how many more there are."""
    top = list(ms_by_session.items())
    more = f", and {len(top) - 8} more" if len(top) > 8 else ""
    return ", ".join(f"{s} {_duration(ms)}" for s, ms in top[:8]) + more


def format_report(report: dict[str, Any]) -> str:
    if not report["queues"]:
        return "no queue events in the log\n"
    out = [f"window {report['since']} .. {report['until']}"]
    for key, r in report["queues"].items():
        out.append("")
        out.append(f"queue {key}")
        out.append(f"  grants {r['grants']}  switches {r['switches']} ({r['switchesPerHour']}/h)  "
                   f"idle-yields {r['idleYields']}  park-yields {r['parkYields']}  "
                   f"handbacks {r['handbackYields']}  "
                   f"ttl-evictions {r['ttlEvictions']}  over-capacity reloads {r['overCapacityReloads']}")
        out.append(f"  utilisation {r['utilisation'] * 100:.1f}% of the window with a slot held, "
                   f"{r['meanHolders']} holders on average")
        out.append("  held: " + "  ".join(f"{role} {_duration(ms)}" for role, ms in r["heldMs"].items()))
        for role, w in r["waits"].items():
            out.append(f"  waits {role}: n={w['count']}  p50 {_duration(w['p50Ms'])}  "
                       f"p95 {_duration(w['p95Ms'])}  max {_duration(w['maxMs'])}")
        if r["abandonedWaits"]:
            out.append(f"  waits abandoned (cancel, disconnect): {r['abandonedWaits']}")
        out.append(f"  held by session: {_by_session(r['heldMsBySession'])}")
        if r["deadMs"]:
            held_ms = sum(r["heldMs"].values())
            share = f" ({r['deadMs'] / held_ms * 100:.0f}% of the time held)" if held_ms else ""
            out.append(f"  dead time: {_duration(r['deadMs'])} held with no request in flight while someone "
                       f"waited{share}: {_by_session(r['deadMsBySession'])}")
            if "deadPastSwitchMs" in r:
                out.append(f"  of it past what a switch would have cost: {_duration(r['deadPastSwitchMs'])} "
                           f"(of {_duration(r['deadPricedMs'])} priced; one rule for the slot hands over then)")
        tokens = r.get("tokens")
        if tokens:
            out.append(f"  tokens: {tokens['requests']} requests prefilled {tokens['prefilled']:,} and reused "
                       f"{tokens['reused']:,} ({tokens['reusedShare'] * 100:.0f}% of prompt tokens); saved "
                       f"{tokens['saved']:,} against prefilling every prompt afresh")
            after = tokens["afterSwitch"]
            out.append(f"  after a switch: {after['requests']} requests prefilled {after['prefilled']:,} "
                       f"({after['meanPrefilled']:,} each)")
            back = tokens.get("returns")
            if back and back["requests"]:
                out.append(f"  back after a switch: {back['requests']} request{'s' if back['requests'] != 1 else ''} found {back['meanKept'] * 100:.0f}% "
                           f"of their context kept: switches are {back['switchCost']}")
            server = r.get("serverMs")
            if server:
                out.append(f"  server time, as it timed {server['timed']} of {tokens['requests']} requests: "
                           f"prefill {_duration(server['prefill'])} (after a switch "
                           f"{_duration(server['prefillAfterSwitch'])}), decode {_duration(server['decode'])}")
            rows = list(tokens["bySession"].items())
            shown = ", ".join(f"{s} {v['prefilled']:,}/{v['reused']:,}" for s, v in rows[:8])
            more = f", and {len(rows) - 8} more" if len(rows) > 8 else ""
            out.append(f"  tokens by session (prefilled/reused): {shown}{more}")
    return "\n".join(out) + "\n"


_SVG_COLORS = {"parent": "#2563eb", "child": "#ea580c", "wait": "#9ca3af", "dead": "#dc2626",
               "switch": "#111827", "idle": "#7c3aed", "ttl": "#dc2626"}


def _ticks(start: float, stop: float, want: int = 10) -> list[float]:
    steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400]
    span = max(stop - start, 1e-3)
    step = next((s for s in steps if span / s <= want), steps[-1] * max(1, int(span / steps[-1] / want) + 1))
    first = (int(start // step) + 1) * step
    return [first + i * step for i in range(int((stop - first) // step) + 1)]


def render_svg(events: list[dict[str, Any]], since: Optional[float] = None, until: Optional[float] = None,
               queue: Optional[str] = None, width: int = 1200, max_lanes: int = 40) -> str:
    """A timeline: one lane per session, grouped by queue; holds as bars coloured by tier, waits
    as thin grey lines before them, switches, idle yields and evictions as markers, a time axis
    and a legend.  Bars closer than a pixel merge, and a queue shows at most ``max_lanes``
    sessions (the rest share one lane), so a day of events stays legible and small."""
    from xml.sax.saxutils import escape

    queues = replay(events)
    if queue is not None:
        queues = {k: v for k, v in queues.items() if k == normalize_url(queue)}
    start = since if since is not None else (events[0]["t"] if events else 0.0)
    stop = until if until is not None else (events[-1]["t"] if events else 1.0)
    stop = max(stop, start + 1e-3)
    left, right, lane_h, top = 200, 20, 16, 56
    plot = width - left - right

    def x(t: float) -> float:
        return left + (min(max(t, start), stop) - start) / (stop - start) * plot

    body: list[str] = []
    y = top
    for key, q in queues.items():
        body.append(f'<text class="queue" x="4" y="{y + 12}">{escape(key)}</text>')
        y += lane_h + 2
        sessions = list(q["sessions"])
        lanes = sessions[:max_lanes]
        lane_of = {s: i for i, s in enumerate(lanes)}
        overflow = len(sessions) - len(lanes)
        names = [escape(s) for s in lanes] + ([f"(+{overflow} more sessions)"] if overflow > 0 else [])
        for i, name in enumerate(names):
            body.append(f'<text class="lane" x="12" y="{y + i * lane_h + 11}">{name}</text>')
            body.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y + i * lane_h + lane_h - 1}" '
                        f'y2="{y + i * lane_h + lane_h - 1}"/>')

        def lane_y(session: str) -> int:
            return y + lane_h * lane_of.get(session, len(lanes))

        spans: dict[int, list[list[float]]] = {}  # waits per lane, merged when closer than a pixel
        for w in sorted(q["waits"], key=lambda w: w.start):
            if w.end < start or w.start > stop:
                continue
            lane = spans.setdefault(lane_y(w.session), [])
            a, b = x(w.start), x(w.end)
            if lane and a - lane[-1][1] < 1.0:
                lane[-1][1] = max(lane[-1][1], b)
            else:
                lane.append([a, b])
        for ly, lane_spans in spans.items():
            for a, b in lane_spans:
                body.append(f'<line class="wait" x1="{a:.1f}" x2="{b:.1f}" y1="{ly + lane_h // 2}" '
                            f'y2="{ly + lane_h // 2}"/>')
        merged: dict[tuple[int, str], list[Any]] = {}
        bars: list[list[Any]] = []
        for h in q["holds"]:
            if h.end < start or h.start > stop:
                continue
            a, b = x(h.start), x(h.end)
            slot = (lane_y(h.session), h.role)
            bar = merged.get(slot)
            if bar is not None and a - bar[2] < 1.0:  # closer than a pixel: one bar
                bar[2] = max(bar[2], b)
                bar[3] += 1
                continue
            bar = [slot, a, b, 1, h]
            merged[slot] = bar
            bars.append(bar)
        for (ly, role), a, b, count, h in bars:
            bar_w = max(b - a, 1.0)
            label = f"{h.session} {role}" + (f": {count} holds" if count > 1 else
                                             f": {_duration((h.end - h.start) * 1000)}, ended by {h.how}")
            tip = f"<title>{escape(label)}</title>" if bar_w >= 3 else ""  # only where one can point
            body.append(f'<rect class="hold {role}" x="{a:.1f}" y="{ly + 2}" width="{bar_w:.1f}" '
                        f'height="{lane_h - 5}">{tip}</rect>')
        for t, session, ms in q["dead"]:  # on the holder's bar: held, nothing in flight, someone waiting
            a, b = x(t - ms / 1000.0), x(t)
            if b < left or t - ms / 1000.0 > stop:
                continue
            ly = lane_y(session)
            body.append(f'<rect class="dead" x="{a:.1f}" y="{ly + 2}" width="{max(b - a, 1.0):.1f}" '
                        f'height="{lane_h - 5}"><title>{escape(session)}: dead {_duration(ms)} '
                        f'(held, nothing in flight, someone waiting)</title></rect>')
        last_mark: dict[tuple[str, int], float] = {}  # markers closer than 3 px in a lane: one

        def crowded(kind: str, ly: int, at: float) -> bool:
            if at - last_mark.get((kind, ly), -10.0) < 3.0:
                return True
            last_mark[(kind, ly)] = at
            return False

        per_lane: dict[int, int] = {}
        for t, session in q["switches"]:
            if start <= t <= stop and session is not None:
                per_lane[lane_y(session)] = per_lane.get(lane_y(session), 0) + 1
        for t, session in q["switches"]:
            if start <= t <= stop and session is not None:
                ly = lane_y(session)
                if per_lane[ly] * 8 > plot:  # too dense for diamonds: a tick atop the lane
                    if not crowded("switch", ly, x(t)):
                        body.append(f'<line class="switch-tick" x1="{x(t):.1f}" x2="{x(t):.1f}" '
                                    f'y1="{ly}" y2="{ly + 3}"/>')
                elif not crowded("switch", ly, x(t)):
                    body.append(f'<path class="mark switch" transform="translate({x(t):.1f},{ly + lane_h // 2})" '
                                f'd="M0,-5 L4,0 L0,5 L-4,0 Z"/>')
        for h in q["holds"]:
            if not start <= h.end <= stop:
                continue
            ly = lane_y(h.session) + lane_h // 2
            if h.how in ("idle", "ttl") and crowded(h.how, ly, x(h.end)):
                continue
            if h.how == "idle":
                body.append(f'<circle class="mark idle" cx="{x(h.end):.1f}" cy="{ly}" r="3.5">'
                            f'<title>{escape(h.session)} yielded (idle)</title></circle>')
            elif h.how == "ttl":
                body.append(f'<path class="mark ttl" transform="translate({x(h.end):.1f},{ly})" '
                            f'd="M-4,-4 L4,4 M-4,4 L4,-4"><title>{escape(h.session)} evicted (TTL)</title></path>')
        y += lane_h * len(names) + 10
    height = y + 30
    axis = [f'<line class="axis" x1="{left}" x2="{width - right}" y1="{height - 26}" y2="{height - 26}"/>']
    fmt = "%H:%M:%S" if stop - start < 6 * 3600 else "%d %H:%M"
    for t in _ticks(start, stop):
        axis.append(f'<line class="grid" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top - 6}" y2="{height - 26}"/>')
        axis.append(f'<text class="tick" x="{x(t):.1f}" y="{height - 12}">{time.strftime(fmt, time.gmtime(t))}</text>')
    legend = []
    lx = left
    for label, cls, shape in (("parent holds", "hold parent", "rect"), ("child holds", "hold child", "rect"),
                              ("dead time", "dead", "rect"),
                              ("waiting", "wait", "line"), ("switch", "mark switch", "diamond"),
                              ("idle yield", "mark idle", "circle"), ("TTL eviction", "mark ttl", "cross")):
        if shape == "rect":
            legend.append(f'<rect class="{cls}" x="{lx}" y="14" width="14" height="10"/>')
        elif shape == "line":
            legend.append(f'<line class="{cls}" x1="{lx}" x2="{lx + 14}" y1="19" y2="19"/>')
        elif shape == "diamond":
            legend.append(f'<path class="{cls}" transform="translate({lx + 7},19)" d="M0,-5 L4,0 L0,5 L-4,0 Z"/>')
        elif shape == "circle":
            legend.append(f'<circle class="{cls}" cx="{lx + 7}" cy="19" r="3.5"/>')
        else:
            legend.append(f'<path class="{cls}" transform="translate({lx + 7},19)" d="M-4,-4 L4,4 M-4,4 L4,-4"/>')
        legend.append(f'<text class="legend" x="{lx + 18}" y="23">{label}</text>')
        lx += 30 + 7 * len(label)
    title = f"llmqueue timeline, {_iso_utc(start)} .. {_iso_utc(stop)} (UTC)"
    style = (
        "text{font-family:system-ui,sans-serif;font-size:11px;fill:#111827}"
        ".queue{font-weight:600;font-size:12px}.lane{fill:#374151}.tick{text-anchor:middle;fill:#6b7280}"
        ".title{font-size:13px;font-weight:600}.grid{stroke:#e5e7eb;stroke-width:1}.axis{stroke:#6b7280}"
        f".parent{{fill:{_SVG_COLORS['parent']}}}.child{{fill:{_SVG_COLORS['child']}}}"
        f".wait{{stroke:{_SVG_COLORS['wait']};stroke-width:2}}.switch{{fill:{_SVG_COLORS['switch']}}}"
        f".switch-tick{{stroke:{_SVG_COLORS['switch']};stroke-width:1}}"
        f".idle{{fill:{_SVG_COLORS['idle']}}}.ttl{{stroke:{_SVG_COLORS['ttl']};stroke-width:2;fill:none}}"
        f".dead{{fill:{_SVG_COLORS['dead']};fill-opacity:0.55}}"
    )
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        f"<style>{style}</style>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text class="title" x="{left}" y="44">{escape(title)}</text>',
        '<g id="legend">', *legend, "</g>",
        '<g id="axis">', *axis, "</g>",
        '<g id="lanes">', *body, "</g>",
        "</svg>", "",
    ])


# =================================================================================================
# The command line
#
# ``python llmqueue.py [daemon options]`` runs the daemon in the foreground (``daemon`` may be
# named).  Subcommands for people: ``status``, ``run``, ``proxy``, ``report`` and ``check-config``.
# =================================================================================================


AGENT_DIR_HELP = "the agent dir (default: $LLMQUEUE_DIR, else $PI_CODING_AGENT_DIR, else ~/.pi/agent)"
_COMMAND_HELP = (
    ("proxy", "put any agent behind the queue: a proxy in front of your model server"),
    ("run", "hold a slot while a command runs: llmqueue run --queue URL -- COMMAND"),
    ("status", "show every queue, its holders and its waiters"),
    ("report", "where the time went, from the event log"),
    ("check-config", "validate llm-queue.json and show where each key queues"),
    ("daemon", "run the daemon in the foreground (the default; clients start it on demand)"),
)


def _idle_exit_arg(text: str) -> int:
    if text == "never":
        return -1
    try:
        return int(text)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"expected milliseconds or 'never' (got {text!r})") from None


def _positive_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        import argparse

        raise argparse.ArgumentTypeError(f"expected a positive integer (got {text!r})")
    return value


def _paths_parser(prog: str, description: str) -> argparse.ArgumentParser:
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"llmqueue {__version__}")
    parser.add_argument("--agent-dir", help=AGENT_DIR_HELP)
    parser.add_argument("--socket", help="the daemon socket (default: AGENT_DIR/llm-queue.sock)")
    return parser


def _socket_path(args: argparse.Namespace) -> str:
    return str(args.socket or os.path.join(args.agent_dir or default_agent_dir(), "llm-queue.sock"))


def _raise_fd_limit() -> None:
    """Raise the soft descriptor limit to the hard one: every waiter is a connection."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


_DAEMON_FLAGS: Dict[str, Tuple[str, Callable[[str], Any]]] = {
    "--agent-dir": ("agent_dir", str), "--socket": ("socket", str), "--config": ("config", str),
    "--models-json": ("models_json", str), "--sweep-ms": ("sweep_ms", _positive_arg),
    "--idle-exit-ms": ("idle_exit_ms", _idle_exit_arg), "--log-file": ("log_file", str),
}


def _daemon_args_quick(argv: list[str]) -> Optional[dict[str, Any]]:
    """The daemon's flags without argparse (a client spawns daemons: their start is on its
    path).  None for anything unusual -- help, a typo, a bad value -- which argparse explains."""
    args: dict[str, Any] = {"agent_dir": None, "socket": None, "config": None, "models_json": None,
                            "sweep_ms": DEFAULT_SWEEP_MS, "idle_exit_ms": None, "log_file": None}
    i = 0
    try:
        while i < len(argv):
            flag, eq, value = argv[i].partition("=")
            if flag not in _DAEMON_FLAGS:
                return None
            if not eq:
                i += 1
                if i >= len(argv) or argv[i].startswith("--"):
                    return None  # a missing value: argparse says so
                value = argv[i]
            name, convert = _DAEMON_FLAGS[flag]
            args[name] = convert(value)
            i += 1
    except Exception:  # a bad value: let argparse say so
        return None
    return args


def _cmd_daemon(argv: list[str]) -> int:
    quick = _daemon_args_quick(argv)
    if quick is not None:
        return _serve(**quick)
    import argparse

    parser = _paths_parser("llmqueue", "Queue coding agents onto one local model server.  With no command, "
                                       "run the llmqueue daemon in the foreground (clients start it on demand).")
    parser.usage = "llmqueue [COMMAND] [options]"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "commands:\n" + "\n".join(f"  {name:<13} {text}" for name, text in _COMMAND_HELP) + \
        "\n\n'llmqueue COMMAND --help' tells more of each."
    parser.add_argument("--config", help="the config file (default: AGENT_DIR/llm-queue.json)")
    parser.add_argument("--models-json", help="pi's provider catalog (default: AGENT_DIR/models.json)")
    parser.add_argument("--sweep-ms", type=_positive_arg, default=DEFAULT_SWEEP_MS,
                        help="how often the sweep may run, in ms (default: 1000)")
    parser.add_argument("--idle-exit-ms", type=_idle_exit_arg, default=None,
                        help="exit this long after the last client leaves, or 'never' "
                             "(default: the config's daemonIdleExitMs, 0)")
    parser.add_argument("--log-file", metavar="PATH", help="append the event log here (default: the config's logFile)")
    args = parser.parse_args(argv)
    return _serve(args.agent_dir, args.socket, args.config, args.models_json, args.sweep_ms, args.idle_exit_ms,
                  args.log_file)


def _serve(agent_dir: Optional[str], socket: Optional[str], config: Optional[str], models_json: Optional[str],
           sweep_ms: int, idle_exit_ms: Optional[int], log_file: Optional[str] = None) -> int:
    _raise_fd_limit()
    daemon = Daemon(agent_dir, socket_path=socket, config_path=config, models_json=models_json,
                    sweep_ms=sweep_ms, idle_exit_ms=idle_exit_ms, log_file=log_file)
    daemon.announce = True
    try:
        daemon.serve_forever()
    except AlreadyRunning as e:
        daemon._say(f"{e}; leaving it be")
        return 0
    except DaemonError as e:
        daemon._say(str(e))
        return 1
    return 0


def _ask(path: str, request: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """One request, one reply, on a fresh connection (for commands, not for the hot path)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(_line(request))
        buf = b""
        while b"\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            buf += chunk
    reply = json.loads(buf.split(b"\n", 1)[0])
    if not isinstance(reply, dict):
        raise ConnectionError("the daemon sent something that is not a reply")
    return reply


def format_status(queues: list[dict[str, Any]]) -> str:
    """``status`` for people: each queue's slots, depth per tier and switches, then every holder
    and waiter as ``sessionKey tier [group]``."""
    if not queues:
        return "no queues yet\n"
    out = []
    for q in queues:
        limit = q.get("maxStreams")
        holders = q.get("holders") or []
        waiting = q.get("waiting") or []
        spares = sum(1 for h in holders if h.get("spare") is True)
        slots = "passthrough" if limit is None else f"{len(holders) - spares}/{limit}"
        if spares:
            slots += f" +{spares} spare"
        auto = q.get("streamsAuto")
        if isinstance(auto, dict):  # ``maxStreams: "auto"``: what its number went by
            slots += (f" (auto: {auto['slots']} slots of {auto['slotContext']:,} tokens" if "slots" in auto
                      else " (auto: the server's slots not known yet")
            slots += f", contexts up to {auto['context']:,})" if "context" in auto else ")"
        depth = {role: sum(1 for w in waiting if w.get("role") == role) for role in ROLES}
        out.append(f"{q.get('queueKey')}  {slots}  waiting: {depth['parent']} parent, "
                   f"{depth['child']} child  switches: {q.get('switches', 0)}")
        if "grants" in q:  # counters: absent from an older daemon's reply
            waits = q.get("longestWaitMs") or {}
            longest = ", ".join(f"{role} {waits.get(role, 0) / 1000:.1f} s" for role in ROLES)
            out.append(f"  grants {q.get('grants', 0)}  queued {q.get('queued', 0)}  "
                       f"idle-yields {q.get('idleYields', 0)}  park-yields {q.get('parkYields', 0)}  "
                       f"handbacks {q.get('handbackYields', 0)}  "
                       f"ttl-evictions {q.get('ttlEvictions', 0)}  "
                       f"longest wait: {longest}")
        tokens = q.get("tokens")
        if isinstance(tokens, dict):  # once a usage op (the proxy, a Client) reported
            out.append(f"  tokens: prefilled {tokens.get('prefilled', 0):,}  reused {tokens.get('reused', 0):,}  "
                       f"over {tokens.get('requests', 0):,} requests")
        for label, people in (("holds", holders), ("waits", waiting)):
            for p in people:
                group = f" [{p['group']}]" if p.get("group") else ""
                spare = " (spare stream)" if p.get("spare") is True else ""
                out.append(f"  {label}  {p.get('sessionKey')} {p.get('role')}{group}{spare}")
        for hold in q.get("holds") or []:  # an idle slot someone waits for: both sides of the rule
            if isinstance(hold, dict):
                out.append(f"  idle   {hold.get('sessionKey')}: {hold.get('explain')}")
    return "\n".join(out) + "\n"


def _prom_label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_prometheus(queues: list[dict[str, Any]]) -> str:
    """``status`` in the Prometheus text exposition format (version 0.0.4), for node_exporter's
    textfile collector or a scrape wrapper."""
    metrics: list[tuple[str, str, str, list[tuple[str, Any]]]] = [
        ("llmqueue_grants_total", "counter", "Slots granted.", []),
        ("llmqueue_switches_total", "counter", "Grants of a waiting session (likely KV-cache re-prefills).", []),
        ("llmqueue_queued_total", "counter", "Acquires that had to wait.", []),
        ("llmqueue_idle_yields_total", "counter", "Slots taken from idle holders for a waiter.", []),
        ("llmqueue_park_yields_total", "counter", "Slots parked holders handed to a waiter at once.", []),
        ("llmqueue_handback_yields_total", "counter",
         "Slots holders between two requests handed over at once.", []),
        ("llmqueue_ttl_evictions_total", "counter", "Slots reclaimed from dead clients (TTL lapsed).", []),
        ("llmqueue_prefilled_tokens_total", "counter", "Prompt tokens the server computed, as it reported them.", []),
        ("llmqueue_reused_tokens_total", "counter", "Prompt tokens the server served from its cache.", []),
        ("llmqueue_holders", "gauge", "Sessions holding a slot.", []),
        ("llmqueue_max_streams", "gauge", "Slots of the queue (absent for passthrough queues).", []),
        ("llmqueue_waiting", "gauge", "Sessions waiting, per tier.", []),
        ("llmqueue_longest_wait_seconds", "gauge", "How long the oldest waiter of each tier has waited.", []),
    ]
    rows = {name: samples for name, _, _, samples in metrics}
    for q in queues:
        label = f'queue="{_prom_label(q.get("queueKey"))}"'
        for name, field in (("llmqueue_grants_total", "grants"), ("llmqueue_switches_total", "switches"),
                            ("llmqueue_queued_total", "queued"), ("llmqueue_idle_yields_total", "idleYields"),
                            ("llmqueue_park_yields_total", "parkYields"),
                            ("llmqueue_handback_yields_total", "handbackYields"),
                            ("llmqueue_ttl_evictions_total", "ttlEvictions")):
            rows[name].append((label, q.get(field, 0)))
        tokens = q.get("tokens")
        if isinstance(tokens, dict):
            rows["llmqueue_prefilled_tokens_total"].append((label, tokens.get("prefilled", 0)))
            rows["llmqueue_reused_tokens_total"].append((label, tokens.get("reused", 0)))
        rows["llmqueue_holders"].append((label, len(q.get("holders") or [])))
        if q.get("maxStreams") is not None:
            rows["llmqueue_max_streams"].append((label, q["maxStreams"]))
        waits = q.get("longestWaitMs") or {}
        for role in ROLES:
            tier = f'{label},role="{role}"'
            rows["llmqueue_waiting"].append(
                (tier, sum(1 for w in q.get("waiting") or [] if w.get("role") == role)))
            rows["llmqueue_longest_wait_seconds"].append((tier, waits.get(role, 0) / 1000.0))
    out = []
    for name, kind, help_text, samples in metrics:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{name}{{{labels}}} {value}" for labels, value in samples)
    return "\n".join(out) + "\n"


def _cmd_status(argv: list[str]) -> int:
    parser = _paths_parser("llmqueue status", "Show every queue, its holders and its waiters.")
    parser.add_argument("--json", action="store_true", help="print the daemon's reply as JSON")
    parser.add_argument("--format", choices=("table", "json", "prometheus"), default="table",
                        help="table (default), json (the daemon's reply) or prometheus (text exposition)")
    parser.add_argument("--watch", type=float, metavar="SECONDS",
                        help="redraw every SECONDS until Ctrl-C")
    args = parser.parse_args(argv)
    path = _socket_path(args)
    try:
        while True:
            try:
                reply = _ask(path, {"op": "status"})
            except (OSError, ValueError) as e:
                print(f"llmqueue: no daemon is running on {path} ({e})", file=sys.stderr)
                return 1
            queues = reply.get("queues") or []
            if args.json or args.format == "json":
                text = json.dumps(reply) + "\n"
            elif args.format == "prometheus":
                text = format_prometheus(queues)
            else:
                text = format_status(queues) + "".join(
                    f"config: {error}\n" for error in reply.get("configErrors") or [])
            if args.watch is None:
                sys.stdout.write(text)
                return 0
            stamp = time.strftime("%H:%M:%S")
            sys.stdout.write(f"\x1b[H\x1b[2J{stamp}  {path}\n\n{text}")  # home, clear, redraw
            sys.stdout.flush()
            time.sleep(max(args.watch, 0.1))
    except KeyboardInterrupt:
        return 0


# Signals ``llmqueue run`` passes on to its command.  Ctrl-C and Ctrl-\ typed at a terminal
# already reach the command (the whole foreground process group gets them), so those two are
# passed on only when they did not come from our terminal.
_FORWARDED = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGQUIT", "SIGWINCH", "SIGCONT")


def _in_terminal_foreground() -> bool:
    """Are we in the foreground of our controlling terminal (whatever stdin is)?  Then the
    terminal's Ctrl-C reaches the whole process group, the command included."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _cmd_run(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    else:
        command = []
    parser = _paths_parser("llmqueue run",
                           "Hold a slot of a queue while a command runs (like flock(1) for a model endpoint).")
    parser.usage = "llmqueue run --queue KEY [options] -- COMMAND [ARGS...]"
    parser.add_argument("--queue", required=True, help="the queueKey: endpoint URL, provider or group")
    parser.add_argument("--session", help="the session key (default: run-PID)")
    parser.add_argument("--role", choices=ROLES, default="parent", help="the tier (default: parent)")
    parser.add_argument("--group", help="a label shown by status")
    parser.add_argument("--fail-closed", action="store_true",
                        help="exit 75 instead of running unqueued when no daemon can be had")
    args, extra = parser.parse_known_args(argv)
    if extra and not command:
        if extra[0].startswith("-"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.error(f"put the command after --: llmqueue run --queue {args.queue} -- {' '.join(extra)}")
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not command:
        parser.error("no command given after --: llmqueue run --queue KEY -- COMMAND [ARGS...]")
    import subprocess

    tty = sys.stderr.isatty()

    def show(lease: Lease, position: int) -> None:
        if tty:
            sys.stderr.write(f"\rllmqueue: waiting for {lease.queue_key}: position {position}   ")
            sys.stderr.flush()

    client = Client(args.agent_dir, socket_path=args.socket,
                    fail_open=False if args.fail_closed else None, on_position=show if tty else None,
                    on_warning=lambda message: print(message, file=sys.stderr))
    try:
        try:
            lease = client.acquire(args.queue, args.session or f"run-{os.getpid()}", args.role, args.group)
        except KeyboardInterrupt:
            print("\nllmqueue: cancelled while queued", file=sys.stderr)
            return 130
        except DaemonUnavailable as e:
            way = "drop --fail-closed" if args.fail_closed else 'set "failOpen": true in the config\'s defaults'
            print(f"llmqueue: {e}; the command was not run (exit status 75: try again later, or {way} "
                  "to run it unqueued)", file=sys.stderr)
            return 75  # EX_TEMPFAIL
        if tty and lease.queued:
            sys.stderr.write("\r\x1b[K")
        try:
            proc = subprocess.Popen(command)
        except OSError as e:
            print(f"llmqueue: cannot run {command[0]}: {e.strerror or e}", file=sys.stderr)
            lease.release()
            return 127
        from_terminal = _in_terminal_foreground()

        def forward(signum: int, frame: Any) -> None:
            if from_terminal and signum in (signal.SIGINT, signal.SIGQUIT):
                return  # the terminal sent it to the command already
            try:
                proc.send_signal(signum)
            except OSError:
                pass

        for name in _FORWARDED:
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), forward)
        code = proc.wait()
        lease.release()
        return code if code >= 0 else 128 - code
    finally:
        client.close()


def _cmd_check_config(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="llmqueue check-config",
                                     description="Validate llm-queue.json and show where each key queues.")
    parser.add_argument("--version", action="version", version=f"llmqueue {__version__}")
    parser.add_argument("--agent-dir", help=AGENT_DIR_HELP)
    parser.add_argument("--config", help="the config file (default: AGENT_DIR/llm-queue.json)")
    parser.add_argument("--models-json", help="pi's provider catalog (default: AGENT_DIR/models.json)")
    args = parser.parse_args(argv)
    agent_dir = args.agent_dir or default_agent_dir()
    path = args.config or os.path.join(agent_dir, "llm-queue.json")
    load = load_config(path)
    catalog = load_catalog(args.models_json or os.path.join(agent_dir, "models.json"))
    if load.state == "missing":
        print(f"{path}: no config file; every queue uses the defaults")
    for error in load.errors:
        print(f"error: {error}")
    for warning in load.warnings:
        print(f"warning: {warning}")
    addressing = Addressing(load.config, catalog)

    def show(key: str) -> None:
        owner, policy = addressing.address_endpoint(key)
        limit = ("passthrough" if policy.max_streams is None else
                 "maxStreams auto" if policy.streams_auto else f"maxStreams {policy.max_streams}")
        print(f"{key} -> queue {owner} ({limit}, {policy.policy})")

    for entry in load.config.queues:
        show(entry.name)
    if catalog:
        print("providers in models.json:")
        for provider in catalog:
            show(provider)
    if load.state in ("ok", "missing"):
        print("ok")
        return 0
    return 1


def _count_arg(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a count, 0 or more (got {text!r})")
    return value


def _listen_arg(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"expected HOST:PORT (got {text!r})") from None
    return (host.strip("[]") or "127.0.0.1"), number


def _identity_arg(text: str) -> Tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if names == ("none",):
        return ()
    for name in names:
        if name not in IDENTITY_SOURCES:
            import argparse

            raise argparse.ArgumentTypeError(
                f"unknown source {name!r} (known: {', '.join(IDENTITY_SOURCES)}, or none)")
    return names


def _cmd_proxy(argv: list[str]) -> int:
    parser = _paths_parser("llmqueue proxy",
                           "Queue any OpenAI-compatible client: a loopback reverse proxy that holds a slot "
                           "for each request's session while it streams.")
    parser.add_argument("--upstream", required=True, help="the model server's base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--listen", type=_listen_arg, default=("127.0.0.1", DEFAULT_PROXY_PORT),
                        help=f"HOST:PORT to listen on (default: 127.0.0.1:{DEFAULT_PROXY_PORT})")
    parser.add_argument("--queue", help="the queueKey (default: the upstream URL)")
    parser.add_argument("--role", choices=ROLES, default="parent",
                        help="the tier of requests with no role and no subagent marker (default: parent)")
    parser.add_argument("--identity", type=_identity_arg, default=IDENTITY_SOURCES, metavar="SOURCES",
                        help="where a request's session comes from, when its path and headers name none: a "
                             f"comma list of {','.join(IDENTITY_SOURCES)} (the default: all), or none")
    parser.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --listen address")
    parser.add_argument("--fail-closed", action="store_true",
                        help="answer 503 instead of forwarding unqueued when no daemon can be had")
    parser.add_argument("--slot-files", type=_count_arg, default=SLOT_FILES, metavar="N",
                        help="contexts kept in llama.cpp slot files at a switch, where the upstream is a "
                             f"one-slot llama-server with --slot-save-path (default {SLOT_FILES}; 0: never)")
    parser.add_argument("--verbose", action="store_true",
                        help="log every request on stderr: its time, session, response status and duration")
    parser.add_argument("--log", metavar="FILE",
                        help="the daemon's event log, for 'llmqueue report' (a daemon this proxy starts "
                             "writes it; default: the config's logFile)")
    args = parser.parse_args(argv)

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def stamped(message: str) -> None:
        now = time.time()
        say(f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now % 1 * 1000):03d} {message}")

    client = Client(args.agent_dir, socket_path=args.socket,
                    fail_open=False if args.fail_closed else None, on_warning=say, log_file=args.log)
    try:
        proxy = Proxy(args.upstream, client=client, listen=args.listen, queue_key=args.queue, role=args.role,
                      allow_remote=args.allow_remote, log=stamped if args.verbose else None,
                      identity=args.identity, slot_files=args.slot_files)
    except OSError as e:
        host, port = args.listen
        host = f"[{host}]" if ":" in host else host
        if e.errno == errno.EADDRINUSE:
            say(f"llmqueue proxy: cannot listen on {host}:{port}: the address is in use (another llmqueue "
                f"proxy, or another server?); pass --listen {host}:PORT for another port")
        else:
            say(f"llmqueue proxy: cannot listen on {host}:{port}: {e.strerror or e}")
        client.close()
        return 2
    except ValueError as e:
        say(f"llmqueue proxy: {e}")
        client.close()
        return 2
    done = threading.Event()
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        signal.signal(getattr(signal, name), lambda signum, frame: done.set())
    server = threading.Thread(target=proxy.serve_forever, name="llmqueue-proxy", daemon=True)
    server.start()
    say(f"llmqueue proxy: {proxy.url} -> {args.upstream} (queue {proxy.queue_key})")
    try:
        reply = client.status_reply()  # starts the daemon: what is wrong is said now, not at a request
    except (DaemonUnavailable, LLMQueueError):
        reply = {"logFile": client.log_file}  # fail-open: no daemon to ask
    for error in reply.get("configErrors") or []:
        say(f"llmqueue proxy: the daemon's config: {error}")
    if args.log:
        logged = reply.get("logFile")
        if logged != client.log_file:
            say(f"llmqueue proxy: the daemon that was already running logs to {logged or 'no file'}, "
                f"not {client.log_file}: --log applies to a daemon the proxy starts (stop that one, "
                "or set defaults.logFile in its config)")
    while not done.wait(1.0):
        pass
    proxy.shutdown()
    client.close()
    return 0


def _find_log(agent_dir: str, config_path: str) -> Optional[str]:
    """The event log ``llmqueue report`` reads by default: the running daemon's (it knows a
    ``--log-file`` too), else the config's ``logFile``; None when neither names one."""
    try:
        logged = _ask(os.path.join(agent_dir, "llm-queue.sock"), {"op": "status"}, timeout=2.0).get("logFile")
        if isinstance(logged, str) and logged:
            return logged
    except (OSError, ValueError):
        pass
    return config_log_path(config_path, load_config(config_path).config.log_file)


def _cmd_report(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="llmqueue report",
                                     description="Figures per queue, and a timeline picture, from the event log.")
    parser.add_argument("--version", action="version", version=f"llmqueue {__version__}")
    parser.add_argument("logfile", nargs="*",
                        help="the event log; rotated files may be given together (default: the running "
                             "daemon's, else the config's logFile)")
    parser.add_argument("--agent-dir", help=AGENT_DIR_HELP)
    parser.add_argument("--since", help="start of the window: an ISO-8601 UTC time, or a duration before the log's end (90m, 2h)")
    parser.add_argument("--until", help="end of the window, the same way")
    parser.add_argument("--queue", help="only this queue (its key as the log names it)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--svg", metavar="FILE", help="also write a timeline picture (SVG) to FILE")
    args = parser.parse_args(argv)
    agent_dir = args.agent_dir or default_agent_dir()
    config_path = os.path.join(agent_dir, "llm-queue.json")
    if not args.logfile:
        found = _find_log(agent_dir, config_path)
        if found is None:
            print(f"llmqueue report: no event log to read: no daemon runs with one, and the config names none.  "
                  f'Turn it on with "defaults": {{"logFile": "llm-queue.log"}} in {config_path}, or start the '
                  "proxy with --log FILE; then run llmqueue report again.  (A proxy that ran with --log FILE "
                  "wrote there: name that file.)", file=sys.stderr)
            return 1
        args.logfile = [found]
    try:
        events = read_event_log(args.logfile)
        end = events[-1]["t"] if events else time.time()
        since = _parse_when(args.since, end) if args.since else None
        until = _parse_when(args.until, end) if args.until else None
    except FileNotFoundError as e:
        print(f"llmqueue report: {e.filename}: no such file.  The event log is written where the config's "
              f"defaults.logFile ({config_path}) or the proxy's --log says, from the first event on.",
              file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"llmqueue report: {e}", file=sys.stderr)
        return 1
    report = build_report(events, since, until, args.queue)
    sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.json else format_report(report))
    if args.svg:
        with open(args.svg, "w", encoding="utf-8") as f:
            f.write(render_svg(events, since, until, args.queue))
    return 0


_COMMANDS: Dict[str, Callable[[List[str]], int]] = {
    "daemon": _cmd_daemon,
    "status": _cmd_status,
    "check-config": _cmd_check_config,
    "run": _cmd_run,
    "proxy": _cmd_proxy,
    "report": _cmd_report,
}


def main(argv: Optional[List[str]] = None) -> int:
    """The ``llmqueue`` command: a subcommand, or daemon options to run the daemon."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-") and args[0] not in _COMMANDS:
        print(f"llmqueue: unknown command {args[0]!r}{_did_you_mean(args[0], list(_COMMANDS))}; the commands "
              f"are {', '.join(_COMMANDS)} ('llmqueue --help' says what each does)", file=sys.stderr)
        return 2
    command = args.pop(0) if args and args[0] in _COMMANDS else "daemon"
    return _COMMANDS[command](args)


if __name__ == "__main__":
    sys.exit(main())
