"""MTP speculative decoding through ``Program.run`` / ``commit`` (ninfer_qwen3_5.speculative_decode), CPU fp32.

Worlds: the embedded default model (its trained MTP head) and tiny random dense and MoE models given a random
MTP head (the training script's MTP module, as in ``test_mtp``). Each world is converted with our converter;
the Program gets the text weights and the ``mtp`` component's (``load_mtp_weights``) in ``ProgramInit.weights``.

A small driver runs units the way the engine will (reserve ``drafts + 1``, run, commit) over three sequences
of different prompt lengths (one prefilled in two chunks, one prefilled while the others decode), so verify
rows share units with plain decode rows and prefill chunks. The reference is the same driver on a Program
built without speculation (drafts always 0): the committed streams must be equal token for token, greedy and
seeded, whatever the engine accepts of each row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ninfer.contracts.architecture import ProgramInit, ProgramOptions
from ninfer.contracts.program import DecodeRow, ExecutionUnit, PrefillChunk, ProgramError, RowSampling
from ninfer.contracts.sampling import SamplingParams
from ninfer.ops import resolve_ops
from ninfer.plugins import get_registry
from support.models import add_mtp_tensors, randomize_weights, tiny_text_model

from .harness import GEOMETRY, load_with_mtp
from .test_mtp import MOE_TEXT, TRAIN, _default_folder, _moe_oracle_mtp

DENSE_TEXT = dict(GEOMETRY, num_hidden_layers=4, intermediate_size=96, tie_word_embeddings=False)
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class World:
    name: str
    config: dict
    weights: dict
    spec: object
    vocab: int


def _build(name: str, tmp: Path) -> World:

    if name == "default":
        folder = _default_folder()
    else:
        hf = tiny_text_model(name, DENSE_TEXT if name == "dense" else MOE_TEXT, seed=21)
        folder = tmp / "hf"
        hf.save_pretrained(folder)
        if name == "dense":
            mtp = TRAIN.build_mtp_class()(hf.config)
            randomize_weights(mtp, 22)
        else:
            mtp = _moe_oracle_mtp(hf.config, seed=22)
        add_mtp_tensors(folder, mtp.float().eval())
    config, spec, weights, _, mtp_weights = load_with_mtp(folder, tmp / "model.ninfer")
    return World(name, config, {**weights, **mtp_weights}, spec, int(config["vocab_size"]))


_WORLDS: dict[str, World] = {}


def _world(name: str, factory) -> World:
    if name not in _WORLDS:
        _WORLDS[name] = _build(name, factory.mktemp(f"spec_{name}"))
    return _WORLDS[name]


@pytest.fixture(params=["default", "dense", "moe"])
def world(request, tmp_path_factory) -> World:
    return _world(request.param, tmp_path_factory)


@pytest.fixture
def default_world(tmp_path_factory) -> World:
    return _world("default", tmp_path_factory)


def program(w: World, k: int, checkpoint_slots: int = 0):
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    options = ProgramOptions(device=torch.device("cpu"), dtype=torch.float32, max_sequences=4, page_size=8,
                             num_pages=192, max_context=512, speculative_tokens=k, checkpoint_slots=checkpoint_slots)
    return w.spec.create_program(ProgramInit(config=w.config, weights=w.weights, ops=ops, options=options))


def prompts(w: World) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, w.vocab, (n,), generator=g).tolist() for n in (23, 9, 14)]


class Driver:
    """Runs three sequences like the engine: unit 1 prefills sequence 0's first half and all of sequence 1;
    unit 2 decodes 1 and prefills the rest of 0; unit 3 decodes 0 (plainly) and 1 and prefills 2; then all
    decode. ``drafts(i, j)``: the drafts of sequence i's j-th decode step (0: plain). ``accept(i, j, tokens)``:
    how many of the produced tokens the engine accepts (default: all, cut to ``steps``). Every sequence
    stops after ``steps`` output tokens."""

    def __init__(self, prog, prompts_, steps: int, drafts, sampling, accept=None) -> None:
        self.p, self.steps, self.drafts, self.sampling = prog, steps, drafts, sampling
        self.accept = accept or (lambda i, j, toks: len(toks))
        self.seqs = [prog.open_sequence(t) for t in prompts_]
        self.out: list[list[int]] = [[] for _ in prompts_]
        self.decodes = [0] * len(prompts_)
        self.units: list[ExecutionUnit] = []
        self.lengths = [len(t) for t in prompts_]

    def row(self, i: int) -> RowSampling:
        params, seed = self.sampling(i)
        return RowSampling(params, seed, len(self.out[i]))

    def unit(self, decode: list[int], chunks: list[tuple[int, int]]) -> None:
        demands, rows = {}, []
        for i in decode:
            left = self.steps - len(self.out[i])
            if left <= 0:
                continue
            n = min(self.drafts(i, self.decodes[i]), left - 1)
            demands[self.seqs[i]] = n + 1
            rows.append(DecodeRow(self.seqs[i], self.row(i), drafts=n))
        units = []
        for i, n in chunks:
            demands[self.seqs[i]] = n
            ends = self.p.computed(self.seqs[i]) + n == self.p.ledger_length(self.seqs[i])
            units.append(PrefillChunk(self.seqs[i], n, self.row(i) if ends else None))
        if not rows and not units:
            return
        assert all(self.p.reserve_units(demands).values())
        unit = ExecutionUnit(decode=tuple(rows), chunks=tuple(units))
        self.units.append(unit)
        pending = self.p.run(unit)
        index = {s: i for i, s in enumerate(self.seqs)}
        accepted = {}
        for r in pending.rows:
            i = index[r.seq]
            decoding = any(d.seq == r.seq for d in rows)
            a = self.accept(i, self.decodes[i], r.tokens) if decoding else len(r.tokens)
            a = min(a, self.steps - len(self.out[i]))
            accepted[r.seq] = a
            self.out[i].extend(r.tokens[:a])
        self.p.commit(pending, accepted)
        for r in rows:
            self.decodes[index[r.seq]] += 1

    def run(self) -> list[list[int]]:
        half = self.lengths[0] // 2
        self.unit([], [(0, half), (1, self.lengths[1])])
        self.unit([1], [(0, self.lengths[0] - half)])
        self.unit([0, 1], [(2, self.lengths[2])])
        while any(len(o) < self.steps for o in self.out):
            self.unit([0, 1, 2], [])
        return self.out


def greedy(i: int):
    return GREEDY, 0


def plain(w: World, steps: int, sampling=greedy) -> list[list[int]]:
    return Driver(program(w, 0), prompts(w), steps, lambda i, j: 0, sampling).run()


def drafting(k: int):
    # Sequence 0's first decode step is plain (so unit 3 packs a plain decode row, a verify row and a chunk),
    # and sequence 2 decodes plainly for its first three steps beside the others' verify rows.
    return lambda i, j: 0 if (i == 0 and j == 0) or (i == 2 and j < 3) else k


_PLAIN: dict[tuple, list[list[int]]] = {}


def plain_cached(w: World, steps: int) -> list[list[int]]:
    key = (w.name, steps)
    if key not in _PLAIN:
        _PLAIN[key] = plain(w, steps)
    return _PLAIN[key]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_speculation_commits_plain_greedy_tokens(world, k):
    want = plain_cached(world, 48)
    prog = program(world, k)
    d = Driver(prog, prompts(world), 48, drafting(k), greedy)
    got = d.run()
    assert got == want
    spec = prog.speculation
    assert spec.verified > 0 and spec.drafted >= spec.verified
    # Unit 3: a plain decode row, a verify row and a prefill chunk in one forward.
    third = d.units[2]
    assert [r.drafts for r in third.decode] == [0, k] and len(third.chunks) == 1
    mean = spec.accepted / spec.verified
    print(f"{world.name} k={k}: {spec.verified} verifies, mean accepted drafts {mean:.3f} "
          f"({spec.accepted}/{spec.drafted})")
    if world.name == "default":
        # The trained head agrees with the target often; a misaligned MTP (wrong position or token) gives ~0.
        assert mean > 0.5


def test_partial_and_zero_commits_continue_like_plain_decoding(default_world):
    w = default_world
    want = plain_cached(w, 48)
    k = 3
    seen = {"partial": 0, "zero": 0}

    def accept(i, j, toks):
        if len(toks) > 1 and j % 3 == 1:
            seen["partial"] += 1
            return 1                      # e.g. a stop string inside the drafts: keep a prefix
        if i == 1 and j == 5:
            seen["zero"] += 1
            return 0                      # nothing of this verify is committed: the row decodes on
        return len(toks)

    got = Driver(program(w, k), prompts(w), 48, drafting(k), greedy, accept).run()
    assert got == want
    assert seen["partial"] > 0 and seen["zero"] == 1


def seeded(i: int):
    if i == 0:
        return SamplingParams(temperature=0.8), 1234
    if i == 1:
        return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, presence_penalty=0.5,
                              repetition_penalty=1.2), 99
    return GREEDY, 0   # a greedy row in the same batch as the sampled ones


@pytest.mark.parametrize("k", [2, 4])
def test_seeded_sampling_commits_plain_sampled_tokens(default_world, k):
    w = default_world
    want = plain(w, 32, seeded)
    prog = program(w, k)
    got = Driver(prog, prompts(w), 32, drafting(k), seeded).run()
    assert got == want
    assert prog.speculation.accepted > 0


def test_abort_leaves_the_row_to_pause_or_release(world):
    prog = program(world, 2)
    seq = prog.open_sequence(prompts(world)[0])
    prog.reserve_units({seq: prog.ledger_length(seq)})
    prog.commit(prog.run(ExecutionUnit(chunks=(PrefillChunk(seq, prog.ledger_length(seq), RowSampling(GREEDY, 0, 0)),))),
                {seq: 1})
    prog.reserve_units({seq: 3})
    pending = prog.run(ExecutionUnit(decode=(DecodeRow(seq, RowSampling(GREEDY, 0, 1), drafts=2),)))
    prog.abort_pending(pending)
    with pytest.raises(ProgramError):
        prog.run(ExecutionUnit(decode=(DecodeRow(seq, RowSampling(GREEDY, 0, 1)),)))
    prog.release(seq)
    assert not prog.speculation.frontiers


def test_a_program_without_speculation_refuses_drafts(default_world):
    prog = program(default_world, 0)
    assert prog.speculation is None and prog.snapshots is None
    assert prog.layout.kv.layers == tuple(prog.cfg.attention_layers)   # no MTP pool
    seq = prog.open_sequence([1, 2, 3])
    prog.reserve_units({seq: 3})
    prog.commit(prog.run(ExecutionUnit(chunks=(PrefillChunk(seq, 3, RowSampling(GREEDY, 0, 0)),))), {seq: 1})
    prog.reserve_units({seq: 2})
    with pytest.raises(ProgramError, match="does not speculate"):
        prog.run(ExecutionUnit(decode=(DecodeRow(seq, RowSampling(GREEDY, 0, 1), drafts=1),)))
    assert prog.computed(seq) == 3   # nothing ran


def test_a_speculating_program_refuses_rows_it_cannot_verify(default_world):
    prog = program(default_world, 2)
    seq = prog.open_sequence([1, 2, 3])
    prog.reserve_units({seq: 3})
    prog.commit(prog.run(ExecutionUnit(chunks=(PrefillChunk(seq, 3, RowSampling(GREEDY, 0, 0)),))), {seq: 1})
    prog.reserve_units({seq: 4})
    # (A constrained row whose mask cannot follow drafts: test_speculative_constrained_program.)
    row = RowSampling(GREEDY, 0, 1)
    with pytest.raises(ProgramError, match="0..2"):
        prog.run(ExecutionUnit(decode=(DecodeRow(seq, row, drafts=3),)))
    # The row is untouched: it still decodes (and speculates).
    pending = prog.run(ExecutionUnit(decode=(DecodeRow(seq, row, drafts=2),)))
    tokens = list(pending.rows[0].tokens)
    ref = program(default_world, 0)
    other = ref.open_sequence([1, 2, 3])
    ref.reserve_units({other: 6})
    ref.commit(ref.run(ExecutionUnit(chunks=(PrefillChunk(other, 3, RowSampling(GREEDY, 0, 0)),))), {other: 1})
    for step in range(len(tokens)):
        ref.commit(ref.run(ExecutionUnit(decode=(DecodeRow(other, RowSampling(GREEDY, 0, 1 + step)),))), {other: 1})
    # What the speculating row committed is plain greedy decoding's continuation (1..3 tokens of it).
    assert 1 <= len(tokens) <= 3 and tokens == list(ref.ledger(other)[4:])
    assert prog.ledger(seq)[:4] == ref.ledger(other)[:4]
    prog.commit(pending, {seq: len(tokens)})
    assert prog.computed(seq) == prog.ledger_length(seq) - 1


def decode_loop(prog, seq: int, steps: int, k: int) -> list[int]:
    """``steps`` tokens of a decode-ready ``seq``, every row drafting up to ``k`` and committed whole."""
    out: list[int] = []
    while len(out) < steps:
        n = min(k, steps - len(out) - 1)
        assert all(prog.reserve_units({seq: n + 1}).values())
        pending = prog.run(ExecutionUnit(decode=(DecodeRow(seq, RowSampling(GREEDY, 0, len(out)), drafts=n),)))
        toks = pending.rows[0].tokens
        prog.commit(pending, {seq: len(toks)})
        out.extend(toks)
    return out


def test_a_sequence_opened_from_a_checkpoint_speculates_exactly(default_world):
    w = default_world
    first = prompts(w)[0]
    want = plain_cached(w, 48)[0][:25]
    prog = program(w, 3, checkpoint_slots=2)
    origin = prog.open_sequence(first)
    prog.reserve_units({origin: len(first)})
    pending = prog.run(ExecutionUnit(chunks=(PrefillChunk(origin, len(first), RowSampling(GREEDY, 0, 0)),)))
    prog.commit(pending, {origin: 1})
    handle = prog.capture_checkpoint(origin)
    # Opened decode-ready from the checkpoint: no hidden state to draft from, so its first step decodes plainly
    # and the MTP frontier starts there; the tokens are plain decoding's.
    seq = prog.open_sequence_from(handle, first + [want[0]])
    assert [want[0], *decode_loop(prog, seq, 24, 3)] == want
    assert prog.speculation.accepted > 0
    prog.release(seq)
    prog.release(origin)
    prog.drop_checkpoint(handle)
