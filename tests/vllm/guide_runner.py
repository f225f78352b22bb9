"""Running a guide's commands as a reader pastes them: a folder laid out as the guide's clone,
the joined `sh` blocks as one bash script in a process group of its own, and that group
stopped after, by its id."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.vllm.conftest import VLLM_PYTHON

STOP_SECONDS = 30


def lay_out_clone(folder: Path, model_folder: Path) -> None:
    """`folder` as a guide's clone after its install step: `.venv` and `.venv-vllm` are the
    environments the tests use, `out/smollm2-hf` the model folder they converted (a guide's
    conversion command then finds it done and returns at once)."""
    (folder / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    (folder / ".venv-vllm").symlink_to(VLLM_PYTHON.parents[1], target_is_directory=True)
    (folder / "out").mkdir()
    (folder / "out" / "smollm2-hf").symlink_to(model_folder, target_is_directory=True)


def service_env(service_port: int) -> dict[str, str]:
    """This environment without CACHE_SERVICE_ settings, but for the service's port (a
    guide's `serve` takes the default 8080)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    env["CACHE_SERVICE_PORT"] = str(service_port)
    return env


def start_script(
    script: str, folder: Path, env: dict[str, str], output: Path
) -> subprocess.Popen[bytes]:
    """`script` under `bash -e -o pipefail` in `folder`, printing into `output`, leading a
    process group of its own: what it starts in the background is in that group too."""
    with output.open("wb") as out:
        return subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=folder,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs (Linux's /proc children lists)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:  # ended since
            continue
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL to `pid` and every process under it at once, as when its host goes: an engine
    and its core and workers (which an API server's death alone leaves running)."""
    for each in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


def group_alive(leader: subprocess.Popen[bytes]) -> bool:
    """Whether anything of the process group `leader` leads still runs (the leader reaped)."""
    leader.poll()
    try:
        os.killpg(leader.pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(leader: subprocess.Popen[bytes]) -> None:
    """Stop what the script left running (nothing, when its last step ran): SIGTERM to the
    process group the test started, by its id, then SIGKILL after STOP_SECONDS."""
    for sent in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + STOP_SECONDS
        if not group_alive(leader):
            break
        try:
            os.killpg(leader.pid, sent)
        except ProcessLookupError:  # ended since
            break
        while group_alive(leader) and time.monotonic() < deadline:
            time.sleep(0.2)
    leader.wait()
