"""Retention classes and the parser of retention tables."""

from __future__ import annotations

import pytest

from cache_service.core.lifetimes import show_retention_table
from cache_service.core.retention import (
    DEFAULT_CLASS,
    DEFAULT_RETENTION,
    RetentionPolicy,
    parse_retention_table,
)

DAY = 86400.0


def test_parse_retention_table_reads_classes_and_ttls() -> None:
    assert parse_retention_table("agent=3d,chat=7d,batch=2h") == {
        "agent": 3 * DAY,
        "chat": 7 * DAY,
        "batch": 7200.0,
    }


def test_parse_retention_table_ignores_blanks_and_empty_items() -> None:
    assert parse_retention_table(" agent = 3d , , chat=7d, ") == {"agent": 3 * DAY, "chat": 7 * DAY}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        (" , ", "empty"),
        ("chat", "not a retention entry"),
        ("=7d", "not a retention entry"),
        ("Chat=7d", "not a retention entry"),
        ("1chat=7d", "not a retention entry"),
        ("chat room=7d", "not a retention entry"),
        ("c" * 33 + "=7d", "not a retention entry"),
        ("chat=", "not a duration"),
        ("chat=7x", "not a duration"),
        ("chat=0", "positive TTL"),
        ("chat=0d", "positive TTL"),
    ],
)
def test_parse_retention_table_rejects_bad_entries(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_retention_table(text)


def test_class_names_may_hold_digits_dashes_and_underscores() -> None:
    assert parse_retention_table("batch_2-x=1h") == {"batch_2-x": 3600.0}


def test_default_policy_is_agent_3d_chat_7d_and_handoff_10m_defaulting_to_chat() -> None:
    policy = RetentionPolicy()
    expected = {"agent": 3 * DAY, "chat": 7 * DAY, "handoff": 600.0}
    assert dict(policy.ttl_seconds) == DEFAULT_RETENTION == expected
    assert policy.default_class == DEFAULT_CLASS == "chat"
    assert policy.classes == ["agent", "chat", "handoff"]


def test_the_default_table_shows_as_the_service_flag_takes_it() -> None:
    assert show_retention_table(DEFAULT_RETENTION) == "agent=3d,chat=7d,handoff=10m"
    assert parse_retention_table(show_retention_table(DEFAULT_RETENTION)) == DEFAULT_RETENTION


def test_resolve_gives_the_default_class_when_none_is_named() -> None:
    assert RetentionPolicy().resolve(None) == ("chat", 7 * DAY)
    assert RetentionPolicy().resolve("agent") == ("agent", 3 * DAY)


def test_resolve_raises_key_error_for_an_unknown_class() -> None:
    with pytest.raises(KeyError):
        RetentionPolicy().resolve("batch")


def test_policy_rejects_a_default_class_not_in_its_table() -> None:
    with pytest.raises(ValueError, match="'batch' is not in the table"):
        RetentionPolicy(ttl_seconds={"chat": DAY}, default_class="batch")


def test_default_policies_do_not_share_their_table() -> None:
    first, second = RetentionPolicy(), RetentionPolicy()
    assert first.ttl_seconds is not second.ttl_seconds
    assert first.ttl_seconds is not DEFAULT_RETENTION


def test_classes_are_sorted() -> None:
    policy = RetentionPolicy(ttl_seconds={"z": 1.0, "a": 2.0, "m": 3.0}, default_class="m")
    assert policy.classes == ["a", "m", "z"]
