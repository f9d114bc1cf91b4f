"""``ninfer --help`` and ``ninfer COMMAND --help`` import no heavy library (torch, the server stack, the hub
client): the plugin modules are loaded and only their ``ninfer_cli_commands`` hooks are called."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from ninfer.plugins import get_registry

# Top-level packages that only running a command may import.
HEAVY = ("torch", "triton", "numpy", "pydantic", "litestar", "huggingface_hub", "tokenizers", "jinja2",
         "safetensors", "xgrammar", "tqdm")


def _imported(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``ninfer ARGS`` under ``-X importtime``; the top-level packages it imported."""
    env = dict(os.environ)
    env.pop("NINFER_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ninfer.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=120)
    modules = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in proc.stderr.splitlines()
               if line.startswith("import time:") and "|" in line}
    return proc, modules


def test_the_import_log_is_read():
    """The parsing above sees the modules a command does import (a vacuous pass would hide a regression)."""
    _, modules = _imported("--help")
    assert {"ninfer", "argparse", "pluggy"} <= modules


def test_top_level_help_imports_nothing_heavy_and_lists_plugin_commands():
    proc, modules = _imported("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
    # serve comes from ninfer-serve's entry point: listed as loaded, not as the "needs ninfer-serve" stub.
    assert "serve a model over HTTP" in proc.stdout and "(needs ninfer-serve)" not in proc.stdout
    for name in get_registry().cli_commands:
        assert name in proc.stdout


@pytest.mark.parametrize("command", sorted(get_registry().cli_commands))
def test_command_help_imports_nothing_heavy(command):
    proc, modules = _imported(command, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: ninfer {command}")
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
