"""vLLM 0.32's own block hashes (tests/engines/vllm_vectors.py, made by vLLM and pinned)
against the package's schemes, without vLLM: tagged extra keys, the LoRA adapter's path,
the fixed seed of an unset PYTHONHASHSEED, prompt-embeds digests, a LoRA name equal to the
salt (one str object or two), and events as vLLM 0.32 publishes them (untagged keys, no
path) verified, or diagnosed, with each extra-keys form."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from cache_service.core.engines.block_hashes import normalize_block_hash
from cache_service.core.engines.schemes import (
    SCHEMES,
    EngineHashScheme,
    diagnose_stored_event,
    scheme_named,
    verify_stored_event,
)
from cache_service.core.engines.schemes.vllm import (
    lay_out_strings,
    tagged_event_keys,
    vllm_scheme,
)
from tests.engines.vllm_vectors import (
    ALGORITHMS,
    BLOCK_SIZE,
    EMBEDS,
    PINNED,
    PROMPTS,
    SCHEME_NAMES,
    UNSET,
    Prompt,
    unjson,
)

RUNS = [
    (scheme, seed, prompt)
    for scheme, seeds in PINNED["hashes"].items()
    for seed, prompts in seeds.items()
    for prompt in prompts
]
# The rule derives these prompts' keys (the shared one's only with one str object, below).
TEXT = ("plain", "salted", "lora", "lora-salted", "lora-same-salt")
SHARED = "lora-same-salt-shared"  # the salt is the LoRA name's own str object
PICKLED = ("vllm-sha256", "vllm-xxhash")


def ours(scheme: str, seed: str, form: str = "tagged") -> EngineHashScheme:
    """Our scheme as an engine's configuration builds it (no seed for PYTHONHASHSEED unset)."""
    return scheme_named(scheme, seed=None if seed == UNSET else seed, extra_keys_form=form)


def event_of(prompt: Prompt, keys: Any, hashes: list[Any]) -> dict[str, Any]:
    """A BlockStored as vLLM 0.32 publishes it: untagged extra keys, the LoRA's name only."""
    return {
        "parent": None,
        "token_ids": list(prompt.tokens[: len(hashes) * BLOCK_SIZE]),
        "block_hashes": hashes,
        "block_size": BLOCK_SIZE,
        "extra_keys": unjson(keys),
        "lora_name": None if prompt.lora is None else prompt.lora[0],
    }


def pinned(scheme: str, seed: str, prompt: str) -> list[bytes]:
    """The pinned digests of a prompt's blocks."""
    return [bytes.fromhex(value) for value in PINNED["hashes"][scheme][seed][prompt]]


def test_the_pinned_vectors_are_vllm_032s_and_cover_every_algorithm() -> None:
    assert PINNED["vllm"] == "0.32.0"
    assert set(PINNED["hashes"]) == set(SCHEME_NAMES.values())
    assert {seed for seeds in PINNED["hashes"].values() for seed in seeds} == {"0", UNSET}
    assert set(PINNED["event_extra_keys"]) == set(PROMPTS)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_only_the_xxhash_algorithms_are_random_when_pythonhashseed_is_unset(
    algorithm: str,
) -> None:
    """What vLLM 0.32 did, pinned; our registry's default seeds must say the same."""
    random = PINNED["random_when_unset"][algorithm]
    assert random == algorithm.startswith("xxhash")
    assert (SCHEMES[SCHEME_NAMES[algorithm]].default_seed is None) == random


@pytest.mark.parametrize(("scheme", "seed", "prompt"), [r for r in RUNS if r[2] in TEXT])
def test_a_text_prompt_hashes_as_vllm_032_from_the_rule(
    scheme: str, seed: str, prompt: str
) -> None:
    spec = PROMPTS[prompt]
    lora_name, lora_path = spec.lora or (None, None)
    got = ours(scheme, seed).block_hashes(
        list(spec.tokens),
        block_size=BLOCK_SIZE,
        lora_name=lora_name,
        lora_path=lora_path,
        cache_salt=spec.cache_salt,
    )
    assert [bytes(value).hex() for value in got] == PINNED["hashes"][scheme][seed][prompt]  # type: ignore[arg-type]


@pytest.mark.parametrize(("scheme", "seed", "prompt"), RUNS)
@pytest.mark.parametrize("int_hashes", [True, False])
def test_vllm_032s_events_verify_from_their_untagged_keys(
    scheme: str, seed: str, prompt: str, int_hashes: bool
) -> None:
    """A salted, LoRA or multimodal event as vLLM 0.32 publishes it verifies: no mismatch,
    no false alarm about the seed. The LoRA's path comes from the engine's lora_modules."""
    spec = PROMPTS[prompt]
    digests = [bytes.fromhex(value) for value in PINNED["hashes"][scheme][seed][prompt]]
    hashes = [normalize_block_hash(d) if int_hashes else d for d in digests]
    event = event_of(spec, PINNED["event_extra_keys"][prompt], hashes)
    lora_path = None if spec.lora is None else spec.lora[1]
    result = verify_stored_event(ours(scheme, seed), **event, lora_path=lora_path)
    assert result.ok, result.reason
    assert [bytes(state) for state in result.states] == digests  # type: ignore[arg-type]


def test_the_salted_block_of_the_issue_is_reproduced() -> None:
    """Issue 25: a block with (("cache_salt", "tenant-x"),) was computed from ("tenant-x",)."""
    spec, pinned = PROMPTS["salted"], PINNED["hashes"]["vllm-sha256"]["0"]["salted"]
    tagged = ours("vllm-sha256", "0").block_hashes(
        list(spec.tokens), block_size=BLOCK_SIZE, cache_salt="tenant-x"
    )
    untagged = ours("vllm-sha256", "0", "untagged").block_hashes(
        list(spec.tokens), block_size=BLOCK_SIZE, cache_salt="tenant-x"
    )
    assert [bytes(v).hex() for v in tagged] == pinned  # type: ignore[arg-type]
    assert all(bytes(v).hex() != want for v, want in zip(untagged, pinned, strict=True))  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt", ["lora", "lora-salted"])
def test_a_lora_event_whose_path_is_not_configured_is_unverifiable_not_a_mismatch(
    prompt: str,
) -> None:
    spec = PROMPTS[prompt]
    hashes = [
        normalize_block_hash(bytes.fromhex(h)) for h in PINNED["hashes"]["vllm-sha256"]["0"][prompt]
    ]
    event = event_of(spec, PINNED["event_extra_keys"][prompt], hashes)
    result = verify_stored_event(ours("vllm-sha256", "0"), **event)
    assert result.outcome == "unverifiable" and result.lora_unknown == "adapter-A"
    assert "'adapter-A' is not in the engine's lora_modules" in result.reason
    wrong_path = verify_stored_event(ours("vllm-sha256", "0"), **event, lora_path="/other")
    assert wrong_path.outcome == "mismatch"  # a path configured wrong does not reproduce
    diagnosis = diagnose_stored_event(scheme_name="vllm-sha256", seed="0", **event)
    assert diagnosis.cause == "unverifiable" and "lora_modules" in diagnosis.detail
    # Configured as an older release: only 0.32's form, which needs the path, could tell.
    older = verify_stored_event(ours("vllm-sha256", "0", "untagged"), **event)
    assert older.outcome == "unverifiable" and older.lora_unknown == "adapter-A"


@pytest.mark.parametrize(
    "prompt", ["salted", "lora", "lora-salted", "images", "lora-same-salt", "embeds-salted"]
)
@pytest.mark.parametrize("scheme", ["vllm-sha256", "vllm-xxhash-cbor"])
def test_an_event_hashed_in_the_other_form_names_the_form_not_the_seed(
    scheme: str, prompt: str
) -> None:
    """vLLM 0.32's events checked as an older release's (untagged), and an older release's
    checked as 0.32's: the seed is right, so the answer names extra_keys_form."""
    spec = PROMPTS[prompt]
    lora_path = None if spec.lora is None else spec.lora[1]
    keys = unjson(PINNED["event_extra_keys"][prompt])
    new_hashes = [bytes.fromhex(h) for h in PINNED["hashes"][scheme]["0"][prompt]]
    old_scheme = ours(scheme, "0", "untagged")
    old_hashes = old_scheme.block_hashes(
        list(spec.tokens),
        block_size=BLOCK_SIZE,
        extra_keys_by_block=[
            old_scheme.event_keys(k, spec.lora and spec.lora[0], None) for k in keys
        ],
    )
    for hashes, configured, other in (
        (new_hashes, "untagged", "tagged"),
        (old_hashes, "tagged", "untagged"),
    ):
        event = event_of(spec, keys, [normalize_block_hash(h) for h in hashes])
        result = verify_stored_event(ours(scheme, "0", configured), **event, lora_path=lora_path)
        assert result.outcome == "unverifiable" and result.other_form == other
        assert f"extra_keys_form = {other!r}" in result.reason and result.states == ()
        diagnosis = diagnose_stored_event(
            scheme_name=scheme, seed="0", extra_keys_form=configured, lora_path=lora_path, **event
        )
        assert diagnosis.cause == "wrong-extra-keys-form", diagnosis.detail
        assert "extra_keys_form" in diagnosis.detail and "PYTHONHASHSEED" not in diagnosis.detail


def test_a_wrong_seed_is_still_a_mismatch_whatever_the_form() -> None:
    spec = PROMPTS["salted"]
    hashes = [
        normalize_block_hash(bytes.fromhex(h))
        for h in PINNED["hashes"]["vllm-sha256"][UNSET]["salted"]
    ]
    event = event_of(spec, PINNED["event_extra_keys"]["salted"], hashes)
    result = verify_stored_event(ours("vllm-sha256", "0"), **event)
    assert result.outcome == "mismatch" and result.other_form is None
    diagnosis = diagnose_stored_event(scheme_name="vllm-sha256", seed="0", **event)
    assert diagnosis.cause == "wrong-seed"
    assert diagnosis.other_seeds == (("vllm-sha256", "vllm-none-hash"),)


@pytest.mark.parametrize(("scheme", "seed", "prompt"), [r for r in RUNS if r[2] != SHARED])
def test_an_events_untagged_keys_tagged_hash_as_vllm_032(
    scheme: str, seed: str, prompt: str
) -> None:
    """The keys `to_event_extra_keys` publishes, tagged back by `tagged_event_keys` (the
    LoRA's path from configuration), hash each prompt's blocks as vLLM did."""
    spec = PROMPTS[prompt]
    lora_name, lora_path = spec.lora or (None, None)
    keys = [
        tagged_event_keys(block, lora_name, lora_path)
        for block in unjson(PINNED["event_extra_keys"][prompt])
    ]
    got = ours(scheme, seed).block_hashes(
        list(spec.tokens), block_size=BLOCK_SIZE, extra_keys_by_block=keys
    )
    assert got == pinned(scheme, seed, prompt)


def test_equal_lora_name_and_salt_and_prompt_embeds_are_tagged_by_kind() -> None:
    """A first str equal to the event's LoRA name is the LoRA, the next the salt; bare bytes
    are a prompt-embeds digest."""
    first, second = unjson(PINNED["event_extra_keys"]["lora-same-salt"])
    assert tagged_event_keys(first, "same", "/adapters/same") == (
        ("lora", "same", "/adapters/same"),
        ("cache_salt", "same"),
    )
    assert tagged_event_keys(second, "same", "/adapters/same") == (
        ("lora", "same", "/adapters/same"),
    )
    first, second = unjson(PINNED["event_extra_keys"]["embeds-salted"])
    assert tagged_event_keys(first, None, None) == (
        ("cache_salt", "tenant-x"),
        ("prompt_embeds", EMBEDS[0]),
    )
    assert tagged_event_keys(second, None, None) == (("prompt_embeds", EMBEDS[1]),)


@pytest.mark.parametrize("scheme", list(SCHEME_NAMES.values()))
def test_one_str_object_as_lora_name_and_salt_hashes_otherwise_under_pickle_only(
    scheme: str,
) -> None:
    """vLLM pickles one str object passed as both LoRA name and salt as a memo reference: an
    in-process caller's blocks differ from an engine core's, which receives each request
    msgpack-decoded. Ours hash as the engine core whatever objects are passed, and as the
    in-process caller with shared_strings."""
    spec = PROMPTS[SHARED]
    lora_name, lora_path = spec.lora or (None, None)
    as_core = pinned(scheme, "0", "lora-same-salt")
    as_caller = pinned(scheme, "0", SHARED)
    assert (as_core != as_caller) == (scheme in PICKLED)
    for salt in (lora_name, "".join(["sa", "me"])):  # one object, and two
        got = ours(scheme, "0").block_hashes(
            list(spec.tokens),
            block_size=BLOCK_SIZE,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=salt,
        )
        shared = vllm_scheme(scheme, seed="0", shared_strings=True).block_hashes(
            list(spec.tokens),
            block_size=BLOCK_SIZE,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=salt,
        )
        assert (got, shared) == (as_core, as_caller)


def test_repeated_strings_are_laid_out_as_vllms_engine_core_has_them() -> None:
    """Tags one object (two images' "mm"), every other repeated string its own; or all one."""
    name = "same"
    keys = (("lora", name, "/a"), ("mm", "img", 0), ("mm", "img", 2), ("cache_salt", name))
    two = ("".join(["sa", "me"]), "".join(["i", "mg"]), "".join(["sa", "me"]))
    core = (("lora", two[0], "/a"), ("mm", two[1], 0), ("mm", "img", 2), ("cache_salt", two[2]))
    assert pickle.dumps(lay_out_strings(keys), 5) == pickle.dumps(core, 5)
    assert pickle.dumps(lay_out_strings(core, shared=True), 5) == pickle.dumps(keys, 5)
    assert pickle.dumps(keys, 5) != pickle.dumps(core, 5)
    assert lay_out_strings(("a", "b")) == ("a", "b") and lay_out_strings(None) is None


@pytest.mark.parametrize("scheme", PICKLED)
@pytest.mark.parametrize("int_hashes", [True, False])
def test_an_in_process_callers_shared_salt_verifies_and_a_wrong_seed_still_does_not(
    scheme: str, int_hashes: bool
) -> None:
    """A block not reproduced whose keys repeat a string is retried with the string as one
    object; only when neither layout reproduces it is it a mismatch."""
    spec = PROMPTS[SHARED]
    lora_path = None if spec.lora is None else spec.lora[1]
    digests = pinned(scheme, "0", SHARED)
    hashes = [normalize_block_hash(d) if int_hashes else d for d in digests]
    event = event_of(spec, PINNED["event_extra_keys"][SHARED], hashes)
    result = verify_stored_event(ours(scheme, "0"), **event, lora_path=lora_path)
    assert result.ok, result.reason
    assert list(result.states) == digests
    diagnosis = diagnose_stored_event(scheme_name=scheme, seed="0", lora_path=lora_path, **event)
    assert diagnosis.cause == "ok", diagnosis.detail
    wrong = verify_stored_event(ours(scheme, "1"), **event, lora_path=lora_path)
    assert wrong.outcome == "mismatch" and wrong.reproduced == 0
