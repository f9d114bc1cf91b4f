"""Loading onto CUDA: staged bounded reads, views on device, one upload per parent per device."""

from __future__ import annotations

import pytest
from artifact_testlib import TEXT_SPECS, mtp_specs, same_bits
from ninfer.artifact import ArtifactReader, Materializer, bind, resolve_load


@pytest.mark.gpu
def test_load_to_cuda_bit_exact_with_views(tiny_parts):
    v = tiny_parts.values
    with ArtifactReader.open(tiny_parts.path) as r:
        plan = resolve_load(bind(r, TEXT_SPECS + mtp_specs()), "cuda", placement={"text/norm": "cpu"})
        out = Materializer(r, chunk_bytes=1000).materialize(plan)
    assert out["text/embed"].device.type == "cuda" and out["text/norm"].device.type == "cpu"
    assert same_bits(out["text/embed"].cpu(), v["text.embed"])
    assert same_bits(out["text/gate"].cpu(), v["text.qg"][1::2])
    assert same_bits(out["mtp/fc"].cpu(), v["mtp.fc"])
    assert same_bits(out["text/scale"].cpu(), v["text.scale"])
    ptr = out["text/embed"].untyped_storage().data_ptr()
    assert out["text/head"].untyped_storage().data_ptr() == ptr == out["mtp/embed"].untyped_storage().data_ptr()


@pytest.mark.gpu
def test_parent_needed_on_cpu_and_cuda_is_read_once(tiny):
    with ArtifactReader.open(tiny.path) as r:
        plan = resolve_load(bind(r, TEXT_SPECS), "cpu", placement={"text/head": "cuda:0"})
        reads = []
        orig = r.read_into
        r.read_into = lambda off, buf: (reads.append(off), orig(off, buf))[1]
        out = Materializer(r).materialize(plan)
    embed = r.object("text.embed")
    assert reads.count(embed.offset) == 1
    assert out["text/embed"].device.type == "cpu" and out["text/head"].device.type == "cuda"
    assert same_bits(out["text/head"].cpu(), out["text/embed"])
