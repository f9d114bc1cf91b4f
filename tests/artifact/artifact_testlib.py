"""Shared builders for the artifact tests (imported by conftest.py and the test modules): a tiny multi-component artifact and directory surgery.

``make_tiny`` writes, through the real ArtifactWriter, an artifact whose text objects come first and
whose mtp-only object comes last, so with ``SMALL_LIMIT`` the mtp object lies in continuation parts
the text never touches. ``rewrite_directory`` re-frames an entry with an edited JSON directory
(keeping the payload), which is how the bad-input tests produce each malformed file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from ninfer.artifact.format import HEADER_BYTES, PAYLOAD_ALIGN, align_up
from ninfer.artifact.writer import ArtifactWriter
from ninfer.contracts.architecture import ParameterSpec

# Entry and part payload capacity 4096 each (the tiny JSON stays under one 4096 page): the 8 KiB
# embedding straddles three files, and the mtp object lies in parts the text never touches.
SMALL_LIMIT = 2 * 4096

TEXT_CONFIG = {"architectures": ["TinyForCausalLM"], "model_type": "tiny", "hidden_size": 8,
               "num_hidden_layers": 1, "vocab_size": 16, "rms_norm_eps": 1e-6,
               "layer_types": ["full_attention"]}
MTP_CONFIG = {"architectures": ["TinyMTP"]}


def bits_tensor(words: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor with exactly the given bit patterns (NaN payloads, signed zeros survive)."""
    int_dtype = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    width = 8 * dtype.itemsize
    signed = [w - (1 << width) if w >= 1 << (width - 1) else w for w in words]
    return torch.tensor(signed, dtype=int_dtype).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality, including shape and dtype."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize]
    return torch.equal(a.contiguous().view(int_dtype), b.contiguous().view(int_dtype))


@dataclass(frozen=True)
class Tiny:
    path: Path
    values: dict[str, torch.Tensor]   # object id -> the tensor written
    tokenizer: bytes


def make_tiny(path: Path, *, max_file_bytes: int = 32_000_000_000, artifact_id: bytes | None = None,
              mtp_rows: int = 1024) -> Tiny:
    """Text objects (embed, fused q/gate rows, norm, scalar) then a large mtp-only object.

    Bindings: ``text/embed`` whole; ``text/head`` = the same parent as parts (tied); ``text/q`` and
    ``text/gate`` de-interleave the even/odd rows of ``text.qg``; ``text/qg_flat`` reshapes it via
    two touching parts; ``text/norm`` fp32; ``text/scale`` an fp32 scalar; ``mtp/fc`` the mtp
    object; ``mtp/embed`` shares ``text.embed``.
    """
    g = torch.Generator().manual_seed(7)
    values = {
        "text.embed": torch.randn(256, 16, generator=g).to(torch.bfloat16),
        "text.qg": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "text.norm": torch.randn(8, generator=g),
        "text.scale": torch.tensor(0.25),
        "mtp.fc": torch.randn(mtp_rows, 8, generator=g).to(torch.bfloat16),
    }
    tokenizer = b'{"model": "tiny tokenizer"}'
    w = ArtifactWriter(path, max_file_bytes=max_file_bytes, artifact_id=artifact_id)
    w.add_component("text", TEXT_CONFIG, resources={"tokenizer.json": "text.tokenizer"},
                    proposal={"domain": "full"})
    w.add_component("mtp", MTP_CONFIG, target="text")
    w.declare_tensor("text.embed", (256, 16), "bf16")
    w.declare_tensor("text.qg", (8, 8), "bf16")
    w.declare_tensor("text.norm", (8,), "fp32")
    w.declare_tensor("text.scale", (), "fp32")
    w.declare_resource("text.tokenizer", len(tokenizer))
    w.declare_tensor("mtp.fc", (mtp_rows, 8), "bf16")
    w.bind("text/embed", "text.embed")
    w.bind_parts("text/head", [("text.embed", 0, 4096)])
    w.bind_parts("text/q", [("text.qg", r * 8, r * 8 + 8) for r in (0, 2, 4, 6)])
    w.bind_parts("text/gate", [("text.qg", r * 8, r * 8 + 8) for r in (1, 3, 5, 7)])
    w.bind_parts("text/qg_flat", [("text.qg", 0, 40), ("text.qg", 40, 64)])
    w.bind("text/norm", "text.norm")
    w.bind("text/scale", "text.scale")
    w.bind("mtp/fc", "mtp.fc")
    w.bind("mtp/embed", "text.embed")
    w.add_use("text/embed", "text/embedding_input")
    w.add_use("text/head", "text/final_norm_output", "A16Only",
              auxiliaries={"activation_input_divisor": "text.scale"})
    w.set_metadata({"name": "tiny-test"})
    w.set_provenance({"source": "synthetic"})
    w.begin_payload()
    for oid in ("text.embed", "text.qg", "text.norm", "text.scale"):
        w.write(oid, values[oid])
    w.write("text.tokenizer", tokenizer)
    half = mtp_rows // 2
    w.write("mtp.fc", values["mtp.fc"][:half])   # chunked writes
    w.write("mtp.fc", values["mtp.fc"][half:])
    w.finish()
    return Tiny(path, values, tokenizer)


TEXT_SPECS = [
    ParameterSpec("text/embed", (256, 16)),
    ParameterSpec("text/head", (256, 16)),
    ParameterSpec("text/q", (4, 8)),
    ParameterSpec("text/gate", (4, 8)),
    ParameterSpec("text/qg_flat", (64,)),
    ParameterSpec("text/norm", (8,)),
    ParameterSpec("text/scale", ()),
]


def mtp_specs(rows: int = 1024) -> list[ParameterSpec]:
    return [ParameterSpec("mtp/fc", (rows, 8), "mtp"), ParameterSpec("mtp/embed", (256, 16), "mtp")]


# -- directory surgery ---------------------------------------------------------------------------
def read_entry(path: Path) -> tuple[bytes, bytes, bytes]:
    """(header, json bytes, entry payload) of an entry file."""
    raw = path.read_bytes()
    (json_bytes,) = struct.unpack_from("<Q", raw, 8)
    start = align_up(HEADER_BYTES + json_bytes, PAYLOAD_ALIGN)
    return raw[:HEADER_BYTES], raw[HEADER_BYTES:HEADER_BYTES + json_bytes], raw[start:]


def rewrite_directory_raw(path: Path, edit: Callable[[bytes], bytes]) -> None:
    """Re-frame the entry with ``edit(json bytes)`` as its directory, keeping header id and payload."""
    header, text, payload = read_entry(path)
    text = edit(text)
    start = align_up(HEADER_BYTES + len(text), PAYLOAD_ALIGN)
    new_header = header[:8] + struct.pack("<Q", len(text)) + header[16:]
    path.write_bytes(new_header + text + bytes(start - HEADER_BYTES - len(text)) + payload)


def rewrite_directory(path: Path, edit: Callable[[dict], None]) -> None:
    """Like :func:`rewrite_directory_raw` with an in-place edit of the parsed JSON root."""
    def apply(text: bytes) -> bytes:
        root = json.loads(text)
        edit(root)
        return json.dumps(root).encode()
    rewrite_directory_raw(path, apply)


def obj_record(root: dict, oid: str) -> dict:
    return next(o for o in root["objects"] if o["id"] == oid)


def flip_payload_byte(reader, logical_offset: int) -> None:
    """XOR one payload byte in whichever physical file holds it."""
    from ninfer.artifact.format import PART_PAYLOAD_START

    for rec, path in zip(reader.directory.files, reader.files, strict=False):
        if rec.payload_begin <= logical_offset < rec.payload_end:
            if rec.index == 0:
                _, text, _ = read_entry(path)
                start = align_up(HEADER_BYTES + len(text), PAYLOAD_ALIGN)
            else:
                start = PART_PAYLOAD_START
            at = start + logical_offset - rec.payload_begin
            data = bytearray(path.read_bytes())
            data[at] ^= 0x5A
            path.write_bytes(bytes(data))
            return
    raise AssertionError(f"offset {logical_offset} outside the payload")
