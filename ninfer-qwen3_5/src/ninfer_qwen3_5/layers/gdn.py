"""The Gated DeltaNet (linear attention) mixer of one layer (reference doc section 5).

Decode rows (``x[:B]``) step their StateImage slots with one ``gdn_decode`` (gates, conv update, recurrent
step and gated norm; reading ``decode_slots``, writing ``decode_out_slots``: every field of the Qwen3.5
StateImage is rewritten by a decode step, which lookahead decode relies on); each chunk (its slice of
``x[B:]``) continues its own slot's state with ``gdn_gates``, ``causal_conv1d_prefill`` and
``gdn_chunk_prefill`` (in place), one chunk after another (the slices are host offsets: no device sync); a call
with several chunks whose slots the caller put on the device (``ctx.chunk_state_slots``) runs them all at once
with ``causal_conv1d_varlen`` and ``gdn_chunk_varlen`` instead (the same values, one launch per op), as does a
padded flat call (``ctx.token_valid``: its tokens in no row get a zero output);
``gated_rms_norm`` then runs once over every chunk token. Gates are fp32 (``gdn_gates``):
``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (log decay, always <= 0).

A call with speculative verify chunks (``ctx.verify``) runs them as successive decode steps instead, all in one
``gdn_verify`` (each row read from its live slot, the state after token ``j`` written to its snapshot ``j``); a
subclass whose decode step is not ``gdn_decode``'s (``fused_verify = False``) runs token ``j`` of every verify row
in one ``_decode`` against the snapshot storage, reading snapshot ``j - 1`` (step 0: snapshot 0, the live image the
Program staged there) and writing snapshot ``j``. Either way the live slots are not touched (see
:mod:`ninfer_qwen3_5.speculative_state`). Its ordinary chunks run as above, each with its own gated norm.

The four input projections run as one GEMM per run of row-adjacent weights (:mod:`.fused`: all four in
the converter's layout, one ``gdn/in_proj`` parent), and q/k/v, z, a, b stay column views of the output: the ops take
row-strided inputs, so a decode step copies nothing between the GEMMs and the kernels.
"""

from __future__ import annotations

import torch

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.layers.fused import NormInput, norm_project, row_groups
from ninfer_qwen3_5.ops.contracts import GDNDecodeParams
from ninfer_qwen3_5.state import conv_field, recurrent_field


class GatedDeltaNet:
    #: Whether verify chunks run as one ``gdn_verify`` (the SiLU-gated ``gdn_decode`` step, fused over tokens).
    #: A subclass that overrides ``_decode`` sets it False: its verify steps token by token through ``_decode``,
    #: over snapshots the Program stages (``Qwen35Model.stages_verify_snapshots``).
    fused_verify = True

    def __init__(self, cfg: Qwen35Config, index: int, w: dict[str, torch.Tensor], ops) -> None:
        self.ops = ops
        self.index = index
        self.eps = cfg.rms_norm_eps
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.key_dim, cfg.value_dim
        self.scale = self.dk ** -0.5
        self.in_groups = row_groups([w["qkv"], w["z"], w["b"], w["a"]])
        self.w_conv, self.w_norm, self.w_out = w["conv"], w["norm"], w["out"]
        # Constant per layer: the decay rate -exp(A_log) in fp32 (HF computes it from A_log.float()).
        self.neg_a = -torch.exp(w["A_log"].float())
        self.dt_bias = w["dt_bias"].float()
        self.conv_name, self.rec_name = conv_field(index), recurrent_field(index)
        self.decode_params = GDNDecodeParams(
            conv_weight=self.w_conv, neg_a=self.neg_a, dt_bias=self.dt_bias, norm_weight=self.w_norm,
            key_heads=self.hk, key_dim=self.dk, value_heads=self.hv, value_dim=self.dv, eps=self.eps,
            scale=self.scale)

    def __call__(self, inp: NormInput, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        ops, n, b_rows = self.ops, inp.residual.shape[0], ctx.num_decode
        (qkv, z, b, a), _, residual = norm_project(ops, inp, self.in_groups)
        z = z.reshape(n, self.hv, self.dv)
        conv_states, rec = ctx.states.field(self.conv_name), ctx.states.field(self.rec_name)
        if ctx.verify is not None:
            o = self._verify(qkv, z, a, b, ctx, conv_states, rec)
            return ops.linear(o.reshape(n, self.value_dim), self.w_out), residual
        outs = []
        if b_rows:
            outs.append(self._decode(qkv[:b_rows], z[:b_rows], a[:b_rows], b[:b_rows], conv_states, rec,
                                     ctx.decode_slots, ctx.decode_out_slots))
        if ctx.num_chunk:
            if ctx.chunk_state_slots is not None and (len(ctx.chunk_lens) > 1 or ctx.token_valid is not None):
                o = self._chunks(qkv[b_rows:], a[b_rows:], b[b_rows:], conv_states, rec, ctx.chunk_cu_q,
                                 ctx.chunk_state_slots)
                if ctx.token_valid is not None:   # a padded call: tokens in no row were never computed
                    o = torch.where(ctx.token_valid, o, 0.0)
            else:
                cores, at = [], b_rows
                for slot, t in zip(ctx.chunk_slots, ctx.chunk_lens, strict=True):
                    cores.append(self._chunk(qkv[at:at + t], a[at:at + t], b[at:at + t], conv_states[slot],
                                             rec[slot]))
                    at += t
                o = cores[0] if len(cores) == 1 else torch.cat(cores)
            outs.append(self._gated_norm(o, z[b_rows:]))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        return ops.linear(o.reshape(n, self.value_dim), self.w_out), residual

    def _verify(self, qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ctx: StepContext,
                conv_states: torch.Tensor, rec: torch.Tensor) -> torch.Tensor:
        """The core output ``[N, Hv, Dv]`` (after the gated norm) of a call with verify chunks."""
        b_rows = ctx.num_decode
        o = torch.empty(z.shape, dtype=qkv.dtype, device=qkv.device)
        if b_rows:
            o[:b_rows] = self._decode(qkv[:b_rows], z[:b_rows], a[:b_rows], b[:b_rows], conv_states, rec,
                                      ctx.decode_slots, ctx.decode_out_slots)
        for at, t, slot in ctx.verify.chunks:
            core = self._chunk(qkv[at:at + t], a[at:at + t], b[at:at + t], conv_states[slot], rec[slot])
            o[at:at + t] = self._gated_norm(core, z[at:at + t])
        snap_conv, snap_rec = ctx.snapshots.field(self.conv_name), ctx.snapshots.field(self.rec_name)
        fused = ctx.verify.rows
        if self.fused_verify and fused is not None:
            self.ops.gdn_verify(qkv, z, a, b, self.decode_params, conv_states, rec, snap_conv, snap_rec,
                                fused.starts, fused.counts, fused.live_slots, fused.snapshots, o)
            return o
        # One decode step per verify token index: token j of every row after token j - 1 of it.
        for step in ctx.verify.steps:
            r = step.index   # evenly spaced rows (every verify unit's): strided views, no gathers
            o[r] = self._decode(qkv[r], z[r], a[r], b[r], snap_conv, snap_rec, step.in_slots, step.out_slots)
        return o

    # -- the output gate: a subclass with another gate activation overrides these two --------------
    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The output norm of chunk tokens: ``gated_rms_norm`` (SiLU gate)."""
        return self.ops.gated_rms_norm(core, z, self.w_norm, self.eps)

    def _decode(self, qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_states: torch.Tensor,
                rec: torch.Tensor, slots: torch.Tensor, out_slots: torch.Tensor | None) -> torch.Tensor:
        """One decode step of rows reading ``slots`` and writing ``out_slots``, output normed: ``gdn_decode``."""
        return self.ops.gdn_decode(qkv, z, a, b, self.decode_params, conv_states, rec, slots, out_slots)

    def _chunks(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_states: torch.Tensor,
                states: torch.Tensor, cu: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Every chunk of the call at once (``cu``: their token offsets, ``slots``: their state slots, on the
        device): what :meth:`_chunk` gives each, in one launch per op."""
        ops, n = self.ops, qkv.shape[0]
        g, beta = ops.gdn_gates(a, b, self.neg_a, self.dt_bias)
        y = ops.causal_conv1d_varlen(qkv, self.w_conv, conv_states, cu, slots)
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return ops.gdn_chunk_varlen(q.reshape(n, self.hk, self.dk), k.reshape(n, self.hk, self.dk),
                                    v.reshape(n, self.hv, self.dv), g, beta, states, cu, slots, self.scale)

    def _chunk(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor,
               state: torch.Tensor) -> torch.Tensor:
        """One sequence's prefill chunk, continuing (and updating) its slot's conv and recurrent state;
        the core output before the gated norm."""
        ops, n = self.ops, qkv.shape[0]
        g, beta = ops.gdn_gates(a, b, self.neg_a, self.dt_bias)
        y = ops.causal_conv1d_prefill(qkv, self.w_conv, conv_state)
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return ops.gdn_chunk_prefill(q.reshape(n, self.hk, self.dk), k.reshape(n, self.hk, self.dk),
                                     v.reshape(n, self.hv, self.dv), g, beta, state, self.scale)
