"""Engines' block hash schemes (vLLM's four, SGLang's, Dynamo's XXH3-64 chain), by name, and
the check that an engine's published hashes are reproduced from its tokens."""

from cache_service.core.engines.schemes.diagnose import (
    COMMON_SEEDS,
    Diagnosis,
    diagnose_stored_event,
)
from cache_service.core.engines.schemes.registry import (
    SCHEMES,
    SchemeInfo,
    scheme_named,
    scheme_names,
)
from cache_service.core.engines.schemes.scheme import (
    ChainState,
    EngineHashScheme,
    EventExtraKeys,
    ExtraKeys,
    LoraPathUnknown,
    PublishedHash,
)
from cache_service.core.engines.schemes.verify import Verification, verify_stored_event
from cache_service.core.engines.schemes.vllm import (
    DEFAULT_EXTRA_KEYS_FORM,
    DEFAULT_SEED,
    EXTRA_KEYS_FORMS,
    canonical_extra_keys,
    tagged_extra_keys,
    untagged_extra_keys,
)

__all__ = [
    "COMMON_SEEDS",
    "DEFAULT_EXTRA_KEYS_FORM",
    "DEFAULT_SEED",
    "EXTRA_KEYS_FORMS",
    "SCHEMES",
    "ChainState",
    "Diagnosis",
    "EngineHashScheme",
    "EventExtraKeys",
    "ExtraKeys",
    "LoraPathUnknown",
    "PublishedHash",
    "SchemeInfo",
    "Verification",
    "canonical_extra_keys",
    "diagnose_stored_event",
    "scheme_named",
    "scheme_names",
    "tagged_extra_keys",
    "untagged_extra_keys",
    "verify_stored_event",
]
