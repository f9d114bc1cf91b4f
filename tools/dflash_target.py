"""The frozen target of drafter training: the default model through transformers (``Qwen3_5ForCausalLM``), and
its MTP head (tools/train_default_model.py's module, loaded from the folder's ``mtp.*`` tensors).

- :meth:`Target.features`: for windows ``[W, T]``, the drafter's context features (the outputs of the target
  layers ``target_layer_ids``: transformers' ``hidden_states[i + 1]``, the same taps as the engine's
  ``Qwen35Model.forward(..., aux_layers=...)``), and the target's greedy next token at every position;
- :meth:`Target.greedy`: the target's argmax at every position of ``[W, L]`` (greedy verification);
- :meth:`Target.mtp_next_next`: the MTP head's greedy draft of ``x_{t+2}`` from ``h_t`` and ``x_{t+1}``.

The model runs in fp32 with eager attention; on CUDA, transformers' pure-torch Gated DeltaNet path runs under
train_default_model's ``deterministic_cumsum`` (flash-linear-attention is kept out so the path, and its
determinism, is the one the default model was trained with).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.modules.setdefault("fla", None)
sys.modules.setdefault("causal_conv1d", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_default_model as tdm  # noqa: E402


class Target:
    def __init__(self, folder: Path, device: torch.device, layer_ids: list[int], with_mtp: bool = False) -> None:
        from transformers import Qwen3_5ForCausalLM

        self.folder, self.device, self.layer_ids = Path(folder), device, list(layer_ids)
        self.model = Qwen3_5ForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                        attn_implementation="eager").to(device).eval()
        self.model.requires_grad_(False)
        self.config = self.model.config
        self.cuda = device.type == "cuda"
        self.mtp = self._load_mtp() if with_mtp else None

    @property
    def embed(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight

    def _load_mtp(self):
        from safetensors import safe_open

        with safe_open(str(self.folder / "model.safetensors"), "pt") as f:
            state = {k[len("mtp."):]: f.get_tensor(k).float() for k in f.keys() if k.startswith("mtp.")}
        if not state:
            return None
        mtp = tdm.build_mtp_class()(self.config)
        mtp.load_state_dict(state, strict=True)
        return mtp.to(self.device).eval().requires_grad_(False)

    def _trunk(self, ids: torch.Tensor):
        with torch.no_grad(), tdm.deterministic_cumsum(self.cuda):
            return self.model.model(input_ids=ids, output_hidden_states=True, use_cache=False)

    def features(self, ids: torch.Tensor, with_final: bool = False):
        """``(features [W, T, n*H] fp32, greedy next token [W, T] int64)`` of windows ``ids [W, T]``, and the
        final-normed hidden states ``[W, T, H]`` (:meth:`mtp_next_next`'s input) when ``with_final``."""
        out = self._trunk(ids)
        feats = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1).float()
        with torch.no_grad():
            greedy = self.model.lm_head(out.last_hidden_state).argmax(-1)
        return (feats, greedy, out.last_hidden_state) if with_final else (feats, greedy)

    def greedy(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's argmax at every position of ``ids [W, L]``."""
        with torch.no_grad(), tdm.deterministic_cumsum(self.cuda):
            return self.model(input_ids=ids, use_cache=False).logits.argmax(-1)

    def mtp_next_next(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[W, T - 2]``: at t, the MTP head's argmax for ``x_{t+2}`` given ``h_t`` (``hidden``: the final-normed
        hidden states of ``ids``) and ``x_{t+1}`` (None without an MTP head)."""
        if self.mtp is None:
            return None
        w, t = ids.shape
        n = t - 2
        with torch.no_grad():
            emb = self.model.model.embed_tokens(ids[:, 1:1 + n])
            pos = torch.arange(n, device=ids.device)[None, None].expand(3, w, n)
            pe = self.model.model.rotary_emb(emb, pos)
            out = self.mtp(emb, hidden[:, :n], pe, tdm.causal_additive_mask(n, ids.device, torch.float32))
            return self.model.lm_head(out).argmax(-1)
