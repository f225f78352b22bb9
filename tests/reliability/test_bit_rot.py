"""Bit rot: bytes flipped on disk inside a stored block's record or payload, under a real
server. Every flip is detected (counted in /metrics), served as a miss (a lookup stops before
the damaged block, a fetch returns null for it), never a 500 and never a wrong byte; the
damaged block goes with its subtree at the next touch flush, and the prompt stored again
works.

How: a round stores one prompt per trial, stops the server, reads each target's exact bytes
(the block's record, or its payload) with py-lmdb, finds every copy of them in data.mdb (LMDB
copies pages on write, so an old page in its free list may hold one too; flipping that one as
well is harmless) and XORs one byte inside the chosen field, then restarts the server and
checks. The trials cycle through every field of the record format (`codec.RECORD_FIELDS`) and
the payload. Flips in LMDB's own page headers and B-tree structure are out of scope: only our
record and payload bytes are damaged.

Short form: four trials per field, in rounds of 50; long form (--reliability=long): 1,000
trials.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import lmdb

from cache_service.client import CacheClient
from cache_service.core.store.parts.codec import RECORD_FIELDS
from tests.integration.conftest import ServerProcess
from tests.reliability.workload import Prompt, PromptSet, Verifier

TARGETS = [*RECORD_FIELDS, "payload"]
BLOCKS = 6
ROUND_TRIALS = 50
FLUSH_WAIT_SECONDS = 20.0
PROMPTS = PromptSet(
    model="bit-rot", block_size=16, families=10**9, variants=1,
    shared_blocks=(2, 2), tail_blocks=(BLOCKS - 2, BLOCKS - 2), payload_bytes=(200, 9000),
)  # fmt: skip


@dataclass
class Trial:
    """One damaged block: which prompt, which block, which field."""

    prompt: Prompt
    block: int
    target: str
    copies: int = 0  # how many copies of its bytes the data file held (all flipped)


def test_flipped_bytes_in_records_and_payloads_are_detected_served_as_misses_and_dropped(
    tmp_path: Path, scale: Callable[[int, int], int], report: Callable[..., None]
) -> None:
    trials_wanted = scale(4 * len(TARGETS), 1000)
    rng = random.Random(11)
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log",
                           block_size="16", touch_flush_interval="0.05")  # fmt: skip
    verifier = Verifier()
    done: list[Trial] = []
    started = time.monotonic()
    restarts = detected = 0
    try:
        server.start()
        while len(done) < trials_wanted:
            count = min(ROUND_TRIALS, trials_wanted - len(done))
            trials = [
                Trial(PROMPTS.prompt(n, 0), rng.randrange(BLOCKS), TARGETS[n % len(TARGETS)])
                for n in range(len(done), len(done) + count)
            ]
            store_all(server.url, trials)
            server.stop()
            flip_all(server.data_dir, trials, rng)
            server.start()  # counts from zero: /metrics tells this round's detections
            restarts += 1
            done += trials
            detected += check_round(server.url, trials, [t.prompt for t in done], verifier)
    finally:
        server.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    assert verifier.wrong == [], verifier.wrong[:10]
    assert verifier.lost == [], verifier.lost[:10]
    by_target = {target: sum(t.target == target for t in done) for target in TARGETS}
    assert min(by_target.values()) >= 2
    assert detected == len(done)
    report(
        trials=len(done),
        fields=len(TARGETS),
        record_trials=sum(t.target != "payload" for t in done),
        payload_trials=sum(t.target == "payload" for t in done),
        detected_pct=round(100.0 * detected / len(done), 1),
        restarts=restarts,
        copies_flipped=sum(t.copies for t in done),
        checked_blocks=verifier.checked_blocks,
        seconds=round(time.monotonic() - started, 1),
    )


def store_all(url: str, trials: list[Trial]) -> None:
    """Store every trial's prompt in full."""
    with CacheClient(url, timeout=30.0) as client:
        for trial in trials:
            prompt = trial.prompt
            stored = client.put_prefix(prompt.model, prompt.tokens, prompt.payloads(0, BLOCKS))
            assert stored.stored_blocks == BLOCKS, prompt.name


def flip_all(data_dir: Path, trials: list[Trial], rng: random.Random) -> None:
    """Flip one byte inside each trial's field, in every copy of its bytes in data.mdb."""
    env = lmdb.open(str(data_dir), max_dbs=16, readonly=True, lock=False)
    blocks, payloads = env.open_db(b"blocks", create=False), env.open_db(b"payloads", create=False)
    targets: list[tuple[Trial, bytes]] = []
    with env.begin() as txn:
        for trial in trials:
            key = bytes.fromhex(trial.prompt.keys[trial.block])
            db = payloads if trial.target == "payload" else blocks
            targets.append((trial, bytes(txn.get(key, db=db))))
    env.close()
    path = data_dir / "data.mdb"
    data = bytearray(path.read_bytes())
    for trial, stored in targets:
        offset = field_offset(trial.target, stored, rng)
        mask = rng.randrange(1, 256)
        at = data.find(stored)
        while at != -1:
            data[at + offset] ^= mask
            trial.copies += 1
            at = data.find(stored, at + 1)
        assert trial.copies, f"{trial.prompt.name}: its bytes are not in data.mdb as stored"
    path.write_bytes(data)


def field_offset(target: str, stored: bytes, rng: random.Random) -> int:
    """A random offset inside `target` of a stored record (or anywhere in a payload)."""
    if target == "payload":
        return rng.randrange(len(stored))
    offset, size = RECORD_FIELDS[target]
    retention_len = stored[RECORD_FIELDS["retention_length"][0]]
    if target == "retention":
        size = retention_len
    elif target == "tokens":
        offset += retention_len
        size = len(stored) - offset
    assert size
    return offset + rng.randrange(size)


def check_round(url: str, trials: list[Trial], every: list[Prompt], verifier: Verifier) -> int:
    """Every damaged block is a miss now, and gone with its subtree after the flush; then,
    stored again, every prompt so far is whole and the store's counts agree with it.
    Returns how many trials were detected: a miss at the damaged block, counted, dropped."""
    records = sum(t.target != "payload" for t in trials)
    payloads = len(trials) - records
    dropped = sum(BLOCKS - t.block for t in trials)
    missed: set[str] = set()
    with CacheClient(url, timeout=30.0) as client:
        for trial in trials:  # before the flush: misses, right bytes before them
            prompt, block = trial.prompt, trial.block
            # A lookup without fetch reads records, not payloads: a damaged payload is met
            # by the fetches (and is gone after the flush, checked below).
            for fetch in (True, False) if trial.target != "payload" else (True,):
                match = client.lookup(prompt.model, prompt.tokens, fetch=fetch)
                verifier.check_match(prompt, match)
                if match.matched_blocks != block:
                    missed.add(prompt.name)
                    verifier.wrong.append(
                        f"{prompt.name} ({trial.target}): lookup matched "
                        f"{match.matched_blocks}, damaged block {block}"
                    )
            fetched = client.get_blocks(prompt.model, prompt.keys)
            if fetched[block] is not None:
                missed.add(prompt.name)
                verifier.wrong.append(f"{prompt.name} ({trial.target}): damaged block fetched")
            for index, payload in enumerate(fetched):  # blocks under it may still be served
                if payload is not None and bytes(payload) != prompt.payload(index):
                    verifier.wrong.append(f"{prompt.name} block {index}: wrong bytes")
        seen = wait_for(url, records=records, payloads=payloads, dropped=dropped)
        if seen["records"] != records or seen["payloads"] < payloads or seen["dropped"] != dropped:
            missed.add("the counters")
            verifier.lost.append(f"after the flush: {seen}; expected {records} records, "
                                 f"{payloads}+ payloads, {dropped} blocks dropped")  # fmt: skip
        for trial in trials:  # after it: gone with the subtree, and a fresh store works
            prompt, block = trial.prompt, trial.block
            fetched = client.get_blocks(prompt.model, prompt.keys)
            verifier.check_fetch(prompt, fetched, at_least=block)
            if any(payload is not None for payload in fetched[block:]):
                missed.add(prompt.name)
                verifier.wrong.append(f"{prompt.name} ({trial.target}): not dropped")
            if client.lookup(prompt.model, prompt.tokens).matched_blocks != block:
                verifier.wrong.append(f"{prompt.name} ({trial.target}): lookup past the drop")
            client.put_prefix(prompt.model, prompt.tokens, prompt.payloads(0, BLOCKS))
            verifier.check_match(prompt, client.lookup(prompt.model, prompt.tokens, fetch=True),
                                 at_least=BLOCKS)  # fmt: skip
        stats = client.stats()
    expected = (BLOCKS * len(every), sum(len(p.payload(i)) for p in every for i in range(BLOCKS)))
    if (stats["blocks"], stats["payload_bytes"]) != expected:
        verifier.wrong.append(
            f"/v1/stats counts {(stats['blocks'], stats['payload_bytes'])} (blocks, payload "
            f"bytes); the prompts stored hold {expected}"
        )
    if "the counters" in missed:
        return 0
    return sum(trial.prompt.name not in missed for trial in trials)


COUNTERS = {
    "records": re.compile(r"^prompt_cache_corrupt_records_total (\S+)$", re.MULTILINE),
    "payloads": re.compile(r"^prompt_cache_corrupt_payloads_total (\S+)$", re.MULTILINE),
    "dropped": re.compile(
        r'^prompt_cache_evicted_blocks_total\{[^}]*reason="corrupt"[^}]*\} (\S+)$', re.MULTILINE
    ),
}


def counters(url: str) -> dict[str, float]:
    """The damage counters in /metrics (of this server process)."""
    text = httpx.get(url + "/metrics", timeout=30.0).text
    return {
        name: sum(float(v) for v in pattern.findall(text)) for name, pattern in COUNTERS.items()
    }


def wait_for(url: str, *, records: int, payloads: int, dropped: int) -> dict[str, float]:
    """The counters once the flush has dropped what the reads found (or the wait ran out)."""
    deadline = time.monotonic() + FLUSH_WAIT_SECONDS
    while True:
        seen = counters(url)
        done = seen["records"] >= records and seen["payloads"] >= payloads
        if (done and seen["dropped"] >= dropped) or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)
