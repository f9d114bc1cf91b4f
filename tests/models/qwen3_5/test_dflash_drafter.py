"""The DFlash / DFlash2 drafter (ninfer_qwen3_5.dflash.drafter) against an independent torch reference.

World: a tiny random Qwen3.5 target from transformers and a random drafter in the z-lab format
(``support.dflash``), both converted with our converter (``--draft``) and loaded back; our KV is one PagedKVCache
holding the target's attention pools and the drafter's (their own head geometry), page size 4 so tables span
pages.

Oracle (written here from the published architecture, no paging, no cache): the target's context features are
transformers' ``hidden_states[i + 1]`` of the target layers; the drafter runs the context and the block as one
sequence per layer, K/V of both from the same projections, an explicit attention mask (context always visible;
inside the block all or causal; a sliding window both ways), plain RMSNorms, the NeoX RoPE of the config, the
DFlash2 conv written as loops over taps, the target's LM head times ``output_multiplier`` with the soft cap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ninfer.conversion import convert
from ninfer.storage.kv_pool import PagedKVCache
from ninfer.storage.state_image import StateImageStorage
from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.dflash.drafter import BlockRow, DFlashDrafter
from ninfer_qwen3_5.dflash_reference import load_reference
from ninfer_qwen3_5.model import Qwen35Model
from ninfer_qwen3_5.mtp import mtp_step_context
from ninfer_qwen3_5.state import state_layout
from support.dflash import drafter_config, drafter_tensors, write_dflash_drafter
from support.models import tiny_text_model

from .harness import GEOMETRY

CPU, F32 = torch.device("cpu"), torch.float32
ATOL, RTOL = 1e-4, 1e-4
TEXT = dict(GEOMETRY, num_hidden_layers=4, intermediate_size=96, tie_word_embeddings=False)
BASE = dict(hidden_size=64, vocab_size=512, num_target_layers=4, target_layer_ids=[0, 2], block_size=8,
            mask_token_id=511, head_dim=8, heads=4, kv_heads=2, intermediate=80)
VARIANTS = {
    "dflash": dict(generation=1),
    "dflash_swa_causal": dict(generation=1, sliding_window=6),   # v1 sliding layers: causal, window 6
    "dflash2": dict(generation=2, sliding_window=9, conv_group=8, selector_rank=8, selector_top_k=4),
    "dflash2_full": dict(generation=2, conv_group=16, conv_kernel=3),
}


@dataclass
class World:
    name: str
    hf_config: dict
    tensors: dict
    cfg: Qwen35Config
    ops: object
    model: Qwen35Model
    drafter: DFlashDrafter
    hf: torch.nn.Module


_HF: dict[str, tuple] = {}
_WORLDS: dict[str, World] = {}


def _target(tmp: Path):
    if "target" not in _HF:
        folder = tmp / "target"
        hf = tiny_text_model("dense", TEXT, seed=31)
        hf.save_pretrained(folder)
        _HF["target"] = (folder, hf)
    return _HF["target"]


def _world(name: str, factory) -> World:
    if name in _WORLDS:
        return _WORLDS[name]
    tmp = factory.mktemp(f"dflash_{name}")
    folder, hf = _target(factory.getbasetemp())
    kw = {**BASE, **VARIANTS[name]}
    write_dflash_drafter(tmp / "draft", seed=32, **kw)
    entry = convert(folder, tmp / "m.ninfer", progress=False, draft=tmp / "draft").paths[0]
    cfg, ops, model, drafter = load_reference(entry)
    hf_cfg = drafter_config(**kw)
    _WORLDS[name] = World(name, hf_cfg, drafter_tensors(hf_cfg, seed=32), cfg, ops, model, drafter, hf)
    return _WORLDS[name]


@pytest.fixture(params=list(VARIANTS))
def world(request, tmp_path_factory) -> World:
    return _world(request.param, tmp_path_factory)


class Store:
    """The target's attention pools plus the drafter's (own geometry), and StateImages for the GDN layers."""

    def __init__(self, w: World, *, num_pages: int = 256, page_size: int = 4) -> None:
        d = w.drafter.cfg
        own = {layer.kv_layer: (d.num_kv_heads, d.head_dim) for layer in w.drafter.layers}
        self.w = w
        self.kv = PagedKVCache((*w.cfg.attention_layers, *own), num_pages=num_pages, page_size=page_size,
                               num_kv_heads=w.cfg.num_kv_heads, head_dim=w.cfg.head_dim, dtype=F32, device=CPU,
                               geometry=own)
        self.states = StateImageStorage(state_layout(w.cfg, F32), 4, CPU)
        self.kv.ensure("other", 9)   # a live table first, so the sequences' pages are not 0, 1, 2, ...

    def prefill(self, seq: int, tokens: list[int], start: int = 0, reserve: int = 0) -> None:
        """Our target over ``tokens`` from ``start`` (state slot ``seq``), then its context K/V in the drafter."""
        assert self.kv.ensure(seq, start + len(tokens) + reserve, write_from=start)
        ctx = mtp_step_context(self.kv, chunks=[(seq, start, len(tokens))], device=CPU)
        ctx = replace(ctx, chunk_slots=(seq,), states=self.states)
        ids = self.w.drafter.cfg.target_layer_ids
        _, aux = self.w.model.forward(torch.tensor(tokens), ctx, None, aux_layers=ids)
        assert aux.shape == (len(tokens), len(ids) * self.w.cfg.hidden_size)
        self.w.drafter.write_context(self.kv, aux, ctx.positions, ctx.slot_mapping)


# -- the oracle ----------------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotate-half over the whole head: x [L, heads, D] at positions pos [L]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).float()[:, None], torch.cat((ang.sin(), ang.sin()), -1).float()[:, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def _conv(x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """out[t, c] = sum over taps o with t - o >= 0 of (base[o, c] + dyn[t, o, c // group]) * x[t - o, c]."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for o in range(base.shape[0]):
            if t - o >= 0:
                out[t] += (base[o] + dyn[t, o].repeat_interleave(group)) * x[t - o]
    return out


def oracle_block_logits(w: World, tokens: list[int], anchor: int, length: int) -> torch.Tensor:
    """The drafter's logits ``[length - 1, V]`` for a block anchored after the context ``tokens``."""
    c, t = w.hf_config, w.tensors
    dc = c["dflash_config"]
    eps, theta = c["rms_norm_eps"], c.get("rope_theta") or c["rope_parameters"]["rope_theta"]
    nq, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    gen2 = c["architectures"][0] == "DFlash2DraftModel"
    causal = c.get("is_causal", c["layer_types"][0] == "sliding_attention")
    window = c["sliding_window"] if c["layer_types"][0] == "sliding_attention" else None
    with torch.no_grad():
        hs = w.hf(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
        ctx = _rms(torch.cat([hs[i + 1][0] for i in dc["target_layer_ids"]], -1) @ t["fc.weight"].T,
                   t["hidden_norm.weight"], eps)
        s = len(tokens)
        block = torch.tensor([anchor] + [dc["mask_token_id"]] * (length - 1))
        x = w.hf.model.embed_tokens(block)
        kpos, qpos = torch.arange(s + length), torch.arange(s, s + length)
        allowed = torch.ones(length, s + length, dtype=torch.bool)
        if causal:
            allowed &= kpos[None] <= qpos[:, None]
        if window is not None:
            allowed &= (qpos[:, None] - kpos[None] < window) & (kpos[None] - qpos[:, None] < window)

        def conv_pair(prefix: str, h: torch.Tensor):
            K = dc["conv_kernel_size"]
            dyn = (h @ t[prefix + ".kernel_projection.weight"].T).view(length, 2, K, -1)
            base = t[prefix + ".base_kernel"]
            return _conv(h, dyn[:, 0], base[0], dc["conv_group_size"]), (dyn[:, 1], base[1])

        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}."
            h = _rms(x, t[p + "input_layernorm.weight"], eps)
            if gen2:
                h, fin = conv_pair(p + "attention_conv", h)
            q = _rope(_rms((h @ t[p + "self_attn.q_proj.weight"].T).view(length, nq, d), t[p + "self_attn.q_norm.weight"],
                           eps), qpos, theta)
            both = torch.cat((ctx, h))
            k = _rope(_rms((both @ t[p + "self_attn.k_proj.weight"].T).view(-1, nkv, d), t[p + "self_attn.k_norm.weight"],
                           eps), kpos, theta)
            v = (both @ t[p + "self_attn.v_proj.weight"].T).view(-1, nkv, d)
            k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
            scores = scores.masked_fill(~allowed[None], float("-inf"))
            o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, nq * d)
            o = o @ t[p + "self_attn.o_proj.weight"].T
            if gen2:
                o = _conv(o, fin[0], fin[1], dc["conv_group_size"])
            x = x + o
            h = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
            if gen2:
                h, fin = conv_pair(p + "mlp_conv", h)
            m = (F.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[
                p + "mlp.down_proj.weight"].T
            if gen2:
                m = _conv(m, fin[0], fin[1], dc["conv_group_size"])
            x = x + m
        out = _rms(x, t["norm.weight"], eps)[1:]
        logits = w.hf.lm_head(out) * dc.get("output_multiplier", 1.0)
        cap = dc.get("final_logit_softcapping")
        return torch.tanh(logits / cap) * cap if cap else logits


def _prompt(w: World, seed: int, n: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_block_logits_match_the_oracle(world):
    w = world
    store = Store(w)
    rows, want = [], []
    for seq, (n, length, chunks) in enumerate([(21, 8, (21,)), (13, 4, (5, 8)), (30, 6, (11, 7, 12))]):
        ids = _prompt(w, seq, n + 1)
        at = 0
        for j, c in enumerate(chunks):   # the context in chunks (incremental writes as prefill and decode do)
            store.prefill(seq, ids[at:at + c], start=at, reserve=length if j == len(chunks) - 1 else 0)
            at += c
        rows.append(BlockRow(seq, n, ids[n], length))
        want.append(oracle_block_logits(w, ids[:n], ids[n], length))
    got = w.drafter.logits(w.drafter.block_hidden(store.kv, rows))
    torch.testing.assert_close(got, torch.cat(want), atol=ATOL, rtol=RTOL)
    # One row alone gives the same logits (rows never interact).
    alone = w.drafter.logits(w.drafter.block_hidden(store.kv, rows[1:2]))
    torch.testing.assert_close(alone, want[1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v.get("sliding_window")])
def test_the_window_cuts_the_context_when_it_is_longer(tmp_path_factory, name):
    """A sliding layer's window is shorter than this context: the windowed path runs and matches the oracle."""
    w = _world(name, tmp_path_factory)
    assert all(layer.window is not None and layer.window < 40 for layer in w.drafter.layers)
    store = Store(w)
    ids = _prompt(w, 9, 41)
    store.prefill(0, ids[:40], reserve=4)
    got = w.drafter.logits(w.drafter.block_hidden(store.kv, [BlockRow(0, 40, ids[40], 4)]))
    torch.testing.assert_close(got, oracle_block_logits(w, ids[:40], ids[40], 4), atol=ATOL, rtol=RTOL)


def test_the_block_never_changes_the_context_kv(world):
    """A block writes only its own positions: the context K/V below it are bit-identical after it."""
    w = world
    store = Store(w)
    ids = _prompt(w, 3, 18)
    store.prefill(0, ids[:17], reserve=5)
    pages = store.kv.table(0)
    before = [tuple(t.clone() for t in store.kv.pools(layer.kv_layer)) for layer in w.drafter.layers]
    w.drafter.block_hidden(store.kv, [BlockRow(0, 17, ids[17], 5)])
    for layer, (k0, v0) in zip(w.drafter.layers, before, strict=True):
        k, v = store.kv.pools(layer.kv_layer)
        for pos in range(17):
            page, off = pages[pos // 4], pos % 4
            assert torch.equal(k[page, off], k0[page, off]) and torch.equal(v[page, off], v0[page, off])
