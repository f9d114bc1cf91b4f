"""The Qwen4-Exp text model: embedding into hc_count residual streams, the hybrid decoder stack, the final stream
reduction and the LM head (docs/architectures/qwen4exp.md).

Per layer: PLE adds its n-gram embedding to every stream (PLE layers only); the attention hyper-connection reads the
bank into one input for the mixer (Gated DeltaNet, or QSA attention) and injects its output per stream; the MLP
hyper-connection does the same around the MoE (Qwen3.5-MoE's block: softmax top-k router, routed experts, a
sigmoid-gated shared expert). There is no final norm: the final reduction's mixed streams go to the LM head. Only
the rows that sample (``logit_rows``) go through the reduction and the head. Positions are text positions (the
computed index); the rotary tables are Qwen3.5's MRoPE tables with three identical position rows, except in a call
with media (:meth:`Qwen4ExpModel.forward`'s ``positions3`` and ``media_rows``).

Parameter preparation: the loader never casts; each float weight stored in another float dtype is cast to the
activation dtype once, here (tied embed / lm_head stay one tensor). ``gdn/A_log`` and ``gdn/dt_bias`` keep their
stored dtype (read in fp32 only), and the PLE tables stay in host memory in their stored dtype (the gathered rows
are cast). A non-float weight, and a quantized one (not supported yet), is an error naming the parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from ninfer.contracts.features import StartupFeatures
from ninfer.contracts.program import ProgramError
from ninfer.quant import PackedWeight
from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.layers.fused import NormInput
from ninfer_qwen3_5.layers.gdn import GatedDeltaNet
from ninfer_qwen3_5.layers.host_options import expert_caches, host_expert_options, host_mailboxes, kernel_name
from ninfer_qwen3_5.layers.moe import SparseMoE
from ninfer_qwen3_5.model import inverse_frequencies
from ninfer_qwen3_5.parameters import layer_prefix

from ninfer_qwen4exp.config import INDEXED, Qwen4ExpConfig
from ninfer_qwen4exp.layers.gdn import SigmoidGatedDeltaNet
from ninfer_qwen4exp.layers.hyper import HyperConnection
from ninfer_qwen4exp.layers.ple import PLELayer, ngram_windows
from ninfer_qwen4exp.layers.qsa import QSAAttention
from ninfer_qwen4exp.parameters import host_expert_layers, host_expert_names, is_host_parameter, text_shapes
from ninfer_qwen4exp.ple_hash import config_hash

# Parameters read only in fp32, so any stored float dtype is fine.
_ANY_FLOAT = ("gdn/A_log", "gdn/dt_bias")


@dataclass(frozen=True)
class _Layer:
    ple: PLELayer | None
    attn_hc: HyperConnection
    mixer: object
    mlp_hc: HyperConnection
    moe: SparseMoE


def _group(weights: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def prepare_weights(cfg: Qwen4ExpConfig, weights: Mapping[str, torch.Tensor],
                    dtype: torch.dtype, host_banks: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every text parameter, checked, in ``dtype`` where the model computes with it (module docstring); host
    tables and the ``host_banks`` (host expert banks) as stored."""
    prepared: dict[str, torch.Tensor] = {}
    cast: dict[tuple, torch.Tensor] = {}
    for name, shape in text_shapes(cfg).items():
        w = weights.get(name)
        if w is None:
            raise ProgramError(f"Qwen4-Exp weights lack parameter {name!r}")
        if isinstance(w, PackedWeight):
            raise ProgramError(f"parameter {name!r} is stored {w.format}; quantized Qwen4-Exp weights are not "
                               f"supported yet")
        if tuple(w.shape) != shape:
            raise ProgramError(f"parameter {name!r} has shape {tuple(w.shape)}, expected {shape}")
        if not w.dtype.is_floating_point:
            raise ProgramError(f"parameter {name!r} is {w.dtype}; Qwen4-Exp weights must be floating point")
        host = is_host_parameter(name) or name in host_banks   # kept as stored
        if w.dtype != dtype and not name.endswith(_ANY_FLOAT) and not host:
            key = (w.device, w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), w.stride())
            if key not in cast:
                cast[key] = w.to(dtype)
            w = cast[key]
        prepared[name] = w
    return prepared


class Qwen4ExpModel:
    # A verify forward reads each verify row's staged first snapshot: the PLE layers' n-gram history and the
    # sigmoid-gated GDN layers' token-by-token verify (see ninfer_qwen3_5.speculative_state).
    stages_verify_snapshots = True

    def __init__(self, cfg: Qwen4ExpConfig, weights: Mapping[str, torch.Tensor], ops, device: torch.device,
                 dtype: torch.dtype, *, features: StartupFeatures | None = None) -> None:
        """``features``: the host-expert ones as Qwen3.5's model reads them (the text layers' routed experts in host
        memory, but the last ``device_expert_layers`` layers', docs/memory.md "Host experts")."""
        features = features or StartupFeatures()
        self.cfg, self.ops = cfg, ops
        w = prepare_weights(cfg, weights, dtype, host_expert_names(cfg, features))
        host_layers = set(host_expert_layers(cfg, features))
        n, h, eps, c35 = cfg.hc_count, cfg.hidden_size, cfg.rms_norm_eps, cfg.qwen35
        hosted = host_expert_options(h, cfg.moe_intermediate_size, cfg.num_experts, device, dtype, features, ops=ops)
        self.host_expert_kernel = kernel_name(hosted)   # what the host computes with ("auto" resolved)
        self.host_expert_threads = hosted.get("threads")
        self.embed, self.lm_head = w["text/embed"], w["text/lm_head"]
        self.mixer_hc = HyperConnection(n, h, eps, _group(w, "text/mixer_hc/"), ops)
        gdn_class = SigmoidGatedDeltaNet if cfg.output_gate_type == "sigmoid" else GatedDeltaNet
        self.layers: list[_Layer] = []
        for i, kind in enumerate(cfg.layer_types):
            p = layer_prefix("text", i) + "/"
            mixer = (QSAAttention(cfg, i, _group(w, p + "attention/"), ops) if kind == INDEXED
                     else gdn_class(c35, i, _group(w, p + "gdn/"), ops))
            ple = None
            if i in cfg.ple_layers:
                ple = PLELayer(i, config_hash(cfg, cfg.ple_layers.index(i)), n, h, cfg.ngram_size, cfg.eos_token_id,
                               eps, _group(w, p + "ple/"), ops, device)
            self.layers.append(_Layer(ple, HyperConnection(n, h, eps, _group(w, p + "attn_hc/"), ops), mixer,
                                      HyperConnection(n, h, eps, _group(w, p + "mlp_hc/"), ops),
                                      SparseMoE(c35, _group(w, p + "moe/"), ops,
                                                **(hosted if i in host_layers else {}))))
        self.inv_freq = inverse_frequencies(c35).to(device)
        self.sections = cfg.mrope_section

    def expert_caches(self) -> list:
        """The layers' device caches of host experts, in layer order (``HostExpertCaches``)."""
        return expert_caches(layer.moe for layer in self.layers)

    def host_mailboxes(self) -> list:
        """The layers' host-call mailboxes, in layer order (``HostExpertCaches``)."""
        return host_mailboxes(layer.moe for layer in self.layers)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos3 = positions.unsqueeze(0).expand(3, -1)
        return self.ops.mrope_cos_sin(pos3, self.inv_freq, self.sections, True)

    @property
    def multimodal_sections(self) -> tuple[int, ...]:
        """The MRoPE sections of 3-axis positions: the config's, else HF's default (11, 11, 10)."""
        return tuple(self.sections or (11, 11, 10))

    def rotary3(self, positions3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of per-axis positions ``[3, N]`` (multimodal prompts; text tokens have three equal rows)."""
        return self.ops.mrope_cos_sin(positions3, self.inv_freq, self.multimodal_sections, True)

    def forward(self, tokens: torch.Tensor, ctx: StepContext, logit_rows: torch.Tensor | None,
                return_bank: bool = False, *, positions3: torch.Tensor | None = None,
                media_rows: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits ``[len(logit_rows), V]`` of the tokens at ``logit_rows`` (None: every token); with
        ``return_bank``, ``(logits, bank)``: ``bank`` ``[N, n*H]`` every token's hyper-connection bank after the
        last layer, before the final reduction (what the MTP head takes, :mod:`ninfer_qwen4exp.mtp`).

        Multimodal calls, as Qwen3.5's: ``positions3`` int64 ``[3, N]``, every token's T/H/W positions (None:
        ``ctx.positions`` on all three axes); ``media_rows`` ``(index [M], rows [M, H])``: the embeddings of tokens
        ``index`` are ``rows`` instead of their token's, before the streams are formed. The n-gram windows still
        hash the token ids, placeholders included (transformers' ``ple_input_ids``)."""
        cfg = self.cfg
        cos, sin = self.rotary(ctx.positions) if positions3 is None else self.rotary3(positions3)
        ctx = replace(ctx, cos=cos, sin=sin)
        embedded = self.embed.index_select(0, tokens)
        if media_rows is not None:
            index, rows = media_rows
            embedded = embedded.index_copy(0, index, rows.to(embedded.dtype))
        bank = embedded.repeat(1, cfg.hc_count)
        windows = ngram_windows(tokens, ctx, cfg.ngram_size, cfg.eos_token_id) if cfg.ple_layers else None
        for layer in self.layers:
            if layer.ple is not None:
                bank = layer.ple(bank, windows, ctx)
            u, inject = layer.attn_hc.read(bank)
            y = layer.mixer(u, ctx) if isinstance(layer.mixer, QSAAttention) else layer.mixer(NormInput.formed(u),
                                                                                               ctx)[0]
            bank = layer.attn_hc.write(bank, y, inject)
            u, inject = layer.mlp_hc.read(bank)
            bank = layer.mlp_hc.write(bank, layer.moe(NormInput.formed(u))[0], inject)
        selected = bank if logit_rows is None else bank.index_select(0, logit_rows)
        h, _ = self.mixer_hc.read(selected)
        logits = self.ops.logits(h, self.lm_head)
        return (logits, bank) if return_bank else logits
