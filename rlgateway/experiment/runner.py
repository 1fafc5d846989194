"""`Experiment`: a spec run end to end. It checks every part before anything starts, starts the
deployment (or joins one), evaluates the base policy, then drives rollouts with `concurrency`
groups in flight (each waits on the gateway's staleness admission rather than flooding it) while
the trainer trains, evaluates every `eval.every` steps and at the end, and writes the outputs.

Resuming: the store is the experiment's position. Every group carries its row's place in the
data stream (`epoch`, `index`) in its sessions' metadata, written when the group is created; a
restarted experiment reads its run's sessions back (`resume_plan`), skips the rows whose groups
were recorded, and reruns the rows whose groups never got an answer. Sessions a killed
experiment left unfinished are ended as failed, so their groups are judged at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlgateway.experiment.dataset import Cursor, DataStream, Splits, load
from rlgateway.experiment.deploy import Deployment, LocalDeployment, RemoteDeployment
from rlgateway.experiment.evaluate import evaluate
from rlgateway.experiment.report import Report
from rlgateway.experiment.rewards import RewardFn, RewardRunner, resolve_reward
from rlgateway.experiment.rollouts import Rollouts, Sampling
from rlgateway.experiment.spec import ExperimentSpec, load_spec
from rlgateway.experiment.workflow_registry import build_workflow
from rlgateway.experiment.workflows import Workflow, render
from rlgateway.models import resolve_model
from trainer.config import TrainConfig, validate_config

MONITOR_SECONDS = 0.5
RESTART_FAILURE = "the experiment stopped before this episode finished"


@dataclass(frozen=True, slots=True)
class ResumePlan:
    done: frozenset[tuple[int, int]]
    """(epoch, index) of the rows whose groups are recorded."""
    reruns: Counter[tuple[int, int]]
    """How many groups each row already had (group ids stay unique when a row is rerun)."""
    unfinished: tuple[str, ...]
    """Sessions a stopped experiment left open: to end as failed."""


def resume_plan(sessions: list[dict[str, Any]]) -> ResumePlan:
    """From a run's sessions: a row is done when its group got at least one answer (an ended
    session that did not fail on the restart); the open sessions are to end as failed."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in sessions:
        if "epoch" in s["metadata"]:
            groups.setdefault(s["group_id"], []).append(s)
    done: set[tuple[int, int]] = set()
    reruns: Counter[tuple[int, int]] = Counter()
    unfinished: list[str] = []
    for members in groups.values():
        meta = members[0]["metadata"]
        key = (int(meta["epoch"]), int(meta["index"]))
        reruns[key] += 1
        answered = [
            m for m in members if m["status"] == "ended" and m.get("failure") != RESTART_FAILURE
        ]
        if answered:
            done.add(key)
        unfinished += [m["id"] for m in members if m["status"] != "ended"]
    return ResumePlan(frozenset(done), reruns, tuple(unfinished))


def first_not_done(done: frozenset[tuple[int, int]], rows: int) -> Cursor:
    """Where the stream resumes: the first position whose row is not done."""
    epoch, index = 0, 0
    while (epoch, index) in done:
        index += 1
        if index == rows:
            epoch, index = epoch + 1, 0
    return Cursor(epoch=epoch, index=index)


@dataclass(frozen=True, slots=True)
class Parts:
    """Everything checked before anything starts."""

    splits: Splits
    workflow: Workflow
    reward: RewardRunner
    cfg: TrainConfig
    model_dir: Path


class Experiment:
    def __init__(
        self,
        spec: ExperimentSpec,
        *,
        base_dir: Path | str = ".",
        out: Path | str | None = None,
        gateway_url: str | None = None,
        admin_token: str | None = None,
        run_id: str | None = None,
        workflow: Workflow | None = None,
        reward: RewardFn | None = None,
    ) -> None:
        """`workflow` and `reward`, when given, are used instead of the spec's (Python objects
        need no import path)."""
        self.spec = spec
        self.workflow = workflow
        self.reward = reward
        self.base_dir = Path(base_dir)
        self.out = Path(out) if out is not None else Path("runs") / spec.name
        self.gateway_url = gateway_url
        self.admin_token = admin_token
        self.run_id = run_id
        self.log: list[str] = []

    @classmethod
    def from_yaml(
        cls, path: str | Path, overrides: list[str] | None = None, **kwargs: Any
    ) -> Experiment:
        """The spec at `path` with `KEY=VALUE` overrides (`spec.spec_overrides`); relative paths
        in it resolve against its folder."""
        return cls(load_spec(path, overrides), base_dir=Path(path).resolve().parent, **kwargs)

    def run(self) -> dict[str, Any]:
        """Run to the end (`train.max_steps`, or `minutes`); returns the summary."""
        return asyncio.run(self.arun())

    # -- the parts ---------------------------------------------------------------------------

    def prepare(self) -> Parts:
        """Load and check every part; a user's mistake is a ValueError saying what to fix."""
        spec = self.spec
        engine = spec.engine.settings()
        if self.gateway_url is not None and engine:
            raise ValueError(
                f"engine: {', '.join(sorted(engine))} set the embedded "
                "gateway's engine; the gateway at --gateway-url has its own (set them on its "
                "`rlgateway serve`)"
            )
        splits = load(spec.dataset, base_dir=self.base_dir)
        fn = resolve_reward(self.reward or spec.reward.fn, base_dir=self.base_dir)
        reward = RewardRunner(
            fn,
            timeout=spec.reward.timeout,
            executor=spec.reward.executor,
            max_workers=spec.reward.workers,
        )
        workflow = self.workflow or build_workflow(spec.workflow, base_dir=self.base_dir)
        template = None if self.workflow else getattr(spec.workflow, "prompt", None)
        for split, rows in (("train", splits.train), ("eval", splits.eval)):
            if template is not None and rows:
                try:
                    render(template, rows[0])
                except (KeyError, IndexError, ValueError) as exc:
                    raise ValueError(
                        f"workflow.prompt {template!r} names a field the {split} rows lack "
                        f"({exc}); they have: {', '.join(sorted(rows[0]))}"
                    ) from None
        model_dir = resolve_model(spec.model, self.base_dir)
        data = dict(spec.train)
        data.setdefault("max_steps", 100)
        data |= {
            "run": "",
            "database_url": "sqlite:///unused.db",
            "model": str(model_dir),
            "checkpoint_dir": str((self.out / "checkpoints").resolve()),
            "tensorboard": False,  # the experiment writes the curves (Report), train and eval
        }
        cfg = validate_config(data, "train")
        if cfg.group_size < 1:
            raise ValueError("train.group_size must be >= 1")
        return Parts(splits, workflow, reward, cfg, model_dir)

    # -- the run -----------------------------------------------------------------------------

    async def arun(self) -> dict[str, Any]:
        parts = self.prepare()
        self.out.mkdir(parents=True, exist_ok=True)
        report = Report(self.out)
        dep = await self._deploy(parts)
        t0 = time.perf_counter()
        try:
            summary = await self._drive(dep, parts, report)
        finally:
            parts.reward.close()
            await dep.close()
            report.close()
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        summary["curve"] = str(report.curve(f"{self.spec.name}: {parts.cfg.algorithm}"))
        return report.summary(summary)

    async def _deploy(self, parts: Parts) -> Deployment:
        spec = self.spec
        if self.gateway_url is None:
            return await LocalDeployment.start(
                parts.cfg,
                name=spec.name,
                model_dir=parts.model_dir,
                out=self.out,
                served_model_name=spec.served_model_name,
                engine=spec.engine.settings(),
            )
        if not self.admin_token:
            raise ValueError(
                "--gateway-url needs the gateway's admin token (--admin-token or "
                "RLGATEWAY_ADMIN_TOKEN)"
            )
        return await RemoteDeployment.start(
            self.gateway_url,
            self.admin_token,
            parts.cfg,
            name=spec.name,
            out=self.out,
            run_id=self.run_id,
            served_model_name=spec.served_model_name,
        )

    async def _drive(self, dep: Deployment, parts: Parts, report: Report) -> dict[str, Any]:
        spec, cfg = self.spec, parts.cfg
        rollouts = Rollouts(dep.client, parts.workflow, parts.reward, model=dep.served_model_name)
        sampling = Sampling(cfg.temperature, cfg.max_tokens, False)
        plan = resume_plan(await dep.client.all_sessions(dep.run_id))
        cut_short = [s["id"] for s in await dep.client.all_sessions(dep.eval_run_id, "active")]
        for sid in (*plan.unfinished, *cut_short):  # what a stopped experiment left in flight
            await dep.client.end(sid, failure=RESTART_FAILURE)
        stream = DataStream(
            parts.splits.train,
            seed=spec.dataset.seed,
            shuffle=spec.dataset.shuffle,
            start=first_not_done(plan.done, len(parts.splits.train)),
        )
        evaluated = {r["step"] for r in report.rows() if "eval_rows" in r}

        async def run_eval(step: int) -> None:
            if not parts.splits.eval or step in evaluated:
                return
            evaluated.add(step)
            row = await evaluate(
                rollouts,
                dep.eval_run_id,
                parts.splits.eval,
                spec.eval,
                step=step,
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
            )
            report.write(row)
            await dep.record_eval(step, step, row)
            print(_eval_line(row), flush=True)

        await run_eval(dep.trained_step())
        stop = asyncio.Event()

        def next_row() -> tuple[Cursor, dict[str, Any]]:
            while True:
                cursor, row = stream.next()
                if (cursor.epoch, cursor.index) not in plan.done:
                    return cursor, row

        async def worker() -> None:
            while not stop.is_set():
                cursor, row = next_row()
                key = (cursor.epoch, cursor.index)
                n = plan.reruns[key]
                plan.reruns[key] += 1
                gid = f"e{cursor.epoch}-i{cursor.index}" + (f"-r{n}" if n else "")
                meta = {
                    "epoch": cursor.epoch,
                    "index": cursor.index,
                    "prompt": str(row.get("prompt", ""))[:500],
                }
                await rollouts.group(
                    dep.run_id,
                    row,
                    size=cfg.group_size,
                    group_id=gid,
                    metadata=meta,
                    sampling=sampling,
                    stop=stop,
                )

        workers = [asyncio.create_task(worker()) for _ in range(spec.concurrency)]
        deadline = None if spec.minutes is None else time.monotonic() + spec.minutes * 60
        evaluating: asyncio.Task[None] | None = None
        every = spec.eval.every
        next_eval = (dep.trained_step() // every + 1) * every if every else None
        seen = rollouts.tally.episodes
        interrupted = False
        try:
            while True:
                for row in await dep.poll():
                    t = rollouts.tally
                    row |= {
                        "rollout_episodes": t.episodes,
                        "rollout_failed": sum(t.failures.values()),
                        "admission_waits": dep.client.admission_waits,
                        "epoch": stream.position.epoch,
                    }
                    report.write(row)
                    print(_train_line(row, t.episodes - seen), flush=True)
                    seen = t.episodes
                step = dep.trained_step()
                if (
                    next_eval is not None
                    and step >= next_eval
                    and (evaluating is None or evaluating.done())
                ):
                    next_eval = (step // every + 1) * every
                    evaluating = asyncio.create_task(run_eval(step))
                if dep.training_over() or (deadline is not None and time.monotonic() > deadline):
                    break
                if any(w.done() and w.exception() is not None for w in workers):
                    break
                await asyncio.sleep(MONITOR_SECONDS)
        except asyncio.CancelledError:
            # Ctrl-C (asyncio.run cancels this task): stop at once. The episodes in flight stay
            # open, and the next run ends them as failed and hands their rows out again, as it
            # does after a kill -9 (`resume_plan`).
            interrupted = True
            raise
        finally:
            stop.set()
            if interrupted:
                for task in [*workers, evaluating]:
                    if task is not None:
                        task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            if evaluating is not None:
                await (
                    asyncio.gather(evaluating, return_exceptions=True)
                    if interrupted
                    else evaluating
                )
        for w in workers:
            if w.exception() is not None:
                raise w.exception()  # type: ignore[misc]
        dep.raise_failure()
        await dep.stop_training()
        for row in await dep.poll():
            report.write(row)
        await run_eval(dep.trained_step())
        await rollouts.close()
        t = rollouts.tally
        return {
            "name": spec.name,
            "run_id": dep.run_id,
            "eval_run_id": dep.eval_run_id,
            "steps": dep.trained_step(),
            "episodes": t.episodes,
            "failures": dict(t.failures),
            "reward_outcomes": dict(parts.reward.counts),
            "admission_waits": dep.client.admission_waits,
            "out": str(self.out),
        }


def _train_line(row: dict[str, Any], episodes: int) -> str:
    parts = [f"step {row['step']:>4}"]
    for k in ("reward_mean", "loss", "step_seconds"):
        if isinstance(row.get(k), int | float):
            parts.append(f"{k} {row[k]:.3f}")
    parts.append(f"episodes +{episodes}")
    return "  ".join(parts)


def _eval_line(row: dict[str, Any]) -> str:
    keys = [k for k in row if k.startswith("eval_") and isinstance(row[k], float)]
    return f"eval @ step {row['step']}: " + "  ".join(f"{k[5:]} {row[k]:.3f}" for k in keys)
