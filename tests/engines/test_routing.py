"""Routing scores: one hashing per scheme in use, best-first rows per engine and medium,
stale views, the instances filter, prompts shorter than a block, and the payload store's
own read-only score."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.blocks import Namespace
from cache_service.core.cache import PrefixCache
from cache_service.core.cache_observer import CacheObserver
from cache_service.core.config import CacheConfig
from cache_service.core.engines.block_hashes import EngineBlockHash
from cache_service.core.engines.chain_memo import ChainMemo
from cache_service.core.engines.decoding import BlockStored
from cache_service.core.engines.routing import (
    EngineSpec,
    InstanceScore,
    RouteScorer,
    StoreScore,
    Unscored,
    score_store,
    select_engines,
)
from cache_service.core.engines.schemes import EngineHashScheme, ExtraKeys, scheme_named
from cache_service.core.engines.views import EngineViews
from cache_service.core.errors import InvalidField, UnknownInstance
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.protocols import BlockStore
from cache_service.core.touches import TouchOptions

if TYPE_CHECKING:
    from conftest import VirtualClock

PROMPT = list(range(1000, 1000 + 16 * 10))  # ten blocks of 16
SHA = "vllm-sha256-cbor"


LORAS = (("l", "/adapters/l"),)  # the engines' lora_modules


def spec(
    name: str,
    scheme: str = SHA,
    seed: str | None = "0",
    block_size: int = 16,
    **keys: object,
) -> EngineSpec:
    keys.setdefault("lora_modules", LORAS)
    return EngineSpec(name, scheme, seed, block_size, **keys)  # type: ignore[arg-type]


def chain_of(
    engine: EngineSpec,
    tokens: Sequence[int],
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[EngineBlockHash]:
    """The hashes the engine publishes for `tokens` (schemes are checked against golden
    vectors in test_schemes.py and tests/engines/test_vllm_vectors.py)."""
    assert engine.hash_scheme is not None
    scheme = scheme_named(
        engine.hash_scheme, seed=engine.seed, extra_keys_form=engine.extra_keys_form
    )
    return scheme.normalized(
        tokens,
        block_size=engine.block_size,
        lora_name=lora_name,
        lora_path=engine.lora_path(lora_name),
        cache_salt=cache_salt,
    )


def hold(views: EngineViews, engine: EngineSpec, blocks: Sequence[EngineBlockHash],
          *, medium: str | None = None, rank: int = 0) -> None:  # fmt: skip
    views.apply_events(engine.name, rank, [BlockStored(tuple(blocks), medium=medium)])


class CountingFactory:
    """Builds the real schemes, with every block step counted."""

    def __init__(self) -> None:
        self.steps = 0
        self.built: list[tuple[str, str | None, str]] = []

    def __call__(self, name: str, seed: str | None, form: str) -> EngineHashScheme:
        self.built.append((name, seed, form))
        scheme = scheme_named(name, seed=seed, extra_keys_form=form)
        inner = scheme.step

        def counted(parent: bytes | int | None, tokens: Sequence[int], extra: ExtraKeys) -> object:
            self.steps += 1
            return inner(parent, tokens, extra)

        return replace(scheme, step=counted)  # type: ignore[arg-type]


def test_sixteen_engines_on_two_configurations_hash_the_prompt_twice() -> None:
    views = EngineViews(max_blocks_per_engine=10_000)
    engines = [spec(f"vllm-{i}") for i in range(12)]
    engines += [spec(f"dynamo-{i}", "xxh3-64-1337", None) for i in range(4)]
    for index, engine in enumerate(engines):
        hold(views, engine, chain_of(engine, PROMPT)[: index % 10])
    factory = CountingFactory()
    scorer = RouteScorer(views, scheme_factory=factory)
    scores = scorer.score(PROMPT, engines)
    assert scores.chains_hashed == 2
    assert factory.steps == 2 * 10  # each configuration's chain once: 10 blocks each
    assert len({row.instance for row in scores.instances}) == 16
    scorer.score(PROMPT, engines)
    # Schemes are kept, one per (scheme, seed, extra-keys form).
    assert sorted(factory.built) == [(SHA, "0", "tagged"), ("xxh3-64-1337", None, "tagged")]


def test_different_seeds_or_block_sizes_are_different_chains() -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    engines = [spec("a"), spec("b", seed="1"), spec("c", block_size=32), spec("d")]
    factory = CountingFactory()
    scores = RouteScorer(views, scheme_factory=factory).score(PROMPT, engines)
    assert scores.chains_hashed == 3
    assert factory.steps == 10 + 10 + 5


def test_rows_are_best_first_with_token_counts() -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    a, b, c = spec("a"), spec("b"), spec("c")
    full = chain_of(a, PROMPT)
    hold(views, a, full[:7])
    hold(views, b, full[:3])
    tokens = [*PROMPT, 1, 2, 3]  # a partial last block is never cached
    scores = RouteScorer(views).score(tokens, [c, b, a])
    assert scores.prompt_tokens == len(tokens)
    assert scores.instances == [
        InstanceScore("a", "GPU", 7, 112, len(tokens) - 112, 16, 0, False),
        InstanceScore("b", "GPU", 3, 48, len(tokens) - 48, 16, 0, False),
        InstanceScore("c", "GPU", 0, 0, len(tokens), 16, None, False),
    ]
    assert scores.best == scores.instances[0]


def test_engines_of_different_block_sizes_compare_by_tokens() -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    small, large = spec("small"), spec("large", block_size=64)
    tokens = list(range(256))
    hold(views, small, chain_of(small, tokens)[:5])  # 80 tokens
    hold(views, large, chain_of(large, tokens)[:2])  # 128 tokens
    rows = RouteScorer(views).score(tokens, [small, large]).instances
    assert [(row.instance, row.matched_blocks, row.cached_tokens) for row in rows] == [
        ("large", 2, 128),
        ("small", 5, 80),
    ]


def test_each_medium_is_a_row_and_the_faster_one_wins_a_tie() -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    a, b = spec("a"), spec("b")
    full = chain_of(a, PROMPT)
    hold(views, a, full[:2], medium="GPU")
    hold(views, a, full[:6], medium="CPU")
    hold(views, b, full[:6], medium="DISK")
    rows = RouteScorer(views).score(PROMPT, [a, b]).instances
    assert [(row.instance, row.medium, row.matched_blocks) for row in rows] == [
        ("a", "CPU", 6),
        ("b", "DISK", 6),
        ("a", "GPU", 2),
    ]


def test_a_stale_view_is_flagged_and_ranks_after_a_sound_one_of_equal_tokens() -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    a, b, c = spec("a"), spec("b"), spec("c")
    full = chain_of(a, PROMPT)
    hold(views, a, full[:4])
    hold(views, b, full[:4])
    views.set_stale("a", 0, True)
    rows = RouteScorer(views).score(PROMPT, [a, b, c]).instances
    assert [(row.instance, row.stale) for row in rows] == [("b", False), ("a", True), ("c", False)]


def test_the_best_row_is_a_sound_view_even_when_a_stale_one_claims_more() -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    a, b = spec("a"), spec("b")
    full = chain_of(a, PROMPT)
    hold(views, a, full[:6])
    hold(views, b, full[:3])
    views.set_stale("a", 0, True)  # a lost events: its 6 blocks may be gone
    scores = RouteScorer(views).score(PROMPT, [a, b])
    assert [row.instance for row in scores.instances] == ["a", "b"]  # still shown first
    assert scores.best is not None and scores.best.instance == "b"
    views.set_stale("b", 0, True)  # no sound view holds anything: the stale claim is all
    scores = RouteScorer(views).score(PROMPT, [a, b])
    assert scores.best is not None and scores.best.instance == "a"


def test_a_stale_engine_holding_nothing_is_flagged() -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    views.set_stale("c", 0, True)
    rows = RouteScorer(views).score(PROMPT, [spec("c")]).instances
    assert [(row.instance, row.stale) for row in rows] == [("c", True)]


def test_the_lora_name_and_cache_salt_are_hashed_as_the_engine_does() -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    a = spec("a")
    hold(views, a, chain_of(a, PROMPT, lora_name="l", cache_salt="s1"))
    scorer = RouteScorer(views)

    def held(**extra: str) -> int:
        return scorer.score(PROMPT, [a], **extra).instances[0].matched_blocks

    assert held(lora_name="l", cache_salt="s1") == 10
    assert held(lora_name="l") == 0
    assert held(cache_salt="s1") == 0


def test_a_prompt_shorter_than_a_block_holds_nothing_anywhere() -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    a = spec("a")
    hold(views, a, chain_of(a, PROMPT))
    scores = RouteScorer(views).score(PROMPT[:15], [a])
    assert scores.instances == [InstanceScore("a", "GPU", 0, 0, 15, 16, None, False)]
    assert scores.best is None
    assert RouteScorer(views).score([], [a]).instances[0].tokens_to_prefill == 0


def test_engines_that_cannot_be_hashed_are_listed_with_the_reason() -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    engines = [spec("a"), spec("none", scheme=None), spec("unseeded", "vllm-xxhash", None),  # type: ignore[arg-type]
               spec("odd", scheme="md5"), spec("form", extra_keys_form="v2")]  # fmt: skip
    scores = RouteScorer(views).score(PROMPT, engines)
    assert [row.instance for row in scores.instances] == ["a"]
    reasons = {item.instance: item.reason for item in scores.unscored}
    assert set(reasons) == {"none", "unseeded", "odd", "form"}
    assert "no hash_scheme" in reasons["none"]
    assert "PYTHONHASHSEED" in reasons["unseeded"] and "random" in reasons["unseeded"]
    assert "unknown engine hash scheme" in reasons["odd"]
    assert "unknown extra_keys_form 'v2'" in reasons["form"]
    assert all(isinstance(item, Unscored) for item in scores.unscored)


def test_a_sha256_engine_without_a_seed_is_scored_with_vllms_fixed_default() -> None:
    """vLLM 0.32 roots sha256 and sha256_cbor at "vllm-none-hash" when PYTHONHASHSEED is
    unset: such an engine is scored, and shares its chain with one configured so."""
    views = EngineViews(max_blocks_per_engine=1000)
    unset, named = spec("unset", seed=None), spec("named", seed="vllm-none-hash")
    hold(views, unset, chain_of(named, PROMPT)[:4])
    scores = RouteScorer(views).score(PROMPT, [unset, named])
    assert scores.chains_hashed == 1 and not scores.unscored
    assert {row.instance: row.matched_blocks for row in scores.instances} == {
        "unset": 4,
        "named": 0,
    }


def test_salted_and_lora_prompts_route_by_vllm_032s_tagged_keys() -> None:
    """A salted or LoRA prompt is hashed as vLLM 0.32 hashes it: tagged keys, the LoRA's
    configured path. The untagged (older) form gives other hashes, so an engine of each
    form is matched only by its own."""
    views = EngineViews(max_blocks_per_engine=1000)
    new, old = spec("new"), spec("old", extra_keys_form="untagged")
    for engine in (new, old):
        hold(views, engine, chain_of(engine, PROMPT, cache_salt="tenant-x"))
        hold(views, engine, chain_of(engine, PROMPT, lora_name="l"))
    scorer = RouteScorer(views)
    for keys in ({"cache_salt": "tenant-x"}, {"lora_name": "l"}):
        scores = scorer.score(PROMPT, [new, old], **keys)  # type: ignore[arg-type]
        assert scores.chains_hashed == 2
        assert {row.instance: row.matched_blocks for row in scores.instances} == {
            "new": 10,
            "old": 10,
        }
    # The tagged chain is vLLM 0.32's own (tests/engines/vllm_vectors.py pins it).
    tagged = scheme_named(SHA, seed="0").normalized(
        PROMPT, block_size=16, lora_name="l", lora_path="/adapters/l"
    )
    assert chain_of(new, PROMPT, lora_name="l") == tagged != chain_of(old, PROMPT, lora_name="l")


def test_a_lora_whose_path_an_engine_does_not_know_leaves_it_unscored() -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    known, unknown = spec("known"), spec("unknown", lora_modules=())
    old = spec("old", extra_keys_form="untagged", lora_modules=())  # hashes the name only
    sglang = spec("s", "sglang", None, lora_modules=())  # hashes tokens only
    hold(views, known, chain_of(known, PROMPT, lora_name="l"))
    scores = RouteScorer(views).score(PROMPT, [known, unknown, old, sglang], lora_name="l")
    assert {row.instance for row in scores.instances} == {"known", "old", "s"}
    (missing,) = scores.unscored
    assert missing.instance == "unknown"
    assert "'l' is not in the engine's lora_modules" in missing.reason


def test_the_instances_filter_keeps_the_named_in_order_and_refuses_unknown_names() -> None:
    engines = [spec("a"), spec("b"), spec("c")]
    assert select_engines(engines, None) == engines
    assert [e.name for e in select_engines(engines, ["c", "a", "c"])] == ["c", "a"]
    with pytest.raises(UnknownInstance) as refused:
        select_engines(engines, ["a", "x", "b", "y"])
    assert refused.value.status == 422
    assert refused.value.problem_type.endswith("/unknown-instance")
    assert refused.value.field == "instances[1]"
    assert "'x', 'y'" in refused.value.detail
    assert [e["field"] for e in refused.value.to_problem()["errors"]] == [
        "instances[1]",
        "instances[3]",
    ]


@settings(max_examples=40, deadline=None)
@given(
    held=st.lists(st.integers(0, 10), min_size=1, max_size=6),
    cut=st.integers(0, 16 * 10 + 7),
)
def test_each_engine_scores_the_prefix_it_holds(held: list[int], cut: int) -> None:
    views = EngineViews(max_blocks_per_engine=1000)
    engines = [spec(f"e{i}") for i in range(len(held))]
    full = chain_of(engines[0], PROMPT)
    for engine, count in zip(engines, held, strict=True):
        hold(views, engine, full[:count])
    tokens = [*PROMPT, *range(7)][:cut]  # up to 7 tokens past the last full block
    rows = RouteScorer(views).score(tokens, engines).instances
    by_name = {row.instance: row for row in rows}
    for engine, count in zip(engines, held, strict=True):
        expected = min(count, cut // 16)
        row = by_name[engine.name]
        assert (row.matched_blocks, row.cached_tokens) == (expected, 16 * expected)
        assert row.tokens_to_prefill == cut - 16 * expected
    assert [row.cached_tokens for row in rows] == sorted(
        (row.cached_tokens for row in rows), reverse=True
    )


_FLEET = [
    spec("v0"),
    spec("v1", extra_keys_form="untagged"),
    spec("v2", "vllm-sha256"),
    spec("s0", "sglang", None),
    spec("d0", "xxh3-64-1337", None, block_size=8),
]
_HOLD = st.tuples(
    st.integers(0, len(_FLEET) - 1),  # which engine
    st.integers(0, 2),  # which prompt's chain
    st.integers(0, 12),  # from block
    st.integers(0, 12),  # how many blocks
    st.sampled_from([None, "CPU"]),
    st.integers(0, 1),  # rank
)


@settings(max_examples=60, deadline=None)
@given(
    holds=st.lists(_HOLD, max_size=12),
    queries=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 16 * 12 + 5), st.sampled_from([None, "l"])),
        min_size=1,
        max_size=6,
    ),
    segment_blocks=st.integers(1, 5),
)
def test_memo_and_early_stop_give_exactly_the_full_hash_answers(
    holds: list[tuple[int, int, int, int, str | None, int]],
    queries: list[tuple[int, int, str | None]],
    segment_blocks: int,
) -> None:
    # Prompts share prefixes (1 and 2 extend 0 differently), engines hold runs of their
    # chains with gaps, in two media and ranks; the reference hashes every block each time.
    base = [*PROMPT, *range(5000, 5000 + 16 * 3)]
    prompts = [base, [*base[:100], *range(7000, 7100)], [*base, *range(9000, 9040)]]
    views = EngineViews(max_blocks_per_engine=40)  # small: the bound's drops happen too
    for engine_index, prompt_index, start, count, medium, rank in holds:
        engine = _FLEET[engine_index]
        chain = chain_of(engine, prompts[prompt_index], lora_name="l")
        chain += chain_of(engine, prompts[prompt_index])
        hold(views, engine, chain[start : start + count], medium=medium, rank=rank)
    memo = ChainMemo(max_blocks=30, segment_blocks=segment_blocks)
    fast, reference = RouteScorer(views, memo=memo), RouteScorer(views, full_hash=True)
    for prompt_index, cut, lora in queries * 2:  # the second pass meets a warm memo
        tokens = prompts[prompt_index][:cut]
        assert fast.score(tokens, _FLEET, lora_name=lora) == reference.score(
            tokens, _FLEET, lora_name=lora
        )
    assert memo.blocks <= 30


def test_a_prompt_nobody_holds_past_its_first_blocks_is_not_hashed_further() -> None:
    views = EngineViews(max_blocks_per_engine=10_000)
    engines = [spec(f"e{i}") for i in range(4)]
    tokens = list(range(16 * 100))
    hold(views, engines[0], chain_of(engines[0], tokens)[:3])
    factory = CountingFactory()
    scores = RouteScorer(views, scheme_factory=factory).score(tokens, engines)
    assert scores.instances[0].matched_blocks == 3
    assert factory.steps == 16  # one segment of 16 blocks, not 100 blocks
    factory.steps = 0
    RouteScorer(views, scheme_factory=factory, full_hash=True).score(tokens, engines)
    assert factory.steps == 100


def test_a_shared_memo_spares_a_later_scorer_the_hashing() -> None:
    views = EngineViews(max_blocks_per_engine=10_000)
    engine = spec("a")
    tokens = list(range(16 * 64))
    hold(views, engine, chain_of(engine, tokens))
    memo = ChainMemo()
    factory = CountingFactory()
    first = RouteScorer(views, scheme_factory=factory, memo=memo).score(tokens, [engine])
    assert factory.steps == 64
    again = RouteScorer(views, scheme_factory=factory, memo=memo).score(tokens, [engine])
    assert again == first and factory.steps == 64


class LookupCounter(CacheObserver):
    """Counts the lookups a cache reports."""

    def __init__(self) -> None:
        self.lookups = 0

    def on_lookup(self, **_: object) -> None:
        self.lookups += 1


@pytest.mark.store_opened(lifetimes=DEFAULT_LIFETIMES)
def test_the_store_score_is_the_stored_prefix_and_touches_nothing(
    store: BlockStore, clock: VirtualClock
) -> None:
    events = LookupCounter()
    cache = PrefixCache(
        store,
        config=CacheConfig(default_block_size=16),
        touches=TouchOptions(defer=True),
        clock=clock,
        events=events,
    )
    namespace = Namespace(model="m")
    cache.insert(namespace, PROMPT[:64], [b"x"] * 4)
    scored = score_store(cache, namespace, PROMPT)
    assert scored == StoreScore(4, 64, len(PROMPT) - 64, 16)
    assert cache.touches.pending == 0
    assert events.lookups == 0
    assert score_store(cache, Namespace(model="m", salt="other"), PROMPT).matched_blocks == 0
    with pytest.raises(InvalidField):
        score_store(cache, namespace, PROMPT, block_size=32)
    # A lookup of the same prompt, by contrast, is counted and marks the prefix used.
    cache.match_prefix(namespace, PROMPT)
    assert (cache.touches.pending, events.lookups) == (1, 1)
