"""A prompt handed from a prefill engine to a decode engine: the report, and the last group.

A prefill engine's request (vLLM's `do_remote_decode`) is answered with what was stored of
its prompt: every whole group under the prompt's own keys, where any later prompt sharing the
prefix finds them, and the partial last group (the prompt's tokens past its last whole group)
under a namespace of its own. That namespace's salt names a random nonce and a digest of the
whole prompt, so only a decode engine given this request's report, for this very prompt, can
name it: no other prompt is ever offered those blocks. Its tokens are the tail's, padded with
`PAD_TOKEN` to a whole group, since the service keeps whole blocks only; the KV of the padding
is whatever the last engine block's slots held, never read (vLLM reads a block's KV only up to
the request's length, and overwrites the slots past it as it decodes).

The report, as the prefill engine's answer carries it to the decode engine:

    {"do_remote_prefill": true, "do_remote_decode": false,
     "prompt_cache": {"stored_tokens": N, "tail_tokens": T, "tail_nonce": "<32 hex>"}}
"""

from __future__ import annotations

import secrets
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from cache_service.core.engines.groups import BlockGroups
from cache_service.integrations.vllm.options import REQUEST_PARAMS_KEY
from cache_service.integrations.vllm.plan import LoadTask, Namespace, StoreTask

PAD_TOKEN = 0
SALT_PREFIX = "pd-tail"
# A decode engine waiting for a prefill engine's stores asks again after this, doubling up to
# the most: a store lands within milliseconds of the answer on one host.
POLL_SECONDS = (0.005, 0.1)
Held = tuple[int, list[list[str]]]  # the tokens every rank's namespace holds; each rank's keys


@dataclass(frozen=True, slots=True)
class Tail:
    """A prompt's partial last group: where it is stored and the tokens its key is cut from."""

    namespace: Namespace
    tokens: list[int]  # the tail's tokens, padded to a whole group
    length: int  # the tail's own tokens (the rest is padding)
    nonce: str


def new_nonce() -> str:
    """A random nonce for one request's tail (128 bits, hex)."""
    return secrets.token_hex(16)


def tail_of(
    prompt: Sequence[int],
    *,
    group_tokens: int,
    nonce: str,
    namespace: Namespace,
    retention: str = "",
) -> Tail | None:
    """The prompt's partial last group under the request's nonce, or None when the prompt ends
    on a group boundary. `retention` ("" = the namespace's) is the tail's class."""
    whole = len(prompt) // group_tokens * group_tokens
    length = len(prompt) - whole
    if not length:
        return None
    digest = xxhash.xxh3_128_hexdigest(struct.pack(f"<{len(prompt)}I", *prompt))
    own = replace(
        namespace,
        salt=f"{SALT_PREFIX}.{nonce}.{digest}",
        retention=retention or namespace.retention,
    )
    tokens = [*prompt[whole:], *([PAD_TOKEN] * (group_tokens - length))]
    return Tail(own, tokens, length, nonce)


def report(stored_tokens: int, *, tail_nonce: str = "", tail_tokens: int = 0) -> dict[str, Any]:
    """The kv_transfer_params a prefill engine's answer carries to the decode engine (its last
    group's nonce and tokens where it stored one)."""
    own: dict[str, Any] = {"stored_tokens": stored_tokens}
    if tail_nonce:
        own.update(tail_tokens=tail_tokens, tail_nonce=tail_nonce)
    return {"do_remote_prefill": True, "do_remote_decode": False, REQUEST_PARAMS_KEY: own}


def poll(
    look: Callable[[], Held | None], wanted: int, held: Held | None, deadline: float
) -> Held | None:
    """`look` again until it finds `wanted` tokens or `deadline` passes; the last answer."""
    pause, longest = POLL_SECONDS
    while (held is None or held[0] < wanted) and time.monotonic() + pause < deadline:
        time.sleep(pause)
        pause = min(2 * pause, longest)
        held = look()
    return held


def tail_store(
    request_id: str,
    prompt: Sequence[int],
    block_ids: Sequence[int],
    groups: BlockGroups,
    *,
    namespace: Namespace,
    retention: str,
) -> tuple[StoreTask, Tail] | None:
    """The store of a computed prompt's partial last group under a new nonce, from its vLLM
    blocks (`block_ids`: all the request's); None when the prompt ends on a group boundary or
    vLLM has not allocated its last blocks. The group's blocks past the prompt's end are not
    allocated: the last one stands in for them (never read, see above)."""
    tail = tail_of(
        prompt,
        group_tokens=groups.group_tokens,
        nonce=new_nonce(),
        namespace=namespace,
        retention=retention,
    )
    first = groups.whole_groups(len(prompt)) * groups.engine_blocks
    end = -(-len(prompt) // groups.engine_block_tokens)
    if tail is None or end > len(block_ids):
        return None
    blocks = list(block_ids[first:end])
    blocks += [blocks[-1]] * (groups.engine_blocks - len(blocks))
    return StoreTask(request_id, tail.namespace, 0, tail.tokens, blocks), tail


def tail_load(
    request_id: str,
    tail: Tail,
    keys: list[list[str]],
    block_ids: Sequence[int],
    *,
    prompt_tokens: int,
    first_block: int,
    groups: BlockGroups,
) -> LoadTask:
    """The load of a prompt's partial last group (its service keys, each rank's) into its
    vLLM blocks from `first_block` (of all the request's `block_ids`) to the prompt's end."""
    engine = groups.engine_block_tokens
    prompt = prompt_tokens
    group_first = groups.whole_groups(prompt) * groups.engine_blocks
    start = max(first_block, group_first)
    end = -(-prompt // engine)
    return LoadTask(
        request_id=request_id,
        namespace=tail.namespace,
        first_group=0,
        keys=keys[0],
        block_ids=list(block_ids[start:end]),
        skip=start - group_first,
        rank_keys=tuple(keys[1:]),
    )
