"""Greedy outputs compared the way vLLM's own tests compare them (`check_logprobs_close`).

bf16 kernels round by shape and, on a CPU, by how the work is split among threads: two
engines computing the same prompt may then part at a near-tie of the two most likely tokens,
and from there on their greedy tokens differ. So two outputs are "the same" when their tokens
are equal, or when, at the first token where they part, each one's token is among the other's
`TOP` most likely ones (a near-tie); anything else is a real difference. Engines are asked for
`logprobs=TOP` (bench/vllm_engine.py's "top", the OpenAI server's `top_logprobs`).
"""

from __future__ import annotations

from typing import Any

TOP = 5


def parting(output: dict[str, Any], reference: dict[str, Any]) -> str:
    """Where `output` parts from `reference` at a near-tie ("" when equal); AssertionError
    when they differ otherwise."""
    tokens, expected = output["tokens"], reference["tokens"]
    assert len(tokens) == len(expected), f"{len(tokens)} tokens against {len(expected)}"
    for index, (token, wanted) in enumerate(zip(tokens, expected, strict=True)):
        if token == wanted:
            continue
        ours, theirs = output["top"][index], reference["top"][index]
        detail = (
            f"token {index}: {token} against {wanted}; "
            f"top {TOP} here {_ranked(ours)}, in the reference {_ranked(theirs)}"
        )
        assert str(wanted) in ours and str(token) in theirs, f"not a near-tie at {detail}"
        gap = theirs[str(wanted)] - theirs[str(token)]
        return f"parted at a near-tie ({gap:.3f} nats in the reference) at {detail}"
    return ""


def partings(outputs: list[dict[str, Any]], references: list[dict[str, Any]]) -> list[str]:
    """`parting` of each output from its reference, for the outputs that part at all."""
    assert len(outputs) == len(references)
    found = [
        parting(output, reference) for output, reference in zip(outputs, references, strict=True)
    ]
    return [f"prompt {index}: {text}" for index, text in enumerate(found) if text]


def _ranked(top: dict[str, float]) -> str:
    return ", ".join(
        f"{token}={logprob:.3f}"
        for token, logprob in sorted(top.items(), key=lambda item: -item[1])
    )
