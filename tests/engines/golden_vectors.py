"""Golden vectors of the engine hash schemes, and the reference code that generated them.

The reference definitions below share no code with cache_service: they are re-stated from
the engines' sources (the versions are cited in each scheme's module docstring):

- vLLM (vllm/v1/core/kv_cache_utils.py `init_none_hash`, `hash_block_tokens`,
  `generate_block_hash_extra_keys`; vllm/utils/hashing.py; snapshot 001cabc1be16): root =
  H(seed string), block = H((parent digest, tuple(tokens), extra keys or None)), with the
  extra keys in the older releases' UNTAGGED form (the bare LoRA name, the bare salt):
  the schemes' extra_keys_form "untagged". vLLM 0.32 tags them (and hashes the LoRA's
  path); its vectors, made by vLLM itself, are in tests/engines/vllm_vectors.py. The CBOR
  here is encoded by hand per RFC 8949's canonical rules (what cbor2.dumps(canonical=True)
  writes for these shapes, and what Mooncake's conductor re-implements in C++), so the
  vectors do not rest on the cbor2 the package uses; pickle is vLLM's definition itself.
- SGLang (python/sglang/srt/mem_cache/radix_cache.py, `get_hash_str`, `hash_str_to_int64`;
  snapshot 006b0e3d317f): SHA-256 chain over u32-LE tokens, published as the signed int64
  of the digest's first 8 bytes.
- Dynamo (docs "KV Events & Hashing Consistency", kv router `compute_block_hash_for_seq`,
  `compute_seq_hash_for_block`): XXH3-64 seed 1337, local hash of u32-LE tokens, sequence
  hash of (parent u64 LE || local u64 LE).

Run `python -m tests.engines.golden_vectors` to print the vectors again; they were pinned
once from that output into GOLDEN and must only change with a reason.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable

import xxhash

SEED = "0"  # vLLM's PYTHONHASHSEED for every vLLM vector
BLOCK_SIZE = 4
U64 = (1 << 64) - 1

# name -> (tokens, lora_name, cache_salt)
PROMPTS: dict[str, tuple[list[int], str | None, str | None]] = {
    "plain": (list(range(1, 11)), None, None),  # two full blocks and a partial one
    "lora": ([1, 2, 3, 4, 5, 6, 7, 8], "adapter-A", None),
    "salted": ([1, 2, 3, 4, 5, 6, 7, 8], None, "tenant-salt"),
    "lora-salted": ([1, 2, 3, 4, 5, 6, 7, 8], "adapter-A", "tenant-salt"),
    "wide-ids": (
        [0, 23, 24, 255, 256, 65535, 65536, 151643, 2**31 - 1, 2**32 - 1, 7, 9],
        None,
        None,
    ),
}


# -- canonical CBOR by hand (RFC 8949 section 4.2.1: shortest heads) --


def _head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if value < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, value)
    raise ValueError("too large for a CBOR head")


def cbor(value: object) -> bytes:
    """Canonical CBOR of None, non-negative ints, bytes, str and tuples."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _head(0, value)
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return _head(3, len(raw)) + raw
    if isinstance(value, tuple):
        return _head(4, len(value)) + b"".join(cbor(item) for item in value)
    raise TypeError(type(value))


def _pickle(value: object) -> bytes:
    return pickle.dumps(value, protocol=5)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return bytes(xxhash.xxh3_128_digest(data))


# name -> (serializer, digest): vLLM's sha256_cbor, xxhash_cbor, sha256, xxhash.
VLLM_HASHES: dict[str, tuple[Callable[[object], bytes], Callable[[bytes], bytes]]] = {
    "vllm-sha256-cbor": (cbor, _sha256),
    "vllm-xxhash-cbor": (cbor, _xxh3_128),
    "vllm-sha256": (_pickle, _sha256),
    "vllm-xxhash": (_pickle, _xxh3_128),
}


def reference_vllm(
    name: str, seed: str, tokens: list[int], lora: str | None, salt: str | None
) -> list[bytes]:
    """vLLM: parent = H(seed); each full block H((parent, tuple(tokens), extra or None))."""
    serialize, digest = VLLM_HASHES[name]
    parent = digest(serialize(seed))
    out = []
    for index in range(len(tokens) // BLOCK_SIZE):
        keys = ([lora] if lora is not None else []) + ([salt] if index == 0 and salt else [])
        block = tuple(tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
        parent = digest(serialize((parent, block, tuple(keys) if keys else None)))
        out.append(parent)
    return out


def reference_sglang(tokens: list[int]) -> list[int]:
    """SGLang: sha256(prior digest || u32-LE tokens), published as signed int64 of 8 bytes."""
    prior = b""
    out = []
    for index in range(len(tokens) // BLOCK_SIZE):
        block = tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
        prior = hashlib.sha256(prior + b"".join(t.to_bytes(4, "little") for t in block)).digest()
        out.append(struct.unpack(">q", prior[:8])[0])
    return out


def reference_xxh3(tokens: list[int]) -> list[int]:
    """Dynamo: seq[0] = local[0]; seq[i] = xxh3_64(seq[i-1] LE || local[i] LE, 1337)."""
    out: list[int] = []
    for index in range(len(tokens) // BLOCK_SIZE):
        block = tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
        local = int(xxhash.xxh3_64_intdigest(struct.pack(f"<{len(block)}I", *block), seed=1337))
        if out:
            local = int(xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], local), seed=1337))
        out.append(local)
    return out


def reference(scheme: str, prompt: str) -> list[str]:
    """A prompt's published hashes under a scheme, as hex (64-bit ints as 16 hex digits)."""
    tokens, lora, salt = PROMPTS[prompt]
    if scheme in VLLM_HASHES:
        return [d.hex() for d in reference_vllm(scheme, SEED, tokens, lora, salt)]
    values = reference_sglang(tokens) if scheme == "sglang" else reference_xxh3(tokens)
    return [f"{value & U64:016x}" for value in values]


# Pinned from `python -m tests.engines.golden_vectors` (seed "0", block size 4).
GOLDEN: dict[str, dict[str, list[str]]] = {
    "vllm-sha256-cbor": {
        "plain": [
            "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb",
            "24125b23e68883b5c2141db2959d48433fe6bde2f26bd914efad121d154ab2d6",
        ],
        "lora": [
            "1424c0ec536f82188b592f263601d4e48c0255081c5f1e9225163c6d611a5222",
            "4a2ec941640a8f2470869ec2b3cf6bdd90e2be83b21807b628ac9abe9341eea9",
        ],
        "salted": [
            "3be45574566e2f3c51c9f254d9627cf113382b627aeaefe8b661d66cfa089359",
            "22dea68f80ff7f40243dfb906a33db02571905c78a3b42153a56de5ad08c661a",
        ],
        "lora-salted": [
            "22977da6c71098507264dbf4161d451c2d98494c5c146717f36787e184b36040",
            "6a3cd7de2626c2d2982eb5bc9d4878a49745c3784bde8a2334ffac47286bb866",
        ],
        "wide-ids": [
            "ca90027d467f8ae0c02e71aa4eff29f116d1b74ca16446a60ab640f53e976f43",
            "b775930c5f218a58b3ade796ea4a666b7f17e605c19c6315b0f1d34c7c49a4a2",
            "cac4bbdc1e10130936abed81b61e2acba518efc533211e693882a1bf4c07b7dd",
        ],
    },
    "vllm-xxhash-cbor": {
        "plain": ["0a8577df5ee3430515a8cc1f6e3ac52e", "d152782cb4d753bde718a811a3b75e23"],
        "lora": ["272058964b52dd42781a9d5396977afc", "d277ae3df15666ccb275a74b95cf779d"],
        "salted": ["397eeff7661fa56d166ca89f68903b2e", "6fc87f38b657ad6e555e6e2ecc098b1b"],
        "lora-salted": ["da2f8cddc2a73704a9d7fcc7cdcb6753", "de1ceec0b7787f3e6485f0bc0b98934c"],
        "wide-ids": [
            "cd09d8ae700da635d72fa41ccddba746",
            "c2b7c116a374a921f12990ea6cdd8578",
            "348e026ca5ae413151caa455edd21aef",
        ],
    },
    "vllm-sha256": {
        "plain": [
            "762b2e7e1520febd3a0aedb7358e8602facf3924440e18538fce057e23bae91d",
            "9e62b5a7ec298f33cb4c7d9e00b659874bb2432d23ad6879ad1746592a2b036b",
        ],
        "lora": [
            "5c5d9e04e03de9f2f4a9f38766c4d0fb0e207ccf5d2fb3b272c50117f336ae0c",
            "bde66cc24757972cc88e0fe62079d85934868c2733874ffa1c54ff679604f61a",
        ],
        "salted": [
            "373c09c29ab08b91b13bf1a67e0a461990572d476016c064b6ba6b75c163ceb1",
            "141900dd6fe59d22764357a125ecf4d670923bb12ad705a520de0e98c7338d5d",
        ],
        "lora-salted": [
            "dacd8a5addba8cf4b89589bedab04999b3676299a455ba3e085cc7777be6b328",
            "55575bd9b63ced6a3dc36c355afbb5f551599533795c26d27d8b5fc836681618",
        ],
        "wide-ids": [
            "545f0ac9f9f843830a203b2f3d14417a6c11babbf9e992b08b9fba32e4295950",
            "02b48e221b07b27a9684637c901e2bdf7989ffc9ab64de0d2e6eef9638139c47",
            "948f4db6f5c5e9ec3c0fab89fb1861ab3b007ded72e508c77b6ab40eb4f05981",
        ],
    },
    "vllm-xxhash": {
        "plain": ["f3856cedd7e636094750c4546e855397", "0c9832567b17003b126077f57e0bb670"],
        "lora": ["b1aa3a31e90b1754b1852a0f7a380189", "4c888457d6c8849cf83d15ba5fda289a"],
        "salted": ["b7695c9019e96d1638296d38cd1edff5", "79091a312d036b0c3fbbd3e5d38f23ae"],
        "lora-salted": ["1c91f19130f47d618fb69f5b23eb5450", "1f6871daab8f53ebcf2e7c005b968913"],
        "wide-ids": [
            "67c3a88dbd0512170d00efde2ce64f6a",
            "4a0c27beb704349ca28ef11659f03b8f",
            "e5386e18dd456f4e38980aaa67ccaf85",
        ],
    },
    "sglang": {
        "plain": ["cf97adeedb59e05b", "4ebfa8a1f3c34151"],
        "lora": ["cf97adeedb59e05b", "4ebfa8a1f3c34151"],
        "salted": ["cf97adeedb59e05b", "4ebfa8a1f3c34151"],
        "lora-salted": ["cf97adeedb59e05b", "4ebfa8a1f3c34151"],
        "wide-ids": ["b152770914727e87", "32e5a87ac521d104", "9fccdb054edfbbd8"],
    },
    "xxh3-64-1337": {
        "plain": ["cb38e4d7fb2dca5c", "44a2b2379d6d3c3d"],
        "lora": ["cb38e4d7fb2dca5c", "44a2b2379d6d3c3d"],
        "salted": ["cb38e4d7fb2dca5c", "44a2b2379d6d3c3d"],
        "lora-salted": ["cb38e4d7fb2dca5c", "44a2b2379d6d3c3d"],
        "wide-ids": ["c30a54e421022c69", "3a41e691a144582e", "12c3292800d33a68"],
    },
}


if __name__ == "__main__":
    for scheme_name in (*VLLM_HASHES, "sglang", "xxh3-64-1337"):
        print(f"    {scheme_name!r}: {{")
        for prompt_name in PROMPTS:
            print(f"        {prompt_name!r}: {reference(scheme_name, prompt_name)!r},")
        print("    },")
