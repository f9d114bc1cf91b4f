"""Encode units of the Qwen3.5 Program: each span of a prompt's media (an image, one temporal patch of a video) is
encoded when a chunk first reaches it, so the engine can bound a step's encoder work by cutting chunks
(``Program.check_media`` / ``Program.encode_work``).

Oracle: transformers' logits at every prompt position (as test_vision_oracle.py, same tolerance) for a prompt
whose video is encoded one temporal patch per chunk; the tower calls show what each chunk encoded.
"""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.program import ProgramError

from .vision_harness import make_vision_program, media_prompt

ATOL, RTOL = 5e-4, 1e-4
PARTS = [1, ("image", (1, 6, 4)), 2, ("video", (3, 4, 4)), 3, 4]


def test_check_media_and_encode_work_report_the_units(vision_case):
    case = vision_case("dense")
    prompt = media_prompt(PARTS, seed=3)
    p = make_vision_program(case)
    image, video = prompt.media
    assert p.check_media(prompt.tokens, None, prompt.media) == (24, 16, 16, 16)
    assert p.capacity().free_state_slots == 4                      # nothing opened
    with pytest.raises(ProgramError, match="placeholder token"):
        p.check_media(prompt.tokens, None, [video.__class__(**{**video.__dict__, "token_id": image.token_id})])
    seq = p.open_sequence(prompt.tokens, media=prompt.media)
    n = len(prompt.tokens)
    (ia, ib), = image.spans
    spans = video.spans
    assert p.encode_work(seq, n) == ((ia, 24), (spans[0][0], 16), (spans[1][0], 16), (spans[2][0], 16))
    assert p.encode_work(seq, ia) == ()                            # a chunk that stops before the image
    assert all(p.reserve_units({seq: n}).values())
    p.score_chunk(seq, ia + 2, logits=False)                       # into the image: encoded, kept
    assert p.encode_work(seq, n) == ((spans[0][0], 16), (spans[1][0], 16), (spans[2][0], 16))
    p.score_chunk(seq, spans[1][0] + 1 - (ia + 2), logits=False)   # past the image, into the second frame
    assert p.encode_work(seq, n) == ((spans[2][0], 16),)
    # A sequence opened again (a Replay) from inside the second frame needs it encoded again, at its start.
    handle_free = make_vision_program(case, checkpoint_slots=1)
    first = handle_free.open_sequence(prompt.tokens, media=prompt.media)
    assert all(handle_free.reserve_units({first: n}).values())
    handle_free.score_chunk(first, spans[1][0] + 3, logits=False)
    ckpt = handle_free.capture_checkpoint(first)
    again = handle_free.open_sequence_from(ckpt, prompt.tokens, media=prompt.media)
    assert handle_free.encode_work(again, n) == ((spans[1][0] + 3, 16), (spans[2][0], 16))


def test_a_video_encoded_one_temporal_patch_per_chunk_matches_transformers(vision_case):
    case = vision_case("dense")
    prompt = media_prompt(PARTS, seed=5)
    case.hf.model.rope_deltas = None
    with torch.no_grad():
        ref = case.hf(**prompt.hf_inputs).logits[0].float()
    p = make_vision_program(case)
    calls = []
    encode = p.tower.encode
    p.tower.encode = lambda pixels, grids: calls.append(list(grids)) or encode(pixels, grids)
    seq = p.open_sequence(prompt.tokens, media=prompt.media)
    n = len(prompt.tokens)
    assert all(p.reserve_units({seq: n}).values())
    cuts = [a + 1 for a, _ in prompt.media[1].spans] + [n]         # each chunk reaches one more video frame
    logits, at = [], 0
    for cut in cuts:
        logits.append(p.score_chunk(seq, cut - at))
        at = cut
    ours = torch.cat(logits)
    assert calls == [[(1, 6, 4), (1, 4, 4)], [(1, 4, 4)], [(1, 4, 4)]]
    err = (ours - ref).abs().max().item()
    assert torch.allclose(ours, ref, atol=ATOL, rtol=RTOL), f"max err {err:.2e}"
    assert not p._media[seq].embeddings                            # every unit consumed and released
