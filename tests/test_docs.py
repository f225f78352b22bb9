"""The docs pages refer only to assets the service serves itself (no browser: see
tests/integration/test_docs_offline.py for the pages rendered with the network blocked)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from cache_service.service.api import create_app
from cache_service.service.api.auth import ROUTE_ROLES
from cache_service.service.api.docs import ASSETS, STATIC_DIR
from cache_service.service.settings import Settings

PAGES = ("/docs", "/redoc")
# The attributes a page loads something through, and the one URL Swagger UI's script fetches.
REFERENCE = re.compile(r"""(?:\bsrc|\bhref|spec-url)="([^"]*)"|\burl: '([^']*)'""")
MEDIA_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".json": "application/json",
}


@pytest.fixture
def app(tmp_path: Path) -> FastAPI:
    """The service's app; its lifespan (the store) is not started: the docs do not need it."""
    return create_app(Settings(data_dir=tmp_path / "data"))


def get(app: FastAPI, url: str, *, root_path: str = "") -> httpx.Response:
    """One GET through the app in this process (no server, no lifespan)."""

    async def one() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            return await client.get(url)

    return asyncio.run(one())


def references(page: str) -> list[str]:
    """Every URL a docs page's HTML makes the browser load."""
    return [src or url for src, url in REFERENCE.findall(page)]


@pytest.mark.parametrize("page", PAGES)
def test_docs_page_loads_nothing_from_another_host(app: FastAPI, page: str) -> None:
    answer = get(app, page)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "text/html; charset=utf-8"
    assert "http:" not in answer.text and "https:" not in answer.text
    assert "//" not in "".join(references(answer.text))  # no scheme-relative URL either
    assert len(references(answer.text)) >= 3  # a script, an icon, the schema (and a stylesheet)


@pytest.mark.parametrize("page", PAGES)
def test_every_asset_a_docs_page_references_is_served(app: FastAPI, page: str) -> None:
    for url in references(get(app, page).text):
        assert url.startswith("/"), url
        answer = get(app, url)
        assert answer.status_code == 200, url
        assert answer.headers["content-type"] == MEDIA_TYPES[Path(url).suffix], url
        assert len(answer.content) > 0, url


def test_every_vendored_asset_is_referenced_and_served_whole(app: FastAPI) -> None:
    referenced = {url for page in PAGES for url in references(get(app, page).text)}
    for path, (name, _) in ASSETS.items():
        assert path in referenced, path
        assert get(app, path).content == (STATIC_DIR / name).read_bytes()


def test_docs_urls_follow_the_root_path_a_proxy_mounts_the_service_under(app: FastAPI) -> None:
    for page in PAGES:
        urls = references(get(app, page, root_path="/cache").text)
        assert urls and all(url.startswith("/cache/") for url in urls), urls


def test_swagger_ui_asks_no_online_validator(app: FastAPI) -> None:
    assert '"validatorUrl": null' in get(app, "/docs").text


def test_docs_assets_need_the_role_the_docs_pages_need() -> None:
    for path in ASSETS:
        assert ROUTE_ROLES[path] == ROUTE_ROLES["/docs"], path


def test_each_vendored_script_ships_with_its_licences() -> None:
    for name in ("LICENSE.swagger-ui", "NOTICE.swagger-ui", "LICENSE.redoc", "README.md"):
        assert (STATIC_DIR / name).is_file(), name
    for name, _ in ASSETS.values():
        if name.endswith(".js"):
            assert (STATIC_DIR / f"{name}.LICENSE.txt").is_file(), name
