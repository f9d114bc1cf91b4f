"""The import layering of every distribution, checked with import-linter (contracts in ``.importlinter``).

Core layers, lowest first: errors <- contracts, plugins <- storage, ops, artifact <- program, planning,
constrained, conversion <- model_source <- scoring <- engine <- bench <- cli, testing. Core never imports a plugin
distribution, and no package has an import cycle among its sub-packages or modules.
"""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter.cli")

ROOT = Path(__file__).resolve().parents[2]


def test_import_linter_contracts_are_kept():
    # In a subprocess: import-linter configures logging (dictConfig), which would disable the loggers of
    # every module imported so far for the rest of the test run.
    script = ("import sys; from importlinter.cli import lint_imports; "
              f"sys.exit(lint_imports(config_filename={str(ROOT / '.importlinter')!r}, no_cache=True, no_logo=True))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _core_layers() -> set[str]:
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter", encoding="utf-8")
    lines = parser["importlinter:contract:core-layers"]["layers"].split("\n")
    return {name.strip() for line in lines for name in line.split("|") if name.strip()}


def test_the_contracts_cover_every_core_package():
    """A new top-level package or module of ``ninfer`` must be placed in a layer (else nothing checks its imports)."""
    core = ROOT / "ninfer-core" / "src" / "ninfer"
    names = sorted(p.stem for p in core.iterdir()
                   if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__"))
    missing = [name for name in names if name not in _core_layers()]
    assert not missing, f"ninfer.{{{', '.join(missing)}}} in no import-linter layer"


def test_no_core_module_is_over_500_lines():
    """One concept per module: a module past ~500 lines is doing more than one thing."""
    core = ROOT / "ninfer-core" / "src" / "ninfer"
    long = {str(p.relative_to(core)): n for p in core.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert not long, f"ninfer-core modules over 500 lines: {long}"
