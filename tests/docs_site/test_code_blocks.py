"""Every code block of the documentation is run by a test, parsed, prose-like text, or marked
illustrative with the reason no test runs it (the markers: tests/docs_site/code_blocks.py).

- Every block names its language, one Pygments highlights (`text` for diagrams, outputs and
  file trees, `sh` for commands, `console` for a session with `$` prompts and its output).
- `text` blocks are prose-like and need no marker.
- `json` (one value, or JSON lines), `toml` and `yaml` blocks must parse, unless illustrative.
- `python` blocks must compile; every one not marked illustrative RUNS, against a real
  `cache-service serve` on 127.0.0.1 (a free port, a fresh data folder, one per page), with
  the docs' "http://127.0.0.1:8080" replaced by that server's URL. A page's blocks run in page
  order in one namespace (later blocks build on earlier ones, as a reader types them), seeded
  with `stand_ins()`, the names the docs leave to the reader; CLAIMS holds what a page's comments
  say the run gives, checked after it.
- `sh` blocks must pass `bash -n`, and so must the `$` commands of `console` blocks; an `sh`
  block marked run is run by bash in a temporary folder (`.venv` there links to this Python's
  environment, whose bin/ leads PATH). Commands that install, start a long-lived server or need
  Docker, kubectl, a GPU or vLLM are illustrative, naming the test that runs them if one does.
- `<!-- test-command -->` marks README's test command (.ci/run runs it) and copies of it,
  which must be the same line.
- Anything else needs the illustrative marker: the test lists every block none of this covers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

from cache_service.client import CacheClient
from tests.docs_site.code_blocks import (
    CODE_MARKER,
    CONTENT,
    ILLUSTRATIVE,
    REPO,
    RUN,
    TEST_COMMAND,
    TESTED_BY_CI,
    CodeBlock,
    all_blocks,
    doc_files,
)
from tests.integration.conftest import free_port

BLOCKS = all_blocks()
RUNNABLE = {"python", "sh"}  # the languages a test can run
PARSED = {"json", "toml", "yaml"}  # data: parsing checks all there is to check
PROSE = {"text"}
MAX_REASON_CHARS = 100
DOCS_URL = "http://127.0.0.1:8080"  # where the docs say the service listens
SHELL_SECONDS = 60
README_PATH = Path("README.md")


def stand_ins(url: str) -> dict[str, Any]:
    """The names the docs leave to the reader, as small stand-ins for a page served at `url`
    (a block that defines a name itself overrides its stand-in)."""
    return {
        # prefill-worker.md: your engine's KV bytes for block i of the prompt, the service's
        # base URL, your Prometheus registry and your logger.
        "compute_kv_block": lambda index: bytes([index]) * 4096,
        "url": url,
        "registry": CollectorRegistry(),
        "log": logging.getLogger("docs.worker"),
        # engines.md, kv-events.md: an API key (the test's server runs without --auth keys),
        # a prompt's token ids, and your router's hand-off of the request to an engine.
        "key": None,
        "token_ids": list(range(1000, 2024)),
        "send_to": lambda instance: None,
    }


# What a page's comments say its blocks give, checked in the page's namespace after they ran:
# expression -> the value the comment states.
CLAIMS: dict[str, dict[str, object]] = {
    "docs/content/guides/prefill-worker.md": {
        "stored": 16,  # "16: blocks newly stored"
        "stored.as_sent": True,
        "(hit.matched_blocks, hit.cached_tokens)": (16, 1024),
        "hit.payloads == kv": True,
        "cache.lookup('llama-3-8b', other).cached_tokens": 448,  # "448: 7 full blocks"
        "cache.healthy(ready=True)": True,
    },
}

# Pages whose blocks route prompts to engines (POST /v1/route): their server follows two
# engines, vllm-a and vllm-b, of the model they name, on loopback ports nothing publishes on.
ROUTING_PAGES = {"docs/content/engines.md", "docs/content/guides/kv-events.md"}
ROUTED_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def accounted_for(block: CodeBlock) -> bool:
    """Whether a test runs, parses or reads the block, or it is marked illustrative."""
    if block.marker is not None and block.marker.kind in {ILLUSTRATIVE, TESTED_BY_CI}:
        return True
    if block.language == "python" or (block.language == "sh" and block.marked_run):
        return True
    return block.language in PARSED | PROSE


def python_runs() -> dict[str, list[CodeBlock]]:
    """The python blocks that run, by page, in page order."""
    pages: dict[str, list[CodeBlock]] = {}
    for block in BLOCKS:
        if block.language == "python" and not block.illustrative:
            pages.setdefault(str(block.path), []).append(block)
    return pages


def readme_test_command() -> CodeBlock:
    """README's test command: the block after `<!-- test-command -->`, which .ci/run runs."""
    (command,) = [
        block
        for block in BLOCKS
        if block.path == README_PATH and block.marker and block.marker.kind == TESTED_BY_CI
    ]
    return command


# -- every block: its language and its marker ---------------------------------------------------


def test_every_block_names_a_language_pygments_highlights() -> None:
    unnamed = [block.where for block in BLOCKS if not block.language]
    assert unnamed == [], "name a language (text, sh, console, python...): " + " ".join(unnamed)
    unknown = []
    for block in BLOCKS:
        try:
            get_lexer_by_name(block.language)
        except ClassNotFound:
            unknown.append(f"{block.where}: {block.language}")
    assert unknown == []


def test_every_marker_is_run_or_illustrative_with_a_short_reason() -> None:
    wrong = []
    for block in BLOCKS:
        marker = block.marker
        if marker is None:
            continue
        if marker.kind == ILLUSTRATIVE:
            if not marker.reason or len(marker.reason) > MAX_REASON_CHARS:
                wrong.append(f"{block.where}: an illustrative block needs a short reason")
        elif marker.kind == RUN:
            if marker.reason or block.language not in RUNNABLE:
                wrong.append(f"{block.where}: only python and sh blocks run, with no reason")
        elif marker.kind == TESTED_BY_CI:
            if block.language != "sh":
                wrong.append(f"{block.where}: the test command is an sh block")
        else:
            wrong.append(f"{block.where}: unknown marker {marker.kind!r}")
    assert wrong == []


def test_no_marker_stands_anywhere_but_before_a_code_block() -> None:
    used = {(str(block.path), block.marker.line) for block in BLOCKS if block.marker}
    stray = []
    for path in doc_files():
        relative = str(path.relative_to(REPO))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            is_marker = CODE_MARKER.match(line) or line.strip() == TEST_COMMAND
            if is_marker and (relative, number) not in used:
                stray.append(f"{relative}:{number}")
    assert stray == []


def test_every_block_is_run_parsed_or_marked_illustrative() -> None:
    unmarked = [f"{block.where} ({block.language})" for block in BLOCKS if not accounted_for(block)]
    assert unmarked == [], (
        "mark each <!-- code: run --> (a test runs it) or <!-- code: illustrative: REASON --> "
        "(why none can): " + " ".join(unmarked)
    )


def test_copies_of_the_test_command_are_readmes() -> None:
    command = readme_test_command().text
    copies = [block for block in BLOCKS if block.marker and block.marker.kind == TESTED_BY_CI]
    assert [block.where for block in copies if block.text != command] == []


def test_replay_examples_write_their_reports_into_a_folder_git_ignores() -> None:
    """A reader who pastes a replay example from the docs in the checkout leaves no report or
    figure beside the code to commit by mistake (out/ is in .gitignore)."""
    outputs = []
    for block in BLOCKS:
        if block.language == "sh":
            for command in block.text.replace("\\\n", " ").splitlines():
                if "cache-service replay" in command:
                    outputs += re.findall(r"--(?:json|plot) (\S+)", command)
    assert outputs, "no replay example writes a report"
    ignored = subprocess.run(
        ["git", "check-ignore", *outputs], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert sorted(ignored.stdout.split()) == sorted(outputs)
    assert all(Path(path).parts[0] == "out" for path in outputs)


# -- parsed and syntax-checked ---------------------------------------------------------------


def parse_json(text: str) -> None:
    """One JSON value, or JSON lines (one value per non-blank line)."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        for line in text.splitlines():
            if line.strip():
                json.loads(line)


PARSERS: dict[str, Callable[[str], object]] = {
    "json": parse_json,
    "toml": tomllib.loads,
    "yaml": lambda text: list(yaml.safe_load_all(text)),
}


def test_data_blocks_parse() -> None:
    failures = []
    for block in BLOCKS:
        if block.language in PARSERS and not block.illustrative:
            try:
                PARSERS[block.language](block.text)
            except ValueError as error:  # JSONDecodeError and TOMLDecodeError are ValueErrors
                failures.append(f"{block.where}: {error}")
            except yaml.YAMLError as error:
                failures.append(f"{block.where}: {error}")
    assert failures == []


def test_python_blocks_compile() -> None:
    failures = []
    for block in BLOCKS:
        if block.language == "python":
            try:
                compile(block.text, block.where, "exec")
            except SyntaxError as error:
                failures.append(f"{block.where}: {error}")
    assert failures == []


def console_commands(text: str) -> str:
    """The commands of a console session: its `$ ` lines without the prompt."""
    return "".join(line[2:] + "\n" for line in text.splitlines() if line.startswith("$ "))


def test_shell_blocks_pass_bash_syntax_check() -> None:
    failures = []
    for block in BLOCKS:
        if block.language == "sh":
            script = block.text
        elif block.language == "console":
            script = console_commands(block.text)
            if not script:
                failures.append(f"{block.where}: a console block with no `$ ` prompt: use sh")
                continue
        else:
            continue
        done = subprocess.run(
            ["bash", "-n"], input=script, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            failures.append(f"{block.where}: {done.stderr.strip()}")
    assert failures == []


# -- run ---------------------------------------------------------------------------------------


def engines_file(folder: Path) -> Path:
    """An engines file: vllm-a and vllm-b of ROUTED_MODEL, on loopback ports nobody uses."""
    path = folder / "engines.toml"
    tables = "".join(
        f'[[engine]]\nname = "{name}"\nendpoint = "tcp://127.0.0.1:{free_port()}"\n\n'
        for name in ("vllm-a", "vllm-b")
    )
    path.write_text(
        f'[defaults]\nmodel = "{ROUTED_MODEL}"\nblock_size = 16\n'
        f'hash_scheme = "vllm-sha256-cbor"\nseed = "0"\n\n{tables}'
    )
    return path


def run_python(blocks: list[CodeBlock], url: str) -> dict[str, Any]:
    """Run a page's python blocks in order in one namespace; that namespace. Each block is
    compiled with blank lines before it, so a traceback names the Markdown file's own line."""
    namespace: dict[str, Any] = {"__name__": "__main__", **stand_ins(url)}
    for block in blocks:
        source = "\n" * block.line + block.text.replace(DOCS_URL, url)
        exec(compile(source, str(REPO / block.path), "exec"), namespace)
    return namespace


@pytest.mark.integration
@pytest.mark.parametrize("page", sorted(python_runs()))
def test_python_blocks_run_against_a_real_service(
    page: str, make_server: Callable[..., Any], tmp_path: Path
) -> None:
    flags = {"kv_events_config": str(engines_file(tmp_path))} if page in ROUTING_PAGES else {}
    server = make_server(**flags)
    namespace = run_python(python_runs()[page], server.url)
    try:
        for expression, stated in CLAIMS.get(page, {}).items():
            assert eval(expression, namespace) == stated, expression
    finally:
        for value in namespace.values():
            if isinstance(value, CacheClient):
                value.close()


def run_shell(block: CodeBlock, folder: Path) -> subprocess.CompletedProcess[str]:
    """Run an sh block with bash (-e, pipefail) in `folder`, where `.venv` links to this
    Python's environment and its bin/ leads PATH, as a reader's checkout has it."""
    environment = Path(sys.prefix)
    (folder / ".venv").symlink_to(environment, target_is_directory=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("CACHE_SERVICE_")}
    env["PATH"] = f"{environment / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.text],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=SHELL_SECONDS,
        check=False,
    )


def test_shell_blocks_marked_run_succeed(tmp_path: Path) -> None:
    failures = []
    for index, block in enumerate(b for b in BLOCKS if b.language == "sh" and b.marked_run):
        folder = tmp_path / str(index)
        folder.mkdir()
        done = run_shell(block, folder)
        if done.returncode != 0:
            failures.append(f"{block.where}: exit {done.returncode}\n{done.stdout}{done.stderr}")
    assert failures == []


def test_a_shell_block_runs_in_its_own_folder_with_the_environment_on_path(
    tmp_path: Path,
) -> None:
    script = ".venv/bin/cache-service --help | grep -q replay\ncache-service --help >/dev/null\n"
    block = CodeBlock(Path("page.md"), 1, "sh", "sh", script + "touch made-here\n", None)
    done = run_shell(block, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "made-here").is_file()
    failing = CodeBlock(Path("page.md"), 1, "sh", "sh", "false | cat\ntouch not-here\n", None)
    (tmp_path / "second").mkdir()
    assert run_shell(failing, tmp_path / "second").returncode != 0
    assert not (tmp_path / "second" / "not-here").exists()


# -- rendered ----------------------------------------------------------------------------------

SNIPPET = re.compile(r'^-{1,}8<-{1,} "([^"]+)"\s*$', re.MULTILINE)
HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
MARKER_TEXTS = ("code: run", "code: illustrative", "test-command --")
API_DOCS = re.compile(r"^::: ", re.MULTILINE)


def test_every_block_renders_as_code_and_no_marker_shows(built_site: Path) -> None:
    by_file: dict[Path, list[CodeBlock]] = {}
    for block in BLOCKS:
        by_file.setdefault(block.path, []).append(block)
    wrong = []
    for page in sorted(CONTENT.rglob("*.md")):
        relative, text = page.relative_to(REPO), page.read_text(encoding="utf-8")
        expected = len(by_file.get(relative, []))
        for included in SNIPPET.findall(text):
            expected += len(by_file.get(Path(included), []))
        html = (built_site / page.relative_to(CONTENT).with_suffix(".html")).read_text("utf-8")
        shown = html.count("<pre")
        # A page of API docs (`::: module`) shows its docstrings' code too.
        if shown < expected or (shown > expected and not API_DOCS.search(text)):
            wrong.append(f"{relative}: {shown} code blocks shown, {expected} written")
        visible = HTML_COMMENT.sub("", html)  # a marker is a comment, or shows as text
        if any(needle in visible for needle in MARKER_TEXTS):
            wrong.append(f"{relative}: a marker shows on the page")
    assert wrong == []
