"""The drafters' corpus: the default model's own token streams (tools/train_default_model.py ``prepare``), windows
and training anchors.

- :func:`prepare` runs the default model's ``prepare`` stage into ``--work`` and then checks the result against
  the target folder: the tokenizer must be the target's (else the token ids mean nothing to it), and the streams'
  SHA-256 are compared with the target's ``training_report.json`` (equal on the CPython that built the shipped
  model; on another version the corpus files differ, which is recorded, not refused).
- :func:`prepare_smoke` builds a few-file corpus with the target's own tokenizer (no tokenizer training), for CPU
  smoke runs and the tool's test.
- :func:`load_streams` reads the uint16 streams, checked against the manifest.
- Anchors (:func:`sample_anchors`): per window, ``n`` distinct positions drawn from a CPU generator among those
  whose block ``[s, s + B)`` lies inside the window, whose context is not empty (``s >= 1``) and, with
  ``--anchors assistant``, whose token lies inside an assistant turn (:func:`assistant_mask`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import torch

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

import default_model_corpus as corpus  # noqa: E402
import train_default_model as tdm  # noqa: E402

STREAMS = ("train", "heldout_source", "heldout_chat")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_work(work: Path, target: Path) -> dict:
    """What the prepared corpus is relative to the target's training corpus (module docstring)."""
    if _sha256(work / "tokenizer.json") != _sha256(target / "tokenizer.json"):
        raise RuntimeError(f"{work}/tokenizer.json is not the tokenizer of {target}: the token ids would not be "
                           f"the target's (prepare on the CPython that built it, or use prepare --smoke-files)")
    manifest = json.loads((work / "manifest.json").read_text())
    report = target / "training_report.json"
    shipped = json.loads(report.read_text())["corpus"]["streams"] if report.exists() else {}
    same = {name: shipped.get(name, {}).get("sha256") == info["sha256"] for name, info in manifest["streams"].items()}
    return {"tokenizer": "the target's", "streams_equal_to_the_targets_training_corpus": same,
            "python": manifest.get("python"), "smoke_files": manifest.get("smoke_files", 0),
            "streams": {k: {"tokens": v["tokens"], "sha256": v["sha256"]} for k, v in manifest["streams"].items()}}


def prepare(work: Path, target: Path, seed: int = 0) -> dict:
    """The default model's ``prepare`` stage (full corpus, its tokenizer retrained deterministically), checked."""
    tdm.prepare(Namespace(work=str(work), seed=seed, smoke_files=0, vocab_size=6144))
    return check_work(work, target)


def prepare_smoke(work: Path, target: Path, files: int, seed: int = 0) -> dict:
    """A corpus of the ``files`` smallest training files of at least 4 kB and the smallest held-out file with
    docstring chats, encoded with the target's tokenizer (module docstring)."""
    from tokenizers import Tokenizer

    work.mkdir(parents=True, exist_ok=True)
    lib = corpus.stdlib_dir()
    every = corpus.list_files(lib)
    by_size = sorted(every, key=lambda f: (f.size, f.rel))
    train_f = [f for f in by_size if not f.heldout and f.size >= 4096][:files]
    # The smallest held-out file with docstring chats, so both held-out streams have text.
    held_f = next([f] for f in by_size if f.heldout and any(d.kind == "chat" for d in corpus.build_documents([f], lib)))
    docs = corpus.build_documents(sorted(train_f + held_f, key=lambda f: f.rel), lib, seed=seed)
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    (work / "tokenizer.json").write_bytes((target / "tokenizer.json").read_bytes())
    eot = tok.token_to_id("<|endoftext|>")
    texts = {"train": [d.text for d in docs if not d.heldout],
             "heldout_source": [d.text for d in docs if d.heldout and d.kind != "chat"],
             "heldout_chat": [d.text for d in docs if d.heldout and d.kind == "chat"]}
    info = {}
    for name, items in texts.items():
        arr = tdm._encode_stream(tok, items, eot)
        arr.tofile(work / f"{name}.u16")
        info[name] = {"documents": len(items), "tokens": int(arr.size), "sha256": _sha256(work / f"{name}.u16")}
    import platform

    manifest = {"python": platform.python_version(), "seed": seed, "smoke_files": files, "streams": info,
                "files": [f"Lib/{f.rel}" for f in train_f + held_f]}
    (work / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return check_work(work, target)


def load_streams(work: Path) -> dict[str, np.ndarray]:
    manifest = json.loads((work / "manifest.json").read_text())
    out = {}
    for name in STREAMS:
        path = work / f"{name}.u16"
        if _sha256(path) != manifest["streams"][name]["sha256"]:
            raise RuntimeError(f"{path} does not match {work}/manifest.json")
        out[name] = np.fromfile(path, dtype=np.uint16)
    return out


def assistant_mask(stream: np.ndarray, im_start: int, im_end: int, assistant: int) -> np.ndarray:
    """True at the tokens of assistant turns: after ``<|im_start|>assistant`` up to and including ``<|im_end|>``
    (the reply's own tokens, the ones a drafter drafts in a chat)."""
    out = np.zeros(len(stream), dtype=bool)
    starts = np.nonzero(stream[:-1] == im_start)[0]
    ends = np.nonzero(stream == im_end)[0]
    for s in starts[stream[starts + 1] == assistant]:
        j = np.searchsorted(ends, s)
        e = ends[j] if j < len(ends) else len(stream) - 1
        out[s + 2:e + 1] = True
    return out


def windows(stream: np.ndarray, length: int, limit: int = 0) -> np.ndarray:
    """The stream's non-overlapping windows ``[n, length]`` int64 (the tail dropped), the first ``limit`` if set."""
    n = len(stream) // length
    if limit:
        n = min(n, limit)
    return stream[:n * length].reshape(n, length).astype(np.int64)


def sample_anchors(gen: torch.Generator, valid: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchors [W, n] int64, keep [W, n] bool)``: per window, ``n`` distinct anchors drawn uniformly from the
    positions allowed by ``valid [W, T]`` (module docstring), sorted; a window with fewer allowed positions keeps
    them all and marks the rest (anchor 1) ``keep = False``."""
    w, t = valid.shape
    n = min(n, t)
    allowed = valid.clone()
    allowed[:, 0] = False
    allowed[:, t - block + 1:] = False
    keys = torch.rand(w, t, generator=gen)
    keys = torch.where(allowed, keys, 2.0)
    order = keys.argsort(dim=1, stable=True)[:, :n]
    keep = allowed.gather(1, order)
    anchors = torch.where(keep, order, 1)
    anchors, idx = anchors.sort(dim=1, stable=True)
    return anchors, keep.gather(1, idx)
