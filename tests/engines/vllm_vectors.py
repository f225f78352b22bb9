"""Golden vectors of vLLM's block hashes, made by vLLM itself, and pinned.

`python -m tests.engines.vllm_vectors` (run with the vLLM environment's Python,
`.venv-vllm/bin/python`) hashes the PROMPTS with vLLM's own `init_none_hash`,
`generate_block_hash_extra_keys` and `hash_block_tokens` (vllm/v1/core/kv_cache_utils.py),
the way its `get_request_block_hasher` walks a request, for all four
`--prefix-caching-hash-algo`s: with PYTHONHASHSEED "0", and unset for sha256 and
sha256_cbor (vLLM 0.32's fixed default seed). It prints, as JSON, each prompt's block
hashes and the extra keys its KV events would carry (`to_event_extra_keys`), and whether an
unset PYTHONHASHSEED gives a random root per algorithm. Its output was pinned once into
PINNED; tests/engines/test_vllm_vectors.py holds the package's schemes to it without vLLM,
and tests/vllm/test_hash_vectors.py runs this script against the installed vLLM so an
upgrade that changes hashing fails loudly.

This module imports only the standard library (and vLLM inside `generate`, never at
import), so both environments can read it. The request is a stand-in carrying exactly
what `generate_block_hash_extra_keys` reads: `lora_request` (lora_name, lora_path),
`cache_salt`, `mm_features` (identifier, mm_position.offset / .length), `prompt_embeds`
and `_prompt_embeds_per_block_hashes`. vLLM takes a block's prompt-embeds digest from that
dict before it slices and hashes the tensor, so a prompt of embeddings is any non-None
`prompt_embeds` and the dict pre-filled with fixed digests: no torch needed.

A LoRA name equal to the cache salt hashes two ways under pickle (sha256, xxhash): as two
str objects, as an engine core receives a request msgpack-decoded ("lora-same-salt"), or
as one object, the second pickled as a memo reference, as an in-process caller passing one
variable as both reaches the hasher ("lora-same-salt-shared").
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

BLOCK_SIZE = 4
UNSET = "unset"  # the seed label of PYTHONHASHSEED unset
ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
UNSET_ALGORITHMS = ("sha256", "sha256_cbor")  # the others draw a random root when unset
# vLLM's algorithm -> our scheme's name
SCHEME_NAMES = {
    "sha256": "vllm-sha256",
    "sha256_cbor": "vllm-sha256-cbor",
    "xxhash": "vllm-xxhash",
    "xxhash_cbor": "vllm-xxhash-cbor",
}


@dataclass(frozen=True)
class Prompt:
    """A request as far as block hashing reads it."""

    tokens: tuple[int, ...]
    lora: tuple[str, str] | None = None  # (lora_name, lora_path)
    cache_salt: str | None = None
    images: tuple[tuple[str, int, int], ...] = ()  # (identifier, offset, length)
    embeds: tuple[bytes, ...] = ()  # one prompt-embeds digest per full block
    salt_is_lora_name: bool = False  # the salt is the LoRA name's own str object


# Fixed 32-byte digests standing in for vLLM's sha256 of each block's embeddings.
EMBEDS = tuple(hashlib.sha256(f"prompt embeds of block {i}".encode()).digest() for i in range(2))


PROMPTS: dict[str, Prompt] = {
    "plain": Prompt(tuple(range(1, 11))),  # two full blocks and a partial one
    "salted": Prompt(tuple(range(1, 9)), cache_salt="tenant-x"),
    "lora": Prompt(tuple(range(1, 9)), lora=("adapter-A", "/adapters/a")),
    "lora-salted": Prompt(
        tuple(range(1, 9)), lora=("adapter-A", "/adapters/a"), cache_salt="tenant-x"
    ),
    # Two images: the first spans blocks 0 and 1 (offsets 2 and -2), the second block 2.
    "images": Prompt(
        (1, 2, 9, 9, 9, 9, 7, 8, 5, 9, 9, 6),
        images=(("img-a", 2, 4), ("img-b", 9, 2)),
    ),
    "lora-same-salt": Prompt(
        tuple(range(1, 9)), lora=("same", "/adapters/same"), cache_salt="same"
    ),
    "lora-same-salt-shared": Prompt(
        tuple(range(1, 9)),
        lora=("same", "/adapters/same"),
        cache_salt="same",
        salt_is_lora_name=True,
    ),
    # A prompt of embeddings only: vLLM's token ids for it are zeros.
    "embeds": Prompt((0,) * 8, embeds=EMBEDS),
    "embeds-salted": Prompt((0,) * 8, cache_salt="tenant-x", embeds=EMBEDS),
}


def _fresh(text: str) -> str:
    """A new str object equal to `text` (literals of one value are one interned object)."""
    return (text + " ")[:-1]


def _request(prompt: Prompt) -> SimpleNamespace:
    """The stand-in request `generate_block_hash_extra_keys` reads."""
    lora = None
    salt = None if prompt.cache_salt is None else _fresh(prompt.cache_salt)
    if prompt.lora is not None:
        lora_name = _fresh(prompt.lora[0])
        lora = SimpleNamespace(lora_name=lora_name, lora_path=_fresh(prompt.lora[1]))
        if prompt.salt_is_lora_name:
            salt = lora_name
    features = [
        SimpleNamespace(identifier=name, mm_position=SimpleNamespace(offset=at, length=length))
        for name, at, length in prompt.images
    ]
    digests = {
        (i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE): digest for i, digest in enumerate(prompt.embeds)
    }
    return SimpleNamespace(
        lora_request=lora,
        cache_salt=salt,
        mm_features=features,
        # Never sliced: vLLM reads each block's digest from the dict below first.
        prompt_embeds=object() if prompt.embeds else None,
        _prompt_embeds_per_block_hashes=digests,
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(item) for item in value]
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    return value


def unjson(value: Any) -> Any:
    """Pinned event keys as an event decodes them: {"bytes": hex} back into bytes, lists
    kept (msgpack turns tuples into lists)."""
    if isinstance(value, list):
        return [unjson(item) for item in value]
    if isinstance(value, dict):
        return bytes.fromhex(value["bytes"])
    return value


def _set_seed(seed: str) -> None:
    if seed == UNSET:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed


def generate() -> dict[str, Any]:
    """Every vector, from the installed vLLM (imported here only): {"vllm": its version,
    "random_when_unset": {algorithm: bool}, "hashes": {scheme: {seed: {prompt: [hex]}}},
    "event_extra_keys": {prompt: the keys its events carry, one entry per block}}."""
    import vllm  # noqa: PLC0415
    from vllm.utils.hashing import get_hash_fn_by_name  # noqa: PLC0415
    from vllm.v1.core import kv_cache_utils as kv  # noqa: PLC0415

    saved = os.environ.get("PYTHONHASHSEED")
    hashes: dict[str, dict[str, dict[str, list[str]]]] = {}
    event_keys: dict[str, Any] = {}
    random_when_unset: dict[str, bool] = {}
    try:
        for algorithm in ALGORITHMS:
            hash_fn = get_hash_fn_by_name(algorithm)
            _set_seed(UNSET)
            roots = set()
            for _ in range(2):
                kv.init_none_hash(hash_fn)
                roots.add(bytes(kv.NONE_HASH))
            random_when_unset[algorithm] = len(roots) > 1
            for seed in ("0", UNSET) if algorithm in UNSET_ALGORITHMS else ("0",):
                _set_seed(seed)
                kv.init_none_hash(hash_fn)
                runs = hashes.setdefault(SCHEME_NAMES[algorithm], {}).setdefault(seed, {})
                for name, prompt in PROMPTS.items():
                    runs[name], keys = _hash_prompt(kv, hash_fn, prompt)
                    if event_keys.setdefault(name, keys) != keys:
                        raise AssertionError(f"{name}: event keys differ by algorithm")
    finally:
        _set_seed(UNSET if saved is None else saved)
    return {
        "vllm": str(getattr(vllm, "__version__", "unknown")),
        "random_when_unset": random_when_unset,
        "hashes": hashes,
        "event_extra_keys": event_keys,
    }


def _hash_prompt(kv: Any, hash_fn: Any, prompt: Prompt) -> tuple[list[str], Any]:
    """The prompt's block hashes (hex) and the extra keys its events carry, as vLLM's
    request block hasher and block pool make them."""
    request = _request(prompt)
    hashes: list[str] = []
    extra_keys: list[Any] = []
    parent = None
    mm_index = 0
    for start in range(0, len(prompt.tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        end = start + BLOCK_SIZE
        keys, mm_index = kv.generate_block_hash_extra_keys(request, start, end, mm_index)
        parent = kv.hash_block_tokens(hash_fn, parent, prompt.tokens[start:end], keys)
        hashes.append(bytes(parent).hex())
        extra_keys.append(keys)
    return hashes, _jsonable(kv.to_event_extra_keys(extra_keys))


# Pinned from `.venv-vllm/bin/python -m tests.engines.vllm_vectors` (vLLM 0.32.0).
PINNED: dict[str, Any] = {
    "event_extra_keys": {
        "embeds": [
            [{"bytes": "b288271d92061477154af7121095f4e566d94cbed6a6f55dbe7651eaf8abfee1"}],
            [{"bytes": "7351c47462f9378efb25ff3b20131945ca9f1aa1ae70cec49378474ff1251dc3"}],
        ],
        "embeds-salted": [
            [
                "tenant-x",
                {"bytes": "b288271d92061477154af7121095f4e566d94cbed6a6f55dbe7651eaf8abfee1"},
            ],
            [{"bytes": "7351c47462f9378efb25ff3b20131945ca9f1aa1ae70cec49378474ff1251dc3"}],
        ],
        "images": [[["img-a", 2]], [["img-a", -2]], [["img-b", 1]]],
        "lora": [["adapter-A"], ["adapter-A"]],
        "lora-salted": [["adapter-A", "tenant-x"], ["adapter-A"]],
        "lora-same-salt": [["same", "same"], ["same"]],
        "lora-same-salt-shared": [["same", "same"], ["same"]],
        "plain": [None, None],
        "salted": [["tenant-x"], None],
    },
    "hashes": {
        "vllm-sha256": {
            "0": {
                "embeds": [
                    "221c8abf5a04b4654a88b8d52685be4fe7182319954297d2e4cbb8cfd7910a2e",
                    "9e5b6601bdf7361bb7e99310c123d39abdc27d5056083340b5fcc34e37af6104",
                ],
                "embeds-salted": [
                    "d8a2dfbfe3de975c37952a5a9211bd351e8c6b024100c5ca8ab390231aca194b",
                    "27aad24aebe8bfaad11ffe9beb346734387846057170f1ed45f754540b35ceba",
                ],
                "images": [
                    "9e1a265fe8faaa5efbd13317ac930aa9b5eeaaffa0d4e09c7ac1f8ee7c782845",
                    "3a37f19b006b39b1f30ce601bdbf193c52697473ec875a6e06d33188369d7778",
                    "a0b2b5ba60d63b8aa91eac7889db014303e85b7fc5324c726eb40bff8b2baa8c",
                ],
                "lora": [
                    "8723d8fb4a699d29de52d7426a579cbbfdcd28e1c817cd50532693f2d8ea3298",
                    "faeb7037660136fdb433276c53ab33c6c9f39d1d50b0ba0369123890584839a5",
                ],
                "lora-salted": [
                    "cf076692f44524ac2704335b4678949db9589ffd2e507ec25c4b7ee96aeb7a33",
                    "e194c74e1452a62e99b604f729a527961f2df027b3874096844d26e66f3712bc",
                ],
                "lora-same-salt": [
                    "a82a9cf41e2095bb2b44df4c2c5e9a1e1c11915b428ae458f9a9a85dad38f31e",
                    "448849833958f59517712378d0d90265305c4dabad61db8399cec9a9dc9e97ef",
                ],
                "lora-same-salt-shared": [
                    "735a4cf982959a00489ebf85a0ee27b598b3a9e3cb1b71002830240656f94662",
                    "d17192107d84521e7817af6900a7edce6b8a7c339a84c84399671c450b779421",
                ],
                "plain": [
                    "762b2e7e1520febd3a0aedb7358e8602facf3924440e18538fce057e23bae91d",
                    "9e62b5a7ec298f33cb4c7d9e00b659874bb2432d23ad6879ad1746592a2b036b",
                ],
                "salted": [
                    "b186036fb19fb76a88d5bae67b69c52f16fa22e13361b0a39d65e08501b442b1",
                    "e204adf6f595f3cd1525151254ea60581e11362509189cad020b4a9f2f693ce5",
                ],
            },
            "unset": {
                "embeds": [
                    "cef898ec587dab44705fa6a87f001f121ece0b5077c48476e42256b95d9da1ac",
                    "b67b2b69132f419ddbb44511845d77c0bcf25e2a44454914f5d767418afcec8e",
                ],
                "embeds-salted": [
                    "4432d786115389f0607425110be44b9f61cd0aa3c2e9f54b6586b2441ad5df72",
                    "bf3a91cca15ad05516a26ca6decdf319d063cafe53a2b4602b233982b81601e6",
                ],
                "images": [
                    "f00a7ea8f58a50e310b1d497bb599c8dcf84f8ba2b2cf63500065ebe71781313",
                    "bd4ab8023a4e3846869fab7b83d4b5db6c3d6107f4ea60f22c3062edadf06964",
                    "c24e341c11a88ee37f857eb4774a06ae68b2b2226bfa52312eb9b71c20be28a3",
                ],
                "lora": [
                    "12c2008ff28966e23cb4bb1de0a8a7a794f8dc460d5ccefe82cdb7100e8644f0",
                    "336ae50ece719d9f4e62cab831657907b3b6c5d9433d991d2fb0248d4b1fa66c",
                ],
                "lora-salted": [
                    "59495d44255daf98b17be7eac9eb8cf3e7b4478567a5fff5e084cda54c19715c",
                    "1c28a6f4af5595460e70183e9e607ed40d11e6104187a9954774d99dfc05ff91",
                ],
                "lora-same-salt": [
                    "8e7802f969d48dc2c65ced5349e10fdec022540bbcc3b38a6705878d1ebce912",
                    "86f73e6f4b70c2b2229326e5f5f28b65b2d44369bdb3b8d9fba491c567303fc6",
                ],
                "lora-same-salt-shared": [
                    "02376da1cf86d366363c5035934cfdc784058c0d1124638ef9dba4ea3f7fa72b",
                    "2284536784b06e36d91e0219240ede48134ec75ee10f7014e6acc35716742926",
                ],
                "plain": [
                    "52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a",
                    "bee96bce54f5fcaba04c4a3fc2491b30b48e29dbbd38a327d41bc1f76b956dde",
                ],
                "salted": [
                    "e18fa110ef145cb00b2492b08889a7241380841b4b3e199c51d221fe2103f0d4",
                    "947e0c94bd88b91d0eb70bb6bcc6808d7cb6a124b1283e2c4f645026df8c6014",
                ],
            },
        },
        "vllm-sha256-cbor": {
            "0": {
                "embeds": [
                    "05d34a5d81671f06d087c5c4a43985f33e6f160173475a178f9190129204737d",
                    "268ea870f8c39a1ab5f7a63f601bd7ada6ed85d9c788969eaaf9a3dc5b9aa49d",
                ],
                "embeds-salted": [
                    "a3d92897ef02ae47a3c12da969bd10a6d7046726d64abead79daeb490cfb3d40",
                    "a369218c04cbfe7271a2eb0ba4fb8a55e3a47e475e0bae3db8d23a3ca0f704c0",
                ],
                "images": [
                    "2f765efa8e58a6be9b10a7a462d74a3cec14317b82340743cfd92f92b33c71e8",
                    "7c440441752dbdb2aa04e0cf50c6613e5d6f9f56a2b3946cc966055b53eb579b",
                    "411ab758e52df1894728235a6105214f9c91a7a33fcb3e44f256370eba2be2bc",
                ],
                "lora": [
                    "30d72ad9133f000d4a30ea55a9825402cd374bef22cbe53c2e1297bc972d4b0a",
                    "0fea2e961aff3a88e8a3b579bad09d0eb15d284b47aee01ec0551b4e6da4a769",
                ],
                "lora-salted": [
                    "13aa7fbe04692beb85c02edbea6b7feaa2a3999cb3cd39fc801bcaa5fe9fe59d",
                    "fc7ee5227e60c6a57c4cb44869c4cd235036d8a7ed177e626b37eaf2709fd83d",
                ],
                "lora-same-salt": [
                    "f2905c95838097821ef3fe1fd35828e8843d4c695d9269c766c023d91c9bf785",
                    "524f586f37a385120d0b15adbc40da636b658c75f7160d6c7045ae9e93abda02",
                ],
                "lora-same-salt-shared": [
                    "f2905c95838097821ef3fe1fd35828e8843d4c695d9269c766c023d91c9bf785",
                    "524f586f37a385120d0b15adbc40da636b658c75f7160d6c7045ae9e93abda02",
                ],
                "plain": [
                    "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb",
                    "24125b23e68883b5c2141db2959d48433fe6bde2f26bd914efad121d154ab2d6",
                ],
                "salted": [
                    "fc034f78776622256d044c1063c304258b7de95f74b6561b50934979cac5f619",
                    "14fe4bae9db3a93ec6bd0e96897105c81f71abcd581114f1e758241ad958e5e2",
                ],
            },
            "unset": {
                "embeds": [
                    "c990abaa069b22872a87ca3533d1918074ee6ae58cdee745d6f82b77c6b6cae9",
                    "a7e41eea8724bc0025e317119d83ec9217039938526ad1f87eda1494a6fa9c4a",
                ],
                "embeds-salted": [
                    "d8d68239b67c2f0648a806de41bfd964b4537089267c73d70b3a3c0bb683c8a0",
                    "afcc02086442505d9302d7d0f71e25d119e15329d7a330fcc53f4c8670c67eef",
                ],
                "images": [
                    "64e0b3cd1b45ec454bc244b28e5039088188b2295393a4cc897a0d4a33af1f37",
                    "9fe612b9a64a487f16078e367f008f16ed0fb11172b255606c8e3c56cededa81",
                    "06956518cc2b8dcbdb809f609b0a95316447de8c0a6f89cbbf4902ae3e23e2bd",
                ],
                "lora": [
                    "1780689fa3e546a3ec15a618686028265c8c9088806ee34a00562d9c3962608f",
                    "a6f925ef5f7a0ec3397363527bff55d87ff5c62f62ecd427b865b57d231cf1d4",
                ],
                "lora-salted": [
                    "abc3e6d0f844ea7dbe2df28947a381e87388148d0b8204eacde72421683a3461",
                    "5301120184e489f6e5e59fc1775ead39d3c6eaacf1aa79d650f567032969a25d",
                ],
                "lora-same-salt": [
                    "99d247df201591976408e49de2ac39198317c12b17b1f82f85b04aad970389f2",
                    "613e9400a8f9e0aa8100ffac2475684bff2ccfe552fce01c31ba856e1a07eaab",
                ],
                "lora-same-salt-shared": [
                    "99d247df201591976408e49de2ac39198317c12b17b1f82f85b04aad970389f2",
                    "613e9400a8f9e0aa8100ffac2475684bff2ccfe552fce01c31ba856e1a07eaab",
                ],
                "plain": [
                    "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111",
                    "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1",
                ],
                "salted": [
                    "aef01e2249762e37efdbd359a63d1bb34d1d4876e69e689829798a9b03595cf8",
                    "ebe697981bbe12d758c4c2a783249d8532dd89c4125af652f0cbe56509bc1c1e",
                ],
            },
        },
        "vllm-xxhash": {
            "0": {
                "embeds": ["d4cd43d6708fd52d3638b7e7803ae272", "f3770ce68448ee632f852149f4536838"],
                "embeds-salted": [
                    "4301ee7282a666a6697e4fbc08dc9039",
                    "bb8910aebd6208b95a99332323886038",
                ],
                "images": [
                    "143abad8e9521cb3f2710ba56b9287b7",
                    "e466239b9ee9414f0e42c5d8701fe334",
                    "70261f60175ce54a4665e4f4e40df52b",
                ],
                "lora": ["3de46e1bc0d17b1676301969bf380448", "3bfa8f0bab1eab640e468585f2805597"],
                "lora-salted": [
                    "5a8ae80ceba5304b406511f083958129",
                    "239d80116f484f38762e8ee6032cffca",
                ],
                "lora-same-salt": [
                    "d1af289d6623521326012522a2cd17b4",
                    "a6540348efa5f75aa7cc2a065a89a080",
                ],
                "lora-same-salt-shared": [
                    "12253fdb5df1c8070c48459230c57c3e",
                    "9cf5755747351cc7e37344f278e3b482",
                ],
                "plain": ["f3856cedd7e636094750c4546e855397", "0c9832567b17003b126077f57e0bb670"],
                "salted": ["41786a733c4cfe46705ae08fff459cf4", "878520518e8ad5956bfdbfd5bcc164ae"],
            }
        },
        "vllm-xxhash-cbor": {
            "0": {
                "embeds": ["fc99780ab71dd56919a67ff2112289ce", "988935c4d9f94db50e4a332e241a7265"],
                "embeds-salted": [
                    "65568ae577ccb0684fb518a2cfcace80",
                    "c44eb3d903cd5fcf895cc3eac39aa30a",
                ],
                "images": [
                    "c8f0eccd9c72b7a7df6d9a822d17f242",
                    "b72de9e7df5e96a9ac1886c5598c4df0",
                    "153d27ed8784fffe4fcd74f5f12cd782",
                ],
                "lora": ["baccc8e2ed9ee1f15882e7cc6a70b016", "f63a480adbb689716fe00677b752a92a"],
                "lora-salted": [
                    "e04866fd556d71fb8ae7e46388e3fb7d",
                    "112082cd4ee7d0148dec02b56a045fb2",
                ],
                "lora-same-salt": [
                    "1ccbbd1d83351ccbe698ebf6dddb5c44",
                    "239b93d630bafab5c1b6ad7e9f54e9ab",
                ],
                "lora-same-salt-shared": [
                    "1ccbbd1d83351ccbe698ebf6dddb5c44",
                    "239b93d630bafab5c1b6ad7e9f54e9ab",
                ],
                "plain": ["0a8577df5ee3430515a8cc1f6e3ac52e", "d152782cb4d753bde718a811a3b75e23"],
                "salted": ["bc649eaf997a2309b72f8012eb89ff02", "23cb3a08404ab1c392d75a6585b23eb4"],
            }
        },
    },
    "random_when_unset": {
        "sha256": False,
        "sha256_cbor": False,
        "xxhash": True,
        "xxhash_cbor": True,
    },
    "vllm": "0.32.0",
}


if __name__ == "__main__":
    json.dump(generate(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
