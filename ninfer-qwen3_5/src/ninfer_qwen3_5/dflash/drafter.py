"""The DFlash / DFlash2 drafter: context K/V from the target's hidden states, and one block forward.

Context (:meth:`DFlashDrafter.write_context`): for committed target positions ``t``, ``a_t`` is the concatenation
of the outputs of the target layers ``target_layer_ids`` (:meth:`~ninfer_qwen3_5.model.Qwen35Model.forward`'s
``aux_layers``); ``c_t = hidden_norm(fc(a_t))``; every drafter layer ``l`` stores ``K_l = rope(k_norm(k_proj_l(c_t)),
t)`` and ``V_l = v_proj_l(c_t)`` at ``t`` in its own pool of the Program's paged KV cache (the pools share the
target's page tables). The context never runs through the drafter's layers.

Block (:meth:`DFlashDrafter.block_hidden`): a row anchored at position ``s`` (its last committed token, which
the target has not computed yet) runs the ``B`` tokens ``[anchor, mask x (B - 1)]`` at positions ``s..s+B-1``
through every layer (embeddings: the target's table times ``input_embedding_scale``)::

    h = input_norm(x)                           # DFlash2: h, k2 = attention_conv.prepare(h)
    q, k, v = q_proj(h), k_proj(h), v_proj(h);  q, k = rope(q_norm(q)), rope(k_norm(k))
    K/V of the block positions -> the layer's pool (provisional: the row's next commit overwrites them)
    o = o_proj(attention(q over the context and the block))    # DFlash2: o = attention_conv.finish(o, k2)
    x = x + o;  h = post_norm(x)                # DFlash2: conv around the MLP likewise
    x = x + down(silu(gate(h)) * up(h))

and returns ``norm(x)`` of the ``B - 1`` mask positions: mask slot ``j`` predicts the token at ``s + j``
(:meth:`DFlashDrafter.logits`: the target's LM head times ``output_multiplier``, then
``c * tanh(logits / c)`` with ``c = final_logit_softcapping`` when set). Attention of a block query at ``p``:
every context position and every block position (non-causal) or those up to ``p`` (causal), within the layer's
sliding window (keys less than ``W`` away) if it has one. RoPE is the plain NeoX rotation over the whole head
with ``rope_theta``; all norms are plain RMSNorms (run as unit-offset norms, :mod:`.weights`).

DFlash2's grouped dynamic causal conv (per layer, one around attention and one around the MLP): with ``G``
channel groups of ``conv_group_size`` channels and ``K`` taps along the block (token ``t - o`` for tap ``o``,
zero before the block's first token), ``kernel_projection(h)`` gives per token two sets of ``K x G`` dynamic
weights; ``prepare(h) = sum_o (base[0, o] + dyn0[o, group]) * h[t - o]`` (per channel), and ``finish(y) = sum_o
(base[1, o] + dyn1[o, group]) * y[t - o]`` with ``dyn1`` from the same ``h``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from ninfer.contracts.program import ProgramError
from ninfer.program.batch import to_device
from ninfer.storage.kv_pool import PagedKVCache

from ninfer_qwen3_5.dflash.config import COMPONENT, DFlashConfig
from ninfer_qwen3_5.dflash.parameters import dflash_layer_prefix
from ninfer_qwen3_5.dflash.weights import prepare_dflash_weights


@dataclass(frozen=True)
class BlockRow:
    """One row of a block forward: sequence ``seq`` whose drafter pools hold its context ``[0, start)``, anchored
    at ``start`` with token ``anchor``, ``length`` block tokens (``>= 2``: the anchor and ``length - 1`` masks)."""

    seq: object
    start: int
    anchor: int
    length: int


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    query: torch.Tensor      # [Nq*D, H]
    kv: torch.Tensor         # [2*Nkv*D, H]: key rows, then value rows (a view of the drafter's ctx_kv)
    out: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    causal: bool
    window: int | None
    kv_layer: int
    conv: tuple | None       # DFlash2: (attention base, projection, mlp base, projection)


@dataclass(frozen=True)
class BlockInputs:
    """The device inputs of one block forward over its ``T`` tokens, row after row: ``tokens``, ``positions`` and
    KV ``slot_mapping`` int64 ``[T]``; ``attention(q [T, Hq, D], layer)`` over the layer's pool; DFlash2's conv
    ``shifts`` (:func:`conv_sources`; None for DFlash); ``keep`` int64, the mask tokens whose outputs come out."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    attention: Callable[[torch.Tensor, _Layer], torch.Tensor]
    shifts: torch.Tensor | None
    keep: torch.Tensor


def inverse_frequencies(cfg: DFlashConfig) -> torch.Tensor:
    """``1 / theta^(2i/D)`` for i < D/2, fp32, computed on the CPU as HF's default RoPE does."""
    d = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


class DFlashDrafter:
    """The ``dflash`` component as a drafter for its target (module docstring). ``weights`` hold the ``dflash/*``
    parameters (others are ignored); ``embed`` / ``lm_head`` are the target's prepared tensors, shared;
    ``kv_layers[i]`` is the KV pool id of drafter layer i (its pools have the drafter's own head geometry)."""

    def __init__(self, cfg: DFlashConfig, weights: Mapping[str, torch.Tensor], embed: torch.Tensor,
                 lm_head: torch.Tensor, ops, device: torch.device, dtype: torch.dtype,
                 kv_layers: Sequence[int]) -> None:
        if len(kv_layers) != cfg.num_layers:
            raise ProgramError(f"a DFlash drafter of {cfg.num_layers} layers needs as many KV pools, got {kv_layers}")
        self.cfg, self.ops, self.eps, self.device, self.dtype = cfg, ops, cfg.rms_norm_eps, device, dtype
        w = prepare_dflash_weights(cfg, weights, dtype)
        self.embed, self.lm_head = embed, lm_head
        self.fc, self.hidden_norm, self.norm = w[f"{COMPONENT}/fc"], w[f"{COMPONENT}/hidden_norm"], w[f"{COMPONENT}/norm"]
        # Every layer's key and value rows in one tensor: the context's K/V of all layers is one GEMM, and a
        # layer's block K/V one GEMM over its (contiguous) slice.
        self.ctx_kv = torch.cat([w[dflash_layer_prefix(i) + f"/attention/{s}"] for i in range(cfg.num_layers)
                                 for s in ("key", "value")])
        kd = cfg.num_kv_heads * cfg.head_dim
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = dflash_layer_prefix(i) + "/"
            conv = None
            if cfg.generation == 2:
                conv = tuple(w[p + s] for s in ("attention_conv/base", "attention_conv/projection", "mlp_conv/base",
                                                "mlp_conv/projection"))
            self.layers.append(_Layer(w[p + "input_norm"], w[p + "post_norm"], w[p + "attention/query"],
                                      self.ctx_kv[2 * i * kd:(2 * i + 2) * kd], w[p + "attention/out"], w[p + "attention/q_norm"], w[p + "attention/k_norm"],
                                      w[p + "mlp/gate_up"], w[p + "mlp/down"], cfg.causal[i], cfg.sliding_window[i],
                                      kv_layers[i], conv))
        if cfg.generation == 2:
            self.selector_predecessor = w[f"{COMPONENT}/selector/predecessor"]
            self.selector_successor = w[f"{COMPONENT}/selector/successor"]
            self.selector_hidden = w[f"{COMPONENT}/selector/hidden"]
        self.inv_freq = inverse_frequencies(cfg).to(device)
        self.scale = cfg.head_dim ** -0.5

    # -- shared pieces ---------------------------------------------------------------------------
    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.mrope_cos_sin(positions[None], self.inv_freq, None, False)

    def _kv_write(self, layer: _Layer, kv: PagedKVCache, k, v, cos, sin, slots: torch.Tensor) -> None:
        n, hk, d = k.shape[0], self.cfg.num_kv_heads, self.cfg.head_dim
        k = self.ops.rope(self.ops.rms_norm_unit_offset(k.reshape(n, hk, d), layer.k_norm, self.eps), cos, sin)
        k_pool, v_pool = kv.pools(layer.kv_layer)
        self.ops.kv_cache_write(k.contiguous(), v.reshape(n, hk, d).contiguous(), k_pool, v_pool, slots)

    # -- context ---------------------------------------------------------------------------------
    def write_context(self, kv: PagedKVCache, aux: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """Store the context K/V of ``N`` committed positions (module docstring): ``aux`` ``[N, n*H]`` their target
        features, ``positions`` / ``slot_mapping`` int64 ``[N]`` their positions and flat KV slots."""
        if aux.shape[0] == 0:
            return
        ops, cfg = self.ops, self.cfg
        c = ops.rms_norm_unit_offset(ops.linear(aux, self.fc), self.hidden_norm, self.eps)
        kv_all = ops.linear(c, self.ctx_kv)
        cos, sin = self._rotary(positions)
        kd = cfg.num_kv_heads * cfg.head_dim
        for i, layer in enumerate(self.layers):
            k = kv_all[:, 2 * i * kd:(2 * i + 1) * kd]
            v = kv_all[:, (2 * i + 1) * kd:(2 * i + 2) * kd]
            self._kv_write(layer, kv, k, v, cos, sin, slot_mapping)

    # -- block -----------------------------------------------------------------------------------
    def block_hidden(self, kv: PagedKVCache, rows: Sequence[BlockRow]) -> torch.Tensor:
        """The normed outputs ``[sum(length - 1), H]`` of every row's mask positions, row after row (module
        docstring). Writes the block K/V into the drafter pools at the rows' positions ``[start, start + length)``,
        which must be covered by their pages."""
        return self.block_forward(kv, self.block_inputs(kv, rows))

    def block_inputs(self, kv: PagedKVCache, rows: Sequence[BlockRow]) -> BlockInputs:
        """The device inputs of the block forward of ``rows``, built from the host."""
        if not rows or any(r.length < 2 or r.start < 0 for r in rows):
            raise ProgramError(f"a DFlash block needs rows of length >= 2 at start >= 0: {list(rows)}")
        cfg, dev = self.cfg, self.device
        toks, pos, slots, seqs, owner = [], [], [], [], []
        for r, row in enumerate(rows):
            toks += [row.anchor] + [cfg.mask_token_id] * (row.length - 1)
            pos += list(range(row.start, row.start + row.length))
            slots += kv.slot_mapping(row.seq, row.start, row.start + row.length)
            seqs += [row.seq] * row.length
            owner += [r] * row.length
        ends = [rows[o].start + rows[o].length for o in owner]
        keep = [i for i in range(len(toks)) if pos[i] != rows[owner[i]].start]
        shifts = (conv_sources([r.length for r in rows], cfg.conv_kernel_size, dev) if cfg.generation == 2
                  else None)
        # Host lists reach the device through pinned non-blocking copies (a pageable copy waits for the stream).
        return BlockInputs(to_device(toks, torch.int64, dev), to_device(pos, torch.int64, dev),
                           to_device(slots, torch.int64, dev), _Attention(kv, seqs, pos, ends, self.scale, self.ops, dev),
                           shifts, to_device(keep, torch.int64, dev))

    def block_forward(self, kv: PagedKVCache, inputs: BlockInputs) -> torch.Tensor:
        """The block forward on device inputs (eager from :meth:`block_inputs`, or a graph's static inputs): the
        normed outputs of the tokens ``inputs.keep``; writes the block K/V at ``inputs.slot_mapping``."""
        ops, cfg = self.ops, self.cfg
        t = inputs.tokens.shape[0]
        x = self.embed.index_select(0, inputs.tokens)
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        cos, sin = self._rotary(inputs.positions)
        shifts = inputs.shifts
        nq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qd, kd = nq * d, hk * d
        for layer in self.layers:
            h = ops.rms_norm_unit_offset(x, layer.input_norm, self.eps)
            if layer.conv is not None:
                h, dyn = self._conv_prepare(h, layer.conv[0], layer.conv[1], shifts)
            q = ops.rope(ops.rms_norm_unit_offset(ops.linear(h, layer.query).reshape(t, nq, d), layer.q_norm, self.eps),
                         cos, sin)
            kv_rows = ops.linear(h, layer.kv)
            self._kv_write(layer, kv, kv_rows[:, :kd], kv_rows[:, kd:], cos, sin, inputs.slot_mapping)
            o = inputs.attention(q.contiguous(), layer)
            o = ops.linear(o.reshape(t, qd), layer.out)
            if layer.conv is not None:
                o = _grouped_conv(o, dyn, layer.conv[0][1], shifts)
            x = x + o
            h = ops.rms_norm_unit_offset(x, layer.post_norm, self.eps)
            if layer.conv is not None:
                h, dyn = self._conv_prepare(h, layer.conv[2], layer.conv[3], shifts)
            m = ops.linear(ops.silu_and_mul(ops.linear(h, layer.gate_up)), layer.down)
            if layer.conv is not None:
                m = _grouped_conv(m, dyn, layer.conv[2][1], shifts)
            x = x + m
        return ops.rms_norm_unit_offset(x.index_select(0, inputs.keep), self.norm, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 draft logits of normed block outputs ``[..., H]`` (module docstring)."""
        shape = hidden.shape[:-1]
        out = self.ops.logits(hidden.reshape(-1, hidden.shape[-1]), self.lm_head)
        if self.cfg.output_multiplier != 1.0:
            out = out * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap:
            out = torch.tanh(out / cap) * cap
        return out.reshape(*shape, out.shape[-1])

    # -- DFlash2 conv ----------------------------------------------------------------------------
    def _conv_prepare(self, h: torch.Tensor, base: torch.Tensor, projection: torch.Tensor, shifts: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prepare(h), the finish weights)``: ``kernel_projection(h)`` as ``[T, 2, K, G]``, set 0 applied now."""
        k, g = self.cfg.conv_kernel_size, self.cfg.conv_groups
        dyn = self.ops.linear(h, projection).reshape(h.shape[0], 2, k, g)
        return _grouped_conv(h, dyn[:, 0], base[0], shifts), dyn[:, 1]


def conv_sources(lengths: Sequence[int], k: int, device: torch.device) -> torch.Tensor:
    """int64 ``[K, T]`` for rows of ``lengths`` tokens packed row after row: for tap ``o``, the packed index of
    token ``i - o`` of the same row, or ``T`` (a zero row) before the row's first token."""
    t = sum(lengths)
    idx, at = [], 0
    for n in lengths:
        idx.append([[at + j - o if j >= o else t for j in range(n)] for o in range(k)])
        at += n
    return to_device([sum((r[o] for r in idx), []) for o in range(k)], torch.int64, device)


def _grouped_conv(x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """``sum_o (base[o] + dyn[:, o, group]) * x[t - o]`` per channel (module docstring), in ``x``'s dtype; ``dyn``
    ``[T, K, G]``, ``base`` ``[K, H]``, ``shifts`` from :func:`conv_sources`."""
    t, h = x.shape
    g = dyn.shape[-1]
    padded = torch.cat((x, x.new_zeros(1, h)))
    out = torch.zeros_like(x).view(t, g, h // g)
    for o in range(base.shape[0]):
        v = padded.index_select(0, shifts[o]).view(t, g, h // g)
        out = out + base[o].to(x.dtype).view(1, g, h // g) * v
        out = torch.addcmul(out, dyn[:, o, :, None].to(x.dtype), v)
    return out.view(t, h)


class _Attention:
    """Block attention of one block forward (module docstring), per layer kind: every block token is its own
    attention row of one query whose keys are ``[lo, hi)`` of its sequence; ``hi`` the block's end (non-causal)
    or the token's own position + 1 (causal), ``lo`` 0 or, in a sliding layer, the window's start. Rows with
    ``lo == 0`` everywhere run the core's paged attention (a query at ``hi - 1`` sees ``[0, hi)``); a window
    that cuts the context runs :func:`_window_attention`."""

    def __init__(self, kv: PagedKVCache, seqs: list, pos: list[int], ends: list[int], scale: float, ops,
                 device: torch.device) -> None:
        self.kv, self.seqs, self.pos, self.ends, self.scale, self.ops, self.device = kv, seqs, pos, ends, scale, ops, device
        self._plans: dict[tuple[bool, int | None], tuple] = {}

    def _plan(self, causal: bool, window: int | None) -> tuple:
        key = (causal, window)
        if key not in self._plans:
            hi = [p + 1 if causal else e for p, e in zip(self.pos, self.ends, strict=True)]
            lo = [0] * len(hi)
            if window is not None:
                lo = [max(0, p - window + 1) for p in self.pos]
                hi = [min(h, p + window) for h, p in zip(hi, self.pos, strict=True)]
            t = len(hi)
            tables = self.kv.page_table_tensor(self.seqs, hi, non_blocking=True)
            lens = to_device(hi, torch.int32, self.device)
            cu = torch.arange(t + 1, dtype=torch.int32, device=self.device)
            self._plans[key] = (lo, hi, tables, lens, cu)
        return self._plans[key]

    def __call__(self, q: torch.Tensor, layer: _Layer) -> torch.Tensor:
        lo, hi, tables, lens, cu = self._plan(layer.causal, layer.window)
        k_pool, v_pool = self.kv.pools(layer.kv_layer)
        if not any(lo):
            return self.ops.paged_attention(q, k_pool, v_pool, cu, lens, tables, self.scale)
        return _window_attention(q, k_pool, v_pool, tables, lo, hi, self.scale)


def _window_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                      lo: list[int], hi: list[int], scale: float) -> torch.Tensor:
    """Query ``t`` of ``q`` ``[T, Hq, D]`` over its keys ``[lo[t], hi[t])`` (page table row ``t``), GQA, fp32
    softmax, rounded once to ``q``'s dtype."""
    t, hq, d = q.shape
    page, hkv = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty_like(q)
    for i in range(t):
        keys = torch.arange(lo[i], hi[i], device=q.device)
        pages = tables[i].to(torch.int64).index_select(0, keys // page)
        k = k_pool[pages, keys % page].float()          # [L, Hkv, D]
        v = v_pool[pages, keys % page].float()
        qi = q[i].float().view(hkv, hq // hkv, d)       # query head h reads KV head h // (Hq / Hkv)
        scores = torch.einsum("grd,lgd->grl", qi, k) * scale
        o = torch.einsum("grl,lgd->grd", torch.softmax(scores, dim=-1), v)
        out[i] = o.reshape(hq, d).to(q.dtype)
    return out
