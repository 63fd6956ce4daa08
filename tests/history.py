"""The history checker (issue 6, item 3): replay a daemon's event log plus its clients' own
transcripts and report every place where the history breaks the specification.

Not a suite: a module the soak, fault and fuzz suites call, pinned by ``tests/test_history.py``
with hand-made histories that break each rule.

Inputs
------
* **The event log**: the daemon's ``logFile`` lines (JSON objects; ``load_log``).  Every line has
  ``event``, ``queueKey`` and ``ts`` (ISO-8601 UTC with milliseconds, taken once per daemon turn
  when the turn's lines are flushed); scheduler lines add ``sessionKey`` and ``role``, grants
  ``seq``.
* **Transcripts**: what each client connection sent and received, one JSON object per record
  (``record`` builds one, ``TranscriptFile`` appends them to a file, ``TracedPeer`` records a
  ``tests.harness.Peer``)::

      {"conn": "w1/c17", "t": 1764430000.123456, "dir": "send", "msg": {"op": "acquire", ...}}
      {"conn": "w1/c17", "t": 1764430000.125001, "dir": "recv", "msg": {"op": "granted", ...}}
      {"conn": "w1/c17", "t": 1764430000.400000, "dir": "close"}
      {"conn": "w1/c17", "t": 1764430000.400000, "dir": "note", "what": "freeze"}

  ``t`` is the wall clock (``time.time()``, the clock the log's ``ts`` is taken from) read just
  *before* the write of a request or the close of the socket (the daemon may act on it before
  the client runs again), and just *after* a reply line was read.  A client that may be killed
  writes a request's record before the request (a record of a request never sent is harmless;
  a request the daemon saw without a record is not).  ``close`` is the moment the
  connection was closed (or the process holding it was killed: the killer appends the time read
  just before the kill, and may add ``"by"``, a time by which the dead process's sockets were
  certainly closed -- its reaping; a dying process under load takes a while to let go of them).
  A dead waiter is judged against ``by``, a dequeue against ``t``.  ``note`` is free text for the suite; the checker ignores it.  Records
  of one connection are in the order they happened; connections may be interleaved in any
  order.  Every request names its ``sessionKey``; a session uses one connection at a time (a
  reconnect closes the old one first).  A client that re-``acquire``s a queue after a ``cancel``
  fences the cancel first (a request with a reply, e.g. a bare ``renew``): a ``granted`` that
  arrives after a ``cancel`` (or ``bye``) and before that fence's reply was sent before the cancel
  took effect, so it is stale -- the cancel freed that slot -- and no hold.
* **The queue policies** (``QueueSpec`` per owning queue key, or one default): ``maxStreams``,
  ``policy``, ``leaseTtlMs``, ``agingAfterMs``, ``agingAfterSlots``.  ``key_map`` maps the key a
  client asked with to the queue that owns it (identity by default).
* ``sweep_ms`` (the daemon's ``--sweep-ms``), and optionally ``final_status``: the ``queues``
  of a ``status`` reply taken after the last logged event.

Timing model (``margin_ms``, default 100)
-----------------------------------------
The daemon stamps a line with the wall clock at the end of the turn that produced it, floored to
the millisecond; the decisions inside the turn used the monotonic clock read at its start.  A
request's processing time is at or after its send, and at or before the receipt of the reply to
it -- or, for a request without a reply (``role``, ``cancel``, ``acquire`` while it waits,
``bye``), at or before the reply to the next request on the same connection that does get one
(replies come in request order).  ``margin_ms`` bounds, once, everything the checker cannot see:
the delivery delay of a line on the socket, the length of one daemon turn, and the time the OS
keeps the daemon or a client off the CPU.  So an event logged at ``ts`` was decided within
``[ts - margin_ms, ts + 1 ms]`` (1 ms: the log's granularity), and a request sent at ``s`` without
a recorded reply was processed within ``[s, s + margin_ms]``.  Where a rule would depend on the
order of two things closer than that, the checker accepts either order; everywhere else it is
exact.  A margin of a quarter of the minimum TTL (1000 ms) or less keeps every TTL bound
meaningful.

Rules (``Violation.rule``)
--------------------------
``capacity`` (a)  a grant while the queue already has ``maxStreams`` holders (a grant line with
                  ``spare: true`` is a parent's spare stream: counted against ``parentStreams``
                  instead, and only while children hold every slot).  A ``config`` line
                  (``reason: over-capacity``) lowers the queue's limit from there on: its holders
                  keep their slots and the queue grants nothing until it is back under the limit.
                  From the transcripts: more client-side holds of a queue at once than
                  ``maxStreams`` (see "client holds" below).
``order``    (b)  a queued waiter granted out of turn.  ``fifo``: the oldest waiter (enqueue order
                  is the order of ``queued`` lines).  ``priority-aging``: a parent must be the
                  oldest parent and no child may have been due by aging; a child ahead of a
                  waiting parent must be the oldest child and have waited ``agingAfterMs`` or
                  seen ``agingAfterSlots`` parent grants in a row since it queued (counted from
                  the log: parent grants since its ``queued`` line and since the last child
                  grant).  A grant straight into a free slot while someone waits is a queue jump
                  (a spare stream's while no waiter is certainly a parent, by the tier below,
                  is none: a child cannot take it).
                  A spare stream goes to the oldest waiting parent.
                  A waiter's tier is the ``queued`` line's role as changed by its session's
                  ``role`` requests in the transcripts (a ``role`` whose processing window
                  straddles the grant leaves both tiers possible); the granted waiter's tier is
                  the grant line's role, which must be one of its possible tiers.  Also: a
                  ``queued`` line while the queue had a free slot.
``ttl``      (c)  a TTL eviction (``evict``, reason ``ttl``) outside
                  ``[last beat + TTL, last beat + TTL + sweep]``: earlier than ``TTL - 1 ms`` after
                  a beat the daemon certainly had, or later than ``TTL + sweep + margin`` after
                  the latest beat it may have had.  Beats: the grant, every re-``acquire`` and
                  keyed ``renew`` of the lease, and every bare ``renew`` of a connection that holds
                  it.  A keyed beat answered ``granted: true`` was certainly had; another beat
                  was certainly had when sent ``margin_ms`` before the eviction.  Also a ``ttl``
                  violation: a lease still held (a beat answered ``granted: true``, or a release)
                  more than ``TTL + sweep + margin`` after the latest beat it may have had -- a
                  lapsed lease the sweep missed.  Without a transcript of the lease, only the
                  lower bound from the grant line is checked.  TTL: the ``leaseTtlMs`` of the
                  ``granted`` reply, else the queue's policy.
``double-hold`` (d) a grant (or a ``queued`` line) for a session that already holds the queue;
                  from the transcripts: a ``granted`` reply with a new ``seq`` while that session
                  still holds an older grant of the queue.
``seq``      (d)  a grant whose ``seq`` is not above every earlier ``seq`` of its queue.
``waiter``   (e)  a ``queued`` line for a session already waiting; a waiter granted although every
                  connection that asked for it had closed (``margin_ms`` before); a waiter dequeued with reason
                  ``cancel`` although its session sent no ``cancel``, or ``disconnect`` although no
                  connection of the session closed with an acquire of that queue outstanding (each such
                  close answers for one dequeue; a grant or cancel the client saw before the dequeue
                  retires earlier closes); with ``final_status``: a waiter the log leaves
                  waiting that ``status`` no longer lists (a vanished waiter) or one ``status``
                  lists that the log never queued; from the transcripts: an ``acquire`` that was
                  never granted, never cancelled and whose connection never closed, while the log
                  ends with the session neither waiting nor holding.
``consistency`` the log contradicts itself or the transcripts: a release, eviction or dequeue of
                  a session that holds or waits for nothing, a ``switch`` that does not follow
                  the grant of a waiter (or a waiter's grant without one), a ``config`` line whose
                  holder count differs from the replay, a ``granted`` reply whose ``seq`` has no
                  ``grant`` line, a keyed beat answered ``granted: true`` while the log shows no
                  lease or ``granted: false`` while it shows one, ``final_status`` holders that
                  differ from the replay.

Client holds (from the transcripts alone)
-----------------------------------------
A client holds a queue from the receipt of a ``granted`` reply until the first of: it sends
``release``/``cancel`` for it or ``bye``, its connection closes, a keyed ``renew`` answers
``granted: false`` -- and never past what it can prove: ``TTL`` after the latest request the
daemon answered as held (the ``acquire`` that was granted, a re-``acquire``, a keyed ``renew``
answered ``granted: true``; sent at ``s``, it was processed after ``s``), and for a lease acquired
with ``activity: true`` also ``idleYieldMs`` after the latest such keyed one (it may be yielded
then).  Those intervals are what the client could safely stream in; their overlap per queue is
checked against ``maxStreams``, and one session's against each other.

Not modelled: a reload that regroups queues or changes a policy without a ``config`` line (pass
the policy in force), TTL growth by a reload, sessions without ``sessionKey``.

Use::

    report = check_history(load_log(log_path), load_transcripts(paths), policies={key: QueueSpec(...)},
                           sweep_ms=20, final_status=daemon.status())
    report.assert_clean()        # or report.violations, report.stats, report.holds
"""

from __future__ import annotations

import calendar
import json
import os
import time
from collections import OrderedDict, defaultdict
from typing import (Any, Callable, DefaultDict, Dict, Iterable, Iterator, List, Mapping, NamedTuple,
                    Optional, Sequence, Set, Tuple)

PARENT, CHILD = "parent", "child"
INF = float("inf")

RULES = ("capacity", "order", "ttl", "double-hold", "seq", "waiter", "consistency")


# -- inputs ---------------------------------------------------------------------------------------


class QueueSpec(NamedTuple):
    """The policy a queue ran under (the config's per-queue fields, already resolved)."""

    max_streams: Optional[int] = 1  # None: passthrough
    policy: str = "priority-aging"
    lease_ttl_ms: int = 30000
    aging_after_slots: int = 3
    aging_after_ms: int = 60000
    idle_yield_ms: int = 30000
    parent_streams: int = 1  # spare streams beyond maxStreams, for parents (grant lines say spare)


_SPEC_FIELDS = {"maxStreams": "max_streams", "policy": "policy", "leaseTtlMs": "lease_ttl_ms",
                "agingAfterSlots": "aging_after_slots", "agingAfterMs": "aging_after_ms",
                "idleYieldMs": "idle_yield_ms", "parentStreams": "parent_streams"}


def specs_from_config(config: Mapping[str, Any]) -> Tuple[QueueSpec, Dict[str, QueueSpec]]:
    """``(default spec, {queue key: spec})`` of an ``llm-queue.json`` dict whose queue entries are
    plain endpoint keys (no ``match`` groups, no provider names)."""
    base = QueueSpec()
    defaults = config.get("defaults") or {}
    base = base._replace(**{_SPEC_FIELDS[k]: v for k, v in defaults.items() if k in _SPEC_FIELDS})
    specs: Dict[str, QueueSpec] = {}
    for key, entry in (config.get("queues") or {}).items():
        spec = base._replace(**{_SPEC_FIELDS[k]: v for k, v in entry.items() if k in _SPEC_FIELDS})
        if entry.get("enabled") is False:
            spec = spec._replace(max_streams=None)
        specs[key] = spec
    return base, specs


_TS_CACHE: Dict[str, float] = {}


def parse_ts(ts: str) -> float:
    """An ISO-8601 UTC timestamp with milliseconds (``2026-11-29T15:44:01.123Z``) as epoch ms."""
    head = ts[:19]
    base = _TS_CACHE.get(head)
    if base is None:
        base = float(calendar.timegm(time.strptime(head, "%Y-%m-%dT%H:%M:%S"))) * 1000.0
        if len(_TS_CACHE) > 100000:
            _TS_CACHE.clear()
        _TS_CACHE[head] = base
    frac = ts[20:].rstrip("Z")
    return base + (float("0." + frac) * 1000.0 if frac else 0.0)


def load_log(path: str) -> List[Dict[str, Any]]:
    """The JSON objects of an event log, in order (a torn last line is left out)."""
    out: List[Dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            if not raw.endswith("\n"):
                break  # the daemon writes whole lines; a partial one is still being written
            line = json.loads(raw)
            if isinstance(line, dict):
                out.append(line)
    return out


def record(conn: str, direction: str, msg: Optional[Mapping[str, Any]] = None, *,
           what: Optional[str] = None, t: Optional[float] = None) -> Dict[str, Any]:
    """One transcript record; ``t`` defaults to ``time.time()`` now."""
    rec: Dict[str, Any] = {"conn": conn, "t": time.time() if t is None else t, "dir": direction}
    if msg is not None:
        rec["msg"] = dict(msg)
    if what is not None:
        rec["what"] = what
    return rec


class TranscriptFile:
    """Appends records to a JSON-lines file, one ``os.write`` per record, so the records of a
    process killed with SIGKILL are all on disk but (at most) a torn last line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, rec: Mapping[str, Any]) -> None:
        os.write(self.fd, (json.dumps(rec, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def load_transcripts(paths: Iterable[str]) -> List[Dict[str, Any]]:
    """Every record of the given transcript files; a torn last line (a killed writer) is left out."""
    out: List[Dict[str, Any]] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for raw in f:
                if not raw.endswith("\n"):
                    break
                try:
                    rec = json.loads(raw)
                except ValueError:
                    break
                if isinstance(rec, dict):
                    out.append(rec)
    return out


class TracedPeer:
    """A ``tests.harness.Peer`` whose sends, receipts and close are recorded into ``sink``."""

    def __init__(self, peer: Any, conn: str, sink: List[Dict[str, Any]]) -> None:
        self.peer = peer
        self.conn = conn
        self.sink = sink

    def send(self, message: Dict[str, Any]) -> None:
        t = time.time()
        self.peer.send(message)
        self.sink.append(record(self.conn, "send", message, t=t))

    def recv(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        reply: Dict[str, Any] = self.peer.recv(timeout)
        self.sink.append(record(self.conn, "recv", reply))
        return reply

    def ask(self, message: Dict[str, Any], timeout: Optional[float] = None) -> Dict[str, Any]:
        self.send(message)
        return self.recv(timeout)

    def close(self) -> None:
        t = time.time()
        self.peer.close()
        self.sink.append(record(self.conn, "close", t=t))


# -- outputs --------------------------------------------------------------------------------------


class Violation(NamedTuple):
    rule: str  # one of RULES
    queue: str
    message: str
    at: str  # where: "log line N" or "transcript <conn>"

    def __str__(self) -> str:
        return f"[{self.rule}] {self.queue}: {self.message} ({self.at})"


class Hold(NamedTuple):
    """A client-side hold: the interval a client could prove it held a slot (epoch ms)."""

    conn: str
    queue: str
    session: str
    seq: Optional[int]
    start: float
    end: float


class Report:
    """What a replay found: ``violations`` (empty when the history is clean) and figures."""

    def __init__(self) -> None:
        self.violations: List[Violation] = []
        self.stats: Dict[str, int] = defaultdict(int)
        self.waiting_at_end: Dict[str, List[str]] = {}
        self.holding_at_end: Dict[str, List[str]] = {}
        self.holds: List[Hold] = []
        self.max_client_holds: Dict[str, int] = {}
        self.pending_acquires: List[Tuple[str, str, str]] = []  # (conn, queue, session)
        # per TTL eviction checked against beats: ms past (latest possible beat + TTL); the sweep
        # promise is that this stays within [-(beat's delivery), sweep]
        self.eviction_delays_ms: List[float] = []

    def add(self, rule: str, queue: str, message: str, at: str) -> None:
        self.violations.append(Violation(rule, queue, message, at))

    def by_rule(self, rule: str) -> List[Violation]:
        return [v for v in self.violations if v.rule == rule]

    def rules(self) -> Set[str]:
        return {v.rule for v in self.violations}

    def assert_clean(self, limit: int = 25) -> None:
        if self.violations:
            shown = "\n".join(str(v) for v in self.violations[:limit])
            more = len(self.violations) - limit
            raise AssertionError(f"{len(self.violations)} history violation(s):\n{shown}"
                                 + (f"\n... and {more} more" if more > 0 else ""))


# -- the transcript side --------------------------------------------------------------------------


class _Op:
    """One request a client sent, with what the transcript tells about when it was processed."""

    __slots__ = ("conn", "t", "op", "key", "queue", "session", "role", "activity", "ack", "reply",
                 "fence")

    def __init__(self, conn: str, t: float, msg: Mapping[str, Any], queue: Optional[str]) -> None:
        self.conn = conn
        self.t = t
        self.op: str = str(msg.get("op"))
        key = msg.get("queueKey")
        self.key: Optional[str] = key if isinstance(key, str) else None
        self.queue = queue
        session = msg.get("sessionKey")
        self.session: Optional[str] = session if isinstance(session, str) else None
        role = msg.get("role")
        self.role: Optional[str] = role if isinstance(role, str) else None
        self.activity = msg.get("activity") is True
        self.ack: Optional[float] = None  # processed no later than this (a reply's receipt)
        self.reply: Optional[Dict[str, Any]] = None
        self.fence: List[_Op] = []  # reply-less requests sent before this one: acked with it

    def done_by(self, margin: float) -> float:
        """The latest moment this request can have been processed."""
        return self.ack if self.ack is not None else self.t + margin


class _GrantSeen(NamedTuple):
    conn: str
    queue: str
    session: str
    seq: Optional[int]
    t: float
    ttl_ms: Optional[int]
    idle_ms: Optional[int]
    activity: bool
    asked_at: float  # send time of the earliest acquire this reply answered
    stale: bool = False  # sent before a cancel (or bye) of the client took effect: no hold


class _Conn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: List[_Op] = []
        self.grants: List[_GrantSeen] = []
        self.closed: Optional[float] = None
        self.closed_by: Optional[float] = None  # certainly closed by then (a killed process's reaping)
        self.bye: Optional[float] = None
        self.events: List[Tuple[float, str, Any]] = []  # ("granted", _GrantSeen) / ("op", _Op) / ("close", None)

    @property
    def gone(self) -> Optional[float]:
        """When this connection stopped counting for the daemon: ``bye`` or close."""
        times = [t for t in (self.closed, self.bye) if t is not None]
        return min(times) if times else None

    @property
    def gone_by(self) -> Optional[float]:
        """When this connection certainly stopped counting: ``bye``, or the close's ``by``."""
        closed = self.closed_by if self.closed_by is not None else self.closed
        times = [t for t in (closed, self.bye) if t is not None]
        return min(times) if times else None


class _Transcripts:
    def __init__(self, records: Iterable[Mapping[str, Any]], key_map: Callable[[str], str],
                 report: Report) -> None:
        self.conns: Dict[str, _Conn] = {}
        self.role_ops: DefaultDict[str, List[_Op]] = defaultdict(list)  # session -> role ops
        self.cancels: DefaultDict[Tuple[str, str], List[_Op]] = defaultdict(list)  # (queue, session)
        self.keyed_beats: DefaultDict[Tuple[str, str], List[_Op]] = defaultdict(list)
        self.session_conns: DefaultDict[Tuple[str, str], Set[str]] = defaultdict(set)  # who acquired
        self.sessions: Set[str] = set()
        self.session_any_conns: DefaultDict[str, Set[str]] = defaultdict(set)  # every conn naming it
        by_conn: Dict[str, List[Mapping[str, Any]]] = {}
        for rec in records:
            by_conn.setdefault(str(rec.get("conn")), []).append(rec)
        for name, recs in by_conn.items():
            self._read(name, recs, key_map, report)
        for ops in list(self.role_ops.values()) + list(self.keyed_beats.values()):
            ops.sort(key=lambda op: op.t)

    def _read(self, name: str, recs: List[Mapping[str, Any]], key_map: Callable[[str], str],
              report: Report) -> None:
        c = self.conns[name] = _Conn(name)
        direct: List[_Op] = []  # requests whose reply is next in line: renew, release, status
        unfenced: List[_Op] = []
        asking: DefaultDict[Tuple[str, str], List[_Op]] = defaultdict(list)
        # (queue, session) -> (replies to in-order requests already expected when it was
        # cancelled, the cancelled acquires): a granted before the next such reply is stale
        cancelling: Dict[Tuple[str, str], Tuple[int, List[_Op]]] = {}
        direct_sent = direct_got = 0
        said_bye = False
        for rec in recs:
            t = float(rec.get("t", 0.0)) * 1000.0
            kind = rec.get("dir")
            msg = rec.get("msg") or {}
            if kind == "send":
                key = msg.get("queueKey")
                op = _Op(name, t, msg, key_map(key) if isinstance(key, str) else None)
                c.ops.append(op)
                c.events.append((t, "op", op))
                if op.session is not None:
                    self.sessions.add(op.session)
                    self.session_any_conns[op.session].add(name)
                if op.op in ("renew", "release", "status"):
                    op.fence, unfenced = unfenced, []
                    direct.append(op)
                    direct_sent += 1
                else:
                    unfenced.append(op)
                if op.op == "cancel" and op.queue is not None and op.session is not None:
                    cancelling[(op.queue, op.session)] = (direct_sent, asking.pop((op.queue, op.session), []))
                elif op.op == "bye":
                    said_bye = True
                    for k in list(asking):
                        cancelling[k] = (direct_sent, asking.pop(k))
                if op.op == "acquire" and op.queue is not None and op.session is not None:
                    asking[(op.queue, op.session)].append(op)
                    self.session_conns[(op.queue, op.session)].add(name)
                elif op.op == "role" and op.session is not None:
                    self.role_ops[op.session].append(op)
                elif op.op == "cancel" and op.queue is not None and op.session is not None:
                    self.cancels[(op.queue, op.session)].append(op)
                elif op.op == "renew" and op.queue is not None and op.session is not None:
                    self.keyed_beats[(op.queue, op.session)].append(op)
                elif op.op == "bye" and c.bye is None:
                    c.bye = t
            elif kind == "recv":
                what = msg.get("op")
                if what in ("ok", "status"):
                    direct_got += 1
                    if not said_bye:
                        for k in [k for k, (due, _) in cancelling.items() if direct_got > due]:
                            del cancelling[k]
                    if direct:
                        op = direct.pop(0)
                        op.ack, op.reply = t, dict(msg)
                        for f in op.fence:
                            if f.ack is None:
                                f.ack = t
                elif what == "granted":
                    key, session = msg.get("queueKey"), msg.get("sessionKey")
                    if not isinstance(key, str) or not isinstance(session, str):
                        continue
                    queue = key_map(key)
                    stale = (queue, session) in cancelling
                    waiting = cancelling[(queue, session)][1] if stale else asking.pop((queue, session), [])
                    seq = msg.get("seq")
                    ttl, idle = msg.get("leaseTtlMs"), msg.get("idleYieldMs")
                    for op in waiting:
                        if op.ack is None:
                            op.ack = t
                        op.reply = dict(msg)
                    if not waiting and not stale:
                        report.add("consistency", queue, f"a granted reply for {session} that no pending "
                                   f"acquire asked for", f"transcript {name}")
                    g = _GrantSeen(name, queue, session, seq if isinstance(seq, int) else None, t,
                                   ttl if isinstance(ttl, int) else None,
                                   idle if isinstance(idle, int) else None,
                                   any(op.activity for op in waiting),
                                   min((op.t for op in waiting), default=t), stale)
                    c.grants.append(g)
                    c.events.append((t, "granted", g))
            elif kind == "close":
                if c.closed is None:
                    c.closed = t
                    by = rec.get("by")
                    if isinstance(by, (int, float)) and not isinstance(by, bool) and by * 1000.0 > t:
                        c.closed_by = float(by) * 1000.0
                    c.events.append((t, "close", None))
        for (queue, session), ops in asking.items():
            if ops and not self._abandoned(c, queue, session, ops[0].t):
                report.pending_acquires.append((name, queue, session))

    def _abandoned(self, c: _Conn, queue: str, session: str, since: float) -> bool:
        """Did this connection cancel the acquire sent at ``since``, or go away after it?"""
        if c.gone is not None:
            return True
        return any(op.t >= since for op in self.cancels.get((queue, session), ()) if op.conn == c.name)

    def grants_of(self, queue: str, session: str) -> List[_GrantSeen]:
        return [g for name in self.session_conns.get((queue, session), ())
                for g in self.conns[name].grants if g.queue == queue and g.session == session]


# -- the log side ---------------------------------------------------------------------------------


class _Waiter:
    __slots__ = ("session", "role", "ts", "line", "parent_mark", "ops")

    def __init__(self, session: str, role: str, ts: float, line: int, parent_mark: int) -> None:
        self.session = session
        self.role = role
        self.ts = ts
        self.line = line
        self.parent_mark = parent_mark
        self.ops: Optional[List[_Op]] = None  # role requests that may have re-tiered it


class _Lease:
    __slots__ = ("queue", "session", "seq", "role", "ts", "line", "end", "end_reason", "end_line", "spare")

    def __init__(self, queue: str, session: str, seq: Optional[int], role: str, ts: float, line: int,
                 spare: bool = False) -> None:
        self.spare = spare  # on a parent's spare stream: counted against parentStreams, not maxStreams
        self.queue = queue
        self.session = session
        self.seq = seq
        self.role = role
        self.ts = ts
        self.line = line
        self.end: Optional[float] = None
        self.end_reason: Optional[str] = None
        self.end_line: Optional[int] = None


class _QueueState:
    def __init__(self, key: str, spec: QueueSpec) -> None:
        self.key = key
        self.spec = spec
        self.limit = spec.max_streams
        self.holders: Dict[str, _Lease] = {}
        self.waiting: OrderedDict[str, _Waiter] = OrderedDict()
        self.last_seq: Optional[int] = None
        self.parent_grants = 0
        self.child_mark = 0
        self.expect_switch: Optional[Tuple[str, Optional[int]]] = None


class HistoryChecker:
    """Replays one history; ``check()`` returns the Report.  See the module docstring."""

    def __init__(self, log: Sequence[Mapping[str, Any]], transcripts: Iterable[Mapping[str, Any]] = (), *,
                 policies: Optional[Mapping[str, QueueSpec]] = None, default: Optional[QueueSpec] = None,
                 sweep_ms: float, margin_ms: float = 100.0, key_map: Optional[Callable[[str], str]] = None,
                 final_status: Optional[Sequence[Mapping[str, Any]]] = None) -> None:
        self.log = log
        self.policies = dict(policies or {})
        self.default = default or QueueSpec()
        self.sweep = float(sweep_ms)
        self.m = float(margin_ms)
        self.key_map: Callable[[str], str] = key_map or (lambda key: key)
        self.final_status = final_status
        self.report = Report()
        self.tx = _Transcripts(transcripts, self.key_map, self.report)
        self.queues: Dict[str, _QueueState] = {}
        self.leases: DefaultDict[Tuple[str, str], List[_Lease]] = defaultdict(list)
        self.last_ts = -INF
        self._dequeued: List[Tuple[str, _Waiter, str, float, int]] = []
        self._close_cache: Dict[Tuple[str, str], List[List[Optional[float]]]] = {}

    def spec(self, queue: str) -> QueueSpec:
        return self.policies.get(queue, self.default)

    # -- driver -----------------------------------------------------------------------------------

    def check(self) -> Report:
        r = self.report
        for n, line in enumerate(self.log, 1):
            self._line(n, line)
        r.stats["log lines replayed"] = len(self.log)
        for key, q in self.queues.items():
            r.waiting_at_end[key] = list(q.waiting)
            r.holding_at_end[key] = list(q.holders)
            if q.expect_switch is not None:
                r.add("consistency", key, f"the grant of waiter {q.expect_switch[0]} has no switch line",
                      "end of log")
        if self.log:  # the log against the transcripts (without a log: the client side only)
            self._check_ttl()
            self._check_beats_have_leases()
            self._check_dequeues_against_transcripts()
            self._check_pending_acquires()
        self._check_final_status()
        self._client_holds()
        return r

    # -- one log line -----------------------------------------------------------------------------

    def _line(self, n: int, line: Mapping[str, Any]) -> None:
        r = self.report
        at = f"log line {n}"
        event, key, ts_text = line.get("event"), line.get("queueKey"), line.get("ts")
        if not isinstance(event, str) or not isinstance(key, str) or not isinstance(ts_text, str):
            r.add("consistency", str(key), f"a line without event/queueKey/ts: {dict(line)}", at)
            return
        ts = parse_ts(ts_text)
        if ts < self.last_ts:
            r.add("consistency", key, f"ts goes backwards ({ts_text})", at)
        self.last_ts = max(self.last_ts, ts)
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = _QueueState(key, self.spec(key))
        session = line.get("sessionKey")
        role = line.get("role")
        if q.expect_switch is not None and event != "switch":
            r.add("consistency", key, f"the grant of waiter {q.expect_switch[0]} is not followed by its "
                  "switch line", at)
            q.expect_switch = None
        if event == "config":
            self._config(q, line, at)
            return
        if not isinstance(session, str) or role not in (PARENT, CHILD):
            r.add("consistency", key, f"a {event} line without sessionKey/role: {dict(line)}", at)
            return
        assert isinstance(role, str)
        r.stats[f"{event} lines"] += 1
        if event == "queued":
            self._queued(q, session, role, ts, n, at)
        elif event == "grant":
            self._grant(q, session, role, line.get("seq"), ts, n, at, line.get("spare") is True)
        elif event == "switch":
            seq = line.get("seq")
            if q.expect_switch != (session, seq if isinstance(seq, int) else None):
                r.add("consistency", key, f"a switch line for {session} that does not follow the grant of a "
                      "waiter", at)
            q.expect_switch = None
        elif event in ("release", "evict"):
            lease = q.holders.pop(session, None)
            if lease is None:
                r.add("consistency", key, f"{event} of {session}, which holds nothing", at)
                return
            lease.end, lease.end_reason, lease.end_line = ts, (
                "ttl" if event == "evict" else str(line.get("reason"))), n
            if event == "evict" and line.get("reason") != "ttl":
                r.add("consistency", key, f"an eviction with reason {line.get('reason')!r} (only ttl exists)", at)
        elif event == "dequeue":
            w = q.waiting.pop(session, None)
            if w is None:
                r.add("consistency", key, f"dequeue of {session}, which waits for nothing", at)
                return
            if line.get("reason") == "merged":
                return  # a reload folded it into the same session's request or slot elsewhere
            self._dequeued.append((q.key, w, str(line.get("reason")), ts, n))
        elif event == "move":  # a reload moved a holder or a waiter here from another queue
            src = self.queues.get(str(line.get("from")))
            if line.get("what") == "holder":
                lease = src.holders.pop(session, None) if src is not None else None
                if lease is None:
                    r.add("consistency", key, f"a move of holder {session}, which holds nothing there", at)
                    return
                q.holders.setdefault(session, lease)  # a session's twin leases count once here
            else:
                w = src.waiting.pop(session, None) if src is not None else None
                if w is None:
                    r.add("consistency", key, f"a move of waiter {session}, which waits for nothing there", at)
                    return
                q.waiting.setdefault(session, w)
        elif event == "dead":  # a holder's spell with nothing in flight while someone waited
            if session not in q.holders:
                r.add("consistency", key, f"dead time of {session}, which holds nothing there", at)
            ms = line.get("ms")
            if not isinstance(ms, int) or isinstance(ms, bool) or ms <= 0:
                r.add("consistency", key, f"a dead spell of {ms!r} ms", at)
        elif event == "usage":
            pass  # token counts: no scheduling state
        else:
            r.add("consistency", key, f"unknown event {event!r}", at)

    def _config(self, q: _QueueState, line: Mapping[str, Any], at: str) -> None:
        limit, holders = line.get("maxStreams"), line.get("holders")
        if line.get("reason") == "over-capacity" and isinstance(limit, int):
            if holders != len(q.holders):
                self.report.add("consistency", q.key, f"an over-capacity line says {holders} holders, the "
                                f"replay has {len(q.holders)}", at)
            q.limit = limit
            self.report.stats["over-capacity reloads"] += 1

    def _queued(self, q: _QueueState, session: str, role: str, ts: float, n: int, at: str) -> None:
        r = self.report
        if session in q.holders:
            r.add("double-hold", q.key, f"{session} queued while it holds the queue (a second slot)", at)
        if session in q.waiting:
            r.add("waiter", q.key, f"{session} queued twice", at)
            return
        regular = sum(1 for h in q.holders.values() if not h.spare)
        if q.limit is None or regular < q.limit:
            r.add("order", q.key, f"{session} queued while a slot was free ({regular}/{q.limit})", at)
        q.waiting[session] = _Waiter(session, role, ts, n, q.parent_grants)

    def _grant(self, q: _QueueState, session: str, role: str, seq: Any, ts: float, n: int, at: str,
               spare: bool = False) -> None:
        r = self.report
        r.stats["grants replayed"] += 1
        if not isinstance(seq, int):
            r.add("seq", q.key, f"the grant of {session} carries no seq", at)
            seq = None
        elif q.last_seq is not None and seq <= q.last_seq:
            r.add("seq", q.key, f"grant seq {seq} of {session} after seq {q.last_seq}", at)
        if seq is not None:
            q.last_seq = seq if q.last_seq is None else max(q.last_seq, seq)
        if session in q.holders:
            r.add("double-hold", q.key, f"{session} granted while it already holds seq {q.holders[session].seq}", at)
        regular = [h for h in q.holders.values() if not h.spare]
        if spare:  # a parent's spare stream: only when children hold every slot, and a spare is free
            spares = len(q.holders) - len(regular)
            if role != PARENT or spares >= q.spec.parent_streams or any(h.role == PARENT for h in regular):
                r.add("capacity", q.key, f"{session} ({role}) granted a spare stream with {spares} spare "
                      f"(parentStreams {q.spec.parent_streams}) beside {sorted((h.session, h.role) for h in regular)}",
                      at)
        elif q.limit is not None and len(regular) >= q.limit:
            r.add("capacity", q.key, f"{session} granted with {len(regular)} holders already "
                  f"(maxStreams {q.limit}): {sorted(h.session for h in regular)}", at)
        w = q.waiting.get(session)
        if w is not None and spare:  # FIFO among the parents (children cannot take the stream)
            older = list(q.waiting)[:list(q.waiting).index(session)]
            if any(self._tiers(q.waiting[o], ts) == {PARENT} for o in older):
                r.add("order", q.key, f"{session} granted a spare stream ahead of an older parent", at)
            self._check_alive(q, session, ts, at)
            del q.waiting[session]
            q.expect_switch = (session, seq)
            r.stats["switches replayed"] += 1
        elif w is not None:
            self._check_pick(q, w, role, ts, at)
            self._check_alive(q, session, ts, at)
            del q.waiting[session]
            q.expect_switch = (session, seq)
            r.stats["switches replayed"] += 1
        elif q.waiting and not (spare and all(self._tiers(o, ts) != {PARENT} for o in q.waiting.values())):
            first = next(iter(q.waiting))
            r.add("order", q.key, f"{session} granted straight into a free slot while {first} and "
                  f"{len(q.waiting) - 1} more waited", at)
        if spare:
            r.stats["spare grants replayed"] += 1
        lease = _Lease(q.key, session, seq, role, ts, n, spare)
        q.holders[session] = lease
        self.leases[(q.key, session)].append(lease)
        if role == PARENT and not spare:  # a spare stream took no child's slot: no aging
            q.parent_grants += 1
        else:
            q.child_mark = q.parent_grants

    # -- rule (b): who is next --------------------------------------------------------------------

    def _tiers(self, w: _Waiter, at_ts: float) -> Set[str]:
        """The tiers waiter ``w`` may have had when a grant logged at ``at_ts`` was decided."""
        if w.ops is None:  # its session's role requests not certainly processed before it queued
            w.ops = [op for op in self.tx.role_ops.get(w.session, ())
                     if op.role in (PARENT, CHILD) and op.done_by(self.m) >= w.ts - self.m]
        tiers = {w.role}
        for op in w.ops:
            lo, hi = op.t, op.done_by(self.m)  # processed within [lo, hi]
            if lo > at_ts + 1.0:
                break  # this one and every later one: certainly after the grant
            assert op.role is not None
            certain = lo > w.ts + 1.0 and hi < at_ts - self.m
            tiers = {op.role} if certain else tiers | {op.role}
        return tiers

    def _aged(self, q: _QueueState, w: _Waiter, ts: float, certainly: bool) -> bool:
        """Had child ``w`` aged at a grant logged at ``ts``?  ``certainly``: beyond any timing
        doubt (for a missed aging); otherwise: possibly (to excuse a jump)."""
        spec = q.spec
        if spec.aging_after_slots > 0 and (
                q.parent_grants - max(w.parent_mark, q.child_mark) >= spec.aging_after_slots):
            return True  # exact: counted from the log's own grant lines
        if spec.aging_after_ms > 0:
            waited = ts - w.ts
            if certainly:
                return waited >= spec.aging_after_ms + 1.0 + self.m
            return waited >= spec.aging_after_ms - 1.0 - self.m
        return False

    def _in_a_row(self, q: _QueueState, w: _Waiter) -> int:
        return q.parent_grants - max(w.parent_mark, q.child_mark)

    def _check_pick(self, q: _QueueState, w: _Waiter, role: str, ts: float, at: str) -> None:
        """Was waiter ``w`` (granted as ``role`` at ``ts``) the one the policy picks next?"""
        r = self.report
        waiters = list(q.waiting.values())
        mine_at = waiters.index(w)
        older = waiters[:mine_at]
        if q.spec.policy == "fifo":
            if older:
                r.add("order", q.key, f"fifo: {w.session} granted ahead of older waiter {older[0].session}", at)
            return
        cache: Dict[str, Set[str]] = {}

        def tiers(o: _Waiter) -> Set[str]:
            got = cache.get(o.session)
            if got is None:
                got = cache[o.session] = self._tiers(o, ts)
            return got

        mine = tiers(w)
        if role not in mine:
            r.add("order", q.key, f"{w.session} granted as {role} but its tier was {sorted(mine)}", at)
        others = [o for o in waiters if o is not w]
        if role == PARENT:
            for o in older:
                if CHILD not in tiers(o):
                    r.add("order", q.key, f"parent {w.session} granted ahead of older parent {o.session}", at)
                    return
            head = next((o for o in others if CHILD in tiers(o)), None)  # the oldest child, if certain
            if head is not None and tiers(head) == {CHILD} and self._aged(q, head, ts, certainly=True):
                r.add("order", q.key, f"parent {w.session} granted while child {head.session} was due by aging "
                      f"(waited {ts - head.ts:.0f} ms, {self._in_a_row(q, head)} parent grants in a row)", at)
            return
        for o in older:
            if PARENT not in tiers(o):
                r.add("order", q.key, f"child {w.session} granted ahead of older child {o.session}", at)
                return
        parent = older[0] if older else next((o for o in others if tiers(o) == {PARENT}), None)
        if parent is None:
            return
        if self._aged(q, w, ts, certainly=False):
            r.stats["aging jumps"] += 1
        else:
            r.add("order", q.key, f"child {w.session} jumped parent {parent.session} without aging (waited "
                  f"{ts - w.ts:.0f} ms, {self._in_a_row(q, w)} parent grants in a row)", at)

    def _check_alive(self, q: _QueueState, session: str, ts: float, at: str) -> None:
        """A waiter is never granted once every connection that asked for it has closed."""
        names = self.tx.session_conns.get((q.key, session))
        if not names:
            return  # no transcript of this session
        asked = [self.tx.conns[n] for n in names
                 if any(op.op == "acquire" and op.queue == q.key and op.session == session and op.t <= ts + 1.0
                        for op in self.tx.conns[n].ops)]
        gone = [c.gone_by for c in asked]
        if asked and all(g is not None and g < ts - self.m for g in gone):
            last = max(g for g in gone if g is not None)
            self.report.add("waiter", q.key, f"{session} granted {ts - last:.0f} ms after its last connection "
                            "closed (a dead waiter)", at)

    # -- rule (c): TTL ----------------------------------------------------------------------------

    def _lease_beats(self, lease: _Lease, grants: List[_GrantSeen]
                     ) -> Tuple[List[Tuple[float, float, bool]], Optional[int], Set[str]]:
        """The beats of ``lease`` from the transcripts: ``(sent, processed by, certain)`` each,
        the TTL of its granted reply, and the connections it was granted to.  A keyed beat names
        the session, so it counts from any connection; a bare renew and a re-``acquire`` count
        on a connection the lease was granted to, once that connection had the grant."""
        mine = [g for g in grants if g.seq == lease.seq and g.seq is not None]
        since: Dict[str, float] = {}
        for g in mine:
            since[g.conn] = min(since.get(g.conn, INF), g.t)
        ttl = next((g.ttl_ms for g in mine if g.ttl_ms is not None), None)
        end = lease.end if lease.end is not None else INF
        beats: List[Tuple[float, float, bool]] = []
        for op in self.tx.keyed_beats.get((lease.queue, lease.session), ()):
            if op.t > end + 1.0 or op.t <= min(since.get(op.conn, INF), lease.ts + 1.0):
                continue
            answer = (op.reply or {}).get("granted")
            if answer is False:
                continue  # processed when the lease was already gone
            beats.append((op.t, op.done_by(self.m), answer is True or op.t < end - self.m))
        for name, first in since.items():
            for op in self.tx.conns[name].ops:
                if op.t <= first or op.t > end + 1.0:
                    continue
                keyed = op.queue == lease.queue and op.session == lease.session
                if (op.op == "renew" and op.queue is None) or (op.op == "acquire" and keyed):
                    beats.append((op.t, op.done_by(self.m), op.t < end - self.m))
        return beats, ttl, set(since)

    def _check_ttl(self) -> None:
        r = self.report
        for (queue, session), leases in self.leases.items():
            grants = self.tx.grants_of(queue, session)
            for lease in leases:
                spec = self.spec(queue)
                beats, ttl_seen, conns = self._lease_beats(lease, grants)
                ttl = float(ttl_seen if ttl_seen is not None else spec.lease_ttl_ms)
                at = f"log line {lease.end_line or lease.line}"
                grant_hi = min([lease.ts + 1.0] + [g.t for g in grants if g.seq == lease.seq])
                if lease.end_reason == "ttl":
                    e = lease.end
                    assert e is not None
                    r.stats["ttl evictions checked"] += 1
                    lower = max([lease.ts - self.m] + [s for s, _, sure in beats if sure])
                    if e + 1.0 < lower + ttl:
                        r.add("ttl", queue, f"{session} evicted {lower + ttl - e:.0f} ms before its TTL lapsed "
                              f"(last certain beat {e - lower:.0f} ms before the eviction, TTL {ttl:.0f})", at)
                    if conns:
                        r.stats["ttl evictions checked against beats"] += 1
                        latest = max([grant_hi] + [hi for s, hi, _ in beats if s <= e + 1.0 - ttl])
                        late = e - (latest + ttl + self.sweep)
                        r.eviction_delays_ms.append(late + self.sweep)
                        if late > self.m:
                            r.add("ttl", queue, f"{session} evicted {late:.0f} ms past last beat + TTL + sweep "
                                  f"(margin {self.m:.0f})", at)
                if not conns:
                    continue
                # A lapsed lease the sweep missed: still answered as held past TTL + sweep.
                proven: List[Tuple[float, float]] = [(grant_hi, grant_hi)] + [(s, hi) for s, hi, _ in beats]
                proven.sort()
                latest = grant_hi
                missed = False
                for s, hi in proven[1:]:
                    if s > latest + ttl + self.sweep + self.m and self._answered_held(lease, s):
                        r.add("ttl", queue, f"{session} was still held {s - latest - ttl:.0f} ms after its TTL "
                              "lapsed: the sweep missed it", at)
                        missed = True
                        break
                    latest = max(latest, hi)
                if not missed and lease.end is not None and lease.end_reason != "ttl" and (
                        lease.end - self.m > latest + ttl + self.sweep + self.m):
                    r.add("ttl", queue, f"{session} released ({lease.end_reason}) {lease.end - latest - ttl:.0f} ms "
                          "after its TTL lapsed: the sweep missed it", at)
                self._check_beat_answers(lease)

    def _check_beats_have_leases(self) -> None:
        """A keyed beat answered ``granted: true`` while the log shows no lease of the session."""
        for (queue, session), ops in self.tx.keyed_beats.items():
            leases = self.leases.get((queue, session), [])
            for op in ops:
                if (op.reply or {}).get("granted") is not True:
                    continue
                hi = op.done_by(self.m)
                if not any(op.t <= (l.end if l.end is not None else INF) + 1.0 and hi >= l.ts - self.m
                           for l in leases):
                    self.report.add("consistency", queue, f"a keyed renew of {session} answered granted:true "
                                    "while the log shows no lease of it", f"transcript {op.conn}")

    def _answered_held(self, lease: _Lease, sent: float) -> bool:
        for op in self.tx.keyed_beats.get((lease.queue, lease.session), ()):
            if op.t == sent and (op.reply or {}).get("granted") is True:
                return True
        return False

    def _check_beat_answers(self, lease: _Lease) -> None:
        """A keyed beat answered ``granted: false`` while the log shows the lease held."""
        end = lease.end if lease.end is not None else INF
        for op in self.tx.keyed_beats.get((lease.queue, lease.session), ()):
            if (op.reply or {}).get("granted") is not False:
                continue
            if op.t > lease.ts + 1.0 and op.done_by(self.m) < end - self.m:
                self.report.add("consistency", lease.queue, f"a keyed renew of {lease.session} answered "
                                f"granted:false while the log shows seq {lease.seq} held",
                                f"transcript {op.conn}")

    # -- rule (e): waiters against the transcripts ------------------------------------------------

    def _check_dequeues_against_transcripts(self) -> None:
        r = self.report
        for queue, w, reason, ts, n in self._dequeued:
            r.stats[f"dequeues ({reason})"] += 1
            if w.session not in self.tx.sessions:
                continue  # no transcript of this session: nothing to hold it against
            at = f"log line {n}"
            if reason == "cancel":
                if not any(op.t <= ts + 1.0 and op.done_by(self.m) >= w.ts - self.m
                           for op in self.tx.cancels.get((queue, w.session), ())):
                    r.add("waiter", queue, f"{w.session} dequeued as cancelled but it sent no cancel", at)
            elif reason == "disconnect":
                # Held against the closes themselves, not the log's times around the waiter: a
                # daemon kept off the CPU for longer than the margin reads an acquire, its
                # connection's end and the same session's acquire on a new connection in one late
                # turn, and logs the first waiter queued and dequeued after all three.
                closes = self._closes_with_acquire_outstanding(queue, w.session)
                fit = [c for c in closes if c[0] <= ts + 1.0 and (c[1] is None or c[1] > ts - self.m)]
                if fit:
                    closes.remove(fit[0])  # each close answers for one dequeue
                else:
                    r.add("waiter", queue, f"{w.session} dequeued as disconnected but none of its connections "
                          "closed", at)

    def _closes_with_acquire_outstanding(self, queue: str, session: str) -> List[List[Optional[float]]]:
        """``[close time, retired at]`` for each connection of ``session`` that went away with an
        acquire of ``queue`` outstanding (sent, and no grant or cancel of it seen since), in time
        order.  A grant or a cancel the client saw later retires it: a waiter life ended there.
        The session's records come from one client, so their order is the order they happened.
        Built once per pair; the caller removes the closes it matched."""
        cached = self._close_cache.get((queue, session))
        if cached is not None:
            return cached
        events: List[Tuple[float, int, str, str]] = []
        for name in self.tx.session_any_conns.get(session, ()):
            c = self.tx.conns[name]
            for op in c.ops:
                if op.queue == queue and op.session == session and op.op in ("acquire", "cancel"):
                    events.append((op.t, 0, op.op, name))
            for g in c.grants:
                if g.queue == queue and g.session == session:
                    events.append((g.t, 0, "granted", name))
            if c.gone is not None:
                events.append((c.gone, 1, "gone", name))
        events.sort()
        outstanding: Set[str] = set()
        closes: List[List[Optional[float]]] = []
        for t, _, kind, name in events:
            if kind == "acquire":
                outstanding.add(name)
            elif kind == "gone":
                if name in outstanding:
                    outstanding.discard(name)
                    closes.append([t, None])
            else:  # granted, cancel: that life is over
                outstanding.clear()
                for close in closes:
                    if close[1] is None:
                        close[1] = t
        self._close_cache[(queue, session)] = closes
        return closes

    def _check_pending_acquires(self) -> None:
        for conn, queue, session in self.report.pending_acquires:
            q = self.queues.get(queue)
            if q is None or (session not in q.waiting and session not in q.holders):
                self.report.add("waiter", queue, f"{session} still waits for its acquire, but the log has it "
                                "neither waiting nor holding (a vanished waiter)", f"transcript {conn}")

    def _check_final_status(self) -> None:
        if self.final_status is None:
            return
        r = self.report
        seen: Set[str] = set()
        for entry in self.final_status:
            key = str(entry.get("queueKey"))
            seen.add(key)
            q = self.queues.get(key)
            waiting = [str(x.get("sessionKey")) for x in entry.get("waiting", ())]
            holders = sorted(str(x.get("sessionKey")) for x in entry.get("holders", ()))
            log_waiting = list(q.waiting) if q else []
            log_holders = sorted(q.holders) if q else []
            for s in log_waiting:
                if s not in waiting:
                    r.add("waiter", key, f"{s} waits by the log but status no longer lists it (a vanished "
                          "waiter)", "final status")
            for s in waiting:
                if s not in log_waiting:
                    r.add("waiter", key, f"status lists waiter {s} that the log never queued", "final status")
            if [s for s in log_waiting if s in waiting] != [s for s in waiting if s in log_waiting]:
                r.add("waiter", key, f"status lists the waiters as {waiting}, the log queued them as {log_waiting}",
                      "final status")
            if holders != log_holders:
                r.add("consistency", key, f"status holders {holders}, replayed holders {log_holders}", "final status")
        for key, q in self.queues.items():
            if key not in seen and (q.waiting or q.holders):
                r.add("waiter" if q.waiting else "consistency", key, f"status has no queue {key}, the log leaves "
                      f"waiters {list(q.waiting)} and holders {sorted(q.holders)}", "final status")

    # -- client holds (transcripts alone) ---------------------------------------------------------

    def _client_holds(self) -> None:
        r = self.report
        log_seqs: Set[Tuple[str, str, Optional[int]]] = {
            (l.queue, l.session, l.seq) for ls in self.leases.values() for l in ls}
        spare_seqs: Set[Tuple[str, str, Optional[int]]] = {
            (l.queue, l.session, l.seq) for ls in self.leases.values() for l in ls if l.spare}
        holds: List[Hold] = []
        for c in self.tx.conns.values():
            for g in c.grants:
                if self.log and g.seq is not None and (g.queue, g.session, g.seq) not in log_seqs:
                    r.add("consistency", g.queue, f"{g.session} got granted seq {g.seq}, which no grant line "
                          "has", f"transcript {c.name}")
            holds.extend(self._holds_of(c))
        r.holds = holds
        by_queue: DefaultDict[str, List[Hold]] = defaultdict(list)
        for h in holds:
            by_queue[h.queue].append(h)
        for queue, hs in by_queue.items():
            limit = self.spec(queue).max_streams
            spare_limit = self.spec(queue).parent_streams
            edges = sorted([(h.start, 1, h) for h in hs if h.end > h.start]
                           + [(h.end, -1, h) for h in hs if h.end > h.start], key=lambda e: (e[0], e[1]))
            live: Dict[Tuple[str, str], Hold] = {}
            peak = 0
            reported = False
            for t, step, h in edges:
                if step < 0:
                    if live.get((h.conn, h.session)) is h:
                        del live[(h.conn, h.session)]
                    continue
                same = [o for o in live.values() if o.session == h.session and o.seq != h.seq]
                if same:
                    r.add("double-hold", queue, f"{h.session} holds seq {h.seq} (from {h.start:.0f}) while it "
                          f"still holds seq {same[0].seq} (client side)", f"transcript {h.conn}")
                live[(h.conn, h.session)] = h
                count = len({(o.session, o.seq) for o in live.values()})
                peak = max(peak, count)
                spares = len({(o.session, o.seq) for o in live.values() if (queue, o.session, o.seq) in spare_seqs})
                if limit is not None and (count - spares > limit or spares > spare_limit) and not reported:
                    reported = True
                    r.add("capacity", queue, f"{count} clients held at once (maxStreams {limit}): "
                          f"{sorted((o.session, o.seq) for o in live.values())}", f"transcript {h.conn}")
            r.max_client_holds[queue] = peak
        r.stats["client holds"] = len(holds)

    def _holds_of(self, c: _Conn) -> Iterator[Hold]:
        """The intervals this connection could prove it held each queue."""
        open_: Dict[Tuple[str, str], List[Any]] = {}  # -> [grant, start, proven_ttl, proven_idle]

        def close(key: Tuple[str, str], t: float) -> Iterator[Hold]:
            g, start, by_ttl, by_idle = open_.pop(key)
            until = min(t, by_ttl, by_idle)
            yield Hold(c.name, g.queue, g.session, g.seq, start, max(start, until))

        spec_of = self.spec
        for t, kind, item in c.events:
            if kind == "granted":
                g: _GrantSeen = item
                if g.stale:
                    continue
                key = (g.queue, g.session)
                ttl = float(g.ttl_ms if g.ttl_ms is not None else spec_of(g.queue).lease_ttl_ms)
                idle = float(g.idle_ms if g.idle_ms is not None else spec_of(g.queue).idle_yield_ms)
                if key in open_:
                    if open_[key][0].seq == g.seq:  # a re-grant of the lease it holds: proof
                        open_[key][2] = max(open_[key][2], g.asked_at + ttl)
                        if open_[key][3] != INF:
                            open_[key][3] = max(open_[key][3], g.asked_at + idle)
                        continue
                    self.report.add("double-hold", g.queue, f"{g.session} granted seq {g.seq} while it holds seq "
                                    f"{open_[key][0].seq} (client side)", f"transcript {c.name}")
                    yield from close(key, t)
                by_idle = g.asked_at + idle if g.activity and idle > 0 else INF
                open_[key] = [g, t, g.asked_at + ttl, by_idle]
            elif kind == "op":
                op: _Op = item
                if op.op == "bye":
                    for key in list(open_):
                        yield from close(key, t)
                    continue
                if op.queue is None or op.session is None:
                    continue
                key = (op.queue, op.session)
                if key not in open_:
                    continue
                if op.op in ("release", "cancel"):
                    yield from close(key, t)
                elif op.op == "renew":
                    answer = (op.reply or {}).get("granted")
                    g = open_[key][0]
                    if answer is True:
                        ttl = float(g.ttl_ms if g.ttl_ms is not None else spec_of(g.queue).lease_ttl_ms)
                        idle = float(g.idle_ms if g.idle_ms is not None else spec_of(g.queue).idle_yield_ms)
                        open_[key][2] = max(open_[key][2], op.t + ttl)
                        if open_[key][3] != INF:
                            open_[key][3] = max(open_[key][3], op.t + idle)
                    elif answer is False:
                        yield from close(key, op.ack if op.ack is not None else t)
            elif kind == "close":
                for key in list(open_):
                    yield from close(key, t)
        for key in list(open_):
            yield from close(key, INF)


def check_history(log: Sequence[Mapping[str, Any]], transcripts: Iterable[Mapping[str, Any]] = (), **kwargs: Any
                  ) -> Report:
    """Replay ``log`` and ``transcripts``; see ``HistoryChecker`` for the keyword arguments."""
    return HistoryChecker(log, transcripts, **kwargs).check()
