"""Token ids as the service carries them: uint32 little-endian, `TOKEN_BYTES` bytes a token.

A prompt is checked once where it comes in (an HTTP body, the client, an engine's event, a
direct `PrefixCache` call), by `as_token_bytes` or `tokens_to_bytes`, into `TokenBytes`:
bytes holding whole tokens. Past that point no code counts bytes per token: `tokens_in`
gives a prompt's (or a stored block's) length in tokens, `bytes_of_tokens` a block's stride
and `block_of` a block's bytes.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any, NewType, Protocol, runtime_checkable

from cache_service.core.errors import InvalidField

TOKEN_BYTES = 4  # a token id is a uint32
MAX_TOKEN_ID = 2**32 - 1


@runtime_checkable
class IdArray(Protocol):
    """An array of ids from a tokenizer or an engine (a numpy array, a torch tensor)."""

    def tolist(self) -> Any:
        """The ids as a Python list."""


# ids, an array of ids, or already uint32 little-endian bytes
TokenInput = Sequence[int] | IdArray | bytes | memoryview

_TOKEN_TYPECODE = "I" if array("I").itemsize == TOKEN_BYTES else "L"


TokenBytes = NewType("TokenBytes", bytes)
"""A prompt's token ids as uint32 little-endian bytes, a whole number of tokens long: made
only by `as_token_bytes` and `tokens_to_bytes` (where a prompt comes in), and a plain `bytes`
at run time, as vLLM's BlockHash is: a subclass would copy every prompt once more."""


def bytes_of_tokens(token_count: int) -> int:
    """The bytes `token_count` tokens take (of a block size: the stride between blocks)."""
    return token_count * TOKEN_BYTES


def whole_tokens(data: bytes | memoryview) -> bool:
    """Whether bytes are a whole number of tokens long."""
    return not len(data) % TOKEN_BYTES


def tokens_in(data: bytes | memoryview) -> int:
    """The whole tokens in bytes of this encoding: a prompt's length, or a stored block's."""
    return len(data) // TOKEN_BYTES


def block_of(token_bytes: TokenBytes, index: int, block_size: int) -> bytes:
    """The bytes of block `index` (of `block_size` tokens); short or empty past the end."""
    stride = bytes_of_tokens(block_size)
    return token_bytes[index * stride : (index + 1) * stride]


def tokens_to_bytes(tokens: Sequence[int] | IdArray | array[int]) -> TokenBytes:
    """Encode token ids as uint32 little-endian; ValueError for an id outside 0..2^32-1."""
    if not isinstance(tokens, list):
        native = _uint32_buffer(tokens)
        if native is not None:
            return TokenBytes(native)
        if isinstance(tokens, IdArray):  # numpy, torch, array: one pass in C, not one per id
            tokens = tokens.tolist()
    try:
        if isinstance(tokens, list):  # fromlist: a third faster than array() on a list
            packed = array(_TOKEN_TYPECODE)
            packed.fromlist(tokens)
        else:
            packed = array(_TOKEN_TYPECODE, tokens)
    except OverflowError as exc:
        raise ValueError(f"token ids are 0..{MAX_TOKEN_ID}") from exc
    if packed.itemsize != TOKEN_BYTES:  # pragma: no cover - only with an 8-byte 'L'
        raise RuntimeError("no 4-byte unsigned array type on this platform")
    if sys.byteorder == "big":  # pragma: no cover - the wire format is little-endian
        packed.byteswap()
    return TokenBytes(packed.tobytes())


def _uint32_buffer(tokens: object) -> bytes | None:
    """The bytes of a flat buffer of native uint32 ids (a numpy uint32 array, array('I')) on
    a little-endian machine, where every value is a valid id and no id needs a look; else None."""
    if sys.byteorder != "little":  # pragma: no cover - the wire format is little-endian
        return None
    try:
        view = memoryview(tokens)  # type: ignore[arg-type]
    except TypeError:
        return None
    with view:
        if view.ndim == 1 and view.format in ("I", "=I", "<I") and view.itemsize == TOKEN_BYTES:
            return view.tobytes()
    return None


def bytes_to_tokens(data: bytes) -> list[int]:
    """Decode uint32 little-endian bytes back into token ids."""
    if not whole_tokens(data):
        raise ValueError(f"token bytes must be a multiple of {TOKEN_BYTES} long")
    packed = array(_TOKEN_TYPECODE)
    packed.frombytes(data)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tolist()


def as_token_bytes(tokens: TokenInput | None, field: str = "tokens") -> TokenBytes:
    """A prompt's tokens, given as ids or as uint32 little-endian bytes, as TokenBytes;
    InvalidField naming `field` for bytes that are not whole tokens, for None (an absent
    frame) and for ids that are not integers in 0..2^32-1."""
    if isinstance(tokens, bytes | memoryview):
        if whole_tokens(tokens):
            return TokenBytes(bytes(tokens))  # bytes(b) is b itself: no copy of a bytes
    elif tokens is not None:
        try:
            return tokens_to_bytes(tokens)
        except ValueError:  # an id out of range: the rule says it all
            raise InvalidField(field, f"token ids are integers in 0..{MAX_TOKEN_ID}") from None
        except TypeError as exc:  # not integers: the rule, and what was given instead
            raise InvalidField(
                field, f"token ids are integers in 0..{MAX_TOKEN_ID} ({exc})"
            ) from None
    raise InvalidField(
        field, f"binary tokens are uint32 little-endian: {TOKEN_BYTES} bytes a token"
    )
