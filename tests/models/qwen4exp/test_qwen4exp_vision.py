"""Oracle: multimodal prompts through a converted ``Qwen4ExpForConditionalGeneration`` (Qwen3.5-MoE's tower in front
of the Qwen4-Exp text model) against transformers', fp32 on the CPU.

The text model is the ``sparse`` case of :mod:`harness` (QSA keeping 2 blocks of 2 tokens, 3 streams, PLE on a GDN
layer) with MRoPE sections (2, 1, 1) over 8 rotary dims, so T, H and W each own frequencies; the vocabulary holds the
placeholder ids of :mod:`qwen3_5.vision_harness`, whose prompts (images, an image and a video, odd grids) and tower
these tests share. Checked: the logits at every prompt position in one chunk and in chunks that cut image spans
(the embeddings of a span's rest are taken from the tower's output of the first chunk), and greedy decoding's
tokens and logits, where the decode rows run at ``index + delta`` on all three axes. The n-gram windows hash the
placeholder ids, as transformers' ``ple_input_ids`` do.

Tolerance as the text oracle (test_qwen4exp_oracle.py): |ours - hf| <= 5e-4 + 1e-4 |hf|; greedy tokens identical.
"""

from __future__ import annotations

import pytest
import torch
from ninfer.artifact import ArtifactReader, load_weights
from ninfer.contracts.architecture import ProgramInit, ProgramOptions
from ninfer.contracts.features import StartupFeatures
from ninfer.ops import resolve_ops
from ninfer.plugins import get_registry
from ninfer.testing import randomize_weights
from qwen3_5.vision_harness import _DRAWS, TOKENS, VISION, media_prompt

from .harness import CASES, Runner

pytest.importorskip("transformers.models.qwen4_exp")

ATOL, RTOL = 5e-4, 1e-4
STEPS = 16
TEXT = dict(CASES["sparse"], vocab_size=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
TOWER = dict(VISION, out_hidden_size=TEXT["hidden_size"])
PROMPTS = {
    "image": [1, 2, ("image", (1, 6, 10)), 3, 4, 5],
    "image_video": [7, ("image", (1, 4, 4)), 8, ("video", (3, 4, 4)), 9, 10],
}
_QWEN4_DRAWS = {
    **_DRAWS,
    "A_log": lambda shape, g: torch.log(torch.empty(shape).uniform_(0.1, 2.0, generator=g)),
    "dt_bias": lambda shape, g: torch.empty(shape).uniform_(-1.0, 1.0, generator=g),
}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    import transformers as tf
    from ninfer.conversion import convert

    model = tf.Qwen4ExpForConditionalGeneration(tf.Qwen4ExpConfig(text_config=TEXT, vision_config=TOWER, **TOKENS))
    randomize_weights(model, 41, draws=_QWEN4_DRAWS)
    with torch.no_grad():   # as harness.build_hf: a wider head gives O(1) logits after the stream reduction
        model.lm_head.weight.mul_(3.0)
    model = model.float().eval()
    root = tmp_path_factory.mktemp("qwen4exp_vision")
    model.save_pretrained(root / "hf")
    convert(root / "hf", root / "m.ninfer", progress=False)
    with ArtifactReader.open(root / "m.ninfer") as reader:
        config = reader.component("text").config
        spec = get_registry().architecture(config["architectures"][0])
        weights = load_weights(reader, spec.parameter_specs(config, StartupFeatures(vision=True)), "cpu")
    return model, config, weights, spec, root / "m.ninfer"


def _program(case, page_size: int = 4):
    _, config, weights, spec, _ = case
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    options = ProgramOptions(device=torch.device("cpu"), dtype=torch.float32, max_sequences=4, page_size=page_size,
                             num_pages=512, max_context=2048)
    return spec.create_program(ProgramInit(config=config, weights=weights, ops=ops, options=options,
                                           features=StartupFeatures(vision=True)))


def _hf_logits(hf, inputs):
    hf.model.rope_deltas = None     # transformers caches the last call's delta on the model
    with torch.no_grad():
        return hf(**inputs).logits[0].float()


def _close(ours, ref, what):
    err = (ours - ref).abs()
    assert torch.all(err <= ATOL + RTOL * ref.abs()), f"{what}: max err {err.max().item():.3e}"


@pytest.mark.parametrize("name", sorted(PROMPTS))
@pytest.mark.parametrize("chunk", [None, 5])
def test_prompt_logits_match_transformers(case, name, chunk):
    prompt = media_prompt(PROMPTS[name], seed=3)
    ref = _hf_logits(case[0], prompt.hf_inputs)
    program = _program(case)
    seq = program.open_sequence(prompt.tokens, media=prompt.media)
    n = len(prompt.tokens)
    sizes = [n] if chunk is None else [min(chunk, n - i) for i in range(0, n, chunk)]
    out = []
    for size in sizes:
        assert program.reserve_units({seq: size})[seq]
        out.append(program.score_chunk(seq, size))
    program.release(seq)
    _close(torch.cat(out).float(), ref, f"{name}, chunks of {chunk or n}")


def test_the_media_move_the_logits(case):
    # The oracle's power: with the image's pixels zeroed (the same tokens) transformers' logits move far past the
    # tolerance, so the test above compares the media path, not the text around it.
    prompt = media_prompt(PROMPTS["image"], seed=3)
    zeroed = dict(prompt.hf_inputs, pixel_values=torch.zeros_like(prompt.hf_inputs["pixel_values"]))
    moved = (_hf_logits(case[0], prompt.hf_inputs) - _hf_logits(case[0], zeroed)).abs().max()
    assert moved > 100 * ATOL


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_decode_matches_transformers(case, name):
    prompt = media_prompt(PROMPTS[name], seed=4)
    hf = case[0]
    hf.model.rope_deltas = None
    n = len(prompt.tokens)
    with torch.no_grad():
        out = hf.generate(**prompt.hf_inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    ref_tokens, ref_logits = out.sequences[0, n:].tolist(), [lg[0].float() for lg in out.logits]
    program = _program(case)
    run = Runner(program)
    seq = program.open_sequence(prompt.tokens, media=prompt.media)
    run.unit(chunks=[(seq, 7)])                       # a prefill in two chunks (the first cuts the image's span)
    tokens = [run.unit(chunks=[(seq, n - 7)])[seq]]
    while len(tokens) < STEPS:
        tokens.append(run.unit(decode=[seq])[seq])
    assert tokens == ref_tokens, f"{name}: greedy tokens differ from transformers'"
    for step, (a, b) in enumerate(zip(run.logits[seq], ref_logits, strict=True)):
        _close(a.float(), b, f"{name} step {step}")


def test_speculation_with_vision_is_refused(case):
    from ninfer.errors import NotSupportedError

    _, config, _, spec, _ = case
    with pytest.raises(NotSupportedError, match="vision with speculative decoding"):
        spec.parameter_specs(config, StartupFeatures(vision=True, speculative="mtp"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_profile_counts_the_tower_and_the_rope_delta_exactly(case, dtype):
    from ninfer.testing import build_program, profile_mismatches

    built = build_program(case[4], dtype=dtype, features=StartupFeatures(vision=True))
    assert profile_mismatches(built) == []
    text = build_program(case[4], dtype=dtype)
    assert built.profile.weight_bytes > text.profile.weight_bytes
    assert built.profile.state_bytes_per_sequence > text.profile.state_bytes_per_sequence   # the rope delta field
    assert built.profile.encoder_bytes_per_row > 0 == text.profile.encoder_bytes_per_row
