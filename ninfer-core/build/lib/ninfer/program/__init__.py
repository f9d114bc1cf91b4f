"""The Program: the one owner of a model instance's sequences, KV pages, StateImage slots and model calls.

Modules (each states its invariants):

- :mod:`~ninfer.program.model`: ``ModelProgram``, what an architecture subclasses (a declared layout and
  one model call over a packed batch); builds the storage, packs batches, captures decode graphs.
- :mod:`~ninfer.program.base`: ``SequenceProgram``, the bookkeeping: sequences, reservations,
  run / commit / abort, pause / release, causal scoring.
- :mod:`~ninfer.program.ledger`: one sequence's record and the ledger rules.
- :mod:`~ninfer.program.batch`: what one model call receives (a leaf: decode rows, chunk, packed batch).
- :mod:`~ninfer.program.checkpoints`: checkpoints, the Host tier, the Snapshot pause.
- :mod:`~ninfer.program.lookahead`: launching the next decode step before this one's tokens are on the host.
- :mod:`~ninfer.program.sampling`: masks, penalties, the draw and logprobs over a batch of logits.
- :mod:`~ninfer.program.graphs`: CUDA graphs of the decode-only model call.
- :mod:`~ninfer.program.token_bitmask`: allowed-token bitmasks (constrained decoding).
"""
