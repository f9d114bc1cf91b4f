"""/metrics of a speculating server: the per-draft-position counters ``ninfer_spec_drafted_by_position_total``
and ``ninfer_spec_accepted_by_position_total`` carry one series per position (label ``position``), equal to the
engine's stats and consistent with the speculation totals, so ``accepted / drafted`` per position is the
acceptance rate; without speculation the families are exported with no series."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import MODEL_ID, client_for, wait_idle

FAMILIES = ("ninfer_spec_drafted_by_position", "ninfer_spec_accepted_by_position")


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="module")
def spec_engine(artifact):
    from ninfer import Engine

    eng = Engine.start(artifact, device="cpu", dtype="float32", max_concurrency=2, max_context=256,
                       speculative="mtp", num_speculative_tokens=3)
    yield eng
    eng.close()


def test_per_position_series(spec_engine):
    with client_for(spec_engine) as c:
        for prompt in ("import os\nimport sys\n\n\ndef main():\n", "class Queue:\n    def __init__(self):\n"):
            r = c.post("/v1/completions", json={"model": MODEL_ID, "prompt": prompt, "max_tokens": 24,
                                                "temperature": 0})
            assert r.status_code == 200, r.text
        stats = wait_idle(spec_engine)
        text = c.get("/metrics").text
    samples = _samples(text)
    for family in FAMILIES:
        assert f"# TYPE {family}_total counter" in text
    drafted = [samples[("ninfer_spec_drafted_by_position_total", (("position", str(j)),))] for j in (1, 2, 3)]
    accepted = [samples[("ninfer_spec_accepted_by_position_total", (("position", str(j)),))] for j in (1, 2, 3)]
    assert ("ninfer_spec_drafted_by_position_total", (("position", "4"),)) not in samples   # k = 3
    assert tuple(drafted) == stats.spec_drafted_by_position and tuple(accepted) == stats.spec_accepted_by_position
    assert drafted[0] == samples[("ninfer_spec_verify_steps_total", ())] > 0
    assert sum(drafted) == samples[("ninfer_spec_drafted_tokens_total", ())]
    assert sum(accepted) == samples[("ninfer_spec_accepted_tokens_total", ())] > 0
    assert drafted[0] >= drafted[1] >= drafted[2] and accepted[0] >= accepted[1] >= accepted[2]


def test_no_series_without_speculation(scripted):
    wait_idle(scripted)
    with client_for(scripted) as c:
        text = c.get("/metrics").text
    names = {f.name: f for f in text_string_to_metric_families(text)}
    for family in FAMILIES:
        assert family in names and names[family].type == "counter" and names[family].samples == []
