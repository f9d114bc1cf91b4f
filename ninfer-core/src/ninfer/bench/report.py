"""FLOP and byte accounting, and the benchmark report (JSON-ready dict and text table).

Accounting (from the architecture's ModelProfile; a multiply-add is two FLOPs):

- Prefill of T tokens after ``start`` cached ones: ``2 * matmul_params_per_token * T`` (every weight
  matrix once per token) ``+ 2 * head_params`` (only the last token samples) ``+ mixer_flops_per_token
  * T`` (linear-attention recurrence) ``+ attention_flops_per_query_key * pairs`` with causal
  ``pairs = T * start + T (T + 1) / 2``. The embedding lookup is a gather and counts nothing.
- One decode step of B rows attending ``context`` positions each moves at least: every resident
  weight it reads once (``weight_bytes``, less what it leaves unread: of an untied input embedding all
  but B rows, ``embedding_bytes * (1 - B / vocab)``; of a MoE's routed experts all but the expected
  distinct experts of B independent uniform top-k routings, ``E * (1 - (1 - k/E)^B)`` per layer -- a
  random-weight benchmark's routing; a trained router's may differ), per row the KV it reads (``context *
  kv_bytes_per_token``) and writes (one token), and its StateImage read and written back. Routed experts and an
  input embedding placed in host memory (``host_read_bytes``) count the same, as if read from the device: the
  share then says how far the step is from an all-resident model's floor.

Start-up (``startup``): ``Engine.info["startup"]`` (seconds by phase: load, decode graphs, warm-up, and the whole
start) and the first burst after ready (:meth:`~ninfer.bench.workload.Workload.first_burst`), the cold-start figure.

Ratios: decode ``bytes_per_step * steps_per_s / copy_bytes_per_s`` and prefill ``flops / ttft /
matmul_flops_per_s``, the limits measured in the same run (:mod:`.limits`). 1.0 is the physical
floor; the engine's overheads (launches, host work, scheduling) are what keeps a figure under it. When the
copy was measured again after the workload, each decode row also has ``copy_bandwidth_ratio_after``.

Decode rates count committed tokens (:mod:`.workload`): ``tokens_per_s`` is the batch's committed output
tokens per second, ``token_ms`` a request's time per committed token, ``step_ms`` one engine decode step and
``tokens_per_step`` the tokens a step commits per request (1 without speculation, when ``step_ms ==
token_ms``). The byte count is that of a plain decode step; a speculative verify step also writes the KV and
state of every verified position and runs the draft head, so with speculation the ratio is a lower bound.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ninfer.bench.limits import DeviceLimits
from ninfer.bench.workload import BenchSettings, DecodeResult, FirstBurst, PrefillResult
from ninfer.contracts.architecture import ModelProfile

SCHEMA = "ninfer-bench/1"


def causal_pairs(tokens: int, start: int = 0) -> int:
    """(query, key) pairs of causal attention for ``tokens`` new tokens after ``start`` cached ones."""
    return tokens * start + tokens * (tokens + 1) // 2


def prefill_flops(profile: ModelProfile, tokens: int, start: int = 0) -> int:
    return (2 * profile.matmul_params_per_token * tokens + 2 * profile.head_params
            + profile.mixer_flops_per_token * tokens
            + profile.attention_flops_per_query_key * causal_pairs(tokens, start))


def expected_distinct_experts(experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts of ``rows`` independent uniform top-k routings over ``experts``."""
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)


def decode_weight_bytes(profile: ModelProfile, batch: int) -> float:
    """Weight bytes one decode step of ``batch`` rows reads (module docstring)."""
    unread = profile.embedding_bytes * (1.0 - min(1.0, batch / max(1, profile.vocab_size)))
    total = profile.weight_bytes + profile.host_read_bytes   # host tables: counted as read all the same
    if profile.routed_expert_bytes and profile.num_experts:
        e, k = profile.num_experts, profile.experts_per_token
        unread += profile.routed_expert_bytes * (1.0 - expected_distinct_experts(e, k, batch) / e)
    return total - unread


def decode_step_bytes(profile: ModelProfile, batch: int, context: float) -> float:
    per_row = (context * profile.kv_bytes_per_token + profile.kv_bytes_per_token
               + 2 * profile.state_bytes_per_sequence)
    return decode_weight_bytes(profile, batch) + batch * per_row


def decode_row(profile: ModelProfile, limits: DeviceLimits, r: DecodeResult) -> dict[str, Any]:
    step_bytes = decode_step_bytes(profile, r.batch, r.context_tokens)
    achieved = step_bytes / r.step_s
    return {"batch": r.batch, "tokens_per_s": r.tokens_per_s, "token_ms": r.token_s * 1000.0,
            "step_ms": r.step_s * 1000.0, "tokens_per_step": r.tokens_per_step, "engine_steps": r.engine_steps,
            "context_tokens": r.context_tokens, "bytes_per_step": step_bytes, "achieved_bytes_per_s": achieved,
            "copy_bandwidth_ratio": achieved / limits.copy_bytes_per_s,
            "copy_bandwidth_ratio_after": (None if limits.copy_bytes_per_s_after is None
                                           else achieved / limits.copy_bytes_per_s_after),
            "ttft_ms": r.ttft_s * 1000.0,
            "steps": r.steps, "short_run_s": r.short_s, "long_run_s": r.long_s,
            "short_run_samples_s": list(r.short_samples), "long_run_samples_s": list(r.long_samples),
            "short_run_row_steps": list(r.short_row_steps), "long_run_row_steps": list(r.long_row_steps)}


def prefill_row(profile: ModelProfile, limits: DeviceLimits, r: PrefillResult) -> dict[str, Any]:
    flops = prefill_flops(profile, r.tokens)
    achieved = flops / r.ttft_s
    return {"tokens": r.tokens, "tokens_per_s": r.tokens_per_s, "ttft_ms": r.ttft_s * 1000.0, "flops": flops,
            "achieved_flops_per_s": achieved, "matmul_peak_ratio": achieved / limits.matmul_flops_per_s,
            "ttft_samples_s": list(r.ttft_samples)}


def startup_row(startup: dict[str, Any] | None, first: FirstBurst | None) -> dict[str, Any]:
    row = dict(startup or {})
    if first is not None:
        row["first_burst"] = {"prompt_tokens": list(first.prompt_tokens), "ttft_max_ms": first.ttft_max_s * 1000.0,
                              "ttft_samples_s": list(first.ttft_samples)}
    return row


def build_report(*, meta: dict[str, Any], engine_info: dict[str, Any], profile: ModelProfile,
                 limits: DeviceLimits, settings: BenchSettings, decode: list[DecodeResult],
                 prefill: list[PrefillResult], memory: dict[str, Any] | None,
                 startup: dict[str, Any] | None = None, first_burst: FirstBurst | None = None) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        **meta,
        "engine": engine_info,
        "settings": dataclasses.asdict(settings),
        "profile": dataclasses.asdict(profile),
        "limits": dataclasses.asdict(limits),
        "decode": [decode_row(profile, limits, r) for r in decode],
        "prefill": [prefill_row(profile, limits, r) for r in prefill],
        "memory": memory,
        "startup": startup_row(startup, first_burst),
    }


def _after(lim: dict[str, Any]) -> str:
    after = lim.get("copy_bytes_per_s_after")
    return "" if after is None else f", {after / 1e9:,.1f} GB/s after the workload"


def _speculation_lines(spec: dict[str, Any]) -> list[str]:
    mean = spec["mean_accepted_length"]
    positions = ", ".join(f"{j}: {rate:.1%} of {n}" for j, (rate, n) in enumerate(
        zip(spec["acceptance_by_position"], spec["drafted_by_position"], strict=True), start=1))
    return [f"speculative: {spec['backend']}, {spec['num_speculative_tokens']} drafts per step; "
            f"{spec['verifies']} verifies, {spec['accepted']} of {spec['drafted']} drafts accepted, "
            f"mean accepted length {'-' if mean is None else f'{mean:.2f}'} tokens per verify",
            f"acceptance by draft position (accepted share of the verifies that drafted it): {positions or '-'}"]


def format_report(report: dict[str, Any]) -> str:
    lim, s = report["limits"], report["settings"]
    lines = [
        f"ninfer bench: {report['model']['name']} on {report['engine']['device']} ({report['engine']['dtype']}), "
        f"{report['date']}",
        f"limits: copy {lim['copy_bytes_per_s'] / 1e9:,.1f} GB/s (read + write, {lim['copy_buffer_bytes'] >> 20} MiB "
        f"buffer){_after(lim)}; matmul {lim['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s ({lim['matmul_dtype']}, "
        f"n={lim['matmul_n']})",
    ]
    start = report.get("startup") or {}
    if start:
        names = (("load_s", "load"), ("graphs_s", "graphs"), ("prefill_graphs_s", "of which prefill graphs"),
                 ("warmup_s", "warm-up"))
        phases = [f"{label} {start[k]:.2f} s" for k, label in names if start.get(k) is not None]
        line = f"start-up: {start['total_s']:.2f} s" if start.get("total_s") is not None else "start-up:"
        line += f" ({', '.join(phases)})" if phases else ""
        first = start.get("first_burst")
        if first is not None:
            line += (f"; first burst after ready: {len(first['prompt_tokens'])} requests, TTFT max "
                     f"{first['ttft_max_ms']:.1f} ms")
        lines.append(line)
    spec = report["engine"].get("speculation")
    if spec is not None:
        lines += _speculation_lines(spec)
    hosted = report["engine"].get("host_experts")
    if hosted is not None:
        hits, misses = sum(hosted["cache_hits"]), sum(hosted["cache_misses"])
        rate = f"{hits / (hits + misses):.1%}" if hits + misses else "-"
        lines.append(f"host experts: {hosted.get('device_expert_layers') or 0} MoE layers whole on the device, "
                     f"{hosted['expert_cache_slots'] or 0} cached per host layer, hit rate {rate} of "
                     f"{hits + misses} routed pairs (the byte shares below count every expert byte as read from "
                     f"the device)")
    if report["decode"]:
        lines += ["",
                  f"decode: prompt {s['decode_prompt_tokens']} + {s['decode_base_tokens']} tokens, then "
                  f"{s['decode_steps']} measured tokens per request; median of {s['repeats']} (tok/s: committed "
                  f"tokens; tok/step: per request)",
                  f"{'B':>3} {'tok/s':>10} {'step ms':>9} {'tok/step':>8} {'context':>8} {'MB/step':>9} {'GB/s':>8} "
                  f"{'of copy BW':>10} {'(after)':>9} {'TTFT ms':>9}"]
        for r in report["decode"]:
            after = r.get("copy_bandwidth_ratio_after")
            lines.append(f"{r['batch']:>3} {r['tokens_per_s']:>10,.1f} {r['step_ms']:>9.2f} "
                         f"{r['tokens_per_step']:>8.2f} {r['context_tokens']:>8.0f} "
                         f"{r['bytes_per_step'] / 1e6:>9.2f} {r['achieved_bytes_per_s'] / 1e9:>8.2f} "
                         f"{r['copy_bandwidth_ratio']:>10.2%} {'-' if after is None else f'{after:.2%}':>9} "
                         f"{r['ttft_ms']:>9.1f}")
    if report["prefill"]:
        lines += ["", f"prefill: one request, one output token; median of {s['repeats']}",
                  f"{'tokens':>7} {'tok/s':>10} {'TTFT ms':>10} {'GFLOP':>9} {'GFLOP/s':>9} {'of matmul peak':>14}"]
        for r in report["prefill"]:
            lines.append(f"{r['tokens']:>7} {r['tokens_per_s']:>10,.1f} {r['ttft_ms']:>10.1f} {r['flops'] / 1e9:>9.3f} "
                         f"{r['achieved_flops_per_s'] / 1e9:>9.2f} {r['matmul_peak_ratio']:>14.2%}")
    return "\n".join(lines)
