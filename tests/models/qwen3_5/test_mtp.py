"""The Qwen3.5 MTP drafter (ninfer_qwen3_5.mtp) against an oracle: the training script's transformers MTP module.

Worlds: the embedded default model (trained, its ``mtp.*`` head shipped in the checkpoint) and a tiny random MoE
checkpoint given an oracle-built MTP head (MoE decoder layer). Each is converted with our converter; the target's
text weights and the ``mtp`` component load from the artifact; our KV is one PagedKVCache holding the target's
attention pools plus the MTP pool (the layout the Program will declare), page size 4 so tables span pages.

Oracle: transformers' ``Qwen3_5ForCausalLM`` (``last_hidden_state`` is final-normed: checked against its
logits) and ``tools/train_default_model.py``'s ``Qwen3_5MTP`` run causally over all positions at once
(no cache: a k-step draft is recomputed over the grown sequence each step).
"""

from __future__ import annotations

import copy
import importlib.util
import os
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from ninfer.artifact import ArtifactReader, MissingComponentError, load_weights
from ninfer.contracts.features import StartupFeatures
from ninfer.contracts.program import ProgramError
from ninfer.errors import NotSupportedError
from ninfer.ops import resolve_ops
from ninfer.plugins import get_registry
from ninfer.storage.kv_pool import PagedKVCache
from ninfer.storage.state_image import StateImageStorage
from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.model import Qwen35Model
from ninfer_qwen3_5.mtp import (
    DraftRow,
    Qwen35MTPHead,
    load_mtp_weights,
    mtp_kv_layer,
    mtp_num_layers,
    mtp_parameter_specs,
    mtp_step_context,
)
from ninfer_qwen3_5.state import state_layout
from support.models import add_mtp_tensors, randomize_weights, tiny_text_model

from .harness import GEOMETRY, load_with_mtp

ROOT = Path(__file__).resolve().parents[3]
CPU, F32 = torch.device("cpu"), torch.float32
ATOL, RTOL = 1e-4, 1e-5
MOE_TEXT = dict(GEOMETRY, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, tie_word_embeddings=False)


def _training_script():
    spec = importlib.util.spec_from_file_location("train_default_model", ROOT / "tools" / "train_default_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRAIN = _training_script()


def _default_folder() -> Path:
    return get_registry().default_models["qwen3_5-stdlib"].source


def _load_oracle_mtp(hf_config, folder: Path) -> torch.nn.Module:
    """The training script's MTP module with the checkpoint's ``mtp.*`` tensors, loaded strictly."""
    from safetensors.torch import load_file

    mtp = TRAIN.build_mtp_class()(hf_config)
    state = {k[len("mtp."):]: v for k, v in load_file(folder / "model.safetensors").items() if k.startswith("mtp.")}
    mtp.load_state_dict(state, strict=True)
    return mtp.float().eval()


def _moe_oracle_mtp(hf_config, seed: int) -> torch.nn.Module:
    """The training script's MTP module with its decoder layer replaced by transformers' MoE decoder layer
    (the script builds the dense layer, which needs a dense width: given one only to construct it)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    dense = copy.deepcopy(hf_config)
    dense.intermediate_size = hf_config.moe_intermediate_size
    mtp = TRAIN.build_mtp_class()(dense)
    layer_cfg = copy.deepcopy(hf_config)
    layer_cfg.num_hidden_layers, layer_cfg.layer_types = 1, ["full_attention"]
    mtp.layers[0] = Qwen3_5MoeDecoderLayer(layer_cfg, 0)
    randomize_weights(mtp, seed)
    return mtp.float().eval()


@dataclass
class World:
    cfg: Qwen35Config
    ops: object
    model: Qwen35Model
    head: Qwen35MTPHead
    mtp_config: dict
    mtp_weights: dict
    hf: torch.nn.Module
    oracle: torch.nn.Module


def _world(name: str, tmp: Path) -> World:
    import transformers as tf

    if name == "default":
        folder = _default_folder()
        hf = tf.Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        oracle = _load_oracle_mtp(hf.config, folder)
    else:
        hf = tiny_text_model("moe", MOE_TEXT, seed=11)
        folder = tmp / "hf"
        hf.save_pretrained(folder)
        oracle = _moe_oracle_mtp(hf.config, seed=12)
        add_mtp_tensors(folder, oracle)
    config, _, weights, mtp_config, mtp_weights = load_with_mtp(folder, tmp / "model.ninfer")
    cfg = Qwen35Config.from_compact(config)
    ops = resolve_ops(get_registry().ops, "cpu", F32, force="reference")
    model = Qwen35Model(cfg, weights, ops, CPU, F32)
    head = Qwen35MTPHead(cfg, mtp_config, mtp_weights, model.embed, model.lm_head, ops, CPU, F32)
    return World(cfg, ops, model, head, mtp_config, mtp_weights, hf, oracle)


_WORLDS: dict[str, World] = {}


@pytest.fixture(params=["default", "moe"])
def world(request, tmp_path_factory) -> World:
    if request.param not in _WORLDS:
        _WORLDS[request.param] = _world(request.param, tmp_path_factory.mktemp(f"mtp_{request.param}"))
    return _WORLDS[request.param]


@pytest.fixture
def default_world(tmp_path_factory) -> World:
    if "default" not in _WORLDS:
        _WORLDS["default"] = _world("default", tmp_path_factory.mktemp("mtp_default"))
    return _WORLDS["default"]


class Store:
    """Paged KV with the target's attention pools plus the MTP pool, and StateImages for the GDN layers."""

    def __init__(self, w: World, *, num_pages: int = 512, page_size: int = 4, slots: int = 4) -> None:
        cfg = w.cfg
        self.w = w
        self.kv = PagedKVCache((*cfg.attention_layers, mtp_kv_layer(cfg)), num_pages=num_pages, page_size=page_size,
                               num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=F32, device=CPU)
        self.states = StateImageStorage(state_layout(cfg, F32), slots, CPU)

    def target_prefill(self, seq: int, tokens: list[int], reserve: int = 0, start: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Our target over ``tokens`` (positions from ``start``) in one chunk (sequence ``seq`` uses StateImage
        slot ``seq``): every position's (logits, final-normed hidden); pages for ``reserve`` more tokens."""
        assert self.kv.ensure(seq, start + len(tokens) + reserve, write_from=start)
        ctx = mtp_step_context(self.kv, chunks=[(seq, start, len(tokens))], device=CPU)
        ctx = replace(ctx, chunk_slots=(seq,), states=self.states)
        return self.w.model.forward(torch.tensor(tokens), ctx, None, return_hidden="all")

    def mtp(self, head: Qwen35MTPHead, tokens_next, hidden, *, decode=(), chunks=()):
        ctx = mtp_step_context(self.kv, decode=decode, chunks=chunks, device=CPU)
        return head.forward(torch.as_tensor(tokens_next), hidden, ctx, None)


def _hf_hidden(w: World, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = w.hf(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    h = out.hidden_states[-1][0]
    # The last entry is final-normed: the LM head of it gives the model's logits.
    torch.testing.assert_close(w.hf.lm_head(h), out.logits[0], atol=1e-5, rtol=1e-5)
    return out.logits[0], h


def _oracle(w: World, hidden: torch.Tensor, tokens_next: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle MTP over positions 0..n-1 (causal): (logits [n, V], out [n, H])."""
    n = len(tokens_next)
    with torch.no_grad():
        emb = w.hf.model.embed_tokens(torch.tensor([tokens_next]))
        pos = torch.arange(n)[None, None].expand(3, 1, n)
        pe = w.hf.model.rotary_emb(emb, pos)
        out = w.oracle(emb, hidden[None], pe, TRAIN.causal_additive_mask(n, CPU, F32))[0]
        return w.hf.lm_head(out), out


def _prompt(w: World, seed: int, n: int) -> list[int]:
    return torch.randint(0, w.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_target_hidden_and_mtp_prefill_and_decode_match_the_oracle(world):
    w = world
    ids = _prompt(w, 3, 64)
    store = Store(w)
    store.kv.ensure(99, 8)   # a live table first, so the sequences' pages are not 0, 1, 2, ...
    logits, hidden = store.target_prefill(1, ids)
    hf_logits, hf_h = _hf_hidden(w, ids)
    torch.testing.assert_close(hidden, hf_h, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=RTOL)

    ref_logits, ref_out = _oracle(w, hf_h[:-1], ids[1:])
    n = len(ids) - 1
    # Prefill: positions 0..n-1 in one chunk (x_{t+1} = ids[t + 1]).
    out = store.mtp(w.head, ids[1:], hidden[:-1], chunks=[(1, 0, n)])
    torch.testing.assert_close(out.logits, ref_logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.hidden, ref_out, atol=ATOL, rtol=RTOL)
    # Decode: the same positions one at a time on another sequence's pages.
    store.kv.ensure(2, len(ids), write_from=0)
    for t in range(n):
        step = store.mtp(w.head, ids[t + 1:t + 2], hidden[t:t + 1], decode=[(2, t)])
        torch.testing.assert_close(step.logits[0], ref_logits[t], atol=ATOL, rtol=RTOL)
    # Two chunks, the second one sharing its call with a decode row of another sequence.
    store.kv.ensure(3, len(ids), write_from=0)
    first = store.mtp(w.head, ids[1:41], hidden[:40], chunks=[(3, 0, 40)])
    torch.testing.assert_close(first.logits, ref_logits[:40], atol=ATOL, rtol=RTOL)
    mixed = store.mtp(w.head, [ids[1], *ids[41:]], torch.cat((hidden[:1], hidden[40:-1])),
                      decode=[(2, 0)], chunks=[(3, 40, n - 40)])
    torch.testing.assert_close(mixed.logits[0], ref_logits[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(mixed.logits[1:], ref_logits[40:], atol=ATOL, rtol=RTOL)


def test_model_returns_logits_alone_by_default(default_world):
    """``return_hidden`` adds the final-normed hidden states ("rows": of the logit rows, "all": of every token);
    the logits are the same bits as the default path's."""
    w = default_world
    ids = _prompt(w, 4, 16)
    rows = torch.tensor([3, len(ids) - 1])
    outs = []
    for return_hidden in (None, "rows", "all"):
        store = Store(w)
        assert store.kv.ensure(0, len(ids), write_from=0)
        ctx = replace(mtp_step_context(store.kv, chunks=[(0, 0, len(ids))], device=CPU), chunk_slots=(0,),
                      states=store.states)
        outs.append(w.model.forward(torch.tensor(ids), ctx, rows, return_hidden=return_hidden))
    alone, (logits, hidden), (logits_all, hidden_all) = outs
    assert isinstance(alone, torch.Tensor) and torch.equal(alone, logits) and torch.equal(alone, logits_all)
    assert hidden.shape == (2, w.cfg.hidden_size) and hidden_all.shape == (len(ids), w.cfg.hidden_size)
    assert torch.equal(hidden_all[rows], hidden)
    assert torch.equal(w.ops.logits(hidden, w.model.lm_head), logits)
    with pytest.raises(ProgramError, match="return_hidden"):
        w.model.forward(torch.tensor(ids), ctx, rows, return_hidden=True)


def _oracle_draft(w: World, hf_h: torch.Tensor, ids: list[int], sampled: int, k: int):
    """k greedy oracle steps after the prompt ``ids`` and its sampled token: each step recomputes the oracle
    over positions 0..p+i with the drafts' own outputs and tokens appended."""
    hidden, tokens = hf_h, [*ids[1:], sampled]
    toks, logits = [], []
    for _ in range(k):
        lg, out = _oracle(w, hidden, tokens)
        toks.append(int(lg[-1].argmax()))
        logits.append(lg[-1])
        hidden, tokens = torch.cat((hidden, out[-1:])), [*tokens, toks[-1]]
    return toks, torch.stack(logits)


def test_draft_k3_equals_the_autoregressive_oracle(world):
    w, k = world, 3
    store = Store(w)
    a, b = _prompt(w, 5, 64), _prompt(w, 6, 40)
    la, ha = store.target_prefill(0, a, reserve=k + 1)
    lb, hb = store.target_prefill(1, b, reserve=k + 1)
    sa, sb = int(la[-1].argmax()), int(lb[-1].argmax())
    hf_a, hf_b = _hf_hidden(w, a)[1], _hf_hidden(w, b)[1]
    # MTP pools: a covers 0..62 (its draft row is the one position 63), b covers 0..35 (its row is 36..39).
    store.mtp(w.head, a[1:], ha[:-1], chunks=[(0, 0, len(a) - 1)])
    store.mtp(w.head, b[1:37], hb[:36], chunks=[(1, 0, 36)])
    rows = [DraftRow(1, 36, 4), DraftRow(0, 63, 1)]
    tokens = torch.tensor([*b[37:], sb, sa])
    hidden = torch.cat((hb[36:], ha[63:]))
    draft = w.head.draft(store.kv, rows, tokens, hidden, k)
    assert draft.tokens.shape == (2, k) and draft.logits.shape == (2, k, w.cfg.vocab_size)
    for r, (ids, hf_h, sampled) in enumerate(((b, hf_b, sb), (a, hf_a, sa))):
        ref_toks, ref_logits = _oracle_draft(w, hf_h, ids, sampled, k)
        assert draft.tokens[r].tolist() == ref_toks
        torch.testing.assert_close(draft.logits[r], ref_logits, atol=ATOL, rtol=RTOL)


def test_next_draft_after_a_partial_accept_overwrites_the_provisional_kv(world):
    """Draft k=3 from position p (provisional MTP K/V at p+1, p+2), verify [x, d1, d2, d3] with the target,
    accept one draft: the next draft (start p+1, length 2: tokens d1 and the bonus, the verify's hidden states)
    equals the oracle run from scratch over the committed sequence."""
    w, k = world, 3
    store = Store(w)
    ids = _prompt(w, 9, 48)
    p = len(ids) - 1
    logits, hidden = store.target_prefill(0, ids, reserve=k + 1)
    sampled = int(logits[-1].argmax())
    store.mtp(w.head, ids[1:], hidden[:-1], chunks=[(0, 0, p)])
    first = w.head.draft(store.kv, [DraftRow(0, p, 1)], torch.tensor([sampled]), hidden[-1:], k)
    d = first.tokens[0].tolist()
    verify_logits, verify_hidden = store.target_prefill(0, [sampled, *d], reserve=k + 1, start=p + 1)
    # Accept exactly d1 (whatever the target says) with the target's argmax after it as the bonus.
    bonus = int(verify_logits[1].argmax())
    committed = [*ids, sampled, d[0]]
    second = w.head.draft(store.kv, [DraftRow(0, p + 1, 2)], torch.tensor([d[0], bonus]), verify_hidden[:2], k)
    ref_toks, ref_logits = _oracle_draft(w, _hf_hidden(w, committed)[1], committed, bonus, k)
    assert second.tokens[0].tolist() == ref_toks
    torch.testing.assert_close(second.logits[0], ref_logits, atol=ATOL, rtol=RTOL)


def _heldout_tokens(n: int) -> list[int]:
    """The first ``n`` tokens of ``fractions.py`` of this interpreter's standard library (a module held out of
    the default model's training corpus, docs/default-model.md)."""
    from tokenizers import Tokenizer

    source = (Path(os.__file__).parent / "fractions.py").read_text()
    ids = Tokenizer.from_file(str(_default_folder() / "tokenizer.json")).encode(source).ids
    assert len(ids) >= n
    return ids[:n]


def _agreement(w: World, head: Qwen35MTPHead, ids: list[int]) -> float:
    """Teacher-forced greedy agreement: the MTP draft at t (from h_t and the true x_{t+1}) equals the main
    head's argmax at t + 1."""
    store = Store(w, num_pages=256, page_size=16)
    logits, hidden = store.target_prefill(0, ids)
    draft = store.mtp(head, ids[1:], hidden[:-1], chunks=[(0, 0, len(ids) - 1)]).logits.argmax(-1)
    main = logits[1:].argmax(-1)
    return float((draft == main).float().mean())


def test_trained_head_agrees_with_the_main_head_and_a_swapped_fc_does_not(default_world):
    w = default_world
    ids = _heldout_tokens(512)
    agree = _agreement(w, w.head, ids)
    H = w.cfg.hidden_size
    fc = w.mtp_weights["mtp/fc"]
    swapped = dict(w.mtp_weights, **{"mtp/fc": torch.cat((fc[:, H:], fc[:, :H]), dim=1)})
    bad = Qwen35MTPHead(w.cfg, w.mtp_config, swapped, w.model.embed, w.model.lm_head, w.ops, CPU, F32)
    wrong = _agreement(w, bad, ids)
    print(f"MTP greedy agreement on fractions.py[:512]: {agree:.3f}; fc halves swapped: {wrong:.3f}")
    assert agree >= 0.25, agree
    assert wrong <= agree - 0.15, (agree, wrong)


def test_mtp_specs_load_with_the_text_specs_in_one_binding(default_world, tmp_path):
    """The wiring path: ``parameter_specs`` plus :func:`mtp_parameter_specs` of the same text config bind in one
    ``load_weights`` call, and a head built from that one weights map equals the one from the component."""
    from ninfer.conversion import convert

    artifact = tmp_path / "default.ninfer"
    convert(_default_folder(), artifact, progress=False)
    reader = ArtifactReader.open(artifact)
    config = reader.component("text").config
    specs = get_registry().architecture(config["architectures"][0]).parameter_specs(config, StartupFeatures())
    mtp_specs = mtp_parameter_specs(config)
    assert mtp_specs == mtp_parameter_specs(config, reader.component("mtp").config)
    assert {s.component for s in mtp_specs} == {"mtp"}
    weights = load_weights(reader, [*specs, *mtp_specs], "cpu")
    w = default_world
    assert all(torch.equal(weights[n], t) for n, t in w.mtp_weights.items())
    head = Qwen35MTPHead(w.cfg, config, weights, w.model.embed, w.model.lm_head, w.ops, CPU, F32)
    ids = _prompt(w, 8, 10)
    a, b = Store(w), Store(w)
    _, hidden = a.target_prefill(0, ids)
    assert b.kv.ensure(0, len(ids), write_from=0)
    ours = a.mtp(head, ids[1:], hidden[:-1], chunks=[(0, 0, len(ids) - 1)])
    ref = b.mtp(w.head, ids[1:], hidden[:-1], chunks=[(0, 0, len(ids) - 1)])
    assert torch.equal(ours.logits, ref.logits)


def test_bad_inputs_name_the_problem(default_world, tmp_path):
    w = default_world
    with pytest.raises(NotSupportedError, match="mtp_num_hidden_layers=2"):
        mtp_num_layers({"mtp_num_hidden_layers": 2})
    with pytest.raises(NotSupportedError, match="dedicated embeddings"):
        mtp_num_layers({"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": True})
    store = Store(w)
    ids = _prompt(w, 7, 12)
    _, hidden = store.target_prefill(0, ids)   # pages for 12 tokens: a 3-step draft from 11 needs 14
    with pytest.raises(ProgramError, match="needs pages for 14 tokens"):
        w.head.draft(store.kv, [DraftRow(0, 11, 1)], torch.tensor([1]), hidden[-1:], 3)
    with pytest.raises(ProgramError, match="one next token and one hidden state per position"):
        store.mtp(w.head, [1, 2], hidden[:1], decode=[(0, 0)])
    no_mtp = tmp_path / "text_only.ninfer"
    from ninfer.conversion import convert

    hf = tiny_text_model("dense", dict(GEOMETRY, num_hidden_layers=4, intermediate_size=96), seed=3)
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", no_mtp, progress=False)
    with pytest.raises(MissingComponentError, match="'mtp'"):
        load_mtp_weights(ArtifactReader.open(no_mtp), "cpu")

