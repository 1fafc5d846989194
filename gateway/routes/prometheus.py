"""`GET /metrics`: Prometheus text format (admin token; in Prometheus set
`authorization: {credentials: <admin token>}` on the scrape job)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.deps import GatewayDep
from gateway.errors import error_docs
from gateway.routes.access import AdminDep

router = APIRouter(tags=["metrics"], responses=error_docs(401, 403, 500))


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
async def metrics(gw: GatewayDep, _: AdminDep) -> Response:
    await gw.metrics.refresh(gw.engine, gw.store)
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)
