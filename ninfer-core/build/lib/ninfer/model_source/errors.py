"""The error every model-source failure raises (naming the model and the cause)."""

from __future__ import annotations

from ninfer.errors import NInferError


class ModelSourceError(NInferError):
    """The named model is not an artifact, a checkpoint folder, a shipped default model or a Hugging Face repo
    that can be found or downloaded, or it cannot be converted; the message names the model and the cause."""
