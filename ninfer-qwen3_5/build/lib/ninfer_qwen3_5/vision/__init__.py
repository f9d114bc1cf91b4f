"""Qwen3.5's vision tower: its compact config (:mod:`.config`), parameters (:mod:`.parameters`), the tower's
maths (:mod:`.tower`, over :mod:`.grid`'s per-image index tables), the multimodal RoPE positions of a prompt
(:mod:`.positions`), the media of the Program's sequences (:mod:`.media`) and one model call's multimodal inputs
(:mod:`.inputs`). Importing this package imports nothing heavy; the modules that need torch import it themselves."""
