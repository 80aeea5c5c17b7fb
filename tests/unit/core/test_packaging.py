"""The install a new user runs first (`pip install -e .`, via scripts/setup_env.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# What `pip install -e .` has setuptools' PEP 660 backend do, without building: load setup.py,
# pick the editable strategy and enter/exit it, recording the warnings it emits. Private
# setuptools API (`editable_wheel._select_strategy`): if setuptools renames it, adapt this probe.
_PROBE = """
import json, warnings
from distutils.core import run_setup
from setuptools.command.editable_wheel import editable_wheel
dist = run_setup("setup.py", stop_after="init")
cmd = editable_wheel(dist)
cmd.ensure_finalized()
strategy = cmd._select_strategy(dist.get_name(), "py3-none-any", "build")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with strategy:
        pass
print(json.dumps({"strategy": type(strategy).__name__,
                  "paths": [str(p) for p in getattr(strategy, "path_entries", [])],
                  "warnings": [str(w.message) for w in caught]}))
"""


def test_the_editable_install_warns_nothing_and_puts_the_repository_root_on_the_path() -> None:
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # before: the meta-path finder, whose exit warns "Please be careful with folders in your
    # working directory with the same name as your package" on every install
    assert got["warnings"] == []
    assert got["strategy"] == "_StaticPth" and [(ROOT / p).resolve() for p in got["paths"]] == [ROOT]
