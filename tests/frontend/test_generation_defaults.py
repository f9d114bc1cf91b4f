"""Sampling defaults and EOS ids from the artifact's generation/tokenizer configs."""

from __future__ import annotations

import pytest
from ninfer_qwen3_5.frontend import FrontendError, QwenFrontend
from ninfer_qwen3_5.frontend.generation_defaults import GenerationDefaults, apply_request_values

from .conftest import ENDOFTEXT, IM_END


def test_frontend_defaults(frontend: QwenFrontend):
    assert dict(frontend.sampling_defaults()) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert frontend.eos_token_ids == (IM_END, ENDOFTEXT)
    assert frontend.vocab_size == 248077


def test_request_values_win(frontend: QwenFrontend):
    merged = apply_request_values(frontend.sampling_defaults(), {"temperature": 0.0, "top_k": None, "seed": 3})
    assert merged == {"temperature": 0.0, "top_p": 0.95, "top_k": 20, "seed": 3}


def test_do_sample_false_is_greedy(frontend: QwenFrontend):
    d = GenerationDefaults.from_configs({"do_sample": False, "temperature": 0.7, "eos_token_id": 5}, None,
                                        frontend.tokenizer)
    assert d.sampling["temperature"] == 0.0 and d.eos_token_ids == (5,)


def test_eos_sources_and_errors(frontend: QwenFrontend):
    tok = frontend.tokenizer
    assert GenerationDefaults.from_configs(None, {"eos_token": {"content": "<|endoftext|>"}}, tok).eos_token_ids == (
        ENDOFTEXT,)
    assert GenerationDefaults.from_configs({"eos_token_id": IM_END}, {"eos_token": "<|im_end|>"}, tok
                                           ).eos_token_ids == (IM_END,)
    with pytest.raises(FrontendError, match="no EOS token"):
        GenerationDefaults.from_configs({"temperature": 1.0}, {}, tok)
    with pytest.raises(FrontendError, match="not in the vocabulary"):
        GenerationDefaults.from_configs(None, {"eos_token": "<nope>"}, tok)
    with pytest.raises(FrontendError, match="eos_token_id"):
        GenerationDefaults.from_configs({"eos_token_id": [10**9]}, None, tok)
    with pytest.raises(FrontendError, match="temperature"):
        GenerationDefaults.from_configs({"temperature": "hot", "eos_token_id": 1}, None, tok)


def test_a_whole_float_top_k_is_an_int(frontend: QwenFrontend):
    """JSON writers may store top_k 20 as 20.0: it is the integer the sampler takes (the converter accepts it too),
    else every request that does not set top_k would be refused for a value the client never sent."""
    from ninfer.contracts.sampling import SamplingParams

    d = GenerationDefaults.from_configs({"top_k": 20.0, "eos_token_id": 1}, None, frontend.tokenizer)
    assert d.sampling["top_k"] == 20 and type(d.sampling["top_k"]) is int
    SamplingParams(**d.sampling).validate()
    with pytest.raises(FrontendError, match=r"top_k=20\.5 is not an integer"):
        GenerationDefaults.from_configs({"top_k": 20.5, "eos_token_id": 1}, None, frontend.tokenizer)


def test_missing_tokenizer_is_a_clear_error():
    with pytest.raises(FrontendError, match="tokenizer.json"):
        QwenFrontend({"generation_config.json": b"{}"})
