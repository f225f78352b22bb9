"""The Kubernetes manifests (deploy/kubernetes): rendered by kubectl's kustomize, validated
against the Kubernetes schemas offline, and their ports, probes, flags, keys and volumes
checked against the service's own command line and settings."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from cache_service import __version__
from cache_service.core.disk import MARGIN_MAX_BYTES
from cache_service.core.engines.schemes.vllm import ALGORITHMS
from cache_service.core.store.redis.connect import PASSWORD_ENV, USERNAME_ENV
from cache_service.core.store.registry import parse_store_url
from cache_service.service.server import exit_bound_seconds
from cache_service.service.settings import Settings
from cache_service.service.usage import DEFAULT_KEEP
from tests.deploy.conftest import require_module
from tests.deploy.kit import (
    DEPLOY,
    DOCKERFILE,
    KUBERNETES,
    LOCAL_VALUES,
    effective_settings,
    get,
    kustomize,
    localised,
    make_key_file,
    running_service,
    unknown_variables,
)
from tests.integration.conftest import free_port

LAYOUTS = ("base", "overlays/sidecar", "overlays/shared", "overlays/redis-cluster")
OVERLAYS = ("overlays/sidecar", "overlays/shared", "overlays/redis-cluster")
# The layouts whose cache keeps an LMDB store in the pod; the Redis Cluster layout's cache is
# run against a local cluster in test_redis_layout.py.
LMDB_OVERLAYS = ("overlays/sidecar", "overlays/shared")
WORKLOAD_KINDS = {
    "overlays/sidecar": "Deployment",
    "overlays/shared": "StatefulSet",
    "overlays/redis-cluster": "Deployment",
}
# The variables the service reads beside its settings (a Redis password has no flag: it
# would show in process lists), which may therefore come from a Secret.
SECRET_VARIABLES = {PASSWORD_ENV, USERNAME_ENV}
CACHE_CONTAINER = "prompt-cache"
# Custom resources of the Prometheus Operator: no schema in kubernetes-validate, so their
# fields are checked by hand below.
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}
# The oldest Kubernetes the manifests promise to fit (fsGroupChangePolicy, policy/v1 PDBs and
# StatefulSet fields are older), and the newest schemas the validator ships.
OLDEST_KUBERNETES = "1.29"
# Besides LMDB's map, the data folder holds the disk-reserve file (up to the disk's margin,
# MARGIN_MAX_BYTES: cache_service/core/reserve.py), and small files: the quotas file, LMDB's
# lock file, the usage log's lock. 32 MiB covers those with room to spare.
SMALL_FILES_BYTES = 32 * 2**20
# What the sidecar layout's grace period leaves vLLM to drain before the cache gets SIGTERM
# (Kubernetes' default grace period: vLLM's own stop is not bounded by anything we ship).
VLLM_DRAIN_SECONDS = 30

QUANTITY = re.compile(r"^(?P<number>[0-9.]+)(?P<unit>[KMGTPE]i?|m|)$")
UNITS = {"": 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
UNITS |= {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "Ei": 2**60}


def quantity(text: str | int) -> float:
    """A Kubernetes quantity ("10Gi", "500m", "2") as a number."""
    match = QUANTITY.match(str(text))
    assert match, f"not a quantity: {text!r}"
    return float(match["number"]) * UNITS[match["unit"]]


def of_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The rendered documents of one kind."""
    return [doc for doc in documents if doc["kind"] == kind]


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a matchLabels selector (non-empty) selects these labels."""
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every layout, rendered once by `kubectl kustomize`."""
    return {layout: kustomize(KUBERNETES / layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real key file, standing in for the Secret's keys.toml."""
    return make_key_file(tmp_path_factory.mktemp("keys"))


class Workload:
    """An overlay's workload and what the cache container in it runs with."""

    def __init__(self, documents: list[dict[str, Any]], kind: str, key_file: Path) -> None:
        (self.manifest,) = of_kind(documents, kind)
        self.pod: dict[str, Any] = self.manifest["spec"]["template"]["spec"]
        self.pod_labels: dict[str, str] = self.manifest["spec"]["template"]["metadata"]["labels"]
        # A regular container (shared layout) or a native sidecar, in initContainers.
        (self.container,) = [c for c in pod_containers(self.pod) if c["name"] == CACHE_CONTAINER]
        self.is_init_container = self.container in self.pod.get("initContainers", [])
        self.env = container_environment(self.container, documents)
        self.secret_env = secret_variables(self.container)
        argv = [*self.container.get("command", []), *self.container["args"]]
        self.settings: Settings = effective_settings(argv, self.env, key_file=key_file)
        self.ports = {port["name"]: port["containerPort"] for port in self.container["ports"]}

    def port_number(self, port: str | int) -> int:
        """A probe's or Service's target port (a name of the container's, or a number)."""
        return self.ports[port] if isinstance(port, str) else port

    def volume(self, name: str) -> dict[str, Any]:
        """The pod volume (or StatefulSet volume claim template) called `name`."""
        for volume in self.pod.get("volumes", []):
            if volume["name"] == name:
                return dict(volume)
        for claim in self.manifest["spec"].get("volumeClaimTemplates", []):
            if claim["metadata"]["name"] == name:
                return {"name": name, "claim": claim["spec"]}
        raise AssertionError(f"no volume {name!r} in the {self.manifest['kind']}")

    def mount_at(self, path: Path) -> dict[str, Any]:
        """The cache container's volume mount whose folder holds `path` (or is it)."""
        mounts = [m for m in self.container["volumeMounts"] if path.is_relative_to(m["mountPath"])]
        assert mounts, f"nothing is mounted at {path} in the cache container"
        return max(mounts, key=lambda m: len(m["mountPath"]))


def pod_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """A pod's containers: its init containers (native sidecars among them), then the rest."""
    return [*pod.get("initContainers", []), *pod["containers"]]


def container_environment(
    container: dict[str, Any], documents: list[dict[str, Any]]
) -> dict[str, str]:
    """The variables a container gets: its ConfigMaps (envFrom), then its own env list."""
    env: dict[str, str] = {}
    config_maps = {doc["metadata"]["name"]: doc for doc in of_kind(documents, "ConfigMap")}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in config_maps, f"envFrom names ConfigMap {name}, which is not rendered"
        env.update(config_maps[name]["data"])
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
            continue
        if "secretKeyRef" in variable["valueFrom"]:  # its value is not in the manifests
            continue
        reference = variable["valueFrom"]["configMapKeyRef"]
        assert reference["name"] in config_maps, f"{variable['name']}: no such ConfigMap"
        env[variable["name"]] = config_maps[reference["name"]]["data"][reference["key"]]
    return env


def secret_variables(container: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The container's variables taken from a Secret: name -> its secretKeyRef."""
    return {
        variable["name"]: variable["valueFrom"]["secretKeyRef"]
        for variable in container.get("env", [])
        if "secretKeyRef" in variable.get("valueFrom", {})
    }


def expand_variables(text: str, env: dict[str, str]) -> str:
    """A command line argument as the kubelet runs it: $(NAME) replaced by the container's
    variable, $$ by $; a $(NAME) of no variable would stay as written, so it fails here."""

    def replace(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        assert match[1] in env, f"{text}: the container has no variable {match[1]}"
        return env[match[1]]

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", replace, text)


def flag_values(argv: list[str]) -> dict[str, str]:
    """The `--flag value` pairs of a command line (each flag given once)."""
    values: dict[str, str] = {}
    for flag, value in itertools.pairwise(argv):
        if flag.startswith("--") and not value.startswith("--"):
            assert flag not in values, f"{flag} given twice"
            values[flag] = value
    return values


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    """Each overlay in turn."""
    return str(request.param)


@pytest.fixture(scope="module")
def workload(overlay: str, rendered: dict[str, list[dict[str, Any]]], key_file: Path) -> Workload:
    """The overlay's workload, read against the service's settings."""
    return Workload(rendered[overlay], WORKLOAD_KINDS[overlay], key_file)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rendered_manifest_is_valid_against_the_kubernetes_schemas(
    layout: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    kubernetes_validate = require_module("kubernetes_validate")
    newest = kubernetes_validate.latest_version()
    checked = []
    for document in rendered[layout]:
        if document["kind"] in CUSTOM_KINDS:
            continue
        for version in (OLDEST_KUBERNETES, newest):
            try:  # strict: a misspelt or misplaced field is an error, not ignored
                kubernetes_validate.validate(document, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                name = f"{document['kind']}/{document['metadata']['name']}"
                pytest.fail(f"{layout}: {name} is invalid for Kubernetes {version}: {exc}")
        checked.append(document["kind"])
    assert {"Service", "ConfigMap", "PodDisruptionBudget"} <= set(checked)
    if layout == "overlays/shared":
        assert "NetworkPolicy" in checked


def test_each_overlay_renders_its_layout(rendered: dict[str, list[dict[str, Any]]]) -> None:
    (sidecar,) = of_kind(rendered["overlays/sidecar"], "Deployment")
    pod = sidecar["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["vllm"]
    assert [c["name"] for c in pod["initContainers"]] == [CACHE_CONTAINER]
    (vllm,) = pod["containers"]
    assert vllm["image"].startswith("vllm-openai-prompt-cache:")  # Dockerfile.vllm's

    (shared,) = of_kind(rendered["overlays/shared"], "StatefulSet")
    claims = [claim["metadata"]["name"] for claim in shared["spec"]["volumeClaimTemplates"]]
    assert claims == ["data"]
    # Each replica is a cache of its own (its own LMDB on its own volume): one replica, so
    # that the Service does not split every prefix's hits (many share one on Redis instead).
    assert shared["spec"]["replicas"] == 1
    headless = [s for s in of_kind(rendered["overlays/shared"], "Service") if s["metadata"]["name"]]
    assert shared["spec"]["serviceName"] in {s["metadata"]["name"] for s in headless}


def test_cache_command_line_and_variables_are_accepted_by_the_service(
    workload: Workload,
) -> None:
    # Workload() already ran the flags through the CLI's parser and the service's settings
    # (an unknown flag or an invalid combination fails there); variables no setting reads are
    # silently ignored by the service, so they are looked for here.
    assert unknown_variables(workload.env) == []
    assert workload.container["args"][0] == "serve"
    # A Secret's variables must be ones the service reads, under their exact names.
    assert set(workload.secret_env) <= SECRET_VARIABLES, workload.secret_env


def test_container_ports_are_the_ones_the_service_listens_on(workload: Workload) -> None:
    settings = workload.settings
    assert settings.host == "0.0.0.0"  # the kubelet's probes reach the pod's address
    assert workload.ports["http"] == settings.port
    assert settings.metrics_port is not None, "Prometheus needs the metrics port"
    assert workload.ports["metrics"] == settings.metrics_port
    assert settings.metrics_host == "0.0.0.0"


def test_probes_ask_healthz_and_readyz_on_the_api_port(workload: Workload) -> None:
    container, port = workload.container, workload.settings.port
    probes = [("livenessProbe", "/healthz"), ("startupProbe", "/healthz")]
    # A native sidecar has none (see the next test); a regular container must have one.
    if not workload.is_init_container:
        probes.append(("readinessProbe", "/readyz"))
    for probe, path in probes:
        assert probe in container, probe
        action = container[probe]["httpGet"]
        assert action["path"] == path, probe
        assert workload.port_number(action["port"]) == port, probe


def test_in_the_sidecar_layout_the_cache_is_a_native_sidecar_that_cannot_unready_vllm(
    rendered: dict[str, list[dict[str, Any]]], key_file: Path
) -> None:
    workload = Workload(rendered["overlays/sidecar"], "Deployment", key_file)
    # An init container with restartPolicy Always (Kubernetes 1.29+): started before the main
    # containers, restarted on its own, and stopped only after they have exited.
    assert workload.is_init_container
    assert workload.container["restartPolicy"] == "Always"
    assert workload.pod.get("restartPolicy", "Always") == "Always"
    # A sidecar's readiness probe counts toward the pod's Ready condition (Kubernetes docs,
    # Sidecar Containers): the engine fails open to the cache, so no probe of the cache may
    # take vLLM's pod out of its Service.
    for container in pod_containers(workload.pod):
        if container["name"] == CACHE_CONTAINER:
            assert "readinessProbe" not in container
    assert "livenessProbe" in workload.container
    assert "startupProbe" in workload.container
    (vllm,) = [c for c in workload.pod["containers"] if c["name"] == "vllm"]
    assert "readinessProbe" in vllm  # the pod's readiness is the engine's


class Engine:
    """The sidecar layout's vLLM container: its variables, and its flags as it runs them."""

    def __init__(self, documents: list[dict[str, Any]], pod: dict[str, Any]) -> None:
        (self.container,) = [c for c in pod["containers"] if c["name"] == "vllm"]
        self.env = container_environment(self.container, documents)
        argv = [expand_variables(arg, self.env) for arg in self.container["args"]]
        self.flags = flag_values(argv)
        self.kv_events_config: dict[str, Any] = json.loads(self.flags["--kv-events-config"])

    @property
    def served_model_name(self) -> str:
        """The model name clients (and /v1/route) use: vLLM's --model unless renamed."""
        return self.flags.get("--served-model-name", self.flags["--model"])


@pytest.fixture(scope="module")
def sidecar(rendered: dict[str, list[dict[str, Any]]], key_file: Path) -> tuple[Workload, Engine]:
    """The sidecar layout's cache and the vLLM engine beside it."""
    documents = rendered["overlays/sidecar"]
    workload = Workload(documents, "Deployment", key_file)
    return workload, Engine(documents, workload.pod)


def test_the_sidecar_cache_follows_the_kv_events_vllm_publishes_in_the_pod(
    sidecar: tuple[Workload, Engine],
) -> None:
    workload, engine = sidecar
    # The service's own reading of its settings (flags and variables).
    (followed,) = workload.settings.kv_event_engines()
    config = engine.kv_events_config
    assert config["enable_kv_cache_events"] is True
    assert config["publisher"] == "zmq"
    published = urlsplit(config["endpoint"])
    subscribed = urlsplit(followed.endpoint)
    assert published.scheme == subscribed.scheme == "tcp"
    # vLLM's PUB binds (on every address of the pod, loopback among them); the cache's SUB
    # connects over loopback, to the same port.
    assert published.hostname in {"*", "0.0.0.0", "127.0.0.1"}
    assert subscribed.hostname == "127.0.0.1"
    assert subscribed.port == published.port
    # Rank r would publish on port + r: one rank here, and the cache follows one.
    assert int(engine.flags.get("--data-parallel-size", "1")) == followed.data_parallel_size
    assert followed.replay_endpoint is None  # vLLM's config names no replay socket either
    assert "replay_endpoint" not in config


def test_vllm_hashes_its_blocks_the_way_the_sidecar_cache_recomputes_them(
    sidecar: tuple[Workload, Engine],
) -> None:
    workload, engine = sidecar
    (followed,) = workload.settings.kv_event_engines()
    assert followed.hash_scheme is not None
    algorithm = ALGORITHMS[followed.hash_scheme][0]  # vllm-sha256 -> sha256
    assert engine.flags["--prefix-caching-hash-algo"] == algorithm
    assert int(engine.flags["--block-size"]) == followed.block_size
    assert followed.model == engine.served_model_name


def test_vllm_loads_and_stores_its_prefix_kv_through_the_cache_beside_it(
    sidecar: tuple[Workload, Engine],
) -> None:
    workload, engine = sidecar
    config = json.loads(engine.flags["--kv-transfer-config"])
    assert config["kv_connector"] == "PromptCacheConnector"
    assert config["kv_connector_module_path"] == "cache_service.integrations.vllm"
    assert config["kv_role"] == "kv_both"
    assert config["kv_load_failure_policy"] == "recompute"  # a cache problem is a miss
    url = urlsplit(config["kv_connector_extra_config"]["url"])
    assert (url.scheme, url.hostname, url.port) == ("http", "127.0.0.1", workload.settings.port)
    # The key comes from a Secret through the variable the connector reads, not argv.
    (variable,) = [v for v in engine.container["env"] if v["name"] == "CACHE_SERVICE_API_KEY"]
    assert set(variable["valueFrom"]) == {"secretKeyRef"}
    dockerfile = (DEPLOY / "docker" / "Dockerfile.vllm").read_text()
    assert "ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0" in dockerfile


def test_pythonhashseed_and_the_cache_seed_come_from_one_configmap_key(
    sidecar: tuple[Workload, Engine],
) -> None:
    workload, engine = sidecar
    (followed,) = workload.settings.kv_event_engines()
    key = "CACHE_SERVICE_KV_EVENTS_SEED"
    # vLLM's PYTHONHASHSEED is that key of the ConfigMap the cache takes its variables from,
    # and nothing in the cache's own command line or env list overrides it there.
    (variable,) = [v for v in engine.container["env"] if v["name"] == "PYTHONHASHSEED"]
    reference = variable["valueFrom"]["configMapKeyRef"]
    cache_maps = [source["configMapRef"]["name"] for source in workload.container["envFrom"]]
    assert reference == {"name": reference["name"], "key": key}
    assert reference["name"] in cache_maps
    assert "--kv-events-seed" not in workload.container["args"]
    assert key not in {v["name"] for v in workload.container.get("env", [])}
    assert followed.seed is not None
    assert followed.seed == workload.settings.kv_events_seed == engine.env["PYTHONHASHSEED"]
    # Python refuses to start with any other PYTHONHASHSEED than "random" or an integer in
    # [0, 4294967295]; "random" would give every vLLM process its own hashes.
    seeded = subprocess.run(
        [sys.executable, "-c", "import sys; print(sys.flags.hash_randomization)"],
        env={"PYTHONHASHSEED": followed.seed},
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert seeded.returncode == 0, seeded.stderr
    assert followed.seed != "random"


def test_the_shared_layout_follows_no_kv_events(
    rendered: dict[str, list[dict[str, Any]]], key_file: Path
) -> None:
    # No engine runs beside the shared caches: none to subscribe to.
    workload = Workload(rendered["overlays/shared"], "StatefulSet", key_file)
    assert workload.settings.kv_event_engines() == ()


def test_in_the_shared_layout_the_cache_is_a_regular_container_with_readiness(
    rendered: dict[str, list[dict[str, Any]]], key_file: Path
) -> None:
    workload = Workload(rendered["overlays/shared"], "StatefulSet", key_file)
    assert not workload.is_init_container
    assert "initContainers" not in workload.pod
    assert workload.container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_api_keys_come_from_the_secret_mounted_where_the_service_reads_them(
    workload: Workload,
) -> None:
    settings = workload.settings
    assert settings.auth == "keys"
    assert settings.api_keys_file is not None
    keys_file = Path(settings.api_keys_file)
    mount = workload.mount_at(keys_file)
    assert mount.get("readOnly") is True
    secret = workload.volume(mount["name"])["secret"]
    assert secret["secretName"] == "prompt-cache-api-keys"
    # The whole Secret is mounted as a folder: the file is the Secret's key of that name.
    assert "subPath" not in mount, "a subPath mount never sees the Secret change"
    assert keys_file.parent == Path(mount["mountPath"])
    items = {item["key"]: item["path"] for item in secret.get("items", [])}
    assert items.get(keys_file.name, keys_file.name) == keys_file.name == "keys.toml"


def test_the_store_is_on_the_data_volume_and_the_volume_holds_its_map(
    workload: Workload,
) -> None:
    settings = workload.settings
    if parse_store_url(settings.store_url())[0] != "lmdb":
        # On Redis the pod keeps nothing: no data volume, and the image's /data unmounted.
        mounted = {mount["mountPath"] for mount in workload.container["volumeMounts"]}
        assert "/data" not in mounted
        assert "data" not in {volume["name"] for volume in workload.pod.get("volumes", [])}
        assert "volumeClaimTemplates" not in workload.manifest["spec"]
        return
    data_dir = Path(settings.store_url())
    mount = workload.mount_at(data_dir)
    assert Path(mount["mountPath"]) == data_dir == Path("/data")  # the image's VOLUME
    volume = workload.volume(mount["name"])
    # LMDB's data file can grow to its map (twice the capacity plus slack), and the folder
    # also holds the disk-reserve file and small files: an emptyDir past its sizeLimit gets
    # the pod evicted, and a volume that cannot hold them fills up.
    if "emptyDir" in volume:
        room = quantity(volume["emptyDir"]["sizeLimit"])
    else:
        room = quantity(volume["claim"]["resources"]["requests"]["storage"])
    needed = settings.map_size_bytes() + MARGIN_MAX_BYTES + SMALL_FILES_BYTES
    usage_log = settings.usage_log
    if usage_log is not None and Path(usage_log).is_relative_to(data_dir):
        needed += (DEFAULT_KEEP + 1) * settings.usage_log_max_bytes  # the log and its rotations
    assert room >= needed, (room, needed)


def test_resources_fit_the_workers_and_the_stop_fits_the_grace_period(
    workload: Workload,
) -> None:
    resources = workload.container["resources"]
    for what in ("cpu", "memory"):
        assert quantity(resources["requests"][what]) <= quantity(resources["limits"][what])
    # One worker process per core of the limit: more only contend for it.
    assert workload.settings.workers <= math.ceil(quantity(resources["limits"]["cpu"]))
    grace = workload.pod.get("terminationGracePeriodSeconds", 30)
    bound = exit_bound_seconds(workload.settings.shutdown_timeout)
    # A native sidecar gets SIGTERM only once the main containers have exited, within the
    # same grace period: vLLM's drain comes out of it first.
    before = VLLM_DRAIN_SECONDS if workload.is_init_container else 0
    assert grace >= before + bound, (grace, before, bound)


def test_cache_runs_as_the_image_user_from_the_image_at_the_package_version(
    workload: Workload,
) -> None:
    user = re.search(r"^USER (\d+)(?::(\d+))?$", DOCKERFILE.read_text(), re.M)
    assert user, "the Dockerfile sets no numeric USER"
    context = workload.container["securityContext"]
    assert context["runAsNonRoot"] is True
    assert str(context["runAsUser"]) == user[1]
    assert str(workload.pod["securityContext"]["fsGroup"]) == (user[2] or user[1])
    # --workers keeps metrics in files under /tmp: a read-only root needs it writable.
    assert context["readOnlyRootFilesystem"] is True
    workload.mount_at(Path("/tmp/cache-service-metrics-1-x"))
    assert workload.container["image"].endswith(f":{__version__}")


def test_the_service_monitor_scrapes_the_cache_pods_metrics_port(
    overlay: str, workload: Workload, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    documents = rendered[overlay]
    (monitor,) = of_kind(documents, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [
        s for s in of_kind(documents, "Service") if labels_match(selector, s["metadata"]["labels"])
    ]
    assert len(services) == 1, "the ServiceMonitor should select exactly the cache's Service"
    (service,) = services
    assert labels_match(service["spec"]["selector"], workload.pod_labels)
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in ports, f"the Service has no port {endpoint['port']}"
        target = ports[endpoint["port"]]["targetPort"]
        assert workload.port_number(target) == workload.settings.metrics_port
        assert endpoint.get("path", "/metrics") == "/metrics"
    assert workload.port_number(ports["http"]["targetPort"]) == workload.settings.port


def test_every_service_reaches_a_named_port_of_the_pods(
    overlay: str, workload: Workload, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    # Each Service selects the pods of one workload (the cache's, or the Redis nodes' in the
    # Redis Cluster layout), and each of its ports is a port those pods name.
    templates = [
        doc["spec"]["template"]
        for doc in rendered[overlay]
        if doc["kind"] in {"Deployment", "StatefulSet"}
    ]
    for service in of_kind(rendered[overlay], "Service"):
        name, selector = service["metadata"]["name"], service["spec"]["selector"]
        selected = [t for t in templates if labels_match(selector, t["metadata"]["labels"])]
        assert len(selected) == 1, f"the Service {name} selects {len(selected)} workloads"
        (template,) = selected
        if service["metadata"]["labels"].get("app.kubernetes.io/name") == "prompt-cache":
            assert template["metadata"]["labels"] == workload.pod_labels
        named = {
            port["name"]
            for container in pod_containers(template["spec"])
            for port in container.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in named, (name, port)


def test_the_disruption_budget_covers_the_cache_pods_and_lets_a_drain_proceed(
    overlay: str, workload: Workload, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    (budget,) = [
        budget
        for budget in of_kind(rendered[overlay], "PodDisruptionBudget")
        if labels_match(budget["spec"]["selector"]["matchLabels"], workload.pod_labels)
    ]
    replicas = workload.manifest["spec"].get("replicas", 1)
    if "maxUnavailable" in budget["spec"]:
        assert int(budget["spec"]["maxUnavailable"]) >= 1
    else:
        assert int(budget["spec"]["minAvailable"]) < replicas


def test_the_shared_layout_lets_only_clients_reach_the_api_and_prometheus_the_metrics(
    rendered: dict[str, list[dict[str, Any]]], key_file: Path
) -> None:
    documents = rendered["overlays/shared"]
    workload = Workload(documents, "StatefulSet", key_file)
    (policy,) = of_kind(documents, "NetworkPolicy")
    spec = policy["spec"]
    assert labels_match(spec["podSelector"]["matchLabels"], workload.pod_labels)
    assert spec["policyTypes"] == ["Ingress"]
    # Every port of the cache is covered by exactly the rule meant for it.
    allowed: dict[int, list[dict[str, Any]]] = {}
    for rule in spec["ingress"]:
        for port in rule["ports"]:
            assert port.get("protocol", "TCP") == "TCP"
            allowed.setdefault(workload.port_number(port["port"]), []).extend(rule["from"])
    settings = workload.settings
    assert settings.metrics_port is not None
    assert set(allowed) == {settings.port, settings.metrics_port}
    # The API: any pod of the namespace (a bare podSelector), and nothing wider.
    assert allowed[settings.port] == [{"podSelector": {}}]
    # The metrics (no key, per-tenant counters): the monitoring namespace only, by the label
    # Kubernetes sets on every namespace.
    assert allowed[settings.metrics_port] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]


def test_the_sidecar_layout_ships_no_network_policy_that_could_block_vllm(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    assert of_kind(rendered["overlays/sidecar"], "NetworkPolicy") == []


def test_the_service_monitor_job_is_the_one_the_alerts_watch(
    overlay: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    # The Prometheus Operator names a ServiceMonitor's job after the Service (or the Service
    # label spec.jobLabel names); the alerts' `up{job="prompt-cache"}` must find it.
    documents = rendered[overlay]
    (monitor,) = of_kind(documents, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    (service,) = [
        s for s in of_kind(documents, "Service") if labels_match(selector, s["metadata"]["labels"])
    ]
    job_label = monitor["spec"].get("jobLabel")
    job = service["metadata"]["labels"][job_label] if job_label else service["metadata"]["name"]
    alerts = (KUBERNETES.parent / "prometheus" / "rules").glob("*.yml")
    watched = set(re.findall(r'\bjob="([^"]+)"', "".join(p.read_text() for p in alerts)))
    assert watched == {job}, (watched, job)


@pytest.mark.parametrize("lmdb_overlay", LMDB_OVERLAYS)
def test_cache_command_line_starts_a_service_that_answers_probes_and_scrapes(
    lmdb_overlay: str,
    rendered: dict[str, list[dict[str, Any]]],
    key_file: Path,
    tmp_path: Path,
) -> None:
    # The container's own flags and variables, run for real: only the addresses (loopback),
    # the ports (free ones), the data folder and the key file are this machine's.
    workload = Workload(rendered[lmdb_overlay], WORKLOAD_KINDS[lmdb_overlay], key_file)
    settings = workload.settings
    port, metrics_port = free_port(), free_port()
    argv = localised(
        workload.container["args"],
        LOCAL_VALUES
        | {
            "--port": str(port),
            "--metrics-port": str(metrics_port),
            "--data-dir": str(tmp_path / "data"),
            "--api-keys-file": str(key_file),
        },
    )
    # A port on this machine's loopback where nothing publishes: the cache must start and
    # serve without its engine (in the pod, it starts before vLLM binds).
    env = dict(workload.env)
    engines = settings.kv_event_engines()
    if engines:
        env["CACHE_SERVICE_KV_EVENTS"] = f"tcp://127.0.0.1:{free_port()}"
    with running_service(argv, env, tmp_path / "server.log") as proc:
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe not in workload.container:  # a native sidecar has no readiness probe
                continue
            path = workload.container[probe]["httpGet"]["path"]
            deadline = time.monotonic() + 30
            while (status := get(f"http://127.0.0.1:{port}{path}")) != 200:
                assert time.monotonic() < deadline, f"{probe} {path}: {status}"
                time.sleep(0.1)
        assert get(f"http://127.0.0.1:{port}/v1/stats") == 401  # the keys are in force
        deadline = time.monotonic() + 30  # one worker takes the metrics port
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as answer:
                    metrics = answer.read().decode()
                assert "prompt_cache_" in metrics
                break
            except OSError:
                assert time.monotonic() < deadline, "the metrics port does not answer"
                time.sleep(0.1)
        if engines:  # followed: its counters are there, at zero (nothing published)
            name = env["CACHE_SERVICE_KV_EVENTS"].removeprefix("tcp://")
            assert f'prompt_cache_kv_events_batches_total{{engine="{name}"}} 0.0' in metrics
            # Ready without its engine too (the sidecar has no readiness probe to ask).
            assert get(f"http://127.0.0.1:{port}/readyz") == 200
        proc.terminate()
        started = time.monotonic()
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - started <= exit_bound_seconds(settings.shutdown_timeout)
