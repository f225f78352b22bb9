"""Retention classes and the parsers of durations, sizes and retention tables."""

from __future__ import annotations

import pytest

from cache_service.retention import (
    DEFAULT_CLASS,
    DEFAULT_RETENTION,
    RetentionPolicy,
    parse_duration,
    parse_retention_table,
    parse_size,
)

DAY = 86400.0


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("45s", 45.0),
        ("30m", 1800.0),
        ("2h", 7200.0),
        ("3d", 3 * DAY),
        ("1w", 7 * DAY),
        ("90", 90.0),
        ("0", 0.0),
        ("1.5h", 5400.0),
        (" 7d ", 7 * DAY),
        ("7 d", 7 * DAY),
        ("3D", 3 * DAY),
    ],
)
def test_parse_duration_reads_number_and_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["", "d", "3x", "-1d", "3dd", "1e3", "three days", "3 d 2h", "inf"]
)
def test_parse_duration_rejects_anything_else(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("10b", 10),
        ("1kb", 1000),
        ("512MB", 512 * 10**6),
        ("10GB", 10 * 10**9),
        ("1TB", 10**12),
        ("1KiB", 1024),
        ("512MiB", 512 * 2**20),
        ("20GiB", 20 * 2**30),
        ("2TiB", 2 * 2**40),
        ("1.5KiB", 1536),
        (" 1 GiB ", 2**30),
    ],
)
def test_parse_size_reads_number_and_unit(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "10XB", "-1", "1 G i B", "ten", "10GiBs"])
def test_parse_size_rejects_anything_else(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


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


def test_default_policy_is_agent_3d_and_chat_7d_defaulting_to_chat() -> None:
    policy = RetentionPolicy()
    assert dict(policy.ttl_seconds) == {"agent": 3 * DAY, "chat": 7 * DAY}
    assert DEFAULT_RETENTION == {"agent": 3 * DAY, "chat": 7 * DAY}
    assert policy.default_class == DEFAULT_CLASS == "chat"
    assert policy.classes == ["agent", "chat"]


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
