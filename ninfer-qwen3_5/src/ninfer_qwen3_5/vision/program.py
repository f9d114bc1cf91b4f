"""The Program side of vision, shared by every architecture that takes Qwen3.5's tower (Qwen3.5, Qwen3.5-MoE,
Qwen4-Exp): :class:`MediaProgram`, a mixin for a :class:`~ninfer.program.model.ModelProgram` subclass.

What it adds to the Program: the tower (built by :meth:`MediaProgram.build_vision` when
``ProgramInit.features.vision`` is on), media taken with a prompt (:meth:`MediaProgram.open_sequence`, checked
against the prompt first), the encode work of a chunk (:meth:`MediaProgram.encode_work`), and a forward whose chunks
of a sequence with media give the model their tokens' three MRoPE axes and the media embeddings over the
placeholders (:meth:`MediaProgram.forward`, through :mod:`ninfer_qwen3_5.vision.inputs`). A decode row of such a
sequence is at ``index + delta`` on all three axes; the delta is the StateImage field ``rope_delta``
(:mod:`ninfer_qwen3_5.state`), so decode graphs and lookahead steps read it on the device and checkpoints keep it:
the host class's ``forward_packed`` calls :meth:`MediaProgram.media_decode_context`.

The host class's model must take ``forward(tokens, ctx, logit_rows, *, positions3=, media_rows=)`` and have
``multimodal_sections`` (the three MRoPE sections) and the host class sets ``self.model`` before
:meth:`build_vision`. Only the engine worker calls these methods (the Program's ownership rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from ninfer.contracts.architecture import ProgramInit
from ninfer.contracts.media import MediaInput
from ninfer.contracts.program import ProgramError, SeqId
from ninfer.program.batch import ForwardBatch, PackedBatch, pack_batch

from ninfer_qwen3_5.state import ROPE_DELTA
from ninfer_qwen3_5.vision.config import VisionConfig
from ninfer_qwen3_5.vision.inputs import media_step, release_consumed
from ninfer_qwen3_5.vision.media import MediaError, SequenceMedia, sequence_media
from ninfer_qwen3_5.vision.tower import VisionTower


class MediaProgram:
    """Media for a ModelProgram (module docstring). Without :meth:`build_vision` the Program takes no media (a
    MediaError names why) and every method falls through to the base's behaviour."""

    tower: VisionTower | None = None
    vision_cfg: VisionConfig | None = None
    rope_delta: torch.Tensor | None = None     # int64 [state slots, 1]: the StateImages' rope deltas

    def build_vision(self, init: ProgramInit, vocab_size: int, rotary_dim: int) -> None:
        """The tower from ``init`` (its ``vision/*`` weights, the text config's ``vision_config``), checked against
        the text model: MRoPE sections that cover its ``rotary_dim`` and placeholder ids inside ``vocab_size``."""
        self._media: dict[SeqId, SequenceMedia] = {}
        vision = init.config.get("vision_config")
        if vision is None:
            raise ProgramError("vision is on but the text config has no vision_config (an artifact without a "
                               "vision tower, or converted before ninfer stored it: re-convert)")
        self.vision_cfg = vcfg = VisionConfig.from_compact(vision)
        sections, half = self.model.multimodal_sections, rotary_dim // 2
        if len(sections) != 3 or sum(sections) != half:
            raise ProgramError(f"mrope_section {list(sections)} must be three sizes summing to the {half} rotary "
                               f"frequencies for multimodal positions")
        bad = [t for t in (vcfg.image_token_id, vcfg.video_token_id) if not 0 <= t < vocab_size]
        if bad:
            raise ProgramError(f"vision placeholder token ids {bad} are outside the vocabulary of {vocab_size}")
        self.tower = VisionTower(vcfg, init.weights, init.ops, self.device, init.options.dtype)
        self.rope_delta = self.states.field(ROPE_DELTA)

    @property
    def _sequence_media(self) -> dict[SeqId, SequenceMedia]:
        return getattr(self, "_media", {})

    def open_sequence(self, tokens: Sequence[int], prompt_length: int | None = None,
                      media: Sequence[MediaInput] = ()) -> SeqId:
        """As the base; ``media`` (images and videos, :mod:`ninfer_qwen3_5.vision.media`) are checked against
        the prompt first, and need the vision tower (a MediaError otherwise)."""
        checked = self._check_media(tokens, prompt_length, media)
        seq = super().open_sequence(tokens, prompt_length)
        self._bind_media(seq, checked)
        return seq

    def open_sequence_from(self, checkpoint, tokens: Sequence[int], prompt_length: int | None = None,
                           media: Sequence[MediaInput] = ()) -> SeqId:
        checked = self._check_media(tokens, prompt_length, media)
        seq = super().open_sequence_from(checkpoint, tokens, prompt_length)
        self._bind_media(seq, checked)
        return seq

    def check_media(self, tokens: Sequence[int], prompt_length: int | None,
                    media: Sequence[MediaInput]) -> tuple[int, ...]:
        """As :meth:`open_sequence` checks them (nothing opened); the pixel rows of each span, in token order (a
        span is one encode unit: an image, or one temporal patch of a video)."""
        checked = self._check_media(tokens, prompt_length, media)
        return () if checked is None else tuple(rows for _, rows in checked.work(0, checked.prompt_length))

    def encode_work(self, seq: SeqId, end: int) -> tuple[tuple[int, int], ...]:
        start = self.computed(seq)
        m = self._sequence_media.get(seq)
        return () if m is None or end <= start else tuple(m.work(start, end))

    def _check_media(self, tokens: Sequence[int], prompt_length: int | None, media: Sequence[MediaInput]
                     ) -> SequenceMedia | None:
        if not media:
            return None
        if self.tower is None:
            raise MediaError(f"this model was started without a vision tower, so it takes no images or videos "
                             f"(got {len(media)}): its artifact has none, or vision is off")
        tokens = list(tokens)
        return sequence_media(tokens, len(tokens) if prompt_length is None else int(prompt_length), media,
                              self.vision_cfg)

    def _bind_media(self, seq: SeqId, checked: SequenceMedia | None) -> None:
        if self.rope_delta is not None:
            # Every open sets it: a sequence opened from a checkpoint starts from the checkpoint's image.
            self.states.slot_field(ROPE_DELTA, self._seqs[seq].slot).fill_(checked.delta if checked else 0)
        if checked is not None:
            self._media[seq] = checked

    def _free(self, seq: SeqId, s) -> None:
        self._sequence_media.pop(seq, None)
        super()._free(seq, s)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """As the base, except a call with a chunk of a sequence with media: its tokens' three position axes and
        its media embeddings (encoded by the tower when a chunk first needs them) go to the model
        (:mod:`ninfer_qwen3_5.vision.inputs`)."""
        media = self._sequence_media
        if self.tower is None or not any(c.seq in media for c in batch.chunks):
            return super().forward(batch)
        step = media_step(batch, media, self.tower, self.device)
        packed = pack_batch(batch, self.device)
        logits = self.model.forward(packed.tokens, self.step_context(packed), packed.logit_rows,
                                    positions3=step.positions, media_rows=step.rows)
        release_consumed(batch, media)
        return logits

    def media_decode_context(self, batch: PackedBatch, ctx):
        """``ctx`` with the decode rows of a vision Program at ``index + delta``: the delta is a StateImage field,
        so it is also rewritten in each row's out slot like every other (a lookahead step's spare). Device-side
        only, so decode graphs capture it. Unchanged without vision or decode rows."""
        if self.rope_delta is None or not batch.num_decode:
            return ctx
        b = batch.num_decode
        delta = self.rope_delta.index_select(0, batch.decode_slots)
        self.rope_delta.index_copy_(0, batch.decode_out_slots, delta)
        return replace(ctx, positions=torch.cat((batch.positions[:b] + delta[:, 0], batch.positions[b:])))
