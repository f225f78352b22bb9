"""Engine views: stores, removals, clears, groups, media, the bound, and prefix queries."""

from __future__ import annotations

from itertools import takewhile

from hypothesis import given
from hypothesis import strategies as st

from cache_service.core.engines.block_hashes import EngineBlockHash
from cache_service.core.engines.decoding import AllBlocksCleared, BlockRemoved, BlockStored
from cache_service.core.engines.views import EngineViews, PrefixHold, normalize_medium


def h(*values: int) -> tuple[EngineBlockHash, ...]:
    return tuple(EngineBlockHash(value) for value in values)


def chain(n: int, start: int = 1) -> list[EngineBlockHash]:
    return [EngineBlockHash(start + i) for i in range(n)]


def test_a_store_is_held_and_a_repeated_store_is_not_counted_twice() -> None:
    views = EngineViews(max_blocks_per_engine=100)
    first = views.apply_events("a", 0, [BlockStored(h(1, 2, 3))])
    again = views.apply_events("a", 0, [BlockStored(h(1, 2, 3))])
    assert (first.stored, again.stored, again.refreshed) == (3, 0, 3)
    assert views.block_count("a") == 3
    assert views.match_prefix(chain(5)) == [PrefixHold("a", "GPU", 3, 0, False)]


def test_a_removal_drops_only_its_medium_and_group() -> None:
    views = EngineViews(max_blocks_per_engine=100)
    views.apply_events(
        "a",
        0,
        [
            BlockStored(h(1, 2), medium="GPU"),
            BlockStored(h(1, 2), medium="CPU"),
            BlockStored(h(1, 2), group_idx=1),
            BlockStored(h(1, 2), group_idx=1, medium="CPU"),
            BlockRemoved(h(2), medium="GPU"),
        ],
    )
    assert not views.holds("a", 0, 0, EngineBlockHash(2), "GPU")
    assert views.holds("a", 0, 0, EngineBlockHash(2), "CPU")
    assert views.holds("a", 0, 1, EngineBlockHash(2), "GPU")
    # Group 1 still holds block 2 on GPU, group 0 does not: a prefix needs both.
    assert views.match_prefix(chain(2)) == [
        PrefixHold("a", "CPU", 2, 0, False),
        PrefixHold("a", "GPU", 1, 0, False),
    ]


def test_a_clear_empties_the_rank_and_leaves_other_ranks() -> None:
    views = EngineViews(max_blocks_per_engine=100)
    views.apply_events("a", 0, [BlockStored(h(1, 2))])
    views.apply_events("a", 1, [BlockStored(h(1, 2, 3))])
    views.apply_events("a", 1, [AllBlocksCleared()])
    assert views.match_prefix(chain(3)) == [PrefixHold("a", "GPU", 2, 0, False)]


def test_the_best_rank_answers_for_the_engine() -> None:
    views = EngineViews(max_blocks_per_engine=100)
    views.apply_events("a", 0, [BlockStored(h(1))])
    views.apply_events("a", 1, [BlockStored(h(1, 2, 3))])
    assert views.match_prefix(chain(4)) == [PrefixHold("a", "GPU", 3, 1, False)]


def test_only_full_attention_groups_are_indexed() -> None:
    views = EngineViews(max_blocks_per_engine=100)
    result = views.apply_events(
        "a",
        0,
        [
            BlockStored(h(1, 2), group_idx=0, kv_cache_spec_kind="full_attention"),
            BlockStored(h(1, 2, 3), group_idx=1, kv_cache_spec_kind="sliding_window"),
        ],
    )
    assert result.ignored == 3
    assert views.match_prefix(chain(3)) == [PrefixHold("a", "GPU", 2, 0, False)]


def test_a_group_learned_late_not_to_be_full_attention_is_forgotten() -> None:
    views = EngineViews(max_blocks_per_engine=100)
    views.apply_events("a", 0, [BlockStored(h(1, 2)), BlockStored(h(1, 2), group_idx=1)])
    views.apply_events("a", 0, [BlockStored(h(5), group_idx=1, kv_cache_spec_kind="mamba")])
    assert views.block_count("a") == 2
    assert views.match_prefix(chain(2))[0].blocks == 2


def test_media_names_are_normalised() -> None:
    assert [normalize_medium(m) for m in (None, "gpu", "CPU_PINNED", "CPU_TIER2", "DISK")] == [
        "GPU",
        "GPU",
        "CPU",
        "DISK",
        "DISK",
    ]
    assert normalize_medium("EXTERNAL") == "EXTERNAL"


def test_the_bound_drops_the_least_recently_stored_and_counts_it() -> None:
    views = EngineViews(max_blocks_per_engine=3)
    views.apply_events("a", 0, [BlockStored(h(1, 2, 3))])
    views.apply_events("a", 0, [BlockStored(h(1))])  # refreshes 1: 2 is now the oldest
    result = views.apply_events("a", 0, [BlockStored(h(4))])
    assert result.dropped == 1 and views.dropped_total("a") == 1
    assert views.block_count("a") == 3
    assert not views.holds("a", 0, 0, EngineBlockHash(2))
    assert views.holds("a", 0, 0, EngineBlockHash(1))
    assert views.match_prefix(chain(3)) == [PrefixHold("a", "GPU", 1, 0, False)]


def test_stale_ranks_are_reported_with_their_holds() -> None:
    views = EngineViews(max_blocks_per_engine=10)
    views.apply_events("a", 0, [BlockStored(h(1))])
    views.set_stale("a", 0, True)
    assert views.is_stale("a")
    assert views.match_prefix(chain(1)) == [PrefixHold("a", "GPU", 1, 0, True)]


def test_the_query_can_be_limited_to_some_engines() -> None:
    views = EngineViews(max_blocks_per_engine=10)
    views.apply_events("a", 0, [BlockStored(h(1))])
    views.apply_events("b", 0, [BlockStored(h(1, 2))])
    assert [hold.engine for hold in views.match_prefix(chain(2), engines=["b", "zz"])] == ["b"]


@given(
    st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(1, 12), min_size=1, max_size=5)),
        max_size=30,
    ),
    st.lists(st.integers(1, 12), max_size=12),
)
def test_leading_blocks_match_a_plain_set_model(
    ops: list[tuple[bool, list[int]]], query: list[int]
) -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    model: set[int] = set()
    for is_store, blocks in ops:
        event = BlockStored(h(*blocks)) if is_store else BlockRemoved(h(*blocks))
        views.apply_events("a", 0, [event])
        model = model | set(blocks) if is_store else model - set(blocks)
    expected = 0
    for block in query:
        if block not in model:
            break
        expected += 1
    holds = views.match_prefix([EngineBlockHash(b) for b in query])
    assert (holds[0].blocks if holds else 0) == expected


def test_a_32k_token_prompt_against_16_engines_counts_every_engine_whole() -> None:
    # How fast this is, is bench/route_scores.py's to measure ("view look-ups alone").
    views = EngineViews(max_blocks_per_engine=100_000)
    prompt = chain(512)  # 32k tokens in blocks of 64
    for engine in range(16):
        # Every engine holds the whole prompt on GPU (the worst case: no early miss), and
        # half of them a quarter of it on CPU too.
        views.apply_events(f"e{engine}", 0, [BlockStored(tuple(prompt))])
        views.apply_events(f"e{engine}", 0, [BlockStored(h(*range(10_000, 12_000)))])
        if engine % 2:
            views.apply_events(f"e{engine}", 0, [BlockStored(tuple(prompt[:128]), medium="CPU")])
    holds = views.match_prefix(prompt)
    assert sorted((hold.engine, hold.medium, hold.blocks) for hold in holds) == sorted(
        [(f"e{e}", "GPU", 512) for e in range(16)]
        + [(f"e{e}", "CPU", 128) for e in range(1, 16, 2)]
    )


_MEDIA = ("GPU", "CPU", "DISK")
_event = st.one_of(
    st.builds(
        BlockStored,
        st.lists(st.integers(1, 10), min_size=1, max_size=4).map(lambda b: h(*b)),
        group_idx=st.sampled_from([None, 0, 1]),
        medium=st.sampled_from(_MEDIA),
        kv_cache_spec_kind=st.sampled_from([None, None, "full_attention", "sliding_window"]),
    ),
    st.builds(
        BlockRemoved,
        st.lists(st.integers(1, 10), min_size=1, max_size=4).map(lambda b: h(*b)),
        group_idx=st.sampled_from([None, 0, 1]),
        medium=st.sampled_from(_MEDIA),
    ),
    st.builds(AllBlocksCleared),
)


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 1), _event | st.just("reset")),
        max_size=40,
    ),
    st.integers(1, 8),
)
def test_the_held_index_counts_exactly_the_blocks_some_engine_holds(
    ops: list[tuple[str, int, object]], bound: int
) -> None:
    # Stores, removals, clears, resets, ignored groups and the bound's drops all keep the
    # index equal to "some engine, rank, group or medium holds it".
    views = EngineViews(max_blocks_per_engine=bound)
    for engine, rank, op in ops:
        if op == "reset":
            views.reset(engine, rank)
        else:
            views.apply_events(engine, rank, [op])  # type: ignore[list-item]
    for value in range(1, 11):
        block = EngineBlockHash(value)
        anyone = any(
            views.holds(engine, rank, group, block, medium)
            for engine in ("a", "b")
            for rank in (0, 1)
            for group in (0, 1)
            for medium in _MEDIA
        )
        assert views.held_prefix([block]) == int(anyone)
    total = sum(views.block_count(engine) for engine in ("a", "b"))
    assert views.held_blocks() <= total
    # The one-walk answer (bitmasks) equals each engine's sets walked one by one.
    for query in ([], chain(3), chain(10), [EngineBlockHash(b) for b in (2, 1, 3, 4)]):
        got = {
            (x.engine, x.medium): (x.blocks, x.data_parallel_rank)
            for x in views.match_prefix(query)
        }
        assert got == _set_walk(views, query)


def _set_walk(
    views: EngineViews, query: list[EngineBlockHash]
) -> dict[tuple[str, str], tuple[int, int]]:
    """Per (engine, medium) holding a leading block: the most any rank holds (every group of
    the rank must hold a block), and the first rank holding that many."""
    best: dict[tuple[str, str], tuple[int, int]] = {}
    for engine in views.engines():
        for rank, state in views._view(engine)._ranks.items():
            media = {medium for groups in state.groups.values() for medium in groups}
            for medium in media:
                count = min(
                    len(list(takewhile(groups.get(medium, set()).__contains__, query)))
                    for groups in state.groups.values()
                )
                if count and count > best.get((engine, medium), (0, 0))[0]:
                    best[(engine, medium)] = (count, rank)
    return best


def test_held_prefix_stops_at_the_first_block_nobody_holds() -> None:
    views = EngineViews(max_blocks_per_engine=100)
    views.apply_events("a", 0, [BlockStored(h(1, 2))])
    views.apply_events("b", 0, [BlockStored(h(3), medium="CPU")])
    assert views.held_prefix(chain(5)) == 3
    views.apply_events("a", 0, [BlockRemoved(h(2))])
    assert views.held_prefix(chain(5)) == 1
    assert views.held_prefix([]) == 0
