"""Who is calling: the admin, a run's agent, or one session.

Three kinds of bearer key, sent as `Authorization: Bearer KEY` (what the openai SDK sends) or
`x-api-key: KEY`:

- the admin token (`RLGATEWAY_ADMIN_TOKEN`): everything; compared in constant time;
- a run key `rlr-...` (returned by `POST /runs`): creates, lists and uses sessions of its run and
  reads the run's data; nothing of any other run, and no operator action (pause, delete, ...);
- a session key `rlg-...` (returned with each session): that one session only.

Agent keys are stored as their SHA-256 and looked up by it, so a plain key is never stored. A key
asking for another run's or session's resource gets 404, as if it did not exist; a key asking
for something of its own that its kind may not do gets 403.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import Request

from gateway.errors import Conflict, Forbidden, NotFound, Unauthorized
from store import Store
from store.errors import NotFoundError
from store.sessions import hash_key
from store.types import SessionInfo, SessionStatus


class SessionDirectory:
    """Session and run-key lookups by key and id, cached: a key's session never changes, and this
    gateway updates an entry when it ends a session. A session ended elsewhere may still look
    active here; its turns are then refused when they are committed (the store checks), so nothing
    is recorded into an ended session either way. Run keys are cached by digest until the run's
    key is replaced or the run deleted through this gateway (`forget_run`); on a store other
    gateways share (PostgreSQL), where the key may be replaced through another one, they are
    looked up on every use (run keys create sessions and browse: a handful of calls per group,
    not per turn)."""

    def __init__(self, store: Store, max_entries: int = 100_000) -> None:
        self.store = store
        self.max_entries = max_entries
        self.cache_run_keys = not store.shared
        self._by_key: dict[str, str] = {}
        self._by_id: dict[str, SessionInfo] = {}
        self._run_keys: dict[str, str] = {}

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

    async def run_of_key(self, api_key: str) -> str | None:
        """The id of the run whose agent key this is, or None."""
        digest = hash_key(api_key)
        run_id = self._run_keys.get(digest)
        if run_id is not None:
            return run_id
        run = await self.store.run_for_key(api_key)
        if run is None:
            return None
        if not self.cache_run_keys:
            return run.id
        if len(self._run_keys) >= self.max_entries:
            self._run_keys.clear()
        self._run_keys[digest] = run.id
        return run.id

    def forget_run(self, run_id: str, session_ids: Sequence[str] = ()) -> None:
        """Drop a run's cached key (replaced or deleted) and, when deleted, its sessions."""
        for digest in [d for d, r in self._run_keys.items() if r == run_id]:
            del self._run_keys[digest]
        gone = set(session_ids)
        for sid in gone:
            self._by_id.pop(sid, None)
        for digest in [d for d, s in self._by_key.items() if s in gone]:
            del self._by_key[digest]


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller. Exactly one holds: `admin`; a run key (`run_id` set, `session`
    None outside a session route); a session key (`session` set, `run_id` its run)."""

    admin: bool
    session: SessionInfo | None
    """The session the request is about (recorded into, for completions); None outside one."""
    run_id: str | None = None
    """The run of the agent key (run key or session key); None for the admin."""
    session_key: bool = False
    """True when the key is a session's own key (its scope is that session alone)."""


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
    """401 unless the bearer is the admin token (see `authenticate` for agent keys' 403)."""
    token = bearer(request)
    if token is None:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <admin token>'")
    if not is_admin(token, admin_token):
        raise Unauthorized("wrong admin token")


async def authenticate(
    request: Request, sessions: SessionDirectory, admin_token: str | None
) -> Caller:
    """The caller behind the bearer key; 401 when there is none or it is unknown."""
    token = bearer(request)
    if token is None:
        raise Unauthorized(
            "missing API key: send 'Authorization: Bearer <key>' (the admin token, a run's "
            "api_key, or the api_key returned when the session was created)"
        )
    if is_admin(token, admin_token):
        return Caller(admin=True, session=None)
    session = await sessions.by_key(token)
    if session is not None:
        return Caller(admin=False, session=session, run_id=session.run_id, session_key=True)
    run_id = await sessions.run_of_key(token)
    if run_id is not None:
        return Caller(admin=False, session=None, run_id=run_id)
    raise Unauthorized(
        "invalid API key: use the admin token, a run's api_key, or the api_key returned when "
        "the session was created"
    )


async def resolve(
    request: Request, sessions: SessionDirectory, admin_token: str | None, session_id: str | None
) -> Caller:
    """The caller of a request about the session in the path (if any): the admin, the run key of
    that session's run, or the session's own key. Without a session in the path a session key
    means its own session, a run key is refused (403: it must name a session)."""
    caller = await authenticate(request, sessions, admin_token)
    if session_id is None:
        if caller.admin or caller.session_key:
            return caller
        raise Forbidden(
            "a run key cannot make unrecorded calls: use a session's base_url "
            "(.../sessions/{id}/v1) or the session's own api_key"
        )
    if caller.session_key:
        assert caller.session is not None
        if caller.session.id != session_id:
            # Another session's key: do not reveal whether the session exists.
            raise NotFound(f"session {session_id!r} does not exist for this key")
        return caller
    try:
        info = await sessions.by_id(session_id)
    except NotFoundError:
        raise NotFound(f"session {session_id!r} does not exist") from None
    if not caller.admin and info.run_id != caller.run_id:
        raise NotFound(f"session {session_id!r} does not exist for this key")
    return Caller(admin=caller.admin, session=info, run_id=caller.run_id)


def require_active(caller: Caller) -> None:
    if caller.session is not None and caller.session.status is SessionStatus.ENDED:
        raise Conflict(
            f"session {caller.session.id} has ended: create a new session for more completions"
        )


def check_run_access(caller: Caller, run_id: str, *, agents: bool) -> None:
    """Whether `caller` may act on run `run_id`: the admin always; a run key of this run when
    `agents` allows agent keys; 404 for another run's keys (nothing of it is revealed), 403 for
    this run's keys where only the admin may act."""
    if caller.admin:
        return
    if caller.run_id != run_id:
        raise NotFound(f"run {run_id!r} does not exist for this key")
    if caller.session_key:
        raise Forbidden(
            "a session key reaches its own session only: use the run's api_key or the admin token"
        )
    if not agents:
        raise Forbidden("only the admin token may do this to a run")
