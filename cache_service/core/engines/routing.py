"""Routing scores: for one prompt, how much of it each engine already holds, best first.

An engine is known by its spec (name, hash scheme, seed, block size, the form its vLLM
release hashes extra keys in, its LoRA adapters' paths). The prompt is hashed once per
distinct (scheme, seed, extra-keys form, block size, and the path of the request's LoRA
adapter where the scheme hashes it) among the engines asked about (the LoRA name and cache
salt are the request's, so the same for all), and each chain is then matched
against the views of the engines that share it in one `EngineViews.match_prefix` call: with
16 engines on one vLLM configuration a prompt is hashed once, not 16 times. Even that once
is cut short (chain_memo.py): hashing stops at the first block no engine holds at all, and
a `ChainMemo` shared between requests skips re-hashing a prefix seen before. Both leave
every answer as hashing the whole prompt would give it (`full_hash=True` does that, for
tests and the benchmark's baseline).

Every scored engine gets at least one row: one per medium it holds a leading block in, or a
single GPU row of 0 blocks when it holds none (a candidate that must prefill everything is
still a candidate). An engine whose blocks cannot be matched to a prompt (no hash scheme
configured, a vLLM xxhash scheme without its PYTHONHASHSEED, a LoRA adapter whose path the
engine hashes and its lora_modules do not give) is listed as unscored with the reason,
never silently scored as holding nothing.

Rows are ordered best first: live engines before engines whose publisher went away (within
the grace the caller allows them), then most cached tokens (blocks x that engine's block
size, so engines with different block sizes compare fairly), then a sound view before a
stale one, then the faster medium (GPU, CPU, disk), then by name so the order is
deterministic. An engine that is not live is never `best`: a request sent there may fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from cache_service.core.blocks import Namespace
from cache_service.core.cache import PrefixCache
from cache_service.core.engines.block_hashes import EngineBlockHash
from cache_service.core.engines.chain_memo import ChainMemo, prompt_chain
from cache_service.core.engines.schemes import (
    DEFAULT_EXTRA_KEYS_FORM,
    EngineHashScheme,
    LoraPathUnknown,
    scheme_named,
)
from cache_service.core.engines.views import CPU, DISK, GPU, EngineViews
from cache_service.core.errors import UnknownInstance
from cache_service.core.tokens import TokenBytes, TokenInput, tokens_in, tokens_to_bytes

SchemeFactory = Callable[[str, str | None, str], EngineHashScheme]  # name, seed, form
GroupKey = tuple[str, str | None, str | None, int, str | None]  # + block size, LoRA path
_MEDIUM_RANK = {GPU: 0, CPU: 1, DISK: 2}


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What routing needs of an engine: its name and how it hashes a prompt's blocks."""

    name: str
    hash_scheme: str | None
    seed: str | None
    block_size: int
    live: bool = True  # False: its publisher went away (disconnected, or silent)
    extra_keys_form: str = DEFAULT_EXTRA_KEYS_FORM  # how its vLLM release hashes extra keys
    lora_modules: tuple[tuple[str, str], ...] = ()  # (LoRA name, adapter path), as served

    def lora_path(self, lora_name: str | None) -> str | None:
        """The configured path of the engine's LoRA adapter `lora_name`, or None."""
        return None if lora_name is None else dict(self.lora_modules).get(lora_name)


@dataclass(frozen=True, slots=True)
class InstanceScore:
    """How much of the prompt one engine holds in one medium."""

    instance: str
    medium: str
    matched_blocks: int
    cached_tokens: int
    tokens_to_prefill: int
    block_size: int
    data_parallel_rank: int | None  # the rank holding the most; None when none holds any
    stale: bool  # the engine's view may miss events (a gap that was not replayed)
    live: bool = True  # False: its publisher went away (ranked after live engines)


@dataclass(frozen=True, slots=True)
class Unscored:
    """An engine that cannot be scored, and why."""

    instance: str
    reason: str


@dataclass(frozen=True, slots=True)
class EngineScores:
    """Every scored engine's rows, best first; the engines that could not be scored."""

    prompt_tokens: int
    instances: list[InstanceScore]
    unscored: list[Unscored]
    chains_hashed: int  # distinct (scheme, seed, block size) chains computed for the prompt

    @property
    def best(self) -> InstanceScore | None:
        """The row to route to: the most tokens among sound views (a stale view may claim
        blocks its engine dropped), a stale one only when no sound view holds any."""
        holding = [row for row in self.instances if row.matched_blocks and row.live]
        sound = [row for row in holding if not row.stale]
        chosen = sound or holding
        return chosen[0] if chosen else None


@dataclass(frozen=True, slots=True)
class StoreScore:
    """How much of the prompt the payload store holds for a namespace: any worker can load
    these blocks from the cache instead of prefilling them."""

    matched_blocks: int
    cached_tokens: int
    tokens_to_prefill: int
    block_size: int


def score_store(
    cache: PrefixCache, namespace: Namespace, tokens: TokenInput, *, block_size: int | None = None
) -> StoreScore:
    """The longest stored, alive and verified prefix of `tokens` in `namespace`, read only.

    Unlike `PrefixCache.match_prefix` (even with touch=False) this counts no lookup in the
    hit and miss metrics, sets no memo and repairs nothing: it is the match step of
    `Operators.explain`, whose store read never writes. A routing question is not a use."""
    size = cache.config.block_size_for(namespace.model, block_size)
    links = cache.chain(namespace, tokens, block_size=size)
    matched = cache.store.match(cache.hasher.namespace_id(namespace), links, now=cache.clock())
    prompt_tokens = tokens_in(links.token_bytes)
    cached = matched.matched * size
    return StoreScore(matched.matched, cached, prompt_tokens - cached, size)


def select_engines(engines: Sequence[EngineSpec], names: Sequence[str] | None) -> list[EngineSpec]:
    """The engines named (all when `names` is None); UnknownInstance naming the unknown ones."""
    if names is None:
        return list(engines)
    by_name = {engine.name: engine for engine in engines}
    unknown = [(index, name) for index, name in enumerate(names) if name not in by_name]
    if unknown:
        index = unknown[0][0]
        known = ", ".join(sorted(by_name)) or "none (no engine publishes KV events for it)"
        missing = ", ".join(repr(name) for _, name in unknown)
        raise UnknownInstance(
            f"instances[{index}]",
            f"unknown instance {missing} for this model; known: {known}",
            errors=[
                {"field": f"instances[{i}]", "message": f"unknown instance {n!r}"}
                for i, n in unknown
            ],
        )
    return [by_name[name] for name in dict.fromkeys(names)]  # in order, each once


class RouteScorer:
    """Scores prompts against engines' views; keeps each (scheme, seed, form)'s hasher.

    `memo` is meant to outlive the scorer (one per service, shared by every request);
    `full_hash` hashes every block of the prompt with no memo and no early stop."""

    def __init__(
        self,
        views: EngineViews,
        *,
        scheme_factory: SchemeFactory | None = None,
        memo: ChainMemo | None = None,
        full_hash: bool = False,
    ) -> None:
        self.views = views
        self.memo = None if full_hash else memo
        self.full_hash = full_hash
        self._factory = scheme_factory or _named_scheme
        self._schemes: dict[tuple[str, str | None, str], EngineHashScheme | str] = {}

    def score(
        self,
        tokens: Sequence[int],
        engines: Iterable[EngineSpec],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        token_bytes: TokenBytes | None = None,
    ) -> EngineScores:
        """Each engine's rows for the prompt `tokens` (with a LoRA name and a cache salt as
        the engines hash them), best first. `token_bytes`, the prompt's `tokens_to_bytes`
        when the caller has it (the store's score encodes it too), saves encoding it again."""
        prompt_tokens = len(tokens)
        # (scheme, seed, form, block size, LoRA path) -> its scheme and engines
        groups: dict[GroupKey, tuple[EngineHashScheme, list[EngineSpec]]] = {}
        unscored: list[Unscored] = []
        for engine in engines:
            scheme = self._scheme_of(engine)
            lora_path = engine.lora_path(lora_name)
            if isinstance(scheme, EngineHashScheme):
                try:  # does the rule need a path this engine does not give?
                    scheme.extra_keys_rule(0, lora_name, lora_path, cache_salt)
                except LoraPathUnknown as exc:
                    scheme = str(exc)
            if isinstance(scheme, str):
                unscored.append(Unscored(engine.name, scheme))
                continue
            if not scheme.covers_extra_keys:
                lora_path = None  # tokens only: one chain whatever the LoRA
            key = (scheme.name, scheme.seed, scheme.extra_keys_form, engine.block_size, lora_path)
            groups.setdefault(key, (scheme, []))[1].append(engine)
        rows: list[InstanceScore] = []
        memo = self.memo
        if memo is not None and groups and token_bytes is None:
            try:  # encoded once for every scheme's memo look-ups
                token_bytes = tokens_to_bytes(tokens)
            except ValueError:  # an id outside u32: hashed without the memo
                memo = None
        for (_, _, _, block_size, lora_path), (scheme, members) in groups.items():
            if self.full_hash:
                chain = scheme.normalized(
                    tokens,
                    block_size=block_size,
                    lora_name=lora_name,
                    lora_path=lora_path,
                    cache_salt=cache_salt,
                )
            else:
                chain = prompt_chain(
                    scheme,
                    tokens,
                    block_size=block_size,
                    lora_name=lora_name,
                    lora_path=lora_path,
                    cache_salt=cache_salt,
                    memo=memo,
                    held_prefix=self.views.held_prefix,
                    token_bytes=token_bytes,
                )
            rows += self._rows(chain, members, block_size, prompt_tokens)
        rows.sort(key=_rank)
        return EngineScores(prompt_tokens, rows, unscored, len(groups))

    def _scheme_of(self, engine: EngineSpec) -> EngineHashScheme | str:
        """The engine's scheme (built once and kept), or why it cannot be scored."""
        if engine.hash_scheme is None:
            return "no hash_scheme configured: its block hashes cannot be matched to a prompt"
        key = (engine.hash_scheme, engine.seed, engine.extra_keys_form)
        scheme = self._schemes.get(key)
        if scheme is None:
            try:
                scheme = self._factory(*key)
            except ValueError as exc:  # an unknown scheme or form, xxhash without a seed
                scheme = str(exc)
            self._schemes[key] = scheme
        return scheme

    def _rows(
        self,
        chain: Sequence[EngineBlockHash],
        members: Sequence[EngineSpec],
        block_size: int,
        prompt_tokens: int,
    ) -> list[InstanceScore]:
        names = [engine.name for engine in members]
        live = {engine.name: engine.live for engine in members}
        holds = self.views.match_prefix(chain, engines=names) if chain else []
        rows = []
        holding = set()
        for hold in holds:
            cached = hold.blocks * block_size
            holding.add(hold.engine)
            rows.append(
                InstanceScore(
                    hold.engine,
                    hold.medium,
                    hold.blocks,
                    cached,
                    prompt_tokens - cached,
                    block_size,
                    hold.data_parallel_rank,
                    hold.stale,
                    live[hold.engine],
                )
            )
        for name in names:
            if name not in holding:
                stale = self.views.is_stale(name)
                rows.append(
                    InstanceScore(
                        name, GPU, 0, 0, prompt_tokens, block_size, None, stale, live[name]
                    )
                )
        return rows


@lru_cache(maxsize=256)  # a scheme is immutable; its root digest is worth computing once
def _named_scheme(name: str, seed: str | None, extra_keys_form: str) -> EngineHashScheme:
    return scheme_named(name, seed=seed, extra_keys_form=extra_keys_form)


def _rank(row: InstanceScore) -> tuple[bool, int, bool, int, str, str]:
    return (
        not row.live,
        -row.cached_tokens,
        row.stale,
        _MEDIUM_RANK.get(row.medium, len(_MEDIUM_RANK)),
        row.instance,
        row.medium,
    )
