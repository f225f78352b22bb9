"""Which host this process runs on, as the kernel names the boot: two processes that read the
same boot id share a kernel, so a path one names reaches the same file system for both
(given the same mounts, which the reader checks by opening the store it names)."""

from __future__ import annotations

from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id(source: Path = BOOT_ID) -> str:
    """This kernel's boot id; "" where the system does not tell (no same-host reads then)."""
    try:
        return source.read_text().strip()
    except OSError:
        return ""
