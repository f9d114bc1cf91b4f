"""Multimodal RoPE positions of a prompt: three axes (T, H, W) per token, and the rope delta of what follows.

A prompt is text with *vision runs*: a run is the consecutive placeholder tokens of one image, or of one video
frame (a video of ``t`` temporal patches fills ``t`` runs of grid ``(1, h, w)``, separated by timestamp text, as
Qwen3.5 writes them). Walking the prompt with a running position ``p`` (0 at the start):

- a text token gets ``(p, p, p)`` and advances ``p`` by one;
- a run of patch grid ``(t, h, w)`` (merge size ``m``; ``t * h/m * w/m`` tokens, in (t, row, col) order) gets
  ``(p + i, p + r, p + c)`` for its token at temporal index i, merged row r and column c, and advances ``p`` by
  ``max(h, w) / m`` (not by its token count: a run's positions are 2-D);
- the *rope delta* is ``max(all positions) + 1 - prompt length``: every later token (the generated ones, and a
  Replay's ledger past the prompt) at ledger index ``j`` is at ``(j + delta)`` on all three axes.

This is transformers' ``Qwen3_5Model.get_rope_index`` (its videos split per frame, ``time_interval`` 1) with the
runs given explicitly instead of found by grouping ``mm_token_type_ids``; a text-only prompt is ``(j, j, j)``
with delta 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer_qwen3_5.vision.grid import Grid


@dataclass(frozen=True)
class VisionRun:
    """The placeholder tokens ``[start, start + length)`` of one image or video frame of patch grid ``grid``."""

    start: int
    grid: Grid
    merge: int

    @property
    def merged(self) -> tuple[int, int, int]:
        t, h, w = self.grid
        return t, h // self.merge, w // self.merge

    @property
    def length(self) -> int:
        t, h, w = self.merged
        return t * h * w

    @property
    def end(self) -> int:
        return self.start + self.length


def rope_positions(length: int, runs: Sequence[VisionRun]) -> tuple[torch.Tensor, int]:
    """(int64 ``[3, length]`` positions of a prompt of ``length`` tokens with vision ``runs``, rope delta).
    The runs must be in order, disjoint and inside the prompt (ValueError naming the run otherwise)."""
    pos = torch.empty((3, length), dtype=torch.int64)
    at, p = 0, 0          # next token index, next position
    for k, run in enumerate(runs):
        if run.start < at or run.end > length:
            raise ValueError(f"vision run {k} [{run.start}, {run.end}) overlaps the previous one or leaves the "
                             f"prompt of {length} tokens")
        text = run.start - at
        pos[:, at:run.start] = torch.arange(p, p + text, dtype=torch.int64)
        p += text
        t, h, w = run.merged
        ti, hi, wi = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        pos[:, run.start:run.end] = torch.stack((ti, hi, wi)).reshape(3, -1) + p
        p += max(h, w)
        at = run.end
    pos[:, at:] = torch.arange(p, p + length - at, dtype=torch.int64)
    delta = int(pos.max()) + 1 - length if length else 0
    return pos, delta
