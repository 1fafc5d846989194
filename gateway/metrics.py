"""Prometheus metrics of one gateway (served at `/metrics`, admin token).

Counted as they happen: HTTP requests and latencies by route template (never by raw path, so
ids do not explode the label set), tokens captured into the store, prefix breaks, rewards,
admission rejections (429). Read at scrape time: the engine's state (up, paused, version, load,
restarts after it died) and, from the store, each unstopped run's newest trainer step (step
time, staleness, reward, throughput), so a trainer in another process shows up too.

Each app has its own `CollectorRegistry`, so several apps in one process (tests) do not clash.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engines.base import EngineHealth
from engines.errors import EngineError
from store.types import CompletionRecord, RunStatus

if TYPE_CHECKING:
    from engines.base import Engine
    from store import Store


async def engine_health(engine: Engine) -> EngineHealth:
    """The engine's health; an engine that cannot even say (its health call raised) is down,
    with the error as the reason, so that a probe gets an answer either way."""
    try:
        return await engine.health()
    except EngineError as exc:
        return EngineHealth(
            ok=False,
            paused=False,
            version=engine.version(),
            running=0,
            waiting=0,
            detail=f"{type(exc).__name__}: {exc}",
        )


SERVER_STATES = ("up", "down", "stale")
"""The states of a server behind a router (`engines.base.ServerState`)."""

_TRAINER_FIELDS = {
    "step": "the newest training step",
    "step_seconds": "seconds the newest step took",
    "staleness_mean": "mean policy-version lag of the newest step's tokens",
    "staleness_max": "largest policy-version lag of the newest step's tokens",
    "reward_mean": "mean reward of the newest step's trajectories",
    "tokens_per_s": "trained tokens per second in the newest step",
}


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "rlgateway_http_requests", "HTTP requests", ["method", "route", "status"], registry=r
        )
        self.latency = Histogram(
            "rlgateway_http_request_duration_seconds",
            "HTTP request latency to the end of the response",
            ["method", "route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.tokens = Counter(
            "rlgateway_tokens_captured",
            "Tokens recorded into the store (prompt: new context tokens; sampled: generated)",
            ["kind"],
            registry=r,
        )
        self.completions = Counter(
            "rlgateway_completions_recorded", "Completions (turns) recorded", registry=r
        )
        self.prefix_breaks = Counter(
            "rlgateway_prefix_breaks",
            "Requests that extended no segment of their session",
            registry=r,
        )
        self.rewards = Counter("rlgateway_rewards", "Rewards received", ["source"], registry=r)
        self.admission_rejections = Counter(
            "rlgateway_admission_rejections",
            "Session creations refused with 429 at the staleness bound",
            registry=r,
        )
        self.engine_up = Gauge(
            "rlgateway_engine_up", "1 while the engine can serve, 0 while it is down", registry=r
        )
        self.engine_restarts = Counter(
            "rlgateway_engine_restarts",
            "Times the engine was started again after it died",
            registry=r,
        )
        self._restarts_seen = 0
        self.engine_paused = Gauge(
            "rlgateway_engine_paused", "1 while the engine is paused", registry=r
        )
        self.engine_version = Gauge(
            "rlgateway_engine_version", "Policy version the engine serves", registry=r
        )
        self.engine_running = Gauge(
            "rlgateway_engine_running", "Requests the engine is decoding", registry=r
        )
        self.engine_waiting = Gauge(
            "rlgateway_engine_waiting", "Requests admitted, not yet started", registry=r
        )
        self.server_version = Gauge(
            "rlgateway_engine_server_version",
            "Policy version each server behind the router last said it serves",
            ["server"],
            registry=r,
        )
        self.server_state = Gauge(
            "rlgateway_engine_server_state",
            "1 for each router server's state (up: in rotation; down: not answering; stale: "
            "answering at another version, out of rotation until re-synced), 0 for the others",
            ["server", "state"],
            registry=r,
        )
        self.run_paused = Gauge(
            "rlgateway_run_paused", "1 while a run's training is paused", ["run"], registry=r
        )
        self.run_sessions = Gauge(
            "rlgateway_run_sessions",
            "A run's sessions by what became of them (trained, stale, filtered, untrainable, "
            "incomplete, orphaned; failed: ended by its agent as failed; pending: not settled "
            "yet)",
            ["run", "outcome"],
            registry=r,
        )
        self.trainer = {
            name: Gauge(f"rlgateway_trainer_{name}", doc, ["run"], registry=r)
            for name, doc in _TRAINER_FIELDS.items()
        }

    def observe_records(self, records: list[CompletionRecord]) -> None:
        """Called after a request's turns were committed."""
        for rec in records:
            self.completions.inc()
            self.tokens.labels(kind="prompt").inc(len(rec.prompt_ids) - rec.prefix_len)
            self.tokens.labels(kind="sampled").inc(len(rec.output_ids))
            if rec.prefix_break and rec.side is None:  # a side request is its own talk
                self.prefix_breaks.inc()

    async def refresh(self, engine: Engine, store: Store) -> None:
        """Read the gauges that live elsewhere: the engine, and the runs' newest steps."""
        h = await engine_health(engine)
        self.engine_up.set(1 if h.ok else 0)
        if h.restarts > self._restarts_seen:  # the engine keeps the total; count what is new
            self.engine_restarts.inc(h.restarts - self._restarts_seen)
            self._restarts_seen = h.restarts
        self.engine_paused.set(1 if h.paused else 0)
        self.engine_version.set(h.version)
        self.engine_running.set(h.running)
        self.engine_waiting.set(h.waiting)
        self.server_version.clear()
        self.server_state.clear()
        for server in h.servers:
            self.server_version.labels(server=server.name).set(server.version)
            for state in SERVER_STATES:
                self.server_state.labels(server=server.name, state=state).set(
                    1 if server.state == state else 0
                )
        runs = await store.unstopped_runs()
        latest = await store.latest_steps([r.id for r in runs])
        self.run_paused.clear()
        self.run_sessions.clear()
        for g in self.trainer.values():
            g.clear()
        for run in runs:
            self.run_paused.labels(run=run.id).set(1 if run.status == RunStatus.PAUSED else 0)
            for outcome, n in (await store.outcome_counts(run.id)).items():
                self.run_sessions.labels(run=run.id, outcome=outcome).set(n)
            step = latest.get(run.id)
            if step is None:
                continue
            values = {**step.metrics, "step": step.step}
            for name, gauge in self.trainer.items():
                v = values.get(name)
                if isinstance(v, int | float) and not isinstance(v, bool):
                    gauge.labels(run=run.id).set(v)


class RequestMetrics:
    """ASGI middleware: count and time every HTTP request by its route template."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "<unmatched>"
            method = scope["method"]
            self.metrics.requests.labels(method=method, route=template, status=str(status)).inc()
            self.metrics.latency.labels(method=method, route=template).observe(
                time.perf_counter() - start
            )
