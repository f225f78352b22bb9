"""The compose stack (deploy/compose.yaml): valid for Docker's own loader, every mounted path
present, and the service's flags, ports and health check agreeing with Prometheus' and
Grafana's configuration. (No Docker engine runs here: the stack itself is not started.)"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from cache_service.service.server import exit_bound_seconds
from cache_service.service.settings import Settings
from tests.deploy.conftest import require_tool
from tests.deploy.kit import COMPOSE, DEPLOY, DOCKERFILE, effective_settings, import_yaml

SERVICES = {"cache", "prometheus", "grafana"}


def load(path: Path) -> Any:
    """A YAML file, parsed."""
    return import_yaml().safe_load(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """deploy/compose.yaml, parsed."""
    document = load(COMPOSE)
    assert isinstance(document, dict)
    return document


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """A service's volumes as container path -> source (a host path or a named volume)."""
    table = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        table[target] = source
    return table


def host_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts as container path -> host path (relative to deploy/)."""
    return {
        target: (DEPLOY / source).resolve()
        for target, source in mounts(service).items()
        if source.startswith((".", "/"))
    }


def host_path(service: dict[str, Any], container_path: str) -> Path:
    """Where a path inside the service's container comes from in the repository."""
    for target, source in sorted(host_mounts(service).items(), key=lambda m: -len(m[0])):
        if Path(container_path).is_relative_to(target):
            return source / Path(container_path).relative_to(target)
    raise AssertionError(f"{container_path} is not mounted from the repository")


def cache_settings(compose: dict[str, Any]) -> Settings:
    """What the cache service runs with: its command and environment, as the service reads
    them (the image's entrypoint is `cache-service`)."""
    cache = compose["services"]["cache"]
    environment = {key: str(value) for key, value in cache.get("environment", {}).items()}
    return effective_settings(cache["command"], environment)


def published(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """A service's published ports as (host address, host port, container port)."""
    ports = []
    for entry in service.get("ports", []):
        address, host_port, container_port = str(entry).split(":")
        ports.append((address, int(host_port), int(container_port)))
    return ports


def test_compose_file_is_valid_for_dockers_own_loader() -> None:
    docker = str(require_tool("docker"))
    version = subprocess.run(
        [docker, "compose", "version"], check=False, capture_output=True, timeout=30
    )
    if version.returncode == 0:  # the compose plugin: the Compose Specification, fully
        command = [docker, "compose", "-f", str(COMPOSE), "config", "-q"]
    else:
        # Docker's CLI without the plugin still loads compose files for `docker stack`,
        # offline, against its version 3 schema: a stricter subset of the specification (it
        # refuses, for instance, `depends_on` conditions), so a file it accepts is valid.
        command = [docker, "stack", "config", "-c", str(COMPOSE)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stderr}"


def test_stack_runs_the_service_prometheus_and_grafana(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == SERVICES
    build = services["cache"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    # Named volumes keep the cache, the time series and Grafana's state across restarts.
    for name, path in (("cache", "/data"), ("prometheus", "/prometheus")):
        assert mounts(services[name])[path] in compose["volumes"], name


def test_every_mounted_host_path_exists_in_the_repository(compose: dict[str, Any]) -> None:
    checked = 0
    for name, service in compose["services"].items():
        for target, source in host_mounts(service).items():
            assert source.exists(), f"{name} mounts {source} at {target}: it does not exist"
            assert source.is_relative_to(DEPLOY), f"{name} mounts {source} outside deploy/"
            checked += 1
    assert checked >= 3  # Prometheus' folder, Grafana's provisioning and its dashboards


def test_cache_command_is_accepted_and_published_on_loopback(compose: dict[str, Any]) -> None:
    cache = compose["services"]["cache"]
    settings = cache_settings(compose)  # the service's parser and validation accept it
    assert settings.host == "0.0.0.0"  # the other containers reach it on the stack's network
    assert mounts(cache)[str(settings.data_dir)] == "cache-data"
    # Published on the host's loopback only: no key guards the API here.
    assert published(cache) == [("127.0.0.1", settings.port, settings.port)]
    for name in SERVICES - {"cache"}:
        assert all(address == "127.0.0.1" for address, _, _ in published(compose["services"][name]))


def test_cache_health_check_asks_healthz_on_the_service_port(compose: dict[str, Any]) -> None:
    cache = compose["services"]["cache"]
    settings = cache_settings(compose)
    test = cache["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python3", "-c"]
    assert f"http://127.0.0.1:{settings.port}/healthz" in test[3]
    stop = cache["stop_grace_period"]
    assert stop.endswith("s") and float(stop[:-1]) >= exit_bound_seconds(settings.shutdown_timeout)


def test_prometheus_scrapes_the_cache_metrics_port_and_loads_the_rules(
    compose: dict[str, Any],
) -> None:
    prometheus = compose["services"]["prometheus"]
    config_flag = next(f for f in prometheus["command"] if f.startswith("--config.file="))
    config_path = host_path(prometheus, config_flag.split("=", 1)[1])
    config = load(config_path)
    targets = [
        target
        for job in config["scrape_configs"]
        if job["job_name"] == "prompt-cache"
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    settings = cache_settings(compose)
    assert settings.metrics_port is not None
    assert settings.metrics_host == "0.0.0.0"  # reachable from Prometheus' container
    assert targets == [f"cache:{settings.metrics_port}"]
    rule_files = [
        match for pattern in config["rule_files"] for match in config_path.parent.glob(pattern)
    ]
    assert rule_files, f"{config['rule_files']} finds no rule file in {config_path.parent}"


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(
    compose: dict[str, Any],
) -> None:
    grafana = compose["services"]["grafana"]
    provisioning = host_path(grafana, "/etc/grafana/provisioning")
    (datasource,) = load(provisioning / "datasources" / "prometheus.yaml")["datasources"]
    url = urlsplit(datasource["url"])
    assert url.hostname == "prometheus"  # the compose service
    prometheus_ports = [c for _, _, c in published(compose["services"]["prometheus"])]
    assert url.port in prometheus_ports
    providers = load(provisioning / "dashboards" / "prompt-cache.yaml")["providers"]
    for provider in providers:
        folder = host_path(grafana, provider["options"]["path"])
        assert sorted(folder.glob("*.json")), f"no dashboard in {folder}"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path(grafana, home).is_file()
