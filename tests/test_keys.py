"""API keys: the key file, the environment's key list, and authentication."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cache_service.service.api_keys import (
    KeyFileError,
    KeyRing,
    Role,
    digest,
    key_file_entry,
    load_key_ring,
    new_key,
    parse_key_file,
    parse_key_list,
)


def test_a_new_key_round_trips_through_its_key_file_entry() -> None:
    secret = new_key()
    ring = KeyRing(parse_key_file(key_file_entry("a-writer", "team-a", Role.WRITER, secret)))
    found = ring.authenticate(secret)
    assert found is not None
    assert (found.id, found.tenant, found.role) == ("a-writer", "team-a", Role.WRITER)
    assert ring.authenticate(secret + "x") is None
    assert ring.authenticate("") is None


def test_the_key_file_holds_only_a_digest_of_the_key() -> None:
    secret = new_key()
    entry = key_file_entry("k", "t", Role.READER, secret)
    assert secret not in entry
    assert digest(secret) in entry


def test_roles_are_ordered_reader_writer_admin() -> None:
    assert Role.READER < Role.WRITER < Role.ADMIN
    assert Role.parse("Writer") is Role.WRITER
    with pytest.raises(ValueError, match="known: reader, writer, admin"):
        Role.parse("owner")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys = 3", "array of tables"),
        ("[[keys]]\nid = 'k'\ntenant = 't'\nrole = 'reader'", r"keys\[0\]: `sha256` is required"),
        (
            "[[keys]]\nid = 'k'\ntenant = 't'\nrole = 'god'\nsha256 = '" + "a" * 64 + "'",
            r"keys\[0\]: unknown role 'god'",
        ),
        (
            "[[keys]]\nid = 'k'\ntenant = 't t'\nrole = 'reader'\nsha256 = '" + "a" * 64 + "'",
            r"keys\[0\]: `tenant` must be",
        ),
        ("[[keys]]\nid = 'k'\ntenant = 't'\nrole = 'reader'\nsha256 = 'abc'", "64 lowercase hex"),
        ("[[keys]]\nid = 'k'\nsecret = 'x'", "unknown field"),
        ("[[keys]\n", "not valid TOML"),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_entry(text: str, message: str) -> None:
    with pytest.raises(KeyFileError, match=message):
        parse_key_file(text)


def test_two_keys_with_one_id_or_one_digest_are_refused() -> None:
    same_id = parse_key_list(f"k:a:reader:{'a' * 64},k:b:reader:{'b' * 64}")
    with pytest.raises(KeyFileError, match="configured twice"):
        KeyRing(same_id)
    same_digest = parse_key_list(f"k1:a:reader:{'a' * 64},k2:b:reader:{'a' * 64}")
    with pytest.raises(KeyFileError, match="same digest"):
        KeyRing(same_digest)


def test_the_key_list_form_of_the_environment() -> None:
    keys = parse_key_list(f" r:team-a:reader:{'c' * 64} , w:team-b:admin:{'d' * 64}")
    assert [(k.id, k.tenant, k.role) for k in keys] == [
        ("r", "team-a", Role.READER),
        ("w", "team-b", Role.ADMIN),
    ]
    with pytest.raises(KeyFileError, match=r"api_keys\[0\]: use id:tenant:role:sha256"):
        parse_key_list("only:three:parts")


def test_a_key_ring_joins_the_file_and_the_list(tmp_path: Path) -> None:
    first, second = new_key(), new_key()
    path = tmp_path / "keys.toml"
    path.write_text(key_file_entry("f", "a", Role.READER, first))
    ring = load_key_ring(path, f"l:b:writer:{digest(second)}")
    assert len(ring) == 2
    assert ring.tenants == {"a", "b"}
    assert ring.authenticate(second) is not None
    with pytest.raises(KeyFileError, match="cannot read key file"):
        load_key_ring(tmp_path / "missing.toml")


def test_admin_new_key_appends_only_a_digest_and_refuses_a_duplicate(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    command = [sys.executable, "-m", "cache_service.cli", "admin", "new-key"]
    args = ["--id", "a-writer", "--tenant", "team-a", "--role", "writer", "--append", str(path)]
    made = subprocess.run([*command, *args], capture_output=True, text=True, check=True)
    secret = made.stdout.strip()
    assert secret.startswith("pck_")
    assert secret not in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600
    found = load_key_ring(path).authenticate(secret)
    assert found is not None
    assert found.role is Role.WRITER
    again = subprocess.run([*command, *args], capture_output=True, text=True, check=False)
    assert again.returncode == 2
    assert "configured twice" in again.stderr
    assert len(load_key_ring(path)) == 1


def test_tenant_capacities_come_from_the_key_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(
        key_file_entry("k", "team-a", Role.WRITER, new_key())
        + '\n[tenants.team-a]\ncapacity = "2GiB"\n\n[tenants.team-b]\ncapacity = 1000\n'
    )
    assert load_key_ring(path).tenant_capacity == {"team-a": 2 * 2**30, "team-b": 1000}
    path.write_text('[tenants.team-a]\nsize = "2GiB"\n')
    with pytest.raises(KeyFileError, match="the only field is `capacity`"):
        load_key_ring(path)
