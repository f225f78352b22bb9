"""Sizes and durations as people write them ('20GiB', '3d') and as we show them back."""

from __future__ import annotations

import re

_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
# Shown with the largest unit that fits: whole units for durations (as --retention takes
# them), binary units for sizes.
_SHOWN_DURATIONS = (("d", 86400), ("h", 3600), ("m", 60))
_SHOWN_SIZES = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def parse_duration(text: str) -> float:
    """Parse '3d', '2h', '30m', '45s' or a plain number of seconds."""
    found = _NUMBER_UNIT.match(text)
    unit = found.group(2).lower() if found else ""
    if not found or unit not in _DURATION_UNITS:
        raise ValueError(f"not a duration: {text!r} (use e.g. 45s, 30m, 2h, 3d)")
    return float(found.group(1)) * _DURATION_UNITS[unit]


def parse_size(text: str) -> int:
    """Parse '20GiB', '512MB', '4096' (bytes) into bytes."""
    found = _NUMBER_UNIT.match(text)
    unit = found.group(2).lower() if found else ""
    if not found or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 20GiB, 10GB)")
    return int(float(found.group(1)) * _SIZE_UNITS[unit])


def show_duration(seconds: float) -> str:
    """'3d', '2h', '90s': the largest unit that divides the duration (as --retention takes it)."""
    for unit, size in _SHOWN_DURATIONS:
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def show_size(size_bytes: int) -> str:
    """'20 GiB', '1.5 GiB', '100 B'."""
    for unit, size in _SHOWN_SIZES:
        if size_bytes >= size:
            return f"{size_bytes / size:.4g} {unit}"
    return f"{size_bytes} B"
