"""The service keeps freed memory for reuse: a second big allocation maps no new pages."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from cache_service.service.allocator import keep_freed_memory

# Run in a fresh process: the setting is process-wide, and the test process must keep glibc's
# defaults. Faults are counted around the second of two 40 MB buffers made and freed in turn.
PROBE = """
import json, resource, sys
from cache_service.service.allocator import keep_freed_memory
applied = keep_freed_memory(int(sys.argv[1]))
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
buffer = bytearray(40 << 20); del buffer
before = faults()
buffer = bytearray(40 << 20); del buffer
print(json.dumps({"applied": applied, "faults": faults() - before}))
"""


def probe(max_bytes: int) -> dict[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(max_bytes)], capture_output=True, text=True, check=True
    )
    return dict(json.loads(result.stdout))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_memory_is_reused_instead_of_mapped_afresh() -> None:
    kept, default = probe(256 << 20), probe(0)
    assert (kept["applied"], default["applied"]) == (True, False)
    assert default["faults"] > 9_000  # 40 MB of new 4 KiB pages, each faulted in
    assert kept["faults"] < 1_000


def test_zero_leaves_the_allocator_alone() -> None:
    assert keep_freed_memory(0) is False
