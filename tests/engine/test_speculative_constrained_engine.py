"""Constrained generation with MTP speculative decoding through the public Engine (CPU fp32, the embedded
default model and its trained MTP head).

The contract: a constrained row drafts and verifies with its grammar's mask at every verified position, and
commits exactly the tokens non-speculative constrained decoding commits, greedy and seeded. Checked for a JSON
schema, a regex and a GBNF grammar at k = 1, 2, 4: every output validates (an independent oracle:
``jsonschema``, ``re.fullmatch``), equals the plain engine's token for token with the same finish, and the
request's grammar matcher ends where plain decoding's does (the same committed tokens, terminated exactly when
it is), also when ``max_tokens`` cuts the output inside the structure. The constrained requests alone make the
engine draft, keep and reject drafts (so none of this holds vacuously); batched with unconstrained
speculating rows and rows asking for logprobs, every row still equals plain decoding, and logprobs equal plain
decoding's at every committed position.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jsonschema
import pytest
from ninfer import Engine, EngineOptions
from ninfer.constrained.matcher import ConstraintMatcher
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.events import GenerationDelta
from ninfer.contracts.frontend import OutputOptions
from ninfer.contracts.sampling import SamplingParams

from .streams import check_stream

PROMPTS = ["# file: Lib/json/__init__.py\nimport json\n", "def join(a, *p):\n    \"\"\"Join two or more pathname",
           "x = {\n"]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "kind": {"enum": ["module", "class", "function"]},
                         "lines": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
          "required": ["name", "kind", "lines"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,8}( [a-z]{1,6}){0,3}\."
GBNF = r"""
root ::= term (ws op ws term){0,3}
term ::= num | "(" num op num ")"
op   ::= "+" | "-" | "*"
num  ::= [1-9] [0-9]{0,2}
ws   ::= " "?
"""
GBNF_ORACLE = re.compile(r"(N|\(NON\))( ?O ?(N|\(NON\))){0,3}".replace("N", "[1-9][0-9]{0,2}").replace("O", r"[-+*]"))
CONSTRAINTS = {"json": OutputConstraint.json_schema(SCHEMA), "regex": OutputConstraint.regex(REGEX),
               "gbnf": OutputConstraint.gbnf(GBNF)}
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95 if seed % 2 else 1.0, max_tokens=64, seed=seed)


def validates(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    return (re.fullmatch(REGEX, text) if kind == "regex" else GBNF_ORACLE.fullmatch(text)) is not None


@dataclass(frozen=True)
class Req:
    kind: str | None        # a CONSTRAINTS key, or None: unconstrained
    prompt: str
    sampling: SamplingParams

    @property
    def output(self) -> OutputOptions | None:
        return None if self.kind is None else OutputOptions(constraint=CONSTRAINTS[self.kind])


# Every constraint: greedy on each prompt, seeded on the first prompt (four seeds), and greedy cut by max_tokens
# inside the structure.
CONSTRAINED = [Req(kind, p, GREEDY) for kind in CONSTRAINTS for p in PROMPTS] + \
              [Req(kind, PROMPTS[0], seeded(s)) for kind in CONSTRAINTS for s in range(4)] + \
              [Req(kind, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5)) for kind in CONSTRAINTS]
LOGPROBS = [Req(None, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, logprobs=True, top_logprobs=2)),
            Req("json", PROMPTS[0], SamplingParams(temperature=0.7, max_tokens=64, seed=5, logprobs=True))]
FREE = [Req(None, p, SamplingParams(temperature=0.0, max_tokens=32)) for p in PROMPTS] + \
       [Req(None, PROMPTS[2], SamplingParams(temperature=0.8, max_tokens=32, seed=9))]


@dataclass(frozen=True)
class Outcome:
    tokens: tuple[int, ...]
    finish: str
    stop: object
    content: str
    logprobs: tuple | None
    matcher: tuple[int, bool] | None   # (committed tokens, terminated) of the request's grammar matcher


@pytest.fixture
def matchers(monkeypatch):
    """Every ConstraintMatcher the frontend opens, in submission order (matchers open on the submitting thread)."""
    import ninfer_qwen3_5.frontend.frontend as frontend

    opened: list[ConstraintMatcher] = []

    class Recorded(ConstraintMatcher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self)

    monkeypatch.setattr(frontend, "ConstraintMatcher", Recorded)
    return opened


def run(engine: Engine, reqs: list[Req], opened: list[ConstraintMatcher]) -> list[Outcome]:
    start = len(opened)
    handles = [engine.submit(r.prompt, sampling=r.sampling, output=r.output) for r in reqs]
    mine = iter(opened[start:])
    owners = [next(mine) if r.kind is not None else None for r in reqs]
    outcomes = []
    for h, m in zip(handles, owners, strict=True):
        events = list(h)
        res = check_stream(events, started=True)
        lps = [lp for e in events if isinstance(e, GenerationDelta) and e.logprobs is not None for lp in e.logprobs]
        outcomes.append(Outcome(res.token_ids, res.finish_reason, res.stop_reason, res.output.content,
                                tuple(lps) if lps else None,
                                None if m is None else (m.committed, m.terminated)))
    return outcomes


def start(artifact, **options) -> Engine:
    return Engine.start(artifact, EngineOptions(device="cpu", dtype="float32", max_context=192, page_size=4,
                                                max_concurrency=8, **options))


_PLAIN: dict[str, list[Outcome]] = {}


@pytest.fixture
def plain(default_artifact, matchers):
    if not _PLAIN:
        with start(default_artifact) as engine:
            for name, reqs in (("constrained", CONSTRAINED), ("logprobs", LOGPROBS), ("free", FREE)):
                _PLAIN[name] = run(engine, reqs, matchers)
    return _PLAIN


def same(got: Outcome, want: Outcome) -> None:
    assert (got.tokens, got.finish, got.stop, got.content, got.matcher) == (
        want.tokens, want.finish, want.stop, want.content, want.matcher)
    if want.logprobs is None:
        assert got.logprobs is None
        return
    assert len(got.logprobs) == len(want.logprobs) == len(want.tokens)
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top, strict=True))


def test_plain_constrained_outputs_validate(plain):
    """The reference itself: every constrained output satisfies its constraint and the grammar ended it, but
    for the max_tokens cuts."""
    for r, o in zip(CONSTRAINED, plain["constrained"], strict=True):
        assert o.matcher == (len(o.tokens), o.finish == "stop")
        if r.sampling.max_tokens == 5:
            assert o.finish == "length" and len(o.tokens) == 5
        else:
            assert o.finish == "stop" and validates(r.kind, o.content), (r, o.content)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_constrained_speculation_commits_plain_constrained_tokens(default_artifact, plain, matchers, k):
    with start(default_artifact, speculative="mtp", num_speculative_tokens=k) as engine:
        got = run(engine, CONSTRAINED, matchers)
        stats = engine.stats()
        # The constrained rows alone drafted; the verifies kept some drafts and rejected others.
        assert stats.spec_verifies > 0 and stats.spec_drafted > stats.spec_accepted > 0
        assert stats.units < stats.completion_tokens
        print(f"k={k}: {stats.spec_verifies} verifies, {stats.spec_accepted}/{stats.spec_drafted} drafts accepted")
        mixed = CONSTRAINED[::3] + FREE + LOGPROBS
        mixed_got = run(engine, mixed, matchers)
    for r, g, w in zip(CONSTRAINED, got, plain["constrained"], strict=True):
        same(g, w)
        if g.finish == "stop":
            assert validates(r.kind, g.content)
    want = plain["constrained"][::3] + plain["free"] + plain["logprobs"]
    for g, w in zip(mixed_got, want, strict=True):
        same(g, w)


def test_logprob_rows_draft_and_report_plain_logprobs(default_artifact, plain, matchers):
    with start(default_artifact, speculative="mtp", num_speculative_tokens=3) as engine:
        got = run(engine, LOGPROBS, matchers)
        stats = engine.stats()
    assert stats.spec_drafted > 0 and stats.spec_accepted > 0
    for g, w in zip(got, plain["logprobs"], strict=True):
        same(g, w)
