"""A `--workers` supervisor killed with SIGKILL leaves its metrics folder; the next start
removes the folders of supervisors no longer running, and no other."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cache_service.cli import METRICS_FOLDER_PREFIX, remove_stale_metrics_folders


def test_the_folders_of_killed_supervisors_are_removed_and_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = tmp_path / f"{METRICS_FOLDER_PREFIX}{int(gone.stdout)}-abc123"
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f"{METRICS_FOLDER_PREFIX}{running.pid}-def456"
        other = tmp_path / "someone-elses-folder"
        for folder in (dead, live, other):
            folder.mkdir()
            (folder / "counter_1.db").write_bytes(b"x")
        assert remove_stale_metrics_folders() == [dead]
        assert not dead.exists()
        assert live.exists() and other.exists()
    finally:
        running.kill()
        running.wait()


def test_a_folder_named_by_our_own_pid_is_a_previous_process_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PID 1 of a restarted container finds the folder of the PID 1 before it (its /tmp on a
    volume that outlived it): not ours, since we have not made one yet, so it goes."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    previous = tmp_path / f"{METRICS_FOLDER_PREFIX}{os.getpid()}-abc123"
    previous.mkdir()
    (previous / "counter_1.db").write_bytes(b"x")
    assert remove_stale_metrics_folders() == [previous]
    assert not previous.exists()
