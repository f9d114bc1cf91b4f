"""QwenFrontend: the Frontend of every Qwen-family artifact, built from its frontend resources.

Resources are the artifact's ``{role: bytes}``: ``tokenizer.json`` (required), ``tokenizer_config.json``
(eos token; may carry ``chat_template``), ``chat_template.jinja``, ``generation_config.json``, and the image and
video preprocessing settings (``preprocessor_config.json``, ``video_preprocessor_config.json`` or
``processor_config.json``; Qwen3.5's defaults without them), read at the first image or video.
Chat messages may carry images and videos (:mod:`ninfer_qwen3_5.frontend.media_prompt`): ``prepare_chat``
preprocesses them on the calling thread (:mod:`ninfer_qwen3_5.frontend.vision`, within ``media_limits``) and
returns a PreparedPrompt with the placeholder runs expanded and its ``media``. A raw text prompt
(``prepare_text``) carries none. Template precedence: an explicit template given at start (``--chat-template FILE``), then
``chat_template.jinja``, then ``tokenizer_config.json``'s ``chat_template``, then NInfer's bundled
``qwen3_5.jinja``. The frontend is immutable after construction and shared by all requests; each request
gets its own :class:`QwenOutputSession`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ninfer.constrained import ConstraintMatcher, GrammarCompiler
from ninfer.contracts.errors import InvalidConstraintError
from ninfer.contracts.frontend import OutputOptions, PreparedPrompt

from ninfer_qwen3_5.frontend.chat_template import BUNDLED_TEMPLATE, ChatTemplate, bundled_template_source
from ninfer_qwen3_5.frontend.detokenizer import IncrementalDetokenizer
from ninfer_qwen3_5.frontend.errors import FrontendError
from ninfer_qwen3_5.frontend.generation_defaults import GenerationDefaults
from ninfer_qwen3_5.frontend.grammar import constraint_ebnf
from ninfer_qwen3_5.frontend.media_prompt import MediaPart, expand_media, extract_media, vision_tokens
from ninfer_qwen3_5.frontend.output_session import QwenOutputSession
from ninfer_qwen3_5.frontend.prompt import (
    TURN_START,
    chat_cache_points,
    ends_inside_thinking,
    normalize_messages,
    plain_data,
    prepared_text_prompt,
)
from ninfer_qwen3_5.frontend.reasoning import THINK_CLOSE, THINK_OPEN
from ninfer_qwen3_5.frontend.tokenizer import QwenTokenizer
from ninfer_qwen3_5.frontend.tool_calls import CALL_CLOSE, CALL_OPEN

if TYPE_CHECKING:
    from ninfer_qwen3_5.frontend.vision import MediaLimits

# Markers of the output format (reasoning and tool calls), parsed as text by the OutputSession.
_OUTPUT_MARKERS = frozenset(m.encode() for m in (THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE))

VISION_RESOURCE_ROLES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
RESOURCE_ROLES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                  *VISION_RESOURCE_ROLES)


def _json_resource(resources: Mapping[str, bytes], role: str) -> dict[str, Any] | None:
    raw = resources.get(role)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise FrontendError(f"{role}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise FrontendError(f"{role}: expected a JSON object")
    return value


def _file_name(source: object) -> str | None:
    """A media item's local file path as an error names it (shortened), None for bytes, data and web URLs."""
    if not isinstance(source, str | os.PathLike):
        return None
    text = os.fspath(source)
    if not isinstance(text, str) or text.startswith(("data:", "http://", "https://")):
        return None
    return text if len(text) <= 200 else f"...{text[-197:]}"


def select_chat_template(resources: Mapping[str, bytes], tokenizer_config: Mapping[str, Any] | None,
                     override: str | None) -> ChatTemplate:
    if override is not None:
        return ChatTemplate(override, "chat template given at start")
    if resources.get("chat_template.jinja") is not None:
        try:
            text = resources["chat_template.jinja"].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FrontendError(f"chat_template.jinja: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
        return ChatTemplate(text, "chat_template.jinja")
    embedded = (tokenizer_config or {}).get("chat_template")
    if isinstance(embedded, list):  # the named-templates form: [{"name": "default", "template": ...}]
        embedded = next((t.get("template") for t in embedded if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if isinstance(embedded, str):
        return ChatTemplate(embedded, "tokenizer_config.json chat_template")
    return ChatTemplate(bundled_template_source(), f"bundled {BUNDLED_TEMPLATE}")


class QwenFrontend:
    """Implements ``ninfer.contracts.frontend.Frontend``.

    ``vocab_size`` is the tokenizer's id range unless the model states its own (the embedding may have
    more rows than the tokenizer has tokens). ``eos_token_ids`` come from the resources only.
    """

    def __init__(self, resources: Mapping[str, bytes], *, chat_template: str | None = None,
                 vocab_size: int | None = None, media_limits: MediaLimits | None = None):
        if resources.get("tokenizer.json") is None:
            raise FrontendError("frontend resources lack tokenizer.json")
        self.tokenizer = QwenTokenizer(resources["tokenizer.json"])
        tokenizer_config = _json_resource(resources, "tokenizer_config.json")
        generation_config = _json_resource(resources, "generation_config.json")
        self.template = select_chat_template(resources, tokenizer_config, chat_template)
        self.defaults = GenerationDefaults.from_configs(generation_config, tokenizer_config, self.tokenizer)
        self.vocab_size: int = vocab_size if vocab_size is not None else self.tokenizer.vocab_size
        if self.vocab_size < self.tokenizer.vocab_size:
            raise FrontendError(f"vocab_size {self.vocab_size} is smaller than the tokenizer's "
                                f"{self.tokenizer.vocab_size} ids")
        self.eos_token_ids: tuple[int, ...] = self.defaults.eos_token_ids
        self._detokenizer = IncrementalDetokenizer(self.tokenizer.token_bytes)
        self._grammar: GrammarCompiler | None = None  # built at the first constrained request
        self._grammar_lock = threading.Lock()
        self.media_limits = media_limits  # None: MediaLimits() (imported with the first media item)
        self.vision_tokens = vision_tokens(self.tokenizer.token_to_id)
        self._vision_resources = {r: resources[r] for r in VISION_RESOURCE_ROLES if resources.get(r) is not None}
        self._vision_configs = None   # parsed at the first media item

    @classmethod
    def from_directory(cls, path: str | Path, **kwargs: Any) -> QwenFrontend:
        """The resources as files of a model directory (missing optional files are simply absent)."""
        root = Path(path)
        resources = {role: (root / role).read_bytes() for role in RESOURCE_ROLES if (root / role).is_file()}
        return cls(resources, **kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def prepare_text(self, text: str) -> PreparedPrompt:
        return prepared_text_prompt(self.encode(text), text)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] = (),
                    enable_thinking: bool = True, add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The prompt text ``prepare_chat`` tokenizes (useful for token counting and debugging); each image or
        video appears as its one unexpanded placeholder."""
        marked, _ = extract_media(messages, sources=False)
        return self._render(marked, tools, enable_thinking, add_generation_prompt, template_kwargs)

    def _render(self, messages, tools, enable_thinking, add_generation_prompt, template_kwargs) -> str:
        return self.template.render(**plain_data(template_kwargs), messages=normalize_messages(messages),
                                    tools=plain_data(list(tools)) or None, enable_thinking=enable_thinking,
                                    add_generation_prompt=add_generation_prompt)

    def prepare_chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] = (),
                     enable_thinking: bool = True, add_generation_prompt: bool = True,
                     media_limits: MediaLimits | None = None, **template_kwargs: Any) -> PreparedPrompt:
        """The rendered and tokenized chat prompt. Image and video parts (module docstring) are checked against
        ``media_limits`` (default: the frontend's) and preprocessed here, on the calling thread; a bad one is a
        MediaError (a FrontendError) naming it."""
        marked, parts = extract_media(messages)
        text = self._render(marked, tools, enable_thinking, add_generation_prompt, template_kwargs)
        ids = self.encode(text)
        turn = self.tokenizer.token_to_id(TURN_START)
        if not parts:
            return prepared_text_prompt(ids, text, chat_cache_points(ids, turn))
        if self.vision_tokens is None:
            raise FrontendError(f"the messages carry {len(parts)} image(s)/video(s) but this model's tokenizer has no "
                                f"vision tokens ({', '.join(('<|image_pad|>', '<|video_pad|>', '<|vision_start|>'))}): "
                                f"it takes text only")
        processed = self._preprocess(parts, media_limits or self.media_limits)
        ids, media = expand_media(ids, processed, [p.kind for p in parts], self.vision_tokens, self.encode)
        return PreparedPrompt(token_ids=ids, media=media, thinking_open=ends_inside_thinking(text),
                              cache_points=chat_cache_points(ids, turn))

    def _preprocess(self, parts: Sequence[MediaPart], limits: MediaLimits | None) -> list[Any]:
        from ninfer_qwen3_5.frontend.vision import (
            MediaError,
            MediaLimits,
            ProcessedImage,
            ProcessedVideo,
            preprocess_image,
            preprocess_video,
            vision_configs,
        )

        limits = limits or MediaLimits()
        limits.check_counts(sum(p.kind == "image" for p in parts), sum(p.kind == "video" for p in parts))
        if self._vision_configs is None:
            self._vision_configs = vision_configs(self._vision_resources)
        image_cfg, video_cfg = self._vision_configs
        out = []
        for p in parts:
            try:
                if p.kind == "image":
                    out.append(p.source if isinstance(p.source, ProcessedImage)
                               else preprocess_image(p.source, image_cfg, limits))
                else:
                    out.append(p.source if isinstance(p.source, ProcessedVideo)
                               else preprocess_video(p.source, video_cfg, limits))
            except MediaError as exc:   # a local file is named: one of several --image flags, say
                where = _file_name(p.source)
                if where is not None:
                    exc.args = (f"{where}: {exc}", *exc.args[1:])
                raise
        return out

    def open_session(self, options: OutputOptions) -> QwenOutputSession:
        for token in options.stop_token_ids:
            if not 0 <= int(token) < self.vocab_size:
                raise FrontendError(f"stop token id {token} is outside the vocabulary [0, {self.vocab_size})")
        matcher = self._constraint_matcher(options) if options.constraint is not None else None
        return QwenOutputSession(self._detokenizer, options, self.eos_token_ids, matcher=matcher,
                                 special_token_ids=self.tokenizer.special_token_ids)

    def grammar_compiler(self) -> GrammarCompiler:
        """The constraint compiler of this vocabulary, shared by every request (built once)."""
        with self._grammar_lock:
            if self._grammar is None:
                # Control tokens are never grammar text, but the output markers this frontend parses
                # as text (some vocabularies mark them special) spell their text for the grammar too.
                tb = self.tokenizer.token_bytes
                control = frozenset(i for i in self.tokenizer.special_token_ids if tb[i] not in _OUTPUT_MARKERS)
                try:
                    self._grammar = GrammarCompiler(tb, control, self.vocab_size, self.eos_token_ids,
                                                    source=constraint_ebnf)
                except ImportError as exc:
                    raise InvalidConstraintError(f"constrained decoding needs the xgrammar package: {exc}") from exc
            return self._grammar

    def _constraint_matcher(self, options: OutputOptions) -> ConstraintMatcher:
        """Compile (or reuse) the request's constraint and open its matcher; on the submitting thread.
        The grammar may end where the session would stop on a token: its stop ids, else the model's EOS
        (with ``ignore_eos`` and no stop ids, the grammar's end still needs a token to be sampled)."""
        assert options.constraint is not None
        compiled = self.grammar_compiler().compile(options.constraint, options.tools,
                                                   thinking_open=options.thinking_open)
        stops = tuple(dict.fromkeys(tuple(options.stop_token_ids)
                                    + (() if options.ignore_eos else tuple(self.eos_token_ids))))
        matcher = ConstraintMatcher(compiled, stops or self.eos_token_ids)
        if not matcher.allows_any(self.vocab_size):
            raise InvalidConstraintError(f"the {options.constraint.kind} constraint allows no token at the "
                                         f"start of the output")
        return matcher

    def sampling_defaults(self) -> Mapping[str, Any]:
        return self.defaults.sampling
