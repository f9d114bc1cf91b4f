"""MRoPE positions of multimodal prompts against transformers' ``get_rope_index`` (and the media checks that
precede them): interleaved text, several images of odd grids, videos split per frame, a prompt that ends in an
image; the rope delta; positions past the prompt; a chunk's slice of them."""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.media import MediaInput
from ninfer.contracts.program import ProgramError
from ninfer_qwen3_5.vision.config import VisionConfig
from ninfer_qwen3_5.vision.media import MediaError, sequence_media

from .vision_harness import IMAGE, VIDEO, media_prompt

PROMPTS = {
    "image": [1, 2, ("image", (1, 6, 10)), 3, 4, 5],
    "images": [7, ("image", (1, 4, 4)), 8, 9, ("image", (1, 10, 6)), ("image", (1, 2, 2)), 10],
    "video": [11, ("video", (3, 4, 6)), 12, 13],
    "image_video": [1, ("image", (1, 6, 4)), 2, ("video", (2, 2, 8)), 3, ("image", (1, 8, 2)), 4, 5],
    "ends_in_image": [1, 2, 3, ("image", (1, 4, 8))],
    "text": [5, 6, 7, 8],
}


def _hf_positions(case, prompt):
    x = prompt.hf_inputs
    pos, delta = case.hf.model.get_rope_index(x["input_ids"], x["mm_token_type_ids"], x.get("image_grid_thw"),
                                              x.get("video_grid_thw"))
    return pos[:, 0], int(delta[0, 0])


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_positions_and_delta_match_get_rope_index(vision_case, name):
    case = vision_case("dense")
    prompt = media_prompt(PROMPTS[name], seed=1)
    cfg = VisionConfig.from_compact(case.config["vision_config"])
    if not prompt.media:
        ref = torch.arange(len(prompt.tokens)).expand(3, -1)
        ref_delta = 0
    else:
        ref, ref_delta = _hf_positions(case, prompt)
    seq = sequence_media(prompt.tokens, len(prompt.tokens), prompt.media, cfg)
    assert torch.equal(seq.positions, ref), name
    assert seq.delta == ref_delta
    if prompt.media:
        assert ref_delta < 0    # images compress positions
    # Past the prompt every axis is index + delta (HF's decode: cache length + rope delta).
    n = len(prompt.tokens)
    assert torch.equal(seq.chunk_positions(n, n + 3), (torch.arange(n, n + 3) + ref_delta).expand(3, -1))
    # Any chunk's slice, also one that starts inside a span and runs past the prompt.
    for a, b in ((0, n), (3, 11), (n - 2, n + 2)):
        assert torch.equal(seq.chunk_positions(a, b)[:, : max(0, min(b, n) - a)], ref[:, a:min(b, n)])


def test_placements_name_the_embedding_rows_a_chunk_holds(vision_case):
    cfg = VisionConfig.from_compact(vision_case("dense").config["vision_config"])
    prompt = media_prompt([1, ("image", (1, 4, 4)), 2, ("video", (2, 2, 4))])
    seq = sequence_media(prompt.tokens, len(prompt.tokens), prompt.media, cfg)
    (a, b), = prompt.media[0].spans
    (c, d), (e, f) = prompt.media[1].spans
    # Units are spans: the image, then each temporal patch of the video (rows counted within the span).
    assert [(p.unit, p.start, p.end, p.row) for p in seq.placements(a + 1, e + 1)] == [
        ((0, 0), a + 1, b, 1), ((1, 0), c, d, 0), ((1, 1), e, e + 1, 0)]
    seq.embeddings = {(0, 0): torch.zeros(4, 64), (1, 0): torch.zeros(2, 64), (1, 1): torch.zeros(2, 64)}
    seq.consumed_before(d)
    assert list(seq.embeddings) == [(1, 1)]
    seq.consumed_before(f)
    assert not seq.embeddings


def _medium(**over):
    prompt = media_prompt([1, ("image", (1, 4, 4)), 2])
    m = prompt.media[0]
    fields = dict(kind=m.kind, pixels=m.pixels, grid=m.grid, digest=m.digest, token_id=m.token_id, spans=m.spans)
    fields.update(over)
    return prompt.tokens, MediaInput(**fields)


@pytest.mark.parametrize("over, message", [
    (dict(token_id=VIDEO), "placeholder token 501 is not this model's image token 500"),
    (dict(grid=(1, 4, 6)), "pixels must be a float tensor [24, 96]"),
    (dict(grid=(1, 3, 4)), "multiples of the spatial merge size"),
    (dict(pixels=torch.zeros(16, 95)), "pixels must be a float tensor [16, 96]"),
    (dict(spans=((2, 5),)), "spans of [3] tokens; grid (1, 4, 4) needs [4]"),
    (dict(spans=((1, 5),)), "holds tokens other than its placeholder"),
    (dict(spans=((8, 12),)), "ends past the prompt"),
])
def test_media_that_do_not_fit_the_prompt_are_refused_naming_the_problem(vision_case, over, message):
    cfg = VisionConfig.from_compact(vision_case("dense").config["vision_config"])
    tokens, m = _medium(**over)
    with pytest.raises(MediaError, match=__import__("re").escape(message)):
        sequence_media(tokens, len(tokens), [m], cfg)


def test_overlapping_media_and_malformed_inputs_are_refused(vision_case):
    cfg = VisionConfig.from_compact(vision_case("dense").config["vision_config"])
    tokens, m = _medium()
    with pytest.raises(MediaError, match="overlap"):
        sequence_media(tokens, len(tokens), [m, m], cfg)
    with pytest.raises(ProgramError, match="increasing and disjoint"):
        _medium(spans=((2, 4), (3, 6)))
    with pytest.raises(ProgramError, match="not 'image' or 'video'"):
        _medium(kind="audio")
    assert IMAGE in tokens
