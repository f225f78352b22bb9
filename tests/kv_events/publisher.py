"""A test publisher of KV events, over real ZMQ sockets, in every encoding engines released.

The wire is restated here from the engines' definitions, sharing no code with the package:

- vLLM `vllm/distributed/kv_events.py`: msgspec structs with `tag=True` (the tag is the class
  name), `array_like=True` until vLLM PR #42892 (events) and after it maps keyed by field with
  the tag under "type"; the batch a map in the newest source read (commit 0181ea31). Fields
  were appended by #16750 (block_hashes .. lora_id), #19737 (medium), #27577 (lora_name),
  #33304 (extra_keys), #37688 (group_idx), #40984 (kv_cache_spec_kind, _sliding_window).
  msgspec writes every field of an array-like struct (msgspec issue #720: omit_defaults does
  not shorten arrays); a map omits fields that have a default and hold it.
- SGLang `python/sglang/srt/disaggregation/kv_events.py`: the same positional shapes with
  `attn_dp_rank` third in the batch, `medium` (PR #18205), and `BlockStoredWithMetadata`
  (PR #30827) appending a `{"cache_salt": ...}` map after `medium`.
- Framing (both): `[topic, seq as 8 bytes big-endian, payload]`; the replay ROUTER takes
  `[identity, b"", start seq]` and answers per buffered batch with seq >= start, then an
  end marker of seq -1 (8 signed bytes). SGLang (and vLLM before the topic was added):
  `[identity, b"", seq, payload]`, end `[identity, b"", -1, b""]`; vLLM 0.32
  (`_service_replay` read in the installed wheel): `[identity, b"", topic, seq, payload]`,
  end `[identity, b"", b"", -1, b""]`.

The PUB side is an XPUB, which is a PUB on the wire but lets a test wait until the
subscriber's subscription has arrived instead of sleeping through ZMQ's slow-joiner window.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
# Fields declared with a default (omitted from a map when they hold it).
DEFAULTED = {"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class Wire:
    """One released encoding: the batch's and events' shapes, and the positional lengths."""

    name: str
    batch: str  # "array" or "map"
    events: str  # "array" or "map"
    stored_fields: int = len(STORED_FIELDS)
    removed_fields: int = len(REMOVED_FIELDS)
    rank: bool = True  # a third batch element (array batches)
    sglang_metadata: bool = False  # a salt goes into a metadata map after medium


WIRES = {
    wire.name: wire
    for wire in (
        Wire("vllm-0.9.0", "array", "array", 5, 1, rank=False),
        Wire("vllm-medium", "array", "array", 6, 2),
        Wire("vllm-lora-name", "array", "array", 7, 2),
        Wire("vllm-extra-keys", "array", "array", 8, 2),
        Wire("vllm-group-idx", "array", "array", 9, 3),
        Wire("vllm-spec-kind", "array", "array", 11, 3),
        Wire("vllm-map-events", "array", "map"),
        Wire("vllm-map-batch", "map", "map"),
        Wire("sglang-0.4", "array", "array", 5, 1, rank=False),
        Wire("sglang-dp", "array", "array", 5, 1),
        Wire("sglang-medium", "array", "array", 6, 2, sglang_metadata=True),
        Wire("sglang-map-events", "array", "map", 6, 2, sglang_metadata=True),
    )
}


def stored(hashes: list[Any], **fields: Any) -> dict[str, Any]:
    """A BlockStored event as a field dict (absent fields are None)."""
    event: dict[str, Any] = {"type": "BlockStored", **dict.fromkeys(STORED_FIELDS)}
    event.update(block_hashes=hashes, token_ids=[], block_size=16)
    event.update(fields)
    return event


def removed(hashes: list[Any], **fields: Any) -> dict[str, Any]:
    """A BlockRemoved event as a field dict."""
    return {
        "type": "BlockRemoved",
        **dict.fromkeys(REMOVED_FIELDS),
        "block_hashes": hashes,
        **fields,
    }


def cleared() -> dict[str, Any]:
    """An AllBlocksCleared event."""
    return {"type": "AllBlocksCleared"}


def encode_event(wire: Wire, event: dict[str, Any]) -> Any:
    """An event as the release's msgspec would lay it out (before msgpack)."""
    tag = event["type"]
    names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, ())
    count = {"BlockStored": wire.stored_fields, "BlockRemoved": wire.removed_fields}.get(tag, 0)
    if wire.sglang_metadata:
        names = names[:count]
    salt = event.get("cache_salt")
    if wire.events == "array":
        if tag not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            return [tag, *event.get("fields", [])]
        values = [event.get(name) for name in names[:count]]
        if wire.sglang_metadata and tag == "BlockStored" and salt is not None:
            values.append({"cache_salt": salt})
        return [tag, *values, *event.get("extra_positional", [])]
    body: dict[str, Any] = {"type": tag}
    for name in names:
        value = event.get(name)
        if value is None and name in DEFAULTED:
            continue  # omit_defaults on a map
        body[name] = value
    if wire.sglang_metadata and salt is not None:
        body["cache_salt"] = salt
    for name, value in event.get("extra_map_fields", {}).items():
        body[name] = value
    return body


def encode_batch(
    wire: Wire, events: list[dict[str, Any]], *, ts: float = 1.0, rank: int | None = 0
) -> bytes:
    """A batch's msgpack payload in the release's encoding."""
    encoded = [encode_event(wire, event) for event in events]
    if wire.batch == "map":
        body: dict[str, Any] = {"ts": ts, "events": encoded}
        if rank is not None:
            body["data_parallel_rank"] = rank
        return bytes(msgpack.packb(body))
    batch: list[Any] = [ts, encoded]
    if wire.rank:
        batch.append(rank)
    return bytes(msgpack.packb(batch))


class TestPublisher:
    """An engine's publisher on 127.0.0.1: XPUB for the stream, optionally a ROUTER replay."""

    __test__ = False  # not a test class, whatever pytest thinks of its name

    def __init__(
        self,
        context: zmq.Context[Any],
        *,
        wire: Wire,
        replay: bool = False,
        buffer_steps: int = 1000,
        topic: bytes = b"kv-events",
        port: int | None = None,
        replay_port: int | None = None,
        rebind_wait_seconds: float = 0.0,
        replay_topic: bool = False,
    ) -> None:
        self.wire = wire
        self.replay_topic = replay_topic  # vLLM 0.32's replay layout
        self.topic = topic
        self.next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._pub = context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.port = _bind(self._pub, port, rebind_wait_seconds)
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.replay_requests: list[int] = []
        self._router: zmq.Socket[Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replay_endpoint: str | None = None
        if replay:
            self._router = context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_port = _bind(self._router, replay_port)
            self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def wait_for_subscriber(self, timeout_seconds: float = 5.0) -> None:
        """Block until a subscription reaches the XPUB (a subscriber is connected)."""
        if not self._pub.poll(int(timeout_seconds * 1000)):
            raise TimeoutError("no subscriber subscribed")
        self._pub.recv()

    def wait_for_replay_requests(self, count: int, timeout_seconds: float = 5.0) -> None:
        """Block until `count` replay requests have been answered or are being answered."""
        deadline = time.monotonic() + timeout_seconds
        while len(self.replay_requests) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.replay_requests)} replay requests, not {count}")
            time.sleep(0.005)

    def publish(
        self,
        events: list[dict[str, Any]],
        *,
        rank: int | None = 0,
        drop: bool = False,
        ts: float | None = None,
    ) -> int:
        """Encode and send a batch with the next sequence number (buffered for replay);
        `drop` buffers it without sending, as a batch lost on the way. Returns its seq."""
        payload = encode_batch(self.wire, events, ts=time.time() if ts is None else ts, rank=rank)
        return self.publish_payload(payload, drop=drop)

    def publish_payload(self, payload: bytes, *, drop: bool = False) -> int:
        """Send an already encoded payload with the next sequence number."""
        with self._lock:
            seq = self.next_seq
            self.next_seq += 1
            self._buffer.append((seq, payload))
        if not drop:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_frames(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the stream (garbage, wrong framing)."""
        self._pub.send_multipart(frames)

    def drop_connections(self) -> None:
        """A network blip: the PUB socket closed and bound again on its port, with the same
        numbering and replay buffer (the same process, still running)."""
        self._pub.close(linger=0)
        self._pub = self._pub.context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        _bind(self._pub, self.port, wait_seconds=2.0)

    def close(self) -> None:
        """Stop the replay thread and close both sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._pub.close(linger=0)

    def _serve_replay(self) -> None:
        assert self._router is not None
        router = self._router
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue  # vLLM logs and ignores such a request
                identity, _, start = frames
                start_seq = int.from_bytes(start, "big")
                self.replay_requests.append(start_seq)
                with self._lock:
                    buffered = [item for item in self._buffer if item[0] >= start_seq]
                topic = [self.topic] if self.replay_topic else []
                for seq, payload in buffered:
                    router.send_multipart([identity, b"", *topic, seq.to_bytes(8, "big"), payload])
                end_topic = [b""] if self.replay_topic else []
                router.send_multipart([identity, b"", *end_topic, END_SEQ, b""])
        finally:
            router.close(linger=0)


def _bind(socket: zmq.Socket[Any], port: int | None, wait_seconds: float = 0.0) -> int:
    if port is None:
        return int(socket.bind_to_random_port("tcp://127.0.0.1"))
    # A closed socket's port is released by ZMQ's I/O thread a moment later: a restarted
    # publisher may retry for a while.
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            socket.bind(f"tcp://127.0.0.1:{port}")
            return port
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                socket.close(linger=0)
                raise
            time.sleep(0.01)
