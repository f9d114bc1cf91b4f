"""The Qwen3.5 Program: its declared layout and one varlen model call per unit, on the ModelProgram base.

The base packs a unit's decode rows (one token each) and its chunks (of other sequences) into one token
sequence, decode rows first (:class:`~ninfer.program.batch.PackedBatch`), and captures and replays the
decode graphs; this call runs it through the model once: projections, norms, MLPs and the LM head see all
N tokens, the attention core runs the decode rows and then every chunk in one varlen call, and the GDN
core runs the decode rows, then each chunk on its own slot (see ``layers``). Physical resources,
declared in :func:`model_layout`: one paged KV pool per full-attention layer and one StateImage per
sequence with the layout of :mod:`ninfer_qwen3_5.state` (so the context cache's checkpoints too).

Speculative verify (:mod:`ninfer_qwen3_5.speculative_state`, the hooks in
:class:`~ninfer_qwen3_5.speculative_program.SpeculativeProgram`): ``configure_speculation`` allocates the snapshot
storage; a batch with verify chunks stages each verify row's live image into its first snapshot, then runs the one
model call; ``select_snapshot`` commits a row's accepted inputs.

Speculative decoding (``ProgramOptions.speculative_tokens = k > 0``, :mod:`ninfer_qwen3_5.speculative_decode`):
the Program also builds the drafter of the backend ``ProgramInit.features.speculative`` names (``"mtp"``, the
default: the MTP head, its ``mtp/*`` parameters in ``ProgramInit.weights``, one more KV pool;
``"dflash"`` / ``"dflash2"``: the artifact's DFlash drafter of that generation, its ``dflash/*`` parameters in
``ProgramInit.weights``, one KV pool per drafter layer with the drafter's head geometry), configures the verify
snapshots for ``max_sequences`` rows of ``k + 1`` inputs, and runs every unit through the drafter's
:class:`~ninfer_qwen3_5.speculative_decode.SpeculativeDecoding` (with the target's taps; verify graphs, no decode
graphs, no lookahead). With ``k = 0`` none of this exists.

Vision (``ProgramInit.features.vision``, :class:`~ninfer_qwen3_5.vision.program.MediaProgram`): the Program also
builds the tower and takes media with a prompt. A call with a chunk of such a sequence gives the model its tokens'
three MRoPE axes and the media embeddings over the placeholders, encoding each medium when a chunk first needs it;
decode rows are at ``index + delta`` on all three axes, the delta a field of the sequence's StateImage
(:mod:`ninfer_qwen3_5.state`), so decode graphs and lookahead steps read it on the device and checkpoints keep it.
Vision and speculative decoding are not combined yet (refused).

A decode step rewrites every field of the StateImage (each GDN layer's conv window and recurrent
state) in ``decode_out_slots``, so this architecture declares lookahead decode (``plugin.py``).
"""

from __future__ import annotations

import torch
from ninfer.contracts.architecture import ProgramInit
from ninfer.contracts.program import ProgramError
from ninfer.program.batch import PackedBatch
from ninfer.program.model import KVGeometry, ModelLayout, ModelProgram

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.dflash import DFLASH_BACKENDS, drafter_for_backend, drafter_kv_layers
from ninfer_qwen3_5.dflash.config import DFlashConfig
from ninfer_qwen3_5.dflash.decoding import DFlashDecoding
from ninfer_qwen3_5.dflash.drafter import DFlashDrafter
from ninfer_qwen3_5.expert_caches import HostExpertCaches
from ninfer_qwen3_5.model import Qwen35Model
from ninfer_qwen3_5.mtp import Qwen35MTPHead, mtp_kv_layer
from ninfer_qwen3_5.mtp.decoding import MTPDecoding
from ninfer_qwen3_5.speculative_decode import SpeculativeDecoding
from ninfer_qwen3_5.speculative_program import SpeculativeProgram
from ninfer_qwen3_5.speculative_state import SpeculativeSnapshots
from ninfer_qwen3_5.state import state_layout
from ninfer_qwen3_5.vision.program import MediaProgram


def model_layout(cfg: Qwen35Config, dtype: torch.dtype, *, mtp: bool = False,
                 drafter: DFlashConfig | None = None, vision: bool = False) -> ModelLayout:
    """The Program's layout; ``mtp``: one more KV pool, the MTP layer's (:func:`~ninfer_qwen3_5.mtp.mtp_kv_layer`);
    ``drafter``: one more per DFlash drafter layer (:func:`~ninfer_qwen3_5.dflash.drafter_kv_layers`), of its
    own head geometry; ``vision``: the StateImage holds the rope delta too (:mod:`ninfer_qwen3_5.state`)."""
    own = tuple((layer, drafter.num_kv_heads, drafter.head_dim) for layer in drafter_kv_layers(cfg, drafter)
                ) if drafter is not None else ()
    layers = tuple(cfg.attention_layers) + ((mtp_kv_layer(cfg),) if mtp else ()) + tuple(o[0] for o in own)
    return ModelLayout(vocab_size=cfg.vocab_size, max_positions=cfg.max_position_embeddings,
                       kv=KVGeometry(layers, cfg.num_kv_heads, cfg.head_dim, own),
                       state=state_layout(cfg, dtype, vision=vision))


class Qwen35Program(MediaProgram, HostExpertCaches, SpeculativeProgram, ModelProgram):
    def __init__(self, init: ProgramInit) -> None:
        cfg = Qwen35Config.from_compact(init.config)
        k = init.options.speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ProgramError(f"ProgramOptions.speculative_tokens must be an int >= 0, got {k!r}")
        # Its layers run a padded flat call on device values alone (the varlen GDN ops, varlen attention, the
        # row-wise rest), so steps that prefill can be captured; not yet beside a drafter's per-token work, media
        # positions or host steps.
        self.flat_steps = not (k or init.features.vision or init.features.host_experts)
        backend = (init.features.speculative or "mtp") if k else None
        drafter = drafter_for_backend(init.config, backend) if backend in DFLASH_BACKENDS else None
        super().__init__(init, model_layout(cfg, init.options.dtype, mtp=backend == "mtp", drafter=drafter,
                                            vision=init.features.vision))
        self.cfg = cfg
        self.model = Qwen35Model(cfg, init.weights, init.ops, self.device, init.options.dtype, features=init.features)
        self.host_expert_kernel = self.model.host_expert_kernel
        self.host_expert_threads = self.model.host_expert_threads
        self.snapshots: SpeculativeSnapshots | None = None
        self.speculation: SpeculativeDecoding | None = None
        if init.features.vision:
            if k:
                raise ProgramError("vision with speculative decoding is not supported yet")
            self.build_vision(init, cfg.vocab_size, cfg.rotary_dim)
        if backend == "mtp":
            head = Qwen35MTPHead(cfg, init.config, init.weights, self.model.embed, self.model.lm_head, init.ops,
                                 self.device, init.options.dtype)
            self.speculation = MTPDecoding(self, head, k)
        elif drafter is not None:
            self.speculation = DFlashDecoding(self, DFlashDrafter(
                drafter, init.weights, self.model.embed, self.model.lm_head, init.ops, self.device, init.options.dtype,
                drafter_kv_layers(cfg, drafter)), k)
        elif backend is not None:
            raise ProgramError(f"the Qwen3.5 Program has no speculative backend {backend!r} (mtp, dflash, dflash2)")
        if k:
            self.configure_speculation(init.options.max_sequences, k + 1)

    def forward_packed(self, batch: PackedBatch) -> torch.Tensor:
        ctx = self.media_decode_context(batch, self.step_context(batch))
        if isinstance(self.speculation, DFlashDecoding):   # score_chunk: the drafter's context follows every forward
            return self.speculation.plain_forward(batch, ctx)
        return self.model.forward(batch.tokens, ctx, batch.logit_rows)
