"""CLI tests drive ``ninfer`` as a subprocess against the embedded default model.

The default model is converted once per test session into a private cache folder, so the tests never
touch the user's cache and every subprocess finds the converted artifact.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def cli_env(default_model_cache):
    env = dict(os.environ, NINFER_CACHE_DIR=str(default_model_cache), PYTHONUNBUFFERED="1")
    env.pop("NINFER_PLUGINS", None)
    return env


@pytest.fixture
def run_cli(cli_env):
    def run(*args: str, stdin: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ninfer.cli.main", *args], input=stdin, env=cli_env,
                              capture_output=True, text=True, timeout=timeout)

    return run


# The greedy continuation the speculative (MTP, DFlash) and stop-string tests compare with.
PLAIN_ARGS = ("generate", "--prompt", "import os\nimport", "-t", "0", "-n", "32", "--quiet")


@pytest.fixture(scope="session")
def plain_generate(cli_env) -> subprocess.CompletedProcess:
    """``ninfer generate`` of PLAIN_ARGS on the default model, run once per test run (a session-scoped fixture): a DFlash artifact's text part
    is the default model, so its plain output is this one too."""
    run = subprocess.run([sys.executable, "-m", "ninfer.cli.main", *PLAIN_ARGS], env=cli_env, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    return run
