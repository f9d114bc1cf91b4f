"""Prompt rendering: our template through our sandbox vs transformers' apply_chat_template (same template,
same tokenizer), and the Qwen3.5 semantics the template must have."""

from __future__ import annotations

import copy
import json

import pytest
from ninfer_qwen3_5.frontend import ChatTemplateError, QwenFrontend
from ninfer_qwen3_5.frontend.chat_template import ChatTemplate, bundled_template_source
from ninfer_qwen3_5.frontend.frontend import select_chat_template

from .conftest import IM_START

TEMPLATE = bundled_template_source()

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK_TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}

SYSTEM = [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Hi"}]
MULTI_TURN = [
    {"role": "system", "content": "Answer in French."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Bonjour !"},
    {"role": "user", "content": [{"type": "text", "text": "Et "}, {"type": "text", "text": "toi ? 你好 🇫🇷"}]},
]
REASONING_HISTORY = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "\nsimple sum\n"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"},
]
TOOL_ROUND = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris and Oslo for 3 days, and the time?"},
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need weather twice and the clock.",
     "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
         {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": {"city": "Oslo", "opts": {"unit": "C"}, "ok": True}}},
         {"id": "c3", "type": "function", "function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21C"},
    {"role": "tool", "tool_call_id": "c2", "content": "Rain\nline two"},
    {"role": "tool", "tool_call_id": "c3", "content": "12:00"},
    {"role": "assistant", "content": "Paris is sunny, Oslo rainy; it is noon.", "reasoning_content": "summarize"},
    {"role": "user", "content": "Thanks"},
]

CASES = {
    "system": (SYSTEM, [], {}),
    "multi_turn": (MULTI_TURN, [], {}),
    "reasoning_history": (REASONING_HISTORY, [], {}),
    "tools_only_system": ([{"role": "user", "content": "time?"}], [CLOCK_TOOL], {}),
    "tool_round": (TOOL_ROUND, [WEATHER_TOOL, CLOCK_TOOL], {}),
    "thinking_off": (MULTI_TURN, [], {"enable_thinking": False}),
    "tool_round_thinking_off": (TOOL_ROUND, [WEATHER_TOOL, CLOCK_TOOL], {"enable_thinking": False}),
    "no_generation_prompt": (REASONING_HISTORY, [], {"add_generation_prompt": False}),
    "preserve_thinking": (TOOL_ROUND, [WEATHER_TOOL], {"preserve_thinking": True}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers(frontend: QwenFrontend, hf_tokenizer, name: str):
    messages, tools, kwargs = CASES[name]
    kwargs = {"enable_thinking": True, "add_generation_prompt": True, **kwargs}
    before = copy.deepcopy(messages)
    ours_text = frontend.render_chat(messages, tools=tools, **kwargs)
    ours = frontend.prepare_chat(messages, tools=tools, **kwargs)
    hf_text = hf_tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=TEMPLATE,
                                               tokenize=False, **kwargs)
    hf_ids = hf_tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=TEMPLATE,
                                              tokenize=True, return_dict=False, **kwargs)
    assert ours_text == hf_text
    assert list(ours.token_ids) == list(hf_ids)
    assert messages == before  # rendering never edits the caller's messages


def test_generation_prompt_thinking_on_and_off(frontend: QwenFrontend):
    on = frontend.render_chat(SYSTEM)
    off = frontend.render_chat(SYSTEM, enable_thinking=False)
    assert on == "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                 "<|im_start|>assistant\n<think>\n"
    assert off == on + "\n</think>\n\n"
    assert frontend.prepare_chat(SYSTEM).thinking_open
    assert not frontend.prepare_chat(SYSTEM, enable_thinking=False).thinking_open
    assert not frontend.prepare_chat(SYSTEM, add_generation_prompt=False).thinking_open
    assert frontend.render_chat(SYSTEM, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_reasoning_only_after_last_user_query(frontend: QwenFrontend):
    text = frontend.render_chat(REASONING_HISTORY, add_generation_prompt=False)
    assert "simple sum" not in text  # before the last query: dropped
    assert "<|im_start|>assistant\n4<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nadd again\n</think>\n\n6<|im_end|>" in text
    kept = frontend.render_chat(REASONING_HISTORY, add_generation_prompt=False, preserve_thinking=True)
    assert "<think>\nsimple sum\n</think>\n\n4" in kept


def test_tool_turns(frontend: QwenFrontend):
    text = frontend.render_chat(TOOL_ROUND[:-2], tools=[WEATHER_TOOL, CLOCK_TOOL])
    system = text[: text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nUse tools when useful.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n" + json.dumps(CLOCK_TOOL) + "\n</tools>" \
        in system
    assert "<tool_call>\n<function=example_function>\n<parameter=example_parameter>\n" in system
    # The tool round's assistant turn is after the last user query: reasoning kept, calls in XML,
    # non-string arguments as JSON, consecutive calls separated by one newline.
    assert ("<|im_start|>assistant\n<think>\nNeed weather twice and the clock.\n</think>\n\nLet me check.\n\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
            "</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n<parameter=ok>\ntrue\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call><|im_end|>\n") in text
    # Consecutive tool results share one user turn.
    assert ("<|im_start|>user\n<tool_response>\nSunny, 21C\n</tool_response>\n<tool_response>\nRain\nline two\n"
            "</tool_response>\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
            ) == text[text.index("<|im_start|>user\n<tool_response>"):]


def test_tool_response_turn_is_not_a_user_query(frontend: QwenFrontend):
    """Reasoning of the assistant turn that made the calls survives the tool results after it."""
    text = frontend.render_chat(TOOL_ROUND[:-1], tools=[WEATHER_TOOL])
    assert "<think>\nNeed weather twice and the clock.\n</think>" in text
    assert "<think>\nsummarize\n</think>\n\nParis is sunny" in text
    after_thanks = frontend.render_chat(TOOL_ROUND, tools=[WEATHER_TOOL])
    assert "Need weather twice" not in after_thanks and "summarize" not in after_thanks


def test_openai_wire_forms(frontend: QwenFrontend):
    """JSON-string arguments and reasoning aliases render like their structured forms."""
    structured = [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": "", "reasoning_content": "r",
                   "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": "x"}}}]}]
    wire = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "reasoning": "r",
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": "x"}'}}]}]
    assert frontend.render_chat(wire) == frontend.render_chat(structured)
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        frontend.render_chat([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])


def test_media_parts(frontend: QwenFrontend):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                            {"type": "video"}, {"type": "image_url", "image_url": {"url": "x"}}]}]
    text = frontend.render_chat(messages, add_vision_id=True)
    assert text.startswith("<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>andVideo 1: "
                           "<|vision_start|><|video_pad|><|vision_end|>Picture 2: <|vision_start|><|image_pad|>")


def test_template_errors_are_request_errors(frontend: QwenFrontend):
    with pytest.raises(ChatTemplateError, match="unexpected message role: robot"):
        frontend.render_chat([{"role": "robot", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        frontend.render_chat([{"role": "user", "content": {"not": "a list"}}])


def test_prepared_prompt_positions(frontend: QwenFrontend):
    prompt = frontend.prepare_chat(SYSTEM)
    assert prompt.token_ids[0] == IM_START
    rows = prompt.positions
    assert len(rows) == 3 and rows[0] == rows[1] == rows[2] == tuple(range(len(prompt.token_ids)))
    raw = frontend.prepare_text("Question: why?\n<think>\n")
    assert raw.thinking_open and raw.token_ids == tuple(frontend.encode("Question: why?\n<think>\n"))
    assert not frontend.prepare_text("<think>x</think> done").thinking_open


def test_template_precedence():
    user = [{"role": "user", "content": "a"}]
    custom = "{{- 'CUSTOM:' ~ messages[0].content -}}"
    in_file = {"chat_template.jinja": b"{{- 'FILE:' ~ messages | length -}}"}
    in_config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "CONFIG"}]}
    assert select_chat_template(in_file, in_config, custom).render(messages=user) == "CUSTOM:a"
    assert select_chat_template(in_file, in_config, None).render(messages=user) == "FILE:1"
    assert select_chat_template({}, in_config, None).render(messages=user) == "CONFIG"
    assert select_chat_template({}, {"chat_template": "STR"}, None).render(messages=user) == "STR"
    assert select_chat_template({}, None, None).source == TEMPLATE


def test_sandbox_blocks_attribute_escape():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(messages=[])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% if %}")


@pytest.mark.parametrize("source, why", [("{{ 1/0 }}", "ZeroDivisionError"),
                                         ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
                                         ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError")])
def test_a_template_that_fails_is_a_chat_template_error(source, why):
    """An artifact's template may be anything: its own failures are ChatTemplateErrors naming them, never a crash."""
    from ninfer_qwen3_5.frontend.chat_template import ChatTemplate, ChatTemplateError

    with pytest.raises(ChatTemplateError, match=why):
        ChatTemplate(source, origin="test template").render(messages=[])


@pytest.mark.parametrize("source, why", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "budget of 200,000 steps"),
    ("{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}",
     "budget of 200,000 steps"),
    ("{{ 'a' * 10**9 }}", "over the sandbox's 1,000,000"),
    ("{{ [0] * 10**8 }}", "over the sandbox's 1,000,000"),
    ("{{ 3 ** 100000000 }}", "integer power over 10,000 digits"),
    # a recursive loop's inner levels count too (loop(x) hands x to the loop directly)
    ("{% for x in [0] recursive %}{% if loop.depth < 4 %}{{ loop(range(100000)) }}{% endif %}{% endfor %}",
     "budget of 200,000 steps"),
    # the guard is a filter: a template variable of its name cannot switch it off
    ("{% set ninfer_loop_guard = {}.fromkeys %}{% set r = range(3000) %}{% for i in r %}{% for j in r %}{% endfor %}"
     "{% endfor %}", "budget of 200,000 steps"),
    ("{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "sum of 524288 \\+ 524288 items"),
    ("{% set ns = namespace(x=10**4000) %}{% for i in range(14) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     "integer product over 10,000 digits"),
    ("{{ ((10**4000)**2)**2 }}", "integer power over 10,000 digits"),
    ("{% for i in range(100) %}{{ 'a' * 999999 }}{% endfor %}", "output ran past 67,108,864 characters"),
    ("{{ lipsum(10**8) }}", "'lipsum' is undefined"),
])
def test_a_template_that_would_run_for_hours_stops_with_a_chat_template_error(source, why):
    """The sandbox stops escapes, not work: each render has a step budget (loop iterations and calls) and bounded
    ``*`` / ``**``; past them the render ends with a ChatTemplateError naming the budget (in about a second)."""
    from ninfer_qwen3_5.frontend.chat_template import ChatTemplate, ChatTemplateError

    with pytest.raises(ChatTemplateError, match=why):
        ChatTemplate(source, origin="test template").render(messages=[])


def test_budgeted_loops_keep_their_semantics():
    """Loops run through the budget's guard: loop.index/length/last, else, recursive loops and loop controls are
    unchanged, small products and powers too, and the budget is per render (many renders never add up)."""
    from ninfer_qwen3_5.frontend.chat_template import RENDER_STEPS, ChatTemplate

    cases = {
        "{% for x in [1,2,3] %}{{ loop.index }}/{{ loop.length }}{% if loop.last %}!{% endif %}{% endfor %}":
            "1/32/33/3!",
        "{% for x in [] %}{{ x }}{% else %}empty{% endfor %}": "empty",
        "{% for x in [[1,[2]],[3]] recursive %}[{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %}]"
        "{% endfor %}": "[[1][[2]]][[3]]",
        "{% for x in range(9) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}"
        "{% endfor %}": "013",
        "{{ 'ab' * 3 }} {{ 2 ** 10 }} {{ 3 * 4 }} {{ [1] * 2 }}": "ababab 1024 12 [1, 1]",
        "{{ (2 ** 20000) % 7 }} {{ 1.0000001 ** 100000000 > 22026 }} {{ (1e308 * 10) ** 2 }}": "4 True inf",
        "{% set s = 'a' * 999999 %}{{ (s * 1)|length }} {{ (s + 'b')|length }}": "999999 1000000",
        "{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}{% for x in range(5) if x % 2 %}{{ x }}"
        "{% endfor %}": "a=113",
    }
    for source, want in cases.items():
        assert ChatTemplate(source).render(messages=[]) == want, source
    n = (RENDER_STEPS * 9 // 10) // 2                  # 90% of the budget in two loops (the sandbox caps a range)
    near = ChatTemplate("{% for i in range(2) %}{% for j in range(" + str(n) + ") %}{% endfor %}{% endfor %}ok")
    for _ in range(3):
        assert near.render(messages=[]) == "ok"
