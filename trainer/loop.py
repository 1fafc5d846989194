"""The asynchronous training loop: claim, filter, advantages, loss, step, checkpoint, publish.

One step:
1. claim at least `batch_size` finished, rewarded trajectories of the run (whole GRPO groups when
   `partial_groups` is wait), under a lease;
2. drop (settle at step -1) those with a token older than `eta` versions, and uniform groups under
   dynamic sampling;
3. build training sequences with token advantages; recompute proximal logprobs (decoupled PPO)
   and reference logprobs (KL) with no grad;
   with a critic (PPO), compute the critic's values of the batch, then GAE advantages and returns;
4. one optimizer step over packed micro-batches (and one of the critic on the value loss);
5. checkpoint (with the trained session ids), mark them consumed, publish weights as version
   step + 1 to the engines.

Generation never waits for training: agents keep running against the gateway, whose admission
control keeps them within `eta` versions of the policy being trained.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store import NotFoundError, Store
from store.types import RunStatus, Trajectory
from trainer import checkpoint
from trainer.algorithms.aggregation import loss_normalizer
from trainer.algorithms.losses import explained_variance
from trainer.backends.base import TrainBackend, ValueBackend
from trainer.batch import TrainSequence
from trainer.config import TrainConfig
from trainer.loss import make_loss_fn, make_value_loss_fn
from trainer.publish import WeightPublisher
from trainer.report import MetricsSink
from trainer.sequences import build_sequences, with_gae

log = logging.getLogger(__name__)


def _group_key(t: Trajectory) -> str:
    return t.session.group_id if t.session.group_id is not None else f"solo:{t.session.id}"


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        store: Store,
        backend: TrainBackend,
        publisher: WeightPublisher | None,
        *,
        reference: TrainBackend | None = None,
        critic: ValueBackend | None = None,
        owner: str | None = None,
        report: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.algo = cfg.algorithm_config()
        self.store = store
        self.backend = backend
        self.reference = reference
        self.critic = critic
        self.publisher = publisher
        self.owner = owner or f"trainer-{uuid.uuid4().hex[:12]}"
        self.loss_fn = make_loss_fn(self.algo)
        self.value_loss_fn = make_value_loss_fn(self.algo)
        self.root = Path(cfg.checkpoint_dir)
        self.metrics_path = self.root / "metrics.jsonl"
        self.is_leader = _rank() == 0
        self.sink = MetricsSink(cfg, self.root, report or _print_report)
        if self.algo.kl_coef > 0 and reference is None:
            raise ValueError("kl_coef > 0 needs a reference model: pass `reference`")
        if self.algo.use_critic and critic is None:
            raise ValueError(
                f"algorithm {cfg.algorithm!r} trains a critic (use_critic): pass `critic` "
                "(trainer.backends.registry.build_value_backend)"
            )

    # -- lifecycle ---------------------------------------------------------------------------

    async def resume(self) -> int:
        """Load the newest checkpoint (if any), settle its sessions as consumed, and publish its
        weights so the engines serve the version training continues from. Returns the step."""
        found = checkpoint.latest(self.root)
        if found is None:
            return self.backend.step
        path, meta = found
        await asyncio.to_thread(self.backend.load, path)
        if self.critic is not None and self.algo.use_critic:
            await asyncio.to_thread(checkpoint.load_critic, path, self.critic)
        if not self.is_leader:
            return self.backend.step
        await self.store.settle_consumed(meta.consumed, step=meta.step)
        await self.store.settle_consumed(meta.dropped, step=-1)
        if self.publisher is not None:
            await self.publisher.publish(self.backend.full_state_dict(), self.backend.step)
        log.info("resumed from %s at step %d", path, self.backend.step)
        return self.backend.step

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Train until `max_steps` (or `stop` is set). Under torchrun every rank runs this: rank 0
        talks to the store and the engines, and hands each batch to the other ranks."""
        while self.backend.step < self.cfg.max_steps:
            if stop is not None and stop.is_set():
                return
            batch = await self._collect(stop) if self.is_leader else None
            batch = _share(batch)
            if batch is None:
                return
            await self._step(batch)

    # -- one step ----------------------------------------------------------------------------

    async def _collect(self, stop: asyncio.Event | None) -> list[Trajectory] | None:
        cfg = self.cfg
        while True:
            if stop is not None and stop.is_set():
                return None
            status = await self._run_status()
            if status != RunStatus.ACTIVE:
                if status != RunStatus.PAUSED:  # stopped or deleted: training is over
                    log.info("run %s is %s: the trainer stops", cfg.run, status or "deleted")
                    return None
                await asyncio.sleep(cfg.poll_seconds)  # paused: start no step, hold no lease
                continue
            claimed = await self.store.claim(
                cfg.run,
                limit=cfg.batch_size * 4,
                owner=self.owner,
                lease_seconds=cfg.lease_seconds,
                gamma=cfg.discount,
            )
            fresh, stale = self._split_stale(claimed)
            if stale:
                await self.store.settle_consumed([t.session.id for t in stale], step=-1)
            chosen, rest, dropped = self._choose(fresh)
            if dropped:
                await self.store.settle_consumed([t.session.id for t in dropped], step=-1)
            if len(chosen) >= cfg.batch_size:
                if rest:
                    await self.store.release([t.session.id for t in rest], owner=self.owner)
                return chosen
            if chosen or rest:
                await self.store.release([t.session.id for t in chosen + rest], owner=self.owner)
            await asyncio.sleep(cfg.poll_seconds)

    async def _run_status(self) -> RunStatus | None:
        """The run's status as the operator set it (None once the run is deleted)."""
        try:
            return RunStatus((await self.store.get_run(self.cfg.run)).status)
        except NotFoundError:
            return None

    def _split_stale(self, trajs: list[Trajectory]) -> tuple[list[Trajectory], list[Trajectory]]:
        oldest_ok = self.backend.step - self.cfg.eta
        fresh = [t for t in trajs if t.min_version < 0 or t.min_version >= oldest_ok]
        stale = [t for t in trajs if not (t.min_version < 0 or t.min_version >= oldest_ok)]
        return fresh, stale

    def _choose(
        self, trajs: list[Trajectory]
    ) -> tuple[list[Trajectory], list[Trajectory], list[Trajectory]]:
        """(train now, give back, drop) under the partial-group policy; whole groups only,
        oldest first, at least batch_size trajectories when there are that many."""
        cfg = self.cfg
        groups: dict[str, list[Trajectory]] = defaultdict(list)
        for t in trajs:
            groups[_group_key(t)].append(t)
        chosen: list[Trajectory] = []
        rest: list[Trajectory] = []
        dropped: list[Trajectory] = []
        for members in groups.values():
            complete = len(members) >= cfg.group_size or cfg.partial_groups == "use"
            if not complete and cfg.partial_groups == "drop":
                dropped += members
            elif complete and len(chosen) < cfg.batch_size:
                chosen += members
            else:
                rest += members
        return chosen, rest, dropped

    async def _step(self, batch: list[Trajectory]) -> None:
        cfg, algo, backend = self.cfg, self.algo, self.backend
        t0 = time.perf_counter()
        version = backend.step
        built = build_sequences(batch, algo, max_tokens=cfg.max_tokens, discount=cfg.discount)
        seqs = built.sequences
        if not seqs:  # every trajectory was filtered out: nothing to train, no new version
            if self.is_leader:
                ids = [t.session.id for t in batch]
                await self.store.mark_consumed(ids, owner=self.owner, step=-1)
            return
        critic = self.critic if algo.use_critic else None
        critic_stats: dict[str, float] = {}
        if critic is not None:
            assert built.token_rewards is not None
            values = await asyncio.to_thread(
                critic.forward_values, seqs, token_budget=cfg.token_budget
            )
            seqs = with_gae(seqs, built.token_rewards, values, algo)
            critic_stats["explained_variance"] = _explained_variance(seqs)
        seqs = await self._with_side_logprobs(seqs)
        n_tokens = sum(s.num_loss_tokens for s in seqs)
        norm = loss_normalizer(algo.agg, num_tokens=n_tokens, num_seqs=len(seqs))
        stats = await asyncio.to_thread(
            backend.train_step,
            seqs,
            self.loss_fn,
            temperature=cfg.temperature,
            token_budget=cfg.token_budget,
            global_norm=norm,
        )
        if critic is not None:
            value_stats = await asyncio.to_thread(
                critic.train_step,
                seqs,
                self.value_loss_fn,
                temperature=cfg.temperature,
                token_budget=cfg.token_budget,
                global_norm=norm,
            )
            critic_stats |= {
                "value_loss": value_stats.pop("loss"),
                "critic_grad_norm": value_stats.pop("grad_norm"),
                "critic_lr": value_stats.pop("lr"),
                **value_stats,
            }
        step = backend.step
        used = [t.session.id for t in built.used]
        dropped = [t.session.id for t in built.dropped]
        saved = await asyncio.to_thread(
            checkpoint.save,
            self.root,
            backend,
            checkpoint.CheckpointMeta(step, used, dropped),
            keep=cfg.keep_checkpoints,
            is_writer=self.is_leader,
            critic=critic,
        )
        weights = backend.full_state_dict()  # a collective: every rank takes part
        if not self.is_leader:
            return
        await self.store.mark_consumed(used, owner=self.owner, step=step)
        if dropped:
            await self.store.mark_consumed(dropped, owner=self.owner, step=-1)
        if self.publisher is not None:
            await self.publisher.publish(weights, step)
        elapsed = time.perf_counter() - t0
        staleness = [
            version - v for s in seqs for v, m in zip(s.versions, s.loss_mask, strict=True) if m
        ]
        rewards = built.rewards
        row = self._emit(
            {
                "step": step,
                "version": step,
                "trajectories": len(built.used),
                "dropped": len(built.dropped),
                # turns the agents never received whole (aborted): recorded, not trained
                "aborted_turns": built.aborted_turns,
                "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
                "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
                "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
                "staleness_max": max(staleness, default=0),
                "tokens": n_tokens,
                "tokens_per_s": n_tokens / elapsed if elapsed > 0 else 0.0,
                "step_seconds": elapsed,
                **stats,
                **critic_stats,
            }
        )
        await self.store.record_step(
            cfg.run, step, version=step, metrics=row, checkpoint=str(saved.resolve())
        )

    async def _with_side_logprobs(self, seqs: list[TrainSequence]) -> list[TrainSequence]:
        cfg, algo = self.cfg, self.algo
        prox = ref = None
        if algo.decoupled:
            prox = await asyncio.to_thread(
                self.backend.forward_logprobs, seqs, cfg.temperature, token_budget=cfg.token_budget
            )
        if algo.kl_coef > 0 and self.reference is not None:
            ref = await asyncio.to_thread(
                self.reference.forward_logprobs,
                seqs,
                cfg.temperature,
                token_budget=cfg.token_budget,
            )
        out = []
        for i, s in enumerate(seqs):
            out.append(
                dataclasses.replace(
                    s,
                    prox_logprobs=prox[i] if prox is not None else None,
                    ref_logprobs=ref[i] if ref is not None else None,
                )
            )
        return out

    # -- reporting ---------------------------------------------------------------------------

    def _emit(self, row: dict[str, Any]) -> dict[str, Any]:
        self.sink.emit(row)
        return row

    def close(self) -> None:
        """Flush and close the metric writers (TensorBoard, W&B)."""
        self.sink.close()


def _explained_variance(seqs: list[TrainSequence]) -> float:
    """Of the critic's old values for the GAE returns, over the batch's sampled tokens."""
    import torch

    mask = [m for s in seqs for m in s.loss_mask]
    values = [v for s in seqs for v in (s.values or [])]
    returns = [r for s in seqs for r in (s.returns or [])]
    ev = explained_variance(
        torch.tensor([values], dtype=torch.float64),
        torch.tensor([returns], dtype=torch.float64),
        torch.tensor([mask], dtype=torch.bool),
    )
    return float(ev)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _share(batch: list[Trajectory] | None) -> list[Trajectory] | None:
    """Rank 0's batch on every rank (a no-op in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return batch
    box: list[Any] = [batch]
    dist.broadcast_object_list(box, src=0)
    shared: list[Trajectory] | None = box[0]
    return shared


def _print_report(row: dict[str, Any]) -> None:
    keys = (
        "reward_mean",
        "loss",
        "approx_kl",
        "value_loss",
        "explained_variance",
        "clip_frac_high",
        "imp_weight_max",
        "staleness_max",
        "tokens_per_s",
    )
    parts = [f"step {row['step']}"] + [
        f"{k} {row[k]:.4g}" for k in keys if isinstance(row.get(k), int | float)
    ]
    print(" | ".join(parts), flush=True)
