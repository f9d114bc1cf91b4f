"""ArtifactWriter protocol: publication order, no overwrite, temp-file cleanup, misuse errors."""

from __future__ import annotations

import os

import ninfer.artifact.writer as writer_mod
import pytest
import torch
from artifact_testlib import SMALL_LIMIT, make_tiny
from ninfer.artifact import ArtifactReader
from ninfer.artifact.errors import (
    PartRangeError,
    SchemaError,
    TargetExistsError,
    UnknownFormatError,
    UnknownReferenceError,
    WriterError,
)
from ninfer.artifact.writer import ArtifactWriter


def _small(path, **kw) -> ArtifactWriter:
    """A declared (not begun) writer: one text component, a 10000-byte and a 16-byte tensor."""
    w = ArtifactWriter(path, **kw)
    w.add_component("text", {"architectures": ["T"]})
    w.declare_tensor("a", (5000,), "bf16")
    w.declare_tensor("b", (4,), "fp32")
    w.bind("text/a", "a")
    w.bind("text/b", "b")
    return w


def _write_all(w: ArtifactWriter) -> None:
    w.write("a", torch.zeros(5000, dtype=torch.bfloat16))
    w.write("b", torch.ones(4))


def _listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_parts_are_published_before_the_entry(tmp_path, monkeypatch):
    order = []
    real = writer_mod._publish_file

    def recording(temp, target):
        order.append(target.name)
        real(temp, target)

    monkeypatch.setattr(writer_mod, "_publish_file", recording)
    w = _small(tmp_path / "m.ninfer", max_file_bytes=SMALL_LIMIT)
    w.begin_payload()
    _write_all(w)
    files = w.finish()
    assert len(files) == 3 and files[0] == tmp_path / "m.ninfer"
    assert order == ["m.ninfer.part-0001", "m.ninfer.part-0002", "m.ninfer"]
    assert _listing(tmp_path) == ["m.ninfer", "m.ninfer.part-0001", "m.ninfer.part-0002"]


def test_failure_after_parts_leaves_no_entry_and_no_temp(tmp_path, monkeypatch):
    real = writer_mod._publish_file

    def failing_on_entry(temp, target):
        if target.name == "m.ninfer":
            raise OSError("disk vanished")
        real(temp, target)

    monkeypatch.setattr(writer_mod, "_publish_file", failing_on_entry)
    w = _small(tmp_path / "m.ninfer", max_file_bytes=SMALL_LIMIT)
    w.begin_payload()
    _write_all(w)
    with pytest.raises(WriterError, match=r"m\.ninfer: cannot write: disk vanished"):
        w.finish()
    assert _listing(tmp_path) == []   # no entry; the published parts were rolled back; no temps


def test_never_overwrites_an_existing_entry(tmp_path):
    target = tmp_path / "m.ninfer"
    target.write_bytes(b"precious")
    w = _small(target)
    with pytest.raises(TargetExistsError, match="m.ninfer"):
        w.begin_payload()
    assert target.read_bytes() == b"precious" and _listing(tmp_path) == ["m.ninfer"]
    target.unlink()   # the directory is still open: once the target is free, writing works
    w.begin_payload()
    _write_all(w)
    assert w.finish() == [target]


def test_never_overwrites_an_existing_part(tmp_path):
    (tmp_path / "m.ninfer.part-0002").write_bytes(b"precious")
    w = _small(tmp_path / "m.ninfer", max_file_bytes=SMALL_LIMIT)
    with pytest.raises(TargetExistsError, match="m.ninfer.part-0002"):
        w.begin_payload()
    assert _listing(tmp_path) == ["m.ninfer.part-0002"]


def test_target_created_during_writing_is_not_overwritten(tmp_path):
    target = tmp_path / "m.ninfer"
    w = _small(target, max_file_bytes=SMALL_LIMIT)
    w.begin_payload()
    _write_all(w)
    target.write_bytes(b"someone else")
    with pytest.raises(TargetExistsError, match="m.ninfer"):
        w.finish()
    assert target.read_bytes() == b"someone else"
    assert _listing(tmp_path) == ["m.ninfer"]   # our parts rolled back, temps removed


def test_temp_files_live_beside_target_and_abort_removes_them(tmp_path):
    w = _small(tmp_path / "m.ninfer", max_file_bytes=SMALL_LIMIT)
    w.begin_payload()
    temps = _listing(tmp_path)
    assert len(temps) == 3 and all(n.startswith(".m.ninfer") and n.endswith(".tmp") for n in temps)
    w.write("a", torch.zeros(100, dtype=torch.bfloat16))
    w.abort()
    w.abort()   # idempotent
    assert _listing(tmp_path) == []
    with pytest.raises(WriterError, match="state: aborted"):
        w.write("a", b"\0\0")


def test_context_manager_aborts_on_exception_and_never_auto_finishes(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), _small(tmp_path / "m.ninfer") as w:
        w.begin_payload()
        raise RuntimeError("boom")
    assert _listing(tmp_path) == []
    with _small(tmp_path / "n.ninfer") as w:
        w.begin_payload()
        _write_all(w)
    assert _listing(tmp_path) == []   # complete but not finished: nothing published


def test_finished_files_are_readable_and_not_private(tmp_path):
    w = _small(tmp_path / "m.ninfer", artifact_id=bytes(range(16)))
    w.begin_payload()
    _write_all(w)
    (path,) = w.finish()
    assert path.stat().st_mode & 0o044, "published files keep the umask-derived mode, not mkstemp's 0600"
    with ArtifactReader.open(path) as r:
        assert r.artifact_id == bytes(range(16)).hex()
        assert r.read_object("b") == torch.ones(4).numpy().tobytes()


def test_protocol_errors(tmp_path):
    w = _small(tmp_path / "m.ninfer")
    with pytest.raises(WriterError, match="begin_payload"):
        w.write("a", b"\0\0")
    with pytest.raises(WriterError, match="declared twice"):
        w.declare_tensor("a", (1,), "bf16")
    with pytest.raises(WriterError, match="bound twice"):
        w.bind("text/a", "b")
    with pytest.raises(WriterError, match="declared twice"):
        w.add_component("text", {"architectures": ["T"]})
    w.begin_payload()
    with pytest.raises(WriterError, match="frozen"):
        w.declare_resource("r", 3)
    with pytest.raises(WriterError, match="frozen"):
        w.bind("text/c", "a")
    with pytest.raises(WriterError, match="'b' is not next.*next is 'a'"):
        w.write("b", torch.ones(4))
    with pytest.raises(WriterError, match="undeclared object 'zz'"):
        w.write("zz", b"1")
    with pytest.raises(WriterError, match="contiguous"):
        w.write("a", torch.zeros(2, 4, dtype=torch.bfloat16).t())
    with pytest.raises(WriterError, match="overflows"):
        w.write("a", bytes(10002))
    w.write("a", bytes(10000))
    with pytest.raises(WriterError, match="'a' is already complete"):
        w.write("a", b"\0")
    with pytest.raises(WriterError, match="'b' is incomplete \\(0/16"):
        w.finish()
    w.write("b", memoryview(bytes(16)))
    w.finish()
    with pytest.raises(WriterError):
        w.write("b", b"")


def test_declaration_errors(tmp_path):
    w = ArtifactWriter(tmp_path / "m.ninfer")
    with pytest.raises(SchemaError, match="'q'.*nvfp4 needs N % 128 == 0"):
        w.declare_tensor("q", (100, 64), "nvfp4")
    with pytest.raises(UnknownFormatError, match="bf17"):
        w.declare_tensor("q", (2,), "bf17")
    with pytest.raises(WriterError, match="positive"):
        w.declare_tensor("q", (2, 0), "bf16")
    with pytest.raises(WriterError, match="positive"):
        w.declare_resource("r", 0)
    with pytest.raises(WriterError, match="16 bytes"):
        ArtifactWriter(tmp_path / "x", artifact_id=b"short")
    with pytest.raises(WriterError, match="positive"):
        ArtifactWriter(tmp_path / "x", max_file_bytes=0)


@pytest.mark.parametrize("mutate, error, match", [
    (lambda w: w.bind("text/c", "ghost"), UnknownReferenceError, "ghost"),
    (lambda w: w.bind_parts("text/c", [("b", 0, 5)]), PartRangeError, "'b'"),
    (lambda w: w.add_component("mtp", {"architectures": ["M"]}, target="vision"), UnknownReferenceError,
     "vision"),
    (lambda w: w.add_use("text/zz", "in"), UnknownReferenceError, "text/zz"),
    (lambda w: w.set_metadata({"x": float("nan")}), SchemaError, "JSON"),
])
def test_directory_is_validated_before_any_file_exists(tmp_path, mutate, error, match):
    w = _small(tmp_path / "m.ninfer")
    mutate(w)
    with pytest.raises(error, match=match):
        w.begin_payload()
    assert _listing(tmp_path) == []


def test_missing_text_component_is_rejected(tmp_path):
    w = ArtifactWriter(tmp_path / "m.ninfer")
    w.add_component("mtp", {"architectures": ["M"]})
    w.declare_tensor("a", (1,), "fp32")
    with pytest.raises(SchemaError, match="'text'"):
        w.begin_payload()


def test_cap_too_small_for_the_directory(tmp_path):
    w = _small(tmp_path / "m.ninfer", max_file_bytes=4096 + 100)
    with pytest.raises(WriterError, match="max_file_bytes=4196"):
        w.begin_payload()
    assert _listing(tmp_path) == []


def test_auxiliary_binding_forms(tmp_path):
    w = _small(tmp_path / "m.ninfer")
    w.add_use("text/a", "in1", "AllowA8", auxiliaries={"activation_input_divisor": "b"})
    w.add_use("text/a", "in2", auxiliaries={"activation_input_divisor": [("b", 2, 3)]})
    w.add_use("text/b", "in1", auxiliaries={"d": {"parts": [{"object": "b", "range": [0, 1]}]}})
    w.begin_payload()
    _write_all(w)
    (path,) = w.finish()
    with ArtifactReader.open(path) as r:
        u1, u2, u3 = r.directory.uses
        assert u1.activation_policy == "AllowA8" and u1.auxiliaries["activation_input_divisor"].object == "b"
        assert [(p.object, p.begin, p.end) for p in u2.auxiliaries["activation_input_divisor"].parts] == [("b", 2, 3)]
        assert u3.auxiliaries["d"].parts[0].end == 1


def test_same_artifact_written_twice_differs_only_in_id(tmp_path):
    a = make_tiny(tmp_path / "a.ninfer", artifact_id=b"\1" * 16)
    b = make_tiny(tmp_path / "b.ninfer", artifact_id=b"\2" * 16)
    ra, rb = a.path.read_bytes(), b.path.read_bytes()
    assert ra[:16] == rb[:16] and ra[32:] == rb[32:] and ra[16:32] != rb[16:32]


def test_an_interruption_right_after_a_part_is_linked_rolls_it_back(tmp_path, monkeypatch):
    """A Ctrl-C between linking a part and recording it: the part is ours (the same file as our temp), so it is
    removed with the rest, and the next run does not find a stray part in its way."""
    real_link, linked = os.link, []

    def link_then_interrupt(src, dst):
        real_link(src, dst)
        linked.append(os.path.basename(dst))
        if len(linked) == 2:
            raise KeyboardInterrupt

    def interrupted_finish() -> None:
        w = _small(tmp_path / "m.ninfer", max_file_bytes=SMALL_LIMIT)
        w.begin_payload()
        _write_all(w)
        with pytest.raises(KeyboardInterrupt):
            w.finish()

    monkeypatch.setattr(os, "link", link_then_interrupt)
    interrupted_finish()
    assert linked == ["m.ninfer.part-0001", "m.ninfer.part-0002"] and _listing(tmp_path) == []
    # The same just after the temp's name is gone too: the part is still known as ours by its inode.
    real_unlink, unlinked = os.unlink, []

    def unlink_then_interrupt(path, *a, **k):
        real_unlink(path, *a, **k)
        if str(path).endswith(".tmp"):
            unlinked.append(path)
            if len(unlinked) == 1:
                raise KeyboardInterrupt

    monkeypatch.setattr(os, "link", real_link)
    monkeypatch.setattr(os, "unlink", unlink_then_interrupt)
    interrupted_finish()
    assert len(unlinked) >= 1 and _listing(tmp_path) == []
    monkeypatch.setattr(os, "unlink", real_unlink)
    w = _small(tmp_path / "m.ninfer", max_file_bytes=SMALL_LIMIT)
    w.begin_payload()
    _write_all(w)
    assert len(w.finish()) == 3


@pytest.mark.parametrize("where", ["begin", "write", "finish"])
def test_an_os_failure_to_write_names_the_file_and_the_reason(tmp_path, monkeypatch, where):
    """Disk full, a read-only file system, a name too long: a WriterError naming the file and the reason (the
    converter prints it as one line), and nothing left behind."""
    import errno

    def fail(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    w = _small(tmp_path / "m.ninfer", max_file_bytes=SMALL_LIMIT)
    if where == "begin":
        monkeypatch.setattr(writer_mod.tempfile, "mkstemp", fail)
        with pytest.raises(WriterError, match=r"m\.ninfer.*: cannot write: No space left on device"):
            w.begin_payload()
    else:
        w.begin_payload()
        if where == "write":
            monkeypatch.setattr(os, "pwrite", fail)
            with pytest.raises(WriterError, match=r"\.tmp: cannot write: No space left on device"):
                w.write("a", torch.zeros(5000, dtype=torch.bfloat16))
        else:
            _write_all(w)
            monkeypatch.setattr(os, "fsync", fail)
            with pytest.raises(WriterError, match="cannot write: No space left on device"):
                w.finish()
    assert _listing(tmp_path) == []
