"""Start-up warm-up: one short request through the public Engine before the server takes traffic.

It runs the whole path a chat request takes (template, tokenization, prefill, decode, sampling,
output session), so first-use costs (lazy imports, allocator growth, kernel selection) are not paid
by the first client. Per docs/design.md section 7 it runs with the request-level context cache off
(``cache=False``: on a cache-enabled engine it binds no checkpoint and publishes none) and must leave
nothing behind: afterwards no request is outstanding and no KV page, state slot or checkpoint is held,
which :func:`warm_up` checks and reports as an error rather than serving from a leaking engine.
"""

from __future__ import annotations

import time
from typing import Any

from ninfer.contracts.frontend import OutputOptions
from ninfer.errors import NInferError

WARMUP_MESSAGES = ({"role": "user", "content": "Say hello."},)


class WarmupError(NInferError):
    """The warm-up request failed or left engine resources held."""


def warm_up(engine: Any, *, max_tokens: int = 4, timeout_s: float = 300.0) -> float:
    """Run the warm-up request; return its duration in seconds."""
    started = time.monotonic()
    prompt = engine.frontend.prepare_chat(list(WARMUP_MESSAGES), enable_thinking=False)
    room = engine.max_context - len(prompt.token_ids)
    params = engine.sampling_params(max_tokens=max(1, min(max_tokens, room)), temperature=0.0, ignore_eos=True)
    result = engine.generate(prompt, sampling=params, output=OutputOptions(), timeout=timeout_s,
                             request_id="ninfer-serve-warmup", cache=False)
    if not result.token_ids:
        raise WarmupError("the warm-up request produced no token")
    # The worker publishes stats after the step that settled the request; wait for that snapshot.
    deadline = time.monotonic() + 5.0
    while True:
        s = engine.stats()
        held = {"outstanding requests": s.outstanding, "running requests": s.running, "queued requests":
                s.queue_depth, "KV pages": s.pages_used, "state slots": s.state_slots_used,
                "context-cache checkpoints": getattr(s, "cache_checkpoints", 0)}
        if not any(held.values()):
            return time.monotonic() - started
        if time.monotonic() > deadline:
            left = ", ".join(f"{v} {k}" for k, v in held.items() if v)
            raise WarmupError(f"the warm-up request left engine resources held: {left}")
        time.sleep(0.01)
