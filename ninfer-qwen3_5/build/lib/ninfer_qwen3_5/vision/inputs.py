"""One model call's multimodal inputs: every token's three MRoPE position axes, and the media embeddings that
replace placeholder embeddings, for a batch of decode rows and chunks laid out as one token sequence (decode rows
first, then the chunks in order: :class:`~ninfer.program.batch.PackedBatch`).

Positions: a decode row at ledger index ``at`` is at ``at + delta`` on all three axes (``delta`` its sequence's
rope delta, 0 without media); a chunk's tokens take their sequence's prompt positions
(:meth:`~ninfer_qwen3_5.vision.media.SequenceMedia.chunk_positions`), a text sequence's chunk its indices.

Embeddings: the encode units a chunk's tokens fill (:meth:`~ninfer_qwen3_5.vision.media.SequenceMedia.placements`:
an image, or one temporal patch of a video) are encoded, those not yet encoded all in one tower call (a batch
across sequences; consecutive temporal patches of one video as one grid), and kept on their sequence until a chunk
has passed them: a chunk boundary inside a span reuses the rows encoded for the chunk before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from ninfer.contracts.program import SeqId
from ninfer.program.batch import ForwardBatch

from ninfer_qwen3_5.vision.media import SequenceMedia, Unit, unit_grid
from ninfer_qwen3_5.vision.tower import VisionTower


@dataclass(frozen=True)
class MediaStep:
    """``positions`` int64 ``[3, N]``; ``rows`` (None: no placeholder in the call): token indices int64 ``[M]``
    and their embeddings ``[M, H]`` (run dtype), both on the device."""

    positions: torch.Tensor
    rows: tuple[torch.Tensor, torch.Tensor] | None


def _to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the stream (pinned, non-blocking on CUDA)."""
    host = host.contiguous()
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def encode_missing(tower: VisionTower, media: Mapping[SeqId, SequenceMedia], wanted: list[tuple[SeqId, Unit]]
                   ) -> None:
    """Encode the units ``(seq, unit)`` of ``wanted`` that hold no embeddings yet, in one tower call, and keep
    each unit's rows on its sequence. Consecutive temporal patches of one video go in as one grid ``(k, h, w)``
    (the tower attends to each temporal patch on its own, so this equals encoding them apart)."""
    todo = sorted(dict.fromkeys((s, u) for s, u in wanted if u not in media[s].embeddings))
    if not todo:
        return
    groups: list[list[tuple[SeqId, Unit]]] = []
    for s, u in todo:
        last = groups[-1][-1] if groups else None
        if (last is not None and last[0] == s and last[1][0] == u[0] and last[1][1] + 1 == u[1]
                and media[s].media[u[0]].kind == "video"):
            groups[-1].append((s, u))
        else:
            groups.append([(s, u)])
    pixels, grids = [], []
    for g in groups:
        s, (i, j) = g[0]
        m = media[s].media[i]
        (t, h, w), row = unit_grid(m, j)
        t *= len(g)
        pixels.append(m.pixels[row:row + t * h * w])
        grids.append((t, h, w))
    out = tower.encode(torch.cat(pixels), grids)
    at = 0
    for s, u in todo:
        m = media[s].media[u[0]]
        n = m.spans[u[1]][1] - m.spans[u[1]][0]
        media[s].embeddings[u] = out[at:at + n]
        at += n


def media_step(batch: ForwardBatch, media: Mapping[SeqId, SequenceMedia], tower: VisionTower,
               device: torch.device) -> MediaStep:
    """The call's positions and embedding rows (module docstring); encodes what the chunks need first."""
    d = batch.decode
    cols = []
    if d is not None:
        delta = [media[s].delta if s in media else 0 for s in d.seqs]
        cols.append(torch.tensor([a + x for a, x in zip(d.at, delta, strict=True)], dtype=torch.int64).expand(3, -1))
    placed = []
    at = len(d.seqs) if d is not None else 0
    for c in batch.chunks:
        m = media.get(c.seq)
        if m is None:
            cols.append(torch.arange(c.start, c.kv_len, dtype=torch.int64).expand(3, -1))
        else:
            cols.append(m.chunk_positions(c.start, c.kv_len))
            placed.extend((c.seq, at - c.start, p) for p in m.placements(c.start, c.kv_len))
        at += c.num_tokens
    positions = _to(torch.cat(cols, dim=1), device)
    if not placed:
        return MediaStep(positions, None)
    encode_missing(tower, media, [(s, p.unit) for s, _, p in placed])
    index = [k for _, off, p in placed for k in range(off + p.start, off + p.end)]
    rows = torch.cat([media[s].embeddings[p.unit][p.row:p.row + p.end - p.start] for s, _, p in placed])
    return MediaStep(positions, (_to(torch.tensor(index, dtype=torch.int64), device), rows))


def release_consumed(batch: ForwardBatch, media: Mapping[SeqId, SequenceMedia]) -> None:
    """After a call: forget the embeddings the chunks' sequences no longer need."""
    for c in batch.chunks:
        if c.seq in media:
            media[c.seq].consumed_before(c.kv_len)
