"""StateImage slot storage: each sequence's recurrent state as one contiguous image.

An architecture declares a :class:`StateLayout` (named fields, shapes, dtypes). The storage holds
``num_slots`` images in one ``uint8 [num_slots, image_bytes]`` buffer; every field is a typed view
``[num_slots, *shape]`` into it, so a slot's whole image is one contiguous byte range (a full copy
or a Host replica is one copy of that range, in the same layout).

Invariants:
- Field offsets are aligned to ``StateLayout.alignment`` bytes and fields never overlap.
- A slot is either free or owned by exactly one holder; :meth:`StateImageStorage.allocate` hands out
  a slot whose image is native-initialised (all zeros, every field: an architecture whose initial state is not zero cannot use this storage as is).
- Reserve (allocate), native init, and writes by ops are distinct actions; init happens only here.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from ninfer.errors import NInferError


class StateImageError(NInferError):
    """A slot operation broke the ownership rules, or a layout is invalid."""


@dataclass(frozen=True)
class StateField:
    """One field of a state image, e.g. ``layers/0/conv`` of shape ``(C, K-1)``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateLayout:
    """The ordered fields of one image; ``offsets`` and ``image_bytes`` follow from them."""

    fields: tuple[StateField, ...]
    alignment: int = 256

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise StateImageError(f"state layout has duplicate field names: {names}")

    def offsets(self) -> dict[str, int]:
        out, pos = {}, 0
        for f in self.fields:
            out[f.name] = pos
            pos += -(-f.nbytes // self.alignment) * self.alignment
        return out

    @property
    def image_bytes(self) -> int:
        # Aligned end of the last field; at least one alignment unit so an empty layout is still valid.
        total = sum(-(-f.nbytes // self.alignment) * self.alignment for f in self.fields)
        return max(total, self.alignment)


class StateImageStorage:
    """``num_slots`` state images on one device, a slot allocator, and typed field views."""

    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device) -> None:
        if num_slots < 1:
            raise StateImageError(f"state storage needs at least one slot, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.device = torch.device(device)
        self._raw = torch.zeros((num_slots, layout.image_bytes), dtype=torch.uint8, device=self.device)
        offsets = layout.offsets()
        self._views: dict[str, torch.Tensor] = {}
        for f in layout.fields:
            off = offsets[f.name]
            view = self._raw[:, off: off + f.nbytes].view(f.dtype).view(num_slots, *f.shape)
            self._views[f.name] = view
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def field(self, name: str) -> torch.Tensor:
        """The field across all slots, ``[num_slots, *shape]`` (ops index it with slot ids)."""
        return self._views[name]

    def slot_field(self, name: str, slot: int) -> torch.Tensor:
        """One slot's field, ``[*shape]``: a view, writes land in the image."""
        self._check_owned(slot)
        return self._views[name][slot]

    def image(self, slot: int) -> torch.Tensor:
        """The slot's whole image as ``uint8 [image_bytes]`` (a view)."""
        self._check_owned(slot)
        return self._raw[slot]

    def allocate(self) -> int | None:
        """A native-initialised slot, or None when all are taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        self.init_native(slot)
        return slot

    def init_native(self, slot: int) -> None:
        """Reset the slot to the architecture's initial state (zeros for every declared field)."""
        self._check_owned(slot)
        self._raw[slot].zero_()

    def copy_image(self, src: int, dst: int) -> None:
        """Full copy of one image onto another: one contiguous copy."""
        self._check_owned(src)
        self._check_owned(dst)
        self._raw[dst].copy_(self._raw[src])

    def copy_image_to(self, src: int, dst_storage: StateImageStorage, dst: int) -> None:
        """Full copy of this storage's image ``src`` onto ``dst`` of another storage with the same
        layout (e.g. a checkpoint pool): one contiguous copy."""
        if dst_storage.layout != self.layout:
            raise StateImageError("state images can only be copied between storages of the same layout")
        self._check_owned(src)
        dst_storage._check_owned(dst)
        dst_storage._raw[dst].copy_(self._raw[src])

    def copy_images_to(self, src: torch.Tensor, dst_storage: StateImageStorage, dst: torch.Tensor) -> None:
        """Copy images ``src[i]`` of this storage onto ``dst[i]`` of another storage with the same layout; ``src``
        and ``dst`` are int64 slot tensors on the device, so the copy is CUDA-graph capturable (the slots are a
        graph's inputs). No ownership check: the caller owns every slot named (a graph replays with new slots)."""
        if dst_storage.layout != self.layout:
            raise StateImageError("state images can only be copied between storages of the same layout")
        # Whole images as int64 words when they divide evenly: byte-wide indexing of multi-MB rows is far slower.
        word = torch.int64 if self.layout.image_bytes % 8 == 0 else torch.uint8
        dst_storage._raw.view(word).index_copy_(0, dst, self._raw.view(word).index_select(0, src))

    def load_image(self, slot: int, image: torch.Tensor) -> None:
        """Overwrite the slot's whole image with ``image`` (``uint8 [image_bytes]`` on any device,
        e.g. a Host copy made from :meth:`image`): one contiguous copy."""
        self._check_owned(slot)
        if image.dtype != torch.uint8 or tuple(image.shape) != (self.layout.image_bytes,):
            raise StateImageError(f"an image of {image.dtype} {tuple(image.shape)} does not fit this layout's "
                                  f"uint8 ({self.layout.image_bytes},)")
        self._raw[slot].copy_(image)

    @property
    def image_bytes(self) -> int:
        return self.layout.image_bytes

    def free(self, slot: int) -> None:
        self._check_owned(slot)
        self._used.remove(slot)
        self._free.append(slot)

    def _check_owned(self, slot: int) -> None:
        if slot not in self._used:
            raise StateImageError(f"state slot {slot} is not allocated")
