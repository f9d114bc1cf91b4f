"""``ParameterSpec.placement``: a parameter asked for in host memory is loaded into CPU memory whatever the run
device (``load_weights``), page-locked when the run device is a GPU; anything but "device" or "host" is refused."""

from __future__ import annotations

import dataclasses

import pytest
from artifact_testlib import TEXT_SPECS, same_bits
from ninfer.artifact import ArtifactReader, load_weights
from ninfer.contracts.architecture import ParameterSpec


def _host(name: str):
    return [dataclasses.replace(s, placement="host") if s.name == name else s for s in TEXT_SPECS]


def test_placement_is_device_or_host():
    assert ParameterSpec("text/x", (2,)).placement == "device"
    with pytest.raises(ValueError, match="placement must be one of"):
        ParameterSpec("text/x", (2,), placement="disk")


def test_host_parameter_loads_on_the_cpu_run_device(tiny):
    with ArtifactReader.open(tiny.path) as r:
        out = load_weights(r, _host("text/norm"), "cpu")
    assert out["text/norm"].device.type == "cpu" and not out["text/norm"].is_pinned()
    assert same_bits(out["text/norm"], tiny.values["text.norm"])


@pytest.mark.gpu
def test_host_parameter_stays_on_the_host_of_a_cuda_run(tiny):
    with ArtifactReader.open(tiny.path) as r:
        out = load_weights(r, _host("text/norm"), "cuda")
    assert out["text/norm"].device.type == "cpu" and out["text/embed"].device.type == "cuda"
    assert out["text/norm"].is_pinned()   # page-locked: copies to the GPU at bus speed, without blocking
    assert same_bits(out["text/norm"], tiny.values["text.norm"])
