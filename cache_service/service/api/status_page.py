"""GET /: the status page, for a sidecar where nobody runs Grafana.

It shows the reports /v1/stats and /v1/info answer (the same functions make them; the page
draws their JSON objects) and the status history's charts. It needs an admin key, as
/v1/stats does (auth.py); a browser sends the key as the password of HTTP Basic credentials.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.responses import HTMLResponse

from cache_service.service.api.routes import info_report, stats_report
from cache_service.service.api.state import service_state
from cache_service.service.api.status_html import StatusView, render_status_page

DEFAULT_REFRESH_SECONDS = 15
# Nothing from anywhere: no script, no external style, font or image (the favicon is a
# data: URL), no form, no framing.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "Cache-Control": "no-store",  # every tenant's figures: no shared cache keeps them
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

router = APIRouter()


@router.get("/", include_in_schema=False, response_class=HTMLResponse)
async def status_page(
    request: Request,
    refresh: Annotated[int, Query(ge=0, le=3600)] = DEFAULT_REFRESH_SECONDS,
) -> HTMLResponse:
    """The status page; `?refresh=0` stops it reloading itself, `?refresh=N` sets the pace."""
    state = service_state(request)
    view = StatusView(
        stats=asdict(await stats_report(state)),
        info=asdict(info_report(state)),
        history=state.history,
        refresh_seconds=refresh,
        root=request.scope.get("root_path", "").rstrip("/"),
        generated_at=time.time(),
        process=os.getpid(),
    )
    return HTMLResponse(render_status_page(view), headers=PAGE_HEADERS)
