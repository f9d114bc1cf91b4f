"""Every distribution is fit for a package index (issue 37 item 5): a README shipped as its long description, a
version, a licence, classifiers, and the Python it needs; and its README names only commands that exist."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = ["ninfer-core", "ninfer-qwen3_5", "ninfer-qwen4exp", "ninfer-convert", "ninfer-serve"]


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_metadata_fit_for_an_index(name):
    project = tomllib.loads((ROOT / name / "pyproject.toml").read_text())["project"]
    assert project["name"] == name and project["version"] and project["description"]
    assert project["readme"] == "README.md" and project["license"] == "Apache-2.0"
    assert project["requires-python"].startswith(">=3.11")
    assert any(c.startswith("Development Status") for c in project["classifiers"])
    readme = (ROOT / name / "README.md").read_text()
    assert readme.startswith(f"# {name}\n") and "pip install" in readme
    assert "../" not in readme  # a README on an index cannot follow relative links out of its folder


def test_installed_metadata_carries_the_readme():
    import importlib.metadata as md

    meta = md.metadata("ninfer-core")
    assert meta["Version"] and "ninfer-core" in (meta.get_payload() or meta["Description"] or "")
