"""The near-tie comparison the connector tests hold engines' outputs to."""

from __future__ import annotations

import pytest

from tests.vllm.greedy import parting, partings


def _output(tokens: list[int], *tops: dict[int, float]) -> dict[str, object]:
    return {"tokens": tokens, "top": [{str(k): v for k, v in top.items()} for top in tops]}


def test_equal_tokens_do_not_part() -> None:
    same = _output([1, 2], {1: -0.1, 5: -2.0}, {2: -0.2, 6: -3.0})
    assert parting(same, same) == ""


def test_tokens_parting_where_each_is_among_the_others_most_likely_are_a_near_tie() -> None:
    ours = _output([1, 7, 9], {1: -0.1}, {7: -0.69, 2: -0.70}, {9: -0.1})
    theirs = _output([1, 2, 3], {1: -0.1}, {2: -0.68, 7: -0.71}, {3: -0.1})
    found = parting(ours, theirs)
    assert found.startswith("parted at a near-tie (0.030 nats in the reference) at token 1")
    assert partings([ours, theirs], [ours, theirs]) == []
    assert partings([theirs, ours], [theirs, theirs]) == ["prompt 1: " + found]


def test_a_token_outside_the_others_most_likely_is_a_real_difference() -> None:
    ours = _output([4], {4: -0.01, 2: -6.0})
    theirs = _output([2], {2: -0.01, 3: -5.0})
    with pytest.raises(AssertionError, match="not a near-tie at token 0: 4 against 2"):
        parting(ours, theirs)


def test_outputs_of_other_lengths_differ() -> None:
    with pytest.raises(AssertionError, match="1 tokens against 2"):
        parting(_output([1], {1: 0.0}), _output([1, 2], {1: 0.0}, {2: 0.0}))
