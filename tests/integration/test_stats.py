"""/v1/stats reports the room the store's disk has, beside what the store holds."""

from __future__ import annotations

import os

import httpx

from tests.integration.conftest import ServerProcess


def test_stats_report_the_disk_under_the_data_folder(server: ServerProcess) -> None:
    stats = httpx.get(server.url + "/v1/stats").json()
    disk = stats["disk"]
    data_file = server.data_dir / "data.mdb"
    vfs = os.statvfs(server.data_dir)
    assert disk["file_bytes"] == data_file.stat().st_size
    # The free room is the file system's, read a moment apart: close, not equal.
    assert abs(disk["free_bytes"] - vfs.f_bavail * vfs.f_frsize) < 64 * 2**20
    assert disk["limit_bytes"] <= disk["file_bytes"] + disk["free_bytes"]
    backed = disk["file_bytes"] + disk["free_bytes"]
    assert disk["shortfall_bytes"] == max(stats["capacity_bytes"] - backed, 0)
