"""Engines that go away and come back: the subscriber's liveness against test publishers
over real ZMQ sockets on 127.0.0.1 (disconnects, silence, a blip of the same publisher and
a restarted one noticed at reconnection)."""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from cache_service.core.engines.block_hashes import EngineBlockHash
from cache_service.core.engines.decoding import BlockStored
from cache_service.core.engines.views import EngineViews
from cache_service.service.kv_events.config import EngineConfig
from cache_service.service.kv_events.liveness import (
    DISCONNECTED,
    NO_HISTORY,
    NOT_CONNECTED,
    SILENT,
)
from tests.kv_events.publisher import WIRES, TestPublisher, encode_batch, stored
from tests.kv_events.test_subscriber import (
    chain,
    engine,
    held,
    publisher_pair,
    subscribed,
    wait_until,
)

WIRE = WIRES["vllm-map-batch"]


def test_a_stopped_publisher_is_down_and_up_again_when_its_successor_publishes(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    first = TestPublisher(context, wire=WIRE)
    with subscribed(views, engine(first)) as subscriber:
        try:
            first.wait_for_subscriber()
            wait_until(lambda: subscriber.liveness()["e"].live, "the first connection")
            first.publish([stored([1])])
            wait_until(lambda: views.block_count("e") == 1, "the store")
        finally:
            first.close()
        wait_until(lambda: not subscriber.liveness()["e"].live, "the disconnect")
        down = subscriber.liveness()["e"]
        assert down.reason == DISCONNECTED and down.down_since is not None
        assert subscriber.stats()["e"].downs == 1
        assert views.block_count("e") == 1  # kept: it may come back
        second = TestPublisher(context, wire=WIRE, port=first.port, rebind_wait_seconds=2.0)
        try:
            second.wait_for_subscriber()
            assert not subscriber.liveness()["e"].live  # reconnected, not yet heard from
            second.publish([stored([7])])
            wait_until(lambda: subscriber.liveness()["e"].live, "up at its first batch")
            assert subscriber.stats()["e"].restarts == 1
            assert views.block_count("e") == 1 and held(views, 7) == 1
        finally:
            second.close()


def test_an_engine_never_reached_is_down_from_the_start(views: EngineViews) -> None:
    config = EngineConfig(name="nobody", endpoint="tcp://127.0.0.1:9")
    with subscribed(views, config) as subscriber:
        liveness = subscriber.liveness()["nobody"]
        assert not liveness.live and liveness.reason == NOT_CONNECTED


def test_silence_past_the_timeout_is_down_until_the_next_batch(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    publisher = TestPublisher(context, wire=WIRE)
    try:
        with subscribed(views, engine(publisher), silence_timeout_seconds=0.3) as subscriber:
            publisher.wait_for_subscriber()
            wait_until(lambda: subscriber.liveness()["e"].live, "the connection")
            wait_until(lambda: subscriber.liveness()["e"].reason == SILENT, "the silence")
            publisher.publish([stored([1])])
            wait_until(lambda: subscriber.liveness()["e"].live, "the next batch")
            assert subscriber.stats()["e"].downs == 1
    finally:
        publisher.close()


def test_without_a_silence_timeout_an_idle_engine_stays_live(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    publisher = TestPublisher(context, wire=WIRE)
    try:
        with subscribed(views, engine(publisher), heartbeat_seconds=0.1) as subscriber:
            publisher.wait_for_subscriber()
            wait_until(lambda: subscriber.liveness()["e"].live, "the connection")
            time.sleep(1.0)  # ten heartbeats, answered by the publisher's ZMQ
            assert subscriber.liveness()["e"].live
            assert subscriber.stats()["e"].downs == 0
    finally:
        publisher.close()


def test_a_blip_of_the_same_publisher_is_resumed_from_its_replay_buffer(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    publisher = TestPublisher(context, wire=WIRE, replay=True)
    try:
        with subscribed(views, engine(publisher)) as subscriber:
            publisher.wait_for_subscriber()
            publisher.wait_for_replay_requests(1)
            publisher.publish([stored([1])])
            publisher.publish([stored([2])])
            wait_until(lambda: views.block_count("e") == 2, "the stores")
            publisher.drop_connections()
            wait_until(lambda: not subscriber.liveness()["e"].live, "the disconnect")
            publisher.publish([stored([3])], drop=True)  # sent while nobody listened
            publisher.wait_for_subscriber()
            wait_until(lambda: subscriber.liveness()["e"].live, "the resumed connection")
            wait_until(lambda: views.block_count("e") == 3, "the batch missed meanwhile")
            assert publisher.replay_requests == [0, 1]  # from the last batch applied
            counters = subscriber.stats()["e"]
            assert (counters.restarts, counters.gaps, counters.stale_ranks) == (0, 0, 0)
            publisher.publish([stored([4])])  # seq 3: in order, no restart
            wait_until(lambda: views.block_count("e") == 4, "the next live store")
            assert subscriber.stats()["e"].restarts == 0
    finally:
        publisher.close()


def test_a_restarted_publisher_is_told_at_reconnection_and_its_history_replayed(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    first = TestPublisher(context, wire=WIRE, replay=True)
    with subscribed(views, engine(first)) as subscriber:
        try:
            first.wait_for_subscriber()
            first.wait_for_replay_requests(1)
            for block in (1, 2, 3):
                first.publish([stored([block])])
            wait_until(lambda: views.block_count("e") == 3, "the first publisher's stores")
        finally:
            first.close()
        wait_until(lambda: not subscriber.liveness()["e"].live, "the disconnect")
        second = TestPublisher(
            context,
            wire=WIRE,
            replay=True,
            port=first.port,
            replay_port=first.replay_port,
            rebind_wait_seconds=2.0,
        )
        try:
            second.publish([stored([20])], drop=True)  # its seq 0, before we reconnected
            # An idle engine: it publishes nothing live, and is known all the same.
            wait_until(lambda: subscriber.liveness()["e"].live, "up from the replay answer")
            wait_until(lambda: views.holds("e", 0, 0, EngineBlockHash(20)), "its history")
            assert views.block_count("e") == 1
            assert subscriber.stats()["e"].restarts == 1
            assert second.replay_requests == [2, 0]  # our last batch, then its history
        finally:
            second.close()


def test_batches_queued_before_a_disconnect_do_not_bring_the_engine_back(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    """An engine killed while busy: its last batches are read after the disconnect."""
    publisher = TestPublisher(context, wire=WIRE)
    config = engine(publisher)
    verified = threading.Event()

    def slow(engine_config: EngineConfig, event: BlockStored) -> None:
        verified.wait(5.0)  # hold the subscriber while the publisher goes away

    with subscribed(views, config, verify=slow) as subscriber:
        publisher.wait_for_subscriber()
        wait_until(lambda: subscriber.liveness()["e"].live, "the connection")
        for block in range(1, 6):
            publisher.publish([stored([block], token_ids=list(range(16)))])
        publisher.close()
        time.sleep(0.3)  # the disconnect reaches the monitor while the batches wait
        verified.set()
        wait_until(lambda: views.block_count("e") == 5, "the queued batches")
        wait_until(lambda: not subscriber.liveness()["e"].live, "the disconnect")
        time.sleep(0.2)
        assert not subscriber.liveness()["e"].live
        assert subscriber.liveness()["e"].reason == DISCONNECTED


def test_a_down_rank_counts_nothing_while_another_rank_is_up(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    rank0, rank1 = publisher_pair(context, WIRE)
    config = EngineConfig(name="dp", endpoint=rank0.endpoint, data_parallel_size=2)
    try:
        with subscribed(views, config) as subscriber:
            rank0.wait_for_subscriber()
            rank1.wait_for_subscriber()
            rank0.publish([stored([1])], rank=0)
            rank1.publish([stored([1, 2, 3])], rank=1)
            wait_until(lambda: held(views, 1, 2, 3) == 3, "rank 1's blocks")
            rank1.close()
            wait_until(lambda: held(views, 1, 2, 3) == 1, "rank 1 left out")
            (hold,) = views.match_prefix(chain(1, 2, 3))
            assert (hold.blocks, hold.data_parallel_rank) == (1, 0)
            assert subscriber.liveness()["dp"].live  # rank 0 is up
            rank0.close()
            wait_until(lambda: not subscriber.liveness()["dp"].live, "both ranks down")
            assert held(views, 1, 2, 3) == 3  # wholly down: its rows stay, ranked last
    finally:
        rank0.close()
        rank1.close()


def test_a_history_that_never_ends_marks_the_rank_stale_and_down(
    context: zmq.Context[Any], views: EngineViews
) -> None:
    publisher = TestPublisher(context, wire=WIRE)
    half = context.socket(zmq.ROUTER)  # answers one batch, never the end marker
    half.setsockopt(zmq.LINGER, 0)
    port = half.bind_to_random_port("tcp://127.0.0.1")
    payload = encode_batch(WIRE, [stored([1])])

    def answer_once() -> None:
        if half.poll(5000):
            identity, *_ = half.recv_multipart()
            half.send_multipart([identity, b"", b"t", (0).to_bytes(8, "big"), payload])

    answering = threading.Thread(target=answer_once)
    answering.start()
    config = EngineConfig(
        name="e", endpoint=publisher.endpoint, replay_endpoint=f"tcp://127.0.0.1:{port}"
    )
    try:
        with subscribed(views, config, replay_timeout_seconds=0.3) as subscriber:
            wait_until(lambda: subscriber.stale_engines() == ["e"], "the stale mark")
            assert views.block_count("e") == 1
            liveness = subscriber.liveness()["e"]
            assert not liveness.live and liveness.reason == NO_HISTORY
    finally:
        answering.join()
        half.close(linger=0)
        publisher.close()
