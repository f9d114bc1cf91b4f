"""Qwen4-Exp's own ops: contracts (:mod:`.contracts`), torch references (:mod:`.reference`), registration."""
