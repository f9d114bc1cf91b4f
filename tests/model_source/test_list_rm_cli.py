"""``ninfer list`` and ``ninfer rm`` as a user runs them: subprocesses over a private cache."""

from __future__ import annotations

import json

import pytest

from .conftest import copy_artifact

NAME = "qwen3_5-stdlib"


def test_list_of_an_empty_cache_says_so(run_ninfer):
    out = run_ninfer("list")
    assert out.returncode == 0, out.stderr
    assert f"no converted models in {run_ninfer.cache / 'artifacts'}" in out.stdout
    out = run_ninfer("list", "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == []


def test_list_shows_recorded_names_sizes_and_files(run_ninfer, default_artifact):
    copy_artifact(default_artifact, run_ninfer.cache, f"{NAME}-0123456789abcdef0123.ninfer")
    (run_ninfer.cache / "artifacts" / "broken-ffff.ninfer").write_bytes(b"not an artifact")
    (run_ninfer.cache / "artifacts" / f".{NAME}-x.ninfer.123.tmp").write_bytes(b"in progress")
    out = run_ninfer("list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "MODIFIED", "FILE"]
    assert lines[1].startswith(NAME) and "MiB" in lines[1] and lines[1].endswith("-0123456789abcdef0123.ninfer")
    assert "unreadable" in lines[2] and lines[2].endswith("broken-ffff.ninfer")
    assert len(lines) == 3  # the hidden in-progress file is not listed
    rows = json.loads(run_ninfer("list", "--json").stdout)
    assert [r["name"] for r in rows] == [NAME, None]
    assert rows[0]["bytes"] == default_artifact.stat().st_size and rows[1]["problem"]


def test_rm_by_file_name_then_by_model_name(run_ninfer, default_artifact):
    first = copy_artifact(default_artifact, run_ninfer.cache, f"{NAME}-00000000000000000001.ninfer")
    second = copy_artifact(default_artifact, run_ninfer.cache, f"{NAME}-00000000000000000002.ninfer")
    other = copy_artifact(default_artifact, run_ninfer.cache, "other-3.ninfer")
    out = run_ninfer("rm", first.name)
    assert out.returncode == 0, out.stderr
    assert not first.exists() and second.exists() and f"removed {NAME} ({first.name}" in out.stdout
    out = run_ninfer("rm", NAME)  # every artifact recording the name: the renamed copy records it too
    assert out.returncode == 0, out.stderr
    assert not second.exists() and not other.exists()
    assert out.stdout.count("removed") == 2


def test_rm_unknown_name_removes_nothing_and_lists_what_exists(run_ninfer, default_artifact):
    kept = copy_artifact(default_artifact, run_ninfer.cache, f"{NAME}-00000000000000000001.ninfer")
    out = run_ninfer("rm", NAME, "acme/nope")
    assert out.returncode == 2
    assert "'acme/nope'" in out.stderr and f"it holds: {NAME}" in out.stderr and "nothing was removed" in out.stderr
    assert kept.exists()
    assert run_ninfer("rm", "x").returncode == 2  # an empty cache too
    assert run_ninfer("rm").returncode == 2  # NAME is required


def test_rm_never_touches_files_outside_the_artifacts_folder(run_ninfer, default_artifact, tmp_path):
    outside = copy_artifact(default_artifact, tmp_path, "outside.ninfer")
    (run_ninfer.cache / "artifacts").mkdir(parents=True)
    link = run_ninfer.cache / "artifacts" / "linked.ninfer"
    link.symlink_to(outside)
    out = run_ninfer("rm", "linked.ninfer")
    assert out.returncode == 0, out.stderr
    assert not link.is_symlink() and outside.exists()  # the link went, not its target
    out = run_ninfer("rm", str(outside))
    assert out.returncode == 2 and outside.exists()


def test_broken_links_and_stray_folders_are_listed_and_removable(run_ninfer, default_artifact):
    """A dangling part link, a folder named like a part, a dangling entry link: ``list`` shows the entries (the
    broken ones unreadable) instead of failing, and ``rm`` removes them without touching the folder."""
    arts = run_ninfer.cache / "artifacts"
    copy_artifact(default_artifact, run_ninfer.cache, f"{NAME}-00000000000000000001.ninfer")
    (arts / "junk-4444.ninfer").write_bytes(b"junk")
    (arts / "junk-4444.ninfer.part-0001").symlink_to("/nonexistent/zz")
    (arts / "junk-5555.ninfer").write_bytes(b"junk")
    (arts / "junk-5555.ninfer.part-0001").mkdir()
    (arts / "gone-2222.ninfer").symlink_to("/nonexistent/gone.ninfer")
    out = run_ninfer("list", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["file"].rsplit("/", 1)[-1]: r for r in json.loads(out.stdout)}
    assert set(rows) == {f"{NAME}-00000000000000000001.ninfer", "junk-4444.ninfer", "junk-5555.ninfer",
                         "gone-2222.ninfer"}, rows
    assert all(rows[n]["problem"] for n in ("junk-4444.ninfer", "junk-5555.ninfer", "gone-2222.ninfer"))
    out = run_ninfer("rm", "junk-4444.ninfer", "junk-5555.ninfer", "gone-2222.ninfer")
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in arts.iterdir()) == ["junk-5555.ninfer.part-0001",   # the folder is not ours
                                                      f"{NAME}-00000000000000000001.ninfer"]


def test_rm_takes_end_of_input_at_its_question_as_no(run_ninfer, default_artifact, monkeypatch, capsys):
    """Ctrl-D at the confirmation prompt: nothing removed, no traceback."""
    import io
    import sys

    from ninfer.cli.main import main

    kept = copy_artifact(default_artifact, run_ninfer.cache, f"{NAME}-00000000000000000001.ninfer")
    monkeypatch.setenv("NINFER_CACHE_DIR", str(run_ninfer.cache))

    class _Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", _Tty(""))   # input() meets end of file at once
    assert main(["rm", NAME]) == 1
    assert "nothing removed" in capsys.readouterr().out and kept.exists()


@pytest.mark.parametrize("size, shown", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (15722515, "15.0 MiB"),
                                         (1000 * 1024, "0.98 MiB"), (18 * 2**30, "18.0 GiB"), (2**50, "1024 TiB")])
def test_sizes_are_shown_in_binary_units(size, shown):
    from ninfer.cli.list_cmd import format_size

    assert format_size(size) == shown
