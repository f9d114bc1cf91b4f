"""The Qwen3.5 MTP drafter: one multi-token-prediction step (:meth:`Qwen35MTPHead.forward`) and k-step greedy
drafting (:meth:`Qwen35MTPHead.draft`).

One step for position ``t`` (``h_t`` the target's final-normed hidden state at ``t``, ``x_{t+1}`` the token
after it)::

    e = pre_fc_norm_embedding(embed(x_{t+1}));  g = pre_fc_norm_hidden(h_t)
    u = fc(cat([e, g]))                       # the embedding half first; fc is [H, 2H]
    u = layer(u)                              # one gated full-attention decoder layer at RoPE position t
    out = norm(u);  logits = lm_head(out)     # a prediction of x_{t+2}

Norms are zero-centred RMSNorms. The layer is the target's own full-attention layer code
(:class:`~ninfer_qwen3_5.layers.attention.GatedAttention`: gated attention, q/k norm, partial interleaved
MRoPE from three identical text-position rows; then :class:`~ninfer_qwen3_5.layers.mlp.DenseMLP` or
:class:`~ninfer_qwen3_5.layers.moe.SparseMoE`, as the target's layers), so it computes with the same ops.
It writes its K/V of every position of the call into its own pool of the Program's paged KV cache
(:func:`~ninfer_qwen3_5.mtp.context.mtp_kv_layer`), sharing the sequence's page table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from ninfer.contracts.program import ProgramError
from ninfer.program.batch import to_device
from ninfer.storage.kv_pool import PagedKVCache

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.layers.attention import GatedAttention
from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.layers.fused import NormInput
from ninfer_qwen3_5.layers.mlp import DenseMLP
from ninfer_qwen3_5.layers.moe import SparseMoE
from ninfer_qwen3_5.model import inverse_frequencies
from ninfer_qwen3_5.mtp.context import mtp_kv_layer, mtp_step_context
from ninfer_qwen3_5.mtp.weights import mtp_num_layers, prepare_mtp_weights
from ninfer_qwen3_5.parameters import layer_prefix

#: ``constrain(drafted [R, i], logits [R, V]) -> logits``: what a draft step takes the argmax of (see ``draft``).
Constrain = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MTPOutput:
    """One MTP call's result for its selected rows: ``logits`` fp32 ``[R, V]`` (predictions of ``x_{t+2}``) and
    ``hidden`` ``[R, H]`` the normed output ``out`` they are the LM head of (the next draft step's ``h``)."""

    logits: torch.Tensor
    hidden: torch.Tensor


@dataclass(frozen=True)
class DraftRow:
    """One sequence of a :meth:`Qwen35MTPHead.draft` call: its MTP pool holds positions ``[0, start)``; the call
    is given the target's hidden states and next tokens for positions ``[start, start + length)``
    (``length >= 1``: the positions the target computed since the last draft, the last one's next token being
    the token just sampled)."""

    seq: object
    start: int
    length: int

    @property
    def last(self) -> int:
        """The position whose output gives the first draft token."""
        return self.start + self.length - 1


@dataclass(frozen=True)
class Draft:
    """``tokens`` int64 ``[R, k]``: row r's greedy drafts ``d_1..d_k`` (``d_1`` predicts the token after the
    just-sampled one); ``logits`` fp32 ``[R, k, V]``: the logits each draft is the argmax of (after the draft
    call's ``constrain``, if any), or None when steps ``2..k`` replayed a draft graph, which keeps none. The drafter
    is greedy, so its proposal distribution is one-hot at ``tokens`` (``q_i(d_i) = 1``); the logits are there for a
    caller that applies the request's sampling transforms to the draft distribution."""

    tokens: torch.Tensor
    logits: torch.Tensor | None


class Qwen35MTPHead:
    """The ``mtp`` component of a Qwen3.5 artifact as a drafter for its target model.

    ``weights``: the ``mtp`` component's parameters (:func:`~ninfer_qwen3_5.mtp.weights.load_mtp_weights`);
    ``embed`` / ``lm_head``: the target's (already prepared) ``text/embed`` and ``text/lm_head`` tensors, shared,
    never copied. ``mtp_config``: the component's config, or the compact text config, which carries the same
    ``mtp_*`` keys (one layer, shared embeddings). ``weights`` may hold other parameters too (e.g. the whole
    ``ProgramInit.weights`` once ``parameter_specs`` adds the MTP specs): only ``mtp/*`` names are read.
    """

    #: Steps 2..k of an unconstrained draft replay these when set (:mod:`ninfer_qwen3_5.mtp.draft_graphs`).
    graphs = None
    #: Whole unconstrained drafts whose rows all have ``n`` pending positions replay ``whole_graphs[n]`` (steps 1..k).
    whole_graphs: Mapping = {}

    def __init__(self, cfg: Qwen35Config, mtp_config: Mapping, weights: Mapping[str, torch.Tensor],
                 embed: torch.Tensor, lm_head: torch.Tensor, ops, device: torch.device, dtype: torch.dtype) -> None:
        mtp_num_layers(mtp_config)
        self.cfg, self.ops, self.eps = cfg, ops, cfg.rms_norm_eps
        w = prepare_mtp_weights(cfg, weights, dtype)
        self.embed, self.lm_head = embed, lm_head
        self.fc, self.norm = w["mtp/fc"], w["mtp/norm"]
        self.pre_embedding, self.pre_hidden = w["mtp/pre_fc_norm_embedding"], w["mtp/pre_fc_norm_hidden"]
        p = layer_prefix("mtp", 0) + "/"
        self.input_norm, self.post_norm = w[p + "input_norm"], w[p + "post_norm"]
        self.kv_layer = mtp_kv_layer(cfg, 0)
        self.attention = GatedAttention(cfg, self.kv_layer, _group(w, p + "attention/"), ops)
        self.mlp = (SparseMoE(cfg, _group(w, p + "moe/"), ops) if cfg.is_moe
                    else DenseMLP(_group(w, p + "mlp/"), ops))
        self.inv_freq = inverse_frequencies(cfg).to(device)
        self.device = device

    def forward(self, tokens_next: torch.Tensor, hidden: torch.Tensor, ctx: StepContext,
                logit_rows: torch.Tensor | None) -> MTPOutput:
        """One MTP step for the N tokens of ``ctx`` (decode rows first, then chunks, as the target's calls).

        ``tokens_next`` int64 ``[N]``: ``x_{t+1}`` for each position ``t``; ``hidden`` ``[N, H]`` (activation
        dtype): ``h_t``, the target's final-normed hidden state (or, in drafting, the previous MTP step's
        ``out``); ``ctx.positions``: ``t`` (text positions; the MRoPE rows are built here, ``ctx`` comes without
        rotary tables). Writes the MTP layer's K/V of every position of ``ctx`` into its pool; a decode row
        attends over ``[0, t]``, a chunk causally over its cached prefix. Returns the logits and normed output
        of the rows at ``logit_rows`` (None: every row)."""
        ops, eps = self.ops, self.eps
        if tokens_next.shape[0] != hidden.shape[0] or hidden.shape[0] != ctx.positions.shape[0]:
            raise ProgramError(f"an MTP step needs one next token and one hidden state per position: got "
                               f"{tokens_next.shape[0]} tokens, {hidden.shape[0]} hidden states, "
                               f"{ctx.positions.shape[0]} positions")
        e, _ = ops.embed_rms_norm_unit_offset(tokens_next, self.embed, self.pre_embedding, eps)
        g = ops.rms_norm_unit_offset(hidden, self.pre_hidden, eps)
        u = ops.linear(torch.cat((e, g), dim=-1), self.fc)
        cos, sin = ops.mrope_cos_sin(ctx.positions.unsqueeze(0).expand(3, -1), self.inv_freq,
                                     self.cfg.mrope_section, True)
        ctx = replace(ctx, cos=cos, sin=sin)
        out, residual = self.attention(NormInput(None, u, self.input_norm, eps), ctx)
        out, residual = self.mlp(NormInput(out, residual, self.post_norm, eps))
        if logit_rows is not None:
            out, residual = out.index_select(0, logit_rows), residual.index_select(0, logit_rows)
        h, _ = ops.add_rms_norm_unit_offset(out, residual, self.norm, eps)
        return MTPOutput(ops.logits(h, self.lm_head), h)

    def draft(self, kv: PagedKVCache, rows: Sequence[DraftRow], tokens_next: torch.Tensor, hidden: torch.Tensor,
              k: int, constrain: Constrain | None = None) -> Draft:
        """``k`` greedy autoregressive MTP steps for each row.

        ``constrain(drafted, logits)``, when given, is called before each step's argmax with the drafts so far
        (int64 ``[R, i]``, ``i`` = 0..k-1) and that step's logits ``[R, V]``, and returns the logits to take the
        argmax of (e.g. with a grammar's mask applied: :class:`~ninfer.program.draft_masks.MaskedDrafting`).

        ``tokens_next`` / ``hidden``: ``[sum(length)]`` / ``[sum(length), H]``, row after row, row r's entries for
        positions ``[start, start + length)`` in order (``x_{t+1}`` and the target's ``h_t``). Step 1 runs those
        positions (one call; a row of length 1 as a decode row, a longer one as a chunk) and drafts ``d_1`` from
        each row's last position ``p = start + length - 1``; step ``i`` (2..k) runs position ``p + i - 1`` with
        ``h`` = step ``i - 1``'s normed output and the token ``d_{i-1}``, drafting ``d_i``. Each row's pages must
        cover ``p + k`` tokens (``k - 1`` provisional positions past ``p``; the verify reservation of ``k + 1``
        tokens past the ledger does).

        KV validity: positions ``[start, p]`` are written from committed tokens and the target's own hidden
        states: they are final. Positions ``[p + 1, p + k - 1]`` are provisional (computed from the drafter's own
        hidden states and drafts, whatever the verify accepts). Rollback needs no copy: the next draft of the
        row passes ``start = p + 1`` and ``length = n + 1`` after ``n`` accepted drafts (the target's verify hidden
        states of ``x_{p+1}, d_1..d_n`` and the tokens ``d_1..d_n, bonus``), which overwrites the provisional
        slots before any attention reads them.

        Without ``constrain``, when every row has the same length ``n`` and :attr:`whole_graphs` holds a graph of
        ``n`` pending positions for ``len(rows)`` rows and ``k`` steps over ``kv``, the whole draft replays it; else,
        when :attr:`graphs` holds one for ``len(rows)`` rows and ``k`` steps, steps ``2..k`` replay it (the same
        tokens either way; ``Draft.logits`` is then None)."""
        if k < 1:
            raise ProgramError(f"an MTP draft needs k >= 1, got {k}")
        if not rows or any(r.length < 1 or r.start < 0 for r in rows):
            raise ProgramError(f"an MTP draft needs rows with start >= 0 and length >= 1: {list(rows)}")
        for r in rows:
            if kv.capacity(r.seq) < r.last + k:
                raise ProgramError(f"sequence {r.seq!r}: an MTP draft of {k} steps from position {r.last} needs "
                                   f"pages for {r.last + k} tokens, it has {kv.capacity(r.seq)}")
        total = sum(r.length for r in rows)
        if tokens_next.shape[0] != total or hidden.shape[0] != total:
            raise ProgramError(f"MTP draft rows cover {total} positions; got {tokens_next.shape[0]} tokens and "
                               f"{hidden.shape[0]} hidden states")
        n = rows[0].length
        whole = self.whole_graphs.get(n) if all(r.length == n for r in rows) else None
        if constrain is None and whole is not None and kv is whole.kv and whole.fits(len(rows), k):
            # Copied out of the graph's memory: the next replay of any draft graph rewrites it.
            tokens = whole.run_whole([r.seq for r in rows], [r.start for r in rows], tokens_next, hidden).clone()
            return Draft(tokens=tokens, logits=None)
        # Step 1 packs length-1 rows as decode rows first, then the chunks; map both ways to row order.
        offsets = [0]
        for r in rows:
            offsets.append(offsets[-1] + r.length)
        singles = [i for i, r in enumerate(rows) if r.length == 1]
        longer = [i for i, r in enumerate(rows) if r.length > 1]
        order = [offsets[i] for i in singles] + [t for i in longer for t in range(offsets[i], offsets[i + 1])]
        packed_last, at = {}, len(singles)
        for j, i in enumerate(singles):
            packed_last[i] = j
        for i in longer:
            at += rows[i].length
            packed_last[i] = at - 1
        # Host lists reach the device pinned and non-blocking (a pageable copy waits for the whole stream).
        idx = to_device(order, torch.int64, self.device)
        ctx = mtp_step_context(kv, decode=[(rows[i].seq, rows[i].start) for i in singles],
                               chunks=[(rows[i].seq, rows[i].start, rows[i].length) for i in longer], device=self.device)
        last = to_device([packed_last[i] for i in range(len(rows))], torch.int64, self.device)
        step = self.forward(tokens_next.index_select(0, idx), hidden.index_select(0, idx), ctx, last)
        graphs = self.graphs
        if constrain is None and graphs is not None and kv is graphs.kv and graphs.fits(len(rows), k):
            first = self.ops.greedy_tokens(step.logits)
            rest = graphs.run([r.seq for r in rows], [r.last for r in rows], first, step.hidden)
            return Draft(tokens=torch.cat((first.unsqueeze(1), rest), dim=1), logits=None)
        logits: list[torch.Tensor] = []
        toks: list[torch.Tensor] = []
        for i in range(k):
            if i:
                ctx = mtp_step_context(kv, decode=[(r.seq, r.last + i) for r in rows], device=self.device)
                step = self.forward(toks[-1], step.hidden, ctx, None)
            out = step.logits
            if constrain is not None:
                drafted = (torch.stack(toks, dim=1) if toks
                           else torch.zeros((len(rows), 0), dtype=torch.int64, device=self.device))
                out = constrain(drafted, out)
            logits.append(out)
            toks.append(self.ops.greedy_tokens(out))
        return Draft(tokens=torch.stack(toks, dim=1), logits=torch.stack(logits, dim=1))


def _group(weights: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
