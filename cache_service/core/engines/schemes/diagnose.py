"""Why an engine's stored event is not reproduced: every registered scheme, the configured
seed and common ones, and both of vLLM's extra-keys forms, tried on one event (for
`cache-service doctor`).

The causes, in the order they are looked for: `ok` (the configuration reproduces it),
`wrong-extra-keys-form` (the configured scheme and seed do, with the other vLLM release's
extra_keys_form), `wrong-scheme` (another scheme does with the configured seed),
`wrong-seed` (a vLLM scheme does with a common seed), `unverifiable` (this event cannot
tell: a LoRA adapter whose path is not configured, a salt the event does not show, an
unknown parent) and `unknown` (nothing reproduces it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from cache_service.core.engines.block_hashes import EngineBlockHash
from cache_service.core.engines.schemes.registry import SCHEMES, scheme_named, scheme_names
from cache_service.core.engines.schemes.scheme import ChainState, EventExtraKeys, PublishedHash
from cache_service.core.engines.schemes.verify import Outcome, Verification, verify_stored_event
from cache_service.core.engines.schemes.vllm import DEFAULT_EXTRA_KEYS_FORM, DEFAULT_SEED

Cause = Literal[
    "ok", "wrong-scheme", "wrong-seed", "wrong-extra-keys-form", "unknown", "unverifiable"
]

# Seeds operators commonly give PYTHONHASHSEED, tried when the configured one fails; first
# vLLM 0.32's own for sha256 and sha256_cbor when PYTHONHASHSEED is unset.
COMMON_SEEDS = (DEFAULT_SEED, "0", "1", "42", "123", "1337", "12345", "random")


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """Which schemes reproduce an event, and the likely cause when the configured one fails."""

    cause: Cause
    reproducing: tuple[str, ...]  # schemes reproducing it with the configured seed
    other_seeds: tuple[tuple[str, str], ...]  # (scheme, seed) reproducing it with another
    detail: str


def diagnose_stored_event(
    *,
    scheme_name: str,
    seed: str | int | None,
    parent: PublishedHash | None,
    token_ids: Sequence[int],
    block_hashes: Sequence[PublishedHash],
    block_size: int,
    extra_keys: Sequence[EventExtraKeys] | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    extra_keys_form: str = DEFAULT_EXTRA_KEYS_FORM,
    known_states: Mapping[EngineBlockHash, ChainState] | None = None,
    candidate_seeds: Sequence[str] = COMMON_SEEDS,
) -> Diagnosis:
    """Try every registered scheme on one stored event and name the likely cause."""

    keys_unknown: list[str] = []  # the reasons of schemes that could not see block 0's keys
    lora_unknown: list[str] = []  # likewise, for a LoRA adapter whose path is not given

    def check(name: str, try_seed: str | int | None) -> tuple[Outcome, str | None]:
        """The outcome with the configured form, and the form that reproduces, if any."""
        result: Verification = verify_stored_event(
            scheme_named(name, seed=try_seed, extra_keys_form=extra_keys_form),
            parent=parent,
            token_ids=token_ids,
            block_hashes=block_hashes,
            block_size=block_size,
            extra_keys=extra_keys,
            lora_name=lora_name,
            lora_path=lora_path,
            known_states=known_states,
        )
        if result.keys_unknown:
            keys_unknown.append(result.reason)
        if result.lora_unknown:
            lora_unknown.append(result.reason)
        return result.outcome, extra_keys_form if result.ok else result.other_form

    seeded = {name for name in scheme_names() if SCHEMES[name].uses_seed}
    results = {
        name: check(name, seed)
        for name in scheme_names()
        if seed is not None or name not in seeded or SCHEMES[name].default_seed is not None
    }
    forms = {name: form for name, (_, form) in results.items() if form is not None}
    if forms.get(scheme_name) == extra_keys_form:
        return Diagnosis("ok", (scheme_name,), (), f"{scheme_name} reproduces the event")
    if scheme_name in forms:
        return Diagnosis(
            "wrong-extra-keys-form",
            (scheme_name,),
            (),
            f"{scheme_name} with seed {seed!r} reproduces the event with extra_keys_form = "
            f"{forms[scheme_name]!r}, not the configured {extra_keys_form!r}: set the engine's "
            "extra_keys_form to its vLLM release's ('tagged' from vLLM 0.32, 'untagged' "
            "before)",
        )
    if forms:
        return Diagnosis(
            "wrong-scheme",
            tuple(forms),
            (),
            f"the engine hashes with {' or '.join(forms)}"
            f"{_form_note(forms.values(), extra_keys_form)}, not the configured "
            f"{scheme_name}: configure that scheme (or change the engine's)",
        )
    others: list[tuple[str, str, str]] = []
    for name in sorted(seeded):
        for candidate in candidate_seeds:
            if candidate == (None if seed is None else str(seed)):
                continue
            form = check(name, candidate)[1]
            if form is not None:
                others.append((name, candidate, form))
    if others:
        found = ", ".join(f"{name} with PYTHONHASHSEED={value}" for name, value, _ in others)
        note = _form_note((form for *_, form in others), extra_keys_form)
        return Diagnosis(
            "wrong-seed",
            (),
            tuple((name, value) for name, value, _ in others),
            f"the engine's hashes match {found}{note}, not {scheme_name} with seed {seed!r}: "
            "give the engine and the service the same seed",
        )
    configured = results[scheme_name][0] if scheme_name in results else None
    if lora_unknown:
        return Diagnosis("unverifiable", (), (), lora_unknown[0])
    if keys_unknown and configured != "mismatch":
        # A salted (or multimodal) prompt looks like a wrong seed here: say so, not "unknown".
        return Diagnosis(
            "unverifiable",
            (),
            (),
            f"{keys_unknown[0]}; send the engine an unsalted, text-only prompt of more than "
            "one block: if its event is not reproduced either, PYTHONHASHSEED differs",
        )
    # Without a seed, only an event that starts a prompt could show the configured scheme
    # wrong: a later one, that other schemes fail on, says nothing about it.
    if configured == "unverifiable" or (
        configured is None
        and (
            parent is not None or all(outcome == "unverifiable" for outcome, _ in results.values())
        )
    ):
        return Diagnosis(
            "unverifiable",
            (),
            (),
            "this event cannot tell (its parent's chain state is unknown or its shape is "
            "off); an event that starts a prompt can",
        )
    return Diagnosis(
        "unknown",
        (),
        (),
        f"no registered scheme reproduces the event with seed {seed!r} or a common one: for "
        "vLLM, PYTHONHASHSEED is most likely unset with xxhash or xxhash_cbor (a random root "
        "per process; before vLLM 0.32 with every algorithm) or another value, or "
        "--prefix-caching-hash-algo differs; check the block size too",
    )


def _form_note(found: Iterable[str], configured: str) -> str:
    """ " (with extra_keys_form = X)" when what reproduced used the other form."""
    other = sorted({form for form in found if form != configured})
    return f" (with extra_keys_form = {other[0]!r})" if other else ""
