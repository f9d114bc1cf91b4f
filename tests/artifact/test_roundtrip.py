"""Writer -> reader -> binder -> materializer round trips, bit-exact, across continuation parts."""

from __future__ import annotations

import torch
from artifact_testlib import SMALL_LIMIT, TEXT_SPECS, bits_tensor, make_tiny, mtp_specs, same_bits
from ninfer.artifact import ArtifactReader, Materializer, bind, load_weights, resolve_load
from ninfer.artifact.format import HEADER_BYTES, PART_PAYLOAD_START, PAYLOAD_ALIGN, align_up, part_file_name
from ninfer.artifact.writer import ArtifactWriter
from ninfer.contracts.architecture import ParameterSpec

SPECIAL = {
    # NaN with payloads of both signs, +-inf, +-0, smallest subnormal, ordinary values
    "bf16": [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x3F80],
    "fp16": [0x7E01, 0xFC01, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x3C00],
    "fp32": [0x7FC00001, 0xFF800123, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x3F800000],
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int32": torch.int32}
SHAPES = [(), (3,), (2, 3), (2, 3, 4), (2, 1, 3, 2)]


def _values(fmt: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    n = torch.Size(shape).numel()
    if fmt == "int32":
        words = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64)
        words[: min(n, 2)] = torch.tensor([-(2**31), 2**31 - 1])[: min(n, 2)]
        return words.to(torch.int32).reshape(shape)
    dtype = DTYPES[fmt]
    # random bit patterns (NaN payloads included by chance) with the special words up front
    width = 8 * dtype.itemsize
    raw = torch.randint(0, 2**width, (n,), generator=g, dtype=torch.int64).tolist()
    special = SPECIAL[fmt]
    raw[: min(n, len(special))] = special[: min(n, len(special))]
    return bits_tensor(raw, dtype).reshape(shape)


def test_all_formats_and_ranks_round_trip_bit_exact_across_parts(tmp_path):
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "formats.ninfer"
    tensors: dict[str, torch.Tensor] = {}
    w = ArtifactWriter(path, max_file_bytes=3 * 4096)   # this JSON needs two pages: 4096-byte entry payload
    w.add_component("text", {"architectures": ["T"]})
    for fmt in DTYPES:
        for shape in SHAPES:
            oid = f"{fmt}.r{len(shape)}"
            tensors[oid] = _values(fmt, shape, g)
            w.declare_tensor(oid, shape, fmt)
            w.bind(f"text/{oid}", oid)
    tensors["big"] = _values("bf16", (10000,), g)   # 20000 bytes: must straddle file boundaries
    w.declare_tensor("big", (10000,), "bf16")
    w.bind("text/big", "big")
    w.begin_payload()
    for oid, t in tensors.items():
        w.write(oid, t)
    files = w.finish()
    assert len(files) > 2 and files[1].name == part_file_name(path.name, 1) == "formats.ninfer.part-0001"

    with ArtifactReader.open(path) as r:
        assert len(r.files_of(r.object("big"))) >= 2, "the test must make an object straddle files"
        specs = [ParameterSpec(f"text/{oid}", tuple(t.shape)) for oid, t in tensors.items()]
        out = load_weights(r, specs, "cpu")
        for oid, t in tensors.items():
            assert same_bits(out[f"text/{oid}"], t), oid
        # raw object bytes too (no checksum skipping)
        assert r.read_object("big") == tensors["big"].view(torch.int16).numpy().tobytes()


def test_file_framing_follows_the_spec(tiny_parts):
    r = ArtifactReader.open(tiny_parts.path)
    entry = tiny_parts.path.read_bytes()
    assert entry[:8] == b"NINFER\x00\x03"
    json_bytes = int.from_bytes(entry[8:16], "little")
    assert bytes.fromhex(r.artifact_id) == entry[16:32]
    start = align_up(HEADER_BYTES + json_bytes, PAYLOAD_ALIGN)
    assert len(entry) == start + r.directory.files[0].payload_bytes
    for rec, path in zip(r.directory.files[1:], r.files[1:], strict=False):
        raw = path.read_bytes()
        assert raw[:8] == b"NINPRT\x00\x03"
        assert int.from_bytes(raw[8:16], "little") == rec.index
        assert raw[16:32] == entry[16:32]
        assert raw[32:PART_PAYLOAD_START] == bytes(PART_PAYLOAD_START - 32)
        assert len(raw) == PART_PAYLOAD_START + rec.payload_bytes
        assert len(raw) <= SMALL_LIMIT
    assert len(entry) <= SMALL_LIMIT
    # the logical payload ends with the last object (the writer truncates after it)
    assert r.directory.payload_bytes == r.directory.objects[-1].end
    for obj in r.directory.objects:
        if obj.is_tensor:
            assert obj.offset % 256 == 0
    r.close()


def test_bindings_whole_parts_and_row_deinterleave(tiny_parts):
    v = tiny_parts.values
    with ArtifactReader.open(tiny_parts.path) as r:
        out = load_weights(r, TEXT_SPECS, "cpu")
    assert same_bits(out["text/embed"], v["text.embed"])
    assert same_bits(out["text/head"], v["text.embed"])
    assert same_bits(out["text/q"], v["text.qg"][0::2])
    assert same_bits(out["text/gate"], v["text.qg"][1::2])
    assert same_bits(out["text/qg_flat"], v["text.qg"].reshape(64))
    assert same_bits(out["text/norm"], v["text.norm"])
    assert out["text/scale"].shape == () and same_bits(out["text/scale"], v["text.scale"])


def test_shared_parent_is_read_once_and_views_share_its_storage(tiny):
    with ArtifactReader.open(tiny.path) as r:
        bound = bind(r, TEXT_SPECS + mtp_specs())
        plan = resolve_load(bound, "cpu")
        ids = [p.object.id for p in plan.parents]
        assert ids == sorted(set(ids), key=ids.index) and len(ids) == len(set(ids))
        assert set(ids) == {"text.embed", "text.qg", "text.norm", "text.scale", "mtp.fc"}
        reads = []
        orig = r.read_into

        def counting(offset, buf):
            reads.append((offset, len(buf)))
            return orig(offset, buf)

        r.read_into = counting
        out = Materializer(r, chunk_bytes=100).materialize(plan)
    embed = r.object("text.embed")
    embed_reads = [(o, n) for o, n in reads if embed.offset <= o < embed.end]
    # one pass in 100-byte chunks: bounded reads, each byte once
    assert sum(n for _, n in embed_reads) == embed.bytes and max(n for _, n in embed_reads) <= 100
    base = out["text/embed"].untyped_storage().data_ptr()
    for name in ("text/head", "mtp/embed"):
        assert out[name].untyped_storage().data_ptr() == base
    q_parent = [p for p in bound.parameters if p.name == "text/qg_flat"][0]
    assert q_parent.is_view and len(q_parent.pieces) == 1   # touching parts merged into one range
    gate = [p for p in bound.parameters if p.name == "text/gate"][0]
    assert not gate.is_view
    assert out["text/gate"].untyped_storage().data_ptr() != out["text/qg_flat"].untyped_storage().data_ptr()


def test_load_plan_bytes_and_placement(tiny):
    with ArtifactReader.open(tiny.path) as r:
        bound = bind(r, TEXT_SPECS)
        plan = resolve_load(bound, "cpu", placement={"text/norm": "cuda:1"})
    assert bound.components == ("text",)
    by_id = {p.object.id: p for p in plan.parents}
    assert [str(d) for d in by_id["text.norm"].devices] == ["cuda:1"]
    assert [str(d) for d in by_id["text.embed"].devices] == ["cpu"]
    cpu_parents = sum(p.object.bytes for p in plan.parents if torch.device("cpu") in p.devices)
    assert plan.parent_bytes == {"cpu": cpu_parents, "cuda:1": 32}
    # q and gate are gathered: 2 x 4 x 8 bf16
    assert plan.gathered_bytes == {"cpu": 2 * 4 * 8 * 2}
    assert plan.bytes_per_device == {"cpu": cpu_parents + 128, "cuda:1": 32}
    assert all(p.device.type in ("cpu", "cuda") for p in plan.parameters)
    assert resolve_load(bound, "cuda").parameters[0].device.index is not None


def test_resource_reads_and_component_records(tiny):
    with ArtifactReader.open(tiny.path) as r:
        assert r.resource("text", "tokenizer.json") == tiny.tokenizer
        assert r.resource("text", "chat_template.jinja") is None
        mtp = r.component("mtp")
        assert mtp.target == "text" and mtp.config == {"architectures": ["TinyMTP"]}
        assert r.component("text").proposal == {"domain": "full"}
        assert r.directory.metadata == {"name": "tiny-test"}
        use = r.directory.uses[1]
        assert use.activation_policy == "A16Only"
        assert use.auxiliaries["activation_input_divisor"].object == "text.scale"
        assert len(r.artifact_id) == 32 and int(r.artifact_id, 16) >= 0


def test_only_touched_files_are_opened(tiny_parts):
    with ArtifactReader.open(tiny_parts.path) as r:
        assert r.opened_files == (tiny_parts.path,)
        n_files = len(r.files)
        needed = {p for obj_id in ("text.embed", "text.qg", "text.norm", "text.scale")
                  for p in r.files_of(r.object(obj_id))}
        load_weights(r, TEXT_SPECS, "cpu")
        assert set(r.opened_files) == needed
        assert len(needed) < n_files, "the mtp object must live in parts the text never touches"
        load_weights(r, mtp_specs(), "cpu")
        assert set(r.opened_files) == set(r.files)


def test_writer_limits_produce_valid_files_for_many_caps(tmp_path):
    # The JSON lists the file split and the split depends on the JSON's size; sweep caps around
    # page boundaries to exercise the layout fixed point (and the trailing-space padding).
    for i, limit in enumerate([8192, 8192 + 1, 12287, 12288, 16384 + 100, 40000, 10**9]):
        t = make_tiny(tmp_path / f"cap{i}.ninfer", max_file_bytes=limit, mtp_rows=64 * (i + 1))
        with ArtifactReader.open(t.path) as r:
            assert all(p.stat().st_size <= limit for p in r.files)
            out = load_weights(r, mtp_specs(64 * (i + 1)), "cpu")
            assert same_bits(out["mtp/fc"], t.values["mtp.fc"])
