"""A scripted Program for gateway tests: exact, known output through the real Qwen frontend.

The model reads its instructions from the prompt: the text after ``SCRIPT:`` up to the end of that
chat turn is encoded with the real tokenizer and emitted token by token (logits peaked on the next
script token), then ``<|im_end|>``. A prompt without ``SCRIPT:`` gets endless ``" a"`` tokens (a long,
steady request for queueing and disconnect tests). Everything else (ledgers, pages, state slots,
sampling, logprobs, the OutputSession with its reasoning/tool-call/stop parsing) is the real engine.
``delay`` slows every forward, so a test can act while a request is running.
"""

from __future__ import annotations

import time

import torch
from ninfer.ops.reference.greedy import greedy_tokens
from ninfer.ops.reference.sampling import apply_penalties, sample
from ninfer.program.base import SequenceProgram
from ninfer.program.batch import ForwardBatch
from ninfer.storage.kv_pool import PagedKVCache
from ninfer.storage.state_image import StateField, StateImageStorage, StateLayout

MARKER = "SCRIPT:"
TURN_END = "<|im_end|>"


class _Ops:
    apply_penalties = staticmethod(apply_penalties)
    sample = staticmethod(sample)
    greedy_tokens = staticmethod(greedy_tokens)


class ScriptedProgram(SequenceProgram):
    def __init__(self, frontend, *, max_sequences: int = 2, max_context: int = 512, page_size: int = 16) -> None:
        pages = max_sequences * -(-max_context // page_size)
        kv = PagedKVCache([0], num_pages=pages, page_size=page_size, num_kv_heads=1, head_dim=1,
                          dtype=torch.float32, device=torch.device("cpu"))
        states = StateImageStorage(StateLayout((StateField("h", (1,), torch.int64),)), max_sequences,
                                   torch.device("cpu"))
        super().__init__(vocab_size=frontend.vocab_size, kv=kv, states=states, ops=_Ops(),
                         device=torch.device("cpu"), max_context=max_context)
        self.frontend = frontend
        self.end = frontend.tokenizer.token_to_id(TURN_END)
        self.filler = frontend.encode(" a")[0]
        self.delay = 0.0

    def _script(self, sid) -> list[int]:
        s = self._seqs[sid]
        prompt = self.frontend.decode(s.ledger[: s.prompt_length])
        at = prompt.rfind(MARKER)
        if at < 0:
            return []
        text = prompt[at + len(MARKER):]
        text = text[: text.find(TURN_END)] if TURN_END in text else text
        return self.frontend.encode(text) + [self.end]

    def _logits(self, sid, next_index: int) -> torch.Tensor:
        script = self._script(sid)
        produced = next_index - self._seqs[sid].prompt_length
        token = (script[produced] if produced < len(script) else self.end) if script else self.filler
        logits = torch.zeros(self.vocab_size)
        logits[token] = 40.0
        return logits

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        out = []
        if batch.decode is not None:
            for b, sid in enumerate(batch.decode.seqs):
                out.append(self._logits(sid, int(batch.decode.positions[b]) + 1))
        for c in batch.chunks:
            if c.want_logits:
                out.append(self._logits(c.seq, c.kv_len))
        return torch.stack(out) if out else torch.empty((0, self.vocab_size))
