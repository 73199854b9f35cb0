"""Pieces of the agent loop alone: the hermes parser, tool answers through chat templates, truncation."""

from __future__ import annotations

import pytest

from verl_async.models.tiny import build_char_tokenizer
from verl_async.rollout.chat_turns import ChatTemplateError, ToolTurnTemplate
from verl_async.rollout.tool_parser import MALFORMED, FunctionCall, tool_parser
from verl_async.rollout.tool_session import truncate_text

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Qwen2.5's way with tool messages: consecutive ones become one user turn of <tool_response> blocks
QWEN_LIKE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
NO_TOOL_ROLE = (
    "{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be system/user/assistant') }}{% endif %}"
    "{{ '[' + message['role'] + '] ' + message['content'] + '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}"
)
DROPS_OTHER_ROLES = (
    "{% for message in messages %}{% if message['role'] in ['user', 'assistant'] %}"
    "{{ '<' + message['role'] + '>' + message['content'] + '</s>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)
NO_SYSTEM = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer(template: str):
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


def appended(template: str, model_turn: str, answers: list[str]) -> tuple[str, str]:
    tok = tokenizer(template)
    t = ToolTurnTemplate(tok)
    return t.role, tok.decode(t.tool_turn_ids(tok.encode(model_turn, add_special_tokens=False), answers))


def test_chatml_tool_role_and_the_missing_newline_after_eos():
    assert appended(CHATML, "x<|im_end|>", ["42"]) == ("tool", "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    # a turn cut by another stop (no EOS): the whole end of the assistant message is added
    assert appended(CHATML, "x</tool_call>", ["42"])[1].startswith("<|im_end|>\n<|im_start|>tool\n")


def test_qwen_style_template_groups_tool_answers_into_a_user_turn():
    role, text = appended(QWEN_LIKE, "x<|im_end|>", ["42", "7"])
    assert role == "tool"
    assert text == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n7\n</tool_response>"
                    "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("template, expected", [
    (NO_TOOL_ROLE, "[user] <tool_response>\n42\n</tool_response>\n<tool_response>\n7\n</tool_response></s>[assistant] "),
    (DROPS_OTHER_ROLES, "<user><tool_response>\n42\n</tool_response>\n<tool_response>\n7\n</tool_response></s><assistant>"),
])
def test_templates_without_a_tool_role_fall_back_to_a_user_message(template, expected):
    assert appended(template, "x</s>", ["42", "7"]) == ("user", expected)


def test_a_template_without_a_system_role_still_works():
    assert appended(NO_SYSTEM, "x<|im_end|>", ["1"])[1] == "\n<|im_start|>tool\n1<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_renders_no_assistant_content_is_refused():
    with pytest.raises(ChatTemplateError, match="cannot render an assistant turn"):
        ToolTurnTemplate(tokenizer("{% for m in messages %}{{ m['role'] }}{% endfor %}"))


def test_hermes_parser():
    parse = tool_parser("hermes").parse
    turn = parse('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
                 '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call> done')
    assert turn.calls == [FunctionCall("add", {"a": 1, "b": 2}), FunctionCall("add", {"a": 5})]
    assert turn.content == "I will add.  done" and turn.malformed == 0
    bad = parse('<tool_call>{"name": "add"}</tool_call><tool_call>not json</tool_call>'
                '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "x", "arguments": {}')
    assert bad.malformed == 4 and [c.name for c in bad.calls] == [MALFORMED] * 4
    assert [c.error.split(";")[0] for c in bad.calls] == [
        "the tool call has no name or no arguments", "the tool call is not valid JSON",
        "the tool call has no name or no arguments", "a <tool_call> block was not closed with </tool_call>"]
    deep = parse("<tool_call>" + "[" * 5000 + "</tool_call>")  # json.loads: RecursionError
    assert deep.malformed == 1 and deep.calls[0].error.startswith("the tool call is nested too deeply")
    assert parse("no calls here").calls == []
    assert parse('<tool_call>{"name": "f", "arguments": "not an object"}</tool_call>').calls == [
        FunctionCall("f", "not an object")]
    with pytest.raises(ValueError, match="format='xml'"):
        tool_parser("xml")


@pytest.mark.parametrize("side, expected", [("left", "(truncated)...789"), ("right", "012...(truncated)"),
                                            ("middle", "0...(truncated)...9")])
def test_truncation_sides_as_verl(side, expected):
    assert truncate_text("0123456789", 3 if side != "middle" else 2, side) == expected
    assert truncate_text("short", 10, side) == "short"
