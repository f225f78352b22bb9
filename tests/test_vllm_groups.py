"""vLLM's KV blocks against the service's blocks (plain Python, no vLLM): groups of lcm tokens,
what a prompt may load, and a group's bytes cut into equal pieces and joined back."""

from __future__ import annotations

import math
import random
from array import array

import pytest

from cache_service.core.engines.groups import BlockGroups

ENGINE_SIZES = (16, 64, 128, 256)
SERVICE_SIZES = (16, 64, 128)
PAIRS = [(engine, service) for engine in ENGINE_SIZES for service in SERVICE_SIZES]
# Bytes one token takes across every layer: K and V, 2 layers, 1 KV head, head size 4, bf16.
TOKEN_BYTES = 2 * 2 * 1 * 4 * 2


@pytest.mark.parametrize(("engine", "service"), PAIRS)
def test_a_group_is_the_lcm_of_both_block_sizes_in_whole_blocks_of_each(
    engine: int, service: int
) -> None:
    groups = BlockGroups(engine, service)
    assert groups.group_tokens == math.lcm(engine, service) == max(engine, service)
    assert groups.engine_blocks * engine == groups.group_tokens
    assert groups.service_blocks * service == groups.group_tokens
    assert groups.engine_blocks == max(1, service // engine)
    assert groups.service_blocks == max(1, engine // service)


@pytest.mark.parametrize(("engine", "service"), PAIRS)
def test_only_whole_groups_load_and_never_the_last_prompt_token(engine: int, service: int) -> None:
    groups = BlockGroups(engine, service)
    group = groups.group_tokens
    for whole in (1, 2, 5):
        # A prompt of exactly `whole` groups, all cached: vLLM computes the last token itself,
        # so the last group (which holds it) is not loaded.
        assert groups.loadable_tokens(whole * group, whole * group) == (whole - 1) * group
        # One token more, and every cached group loads.
        assert groups.loadable_tokens(whole * group, whole * group + 1) == whole * group
        # The service holding more than the prompt changes nothing.
        assert groups.loadable_tokens(10 * group, whole * group + 1) == whole * group
        # A group the service holds only in part does not load.
        assert groups.loadable_tokens(whole * group + group - 1, 10 * group) == whole * group
        assert groups.loadable_tokens(whole * group - 1, 10 * group) == (whole - 1) * group
    assert groups.loadable_tokens(0, 10 * group) == 0
    assert groups.loadable_tokens(group, 0) == 0  # an empty prompt loads nothing, no error
    assert groups.loadable_tokens(group, 1) == 0


@pytest.mark.parametrize(("engine", "service"), PAIRS)
def test_whole_groups_counts_from_the_prompts_start(engine: int, service: int) -> None:
    groups = BlockGroups(engine, service)
    group = groups.group_tokens
    assert groups.whole_groups(0) == 0
    assert groups.whole_groups(-5) == 0
    assert groups.whole_groups(group - 1) == 0
    assert groups.whole_groups(group) == 1
    assert groups.whole_groups(3 * group + group // 2) == 3


@pytest.mark.parametrize(("engine", "service"), PAIRS)
def test_a_run_of_groups_covers_its_service_blocks_and_its_engine_blocks(
    engine: int, service: int
) -> None:
    groups = BlockGroups(engine, service)
    assert groups.service_range(0, 0) == range(0)
    assert groups.engine_range(2, 2) == range(0)
    services = groups.service_range(1, 3)
    engines = groups.engine_range(1, 3)
    assert len(services) == 2 * groups.service_blocks
    assert len(engines) == 2 * groups.engine_blocks
    # Both ranges cover the very same tokens: groups 1 and 2.
    tokens = range(groups.group_tokens, 3 * groups.group_tokens)
    assert services.start * service == engines.start * engine == tokens.start
    assert services.stop * service == engines.stop * engine == tokens.stop
    # Consecutive runs meet without a gap or an overlap.
    assert groups.service_range(0, 1).stop == services.start
    assert groups.engine_range(0, 1).stop == engines.start


@pytest.mark.parametrize(("engine", "service"), PAIRS)
def test_a_piece_holds_one_service_block_of_kv(engine: int, service: int) -> None:
    groups = BlockGroups(engine, service)
    assert groups.piece_bytes(TOKEN_BYTES * engine) == TOKEN_BYTES * service


@pytest.mark.parametrize(("engine", "service"), PAIRS)
def test_cut_then_join_gives_back_the_groups_bytes_exactly(engine: int, service: int) -> None:
    groups = BlockGroups(engine, service)
    piece_bytes = groups.piece_bytes(TOKEN_BYTES * engine)
    group = random.Random(f"{engine}/{service}").randbytes(TOKEN_BYTES * groups.group_tokens)
    pieces = groups.cut(group)
    assert len(pieces) == groups.service_blocks
    assert all(len(piece) == piece_bytes for piece in pieces)
    assert b"".join(pieces) == group
    assert groups.join(pieces) == group
    assert groups.join([bytes(piece) for piece in pieces]) == group


def test_cut_gives_views_of_the_groups_buffer_without_copying() -> None:
    groups = BlockGroups(128, 64)
    group = bytearray(64)
    first, second = groups.cut(memoryview(group))
    group[0], group[32] = 1, 2
    assert first[0] == 1 and second[0] == 2


def test_cut_takes_a_typed_view_bytewise() -> None:
    groups = BlockGroups(128, 64)
    halves = array("H", range(16))  # a typed buffer (like a tensor's), 32 bytes
    pieces = groups.cut(memoryview(halves))
    assert [len(piece) for piece in pieces] == [16, 16]
    assert groups.join(pieces) == halves.tobytes()


def test_blocks_that_do_not_divide_each_other_group_by_their_lcm() -> None:
    groups = BlockGroups(96, 64)
    assert groups.group_tokens == 192
    assert (groups.engine_blocks, groups.service_blocks) == (2, 3)
    assert groups.loadable_tokens(1000, 1000) == 5 * 192
    assert groups.loadable_tokens(3 * 192, 3 * 192) == 2 * 192
    assert groups.service_range(1, 2) == range(3, 6)
    assert groups.engine_range(1, 2) == range(2, 4)
    assert groups.piece_bytes(TOKEN_BYTES * 96) == TOKEN_BYTES * 64
    group = random.Random(96).randbytes(TOKEN_BYTES * 192)
    assert groups.join(groups.cut(group)) == group


def test_a_group_that_does_not_cut_evenly_is_refused() -> None:
    groups = BlockGroups(96, 64)  # 2 vLLM blocks cut into 3 pieces
    with pytest.raises(ValueError, match="does not cut into 3 pieces"):
        groups.piece_bytes(1)
    with pytest.raises(ValueError, match="do not cut into 3 pieces"):
        groups.cut(bytes(4))
    with pytest.raises(ValueError, match="do not cut into 2 pieces"):
        BlockGroups(128, 64).cut(bytes(3))


def test_join_refuses_a_wrong_number_of_pieces() -> None:
    groups = BlockGroups(256, 64)
    with pytest.raises(ValueError, match="3 pieces given, a group has 4"):
        groups.join([b"a", b"b", b"c"])
    with pytest.raises(ValueError, match="5 pieces given"):
        groups.join([b"a"] * 5)


@pytest.mark.parametrize(("engine", "service"), [(0, 64), (64, 0), (-16, 64), (16, -64), (0, 0)])
def test_block_sizes_below_one_token_are_refused(engine: int, service: int) -> None:
    with pytest.raises(ValueError, match="at least 1 token"):
        BlockGroups(engine, service)
