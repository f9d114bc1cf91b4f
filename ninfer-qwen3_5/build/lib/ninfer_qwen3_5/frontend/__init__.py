"""The Qwen-family Frontend: tokenizer, chat template, PreparedPrompt, and the per-request OutputSession
(incremental detokenization, stop strings, reasoning split, XML tool calls)."""

from ninfer_qwen3_5.frontend.errors import ChatTemplateError, FrontendError
from ninfer_qwen3_5.frontend.frontend import QwenFrontend
from ninfer_qwen3_5.frontend.output_session import QwenOutputSession

__all__ = ["ChatTemplateError", "FrontendError", "QwenFrontend", "QwenOutputSession"]
