"""Engines' block hash schemes (vLLM's four, SGLang's, Dynamo's XXH3-64 chain), by name, and
the check that an engine's published hashes are reproduced from its tokens."""

from cache_service.core.engines.schemes.registry import (
    SCHEMES,
    SchemeInfo,
    scheme_named,
    scheme_names,
)
from cache_service.core.engines.schemes.scheme import (
    ChainState,
    EngineHashScheme,
    ExtraKeys,
    PublishedHash,
)
from cache_service.core.engines.schemes.verify import (
    COMMON_SEEDS,
    Diagnosis,
    Verification,
    diagnose_stored_event,
    verify_stored_event,
)
from cache_service.core.engines.schemes.vllm import canonical_extra_keys, vllm_extra_keys

__all__ = [
    "COMMON_SEEDS",
    "SCHEMES",
    "ChainState",
    "Diagnosis",
    "EngineHashScheme",
    "ExtraKeys",
    "PublishedHash",
    "SchemeInfo",
    "Verification",
    "canonical_extra_keys",
    "diagnose_stored_event",
    "scheme_named",
    "scheme_names",
    "verify_stored_event",
    "vllm_extra_keys",
]
