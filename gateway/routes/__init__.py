"""One APIRouter per resource: runs, sessions, admin, training, export, engines, metrics, the
page; and the edge every generation route shares (generate.py). Each protocol's routes live in
its package (`gateway.protocols`)."""
