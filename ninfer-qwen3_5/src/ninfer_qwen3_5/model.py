"""The Qwen3.5 text model: embedding, the hybrid decoder stack, final norm and LM head.

Pre-norm residual stream (reference doc section 3): ``x += mixer(norm(x)); x += mlp(norm(x))`` with Qwen3.5's
zero-centred RMSNorm (core's ``rms_norm_unit_offset``: the checkpoint stores the scale's offset from 1), the residual
adds fused into ``add_rms_norm_unit_offset``, which each block runs as part of its first projection
(``add_rms_norm_unit_offset_linear`` via :class:`~ninfer_qwen3_5.layers.fused.NormInput`). Only the rows that sample
(each decode row, the chunk's last token) go through the final norm and the LM head. Positions are text
positions (the computed index); MRoPE cos/sin are built from three identical rows, as HF does for text. A
multimodal call (the Program's vision path) gives each token's three position axes and the media embeddings that
replace placeholder tokens' embeddings.

Parameter preparation: the loader never casts (it hands over the stored encoding); the model casts
float weights stored in another float dtype to the activation dtype once, at construction (bf16
weights run exactly in fp32 on the CPU; fp32 weights round to bf16 on the GPU, as every engine does).
A_log and dt_bias keep their stored dtype (they are only read in fp32). A non-float weight is an error
naming the parameter. A quantized weight (:class:`~ninfer.quant.PackedWeight`) is passed on as stored; the
ops must have an implementation for its format on this device (checked here, an error naming op, format and
device otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from ninfer.contracts.features import StartupFeatures
from ninfer.contracts.program import ProgramError
from ninfer.quant import PackedWeight

from ninfer_qwen3_5.config import FULL, Qwen35Config
from ninfer_qwen3_5.layers.attention import GatedAttention
from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.layers.fused import NormInput
from ninfer_qwen3_5.layers.gdn import GatedDeltaNet
from ninfer_qwen3_5.layers.host_options import expert_caches, host_expert_options, host_mailboxes, kernel_name
from ninfer_qwen3_5.layers.mlp import DenseMLP
from ninfer_qwen3_5.layers.moe import SparseMoE
from ninfer_qwen3_5.parameters import HOST_EXPERT_BANKS, host_expert_layers, layer_prefix, text_shapes

# The ops that read a matmul weight: each must take the quantized formats of the parameters it reads.
_DENSE_WEIGHT_OPS = ("linear", "logits", "add_rms_norm_unit_offset_linear", "add_rms_norm_unit_offset_swiglu")
# Parameters that only ``moe_experts`` reads (the routed banks and the shared expert's down projection).
_EXPERT_WEIGHTS = ("moe/experts/gate_up", "moe/experts/down", "moe/shared/down")


def weight_ops(name: str) -> tuple[str, ...]:
    """The ops that read the matmul weight ``name``: a quantized weight needs a kernel for its format in each."""
    return ("moe_experts",) if name.endswith(_EXPERT_WEIGHTS) else _DENSE_WEIGHT_OPS


def check_weight_formats(ops, formats: Mapping[str, str]) -> None:
    """OpError naming the first op that cannot read a quantized parameter's format (``formats``: name -> format);
    a dense model never asks ``moe_experts``, so a format only the dense kernels read is enough for it."""
    needed: dict[str, set[str]] = {}
    for name, fmt in formats.items():
        for op in weight_ops(name):
            needed.setdefault(op, set()).add(fmt)
    for op in sorted(needed):
        ops.check_formats(op, sorted(needed[op]))
# Parameters read only in fp32, so any stored float dtype is fine.
_ANY_FLOAT = ("gdn/A_log", "gdn/dt_bias")


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: object
    mlp: object


def _group(weights: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The parameters under ``prefix``, keyed by the rest of their name."""
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def inverse_frequencies(cfg: Qwen35Config) -> torch.Tensor:
    """``1 / theta^(2i/R)`` for i < R/2, fp32, computed on the CPU like HF's default RoPE init."""
    r = cfg.rotary_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))


def _stored_experts(cfg: Qwen35Config, weights: Mapping[str, torch.Tensor]) -> tuple[str, int] | None:
    """(format, one routed expert's stored bytes) when the first MoE layer's banks are quantized, else None."""
    banks = [weights.get(layer_prefix("text", 0) + f"/moe/experts/{name}") for name in ("gate_up", "down")]
    if not all(isinstance(b, PackedWeight) for b in banks):
        return None
    return banks[0].format, sum(b.nbytes for b in banks) // cfg.num_experts


class Qwen35Model:
    def __init__(self, cfg: Qwen35Config, weights: Mapping[str, torch.Tensor], ops, device: torch.device,
                 dtype: torch.dtype, *, features: StartupFeatures | None = None) -> None:
        """``features`` (None: the defaults): with ``host_experts``, the routed banks of the text layers but the last
        ``device_expert_layers`` are in host memory (:func:`~.parameters.host_expert_layers`),
        as ``expert_cache_slots``, ``expert_copy_min_tokens``, ``host_expert_threads`` and ``host_expert_kernel``
        say (:func:`~.layers.host_options.host_expert_options`, docs/memory.md "Host experts")."""
        features = features or StartupFeatures()
        self.cfg, self.ops = cfg, ops
        self.host_experts = features.host_experts
        host_layers = set(host_expert_layers(cfg, features))
        self.host_banks = frozenset(layer_prefix("text", i) + bank for i in host_layers for bank in HOST_EXPERT_BANKS)
        hosted = (host_expert_options(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, device, dtype,
                                      features, _stored_experts(cfg, weights), ops=ops) if cfg.is_moe else {})
        self.host_expert_kernel = kernel_name(hosted)   # what the host computes with ("auto" resolved)
        self.host_expert_threads = hosted.get("threads")
        weights = self._prepare_weights(weights, dtype)
        self.embed, self.lm_head, self.norm = weights["text/embed"], weights["text/lm_head"], weights["text/norm"]
        self.layers: list[_Layer] = []
        for i, kind in enumerate(cfg.layer_types):
            p = layer_prefix("text", i) + "/"
            mixer = (GatedAttention(cfg, i, _group(weights, p + "attention/"), ops) if kind == FULL
                     else GatedDeltaNet(cfg, i, _group(weights, p + "gdn/"), ops))
            mlp = (SparseMoE(cfg, _group(weights, p + "moe/"), ops, **(hosted if i in host_layers else {}))
                   if cfg.is_moe
                   else DenseMLP(_group(weights, p + "mlp/"), ops))
            self.layers.append(_Layer(weights[p + "input_norm"], weights[p + "post_norm"], mixer, mlp))
        self.inv_freq = inverse_frequencies(cfg).to(device)
        # HF's Qwen3.5 text rotary always recomposes interleaved (the config flag is informational).
        self.sections = cfg.mrope_section

    def _prepare_weights(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        prepared = dict(weights)
        # One cast per shared tensor (tied embed/lm_head stay shared). The loader hands each name its
        # own view object, so sharing is keyed by storage and view geometry, not by id().
        cast: dict[tuple, torch.Tensor] = {}
        packed: dict[str, str] = {}
        for name, shape in text_shapes(self.cfg).items():
            w = weights.get(name)
            if w is None:
                raise ProgramError(f"Qwen3.5 weights lack parameter {name!r}")
            if tuple(w.shape) != shape:
                raise ProgramError(f"parameter {name!r} has shape {tuple(w.shape)}, expected {shape}")
            if isinstance(w, PackedWeight):
                if name == "text/embed":
                    raise ProgramError(f"parameter {name!r} is stored {w.format}; the embedding table must be a "
                                       f"float format")
                if name not in self.host_banks:   # the host decodes any format
                    packed[name] = w.format
                continue
            if not w.dtype.is_floating_point:
                raise ProgramError(f"parameter {name!r} is {w.dtype}; Qwen3.5 weights must be floating point")
            if name in self.host_banks:
                continue   # kept as stored in host memory: the host computes in the wider dtype
            if w.dtype != dtype and not name.endswith(_ANY_FLOAT):
                key = (w.device, w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), w.stride())
                if key not in cast:
                    # A host-placed table stays page-locked: the device reads it in place.
                    cast[key] = w.to(dtype).pin_memory() if w.is_pinned() else w.to(dtype)
                prepared[name] = cast[key]
        check_weight_formats(self.ops, packed)
        return prepared

    def expert_caches(self) -> list:
        """The layers' device caches of host experts, in layer order (program's ``HostExpertCaches``)."""
        return expert_caches(layer.mlp for layer in self.layers)

    def host_mailboxes(self) -> list:
        """The layers' host-call mailboxes, in layer order (program's ``HostExpertCaches``)."""
        return host_mailboxes(layer.mlp for layer in self.layers)

    @property
    def stages_verify_snapshots(self) -> bool:
        """Whether a verify forward needs each verify row's live image staged into its first snapshot beforehand:
        only when a GDN layer verifies token by token (``GatedDeltaNet.fused_verify`` False); ``gdn_verify`` reads
        the live slots itself."""
        return any(not getattr(layer.mixer, "fused_verify", True) for layer in self.layers)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos3 = positions.unsqueeze(0).expand(3, -1)   # a view: both implementations read strided positions
        return self.ops.mrope_cos_sin(pos3, self.inv_freq, self.sections, True)

    @property
    def multimodal_sections(self) -> tuple[int, ...]:
        """The MRoPE sections of 3-axis positions: the config's, else HF's default (11, 11, 10)."""
        return tuple(self.cfg.mrope_section or (11, 11, 10))

    def rotary3(self, positions3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of per-axis positions ``[3, N]`` (multimodal prompts; text tokens have three equal rows)."""
        return self.ops.mrope_cos_sin(positions3, self.inv_freq, self.multimodal_sections, True)

    def forward(self, tokens: torch.Tensor, ctx: StepContext, logit_rows: torch.Tensor | None,
                return_hidden: str | None = None, aux_layers: tuple[int, ...] | None = None, *,
                positions3: torch.Tensor | None = None, media_rows: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """fp32 logits ``[len(logit_rows), V]`` of the tokens at ``logit_rows`` (None: every token). ``ctx`` comes
        without rotary tables; they are built here, after the embedding.

        Multimodal calls: ``positions3`` int64 ``[3, N]``, every token's T/H/W positions (None: ``ctx.positions``
        on all three axes); ``media_rows`` ``(index [M], rows [M, H])``: the embeddings of tokens ``index`` are
        ``rows`` instead of their token's (media embeddings over placeholders), before the first norm.

        ``return_hidden`` (default None: the logits alone, the hot path untouched): return ``(logits, hidden)``
        with ``hidden`` the final-normed hidden states (activation dtype) the LM head reads, what an MTP
        drafter takes as ``h_t`` (:mod:`ninfer_qwen3_5.mtp`): ``"rows"``: ``[len(logit_rows), H]``, those of the
        logit rows; ``"all"``: ``[N, H]``, every token's (the final norm then runs over all N rows; the logits
        are still those of ``logit_rows``).

        ``aux_layers`` (a DFlash drafter's target layers): also return, last, ``aux`` ``[N, len(aux_layers) * H]``:
        for every token, the outputs of those layers (the residual stream after the layer, HF's
        ``hidden_states[i + 1]``) concatenated in the given order."""
        if return_hidden not in (None, "rows", "all"):
            raise ProgramError(f"return_hidden must be None, 'rows' or 'all', got {return_hidden!r}")
        ops, eps = self.ops, self.cfg.rms_norm_eps
        # The embedding rows and the first block's pre-norm in one op; then the rotary tables, whose kernel
        # computes them while the embedding's finishes (PDL), and the first projection.
        first = self.layers[0].input_norm
        normed, residual = ops.embed_rms_norm_unit_offset(tokens, self.embed, first, eps)
        if media_rows is not None:
            index, rows = media_rows
            residual = residual.index_copy(0, index, rows.to(residual.dtype))
            normed = ops.rms_norm_unit_offset(residual, first, eps)
        cos, sin = self.rotary(ctx.positions) if positions3 is None else self.rotary3(positions3)
        ctx = replace(ctx, cos=cos, sin=sin)
        out = None   # the first layer's input is the embedding itself, normed already
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            inp = NormInput(out, residual, layer.input_norm, eps, normed if i == 0 else None)
            out, residual = layer.mixer(inp, ctx)
            out, residual = layer.mlp(NormInput(out, residual, layer.post_norm, eps))
            if aux_layers and i in aux_layers:
                taps[i] = out + residual   # the add the next layer's norm fuses, in the activation dtype
        extra = (torch.cat([taps[i] for i in aux_layers], dim=-1),) if aux_layers else ()
        if return_hidden == "all":
            h_all, _ = ops.add_rms_norm_unit_offset(out, residual, self.norm, eps)
            h = h_all if logit_rows is None else h_all.index_select(0, logit_rows)
            return (ops.logits(h, self.lm_head), h_all, *extra)
        if logit_rows is not None:
            out, residual = out.index_select(0, logit_rows), residual.index_select(0, logit_rows)
        h, _ = ops.add_rms_norm_unit_offset(out, residual, self.norm, eps)
        logits = ops.logits(h, self.lm_head)
        if return_hidden:
            return (logits, h, *extra)
        return (logits, *extra) if extra else logits
