#!/usr/bin/env python3
"""Find a training-corpus passage the embedded default model reproduces exactly under greedy decoding.

The end-to-end tests need a prompt whose greedy continuation is known in advance *from the corpus*,
not from a previous run of the engine, so a wrong engine cannot bless its own output. This script
walks the default model's training files in a fixed order and, in each, windows starting every
``--stride`` tokens: the window's first ``--prompt-tokens`` tokens are the prompt, and the engine
greedily generates ``--continue-tokens`` tokens through the public Engine (fp32, CPU). The window whose generation reproduces the most corpus tokens exactly is
written to the fixture file with its provenance; docs/default-model.md says how it was chosen.

    python3 tools/find_memorized_passage.py --out tests/fixtures/default_model_passage.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from default_model_corpus import list_files, stdlib_dir  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--continue-tokens", type=int, default=32)
    ap.add_argument("--stride", type=int, default=192)
    ap.add_argument("--windows-per-file", type=int, default=1)
    ap.add_argument("--min-tokens", type=int, default=16, help="the fewest reproduced tokens accepted")
    ap.add_argument("--max-files", type=int, default=80)
    args = ap.parse_args()

    from ninfer import Engine
    from ninfer.model_source import resolve_model

    lib = stdlib_dir()
    files = [lib / f.rel for f in list_files(lib) if not f.heldout and f.size > 2000][: args.max_files]
    with Engine.start(resolve_model(None), max_concurrency=8, dtype="float32", device="cpu") as engine:
        fe = engine.frontend
        greedy = engine.sampling_params(temperature=0.0, max_tokens=args.continue_tokens, ignore_eos=True)
        windows = []
        need = args.prompt_tokens + args.continue_tokens
        for path in files:
            # Exactly the training document: tools/default_model_corpus.py puts this header first.
            ids = fe.encode(f"# file: Lib/{path.relative_to(lib).as_posix()}\n" + path.read_text(encoding="utf-8"))
            for w in range(args.windows_per_file):
                start = w * args.stride
                if start + need <= len(ids):
                    windows.append((path, start, ids[start: start + args.prompt_tokens],
                                    ids[start + args.prompt_tokens: start + need]))
        best = None  # (reproduced, window index, path, start, prompt, expected)
        for batch_start in range(0, len(windows), 8):
            handles = [(batch_start + k, path, start, prompt, expected, engine.submit(prompt, sampling=greedy))
                       for k, (path, start, prompt, expected) in enumerate(windows[batch_start: batch_start + 8])]
            for index, path, start, prompt, expected, handle in handles:
                got = list(handle.result().token_ids)
                match = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), len(expected))
                print(f"{path.relative_to(lib)}@{start}: {match}/{len(expected)} tokens reproduced", file=sys.stderr)
                if best is None or match > best[0]:
                    best = (match, index, path, start, prompt, expected)
        if best is None or best[0] < args.min_tokens:
            print(f"no window reproduced {args.min_tokens} tokens exactly", file=sys.stderr)
            return 1
        match, _, path, start, prompt, expected = best
        reproduced = expected[:match]
        fixture = {
            "source_file": str(path.relative_to(lib)),
            "token_offset": start,
            "python": sys.version.split()[0],
            "prompt_text": fe.decode(prompt),
            "prompt_token_ids": prompt,
            "continuation_text": fe.decode(reproduced),
            "continuation_token_ids": reproduced,
            "how_chosen": (f"the longest exact greedy reproduction (fp32, CPU) among {len(windows)} windows of the "
                           f"training files (corpus order, held-out modules excluded, windows every {args.stride} "
                           f"tokens from each file's training-document start, {args.prompt_tokens}-token prompts, "
                           f"up to {args.continue_tokens} tokens compared); ties go to the earlier window. "
                           f"Found by tools/find_memorized_passage.py"),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(fixture, indent=2, ensure_ascii=False) + "\n")
        print(f"chosen: {fixture['source_file']}@{start}, {match} tokens", file=sys.stderr)
        return 0




if __name__ == "__main__":
    sys.exit(main())
