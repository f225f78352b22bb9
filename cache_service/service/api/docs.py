"""The API docs pages, /docs (Swagger UI) and /redoc, with their scripts served by the service.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so they are blank in a cluster without
internet access. These pages are the same HTML pointing at copies vendored in `static/` (see its
README.md for their versions and licences). Each asset has a route of its own with an exact
path, so that the Authenticator gives it the role of /docs (`ROUTE_ROLES` matches exact paths).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from starlette.responses import FileResponse, HTMLResponse

STATIC_DIR = Path(__file__).with_name("static")
DOCS_PATH = "/docs"
REDOC_PATH = "/redoc"
SWAGGER_JS = "/docs/swagger-ui-bundle.js"
SWAGGER_CSS = "/docs/swagger-ui.css"
FAVICON = "/docs/favicon.png"
REDOC_JS = "/redoc/redoc.standalone.js"
# URL path -> (file in STATIC_DIR, media type). Text types get "; charset=utf-8" from Starlette.
ASSETS: dict[str, tuple[str, str]] = {
    SWAGGER_JS: ("swagger-ui-bundle.js", "text/javascript"),
    SWAGGER_CSS: ("swagger-ui.css", "text/css"),
    FAVICON: ("favicon-32x32.png", "image/png"),
    REDOC_JS: ("redoc.standalone.js", "text/javascript"),
}
# Swagger UI's default validatorUrl shows a badge image fetched from swagger.io's online
# validator, which would send it the schema's URL: never from an air-gapped cluster.
SWAGGER_PARAMETERS: dict[str, Any] = {"validatorUrl": None}


def _root(request: Request) -> str:
    """The path prefix a proxy mounts the service under (uvicorn's --root-path), or ''."""
    root: str = request.scope.get("root_path", "")
    return root.rstrip("/")


def _asset_endpoint(file: Path, media_type: str) -> Callable[[], Awaitable[FileResponse]]:
    async def asset() -> FileResponse:
        return FileResponse(file, media_type=media_type)

    return asset


def install_docs(app: FastAPI) -> None:
    """Add /docs, /docs/oauth2-redirect, /redoc and their assets to an app built with
    docs_url=None and redoc_url=None (which turns off FastAPI's CDN pages)."""
    assert app.docs_url is None and app.redoc_url is None, "FastAPI's CDN pages are still on"
    openapi_url = app.openapi_url or "/openapi.json"
    oauth2_redirect_url = app.swagger_ui_oauth2_redirect_url

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = _root(request)
        return get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=root + SWAGGER_JS,
            swagger_css_url=root + SWAGGER_CSS,
            swagger_favicon_url=root + FAVICON,
            oauth2_redirect_url=root + oauth2_redirect_url if oauth2_redirect_url else None,
            init_oauth=app.swagger_ui_init_oauth,
            swagger_ui_parameters={**SWAGGER_PARAMETERS, **(app.swagger_ui_parameters or {})},
        )

    async def redoc(request: Request) -> HTMLResponse:
        root = _root(request)
        return get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=root + REDOC_JS,
            redoc_favicon_url=root + FAVICON,
            with_google_fonts=False,  # ReDoc falls back to the system's fonts
        )

    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    app.add_api_route(DOCS_PATH, swagger_ui, methods=["GET"], include_in_schema=False)
    if oauth2_redirect_url:
        app.add_api_route(
            oauth2_redirect_url, oauth2_redirect, methods=["GET"], include_in_schema=False
        )
    app.add_api_route(REDOC_PATH, redoc, methods=["GET"], include_in_schema=False)
    for path, (name, media_type) in ASSETS.items():
        endpoint = _asset_endpoint(STATIC_DIR / name, media_type)
        app.add_api_route(path, endpoint, methods=["GET"], include_in_schema=False)
