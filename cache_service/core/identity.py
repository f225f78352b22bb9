"""The settings a store's data was made with, recorded in the store, and a rule for each.

A block's key is made from the hash seed, the hashing scheme and the block size of its model:
a process with other values computes other keys, finds none of the stored blocks and fills
the store beside them (the silent 0% hit rate). Those settings must match the record. Others
only steer what is kept: capacity and water marks, retention TTLs (a block keeps the
absolute expiry and the class name it was stored with; no stored class is looked up again)
and the eviction policy (every policy ranks blocks on one scale, the use sequence, so the
eviction index stays ordered; a block is ranked the new way at its next use). They may
change between runs, and each change is logged.

The record is a JSON object of named fields, so a new field is one more entry in `FIELDS`
and one more value in `identity_of`. A field the record lacks (a store made
before the field existed) is adopted from the opening process; a field this build does not
know is kept as it is. The store only keeps the bytes (`store.protocols.IdentityCheck`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cache_service.core.errors import SettingsMismatch, StorageError
from cache_service.core.hashing import HASH_SCHEME, HASH_VERSION, seed_fingerprint
from cache_service.core.units import show_duration, show_size


class Rule(enum.Enum):
    """What a difference between the record and the opening process means."""

    MUST_MATCH = "must match"  # the process is refused
    MAY_CHANGE = "may change"  # the record takes the new value; the change is logged


def _show_table(table: Mapping[str, Any], show_value: Callable[[Any], str] = str) -> str:
    return ",".join(f"{name}={show_value(table[name])}" for name in sorted(table)) or "none"


def _show_retention(table: Mapping[str, float]) -> str:
    return _show_table(table, show_duration)


def _retention_consequence(old: Mapping[str, float], new: Mapping[str, float]) -> str:
    gone = sorted(set(old) - set(new))
    if not gone and all(new[name] == ttl for name, ttl in old.items()):
        return ""  # classes were only added
    said = "blocks stored before keep the expiry they were given"
    return f"{said} (also those of the removed {', '.join(gone)})" if gone else said


def _block_sizes_differ(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether some model is cut into blocks of another size: an override equal to the
    default cuts the same keys as none, and a default that differs is its own field."""
    if "block_size" not in old:
        return bool(old["model_block_size"] != new["model_block_size"])
    overrides = set(old["model_block_size"]) | set(new["model_block_size"])
    return any(
        old["model_block_size"].get(model, old["block_size"])
        != new["model_block_size"].get(model, new["block_size"])
        for model in overrides
    )


def _capacity_consequence(old: int, new: int) -> str:
    return "blocks over it will be evicted" if new < old else ""


_KEYS_DIFFER = "Keys made with other values would find none of its blocks."


def _policy_consequence(old: str, new: str) -> str:
    # Every policy ranks by the use sequence (plus what it grants a block), so the index
    # stays sorted across a change; each block is ranked the new way at its next use.
    return "blocks keep the rank the old policy gave them until their next use"


@dataclass(frozen=True)
class RecordField:
    """One recorded setting: its rule, the flag that sets it, and how it is shown."""

    rule: Rule
    label: str  # the flag, as the operator writes it
    show: Callable[[Any], str] = str
    public: Callable[[Any], str] | None = None  # for log lines, where `show` would tell too much
    consequence: Callable[[Any, Any], str] | None = None  # said after a logged change
    # Whether the stored and the requested record differ in this field (default: unequal).
    differs: Callable[[Mapping[str, Any], Mapping[str, Any]], bool] | None = None

    def differ(self, name: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
        """Whether records `old` and `new` differ in this field (both have it)."""
        return self.differs(old, new) if self.differs else bool(old[name] != new[name])


FIELDS: dict[str, RecordField] = {
    "seed": RecordField(
        Rule.MUST_MATCH,
        "--seed",
        show=repr,
        public=lambda seed: f"(fingerprint {seed_fingerprint(seed)})",
    ),
    "hash_scheme": RecordField(Rule.MUST_MATCH, "hash scheme"),
    "block_size": RecordField(Rule.MUST_MATCH, "--block-size"),
    "model_block_size": RecordField(
        Rule.MUST_MATCH, "--model-block-size", show=_show_table, differs=_block_sizes_differ
    ),
    "retention": RecordField(
        Rule.MAY_CHANGE, "--retention", show=_show_retention, consequence=_retention_consequence
    ),
    "capacity": RecordField(
        Rule.MAY_CHANGE, "--capacity", show=show_size, consequence=_capacity_consequence
    ),
    "high_water": RecordField(Rule.MAY_CHANGE, "--high-water"),
    "low_water": RecordField(Rule.MAY_CHANGE, "--low-water"),
    "eviction_policy": RecordField(
        Rule.MAY_CHANGE, "--eviction-policy", consequence=_policy_consequence
    ),
}


def _decode(stored: bytes, where: str) -> dict[str, Any]:
    try:
        record = json.loads(stored)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise StorageError(f"{where}: the record of its settings is not a JSON object")
    return record


class StoreIdentity:
    """One process's values of the recorded settings, checked against a store's record."""

    def __init__(
        self, values: Mapping[str, Any], *, fields: Mapping[str, RecordField] = FIELDS
    ) -> None:
        unknown = set(values) - set(fields)
        if unknown:
            raise ValueError(f"no rule for recorded settings {sorted(unknown)}")
        self.fields = dict(fields)
        # Compared as the record holds them: JSON turns tuples into lists, int keys into str.
        self.values: dict[str, Any] = json.loads(json.dumps(dict(values)))
        self.notes: list[str] = []  # what the last `settle` changed, for the opener to log

    def settle(self, stored: bytes | None, *, where: str) -> bytes:
        """The record the store at `where` keeps once this process opens it, given the one it
        holds (None: none yet); SettingsMismatch naming each setting that must match and
        does not. What changed since the last run is left in `notes`."""
        record = _decode(stored, where) if stored is not None else {}
        differing = [
            name
            for name, field in self.fields.items()
            if field.rule is Rule.MUST_MATCH
            and name in record
            and name in self.values
            and field.differ(name, record, self.values)
        ]
        if differing:
            raise SettingsMismatch(self._refusal(record, differing, where), settings=differing)
        notes = []
        adopted = [name for name in self.values if name not in record]
        if adopted:
            lead = (
                f"{_place(where)} had no record of the settings that define its data "
                "(a new one, or one made by an earlier version)"
                if stored is None
                else f"{_place(where)} had no record of some settings"
            )
            listed = ", ".join(
                f"{self.fields[name].label} {self._public(name, self.values[name])}"
                for name in adopted
            )
            notes.append(f"{lead}: recorded this process's: {listed}")
        for name, field in self.fields.items():
            if field.rule is Rule.MAY_CHANGE and name in record and name in self.values:
                old, new = record[name], self.values[name]
                if field.differ(name, record, self.values):
                    said = field.consequence(old, new) if field.consequence else ""
                    notes.append(
                        f"{field.label} changed since the last run: "
                        f"{self._public(name, old)} -> {self._public(name, new)}"
                        + (f"; {said}" if said else "")
                    )
        self.notes = notes
        # A field this build does not know (written by a later one) is kept as it is.
        return json.dumps({**record, **self.values}, sort_keys=True).encode()

    def _public(self, name: str, value: Any) -> str:
        field = self.fields[name]
        return (field.public or field.show)(value)

    def _refusal(self, record: Mapping[str, Any], differing: list[str], where: str) -> str:
        lines = [f"the {_place(where)} holds blocks made with other settings:"]
        for name in differing:
            field = self.fields[name]
            lines.append(
                f"  {field.label}: stored {field.show(record[name])}, "
                f"requested {field.show(self.values[name])}"
            )
        build = (
            " (for the hash scheme, a build that computes it)" if "hash_scheme" in differing else ""
        )
        # Every setting that must match makes the keys: one reason covers them all.
        lines.append(
            _KEYS_DIFFER + f" Start with the stored values{build}, or use another --data-dir "
            "for these settings."
        )
        return "\n".join(lines)


def identity_of(
    *,
    seed: str,
    default_block_size: int,
    model_block_sizes: Mapping[str, int],
    retention_ttl_seconds: Mapping[str, float],
    capacity_bytes: int,
    high_water: float,
    low_water: float,
    eviction_policy: str,
) -> StoreIdentity:
    """The identity a process with these settings records in a store it opens."""
    return StoreIdentity(
        {
            "seed": seed,
            "hash_scheme": f"{HASH_SCHEME} v{HASH_VERSION}",
            "block_size": default_block_size,
            "model_block_size": dict(model_block_sizes),
            "retention": {name: float(ttl) for name, ttl in retention_ttl_seconds.items()},
            "capacity": capacity_bytes,
            "high_water": high_water,
            "low_water": low_water,
            "eviction_policy": eviction_policy,
        }
    )


def _place(where: str) -> str:
    """How the messages name a store: a data folder by its path, another store by its URL."""
    return f"store {where}" if "://" in where else f"data folder {where}"
