"""What a user of the installed example plugin does, run in a subprocess whose PYTHONPATH holds the plugin's
temporary site (tests/plugins/test_example_plugin.py): list it, convert checkpoints with it, check its profile
against its Program, read its logits and generate greedily through the Engine.

Usage: ``python run_example_plugin.py SPEC.json`` with ``{"out": DIR, "checkpoints": {NAME: HF_FOLDER},
"engine_checkpoint": NAME, "prompts": [[ids]], "max_tokens": N, "chunk": N}``. Writes ``DIR/results.json``
and ``DIR/logits-NAME.pt`` (the Program's logits of the first prompt, per checkpoint).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from ninfer import Engine
from ninfer.plugins import get_registry
from ninfer.testing import (
    build_program,
    convert_checkpoint,
    greedy_tokens,
    profile_mismatches,
    program_logits,
)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    plugin = next((p for p in get_registry().plugins() if p.name == "llama_mini"), None)
    results: dict = {"plugin": None if plugin is None else {
        "distribution": plugin.distribution, "version": plugin.version,
        "registered": {k: list(v) for k, v in plugin.registered.items()}}}
    artifacts = {name: convert_checkpoint(folder, out / f"{name}.ninfer")
                 for name, folder in spec["checkpoints"].items()}
    results["profile"] = {f"{name}/{dtype}": profile_mismatches(build_program(path, dtype=getattr(torch, dtype)))
                          for name, path in artifacts.items() for dtype in ("float32", "bfloat16")}
    for name, path in artifacts.items():
        program = build_program(path, dtype=torch.float32).program
        torch.save(program_logits(program, spec["prompts"][0], chunk=spec["chunk"]), out / f"logits-{name}.pt")
    with Engine.start(artifacts[spec["engine_checkpoint"]], device="cpu", dtype="float32",
                      max_concurrency=len(spec["prompts"]), max_context=64, page_size=4,
                      prefill_chunk_size=spec["chunk"]) as engine:
        results["engine"] = {"architecture": engine.info["architecture"], "ops": engine.info["ops"],
                             "greedy": greedy_tokens(engine, spec["prompts"], spec["max_tokens"])}
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
