"""The speculative startup options: EngineOptions.speculative / num_speculative_tokens, their check against the
registered backends (ninfer.planning.resolution.check_speculative) on every way an engine starts, and the CLI's
--speculative / --num-speculative-tokens: a bad value or an unregistered backend is refused before a model is
resolved; a registered one resolves to ProgramOptions.speculative_tokens (default 3), with no decode graphs and
no lookahead."""

from types import SimpleNamespace

import pytest
import torch
from ninfer import Engine
from ninfer.cli.main import main
from ninfer.contracts.options import MAX_SPECULATIVE_TOKENS, EngineOptions, InvalidEngineOptions
from ninfer.contracts.speculative import SpeculativeBackendSpec
from ninfer.planning.resolution import DEFAULT_SPECULATIVE_TOKENS, check_speculative, resolve_options

from tests.startup.test_planner import PROFILE

MTP = SpeculativeBackendSpec(name="mtp", architectures=("Toy",), component="mtp", create=lambda init: None)


@pytest.fixture
def mtp_registered(monkeypatch):
    """The plugin registry as seen by the speculative check, with one backend ``mtp`` registered."""
    monkeypatch.setattr("ninfer.plugins.get_registry", lambda: SimpleNamespace(speculative_backends={"mtp": MTP}))


def _no_model(*args, **kwargs):
    raise AssertionError("the model was resolved before the speculative options were checked")


@pytest.mark.parametrize("k", [1, MAX_SPECULATIVE_TOKENS, None])
def test_valid_values_pass_validation(k):
    options = EngineOptions(speculative="mtp", num_speculative_tokens=k)
    assert options.validate() is options
    assert options.features().speculative == "mtp"


@pytest.mark.parametrize("k", [0, MAX_SPECULATIVE_TOKENS + 1, -1])
def test_num_speculative_tokens_out_of_range_is_named(k):
    with pytest.raises(InvalidEngineOptions, match=r"num_speculative_tokens=.*must be an int in 1\.\.15 or None"):
        EngineOptions(speculative="mtp", num_speculative_tokens=k).validate()


@pytest.mark.parametrize("k", [True, 2.0, "3"])
def test_num_speculative_tokens_of_another_type_is_named(k):
    with pytest.raises(InvalidEngineOptions, match=r"num_speculative_tokens=.*: must be an integer or None, not"):
        EngineOptions(speculative="mtp", num_speculative_tokens=k).validate()


def test_num_speculative_tokens_needs_a_backend():
    with pytest.raises(InvalidEngineOptions, match=r"num_speculative_tokens=2: needs speculative"):
        EngineOptions(num_speculative_tokens=2).validate()


@pytest.mark.parametrize("name, match", [("", "must be a speculative backend name"),
                                         (3, "must be a string or None, not int")])
def test_speculative_must_be_a_name(name, match):
    with pytest.raises(InvalidEngineOptions, match=f"speculative=.*{match}"):
        EngineOptions(speculative=name).validate()


def test_causal_scoring_runs_no_speculation():
    with pytest.raises(InvalidEngineOptions, match="speculative='mtp': a causal_scoring engine runs no decode"):
        EngineOptions(purpose="causal_scoring", speculative="mtp").validate()


def test_check_names_the_registered_backends():
    check_speculative(EngineOptions())  # off: nothing to check
    backends = {"mtp": MTP, "dflash": MTP}
    with pytest.raises(InvalidEngineOptions, match=r"speculative='eagle'.*registered: dflash, mtp"):
        check_speculative(EngineOptions(speculative="eagle"), backends)
    with pytest.raises(InvalidEngineOptions, match=r"registered: none"):
        check_speculative(EngineOptions(speculative="mtp"), {})
    check_speculative(EngineOptions(speculative="mtp"), backends)  # registered: passes


def test_the_check_reads_the_plugin_registry(mtp_registered):
    check_speculative(EngineOptions(speculative="mtp"))
    with pytest.raises(InvalidEngineOptions, match="registered: mtp"):
        check_speculative(EngineOptions(speculative="eagle"))


def test_every_engine_start_refuses_an_unknown_backend_before_the_model(mtp_registered, monkeypatch):
    monkeypatch.setattr("ninfer.model_source.resolve_model", _no_model)
    with pytest.raises(InvalidEngineOptions, match="registered: mtp"):
        Engine.start(speculative="eagle")
    # from_parts checks before it touches the Program or the Frontend.
    with pytest.raises(InvalidEngineOptions, match="registered: mtp"):
        Engine.from_parts(object(), object(), speculative="eagle")
    with pytest.raises(InvalidEngineOptions, match="registered: mtp"):
        resolve_options(EngineOptions(speculative="eagle"), device=torch.device("cpu"), dtype=torch.float32,
                        profile=PROFILE, lookahead_supported=False)


def _resolve(device="cpu", **kw):
    return resolve_options(EngineOptions(**kw), device=torch.device(device), dtype=torch.float32, profile=PROFILE,
                           lookahead_supported=True)


@pytest.mark.parametrize("k, want", [(None, DEFAULT_SPECULATIVE_TOKENS), (1, 1), (5, 5)])
def test_resolution_sets_the_program_drafts(mtp_registered, k, want):
    r = _resolve(speculative="mtp", num_speculative_tokens=k)
    assert r.speculative_tokens == want and r.options.num_speculative_tokens == want
    assert r.program_options(8).speculative_tokens == want
    assert r.lookahead_slots == 0
    off = _resolve()
    assert off.speculative_tokens == 0 and off.program_options(8).speculative_tokens == 0
    assert off.options.num_speculative_tokens is None


def test_speculation_turns_lookahead_off_and_keeps_graphs_for_verify(mtp_registered, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    plain = _resolve(device="cuda")
    assert plain.graph_batches > 0 and plain.lookahead_slots > 0  # lookahead is what speculation turns off
    spec = _resolve(device="cuda", speculative="mtp")
    # The speculating Program captures its verify graphs for the same row counts.
    assert spec.graph_batches == plain.graph_batches and spec.lookahead_slots == 0
    with pytest.raises(InvalidEngineOptions, match=r"lookahead=True: speculative decoding .* runs no lookahead"):
        _resolve(speculative="mtp", lookahead=True)


# --- the CLI flags ------------------------------------------------------------------------------------------------

COMMANDS = [("generate", "-p", "x"), ("chat",), ("bench",), ("serve",)]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("flags, error", [
    (("--speculative", "eagle"), "--speculative eagle: invalid engine option speculative='eagle': no installed "
                                 "plugin registers this speculative backend (registered: mtp;"),
    (("--num-speculative-tokens", "3"), "--num-speculative-tokens 3: needs --speculative NAME"),
    (("--speculative", "none", "--num-speculative-tokens", "2"), "--num-speculative-tokens 2: needs --speculative"),
    (("--speculative", "mtp", "--num-speculative-tokens", "16"), "--num-speculative-tokens 16: invalid engine option "
                                                                 "num_speculative_tokens=16: must be an int in 1..15"),
])
def test_flags_fail_before_the_model(command, flags, error, mtp_registered, monkeypatch, capsys):
    monkeypatch.setattr("ninfer.model_source.resolve_model", _no_model)
    assert main([*command, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ninfer {command[0]}: error: {error}") and err.count("\n") == 1, err


def test_none_is_off(monkeypatch):
    from ninfer.cli import common
    from ninfer.cli.main import build_parser

    parsed = build_parser().parse_args(["generate", "-p", "x", "--speculative", "none"])
    options = common.engine_options(parsed)
    assert (options.speculative, options.num_speculative_tokens) == (None, None)
    assert common.engine_options(build_parser().parse_args(["generate", "-p", "x"])).speculative is None


def test_score_has_no_speculative_flags(capsys, monkeypatch):
    monkeypatch.setattr("ninfer.model_source.resolve_model", _no_model)
    for flag in ("--speculative", "--num-speculative-tokens"):
        with pytest.raises(SystemExit) as exited:
            main(["score", "--input", "a.txt", "--output", "r.json", flag, "2"])
        assert exited.value.code == 2
        assert "error: unrecognized arguments: " + flag in capsys.readouterr().err
