"""Fuzzing the V3 reader: every mutated file either loads (and then every read works or raises ArtifactError) or
is refused with a named ArtifactError; no other exception, and no example runs long.

Mutations start from a real artifact written by :func:`make_tiny` (with and without continuation parts): byte
flips anywhere in the entry, truncation at any length, a lying ``json_bytes`` header field, and JSON surgery that
puts a wrong-typed or huge value at any path of the directory, or moves and resizes objects so they overlap or
leave the payload. ``HYPOTHESIS_PROFILE=explore`` runs a longer hunt.
"""

from __future__ import annotations

import json
import struct
import tempfile
import time
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from artifact_testlib import (  # noqa: E402
    SMALL_LIMIT,
    TEXT_SPECS,
    make_tiny,
    mtp_specs,
    read_entry,
    rewrite_directory_raw,
)
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from ninfer.artifact import ArtifactReader, load_weights  # noqa: E402
from ninfer.artifact.errors import ArtifactError  # noqa: E402

# A generous bound per example: a well-behaved reader answers in milliseconds; a lying size that made it read or
# allocate gigabytes would blow far past this.
EXAMPLE_SECONDS = 10.0

_BUILT: dict[bool, tuple[bytes, dict[str, bytes]]] = {}


def _pristine(parts: bool) -> tuple[bytes, dict[str, bytes]]:
    """(entry bytes, {part name: bytes}) of the tiny artifact, built once per layout."""
    if parts not in _BUILT:
        with tempfile.TemporaryDirectory() as d:
            entry = Path(d) / "tiny.ninfer"
            make_tiny(entry, max_file_bytes=SMALL_LIMIT if parts else 32_000_000_000)
            others = {p.name: p.read_bytes() for p in Path(d).iterdir() if p != entry}
            _BUILT[parts] = (entry.read_bytes(), others)
    return _BUILT[parts]


def _exercise(entry_bytes: bytes, parts: dict[str, bytes]) -> None:
    """Open, read every object and resource, then load the text and mtp weights; only ArtifactError may escape."""
    with tempfile.TemporaryDirectory() as d:
        entry = Path(d) / "tiny.ninfer"
        entry.write_bytes(entry_bytes)
        for name, data in parts.items():
            (Path(d) / name).write_bytes(data)
        started = time.monotonic()
        try:
            with ArtifactReader.open(entry) as reader:
                for obj in reader.directory.objects:
                    for read in (reader.verify_object, reader.read_object):
                        try:
                            read(obj.id)
                        except ArtifactError:
                            pass
                for cid in reader.directory.components:
                    for role in reader.component(cid).resources:
                        try:
                            reader.resource(cid, role)
                        except ArtifactError:
                            pass
                for specs in (TEXT_SPECS, mtp_specs()):
                    try:
                        load_weights(reader, specs, "cpu")
                    except ArtifactError:
                        pass
        except ArtifactError:
            pass
        assert time.monotonic() - started < EXAMPLE_SECONDS


def _json_paths(node, prefix=()) -> list[tuple]:
    """Every path (tuple of keys and indices) into a parsed JSON tree, the root excluded."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        out.append(prefix + (key,))
        out.extend(_json_paths(child, prefix + (key,)))
    return out


HUGE = st.sampled_from([2**63 - 1, 2**63, 2**64, 2**64 + 1, -(2**63), 10**30, -1, 0, 1, 255, 256, 257])
WRONG = st.one_of(
    HUGE, st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none(),
    st.text(max_size=12), st.lists(st.integers(min_value=-3, max_value=300), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2), st.just([]), st.just({}),
    st.just("bf16"), st.just("fp32"), st.just("row_major"),
)

LAYOUT = st.booleans()


@given(parts=LAYOUT, flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(1, 255)), min_size=1,
                                    max_size=4))
def test_byte_flips(parts, flips):
    entry, others = _pristine(parts)
    data = bytearray(entry)
    for at, mask in flips:
        data[at % len(data)] ^= mask
    _exercise(bytes(data), others)


@given(parts=LAYOUT, keep=st.integers(min_value=0), which=st.integers(min_value=0))
def test_truncations(parts, keep, which):
    """Truncate the entry or one part to any length."""
    entry, others = _pristine(parts)
    names = sorted(others)
    if which % (len(names) + 1) == 0:
        _exercise(entry[:keep % (len(entry) + 1)], others)
    else:
        name = names[which % (len(names) + 1) - 1]
        cut = dict(others, **{name: others[name][:keep % (len(others[name]) + 1)]})
        _exercise(entry, cut)


@given(parts=LAYOUT, json_bytes=st.one_of(HUGE.filter(lambda v: 0 <= v < 2**64), st.integers(0, 2**64 - 1)))
def test_lying_json_size(parts, json_bytes):
    entry, others = _pristine(parts)
    _exercise(entry[:8] + struct.pack("<Q", json_bytes) + entry[16:], others)


@given(parts=LAYOUT, pick=st.integers(min_value=0), value=WRONG)
def test_wrong_typed_json_values(parts, pick, value):
    """Any JSON value anywhere in the directory replaced by a wrong-typed, huge or plausible one."""
    entry, others = _pristine(parts)
    root = json.loads(read_entry_bytes(entry)[1])
    paths = _json_paths(root)
    path = paths[pick % len(paths)]
    node = root
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    _exercise(_reframe(entry, json.dumps(root).encode()), others)


@given(parts=LAYOUT, edits=st.lists(st.tuples(st.integers(min_value=0), st.sampled_from(["offset", "bytes"]),
                                              st.one_of(HUGE, st.integers(-10, 20_000))), min_size=1, max_size=3))
def test_objects_moved_and_resized(parts, edits):
    """Object records moved and resized: overlaps, gaps, misalignment, ranges past the payload."""
    entry, others = _pristine(parts)
    root = json.loads(read_entry_bytes(entry)[1])
    for pick, field, value in edits:
        obj = root["objects"][pick % len(root["objects"])]
        obj[field] = value if field == "bytes" or value < 0 else value - value % 256 if pick % 2 else value
    _exercise(_reframe(entry, json.dumps(root).encode()), others)


@given(parts=LAYOUT, pick=st.integers(min_value=0), rank=st.integers(0, 6), dim=HUGE)
def test_lying_shapes(parts, pick, rank, dim):
    """Tensor shapes with huge, zero or negative dimensions (the size and element counts must not overflow)."""
    entry, others = _pristine(parts)
    root = json.loads(read_entry_bytes(entry)[1])
    tensors = [o for o in root["objects"] if "shape" in o]
    tensors[pick % len(tensors)]["shape"] = [dim] * rank
    _exercise(_reframe(entry, json.dumps(root).encode()), others)


def read_entry_bytes(entry: bytes) -> tuple[bytes, bytes, bytes]:
    """:func:`artifact_testlib.read_entry` on bytes."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "e.ninfer"
        p.write_bytes(entry)
        return read_entry(p)


def _reframe(entry: bytes, text: bytes) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "e.ninfer"
        p.write_bytes(entry)
        rewrite_directory_raw(p, lambda _: text)
        return p.read_bytes()
