"""Oracle: multimodal prompts through our converted artifact and Program against transformers'
``Qwen3_5(Moe)ForConditionalGeneration``, fp32 on the CPU.

Prompts: odd grids, several images in one prompt, an image and a video (split per frame), a prompt that ends in
an image. Checked: the logits at every prompt position (causal scoring, in chunks whose boundaries fall inside
image spans) and 32 greedy tokens with their logits, with chunked prefill, alone and batched with a text-only
request and with another multimodal request (their media encoded in one tower call); then lookahead decode
(the rope delta follows the state's slot), a Replay resume and a resume from a checkpoint taken inside an image
span (the embeddings are encoded again for the rest of the span).

Tolerance as the text oracle (test_qwen35_oracle.py): |ours - hf| <= 5e-4 + 1e-4 |hf|; greedy tokens identical.
The media rows move the logits by O(1) (the first test checks that zeroed pixels are caught).
"""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.program import DecodeRow, ExecutionUnit, PrefillChunk, ProgramError, RowSampling

from .harness import GREEDY, Runner, split
from .vision_harness import make_vision_program, media_prompt

ATOL, RTOL = 5e-4, 1e-4
STEPS = 32
PROMPTS = {
    "image": [1, 2, ("image", (1, 6, 10)), 3, 4, 5],
    "images": [7, ("image", (1, 4, 4)), 8, 9, ("image", (1, 10, 6)), 10, ("image", (1, 2, 2)), 11, 12],
    "image_video": [1, ("image", (1, 6, 4)), 2, ("video", (3, 4, 4)), 3, 4],
    "ends_in_image": [5, 6, 7, ("image", (1, 4, 8))],
}


def _close(ours, ref, what):
    err = (ours - ref).abs().max().item()
    assert torch.allclose(ours, ref, atol=ATOL, rtol=RTOL), f"{what}: max err {err:.2e}"


def _hf_logits(hf, prompt):
    hf.model.rope_deltas = None     # transformers caches the last call's delta on the model
    with torch.no_grad():
        return hf(**prompt.hf_inputs).logits[0].float()


def _hf_greedy(hf, inputs: dict, steps: int = STEPS):
    hf.model.rope_deltas = None
    n = inputs["input_ids"].shape[1]
    out = hf.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, n:].tolist(), [lg[0].float() for lg in out.logits]


def _text_inputs(tokens):
    return {"input_ids": torch.tensor([tokens])}


def _check_run(run, seq, tokens, ref, what):
    ref_tokens, ref_logits = ref
    assert tokens == ref_tokens, f"{what}: greedy tokens differ"
    for step, (a, b) in enumerate(zip(run.logits[seq], ref_logits, strict=True)):
        _close(a, b, f"{what} step {step}")


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("name", sorted(PROMPTS))
@pytest.mark.parametrize("chunk", [None, 5])
def test_logits_at_every_prompt_position_match_transformers(vision_case, kind, name, chunk):
    case = vision_case(kind)
    prompt = media_prompt(PROMPTS[name], seed=2)
    ref = _hf_logits(case.hf, prompt)
    p = make_vision_program(case)
    seq = p.open_sequence(prompt.tokens, media=prompt.media)
    n = len(prompt.tokens)
    assert all(p.reserve_units({seq: n}).values())
    ours = torch.cat([p.score_chunk(seq, k) for k in split(n, chunk or n)])
    _close(ours, ref, f"{kind} {name} chunk {chunk}")
    if chunk is None and name == "image":
        # The oracle's power: the same prompt with blank pixels gives other logits after the image.
        blank = media_prompt(PROMPTS[name], seed=2)
        blank.hf_inputs["pixel_values"] = torch.zeros_like(blank.hf_inputs["pixel_values"])
        assert (_hf_logits(case.hf, blank)[-1] - ref[-1]).abs().max() > 0.1


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("name", ["images", "image_video", "ends_in_image"])
def test_greedy_decode_batched_with_a_text_request_matches_transformers(vision_case, kind, name):
    """The multimodal prompt prefills in chunks of 6 (boundaries inside spans) while a text-only request decodes
    beside it, then both decode together."""
    case = vision_case(kind)
    prompt = media_prompt(PROMPTS[name], seed=4)
    text = [int(t) for t in torch.randint(0, 490, (9,), generator=torch.Generator().manual_seed(5))]
    ref_mm = _hf_greedy(case.hf, prompt.hf_inputs)
    ref_text = _hf_greedy(case.hf, _text_inputs(text))

    run = Runner(make_vision_program(case))
    t_seq = run.open(text)
    m_seq = run.p.open_sequence(prompt.tokens, media=prompt.media)
    out = {t_seq: [run.unit(chunk=(t_seq, len(text)))[t_seq]], m_seq: []}
    for k in split(len(prompt.tokens), 6):
        for s, tok in run.unit(decode=[t_seq], chunk=(m_seq, k)).items():
            out[s].append(tok)
    while len(out[m_seq]) < STEPS:
        rows = [s for s in (t_seq, m_seq) if len(out[s]) < STEPS]
        for s, tok in run.unit(decode=rows).items():
            out[s].append(tok)
    _check_run(run, m_seq, out[m_seq], ref_mm, f"{kind} {name}")
    _check_run(run, t_seq, out[t_seq][:STEPS], (ref_text[0], ref_text[1]), f"{kind} text beside {name}")


def test_two_multimodal_prefills_in_one_unit_encode_their_media_in_one_tower_call(vision_case):
    case = vision_case("dense")
    a, b = media_prompt(PROMPTS["image"], seed=6), media_prompt(PROMPTS["image_video"], seed=7)
    p = make_vision_program(case)
    calls = []
    encode = p.tower.encode
    p.tower.encode = lambda pixels, grids: calls.append(list(grids)) or encode(pixels, grids)
    run = Runner(p)
    sa = p.open_sequence(a.tokens, media=a.media)
    sb = p.open_sequence(b.tokens, media=b.media)
    first = run.unit(chunks=[(sa, len(a.tokens)), (sb, len(b.tokens))])
    assert calls == [[(1, 6, 10), (1, 6, 4), (3, 4, 4)]]
    out = {s: [first[s]] for s in (sa, sb)}
    for _ in range(STEPS - 1):
        for s, tok in run.unit(decode=[sa, sb]).items():
            out[s].append(tok)
    assert len(calls) == 1
    _check_run(run, sa, out[sa], _hf_greedy(case.hf, a.hf_inputs), "first of two")
    _check_run(run, sb, out[sb], _hf_greedy(case.hf, b.hf_inputs), "second of two")
    assert not p._media[sa].embeddings and not p._media[sb].embeddings   # consumed: released


class _Stepping(Runner):
    """Greedy rows whose RowSampling step counts their sampled tokens, as the engine's (a lookahead step is
    adopted only when the next unit's rows are the ones it predicted)."""

    def __init__(self, program) -> None:
        super().__init__(program, record=False)
        self.steps: dict[int, int] = {}

    def row_sampling(self, seq: int, overrides: dict) -> RowSampling:
        return RowSampling(GREEDY.params, seed=seq, step=self.steps.get(seq, 0))

    def committed(self, pending) -> None:
        for r in pending.rows:
            self.steps[r.seq] = self.steps.get(r.seq, 0) + 1


def test_lookahead_replay_and_checkpoint_resume_keep_the_positions(vision_case):
    case = vision_case("dense")
    prompt = media_prompt(PROMPTS["image_video"], seed=8)
    ref_tokens, _ = _hf_greedy(case.hf, prompt.hf_inputs, 12)

    # Lookahead decode: each step runs ahead into a spare slot and is adopted; the delta moves with the state.
    p = make_vision_program(case, lookahead_slots=2)
    run = _Stepping(p)
    seq = p.open_sequence(prompt.tokens, media=prompt.media)
    toks = [run.prefill(seq, split(len(prompt.tokens), 7))]
    slots = set()
    for _ in range(11):
        toks.append(run.unit(decode=[seq])[seq])
        slots.add(p.state_slot(seq))
        # The slot the sequence's state lives in now holds its delta (a tiny model's greedy tokens may not
        # notice a shifted position; the table must hold it anyway).
        assert int(p.rope_delta[p.state_slot(seq)]) == p._media[seq].delta == -9
    assert toks == ref_tokens
    assert p.lookahead_stats.adopted > 0 and len(slots) > 1

    # Replay: the ledger so far (prompt and 5 outputs) reopened with the same media continues identically.
    ledger = p.ledger(seq)[: len(prompt.tokens) + 5]
    again = p.open_sequence(ledger, prompt_length=len(prompt.tokens), media=prompt.media)
    run.prefill(again, split(len(ledger) - 1, 9))
    rest = [run.unit(decode=[again])[again] for _ in range(7)]
    assert rest == ref_tokens[5:12]

    # A checkpoint inside the image's span: a sequence opened from it encodes the image again for the rest.
    c = make_vision_program(case, checkpoint_slots=2)
    crun = Runner(c, record=False)
    first = c.open_sequence(prompt.tokens, media=prompt.media)
    (start, end), = prompt.media[0].spans
    cut = start + 3
    crun.unit(chunk=(first, cut))
    handle = c.capture_checkpoint(first)
    assert handle is not None and handle.covered == cut
    resumed = c.open_sequence_from(handle, prompt.tokens, media=prompt.media)
    got = [crun.prefill(resumed, [end - cut + 2, len(prompt.tokens) - end - 2])]
    got += [crun.unit(decode=[resumed])[resumed] for _ in range(11)]
    assert got == ref_tokens


def test_media_need_the_vision_tower(vision_case):
    case = vision_case("dense")
    prompt = media_prompt(PROMPTS["image"])
    p = make_vision_program(case, vision=False)
    with pytest.raises(ProgramError, match="started without a vision tower"):
        p.open_sequence(prompt.tokens, media=prompt.media)
    assert p.capacity().free_state_slots == 4            # nothing taken
    seq = p.open_sequence(prompt.tokens)                 # the placeholders alone are plain tokens
    assert all(p.reserve_units({seq: len(prompt.tokens)}).values())
    pending = p.run(ExecutionUnit(chunks=(PrefillChunk(seq, len(prompt.tokens), GREEDY),)))
    p.commit(pending, {seq: 1})
    pending = p.run(ExecutionUnit(decode=(DecodeRow(seq, GREEDY),)))
    p.commit(pending, {seq: 1})
