"""The live stack of tests/deploy: the service, a real Prometheus with our rules, and traffic.

The service runs with API keys of two tenants (so per-tenant series exist), two retention
classes and its metrics port, which Prometheus scrapes every second without a key. Prometheus
first scrapes the counters at zero, then the traffic runs, then the stack waits until
Prometheus holds the service's final counts and has evaluated its rules on them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cache_service.client import CacheClient, Usage
from cache_service.core.errors import ServiceError
from tests.deploy.prometheus_process import PrometheusProcess, Series, wait_for_rules_after_scrape
from tests.integration.conftest import ServerProcess, free_port

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules"
BLOCK = 4
MODEL = "m"
# Key id -> (tenant, role); team-a and team-b send traffic, ops reads the stats.
KEY_ROLES = {"a": ("team-a", "writer"), "b": ("team-b", "writer"), "ops": ("operators", "admin")}
SCRAPE_WAIT_SECONDS = 30.0


@dataclass
class LiveStack:
    """What the tests read: both processes, the keys, and what the service reported."""

    service: ServerProcess
    prometheus: PrometheusProcess
    secrets: dict[str, str]
    stats: dict[str, Any]  # /v1/stats (admin) once the traffic was done
    usage: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # the answers' sums

    def query(self, expr: str, *, at: float | None = None) -> Series:
        """An instant query against the stack's Prometheus (now, or at Unix time `at`)."""
        return self.prometheus.query(expr, at=at)


def write_keys(path: Path) -> dict[str, str]:
    """A key file of KEY_ROLES at `path`; the secrets by key id."""
    from cache_service.service.api_keys import Role, key_file_entry, new_key  # noqa: PLC0415

    secrets = {key_id: new_key() for key_id in KEY_ROLES}
    entries = [
        key_file_entry(key_id, tenant, Role.parse(role), secrets[key_id])
        for key_id, (tenant, role) in KEY_ROLES.items()
    ]
    path.write_text("\n".join(entries))
    return secrets


def tokens(first: int, count: int) -> list[int]:
    """`count` tokens from `first` on: distinct prompts for distinct ranges."""
    return list(range(first, first + count))


def drive_traffic(stack: LiveStack) -> None:
    """Stores and lookups with known hits and misses in two classes for two tenants, and a
    few 4xx answers; the hit and miss tokens the answers report are summed in stack.usage."""

    def counted(tenant: str, retention: str, usage: Usage) -> None:
        sums = stack.usage.setdefault((tenant, retention), [0, 0])
        sums[0] += usage.prompt_cache_hit_tokens
        sums[1] += usage.prompt_cache_miss_tokens

    payload = b"k" * 1024
    for key_id, first in (("a", 0), ("b", 10_000)):
        tenant = KEY_ROLES[key_id][0]
        with CacheClient(stack.service.url, api_key=stack.secrets[key_id]) as client:
            chat, agent = tokens(first, 4 * BLOCK), tokens(first + 500, 2 * BLOCK)
            # chat: a miss, a store, then a longer prompt that hits the stored prefix.
            counted(tenant, "chat", client.lookup(MODEL, chat, retention="chat").usage)
            client.store(MODEL, chat, [payload] * 4, retention="chat")
            longer = chat + tokens(first + 900, 2 * BLOCK)
            counted(tenant, "chat", client.lookup(MODEL, longer, retention="chat").usage)
            if key_id == "a":  # agent for team-a only: its classes' ratios differ
                client.store(MODEL, agent, [payload] * 2, retention="agent")
                counted(tenant, "agent", client.lookup(MODEL, agent, retention="agent").usage)
                other = tokens(first + 700, BLOCK)
                counted(tenant, "agent", client.lookup(MODEL, other, retention="agent").usage)
    # 4xx answers, for the errors-by-status panel: no key (401) and an unknown path (404).
    with CacheClient(stack.service.url) as anonymous, contextlib.suppress(ServiceError):
        anonymous.lookup(MODEL, tokens(0, BLOCK))
    headers = {"Authorization": f"Bearer {stack.secrets['ops']}"}
    httpx.get(stack.service.url + "/v1/no-such-route", headers=headers, timeout=5.0)


def prepare_lookup_series(stack: LiveStack) -> None:
    """One refused lookup (400: a body that is not JSON), which creates the lookup route's
    latency series without counting a token: the service makes a route's series on its first
    request, and a rate over a window needs a sample from before the traffic."""
    response = httpx.post(
        stack.service.url + "/v1/lookup",
        content=b"not json",
        headers={
            "Authorization": f"Bearer {stack.secrets['a']}",
            "Content-Type": "application/json",
        },
        timeout=5.0,
    )
    assert response.status_code == 400, response.text


def admin_stats(stack: LiveStack) -> dict[str, Any]:
    """/v1/stats as the admin sees it (with tenants)."""
    with CacheClient(stack.service.url, api_key=stack.secrets["ops"]) as client:
        return client.stats()


def wait_until_scraped_and_evaluated(stack: LiveStack) -> None:
    """Wait until Prometheus holds the service's final token counts, then until the rules
    have been evaluated a full interval after that scrape."""
    stats = stack.stats
    hits = sum(c["hit_tokens"] for c in stats["retention"].values())
    misses = sum(c["miss_tokens"] for c in stats["retention"].values())
    prometheus = stack.prometheus

    def total(expr: str, expected: int) -> None:
        prometheus.wait_for(
            f"sum({expr})",
            lambda result: bool(result) and float(result[0]["value"][1]) == expected,
            what=f"a scrape with sum({expr}) == {expected} (as /v1/stats reports)",
            timeout_seconds=SCRAPE_WAIT_SECONDS,
        )

    total("prompt_cache_hit_tokens_total", hits)
    total("prompt_cache_miss_tokens_total", misses)
    wait_for_rules_after_scrape(
        prometheus,
        "prompt_cache_miss_tokens_total",
        "job:prompt_cache_token_hit_ratio:rate5m",
        timeout_seconds=SCRAPE_WAIT_SECONDS,
    )


@contextlib.contextmanager
def start_live_stack(prometheus_binary: Path, workdir: Path) -> Iterator[LiveStack]:
    """Start the service and Prometheus, drive the traffic, wait for the scrape and the
    rules; stop both processes (by PID) on exit."""
    secrets = write_keys(workdir / "keys.toml")
    metrics_port = free_port()
    service = ServerProcess(
        workdir / "data",
        workdir / "service.log",
        auth="keys",
        api_keys_file=str(workdir / "keys.toml"),
        metrics_port=str(metrics_port),
        block_size=str(BLOCK),
        retention="agent=3d,chat=7d",
        capacity="64MiB",
        touch_flush_interval="0.05",
    )
    prometheus = PrometheusProcess(
        prometheus_binary,
        workdir / "prometheus",
        targets=[f"127.0.0.1:{metrics_port}"],
        rule_files=sorted(RULES.glob("*.yml")),
    )
    try:
        service.start()
        prometheus.start()
        stack = LiveStack(service=service, prometheus=prometheus, secrets=secrets, stats={})
        prepare_lookup_series(stack)
        # The counters at zero first, and the lookup route's histogram: a rate needs a sample
        # before the traffic (a series born with its first count shows no increase).
        prometheus.wait_for(
            'prompt_cache_hit_tokens_total{job="prompt-cache"}'
            ' or prompt_cache_request_duration_seconds_count{route="/v1/lookup"}',
            lambda result: len(result) == 3,
            what="a scrape of both classes' counters and of the lookup route's histogram",
            timeout_seconds=SCRAPE_WAIT_SECONDS,
        )
        drive_traffic(stack)
        stack.stats = admin_stats(stack)
        wait_until_scraped_and_evaluated(stack)
        yield stack
    finally:
        prometheus.stop()
        service.stop()
