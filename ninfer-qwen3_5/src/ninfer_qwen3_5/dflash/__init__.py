"""DFlash and DFlash2 block-diffusion drafters for Qwen3.5 targets: config (:mod:`.config`), parameters
(:mod:`.parameters`), the converter's draft mapping (:mod:`.mapping`)."""
