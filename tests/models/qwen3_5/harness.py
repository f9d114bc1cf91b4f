"""Tiny random Qwen3.5 checkpoints built with transformers, converted with our converter, loaded back.

``conftest.py`` exposes the session fixture ``qwen_case``. Each case is built once (lazily): an HF model with non-trivial random weights (norm
weights, A_log and dt_bias re-drawn so that zero/one initialisations cannot hide a bug), saved with
``save_pretrained``, converted by ``ninfer.conversion.convert``, read with ``ArtifactReader`` and
``load_weights``. Tests build Programs from a case with :func:`make_program` and drive them with
:class:`Runner` the way the engine does (reserve, run, commit every row).
"""

from __future__ import annotations

import sys

sys.modules.setdefault("fla", None)            # force transformers' torch GDN path (the oracle)
sys.modules.setdefault("causal_conv1d", None)

import json  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from ninfer.artifact import ArtifactReader, load_weights  # noqa: E402
from ninfer.contracts.architecture import ProgramInit, ProgramOptions  # noqa: E402
from ninfer.contracts.features import StartupFeatures  # noqa: E402
from ninfer.contracts.program import (  # noqa: E402
    DecodeRow,
    ExecutionUnit,
    PrefillChunk,
    RowSampling,
)
from ninfer.contracts.sampling import SamplingParams  # noqa: E402
from ninfer.ops import resolve_ops  # noqa: E402
from ninfer.plugins import get_registry  # noqa: E402
from support.models import randomize_weights, tiny_text_model  # noqa: E402

GEOMETRY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096)

# name -> (HF config class path, config kwargs)
CASES: dict[str, dict] = {
    "dense": dict(kind="dense", text=dict(GEOMETRY, num_hidden_layers=4, intermediate_size=96,
                                          tie_word_embeddings=False)),
    "dense_tied": dict(kind="dense", text=dict(GEOMETRY, num_hidden_layers=4, intermediate_size=80,
                                               tie_word_embeddings=True)),
    "moe": dict(kind="moe", text=dict(GEOMETRY, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                      tie_word_embeddings=False)),
    # Hv != Hk (ratio 3), Dv != Dk, 9 layers (attention at 3 and 7, GDN last), wider head with
    # partial rotary 8 dims and explicit interleaved MRoPE sections.
    "odd": dict(kind="dense", text=dict(GEOMETRY, num_hidden_layers=9, intermediate_size=72, head_dim=32,
                                        linear_num_key_heads=2, linear_num_value_heads=6, linear_value_head_dim=24,
                                        rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                                             partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                                                             mrope_interleaved=True),
                                        tie_word_embeddings=False)),
    # Multimodal declaration with a vision tower and (injected) MTP tensors; tied embeddings.
    "vlm": dict(kind="conditional", text=dict(GEOMETRY, num_hidden_layers=4, intermediate_size=96,
                                              tie_word_embeddings=True),
                vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                            num_position_embeddings=16, patch_size=4)),
    # Long-context cases (16k positions) for the long oracle; explicit seeds keep the other cases'.
    "long_dense": dict(kind="dense", seed=31, text=dict(GEOMETRY, num_hidden_layers=4, intermediate_size=96,
                                                        max_position_embeddings=16400, tie_word_embeddings=False)),
    "long_moe": dict(kind="moe", seed=32, text=dict(GEOMETRY, num_hidden_layers=4, num_experts=8,
                                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                                    shared_expert_intermediate_size=48,
                                                    max_position_embeddings=16400, tie_word_embeddings=False)),
}

GREEDY = RowSampling(SamplingParams(temperature=0.0), seed=0, step=0)


def _inject_mtp(folder: Path, text: dict) -> None:
    """Add one MTP layer's tensors (vLLM/checkpoint names) to the saved checkpoint and config."""
    from safetensors.torch import load_file, save_file

    st = folder / "model.safetensors"
    tensors = load_file(st)
    H, D, Nq, Nkv, I = (text["hidden_size"], text["head_dim"], text["num_attention_heads"],  # noqa: E741
                        text["num_key_value_heads"], text["intermediate_size"])
    g = torch.Generator().manual_seed(7)
    shapes = {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,),
              "mtp.layers.0.input_layernorm.weight": (H,), "mtp.layers.0.post_attention_layernorm.weight": (H,),
              "mtp.layers.0.self_attn.q_proj.weight": (2 * Nq * D, H),
              "mtp.layers.0.self_attn.k_proj.weight": (Nkv * D, H),
              "mtp.layers.0.self_attn.v_proj.weight": (Nkv * D, H),
              "mtp.layers.0.self_attn.o_proj.weight": (H, Nq * D),
              "mtp.layers.0.self_attn.q_norm.weight": (D,), "mtp.layers.0.self_attn.k_norm.weight": (D,),
              "mtp.layers.0.mlp.gate_proj.weight": (I, H), "mtp.layers.0.mlp.up_proj.weight": (I, H),
              "mtp.layers.0.mlp.down_proj.weight": (H, I)}
    for name, shape in shapes.items():
        tensors[name] = torch.randn(shape, generator=g)
    save_file(tensors, st, metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    cfg["text_config"]["mtp_use_dedicated_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def _build_hf(case: dict, seed: int):
    if case["kind"] != "conditional":
        model = tiny_text_model(case["kind"], case["text"], seed)
    else:
        import transformers as tf

        cfg = tf.Qwen3_5Config(text_config=case["text"], vision_config=case["vision"],
                               tie_word_embeddings=case["text"]["tie_word_embeddings"])
        model = tf.Qwen3_5ForConditionalGeneration(cfg)
        randomize_weights(model, seed)
    if case["text"]["tie_word_embeddings"]:
        model.tie_weights()
    return model.eval()


@dataclass
class Case:
    name: str
    hf: torch.nn.Module
    source: Path
    artifact: Path
    reader: ArtifactReader
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
        from ninfer.conversion import convert

        case = CASES[name]
        seeded = sorted(n for n, c in CASES.items() if "seed" not in c)
        hf = _build_hf(case, seed=case.get("seed") or seeded.index(name) + 1)
        src = self.root / name
        hf.save_pretrained(src)
        if case["kind"] == "conditional":
            _inject_mtp(src, case["text"])
        out = self.root / f"{name}.ninfer"
        convert(src, out, progress=False)
        reader = ArtifactReader.open(out)
        config = reader.component("text").config
        spec = get_registry().architecture(config["architectures"][0])
        weights = load_weights(reader, spec.parameter_specs(config, StartupFeatures()), "cpu")
        return Case(name, hf, src, out, reader, config, weights, spec)


def make_program(case: Case, *, page_size: int = 4, num_pages: int = 256, max_sequences: int = 4,
                 max_context: int = 1024, lookahead_slots: int = 0, checkpoint_slots: int = 0):
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    options = ProgramOptions(device=torch.device("cpu"), dtype=torch.float32, max_sequences=max_sequences,
                             page_size=page_size, num_pages=num_pages, max_context=max_context,
                             lookahead_slots=lookahead_slots, checkpoint_slots=checkpoint_slots)
    return case.spec.create_program(ProgramInit(config=case.config, weights=case.weights, ops=ops,
                                                options=options))


class Runner:
    """Drives a Program like the engine (reserve, run, commit everything) and, with ``record``, records
    the logits each unit produced: ``logits[seq]`` is the list of that sequence's sampled-row logits.
    Subclasses choose each row's sampling (:meth:`row_sampling`) and see each committed batch."""

    def __init__(self, program, *, record: bool = True) -> None:
        self.p = program
        self.logits: dict[int, list[torch.Tensor]] = {}
        self._last: torch.Tensor | None = None
        self.record = record
        if not record:
            return
        forward = program.forward

        def recording(batch):
            self._last = forward(batch)
            return self._last

        program.forward = recording

    def row_sampling(self, seq: int, overrides: dict) -> RowSampling:
        return overrides.get(seq, GREEDY)

    def committed(self, pending) -> None:
        """Called after each unit's commit (every row accepted whole)."""

    def open(self, tokens, prompt_length=None) -> int:
        return self.p.open_sequence(list(tokens), prompt_length=prompt_length)

    def unit(self, decode=(), chunk=None, sampling=None, chunks=()) -> dict[int, int]:
        """Run one unit; ``decode`` seq ids (greedy unless ``sampling[seq]``), ``chunk`` (seq, n) and/or
        ``chunks`` [(seq, n), ...] (in that order after ``chunk``)."""
        sampling = sampling or {}
        parts = ([chunk] if chunk is not None else []) + list(chunks)
        demands = {s: 1 for s in decode}
        for seq, n in parts:
            demands[seq] = n
        assert all(self.p.reserve_units(demands).values())
        units = []
        for seq, n in parts:
            ends = self.p.computed(seq) + n == self.p.ledger_length(seq)
            units.append(PrefillChunk(seq, n, self.row_sampling(seq, sampling) if ends else None))
        pending = self.p.run(ExecutionUnit(
            decode=tuple(DecodeRow(s, self.row_sampling(s, sampling)) for s in decode), chunks=tuple(units)))
        if self.record:
            for i, row in enumerate(pending.rows):
                self.logits.setdefault(row.seq, []).append(self._last[i].clone())
        self.p.commit(pending, {r.seq: len(r.tokens) for r in pending.rows})
        self.committed(pending)
        return {r.seq: r.tokens[0] for r in pending.rows}

    def prefill(self, seq: int, chunks=None) -> int | None:
        """Process the ledger up to its end in ``chunks`` (default: one chunk); returns the sampled
        token, or None for a Replay that stops one short (``chunks`` summing to ledger-1)."""
        remaining = self.p.ledger_length(seq) - self.p.computed(seq)
        chunks = list(chunks or [remaining])
        out = None
        for n in chunks:
            out = self.unit(chunk=(seq, n)).get(seq)
        return out

    def generate(self, prompt, steps: int, chunks=None) -> list[int]:
        seq = self.open(prompt)
        toks = [self.prefill(seq, chunks)]
        for _ in range(steps - 1):
            toks.append(self.unit(decode=[seq])[seq])
        return toks


def mixed_run(program) -> tuple[dict[int, list[torch.Tensor]], list[dict[int, int]]]:
    """Three sequences through ``program``: prefill one, decode it alone twice (one row), prefill the second and the
    third in one unit beside a decode row of the first (a mixed unit of two chunks), then decode all three together
    twice (three rows). Returns the recorded logits per sequence and each unit's tokens."""
    r = Runner(program)
    a, b, c = r.open(prompt(1, 9)), r.open(prompt(2, 7)), r.open(prompt(3, 5))
    tokens = [{a: r.prefill(a)}]
    tokens += [r.unit(decode=[a]) for _ in range(2)]
    tokens.append(r.unit(decode=[a], chunks=[(b, 7), (c, 5)]))
    tokens += [r.unit(decode=[a, b, c]) for _ in range(2)]
    return r.logits, tokens


def assert_same_run(want: tuple, got: tuple, what: str, tol: float = 1e-4) -> None:
    """Two :func:`mixed_run` results: the same tokens, and every recorded logits row within ``tol`` (max abs)."""
    (want_logits, want_tokens), (got_logits, got_tokens) = want, got
    assert got_tokens == want_tokens, what
    for seq, rows in want_logits.items():
        for i, (w, g) in enumerate(zip(rows, got_logits[seq], strict=True)):
            err = (g.float().cpu() - w.float().cpu()).abs().max().item()
            assert err <= tol, f"{what}: sequence {seq} row {i} logits differ by {err:.2e}"


def split(n: int, size: int) -> list[int]:
    return [min(size, n - i) for i in range(0, n, size)]


def prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def load_with_mtp(folder: Path, artifact: Path):
    """Convert the HF ``folder`` (with ``mtp.*`` tensors) to ``artifact`` and load it on the CPU:
    ``(compact text config, architecture spec, text weights, MTP config, MTP weights)``."""
    from ninfer.conversion import convert
    from ninfer_qwen3_5.mtp import load_mtp_weights

    convert(folder, artifact, progress=False)
    reader = ArtifactReader.open(artifact)
    config = reader.component("text").config
    spec = get_registry().architecture(config["architectures"][0])
    weights = load_weights(reader, spec.parameter_specs(config, StartupFeatures()), "cpu")
    mtp_config, mtp_weights = load_mtp_weights(reader, "cpu")
    return config, spec, weights, mtp_config, mtp_weights
