"""The Qwen4-Exp Program: its declared layout (:mod:`ninfer_qwen4exp.state`) and one model call per unit, on the
ModelProgram base.

The base packs a unit's decode rows and chunks into one token sequence; this call runs it through the model once
(:mod:`ninfer_qwen4exp.model`). Everything a sequence carries between steps lives in the base's structures: each
GDN layer's conv and recurrent state, each PLE layer's conv history and the n-gram context in the sequence's
StateImage; each indexed-attention layer's K/V and its indexer's per-token keys and rotary angles in the paged KV
(a side pool under the same page tables). Chunked prefill, batching, pause with Replay or Snapshot, and the
context cache's checkpoints (a StateImage copy plus a shared KV prefix) therefore carry all of it with no code here.

Speculative decoding (``ProgramOptions.speculative_tokens = k > 0``, backend ``mtp``, the only one): the Program
builds the MTP head (:mod:`ninfer_qwen4exp.mtp`, its ``mtp/*`` parameters in ``ProgramInit.weights``, one more KV
pool and indexer pool), and runs every unit through Qwen3.5's speculative machinery
(:class:`~ninfer_qwen3_5.mtp.decoding.MTPDecoding` over :class:`~ninfer_qwen3_5.speculative_program.SpeculativeProgram`):
verify chunks step every piece of StateImage state per position into snapshots (GDN as Qwen3.5, PLE conv history
and n-gram context in :mod:`ninfer_qwen4exp.layers.ple`), QSA K/V and indexer keys beyond the accepted extent are
never read. The MTP taps are the target's pre-reduction banks.

Vision (``ProgramInit.features.vision``): Qwen3.5-MoE's tower and media handling
(:class:`~ninfer_qwen3_5.vision.program.MediaProgram`): media embeddings replace their placeholders' token
embeddings before the residual streams are formed, every token of a chunk with media gets its three MRoPE axes, and
decode rows the StateImage's rope delta. The n-gram windows hash the placeholder ids, as transformers does. Not
combined with speculation (refused).

Decode CUDA graphs (without speculation): the base's, with the QSA ops on their Triton kernels (no host reads) and
each PLE layer's host-table gather as a host step between graph segments (:mod:`ninfer.program.host_steps`). With
speculation every unit runs eagerly (no verify or draft graphs yet). Not yet: lookahead decode (not declared).
"""

from __future__ import annotations

import torch
from ninfer.contracts.architecture import ProgramInit
from ninfer.contracts.program import ProgramError
from ninfer.program.batch import PackedBatch
from ninfer.program.model import ModelProgram
from ninfer_qwen3_5.expert_caches import HostExpertCaches
from ninfer_qwen3_5.mtp.decoding import MTPDecoding
from ninfer_qwen3_5.speculative_program import SpeculativeProgram
from ninfer_qwen3_5.vision.program import MediaProgram

from ninfer_qwen4exp.config import Qwen4ExpConfig
from ninfer_qwen4exp.model import Qwen4ExpModel
from ninfer_qwen4exp.mtp import Qwen4ExpMTPHead
from ninfer_qwen4exp.state import model_layout


class Qwen4ExpMTPDecoding(MTPDecoding):
    """Qwen3.5's MTP bookkeeping with the Qwen4-Exp target's taps: every token's pre-reduction bank."""

    def model_forward(self, packed, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        return self.p.model.forward(packed.tokens, ctx, packed.logit_rows, return_bank=True)


class Qwen4ExpProgram(MediaProgram, HostExpertCaches, SpeculativeProgram, ModelProgram):
    def __init__(self, init: ProgramInit) -> None:
        cfg = Qwen4ExpConfig.from_compact(init.config)
        k = init.options.speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ProgramError(f"ProgramOptions.speculative_tokens must be an int >= 0, got {k!r}")
        backend = (init.features.speculative or "mtp") if k else None
        if backend not in (None, "mtp"):
            raise ProgramError(f"the Qwen4-Exp Program has no speculative backend {backend!r} (mtp)")
        f = init.features
        if f.vision and k:
            raise ProgramError("Qwen4-Exp vision with speculative decoding is not supported yet")
        super().__init__(init, model_layout(cfg, init.options.dtype, mtp=backend == "mtp", vision=f.vision))
        self.cfg = cfg
        self.model = Qwen4ExpModel(cfg, init.weights, init.ops, self.device, init.options.dtype, features=f)
        self.host_expert_kernel = self.model.host_expert_kernel
        self.host_expert_threads = self.model.host_expert_threads
        if f.vision:
            self.build_vision(init, cfg.vocab_size, cfg.rotary_dim)
        if backend == "mtp":
            head = Qwen4ExpMTPHead(cfg, init.config, init.weights, self.model.embed, self.model.lm_head, init.ops,
                                   self.device, init.options.dtype)
            self.speculation = Qwen4ExpMTPDecoding(self, head, k)
            self.configure_speculation(init.options.max_sequences, k + 1)

    def forward_packed(self, batch: PackedBatch) -> torch.Tensor:
        ctx = self.media_decode_context(batch, self.step_context(batch))
        return self.model.forward(batch.tokens, ctx, batch.logit_rows)

    def capture_decode_graphs(self, max_batch: int) -> tuple[int, ...]:
        if self.speculation is not None:
            return ()   # verify and draft graphs are Qwen3.5's; Qwen4-Exp's verify steps run eagerly
        return super().capture_decode_graphs(max_batch)
