"""guides/vllm.md's install step is what the tests and CI install: its `.venv-vllm` lines are
tests/vllm/make-venv.sh's commands, and its `.venv` ones README's test command's (which runs
that script), with the `[model]` extra alone. tests/vllm/test_guide.py runs the guide's other
steps against a real engine."""

from __future__ import annotations

import re

from tests.docs_site.code_blocks import CONTENT, REPO, TESTED_BY_CI, CodeBlock, find_blocks

GUIDE = CONTENT / "guides" / "vllm.md"
SCRIPT = REPO / "tests" / "vllm" / "make-venv.sh"
README = REPO / "README.md"
EXTRAS = re.compile(r"-e '\.\[([a-z,]+)\]'")


def install_block() -> CodeBlock:
    """The guide's install step: the block whose marker names make-venv.sh."""
    blocks = find_blocks(GUIDE.read_text(encoding="utf-8"), GUIDE.relative_to(REPO))
    (block,) = [b for b in blocks if b.marker and "make-venv.sh" in b.marker.reason]
    return block


def script_commands() -> list[str]:
    """make-venv.sh's commands: its lines but blank ones, comments, `set` and the `cd` to the
    repository's root (where the guide's reader already is)."""
    lines = SCRIPT.read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]


def readme_test_command() -> str:
    """README's test command, the line .ci/run runs."""
    blocks = find_blocks(README.read_text(encoding="utf-8"), README.relative_to(REPO))
    (block,) = [b for b in blocks if b.marker and b.marker.kind == TESTED_BY_CI]
    return block.text.strip()


def test_the_vllm_guides_install_step_is_make_venv_sh_and_readmes_test_command() -> None:
    lines = install_block().text.splitlines()
    commands = script_commands()
    assert len(commands) == 3  # the venv, the install, the removal: the guide's prose says so
    assert lines[-len(commands) :] == commands
    ci = readme_test_command()
    assert "bash tests/vllm/make-venv.sh" in ci.split(" && ")
    (extras,) = EXTRAS.findall(ci)
    assert "model" in extras.split(",")
    ours = [part for line in lines[: -len(commands)] for part in line.split(" && ")]
    assert "pip install -e '.[model]'" in " ".join(ours)  # of README's extras, the one needed
    for part in ours:
        assert part.replace("'.[model]'", f"'.[{extras}]'") in ci.split(" && "), part
