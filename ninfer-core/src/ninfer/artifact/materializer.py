"""The materializer: a LoadPlan -> torch tensors in the stored encoding.

Invariants:
- each parent object is read exactly once, in bounded chunks (``chunk_bytes``), its checksum
  verified over the bytes read (unless ``verify=False``), and held as one tensor per device;
- a parameter that is one contiguous range of one parent is a zero-copy view of that tensor,
  reshaped to the parameter's shape; any other binding (e.g. a row de-interleave) is gathered
  into a new tensor on the parameter's device;
- bytes are never converted: tensors carry the stored format's dtype, words bit-exact; a quantized
  parameter is a :class:`~ninfer.quant.PackedWeight` of plane views of its parent's bytes (never
  decoded, never repacked).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import xxhash

from ninfer.artifact.binder import bind
from ninfer.artifact.errors import PlacementError
from ninfer.artifact.load_plan import LoadPlan, ParentLoad, resolve_load
from ninfer.artifact.reader import DEFAULT_CHUNK_BYTES, ArtifactReader
from ninfer.contracts.architecture import ParameterSpec
from ninfer.errors import NotSupportedError
from ninfer.quant import PackedWeight, packed_view
from ninfer.quant.fp8_row import FORMAT as FP8_ROW


def a8_parameters(reader: ArtifactReader) -> frozenset[str]:
    """Parameters every use of which allows 8-bit activations (``AllowA8``; a parameter with no use: none).
    The materializer marks those stored as fp8 row matrices ``activations="a8"``: their ops quantize
    activations per token to E4M3."""
    policies: dict[str, set[str | None]] = {}
    for u in reader.directory.uses:
        policies.setdefault(u.parameter, set()).add(u.activation_policy)
    return frozenset(name for name, pols in policies.items() if pols == {"AllowA8"})


class Materializer:
    """Reads a plan's parents from ``reader`` and builds the parameter tensors."""

    def __init__(self, reader: ArtifactReader, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 verify: bool = True, progress: Callable[[int, int], None] | None = None,
                 pin_host: bool = False) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.reader = reader
        # Host copies in page-locked memory: a GPU copies them at full bus speed and without blocking the host.
        self.pin_host = pin_host
        self.chunk_bytes = chunk_bytes
        self.verify = verify
        self.progress = progress  # progress(bytes_read, total_bytes), after each parent

    def materialize(self, plan: LoadPlan) -> dict[str, torch.Tensor | PackedWeight]:
        """Tensors by parameter name (see the module docstring for what is a view)."""
        if sys.byteorder != "little":  # contiguous_le_v1 words are little-endian
            raise NotSupportedError("loading .ninfer weights needs a little-endian host")
        if plan.artifact_id != self.reader.artifact_id:
            raise PlacementError(f"{self.reader.path}: the load plan was resolved for artifact "
                                 f"{plan.artifact_id}, this file set is {self.reader.artifact_id}")
        total = sum(p.object.bytes for p in plan.parents)
        done = 0
        resident = {}
        for p in plan.parents:
            resident[p.object.id] = self._load_parent(p)
            done += p.object.bytes
            if self.progress is not None:
                self.progress(done, total)
        out: dict[str, torch.Tensor] = {}
        a8 = a8_parameters(self.reader)
        for load in plan.parameters:
            bp = load.parameter
            if bp.quantized:  # the binder checked: one block of whole rows of one parent
                p = bp.pieces[0]
                view = packed_view(bp.format, resident[p.object.id][load.device], p.object.shape,
                                   p.begin, p.end, bp.shape, bp.name)
                # A8 only for matrices: the MoE op has no A8 product for an expert bank (AllowA8 permits, never
                # requires, 8-bit activations), so a bank stays A16.
                take_a8 = bp.name in a8 and bp.format == FP8_ROW and len(bp.shape) == 2
                out[bp.name] = replace(view, activations="a8") if take_a8 else view
                continue
            slices = [resident[p.object.id][load.device][p.begin:p.end] for p in bp.pieces]
            flat = slices[0] if len(slices) == 1 else torch.cat(slices)
            out[bp.name] = flat.view(bp.shape)
        return out

    def _host_buffer(self, size: int) -> torch.Tensor:
        if self.pin_host:
            try:
                return torch.empty(size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:   # the host would not lock that much: pageable memory works, copies are slower
                self.pin_host = False
        return torch.empty(size, dtype=torch.uint8)

    def _load_parent(self, parent: ParentLoad) -> dict[torch.device, torch.Tensor]:
        """One bounded read of the parent; a flat tensor of the stored dtype on each device."""
        obj = parent.object
        hasher = xxhash.xxh64() if self.verify else None
        cpu = torch.device("cpu")
        out: dict[torch.device, torch.Tensor] = {}
        if cpu in parent.devices:
            host = self._host_buffer(obj.bytes)
            view = memoryview(host.numpy())
            for pos in range(0, obj.bytes, self.chunk_bytes):
                chunk = view[pos:pos + self.chunk_bytes]
                self.reader.read_into(obj.offset + pos, chunk)
                if hasher is not None:
                    hasher.update(chunk)
            if hasher is not None:
                self.reader.check_checksum(obj, hasher.hexdigest())
            out[cpu] = host.view(parent.dtype)
            for dev in parent.devices:
                if dev != cpu:
                    out[dev] = out[cpu].to(dev)
            return out
        # GPU only: stream through one chunk-sized (pinned) staging buffer, never the whole parent.
        targets = {dev: torch.empty(obj.bytes, dtype=torch.uint8, device=dev) for dev in parent.devices}
        size = min(self.chunk_bytes, obj.bytes)
        staging = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        view = memoryview(staging.numpy())
        for pos in range(0, obj.bytes, size):
            n = min(size, obj.bytes - pos)
            self.reader.read_into(obj.offset + pos, view[:n])
            if hasher is not None:
                hasher.update(view[:n])
            for buf in targets.values():
                buf[pos:pos + n].copy_(staging[:n])  # blocking: the staging buffer is reused next chunk
        if hasher is not None:
            self.reader.check_checksum(obj, hasher.hexdigest())
        return {dev: buf.view(parent.dtype) for dev, buf in targets.items()}


def load_weights(reader: ArtifactReader, specs: Sequence[ParameterSpec], device: str | torch.device, *,
                 verify: bool = True, progress: Callable[[int, int], None] | None = None
                 ) -> dict[str, torch.Tensor]:
    """``bind`` + ``resolve_load`` + ``Materializer.materialize`` with every parameter on ``device``, except
    those whose spec asks for host placement, which are loaded into CPU memory (page-locked when ``device`` is a
    GPU, so that copies of them to it run at bus speed)."""
    host = {s.name: "cpu" for s in specs if s.placement == "host"}
    plan = resolve_load(bind(reader, specs), device, placement=host)
    pin = bool(host) and torch.device(device).type == "cuda"
    return Materializer(reader, verify=verify, progress=progress, pin_host=pin).materialize(plan)
