#!/usr/bin/env python3
"""What one speculative verify step costs against one decode step at a published shape (issue 31 item 7; DFlash
and DFlash2: issue 34 item 6).

Builds the random-weight model of ``--shape`` (tools/gpu_bench_shapes.py) with a random MTP head (the training
script's ``Qwen3_5MTP``: one decoder layer, shared embedding and LM head), converts it in memory, and for each
``k`` of ``--ks`` starts the public Engine (``speculative="mtp"``, ``num_speculative_tokens=k``; k = 0: none), which
captures its graphs at start: decode graphs without speculation, verify graphs with it. Then per k:

- graph: the median of ``--replays`` CUDA-event-timed replays of the captured graph for B rows (decode: B tokens;
  verify: B * (k + 1) tokens), on the capture's inputs (a context of k + 1 tokens or less, so the figure is the
  weights' and states' traffic, not attention over a long context);
- end to end at B = 1: ``Engine.generate`` of ``--tokens`` and of ``max(8, k + 1)`` tokens from the same prompt,
  greedy; the difference over the extra tokens is the time per committed token (both runs end with the same
  rounds that draft fewer than k tokens near the budget, which run eagerly, so they cancel). With a random head
  almost no draft is accepted, so for k > 0 it is the time of one whole speculative step (draft k tokens, verify
  k + 1);
- for k >= 2, the replay of the MTP draft graph (draft steps 2..k) for B rows, the same way;
- with ``--stages``, where a speculative step's time goes at B = 1 (:func:`stage_times`): host milliseconds and
  device milliseconds (CUDA events at the stage's entry and exit, no added synchronisation) of the engine's step,
  the speculative Program step, drafting (and its eager MTP forwards), the draft and verify graph replays, the
  acceptance and the commit, per speculative step.

From those, the speed-up a checkpoint whose head is trained would get at a mean accepted length ``a`` (tokens
committed per verify, ``--accepted``): ``a * decode_step / speculative_step``. Writes ``verify_cost.json``.

``--speculative dflash`` / ``dflash2`` measures a DFlash / DFlash2 drafter instead of the MTP head: a random drafter
of the published size (tools/random_drafters.py: 5 layers at the target's hidden size, its attention heads and FFN
width, ``target_layer_ids`` by the reference rule) is written as a z-lab folder and attached to the in-memory
conversion as ``ninfer-convert --draft`` attaches it. ``--ks`` then counts the drafts of a round (block size - 1:
7 and 15 for blocks 8 and 16), the graph is the verify graph (DFlash verifies through the same captured graphs),
the draft graph the drafter's block graph (:mod:`ninfer_qwen3_5.dflash.graphs`: block forward, logits and greedy
path of full blocks), the end to end time per committed token is one round (draft + verify), and ``--stages``
times the drafter's pieces: the whole ``draft``, the block graph's replay, and for what runs eagerly the block
forward through the drafter's layers, its LM-head logits and the path walk (argmax, or DFlash2's selector); and
the context K/V written from the target's taps. The JSON then also names the backend and the drafter, and each k its block, the draft
stage's milliseconds (``draft_ms_b1``, the device time on CUDA, else the host's) over a decode step's, and on CUDA
``device_round_over_decode_b1``: (verify replay + the draft's device time) / the decode replay at B = 1.

    python3 tools/gpu_verify_cost.py --tokenizer tok.json --out $OUT                  # 9B shape, on the H200
    python3 tools/gpu_verify_cost.py --ks 0,3 --gemv-tc 0,1 --tokenizer tok.json --out $OUT   # the TC GEMV A/B
    python3 tools/gpu_verify_cost.py --ks 0,3 --gemv-row-mib 48,256 --tokenizer tok.json --out $OUT   # 4-row GEMV A/B
    python3 tools/gpu_verify_cost.py --tiny --device cpu --tokenizer tok.json --out /tmp/vc   # the method on the CPU
    python3 tools/gpu_verify_cost.py --speculative dflash --ks 0,7,15 --stages --tokenizer tok.json --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_shapes as shapes  # noqa: E402
import random_drafters  # noqa: E402

#: Per backend: the default ``--ks`` and ``--accepted`` (DFlash: the published accepted lengths at blocks 8-16).
DEFAULTS = {"mtp": ("0,1,2,3,4", "1.8,2.5,3.0"), "dflash": ("0,7,15", "6.9,8.0,10.8"),
            "dflash2": ("0,7,15", "6.9,8.0,10.8")}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="9b")
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--speculative", choices=sorted(DEFAULTS), default="mtp",
                    help="the drafter: the MTP head, or a random DFlash / DFlash2 drafter of the published size")
    ap.add_argument("--ks", default=None, help="drafts per step (0: no speculation); default per --speculative")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=136)
    ap.add_argument("--accepted", default=None,
                    help="mean accepted lengths to project speed-ups for; default per --speculative")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ninfer_verify_cost"))
    ap.add_argument("--gemv-tc", default="",
                    help="comma list of 0/1/l2: run every k with the tensor-core GEMV for 2-16 rows off, on (the "
                         "NINFER_GEMV_TC candidate), or on with its L2 prefetch before the PDL wait "
                         "(NINFER_GEMV_TC_L2_PREFETCH) on the one artifact; default: as the environment says")
    ap.add_argument("--gemv-row-mib", default="",
                    help="comma list of MiB: run every k (after --gemv-tc's settings) with the CUDA-core GEMV taking "
                         "M rows while M x weight bytes stays under each (ninfer.ops.triton.linear.MAX_ROW_BYTES; "
                         "the verify's 4 rows of a 9B projection need ~256): whether its launch overlap beats "
                         "cuBLAS there; default: the module's own")
    ap.add_argument("--stages", action="store_true", help="also time the stages of a speculative step (B=1)")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="also list the top kernels of each graph's replay at B=1 (ROWS kernels; torch.profiler)")
    args = ap.parse_args(argv)
    ks, accepted = DEFAULTS[args.speculative]
    args.ks, args.accepted = args.ks or ks, args.accepted or accepted
    return args


def mtp_head(model, device, dtype, seed: int):
    """A random MTP head for ``model`` (the training script's module), its tensors named as a checkpoint's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_default_model",
                                                  Path(__file__).resolve().parent / "train_default_model.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    cls = train.build_mtp_class()
    head = shapes.random_model(lambda: cls(model.config), device, dtype, seed, norms=())
    model.config.mtp_num_hidden_layers = 1
    model.config.mtp_use_dedicated_embeddings = False
    return {f"mtp.{k}": v.detach().contiguous() for k, v in head.state_dict().items()}


def graph_ms(graphs, b: int, replays: int, sync) -> float | None:
    """Median replay time of ``graphs``' graph for ``b`` rows on its capture inputs (None: not captured)."""
    import torch

    if graphs is None or not graphs.has(b):
        return None
    with torch.inference_mode():   # the graphs' static buffers are inference tensors (made under the engine's mode)
        return _graph_ms(graphs, b, replays, sync)


def _graph_ms(graphs, b: int, replays: int, sync) -> float:
    import torch

    graphs._valid_inputs(b)   # noqa: SLF001 - the capture's inputs: valid for every kernel, whatever ran before
    graph = graphs._graphs[b][0]   # noqa: SLF001
    if graph is None:   # no CUDA: the static forward eagerly (the method's check on the CPU)
        run = lambda: graphs._run_static(b)   # noqa: E731, SLF001
    else:
        run = graph.replay
    for _ in range(3):
        run()
    times = []
    for _ in range(replays):
        if torch.cuda.is_available() and graph is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_table(graphs, b: int, rows: int) -> list[dict]:
    """The kernels of five replays of graph ``b`` by total GPU time (torch.profiler), ``rows`` of them."""
    from torch.profiler import ProfilerActivity, profile

    graphs._valid_inputs(b)   # noqa: SLF001
    graph = graphs._graphs[b][0]   # noqa: SLF001
    graph.replay()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    return [{"kernel": e.key[:90], "calls_per_replay": e.count / 5, "us_per_replay": e.device_time_total / 5}
            for e in events[:rows]]


def end_to_end(engine, tokens: int, vocab: int, short_tokens: int = 8) -> dict:
    """Time per committed token at B = 1 (module docstring): runs of ``tokens`` and ``short_tokens`` tokens.
    A row near its budget drafts less (its last k rounds, eager); with ``short_tokens >= k + 1`` both runs end
    with the same such rounds, so the difference counts full rounds only."""
    from ninfer.contracts.sampling import SamplingParams

    prompt = [(37 * i + 11) % (vocab - 1) + 1 for i in range(64)]

    def wall(n):
        t0 = time.perf_counter()
        r = engine.generate(prompt, sampling=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        assert len(r.token_ids) == n
        return time.perf_counter() - t0

    if tokens <= short_tokens:
        raise SystemExit(f"--tokens {tokens} must exceed {short_tokens} (the short run: 8, or k + 1 if larger)")
    wall(short_tokens)   # the first request pays any first-use cost
    short, full = min(wall(short_tokens) for _ in range(2)), min(wall(tokens) for _ in range(2))
    s = engine.stats().as_dict()
    return {"ms_per_token": (full - short) / (tokens - short_tokens) * 1e3, "verifies": s.get("spec_verifies"),
            "drafted": s.get("spec_drafted"), "accepted": s.get("spec_accepted")}


# (module, class, method, stage name): the stages of one engine step with speculation, outermost first.
STAGES = (("ninfer.engine.worker", "EngineCore", "step", "engine step"),
          ("ninfer_qwen3_5.speculative_decode", "SpeculativeDecoding", "run", "program step"),
          ("ninfer_qwen3_5.mtp.decoding", "MTPDecoding", "draft", "draft"),
          ("ninfer_qwen3_5.mtp.head", "Qwen35MTPHead", "forward", "eager MTP forward"),
          ("ninfer_qwen3_5.mtp.draft_graphs", "DraftGraphs", "run", "draft graph"),
          ("ninfer_qwen3_5.verify_graphs", "VerifyGraphs", "run", "verify graph"),
          ("ninfer_qwen3_5.speculative_decode", "SpeculativeDecoding", "_accept", "acceptance"),
          ("ninfer_qwen3_5.speculative_decode", "SpeculativeDecoding", "commit_inputs", "commit"))
# The same for a DFlash / DFlash2 round; class None: a function of the module (the path walks, which
# dflash.decoding calls by its own names).
DFLASH_STAGES = (("ninfer.engine.worker", "EngineCore", "step", "engine step"),
                 ("ninfer_qwen3_5.speculative_decode", "SpeculativeDecoding", "run", "program step"),
                 ("ninfer_qwen3_5.dflash.decoding", "DFlashDecoding", "draft", "draft"),
                 ("ninfer_qwen3_5.dflash.graphs", "DFlashGraphs", "run", "drafter graph"),
                 ("ninfer_qwen3_5.dflash.drafter", "DFlashDrafter", "block_hidden", "drafter block"),
                 ("ninfer_qwen3_5.dflash.drafter", "DFlashDrafter", "logits", "drafter logits"),
                 ("ninfer_qwen3_5.dflash.decoding", None, "argmax_path", "draft path"),
                 ("ninfer_qwen3_5.dflash.decoding", None, "select_path", "draft path"),
                 ("ninfer_qwen3_5.verify_graphs", "VerifyGraphs", "run", "verify graph"),
                 ("ninfer_qwen3_5.speculative_decode", "SpeculativeDecoding", "_accept", "acceptance"),
                 ("ninfer_qwen3_5.speculative_decode", "SpeculativeDecoding", "commit_inputs", "commit"),
                 ("ninfer_qwen3_5.dflash.drafter", "DFlashDrafter", "write_context", "drafter context"))


def stage_times(engine, tokens: int, vocab: int, device, stages=STAGES) -> dict:
    """Per speculative step: host ms and device ms of each stage of ``stages`` (:data:`STAGES`) over one greedy
    generation of ``tokens`` tokens at B = 1. The methods are wrapped on their classes (or modules) for the run
    and restored after; a wrapper reads the clock and records a CUDA event on entry and exit, so it adds no
    synchronisation."""
    import importlib

    import torch
    from ninfer.contracts.sampling import SamplingParams

    cuda = device.type == "cuda"
    records: dict[str, list] = {name: [] for *_, name in stages}
    saved = []

    def wrap(fn, name):
        def timed(*a, **kw):
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
            if ev:
                ev[0].record()
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                host = time.perf_counter() - t0
                if ev:
                    ev[1].record()
                records[name].append((host, ev))
        return timed

    for module, cls, meth, name in stages:
        mod = importlib.import_module(module)
        klass = mod if cls is None else getattr(mod, cls)
        fn = vars(klass).get(meth)
        if fn is None:
            continue
        saved.append((klass, meth, fn))
        setattr(klass, meth, wrap(fn, name))
    try:
        prompt = [(37 * i + 11) % (vocab - 1) + 1 for i in range(64)]
        engine.generate(prompt, sampling=SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    finally:
        for klass, meth, fn in saved:
            setattr(klass, meth, fn)
    if cuda:
        torch.cuda.synchronize(device)
    steps = max(1, len(records["verify graph"]) or len(records["program step"]))
    out = {"speculative_steps": steps}
    for name, rows in records.items():
        host = sum(h for h, _ in rows) * 1e3 / steps
        dev = sum(e[0].elapsed_time(e[1]) for _, e in rows) / steps if cuda and rows else None
        out[name] = {"calls_per_step": len(rows) / steps, "host_ms": round(host, 3),
                     "device_ms": None if dev is None else round(dev, 3)}
    return out


def build_artifact(args, geometry: dict, device) -> tuple[Path, dict | None]:
    """The random model of ``geometry`` with its drafter (the MTP head, or a random DFlash / DFlash2 drafter
    folder attached as ``--draft``), converted in memory. Returns the artifact and the drafter's description
    (None for MTP)."""
    import shutil

    import torch

    model = shapes.build_hf(geometry, device, 0)
    extra, draft, drafter = None, None, None
    if args.speculative == "mtp":
        extra = mtp_head(model, device, torch.bfloat16, 1)
    else:
        draft = args.work / "draft"
        drafter = random_drafters.write_random_drafter(draft, geometry, args.speculative, device)
    folder = args.work / "src"
    folder.mkdir(exist_ok=True)
    shapes.write_frontend(folder, args.tokenizer)
    artifact = args.work / "verify-cost.ninfer"
    try:
        shapes.convert_in_memory(model, folder, artifact, f"verify-cost-{args.shape}", extra=extra, draft=draft)
    finally:
        if draft is not None:
            shutil.rmtree(draft, ignore_errors=True)
    del model, extra
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return artifact, drafter


def derive(result: dict, accepted: list[float], dflash: bool) -> None:
    """Each speculating k's ratios to the k = 0 entry and its projected speed-ups (module docstring)."""
    for e in result["ks"]:
        base = next((b for b in result["ks"] if b.get("k") == 0 and "graph_ms" in b
                     and b.get("gemv_tc") == e.get("gemv_tc") and b.get("gemv_row_mib") == e.get("gemv_row_mib")),
                    None)
        if base is None or not e.get("k") or "graph_ms" not in e:
            continue
        e["verify_over_decode"] = {b: (v / base["graph_ms"][b] if v and base["graph_ms"].get(b) else None)
                                   for b, v in e["graph_ms"].items()}
        step, dec = e["end_to_end_b1"]["ms_per_token"], base["end_to_end_b1"]["ms_per_token"]
        e["step_over_decode_b1"] = step / dec
        e["projected_speedup_b1"] = {str(a): a * dec / step for a in accepted if a <= e["k"] + 1}
        draft = (e.get("stages_b1") or {}).get("draft")
        if dflash and draft:
            ms = draft["device_ms"] if draft["device_ms"] is not None else draft["host_ms"]
            e["draft_ms_b1"], e["draft_over_decode_b1"] = ms, ms / dec
            v, d = e["graph_ms"].get("1"), base["graph_ms"].get("1")
            if v and d and draft["device_ms"] is not None:
                e["device_round_over_decode_b1"] = (v + draft["device_ms"]) / d


def print_table(result: dict, batches: list[int], dflash: bool) -> None:
    step = "round" if dflash else "step"
    print(f"{'tc':>2} {'MiB':>4} {'k':>2} | " + " | ".join(f"graph B={b} ms (x decode)" for b in batches)
          + (" | draft B=1 ms (x decode)" if dflash else "")
          + f" | e2e B=1 ms/{step} (x decode) | projected speed-up B=1")
    for e in result["ks"]:
        tc = {None: "-", False: "0", True: "1", "l2": "l2"}[e.get("gemv_tc")]
        tc = f"{tc:>2} {e.get('gemv_row_mib', '-'):>4}"
        if "graph_ms" not in e:
            print(f"{tc:>2} {e['k']:>2} | {e.get('skipped')}")
            continue
        cells = []
        for b in batches:
            v = e["graph_ms"][str(b)]
            r = (e.get("verify_over_decode") or {}).get(str(b))
            cells.append("-" if v is None else f"{v:.3f}" + (f" ({r:.2f}x)" if r else ""))
        if dflash:
            cells.append(f"{e['draft_ms_b1']:.3f} ({e['draft_over_decode_b1']:.2f}x)" if "draft_ms_b1" in e else "-")
        e2e = e["end_to_end_b1"]["ms_per_token"]
        proj = ", ".join(f"a={a}: {s:.2f}x" for a, s in (e.get("projected_speedup_b1") or {}).items())
        print(f"{tc:>2} {e['k']:>2} | " + " | ".join(cells) + f" | {e2e:.3f}"
              + (f" ({e['step_over_decode_b1']:.2f}x)" if "step_over_decode_b1" in e else "") + f" | {proj}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from ninfer import Engine, EngineOptions

    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    sargs = shapes.parse_args(["--shape", args.shape, "--tokenizer", str(args.tokenizer), "--device", args.device,
                               "--no-hf", *(["--tiny"] if args.tiny else [])])
    geometry = shapes.geometry_for(sargs)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    dflash = args.speculative != "mtp"
    artifact, drafter = build_artifact(args, geometry, device)
    batches = [int(b) for b in args.batches.split(",")]
    result = {"shape": args.shape, "tiny": args.tiny, "geometry": {k: v for k, v in geometry.items() if k != "kind"},
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "ks": []}
    if dflash:
        result.update(speculative=args.speculative, drafter=drafter)
        print(f"drafter: {json.dumps(drafter)}", flush=True)
    from ninfer.ops.triton import linear, linear_tc

    tcs = [None] if not args.gemv_tc else [{"0": False, "1": True, "l2": "l2"}[v] for v in args.gemv_tc.split(",")]
    mibs = [None] if not args.gemv_row_mib else [int(v) for v in args.gemv_row_mib.split(",")]
    default_row_bytes = linear.MAX_ROW_BYTES
    try:
        for tc, mib, k in [(tc, mib, int(x)) for tc in tcs for mib in mibs for x in args.ks.split(",")]:
            tagged = {**({} if tc is None else {"gemv_tc": tc}), **({} if mib is None else {"gemv_row_mib": mib})}
            if time.perf_counter() - t_start > args.budget_s:
                result["ks"].append({"k": k, "skipped": "budget", **tagged})
                continue
            if tc is not None:
                # Read at each call: the graphs captured at start bake them in.
                linear_tc.ENABLED, linear_tc.L2_PREFETCH = bool(tc), tc == "l2"
            # Read by use_gemv at each call, as ENABLED is.
            linear.MAX_ROW_BYTES = default_row_bytes if mib is None else mib << 20
            opts = EngineOptions(device=args.device, dtype="bfloat16" if device.type == "cuda" else "float32",
                                 max_concurrency=max(batches), max_context=2048, warmup=False,
                                 **({"speculative": args.speculative, "num_speculative_tokens": k} if k else {}))
            entry: dict = {"k": k, **({"block": k + 1} if dflash and k else {}), **tagged}
            with Engine.start(artifact, opts) as engine:
                program = engine._program   # noqa: SLF001 - the tool times the Program's own graphs
                graphs = program.speculation.graphs if k else program.graphs
                entry["graph_ms"] = {str(b): graph_ms(graphs, b, args.replays, sync) for b in batches}
                drafts = getattr(getattr(program.speculation, "head", None), "graphs", None) if k else None
                if dflash and k:
                    drafts = program.speculation.block_graphs
                if drafts is not None:   # the MTP draft graphs (steps 2..k), or DFlash's block graphs
                    entry["draft_graph_ms"] = {str(b): graph_ms(drafts, b, args.replays, sync) for b in batches}
                if args.profile and graphs is not None and graphs.has(1) and device.type == "cuda":
                    entry["kernels_b1"] = kernel_table(graphs, 1, args.profile)
                    for row in entry["kernels_b1"]:
                        print(f"  k={k} {row['us_per_replay']:9.1f} us {row['calls_per_replay']:6.1f}x {row['kernel']}")
                entry["end_to_end_b1"] = end_to_end(engine, args.tokens, geometry["vocab_size"], max(8, k + 1))
                if args.stages and k:
                    entry["stages_b1"] = stage_times(engine, args.tokens, geometry["vocab_size"], device,
                                                     DFLASH_STAGES if dflash else STAGES)
                    for name, v in entry["stages_b1"].items():
                        if isinstance(v, dict):
                            print(f"  k={k} {name:>18}: {v['calls_per_step']:.2f} calls/step, host {v['host_ms']} ms,"
                                  f" device {v['device_ms']} ms", flush=True)
            result["ks"].append(entry)
            print(json.dumps(entry), flush=True)
    finally:
        artifact.unlink(missing_ok=True)
        for p in args.work.glob("verify-cost*"):
            p.unlink(missing_ok=True)
    derive(result, [float(a) for a in args.accepted.split(",")], dflash)
    (args.out / "verify_cost.json").write_text(json.dumps(result, indent=2))
    print_table(result, batches, dflash)
    return 0


if __name__ == "__main__":
    sys.exit(main())
