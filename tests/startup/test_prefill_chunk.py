"""The prefill chunk: its per-purpose default (8,192 generation, 2,048 scoring), the explicit value
winning, bad values refused by name, the planner sizing the workspace for the chunk a request can
actually have, and the `--prefill-chunk-size` flag of every command that shares the engine flags."""

from __future__ import annotations

import pytest
from ninfer.cli import common
from ninfer.cli.main import build_parser, main
from ninfer.contracts.options import (
    GENERATION_PREFILL_CHUNK,
    SCORING_PREFILL_CHUNK,
    EngineOptions,
    InvalidEngineOptions,
)

from tests.startup.test_planner import budget, plan_memory


def test_default_chunk_depends_on_purpose():
    assert EngineOptions().prefill_chunk_size is None
    assert EngineOptions().prefill_chunk == GENERATION_PREFILL_CHUNK == 8192
    assert EngineOptions(purpose="causal_scoring").prefill_chunk == SCORING_PREFILL_CHUNK == 2048
    assert EngineOptions(prefill_chunk_size=300).prefill_chunk == 300
    assert EngineOptions(purpose="causal_scoring", prefill_chunk_size=300).prefill_chunk == 300
    # the default checkpoint interval follows the resolved chunk (a page multiple)
    assert EngineOptions(context_cache=True).checkpoint_interval == 8192
    assert EngineOptions(context_cache=True, prefill_chunk_size=300).checkpoint_interval == 288


@pytest.mark.parametrize("bad", [0, -5])
def test_bad_chunk_is_refused_by_name(bad):
    with pytest.raises(InvalidEngineOptions, match="prefill_chunk_size"):
        EngineOptions(prefill_chunk_size=bad).validate()


def test_planner_workspace_uses_the_chunk_a_request_can_have():
    # max_context 1024 < the default chunk: a step prefills chunks of at most the 2 running requests, each
    # under 1024 tokens, so the workspace is the one of an explicit 2048-token chunk, not of 8192.
    def work(**kw):
        opts = EngineOptions(max_concurrency=2, max_context=1024, **kw)
        return plan_memory(opts, budget(4096), load_bytes=0).workspace_bytes

    assert work() == work(prefill_chunk_size=2048) == work(prefill_chunk_size=4096)
    assert work(prefill_chunk_size=512) < work(prefill_chunk_size=1024) < work()
    # the step budget while decoding never enlarges a step beyond the prefill chunk
    assert work(prefill_chunk_size=512, max_step_tokens=4096) == work(prefill_chunk_size=512)
    # scoring: its [chunk, vocab] logits are part of the workspace, which its smaller default keeps down
    def score_work(**kw):
        opts = EngineOptions(purpose="causal_scoring", max_concurrency=1, max_context=8192, **kw)
        return plan_memory(opts, budget(4096), load_bytes=0).workspace_bytes

    assert score_work() == score_work(prefill_chunk_size=2048) < score_work(prefill_chunk_size=8192)


@pytest.mark.parametrize("command, required", [("generate", ("--prompt", "x")), ("chat", ()), ("serve", ()),
                                                ("bench", ())])
def test_flag_reaches_engine_options(command, required):
    parser = build_parser()
    default = common.engine_options(parser.parse_args([command, *required]))
    assert default.prefill_chunk_size is None and default.prefill_chunk == 8192
    set_ = common.engine_options(parser.parse_args([command, *required, "--prefill-chunk-size", "512"]))
    assert set_.prefill_chunk_size == 512 and set_.prefill_chunk == 512


@pytest.mark.parametrize("command, required", [("generate", ("--prompt", "x")), ("chat", ()), ("serve", ()),
                                                ("bench", ())])
def test_step_budget_flag_reaches_engine_options(command, required):
    parser = build_parser()
    default = common.engine_options(parser.parse_args([command, *required]))
    assert default.max_step_tokens is None and default.step_tokens == 256
    set_ = common.engine_options(parser.parse_args([command, *required, "--max-step-tokens", "300"]))
    assert set_.max_step_tokens == 300 and set_.step_tokens == 300


def test_host_experts_keep_the_larger_step_budget_and_a_smaller_chunk():
    # A host-expert step's expert copies cost about the same at any chunk size: the default budget is 2,048 there,
    # 256 otherwise (auto host experts count as off until the plan resolves them), and an explicit budget wins.
    assert EngineOptions(host_experts=True).step_tokens == 2048
    assert EngineOptions(host_experts=None).step_tokens == EngineOptions(host_experts=False).step_tokens == 256
    assert EngineOptions(host_experts=True, max_step_tokens=300).step_tokens == 300
    # Likewise the prefill chunk: 2,048 with host experts (its workspace competes with device expert layers).
    assert EngineOptions(host_experts=True).prefill_chunk == 2048
    assert EngineOptions(host_experts=None).prefill_chunk == 8192
    assert EngineOptions(host_experts=True, prefill_chunk_size=4096).prefill_chunk == 4096


@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_bad_step_budget_is_refused_by_name(bad):
    with pytest.raises(InvalidEngineOptions, match="max_step_tokens"):
        EngineOptions(max_step_tokens=bad).validate()


@pytest.mark.parametrize("command, required", [("generate", ("--prompt", "x")), ("chat", ()), ("serve", ()),
                                                ("bench", ())])
@pytest.mark.parametrize("bad", ["0", "-8"])
def test_bad_flag_fails_by_name_before_loading(command, required, bad, capsys, tmp_path):
    # a model path that does not exist: the flag's error must come first (nothing resolved or loaded)
    code = main([command, str(tmp_path / "nope.ninfer"), *required, "--prefill-chunk-size", bad, "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"ninfer {command}: error: --prefill-chunk-size must be at least 1 token, got {bad}")
    assert "nope.ninfer" not in err and "Traceback" not in err
