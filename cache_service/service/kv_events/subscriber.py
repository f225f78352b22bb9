"""Subscribes to engines' KV events over ZMQ and keeps their views (one background thread).

Each (engine, rank) gets its own SUB socket, connected to the rank's endpoint and subscribed
to the configured topic prefix ("" for all): a stream is then one publisher's numbering, which
a batch's own `data_parallel_rank` (absent in older releases) could not guarantee. Messages are
``[topic, seq (8 bytes big-endian), payload]``.

Sequence numbers are judged by `SequenceTracker`. On a gap mid-stream, if the engine has a
replay endpoint, a DEALER asks its ROUTER for the batches from the first missing one
(replay.py: either release's reply layout); a gap replay cannot fill marks the rank stale,
as does a gap without a replay endpoint. A restart (numbers starting over) rebuilds the
rank's view; the history before a restarted publisher's first message we saw is replayed
when possible. A stale rank becomes sound again on a restart or on an AllBlocksCleared.

Connections are watched (ZMQ's socket monitor, and ZMTP heartbeats on the SUB so a host that
vanished is a disconnect too). When a rank first connects and has a replay endpoint, its
history is asked for at once, so a service started after an idle engine knows its cache
before any new event. When a rank reconnects, the batch we applied last is asked for: the
same publisher still holds it byte for byte, and what it sent meanwhile is applied; anything
else is a restarted publisher, whose view is rebuilt from its history. Liveness
(liveness.py) follows the connections, the messages and, when set, a silence timeout.

A thread rather than asyncio: the loop is small and CPU-bound, replay is a blocking
exchange with a deadline, and the views are read by request handlers in any thread; it
never holds up the server's event loop. Every wait is bounded (poll slices of
`poll_interval_seconds`), and a round reads each ready stream for a share of
`DRAIN_SECONDS` at most, checking the stop flag between messages: `stop` returns within
about one message's handling (a 32k-token batch: some 12 ms) even while publishers flood.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash
import zmq
from zmq.utils.monitor import recv_monitor_message

from cache_service.core.engines.decoding import (
    AllBlocksCleared,
    BlockStored,
    MalformedEvent,
    decode_batch,
)
from cache_service.core.engines.sequence import SequenceTracker, Verdict
from cache_service.core.engines.views import EngineViews
from cache_service.service.kv_events.config import EngineConfig
from cache_service.service.kv_events.counters import EngineCounters
from cache_service.service.kv_events.liveness import (
    DISCONNECTED,
    NO_HISTORY,
    SILENT,
    EngineLiveness,
    RankLiveness,
    engine_liveness,
)
from cache_service.service.kv_events.replay import ReplayResult, request_replay

log = logging.getLogger("cache_service.kv_events")

VerifyHook = Callable[[EngineConfig, BlockStored], bool | None]
RECEIVE_HWM = 100_000  # batches a stream may queue while replay runs (vLLM's PUB HWM)
MAX_DRAIN = 1000  # messages read from one stream before looking at the others
# A round's reading time, shared by the ready streams: a flooded stream cannot starve the
# others, and the stop flag and connection events are looked at again soon.
DRAIN_SECONDS = 0.05
HEARTBEAT_SECONDS = 2.0  # ZMTP PINGs on each SUB; no answer for 3 intervals is a disconnect
MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


@dataclass(eq=False)
class _Stream:
    engine: EngineConfig
    rank: int
    endpoint: str
    replay_endpoint: str | None
    counters: EngineCounters
    tracker: SequenceTracker = field(default_factory=SequenceTracker)
    sub: zmq.Socket[Any] | None = None
    monitor: zmq.Socket[Any] | None = None
    stale: bool = False
    liveness: RankLiveness = field(default_factory=RankLiveness)
    last_batch: tuple[int, int] | None = None  # (seq, XXH3-64 of its payload) applied last


class KvEventSubscriber:
    """Feeds `views` from every configured engine's KV events until stopped."""

    def __init__(
        self,
        engines: Sequence[EngineConfig],
        views: EngineViews,
        *,
        verify: VerifyHook | None = None,
        replay_timeout_seconds: float = 2.0,
        poll_interval_seconds: float = 0.05,
        mismatch_alarm_after: int = 3,
        silence_timeout_seconds: float = 0.0,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
    ) -> None:
        self.engines = list(engines)
        self.views = views
        self.silence_timeout_seconds = silence_timeout_seconds  # 0: silence is no sign
        self.heartbeat_seconds = heartbeat_seconds
        self.replay_timeout_seconds = replay_timeout_seconds
        self.poll_interval_seconds = poll_interval_seconds
        self.mismatch_alarm_after = mismatch_alarm_after
        self._verify = verify
        self._counters = {engine.name: EngineCounters() for engine in self.engines}
        self._streams = [
            _Stream(engine, ranked.rank, ranked.endpoint, ranked.replay_endpoint, counters)
            for engine in self.engines
            for ranked in engine.ranks()
            for counters in [self._counters[engine.name]]
        ]
        self._context: zmq.Context[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()

    def start(self, *, timeout_seconds: float = 5.0) -> None:
        """Open the sockets and start the thread; returns once every SUB is connecting."""
        if self._thread is not None:
            raise RuntimeError("the subscriber is already started")
        self._context = zmq.Context()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_seconds):
            raise TimeoutError("the KV-event subscriber did not start")

    def stop(self, *, timeout_seconds: float = 5.0) -> bool:
        """Stop the thread and close every socket; False if it did not end in time."""
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        self._stop.set()
        thread.join(timeout_seconds)
        if thread.is_alive():
            log.error("the KV-event subscriber did not stop within %.1f s", timeout_seconds)
            return False
        if self._context is not None:
            self._context.term()  # every socket was closed by the thread
            self._context = None
        return True

    def __enter__(self) -> KvEventSubscriber:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stats(self) -> dict[str, EngineCounters]:
        """Each engine's counters, copied."""
        return {name: counters.snapshot() for name, counters in self._counters.items()}

    def stale_engines(self) -> list[str]:
        """The engines with a rank whose view may miss events."""
        return [name for name, counters in self._counters.items() if counters.stale]

    def liveness(self) -> dict[str, EngineLiveness]:
        """Each engine: live, or down since when and why."""
        ranks: dict[str, list[RankLiveness]] = {engine.name: [] for engine in self.engines}
        for stream in self._streams:
            ranks[stream.engine.name].append(stream.liveness)
        return {name: engine_liveness(states) for name, states in ranks.items()}

    # The subscriber's thread: everything below runs in it alone.

    def _run(self) -> None:
        assert self._context is not None
        poller = zmq.Poller()
        try:
            for stream in self._streams:
                self._open(stream)
                assert stream.sub is not None and stream.monitor is not None
                poller.register(stream.sub, zmq.POLLIN)
                poller.register(stream.monitor, zmq.POLLIN)
            self._ready.set()
            interval_ms = max(1, int(self.poll_interval_seconds * 1000))
            while not self._stop.is_set():
                ready = dict(poller.poll(interval_ms))
                if self.silence_timeout_seconds > 0:
                    self._check_silence()
                # Connection events first: a disconnect must be noted before a restarted
                # publisher's first (low) numbers are judged, or they pass for duplicates.
                for stream in self._streams:
                    if stream.monitor in ready:
                        self._watch_connection(stream)
                draining = [stream for stream in self._streams if stream.sub in ready]
                share = DRAIN_SECONDS / max(1, len(draining))
                for stream in draining:
                    if self._stop.is_set():
                        break
                    self._drain(stream, deadline=time.monotonic() + share)
        except Exception:  # the loop must never die silently: log, and let stop() see it
            log.exception("the KV-event subscriber failed")
        finally:
            for stream in self._streams:
                self._close(stream)
            self._ready.set()

    def _open(self, stream: _Stream) -> None:
        assert self._context is not None
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, stream.engine.topic.encode())
        if self.heartbeat_seconds > 0:
            interval_ms = max(1, int(self.heartbeat_seconds * 1000))
            sub.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * interval_ms)
        stream.monitor = sub.get_monitor_socket(MONITORED)
        sub.connect(stream.endpoint)
        stream.sub = sub

    def _close(self, stream: _Stream) -> None:
        if stream.sub is not None:
            if stream.monitor is not None:
                stream.sub.disable_monitor()
                stream.monitor.close(linger=0)
                stream.monitor = None
            stream.sub.close(linger=0)
            stream.sub = None

    def _watch_connection(self, stream: _Stream) -> None:
        assert stream.monitor is not None
        while stream.monitor.poll(0):
            event = recv_monitor_message(stream.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # The next numbers may come from a restarted publisher.
                stream.tracker.note_reconnect()
                stream.liveness.connected = False
                self._went_down(stream, DISCONNECTED)
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected(stream)

    def _connected(self, stream: _Stream) -> None:
        """A (re)connection: ask for the history, or check who answers now."""
        liveness = stream.liveness
        first = not liveness.ever_connected
        liveness.connected = liveness.ever_connected = True
        if stream.replay_endpoint is None:
            if first:
                self._heard(stream)  # nothing to be wrong about yet
            return  # a reconnection: up again at its first message, which the tracker judges
        if stream.tracker.last_live is None:
            self._replay_history(stream)
        else:
            self._resume(stream)

    def _replay_history(self, stream: _Stream) -> None:
        """The publisher's buffered history, applied before any live message."""
        result = self._replay(stream, 0)
        for seq, payload in result.batches:
            if stream.tracker.on_history(seq).verdict is not Verdict.DUPLICATE:
                stream.counters.replayed_batches += 1
                self._apply(stream, payload, seq)
        if result.complete:
            self._heard(stream)
            return
        stream.liveness.note(NO_HISTORY)
        self.views.set_down(stream.engine.name, stream.rank, True)
        if result.batches:
            # The history's end never came: later batches may remove blocks applied here.
            self._lost(stream)

    def _resume(self, stream: _Stream) -> None:
        """After a reconnection: the same publisher (apply what it sent meanwhile) or a
        restarted one (rebuild the view from its history)."""
        last = stream.last_batch
        start = stream.tracker.last_live if last is None else last[0]
        assert start is not None
        result = self._replay(stream, start)
        if not result.complete:
            return  # no answer: the first live message decides
        first = result.batches[0] if result.batches else None
        if last is not None and first is not None and first[0] == last[0]:
            same = xxhash.xxh3_64_intdigest(first[1]) == last[1]
        else:
            same = False
        if same:
            stream.tracker.note_same_publisher()
            holes = False
            for seq, payload in result.batches[1:]:
                replayed = stream.tracker.on_replayed(seq)
                if replayed.verdict is not Verdict.DUPLICATE:
                    holes |= replayed.verdict is Verdict.GAP
                    stream.counters.replayed_batches += 1
                    self._apply(stream, payload, seq)
            if holes:
                self._lost(stream)
            self._heard(stream)
            return
        if first is not None and first[0] > start:
            why = f"its replay buffer no longer holds batch {start}: taken as a restart"
        else:
            why = f"after reconnecting, its batch {start} is not the one applied"
        self._restarted(stream, why)
        stream.tracker.start_over()
        stream.last_batch = None
        self._replay_history(stream)

    def _restarted(self, stream: _Stream, why: str) -> None:
        stream.counters.restarts += 1
        forgotten = self.views.reset(stream.engine.name, stream.rank)
        self._set_stale(stream, False)
        log.warning(
            "engine %s rank %d: the publisher restarted (%s); its view is rebuilt "
            "(%d entries forgotten)",
            stream.engine.name,
            stream.rank,
            why,
            forgotten,
        )

    def _heard(self, stream: _Stream) -> None:
        if stream.liveness.come_up(time.monotonic()):
            self.views.set_down(stream.engine.name, stream.rank, False)
            log.info("engine %s rank %d is up", stream.engine.name, stream.rank)

    def _went_down(self, stream: _Stream, reason: str) -> None:
        self.views.set_down(stream.engine.name, stream.rank, True)
        if stream.liveness.go_down(reason):
            stream.counters.downs += 1
            log.warning("engine %s rank %d is down (%s)", stream.engine.name, stream.rank, reason)

    def _check_silence(self) -> None:
        deadline = time.monotonic() - self.silence_timeout_seconds
        for stream in self._streams:
            if stream.liveness.up and stream.liveness.heard_at < deadline:
                self._went_down(stream, SILENT)

    def _drain(self, stream: _Stream, *, deadline: float) -> None:
        """Read the stream's queued messages until none is left, `deadline`, or stop."""
        assert stream.sub is not None and stream.monitor is not None
        for _ in range(MAX_DRAIN):
            if self._stop.is_set() or time.monotonic() >= deadline:
                return
            # A disconnect noticed while this stream was being read (a restart mid-drain)
            # is noted before the next number is judged.
            if stream.monitor.poll(0):
                self._watch_connection(stream)
            try:
                frames = stream.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_message(stream, frames)

    def _on_message(self, stream: _Stream, frames: list[bytes]) -> None:
        counters = stream.counters
        if len(frames) != 3 or len(frames[1]) != 8:
            self._malformed(stream, f"{len(frames)} frames, not [topic, seq, payload]")
            return
        seq = int.from_bytes(frames[1], "big")
        if stream.liveness.connected:  # not what was queued before a disconnect
            self._heard(stream)
        decision = stream.tracker.on_live(seq)
        if decision.verdict is Verdict.IN_ORDER:
            self._apply(stream, frames[2], seq)
            return
        if decision.verdict is Verdict.DUPLICATE:
            counters.duplicates += 1
            return
        mid_stream = decision.verdict is Verdict.GAP
        if decision.verdict is Verdict.RESTART:
            self._restarted(stream, f"seq {seq}")
        elif mid_stream:
            counters.gaps += 1
            log.warning(
                "engine %s rank %d: batches %d..%d were lost",
                stream.engine.name,
                stream.rank,
                decision.missing.start,
                decision.missing.stop - 1,
            )
        holes = False
        if decision.missing and stream.replay_endpoint is not None:
            for replayed_seq, payload in self._replay(stream, decision.missing.start).batches:
                replayed = stream.tracker.on_replayed(replayed_seq)
                if replayed.verdict is not Verdict.DUPLICATE:
                    holes |= replayed.verdict is Verdict.GAP
                    counters.replayed_batches += 1
                    self._apply(stream, payload, replayed_seq)
        held = stream.tracker.on_replayed(seq)
        if held.verdict is not Verdict.DUPLICATE:
            holes |= held.verdict is Verdict.GAP
            self._apply(stream, frames[2], seq)
        if mid_stream and holes:
            self._lost(stream)

    def _lost(self, stream: _Stream) -> None:
        self._set_stale(stream, True)
        log.warning(
            "engine %s rank %d: lost batches could not be replayed; its view is stale "
            "until the engine restarts or clears its cache",
            stream.engine.name,
            stream.rank,
        )

    def _replay(self, stream: _Stream, start: int) -> ReplayResult:
        """The batches the engine's replay socket sends from `start` on (bounded wait)."""
        assert self._context is not None and stream.replay_endpoint is not None
        stream.counters.replays += 1
        result = request_replay(
            self._context,
            stream.replay_endpoint,
            start,
            timeout_seconds=self.replay_timeout_seconds,
            stop=self._stop,
        )
        for _ in range(result.malformed):
            self._malformed(stream, "a replay reply is not [b'', (topic,) seq, payload]")
        if not result.complete:
            stream.counters.replay_failures += 1
            log.warning(
                "engine %s rank %d: replay from %d did not end within %.1f s (%d batches)",
                stream.engine.name,
                stream.rank,
                start,
                self.replay_timeout_seconds,
                len(result.batches),
            )
        return result

    def _apply(self, stream: _Stream, payload: bytes, seq: int) -> None:
        counters = stream.counters
        stream.last_batch = (seq, xxhash.xxh3_64_intdigest(payload))
        try:
            batch = decode_batch(payload)
        except MalformedEvent as exc:
            self._malformed(stream, exc.reason)
            return
        counters.batches += 1
        counters.events += len(batch.events)
        counters.unknown_events += batch.unknown
        counters.malformed_events += len(batch.malformed)
        applied = self.views.apply_batch(stream.engine.name, stream.rank, batch)
        counters.dropped_entries += applied.dropped
        if stream.stale and any(isinstance(event, AllBlocksCleared) for event in batch.events):
            self._set_stale(stream, False)  # an emptied cache is known exactly again
        if self._verify is not None:
            for event in batch.events:
                if isinstance(event, BlockStored) and event.token_ids:
                    self._check(stream, event)

    def _check(self, stream: _Stream, event: BlockStored) -> None:
        assert self._verify is not None
        counters = stream.counters
        try:
            reproduced = self._verify(stream.engine, event)
        except Exception:  # a broken hook must not stop ingestion
            counters.verify_errors += 1
            if counters.verify_errors == 1:
                log.exception("engine %s: verifying a stored event failed", stream.engine.name)
            return
        if reproduced is True:
            counters.verified += 1
        elif reproduced is False:
            counters.mismatches += 1
            if counters.mismatches == self.mismatch_alarm_after or (
                counters.mismatches > self.mismatch_alarm_after and counters.mismatches % 1000 == 0
            ):
                log.error(
                    "engine %s: %d stored events have block hashes that hash scheme %s with "
                    "seed %r does not reproduce from their tokens; routing scores for this "
                    "engine are wrong until the engine's hash algorithm and PYTHONHASHSEED "
                    "match the configuration (run `cache-service doctor`)",
                    stream.engine.name,
                    counters.mismatches,
                    stream.engine.hash_scheme,
                    stream.engine.seed,
                )

    def _malformed(self, stream: _Stream, reason: str) -> None:
        stream.counters.malformed += 1
        count = stream.counters.malformed
        if count == 1 or count % 1000 == 0:
            log.warning(
                "engine %s rank %d: skipped a malformed message (%d so far): %s",
                stream.engine.name,
                stream.rank,
                count,
                reason,
            )

    def _set_stale(self, stream: _Stream, stale: bool) -> None:
        if stream.stale != stale:
            stream.stale = stale
            stream.counters.stale_ranks += 1 if stale else -1
            self.views.set_stale(stream.engine.name, stream.rank, stale)
