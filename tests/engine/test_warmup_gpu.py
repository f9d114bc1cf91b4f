"""No compilation while serving (issue 30 item 3), on CUDA with the embedded default model.

Every Triton kernel of the ninfer packages keeps its compiled variants in a per-device cache (triton 3.x:
``JITFunction.device_caches[device][0]``, key -> kernel). The caches are emptied before the engine starts, so
every variant counted afterwards is this engine's. After ``Engine.start`` with the warm-up, bursts of
requests with varied prompt lengths (1 to past the prefill chunk), several prefills per step, decode rows
beside chunks, and constrained, logprob, penalised, greedy and sampled rows must compile nothing; without
the warm-up the same traffic does compile (the control that shows the count sees compilations).
"""

from __future__ import annotations

import ast
import random
import sys

import pytest
from ninfer import Engine, EngineOptions
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.frontend import OutputOptions
from ninfer.testing import settled

from .test_multi_prefill import hold_forward

pytestmark = pytest.mark.gpu

BURSTS = ([1, 7, 16, 31, 100, 257, 2, 45], [600, 3, 64, 129, 5, 17, 300, 1], [11, 12, 13, 14, 15, 32, 33, 9])


def kernels() -> dict:
    """Every Triton JITFunction defined in an imported ninfer module, by qualified name."""
    from triton.runtime.jit import JITFunction

    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("ninfer"):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, JITFunction):
                found[f"{value.fn.__module__}.{value.fn.__name__}"] = value
    return found


def variant_caches(fn) -> list[dict]:
    """The compiled-variant dict of each device a kernel ran on (the first item of each device's entry)."""
    return [entry[0] for entry in fn.device_caches.values()]


def variants() -> dict[str, set[str]]:
    """Each kernel's compiled variants, by their cache keys (the specialisation and the launch options)."""
    return {name: {str(k) for c in variant_caches(fn) for k in c} for name, fn in kernels().items()}


def _arguments(fn, key: str) -> dict[str, str] | None:
    """A cache key's specialisation as {argument: its specialisation}, when it parses (a list of one entry per
    argument, then the options)."""
    try:
        spec = ast.literal_eval(key[: key.index("]") + 1] if key.startswith("[") else "")
        return {name: repr(entry) for name, entry in zip(fn.arg_names, spec, strict=True)}
    except (ValueError, SyntaxError, TypeError):
        return None


def explain(new: dict[str, set[str]], old: dict[str, set[str]]) -> str:
    """For each new variant: the arguments whose specialisation differs from the kernel's closest older one."""
    fns, lines = kernels(), []
    for name, keys in sorted(new.items()):
        for key in sorted(keys):
            args = _arguments(fns[name], key)
            olds = [a for a in (_arguments(fns[name], k) for k in old.get(name, ())) if a is not None]
            if args is None or not olds:
                lines.append(f"{name}: {key[:300]}")
                continue
            closest = min(olds, key=lambda o: sum(o[a] != v for a, v in args.items()))
            changed = (f"{a} {closest[a]} -> {v}" for a, v in args.items() if closest[a] != v)
            lines.append(f"{name}: " + ", ".join(changed))
    return "\n".join(lines)


_KEPT: list[dict] = []   # the forgotten variants stay referenced: a graph of an earlier engine may use them


def forget_compiled_variants() -> None:
    """Empty every in-memory variant cache (later launches load from triton's disk cache or compile)."""
    for fn in kernels().values():
        for cache in variant_caches(fn):
            _KEPT.append(dict(cache))
            cache.clear()


def requests(lengths: list[int], vocab: int, seed: int):
    """(prompt, submit keywords) per length, rotating greedy, sampled, penalised, constrained and logprob rows."""
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(10, vocab - 10) for _ in range(n)]
        kw = dict(max_tokens=rng.randint(3, 10), ignore_eos=True, seed=1000 * seed + i)
        kind = (i + seed) % 5
        if kind == 0:
            kw.update(temperature=0.0)
        elif kind == 1:
            kw.update(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05)
        elif kind == 2:
            kw.update(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2)
        elif kind == 3:
            kw.update(temperature=0.0, output=OutputOptions(constraint=OutputConstraint.regex("[a-z ]{1,24}")))
        else:
            kw.update(temperature=0.0, logprobs=True, top_logprobs=3)
        out.append((prompt, kw))
    return out


def run_bursts(engine: Engine) -> None:
    """Each burst lands at once: the worker is held inside its first forward while the rest are submitted."""
    program = engine._program  # noqa: SLF001
    gate, entered = hold_forward(program)
    for seed, lengths in enumerate(BURSTS):
        work = requests(lengths, engine.vocab_size, seed)
        entered.clear()
        gate.clear()
        handles = [engine.submit(work[0][0], **work[0][1])]
        assert entered.wait(120)
        handles += [engine.submit(p, **kw) for p, kw in work[1:]]
        gate.set()
        for h in handles:
            with h:
                h.result(300)


def start(artifact, warmup: bool) -> Engine:
    # A prefill chunk the longest prompts pass (chunks that do not sample) and a step budget that cuts chunks
    # beside decode rows.
    return Engine.start(artifact, EngineOptions(device="cuda", max_concurrency=8, max_context=1024,
                                                prefill_chunk_size=256, max_step_tokens=96, warmup=warmup))


def test_serving_after_the_warmup_compiles_nothing(default_artifact):
    forget_compiled_variants()
    with start(default_artifact, warmup=True) as engine:
        assert engine.info["startup"]["warmup_units"] > 0
        ready = variants()
        run_bursts(engine)
        stats = settled(engine)
        assert stats.max_unit_chunks >= 2 and stats.finished == sum(len(b) for b in BURSTS)
        new = {k: keys - ready.get(k, set()) for k, keys in variants().items() if keys - ready.get(k, set())}
    assert not new, f"kernel variants compiled while serving, after the warm-up:\n{explain(new, ready)}"


def test_without_the_warmup_serving_compiles(default_artifact):
    forget_compiled_variants()
    with start(default_artifact, warmup=False) as engine:
        ready = variants()
        run_bursts(engine)
        compiled = sum(len(keys - ready.get(k, set())) for k, keys in variants().items())
    assert compiled > 0
