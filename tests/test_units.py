"""Sizes and durations: parsed as people write them, shown as the flags take them."""

from __future__ import annotations

import pytest

from cache_service.core.units import parse_duration, parse_size, show_duration, show_size

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


def test_values_are_shown_as_the_flags_take_them() -> None:
    assert [show_duration(s) for s in (259200, 7200, 90, 1.5)] == ["3d", "2h", "90s", "1.5s"]
    assert [show_size(n) for n in (10 * 2**30, 3 * 2**29, 4096, 100)] == [
        "10 GiB",
        "1.5 GiB",
        "4 KiB",
        "100 B",
    ]
