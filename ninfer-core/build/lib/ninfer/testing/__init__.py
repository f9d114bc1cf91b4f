"""Test helpers for architecture plugins, installed with ninfer-core (docs/plugins.md, "Testing").

Importing this package needs nothing beyond ninfer-core's own dependencies: the oracle model, when a helper
needs one, is built by the caller (with transformers) and passed in.

- :mod:`~ninfer.testing.checkpoints`: a byte-level tokenizer, well-conditioned random weights, saving a tiny
  Hugging Face model and converting it, the default model in a private cache.
- :mod:`~ninfer.testing.programs`: a Program built from an artifact as startup builds it; its logits through
  the scoring path.
- :mod:`~ninfer.testing.profiles`: the ``ModelProfile`` checked against the Program's real allocations.
- :mod:`~ninfer.testing.reference`: the oracle's logits and greedy tokens.
- :mod:`~ninfer.testing.engines`: greedy generations through an Engine, settled stats, torch threads.
"""

from ninfer.testing.checkpoints import (
    CHATML_SPECIALS,
    convert_checkpoint,
    default_model_in,
    randomize_weights,
    save_checkpoint,
    write_byte_tokenizer,
)
from ninfer.testing.engines import greedy_tokens, settled, torch_threads
from ninfer.testing.profiles import assert_profile_exact, measured_profile, profile_mismatches
from ninfer.testing.programs import BuiltProgram, build_program, program_logits
from ninfer.testing.reference import first_divergence, reference_greedy, reference_logits

__all__ = [
    "CHATML_SPECIALS", "BuiltProgram", "assert_profile_exact", "build_program", "convert_checkpoint",
    "default_model_in", "first_divergence", "greedy_tokens", "measured_profile", "profile_mismatches",
    "program_logits", "randomize_weights", "reference_greedy", "reference_logits", "save_checkpoint", "settled",
    "torch_threads", "write_byte_tokenizer",
]
