"""The engine hash schemes by name, as an engine's configuration selects them."""

from __future__ import annotations

from dataclasses import dataclass

from cache_service.core.engines.schemes.scheme import EngineHashScheme
from cache_service.core.engines.schemes.sglang import sglang_scheme
from cache_service.core.engines.schemes.vllm import (
    ALGORITHMS,
    DEFAULT_EXTRA_KEYS_FORM,
    DEFAULT_SEED,
    FIXED_DEFAULT_SEED,
    vllm_scheme,
)
from cache_service.core.engines.schemes.xxh3_chain import xxh3_chain_scheme


@dataclass(frozen=True, slots=True)
class SchemeInfo:
    """What a scheme is for, and what the engine must run with for its hashes to match."""

    name: str
    engine: str
    uses_seed: bool
    engine_settings: str
    # The seed the engine uses with PYTHONHASHSEED unset, when it is not random (vLLM 0.32's
    # "vllm-none-hash" for sha256 and sha256_cbor); None: a seed must be configured.
    default_seed: str | None = None


SCHEMES: dict[str, SchemeInfo] = {
    **{
        name: SchemeInfo(
            name=name,
            engine="vLLM (V1 engine)",
            uses_seed=True,
            engine_settings=(
                f"--prefix-caching-hash-algo {algo} and PYTHONHASHSEED set to the configured seed"
                + (
                    f" (unset: vLLM 0.32 uses {DEFAULT_SEED!r})"
                    if name in FIXED_DEFAULT_SEED
                    else " (unset: random per process)"
                )
            ),
            default_seed=DEFAULT_SEED if name in FIXED_DEFAULT_SEED else None,
        )
        for name, (algo, *_) in ALGORITHMS.items()
    },
    "sglang": SchemeInfo(
        name="sglang",
        engine="SGLang",
        uses_seed=False,
        engine_settings="--page-size equal to the configured block size (SGLang's default is 1)",
    ),
    "xxh3-64-1337": SchemeInfo(
        name="xxh3-64-1337",
        engine="Dynamo's KV router and publishers that hash like it",
        uses_seed=False,
        engine_settings="the router's kv block size equal to the configured block size",
    ),
}


def scheme_names() -> tuple[str, ...]:
    """Every registered scheme's name."""
    return tuple(SCHEMES)


def scheme_named(
    name: str,
    *,
    seed: str | int | None = None,
    extra_keys_form: str = DEFAULT_EXTRA_KEYS_FORM,
) -> EngineHashScheme:
    """The scheme `name` with the engine's seed (vLLM's PYTHONHASHSEED, as its string) and
    the form its release hashes extra keys in (vLLM's "tagged" or "untagged").

    Seedless schemes (sglang, xxh3-64-1337) ignore `seed` and `extra_keys_form`, so one
    configuration can be passed to every scheme. A vLLM scheme without a seed takes vLLM
    0.32's fixed default where vLLM has one (sha256, sha256_cbor); the xxhash ones are
    refused, never made random."""
    if name in ALGORITHMS:
        return vllm_scheme(name, seed=seed, extra_keys_form=extra_keys_form)
    if name == "sglang":
        return sglang_scheme()
    if name == "xxh3-64-1337":
        return xxh3_chain_scheme()
    raise ValueError(f"unknown engine hash scheme {name!r}; known: {', '.join(SCHEMES)}")
