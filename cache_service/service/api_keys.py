"""API keys: who a request is (a key id, its tenant and its role), from a key file or env.

A key file is TOML and holds only SHA-256 digests of the keys, never the keys themselves::

    [[keys]]
    id = "team-a-writer"      # a public name: shown in logs, usage records and errors
    tenant = "team-a"         # the tenant is part of every namespace the key reaches
    role = "writer"           # reader (lookup, fetch), writer (+ store), admin (+ operators)
    sha256 = "9f86d0..."      # hex SHA-256 of the key, as `cache-service admin new-key` prints
    requests_per_second = 200 # optional quotas, enforced across all worker processes (429)
    bytes_per_second = "1GiB" # request and response bodies together

    [tenants.team-a]
    capacity = "20GiB"        # optional: past it, the tenant evicts its own blocks first

The same entries can come from the environment as `id:tenant:role:sha256` separated by
commas. Keys are random 256-bit secrets, so a plain SHA-256 is the right digest (a slow
password hash protects guessable secrets, and costs every request).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
import secrets
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cache_service.core.hashing import tenant_partition
from cache_service.core.units import parse_size

KEY_PREFIX = "pck_"
QUOTA_FIELDS = ("requests_per_second", "bytes_per_second")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DIGEST_PATTERN = re.compile(r"^[0-9a-f]{64}$")


class Role(enum.IntEnum):
    """What a key may do; each role may do everything the roles below it may."""

    READER = 1  # lookup, fetch, explain, info
    WRITER = 2  # + store, pin within the tenant's pin quota
    ADMIN = 3  # + pin, purge, stats and metrics of every tenant

    @classmethod
    def parse(cls, text: str) -> Role:
        """The role called `text`; ValueError otherwise."""
        try:
            return cls[text.upper()]
        except KeyError:
            known = ", ".join(role.name.lower() for role in cls)
            raise ValueError(f"unknown role {text!r} (known: {known})") from None


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One configured key: its public id, tenant, role and the digest of its secret."""

    id: str
    tenant: str
    role: Role
    sha256: str
    requests_per_second: float | None = None
    bytes_per_second: float | None = None

    @property
    def has_quota(self) -> bool:
        """Whether a rate quota applies to this key."""
        return self.requests_per_second is not None or self.bytes_per_second is not None


class KeyFileError(ValueError):
    """A key file or key list that cannot be used; the message says where and why."""


def digest(presented: str) -> str:
    """The hex SHA-256 a key file keeps for a key."""
    return hashlib.sha256(presented.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A fresh random key (256 bits, URL-safe)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyRing:
    """The configured keys, looked up by the digest of a presented key."""

    def __init__(
        self, keys: Iterable[ApiKey], *, tenant_capacity: Mapping[str, int] | None = None
    ) -> None:
        self.tenant_capacity = dict(tenant_capacity or {})  # tenant -> quota in bytes
        self._by_digest: dict[str, ApiKey] = {}
        partitions: dict[bytes, str] = {}
        ids: set[str] = set()
        for key in keys:
            if key.id in ids:
                raise KeyFileError(f"key id {key.id!r} is configured twice")
            if key.sha256 in self._by_digest:
                raise KeyFileError(f"keys {key.id!r} and {self._by_digest[key.sha256].id!r} "
                                   "have the same digest")  # fmt: skip
            other = partitions.setdefault(tenant_partition(key.tenant), key.tenant)
            if other != key.tenant:  # 2^-64 by chance: refuse rather than share a partition
                raise KeyFileError(f"tenants {other!r} and {key.tenant!r} clash; rename one")
            ids.add(key.id)
            self._by_digest[key.sha256] = key

    def __len__(self) -> int:
        return len(self._by_digest)

    def __iter__(self) -> Iterator[ApiKey]:
        return iter(self._by_digest.values())

    @property
    def tenants(self) -> frozenset[str]:
        """Every tenant some key belongs to."""
        return frozenset(key.tenant for key in self._by_digest.values())

    def authenticate(self, presented: str) -> ApiKey | None:
        """The key whose digest matches `presented`, or None. The digest of a random secret
        says nothing about it, so finding the entry by digest leaks nothing; the final
        comparison is constant-time all the same."""
        wanted = digest(presented)
        found = self._by_digest.get(wanted)
        if found is None or not hmac.compare_digest(found.sha256, wanted):
            return None
        return found


def _entry(raw: Mapping[str, Any], where: str) -> ApiKey:
    unknown = set(raw) - {"id", "tenant", "role", "sha256", *QUOTA_FIELDS}
    if unknown:
        raise KeyFileError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    values = {}
    for field in ("id", "tenant", "role", "sha256"):
        value = raw.get(field)
        if not isinstance(value, str):
            raise KeyFileError(f"{where}: `{field}` is required (a string)")
        values[field] = value
    for field in ("id", "tenant"):
        if not NAME_PATTERN.match(values[field]):
            raise KeyFileError(
                f"{where}: `{field}` must be 1-64 characters of letters, digits, '.', '_' "
                "or '-', starting with a letter or digit"
            )
    if not DIGEST_PATTERN.match(values["sha256"]):
        raise KeyFileError(f"{where}: `sha256` must be 64 lowercase hex characters")
    try:
        role = Role.parse(values["role"])
    except ValueError as exc:
        raise KeyFileError(f"{where}: {exc}") from None
    quotas = {field: _rate(raw.get(field), f"{where}: `{field}`") for field in QUOTA_FIELDS}
    return ApiKey(values["id"], values["tenant"], role, values["sha256"], **quotas)


def _rate(value: Any, where: str) -> float | None:
    """A positive rate: a number, or for bytes a size such as "200MiB"."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = parse_size(value)
        except ValueError as exc:
            raise KeyFileError(f"{where}: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise KeyFileError(f"{where}: must be a positive number")
    return float(value)


def parse_key_file(text: str, *, source: str = "key file") -> list[ApiKey]:
    """The keys of a TOML key file; KeyFileError naming the entry at fault."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KeyFileError(f"{source}: not valid TOML ({exc})") from None
    entries = data.get("keys", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise KeyFileError(f"{source}: `keys` must be an array of tables ([[keys]])")
    return [_entry(entry, f"{source}: keys[{i}]") for i, entry in enumerate(entries)]


def parse_tenant_capacities(text: str, *, source: str = "key file") -> dict[str, int]:
    """The `[tenants.NAME] capacity = "20GiB"` quotas of a key file."""
    data = tomllib.loads(text)
    tenants = data.get("tenants", {})
    if not isinstance(tenants, dict):
        raise KeyFileError(f"{source}: `tenants` must be a table of tables ([tenants.NAME])")
    quotas = {}
    for name, fields in tenants.items():
        where = f"{source}: tenants.{name}"
        if not NAME_PATTERN.match(name):
            raise KeyFileError(f"{where}: not a tenant name")
        if not isinstance(fields, dict) or set(fields) - {"capacity"}:
            raise KeyFileError(f"{where}: the only field is `capacity`")
        if "capacity" in fields:
            capacity = _rate(fields["capacity"], f"{where}: `capacity`")
            assert capacity is not None
            quotas[name] = int(capacity)
    return quotas


def parse_key_list(text: str) -> list[ApiKey]:
    """Keys given as `id:tenant:role:sha256`, comma separated (the environment's form)."""
    keys = []
    for index, item in enumerate(filter(None, (part.strip() for part in text.split(",")))):
        parts = item.split(":")
        if len(parts) != 4:
            raise KeyFileError(f"api_keys[{index}]: use id:tenant:role:sha256")
        fields = dict(zip(("id", "tenant", "role", "sha256"), parts, strict=True))
        keys.append(_entry(fields, f"api_keys[{index}]"))
    return keys


def load_key_ring(path: Path | None, listed: str = "") -> KeyRing:
    """The keys of a key file (if given) and of a key list together."""
    keys = parse_key_list(listed)
    quotas: dict[str, int] = {}
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from None
        keys += parse_key_file(text, source=str(path))
        quotas = parse_tenant_capacities(text, source=str(path))
    return KeyRing(keys, tenant_capacity=quotas)


def key_file_entry(key_id: str, tenant: str, role: Role, presented: str) -> str:
    """The TOML stanza of a key, holding only its digest."""
    return (
        f'[[keys]]\nid = "{key_id}"\ntenant = "{tenant}"\nrole = "{role.name.lower()}"\n'
        f'sha256 = "{digest(presented)}"\n'
    )
