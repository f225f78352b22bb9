"""The KV-event subscriber against test publishers over real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq

from cache_service.core.engines.block_hashes import EngineBlockHash
from cache_service.core.engines.decoding import BlockStored
from cache_service.core.engines.views import EngineViews, PrefixHold
from cache_service.service.kv_events.config import EngineConfig
from cache_service.service.kv_events.subscriber import KvEventSubscriber
from tests.kv_events.publisher import WIRES, TestPublisher, Wire, cleared, removed, stored

WAIT_SECONDS = 5.0


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def chain(*values: int) -> list[EngineBlockHash]:
    return [EngineBlockHash(value) for value in values]


def held(views: EngineViews, *values: int, medium: str = "GPU") -> int:
    holds = [hold for hold in views.match_prefix(chain(*values)) if hold.medium == medium]
    return holds[0].blocks if holds else 0


@contextmanager
def subscribed(
    views: EngineViews, *engines: EngineConfig, **options: Any
) -> Iterator[KvEventSubscriber]:
    subscriber = KvEventSubscriber(engines, views, **options)
    subscriber.start()
    try:
        yield subscriber
    finally:
        started = time.monotonic()
        assert subscriber.stop(timeout_seconds=5.0)
        assert time.monotonic() - started < 2.0


def engine(publisher: TestPublisher, name: str = "e", **fields: Any) -> EngineConfig:
    return EngineConfig(
        name=name,
        endpoint=publisher.endpoint,
        replay_endpoint=publisher.replay_endpoint,
        **fields,
    )


@pytest.mark.parametrize("wire", WIRES.values(), ids=WIRES.keys())
def test_stores_removals_duplicates_and_clears_reach_the_view(
    context: zmq.Context[Any], views: EngineViews, wire: Wire
) -> None:
    publisher = TestPublisher(context, wire=wire)
    try:
        with subscribed(views, engine(publisher)) as subscriber:
            publisher.wait_for_subscriber()
            publisher.publish([stored([1, 2, 3], token_ids=[0] * 48)])
            wait_until(lambda: held(views, 1, 2, 3, 4) == 3, "the store")
            publisher.publish([stored([1, 2, 3])])  # a repeated store
            publisher.publish([removed([3])])
            wait_until(lambda: held(views, 1, 2, 3) == 2, "the removal")
            assert views.block_count("e") == 2
            publisher.publish([cleared()])
            wait_until(lambda: views.block_count("e") == 0, "the clear")
            counters = subscriber.stats()["e"]
            assert (counters.batches, counters.events, counters.malformed) == (4, 4, 0)
            assert not counters.stale
    finally:
        publisher.close()


def test_unknown_tags_and_fields_are_skipped_and_counted(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    publisher = TestPublisher(context, wire=WIRES["vllm-map-events"])
    try:
        with subscribed(views, engine(publisher)) as subscriber:
            publisher.wait_for_subscriber()
            unknown = {"type": "BlockInactive", "extra_map_fields": {"block_hashes": [1]}}
            extra = stored([5], extra_map_fields={"session_id": "s", "new_field": {"a": 1}})
            publisher.publish([unknown, extra])
            wait_until(lambda: held(views, 5) == 1, "the store with unknown fields")
            assert subscriber.stats()["e"].unknown_events == 1
    finally:
        publisher.close()


def test_media_are_kept_per_block(context: zmq.Context[Any], views: EngineViews) -> None:
    publisher = TestPublisher(context, wire=WIRES["sglang-medium"])
    try:
        with subscribed(views, engine(publisher)):
            publisher.wait_for_subscriber()
            publisher.publish([stored([1, 2], medium="GPU"), stored([1, 2], medium="CPU_PINNED")])
            publisher.publish([removed([2], medium="GPU")])
            wait_until(lambda: held(views, 1, 2) == 1, "the GPU removal")
            assert held(views, 1, 2, medium="CPU") == 2
    finally:
        publisher.close()


def test_data_parallel_ranks_publish_on_consecutive_ports(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    rank0, rank1 = publisher_pair(context, WIRES["vllm-map-batch"])
    try:
        config = EngineConfig(name="dp", endpoint=rank0.endpoint, data_parallel_size=2)
        with subscribed(views, config):
            rank0.wait_for_subscriber()
            rank1.wait_for_subscriber()
            rank0.publish([stored([1])], rank=0)
            rank1.publish([stored([1, 2, 3])], rank=1)
            wait_until(
                lambda: (
                    views.match_prefix(chain(1, 2, 3)) == [PrefixHold("dp", "GPU", 3, 1, False)]
                ),
                "rank 1's store",
            )
            assert views.holds("dp", 0, 0, EngineBlockHash(1))
            assert not views.holds("dp", 0, 0, EngineBlockHash(2))
    finally:
        rank0.close()
        rank1.close()


def publisher_pair(context: zmq.Context[Any], wire: Wire) -> tuple[TestPublisher, TestPublisher]:
    for _ in range(20):
        first = TestPublisher(context, wire=wire)
        try:
            return first, TestPublisher(context, wire=wire, port=first.port + 1)
        except zmq.ZMQError:
            first.close()  # port + 1 was taken: try another pair
    raise RuntimeError("no two consecutive free ports")


def test_a_gap_without_replay_marks_the_engine_stale_until_a_clear(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    publisher = TestPublisher(context, wire=WIRES["vllm-group-idx"])
    try:
        with subscribed(views, engine(publisher)) as subscriber:
            publisher.wait_for_subscriber()
            publisher.publish([stored([1])])
            publisher.publish([stored([2])], drop=True)
            publisher.publish([stored([3])])
            wait_until(lambda: subscriber.stale_engines() == ["e"], "the stale mark")
            counters = subscriber.stats()["e"]
            assert (counters.gaps, counters.replays, counters.stale_ranks) == (1, 0, 1)
            assert views.holds("e", 0, 0, EngineBlockHash(3))
            assert not views.holds("e", 0, 0, EngineBlockHash(2))
            assert views.match_prefix(chain(1))[0].stale
            publisher.publish([cleared(), stored([9])])
            wait_until(lambda: not subscriber.stale_engines(), "the clear")
            assert held(views, 9) == 1 and not views.is_stale("e")
    finally:
        publisher.close()


@pytest.mark.parametrize("replay_topic", [False, True], ids=["sglang-layout", "vllm-0.32-layout"])
def test_a_gap_is_filled_from_the_replay_socket(
    context: zmq.Context[Any], views: EngineViews, replay_topic: bool
) -> None:
    publisher = TestPublisher(
        context, wire=WIRES["vllm-map-events"], replay=True, replay_topic=replay_topic
    )
    try:
        with subscribed(views, engine(publisher)) as subscriber:
            publisher.wait_for_subscriber()
            publisher.wait_for_replay_requests(1)  # the (empty) history, asked at connection
            publisher.publish([stored([1])])
            publisher.publish([stored([2], parent_block_hash=1)], drop=True)
            publisher.publish([removed([1])], drop=True)
            publisher.publish([stored([3], parent_block_hash=2)])
            wait_until(lambda: views.holds("e", 0, 0, EngineBlockHash(3)), "the live store")
            assert views.holds("e", 0, 0, EngineBlockHash(2))
            assert not views.holds("e", 0, 0, EngineBlockHash(1))
            counters = subscriber.stats()["e"]
            # The buffer also held the live batch 3: applied from replay, then skipped live.
            assert (counters.gaps, counters.replays, counters.replayed_batches) == (1, 2, 3)
            assert publisher.replay_requests == [0, 1]
            assert counters.malformed == 0
            assert not subscriber.stale_engines()
            publisher.publish([stored([4])])
            wait_until(lambda: views.holds("e", 0, 0, EngineBlockHash(4)), "the next store")
            assert subscriber.stats()["e"].duplicates == 0
    finally:
        publisher.close()


def test_a_gap_the_replay_buffer_no_longer_holds_marks_the_engine_stale(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    publisher = TestPublisher(context, wire=WIRES["vllm-spec-kind"], replay=True, buffer_steps=1)
    try:
        with subscribed(views, engine(publisher)) as subscriber:
            publisher.wait_for_subscriber()
            publisher.wait_for_replay_requests(1)
            publisher.publish([stored([1])])
            publisher.publish([stored([2])], drop=True)
            publisher.publish([stored([3])], drop=True)
            publisher.publish([stored([4])])
            wait_until(lambda: subscriber.stale_engines() == ["e"], "the stale mark")
            assert views.holds("e", 0, 0, EngineBlockHash(4))
            assert subscriber.stats()["e"].replays == 2
    finally:
        publisher.close()


@pytest.mark.parametrize("replay_topic", [False, True], ids=["sglang-layout", "vllm-0.32-layout"])
def test_a_late_subscriber_asks_for_the_history_at_once(
    context: zmq.Context[Any], views: EngineViews, replay_topic: bool
) -> None:
    """An idle engine: no live message comes, and the view is filled all the same."""
    publisher = TestPublisher(
        context, wire=WIRES["vllm-map-batch"], replay=True, replay_topic=replay_topic
    )
    try:
        for block in (1, 2, 3):
            publisher.publish([stored([block])], drop=True)  # before anyone listened
        with subscribed(views, engine(publisher)) as subscriber:
            wait_until(lambda: held(views, 1, 2, 3) == 3, "the history")
            counters = subscriber.stats()["e"]
            assert (counters.replays, counters.replayed_batches, counters.malformed) == (1, 3, 0)
            assert subscriber.liveness()["e"].live
            publisher.wait_for_subscriber()
            publisher.publish([stored([4])])  # seq 3: next in order
            wait_until(lambda: held(views, 1, 2, 3, 4) == 4, "the live store")
            counters = subscriber.stats()["e"]
            assert (counters.gaps, counters.replays, counters.duplicates) == (0, 1, 0)
    finally:
        publisher.close()


def test_a_late_subscriber_replays_the_publisher_history(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    publisher = TestPublisher(context, wire=WIRES["vllm-map-batch"], replay=True)
    try:
        for block in (1, 2, 3):
            publisher.publish([stored([block])], drop=True)  # before anyone listened
        with subscribed(views, engine(publisher)) as subscriber:
            publisher.wait_for_subscriber()
            publisher.publish([stored([4])])
            wait_until(lambda: held(views, 1, 2, 3, 4) == 4, "the history")
            counters = subscriber.stats()["e"]
            assert (counters.gaps, counters.replays, counters.stale_ranks) == (0, 1, 0)
            assert publisher.replay_requests == [0]
    finally:
        publisher.close()


def test_a_restarted_publisher_rebuilds_the_view(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    first = TestPublisher(context, wire=WIRES["vllm-extra-keys"])
    config = engine(first)
    with subscribed(views, config) as subscriber:
        try:
            first.wait_for_subscriber()
            for block in (1, 2, 3):
                first.publish([stored([block])])
            wait_until(lambda: held(views, 1, 2, 3) == 3, "the first publisher's stores")
        finally:
            first.close()
        second = TestPublisher(
            context, wire=WIRES["vllm-extra-keys"], port=first.port, rebind_wait_seconds=2.0
        )
        try:
            second.wait_for_subscriber()
            second.publish([stored([7])])  # seq 0 again
            wait_until(lambda: views.holds("e", 0, 0, EngineBlockHash(7)), "the new store")
            assert views.block_count("e") == 1
            assert subscriber.stats()["e"].restarts == 1
            second.publish([stored([8])])
            wait_until(lambda: views.block_count("e") == 2, "the next store")
        finally:
            second.close()


def test_garbage_frames_are_counted_and_skipped(
    context: zmq.Context[Any], views: EngineViews, caplog: pytest.LogCaptureFixture
) -> None:
    publisher = TestPublisher(context, wire=WIRES["vllm-map-batch"])
    try:
        with subscribed(views, engine(publisher)) as subscriber:
            publisher.wait_for_subscriber()
            publisher.send_frames([b"kv-events"])
            publisher.send_frames([b"kv-events", b"short", b"payload"])
            publisher.publish_payload(b"\xc1 not msgpack")
            publisher.publish_payload(b"\x93\x01\x02\x03")  # an array of three numbers
            publisher.publish([stored([1])])
            wait_until(lambda: held(views, 1) == 1, "the store after the garbage")
            counters = subscriber.stats()["e"]
            assert (counters.malformed, counters.batches, counters.gaps) == (4, 1, 0)
    finally:
        publisher.close()
    assert "malformed" in caplog.text


def test_mismatched_hashes_are_counted_and_raise_the_alarm(
    context: zmq.Context[Any], views: EngineViews, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[BlockStored] = []

    def verify(config: EngineConfig, event: BlockStored) -> bool | None:
        seen.append(event)
        assert config.hash_scheme == "vllm-sha256-cbor"
        return event.block_hashes[0] == 1  # only block 1 "reproduces"

    publisher = TestPublisher(context, wire=WIRES["vllm-spec-kind"])
    try:
        config = engine(publisher, hash_scheme="vllm-sha256-cbor", seed="0")
        with subscribed(views, config, verify=verify) as subscriber:
            publisher.wait_for_subscriber()
            publisher.publish([stored([1], token_ids=[1] * 16), stored([9], token_ids=[])])
            for block in (2, 3, 4):
                publisher.publish([stored([block], token_ids=[block] * 16)])
            wait_until(lambda: subscriber.stats()["e"].mismatches == 3, "three mismatches")
            assert subscriber.stats()["e"].verified == 1
            assert len(seen) == 4  # the event without tokens is not verified
    finally:
        publisher.close()
    alarms = [r for r in caplog.records if r.levelno == logging.ERROR and "engine e" in r.message]
    assert len(alarms) == 1 and "vllm-sha256-cbor" in alarms[0].message


def test_a_failing_verify_hook_does_not_stop_ingestion(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    def verify(config: EngineConfig, event: BlockStored) -> bool | None:
        raise RuntimeError("broken hook")

    publisher = TestPublisher(context, wire=WIRES["vllm-spec-kind"])
    try:
        with subscribed(views, engine(publisher), verify=verify) as subscriber:
            publisher.wait_for_subscriber()
            publisher.publish([stored([1], token_ids=[1] * 16)])
            publisher.publish([stored([2], token_ids=[2] * 16)])
            wait_until(lambda: views.block_count("e") == 2, "both stores")
            assert subscriber.stats()["e"].verify_errors == 2
    finally:
        publisher.close()


def test_the_memory_bound_drops_entries_and_counts_them(context: zmq.Context[Any]) -> None:
    views = EngineViews(max_blocks_per_engine=2)
    publisher = TestPublisher(context, wire=WIRES["sglang-dp"])
    try:
        with subscribed(views, engine(publisher)) as subscriber:
            publisher.wait_for_subscriber()
            publisher.publish([stored([1, 2, 3])])
            wait_until(lambda: subscriber.stats()["e"].dropped_entries == 1, "a drop")
            assert views.block_count("e") == 2
    finally:
        publisher.close()


def test_stop_without_any_publisher_is_prompt(views: EngineViews) -> None:
    config = EngineConfig(name="nobody", endpoint="tcp://127.0.0.1:9", replay_endpoint=None)
    with subscribed(views, config) as subscriber:
        assert subscriber.stats()["nobody"].batches == 0


def test_a_restart_whose_first_batches_were_missed_is_told_by_the_reconnect(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    first = TestPublisher(context, wire=WIRES["vllm-map-batch"])
    with subscribed(views, engine(first)) as subscriber:
        try:
            first.wait_for_subscriber()
            for block in range(1, 7):  # seqs 0..5
                first.publish([stored([block])])
            wait_until(lambda: views.block_count("e") == 6, "the first publisher's stores")
        finally:
            first.close()
        second = TestPublisher(
            context, wire=WIRES["vllm-map-batch"], port=first.port, rebind_wait_seconds=2.0
        )
        try:
            for block in (20, 21, 22):  # seqs 0..2, sent before the subscriber reconnected
                second.publish([stored([block])], drop=True)
            second.wait_for_subscriber()
            second.publish([stored([23])])  # seq 3: below 5, after a disconnect
            wait_until(lambda: subscriber.stats()["e"].restarts == 1, "the restart")
            assert views.holds("e", 0, 0, EngineBlockHash(23))
            assert views.block_count("e") == 1  # nothing of the old process; 0..2 never seen
            assert not subscriber.stale_engines()
        finally:
            second.close()


def test_a_replay_socket_that_never_answers_times_out_and_marks_the_engine_stale(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    publisher = TestPublisher(context, wire=WIRES["vllm-map-batch"])
    silent = context.socket(zmq.ROUTER)  # bound, reads requests, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = EngineConfig(
            name="e", endpoint=publisher.endpoint, replay_endpoint=f"tcp://127.0.0.1:{port}"
        )
        with subscribed(views, config, replay_timeout_seconds=0.3) as subscriber:
            publisher.wait_for_subscriber()
            publisher.publish([stored([1])])
            publisher.publish([stored([2])], drop=True)
            publisher.publish([stored([3])])
            wait_until(lambda: subscriber.stale_engines() == ["e"], "the stale mark")
            counters = subscriber.stats()["e"]
            # The history asked at connection, then the gap: neither answered.
            assert (counters.replays, counters.replay_failures) == (2, 2)
            assert views.holds("e", 0, 0, EngineBlockHash(3))
            requests = [silent.recv_multipart()[1:] for _ in range(2) if silent.poll(1000)]
            assert requests == [[b"", (0).to_bytes(8, "big")], [b"", (1).to_bytes(8, "big")]]
    finally:
        silent.close(linger=0)
        publisher.close()


def test_stop_is_prompt_while_a_publisher_floods_large_batches(context: zmq.Context[Any]) -> None:
    """A round reads for a bounded time and looks at the stop flag between messages."""
    from cache_service.service.kv_events.verifier import SchemeVerifier  # noqa: PLC0415
    from tests.kv_events.prompts import prompt_events  # noqa: PLC0415
    from tests.kv_events.publisher import encode_batch  # noqa: PLC0415

    tokens = [(i * 7919) % 50_000 for i in range(32 * 1024)]  # 2048 blocks of 16
    publisher = TestPublisher(context, wire=WIRES["vllm-map-batch"])
    config = engine(publisher, hash_scheme="vllm-sha256-cbor", seed="0")
    views = EngineViews(max_blocks_per_engine=1 << 16)
    subscriber = KvEventSubscriber([config], views, verify=SchemeVerifier([config]))
    subscriber.start()
    try:
        publisher.wait_for_subscriber()
        payload = encode_batch(
            publisher.wire, prompt_events("vllm-sha256-cbor", tokens, seed="0"), ts=0.0
        )
        for _ in range(400):  # each costs the subscriber ~10 ms to decode, verify, apply
            publisher.publish_payload(payload)
        wait_until(lambda: subscriber.stats()["e"].verified >= 2, "the flood being read")
        started = time.monotonic()
        assert subscriber.stop(timeout_seconds=5.0)
        took = time.monotonic() - started
        assert took < 2.0, took
        assert subscriber.stats()["e"].batches < 400  # it stopped mid-flood
        assert not any(t.name == "kv-events" and t.is_alive() for t in threading.enumerate())
    finally:
        subscriber.stop()
        publisher.close()


def test_a_restart_read_together_with_its_disconnect_is_not_taken_for_duplicates(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    """The subscriber is held inside a drain (by its verify hook) while the publisher
    restarts at seq 5 and sends: the disconnect is then queued with the new numbers, and
    must be noted before they are judged (else 5 passes for a duplicate of the old 5)."""
    entered, release = threading.Event(), threading.Event()
    holder: list[KvEventSubscriber] = []

    def hold_on_block_6(config: EngineConfig, event: BlockStored) -> bool | None:
        if event.block_hashes[0] == 6:
            entered.set()
            # Held, but letting the SUB socket process ZMQ's commands (in this, its own
            # thread): that is how it resends its subscription to the new publisher, as
            # its recv calls would while it drains a busy stream.
            sub = holder[0]._streams[0].sub  # the hold needs the socket itself
            assert sub is not None
            deadline = time.monotonic() + 10.0
            while not release.is_set() and time.monotonic() < deadline:
                sub.getsockopt(zmq.EVENTS)
                time.sleep(0.005)
        return None

    first = TestPublisher(context, wire=WIRES["vllm-map-batch"])
    with subscribed(views, engine(first), verify=hold_on_block_6) as subscriber:
        holder.append(subscriber)
        second: TestPublisher | None = None
        try:
            first.wait_for_subscriber()
            for block in range(1, 7):  # seqs 0..5; the subscriber stops at the last
                first.publish([stored([block], token_ids=[block] * 16)])
            assert entered.wait(WAIT_SECONDS)
            first.close()
            second = TestPublisher(
                context, wire=WIRES["vllm-map-batch"], port=first.port, rebind_wait_seconds=2.0
            )
            second.next_seq = 5  # its first numbers were missed: 5 and 6 are what arrives
            second.wait_for_subscriber()  # ZMQ reconnected while the subscriber was held
            second.publish([stored([20], token_ids=[20] * 16)])
            second.publish([stored([21], token_ids=[21] * 16)])
            time.sleep(0.3)  # both are queued in the SUB socket, behind the disconnect
            release.set()
            wait_until(lambda: views.holds("e", 0, 0, EngineBlockHash(21)), "the new stores")
            assert subscriber.stats()["e"].restarts == 1
            assert subscriber.stats()["e"].duplicates == 0
            assert views.holds("e", 0, 0, EngineBlockHash(20))
            assert views.block_count("e") == 2  # the old process's blocks are forgotten
        finally:
            release.set()
            first.close()
            if second is not None:
                second.close()
