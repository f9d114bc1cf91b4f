"""The Program: the declared layout (:mod:`.layout`) and the model call, on core's ModelProgram.

:class:`~ninfer.program.model.ModelProgram` allocates what the layout declares (the KV pools, the StateImage
slots) and does all the bookkeeping: sequences, KV reservations, packing each unit into a PackedBatch,
sampling, decode CUDA graphs. The architecture supplies the layout and ``forward_packed``, which must be
graph-capturable on a decode-only batch (``num_chunk == 0``): device tensors only, no host synchronisation.
"""

from __future__ import annotations

import torch
from ninfer.contracts.architecture import ProgramInit
from ninfer.program.batch import PackedBatch
from ninfer.program.model import ModelProgram

from ninfer_llama_mini.config import LlamaMiniConfig
from ninfer_llama_mini.layout import model_layout
from ninfer_llama_mini.model import LlamaMiniModel


class LlamaMiniProgram(ModelProgram):
    def __init__(self, init: ProgramInit) -> None:
        cfg = LlamaMiniConfig.from_compact(init.config)
        super().__init__(init, model_layout(cfg))
        self.model = LlamaMiniModel(cfg, init.weights, init.ops, self.device, init.options.dtype)

    def forward_packed(self, batch: PackedBatch) -> torch.Tensor:
        return self.model.forward(batch, self.kv)
