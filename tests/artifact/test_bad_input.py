"""Every malformed file is its own exception type, and the message names the file or object."""

from __future__ import annotations

import shutil

import pytest
from artifact_testlib import (
    SMALL_LIMIT,
    TEXT_SPECS,
    flip_payload_byte,
    make_tiny,
    mtp_specs,
    obj_record,
    rewrite_directory,
    rewrite_directory_raw,
)
from ninfer.artifact import ArtifactReader, bind, load_weights
from ninfer.artifact.errors import (
    ArtifactError,
    ArtifactIdMismatchError,
    ArtifactNotFoundError,
    BadMagicError,
    BindingShapeError,
    ChecksumMismatchError,
    CoverageError,
    DuplicateIdError,
    DuplicateMemberError,
    FileLengthError,
    FramingError,
    MalformedJSONError,
    MisalignedObjectError,
    MissingBindingError,
    MissingComponentError,
    MissingPartError,
    ObjectRangeError,
    ObjectSizeError,
    OverlappingObjectsError,
    PartRangeError,
    ReaderClosedError,
    SchemaError,
    TruncatedFileError,
    UnknownFieldError,
    UnknownFormatError,
    UnknownLayoutError,
    UnknownReferenceError,
    UnsupportedFormatError,
    UnsupportedVersionError,
)
from ninfer.contracts.architecture import ParameterSpec
from ninfer.errors import NInferError, NotSupportedError


def _open(path):
    return ArtifactReader.open(path)


# -- framing ---------------------------------------------------------------------------------------
def test_truncated_entry(tiny):
    data = tiny.path.read_bytes()
    tiny.path.write_bytes(data[:-1])
    with pytest.raises(TruncatedFileError, match="tiny.ninfer"):
        _open(tiny.path)
    tiny.path.write_bytes(data[:20])
    with pytest.raises(TruncatedFileError, match="header"):
        _open(tiny.path)
    tiny.path.write_bytes(data[:100])  # inside the JSON
    with pytest.raises(TruncatedFileError, match="JSON"):
        _open(tiny.path)


def test_trailing_bytes_and_dirty_padding(tiny):
    data = tiny.path.read_bytes()
    tiny.path.write_bytes(data + b"\0")
    with pytest.raises(FileLengthError, match="tiny.ninfer") as info:
        _open(tiny.path)
    assert not isinstance(info.value, TruncatedFileError)
    json_bytes = int.from_bytes(data[8:16], "little")
    dirty = bytearray(data)
    dirty[32 + json_bytes] = 1   # first byte of the zero gap
    tiny.path.write_bytes(bytes(dirty))
    with pytest.raises(FramingError, match="padding"):
        _open(tiny.path)


def test_truncated_part(tiny_parts):
    with _open(tiny_parts.path) as r:
        last = r.files[-1]
    last.write_bytes(last.read_bytes()[:-3])
    with _open(tiny_parts.path) as r:
        load_weights(r, TEXT_SPECS, "cpu")  # the text never touches the last part
        with pytest.raises(TruncatedFileError, match=last.name):
            load_weights(r, mtp_specs(), "cpu")


def test_wrong_magic_and_version(tiny):
    data = tiny.path.read_bytes()
    tiny.path.write_bytes(b"GGUF\x00\x00\x00\x03" + data[8:])
    with pytest.raises(BadMagicError, match="tiny.ninfer"):
        _open(tiny.path)
    tiny.path.write_bytes(data[:7] + b"\x02" + data[8:])
    with pytest.raises(UnsupportedVersionError, match="version 2"):
        _open(tiny.path)
    # a part file given as the entry has the part magic: wrong magic for an entry
    tiny.path.write_bytes(b"NINPRT\x00\x03" + data[8:])
    with pytest.raises(BadMagicError):
        _open(tiny.path)


def test_part_with_wrong_magic(tiny_parts):
    with _open(tiny_parts.path) as r:
        part = r.files[1]
    raw = part.read_bytes()
    part.write_bytes(b"NINFER\x00\x03" + raw[8:])
    with _open(tiny_parts.path) as r, pytest.raises(BadMagicError, match=part.name):
        r.read_object("text.embed")


def test_missing_entry_file(tmp_path):
    with pytest.raises(ArtifactNotFoundError, match="nope.ninfer"):
        _open(tmp_path / "nope.ninfer")


# -- JSON ------------------------------------------------------------------------------------------
def test_malformed_json(tiny):
    rewrite_directory_raw(tiny.path, lambda t: t[:-1])   # drop the closing brace
    with pytest.raises(MalformedJSONError, match="tiny.ninfer"):
        _open(tiny.path)


def test_invalid_utf8_and_nan(tiny):
    p = tiny.path
    original = p.read_bytes()
    rewrite_directory_raw(p, lambda t: t.replace(b'"tiny-test"', b'"tiny-\xff"'))
    with pytest.raises(MalformedJSONError, match="UTF-8"):
        _open(p)
    p.write_bytes(original)
    rewrite_directory_raw(p, lambda t: t.replace(b'"rms_norm_eps":1e-06', b'"rms_norm_eps":NaN'))
    with pytest.raises(MalformedJSONError, match="NaN"):
        _open(p)


def test_duplicate_member_name(tiny):
    rewrite_directory_raw(tiny.path, lambda t: t.replace(b'"metadata":{"name":"tiny-test"}',
                                                         b'"metadata":{"name":"a","name":"b"}'))
    with pytest.raises(DuplicateMemberError, match="'name'"):
        _open(tiny.path)


@pytest.mark.parametrize("where", ["root", "object", "binding", "part", "component", "file", "use"])
def test_unknown_field(tiny, where):
    def edit(root):
        target = {
            "root": root,
            "object": obj_record(root, "text.qg"),
            "binding": root["bindings"]["text/embed"],
            "part": root["bindings"]["text/q"]["parts"][0],
            "component": root["components"]["mtp"],
            "file": root["files"][0],
            "use": root["uses"][0],
        }[where]
        target["zz_extra"] = 1
    rewrite_directory(tiny.path, edit)
    with pytest.raises(UnknownFieldError, match="zz_extra"):
        _open(tiny.path)


def test_open_objects_accept_unknown_fields(tiny):
    def edit(root):
        root["components"]["text"]["config"]["new_field"] = {"x": 1}
        root["metadata"]["anything"] = [1, 2]
        root["provenance"]["recipe"] = "r"
    rewrite_directory(tiny.path, edit)
    with _open(tiny.path) as r:
        assert r.component("text").config["new_field"] == {"x": 1}


@pytest.mark.parametrize("edit, match", [
    (lambda root: obj_record(root, "text.qg").__setitem__("offset", "256"), "offset must be an integer"),
    (lambda root: obj_record(root, "text.qg").__setitem__("offset", 256.0), "offset must be an integer"),
    (lambda root: obj_record(root, "text.qg").__setitem__("bytes", True), "bytes must be an integer"),
    (lambda root: obj_record(root, "text.qg").__setitem__("shape", [8, 0]), "positive"),
    (lambda root: obj_record(root, "text.qg").__setitem__("checksum", "crc32:0"), "checksum"),
    (lambda root: obj_record(root, "text.qg").__setitem__("kind", "blob"), "kind"),
    (lambda root: obj_record(root, "text.qg").pop("layout"), "layout"),
    (lambda root: root["components"].pop("text"), "lacks 'text'"),
    (lambda root: root["components"]["mtp"].__setitem__("proposal", {"domain": "full"}), "only the text"),
    (lambda root: root["components"]["text"]["config"].pop("architectures"), "architectures"),
    (lambda root: root["files"][0].__setitem__("path", "x.ninfer"), "null"),
    (lambda root: root["bindings"]["text/embed"].__setitem__("parts", []), "exactly one"),
    (lambda root: root["uses"].append(dict(root["uses"][0])), "appears twice"),
    (lambda root: root["uses"][1].__setitem__("activation_policy", "AllowA2"), "activation_policy"),
    (lambda root: obj_record(root, "text.tokenizer").__setitem__("id", ""), "non-empty"),
])
def test_schema_errors(tiny, edit, match):
    rewrite_directory(tiny.path, edit)
    with pytest.raises(SchemaError, match=match):
        _open(tiny.path)


def test_part_paths_must_be_bare_names(tiny_parts):
    rewrite_directory(tiny_parts.path, lambda root: root["files"][1].__setitem__("path", "../evil.part"))
    with pytest.raises(SchemaError, match="bare file name"):
        _open(tiny_parts.path)


# -- objects ---------------------------------------------------------------------------------------
def test_duplicate_object_id(tiny):
    rewrite_directory(tiny.path, lambda root: obj_record(root, "text.norm").__setitem__("id", "text.qg"))
    with pytest.raises(DuplicateIdError, match="'text.qg'"):
        _open(tiny.path)


def test_overlapping_objects(tiny):
    def edit(root):
        qg = obj_record(root, "text.qg")
        embed = obj_record(root, "text.embed")
        qg["offset"] = embed["offset"] + embed["bytes"] - 256   # aligned, sorted, but overlapping
    rewrite_directory(tiny.path, edit)
    with pytest.raises(OverlappingObjectsError, match="'text.qg'.*overlaps object 'text.embed'"):
        _open(tiny.path)


def test_misaligned_tensor(tiny):
    rewrite_directory(tiny.path, lambda root: obj_record(root, "text.qg").__setitem__(
        "offset", obj_record(root, "text.qg")["offset"] + 2))
    with pytest.raises(MisalignedObjectError, match="'text.qg'"):
        _open(tiny.path)


def test_unsorted_objects_and_object_past_payload(tiny):
    p = tiny.path
    original = p.read_bytes()
    rewrite_directory(p, lambda root: root["objects"].reverse())
    with pytest.raises(ObjectRangeError, match="sorted by offset") as info:
        _open(p)
    assert not isinstance(info.value, OverlappingObjectsError)
    p.write_bytes(original)

    def grow(root):
        last = root["objects"][-1]
        last["shape"] = [last["shape"][0] * 4, last["shape"][1]]
        last["bytes"] *= 4
    rewrite_directory(p, grow)
    with pytest.raises(ObjectRangeError, match="'mtp.fc'.*past the logical payload"):
        _open(p)


def test_bytes_must_equal_encoded_size(tiny):
    rewrite_directory(tiny.path, lambda root: obj_record(root, "text.norm").__setitem__("bytes", 36))
    with pytest.raises(ObjectSizeError, match="'text.norm'.*36.*32"):
        _open(tiny.path)


# -- references --------------------------------------------------------------------------------------
def test_binding_references_unknown_object(tiny):
    rewrite_directory(tiny.path, lambda root: root["bindings"]["text/norm"].__setitem__("object", "ghost"))
    with pytest.raises(UnknownReferenceError, match="'text/norm'.*'ghost'"):
        _open(tiny.path)


@pytest.mark.parametrize("edit", [
    lambda root: root["uses"][0].__setitem__("parameter", "text/ghost"),
    lambda root: root["components"]["text"]["resources"].__setitem__("tokenizer.json", "ghost"),
    lambda root: root["components"]["mtp"].__setitem__("target", "ghost"),
])
def test_other_dangling_references(tiny, edit):
    rewrite_directory(tiny.path, edit)
    with pytest.raises(UnknownReferenceError, match="ghost"):
        _open(tiny.path)


def test_part_range_beyond_object(tiny):
    rewrite_directory(tiny.path, lambda root: root["bindings"]["text/q"]["parts"][3].__setitem__("range", [56, 65]))
    with pytest.raises(PartRangeError, match="'text/q'.*'text.qg'.*64 elements"):
        _open(tiny.path)
    rewrite_directory(tiny.path, lambda root: root["bindings"]["text/q"]["parts"][3].__setitem__("range", [8, 8]))
    with pytest.raises(PartRangeError, match="empty"):
        _open(tiny.path)


# -- payload -------------------------------------------------------------------------------------------
def test_missing_part(tiny_parts):
    with _open(tiny_parts.path) as r:
        part = r.files[-1]
    part.unlink()
    with _open(tiny_parts.path) as r:
        load_weights(r, TEXT_SPECS, "cpu")   # text lives in the entry and the first parts
        with pytest.raises(MissingPartError, match=part.name):
            load_weights(r, mtp_specs(), "cpu")


def test_part_from_another_artifact(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = make_tiny(tmp_path / "a" / "m.ninfer", max_file_bytes=SMALL_LIMIT)
    b = make_tiny(tmp_path / "b" / "m.ninfer", max_file_bytes=SMALL_LIMIT)
    with _open(a.path) as ra, _open(b.path) as rb:
        assert ra.artifact_id != rb.artifact_id and len(ra.files) == len(rb.files)
        victim = ra.files[1]
        shutil.copyfile(rb.files[1], victim)
    with _open(a.path) as r, pytest.raises(ArtifactIdMismatchError, match=f"{victim.name}.*{r.artifact_id}"):
        r.read_object("text.embed")


def test_part_renamed_to_another_index(tiny_parts):
    with _open(tiny_parts.path) as r:
        p1, p2 = r.files[1], r.files[2]
    tmp = p1.with_suffix(".swap")
    p1.rename(tmp)
    p2.rename(p1)
    tmp.rename(p2)
    with _open(tiny_parts.path) as r, pytest.raises(ArtifactIdMismatchError, match="part 2"):
        r.read_object("text.embed")


def test_checksum_mismatch_names_object_and_file(tiny_parts):
    with _open(tiny_parts.path) as r:
        flip_payload_byte(r, r.object("text.qg").offset + 3)
    with _open(tiny_parts.path) as r:
        with pytest.raises(ChecksumMismatchError, match="'text.qg'.*tiny.ninfer"):
            r.read_object("text.qg")
        assert len(r.read_object("text.qg", verify=False)) == 128
        with pytest.raises(ChecksumMismatchError, match="'text.qg'"):
            load_weights(r, TEXT_SPECS, "cpu")
        with pytest.raises(ChecksumMismatchError):
            r.verify_object("text.qg", chunk_bytes=7)


def test_unselected_component_bytes_are_never_read(tiny):
    with _open(tiny.path) as r:
        fc = r.object("mtp.fc")
        flip_payload_byte(r, fc.offset + 100)
    with _open(tiny.path) as r:
        out = load_weights(r, TEXT_SPECS, "cpu")   # must not raise: mtp.fc is not read
        assert len(out) == len(TEXT_SPECS)
        with pytest.raises(ChecksumMismatchError, match="'mtp.fc'"):
            load_weights(r, mtp_specs(), "cpu")


def test_resource_checksum_is_verified(tiny):
    with _open(tiny.path) as r:
        flip_payload_byte(r, r.object("text.tokenizer").offset)
    with _open(tiny.path) as r, pytest.raises(ChecksumMismatchError, match="'text.tokenizer'"):
        r.resource("text", "tokenizer.json")


# -- binding ---------------------------------------------------------------------------------------------
def test_binding_does_not_cover_parameter(tiny):
    with _open(tiny.path) as r:
        with pytest.raises(CoverageError, match="'text/q'.*32 elements.*40"):
            bind(r, [ParameterSpec("text/q", (5, 8))])
        with pytest.raises(CoverageError, match="'text/norm'"):
            bind(r, [ParameterSpec("text/norm", (9,))])
        with pytest.raises(BindingShapeError, match="'text/norm'.*\\[8\\].*\\[2, 4\\]"):
            bind(r, [ParameterSpec("text/norm", (2, 4))])
    # a file whose parts are one row short of the parameter
    rewrite_directory(tiny.path, lambda root: root["bindings"]["text/q"]["parts"].pop())
    with _open(tiny.path) as r, pytest.raises(CoverageError, match="24 elements"):
        bind(r, [ParameterSpec("text/q", (4, 8))])


def test_missing_binding(tiny):
    with _open(tiny.path) as r, pytest.raises(MissingBindingError, match="'text/ghost'"):
        bind(r, [ParameterSpec("text/ghost", (1,))])


def test_selecting_a_component_the_file_lacks(tiny):
    with _open(tiny.path) as r:
        with pytest.raises(MissingComponentError, match="'vision'.*text, mtp"):
            bind(r, [ParameterSpec("vision/patch_embed", (4,), "vision")])
        with pytest.raises(MissingComponentError, match="'dflash'"):
            r.component("dflash")


def test_unknown_format_fails_only_when_interpreted(tiny):
    rewrite_directory(tiny.path, lambda root: obj_record(root, "mtp.fc").__setitem__("format", "bf17"))
    with _open(tiny.path) as r:   # opening is fine: the format is not interpreted yet
        load_weights(r, TEXT_SPECS, "cpu")
        with pytest.raises(UnknownFormatError, match="'mtp.fc'.*'bf17'"):
            bind(r, mtp_specs())


def test_a_known_format_this_engine_does_not_implement_is_not_supported(tiny, monkeypatch):
    # Every format V3 names is implemented today; a table entry marked unsupported (what a newer V3 format would
    # be until implemented) fails at bind with a NotSupportedError naming it.
    from ninfer.artifact import format as fmt

    monkeypatch.setitem(fmt.FORMATS, "nvfp6", fmt.FormatInfo("nvfp6", ("block_scale_v9",), False,
                                                             description="a future format"))

    def edit(root):
        rec = obj_record(root, "mtp.fc")
        rec["format"], rec["layout"] = "nvfp6", "block_scale_v9"
    rewrite_directory(tiny.path, edit)
    with _open(tiny.path) as r:
        with pytest.raises(UnsupportedFormatError, match="'mtp.fc'.*nvfp6") as info:
            bind(r, mtp_specs())
    assert isinstance(info.value, NotSupportedError) and isinstance(info.value, ArtifactError)


@pytest.mark.parametrize("layout", ["row_split_k128_v1", "tiled_v9"])
def test_layout_not_defined_for_format(tiny, layout):
    rewrite_directory(tiny.path, lambda root: obj_record(root, "mtp.fc").__setitem__("layout", layout))
    with _open(tiny.path) as r, pytest.raises(UnknownLayoutError, match=f"'mtp.fc'.*{layout}"):
        bind(r, mtp_specs())


def test_closed_reader_refuses_reads(tiny):
    r = _open(tiny.path)
    r.close()
    r.close()   # idempotent
    with pytest.raises(ReaderClosedError, match="closed") as info:
        r.read_object("text.qg")
    assert isinstance(info.value, NInferError)
