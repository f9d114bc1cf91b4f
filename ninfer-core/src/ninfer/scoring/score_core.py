"""CausalScoreCore: offline scoring, the engine's ``causal_scoring`` purpose.

The core calls the Program serially, one window at a time (see :mod:`.windows`): each window opens a
fresh sequence (an empty State and Main KV), reserves KV for its inputs, runs them in chunks of at
most ``prefill_chunk_size`` tokens through :meth:`ScoringProgram.score_chunk`, and releases the
sequence, so no history crosses windows or texts. There is no worker, scheduler, request or
context cache; one lock makes concurrent ``score`` calls take turns.

Memory: a chunk's fp32 logits ``[chunk, vocab]`` are reduced to the targets' log-probabilities (and
top-k) as soon as they exist, so nothing of size ``window x vocab`` is ever held. Chunks that only
feed context (the first ``context - stride`` inputs of a later window) skip the LM head.

Numerics: ``logprob = logit[target] - logsumexp(logits)`` in fp32 on the device; the per-text NLL is
summed on the host in float64. A non-finite log-probability is an error (never a silent NaN
perplexity).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ninfer.contracts.program import ScoringProgram, TokenLogprob
from ninfer.errors import NInferError, NotSupportedError
from ninfer.ops.registry import OpError
from ninfer.scoring.inputs import normalize_inputs, tokenize
from ninfer.scoring.report import ScoreReport, ScoreSettings, TextScore
from ninfer.scoring.windows import InvalidScoringOptions, Window, check_window_options, plan_windows

Progress = Callable[[int, int], None]
"""``progress(scored_so_far, total_to_score)``, in target tokens, called after every scored chunk."""


class ScoringError(NInferError):
    """Scoring could not produce a valid result (the message names the text and window)."""


def _reference_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from ninfer.ops.reference.logprobs import token_logprobs

    return token_logprobs(logits, targets)


def _program_logprobs(program):
    try:
        return program.ops.token_logprobs
    except OpError:  # no implementation for this device and dtype: the torch reference
        return _reference_logprobs


class CausalScoreCore:
    """Serial window scoring over one :class:`~ninfer.contracts.program.ScoringProgram` (module docstring).

    ``max_context`` bounds ``context``: the Program's KV pool must hold one window of it.
    """

    def __init__(self, program: ScoringProgram, frontend, *, max_context: int, prefill_chunk_size: int, device: str,
                 dtype: str, info: Mapping[str, Any] | None = None) -> None:
        if not isinstance(program, ScoringProgram):
            raise NotSupportedError(f"{type(program).__name__} cannot score: it is not a ScoringProgram "
                                    f"(score_chunk and the Program members)")
        self._program = program
        # The Program's ops when it has them (token_logprobs: one pass per row on CUDA), else the reference.
        self._token_logprobs = _program_logprobs(program)
        self._frontend = frontend
        self._max_context = int(max_context)
        self._chunk = int(prefill_chunk_size)
        self._device = device
        self._dtype = dtype
        self._info = dict(info or {})
        self._lock = threading.Lock()
        self._scoring_thread: int | None = None   # the thread inside score(), to refuse a re-entrant call
        self.windows_run = 0       # totals since start, for Engine.stats()
        self.chunks_run = 0
        self.tokens_processed = 0

    @property
    def max_context(self) -> int:
        return self._max_context

    def resolve_options(self, context: int | None, stride: int | None) -> tuple[int, int]:
        """Defaults: ``context`` = max_context, ``stride`` = context // 2 (at least 1)."""
        if context is None:
            context = self._max_context
        if stride is None:
            stride = max(1, context // 2) if isinstance(context, int) else context
        check_window_options(context, stride)
        if context > self._max_context:
            limit = self._info.get("max_position_embeddings")
            model = f" (the model has {limit} positions)" if limit else ""
            raise InvalidScoringOptions(f"invalid scoring option context={context}: it exceeds this engine's "
                                        f"max_context {self._max_context}{model}; start the engine with a larger "
                                        f"max_context or score with a smaller context")
        return context, stride

    def score(self, inputs, *, context: int | None = None, stride: int | None = None, logprobs: bool = False,
              top_logprobs: int = 0, progress: Progress | None = None) -> ScoreReport:
        context, stride = self.resolve_options(context, stride)
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise InvalidScoringOptions(f"invalid scoring option top_logprobs={top_logprobs!r}: must be an int >= 0")
        if top_logprobs > 0 and not logprobs:
            raise InvalidScoringOptions("top_logprobs needs logprobs=True (the top-k are per-token detail)")
        vocab = int(self._program.vocab_size)
        if top_logprobs > vocab:  # a silent cap would hide a typo that asks for a report of vocab-sized rows
            raise InvalidScoringOptions(f"invalid scoring option top_logprobs={top_logprobs}: it exceeds the "
                                        f"vocabulary ({vocab} tokens)")
        items = normalize_inputs(inputs)
        token_lists = [tokenize(item, self._frontend, vocab, i) for i, item in enumerate(items)]
        total = sum(max(0, len(t) - 1) for t in token_lists)
        settings = ScoreSettings(context=context, stride=stride, dtype=self._dtype, device=self._device,
                                 prefill_chunk_size=self._chunk, logprobs=bool(logprobs), top_logprobs=top_logprobs)
        if self._scoring_thread == threading.get_ident():
            # The lock is not re-entrant: waiting for it here would wait for ourselves forever.
            raise InvalidScoringOptions("score() was called from inside a score() call on the same thread (its "
                                        "progress callback): score the next texts after this call returns")
        with self._lock:
            self._scoring_thread = threading.get_ident()
            try:
                return self._score_locked(items, token_lists, total, settings, context, stride, logprobs,
                                          top_logprobs, progress)
            finally:
                self._scoring_thread = None

    def _score_locked(self, items, token_lists, total, settings, context, stride, logprobs, top_logprobs,
                      progress) -> ScoreReport:
        """score() under the scorer's lock: the windows of every text, in order."""
        started = time.perf_counter()
        processed0 = self.tokens_processed
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

        if progress is not None:
            progress(0, total)
        results = []
        for i, (item, tokens) in enumerate(zip(items, token_lists, strict=True)):
            results.append(self._score_text(i, item.id, tokens, context, stride, bool(logprobs), top_logprobs,
                                            advance))
        elapsed = time.perf_counter() - started
        processed = self.tokens_processed - processed0
        return ScoreReport(settings=settings, artifact=self._info, texts=tuple(results), elapsed_s=elapsed,
                           processed_tokens=processed)

    def _score_text(self, index: int, text_id: str | None, tokens: list[int], context: int, stride: int,
                    logprobs: bool, top_k: int, advance: Callable[[int], None]) -> TextScore:
        windows = plan_windows(len(tokens), context, stride)
        nll = 0.0
        detail: list[TokenLogprob] | None = [] if logprobs else None
        for w in windows:
            nll += self._score_window(index, tokens, w, top_k, detail, advance)
        return TextScore(index=index, id=text_id, input_tokens=len(tokens), scored_tokens=max(0, len(tokens) - 1),
                         nll=nll, windows=len(windows), token_logprobs=None if detail is None else tuple(detail))

    def _score_window(self, index: int, tokens: list[int], w: Window, top_k: int,
                      detail: list[TokenLogprob] | None, advance: Callable[[int], None]) -> float:
        """The window's summed NLL (float64); appends its targets' detail in order."""
        p = self._program
        seq = p.open_sequence(tokens[w.begin:w.end - 1])
        try:
            if not p.reserve_units({seq: w.num_inputs})[seq]:
                raise ScoringError(f"the KV pool cannot hold a window of {w.num_inputs} tokens")
            self.windows_run += 1
            # Input j (token x[begin + j]) predicts x[begin + j + 1]; the first target's predictor:
            first_row = w.first_target - 1 - w.begin
            nll = 0.0
            pos = 0
            while pos < first_row:  # context only: no LM head
                n = min(self._chunk, first_row - pos)
                p.score_chunk(seq, n, logits=False)
                self._count(n)
                pos += n
            while pos < w.num_inputs:
                n = min(self._chunk, w.num_inputs - pos)
                logits = p.score_chunk(seq, n)
                self._count(n)
                lo = w.begin + pos + 1
                nll += self._reduce(index, w, logits, tokens[lo:lo + n], top_k, detail, self._token_logprobs)
                pos += n
                advance(n)
            return nll
        finally:
            p.release(seq)

    def _count(self, n: int) -> None:
        self.chunks_run += 1
        self.tokens_processed += n

    @staticmethod
    def _reduce(index: int, w: Window, logits: torch.Tensor, targets: list[int], top_k: int,
                detail: list[TokenLogprob] | None, token_logprobs) -> float:
        """Reduce one chunk's ``[n, V]`` fp32 logits to its targets' NLL (and detail) right away."""
        tgt = torch.tensor(targets, dtype=torch.int64).to(logits.device)
        lp, lse = token_logprobs(logits, tgt)
        top = None
        if detail is not None and top_k > 0:
            vals, ids = torch.topk(logits, top_k, dim=-1)
            top = ((vals - lse[:, None]).cpu().tolist(), ids.cpu().tolist())
        lp_host = lp.cpu()
        if not bool(torch.isfinite(lp_host).all()):
            raise ScoringError(f"text {index}, window [{w.begin}, {w.end}): the model produced non-finite "
                               f"log-probabilities (overflow in this dtype?)")
        if detail is not None:
            values = lp_host.tolist()
            for j, (t, v) in enumerate(zip(targets, values, strict=True)):
                alts = () if top is None else tuple(zip(top[1][j], top[0][j], strict=True))
                detail.append(TokenLogprob(token=t, logprob=v, top=alts))
        return -math.fsum(lp_host.double().tolist())
