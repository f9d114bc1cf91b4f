"""A differentiable DFlash / DFlash2 drafter for training (tools/train_dflash.py), in the z-lab format.

The forward is the math of ``ninfer_qwen3_5.dflash.drafter`` (the engine's drafter), written for training: many
blocks of many windows at once, no KV cache. Its parameter names are the z-lab checkpoint's tensor names
(``fc.weight``, ``layers.{i}.self_attn.q_proj.weight``, ``candidate_selector.predecessor_codebook``, ...), so
``state_dict()`` is what ``ninfer-convert TARGET OUT --draft DIR`` reads (``ninfer_qwen3_5.dflash.mapping``);
the config is parsed with the engine's own ``compact_dflash_config``, so a folder this module writes is checked
by the same code that converts it.

Math (``T`` window positions, ``N`` anchors per window, block size ``B``):

- context ``c_t = hidden_norm(fc(a_t))`` for the target features ``a_t`` (the outputs of ``target_layer_ids``);
  every layer's context keys ``rope(k_norm(k_proj(c_t)), t)`` and values ``v_proj(c_t)``;
- the block of anchor ``s`` is ``[x_s, mask x (B - 1)]`` at positions ``s..s+B-1``; each layer runs input norm,
  (DFlash2: ``attention_conv.prepare``), q/k/v with q/k norms and RoPE, attention of every block query over the
  context keys ``t < s`` and all ``B`` keys of its own block (non-causal), ``o_proj`` (DFlash2:
  ``attention_conv.finish``), residual, post norm, (conv) SwiGLU MLP (conv), residual; then ``norm``;
- logits: the target's LM head times ``output_multiplier``, soft-capped when ``final_logit_softcapping`` is set.

Only full-attention non-causal layers are trained (no sliding window): what the written configs declare.
RMSNorm weights are plain (``x_normed * w``, initialised to 1), as the z-lab checkpoints store them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from ninfer_qwen3_5.dflash.config import DFlashConfig, compact_dflash_config
from torch import nn


def hf_config(*, generation: int, vocab_size: int, hidden_size: int, num_target_layers: int,
              target_layer_ids: list[int], mask_token_id: int, block_size: int, layers: int, heads: int,
              kv_heads: int, head_dim: int, intermediate: int, rope_theta: float, rms_norm_eps: float,
              conv_kernel: int = 2, conv_group: int = 16, selector_rank: int = 32, selector_top_k: int = 16
              ) -> dict:
    """A z-lab ``config.json`` of the drafter (both generations carry every drafter field in ``dflash_config``;
    the first generation also keeps ``block_size`` at the top level, as its published configs do)."""
    dc: dict = {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id, "block_size": block_size}
    cfg: dict = {
        "architectures": ["DFlash2DraftModel" if generation == 2 else "DFlashDraftModel"], "model_type": "qwen3",
        "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": hidden_size,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": rms_norm_eps,
        "vocab_size": vocab_size, "max_position_embeddings": 4096, "num_target_layers": num_target_layers,
        "tie_word_embeddings": False, "is_causal": False, "layer_types": ["full_attention"] * layers,
        "sliding_window": None, "use_sliding_window": False, "dtype": "bfloat16",
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"}, "dflash_config": dc,
    }
    if generation == 2:
        dc.update(conv_kernel_size=conv_kernel, conv_group_size=conv_group, selector_rank=selector_rank,
                  selector_top_k=selector_top_k)
    else:
        cfg["block_size"] = block_size
        cfg["rope_theta"] = rope_theta
    return cfg


def parse_config(hf: dict) -> DFlashConfig:
    """The engine's view of a z-lab config; a config this trainer cannot train (a causal or sliding layer) is
    refused."""
    cfg = DFlashConfig.from_compact(compact_dflash_config(hf))
    if any(cfg.causal) or any(w is not None for w in cfg.sliding_window):
        raise ValueError("the trainer trains full-attention, non-causal drafter layers only")
    return cfg


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rotary(positions: torch.Tensor, cfg: DFlashConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[..., D]`` of int64 positions: angles formed in fp64 and rounded once, as the engine's
    ``mrope_cos_sin`` does (inverse frequencies computed in fp32 as HF's default RoPE)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    f = positions.to(torch.float64)[..., None] * inv.to(device=positions.device, dtype=torch.float64)
    f = torch.cat((f, f), dim=-1)
    return f.cos().float(), f.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half over the whole head: ``x [..., heads, D]``, cos/sin ``[..., D]`` (fp32 math)."""
    half = x.shape[-1] // 2
    xf = x.float()
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[..., None, :] + rot * sin[..., None, :]).to(x.dtype)


class GroupedDynamicCausalConv(nn.Module):
    """DFlash2's conv along the block: ``prepare(h) = sum_o (base[0, o] + dyn0[o, group]) * h[t - o]`` with
    ``dyn = kernel_projection(h)`` (two sets of ``K x G`` weights per token), ``finish(y)`` likewise with
    ``base[1]`` and the second set; zero before the block's first token. Initialised to the identity (tap 0 is
    1, no dynamic part), so DFlash2 starts as DFlash."""

    def __init__(self, hidden: int, kernel: int, group: int) -> None:
        super().__init__()
        self.kernel, self.groups = kernel, hidden // group
        base = torch.zeros(2, kernel, hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def _conv(self, x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        # x [..., B, H]; dyn [..., B, K, G]; base [K, H]
        *lead, b, h = x.shape
        g = self.groups
        out = x.new_zeros(*lead, b, g, h // g)
        for o in range(self.kernel):
            v = x if o == 0 else F.pad(x[..., :b - o, :], (0, 0, o, 0))
            v = v.reshape(*lead, b, g, h // g)
            out = out + base[o].to(x.dtype).view(g, h // g) * v + dyn[..., o, :, None].to(x.dtype) * v
        return out.reshape(*lead, b, h)

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dyn = self.kernel_projection(h).unflatten(-1, (2, self.kernel, self.groups))
        return self._conv(h, dyn[..., 0, :, :], self.base_kernel[0]), dyn[..., 1, :, :]

    def finish(self, y: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        return self._conv(y, dyn, self.base_kernel[1])


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def context_kv(self, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context keys / values ``[W, T, Hkv, D]`` of context features ``c [W, T, H]``."""
        d = self.cfg.head_dim
        k = apply_rope(self.k_norm(self.k_proj(c).unflatten(-1, (-1, d))), cos, sin)
        return k, self.v_proj(c).unflatten(-1, (-1, d))

    def forward(self, h: torch.Tensor, ctx: tuple[torch.Tensor, torch.Tensor], visible: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Block attention: ``h [W, N, B, H]`` queries over the context ``ctx`` (keys visible where ``visible
        [W, N, T]``) and their own block."""
        cfg = self.cfg
        d, hkv = cfg.head_dim, cfg.num_kv_heads
        grp = cfg.num_heads // hkv
        q = apply_rope(self.q_norm(self.q_proj(h).unflatten(-1, (-1, d))), cos, sin)
        kb = apply_rope(self.k_norm(self.k_proj(h).unflatten(-1, (-1, d))), cos, sin)
        vb = self.v_proj(h).unflatten(-1, (-1, d))
        q = q.unflatten(-2, (hkv, grp))                               # query head = kv head * grp + g
        kc, vc = ctx
        sc = torch.einsum("wnjkgd,wtkd->wnjkgt", q, kc).float()
        sc = sc.masked_fill(~visible[:, :, None, None, None, :], float("-inf"))
        sb = torch.einsum("wnjkgd,wnikd->wnjkgi", q, kb).float()
        p = torch.softmax(torch.cat((sc, sb), dim=-1) * d ** -0.5, dim=-1).to(q.dtype)
        t = kc.shape[1]
        o = (torch.einsum("wnjkgt,wtkd->wnjkgd", p[..., :t], vc)
             + torch.einsum("wnjkgi,wnikd->wnjkgd", p[..., t:], vb))
        return self.o_proj(o.flatten(-3))


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if cfg.generation == 2:
            self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, ctx, visible, cos, sin):
        h = self.input_layernorm(x)
        conv = getattr(self, "attention_conv", None)
        if conv is not None:
            h, dyn = conv.prepare(h)
        o = self.self_attn(h, ctx, visible, cos, sin)
        x = x + (conv.finish(o, dyn) if conv is not None else o)
        h = self.post_attention_layernorm(x)
        conv = getattr(self, "mlp_conv", None)
        if conv is not None:
            h, dyn = conv.prepare(h)
        m = self.mlp(h)
        return x + (conv.finish(m, dyn) if conv is not None else m)


class CandidateSelector(nn.Module):
    """DFlash2's selector: candidate ``c`` after token ``prev`` scores ``logit(c) + <pred[prev] * (W h),
    succ[c]>``. The successor codebook starts at zero, so the selector starts as the plain argmax."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        r = cfg.selector_rank
        self.predecessor_codebook = nn.Parameter(torch.randn(cfg.vocab_size, r))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, r))
        self.hidden_projection = nn.Linear(cfg.hidden_size, r, bias=False)

    def scores(self, hidden, unary, candidates, prev):
        """``unary [..., k]`` plus the bilinear term of ``candidates [..., k]`` after ``prev [...]``."""
        gate = F.embedding(prev, self.predecessor_codebook) * self.hidden_projection(hidden)
        return unary + torch.einsum("...r,...kr->...k", gate, F.embedding(candidates, self.successor_codebook))


class DraftModel(nn.Module):
    """The drafter (module docstring). ``embed`` / ``lm_head`` are the target's tables, frozen and not part of
    the state dict (the drafter has none of its own)."""

    def __init__(self, hf: dict, embed: torch.Tensor, lm_head: torch.Tensor, seed: int = 0) -> None:
        super().__init__()
        self.hf = dict(hf)
        self.cfg = cfg = parse_config(hf)
        if embed.shape != (cfg.vocab_size, cfg.hidden_size) or lm_head.shape != embed.shape:
            raise ValueError(f"target tables {tuple(embed.shape)} / {tuple(lm_head.shape)} do not fit the drafter")
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)   # initialisation on the CPU from the seed alone
            n = len(cfg.target_layer_ids)
            self.fc = nn.Linear(n * cfg.hidden_size, cfg.hidden_size, bias=False)
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            if cfg.generation == 2:
                self.candidate_selector = CandidateSelector(cfg)
            for name, p in self.named_parameters():
                if name.endswith(("proj.weight", "fc.weight")) and "kernel_projection" not in name:
                    nn.init.normal_(p, std=0.02)

    # -- forward -----------------------------------------------------------------------------------
    def context(self, feats: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context keys / values of target features ``feats [W, T, n*H]`` at positions 0..T-1."""
        c = self.hidden_norm(self.fc(feats))
        cos, sin = rotary(torch.arange(feats.shape[1], device=feats.device), self.cfg)
        return [layer.self_attn.context_kv(c, cos, sin) for layer in self.layers]

    def block_hidden(self, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                     length: int | None = None) -> torch.Tensor:
        """Normed outputs ``[W, N, B - 1, H]`` of the mask slots of the blocks anchored at ``anchors [W, N]``
        (positions; the anchor token is ``tokens[w, anchors[w, n]]``), context = positions before the anchor."""
        cfg = self.cfg
        b = length or cfg.block_size
        ctx = self.context(feats)
        anchor_tok = tokens.gather(1, anchors)
        ids = torch.full((*anchors.shape, b), cfg.mask_token_id, dtype=torch.int64, device=tokens.device)
        ids[..., 0] = anchor_tok
        x = F.embedding(ids, self.embed).to(feats.dtype)
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        cos, sin = rotary(anchors[..., None] + torch.arange(b, device=anchors.device), cfg)
        visible = torch.arange(feats.shape[1], device=feats.device) < anchors[..., None]    # [W, N, T]
        for layer, kv in zip(self.layers, ctx, strict=True):
            x = layer(x, kv, visible, cos, sin)
        return self.norm(x[:, :, 1:])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden @ self.lm_head.to(hidden.dtype).T
        if self.cfg.output_multiplier != 1.0:
            out = out * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out

    # -- the z-lab folder --------------------------------------------------------------------------
    def save(self, folder: Path, extra_files: dict[str, str] | None = None) -> None:
        """``config.json`` and ``model.safetensors`` (bf16, the z-lab names) into ``folder``."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.hf, indent=2) + "\n")
        tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        for name, text in (extra_files or {}).items():
            (folder / name).write_text(text)

    @classmethod
    def load(cls, folder: Path, embed: torch.Tensor, lm_head: torch.Tensor) -> DraftModel:
        """A drafter from a z-lab folder (fp32 parameters holding the stored values)."""
        from safetensors.torch import load_file

        hf = json.loads((Path(folder) / "config.json").read_text())
        model = cls(hf, embed, lm_head)
        state = {k: v.float() for k, v in load_file(str(Path(folder) / "model.safetensors")).items()}
        model.load_state_dict(state, strict=True)
        return model

    def round_to_bf16(self) -> None:
        """Parameters rounded to the bf16 values the folder stores (evaluate what ships)."""
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(p.to(torch.bfloat16).float())
