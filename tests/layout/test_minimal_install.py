"""``pip install ./ninfer-core ./ninfer-qwen3_5`` alone gives a working ``ninfer generate`` (issue 37 item 5): in a
fresh virtual environment without the other distributions, the embedded default model converts and generates. And
``ninfer-qwen4exp`` installs beside them alone (issue 35 item 1): ``ninfer plugins`` lists it.

Slow (a virtual environment with torch; minutes): skipped unless ``NINFER_RUN_SLOW=1``. A local torch wheel in
``NINFER_TORCH_WHEELS`` (a folder, e.g. /opt/wheels) is used when present, else the package index.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _fresh_install(tmp_path: Path, names: tuple[str, ...]) -> Path:
    """A new virtual environment with torch and only the distributions ``names`` installed; its bin folder."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    import torch

    wheels = os.environ.get("NINFER_TORCH_WHEELS")
    torch_req = [f"torch=={torch.__version__.split('+')[0]}"]
    find = ["--find-links", wheels] if wheels else ["--index-url", "https://download.pytorch.org/whl/cpu",
                                                     "--extra-index-url", "https://pypi.org/simple"]
    subprocess.run([py, "-m", "pip", "install", "-q", *find, *torch_req], check=True)
    # Installed from copies: a non-editable build writes build/ into the source folder.
    sources = [shutil.copytree(ROOT / name, tmp_path / "src" / name, ignore=shutil.ignore_patterns("build", "*.egg-info"))
               for name in names]
    subprocess.run([py, "-m", "pip", "install", "-q", *map(str, sources)], check=True)
    return env_dir / "bin"


def _installed(bin_dir: Path) -> str:
    return subprocess.run([bin_dir / "python", "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                          check=True).stdout


def test_core_and_qwen3_5_alone_generate(tmp_path):
    bin_dir = _fresh_install(tmp_path, ("ninfer-core", "ninfer-qwen3_5"))
    listed = _installed(bin_dir)
    assert "ninfer-serve" not in listed and "ninfer-convert" not in listed and "ninfer-qwen4exp" not in listed
    env = dict(os.environ, NINFER_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH="")
    out = subprocess.run([bin_dir / "ninfer", "generate", "-p", "def fibonacci(n):", "-n", "8"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "8 generated tokens" in out.stderr and out.stdout.strip()
    version = subprocess.run([bin_dir / "ninfer", "--version"], capture_output=True, text=True, env=env,
                             check=True).stdout
    assert "ninfer-qwen3_5" in version and "ninfer-serve" not in version


def test_qwen4exp_installs_beside_core_and_is_listed(tmp_path):
    """``pip install ./ninfer-core ./ninfer-qwen3_5 ./ninfer-qwen4exp`` (qwen4exp's one plugin dependency is
    ninfer-qwen3_5, whose GDN, MoE and vision code it shares): ``ninfer plugins`` lists it with both architectures
    and its source mapping."""
    bin_dir = _fresh_install(tmp_path, ("ninfer-core", "ninfer-qwen3_5", "ninfer-qwen4exp"))
    listed = _installed(bin_dir)
    assert "ninfer-qwen4exp" in listed and "ninfer-serve" not in listed and "ninfer-convert" not in listed
    env = dict(os.environ, NINFER_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH="")
    out = subprocess.run([bin_dir / "ninfer", "plugins"], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    assert "ninfer-qwen4exp" in out.stdout and "Qwen4ExpForCausalLM" in out.stdout
    assert "Qwen4ExpForConditionalGeneration" in out.stdout
