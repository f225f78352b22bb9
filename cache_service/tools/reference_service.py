"""The metrics and HTTP API reference pages, read from the service's own registry and OpenAPI
document (neither needs a store: the collectors are given stand-in readings)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from prometheus_client import CollectorRegistry

from cache_service.core.blocks import StoreUsage
from cache_service.core.disk import DiskRoom
from cache_service.service.api import create_app
from cache_service.service.api.auth import PUBLIC_PATHS, ROUTE_ROLES
from cache_service.service.api_keys import Role
from cache_service.service.backend_metrics import BackendCounters
from cache_service.service.kv_events.hub import KvEventsHub
from cache_service.service.kv_events.metrics import KvEventsCollector
from cache_service.service.metrics import CacheMetrics, StoreCollector
from cache_service.service.settings import Settings
from cache_service.tools.pd_proxy.metrics import ProxyMetrics
from cache_service.tools.reference_markdown import code, page, prose, require_descriptions, table

# A key ring only to build the app as `--auth keys` serves it: the digest is of no key.
DOCS_KEYS = "docs:docs:admin:" + "0" * 64
# How a family's samples are named on /metrics, where the name alone does not say it.
SAMPLE_NAMES = {"counter": "{name}_total"}
TYPE_NOTES = {"histogram": "histogram (`_bucket`, `_sum`, `_count`)"}


def metric_sources() -> list[tuple[str, str, CollectorRegistry]]:
    """The service's metrics by where they come from, each source on a registry of its own."""
    cache = CollectorRegistry()
    CacheMetrics(cache)
    store = CollectorRegistry()
    usage = StoreUsage(blocks=0, payload_bytes=0, used_bytes=0)
    room = DiskRoom(Path("."), free_bytes=0, file_bytes=0, capacity_bytes=None, margin_bytes=0)
    store.register(StoreCollector(lambda: usage, capacity_bytes=1, disk=lambda: room))
    backend = CollectorRegistry()
    BackendCounters(dict, backend)
    kv_events = CollectorRegistry()
    # With no engine the collector yields every family, empty: all this page reads.
    no_engines = SimpleNamespace(engines=(), subscriber=SimpleNamespace(stats=dict, liveness=dict))
    kv_events.register(KvEventsCollector(cast(KvEventsHub, no_engines)))
    proxy = ProxyMetrics().registry
    return [
        ("Cache and requests", "Counted as requests are answered (with `--workers`, summed "
         "over the workers).", cache),
        ("Store", "Read from the store when scraped; the capacity and disk gauges only for a "
         "store that has them (a store on a local disk).", store),
        ("Remote store", "Only with a Redis store: the failures it answered as misses or "
         "retried.", backend),
        ("KV events", "Only with `--kv-events` or `--kv-events-config`; the `engine` label "
         "takes the configured engine names.", kv_events),
        ("The prefill/decode proxy", "On `cache-service pd-proxy`'s own /metrics, not the "
         "service's; the `engine` label takes the names given to --prefill and --decode.",
         proxy),
    ]  # fmt: skip


def metric_table(registry: CollectorRegistry) -> str:
    """Every metric family of a registry: name on /metrics, type, labels and help text."""
    rows, missing = [], []
    # prometheus_client keeps a registry's collectors, and a labelled metric's label names,
    # in attributes only: a metric with no series yet has no samples to read its labels from.
    for collector in registry._collector_to_names:
        for family in collector.collect():
            labels = getattr(collector, "_labelnames", ()) or getattr(family, "_labelnames", ())
            if not family.documentation:
                missing.append(family.name)
            exposed = SAMPLE_NAMES.get(family.type, "{name}").format(name=family.name)
            kind = TYPE_NOTES.get(family.type, family.type)
            cells = [", ".join(code(label) for label in labels), prose(family.documentation)]
            rows.append([code(exposed), kind, *cells])
    require_descriptions(missing)
    return table(["Metric", "Type", "Labels", "Description"], rows)


def metrics_page() -> str:
    """The metrics reference page."""
    intro = (
        "Served at `/metrics` (an admin key with `--auth keys`), and without a key on "
        "`--metrics-port` if set."
    )
    sections = [
        f"## {title}\n\n{about}\n\n{metric_table(registry)}"
        for title, about, registry in metric_sources()
    ]
    return page("Metrics reference", intro, *sections)


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document the service serves with `--auth keys`, from default settings
    (model_construct: no CACHE_SERVICE_* variable read, no store opened)."""
    settings = Settings.model_construct(auth="keys", api_keys=DOCS_KEYS)
    return create_app(settings).openapi()


def openapi_json(document: dict[str, Any]) -> str:
    """The document as the downloadable file: paths in definition order."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def role_of(path: str) -> str:
    """The least role a key needs for a path (auth.py: a path not listed needs admin)."""
    if path in PUBLIC_PATHS:
        return "none (no key)"
    return ROUTE_ROLES.get(path, Role.ADMIN).name.lower()


def _bodies(content: dict[str, Any]) -> str:
    """Media types and their schemas' names."""
    parts = []
    for media, spec in content.items():
        schema = spec.get("schema", {})
        ref = spec.get("x-frame-header", schema.get("items", schema)).get("$ref", "")
        if ref:
            what = code(ref.rsplit("/", 1)[-1])
            what = f"frames with a {what} header" if "x-frame-header" in spec else what
            what = f"array of {what}" if "items" in schema else what
        else:
            what = "binary" if schema.get("format") == "binary" else schema.get("type", "any")
        parts.append(f"{code(media)} ({what})")
    return ", ".join(parts)


def _operation(path: str, method: str, operation: dict[str, Any]) -> str:
    lines = [f"## {method.upper()} {path}", "", f"**{operation.get('summary', '')}.**"]
    if operation.get("description"):
        lines += ["", operation["description"].strip()]
    lines += ["", f"- Role: {code(role_of(path))}"]
    for parameter in operation.get("parameters", []):
        needed = "required" if parameter.get("required") else "optional"
        about = prose(parameter.get("description", ""))
        lines.append(f"- Parameter {code(parameter['name'])} ({parameter['in']}, {needed}) {about}")
    body = operation.get("requestBody")
    if body:
        lines.append(
            f"- Request body: {_bodies(body['content'])}. {prose(body.get('description', ''))}"
        )
    answers = sorted(operation.get("responses", {}).items(), key=lambda item: item[0])
    rows = [
        [status, prose(a.get("description", "")), _bodies(a.get("content", {}))]
        for status, a in answers
    ]
    lines += ["", table(["Status", "Meaning", "Body"], rows)]
    return "\n".join(line.rstrip() for line in lines)


def http_api_page(document: dict[str, Any]) -> str:
    """The HTTP API reference page of an OpenAPI document."""
    info = document["info"]
    intro = (
        f"{prose(info['description'])}\n\n"
        "As served with `--auth keys`: every request but the health checks needs an API key "
        "(`Authorization: Bearer KEY`) whose role is at least the one named; with `--auth "
        "none` no key is asked for, and no route answers 401, 403 or 429. The OpenAPI "
        f"document of version {info['version']}: [openapi.json](openapi.json) (a running "
        "service serves its own at `/openapi.json`, and pages of it at `/docs` and `/redoc`)."
    )
    paths = document["paths"]
    operations = [_operation(p, m, op) for p, ops in paths.items() for m, op in ops.items()]
    others = [[code(path), code(role_of(path))] for path in ROUTE_ROLES if path not in paths]
    rest = "## Other paths\n\nServed, but not in the OpenAPI document.\n\n"
    return page("HTTP API reference", intro, *operations, rest + table(["Path", "Role"], others))
