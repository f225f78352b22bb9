"""A real Redis Cluster on 127.0.0.1 for tests and benchmarks: redis-server processes,
`redis-cli --cluster create`, the topology read back from CLUSTER NODES, kill -9 of a primary
and its failover timed.

    with LocalRedisCluster(tmp_path) as cluster:      # 3 primaries, 1 replica each
        client = cluster.cluster_client()             # redis.cluster.RedisCluster
        primary = cluster.primaries()[0]
        cluster.kill_primary(primary)                 # SIGKILL by PID
        seconds = cluster.wait_for_failover(primary)  # its replica promoted, cluster_state:ok

Every process is started here and stopped here by PID (SIGTERM, then SIGKILL after a bound);
an `atexit` hook and, on Linux, a parent-death signal stop them if the test run dies first.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple, Self

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

HOST = "127.0.0.1"
SLOTS = 16384
BUS_PORT_OFFSET = 10000  # Redis Cluster's bus listens on the data port + 10000
POLL_SECONDS = 0.05
PORT_ATTEMPTS = 5  # a free port can be taken between our probe and redis-server's bind
LOG_TAIL_LINES = 15


class Address(NamedTuple):
    """A node's host and data port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class NodeView:
    """One line of CLUSTER NODES: a node as one member of the cluster sees it."""

    node_id: str
    address: Address
    flags: frozenset[str]
    primary_id: str | None
    slots: tuple[tuple[int, int], ...]

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags

    @property
    def failed(self) -> bool:
        return bool({"fail", "fail?"} & self.flags)

    @property
    def role_key(self) -> tuple[str, bool, str | None]:
        """Who this node is, whether it is a primary, and whom it follows."""
        return (self.node_id, self.is_primary, self.primary_id)

    @property
    def slot_count(self) -> int:
        return sum(last - first + 1 for first, last in self.slots)


class ClusterError(RuntimeError):
    """The cluster did not start, form or recover in time (the message carries the node logs)."""


def parse_cluster_nodes(text: str) -> list[NodeView]:
    """The nodes listed by CLUSTER NODES (slots being migrated, `[...]`, are left out)."""
    views = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        host, _, port = fields[1].split("@")[0].rpartition(":")
        slots = []
        for field in fields[8:]:
            if field.startswith("["):
                continue
            first, _, last = field.partition("-")
            slots.append((int(first), int(last or first)))
        views.append(
            NodeView(
                node_id=fields[0],
                address=Address(host, int(port)),
                flags=frozenset(fields[2].split(",")),
                primary_id=None if fields[3] == "-" else fields[3],
                slots=tuple(slots),
            )
        )
    return views


def parse_info(text: str) -> dict[str, str]:
    """The `key:value` lines of CLUSTER INFO."""
    pairs = (line.partition(":") for line in text.splitlines() if ":" in line)
    return {key: value.strip() for key, _, value in pairs}


def find_free_port(taken: set[int]) -> int:
    """A port free on 127.0.0.1 whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            port: int = probe.getsockname()[1]
        bus = port + BUS_PORT_OFFSET
        if bus > 65535 or {port, bus, port - BUS_PORT_OFFSET} & taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((HOST, bus))
            except OSError:
                continue
        return port
    raise ClusterError("no free pair of ports (P, P+10000) on 127.0.0.1 after 200 tries")


def _parent_death_signal() -> Callable[[], None] | None:
    """On Linux, a pre-exec hook that has the kernel SIGTERM the child if this process dies."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    # Fires when the thread that forked exits: start clusters from a long-lived thread.
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class _Process:
    address: Address
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]


class LocalRedisCluster:
    """Real redis-server processes formed into one Redis Cluster on 127.0.0.1."""

    def __init__(
        self,
        directory: Path,
        *,
        primaries: int = 3,
        replicas_per_primary: int = 1,
        node_timeout_ms: int = 1000,
        maxmemory_bytes: int | None = None,
        maxmemory_policy: str | None = None,
        extra_args: Sequence[str] = (),
        redis_server: str | Path = "redis-server",
        redis_cli: str | Path = "redis-cli",
        timeout_seconds: float = 30.0,
    ) -> None:
        self.directory = directory
        self.node_count = primaries * (1 + replicas_per_primary)
        self.replicas_per_primary = replicas_per_primary
        self.node_timeout_ms = node_timeout_ms
        self.timeout_seconds = timeout_seconds
        self._redis_server = str(redis_server)
        self._redis_cli = str(redis_cli)
        self._extra_args = list(extra_args)
        if maxmemory_bytes is not None:
            self._extra_args = ["--maxmemory", str(maxmemory_bytes), *self._extra_args]
        if maxmemory_policy is not None:
            self._extra_args = ["--maxmemory-policy", maxmemory_policy, *self._extra_args]
        self._processes: dict[Address, _Process] = {}
        self._clients: dict[Address, redis.Redis] = {}
        self._killed: dict[Address, tuple[float, tuple[str, ...]]] = {}

    # Life cycle

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> Self:
        """Start the nodes, create the cluster and wait until it is ready; stop all on failure."""
        self.directory.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        try:
            self._start_nodes()
            self._create_cluster()
            self.wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace_seconds: float = 5.0) -> None:
        """Stop every process started here: SIGTERM, then SIGKILL after `grace_seconds`."""
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        running = [p for p in self._processes.values() if p.popen.poll() is None]
        for process in running:
            process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for process in running:
            try:
                process.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()
        for process in self._processes.values():
            process.log_file.close()
        atexit.unregister(self.stop)

    def _command(self, port: int) -> list[str]:
        return [
            self._redis_server, "--port", str(port), "--bind", HOST, "--dir", str(self.directory),
            "--cluster-enabled", "yes", "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-config-file", str(self.directory / f"nodes-{port}.conf"),
            "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
            # A replica syncs at once rather than after the default 5 s wait for other replicas.
            "--repl-diskless-sync-delay", "0",
            # stop() must be prompt: a primary would wait up to 10 s for lagging replicas.
            "--shutdown-on-sigterm", "now",
            *self._extra_args,
        ]  # fmt: skip

    def _spawn(self, taken: set[int]) -> _Process:
        port = find_free_port(taken)
        taken.update({port, port + BUS_PORT_OFFSET})
        log_path = self.directory / f"node-{port}.log"
        log_file = log_path.open("ab")
        popen = subprocess.Popen(
            self._command(port),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=_parent_death_signal(),  # noqa: PLW1509 (a prctl call, no locks taken)
        )
        process = _Process(Address(HOST, port), popen, log_path, log_file)
        self._processes[process.address] = process
        return process

    def _start_nodes(self) -> None:
        taken: set[int] = set()
        pending = [self._spawn(taken) for _ in range(self.node_count)]
        for _ in range(PORT_ATTEMPTS):
            retry = [p for p in pending if not self._await_node(p)]
            if not retry:
                return
            for process in retry:  # lost a race for its port: forget it, start another
                process.log_file.close()
                del self._processes[process.address]
                client = self._clients.pop(process.address, None)
                if client is not None:
                    client.close()
            pending = [self._spawn(taken) for _ in retry]
        raise ClusterError(f"nodes kept losing their ports:\n{self.logs()}")

    def _await_node(self, process: _Process) -> bool:
        """True once the node answers PING; False if it lost its port; raise otherwise."""
        deadline = time.monotonic() + self.timeout_seconds
        while time.monotonic() < deadline:
            if process.popen.poll() is not None:
                if "Address already in use" in process.log_path.read_text(errors="replace"):
                    return False
                raise ClusterError(f"{process.address} exited:\n{self.logs()}")
            try:
                if self.node_client(process.address).ping():
                    return True
            except redis.ConnectionError:
                time.sleep(POLL_SECONDS)
        raise ClusterError(f"{process.address} did not answer PING:\n{self.logs()}")

    def _create_cluster(self) -> None:
        addresses = [str(address) for address in self._processes]
        command = [
            self._redis_cli,
            "--cluster", "create", *addresses,
            "--cluster-replicas", str(self.replicas_per_primary),
            "--cluster-yes",
        ]  # fmt: skip
        log_path = self.directory / "cluster-create.log"
        with log_path.open("wb") as log:
            result = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=self.timeout_seconds,
                check=False,
            )
        if result.returncode != 0:
            raise ClusterError(
                f"redis-cli --cluster create exited with {result.returncode}:\n"
                f"{log_path.read_text(errors='replace')}\n{self.logs()}"
            )

    # Addresses, processes and clients

    @property
    def addresses(self) -> list[Address]:
        """Every node started, killed ones included."""
        return list(self._processes)

    def live_addresses(self) -> list[Address]:
        """The nodes whose process is still running."""
        return [a for a, p in self._processes.items() if p.popen.poll() is None]

    def pid(self, address: Address) -> int:
        """The PID of the redis-server serving `address`."""
        return self._processes[address].popen.pid

    def log_path(self, address: Address) -> Path:
        """The file the node at `address` logs to."""
        return self._processes[address].log_path

    def logs(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of every node's log, for error messages."""
        parts = []
        for address, process in self._processes.items():
            tail = process.log_path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {address} (pid {process.popen.pid}) ---\n" + "\n".join(tail))
        return "\n".join(parts)

    def node_client(self, address: Address) -> redis.Redis:
        """A plain client of one node (decoded strings), kept open until stop()."""
        if address not in self._clients:
            self._clients[address] = redis.Redis(
                host=address.host,
                port=address.port,
                decode_responses=True,
                socket_timeout=2.0,
                socket_connect_timeout=2.0,
            )
        return self._clients[address]

    def cluster_client(self, **kwargs: Any) -> RedisCluster:
        """A cluster client (bytes) seeded with every live node; the caller closes it."""
        options: dict[str, Any] = {
            "startup_nodes": [
                ClusterNode(a.host, a.port)  # type: ignore[no-untyped-call]
                for a in self.live_addresses()
            ],
            # redis-py 6+ takes only the count from this for its cluster layer: a connection
            # error is retried at once after reloading the slot map, a CLUSTERDOWN after 0.25 s,
            # so until the replica is promoted the caller does see errors. redis-py 5 gives it
            # to each node's connection instead (backoff included), with 3 cluster-level tries.
            "retry": Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=10),
            "socket_timeout": 2.0,
            "socket_connect_timeout": 2.0,
        }
        options.update(kwargs)
        return RedisCluster(**options)

    # Topology

    def _cluster_text(self, address: Address, *command: str) -> str:
        # Two words, not "CLUSTER NODES": redis-py then leaves the reply as the server's text.
        client = self.node_client(address)
        text = client.execute_command("CLUSTER", *command)  # type: ignore[no-untyped-call]
        return str(text)

    def nodes(self, seen_from: Address | None = None) -> list[NodeView]:
        """CLUSTER NODES as one live node (the first by default) sees the cluster."""
        return parse_cluster_nodes(
            self._cluster_text(seen_from or self.live_addresses()[0], "NODES")
        )

    def primaries(self) -> list[Address]:
        """The primaries that serve slots and are not failed, in port order."""
        found = [n.address for n in self.nodes() if n.is_primary and n.slots and not n.failed]
        return sorted(found, key=lambda a: a.port)

    def replicas_of(self, primary: Address) -> list[Address]:
        """The replicas that follow `primary`."""
        views = self.nodes()
        ids = {n.node_id for n in views if n.address == primary}
        return sorted((n.address for n in views if n.primary_id in ids), key=lambda a: a.port)

    def slots_of(self, primary: Address) -> tuple[tuple[int, int], ...]:
        """The slot ranges `primary` serves."""
        return next((n.slots for n in self.nodes() if n.address == primary), ())

    def primaries_of(self, keys: Iterable[str]) -> dict[str, Address]:
        """The primary serving each key's slot, from one read of the topology."""
        owners = {
            slot: node.address
            for node in self.nodes()
            if node.is_primary and not node.failed
            for first, last in node.slots
            for slot in range(first, last + 1)
        }
        return {key: owners[key_slot(key.encode())] for key in keys}

    def _unready(self) -> str | None:
        """Why the cluster is not ready yet, or None when every live node agrees it is."""
        for address in self.live_addresses():
            info = parse_info(self._cluster_text(address, "INFO"))
            state, slots_ok = info.get("cluster_state"), info.get("cluster_slots_ok")
            if state != "ok" or slots_ok != str(SLOTS):
                return f"{address}: cluster_state {state}, {slots_ok} slots ok"
            # Nodes are never forgotten here, killed ones included: all must have met.
            if info.get("cluster_known_nodes") != str(self.node_count):
                return f"{address} knows {info.get('cluster_known_nodes')} nodes"
        views = [self.nodes(a) for a in self.live_addresses()]
        roles = [{n.role_key for n in v if not n.failed} for v in views]
        if any(r != roles[0] for r in roles):
            return "the nodes disagree about who is a primary and who follows whom"
        # A replica that never synced would refuse to fail over (its data counts as too old).
        for node in views[0]:
            if not node.is_primary and not node.failed:
                link = self.node_client(node.address).info("replication").get("master_link_status")
                if link != "up":
                    return f"replica {node.address}: master_link_status {link}"
        return None

    def wait_until_ready(self, timeout_seconds: float | None = None) -> float:
        """Wait until every live node reports cluster_state:ok with all slots served, all agree
        on the roles and every replica's link is up; return the seconds it took."""
        started = time.monotonic()
        deadline = started + (timeout_seconds or self.timeout_seconds)
        while (reason := self._unready()) is not None:
            if time.monotonic() > deadline:
                raise ClusterError(f"cluster not ready: {reason}\n{self.logs()}")
            time.sleep(POLL_SECONDS)
        return time.monotonic() - started

    # Failure

    def kill_primary(self, primary: Address) -> None:
        """SIGKILL the process of `primary` (a serving primary) and reap it."""
        if primary not in self.primaries():
            raise ValueError(f"{primary} is not a serving primary")
        replicas = self.replicas_of(primary)
        replica_ids = tuple(n.node_id for n in self.nodes() if n.address in replicas)
        process = self._processes[primary]
        self._killed[primary] = (time.monotonic(), replica_ids)
        os.kill(process.popen.pid, signal.SIGKILL)
        process.popen.wait()
        client = self._clients.pop(primary, None)
        if client is not None:
            client.close()

    def wait_for_failover(self, primary: Address, timeout_seconds: float | None = None) -> float:
        """Wait until a replica of the killed `primary` serves its slots and every live node
        reports cluster_state:ok again; return the seconds since the kill."""
        if primary not in self._killed:
            raise ValueError(f"{primary} was not killed by kill_primary()")
        killed_at, replica_ids = self._killed[primary]
        deadline = time.monotonic() + (timeout_seconds or self.timeout_seconds)
        while True:
            reason = self._not_failed_over(primary, replica_ids)
            if reason is None:
                return time.monotonic() - killed_at
            if time.monotonic() > deadline:
                raise ClusterError(f"no failover of {primary}: {reason}\n{self.logs()}")
            time.sleep(POLL_SECONDS)

    def _not_failed_over(self, primary: Address, replica_ids: tuple[str, ...]) -> str | None:
        promoted = [
            n
            for a in self.live_addresses()
            for n in self.nodes(a)
            if "myself" in n.flags and n.node_id in replica_ids and n.is_primary and n.slots
        ]
        if not promoted:
            return "no replica promoted yet"
        for address in self.live_addresses():
            if any(n.address == primary and n.slots for n in self.nodes(address)):
                return f"{address} still maps slots to {primary}"
        return self._unready()

    # Data and settings

    def config_set(self, parameter: str, value: str | int, address: Address | None = None) -> None:
        """CONFIG SET on one node, or on every live node when `address` is None."""
        for target in [address] if address else self.live_addresses():
            self.node_client(target).config_set(parameter, value)

    def flush_all(self) -> None:
        """Delete every key: FLUSHALL on each live primary (replicas follow)."""
        for address in self.primaries():
            self.node_client(address).flushall()
