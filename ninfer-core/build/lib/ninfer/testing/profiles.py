"""Checking an architecture's :class:`~ninfer.contracts.architecture.ModelProfile` against what its Program
really allocates.

The planner sizes the KV pool and admits requests from the profile before any weight is read, so the exact
fields must equal the bytes of the tensors the Program holds (the field docstrings of ``ModelProfile``):

- ``weight_bytes``: every storage the Program reaches, less its KV pools, StateImages and host-placed weights (a
  view counts its whole storage once, so a tied head shared with the embedding counts once);
- ``host_weight_bytes``: the storages of the parameters placed in host memory that the Program keeps;
- ``converted_weight_bytes``: the part of those storages the Program created itself (casts, derived
  constants), i.e. not the loader's;
- ``kv_bytes_per_token``: the KV pools' bytes over their ``num_pages * page_size`` token slots;
- ``state_bytes_per_sequence``: the StateImage storage's bytes over its slots (at least one alignment unit,
  even for an empty state layout);
- ``vocab_size`` and ``max_position_embeddings``: those of the Program's declared layout.

The loader itself never holds more than the planner's ``load_bytes`` (plus ``host_load_bytes`` of host-placed
parameters). Storages are measured as
:func:`~ninfer.planning.calibration.resident_tensor_bytes` measures them at startup.
"""

from __future__ import annotations

from ninfer.planning.calibration import released_weight_bytes, resident_tensor_bytes, tensor_storages
from ninfer.testing.programs import BuiltProgram


def measured_profile(built: BuiltProgram) -> dict[str, int]:
    """The exact ``ModelProfile`` fields as measured on ``built.program`` (a ``ModelProgram``), by name."""
    program, options = built.program, built.options
    kv = resident_tensor_bytes(program.kv)
    states = resident_tensor_bytes(program.states)
    checkpoints = resident_tensor_bytes(program.checkpoint_states)
    host_keys = tensor_storages({n: built.weights[n] for n in built.host_parameters})
    host = sum(n for key, n in tensor_storages(program).items() if key in host_keys)
    weights = resident_tensor_bytes(program) - kv - states - checkpoints - host
    kept_from_loader = (resident_tensor_bytes(built.weights) - released_weight_bytes(built.weights, program,
                                                                                     options.device) - host)
    return {
        "weight_bytes": weights,
        "host_weight_bytes": host,
        "converted_weight_bytes": weights - kept_from_loader,
        "kv_bytes_per_token": kv // (options.num_pages * options.page_size),
        "state_bytes_per_sequence": states // program.states.num_slots,
        "vocab_size": program.vocab_size,
        "max_position_embeddings": program.layout.max_positions,
    }


def profile_mismatches(built: BuiltProgram) -> list[str]:
    """One line per exact profile field that differs from the Program's allocation (empty: the profile is
    exact), plus one if the loader held more than ``load_bytes``."""
    out = [f"{name}: profile says {getattr(built.profile, name)}, the Program holds {value}"
           for name, value in measured_profile(built).items() if getattr(built.profile, name) != value]
    if built.program.kv.bytes_per_token != built.profile.kv_bytes_per_token:
        out.append(f"kv_bytes_per_token: profile says {built.profile.kv_bytes_per_token}, the KV pool's "
                   f"bytes_per_token is {built.program.kv.bytes_per_token}")
    loaded = resident_tensor_bytes(built.weights)
    if loaded > built.load_bytes + built.host_load_bytes:
        out.append(f"load_bytes: the loader held {loaded} bytes, more than the planned {built.load_bytes} + "
                   f"{built.host_load_bytes} (host-placed)")
    return out


def assert_profile_exact(built: BuiltProgram) -> None:
    """AssertionError listing :func:`profile_mismatches` when there is any."""
    mismatches = profile_mismatches(built)
    assert not mismatches, "ModelProfile differs from the Program's allocations:\n" + "\n".join(mismatches)
