"""DFlash / DFlash2 speculative decoding through ``Program.run`` / ``commit`` (ninfer_qwen3_5.dflash.decoding), CPU fp32.

Worlds: the embedded default model and tiny random dense and MoE targets, each converted with a random drafter in
the z-lab format (``support.dflash``, ``--draft``); the Program gets the text and ``dflash`` weights and
``StartupFeatures(speculative=...)``. The default model's DFlash2 drafter has a sliding window shorter than the
prompts, so the windowed attention runs inside the Program too.

The driver is the MTP tests' (``test_speculative_program.Driver``): three sequences, one prefilled in two chunks,
one prefilled beside verify rows, units mixing plain decode rows, verify rows and a chunk. The reference is the
same driver on a Program without speculation: the committed streams must be equal token for token. Random
drafters are seldom accepted, so one test replaces the drafts by the reference continuation with a wrong token
inside (the drafter still runs and writes its block), which makes verifies accept 0..n drafts; its end state
(the drafter's context K/V, the target's KV and GDN state of every committed position) is compared with a run
that never drafted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ninfer.artifact import ArtifactReader, load_weights
from ninfer.contracts.architecture import ProgramInit, ProgramOptions
from ninfer.contracts.features import StartupFeatures
from ninfer.contracts.program import DecodeRow, ExecutionUnit, PrefillChunk, RowSampling
from ninfer.conversion import convert
from ninfer.errors import NotSupportedError
from ninfer.ops import resolve_ops
from ninfer.plugins import get_registry
from ninfer.testing.profiles import measured_profile
from ninfer.testing.programs import BuiltProgram
from ninfer_qwen3_5.dflash.weights import load_dflash_weights
from ninfer_qwen3_5.speculative_decode import Drafts
from support.dflash import write_dflash_drafter
from support.models import tiny_text_model

from .test_mtp import MOE_TEXT, _default_folder
from .test_speculative_program import DENSE_TEXT, GREEDY, Driver, drafting, greedy, seeded

TINY_DRAFT = dict(hidden_size=64, vocab_size=512, num_target_layers=4, target_layer_ids=[0, 2], block_size=8,
                  mask_token_id=511, head_dim=8, heads=4, kv_heads=2, intermediate=80, conv_group=8)
DEFAULT_DRAFT = dict(hidden_size=256, vocab_size=6144, num_target_layers=8, target_layer_ids=[1, 3, 5],
                     block_size=16, mask_token_id=6143, head_dim=32, heads=4, kv_heads=2, intermediate=256,
                     selector_rank=16, selector_top_k=8)
WORLDS = {"default-dflash": ("default", dict(DEFAULT_DRAFT, generation=1)),
          "default-dflash2": ("default", dict(DEFAULT_DRAFT, generation=2, sliding_window=16)),
          "dense-dflash": ("dense", dict(TINY_DRAFT, generation=1)),
          "moe-dflash2": ("moe", dict(TINY_DRAFT, generation=2))}


@dataclass
class World:
    name: str
    backend: str
    config: dict
    weights: dict
    spec: object
    vocab: int
    profile_input: tuple


def _target(kind: str, tmp: Path) -> Path:
    if kind == "default":
        return _default_folder()
    folder = tmp / "hf"
    tiny_text_model(kind, DENSE_TEXT if kind == "dense" else MOE_TEXT, seed=41).save_pretrained(folder)
    return folder


def _build(name: str, tmp: Path) -> World:
    kind, draft = WORLDS[name]
    folder = _target(kind, tmp)
    write_dflash_drafter(tmp / "draft", seed=42, **draft)
    entry = convert(folder, tmp / "m.ninfer", progress=False, draft=tmp / "draft").paths[0]
    backend = "dflash2" if draft["generation"] == 2 else "dflash"
    with ArtifactReader.open(entry) as reader:
        config = reader.component("text").config
        spec = get_registry().architecture(config["architectures"][0])
        specs = spec.parameter_specs(config, StartupFeatures(speculative=backend))
        weights = load_weights(reader, specs, "cpu")
        _, dweights = load_dflash_weights(reader, "cpu")
    assert set(dweights) <= set(weights)
    return World(name, backend, config, weights, spec, int(config["vocab_size"]), (entry, specs))


_WORLDS: dict[str, World] = {}


def _world(name: str, factory) -> World:
    if name not in _WORLDS:
        _WORLDS[name] = _build(name, factory.mktemp(f"dflash_{name}"))
    return _WORLDS[name]


@pytest.fixture(params=list(WORLDS))
def world(request, tmp_path_factory) -> World:
    return _world(request.param, tmp_path_factory)


@pytest.fixture
def default_world(tmp_path_factory) -> World:
    return _world("default-dflash", tmp_path_factory)


def options(k: int, checkpoint_slots: int = 0) -> ProgramOptions:
    return ProgramOptions(device=torch.device("cpu"), dtype=torch.float32, max_sequences=4, page_size=8,
                          num_pages=192, max_context=512, speculative_tokens=k, checkpoint_slots=checkpoint_slots)


def program(w: World, k: int, checkpoint_slots: int = 0):
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    features = StartupFeatures(speculative=w.backend if k else None)
    return w.spec.create_program(ProgramInit(config=w.config, weights=w.weights, ops=ops,
                                             options=options(k, checkpoint_slots), features=features))


def prompts(w: World) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, w.vocab - 1, (n,), generator=g).tolist() for n in (23, 9, 19)]


_PLAIN: dict[tuple, list[list[int]]] = {}


def plain(w: World, steps: int, sampling=greedy) -> list[list[int]]:
    key = (w.name, steps, sampling.__name__)
    if key not in _PLAIN:
        _PLAIN[key] = Driver(program(w, 0), prompts(w), steps, lambda i, j: 0, sampling).run()
    return _PLAIN[key]


@pytest.mark.parametrize("k", [3, 7, 15])   # blocks of 4, 8 and 16
def test_greedy_speculation_commits_plain_greedy_tokens(world, k):
    want = plain(world, 40)
    prog = program(world, k)
    d = Driver(prog, prompts(world), 40, drafting(k), greedy)
    assert d.run() == want
    spec = prog.speculation
    assert spec.verified > 0 and spec.drafted >= spec.verified
    third = d.units[2]
    assert [r.drafts for r in third.decode] == [0, k] and len(third.chunks) == 1


class OracleDrafts:
    """Wraps a DFlash Program's ``draft``: the drafter runs (and writes its block), then its drafts are replaced by
    the reference continuation of each row, wrong from draft ``wrong(i, j)`` on (``None``: all right)."""

    def __init__(self, prog, driver: Driver, want: list[list[int]], wrong) -> None:
        self.spec, self.driver, self.want, self.wrong = prog.speculation, driver, want, wrong
        self.real = self.spec.draft
        self.spec.draft = self

    def __call__(self, verify, masks) -> Drafts:
        real = self.real(verify, masks)
        index = {s: i for i, s in enumerate(self.driver.seqs)}
        out = []
        for (row, n), drafted in zip(verify, real.tokens, strict=True):
            i = index[row.seq]
            done = len(self.driver.out[i])
            right = list(self.want[i][done:done + n])
            right += drafted[len(right):]
            cut = self.wrong(i, self.driver.decodes[i])
            if cut is not None and cut < n:
                right[cut] = (right[cut] + 1) % self.driver.p.vocab_size
            out.append(right)
        return Drafts(out)


def _context_kv(prog, seq, upto: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The drafter's K/V of positions [0, upto) of ``seq``, per drafter layer."""
    slots = torch.tensor(prog.kv.slot_mapping(seq, 0, upto))
    out = []
    for layer in prog.speculation.drafter.layers:
        k, v = prog.kv.pools(layer.kv_layer)
        out.append((k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]))
    return out


def _target_state(prog, seq, upto: int):
    slots = torch.tensor(prog.kv.slot_mapping(seq, 0, upto))
    kv = [(prog.kv.pools(i)[0].flatten(0, 1)[slots], prog.kv.pools(i)[1].flatten(0, 1)[slots])
          for i in prog.cfg.attention_layers]
    slot = prog.state_slot(seq)
    return kv, {f.name: prog.states.field(f.name)[slot].clone() for f in prog.states.layout.fields}


@pytest.mark.parametrize("name", ["default-dflash", "moe-dflash2"])
def test_accepted_and_rejected_drafts_roll_back_to_a_run_that_never_drafted(tmp_path_factory, name):
    w = _world(name, tmp_path_factory)
    k, steps = 7, 40
    want = plain(w, steps)
    # Drafts right up to a varying depth (0..k, sometimes all); the engine also cuts some verifies short.
    prog = program(w, k)
    d = Driver(prog, prompts(w), steps, drafting(k), greedy,
               accept=lambda i, j, toks: 1 if (len(toks) > 2 and j % 4 == 3) else len(toks))
    OracleDrafts(prog, d, want, wrong=lambda i, j: None if j % 3 == 0 else (i + j) % (k + 1))
    assert d.run() == want
    spec = prog.speculation
    assert spec.accepted > spec.verified   # most verifies accept several drafts
    # The same streams with the speculating Program's drafter fed but nothing ever drafted.
    ref = program(w, k)
    r = Driver(ref, prompts(w), steps, lambda i, j: 0, greedy)
    assert r.run() == want
    for a, b in zip(d.seqs, r.seqs, strict=True):
        n = prog.computed(a)
        assert n == ref.computed(b)
        for (k1, v1), (k2, v2) in zip(_context_kv(prog, a, n), _context_kv(ref, b, n), strict=True):
            torch.testing.assert_close(k1, k2, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v1, v2, atol=1e-4, rtol=1e-4)
        (kv1, img1), (kv2, img2) = _target_state(prog, a, n), _target_state(ref, b, n)
        for (k1, v1), (k2, v2) in zip(kv1, kv2, strict=True):
            torch.testing.assert_close(k1, k2, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v1, v2, atol=1e-4, rtol=1e-4)
        for field in img1:
            torch.testing.assert_close(img1[field], img2[field], atol=1e-4, rtol=1e-4)


def test_seeded_sampling_with_a_greedy_drafter_commits_plain_sampled_tokens(default_world):
    """DFlash drafts greedily: the sampled rows' acceptance is the sample op's own draw (seed-exact)."""
    w = default_world
    want = plain(w, 24, seeded)
    prog = program(w, 7)
    assert Driver(prog, prompts(w), 24, drafting(7), seeded).run() == want


def test_dflash2_sampled_rows_run_and_greedy_rows_stay_exact(tmp_path_factory):
    """DFlash2 samples its drafts at temperature > 0 (its q goes to rejection sampling: tests/speculative); a
    greedy row in the same units commits plain greedy decoding's tokens."""
    w = _world("moe-dflash2", tmp_path_factory)
    want = plain(w, 24, seeded)
    prog = program(w, 7)
    got = Driver(prog, prompts(w), 24, drafting(7), seeded).run()
    assert got[2] == want[2]
    assert all(len(o) == 24 and all(0 <= t < w.vocab for t in o) for o in got)


def test_a_sequence_opened_from_a_checkpoint_drafts_at_once(default_world):
    w = default_world
    first = prompts(w)[0]
    want = plain(w, 40)[0][:25]
    prog = program(w, 3, checkpoint_slots=2)
    origin = prog.open_sequence(first)
    prog.reserve_units({origin: len(first)})
    prog.commit(prog.run(ExecutionUnit(chunks=(PrefillChunk(origin, len(first), RowSampling(GREEDY, 0, 0)),))),
                {origin: 1})
    handle = prog.capture_checkpoint(origin)
    seq = prog.open_sequence_from(handle, first + [want[0]])
    out = [want[0]]
    while len(out) < 25:
        n = min(3, 25 - len(out) - 1)
        assert all(prog.reserve_units({seq: n + 1}).values())
        before = prog.speculation.verified
        pending = prog.run(ExecutionUnit(decode=(DecodeRow(seq, RowSampling(GREEDY, 0, len(out)), drafts=n),)))
        assert n == 0 or prog.speculation.verified == before + 1   # the first step verifies too
        toks = pending.rows[0].tokens
        prog.commit(pending, {seq: len(toks)})
        out.extend(toks)
    assert out == want
    for s in (seq, origin):
        prog.release(s)
    prog.drop_checkpoint(handle)


def test_the_backend_must_match_the_drafter_generation(default_world):
    w = default_world
    with pytest.raises(NotSupportedError, match="use --speculative dflash"):
        w.spec.parameter_specs(w.config, StartupFeatures(speculative="dflash2"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["default-dflash2", "dense-dflash"])
def test_the_profile_is_exact(tmp_path_factory, name, dtype):
    """Weights (the drafter's included, its prepared tensors counted as converted), KV bytes per token (the
    drafter's pools included) and the drafts per step the checkpoint's block size gives."""
    from ninfer.planning.calibration import resident_tensor_bytes
    from ninfer.planning.planner import weight_source

    w = _world(name, tmp_path_factory)
    entry, specs = w.profile_input
    with ArtifactReader.open(entry) as reader:
        source = weight_source(reader, specs)
        weights = load_weights(reader, specs, "cpu")
    features = StartupFeatures(speculative=w.backend)
    profile = w.spec.profile(w.config, features, dtype=dtype, stored_dtypes=source.stored_dtypes,
                             packed_bytes=source.packed_bytes)
    ops = resolve_ops(get_registry().ops, "cpu", dtype, force="reference")
    opts = dataclasses.replace(options(3), dtype=dtype)
    prog = w.spec.create_program(ProgramInit(config=w.config, weights=weights, ops=ops, options=opts,
                                             features=features))
    measured = measured_profile(BuiltProgram(prog, profile, weights, source.load_bytes, opts, w.config))
    # The verify snapshots are StateImages the planner counts apart (k + 1 per running request).
    snapshots = resident_tensor_bytes(prog.snapshots)
    measured["weight_bytes"] -= snapshots
    measured["converted_weight_bytes"] -= snapshots
    assert {field: getattr(profile, field) for field in measured} == measured
    assert profile.default_speculative_tokens == WORLDS[name][1]["block_size"] - 1
