"""`cache-service admin ...`: operator commands. `new-key` works on a key file; the others
(see admin_http) ask a running service."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cache_service.service.api_keys import (
    NAME_PATTERN,
    KeyFileError,
    KeyRing,
    Role,
    key_file_entry,
    new_key,
    parse_key_file,
)
from cache_service.tools.admin_http import HTTP_ACTIONS, add_http_actions, run_http_action


def add_admin_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `admin` subcommand and its own subcommands."""
    admin = commands.add_parser(
        "admin", help="operator commands: API keys, explain, pin, unpin, pins, purge"
    )
    actions = admin.add_subparsers(dest="admin_command", required=True, metavar="ACTION")
    key = actions.add_parser(
        "new-key",
        help="make an API key: prints the key once, and stores only its digest",
        description="Make a random API key for a tenant and role. The key is printed once on "
        "stdout; the key file gets only its SHA-256 digest.",
    )
    key.add_argument("--id", required=True, help="public name of the key (letters, digits, ._-)")
    key.add_argument("--tenant", required=True, help="the tenant the key acts for")
    key.add_argument(
        "--role", required=True, choices=[role.name.lower() for role in Role], help="what it may do"
    )
    key.add_argument(
        "--append", type=Path, metavar="FILE", help="append the entry to this key file (0600)"
    )
    add_http_actions(actions)


def run_admin_command(args: argparse.Namespace) -> int:
    """Run one admin action; the exit status."""
    if args.admin_command == "new-key":
        return _new_key(args)
    if args.admin_command in HTTP_ACTIONS:
        return run_http_action(args)
    raise AssertionError(args.admin_command)


def _new_key(args: argparse.Namespace) -> int:
    for field in ("id", "tenant"):
        if not NAME_PATTERN.match(getattr(args, field)):
            print(f"cache-service admin: --{field} must be 1-64 letters, digits, '.', '_' or "
                  "'-', starting with a letter or digit", file=sys.stderr)  # fmt: skip
            return 2
    secret = new_key()
    entry = key_file_entry(args.id, args.tenant, Role.parse(args.role), secret)
    if args.append is None:
        print(secret)
        print("# add to the key file (it holds only the digest):\n" + entry, file=sys.stderr)
        return 0
    existing = args.append.read_text(encoding="utf-8") if args.append.exists() else ""
    try:  # the file as it would be: a duplicate id or a broken file changes nothing
        KeyRing(parse_key_file(existing + "\n" + entry, source=str(args.append)))
    except KeyFileError as exc:
        print(f"cache-service admin: {exc}", file=sys.stderr)
        return 2
    descriptor = os.open(args.append, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(descriptor, "a", encoding="utf-8") as handle:
        handle.write(("\n" if existing and not existing.endswith("\n\n") else "") + entry)
    print(secret)
    print(f"# appended key {args.id!r} ({args.role} of tenant {args.tenant!r}) to {args.append}; "
          "restart the service to load it", file=sys.stderr)  # fmt: skip
    return 0
