"""The Redis Cluster layout (deploy/kubernetes/overlays/redis-cluster): three caches on one
Redis Cluster of six nodes. Its manifests are read against each other (the password, the
nodes, the memory limit), and its scripts are run for real on this machine's loopback: six
redis-server processes started by the nodes' start.sh, formed by the Job's create-cluster.sh,
and the cache's own command line serving on them. Kubernetes itself is not run here."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from bench.redis_cluster import find_free_port, parse_cluster_nodes, parse_info
from cache_service.core.store.redis.connect import (
    GOOD_POLICIES,
    PASSWORD_ENV,
    check_memory_settings,
    parse_nodes,
)
from cache_service.service.server import exit_bound_seconds
from tests.deploy.conftest import require_module, require_tool
from tests.deploy.kit import (
    KUBERNETES,
    LOCAL_VALUES,
    get,
    kustomize,
    localised,
    make_key_file,
    running_service,
)
from tests.deploy.test_kubernetes import Workload, expand_variables, of_kind, quantity
from tests.integration.conftest import free_port

OVERLAY = KUBERNETES / "overlays/redis-cluster"
REDIS = "redis"  # the nodes' container
CACHE_REPLICAS = 3
REDIS_NODES = 6  # three primaries, one replica each
# maxmemory counts keys only: replication and client buffers, fragmentation and a full
# sync's fork come on top. Redis's own guidance leaves a quarter or so of the memory free.
MAX_MEMORY_SHARE = 0.8
# Where the nodes' scripts read and write in the pod; replaced by folders here.
CONFIG_PATH = "/etc/redis/redis.conf"
RUN_FOLDER = "/run/redis/"
NODES_FILE = "/data/nodes.conf"
PASSWORD = "0123456789abcdef" * 4  # what `openssl rand -hex 32` makes
NODE_START_SECONDS = 30.0


def redis_conf(text: str) -> dict[str, str]:
    """redis.conf's directives (the last of each wins, as in Redis), comments left out."""
    directives = {}
    for line in text.splitlines():
        name, _, value = line.strip().partition(" ")
        if name and not name.startswith("#"):
            directives[name] = value.strip()
    return directives


@dataclass
class Layout:
    """The rendered layout: the cache's workload, the Redis nodes and the cluster-create Job."""

    documents: list[dict[str, Any]]
    cache: Workload
    nodes: dict[str, Any]  # the StatefulSet
    job: dict[str, Any]
    files: dict[str, str]  # the nodes' ConfigMap: redis.conf, start.sh, create-cluster.sh

    def redis_container(self) -> dict[str, Any]:
        """The nodes' redis container."""
        (container,) = self.nodes["spec"]["template"]["spec"]["containers"]
        assert container["name"] == REDIS
        return dict(container)

    def job_container(self) -> dict[str, Any]:
        """The Job's one container."""
        (container,) = self.job["spec"]["template"]["spec"]["containers"]
        return dict(container)

    def node_names(self) -> list[str]:
        """HOST:PORT of every pod of the StatefulSet, by its name under the headless Service."""
        spec = self.nodes["spec"]
        ports = {p["name"]: p["containerPort"] for p in self.redis_container()["ports"]}
        name = self.nodes["metadata"]["name"]
        return [
            f"{name}-{i}.{spec['serviceName']}:{ports['redis']}" for i in range(spec["replicas"])
        ]


def variables(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's env list by name."""
    return {variable["name"]: variable for variable in container.get("env", [])}


def config_map_of(documents: list[dict[str, Any]], pod: dict[str, Any]) -> dict[str, str]:
    """The data of the one ConfigMap a pod mounts."""
    (name,) = [v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v]
    (config_map,) = [c for c in of_kind(documents, "ConfigMap") if c["metadata"]["name"] == name]
    return dict(config_map["data"])


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real key file, standing in for the Secret's keys.toml."""
    return make_key_file(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def layout(key_file: Path) -> Layout:
    """The overlay, rendered by `kubectl kustomize` and read."""
    documents = kustomize(OVERLAY)
    cache = Workload(documents, "Deployment", key_file)
    (nodes,) = of_kind(documents, "StatefulSet")
    (job,) = of_kind(documents, "Job")
    files = config_map_of(documents, nodes["spec"]["template"]["spec"])
    assert config_map_of(documents, job["spec"]["template"]["spec"]) == files
    return Layout(documents, cache, nodes, job, files)


def test_three_caches_share_six_redis_nodes_behind_a_headless_service(layout: Layout) -> None:
    assert layout.cache.manifest["spec"]["replicas"] == CACHE_REPLICAS
    assert layout.nodes["spec"]["replicas"] == REDIS_NODES
    (headless,) = [
        s
        for s in of_kind(layout.documents, "Service")
        if s["metadata"]["name"] == layout.nodes["spec"]["serviceName"]
    ]
    assert headless["spec"]["clusterIP"] == "None"
    # The nodes meet before any is ready (readiness only asks PING, but still).
    assert headless["spec"]["publishNotReadyAddresses"] is True
    node_labels = layout.nodes["spec"]["template"]["metadata"]["labels"]
    assert all(node_labels.get(k) == v for k, v in headless["spec"]["selector"].items())
    # The cache's Service, PDB and ServiceMonitor select its pods, never the Redis nodes.
    assert node_labels.get("app.kubernetes.io/name") != "prompt-cache"
    # The official image, pinned to a release of Redis 7 (the cache needs 7.0 or newer).
    for container in (layout.redis_container(), layout.job_container()):
        assert re.fullmatch(r"redis:7\.\d+\.\d+", container["image"]), container["image"]


def test_the_cache_store_url_and_the_cluster_create_job_name_all_six_redis_pods(
    layout: Layout,
) -> None:
    expected = layout.node_names()
    assert len(expected) == REDIS_NODES
    store = layout.cache.settings.store_url()
    assert store.startswith("redis://")
    address = parse_nodes(store.removeprefix("redis://"), tls=False)  # the service's parser
    assert [f"{host}:{port}" for host, port in address.nodes] == expected
    job_env = variables(layout.job_container())
    assert job_env["REDIS_NODES"]["value"].split() == expected
    assert layout.job_container()["command"] == ["sh", "/etc/redis/create-cluster.sh"]
    script = layout.files["create-cluster.sh"]
    assert "--cluster create $REDIS_NODES --cluster-replicas 1 --cluster-yes" in script


def test_the_cache_gets_its_password_from_the_secret_redis_requires(layout: Layout) -> None:
    cache_ref = layout.cache.secret_env[PASSWORD_ENV]
    redis_ref = variables(layout.redis_container())["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    job_ref = variables(layout.job_container())["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert cache_ref == redis_ref == job_ref == {"name": "prompt-cache-redis", "key": "password"}
    # Never in the URL (the service refuses one there) nor in any command line.
    assert "@" not in layout.cache.settings.store_url()
    start = layout.files["start.sh"]
    assert 'echo "requirepass \\"$REDIS_PASSWORD\\""' in start
    assert 'echo "masterauth \\"$REDIS_PASSWORD\\""' in start
    assert "REDISCLI_AUTH" in layout.files["create-cluster.sh"]


def test_redis_evicts_only_expiring_keys_within_the_container_memory_limit(
    layout: Layout,
) -> None:
    container = layout.redis_container()
    env = variables(container)
    # The limit comes from the container's own resources, in bytes.
    reference = env["MEMORY_LIMIT_BYTES"]["valueFrom"]["resourceFieldRef"]
    assert reference["resource"] == "limits.memory"
    assert reference.get("containerName", REDIS) == REDIS
    assert quantity(reference.get("divisor", "1")) == 1
    limit = int(quantity(container["resources"]["limits"]["memory"]))
    assert quantity(container["resources"]["requests"]["memory"]) == limit
    percent = int(env["MAXMEMORY_PERCENT"]["value"])
    maxmemory = limit // 100 * percent  # start.sh's $((MEMORY_LIMIT_BYTES / 100 * PERCENT))
    assert "maxmemory=$((MEMORY_LIMIT_BYTES / 100 * MAXMEMORY_PERCENT))" in layout.files["start.sh"]
    assert 0 < maxmemory <= MAX_MEMORY_SHARE * limit, (maxmemory, limit)
    conf = redis_conf(layout.files["redis.conf"])
    assert "maxmemory" not in conf  # start.sh's is the only one
    assert conf["maxmemory-policy"] == "volatile-lru"
    assert conf["maxmemory-policy"] in GOOD_POLICIES
    check_memory_settings([(maxmemory, conf["maxmemory-policy"])])  # the service's own check


def test_each_node_keeps_its_cluster_config_on_its_volume_and_no_data(layout: Layout) -> None:
    conf = redis_conf(layout.files["redis.conf"])
    assert conf["cluster-enabled"] == "yes"
    mounts = {m["mountPath"]: m["name"] for m in layout.redis_container()["volumeMounts"]}
    claims = {c["metadata"]["name"] for c in layout.nodes["spec"]["volumeClaimTemplates"]}
    config_file = Path(conf["cluster-config-file"])
    assert config_file == Path(NODES_FILE)
    assert mounts[str(config_file.parent)] in claims
    # The decision stated in redis.conf: a cache, persisted nowhere.
    assert conf["appendonly"] == "no"
    assert conf["save"] == '""'
    # The generated config (with the password) goes to memory, not to the volume.
    run = [v for v in layout.nodes["spec"]["template"]["spec"]["volumes"] if v["name"] == "run"]
    assert run == [{"name": "run", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}]
    assert mounts[RUN_FOLDER.rstrip("/")] == "run"


def test_a_drain_takes_one_redis_node_at_a_time(layout: Layout) -> None:
    node_labels = layout.nodes["spec"]["template"]["metadata"]["labels"]
    (budget,) = [
        b
        for b in of_kind(layout.documents, "PodDisruptionBudget")
        if all(node_labels.get(k) == v for k, v in b["spec"]["selector"]["matchLabels"].items())
    ]
    assert budget["spec"]["maxUnavailable"] == 1


# --- The nodes' scripts, run for real on loopback ---------------------------------------------


def localised_conf(text: str, values: dict[str, str]) -> str:
    """redis.conf with the values of some directives replaced in place (Redis acts on some,
    such as `dir`, as it reads them, so appending an override would be too late)."""
    lines, found = [], set()
    for line in text.splitlines():
        name = line.split(" ", 1)[0]
        if name in values:
            found.add(name)
        lines.append(f"{name} {values[name]}" if name in values else line)
    assert found == set(values), f"redis.conf no longer sets {set(values) - found}"
    return "\n".join(lines) + "\n"


@dataclass
class Node:
    """One redis-server started by the layout's start.sh."""

    port: int
    folder: Path
    process: subprocess.Popen[bytes]
    log: IO[bytes]

    def cli(self, *command: str, password: str | None = PASSWORD) -> str:
        """redis-cli's answer (the password from REDISCLI_AUTH, as the layout passes it)."""
        env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
        if password is not None:
            env["REDISCLI_AUTH"] = password
        done = subprocess.run(
            [str(require_tool("redis-cli")), "-h", "127.0.0.1", "-p", str(self.port), *command],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
            check=False,
        )
        return done.stdout + done.stderr


class LocalNodes:
    """Six nodes started with the layout's own redis.conf and start.sh; stopped by PID."""

    def __init__(self, layout: Layout, folder: Path) -> None:
        self.layout, self.folder = layout, folder
        self.nodes: list[Node] = []
        container = layout.redis_container()
        env = variables(container)
        self.limit = int(quantity(container["resources"]["limits"]["memory"]))
        self.percent = env["MAXMEMORY_PERCENT"]["value"]
        # In the pod, the node announces its name under the headless Service (the names the
        # Job and the cache use); here 127.0.0.1 stands in for it (start_node), a name this
        # machine resolves, so that start.sh's rewrite of nodes.conf has work on a restart.
        hostname = expand_variables(env["REDIS_HOSTNAME"]["value"], {"POD_NAME": "pod-0"})
        assert hostname == f"pod-0.{layout.nodes['spec']['serviceName']}"

    def script(self, name: str, replacements: dict[str, str]) -> Path:
        """A layout script with its pod paths replaced by this machine's."""
        text = self.layout.files[name]
        for old, new in replacements.items():
            assert old in text, f"{name} no longer uses {old}"
            text = text.replace(old, new)
        path = self.folder / f"{name}.{len(list(self.folder.iterdir()))}"
        path.write_text(text)
        return path

    def start_node(self, port: int) -> Node:
        """A node on `port`: the layout's redis.conf with local addresses and folders."""
        folder = self.folder / f"node-{port}"
        (folder / "run").mkdir(parents=True, exist_ok=True)
        (folder / "data").mkdir(exist_ok=True)
        conf = localised_conf(
            self.layout.files["redis.conf"],
            {
                "port": str(port),
                "bind": "127.0.0.1",
                "dir": str(folder / "data"),
                "cluster-config-file": str(folder / "data" / "nodes.conf"),
            },
        )
        # stop() must be prompt (a primary would wait for its replicas otherwise).
        (folder / "redis.conf").write_text(conf + "shutdown-on-sigterm now\n")
        start = self.script(
            "start.sh",
            {
                CONFIG_PATH: str(folder / "redis.conf"),
                RUN_FOLDER: f"{folder / 'run'}/",
                NODES_FILE: str(folder / "data" / "nodes.conf"),
            },
        )
        env = {
            "PATH": f"{require_tool('redis-server').parent}:{os.environ['PATH']}",
            "MEMORY_LIMIT_BYTES": str(self.limit),
            "MAXMEMORY_PERCENT": self.percent,
            "REDIS_HOSTNAME": "127.0.0.1",
            "REDIS_PASSWORD": PASSWORD,
        }
        log = (folder / "redis.log").open("ab")
        process = subprocess.Popen(
            ["sh", str(start)], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        node = Node(port, folder, process, log)
        self.nodes.append(node)
        deadline = time.monotonic() + NODE_START_SECONDS
        while "PONG" not in node.cli("ping"):
            assert process.poll() is None, (folder / "redis.log").read_text()
            assert time.monotonic() < deadline, f"node {port} does not answer PING"
            time.sleep(0.05)
        return node

    def stop_node(self, node: Node) -> None:
        """SIGTERM to the node's redis-server (start.sh exec'd it: same PID), then SIGKILL."""
        if node.process.poll() is None:
            node.process.send_signal(signal.SIGTERM)
            try:
                node.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait()
        node.log.close()
        self.nodes.remove(node)

    def create_cluster(self) -> subprocess.CompletedProcess[str]:
        """The Job's create-cluster.sh, naming these nodes."""
        env = {
            "PATH": f"{require_tool('redis-cli').parent}:{os.environ['PATH']}",
            "REDIS_NODES": " ".join(f"127.0.0.1:{node.port}" for node in self.nodes),
            "REDIS_PASSWORD": PASSWORD,
            "WAIT_SECONDS": "60",
        }
        return subprocess.run(
            ["sh", str(self.script("create-cluster.sh", {}))],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )

    def stop(self) -> None:
        """Stop every node started here."""
        for node in list(self.nodes):
            self.stop_node(node)


@pytest.fixture(scope="module")
def local_nodes(layout: Layout, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNodes]:
    """Six nodes started by the layout's start.sh, formed by its create-cluster.sh."""
    require_module("redis")
    require_tool("redis-server")
    require_tool("redis-cli")
    nodes = LocalNodes(layout, tmp_path_factory.mktemp("redis-layout"))
    try:
        taken: set[int] = set()
        for _ in range(REDIS_NODES):
            port = find_free_port(taken)
            taken.update({port, port + 10000})
            nodes.start_node(port)
        created = nodes.create_cluster()
        assert created.returncode == 0, created.stdout + created.stderr
        yield nodes
    finally:
        nodes.stop()


def topology(node: Node) -> tuple[list[str], list[str], int]:
    """The serving primaries' ids, the ids the replicas follow and the slots served, as
    `node` sees the cluster."""
    views = parse_cluster_nodes(node.cli("cluster", "nodes"))
    primaries = [v for v in views if v.is_primary and v.slots]
    followed = sorted(v.primary_id or "" for v in views if not v.is_primary)
    return sorted(v.node_id for v in primaries), followed, sum(v.slot_count for v in primaries)


def test_the_nodes_form_three_primaries_with_a_replica_each(local_nodes: LocalNodes) -> None:
    # Every node sees all six at once (the Job waits for that); who follows whom spreads by
    # gossip within a few heartbeats.
    deadline = time.monotonic() + 30
    for node in local_nodes.nodes:
        while (seen := topology(node))[0] != seen[1]:
            assert time.monotonic() < deadline, seen
            time.sleep(0.1)
        primaries, _, slots = seen
        assert len(primaries) == 3
        assert slots == 16384
    for node in local_nodes.nodes:
        assert parse_info(node.cli("cluster", "info"))["cluster_state"] == "ok"


def test_each_node_runs_with_the_layouts_memory_settings_and_password(
    local_nodes: LocalNodes,
) -> None:
    expected = local_nodes.limit // 100 * int(local_nodes.percent)
    for node in local_nodes.nodes:
        assert node.cli("config", "get", "maxmemory").split() == ["maxmemory", str(expected)]
        policy = node.cli("config", "get", "maxmemory-policy").split()
        assert policy == ["maxmemory-policy", "volatile-lru"]
        assert "NOAUTH" in node.cli("ping", password=None)
        assert "WRONGPASS" in node.cli("ping", password="not-it")
        # The generated config (the password in it) is the owner's only.
        generated = node.folder / "run" / "redis.conf"
        assert generated.stat().st_mode & 0o077 == 0
        assert f'requirepass "{PASSWORD}"' in generated.read_text()


def test_the_cluster_create_job_does_nothing_on_a_formed_cluster(
    local_nodes: LocalNodes,
) -> None:
    before = {n.port: n.cli("cluster", "myid").strip() for n in local_nodes.nodes}
    again = local_nodes.create_cluster()
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing to do" in again.stdout
    assert {n.port: n.cli("cluster", "myid").strip() for n in local_nodes.nodes} == before


def test_a_restarted_node_rejoins_from_its_nodes_conf(local_nodes: LocalNodes) -> None:
    # start.sh rewrites nodes.conf's addresses from the names in it before Redis reads it.
    node = local_nodes.nodes[-1]
    node_id = node.cli("cluster", "myid").strip()
    local_nodes.stop_node(node)
    # As after every pod came back with a new IP: each address in nodes.conf is stale. The
    # names beside them resolve (here to 127.0.0.1), and start.sh puts those back; Redis must
    # accept what it leaves. (On one machine the other nodes would heal one stale node
    # anyway: that the rewrite is what lets a whole cluster of new IPs meet again is not
    # shown here.)
    nodes_file = node.folder / "data" / "nodes.conf"
    nodes_file.write_text(nodes_file.read_text().replace("127.0.0.1:", "10.255.255.1:"))
    restarted = local_nodes.start_node(node.port)
    assert restarted.cli("cluster", "myid").strip() == node_id
    deadline = time.monotonic() + 30
    while parse_info(restarted.cli("cluster", "info")).get("cluster_state") != "ok":
        assert time.monotonic() < deadline, restarted.cli("cluster", "info")
        time.sleep(0.1)


def test_the_cache_command_line_serves_on_the_cluster_with_the_password(
    layout: Layout, local_nodes: LocalNodes, key_file: Path, tmp_path: Path
) -> None:
    # The cache's own flags and variables; only the addresses, ports, the nodes and the key
    # file are this machine's, and the Secret's password is the one the nodes require.
    cache = layout.cache
    port, metrics_port = free_port(), free_port()
    store = "redis://" + ",".join(f"127.0.0.1:{node.port}" for node in local_nodes.nodes)
    argv = localised(
        cache.container["args"],
        LOCAL_VALUES
        | {
            "--port": str(port),
            "--metrics-port": str(metrics_port),
            "--store": store,
            "--api-keys-file": str(key_file),
        },
    )
    env = dict(cache.env) | {PASSWORD_ENV: PASSWORD}
    with running_service(argv, env, tmp_path / "server.log") as proc:
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            path = cache.container[probe]["httpGet"]["path"]
            deadline = time.monotonic() + 30
            while (status := get(f"http://127.0.0.1:{port}{path}")) != 200:
                assert time.monotonic() < deadline, f"{probe} {path}: {status}"
                time.sleep(0.1)
        assert get(f"http://127.0.0.1:{port}/v1/stats") == 401  # the keys are in force
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as answer:
                    assert "prompt_cache_" in answer.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, "the metrics port does not answer"
                time.sleep(0.1)
        proc.terminate()
        started = time.monotonic()
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - started <= exit_bound_seconds(cache.settings.shutdown_timeout)
    assert "redis cluster" in (tmp_path / "server.log").read_text()


def test_the_cache_refuses_to_start_without_the_password(
    layout: Layout, local_nodes: LocalNodes, key_file: Path, tmp_path: Path
) -> None:
    cache = layout.cache
    store = "redis://" + ",".join(f"127.0.0.1:{node.port}" for node in local_nodes.nodes)
    argv = localised(
        cache.container["args"],
        LOCAL_VALUES
        | {"--port": str(free_port()), "--metrics-port": str(free_port()), "--store": store}
        | {"--api-keys-file": str(key_file)},
    )
    with (
        pytest.raises(AssertionError, match="exited"),
        running_service(argv, dict(cache.env), tmp_path / "server.log"),
    ):
        pass
