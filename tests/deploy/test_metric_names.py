"""The service's real /metrics (after traffic, with tenants) passes `promtool check metrics`,
and every metric the rules and the dashboard read is one the service exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from tests.deploy.kit import promtool_check_metrics

if TYPE_CHECKING:
    from tests.deploy.live_stack import LiveStack

# Names of our own series in PromQL text: raw metrics (prompt_cache_...) only, not the
# recording rules' names, which carry colons.
RAW_METRIC = re.compile(r"(?<![:\w])(prompt_cache_[a-z_]+)(?![:\w])")


def scrape(stack: LiveStack, *, admin_port: bool) -> str:
    """/metrics from the metrics port (no key) or from the main port (the admin's key)."""
    if admin_port:
        headers = {"Authorization": f"Bearer {stack.secrets['ops']}"}
        response = httpx.get(stack.service.url + "/metrics", headers=headers, timeout=10.0)
    else:
        target = stack.prometheus.targets[0]
        response = httpx.get(f"http://{target}/metrics", timeout=10.0)
    response.raise_for_status()
    return response.text


def exported_names(text: str) -> set[str]:
    """The sample names of an exposition."""
    return {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")
    } - {""}


def test_metrics_pass_promtool_check_metrics(live_stack: LiveStack, promtool: Path) -> None:
    for admin_port in (False, True):
        text = scrape(live_stack, admin_port=admin_port)
        assert 'prompt_cache_tenant_hit_tokens_total{tenant="team-a"}' in text
        promtool_check_metrics(promtool, text)


def test_every_metric_the_rules_and_dashboard_read_is_exported(live_stack: LiveStack) -> None:
    from tests.deploy.test_dashboard import expressions  # noqa: PLC0415
    from tests.deploy.test_rules import rules  # noqa: PLC0415

    exported = exported_names(scrape(live_stack, admin_port=False))
    texts = [rule["expr"] for rule in rules()] + [expr for _, expr in expressions()]
    read = {name for text in texts for name in RAW_METRIC.findall(text)}
    assert len(read) > 10
    # The live stack stores on LMDB: only a remote store exports the backend's counters
    # (test_backend_live.py checks them on Redis).
    read = {name for name in read if not name.startswith("prompt_cache_backend_")}
    unknown = sorted(name for name in read if name not in exported)
    assert unknown == []


def test_the_metrics_port_and_the_main_port_export_the_same_series(
    live_stack: LiveStack,
) -> None:
    # Latency and request counts differ between two reads (the reads are requests); the
    # names do not.
    assert exported_names(scrape(live_stack, admin_port=False)) <= exported_names(
        scrape(live_stack, admin_port=True)
    )
