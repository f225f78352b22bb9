"""`cache-service`: the command line. Flags override CACHE_SERVICE_* variables, which override
the defaults."""

from __future__ import annotations

import argparse
import copy
import logging
import logging.config
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cache_service import __version__
from cache_service.integrations.demo import add_demo_parser, run_demo_command
from cache_service.service.settings import ENV_PREFIX, Settings, settings_environment
from cache_service.tools.admin import add_admin_parser, run_admin_command
from cache_service.tools.doctor import add_doctor_parser, run_doctor_command
from cache_service.tools.pd_proxy.command import add_pd_proxy_parser, run_pd_proxy_command
from cache_service.tools.replay.arguments import add_replay_parser, run_replay_command
from cache_service.tools.route_cli import add_route_parser, run_route_command

_FLAG_EXAMPLES = {
    "capacity": "20GiB",
    "retention": "agent=3d,chat=7d,batch=2h",
    "model_block_size": "llama-3-8b=16",
    "max_body_size": "512MiB",
    "keep_freed_memory": "1GiB",
}


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        default = field.default
        example = _FLAG_EXAMPLES.get(name)
        help_text = (
            f"{field.description} [env {ENV_PREFIX}{name.upper()}; default {default!s:.40}"
            + (f"; e.g. {example}" if example else "")
            + "]"
        )
        # A true/false setting is also a bare switch: `--access-log` means `--access-log true`.
        switch = {"nargs": "?", "const": "true"} if field.annotation is bool else {}
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=argparse.SUPPRESS,
            metavar=name.upper(),
            help=help_text.replace("%", "%%"),
            **switch,  # type: ignore[arg-type]
        )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="cache-service",
        description="A prefix-aware prompt cache of KV blocks for LLM inference fleets.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the HTTP service on a store (by default the LMDB store in --data-dir)",
        description="Run the HTTP service. Every flag can also be set as an environment "
        f"variable {ENV_PREFIX}<FLAG> (upper case, '_' for '-').",
    )
    _add_settings_flags(serve)
    add_replay_parser(commands)
    add_admin_parser(commands)
    add_doctor_parser(commands)
    add_route_parser(commands)
    add_demo_parser(commands)
    add_pd_proxy_parser(commands)
    return parser


def load_settings(values: dict[str, str]) -> Settings:
    """Settings from flags and environment; exits with a readable message if invalid."""
    try:
        return Settings(**values)  # type: ignore[arg-type]
    except ValidationError as exc:
        lines = [
            f"  --{'-'.join(str(p) for p in err['loc']).replace('_', '-') or 'settings'}: "
            f"{err['msg']}"
            for err in exc.errors()
        ]
        sys.exit("cache-service: invalid configuration:\n" + "\n".join(lines))


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, and the service's own lines (`cache_service`) through its handler."""
    from uvicorn.config import LOG_LEVELS, LOGGING_CONFIG  # noqa: PLC0415

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["cache_service"] = {
        "handlers": ["default"],
        "level": LOG_LEVELS.get(level.lower(), logging.INFO),
        "propagate": False,
    }
    return config


def check_store(settings: Settings) -> None:
    """Open the data folder once before any worker does: exit with the reason if its data was
    made with other settings (a worker's failed start-up would print a traceback instead)."""
    import lmdb  # noqa: PLC0415

    from cache_service.core.errors import NotSupportedByStore, StorageError  # noqa: PLC0415
    from cache_service.service.api.startup import open_store  # noqa: PLC0415

    try:
        open_store(settings.groups).store.close()
    except (StorageError, NotSupportedByStore, lmdb.Error, OSError, ValueError) as exc:
        sys.exit(f"cache-service: {exc}")  # ValueError: a store URL or server refused


def serve(settings: Settings) -> int:
    """Run uvicorn, the app in this process or `--workers` processes sharing one LMDB, until
    a signal; the exit status (0 after a clean stop)."""
    # Imported here so that `--help` and configuration errors answer without loading the app.
    import uvicorn  # noqa: PLC0415

    from cache_service.service.allocator import keep_freed_memory  # noqa: PLC0415
    from cache_service.service.api import create_app  # noqa: PLC0415
    from cache_service.service.api.protocol import (  # noqa: PLC0415
        ENV_NAME as HEADER_LIMIT_ENV,
    )
    from cache_service.service.api.protocol import (  # noqa: PLC0415
        LimitedHttpToolsProtocol,
    )
    from cache_service.service.server import run_single, run_workers  # noqa: PLC0415

    server = settings.groups.server
    logging_config = log_config(server.log_level)
    logging.config.dictConfig(logging_config)  # uvicorn applies it again, in every worker
    check_store(settings)

    # Worker processes (and this one) read the header limit of the HTTP protocol from here.
    os.environ[HEADER_LIMIT_ENV] = str(server.max_header_bytes)
    options = {
        "http": LimitedHttpToolsProtocol,
        "host": server.host,
        "port": server.port,
        "log_level": server.log_level,
        "log_config": logging_config,
        "access_log": server.access_log,
        # Open connections get this long to finish; then the lifespan's stop gives the
        # store calls still running as long again (ServiceLifecycle.stop). A watchdog bounds the
        # whole (service/server.py: exit_bound_seconds).
        "timeout_graceful_shutdown": server.shutdown_timeout,
    }
    if server.workers == 1:
        keep_freed_memory(server.keep_freed_memory)  # workers do it in app_from_environment
        return run_single(uvicorn.Config(create_app(settings), **options))  # type: ignore[arg-type]
    # Workers are new processes: they read the settings back from the environment, and count
    # metrics in files of one folder that /metrics adds up (Prometheus multiprocess mode).
    remove_stale_metrics_folders()
    prefix = f"{METRICS_FOLDER_PREFIX}{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=prefix) as metrics_dir:
        os.environ.update(settings_environment(settings))
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", metrics_dir)
        config = uvicorn.Config(
            "cache_service.service.api.app:app_from_environment",
            factory=True,
            workers=server.workers,
            **options,  # type: ignore[arg-type]
        )
        return run_workers(config)


METRICS_FOLDER_PREFIX = "cache-service-metrics-"


def remove_stale_metrics_folders() -> list[Path]:
    """Remove the metrics folders of `--workers` supervisors that were killed (SIGKILL skips
    their clean-up), named by their PID: a folder is never reused, as its counters would be
    added into a new run's. Returns what it removed."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(METRICS_FOLDER_PREFIX + "*-*"):
        pid = folder.name.removeprefix(METRICS_FOLDER_PREFIX).split("-", 1)[0]
        # Our own PID names no folder of ours yet: one of a previous process with this PID
        # (PID 1 of a restarted container, its /tmp kept) is stale too.
        if pid.isdigit() and (int(pid) == os.getpid() or not _running(int(pid))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `cache-service` console script."""
    parsed = build_parser().parse_args(argv)
    if parsed.command == "replay":
        sys.exit(run_replay_command(parsed))
    if parsed.command == "admin":
        sys.exit(run_admin_command(parsed))
    if parsed.command == "doctor":
        sys.exit(run_doctor_command(parsed))
    if parsed.command == "route":
        sys.exit(run_route_command(parsed))
    if parsed.command == "demo":
        sys.exit(run_demo_command(parsed))
    if parsed.command == "pd-proxy":
        sys.exit(run_pd_proxy_command(parsed))
    args = vars(parsed)
    args.pop("command")
    sys.exit(serve(load_settings(args)))


if __name__ == "__main__":
    main()
