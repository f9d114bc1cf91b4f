"""ninfer.switches.env_switch: 1 on, 0 off, unset or blank the default, anything else an error naming the variable."""

from __future__ import annotations

import pytest
from ninfer.contracts.options import InvalidEngineOptions
from ninfer.switches import env_switch


@pytest.mark.parametrize("raw, default, want", [(None, True, True), (None, False, False), ("", True, True),
                                                (" ", False, False), ("1", False, True), ("0", True, False),
                                                (" 1 ", False, True)])
def test_values(monkeypatch, raw, default, want):
    if raw is None:
        monkeypatch.delenv("NINFER_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("NINFER_TEST_SWITCH", raw)
    assert env_switch("NINFER_TEST_SWITCH", default) is want


def test_a_bad_value_names_the_variable_and_what_it_does(monkeypatch):
    monkeypatch.setenv("NINFER_TEST_SWITCH", "yes")
    with pytest.raises(ValueError, match=r"NINFER_TEST_SWITCH='yes': expected 0 or 1$"):
        env_switch("NINFER_TEST_SWITCH", False)
    with pytest.raises(InvalidEngineOptions, match=r"expected 0 or 1 \(1: on, 0: off\)"):
        env_switch("NINFER_TEST_SWITCH", True, error=InvalidEngineOptions, meaning="1: on, 0: off")
