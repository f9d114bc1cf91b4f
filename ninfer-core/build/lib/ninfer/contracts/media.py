"""Media in a prompt: an image or a video, already preprocessed, and the placeholder tokens it fills.

A multimodal prompt is an ordinary token sequence in which runs of a placeholder token stand for a medium's
embeddings; a :class:`MediaInput` carries the medium's encoder input and names those runs. The architecture
encodes it (its own vision tower), replaces the placeholder embeddings by the encoder's output rows in order, and
gives the tokens whatever positions it defines. Core only carries media from the request to the Program
(``Program.open_sequence(..., media=...)``); what ``pixels`` and ``grid`` mean is the architecture's (and its
frontend's, which produces them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ninfer.contracts.program import ProgramError

if TYPE_CHECKING:
    import torch

MediaKind = Literal["image", "video"]


@dataclass(frozen=True)
class MediaInput:
    """One medium of a prompt.

    - ``kind``: ``"image"`` or ``"video"``.
    - ``pixels``: the encoder's input, in the layout the architecture's frontend defines (for Qwen3.5: float32
      ``[t*h*w, C*Tp*P*P]`` patch rows), on the host.
    - ``grid``: the medium's patch grid, positive ints (for Qwen3.5: ``(t, h, w)`` in patches).
    - ``digest``: a stable digest of ``pixels`` and ``grid`` (two media with one digest encode identically), what
      a cache keys a prompt's media by; never compared to the pixels here.
    - ``token_id``: the placeholder token the spans hold.
    - ``spans``: the ledger ranges ``[start, end)`` of placeholder tokens the medium's embeddings fill, in order:
      non-empty, increasing and disjoint (a video may fill several runs, e.g. one per frame, separated by text).

    Invariants checked here: the above shapes of the fields. Checked by the Program: the spans lie in the prompt,
    hold ``token_id`` only, do not overlap another medium's, and their total length is the number of embeddings
    the encoder makes of ``pixels``. Equality and hashing ignore ``pixels`` (``digest`` stands for them).
    """

    kind: MediaKind
    pixels: torch.Tensor = field(compare=False, repr=False)
    grid: tuple[int, ...]
    digest: str
    token_id: int
    spans: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if self.kind not in ("image", "video"):
            raise ProgramError(f"media kind {self.kind!r} is not 'image' or 'video'")
        if not self.grid or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in self.grid):
            raise ProgramError(f"{self.kind} grid {self.grid!r} must be positive integers")
        if not isinstance(self.digest, str) or not self.digest:
            raise ProgramError(f"{self.kind} digest must be a non-empty string")
        if isinstance(self.token_id, bool) or not isinstance(self.token_id, int) or self.token_id < 0:
            raise ProgramError(f"{self.kind} placeholder token id {self.token_id!r} must be an int >= 0")
        if not self.spans:
            raise ProgramError(f"{self.kind} fills no placeholder span")
        end = 0
        for span in self.spans:
            if (len(span) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in span)
                    or not end <= span[0] < span[1]):
                raise ProgramError(f"{self.kind} spans {self.spans!r} must be non-empty [start, end) ranges, "
                                   f"increasing and disjoint")
            end = span[1]

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens (= embeddings) the medium fills."""
        return sum(b - a for a, b in self.spans)
