"""Weight loading reports progress in bytes: monotone, one call per parent, ending at the total."""

from __future__ import annotations

from artifact_testlib import SMALL_LIMIT, TEXT_SPECS, make_tiny
from ninfer.artifact import ArtifactReader, bind, load_weights, resolve_load


def test_progress_counts_every_parent_byte_once(tmp_path):
    tiny = make_tiny(tmp_path / "m.ninfer", max_file_bytes=SMALL_LIMIT)
    calls: list[tuple[int, int]] = []
    with ArtifactReader.open(tiny.path) as reader:
        plan = resolve_load(bind(reader, TEXT_SPECS), "cpu")
        load_weights(reader, TEXT_SPECS, "cpu", progress=lambda done, total: calls.append((done, total)))
    expected_total = sum(p.object.bytes for p in plan.parents)
    assert len(calls) == len(plan.parents) >= 2
    assert all(total == expected_total for _, total in calls)
    done = [d for d, _ in calls]
    assert done == sorted(done) and len(set(done)) == len(done)
    assert done[-1] == expected_total
