"""The gateway's description of itself, in-process: the OpenAPI document declares every route's
error statuses with the error body's schema and the streaming routes' media types; `/docs`
renders that document without a CDN; the page and its assets carry security headers that its
own scripts live within."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from engines.local import LocalEngine
from tests.support.admin_client import app_client
from tests.support.paths import REPO_ROOT

PAGE_HEADERS = {
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(m.upper(), p, op) for p, ops in spec["paths"].items() for m, op in ops.items()]


async def test_every_operation_declares_its_errors_in_openai_shape(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    async with app_client(engine, tiny_model, f"sqlite:///{tmp_path / 'o.db'}") as c:
        spec = c.app.openapi()
    schemas = spec["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # FastAPI's 422 shape is not what is sent
    assert set(schemas["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    for method, path, op in operations(spec):
        errors = {s: r for s, r in op["responses"].items() if s[0] in "45"}
        assert "500" in errors, (method, path)
        assert any(s[0] == "4" for s in errors), (method, path)
        if "{" in path:
            assert "404" in errors, (method, path)
        # a field's invalid value: 422 on the gateway's own routes, 400 on the protocols' (as
        # OpenAI and Anthropic answer it)
        if "/v1/" in path:
            assert "422" not in errors, (method, path)
            if "requestBody" in op:
                assert "400" in errors, (method, path)
        elif op.get("parameters") or "requestBody" in op:
            assert "422" in errors, (method, path)
        # Anthropic's routes answer errors in Anthropic's shape
        body = "AnthropicErrorBody" if "/v1/messages" in path else "ErrorBody"
        for status, r in errors.items():
            schema = r["content"]["application/json"]["schema"]
            assert schema == {"$ref": f"#/components/schemas/{body}"}, (method, path, status)
    ops = {(m, p): op for m, p, op in operations(spec)}
    export = ops["GET", "/runs/{run_id}/export"]["responses"]["200"]["content"]
    assert "application/x-ndjson" in export
    assert "Retry-After" in ops["POST", "/runs/{run_id}/sessions"]["responses"]["429"]["headers"]
    for path in (
        "/v1/chat/completions",
        "/sessions/{session_id}/v1/completions",
        "/v1/responses",
        "/sessions/{session_id}/v1/messages",
    ):
        content = ops["POST", path]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content), path


async def test_each_session_route_documents_what_its_v1_twin_does(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """`/sessions/{id}/v1/...` is the same operation as `/v1/...` recorded into a named session:
    the same request body, the same answers (plus the unknown session's 404), a distinct id."""
    async with app_client(engine, tiny_model, f"sqlite:///{tmp_path / 't.db'}") as c:
        spec = c.app.openapi()
    ops = {(m, p): op for m, p, op in operations(spec)}
    twins = [(m, p) for m, p in ops if p.startswith("/v1/")]
    assert len(twins) >= 5
    for method, path in twins:
        v1, session = ops[method, path], ops[method, "/sessions/{session_id}" + path]
        assert session["operationId"] != v1["operationId"], path
        assert session.get("requestBody") == v1.get("requestBody"), path
        assert session["tags"] == v1["tags"], path
        assert session["summary"] == v1["summary"], path
        assert set(session["responses"]) == set(v1["responses"]) | {"404"}, path
        for status, answer in v1["responses"].items():
            assert session["responses"][status]["content"] == answer["content"], (path, status)
        names = {p["name"] for p in v1.get("parameters", [])}
        assert {p["name"] for p in session["parameters"]} == names | {"session_id"}, path


async def test_docs_render_the_document_without_a_cdn(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    async with app_client(engine, tiny_model, f"sqlite:///{tmp_path / 'd.db'}") as c:
        r = await c.http.get("/docs")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/html")
        for name, value in PAGE_HEADERS.items():
            assert r.headers[name] == value
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert '<a href="/openapi.json">' in r.text
        assert "<script" not in r.text
        assert "http" not in r.text  # nothing from another origin
        for method, path, _ in operations(c.app.openapi()):
            assert f"{method} {path}" in r.text
        assert (await c.http.get("/redoc")).status_code == 404


@pytest.mark.parametrize(
    ("path", "status"),
    [("/ui", 200), ("/ui/app.js", 200), ("/ui/style.css", 200), ("/", 307)],
)
async def test_the_page_sends_security_headers(
    engine: LocalEngine,
    tiny_model: Path,
    tmp_path: Path,
    path: str,
    status: int,
) -> None:
    async with app_client(engine, tiny_model, f"sqlite:///{tmp_path / 'p.db'}") as c:
        r = await c.http.get(path)
    assert r.status_code == status
    for name, value in PAGE_HEADERS.items():
        assert r.headers[name] == value
    csp = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";"))
    assert csp["default-src"] == "'none'"
    assert csp["script-src"] == csp["style-src"] == csp["connect-src"] == "'self'"
    assert csp["frame-ancestors"] == "'none'"


def test_the_page_uses_no_inline_script_or_style() -> None:
    """What the Content-Security-Policy above would block: inline scripts and handlers, and
    style attributes (the page colours tokens through the CSSOM instead)."""
    ui = REPO_ROOT / "gateway" / "ui"
    html = (ui / "index.html").read_text()
    assert html.count("<script") == html.count('<script src="/ui/')
    assert not re.search(r"\son[a-z]+=", html)  # inline event handlers
    assert "style=" not in html
    for js in ui.glob("*.js"):
        text = js.read_text()
        assert "style:" not in text, js.name
        assert 'setAttribute("style"' not in text, js.name
        assert "innerHTML" not in text, js.name
        assert "eval(" not in text, js.name
