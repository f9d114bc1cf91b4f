"""The expert routing file (``EngineOptions.expert_routing_file``, docs/memory.md "Host experts").

A MoE model whose routed experts live in host memory keeps a device cache of the experts routing favours. The cache
learns which those are as requests run; the routing file carries that knowledge across runs: at start the engine
reads it (when it exists) and fills the caches with the experts it counts most, so the first requests already hit
them; at close it writes back the file's counts plus this run's. Format (JSON, one object):

    {"format": "ninfer-expert-routing/1",
     "layers": [{"calls": 1200, "counts": [37, 0, 5, ...]}, ...]}

one entry per MoE layer with a cache, in layer order: the layer calls counted and the routed (token, expert) pairs
of each expert. Written to a temporary file beside it, then renamed: a crash never leaves half a file.

Ownership: the engine reads the file before its worker starts and the worker writes it at close (the only threads
that touch Program state at those times).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from ninfer.contracts.options import InvalidEngineOptions
from ninfer.contracts.program import ExpertRouting, Program, ProgramError

log = logging.getLogger(__name__)

FORMAT = "ninfer-expert-routing/1"


def _bad(path: Path, why: str) -> InvalidEngineOptions:
    return InvalidEngineOptions(f"invalid engine option expert_routing_file={str(path)!r}: {why}")


def read_routing(path: str | os.PathLike) -> ExpertRouting | None:
    """The routing stored at ``path``; None when there is no file. InvalidEngineOptions naming the problem when
    it cannot be read or is not a routing file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise _bad(path, f"cannot read it ({type(exc).__name__}: {exc})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(path, f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise _bad(path, f"not an expert routing file (format {found!r}, expected {FORMAT!r})")
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise _bad(path, "'layers' must be a list of {calls, counts} objects")
    calls, counts = [], []
    for i, layer in enumerate(layers):
        ok = (isinstance(layer, dict) and _count(layer.get("calls")) and isinstance(layer.get("counts"), list)
              and all(_count(n) for n in layer["counts"]))
        if not ok:
            raise _bad(path, f"layer {i} must be {{\"calls\": int >= 0, \"counts\": [int >= 0, ...]}}")
        calls.append(layer["calls"])
        counts.append(tuple(layer["counts"]))
    return ExpertRouting(tuple(calls), tuple(counts))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def write_routing(path: str | os.PathLike, routing: ExpertRouting) -> None:
    """Store ``routing`` at ``path`` (replacing it whole: a temporary file beside it, then a rename)."""
    path = Path(path)
    doc = {"format": FORMAT, "layers": [{"calls": c, "counts": list(n)}
                                        for c, n in zip(routing.calls, routing.counts, strict=True)]}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RoutingRecorder:
    """One engine's use of its routing file: :meth:`start` warms the Program's caches from it, :meth:`save`
    writes the file's counts plus the Program's at close."""

    def __init__(self, path: Path, base: ExpertRouting | None) -> None:
        self.path, self.base = path, base

    @classmethod
    def start(cls, path: str | os.PathLike, program: Program) -> RoutingRecorder | None:
        """Read ``path`` and warm ``program``'s caches with it (None, with a warning, when the Program has no
        expert cache: nothing to warm or record)."""
        path = Path(path)
        if not program.expert_routing().counts:
            log.warning("expert_routing_file %s: this engine has no device cache of host experts; the file is "
                        "neither read nor written", path)
            return None
        if not path.parent.is_dir():
            raise _bad(path, f"its folder {str(path.parent)!r} does not exist")
        base = read_routing(path)
        if base is not None:
            try:
                program.warm_expert_caches(base)
            except ProgramError as exc:
                raise _bad(path, f"it does not fit this model: {exc}") from None
            log.info("expert caches warmed from %s (%d layers)", path, len(base.counts))
        return cls(path, base)

    def save(self, program: Program) -> None:
        """Write the file's counts plus this run's (the worker, at close)."""
        run = program.expert_routing()
        write_routing(self.path, run if self.base is None else self.base + run)
