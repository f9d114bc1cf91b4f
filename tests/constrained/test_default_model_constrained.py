"""Constrained generation end to end on the embedded default model (CPU, fp32), through the public Engine.

The tiny model knows nothing of JSON or of these grammars, so sampling at temperature 1.0 is a hard
test: over 24 seeds every output must satisfy its constraint, checked by an independent oracle
(``jsonschema``, Python ``re.fullmatch``, set membership, the GBNF on a byte vocabulary, the tool
schema). The grammars are bounded (lengths, ranges, enums), so the grammar itself forces termination
and every request ends with ``"stop"`` well inside ``max_tokens``; a ``max_tokens`` cut inside a
structure ends with ``"length"``. Constrained and unconstrained requests batched together, chunked
and preempted give the same tokens as alone (seeded).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.errors import InvalidConstraintError
from ninfer.contracts.frontend import OutputOptions

from .conftest import in_language

SEEDS = range(24)
PROMPT = "# file: Lib/json/__init__.py\nimport json\n"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "kind": {"enum": ["module", "class", "function"]},
        "lines": {"type": "integer", "minimum": 0, "maximum": 9999},
        "public": {"type": "boolean"},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                   "email": {"type": ["string", "null"], "maxLength": 16}},
                  "required": ["id"], "additionalProperties": False},
    },
    "required": ["name", "kind", "lines"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,8}( [a-z]{1,6}){0,3}\."
CHOICES = ["red", "green", "blue", "dark red"]  # "red" is a prefix of nothing, "dark red" shares a word
GBNF = r"""
root ::= term (ws op ws term){0,3}
term ::= num | "(" num op num ")"
op   ::= "+" | "-" | "*"
num  ::= [1-9] [0-9]{0,2}
ws   ::= " "?
"""
GBNF_ORACLE = re.compile(r"(N|\(NON\))( ?O ?(N|\(NON\))){0,3}".replace("N", "[1-9][0-9]{0,2}").replace("O", r"[-+*]"))
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look up a stdlib symbol",
                                         "parameters": {
    "type": "object",
    "properties": {"module": {"type": "string", "maxLength": 16},
                   "symbol": {"type": "string", "pattern": "^[a-z_]{1,12}$"},
                   "depth": {"type": "integer", "minimum": 1, "maximum": 3},
                   "exact": {"type": "boolean"},
                   "kinds": {"type": "array", "items": {"enum": ["def", "class"]}, "maxItems": 2}},
    "required": ["module", "depth"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def engine(default_artifact):
    from ninfer import Engine

    with Engine.start(default_artifact, device="cpu", dtype="float32", max_concurrency=8) as eng:
        yield eng


def _run(engine, constraint, *, max_tokens, prompt=PROMPT, seeds=SEEDS, **options):
    handles = [engine.submit(prompt, sampling=engine.sampling_params(temperature=1.0, top_p=1.0, top_k=0,
                                                                     min_p=0.0, seed=s, max_tokens=max_tokens),
                             output=OutputOptions(constraint=constraint, **options)) for s in seeds]
    return [h.result() for h in handles]


def _all_stopped(results):
    reasons = [r.finish_reason for r in results]
    assert reasons == ["stop"] * len(results), reasons
    # The grammar ended the output: the last token is an EOS, never published as text.
    assert all("<|" not in r.output.content for r in results)


def test_json_schema_outputs_parse_and_validate(engine):
    results = _run(engine, OutputConstraint.json_schema(SCHEMA), max_tokens=400)
    _all_stopped(results)
    validator = jsonschema.Draft202012Validator(SCHEMA)
    for r in results:
        value = json.loads(r.output.content)
        assert not list(validator.iter_errors(value)), r.output.content


def test_regex_outputs_fullmatch(engine):
    results = _run(engine, OutputConstraint.regex(REGEX), max_tokens=64)
    _all_stopped(results)
    for r in results:
        assert re.fullmatch(REGEX, r.output.content), r.output.content


def test_choice_outputs_are_one_of_the_choices(engine):
    results = _run(engine, OutputConstraint.choice(CHOICES), max_tokens=16)
    _all_stopped(results)
    assert {r.output.content for r in results} <= set(CHOICES)
    assert len({r.output.content for r in results}) > 1  # sampling, not a fixed answer


def test_gbnf_outputs_are_sentences_of_the_grammar(engine, byte_compiler):
    results = _run(engine, OutputConstraint.gbnf(GBNF), max_tokens=64)
    _all_stopped(results)
    for r in results:
        assert in_language(byte_compiler, GBNF, r.output.content), r.output.content
        assert GBNF_ORACLE.fullmatch(r.output.content), r.output.content


def test_required_tool_call_validates_against_the_tool_schema(engine):
    prompt = engine.frontend.prepare_chat([{"role": "user", "content": "Where is json.dumps defined?"}],
                                          tools=[TOOL], enable_thinking=False)
    results = _run(engine, OutputConstraint.tools("lookup"), max_tokens=200, prompt=prompt, tools=(TOOL,))
    _all_stopped(results)
    params = TOOL["function"]["parameters"]
    for r in results:
        (call,) = r.output.tool_calls
        assert call.name == "lookup"
        jsonschema.validate(dict(call.arguments), params)
        assert r.output.content == ""


def test_max_tokens_inside_a_structure_reports_length(engine):
    results = _run(engine, OutputConstraint.json_schema(SCHEMA), max_tokens=8, seeds=range(5))
    for r in results:
        assert r.finish_reason == "length" and len(r.token_ids) == 8
        with pytest.raises(ValueError):
            json.loads(r.output.content)
        head = '{"name": "'  # the schema's first property is required: every output starts so
        assert head.startswith(r.output.content) or r.output.content.startswith(head), r.output.content


def test_an_invalid_constraint_is_rejected_at_submit_and_the_engine_keeps_serving(engine):
    with pytest.raises(InvalidConstraintError, match="does not compile"):
        engine.submit(PROMPT, output=OutputOptions(constraint=OutputConstraint.regex("(unclosed")))
    (r,) = _run(engine, OutputConstraint.choice(["ok"]), max_tokens=4, seeds=[0])
    assert r.output.content == "ok" and r.finish_reason == "stop"


def _mixed(engine):
    """Constrained and unconstrained seeded requests (the unconstrained ones ignore EOS)."""
    fe = engine.frontend
    plain = [(fe.encode(t), OutputOptions()) for t in ("import os\n", "class Queue:\n    def put(self, item):")]
    constrained = [(fe.encode(PROMPT), OutputOptions(constraint=OutputConstraint.json_schema(SCHEMA))),
                   (fe.encode("x = "), OutputOptions(constraint=OutputConstraint.regex(REGEX))),
                   (fe.encode("def f():\n"), OutputOptions(constraint=OutputConstraint.gbnf(GBNF)))]
    out = []
    for i, (prompt, options) in enumerate(plain + constrained):
        params = engine.sampling_params(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=100 + i,
                                        max_tokens=48 if options.constraint is None else 200,
                                        ignore_eos=options.constraint is None)
        out.append((prompt, params, options))
    return out


def _tokens(engine, requests):
    handles = [engine.submit(p, sampling=s, output=o) for p, s, o in requests]
    return [list(h.result().token_ids) for h in handles]


@pytest.fixture(scope="module")
def mixed_alone(engine):
    """``_mixed``'s requests and each one's tokens sent alone (one at a time): the reference of both tests below
    (computed once: the engine is deterministic for seeded requests, and nothing else changes it)."""
    requests = _mixed(engine)
    return requests, [_tokens(engine, [r])[0] for r in requests]


def test_constrained_and_unconstrained_batched_behave_as_alone(default_artifact, engine, mixed_alone):
    from ninfer import Engine

    requests, alone = mixed_alone
    assert _tokens(engine, requests) == alone
    with Engine.start(default_artifact, device="cpu", dtype="float32", max_concurrency=8,
                      prefill_chunk_size=5) as chunked:
        assert _tokens(chunked, requests) == alone


def test_constrained_requests_survive_preemption_and_replay(default_artifact, mixed_alone):
    from ninfer import Engine

    requests, alone = (x * 2 for x in mixed_alone)
    # 8 running requests over 20 pages of 8 tokens: they cannot all grow, so some are paused and replayed;
    # a replayed request's matcher keeps its committed state (Replay never touches it).
    with Engine.start(default_artifact, device="cpu", dtype="float32", max_concurrency=8, prefill_chunk_size=16,
                      page_size=8, num_pages=20, max_context=160) as tight:
        assert _tokens(tight, requests) == alone
        assert tight.stats().preemptions > 0
