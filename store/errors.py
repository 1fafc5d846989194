"""The store's one exception tree. The gateway maps it to HTTP at the route edge:

- `NotFoundError` -> 404, `ConflictError` (and its subclasses) -> 409,
- any other `StoreError` -> 500 (a broken invariant, not a client mistake).

Plain `ValueError` is raised for invalid arguments (a count out of range, a non-finite reward)
before anything touches the database. Every message says what to do next.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the store raises on purpose."""


class NotFoundError(StoreError, LookupError):
    """A run, session, segment or completion that does not exist (or not where it was sought)."""


class ConflictError(StoreError):
    """The request contradicts what the store already holds; nothing was written."""


class SessionEndedError(ConflictError):
    """A turn was recorded on a session that has already ended."""


class LeaseLostError(ConflictError):
    """The trainer no longer holds the lease on a trajectory it wants to mark consumed."""
