"""The Qwen3.5 ModelProfile's exact figures equal the bytes the Program really allocates.

For each artifact (bf16-stored tied dense; fp32-stored untied MoE) and run dtype (fp32, bf16) a
Program is built on the CPU the way startup builds it; the distinct storages reachable from its
model, KV pool and StateImage storage are measured and compared byte for byte with the profile, and
the storages the Program created itself (not the loader's) with ``converted_weight_bytes``.
"""

from __future__ import annotations

import pytest
import torch
from ninfer.artifact import ArtifactReader, load_weights
from ninfer.contracts.architecture import ProgramInit, ProgramOptions
from ninfer.contracts.features import StartupFeatures
from ninfer.ops import resolve_ops
from ninfer.planning.calibration import resident_tensor_bytes
from ninfer.planning.planner import weight_source
from ninfer.plugins import get_registry


def _storages(root) -> dict[int, int]:
    out: dict[int, int] = {}
    stack = [root]
    seen: set[int] = set()
    while stack:  # the same walk as resident_tensor_bytes, keeping the storage keys
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            out[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif id(obj) not in seen:
            seen.add(id(obj))
            if isinstance(obj, dict):
                stack.extend(obj.values())
            elif isinstance(obj, (list, tuple)):
                stack.extend(obj)
            elif type(obj).__module__.startswith("ninfer"):
                stack.extend(vars(obj).values())
    return out


def _build(artifact, dtype, *, num_pages=12, page_size=8, sequences=3):
    features = StartupFeatures()
    with ArtifactReader.open(artifact) as reader:
        config = reader.component("text").config
        spec = get_registry().architecture(config["architectures"][0])
        specs = spec.parameter_specs(config, features)
        source = weight_source(reader, specs)
        weights = load_weights(reader, specs, "cpu")
    profile = spec.profile(config, features, dtype=dtype, stored_dtypes=source.stored_dtypes,
                           packed_bytes=source.packed_bytes)
    ops = resolve_ops(get_registry().ops, "cpu", dtype, force="reference")
    options = ProgramOptions(device=torch.device("cpu"), dtype=dtype, max_sequences=sequences, page_size=page_size,
                             num_pages=num_pages, max_context=num_pages * page_size)
    program = spec.create_program(ProgramInit(config=config, weights=weights, ops=ops, options=options,
                                              features=features))
    return profile, program, weights, source


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("which", ["default_artifact", "tiny_moe_artifact"])
def test_profile_equals_allocated_bytes(request, which, dtype):
    artifact = request.getfixturevalue(which)
    profile, program, loaded, source = _build(artifact, dtype)
    assert resident_tensor_bytes(program.model) == profile.weight_bytes
    assert resident_tensor_bytes(program.kv) == 12 * 8 * profile.kv_bytes_per_token
    assert resident_tensor_bytes(program.states) == 3 * profile.state_bytes_per_sequence
    assert program.kv.bytes_per_token == profile.kv_bytes_per_token
    created = {k: n for k, n in _storages(program.model).items() if k not in _storages(loaded)}
    assert sum(created.values()) == profile.converted_weight_bytes
    # The loader never holds more than the planner's load_bytes (all parents plus gathered copies).
    assert 0 < resident_tensor_bytes(loaded) <= source.load_bytes
    # The parts a decode step reads only in part (ninfer bench's byte count): the input table when it is not the
    # LM head, and the routed expert banks.
    model = program.model
    tied = model.embed.untyped_storage().data_ptr() == model.lm_head.untyped_storage().data_ptr()
    assert profile.embedding_bytes == (0 if tied else model.embed.numel() * model.embed.element_size())
    banks = [t for layer in model.layers for t in (getattr(layer.mlp, "bank_gate_up", None),
                                                   getattr(layer.mlp, "bank_down", None)) if t is not None]
    assert profile.routed_expert_bytes == sum(t.numel() * t.element_size() for t in banks)
    assert (profile.routed_expert_bytes > 0) == (which == "tiny_moe_artifact") == (profile.num_experts > 0)


def test_stored_dtype_decides_what_is_converted(default_artifact, tiny_moe_artifact):
    """bf16 stored + bf16 run: only the derived fp32 tensors (and the MoE block's fused router + shared
    expert input rows) are new; fp32 stored + fp32 run likewise; a different run dtype converts (nearly)
    every weight."""
    for artifact, same, other in ((default_artifact, torch.bfloat16, torch.float32),
                                  (tiny_moe_artifact, torch.float32, torch.bfloat16)):
        p_same, program = _build(artifact, same)[:2]
        p_other = _build(artifact, other)[0]
        cfg = program.cfg
        fused = (cfg.num_layers * (cfg.num_experts + 2 * cfg.shared_expert_intermediate_size + 1)
                 * cfg.hidden_size * same.itemsize) if cfg.is_moe else 0
        assert p_same.converted_weight_bytes - fused < p_same.weight_bytes // 50
        assert p_other.converted_weight_bytes > p_other.weight_bytes * 0.98


def test_engine_memory_summary_matches_the_program(default_artifact):
    from ninfer import Engine

    with Engine.start(default_artifact, device="cpu", max_concurrency=2, max_context=256) as engine:
        m = engine.memory_summary()
        program = engine._owned.program
        assert m is not None and m.measured
        assert engine.info["memory"] == m.as_dict()
        assert m.kv_bytes == resident_tensor_bytes(program.kv)
        # The running requests' StateImages and the default context cache's checkpoint StateImages.
        checkpoints = program.checkpoint_states
        assert checkpoints is not None and checkpoints.num_slots == 16 + 2 * 2
        assert m.state_bytes == resident_tensor_bytes(program.states) + resident_tensor_bytes(checkpoints)
        assert m.weights_bytes == resident_tensor_bytes(program.model)
        # CPU: what start left held is exactly the Program's weights, KV and State.
        assert m.startup_retained_bytes == m.weights_bytes + m.kv_bytes + m.state_bytes
        assert m.runtime_reservation_bytes == m.kv_bytes + m.state_bytes
        assert m.kv_candidate == "every running request at max_context" and m.num_pages == 2 * 256 // 16
        assert (m.graph_calibration_growth_bytes, m.graph_retained_after_release_bytes,
                m.graph_rebuild_estimate_bytes, m.graph_final_growth_bytes) == (0, 0, 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", ["q8", "q4", "fp8"])
def test_profile_of_a_quantized_artifact_equals_allocated_bytes(tiny_moe_artifact, tmp_path, recipe, dtype):
    """Packed weights are held as stored (a byte buffer per parameter), not in the run dtype: the profile the planner
    sizes memory with must say so, or a quantized model is planned as if it were not quantized."""
    from ninfer.conversion import convert

    source = tiny_moe_artifact.parent / "hf"
    artifact = tmp_path / f"{recipe}.ninfer"
    convert(source, artifact, progress=False, quantize=recipe)
    profile, program, loaded, _ = _build(artifact, dtype)
    assert resident_tensor_bytes(program.model) == profile.weight_bytes
    created = {k: n for k, n in _storages(program.model).items() if k not in _storages(loaded)}
    assert sum(created.values()) == profile.converted_weight_bytes
