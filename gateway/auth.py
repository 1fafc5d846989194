"""Who is calling: the admin (bearer = the admin token) or a session (bearer = its key).

Keys arrive as `Authorization: Bearer KEY` (what the openai SDK sends) or `x-api-key: KEY`. The
admin token is compared in constant time; session keys are looked up by their SHA-256 in the store,
so the plain key is never stored.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from gateway.errors import Conflict, NotFound, Unauthorized
from store import Store
from store.errors import NotFoundError
from store.sessions import hash_key
from store.types import SessionInfo, SessionStatus


class SessionDirectory:
    """Session lookups by key and id, cached: a key's session never changes, and this gateway
    updates an entry when it ends a session. A session ended elsewhere may still look active
    here; its turns are then refused when they are committed (the store checks), so nothing is
    recorded into an ended session either way."""

    def __init__(self, store: Store, max_entries: int = 100_000) -> None:
        self.store = store
        self.max_entries = max_entries
        self._by_key: dict[str, str] = {}
        self._by_id: dict[str, SessionInfo] = {}

    def remember(self, info: SessionInfo) -> None:
        if len(self._by_id) >= self.max_entries:
            self._by_id.clear()
            self._by_key.clear()
        self._by_id[info.id] = info

    def remember_key(self, api_key: str, info: SessionInfo) -> None:
        """A session this gateway created: its key is known without a lookup."""
        self.remember(info)
        self._by_key[hash_key(api_key)] = info.id

    async def by_key(self, api_key: str) -> SessionInfo | None:
        digest = hash_key(api_key)
        sid = self._by_key.get(digest)
        if sid is not None and sid in self._by_id:
            return self._by_id[sid]
        info = await self.store.session_for_key(api_key)
        if info is not None:
            self.remember(info)
            self._by_key[digest] = info.id
        return info

    async def by_id(self, session_id: str) -> SessionInfo:
        info = self._by_id.get(session_id)
        if info is None:
            info = await self.store.get_session(session_id)
            self.remember(info)
        return info


@dataclass(frozen=True, slots=True)
class Caller:
    admin: bool
    session: SessionInfo | None
    """The session the request is recorded into; None for admin calls outside any session."""


def bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


def is_admin(token: str | None, admin_token: str | None) -> bool:
    if token is None or not admin_token:
        return False
    return hmac.compare_digest(token.encode(), admin_token.encode())


def require_admin(request: Request, admin_token: str | None) -> None:
    token = bearer(request)
    if token is None:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <admin token>'")
    if not is_admin(token, admin_token):
        raise Unauthorized("wrong admin token")


async def resolve(
    request: Request, sessions: SessionDirectory, admin_token: str | None, session_id: str | None
) -> Caller:
    """The caller of a request, for the session in the path (if any)."""
    token = bearer(request)
    if token is None:
        raise Unauthorized(
            "missing API key: send 'Authorization: Bearer <session key>' (the api_key returned "
            "when the session was created)"
        )
    if is_admin(token, admin_token):
        if session_id is None:
            return Caller(admin=True, session=None)
        try:
            return Caller(admin=True, session=await sessions.by_id(session_id))
        except NotFoundError:
            raise NotFound(f"session {session_id!r} does not exist") from None
    session = await sessions.by_key(token)
    if session is None:
        raise Unauthorized("invalid API key: use the api_key returned when the session was created")
    if session_id is not None and session.id != session_id:
        # Another session's key: do not reveal whether the session exists.
        raise NotFound(f"session {session_id!r} does not exist for this key")
    return Caller(admin=False, session=session)


def require_active(caller: Caller) -> None:
    if caller.session is not None and caller.session.status is SessionStatus.ENDED:
        raise Conflict(
            f"session {caller.session.id} has ended: create a new session for more completions"
        )
