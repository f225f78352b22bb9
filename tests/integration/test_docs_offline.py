"""/docs and /redoc render in headless Chromium that can reach nothing but 127.0.0.1.

Inference clusters often have no internet access; FastAPI's own docs pages load their scripts
from a CDN and stay blank there. The control test serves those CDN pages beside the real
server and checks they do stay blank, so the network is shown to be blocked for the others.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html

from tests.integration.conftest import ServerProcess, free_port

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
pytestmark = [
    pytest.mark.integration,
    # CI installs chromium (.ci/run), so there a missing browser fails rather than skips.
    pytest.mark.skipif(
        CHROMIUM is None and not os.environ.get("CI"),
        reason="no chromium on PATH (Debian: apt-get install -y chromium)",
    ),
]
BROWSER_SECONDS = 90.0  # wall clock for one page; it usually takes 2-5 s
# Virtual time a page may spend loading; it stands still while requests are in flight.
VIRTUAL_TIME_MS = 20_000
SWAGGER_PATH = re.compile(r'class="opblock-summary-path" data-path="([^"]+)"')


def offline_flags() -> list[str]:
    """Chromium flags that leave it only 127.0.0.1: every other host name fails to resolve, and
    every request that is not to loopback goes to a proxy on a closed port (loopback never goes
    through a proxy). No background traffic either: no component updates, sync or first run."""
    return [
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--proxy-server=http://127.0.0.1:{free_port()}",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--disable-default-apps",
        "--no-first-run",
    ]


def rendered_dom(url: str, profile: Path) -> str:
    """The DOM of a page after its scripts ran, in a fresh headless Chromium without network."""
    assert CHROMIUM is not None
    args = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",  # tests run as root, where Chromium's sandbox refuses to start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        *offline_flags(),
        f"--virtual-time-budget={VIRTUAL_TIME_MS}",
        "--dump-dom",
        url,
    ]
    # A session of its own: on a timeout the browser and its helpers go down together.
    browser = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = browser.communicate(timeout=BROWSER_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(browser.pid, signal.SIGKILL)
        browser.communicate()
        raise
    assert browser.returncode == 0, err.decode(errors="replace")[-2000:]
    return html.unescape(out.decode())


def operations(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """Every operation of an OpenAPI schema."""
    return [op for methods in schema["paths"].values() for op in methods.values()]


@pytest.fixture
def schema(server: ServerProcess) -> dict[str, Any]:
    """The real server's OpenAPI schema."""
    found: dict[str, Any] = httpx.get(server.url + "/openapi.json", timeout=10.0).json()
    assert "/v1/lookup" in found["paths"]
    return found


@pytest.fixture
def cdn_pages(schema: dict[str, Any], tmp_path: Path) -> Iterator[str]:
    """FastAPI's default docs pages (scripts from a CDN) and the same schema, served on
    127.0.0.1 by a file server of their own, whose URL this yields."""
    folder = tmp_path / "cdn-pages"
    folder.mkdir()
    swagger = get_swagger_ui_html(openapi_url="/openapi.json", title="CDN Swagger UI")
    redoc = get_redoc_html(openapi_url="/openapi.json", title="CDN ReDoc")
    (folder / "docs.html").write_bytes(bytes(swagger.body))
    (folder / "redoc.html").write_bytes(bytes(redoc.body))
    (folder / "openapi.json").write_text(json.dumps(schema))

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    files = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=files.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{files.server_address[1]}"
    files.shutdown()
    files.server_close()
    thread.join()


def test_swagger_ui_renders_every_operation_offline(
    server: ServerProcess, schema: dict[str, Any], tmp_path: Path
) -> None:
    dom = rendered_dom(server.url + "/docs", tmp_path / "profile")
    assert set(SWAGGER_PATH.findall(dom)) == set(schema["paths"])


def test_redoc_renders_every_operation_offline(
    server: ServerProcess, schema: dict[str, Any], tmp_path: Path
) -> None:
    dom = rendered_dom(server.url + "/redoc", tmp_path / "profile")
    for operation in operations(schema):
        assert f'id="operation/{operation["operationId"]}"' in dom, operation["operationId"]
        assert operation["summary"] in dom


def test_fastapis_cdn_pages_stay_blank_in_the_same_browser(
    cdn_pages: str, schema: dict[str, Any], tmp_path: Path
) -> None:
    assert "https://" in httpx.get(cdn_pages + "/docs.html").text  # the control loads a CDN
    assert httpx.get(cdn_pages + "/openapi.json").json() == schema  # and the same schema
    swagger = rendered_dom(cdn_pages + "/docs.html", tmp_path / "profile-docs")
    assert SWAGGER_PATH.findall(swagger) == []
    redoc = rendered_dom(cdn_pages + "/redoc.html", tmp_path / "profile-redoc")
    assert not any(operation["summary"] in redoc for operation in operations(schema))
