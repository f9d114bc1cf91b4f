"""The Qwen-family Frontend: tokenizer, chat template, PreparedPrompt, and the per-request OutputSession
(incremental detokenization, stop strings, reasoning split, XML tool calls)."""

from ninfer.models.common.qwen.errors import ChatTemplateError, FrontendError
from ninfer.models.common.qwen.frontend import QwenFrontend
from ninfer.models.common.qwen.output_session import QwenOutputSession

__all__ = ["ChatTemplateError", "FrontendError", "QwenFrontend", "QwenOutputSession"]
