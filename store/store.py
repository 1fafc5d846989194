"""`Store`: the one object the gateway and the trainer hold. Thin methods over the modules that
implement them (`sessions`, `turns`, `rewards`, `trajectories`, `queue`); each call is one short
transaction, so one `Store` serves any number of concurrent asyncio tasks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Self

from store import browse, migrate, policy, queue, rewards, runs, sessions, steps, turns
from store.db import Database, redact
from store.errors import StoreError
from store.group_commit import GroupCommitter
from store.trajectories import check_gamma, load_sessions
from store.types import (
    JSON,
    CompletionRecord,
    KeptTurn,
    NewSession,
    Outcome,
    PublishedPolicy,
    Run,
    RunStatus,
    RunSummary,
    SegmentState,
    SessionDetail,
    SessionFilter,
    SessionInfo,
    SessionSummary,
    TrainStep,
    Trajectory,
)


class Store:
    """The durable trajectory store on SQLite or PostgreSQL. Create it with `Store.connect`."""

    def __init__(self, db: Database, *, group_commit: bool = True) -> None:
        self._db = db
        self.url: str = db.url
        """The normalized (async driver) URL."""
        self.dialect: str = db.dialect
        """"sqlite" or "postgresql"."""
        self.shared = self.dialect != "sqlite"
        """Other processes may write it as this one does (a fleet of gateways on PostgreSQL; one
        gateway holds an SQLite file: `gateway/single.py`): what a process holds of it may go
        stale."""
        # Concurrent turns share one transaction (`store.group_commit`): one commit, one fsync
        # and a handful of set-based statements for the whole group, on both backends.
        self._group = GroupCommitter(db) if group_commit else None

    @classmethod
    async def connect(cls, url: str, *, upgrade: bool = True, group_commit: bool = True) -> Self:
        """Open the database at `url` (see `store.db.normalize_url` for the accepted forms).

        With `upgrade` (the default) the schema is first migrated to the newest revision; without
        it, a database not at that revision is refused with a StoreError that says to run
        `rlgateway db upgrade`. A database that cannot be reached raises StoreError too.
        `group_commit` (the default) lets concurrent `record_completions` calls share a
        transaction; without it each call commits its own (what `bench/bench_store.py` compares).
        """
        db = Database(url)
        try:
            await db.ping()
            if upgrade:
                await migrate.upgrade(db)
            else:
                current, head = await migrate.current_revision(db), migrate.head_revision()
                migrate.check_known(current, db)
                if current != head:
                    raise StoreError(
                        f"database {redact(db.url)} is at schema revision {current or 'none'}, "
                        f"this rlgateway needs {head}: run `rlgateway db upgrade`"
                    )
        except BaseException:
            await db.dispose()
            raise
        return cls(db, group_commit=group_commit)

    async def close(self) -> None:
        await self._db.dispose()

    # runs

    async def create_run(self, name: str, config: JSON) -> Run:
        """A new run `run_<24 hex>` with status "active"."""
        return await sessions.create_run(self._db, name, config)

    async def get_run(self, run_id: str) -> Run:
        """Raises NotFoundError for an unknown id."""
        return await sessions.get_run(self._db, run_id)

    async def list_runs(self) -> list[RunSummary]:
        """Every run, newest first, with its session counts and newest training step."""
        return await runs.list_runs(self._db)

    async def unstopped_runs(self) -> list[Run]:
        """Runs that are active or paused, newest first (no counts: cheap)."""
        return await runs.unstopped_runs(self._db)

    async def set_run_status(self, run_id: str, status: RunStatus) -> Run:
        """Set what the trainer obeys (active, paused, stopped). NotFoundError if unknown."""
        return await runs.set_status(self._db, run_id, status)

    async def set_run_config(self, run_id: str, config: JSON) -> Run:
        """Replace the run's stored config (what the gateway's admission and sampling read).
        The caller validates it first, as `POST /runs` does. NotFoundError if unknown."""
        return await runs.set_config(self._db, run_id, config)

    async def new_run_key(self, run_id: str) -> str:
        """A new agent key `rlr-...` for the run (returned once, stored as its sha256); any
        earlier key of the run stops working. NotFoundError if unknown."""
        return await runs.new_key(self._db, run_id)

    async def run_for_key(self, api_key: str) -> Run | None:
        """The run whose agent key this is, or None."""
        return await runs.run_for_key(self._db, api_key)

    async def delete_run(self, run_id: str) -> list[str]:
        """Delete the run and everything of it (sessions, turns, rewards, steps) in one
        transaction; returns the deleted session ids. NotFoundError if unknown."""
        return await runs.delete_run(self._db, run_id)

    # training steps

    async def record_step(
        self,
        run_id: str,
        step: int,
        *,
        version: int,
        metrics: JSON,
        checkpoint: str | None = None,
    ) -> None:
        """Record a trainer step (replacing a row of the same step). NotFoundError for an
        unknown run."""
        await steps.record_step(
            self._db, run_id, step, version=version, metrics=metrics, checkpoint=checkpoint
        )

    async def list_steps(
        self, run_id: str, *, after: int | None = None, limit: int = 10_000
    ) -> list[TrainStep]:
        """The run's training steps in order (after step `after`, when given)."""
        return await steps.list_steps(self._db, run_id, after=after, limit=limit)

    async def latest_steps(self, run_ids: list[str]) -> dict[str, TrainStep]:
        """The newest step of each run that has one."""
        return await steps.latest_steps(self._db, run_ids)

    # published policies

    async def record_policy(self, version: int, path: str | None) -> PublishedPolicy:
        """Record that the gateway's engine now serves `version`, loaded from the model
        directory `path` (None: weights handed over in process)."""
        return await policy.record_policy(self._db, version, path)

    async def latest_policy(self) -> PublishedPolicy | None:
        """The policy recorded last (what a restarted gateway serves again), or None."""
        return await policy.latest_policy(self._db)

    # sessions

    async def list_sessions(
        self, run_id: str, where: SessionFilter, *, limit: int = 50, offset: int = 0
    ) -> tuple[list[SessionSummary], int]:
        """A page of the run's sessions matching `where`, newest first, and the total count."""
        return await browse.list_sessions(self._db, run_id, where, limit=limit, offset=offset)

    async def export_sessions(
        self, run_id: str, where: SessionFilter, *, gamma: float = 1.0
    ) -> AsyncIterator[tuple[SessionDetail, dict[str, JSON]]]:
        """Every matching session, oldest first, as its detail and its segments' transcripts
        (by segment id); read in batches, so a large run streams in bounded memory."""
        check_gamma(gamma)
        async for loaded, transcripts in browse.iter_sessions(self._db, run_id, where):
            yield loaded.detail(gamma), transcripts

    async def create_sessions(
        self,
        run_id: str,
        count: int,
        *,
        group_id: str | None = None,
        metadata: JSON | None = None,
        admit: Callable[[int, int], None] | None = None,
    ) -> list[NewSession]:
        """`count` (1..1024) new sessions `sess_<24 hex>` of one run and group, each with its
        bearer key `rlg-...` (returned here once; stored only as its sha256). NotFoundError for
        an unknown run. `admit(running, accepted)` (the run's counts, as `run_counts` gives them)
        is called in the creating transaction with the run locked, and refuses by raising:
        staleness admission that holds across every gateway on the database."""
        return await sessions.create_sessions(
            self._db, run_id, count, group_id=group_id, metadata=metadata, admit=admit
        )

    async def session_turns(self, session_id: str) -> int:
        """How many turns the session has recorded: a gateway sharing the database with others
        compares it with what it holds to tell that another one wrote the session."""
        return await sessions.session_turns(self._db, session_id)

    async def get_session(self, session_id: str) -> SessionInfo:
        """Raises NotFoundError for an unknown id."""
        return await sessions.get_session(self._db, session_id)

    async def session_for_key(self, api_key: str) -> SessionInfo | None:
        """The session whose bearer key this is, or None."""
        return await sessions.session_for_key(self._db, api_key)

    async def end_session(self, session_id: str, *, failure: str | None = None) -> SessionInfo:
        """End the session (idempotent: `ended_at` is set once). NotFoundError if unknown.

        With a `failure` (why its episode failed; kept to its first 500 characters) it is also
        settled at once as `Outcome.FAILED`: never claimed nor trained, even if it holds a
        reward, and its group is judged without it. An ended session can still fail while the
        trainer has not taken it; once claimed or settled, ConflictError. Failing it again with
        the same reason changes nothing; with another, ConflictError. ValueError for an empty
        reason."""
        return await sessions.end_session(self._db, session_id, failure=failure)

    async def load_segments(self, session_id: str) -> list[SegmentState]:
        """The session's segments by index, each with its transcript and exact tokens."""
        return await turns.load_segments(self._db, session_id)

    # turns

    async def record_completions(self, records: list[CompletionRecord]) -> None:
        """Commit a request's completions (its n choices) in one transaction: all or nothing.

        Each record opens its segment (`opens_segment`) or extends it, and must start exactly
        at the segment's current end (`prefix_len` == its length), else ConflictError. Also
        ConflictError: a completion or segment id (or segment index) already taken, and
        SessionEndedError for an ended session; NotFoundError for an unknown session or
        segment; ValueError for arrays of unequal length.
        """
        if self._group is not None:
            await self._group.record(records)
        else:
            await turns.record_completions(self._db, records)

    async def get_turn(self, completion_id: str) -> KeptTurn | None:
        """The recorded turn of a completion id (its session, status, request and response), or
        None when there is none."""
        return await turns.get_turn(self._db, completion_id)

    # rewards

    async def add_reward(
        self,
        session_id: str,
        value: float,
        *,
        completion_id: str | None = None,
        key: str | None = None,
        late: rewards.LateRewards = "refuse",
    ) -> bool:
        """Record a reward for one turn (`completion_id`) or the episode (None).

        With a `key` it is idempotent: False if the key already holds this same reward,
        ConflictError if it holds a different one. Keyless rewards always add a row. Accepted
        after the session ended, until the trainer takes it; after that ConflictError, or with
        `late="record"` recorded flagged late (exported, never trained). NotFoundError for an
        unknown session or a completion outside it; ValueError for a non-finite value.
        """
        return await rewards.add_reward(
            self._db, session_id, value, completion_id=completion_id, key=key, late=late
        )

    async def set_reward(
        self, session_id: str, value: float, *, completion_id: str | None = None
    ) -> None:
        """Set a reward by hand: replaces every reward of that turn (or of the episode's final
        reward when `completion_id` is None) with this value. NotFoundError as `add_reward`."""
        await rewards.set_reward(self._db, session_id, value, completion_id=completion_id)

    async def session_detail(self, session_id: str, *, gamma: float = 1.0) -> SessionDetail:
        """Everything about one session: segments token by token, rewards, returns."""
        check_gamma(gamma)
        async with self._db.read() as s:
            loaded = await load_sessions(s, [session_id])
        if session_id not in loaded:
            raise sessions.session_not_found(session_id)
        return loaded[session_id].detail(gamma)

    # trainer side

    async def list_trainable(
        self, run_id: str, *, limit: int = 100, gamma: float = 1.0
    ) -> list[Trajectory]:
        """Ended sessions with at least one reward, pending or under an expired lease, oldest
        ended first. Reads only: nothing is claimed."""
        return await queue.list_trainable(self._db, run_id, limit=limit, gamma=gamma)

    async def claim(
        self,
        run_id: str,
        *,
        limit: int,
        owner: str,
        lease_seconds: float,
        gamma: float = 1.0,
    ) -> list[Trajectory]:
        """Atomically lease up to `limit` trainable sessions to `owner` for `lease_seconds`.
        Concurrent claims get disjoint sets; an expired lease returns a session to the queue."""
        return await queue.claim(
            self._db, run_id, limit=limit, owner=owner, lease_seconds=lease_seconds, gamma=gamma
        )

    async def mark_consumed(
        self, session_ids: list[str], *, owner: str, step: int, outcome: Outcome | None = None
    ) -> None:
        """Mark sessions trained at `step` (or settled with `outcome` at step -1). All or
        nothing: LeaseLostError (and no change) unless every one is still leased by `owner`;
        NotFoundError for unknown ids."""
        await queue.mark_consumed(self._db, session_ids, owner=owner, step=step, outcome=outcome)

    async def settle_consumed(
        self, session_ids: list[str], *, step: int, outcome: Outcome | None = None
    ) -> int:
        """Mark these sessions consumed at `step` with `outcome` whatever their lease (unless
        already consumed): crash recovery, and what the trainer drops; returns how many
        changed."""
        return await queue.settle_consumed(self._db, session_ids, step=step, outcome=outcome)

    async def claim_groups(
        self,
        run_id: str,
        *,
        batch_size: int,
        group_size: int,
        partial_groups: str,
        deadline_seconds: float,
        owner: str,
        lease_seconds: float,
        gamma: float = 1.0,
    ) -> queue.GroupClaim:
        """Lease whole ready groups once they add up to `batch_size` (`store.queue`'s module
        docstring: completeness per group, deadlines, `partial_groups`)."""
        return await queue.claim_groups(
            self._db,
            run_id,
            batch_size=batch_size,
            group_size=group_size,
            partial_groups=partial_groups,
            deadline_seconds=deadline_seconds,
            owner=owner,
            lease_seconds=lease_seconds,
            gamma=gamma,
        )

    async def end_idle(self, run_id: str, *, idle_seconds: float) -> tuple[list[str], list[str]]:
        """End the run's sessions idle for `idle_seconds` that were never ended; those without
        a reward are settled as orphaned. Returns (ended, orphaned)."""
        return await queue.end_idle(self._db, run_id, idle_seconds=idle_seconds)

    async def release_owner(self, run_id: str, owner: str) -> int:
        """Every session of the run `owner` leases goes back to the queue now; returns how
        many."""
        return await queue.release_owner(self._db, run_id, owner)

    async def outcome_counts(self, run_id: str) -> dict[str, int]:
        """The run's sessions per outcome, and `pending` for those not settled."""
        return await queue.outcome_counts(self._db, run_id)

    async def renew(self, session_ids: list[str], *, owner: str, lease_seconds: float) -> int:
        """Extend `owner`'s lease of these sessions to `lease_seconds` from now; returns how many
        it still held."""
        return await queue.renew(self._db, session_ids, owner=owner, lease_seconds=lease_seconds)

    async def requeue_after(self, run_id: str, *, step: int) -> int:
        """Crash recovery: sessions of the run consumed after checkpoint `step` go back to the
        queue; returns how many."""
        return await queue.requeue_after(self._db, run_id, step=step)

    async def run_counts(self, run_id: str) -> tuple[int, int]:
        """(running, accepted) trajectories of the run, for staleness admission: active
        sessions, and ended rewarded ones the trainer did not drop."""
        return await queue.run_counts(self._db, run_id)

    async def release(self, session_ids: list[str], *, owner: str) -> None:
        """Return the sessions leased by `owner` to the queue; others are left as they are."""
        await queue.release(self._db, session_ids, owner=owner)
