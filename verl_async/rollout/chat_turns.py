"""Tool answers as tokens, through the model's own chat template.

Between two model turns the loop appends (all with loss mask 0):

1. the rest of the template's end of an assistant message the model did not generate
   (ChatML writes `<|im_end|>\\n`; the model stops at `<|im_end|>`, so `\\n` is added);
2. the tool messages, rendered by the chat template;
3. the template's generation prompt (`<|im_start|>assistant\\n`).

2 and 3 are the text the template adds when the tool messages and the generation prompt
follow an assistant message, cut from a render of a fixed synthetic conversation
(`system`, `user`, `assistant`) with and without them; the tokens are the tokenizer's for
that text. So nothing the model generated is ever re-tokenised.

Fallback: a template that has no tool role (it raises on `role: tool`, or drops the
message's content) gets the answers as ONE user message, each wrapped as Qwen's template
does, `<tool_response>\\n...\\n</tool_response>`. A template that renders neither is refused
when the loop is built.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

_MARK = "\u2063VERL_ASYNC_TURN_MARK\u2063"
_PROBE = "\u2063VERL_ASYNC_TOOL_PROBE\u2063"
_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
_USER = {"role": "user", "content": "Question."}


class ChatTemplateError(ValueError):
    """The model's chat template cannot render a tool answer after an assistant turn."""


class ToolTurnTemplate:
    """Renders tool answers between model turns (see the module docstring)."""

    def __init__(self, tokenizer: Any, tools: Optional[Sequence[dict]] = None) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.base, self.base_text = self._base_conversation()
        self.turn_end_ids = self._turn_end_ids()
        self.role = "tool" if self._renders([{"role": "tool", "content": _PROBE}]) else "user"
        if self.role == "user":
            if not self._renders([self._user_message([_PROBE])]):
                raise ChatTemplateError("the chat template renders neither a tool nor a user message after an "
                                        "assistant turn; set actor_rollout_ref.model.custom_chat_template")
            logger.warning("the chat template has no tool role: tool answers go back as a user message "
                           "(<tool_response>...</tool_response>)")

    # ------------------------------------------------------------------ rendering
    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        kwargs = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)

    def _base_conversation(self) -> tuple[list[dict], str]:
        """A conversation ending in an assistant turn, rendered: with a system message if the template allows one."""
        assistant = {"role": "assistant", "content": _MARK}
        errors = []
        for base in ([_SYSTEM, _USER, assistant], [_USER, assistant]):
            try:
                text = self._render(base, generation_prompt=False)
            except Exception as exc:  # noqa: BLE001 - jinja's TemplateError and what templates raise
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            if _MARK in text:
                return base, text
            errors.append("the assistant message's content is not in the rendered text")
        raise ChatTemplateError(f"the chat template cannot render an assistant turn ({'; '.join(errors)})")

    def _turn_end_ids(self) -> list[int]:
        tail = self.base_text[self.base_text.rindex(_MARK) + len(_MARK):]
        return list(self.tokenizer.encode(tail, add_special_tokens=False)) if tail else []

    def _delta(self, messages: list[dict]) -> str:
        """The text `messages` and the generation prompt add after the base conversation."""
        full = self._render(self.base + messages, generation_prompt=True)
        if not full.startswith(self.base_text):
            raise ChatTemplateError("the chat template re-renders earlier turns when a message is appended")
        return full[len(self.base_text):]

    def _renders(self, messages: list[dict]) -> bool:
        try:
            return _PROBE in self._delta(messages)
        except Exception:  # noqa: BLE001 - a template that raises on the role does not have it
            return False

    @staticmethod
    def _user_message(texts: Sequence[str]) -> dict:
        return {"role": "user", "content": "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in texts)}

    # ------------------------------------------------------------------ the loop's calls
    def messages(self, texts: Sequence[str]) -> list[dict]:
        if self.role == "tool":
            return [{"role": "tool", "content": t} for t in texts]
        return [self._user_message(texts)]

    def missing_turn_end(self, model_turn: Sequence[int]) -> list[int]:
        """The part of the template's end-of-assistant-message the model turn did not end with."""
        end = self.turn_end_ids
        for k in range(min(len(end), len(model_turn)), 0, -1):
            if list(model_turn[-k:]) == end[:k]:
                return end[k:]
        return list(end)

    def tool_turn_ids(self, model_turn: Sequence[int], texts: Sequence[str]) -> list[int]:
        """Tokens to append after a model turn: its missing end, the tool answers, the generation prompt."""
        delta = self._delta(self.messages(texts))
        return self.missing_turn_end(model_turn) + list(self.tokenizer.encode(delta, add_special_tokens=False))
