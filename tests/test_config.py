"""Issue 4 pinned: config validation, addressing (groups, providers, URL normalisation), hot-reload,
the event log and ``check-config``.

In memory (pure): ``validate_config`` reports every violation at once as a path-named message and
unknown or misplaced keys as warnings; ``Addressing`` decides which queue owns a key, table-driven,
with a plain dict standing for models.json; ``normalize_url``; ``load_catalog`` on missing and
broken catalogs.

Through a real daemon process (harness ``DaemonProc``, ``--sweep-ms 20``): groups merge and split,
passthrough, provider names resolved through models.json; every hot-reload case of the
specification (atomic rename, half-written file, rejected config, missing config, startup errors,
widened and lowered ``maxStreams``, regrouping, models.json changes, SIGHUP, the config's directory
removed and restored); the ``logFile`` event log (every event, its fields, the path re-read per
event, swallowed write failures); and the ``check-config`` command.

A reload costs one config poll (the sweep tick, 20 ms) plus the 250 ms debounce, so every
positive wait polls with ``wait_for``; the few negative checks sleep about twice that.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

import llmqueue as lq
from tests.harness import MODULE, DaemonProc, Peer, short_tmpdir, started, wait_for

U1 = "http://127.0.0.1:8001/v1"
U2 = "http://127.0.0.1:8002/v1"
U3 = "http://127.0.0.1:8003/v1"
KEEP_ALIVE = 10**9  # daemonIdleExitMs for every config these tests write: no idle exit mid-test
RELOAD_S = 3.0  # generous upper bound for one reload (poll + 250 ms debounce)
SETTLE_S = 0.7  # a negative check waits this long: more than two reload latencies


# -- helpers -------------------------------------------------------------------------------------


def conf(defaults: Optional[Dict[str, Any]] = None, queues: Optional[Dict[str, Any]] = None,
         **top: Any) -> Dict[str, Any]:
    """A config dict that keeps the daemon resident (daemonIdleExitMs is the production 0 otherwise)."""
    d = dict(defaults or {})
    d.setdefault("daemonIdleExitMs", KEEP_ALIVE)
    out: Dict[str, Any] = dict(top)
    out["defaults"] = d
    out["queues"] = dict(queues or {})
    return out


@contextlib.contextmanager
def daemon(config: Optional[Dict[str, Any]] = None, **kwargs: Any) -> Iterator[DaemonProc]:
    """A started daemon with ``config`` (kept resident), stopped and cleaned up afterwards."""
    with DaemonProc(**kwargs) as d:
        if config is not None:
            d.write_config(config)
        d.start()
        yield d


def acquire(d: DaemonProc, key: str, session: str, role: str = "parent", activity: bool = False) -> Peer:
    p = d.peer()
    msg: Dict[str, Any] = {"op": "acquire", "queueKey": key, "sessionKey": session, "role": role}
    if activity:
        msg["activity"] = True
    p.send(msg)
    return p


def expect_grant(p: Peer, key: str, session: str, timeout: float = RELOAD_S) -> None:
    reply = p.recv(timeout)
    assert reply.get("op") == "granted", reply
    assert reply.get("queueKey") == key, reply
    assert reply.get("sessionKey") == session, reply


def release(p: Peer, key: str, session: str) -> None:
    assert p.ask({"op": "release", "queueKey": key, "sessionKey": session}) == {"op": "ok", "queueKey": key, "sessionKey": session}


def queue_of(d: DaemonProc, key: str) -> Optional[Dict[str, Any]]:
    for q in d.status():
        if q["queueKey"] == key:
            return q
    return None


def sessions(entries: List[Dict[str, Any]]) -> List[str]:
    return [e["sessionKey"] for e in entries]


def wait_max_streams(d: DaemonProc, key: str, value: Any) -> None:
    def seen() -> bool:
        q = queue_of(d, key)
        return q is not None and q["maxStreams"] == value

    wait_for(seen, RELOAD_S)


def write_json(path: str, value: Any) -> None:
    """Atomic save (temp file + rename), like an editor."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def log_lines(path: str) -> List[Dict[str, Any]]:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        obj = json.loads(line)  # every line is one JSON object
        assert isinstance(obj, dict), line
        out.append(obj)
    return out


def wait_log(path: str, predicate: Any) -> List[Dict[str, Any]]:
    def ready() -> Optional[List[Dict[str, Any]]]:
        lines = log_lines(path)
        return lines if predicate(lines) else None

    result: List[Dict[str, Any]] = wait_for(ready, RELOAD_S)
    return result


def has(lines: List[Dict[str, Any]], **fields: Any) -> bool:
    return any(all(line.get(k) == v for k, v in fields.items()) for line in lines)


def mentions_path(message: str, path: str) -> bool:
    """``path`` appears in ``message`` as a whole config path (not as a prefix of a longer one)."""
    return re.search(r"(?<![\w.])" + re.escape(path) + r"(?![\w.])", message) is not None


ISO_MS_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}(Z|\+00:00)$")


# =================================================================================================
# 1. Validation (pure)
# =================================================================================================


def test_the_spec_example_message_appears_verbatim() -> None:
    """queues.zen.maxStreams: 0 is reported exactly as the specification writes it."""
    _, errors, _ = lq.validate_config({"queues": {"zen": {"maxStreams": 0}}})
    assert errors == ["queues.zen.maxStreams must be a positive integer (got 0)"]


BAD_POLICY_VALUES: List[Tuple[str, List[Any]]] = [
    ("maxStreams", [0, -1, 1.5, "2", True, None, 2**31]),
    ("policy", ["lifo", "", 1, None, ["fifo"]]),
    ("leaseTtlMs", [999, 0, -1000, 1000.5, "30000", True]),
    ("agingAfterSlots", [-1, 1.5, "3", True, None]),
    ("agingAfterMs", [-1, 0.5, "60000", False]),
    ("idleYieldMs", [-1, 2.5, "0", True]),
]


def _policy_cases() -> List[Any]:
    cases = []
    for field, values in BAD_POLICY_VALUES:
        for value in values:
            for where in ("defaults", "queues.zen"):
                cases.append(pytest.param(where, field, value, id=f"{where}.{field}={value!r}"))
    return cases


@pytest.mark.parametrize("where,field,value", _policy_cases())
def test_a_wrong_queue_policy_value_is_one_path_named_error(where: str, field: str, value: Any) -> None:
    """Every queue-policy field, in defaults and on an entry, rejects each wrong value by path."""
    raw: Dict[str, Any] = {"defaults": {field: value}} if where == "defaults" else {"queues": {"zen": {field: value}}}
    _, errors, _ = lq.validate_config(raw)
    assert len(errors) == 1, errors
    assert mentions_path(errors[0], f"{where}.{field}"), errors
    assert json.dumps(value) in errors[0], errors  # the offending value is shown, as in "(got 0)"


ENTRY_AND_DEFAULTS_ONLY_BAD: List[Tuple[str, Dict[str, Any], str, Any]] = [
    ("enabled-string", {"queues": {"q": {"enabled": "false"}}}, "queues.q.enabled", "false"),
    ("enabled-int", {"queues": {"q": {"enabled": 0}}}, "queues.q.enabled", 0),
    ("enabled-null", {"queues": {"q": {"enabled": None}}}, "queues.q.enabled", None),
    ("match-empty", {"queues": {"g": {"match": []}}}, "queues.g.match", []),
    ("match-string", {"queues": {"g": {"match": U1}}}, "queues.g.match", U1),
    ("match-object", {"queues": {"g": {"match": {"a": U1}}}}, "queues.g.match", {"a": U1}),
    ("match-int-member", {"queues": {"g": {"match": [U1, 2]}}}, "queues.g.match", [U1, 2]),
    ("match-null-member", {"queues": {"g": {"match": [None]}}}, "queues.g.match", [None]),
    ("match-empty-member", {"queues": {"g": {"match": [""]}}}, "queues.g.match", [""]),
    ("failOpen-string", {"defaults": {"failOpen": "yes"}}, "defaults.failOpen", "yes"),
    ("failOpen-int", {"defaults": {"failOpen": 1}}, "defaults.failOpen", 1),
    ("queueTimeoutMs-negative", {"defaults": {"queueTimeoutMs": -1}}, "defaults.queueTimeoutMs", -1),
    ("queueTimeoutMs-string", {"defaults": {"queueTimeoutMs": "60000"}}, "defaults.queueTimeoutMs", "60000"),
    ("queueTimeoutMs-float", {"defaults": {"queueTimeoutMs": 1.5}}, "defaults.queueTimeoutMs", 1.5),
    ("blockingTools-string", {"defaults": {"blockingTools": "subagent"}}, "defaults.blockingTools", "subagent"),
    ("blockingTools-int-member", {"defaults": {"blockingTools": ["ask_user", 3]}}, "defaults.blockingTools",
     ["ask_user", 3]),
    ("blockingTools-object", {"defaults": {"blockingTools": {}}}, "defaults.blockingTools", {}),
    ("daemonIdleExitMs-negative", {"defaults": {"daemonIdleExitMs": -1}}, "defaults.daemonIdleExitMs", -1),
    ("daemonIdleExitMs-string", {"defaults": {"daemonIdleExitMs": "0"}}, "defaults.daemonIdleExitMs", "0"),
    ("daemonIdleExitMs-float", {"defaults": {"daemonIdleExitMs": 0.5}}, "defaults.daemonIdleExitMs", 0.5),
    ("daemonIdleExitMs-bool", {"defaults": {"daemonIdleExitMs": True}}, "defaults.daemonIdleExitMs", True),
    ("logFile-int", {"defaults": {"logFile": 42}}, "defaults.logFile", 42),
    ("logFile-bool", {"defaults": {"logFile": True}}, "defaults.logFile", True),
    ("logFile-list", {"defaults": {"logFile": ["/tmp/x.log"]}}, "defaults.logFile", ["/tmp/x.log"]),
    ("defaults-list", {"defaults": []}, "defaults", []),
    ("defaults-string", {"defaults": "fast"}, "defaults", "fast"),
    ("defaults-number", {"defaults": 3}, "defaults", 3),
    ("queues-list", {"queues": [U1]}, "queues", [U1]),
    ("queues-string", {"queues": "zen"}, "queues", "zen"),
    ("queue-entry-number", {"queues": {"zen": 3}}, "queues.zen", 3),
    ("queue-entry-list", {"queues": {"zen": []}}, "queues.zen", []),
    ("queue-entry-null", {"queues": {"zen": None}}, "queues.zen", None),
    ("schemaVersion-zero", {"schemaVersion": 0}, "schemaVersion", 0),
    ("schemaVersion-negative", {"schemaVersion": -1}, "schemaVersion", -1),
    ("schemaVersion-float", {"schemaVersion": 1.5}, "schemaVersion", 1.5),
    ("schemaVersion-string", {"schemaVersion": "1"}, "schemaVersion", "1"),
    ("schemaVersion-bool", {"schemaVersion": True}, "schemaVersion", True),
]


@pytest.mark.parametrize("raw,path,value", [pytest.param(r, p, v, id=i) for i, r, p, v in ENTRY_AND_DEFAULTS_ONLY_BAD])
def test_a_wrong_field_type_is_one_path_named_error(raw: Dict[str, Any], path: str, value: Any) -> None:
    """enabled, match, the client and daemon fields, the sections and schemaVersion reject wrong types by path."""
    _, errors, _ = lq.validate_config(raw)
    assert len(errors) == 1, errors
    assert mentions_path(errors[0], path), errors
    assert json.dumps(value) in errors[0], errors


@pytest.mark.parametrize("version", [2, 99])
def test_a_newer_schema_version_is_rejected_with_an_upgrade_llmqueue_error(version: int) -> None:
    _, errors, _ = lq.validate_config({"schemaVersion": version})
    assert len(errors) == 1, errors
    assert mentions_path(errors[0], "schemaVersion"), errors
    assert "upgrade llmqueue" in errors[0], errors


def test_a_config_that_is_not_an_object_is_an_error() -> None:
    _, errors, _ = lq.validate_config([{"defaults": {}}])
    assert len(errors) == 1, errors


def test_every_violation_is_reported_at_once_not_the_first_only() -> None:
    raw = {
        "schemaVersion": 0,
        "defaults": {"maxStreams": 0, "leaseTtlMs": 10, "failOpen": "no", "logFile": 5, "idleYieldMs": -1},
        "queues": {
            "zen": {"maxStreams": 0, "policy": "lifo", "agingAfterSlots": -2},
            "g": {"match": [], "enabled": "yes", "agingAfterMs": 1.5},
            "bad": "entry",
        },
    }
    paths = [
        "schemaVersion", "defaults.maxStreams", "defaults.leaseTtlMs", "defaults.failOpen", "defaults.logFile",
        "defaults.idleYieldMs", "queues.zen.maxStreams", "queues.zen.policy", "queues.zen.agingAfterSlots",
        "queues.g.match", "queues.g.enabled", "queues.g.agingAfterMs", "queues.bad",
    ]
    _, errors, _ = lq.validate_config(raw)
    assert len(errors) == len(paths), errors
    for path in paths:
        assert sum(mentions_path(e, path) for e in errors) == 1, (path, errors)
    assert "queues.zen.maxStreams must be a positive integer (got 0)" in errors


GOOD_VALUES: List[Tuple[str, Dict[str, Any]]] = [
    ("maxStreams-range", {"defaults": {"maxStreams": 1}, "queues": {"q": {"maxStreams": 2147483647}}}),
    ("policies", {"defaults": {"policy": "fifo"}, "queues": {"q": {"policy": "priority-aging"}}}),
    ("leaseTtlMs-minimum", {"defaults": {"leaseTtlMs": 1000}, "queues": {"q": {"leaseTtlMs": 2147483647}}}),
    ("aging-zero", {"defaults": {"agingAfterSlots": 0, "agingAfterMs": 0}, "queues": {"q": {"agingAfterSlots": 0}}}),
    ("idleYieldMs-zero", {"defaults": {"idleYieldMs": 0}, "queues": {"q": {"idleYieldMs": 0}}}),
    ("enabled-bools", {"queues": {"a": {"enabled": False}, "b": {"enabled": True}}}),
    ("match-urls-and-providers", {"queues": {"g": {"match": [U1, "llama"]}}}),
    ("client-fields", {"defaults": {"failOpen": False, "queueTimeoutMs": 0, "blockingTools": ["subagent"]}}),
    ("daemon-fields", {"defaults": {"daemonIdleExitMs": 0, "logFile": "/tmp/llmqueue-test.log"}}),
    ("schemaVersion-current", {"schemaVersion": 1}),
    ("empty", {}),
]


@pytest.mark.parametrize("raw", [pytest.param(r, id=i) for i, r in GOOD_VALUES])
def test_values_in_range_are_accepted_without_errors_or_warnings(raw: Dict[str, Any]) -> None:
    _, errors, warnings = lq.validate_config(raw)
    assert errors == [] and warnings == []


def test_valid_values_reach_the_config_and_the_queue_policy() -> None:
    """defaults overlay every queue; an entry overrides per field; defaults-only fields land on Config."""
    cfg, errors, _ = lq.validate_config({
        "defaults": {"maxStreams": 2, "policy": "fifo", "leaseTtlMs": 5000, "agingAfterSlots": 4,
                     "agingAfterMs": 7000, "idleYieldMs": 900, "failOpen": False, "queueTimeoutMs": 1234,
                     "blockingTools": ["x"], "daemonIdleExitMs": 55, "logFile": "/tmp/a.log"},
        "queues": {"zen": {"maxStreams": 3, "idleYieldMs": 0}},
    })
    assert errors == []
    assert (cfg.fail_open, cfg.queue_timeout_ms, tuple(cfg.blocking_tools), cfg.daemon_idle_exit_ms, cfg.log_file) == (
        False, 1234, ("x",), 55, "/tmp/a.log")
    a = lq.Addressing(cfg, {})
    assert a.address_endpoint("zen")[1] == lq.QueuePolicy(3, "fifo", 5000, 4, 7000, 0)
    assert a.address_endpoint("other")[1] == lq.QueuePolicy(2, "fifo", 5000, 4, 7000, 900)


WARNING_CASES: List[Tuple[str, Dict[str, Any], str]] = [
    ("unknown-top-level", {"extra": 1}, "extra"),
    ("unknown-in-defaults", {"defaults": {"maxStream": 2}}, "defaults.maxStream"),
    ("unknown-on-entry", {"queues": {"zen": {"maxstreams": 2}}}, "queues.zen.maxstreams"),
    ("failOpen-on-entry", {"queues": {"zen": {"failOpen": False}}}, "queues.zen.failOpen"),
    ("queueTimeoutMs-on-entry", {"queues": {"zen": {"queueTimeoutMs": 5}}}, "queues.zen.queueTimeoutMs"),
    ("blockingTools-on-entry", {"queues": {"zen": {"blockingTools": []}}}, "queues.zen.blockingTools"),
    ("daemonIdleExitMs-on-entry", {"queues": {"zen": {"daemonIdleExitMs": 0}}}, "queues.zen.daemonIdleExitMs"),
    ("logFile-on-entry", {"queues": {"zen": {"logFile": "/tmp/x.log"}}}, "queues.zen.logFile"),
    ("enabled-in-defaults", {"defaults": {"enabled": False}}, "defaults.enabled"),
    ("match-in-defaults", {"defaults": {"match": [U1]}}, "defaults.match"),
]


@pytest.mark.parametrize("raw,path", [pytest.param(r, p, id=i) for i, r, p in WARNING_CASES])
def test_unknown_and_misplaced_keys_are_path_named_warnings_not_errors(raw: Dict[str, Any], path: str) -> None:
    _, errors, warnings = lq.validate_config(raw)
    assert errors == []
    assert len(warnings) == 1, warnings
    assert mentions_path(warnings[0], path), warnings


@pytest.mark.parametrize("raw,hint", [
    ({"defaults": {"leaseTTLms": 5000}}, "did you mean leaseTtlMs?"),
    ({"defaults": {"maxStream": 2}}, "did you mean maxStreams?"),
    ({"queues": {"zen": {"maxstreams": 2}}}, "did you mean maxStreams?"),
    ({"queues": {"zen": {"matches": ["x"]}}}, "did you mean match?"),
    ({"default": {}}, "did you mean defaults?"),
])
def test_a_misspelt_config_field_gets_did_you_mean(raw: Dict[str, Any], hint: str) -> None:
    """Issue 34: a typo names the field it was meant to be; one far from every field gets none."""
    _, _, warnings = lq.validate_config(raw)
    assert len(warnings) == 1 and hint in warnings[0], warnings
    _, _, warnings = lq.validate_config({"defaults": {"colour": 1}})
    assert "did you mean" not in warnings[0]


def test_misplaced_keys_are_ignored_not_applied() -> None:
    """enabled/match in defaults make no passthrough and no group; a queue entry's logFile sets no log."""
    cfg, errors, _ = lq.validate_config({
        "defaults": {"enabled": False, "match": [U1, U2]},
        "queues": {"zen": {"logFile": "/tmp/x.log", "failOpen": False, "daemonIdleExitMs": 5}},
    })
    assert errors == []
    assert cfg.log_file is None and cfg.fail_open is True and cfg.daemon_idle_exit_ms == 0
    a = lq.Addressing(cfg, {})
    assert a.address_endpoint(U1) == (U1, lq.DEFAULT_POLICY)
    assert a.address_endpoint(U2)[0] == U2


# =================================================================================================
# 2. Addressing (pure, table-driven)
# =================================================================================================

# models.json as load_catalog returns it: {provider: baseUrl}.  llama and strata share U1.
CATALOG = {"llama": U1, "strata": U1 + "/", "vllm": U2 + "/", "ollama": "HTTP://127.0.0.1:8003/v1/"}

MERGE_SPLIT = {"merge": {"match": [U1], "maxStreams": 2}, "own": {"match": ["strata"], "maxStreams": 1}}
SPLIT_MERGE = {"own": {"match": ["strata"], "maxStreams": 1}, "merge": {"match": [U1], "maxStreams": 2}}

# (id, queues, key, owning queue, its maxStreams: None is passthrough)
ADDRESS_ROWS: List[Tuple[str, Dict[str, Any], str, str, Optional[int]]] = [
    ("group-name", {"one-gpu": {"match": [U1, U2], "maxStreams": 2}}, "one-gpu", "one-gpu", 2),
    ("member-url-1", {"one-gpu": {"match": [U1, U2], "maxStreams": 2}}, U1, "one-gpu", 2),
    ("member-url-2", {"one-gpu": {"match": [U1, U2], "maxStreams": 2}}, U2, "one-gpu", 2),
    ("member-url-unnormalised", {"one-gpu": {"match": [U1, U2], "maxStreams": 2}}, "HTTP://127.0.0.1:8002/v1/",
     "one-gpu", 2),
    ("member-url-first-group-wins", {"first": {"match": [U1], "maxStreams": 2},
                                     "second": {"match": [U1, U2], "maxStreams": 3}}, U1, "first", 2),
    ("member-url-second-group-for-its-own", {"first": {"match": [U1], "maxStreams": 2},
                                             "second": {"match": [U1, U2], "maxStreams": 3}}, U2, "second", 3),
    ("provider-follows-its-endpoint-into-a-group", {"one-gpu": {"match": [U1], "maxStreams": 2}}, "llama",
     "one-gpu", 2),
    ("split-beats-merge", MERGE_SPLIT, "strata", "own", 1),
    ("split-beats-merge-reversed-order", SPLIT_MERGE, "strata", "own", 1),
    ("merge-keeps-the-other-provider", MERGE_SPLIT, "llama", "merge", 2),
    ("merge-keeps-the-other-provider-reversed", SPLIT_MERGE, "llama", "merge", 2),
    ("merge-keeps-the-raw-url", MERGE_SPLIT, U1, "merge", 2),
    ("merge-keeps-the-raw-url-reversed", SPLIT_MERGE, U1, "merge", 2),
    ("provider-group-does-not-capture-the-raw-url", {"own": {"match": ["strata"], "maxStreams": 3}}, U1, U1, 1),
    ("provider-name-to-its-baseurl-queue", {}, "llama", U1, 1),
    ("provider-name-baseurl-trailing-slash", {}, "vllm", U2, 1),
    ("provider-name-baseurl-case", {}, "ollama", U3, 1),
    ("provider-key-policy-governs-its-endpoint", {"llama": {"maxStreams": 3}}, U1, U1, 3),
    ("provider-key-policy-for-the-provider", {"llama": {"maxStreams": 3}}, "llama", U1, 3),
    ("provider-key-policy-for-a-sibling-provider", {"llama": {"maxStreams": 3}}, "strata", U1, 3),
    ("baseurl-key-beats-provider-key", {U1: {"maxStreams": 2}, "llama": {"maxStreams": 5}}, "llama", U1, 2),
    ("baseurl-key-beats-provider-key-reversed", {"llama": {"maxStreams": 5}, U1: {"maxStreams": 2}}, "llama", U1, 2),
    ("baseurl-key-governs-the-url", {"llama": {"maxStreams": 5}, U1: {"maxStreams": 2}}, U1, U1, 2),
    ("disabled-endpoint-disables-its-providers", {U1: {"enabled": False}, "llama": {"maxStreams": 1}}, "llama",
     U1, None),
    ("disabled-endpoint-disables-its-providers-reversed", {"llama": {"maxStreams": 1}, U1: {"enabled": False}},
     "llama", U1, None),
    ("disabled-endpoint-disables-other-providers", {U1: {"enabled": False}, "llama": {"maxStreams": 1}}, "strata",
     U1, None),
    ("disabled-endpoint-is-passthrough", {U1: {"enabled": False}, "llama": {"maxStreams": 1}}, U1, U1, None),
    ("disabled-provider-does-not-disable-an-enabled-endpoint", {U1: {"maxStreams": 2}, "llama": {"enabled": False}},
     "llama", U1, 2),
    ("disabled-provider-does-not-disable-an-enabled-endpoint-reversed",
     {"llama": {"enabled": False}, U1: {"maxStreams": 2}}, "llama", U1, 2),
    ("disabled-provider-leaves-the-url-queued", {U1: {"maxStreams": 2}, "llama": {"enabled": False}}, U1, U1, 2),
    ("disabled-provider-alone-is-passthrough", {"llama": {"enabled": False}}, "llama", U1, None),
    ("disabled-group-does-not-rekey-members", {"g": {"match": [U1], "enabled": False}, U1: {"maxStreams": 2}},
     U1, U1, 2),
    ("disabled-group-does-not-rekey-providers", {"g": {"match": ["llama"], "enabled": False}}, "llama", U1, 1),
    ("disabled-group-name-is-passthrough", {"g": {"match": [U1], "enabled": False}}, "g", "g", None),
    ("disabled-group-lets-the-next-group-take-its-member", {"off": {"match": [U1], "enabled": False},
                                                            "on": {"match": [U1], "maxStreams": 2}}, U1, "on", 2),
    ("unknown-name-is-its-own-queue", {}, "nobody", "nobody", 1),
    ("unknown-url-is-its-own-queue", {}, "http://10.0.0.9:9/v1", "http://10.0.0.9:9/v1", 1),
    ("named-entry-without-catalog", {"zen": {"maxStreams": 3}}, "zen", "zen", 3),
    ("url-entry-matches-normalised", {"HTTP://GPU.local:80/v1/": {"maxStreams": 4}}, "http://gpu.local/v1",
     "http://gpu.local/v1", 4),
    ("url-path-keeps-its-case", {"http://gpu.local/v1": {"maxStreams": 4}}, "http://gpu.local/V1",
     "http://gpu.local/V1", 1),
    ("group-member-normalised", {"g": {"match": ["HTTPS://Gpu.Local:443/v1//"], "maxStreams": 2}},
     "https://gpu.local/v1", "g", 2),
]


@pytest.mark.parametrize("queues,key,owner,max_streams",
                         [pytest.param(q, k, o, m, id=i) for i, q, k, o, m in ADDRESS_ROWS])
def test_address_endpoint_resolves_each_key_to_its_owning_queue(queues: Dict[str, Any], key: str, owner: str,
                                                                max_streams: Optional[int]) -> None:
    cfg, errors, _ = lq.validate_config({"queues": queues})
    assert errors == []
    got_owner, policy = lq.Addressing(cfg, CATALOG).address_endpoint(key)
    assert (got_owner, policy.max_streams) == (owner, max_streams)


# (id, queues, provider, baseUrl, owning queue)
MODEL_ROWS: List[Tuple[str, Dict[str, Any], Optional[str], Optional[str], str]] = [
    ("split-provider", MERGE_SPLIT, "strata", U1, "own"),
    ("split-provider-reversed", SPLIT_MERGE, "strata", U1, "own"),
    ("merged-provider", MERGE_SPLIT, "llama", U1, "merge"),
    ("merged-provider-reversed", SPLIT_MERGE, "llama", U1, "merge"),
    ("provider-via-catalog", MERGE_SPLIT, "llama", None, "merge"),
    ("ungrouped-endpoint", {}, "llama", U1 + "/", U1),
    ("disabled-group", {"g": {"match": ["llama"], "enabled": False}}, "llama", U1, U1),
]


@pytest.mark.parametrize("queues,provider,base_url,owner",
                         [pytest.param(q, p, b, o, id=i) for i, q, p, b, o in MODEL_ROWS])
def test_address_model_puts_a_provider_in_its_exact_group_before_its_endpoints(
        queues: Dict[str, Any], provider: Optional[str], base_url: Optional[str], owner: str) -> None:
    cfg, errors, _ = lq.validate_config({"queues": queues})
    assert errors == []
    assert lq.Addressing(cfg, CATALOG).address_model(provider, base_url) == owner


NORMALISE_ROWS = [
    ("http://h:8001/v1/", "http://h:8001/v1"),
    ("http://h:8001/v1///", "http://h:8001/v1"),
    ("http://h:8001/", "http://h:8001/v1"),
    ("http://h:8001", "http://h:8001/v1"),
    ("http://h:8001/v1/?x=1", "http://h:8001/v1?x=1"),
    ("http://h:8001/openai", "http://h:8001/openai/v1"),
    ("HTTP://Gpu.Example:8001/v1", "http://gpu.example:8001/v1"),
    ("http://h:80/v1", "http://h/v1"),
    ("https://h:443/v1", "https://h/v1"),
    ("http://h:443/v1", "http://h:443/v1"),
    ("https://h:80/v1", "https://h:80/v1"),
    ("http://h/V1/Chat", "http://h/V1/Chat/v1"),
    ("http://127.0.0.1:8001/v1", "http://127.0.0.1:8001/v1"),
]


@pytest.mark.parametrize("url,normal", NORMALISE_ROWS)
def test_urls_are_normalised_as_the_readme_states(url: str, normal: str) -> None:
    """Trailing slashes dropped, scheme and host lower-cased, default port dropped, path case kept,
    and a server's root and its ``/v1`` base URL one key (issue 34: one server, one queue)."""
    assert lq.normalize_url(url) == normal


@pytest.mark.parametrize("content", [
    pytest.param(None, id="missing"),
    pytest.param("", id="empty-file"),
    pytest.param('{"providers": {"llama": {"baseUrl": "', id="invalid-json"),
    pytest.param("[1, 2]", id="not-an-object"),
    pytest.param('{"providers": ["llama"]}', id="providers-not-an-object"),
    pytest.param('{"providers": {"llama": "http://x/v1"}}', id="provider-not-an-object"),
    pytest.param('{"providers": {"llama": {"baseUrl": 5}}}', id="baseurl-not-a-string"),
    pytest.param('{"other": 1}', id="no-providers"),
])
def test_a_missing_or_broken_models_json_is_an_empty_catalog(tmp_path: Any, content: Optional[str]) -> None:
    path = str(tmp_path / "models.json")
    if content is not None:
        with open(path, "w") as f:
            f.write(content)
    catalog = lq.load_catalog(path)
    assert catalog == {}
    assert lq.Addressing(lq.Config(), catalog).address_endpoint("llama")[0] == "llama"


def test_load_catalog_keeps_the_good_providers_of_a_partly_bad_file(tmp_path: Any) -> None:
    path = str(tmp_path / "models.json")
    write_json(path, {"providers": {"llama": {"baseUrl": U1, "models": []}, "bad": 3, "nourl": {"models": []}}})
    assert lq.load_catalog(path) == {"llama": U1}


def test_load_config_missing_file_is_all_defaults_and_torn_file_is_not_an_error_list(tmp_path: Any) -> None:
    missing = lq.load_config(str(tmp_path / "nope.json"))
    assert (missing.state, missing.config, tuple(missing.errors)) == ("missing", lq.Config(), ())
    torn_path = str(tmp_path / "torn.json")
    with open(torn_path, "w") as f:
        f.write('{"queues": {"zen": {"maxStr')
    assert lq.load_config(torn_path).state == "torn"


# =================================================================================================
# 3. Groups, split, passthrough, provider names through a real daemon
# =================================================================================================


def test_socket_a_group_merges_its_member_urls_into_one_slot_and_replies_echo_the_member_key() -> None:
    with daemon(conf(queues={"one-gpu": {"match": [U1, U2], "maxStreams": 1}})) as d:
        a = acquire(d, U1, "A")
        expect_grant(a, U1, "A")
        b = acquire(d, U2, "B")
        assert b.silent(0.2)
        keys = [q["queueKey"] for q in d.status()]
        assert "one-gpu" in keys and U1 not in keys and U2 not in keys, keys
        q = queue_of(d, "one-gpu")
        assert q is not None and q["maxStreams"] == 1
        assert sessions(q["holders"]) == ["A"] and sessions(q["waiting"]) == ["B"]
        release(a, U1, "A")
        expect_grant(b, U2, "B")


@pytest.mark.parametrize("queues", [pytest.param(MERGE_SPLIT, id="merge-first"),
                                    pytest.param(SPLIT_MERGE, id="split-first"),
                                    pytest.param({"own": {"match": ["strata"]}}, id="split-only")])
def test_socket_a_group_naming_one_provider_of_a_shared_endpoint_splits_it_off(queues: Dict[str, Any]) -> None:
    models = {"providers": {"llama": {"baseUrl": U1, "models": []}, "strata": {"baseUrl": U1 + "/", "models": []}}}
    other = "merge" if "merge" in queues else U1
    with daemon(conf(queues=queues), models=models) as d:
        s = acquire(d, "strata", "S")
        expect_grant(s, "strata", "S")
        lp = acquire(d, "llama", "L")
        expect_grant(lp, "llama", "L")  # a separate slot set: not queued behind S
        own, rest = queue_of(d, "own"), queue_of(d, other)
        assert own is not None and sessions(own["holders"]) == ["S"]
        assert rest is not None and sessions(rest["holders"]) == ["L"]


def test_socket_an_enabled_false_queue_is_passthrough() -> None:
    """Every acquire is granted at once and status reports maxStreams null."""
    with daemon(conf(queues={U1: {"enabled": False, "maxStreams": 1}})) as d:
        peers = [acquire(d, U1, f"S{i}") for i in range(4)]
        for i, p in enumerate(peers):
            expect_grant(p, U1, f"S{i}", timeout=2)
        q = queue_of(d, U1)
        assert q is not None and q["maxStreams"] is None
        assert sessions(q["holders"]) == ["S0", "S1", "S2", "S3"] and q["waiting"] == []


def test_socket_a_provider_name_queues_on_its_baseurl_through_models_json() -> None:
    models = {"providers": {"llama": {"baseUrl": U1 + "/", "models": []}}}
    with daemon(conf(queues={U1: {"maxStreams": 1}}), models=models) as d:
        a = acquire(d, "llama", "A")
        expect_grant(a, "llama", "A")
        b = acquire(d, U1, "B")
        assert b.silent(0.2)
        q = queue_of(d, U1)
        assert q is not None and sessions(q["holders"]) == ["A"] and sessions(q["waiting"]) == ["B"]
        assert queue_of(d, "llama") is None
        release(a, "llama", "A")
        expect_grant(b, U1, "B")


def test_socket_a_broken_models_json_is_an_empty_catalog_not_a_crash() -> None:
    with DaemonProc() as d:
        with open(os.path.join(d.agent_dir, "models.json"), "w") as f:
            f.write('{"providers": {"llama": ')
        d.start()
        a = acquire(d, "llama", "A")
        expect_grant(a, "llama", "A")
        assert queue_of(d, "llama") is not None
        assert d.alive()


# =================================================================================================
# 4. Hot-reload through a real daemon
# =================================================================================================


def test_reload_an_atomic_rename_save_is_picked_up() -> None:
    with daemon(conf(queues={U1: {"maxStreams": 1}})) as d:
        expect_grant(acquire(d, U1, "A"), U1, "A")
        wait_max_streams(d, U1, 1)
        d.write_config(conf(queues={U1: {"maxStreams": 3}}))
        wait_max_streams(d, U1, 3)


def config_errors(d: DaemonProc) -> List[str]:
    with d.peer() as p:
        reply = p.ask({"op": "status"})
    return list(reply.get("configErrors") or [])


def test_reload_a_file_of_bad_json_keeps_the_last_good_config_and_says_so_once_on_stderr_and_in_status() -> None:
    """Issue 34: a trailing comma must not look as if it took effect.  The spec's rule stays: the
    last good config keeps serving.  The file is read once it has settled (the debounce), so the
    bad JSON is the file as saved: it is said once, and ``status`` carries it until a good save."""
    with daemon(conf(queues={U1: {"maxStreams": 2}})) as d:
        expect_grant(acquire(d, U1, "A"), U1, "A")
        assert config_errors(d) == []
        with open(d.config_path, "w") as f:  # an in-place, non-atomic save caught half way
            f.write('{"defaults": {"daemonIdleExitMs": 1000000000}, "queues": {"' + U1 + '": {"maxStr')
        wait_for(lambda: "not valid JSON" in d.stderr(), RELOAD_S)
        errors = wait_for(lambda: config_errors(d), RELOAD_S)
        assert any("not valid JSON" in e and d.config_path in e for e in errors), errors
        assert any("keeping the last good config" in e for e in errors), errors
        q = queue_of(d, U1)
        assert q is not None and q["maxStreams"] == 2
        expect_grant(acquire(d, U1, "B"), U1, "B")  # the second slot of the last good config
        time.sleep(SETTLE_S)
        assert d.stderr().count("not valid JSON") == 1  # once, not every poll
        d.write_config(conf(queues={U1: {"maxStreams": 4}}))  # and the watch still works afterwards
        wait_max_streams(d, U1, 4)
        assert config_errors(d) == []


def test_startup_with_a_file_of_bad_json_serves_defaults_and_says_so_in_status() -> None:
    with DaemonProc() as d:
        with open(d.config_path, "w") as f:
            f.write('{"defaults": {"maxStreams": 2,}}')  # a trailing comma
        d.start()
        # The socket listens a moment before the first config read: wait for the line.
        wait_for(lambda: "not valid JSON" in d.stderr(), RELOAD_S)
        assert any("serving with defaults" in e for e in config_errors(d))


def test_reload_a_config_with_errors_is_reported_by_path_on_stderr_and_the_last_good_config_stays() -> None:
    with daemon(conf(queues={U1: {"maxStreams": 2}, "zen": {"maxStreams": 2}})) as d:
        expect_grant(acquire(d, U1, "A"), U1, "A")
        bad = conf(defaults={"leaseTtlMs": 999}, queues={U1: {"maxStreams": 5}, "zen": {"maxStreams": 0}})
        d.write_config(bad)
        wait_for(lambda: "queues.zen.maxStreams must be a positive integer (got 0)" in d.stderr(), RELOAD_S)
        wait_for(lambda: mentions_path(d.stderr(), "defaults.leaseTtlMs"), RELOAD_S)
        q = queue_of(d, U1)
        assert q is not None and q["maxStreams"] == 2
        expect_grant(acquire(d, U1, "B"), U1, "B")
        c = acquire(d, U1, "C")
        assert c.silent(0.2)  # still 2 slots, not the rejected 5
        assert d.alive()


def test_startup_without_a_config_file_is_all_defaults_silently() -> None:
    with DaemonProc(inject_idle_exit=False) as d:
        assert not os.path.exists(d.config_path)
        d.start()
        a = acquire(d, U1, "A")
        expect_grant(a, U1, "A")
        b = acquire(d, U1, "B")
        assert b.silent(0.2)
        q = queue_of(d, U1)
        assert q is not None and q["maxStreams"] == 1 and q["holders"][0]["sessionKey"] == "A"
        assert d.complaints() == ""


def test_startup_with_errors_prints_them_on_stderr_and_serves_with_defaults() -> None:
    bad = conf(defaults={"maxStreams": 3, "idleYieldMs": -1}, queues={"zen": {"policy": "lifo"}})
    with daemon(bad) as d:
        wait_for(lambda: mentions_path(d.stderr(), "defaults.idleYieldMs"), RELOAD_S)
        assert mentions_path(d.stderr(), "queues.zen.policy")
        a = acquire(d, U1, "A")
        a_reply = a.recv(2)
        assert a_reply["op"] == "granted" and a_reply["leaseTtlMs"] == 30000 and a_reply["idleYieldMs"] == 30000
        b = acquire(d, U1, "B")
        assert b.silent(0.2)  # defaults: one slot, not the rejected config's 3
        q = queue_of(d, U1)
        assert q is not None and q["maxStreams"] == 1


def test_reload_a_widened_max_streams_grants_the_waiters_at_once() -> None:
    with daemon(conf(queues={U1: {"maxStreams": 1}})) as d:
        expect_grant(acquire(d, U1, "A"), U1, "A")
        b, c = acquire(d, U1, "B"), acquire(d, U1, "C")
        assert b.silent(0.1) and c.silent(0.1)
        d.write_config(conf(queues={U1: {"maxStreams": 3}}))
        expect_grant(b, U1, "B")
        expect_grant(c, U1, "C")
        q = queue_of(d, U1)
        assert q is not None and sessions(q["holders"]) == ["A", "B", "C"] and q["waiting"] == []


def test_reload_a_lowered_max_streams_never_preempts_and_logs_over_capacity(tmp_path: Any) -> None:
    log = str(tmp_path / "events.log")
    with daemon(conf(defaults={"logFile": log}, queues={U1: {"maxStreams": 2}})) as d:
        a, b = acquire(d, U1, "A"), acquire(d, U1, "B")
        expect_grant(a, U1, "A")
        expect_grant(b, U1, "B")
        c = acquire(d, U1, "C")
        assert c.silent(0.1)
        d.write_config(conf(defaults={"logFile": log}, queues={U1: {"maxStreams": 1}}))
        wait_max_streams(d, U1, 1)
        q = queue_of(d, U1)
        assert q is not None and sessions(q["holders"]) == ["A", "B"] and sessions(q["waiting"]) == ["C"]
        lines = wait_log(log, lambda ls: has(ls, event="config"))
        config_lines = [line for line in lines if line["event"] == "config"]
        assert len(config_lines) == 1, config_lines
        assert config_lines[0]["queueKey"] == U1 and config_lines[0]["reason"] == "over-capacity"
        assert config_lines[0]["holders"] == 2 and config_lines[0]["maxStreams"] == 1
        assert ISO_MS_UTC.match(config_lines[0]["ts"]), config_lines[0]
        release(a, U1, "A")
        assert c.silent(0.3)  # 1 holder of 1: still no room
        q = queue_of(d, U1)
        assert q is not None and sessions(q["holders"]) == ["B"] and sessions(q["waiting"]) == ["C"]
        release(b, U1, "B")
        expect_grant(c, U1, "C")


def test_reload_merging_two_held_one_slot_endpoints_into_a_one_slot_group_never_preempts(tmp_path: Any) -> None:
    log = str(tmp_path / "events.log")
    with daemon(conf(defaults={"logFile": log})) as d:
        a, b = acquire(d, U1, "A"), acquire(d, U2, "B")
        expect_grant(a, U1, "A")
        expect_grant(b, U2, "B")
        d.write_config(conf(defaults={"logFile": log}, queues={"one-gpu": {"match": [U1, U2], "maxStreams": 1}}))
        wait_for(lambda: queue_of(d, "one-gpu") is not None, RELOAD_S)
        keys = [q["queueKey"] for q in d.status()]
        assert U1 not in keys and U2 not in keys, keys  # never two slot sets for one endpoint
        g = queue_of(d, "one-gpu")
        assert g is not None and g["maxStreams"] == 1 and sessions(g["holders"]) == ["A", "B"]
        lines = wait_log(log, lambda ls: has(ls, event="config"))
        assert has(lines, event="config", queueKey="one-gpu", reason="over-capacity", holders=2, maxStreams=1), lines
        c = acquire(d, U1, "C")
        assert c.silent(0.2)
        release(a, U1, "A")
        assert c.silent(0.3)
        release(b, U2, "B")
        expect_grant(c, U1, "C")


def test_reload_holders_and_waiters_move_with_their_queue_on_a_regroup() -> None:
    with daemon(conf(queues={U1: {"maxStreams": 1}, U2: {"maxStreams": 1}})) as d:
        a, b = acquire(d, U1, "A"), acquire(d, U2, "B")
        expect_grant(a, U1, "A")
        expect_grant(b, U2, "B")
        w, x = acquire(d, U1, "W", role="child"), acquire(d, U2, "X")
        assert w.silent(0.1) and x.silent(0.1)
        d.write_config(conf(queues={"one-gpu": {"match": [U1, U2], "maxStreams": 2}}))
        wait_for(lambda: queue_of(d, "one-gpu") is not None, RELOAD_S)
        keys = [q["queueKey"] for q in d.status()]
        assert U1 not in keys and U2 not in keys, keys
        g = queue_of(d, "one-gpu")
        assert g is not None and sessions(g["holders"]) == ["A", "B"] and sessions(g["waiting"]) == ["W", "X"]
        assert [h["role"] for h in g["waiting"]] == ["child", "parent"]
        d.write_config(conf(queues={U1: {"maxStreams": 1}, U2: {"maxStreams": 1}}))  # and back again
        wait_for(lambda: queue_of(d, U1) is not None and queue_of(d, U2) is not None, RELOAD_S)
        old = queue_of(d, "one-gpu")  # an empty queue may linger; nobody holds or waits there
        assert old is None or (old["holders"] == [] and old["waiting"] == []), old
        q1, q2 = queue_of(d, U1), queue_of(d, U2)
        assert q1 is not None and sessions(q1["holders"]) == ["A"] and sessions(q1["waiting"]) == ["W"]
        assert q2 is not None and sessions(q2["holders"]) == ["B"] and sessions(q2["waiting"]) == ["X"]
        release(a, U1, "A")
        expect_grant(w, U1, "W")
        assert x.silent(0.1)


def test_reload_a_changed_models_json_is_picked_up() -> None:
    with daemon(conf(queues={U1: {"maxStreams": 1}}), models={"providers": {}}) as d:
        a = acquire(d, "llama", "A")
        expect_grant(a, "llama", "A")
        assert queue_of(d, "llama") is not None  # unknown provider: a queue of its own
        write_json(os.path.join(d.agent_dir, "models.json"), {"providers": {"llama": {"baseUrl": U1, "models": []}}})
        wait_for(lambda: queue_of(d, U1) is not None, RELOAD_S)
        q = queue_of(d, U1)
        assert q is not None and sessions(q["holders"]) == ["A"]  # the holder moved with its endpoint
        assert queue_of(d, "llama") is None
        b = acquire(d, U1, "B")
        assert b.silent(0.2)
        release(a, "llama", "A")
        expect_grant(b, U1, "B")


def test_reload_sighup_reloads_at_once_faster_than_the_poll() -> None:
    """With --sweep-ms 5000 the poll is slow; SIGHUP applies the new config well inside the 250 ms debounce."""
    with daemon(conf(queues={U1: {"maxStreams": 1}}), sweep_ms=5000) as d:
        expect_grant(acquire(d, U1, "A"), U1, "A")
        b = acquire(d, U1, "B")
        assert b.silent(0.1)
        time.sleep(0.05)
        d.write_config(conf(queues={U1: {"maxStreams": 2}}))
        written = time.monotonic()
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        expect_grant(b, U1, "B", timeout=0.2)
        assert time.monotonic() - written < 0.25  # no poll + debounce can be this fast
        assert d.alive()


def test_reload_the_config_directory_removed_is_said_once_and_recovers_when_restored() -> None:
    cfg_dir = short_tmpdir("lqcfg")
    path = os.path.join(cfg_dir, "llm-queue.json")
    try:
        write_json(path, conf(queues={U1: {"maxStreams": 2}}))
        with daemon(None, inject_idle_exit=False, args=("--config", path)) as d:
            a = acquire(d, U1, "A")
            expect_grant(a, U1, "A")
            wait_max_streams(d, U1, 2)
            assert d.complaints() == ""
            shutil.rmtree(cfg_dir)
            wait_for(lambda: cfg_dir in d.stderr(), RELOAD_S)
            time.sleep(SETTLE_S)  # many polls later
            said = [line for line in d.stderr().splitlines() if cfg_dir in line]
            assert len(said) == 1, said
            q = queue_of(d, U1)
            assert q is not None and q["maxStreams"] == 2  # the last good config, not the defaults
            expect_grant(acquire(d, U1, "B"), U1, "B")
            c = acquire(d, U1, "C")
            assert c.silent(0.1)
            os.makedirs(cfg_dir)
            write_json(path, conf(queues={U1: {"maxStreams": 3}}))
            expect_grant(c, U1, "C")
            wait_max_streams(d, U1, 3)
            assert d.alive()
    finally:
        shutil.rmtree(cfg_dir, ignore_errors=True)


# =================================================================================================
# 5. The event log
# =================================================================================================


def test_log_grant_queued_release_switch_lines_with_their_fields_are_appended(tmp_path: Any) -> None:
    """One JSON line per event appended to what is there; role is the waiter's tier while queued, the lease's after."""
    log = str(tmp_path / "events.log")
    with open(log, "w") as f:
        f.write('{"event":"earlier"}\n')
    with daemon(conf(defaults={"logFile": log}, queues={U1: {"maxStreams": 1}})) as d:
        a = acquire(d, U1, "A")
        expect_grant(a, U1, "A")
        a.send({"op": "role", "sessionKey": "A", "role": "child"})  # a holder keeps its tier
        b = acquire(d, U1, "B", role="child")
        assert b.silent(0.1)
        b.send({"op": "role", "sessionKey": "B", "role": "parent"})  # a waiter is re-tiered
        time.sleep(0.05)
        release(a, U1, "A")
        expect_grant(b, U1, "B")
        release(b, U1, "B")
        lines = wait_log(log, lambda ls: sum(line.get("event") == "release" for line in ls) == 2)
    assert lines[0] == {"event": "earlier"}
    events = lines[1:]
    seen = [(e["event"], e.get("sessionKey"), e.get("role")) for e in events]
    assert [s for s in seen if s[0] != "switch"] == [
        ("grant", "A", "parent"), ("queued", "B", "child"), ("release", "A", "parent"),
        ("grant", "B", "parent"), ("release", "B", "parent")]
    assert [s for s in seen if s[0] == "switch"] == [("switch", "B", "parent")]
    switch_at = seen.index(("switch", "B", "parent"))
    assert seen.index(("release", "A", "parent")) < switch_at < len(seen) - 1
    now = datetime.datetime.now(datetime.timezone.utc)
    for e in events:
        assert e["queueKey"] == U1, e
        assert ISO_MS_UTC.match(e["ts"]), e
        ts = datetime.datetime.strptime(e["ts"][:23], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
        assert abs((now - ts).total_seconds()) < 60, e


def test_log_queue_key_is_the_owning_group_when_a_member_key_was_used(tmp_path: Any) -> None:
    log = str(tmp_path / "events.log")
    with daemon(conf(defaults={"logFile": log}, queues={"one-gpu": {"match": [U1, U2], "maxStreams": 1}})) as d:
        a = acquire(d, U1, "A")
        expect_grant(a, U1, "A")
        b = acquire(d, U2, "B")
        assert b.silent(0.1)
        release(a, U1, "A")
        expect_grant(b, U2, "B")
        lines = wait_log(log, lambda ls: has(ls, event="switch"))
    assert {line["event"] for line in lines} == {"grant", "queued", "release", "switch"}
    assert all(line["queueKey"] == "one-gpu" for line in lines), lines


def test_log_an_idle_yield_is_a_release_with_reason_idle(tmp_path: Any) -> None:
    log = str(tmp_path / "events.log")
    with daemon(conf(defaults={"logFile": log}, queues={U1: {"idleYieldMs": 150}})) as d:
        a = acquire(d, U1, "A", activity=True)
        expect_grant(a, U1, "A")
        b = acquire(d, U1, "B", role="child")
        expect_grant(b, U1, "B")  # A went quiet past its window with B waiting
        lines = wait_log(log, lambda ls: has(ls, event="grant", sessionKey="B"))
    assert has(lines, event="release", reason="idle", queueKey=U1, sessionKey="A", role="parent"), lines
    assert has(lines, event="switch", queueKey=U1, sessionKey="B", role="child"), lines


def test_log_a_ttl_lapse_is_an_evict_with_reason_ttl(tmp_path: Any) -> None:
    log = str(tmp_path / "events.log")
    with daemon(conf(defaults={"logFile": log}, queues={U1: {"leaseTtlMs": 1000}})) as d:
        a = acquire(d, U1, "A", role="child")
        expect_grant(a, U1, "A")  # and never renews: the socket stays open, the lease lapses
        lines = wait_log(log, lambda ls: has(ls, event="evict"))
        assert has(lines, event="evict", reason="ttl", queueKey=U1, sessionKey="A", role="child"), lines
        q = queue_of(d, U1)
        assert q is not None and q["holders"] == []


def test_log_the_path_is_reread_per_event_so_a_reload_turns_it_on_moves_it_and_turns_it_off(tmp_path: Any) -> None:
    first, second = str(tmp_path / "first.log"), str(tmp_path / "second.log")
    with daemon(conf(queues={U1: {"maxStreams": 10}})) as d:
        expect_grant(acquire(d, U1, "A"), U1, "A")
        d.write_config(conf(defaults={"logFile": first}, queues={U1: {"maxStreams": 11}}))
        wait_max_streams(d, U1, 11)
        expect_grant(acquire(d, U1, "B"), U1, "B")
        wait_log(first, lambda ls: has(ls, event="grant", sessionKey="B"))
        d.write_config(conf(defaults={"logFile": second}, queues={U1: {"maxStreams": 12}}))
        wait_max_streams(d, U1, 12)
        expect_grant(acquire(d, U1, "C"), U1, "C")
        wait_log(second, lambda ls: has(ls, event="grant", sessionKey="C"))
        d.write_config(conf(queues={U1: {"maxStreams": 13}}))
        wait_max_streams(d, U1, 13)
        expect_grant(acquire(d, U1, "D"), U1, "D")
        time.sleep(0.2)
    assert [line["sessionKey"] for line in log_lines(first)] == ["B"]
    assert [line["sessionKey"] for line in log_lines(second)] == ["C"]


def _not_a_file_path(tmp_path: Any, kind: str) -> str:
    if kind == "dev-full":
        return "/dev/full"
    if kind == "missing-dir":
        return str(tmp_path / "no" / "such" / "dir" / "events.log")
    if kind == "a-directory":
        os.makedirs(str(tmp_path / "isadir"))
        return str(tmp_path / "isadir")
    with open(str(tmp_path / "plainfile"), "w") as f:  # "under-a-file": ENOTDIR, even for root
        f.write("x")
    return str(tmp_path / "plainfile" / "events.log")


@pytest.mark.parametrize("kind", ["dev-full", "missing-dir", "a-directory", "under-a-file"])
def test_log_write_failures_are_swallowed_and_the_daemon_keeps_serving(tmp_path: Any, kind: str) -> None:
    if kind == "dev-full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    log = _not_a_file_path(tmp_path, kind)
    with daemon(conf(defaults={"logFile": log}, queues={U1: {"maxStreams": 1}})) as d:
        a = acquire(d, U1, "A")
        expect_grant(a, U1, "A")
        b = acquire(d, U1, "B")
        assert b.silent(0.1)
        release(a, U1, "A")
        expect_grant(b, U1, "B")
        a.send({"op": "renew"})
        assert a.recv(2) == {"op": "ok"}
        q = queue_of(d, U1)
        assert q is not None and sessions(q["holders"]) == ["B"]
        assert d.alive()


# =================================================================================================
# 6. check-config
# =================================================================================================


def check_config(tmp_path: Any, config: Optional[Any], models: Optional[Dict[str, Any]] = None,
                 raw_text: Optional[str] = None) -> "subprocess.CompletedProcess[str]":
    path = str(tmp_path / "llm-queue.json")
    if raw_text is not None:
        with open(path, "w") as f:
            f.write(raw_text)
    elif config is not None:
        write_json(path, config)
    argv = [sys.executable, MODULE, "check-config", "--config", path]
    if models is not None:
        mpath = str(tmp_path / "models.json")
        write_json(mpath, models)
        argv += ["--models-json", mpath]
    env = dict(os.environ, PI_CODING_AGENT_DIR=str(tmp_path / "agent"))  # never the user's own catalog
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20, env=env)


def _resolution_line(out: str, key: str, owner: str) -> bool:
    """Some line names ``key`` and, after it, the queue ``owner`` it resolves to."""
    for line in out.splitlines():
        i = line.find(key)
        if i >= 0 and owner in line[i + len(key):]:
            return True
    return False


def test_check_config_a_good_file_exits_0_and_shows_where_each_key_queues(tmp_path: Any) -> None:
    models = {"providers": {"llama": {"baseUrl": U3 + "/", "models": []}}}
    config = {"queues": {U1: {"maxStreams": 2}, "llama": {"maxStreams": 1}, "shared-gpu": {"match": [U2]},
                         U2: {"maxStreams": 4}, "solo-name": {"maxStreams": 1}}}
    r = check_config(tmp_path, config, models)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert _resolution_line(out, U1, U1), out
    assert _resolution_line(out, "llama", U3), out  # a provider name through --models-json
    assert _resolution_line(out, U2, "shared-gpu"), out  # a member URL belongs to its group
    assert _resolution_line(out, "shared-gpu", "shared-gpu"), out
    assert _resolution_line(out, "solo-name", "solo-name"), out


def test_check_config_prints_every_error_and_warning_and_exits_non_zero(tmp_path: Any) -> None:
    config = {"defaults": {"maxStreams": 0, "leaseTtlMs": 1, "enabled": False},
              "queues": {"zen": {"maxStreams": 0, "policy": "lifo", "failOpen": True, "colour": "red"}},
              "extra": True}
    r = check_config(tmp_path, config)
    assert r.returncode != 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "queues.zen.maxStreams must be a positive integer (got 0)" in out, out
    for path in ["defaults.maxStreams", "defaults.leaseTtlMs", "queues.zen.policy",  # errors
                 "defaults.enabled", "queues.zen.failOpen", "queues.zen.colour", "extra"]:  # warnings
        assert mentions_path(out, path), (path, out)


def test_check_config_with_warnings_only_exits_0(tmp_path: Any) -> None:
    r = check_config(tmp_path, {"queues": {"zen": {"logFile": "/tmp/x.log"}}})
    assert r.returncode == 0, r.stdout + r.stderr
    assert mentions_path(r.stdout + r.stderr, "queues.zen.logFile"), r.stdout


def test_check_config_a_missing_file_exits_0(tmp_path: Any) -> None:
    r = check_config(tmp_path, None)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("text", [pytest.param('{"queues": {"zen": ', id="invalid-json"),
                                  pytest.param('{"schemaVersion": 2}', id="newer-schema")])
def test_check_config_a_file_that_cannot_be_used_exits_non_zero(tmp_path: Any, text: str) -> None:
    r = check_config(tmp_path, None, raw_text=text)
    assert r.returncode != 0, r.stdout + r.stderr


def test_check_config_also_shows_where_each_models_json_provider_lands(tmp_path: Any) -> None:
    """Providers that no config key names still get a line: the queue they land in (here one
    through the group naming its endpoint, one split off by a group naming it exactly)."""
    models = {"providers": {"llama": {"baseUrl": U1}, "strata": {"baseUrl": U1}, "other": {"baseUrl": U3}}}
    config = {"queues": {"gpu": {"match": [U1]}, "strata-own": {"match": ["strata"]}}}
    r = check_config(tmp_path, config, models)
    assert r.returncode == 0, r.stdout + r.stderr
    providers = r.stdout.split("providers in models.json:", 1)[1]
    assert _resolution_line(providers, "llama", "gpu"), r.stdout
    assert _resolution_line(providers, "strata", "strata-own"), r.stdout
    assert _resolution_line(providers, "other", U3), r.stdout


def test_log_a_waiter_that_leaves_without_a_grant_is_a_dequeue_with_its_reason() -> None:
    """Additive to the spec's vocabulary: a waiter that cancels, or whose connection closes,
    leaves a ``dequeue`` line (reason cancel / disconnect), so a replay of the log can tell a
    waiter that left from one that was lost."""
    log = os.path.join(short_tmpdir(), "events.log")
    for d in started(config={"defaults": {"logFile": log}}):
        holder, w1, w2 = d.peer(), d.peer(), d.peer()
        holder.ask({"op": "acquire", "queueKey": U1, "sessionKey": "H"})
        w1.send({"op": "acquire", "queueKey": U1, "sessionKey": "W1", "role": "child"})
        w2.send({"op": "acquire", "queueKey": U1, "sessionKey": "W2"})
        wait_for(lambda: d.waiting(U1) == ["W1", "W2"])
        w1.send({"op": "cancel", "queueKey": U1, "sessionKey": "W1"})
        w2.close()
        wait_for(lambda: d.waiting(U1) == [])
        lines = wait_for(lambda: [l for l in log_lines(log) if l["event"] == "dequeue"] or None)
        assert [(l["sessionKey"], l["role"], l["reason"], l["queueKey"]) for l in lines] == [
            ("W1", "child", "cancel", U1), ("W2", "parent", "disconnect", U1)]


def test_reload_a_torn_models_json_keeps_the_catalog_in_use() -> None:
    """A half-written models.json must not split an endpoint's queue for a moment: a session
    queued through a provider name keeps sharing the endpoint's slot with raw-URL clients."""
    models = {"providers": {"llama": {"baseUrl": U1}}}
    for d in started(models=models):
        s, t = d.peer(), d.peer()
        s.ask({"op": "acquire", "queueKey": "llama", "sessionKey": "S"})
        with open(os.path.join(d.agent_dir, "models.json"), "w") as f:
            f.write('{"providers": {"lla')  # torn mid-write
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)  # reload now
        time.sleep(0.3)
        t.send({"op": "acquire", "queueKey": U1, "sessionKey": "T"})
        assert t.silent(0.3)  # still one slot set: S holds it
        assert d.holders(U1) == ["S"] and d.waiting(U1) == ["T"]


def test_reload_a_log_file_that_is_a_fifo_never_blocks_the_daemon() -> None:
    fifo = os.path.join(short_tmpdir(), "log.fifo")
    os.mkfifo(fifo)
    for d in started(config={"defaults": {"logFile": fifo}}):
        with d.peer() as p:
            for i in range(3):
                assert p.ask({"op": "acquire", "queueKey": U1, "sessionKey": f"s{i}"}, timeout=3)["op"] == "granted"
                assert p.ask({"op": "release", "queueKey": U1, "sessionKey": f"s{i}"}, timeout=3) == {"op": "ok", "queueKey": U1, "sessionKey": f"s{i}"}


def test_reload_an_edit_that_meets_a_transient_read_error_is_retried() -> None:
    """The file changed, but reading it failed once (e.g. out of descriptors): the next poll
    tries again instead of waiting for another edit."""
    import llmqueue as lq

    d = lq.Daemon(short_tmpdir(), sweep_ms=20, idle_exit_ms=-1)
    original = lq.load_config
    failures = []

    def flaky(path: str) -> Any:
        if not failures:
            failures.append(path)
            return lq.ConfigLoad("unreadable", lq.Config(), (f"{path}: Too many open files",))
        return original(path)

    d.bind()
    t = threading.Thread(target=d.serve_forever, daemon=True)
    t.start()
    try:
        with Peer(d.socket_path) as p:  # serving: the startup load is done
            assert p.ask({"op": "status"})["op"] == "status"
        lq.load_config = flaky  # type: ignore[assignment]
        write_json(d.config_path, {"defaults": {"maxStreams": 3}})
        wait_for(lambda: failures and d.config.defaults.max_streams == 3, timeout=5)
    finally:
        lq.load_config = original  # type: ignore[assignment]
        d.stop()
        t.join(5)
