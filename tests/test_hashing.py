"""Chained block keys: golden vectors, namespace encoding, determinism and chain properties."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from cache_service.core.blocks import Namespace
from cache_service.core.hashing import DEFAULT_SEED, BlockHasher, seed_fingerprint
from cache_service.core.tokens import MAX_TOKEN_ID, bytes_to_tokens, tokens_to_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]

# -- an independent implementation, straight from the byte layout in hashing.py's docstring --


def _field(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def reference_root(seed: str, namespace: Namespace) -> bytes:
    """root = xxh3_128(b"PCNS" || u8(1) || field(seed) || field(model) || ... || field(salt))."""
    data = (
        b"PCNS"
        + struct.pack("<B", 1)
        + _field(seed)
        + _field(namespace.model)
        + _field(namespace.kv_layout)
        + _field(namespace.tenant)
        + _field(namespace.salt)
    )
    return bytes(xxhash.xxh3_128_digest(data))


def reference_keys(
    seed: str, namespace: Namespace, tokens: list[int], block_size: int
) -> list[bytes]:
    """key[i] = xxh3_128(key[i-1] || tokens of block i as u32_le each); key[-1] is the root."""
    parent = reference_root(seed, namespace)
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        parent = bytes(xxhash.xxh3_128_digest(parent + struct.pack(f"<{block_size}I", *block)))
        keys.append(parent)
    return keys


# -- golden vectors (computed once with the reference functions above, then pinned) ---------

LLAMA = Namespace(model="llama-3-8b")
LAYOUT_AND_SALT = Namespace(model="llama-3-8b", kv_layout="paged-16x128", salt="v2-salt")
EMPTY = Namespace(model="")
GOLDEN_TOKENS = [0, 1, 2**31, 2**32 - 1, 7, 8, 9, 10, 42, 0, 2**32 - 1, 1]

GOLDEN_ROOTS = {
    LLAMA: "85d8858b13d688a8e182ee5bee1dfecf",
    LAYOUT_AND_SALT: "03bd68347c6a97d5db5df5d40b5aaf75",
    EMPTY: "3d5bf6100d82dac72c74a8405879a346",
}
GOLDEN_KEYS = {
    LLAMA: [
        "851802f1ea2db6dee376ec14045d1ac4",
        "f71468285145bbc90d6e2b8bd1413e2a",
        "9d5f8a2dc609e34d9bb2108bf72d7d01",
    ],
    LAYOUT_AND_SALT: [
        "de29081c41c89560808e282d062c7faf",
        "e1a71e5088e0bb62fdb9e8c41480b645",
        "b3cd01885faa3c6ed8d967f32eae733b",
    ],
}


@pytest.mark.parametrize("namespace", list(GOLDEN_ROOTS), ids=["llama", "layout-salt", "empty"])
def test_root_key_matches_golden_vector(namespace: Namespace) -> None:
    assert reference_root(DEFAULT_SEED, namespace).hex() == GOLDEN_ROOTS[namespace]
    assert BlockHasher().root(namespace).hex() == GOLDEN_ROOTS[namespace]


@pytest.mark.parametrize("namespace", list(GOLDEN_KEYS), ids=["llama", "layout-salt"])
def test_block_keys_match_golden_vectors(namespace: Namespace) -> None:
    expected = GOLDEN_KEYS[namespace]
    reference = reference_keys(DEFAULT_SEED, namespace, GOLDEN_TOKENS, 4)
    assert [key.hex() for key in reference] == expected
    keys = BlockHasher().keys(namespace, GOLDEN_TOKENS, block_size=4)
    assert [key.hex() for key in keys] == expected


def test_chain_links_carry_parent_tokens_and_depth() -> None:
    hasher = BlockHasher()
    links = hasher.chain(LLAMA, tokens_to_bytes(GOLDEN_TOKENS), block_size=4)
    assert [link.depth for link in links] == [0, 1, 2]
    assert links[0].parent == hasher.root(LLAMA)
    assert [link.parent for link in links[1:]] == [link.key for link in links[:-1]]
    assert [bytes_to_tokens(link.tokens) for link in links] == [
        GOLDEN_TOKENS[0:4],
        GOLDEN_TOKENS[4:8],
        GOLDEN_TOKENS[8:12],
    ]


def test_default_seed_is_the_documented_one() -> None:
    assert DEFAULT_SEED == "prompt-cache-v1"
    assert BlockHasher().seed == DEFAULT_SEED


# -- namespace encoding ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (Namespace(model="ab", kv_layout="c"), Namespace(model="a", kv_layout="bc")),
        (Namespace(model="m", tenant="ab", salt="c"), Namespace(model="m", tenant="a", salt="bc")),
        (Namespace(model="m", salt="ab", tenant="c"), Namespace(model="m", salt="a", tenant="bc")),
        (Namespace(model="m", kv_layout="x"), Namespace(model="m", tenant="x")),
        (Namespace(model="m", tenant="x"), Namespace(model="m", salt="x")),
    ],
    ids=["model|kv_layout", "tenant|salt", "salt|tenant", "kv_layout-vs-tenant", "tenant-vs-salt"],
)
def test_namespace_encoding_is_unambiguous(left: Namespace, right: Namespace) -> None:
    assert reference_root(DEFAULT_SEED, left) != reference_root(DEFAULT_SEED, right)
    assert BlockHasher().root(left) != BlockHasher().root(right)


def test_same_tokens_in_different_namespaces_get_different_keys() -> None:
    hasher = BlockHasher()
    tokens = list(range(8))
    assert hasher.keys(LLAMA, tokens, block_size=4) != hasher.keys(
        Namespace(model="llama-3-8b", tenant="acme"), tokens, block_size=4
    )


def test_different_seeds_give_different_keys() -> None:
    tokens = list(range(8))
    assert BlockHasher(seed="a").keys(LLAMA, tokens, block_size=4) != BlockHasher(seed="b").keys(
        LLAMA, tokens, block_size=4
    )


# -- full blocks only, token range -----------------------------------------------------------


@pytest.mark.parametrize("extra", [1, 2, 3])
def test_trailing_partial_block_gets_no_key(extra: int) -> None:
    hasher = BlockHasher()
    tokens = list(range(8 + extra))
    assert hasher.keys(LLAMA, tokens, block_size=4) == hasher.keys(LLAMA, tokens[:8], block_size=4)
    assert len(hasher.keys(LLAMA, tokens, block_size=4)) == 2


def test_prompt_shorter_than_a_block_has_no_keys() -> None:
    assert BlockHasher().keys(LLAMA, [1, 2, 3], block_size=4) == []
    assert BlockHasher().keys(LLAMA, [], block_size=4) == []


@pytest.mark.parametrize("block_size", [0, -1])
def test_chain_rejects_non_positive_block_size(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher().chain(LLAMA, tokens_to_bytes([1, 2, 3, 4]), block_size=block_size)


@pytest.mark.parametrize("token", [-1, 2**32, 2**40])
def test_tokens_to_bytes_rejects_ids_outside_uint32(token: int) -> None:
    with pytest.raises(ValueError, match="token ids"):
        tokens_to_bytes([1, token, 2])


def test_tokens_to_bytes_is_uint32_little_endian() -> None:
    assert tokens_to_bytes([0, 1, 2**31, MAX_TOKEN_ID]) == (
        b"\0\0\0\0" + b"\x01\0\0\0" + b"\0\0\0\x80" + b"\xff\xff\xff\xff"
    )
    assert bytes_to_tokens(tokens_to_bytes(GOLDEN_TOKENS)) == GOLDEN_TOKENS


def test_bytes_to_tokens_rejects_a_length_not_a_multiple_of_four() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        bytes_to_tokens(b"\0\0\0")


# -- no per-process randomness ---------------------------------------------------------------


def test_two_hashers_give_identical_keys() -> None:
    tokens = list(range(100))
    assert BlockHasher().keys(LLAMA, tokens, block_size=8) == BlockHasher().keys(
        LLAMA, tokens, block_size=8
    )


def test_a_fresh_process_gives_identical_keys() -> None:
    tokens = list(range(100))
    script = (
        "import json, sys\n"
        "from cache_service.core.blocks import Namespace\n"
        "from cache_service.core.hashing import BlockHasher, seed_fingerprint\n"
        "ns = Namespace(model='llama-3-8b', kv_layout='paged', tenant='t', salt='s')\n"
        "keys = BlockHasher().keys(ns, list(range(100)), block_size=8)\n"
        "json.dump({'keys': [k.hex() for k in keys], 'fp': seed_fingerprint('x')}, sys.stdout)\n"
    )
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, "PYTHONHASHSEED": "random"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    answer = json.loads(done.stdout)
    namespace = Namespace(model="llama-3-8b", kv_layout="paged", tenant="t", salt="s")
    assert answer["keys"] == [k.hex() for k in BlockHasher().keys(namespace, tokens, block_size=8)]
    assert answer["fp"] == seed_fingerprint("x")


def test_seed_fingerprint_is_stable_and_seed_dependent() -> None:
    assert seed_fingerprint(DEFAULT_SEED) == seed_fingerprint(DEFAULT_SEED)
    assert seed_fingerprint(DEFAULT_SEED) == xxhash.xxh3_64_hexdigest(
        b"PCSEED" + b"prompt-cache-v1"
    )
    assert seed_fingerprint(DEFAULT_SEED) != seed_fingerprint("prompt-cache-v2")
    assert BlockHasher(seed="other").fingerprint == seed_fingerprint("other")
    assert len(seed_fingerprint(DEFAULT_SEED)) == 16


# -- properties ------------------------------------------------------------------------------

token_ids = st.integers(min_value=0, max_value=MAX_TOKEN_ID)
prompts = st.lists(token_ids, max_size=64)
block_sizes = st.integers(min_value=1, max_value=8)
namespaces = st.builds(
    Namespace,
    model=st.text(max_size=8),
    kv_layout=st.text(max_size=4),
    tenant=st.text(max_size=4),
    salt=st.text(max_size=4),
)


@given(namespace=namespaces, tokens=prompts, block_size=block_sizes)
def test_keys_are_deterministic_and_match_the_reference(
    namespace: Namespace, tokens: list[int], block_size: int
) -> None:
    first = BlockHasher().keys(namespace, tokens, block_size=block_size)
    assert first == BlockHasher().keys(namespace, tokens, block_size=block_size)
    assert first == reference_keys(DEFAULT_SEED, namespace, tokens, block_size)
    assert len(first) == len(tokens) // block_size


@given(tokens=prompts, cut=st.integers(min_value=0, max_value=64), block_size=block_sizes)
def test_keys_of_a_prefix_are_a_prefix_of_the_longer_prompts_keys(
    tokens: list[int], cut: int, block_size: int
) -> None:
    hasher = BlockHasher()
    longer = hasher.keys(LLAMA, tokens, block_size=block_size)
    shorter = hasher.keys(LLAMA, tokens[:cut], block_size=block_size)
    assert longer[: len(shorter)] == shorter


@given(data=st.data(), block_size=block_sizes)
def test_changing_one_token_changes_its_block_and_every_later_key_only(
    data: st.DataObject, block_size: int
) -> None:
    tokens = data.draw(st.lists(token_ids, min_size=block_size, max_size=64))
    position = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    replacement = data.draw(token_ids.filter(lambda t: t != tokens[position]))
    changed = [*tokens[:position], replacement, *tokens[position + 1 :]]
    hasher = BlockHasher()
    before = hasher.keys(LLAMA, tokens, block_size=block_size)
    after = hasher.keys(LLAMA, changed, block_size=block_size)
    block = position // block_size
    assert before[:block] == after[:block]
    for index in range(block, len(before)):
        assert before[index] != after[index]


@given(
    namespace=namespaces,
    tokens=prompts,
    blocks_known=st.integers(min_value=0, max_value=16),
    block_size=block_sizes,
)
def test_extending_from_a_parent_key_gives_the_whole_prompts_links(
    namespace: Namespace, tokens: list[int], blocks_known: int, block_size: int
) -> None:
    hasher = BlockHasher()
    whole = hasher.chain(namespace, tokens_to_bytes(tokens), block_size=block_size)
    known = min(blocks_known, len(whole))
    parent = whole.keys[known - 1] if known else whole.root
    rest = tokens_to_bytes(tokens[known * block_size :])
    extended = hasher.extend(parent, rest, block_size=block_size, start_depth=known)
    assert extended == list(whole[known:])


def test_extend_refuses_a_negative_depth_and_a_non_positive_block_size() -> None:
    hasher = BlockHasher()
    root = hasher.root(LLAMA)
    with pytest.raises(ValueError, match="start_depth"):
        hasher.extend(root, tokens_to_bytes([1, 2]), block_size=2, start_depth=-1)
    with pytest.raises(ValueError, match="block_size"):
        hasher.extend(root, tokens_to_bytes([1, 2]), block_size=0, start_depth=0)


@pytest.mark.parametrize("cut", [1, 9, 20])
def test_a_truncated_encoded_namespace_is_a_value_error(cut: int) -> None:
    from cache_service.core.hashing import decode_namespace, encode_namespace  # noqa: PLC0415

    encoded = encode_namespace("seed", Namespace(model="m", kv_layout="bf16", tenant="t"))
    with pytest.raises(ValueError):
        decode_namespace(encoded[: len(encoded) - cut])
