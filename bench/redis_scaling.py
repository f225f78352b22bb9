"""Scaling out on Redis Cluster: 1, 2 and 3 service replicas on one cluster against one LMDB
replica and Redis itself, for a 32k-token lookup and a 32k prefix fetch and store.

Usage: python -m bench.redis_scaling [--quick]   (also the `redis` scenario of python -m bench)

Everything runs on 127.0.0.1 and is stopped by the code that started it: a Redis Cluster of
three primaries and three replicas (bench/redis_cluster.py; 1 GiB maxmemory per node,
volatile-lru, as the Redis store requires; emptied before each target's turn, so no run
evicts), three `cache-service serve --store redis://...`
replicas on it, one `cache-service serve` on LMDB (`--lmdb-sync nosync`: Redis persists
nothing either) and the Redis peer's plain `redis-server` (bench/peers/redis_peer.py starts
it; given the cluster's total maxmemory and policy).

The workload: 32,768 tokens in 512 blocks of 64, 8 KiB of payload per block (128 B per
token), so a prefix is 4 MiB of distinct random bytes. Per target:
- lookup: a hit on all 512 blocks, records only (no payloads); Redis itself: one pipeline
  of 512 GETRANGEs of 64 B, about what the store reads of each record;
- fetch: the 512 payloads by key (POST /v1/blocks/fetch); Redis: a pipeline of 512 GETs;
- store: 512 new blocks each call (a fresh salt); Redis: a pipeline of 512 SETs with PX.
Every answer is checked (blocks matched, bytes fetched, blocks stored).

Each is timed by one client (c=1: p50 and p99 per request) and by CLIENTS threads at once,
spread round-robin over the replicas (requests/s, the median of ROUNDS runs, with p50 and
p99 of every request). Targets and operations alternate within each round, so that load
from elsewhere on a shared machine hits all of them alike. The machine has 2 cores shared
by six redis-server processes, the services and the client threads, so concurrency stays at
CLIENTS and an added replica adds no core: the rows show what this box gives, not replicas
on machines of their own. Each concurrent row says the CPU a request cost each group of
processes and how busy the machine was ("elsewhere": kernel work such as loopback
networking and page writeback, and other work on the machine). Ratios are
to the LMDB replica measured in the same run.

Also counted, once, through one replica (no MONITOR): the round trips a lookup, a fetch and
a store make to Redis, from strace on the service (on each socket to a node, a turn is a
run of sends followed by receives), and the commands and socket read events on the
primaries (`INFO commandstats` and `INFO stats`, before and after).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench.peers.harness import check_equal, process_stat, stop_process, time_calls
from bench.peers.payloads import block_keys, prefix_blocks
from bench.peers.redis_peer import ensure_redis, hiredis_reason, start_server
from bench.redis_round_trips import count_redis_work, traced_turns
from bench.report import Row, compare, format_table, latency_row, skipped
from bench.scenarios.context import Context
from bench.services import Service, our_service
from cache_service.client import CacheClient
from cache_service.core.tokens import tokens_to_bytes

SCENARIO = "redis"
MODEL = "bench"
BYTES_PER_TOKEN = 128  # 8 KiB per 64-token block: a 32k prefix is 4 MiB
BLOCKS = 512
CLIENTS = 4  # concurrent client threads: modest, the machine has 2 cores
# Per node. Each target's turn starts on an emptied cluster, and no run fills this: at its
# limit Redis evicts even while it answers reads (a 4 MiB reply counts as memory used), so a
# fetch could lose blocks of the very prefix it reads.
NODE_MAXMEMORY_BYTES = 2**30
IDENTITY_KEY = b"pc:identity"  # the services' settings record (core/store/redis/values.py): kept
TTL_MS = 3_600_000  # Redis's own keys expire as the store's do (volatile-lru needs a TTL)
RECORD_READ_BYTES = 64  # what the Redis "lookup" reads of each key: about a record
OPERATIONS = ("lookup", "fetch", "store")
LMDB = "on lmdb, 1 replica"
ONE_REPLICA = "on redis, 1 replica"

Call = Callable[[], object]


@dataclass(frozen=True)
class Workload:
    """The prompt's tokens and the payloads of its 512 blocks."""

    tokens: bytes
    blocks: list[bytes]

    @property
    def prefix_bytes(self) -> int:
        """The payload bytes of the whole prefix."""
        return sum(map(len, self.blocks))


def workload() -> Workload:
    """512 blocks of 64 tokens, 8 KiB of payload each."""
    return Workload(
        tokens_to_bytes(range(7_000_000, 7_000_000 + BLOCKS * 64)),
        prefix_blocks(bytes_per_token=BYTES_PER_TOKEN, seed=14),
    )


def case(operation: str, clients: int) -> str:
    """The case name of a row, e.g. "32k lookup, records only, c=4"."""
    what = {"lookup": "lookup, records only", "fetch": "fetch, 4 MiB", "store": "store, 4 MiB"}
    return f"32k {what[operation]}, c={clients}"


# -- CPU and concurrent runs --------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a process has used so far (/proc/PID/stat)."""
    fields = process_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy so far (/proc/stat: all but idle, iowait)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuMeter:
    """CPU used by groups of processes, by this one (the client) and by the machine."""

    groups: dict[str, list[int]]

    def read(self) -> dict[str, float]:
        """Seconds so far per group, "client" and "machine"."""
        used = {name: sum(map(cpu_seconds, pids)) for name, pids in self.groups.items()}
        times = os.times()
        return {**used, "client": times.user + times.system, "machine": busy_cpu_seconds()}


@dataclass
class Runs:
    """The concurrent runs of one target and operation: rates, request times, CPU used."""

    rates: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    wall: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)

    def cpu_note(self) -> str:
        """CPU per request by group, and how many of the machine's cores were busy."""
        requests = len(self.seconds)
        ours = {k: v for k, v in self.cpu.items() if k != "machine"}
        per = ", ".join(f"{k} {v / requests * 1000:.2f}" for k, v in ours.items())
        busy, others = self.cpu["machine"] / self.wall, (self.cpu["machine"] - sum(ours.values()))
        return (f"CPU ms/req: {per}; {busy:.2f} of {os.cpu_count()} cores busy, "
                f"{max(0.0, others) / self.wall:.2f} elsewhere")  # fmt: skip


def drive(calls: list[Call], runs: Runs, *, duration_seconds: float, meter: CpuMeter) -> None:
    """Run each call in a thread of its own, over and over until the time is up (one untimed
    call each first); add the run's rate, request times and CPU to `runs`."""
    seconds: list[list[float]] = [[] for _ in calls]
    failures: list[BaseException] = []
    ready, go = threading.Barrier(len(calls) + 1), threading.Barrier(len(calls) + 1)
    deadline = [0.0]

    def loop(index: int, call: Call) -> None:
        try:
            call()
        except BaseException as error:  # reported by the main thread, never lost
            failures.append(error)
        ready.wait()  # every thread warmed up before the clock starts
        go.wait()
        while not failures and time.perf_counter() < deadline[0]:
            began = time.perf_counter()
            try:
                call()
            except BaseException as error:
                failures.append(error)
                return
            seconds[index].append(time.perf_counter() - began)

    threads = [threading.Thread(target=loop, args=item) for item in enumerate(calls)]
    for thread in threads:
        thread.start()
    ready.wait()
    before = meter.read()
    began = time.perf_counter()
    deadline[0] = began + duration_seconds
    go.wait()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    after = meter.read()
    if failures:
        raise failures[0]
    timed = [s for per_thread in seconds for s in per_thread]
    runs.rates.append(len(timed) / wall)
    runs.seconds += timed
    runs.wall += wall
    for name, value in after.items():
        runs.cpu[name] = runs.cpu.get(name, 0.0) + value - before[name]


# -- targets: our service and Redis itself ------------------------------------------------------


@dataclass
class Target:
    """What is measured: one call set per client thread, and how to (re)store the prefix."""

    subject: str
    client: str
    threads: list[dict[str, Call]]
    prepare: Call
    meter: CpuMeter
    single: bool  # also timed at c=1


def service_calls(
    client: CacheClient, work: Workload, keys: list[str], tag: str
) -> dict[str, Call]:
    """Lookup, fetch and store through `client`, each checking its answer."""
    salts = itertools.count()

    def lookup() -> object:
        found = client.lookup(MODEL, work.tokens)
        assert found.matched_blocks == BLOCKS, found.matched_blocks
        return found

    def fetch() -> object:
        payloads = client.get_blocks(MODEL, keys, copy=False)
        got = sum(len(p) for p in payloads if p is not None)
        assert len(payloads) == BLOCKS and got == work.prefix_bytes, got
        return payloads

    def store() -> object:
        stored = client.put_prefix(MODEL, work.tokens, work.blocks, salt=f"{tag}-{next(salts)}")
        assert stored == BLOCKS, stored  # every call writes 512 new blocks
        return stored

    return {"lookup": lookup, "fetch": fetch, "store": store}


def prepare(service: Service, work: Workload) -> list[str]:
    """Store the prefix (again, if evicted) and return its block keys, checked byte for byte."""
    with CacheClient(service.url, timeout=120) as client:
        client.put_prefix(MODEL, work.tokens, work.blocks)
        keys = [str(k) for k in client.lookup(MODEL, work.tokens).keys]
        check_equal(work.blocks)([bytes(p or b"") for p in client.get_blocks(MODEL, keys)])
    assert len(keys) == BLOCKS
    return keys


def service_target(
    subject: str, services: list[Service], work: Workload, meter: CpuMeter, stack: ExitStack,
    *, reset: Call | None = None,
) -> Target:  # fmt: skip
    """CLIENTS clients of our service, round-robin over `services`; `reset` empties the
    store before each turn."""
    keys = prepare(services[0], work)
    clients = [stack.enter_context(CacheClient(services[i % len(services)].url, timeout=120))
               for i in range(CLIENTS)]  # fmt: skip
    threads = [service_calls(c, work, keys, f"{subject}-{i}") for i, c in enumerate(clients)]

    def again() -> None:
        if reset is not None:
            reset()
        assert prepare(services[0], work) == keys

    return Target(subject, "our client", threads, again, meter, single=len(services) == 1)


def emptied(cluster: Any) -> Call:
    """A call that deletes every key of `cluster` but the services' settings record."""

    def reset() -> None:
        client = cluster.cluster_client()
        try:
            identity = client.get(IDENTITY_KEY)
            cluster.flush_all()
            if identity is not None:
                client.set(IDENTITY_KEY, identity)
        finally:
            client.close()

    return reset


def redis_calls(client: Any, work: Workload, namespace: bytes) -> dict[str, Call]:
    """The three on a redis-py client (one node or a cluster), pipelined, checked; and
    "prepare", which stores the prefix (again)."""
    keys = block_keys(BLOCKS, namespace=namespace)
    fresh = itertools.count()

    def run(fill: Callable[[Any], object]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        fill(pipe)
        answers: list[Any] = pipe.execute()
        return answers

    def lookup() -> object:
        answers = run(lambda p: [p.getrange(k, 0, RECORD_READ_BYTES - 1) for k in keys])
        assert all(len(a) == RECORD_READ_BYTES for a in answers)
        return answers

    def fetch() -> object:
        answers = run(lambda p: [p.get(k) for k in keys])
        assert sum(len(a) for a in answers if a is not None) == work.prefix_bytes
        return answers

    def store() -> object:
        prefix = next(fresh).to_bytes(4, "little")
        pairs = zip(keys, work.blocks, strict=True)
        answers = run(lambda p: [p.set(prefix + k, v, px=TTL_MS) for k, v in pairs])
        assert all(answers)
        return answers

    def restore() -> object:
        run(lambda p: [p.set(k, v, px=TTL_MS) for k, v in zip(keys, work.blocks, strict=True)])
        check_equal(work.blocks)(fetch())
        return None

    return {"lookup": lookup, "fetch": fetch, "store": store, "prepare": restore}


def redis_target(
    subject: str, connect: Callable[[], Any], work: Workload, meter: CpuMeter, stack: ExitStack,
    *, reset: Call,
) -> Target:  # fmt: skip
    """CLIENTS redis-py clients, each with its own keys; `reset` empties Redis each turn."""
    clients = [connect() for _ in range(CLIENTS)]
    for client in clients:
        stack.callback(client.close)
    threads = [redis_calls(c, work, f"{subject}-{i}".encode()) for i, c in enumerate(clients)]

    def restore() -> None:
        reset()
        for calls in threads:
            calls["prepare"]()

    return Target(subject, "redis-py pipe", threads, restore, meter, single=True)


@contextmanager
def redis_peer() -> Iterator[tuple[int, int]]:
    """The Redis peer's redis-server (bench/peers/redis_peer.py): its port and PID."""
    path, reason = ensure_redis(allow_install=False)
    if path is None:
        raise RuntimeError(reason)
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as folder:
        process, port = start_server(path, folder)
        try:
            yield port, process.pid
        finally:
            stop_process(process)


# -- round trips --------------------------------------------------------------------------------


def round_trip_rows(cluster: Any, service: Service, work: Workload, count: int) -> list[Row]:
    """What a lookup, a fetch and a store cost on the cluster: round trips seen by strace on
    the service, read events and commands counted by the primaries, in the same window."""
    keys = prepare(service, work)
    ports = {address.port for address in cluster.addresses}
    rows = []
    with CacheClient(service.url, timeout=120) as client:
        calls = service_calls(client, work, keys, "count")
        for operation in OPERATIONS:
            counted: list[tuple[float, dict[str, float], int]] = []

            def run_all(call: Call = calls[operation]) -> None:
                for _ in range(count):
                    call()

            def count_all(counted: list[Any] = counted, run_all: Call = run_all) -> None:
                counted.append(count_redis_work(cluster, run_all, count))

            in_sequence: float | None
            try:
                turns, in_sequence = traced_turns(service.process.pid, ports, count_all, count)
                traced = f"{turns:.2f} send/receive turns over all node sockets"
            except (RuntimeError, OSError, subprocess.SubprocessError) as error:
                in_sequence, traced = None, f"no strace count: {error}"
                if not counted:
                    count_all()
            reads, commands, busy = counted[0]
            listed = ", ".join(f"{n} {v:.2f}" for n, v in sorted(commands.items()))
            note = (f"{traced}; {reads:.2f} read events on {busy} primaries; commands per call: "
                    f"{listed}")  # fmt: skip
            extra = {"turns": traced, "read_events": reads, "commands_per_call": commands,
                     "primaries": busy}  # fmt: skip
            rows.append(Row(SCENARIO, f"32k {operation}: Redis round trips", "redis cluster",
                            "strace + INFO stats", in_sequence, "in sequence", samples=count,
                            note=note, extra=extra))  # fmt: skip
    return rows


def resyncs(cluster: Any) -> int:
    """Full resynchronisations of a replica beyond each replica's first (a replica that fell
    behind the write stream and was cut off), from the nodes' logs."""
    full = sum(
        cluster.log_path(a).read_text(errors="replace").count("Full resync requested")
        for a in cluster.addresses
    )
    return max(0, int(full) - len(cluster.addresses) // 2)


# -- the scenario -------------------------------------------------------------------------------


def measure(ctx: Context, targets: list[Target]) -> list[Row]:
    """ROUNDS rounds, each over every target and operation: c=1 first, then CLIENTS."""
    rounds, duration = ctx.reps(1, 3), 0.5 if ctx.quick else 3.0
    single: dict[tuple[str, str], list[float]] = {}
    runs: dict[tuple[str, str], Runs] = {}
    for _ in range(rounds):
        for target in targets:
            target.prepare()
            for operation in OPERATIONS if target.single else ():
                reps = ctx.reps(5, 30 if operation == "store" else 200) // rounds
                seconds = time_calls(target.threads[0][operation], repetitions=reps, warmup=2)
                single.setdefault((target.subject, operation), []).extend(seconds)
            for operation in OPERATIONS:
                calls = [thread[operation] for thread in target.threads]
                drive(calls, runs.setdefault((target.subject, operation), Runs()),
                      duration_seconds=duration, meter=target.meter)  # fmt: skip
    rows = []
    for target in targets:
        for operation in OPERATIONS if target.single else ():
            seconds = single[(target.subject, operation)]
            rows.append(latency_row(SCENARIO, case(operation, 1), target.subject, target.client,
                                    seconds))  # fmt: skip
        for operation in OPERATIONS:
            run = runs[(target.subject, operation)]
            timed = latency_row(SCENARIO, case(operation, CLIENTS), "", "", run.seconds)
            rows.append(Row(SCENARIO, timed.case, target.subject, f"{target.client}, {CLIENTS} thr",
                            statistics.median(run.rates), "req/s", timed.p50, timed.p99,
                            len(run.seconds), note=run.cpu_note(),
                            extra={"rounds": run.rates}))  # fmt: skip
    return rows


def scale_notes(rows: list[Row]) -> None:
    """Ratios to the LMDB replica in the same run; the cluster rows also say their multiple
    of the cluster's 1-replica figure."""
    by_key = {(r.case, r.subject): r for r in rows}
    for row in rows:
        reference = by_key.get((row.case, LMDB))
        if row.subject == LMDB or reference is None or row.value is None:
            continue
        compare(row, reference)
        one = by_key.get((row.case, ONE_REPLICA))
        said = "vs lmdb"
        if row.subject.startswith("on redis, ") and one is not None and one.value:
            said += f"; {row.value / one.value:.2f}x 1 replica"
        row.note = f"{said}; {row.note}" if row.note else said


def run(ctx: Context) -> list[Row]:
    """The `redis` scenario of python -m bench."""
    reason = hiredis_reason() or ensure_redis(allow_install=ctx.allow_install)[1]
    if reason:
        return [skipped(SCENARIO, case("lookup", CLIENTS), "redis cluster", reason)]
    import redis  # noqa: PLC0415 - optional (the bench extra), checked above

    from bench.redis_cluster import LocalRedisCluster  # noqa: PLC0415 - imports redis-py

    work = workload()
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-redis-")))
        lmdb = stack.enter_context(our_service(capacity="4GiB", lmdb_sync="nosync"))
        cluster = stack.enter_context(
            LocalRedisCluster(
                folder, maxmemory_bytes=NODE_MAXMEMORY_BYTES, maxmemory_policy="volatile-lru"
            )
        )
        url = "redis://" + ",".join(f"{a.host}:{a.port}" for a in cluster.primaries())
        replicas = [stack.enter_context(our_service(store=url)) for _ in range(3)]
        port, peer_pid = stack.enter_context(redis_peer())
        with redis.Redis(host="127.0.0.1", port=port) as admin:  # the cluster's total limit
            admin.config_set("maxmemory", 3 * NODE_MAXMEMORY_BYTES)
            admin.config_set("maxmemory-policy", "volatile-lru")
        nodes = [cluster.pid(a) for a in cluster.addresses]
        rows = round_trip_rows(cluster, replicas[0], work, ctx.reps(10, 200))
        targets = [service_target(LMDB, [lmdb], work, CpuMeter({"service": [lmdb.process.pid]}),
                                  stack)]  # fmt: skip
        for count in (1, 2, 3):
            meter = CpuMeter({"services": [r.process.pid for r in replicas[:count]],
                              "redis": nodes})  # fmt: skip
            subject = f"on redis, {count} replica" + "s" * (count > 1)
            targets.append(service_target(subject, replicas[:count], work, meter, stack,
                                          reset=emptied(cluster)))  # fmt: skip
        direct = CpuMeter({"redis": nodes})
        targets.append(redis_target("redis cluster, direct", cluster.cluster_client, work,
                                    direct, stack, reset=emptied(cluster)))  # fmt: skip
        connect = partial(redis.Redis, host="127.0.0.1", port=port, socket_timeout=60)
        peer = stack.enter_context(connect())
        targets.append(redis_target("redis peer, 1 node", connect, work,
                                    CpuMeter({"redis": [peer_pid]}), stack,
                                    reset=peer.flushall))  # fmt: skip
        measured = measure(ctx, targets)
        scale_notes(measured)
        cut_off = resyncs(cluster)
    rows[:0] = measured[:6]  # the LMDB rows first
    rows += measured[6:]
    rows.append(Row(SCENARIO, "replicas cut off and fully resynced", "redis cluster",
                    "the nodes' logs", cut_off, "resyncs",
                    note="each costs a full copy of a primary's data"))  # fmt: skip
    return rows


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about 30 s: a smoke check")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = run(Context(quick=args.quick, allow_install=False))
    print(format_table(rows))
    print(f"{CLIENTS} client threads, {os.cpu_count()} cores; "
          f"{time.perf_counter() - started:.0f} s")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
