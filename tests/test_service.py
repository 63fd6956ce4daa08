"""``docs/llmqueue-proxy.service``: the systemd user unit that keeps the proxy running.

The file is read as systemd reads it (an INI file with case-sensitive keys and ``%`` specifiers):
it has a ``[Unit]`` with a description and documentation, a ``[Service]`` whose ``ExecStart``
runs ``llmqueue proxy --upstream ...`` by an absolute path and restarts it on failure, and an
``[Install]`` that ``systemctl --user enable`` can act on.  Where ``systemd-analyze`` is
installed, ``systemd-analyze --user verify`` checks a copy whose ``ExecStart`` names this
interpreter and this checkout's ``llmqueue.py`` (the command the unit names exists only after an
install): it must exit 0 and say nothing of the unit.
"""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import MODULE, ROOT

UNIT = os.path.join(ROOT, "docs", "llmqueue-proxy.service")
INSTALLED = "%h/.local/bin/llmqueue"  # where pipx puts the command; the unit's ExecStart starts so


class _Unit(configparser.ConfigParser):
    def optionxform(self, optionstr: str) -> str:
        return optionstr  # systemd's keys keep their case


def read_unit(path: str) -> configparser.ConfigParser:
    unit = _Unit(strict=False, interpolation=None, empty_lines_in_values=False)
    with open(path) as f:
        unit.read_file(f)
    return unit


def test_the_unit_runs_the_proxy_restarts_it_and_installs_for_the_user() -> None:
    unit = read_unit(UNIT)
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    assert unit["Unit"].get("Description")
    assert unit["Unit"].get("Documentation", "").split(":", 1)[0] in ("file", "http", "https", "man", "info")
    exec_start = unit["Service"]["ExecStart"]
    assert "llmqueue proxy --upstream" in exec_start
    argv = shlex.split(exec_start)
    assert argv[0] == INSTALLED  # absolute, as systemd requires (%h: the home directory)
    assert argv[1] == "proxy"
    assert argv[argv.index("--upstream") + 1] == "http://127.0.0.1:8080"
    assert argv[argv.index("--log") + 1] == "%h/.local/state/llmqueue/llmqueue.log"
    assert unit["Service"]["Restart"] == "on-failure"
    assert unit["Install"]["WantedBy"] == "default.target"  # a user unit: no multi-user.target


def test_the_readme_says_how_to_install_it() -> None:
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "docs/llmqueue-proxy.service" in readme
    assert "systemctl --user enable --now llmqueue-proxy" in readme


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: the unit file is checked by parsing only")
    with open(UNIT) as f:
        text = f.read()
    assert text.count(INSTALLED) >= 1
    # The unit names the installed command; verify checks that ExecStart's program exists, so the
    # copy runs this checkout's module with this interpreter instead, with the same arguments.
    copy = tmp_path / "llmqueue-proxy.service"
    copy.write_text(text.replace("ExecStart=" + INSTALLED, f"ExecStart={sys.executable} {MODULE}"))
    runtime = tmp_path / "runtime"  # --user needs a runtime dir; a test may run outside a session
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
    done = subprocess.run([analyze, "--user", "verify", str(copy)], env=env, capture_output=True,
                          text=True, timeout=120)
    said = [line for line in (done.stdout + done.stderr).splitlines() if copy.name in line]
    assert done.returncode == 0, done.stdout + done.stderr
    assert said == [], said  # a warning (an unknown key, a bad value) names the unit: none
