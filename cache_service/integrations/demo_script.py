"""The demo's two conversations, and their prompts as token ids.

`chat_messages` grows a chat one user message a turn, the model's replies kept;
`agent_messages` grows an agent's context one tool call and its result a turn. Each turn's
messages start with the last turn's, so each prompt extends the one before, as a chat or an
agent loop sends them. `Prompter` turns messages into token ids: with a tokenizer, through
its chat template; without one (the tiny seeded model), a stand-in of one id a word.
Plain Python: nothing here loads a model.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

Message = dict[str, str]

CHAT_SYSTEM = """\
You are the assistant of the engineering team at Northwind Freight, a logistics company \
that runs its dispatch and invoicing services in Python. Answer in plain English, briefly, \
and show code only when it helps. Prefer the standard library to new dependencies. When a \
question is ambiguous, say which reading you answer. Never invent APIs: if you are not sure \
that a function exists, say so. The team uses Python 3.11, pytest for tests, ruff for \
linting and mypy in strict mode; services run in containers on Kubernetes, and data lives \
in PostgreSQL. Keep answers under two hundred words unless asked for more."""

CHAT_USERS = (  # one a turn
    "What is the difference between a list and a tuple in Python?",
    "When should I prefer a tuple, then?",
    "How do I sort a list of (name, weight) tuples by weight?",
    "And how do I sort them heaviest first?",
)
CHAT_TURNS = len(CHAT_USERS)

AGENT_SYSTEM = """\
You are a coding agent working in the repository of Northwind Freight's invoice exporter. \
You act through tools; call one tool per turn, as a JSON object on one line: \
{"tool": NAME, "arguments": {...}}. After each result, decide the next step. When you know \
the cause of a problem, explain it and propose a patch as a unified diff.

Tools:
- list_files(path): the files under a folder, with their sizes in bytes.
- search(query, path): lines matching a regular expression, as file:line: text.
- read_file(path, start, end): the lines start..end of a file, numbered.
- run_tests(path): run pytest on a file or folder and return its output."""

AGENT_TASK = (
    "The nightly invoice export failed with KeyError: 'region' at 02:14. Find the cause "
    "and propose a fix."
)

_LISTING = """\
src/exporter/__init__.py 212
src/exporter/cli.py 3 904
src/exporter/config.py 2 117
src/exporter/currency.py 4 482
src/exporter/customers.py 6 035
src/exporter/invoice.py 9 766
src/exporter/pdf.py 12 410
src/exporter/regions.py 1 873
src/exporter/schedule.py 2 660
src/exporter/storage.py 5 129
src/exporter/taxes.py 7 348
src/exporter/templates/invoice.html 8 201
src/exporter/templates/credit_note.html 6 944
tests/test_currency.py 2 311
tests/test_customers.py 3 870
tests/test_invoice.py 7 052
tests/test_regions.py 1 402
tests/test_taxes.py 4 118"""

_SEARCH = """\
src/exporter/customers.py:88:        "region": row["region_code"],
src/exporter/customers.py:131:    # Customers imported before 2024 have no region_code
src/exporter/customers.py:140:        record = {"id": row["id"], "name": row["name"]}
src/exporter/invoice.py:57:    region = customer["region"]
src/exporter/invoice.py:58:    rate = taxes.rate_for(region, invoice_date)
src/exporter/invoice.py:112:    lines.append(format_region(customer["region"]))
src/exporter/regions.py:12:DEFAULT_REGION = "EU-WEST"
src/exporter/regions.py:20:def format_region(region: str) -> str:
src/exporter/taxes.py:44:def rate_for(region: str, on: date) -> Decimal:
src/exporter/taxes.py:51:        raise UnknownRegion(region)
tests/test_invoice.py:33:    customer = {"id": 7, "name": "Acme", "region": "EU-WEST"}
tests/test_regions.py:9:    assert format_region("EU-WEST") == "Europe (West)\""""

_SOURCE = """\
 128 def load_customer(row: Row) -> dict[str, object]:
 129     if row["region_code"] is not None:
 130         return {"id": row["id"], "name": row["name"], "region": row["region_code"]}
 131     # Customers imported before 2024 have no region_code
 132     legacy = LEGACY_REGIONS.get(row["country"])
 133     if legacy is not None:
 134         return {"id": row["id"], "name": row["name"], "region": legacy}
 135     logger.info("customer %s has no region", row["id"])
 136     # Fall through: the caller decides what a customer without a region means.
 137     ...
 140     record = {"id": row["id"], "name": row["name"]}
 141     return record"""

_TESTS = """\
============================= test session starts ==============================
collected 14 items

tests/test_invoice.py ..........F...                                      [100%]

=================================== FAILURES ===================================
________________________ test_invoice_for_legacy_customer ______________________

    def test_invoice_for_legacy_customer(db):
        customer = load_customer(db.row(customer_id=4411))
>       invoice = build_invoice(customer, date(2026, 11, 30))

tests/test_invoice.py:118:
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _
src/exporter/invoice.py:57: in build_invoice
    region = customer["region"]
E   KeyError: 'region'
=========================== short test summary info ============================
FAILED tests/test_invoice.py::test_invoice_for_legacy_customer - KeyError: 'region'
========================= 1 failed, 13 passed in 0.84s ========================="""

# The agent's steps after its first turn: the tool it called and what the tool returned.
AGENT_STEPS = (
    ('{"tool": "list_files", "arguments": {"path": "."}}', _LISTING),
    ('{"tool": "search", "arguments": {"query": "region", "path": "src tests"}}', _SEARCH),
    (
        '{"tool": "read_file", "arguments": {"path": "src/exporter/customers.py", '
        '"start": 128, "end": 141}}',
        _SOURCE,
    ),
    ('{"tool": "run_tests", "arguments": {"path": "tests/test_invoice.py"}}', _TESTS),
)
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
