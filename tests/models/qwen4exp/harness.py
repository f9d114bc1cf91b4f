"""Tiny random Qwen4-Exp checkpoints built with transformers (``Qwen4ExpForCausalLM``, random weights, fp32), saved
with ``save_pretrained``, converted with our converter and loaded back; and a driver of a Program the way the engine
drives it.

Cases (every one is MoE, the only Qwen4-Exp MLP):

- ``sparse``: 4 layers (3 GDN + 1 QSA), 3 residual streams (odd), PLE on the GDN layer 2 (one-based), sigmoid GDN
  gate, QSA keeping 2 blocks of 2 tokens + the tail: long prompts are sparse.
- ``dense``: 5 layers with an explicit layer list (QSA at 1 and 4), 4 streams, PLE on layers 1 and 3 (two PLE
  indices: different primes and multipliers), 4-grams, a silu GDN gate, tied embeddings, a QSA budget above every
  test context (selection keeps everything: exact dense attention), rotary 8 of 16 dims with MRoPE sections.
- ``plain``: 8 layers at the default interval (QSA at 3 and 7), 2 streams, no PLE, blocks of 4 tokens with a budget
  of 3 blocks, so chunks and blocks cut each other at many offsets.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)            # transformers' torch GDN path (the oracle)
sys.modules.setdefault("causal_conv1d", None)

from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from ninfer.artifact import ArtifactReader, load_weights  # noqa: E402
from ninfer.contracts.architecture import ProgramInit, ProgramOptions  # noqa: E402
from ninfer.contracts.features import StartupFeatures  # noqa: E402
from ninfer.contracts.program import DecodeRow, ExecutionUnit, PrefillChunk, RowSampling  # noqa: E402
from ninfer.contracts.sampling import SamplingParams  # noqa: E402
from ninfer.ops import resolve_ops  # noqa: E402
from ninfer.plugins import get_registry  # noqa: E402
from ninfer.testing import CHATML_SPECIALS, convert_checkpoint, write_byte_tokenizer  # noqa: E402
from support.models import randomize_weights  # noqa: E402

EOS = 258   # <|im_end|> of the byte tokenizer
VOCAB = 300

BASE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8,
            num_experts_per_tok=3, hc_lowrank=8, max_position_embeddings=4096, eos_token_id=EOS,
            indexer_kv_heads=1, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})

CASES: dict[str, dict] = {
    "sparse": dict(BASE, num_hidden_layers=4, hc_count=3, ple_layer_ids=[2], ple_embed_dim=32, ngram_size=3,
                   heads_per_ngram=2, ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8,
                   split_ngram_parts=3, indexer_n_heads=2, indexer_head_dim=8, indexer_budget=4,
                   indexer_compress_ratio=2, output_gate_type="sigmoid"),
    "dense": dict(BASE, num_hidden_layers=5, hc_count=4,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                               "full_attention"],
                  ple_layer_ids=[1, 3], ple_embed_dim=48, ngram_size=4, heads_per_ngram=2, ngram_vocab_size_base=40,
                  make_ngram_vocab_size_divisible_by=16, split_ngram_parts=5, ple_conv_kernel_size=3,
                  indexer_n_heads=3, indexer_head_dim=16, indexer_budget=512, indexer_compress_ratio=4,
                  output_gate_type=None, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                                   "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
    "plain": dict(BASE, num_hidden_layers=8, hc_count=2, indexer_n_heads=4, indexer_head_dim=8, indexer_budget=12,
                  indexer_compress_ratio=4, output_gate_type="sigmoid"),
}

GREEDY = RowSampling(SamplingParams(temperature=0.0), seed=0, step=0)


def build_hf(name: str, seed: int):
    import transformers as tf

    cfg = tf.Qwen4ExpTextConfig(**CASES[name])
    cfg.architectures = ["Qwen4ExpForCausalLM"]
    model = tf.Qwen4ExpForCausalLM(cfg)
    randomize_weights(model, seed)
    with torch.no_grad():   # the final reduction's mixed streams are ~0.5 in size: a wider head gives O(1) logits
        model.lm_head.weight.mul_(3.0)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.float().eval()


@dataclass
class Case:
    name: str
    hf: torch.nn.Module
    source: Path
    artifact: Path
    config: dict
    weights: dict[str, torch.Tensor]
    spec: object


class Cases:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Case] = {}

    def __call__(self, name: str) -> Case:
        if name not in self._built:
            self._built[name] = self._build(name)
        return self._built[name]

    def _build(self, name: str) -> Case:
        hf = build_hf(name, seed=sorted(CASES).index(name) + 11)
        src = self.root / name
        hf.save_pretrained(src)
        write_byte_tokenizer(src, specials=CHATML_SPECIALS, eos="<|im_end|>")
        artifact = convert_checkpoint(src, self.root / f"{name}.ninfer")
        with ArtifactReader.open(artifact) as reader:
            config = reader.component("text").config
            spec = get_registry().architecture(config["architectures"][0])
            weights = load_weights(reader, spec.parameter_specs(config, StartupFeatures()), "cpu")
        return Case(name, hf, src, artifact, config, weights, spec)


def make_program(case: Case, *, config: dict | None = None, page_size: int = 4, num_pages: int = 128,
                 max_sequences: int = 4, checkpoint_slots: int = 0, ops=None):
    """A Program of ``case`` on the CPU in fp32, on the torch reference ops unless ``ops`` (an OpSet) is given."""
    ops = ops or resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    options = ProgramOptions(device=torch.device("cpu"), dtype=torch.float32, max_sequences=max_sequences,
                             page_size=page_size, num_pages=num_pages, max_context=num_pages * page_size,
                             checkpoint_slots=checkpoint_slots)
    return case.spec.create_program(ProgramInit(config=config or case.config, weights=case.weights, ops=ops,
                                                options=options))


def hf_logits(case: Case, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits of every position of ``ids``, one forward without a cache."""
    with torch.no_grad():
        return case.hf(torch.tensor([ids]), use_cache=False).logits[0].float()


def prompt(seed: int, length: int, eos_every: int = 0) -> list[int]:
    """Random byte tokens; with ``eos_every``, an EOS every that many tokens (the n-gram windows then restart)."""
    ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    if eos_every:
        for i in range(eos_every - 1, length, eos_every):
            ids[i] = EOS
    return ids


class Runner:
    """Drives a Program like the engine: reserve, run a unit of decode rows and prefill chunks, commit every row.
    ``logits[seq]`` lists the logits of that sequence's sampled rows."""

    def __init__(self, program) -> None:
        self.p = program
        self.logits: dict[int, list[torch.Tensor]] = {}
        forward = program.forward

        def recording(batch):
            self._last = forward(batch)
            return self._last

        program.forward = recording

    def unit(self, decode=(), chunks=()) -> dict[int, int]:
        demands = {s: 1 for s in decode}
        demands.update(dict(chunks))
        assert all(self.p.reserve_units(demands).values())
        parts = []
        for seq, n in chunks:
            ends = self.p.computed(seq) + n == self.p.ledger_length(seq)
            parts.append(PrefillChunk(seq, n, GREEDY if ends else None))
        pending = self.p.run(ExecutionUnit(decode=tuple(DecodeRow(s, GREEDY) for s in decode), chunks=tuple(parts)))
        for i, row in enumerate(pending.rows):
            self.logits.setdefault(row.seq, []).append(self._last[i].clone())
        self.p.commit(pending, {r.seq: len(r.tokens) for r in pending.rows})
        return {r.seq: r.tokens[0] for r in pending.rows}
