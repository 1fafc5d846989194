"""The durable trajectory store (SQLAlchemy 2.0; SQLite by default, PostgreSQL by URL).

`Store` is the whole public API; `store.types` holds the records it takes and returns and
`store.errors` the exceptions it raises. The schema belongs to the Alembic migrations in
`migrations/` (`rlgateway db upgrade`, or `Store.connect(url)` which upgrades by default).
"""

from store.errors import (
    ConflictError,
    LeaseLostError,
    NotFoundError,
    SessionEndedError,
    StoreError,
)
from store.store import Store

__all__ = [
    "ConflictError",
    "LeaseLostError",
    "NotFoundError",
    "SessionEndedError",
    "Store",
    "StoreError",
]
