"""The demo's two conversations, and their prompts as token ids.

`chat_messages` grows a chat one user message a turn, the model's replies kept;
`agent_messages` grows an agent's context one tool call and its result a turn. Each turn's
messages start with the last turn's, so each prompt extends the one before, as a chat or an
agent loop sends them. `Prompter` turns messages into token ids: with a tokenizer, through
its chat template; without one (the tiny seeded model), a stand-in of one id a word.
The texts, as long as production traffic's, are in demo_texts.py. Plain Python: nothing
here loads a model.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from cache_service.integrations.demo_texts import (
    AGENT_STEPS,
    AGENT_SYSTEM,
    AGENT_TASK,
    CHAT_SYSTEM,
    CHAT_USERS,
)

Message = dict[str, str]

CHAT_TURNS = len(CHAT_USERS)
AGENT_TURNS = 1 + len(AGENT_STEPS)  # the task, then one a step


def chat_messages(turn: int, replies: Sequence[str]) -> list[Message]:
    """Turn `turn`'s messages (from 1): the system prompt, the users' messages so far and
    the model's replies to the turns before."""
    messages: list[Message] = [{"role": "system", "content": CHAT_SYSTEM}]
    for index, user in enumerate(CHAT_USERS[:turn]):
        if index:
            messages.append({"role": "assistant", "content": replies[index - 1]})
        messages.append({"role": "user", "content": user})
    return messages


def agent_messages(turn: int) -> list[Message]:
    """Turn `turn`'s messages (from 1): the task, then a tool call and its result a turn."""
    messages: list[Message] = [
        {"role": "system", "content": AGENT_SYSTEM},
        {"role": "user", "content": AGENT_TASK},
    ]
    for call, result in AGENT_STEPS[: turn - 1]:
        messages.append({"role": "assistant", "content": call})
        messages.append({"role": "tool", "content": result})
    return messages


# The stand-in's ids 0..3 mark roles, 4 a message's end; words take the others.
_ROLES = {"system": 0, "user": 1, "assistant": 2, "tool": 3}
_END = 4
_RESERVED = 5


class Prompter:
    """Messages to token ids and token ids to text, for one model."""

    def __init__(self, tokenizer: Any, *, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def encode(self, messages: Sequence[Message]) -> list[int]:
        """The prompt that asks the model for the next assistant message."""
        if self.tokenizer is not None:
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True
            )
            # The template writes the special tokens itself.
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        tokens: list[int] = []
        for message in messages:
            tokens.append(_ROLES[message["role"]])
            tokens += [self._word_id(word) for word in message["content"].split()]
            tokens.append(_END)
        return [*tokens, _ROLES["assistant"]]

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of generated tokens (their ids, without a tokenizer)."""
        if self.tokenizer is None:
            return " ".join(str(token) for token in tokens)
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True)).strip()

    def _word_id(self, word: str) -> int:
        # crc32, not hash(): the same word must get the same id in every process.
        return _RESERVED + zlib.crc32(word.encode()) % (self.vocab_size - _RESERVED)
