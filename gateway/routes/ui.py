"""The web page at `/ui`: static HTML, JS and CSS shipped in the package (`gateway/ui/`), no
CDN. The files hold no data; the page asks for the admin token once, keeps it in the tab's
sessionStorage and sends it as a bearer to the admin API.

`/docs` is a reference of the API rendered here from the OpenAPI document (`/openapi.json`, which
any OpenAPI tool reads), so the docs load nothing from a CDN either; the app turns FastAPI's
Swagger UI and ReDoc pages off (`docs_url=None, redoc_url=None`).

Every response of these routes carries `PAGE_HEADERS`: the page runs only its own scripts and
styles (no inline script or style, no other origin), may not be framed, and sends no referrer.
"""

from __future__ import annotations

from html import escape
from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from gateway.errors import NotFound

router = APIRouter(include_in_schema=False)

PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

_TYPES = {
    "app.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "tokens.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}


def _asset(name: str) -> bytes:
    return files("gateway").joinpath("ui", name).read_bytes()


@router.get("/ui")
async def page() -> HTMLResponse:
    return HTMLResponse(_asset("index.html"), headers=PAGE_HEADERS)


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/ui", headers=PAGE_HEADERS)


@router.get("/ui/{name}")
async def asset(name: str) -> Response:
    media = _TYPES.get(name)
    if media is None:
        raise NotFound(f"no file {name!r} in the page's assets")
    return Response(_asset(name), media_type=media, headers=PAGE_HEADERS)


@router.get("/docs")
async def docs(request: Request) -> HTMLResponse:
    """Every operation of the OpenAPI document: method, path, summary, parameters, statuses."""
    return HTMLResponse(api_reference(request.app.openapi()), headers=PAGE_HEADERS)


def api_reference(spec: dict[str, Any]) -> str:
    """The OpenAPI document `spec` as one static HTML page (every value escaped)."""
    info = spec.get("info", {})
    sections = []
    for path, ops in spec.get("paths", {}).items():
        for method, op in ops.items():
            params = ", ".join(
                f"{p['name']} ({p['in']}{', required' if p.get('required') else ''})"
                for p in op.get("parameters", [])
            )
            ref = (
                op.get("requestBody", {})
                .get("content", {})
                .get("application/json", {})
                .get("schema", {})
                .get("$ref", "")
            )
            statuses = ", ".join(
                f"{s} {r.get('description', '')}" for s, r in sorted(op["responses"].items())
            )
            rows = [
                ("parameters", params),
                ("body", ref.rsplit("/", 1)[-1]),
                ("responses", statuses),
            ]
            sections.append(
                f"<h2><code>{escape(method.upper())} {escape(path)}</code></h2>"
                f"<p>{escape(op.get('summary', ''))}</p>"
                + (f"<pre>{escape(op['description'])}</pre>" if op.get("description") else "")
                + '<dl class="kv">'
                + "".join(f"<dt>{k}</dt><dd>{escape(v)}</dd>" for k, v in rows if v)
                + "</dl>"
            )
    title = escape(str(info.get("title", "API")))
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<title>{title} API</title><link rel="stylesheet" href="/ui/style.css"></head><body>'
        f'<header><a href="/ui" class="brand">{title}</a>'
        '<nav><a href="/openapi.json">openapi.json</a></nav></header><main>'
        f"<h1>{title} API {escape(str(info.get('version', '')))}</h1>"
        f"<p>{escape(str(info.get('summary', '')))}. The machine-readable document is "
        '<a href="/openapi.json">/openapi.json</a> (OpenAPI 3): load it into any OpenAPI '
        "client or viewer.</p>" + "".join(sections) + "</main></body></html>"
    )
