"""Route dependencies that authorize a request (see `gateway.auth` for the rules):

- `AdminDep`: the admin token only (401 without a valid key, 403 for agent keys);
- `RunAgentDep`: the admin or the run key of the run in the path (`{run_id}`);
- `RunAdminDep`: the admin only, on a run in the path (another run's keys get 404, so nothing
  of that run is revealed; this run's keys get 403).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gateway.auth import Caller, authenticate, bearer, check_run_access, is_admin
from gateway.deps import GatewayDep
from gateway.errors import Forbidden, Unauthorized

DOC_BEARER = HTTPBearer(
    auto_error=False,
    description="The admin token, a run's api_key, or a session's api_key "
    "(`x-api-key: KEY` works too)",
)
"""Declares the bearer scheme in the OpenAPI document (so its clients know how to send a key);
the keys are read and checked by `gateway.auth`, which also accepts `x-api-key`."""
BearerDoc = Annotated[HTTPAuthorizationCredentials | None, Depends(DOC_BEARER)]


async def _caller(gw: GatewayDep, request: Request) -> Caller:
    return await authenticate(request, gw.sessions, gw.settings.admin_token)


async def _admin(gw: GatewayDep, request: Request, _: BearerDoc) -> Caller:
    token = bearer(request)
    if token is None:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <admin token>'")
    if is_admin(token, gw.settings.admin_token):
        return Caller(admin=True, session=None)
    if await gw.sessions.by_key(token) is None and await gw.sessions.run_of_key(token) is None:
        raise Unauthorized("wrong admin token")
    raise Forbidden("this needs the admin token; agent keys reach their own run only")


async def _run_agent(gw: GatewayDep, request: Request, run_id: str, _: BearerDoc) -> Caller:
    caller = await _caller(gw, request)
    check_run_access(caller, run_id, agents=True)
    return caller


async def _run_admin(gw: GatewayDep, request: Request, run_id: str, _: BearerDoc) -> Caller:
    caller = await _caller(gw, request)
    check_run_access(caller, run_id, agents=False)
    return caller


AdminDep = Annotated[Caller, Depends(_admin)]
RunAgentDep = Annotated[Caller, Depends(_run_agent)]
RunAdminDep = Annotated[Caller, Depends(_run_admin)]
