"""The memoized, early-stopping walk of a prompt's engine block hashes: the same hashes as
hashing the whole prompt, fewer hashes when a prefix was seen or nobody holds the rest, a
bounded memo shared safely between threads."""

from __future__ import annotations

import gc
import threading
import tracemalloc
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.engines.block_hashes import EngineBlockHash
from cache_service.core.engines.chain_memo import ChainMemo, prompt_chain
from cache_service.core.engines.schemes import EngineHashScheme, ExtraKeys, scheme_named

SCHEMES = ("vllm-sha256", "vllm-sha256-cbor", "vllm-xxhash", "sglang", "xxh3-64-1337")


def scheme(name: str) -> EngineHashScheme:
    return scheme_named(name, seed="0" if name.startswith("vllm") else None)


class Counted:
    """A real scheme whose block steps are counted."""

    def __init__(self, name: str) -> None:
        self.steps = 0
        inner = scheme(name)
        step = inner.step

        def counted(parent: bytes | int | None, tokens: Sequence[int], extra: ExtraKeys) -> object:
            self.steps += 1
            return step(parent, tokens, extra)

        self.scheme = replace(inner, step=counted)  # type: ignore[arg-type]


def tokens_of(n: int, start: int = 0) -> list[int]:
    return [(start + i * 7919) % 50_000 for i in range(n)]


names = st.sampled_from(SCHEMES)
prompts = st.lists(st.integers(0, 2**32 - 1), max_size=200)
extras = st.sampled_from([None, "lora-a"]), st.sampled_from([None, "", "salt"])
PATHS = {"lora-a": "/adapters/a"}  # the engine's lora_modules: vLLM 0.32 hashes the path


@settings(max_examples=60, deadline=None)
@given(names, prompts, st.tuples(st.integers(1, 9), st.integers(1, 5)), *extras)
def test_the_walk_without_memo_is_the_whole_prompts_hashes(
    name: str, tokens: list[int], sizes: tuple[int, int], lora: str | None, salt: str | None
) -> None:
    block_size, seg = sizes
    s = scheme(name)
    keys = {"lora_name": lora, "lora_path": PATHS.get(lora or ""), "cache_salt": salt}
    expected = s.normalized(tokens, block_size=block_size, **keys)
    got = prompt_chain(s, tokens, block_size=block_size, segment_blocks=seg, **keys)
    assert got == expected


@settings(max_examples=60, deadline=None)
@given(
    names,
    st.lists(
        st.tuples(st.integers(0, 60), st.lists(st.integers(0, 3), max_size=60), *extras),
        min_size=1,
        max_size=8,
    ),
    st.integers(1, 4),
    st.integers(1, 40),
)
def test_a_memo_shared_by_prompts_with_common_prefixes_never_changes_a_hash(
    name: str,
    requests: list[tuple[int, list[int], str | None, str | None]],
    block_size: int,
    max_blocks: int,
) -> None:
    # Each prompt reuses a prefix of one base prompt then diverges: hits, partial hits and
    # evictions (a small bound) must all give exactly what hashing everything gives.
    s = scheme(name)
    base = tokens_of(60)
    memo = ChainMemo(max_blocks=max_blocks, segment_blocks=3)
    for keep, tail, lora, salt in requests:
        tokens = base[:keep] + tail
        keys = {"lora_name": lora, "lora_path": PATHS.get(lora or ""), "cache_salt": salt}
        expected = s.normalized(tokens, block_size=block_size, **keys)
        got = prompt_chain(s, tokens, block_size=block_size, memo=memo, **keys)
        assert got == expected
        assert memo.blocks <= max_blocks


@settings(max_examples=60, deadline=None)
@given(names, st.integers(0, 40), st.sets(st.integers(0, 40)), st.integers(1, 6))
def test_the_walk_is_cut_only_past_the_first_block_nobody_holds(
    name: str, n_blocks: int, held_indexes: set[int], seg: int
) -> None:
    s = scheme(name)
    tokens = tokens_of(n_blocks * 4)
    full = s.normalized(tokens, block_size=4)
    held = {full[i] for i in held_indexes if i < len(full)}

    def held_prefix(chain: Sequence[EngineBlockHash]) -> int:
        count = 0
        for block in chain:
            if block not in held:
                break
            count += 1
        return count

    first_unheld = held_prefix(full)
    for memo in (None, ChainMemo(segment_blocks=seg)):
        for _ in range(2):  # cold, then through the memo
            got = prompt_chain(
                s, tokens, block_size=4, memo=memo, held_prefix=held_prefix, segment_blocks=seg
            )
            assert got == full[: len(got)]  # a prefix of the whole chain
            assert len(got) >= first_unheld  # never cut before it: no count can change


def test_a_repeated_prompt_is_not_hashed_again_and_an_extension_only_past_the_shared_part() -> None:
    counted = Counted("vllm-sha256")
    memo = ChainMemo(segment_blocks=4)
    prompt = tokens_of(16 * 40)
    first = prompt_chain(counted.scheme, prompt, block_size=16, memo=memo)
    assert counted.steps == 40 and memo.blocks == 40
    assert prompt_chain(counted.scheme, prompt, block_size=16, memo=memo) == first
    assert counted.steps == 40  # all ten segments from the memo
    longer = prompt + tokens_of(16 * 6, start=99)
    prompt_chain(counted.scheme, longer, block_size=16, memo=memo)
    assert counted.steps == 46


def test_hashing_stops_a_segment_after_the_first_block_nobody_holds() -> None:
    counted = Counted("vllm-sha256-cbor")
    prompt = tokens_of(16 * 100)
    full = scheme("vllm-sha256-cbor").normalized(prompt, block_size=16)
    held = set(full[:20])
    got = prompt_chain(
        counted.scheme,
        prompt,
        block_size=16,
        segment_blocks=8,
        held_prefix=lambda chain: next(
            (i for i, block in enumerate(chain) if block not in held), len(chain)
        ),
    )
    # Three segments of 8: the third holds the first unheld block (20), its last (23) is
    # unheld, so the chain is cut before 23 and nothing past the third segment is hashed.
    assert got == full[:23]
    assert counted.steps == 24


def test_the_lora_name_and_salt_key_the_memo_only_for_schemes_that_hash_them() -> None:
    prompt = tokens_of(64)
    vllm, sglang = Counted("vllm-sha256"), Counted("sglang")
    memo = ChainMemo(segment_blocks=2)
    loras = [(None, None), ("a", "/adapters/a"), ("b", "/adapters/b"), ("a", "/elsewhere/a")]
    for lora, path in loras:
        for counted in (vllm, sglang):
            keys = {"lora_name": lora, "lora_path": path}
            expected = scheme(counted.scheme.name).normalized(prompt, block_size=16, **keys)
            got = prompt_chain(counted.scheme, prompt, block_size=16, memo=memo, **keys)
            assert got == expected
    assert vllm.steps == 4 * 4  # each LoRA its own chain, and each path of one (vLLM 0.32)
    assert sglang.steps == 4  # SGLang does not hash the LoRA: one chain for all four


def test_the_extra_keys_form_keys_the_memo() -> None:
    """A tagged and an untagged engine of one scheme and seed hash a salted prompt apart."""
    prompt = tokens_of(64)
    memo = ChainMemo(segment_blocks=2)
    for form in ("tagged", "untagged", "tagged"):
        s = scheme_named("vllm-sha256", seed="0", extra_keys_form=form)
        expected = s.normalized(prompt, block_size=16, cache_salt="tenant")
        assert prompt_chain(s, prompt, block_size=16, cache_salt="tenant", memo=memo) == expected
    assert memo.hits == 2 and memo.misses == 4  # the second tagged walk: both segments hit


def test_a_token_outside_u32_is_hashed_without_the_memo() -> None:
    s = scheme("vllm-sha256")
    tokens = [2**40, *tokens_of(31)]
    memo = ChainMemo()
    assert prompt_chain(s, tokens, block_size=16, memo=memo) == s.normalized(tokens, block_size=16)
    assert len(memo) == 0


def test_the_bound_drops_the_least_recently_used_segments() -> None:
    s = scheme("xxh3-64-1337")
    memo = ChainMemo(max_blocks=8, segment_blocks=4)
    a, b = tokens_of(64), tokens_of(64, start=5)
    prompt_chain(s, a, block_size=8, memo=memo)  # 8 blocks: 2 segments
    prompt_chain(s, a, block_size=8, memo=memo)
    assert (memo.hits, memo.blocks) == (2, 8)
    prompt_chain(s, b, block_size=8, memo=memo)  # evicts both of a's
    assert memo.blocks == 8
    prompt_chain(s, a, block_size=8, memo=memo)
    assert memo.hits == 2  # a was evicted: missed again


def test_threads_sharing_a_memo_all_get_the_whole_prompts_hashes() -> None:
    s = scheme("vllm-sha256")
    prompts = [tokens_of(16 * 64, start=k % 3) for k in range(12)]
    expected = {k % 3: s.normalized(prompts[k], block_size=16) for k in range(3)}
    memo = ChainMemo(max_blocks=100, segment_blocks=4)  # small: evictions race with reads
    failures: list[str] = []

    def work(k: int) -> None:
        for _ in range(5):
            if prompt_chain(s, prompts[k], block_size=16, memo=memo) != expected[k % 3]:
                failures.append(f"thread {k}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert memo.blocks <= 100


def test_a_memoized_block_costs_under_100_bytes() -> None:
    s = scheme("xxh3-64-1337")
    prompts = [tokens_of(16 * 2048, start=k) for k in range(3)]
    gc.collect()
    tracemalloc.start()
    memo = ChainMemo()
    for prompt in prompts:
        prompt_chain(s, prompt, block_size=16, memo=memo)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert memo.blocks == 3 * 2048
    assert used / memo.blocks < 100, f"{used / memo.blocks:.1f} bytes per block"


def test_a_memo_needs_a_positive_bound() -> None:
    with pytest.raises(ValueError):
        ChainMemo(max_blocks=0)
    with pytest.raises(ValueError):
        ChainMemo(segment_blocks=0)


def test_stats_count_segments_blocks_hits_and_misses() -> None:
    memo = ChainMemo(segment_blocks=4)
    tokens = tokens_of(10 * 16)
    prompt_chain(scheme("sglang"), tokens, block_size=16, memo=memo)
    assert memo.stats() == {"segments": 3, "blocks": 10, "hits": 0, "misses": 3}
    prompt_chain(scheme("sglang"), tokens, block_size=16, memo=memo)
    assert memo.stats() == {"segments": 3, "blocks": 10, "hits": 3, "misses": 3}


def test_a_copy_holds_the_same_segments_and_is_independent() -> None:
    memo = ChainMemo(segment_blocks=4)
    tokens = tokens_of(8 * 16)
    prompt_chain(scheme("sglang"), tokens, block_size=16, memo=memo)
    other = memo.copy()
    other.clear()
    assert (len(memo), memo.blocks, len(other)) == (2, 8, 0)
    copied = memo.copy()
    chain = prompt_chain(scheme("sglang"), tokens, block_size=16, memo=copied)
    assert chain == scheme("sglang").normalized(tokens, block_size=16)
    assert copied.stats()["hits"] == 2 and memo.stats()["hits"] == 0
