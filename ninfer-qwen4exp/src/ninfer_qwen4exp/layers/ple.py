"""PLE: the per-layer embedding of hashed token n-grams, added to every residual stream of its layer before the layer
reads the bank (docs/architectures/qwen4exp.md).

Per token: the n-gram ids of its window (:func:`ngram_windows`, :mod:`~ninfer_qwen4exp.ple_hash`) pick G rows of
the layer's host-resident table, concatenated to ``e[E]`` (``ple_gather`` copies only those rows to the device).
Then, with Xn_q the query-normed streams:

    K = per-stream norm_key(W_key e)  [n, H];   V = W_value e  [H]
    g_k = <K_k, Xn_q,k> / sqrt(H);   g_k <- sign(g_k) sqrt(max(|g_k|, 1e-6))
    v = sigmoid(g) V  [n*H];   c = per-stream norm_conv(v)
    X <- X + (v + silu(dilated causal depthwise conv(c)))

The conv has kernel K and dilation ngram_size, so it reads the last ``(K - 1) * ngram_size`` values of ``c``: the
sequence's StateImage field ``layers/{i}/ple_conv``. It runs through Qwen3.5's causal conv1d ops with the taps
spread onto a dense kernel of width ``(K - 1) * ngram_size + 1`` (zeros between them, built once), which is the same
sum. W_key and W_value read the same embedding: one GEMM (one ``kv_proj`` parent).

The n-gram windows of a call are built once for every PLE layer from the StateImage field ``ngram`` (the last
ngram_size - 1 committed ids, :mod:`~ninfer_qwen4exp.state`) and the call's tokens, which also rewrite that field:
a chunk boundary, a preemption and Replay, or a context-cache checkpoint therefore see exactly the windows of one
uncut pass over the tokens.
"""

from __future__ import annotations

import math

import torch
from ninfer.program.host_steps import host_step
from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.layers.fused import project, row_groups

from ninfer_qwen4exp.ple_hash import NGramHash
from ninfer_qwen4exp.state import NGRAM_FIELD, ple_conv_field


def _stored(ids: torch.Tensor) -> torch.Tensor:
    return ids + 1


def _read(stored: torch.Tensor, eos: int) -> torch.Tensor:
    """The ids of the ``ngram`` field: 0 (a fresh sequence's zeros) is "before the sequence", read as EOS."""
    return torch.where(stored == 0, torch.full_like(stored, eos), stored - 1)


def ngram_windows(tokens: torch.Tensor, ctx: StepContext, n: int, eos: int) -> torch.Tensor:
    """``windows[N, n]``: each token of the call with the n - 1 tokens before it in its sequence (EOS before the
    first); the sequences' ``ngram`` fields advance to their last n - 1 tokens (decode rows: into
    ``decode_out_slots``)."""
    field = ctx.states.field(NGRAM_FIELD)
    if ctx.verify is not None:
        return _verify_windows(tokens, ctx, field, n, eos)
    parts = []
    b_rows = ctx.num_decode
    if b_rows:
        parts.append(_decode_windows(tokens, ctx, field, eos))
    at = b_rows
    for slot, t in zip(ctx.chunk_slots, ctx.chunk_lens, strict=True):
        history = torch.cat((_read(field[slot], eos), tokens[at:at + t]))
        parts.append(history.unfold(0, n, 1))
        field[slot] = _stored(history[-(n - 1):])
        at += t
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _decode_windows(tokens: torch.Tensor, ctx: StepContext, field: torch.Tensor, eos: int) -> torch.Tensor:
    """The decode rows' windows (each row's stored history, then its token), their histories written forward."""
    b_rows = ctx.num_decode
    prev = _read(field.index_select(0, ctx.decode_slots), eos)
    win = torch.cat((prev, tokens[:b_rows, None]), dim=1)
    out = ctx.decode_slots if ctx.decode_out_slots is None else ctx.decode_out_slots
    field.index_copy_(0, out, _stored(win[:, 1:]))
    return win


def _verify_windows(tokens: torch.Tensor, ctx: StepContext, field: torch.Tensor, n: int, eos: int) -> torch.Tensor:
    """``ngram_windows`` of a call with speculative verify chunks: decode rows and ordinary chunks as always; a verify
    row's token ``j`` reads the history its snapshot ``j - 1`` holds (step 0: the staged live history) and writes the
    history after it into snapshot ``j``, as ``j + 1`` decode steps would; the live fields of verify rows are not
    written (:mod:`ninfer_qwen3_5.speculative_state`)."""
    windows = torch.empty((tokens.shape[0], n), dtype=torch.int64, device=tokens.device)
    b_rows = ctx.num_decode
    if b_rows:
        windows[:b_rows] = _decode_windows(tokens, ctx, field, eos)
    for at, t, slot in ctx.verify.chunks:
        history = torch.cat((_read(field[slot], eos), tokens[at:at + t]))
        windows[at:at + t] = history.unfold(0, n, 1)
        field[slot] = _stored(history[-(n - 1):])
    snap = ctx.snapshots.field(NGRAM_FIELD)
    for step in ctx.verify.steps:
        win = torch.cat((_read(snap.index_select(0, step.in_slots), eos), tokens[step.rows, None]), dim=1)
        snap.index_copy_(0, step.out_slots, _stored(win[:, 1:]))
        windows[step.rows] = win
    return windows


def dilated_taps(weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """A depthwise kernel ``[C, K]`` of dilation ``dilation`` as the dense causal kernel ``[C, (K-1)*dilation + 1]``
    with the taps at every ``dilation``-th column (zeros between)."""
    c, k = weight.shape
    dense = weight.new_zeros((c, (k - 1) * dilation + 1))
    dense[:, ::dilation] = weight
    return dense


class PLELayer:
    def __init__(self, index: int, hash_: NGramHash, streams: int, hidden: int, dilation: int, eos: int, eps: float,
                 w: dict[str, torch.Tensor], ops, device: torch.device) -> None:
        self.ops, self.n, self.h, self.eps, self.eos = ops, streams, hidden, eps, eos
        self.heads_per_ngram = hash_.heads_per_ngram
        self.multipliers = torch.tensor(hash_.multipliers, dtype=torch.int64, device=device)
        self.sizes = torch.tensor(hash_.sizes, dtype=torch.int64, device=device)
        self.offsets = torch.tensor(hash_.offsets, dtype=torch.int64, device=device)
        self.table = w["table"]   # host memory, the stored dtype: rows are cast when gathered
        self.kv_groups = row_groups([w["key"], w["value"]])
        self.w_norm_key, self.w_norm_query, self.w_norm_conv = w["norm_key"], w["norm_query"], w["norm_conv"]
        self.w_conv = dilated_taps(w["conv"], dilation)
        self.conv_name = ple_conv_field(index)

    def __call__(self, x: torch.Tensor, windows: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The bank ``x[N, n*H]`` with this layer's embedding added to every stream."""
        ops, n, h, t = self.ops, self.n, self.h, x.shape[0]
        ids = ops.ngram_hash(windows, self.multipliers, self.sizes, self.offsets, self.eos, self.heads_per_ngram)
        emb = self._gather(ids, x.dtype, x.device)
        key, value = project(ops, emb, self.kv_groups)
        k = ops.rms_norm_unit_offset_grouped(key, self.w_norm_key, h, self.eps).view(t, n, h)
        q = ops.rms_norm_unit_offset_grouped(x, self.w_norm_query, h, self.eps).view(t, n, h)
        g = (k * q).sum(dim=-1, keepdim=True) / math.sqrt(h)
        g = g.abs().clamp_min(1e-6).sqrt() * g.sign()
        gated = torch.sigmoid(g) * value.unsqueeze(1)
        normed = ops.rms_norm_unit_offset_grouped(gated.flatten(1), self.w_norm_conv, h, self.eps)
        return x + (gated.flatten(1) + self._conv(normed, ctx))

    def _gather(self, ids: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The table rows of ``ids``; from a host table on a GPU run, a host step (a captured decode graph is cut
        there, :mod:`ninfer.program.host_steps`: the host reads the ids the graph computed)."""
        gather = lambda: self.ops.ple_gather(self.table, ids, dtype)   # noqa: E731
        if self.table.device == device:
            return gather()
        return host_step(gather, (ids.shape[0], ids.shape[1] * self.table.shape[1]), dtype, device)

    def _conv(self, c: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        states, b_rows = ctx.states.field(self.conv_name), ctx.num_decode
        if ctx.verify is not None:
            return self._verify_conv(c, ctx, states)
        outs = []
        if b_rows:
            outs.append(self.ops.causal_conv1d_update(c[:b_rows], self.w_conv, states, ctx.decode_slots,
                                                      ctx.decode_out_slots))
        at = b_rows
        for slot, t in zip(ctx.chunk_slots, ctx.chunk_lens, strict=True):
            outs.append(self.ops.causal_conv1d_prefill(c[at:at + t], self.w_conv, states[slot]))
            at += t
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _verify_conv(self, c: torch.Tensor, ctx: StepContext, states: torch.Tensor) -> torch.Tensor:
        """``_conv`` of a call with verify chunks: token ``j`` of every verify row is one decode step from snapshot
        ``j - 1`` into snapshot ``j`` (as the GDN conv of the same call)."""
        out, b_rows = torch.empty_like(c), ctx.num_decode
        if b_rows:
            out[:b_rows] = self.ops.causal_conv1d_update(c[:b_rows], self.w_conv, states, ctx.decode_slots,
                                                         ctx.decode_out_slots)
        for at, t, slot in ctx.verify.chunks:
            out[at:at + t] = self.ops.causal_conv1d_prefill(c[at:at + t], self.w_conv, states[slot])
        snap = ctx.snapshots.field(self.conv_name)
        for step in ctx.verify.steps:
            out[step.rows] = self.ops.causal_conv1d_update(c[step.rows], self.w_conv, snap, step.in_slots,
                                                           step.out_slots)
        return out
