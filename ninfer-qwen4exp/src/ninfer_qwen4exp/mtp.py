"""The Qwen4-Exp MTP (multi-token prediction) head: one MTP step over a call's positions
(:meth:`Qwen4ExpMTPHead.forward`).

One step for position ``t`` (``X_t`` the target's hyper-connection bank ``[n*H]`` at ``t`` after its last layer,
before the final stream reduction; ``x_{t+1}`` the token after ``t``)::

    e = fc_embedding(pre_fc_norm_embedding(embed(x_{t+1})))            # [H]
    g = pre_fc_norm_hidden(X_t)                                        # over the whole n*H bank
    B = [fc_hidden(g_s) + e for each stream s]                         # the MTP layer's n-stream input
    B' = layer(B)                                                      # an indexed-attention layer with HC and MoE
    logits = lm_head(mixer_hc(B'))                                     # no final norm: a prediction of x_{t+2}

Norms are (1 + w) RMSNorms. The layer is the target's own layer code (:class:`~ninfer_qwen4exp.layers.qsa.QSAAttention`,
:class:`~ninfer_qwen4exp.layers.hyper.HyperConnection`, Qwen3.5's :class:`~ninfer_qwen3_5.layers.moe.SparseMoE`) at
RoPE position ``t``, so it computes with the same ops. It keeps its K/V and its indexer's keys in pools of its own
(:func:`mtp_kv_layer` and that layer's indexer side pool) under the sequence's page tables, as Qwen3.5's MTP layer
does (:func:`ninfer_qwen3_5.mtp.mtp_step_context` builds the call's context). A chained draft step feeds the
previous step's output bank ``B'`` as its ``X``.

The description comes from sglang's Qwen4-Exp MTP as summarised for this project (transformers has no Qwen4-Exp MTP):
the checkpoint names are inferred, and no oracle exists beyond the tests' own fp32 reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from ninfer.contracts.program import ProgramError
from ninfer.quant import PackedWeight
from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.layers.fused import NormInput
from ninfer_qwen3_5.layers.moe import SparseMoE
from ninfer_qwen3_5.model import inverse_frequencies
from ninfer_qwen3_5.mtp import MTPOutput, Qwen35MTPHead
from ninfer_qwen3_5.parameters import layer_prefix

from ninfer_qwen4exp.config import Qwen4ExpConfig
from ninfer_qwen4exp.layers.hyper import HyperConnection
from ninfer_qwen4exp.layers.qsa import QSAAttention
from ninfer_qwen4exp.parameters import mtp_num_layers, mtp_shapes
from ninfer_qwen4exp.state import indexer_pool, mtp_kv_layer

__all__ = ["Qwen4ExpMTPHead", "mtp_indexer_pool", "mtp_kv_layer", "prepare_mtp_weights"]


def mtp_indexer_pool(cfg: Qwen4ExpConfig) -> str:
    return indexer_pool(mtp_kv_layer(cfg))


def prepare_mtp_weights(cfg: Qwen4ExpConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype
                        ) -> dict[str, torch.Tensor]:
    """The ``mtp/*`` parameters checked (present, shape, floating point, not quantized) and cast to ``dtype``."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in mtp_shapes(cfg).items():
        w = weights.get(name)
        if w is None:
            raise ProgramError(f"Qwen4-Exp MTP weights lack parameter {name!r}")
        if isinstance(w, PackedWeight):
            raise ProgramError(f"parameter {name!r} is stored {w.format}; quantized Qwen4-Exp MTP weights are not "
                               f"supported yet")
        if tuple(w.shape) != shape:
            raise ProgramError(f"parameter {name!r} has shape {tuple(w.shape)}, expected {shape}")
        if not w.dtype.is_floating_point:
            raise ProgramError(f"parameter {name!r} is {w.dtype}; Qwen4-Exp weights must be floating point")
        out[name] = w if w.dtype == dtype else w.to(dtype)
    return out


def _group(weights: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


class Qwen4ExpMTPHead(Qwen35MTPHead):
    """The ``mtp`` component of a Qwen4-Exp artifact as a drafter for its target model.

    It is a :class:`~ninfer_qwen3_5.mtp.Qwen35MTPHead` with its own weights and :meth:`forward`: k-step drafting
    (``draft``) and the speculative bookkeeping (:class:`~ninfer_qwen3_5.mtp.decoding.MTPDecoding`) are Qwen3.5's,
    which read only ``forward``, ``ops`` and ``device`` and treat the per-position hidden state as opaque rows: here
    the ``[n*H]`` bank (``MTPOutput.hidden`` is the MTP layer's output bank, a chained step's ``X``).

    ``weights`` holds the ``mtp/*`` parameters (other names are ignored); ``embed`` / ``lm_head`` are the target's
    prepared ``text/embed`` / ``text/lm_head``, shared, never copied; ``mtp_config`` the component's config (or the
    compact text config, which carries the same ``mtp_*`` keys)."""

    def __init__(self, cfg: Qwen4ExpConfig, mtp_config: Mapping, weights: Mapping[str, torch.Tensor],
                 embed: torch.Tensor, lm_head: torch.Tensor, ops, device: torch.device, dtype: torch.dtype) -> None:
        # Qwen35MTPHead.__init__ builds Qwen3.5 layers from Qwen3.5 weights: not called; every attribute its
        # inherited methods read (ops, device) is set here.
        mtp_num_layers(mtp_config)
        self.cfg, self.ops, self.eps, self.device = cfg, ops, cfg.rms_norm_eps, device
        w = prepare_mtp_weights(cfg, weights, dtype)
        n, h = cfg.hc_count, cfg.hidden_size
        self.embed, self.lm_head = embed, lm_head
        self.fc_embedding, self.fc_hidden = w["mtp/fc_embedding"], w["mtp/fc_hidden"]
        self.pre_embedding, self.pre_hidden = w["mtp/pre_fc_norm_embedding"], w["mtp/pre_fc_norm_hidden"]
        p = layer_prefix("mtp", 0) + "/"
        self.attn_hc = HyperConnection(n, h, self.eps, _group(w, p + "attn_hc/"), ops)
        self.attention = QSAAttention(cfg, mtp_kv_layer(cfg), _group(w, p + "attention/"), ops)
        self.mlp_hc = HyperConnection(n, h, self.eps, _group(w, p + "mlp_hc/"), ops)
        self.moe = SparseMoE(cfg.qwen35, _group(w, p + "moe/"), ops)
        self.mixer_hc = HyperConnection(n, h, self.eps, _group(w, "mtp/mixer_hc/"), ops)
        self.inv_freq = inverse_frequencies(cfg.qwen35).to(device)

    def forward(self, tokens_next: torch.Tensor, bank: torch.Tensor, ctx: StepContext,
                logit_rows: torch.Tensor | None) -> MTPOutput:
        """One MTP step for the N positions of ``ctx`` (decode rows first, then chunks, as the target's calls;
        ``ctx`` without rotary tables, built here from ``ctx.positions``). ``tokens_next`` int64 ``[N]``: the
        token after each position; ``bank`` ``[N, n*H]``: the target's pre-reduction bank at each position (or a
        previous MTP step's output bank). Writes the MTP layer's K/V and indexer keys of every position of
        ``ctx``; returns the logits and output banks of the rows at ``logit_rows`` (None: every row)."""
        cfg, ops, eps = self.cfg, self.ops, self.eps
        n, h = cfg.hc_count, cfg.hidden_size
        if tokens_next.shape[0] != bank.shape[0] or bank.shape[0] != ctx.positions.shape[0]:
            raise ProgramError(f"an MTP step needs one next token and one bank per position: got "
                               f"{tokens_next.shape[0]} tokens, {bank.shape[0]} banks, "
                               f"{ctx.positions.shape[0]} positions")
        if bank.shape[-1] != n * h:
            raise ProgramError(f"an MTP step needs banks of {n} streams of {h}, got width {bank.shape[-1]}")
        e = ops.rms_norm_unit_offset(self.embed.index_select(0, tokens_next), self.pre_embedding, eps)
        e = ops.linear(e, self.fc_embedding)
        g = ops.rms_norm_unit_offset(bank, self.pre_hidden, eps)
        x = (ops.linear(g.reshape(-1, h), self.fc_hidden).view(-1, n, h) + e.unsqueeze(1)).reshape(-1, n * h)
        cos, sin = ops.mrope_cos_sin(ctx.positions.unsqueeze(0).expand(3, -1), self.inv_freq, cfg.mrope_section,
                                     True)
        ctx = replace(ctx, cos=cos, sin=sin)
        u, inject = self.attn_hc.read(x)
        x = self.attn_hc.write(x, self.attention(u, ctx), inject)
        u, inject = self.mlp_hc.read(x)
        x = self.mlp_hc.write(x, self.moe(NormInput.formed(u))[0], inject)
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)
        mixed, _ = self.mixer_hc.read(x)
        return MTPOutput(ops.logits(mixed, self.lm_head), x)
