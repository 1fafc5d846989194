"""The web page at `/ui`: static HTML, JS and CSS shipped in the package (`gateway/ui/`), no
CDN. The files hold no data; the page asks for the admin token once, keeps it in the tab's
sessionStorage and sends it as a bearer to the admin API."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from gateway.errors import NotFound

router = APIRouter(include_in_schema=False)

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
    return HTMLResponse(_asset("index.html"), headers={"Cache-Control": "no-cache"})


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/ui")


@router.get("/ui/{name}")
async def asset(name: str) -> Response:
    media = _TYPES.get(name)
    if media is None:
        raise NotFound(f"no file {name!r} in the page's assets")
    return Response(_asset(name), media_type=media, headers={"Cache-Control": "no-cache"})
