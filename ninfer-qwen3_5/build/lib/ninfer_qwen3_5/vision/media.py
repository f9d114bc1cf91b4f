"""One sequence's media: checked against its prompt, its MRoPE positions, and its embeddings while they are needed.

:func:`sequence_media` checks a prompt's :class:`~ninfer.contracts.media.MediaInput` list against the prompt
tokens and the tower's config (a :class:`MediaError` naming the medium and the problem otherwise):

- an image's placeholder is ``image_token_id`` and it fills one span of ``t * h/m * w/m`` tokens; a video's is
  ``video_token_id`` and it fills ``t`` spans of ``h/m * w/m`` tokens, one per temporal patch (its frames, which
  Qwen3.5 separates by timestamps);
- its grid is ``(t, h, w)`` with h and w multiples of the merge size ``m``, its pixels ``[t*h*w, C*Tp*P*P]``;
- its spans lie inside the prompt, hold only its placeholder token, and no two media's spans overlap.

:class:`SequenceMedia` then holds the prompt's positions (:mod:`.positions`; tokens past the prompt are at
``index + delta``), and each medium's embeddings from the first chunk that needs them until a chunk has passed
its last span (:meth:`SequenceMedia.consumed_before`), so a prompt prefilled in several chunks encodes each
medium once, even when a chunk boundary falls inside a span.

Encode units: each span is one unit of encoder work (an image; one temporal patch of a video, which the tower
attends to on its own), encoded when a chunk first reaches it and kept until a chunk has passed it. The engine
bounds a step's encoder work by cutting chunks before a unit (:meth:`SequenceMedia.work`), so a long video is
encoded over several steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from ninfer.contracts.media import MediaInput
from ninfer.contracts.program import ProgramError

from ninfer_qwen3_5.vision.config import VisionConfig
from ninfer_qwen3_5.vision.grid import check_grid
from ninfer_qwen3_5.vision.positions import VisionRun, rope_positions


class MediaError(ProgramError):
    """A prompt's media do not fit its tokens or the model's tower; the message names the medium and the field."""


Unit = tuple[int, int]   # (medium index, span index): one encode unit


@dataclass(frozen=True)
class Placement:
    """The part of encode unit ``unit`` that tokens ``[start, end)`` of a chunk hold: its embedding rows
    ``[row, row + end - start)``."""

    unit: Unit
    start: int
    end: int
    row: int


def unit_grid(m: MediaInput, span: int) -> tuple[tuple[int, int, int], int]:
    """(patch grid, first pixel row) of span ``span`` of ``m``: the whole medium for an image (one span), one
    temporal patch for a video."""
    t, h, w = m.grid
    if m.kind == "image":
        return (t, h, w), 0
    return (1, h, w), span * h * w


@dataclass
class SequenceMedia:
    """A sequence's checked media (see the module docstring). ``positions``: int64 ``[3, prompt_length]``;
    ``delta``: the rope delta of every token past the prompt; ``embeddings``: encode unit -> its rows (run dtype,
    on the device) while a chunk still needs them."""

    media: tuple[MediaInput, ...]
    prompt_length: int
    positions: torch.Tensor
    delta: int
    embeddings: dict[Unit, torch.Tensor] = field(default_factory=dict)

    def work(self, start: int, end: int) -> list[tuple[int, int]]:
        """``(at, pixel rows)`` of each unit ledger tokens ``[start, end)`` reach that holds no embeddings yet,
        in token order; ``at`` is the first of those tokens inside the unit."""
        out = []
        for i, m in enumerate(self.media):
            for j, (a, b) in enumerate(m.spans):
                if a < end and b > start and (i, j) not in self.embeddings:
                    (t, h, w), _ = unit_grid(m, j)
                    out.append((max(a, start), t * h * w))
        return sorted(out)

    def chunk_positions(self, start: int, end: int) -> torch.Tensor:
        """int64 ``[3, end - start]``: the positions of ledger tokens ``[start, end)``."""
        cut = min(max(start, 0), self.prompt_length)
        inside = self.positions[:, cut:min(end, self.prompt_length)]
        past = torch.arange(max(start, self.prompt_length), max(end, self.prompt_length), dtype=torch.int64) + self.delta
        return torch.cat((inside, past.expand(3, -1)), dim=1)

    def placements(self, start: int, end: int) -> list[Placement]:
        """The media rows ledger tokens ``[start, end)`` hold, in token order."""
        out = []
        for i, m in enumerate(self.media):
            for j, (a, b) in enumerate(m.spans):
                lo, hi = max(a, start), min(b, end)
                if lo < hi:
                    out.append(Placement((i, j), lo, hi, lo - a))
        return sorted(out, key=lambda p: p.start)

    def consumed_before(self, end: int) -> None:
        """Forget the embeddings of every unit whose span ends at or before ledger index ``end``."""
        for u in [u for u in self.embeddings if self.media[u[0]].spans[u[1]][1] <= end]:
            del self.embeddings[u]


def vision_runs(media: Sequence[MediaInput], cfg: VisionConfig) -> list[VisionRun]:
    """The runs of ``media`` (already checked), in prompt order."""
    runs = []
    for m in media:
        t, h, w = m.grid
        if m.kind == "image":
            runs.append(VisionRun(m.spans[0][0], (t, h, w), cfg.spatial_merge_size))
        else:
            runs.extend(VisionRun(a, (1, h, w), cfg.spatial_merge_size) for a, _ in m.spans)
    return sorted(runs, key=lambda r: r.start)


def _check(i: int, m: MediaInput, tokens: Sequence[int], prompt_length: int, cfg: VisionConfig) -> None:
    if not isinstance(m, MediaInput):
        raise MediaError(f"media item {i} is {type(m).__name__}, not a MediaInput")
    what = f"{m.kind} {i}"
    try:
        t, h, w = check_grid(m.grid, cfg.spatial_merge_size, f"{what} grid")
    except ValueError as exc:
        raise MediaError(str(exc)) from None
    token = cfg.image_token_id if m.kind == "image" else cfg.video_token_id
    if m.token_id != token:
        raise MediaError(f"{what}: placeholder token {m.token_id} is not this model's {m.kind} token {token}")
    px = m.pixels
    if not isinstance(px, torch.Tensor) or not px.dtype.is_floating_point or tuple(px.shape) != (
            t * h * w, cfg.patch_values):
        got = (tuple(px.shape), px.dtype) if isinstance(px, torch.Tensor) else type(px).__name__
        raise MediaError(f"{what}: pixels must be a float tensor [{t * h * w}, {cfg.patch_values}] (t*h*w rows of "
                         f"C*Tp*P*P values for grid {m.grid}), got {got}")
    frame = h * w // cfg.merge_unit
    want = [t * frame] if m.kind == "image" else [frame] * t
    got = [b - a for a, b in m.spans]
    if got != want:
        raise MediaError(f"{what}: spans of {got} tokens; grid {m.grid} needs {want} "
                         f"({'one span' if m.kind == 'image' else 'one span per temporal patch'})")
    if m.spans[-1][1] > prompt_length:
        raise MediaError(f"{what}: span {m.spans[-1]} ends past the prompt of {prompt_length} tokens")
    for a, b in m.spans:
        if any(tok != token for tok in tokens[a:b]):
            raise MediaError(f"{what}: span [{a}, {b}) holds tokens other than its placeholder {token}")


def sequence_media(tokens: Sequence[int], prompt_length: int, media: Sequence[MediaInput],
                   cfg: VisionConfig) -> SequenceMedia:
    """Check ``media`` against the prompt ``tokens[:prompt_length]`` (module docstring) and compute the
    positions. Nothing is encoded yet."""
    media = tuple(media)
    for i, m in enumerate(media):
        _check(i, m, tokens, prompt_length, cfg)
    spans = sorted((a, b, i) for i, m in enumerate(media) for a, b in m.spans)
    for (_, b, i), (a, _, j) in zip(spans, spans[1:], strict=False):
        if a < b:
            raise MediaError(f"the spans of {media[i].kind} {i} and {media[j].kind} {j} overlap")
    positions, delta = rope_positions(prompt_length, vision_runs(media, cfg))
    return SequenceMedia(media=media, prompt_length=prompt_length, positions=positions, delta=delta)
