"""The asynchronous training loop: claim, filter, advantages, mini-batch updates, checkpoint,
publish.

One step (`_step`; the math is `update`, which touches neither the store nor the engines):
1. claim at least `batch_size` finished, rewarded trajectories of the run (whole GRPO groups when
   `partial_groups` is wait), under a lease that is renewed while the step runs;
2. drop (settle at step -1) those with a token older than `eta` versions, and uniform groups under
   dynamic sampling;
3. build training sequences (`trainer.sequences`: each token at the temperature that sampled it,
   untrainable turns left out of the loss) with their turns' values against the group baseline;
4. recompute proximal logprobs (decoupled PPO) and reference logprobs (a KL term) with no grad,
   once per batch;
5. token advantages: the KL penalty in the reward, then GAE with the critic's values (PPO) or
   the reward-to-go, then batch normalisation;
6. `ppo_epochs` passes over `ppo_n_minibatches` mini-batches, one optimizer step each (and one of
   the critic), so from the second mini-batch on the policy has moved away from the proximal one
   and the clip binds;
7. every `checkpoint_every` steps a checkpoint (with the trained session ids); mark them consumed;
   publish the weights as the next policy version.

The algorithm declares what it needs (`AlgorithmConfig.needs_reference`, `needs_proximal`,
`use_critic`, `entropy_mode`); the loop runs only that. Generation never waits for training:
agents keep running against the gateway, whose admission control keeps them within `eta`
versions of the policy being trained.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store import NotFoundError, Store
from store.types import Outcome, RunStatus, Trajectory
from trainer import checkpoint, lineage
from trainer.algorithms.aggregation import loss_normalizer
from trainer.algorithms.losses import explained_variance, logprob_mismatch
from trainer.backends.base import TrainBackend, ValueBackend
from trainer.batch import TrainSequence, split_minibatches
from trainer.config import TrainConfig
from trainer.loss import make_loss_fn, make_value_loss_fn
from trainer.prefix import minibatch_units
from trainer.publish import WeightPublisher
from trainer.report import MetricsSink
from trainer.sequences import (
    Built,
    build_sequences,
    kl_token_rewards,
    with_advantages,
    with_gae,
)
from trainer.stats import merge_stats
from trainer.torch_thread import on_torch_thread
from trainer.weights import ShardedWeights, serve_weight_passes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Update:
    """What one step's math did (`Trainer.update`)."""

    built: Built
    sequences: list[TrainSequence]
    """The trained sequences with their final advantages (and proximal/reference logprobs);
    empty when every trajectory was filtered out (then nothing was trained)."""
    stats: dict[str, float]
    """Merged over the step's optimizer steps (`merge_update_stats`)."""


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
        self.owner = owner or cfg.trainer_id or f"trainer:{cfg.run}"
        """Who leases the sessions this trainer takes: stable per run, so a restarted trainer
        takes back its own leases at once (`resume`)."""
        self.lineage = lineage.Lineage()
        """Which weights each version number names (`trainer.lineage`): staleness is counted
        in steps along it."""
        self._idle_checked = -math.inf
        """When `_end_idle` last looked (monotonic seconds)."""
        self.settled = Counter[str]()
        """Sessions settled while collecting since the last metrics row (incomplete,
        orphaned), by outcome: reported with the next row."""
        self.loss_fn = make_loss_fn(self.algo)
        self.value_loss_fn = make_value_loss_fn(self.algo)
        self.root = Path(cfg.checkpoint_dir)
        self.metrics_path = self.root / "metrics.jsonl"
        self.is_leader = _rank() == 0
        self.sink = MetricsSink(cfg, self.root, report or _print_report)
        self.step = 0
        """Training steps taken (each is `ppo_epochs` x mini-batches optimizer steps)."""
        self.version = 0
        """The policy version of the current weights: the newest this trainer published (or the
        engines served when it started); the next step publishes `version + 1`."""
        if self.algo.needs_reference and reference is None:
            raise ValueError("kl_coef > 0 needs a reference model: pass `reference`")
        if self.algo.use_critic and critic is None:
            raise ValueError(
                f"algorithm {cfg.algorithm!r} trains a critic (use_critic): pass `critic` "
                "(trainer.backends.registry.build_value_backend)"
            )

    # -- lifecycle ---------------------------------------------------------------------------

    async def resume(self) -> int:
        """Load the newest checkpoint (if any), settle its sessions and put those of later, lost
        steps back in the queue, take back this trainer's own leases, then bring the engines to
        this trainer's weights.

        Against a live gateway: republishing the version the engines serve is a no-op; if they
        serve a newer version (steps after the newest checkpoint, or before the first one, were
        published, then lost), the checkpoint's weights (or the initial ones) are published as
        the version after it, an alias in the run's lineage (`trainer.lineage`), so versions
        only grow and staleness still counts steps. Returns the step."""
        found = checkpoint.latest(self.root)
        if found is not None:
            path, meta = found
            await on_torch_thread(self.backend.load, path)
            if self.critic is not None and self.algo.use_critic:
                await on_torch_thread(checkpoint.load_critic, path, self.critic)
            self.step, self.version = meta.step, meta.policy_version
        if not self.is_leader:
            serve_weight_passes(self.backend)  # rank 0's republish below reads them from all
            return self.step
        with ShardedWeights(self.backend) as weights:
            await self._republish(found, weights)
        if found is not None:
            log.info("resumed from %s at step %d, version %d", found[0], self.step, self.version)
        return self.step

    async def _republish(
        self, found: tuple[Path, checkpoint.CheckpointMeta] | None, weights: ShardedWeights
    ) -> None:
        """Rank 0 of `resume`: settle the checkpoint's sessions, requeue the lost steps', take
        back this trainer's leases, then bring the engines to this trainer's weights
        (`resume`'s docstring)."""
        run = self.cfg.run
        step = 0
        if found is not None:
            _, meta = found
            step = meta.step
            await self.store.settle_consumed(meta.consumed, step=meta.step)
            for outcome, ids in _by_outcome(meta.dropped).items():
                await self.store.settle_consumed(ids, step=-1, outcome=outcome)
        requeued = await self.store.requeue_after(run, step=step)
        if requeued:
            log.info("%d sessions trained after step %d go back to the queue", requeued, step)
        taken_back = await self.store.release_owner(run, self.owner)
        if taken_back:
            log.info(
                "%d sessions this trainer (%s) held go back to the queue", taken_back, self.owner
            )
        kept = lineage.load(self.root)
        served = await self.publisher.served() if self.publisher is not None else None
        if kept is None:
            kept = lineage.Lineage(start=served if found is None and served is not None else 0)
            await on_torch_thread(lineage.save, self.root, kept)
        self.lineage = kept
        if found is None:
            self.version = kept.start
        if self.publisher is None or served is None or served == self.version:
            return
        target = self.version
        if served > self.version:
            target = served + 1
            self.lineage.alias(target, self.version)
            await on_torch_thread(lineage.save, self.root, self.lineage)
        self.version = await self.publisher.publish(weights, target)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Train until `max_steps` (or `stop` is set). Under torchrun every rank runs this: rank 0
        talks to the store and the engines, and hands each batch to the other ranks."""
        while self.step < self.cfg.max_steps:
            if stop is not None and stop.is_set():
                return
            claimed = await self._collect(stop) if self.is_leader else None
            claimed = _share(claimed)
            if claimed is None:
                return
            await self._step(claimed)

    # -- one step ----------------------------------------------------------------------------

    async def _collect(self, stop: asyncio.Event | None) -> Claimed | None:
        """Rank 0: wait for a batch of whole ready groups (`Store.claim_groups`), ending idle
        sessions and settling groups past their deadline on the way; stale tokens are masked
        (or, with `stale_tokens: drop`, their trajectories settled as stale)."""
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
            ended, orphaned = await self._end_idle()
            if ended:
                log.warning(
                    "%d sessions idle for %.0f s were never ended: ended them (%d without a "
                    "reward settled as orphaned)",
                    len(ended),
                    cfg.session_idle_seconds,
                    len(orphaned),
                )
                self.settled[Outcome.ORPHANED] += len(orphaned)
            claim = await self.store.claim_groups(
                cfg.run,
                batch_size=cfg.batch_size,
                group_size=cfg.group_size,
                partial_groups=cfg.partial_groups,
                deadline_seconds=cfg.group_deadline_seconds,
                owner=self.owner,
                lease_seconds=cfg.lease_seconds,
                gamma=cfg.discount,
            )
            if claim.incomplete:
                log.warning(
                    "%d sessions of groups short of group_size %d at their deadline were "
                    "dropped (partial_groups: drop)",
                    len(claim.incomplete),
                    cfg.group_size,
                )
                self.settled[Outcome.INCOMPLETE] += len(claim.incomplete)
            batch = claim.trajectories
            stale_versions = frozenset(
                v
                for v in {v for t in batch for seg in t.segments for v in seg.versions}
                if v >= 0 and self.lineage.age(v, self.version) > cfg.eta
            )
            if cfg.stale_tokens == "drop" and stale_versions:
                stale = [t for t in batch if _sampled_versions(t) & stale_versions]
                await self.store.settle_consumed(
                    [t.session.id for t in stale], step=-1, outcome=Outcome.STALE
                )
                log.warning(
                    "%d trajectories held tokens more than eta=%d steps old: settled as stale "
                    "(stale_tokens: drop; mask would train their fresh tokens)",
                    len(stale),
                    cfg.eta,
                )
                self.settled[Outcome.STALE] += len(stale)
                batch = [t for t in batch if t not in stale]
                stale_versions = frozenset()
            if batch:
                return Claimed(batch, stale_versions)
            await asyncio.sleep(cfg.poll_seconds)

    async def _end_idle(self) -> tuple[list[str], list[str]]:
        """`Store.end_idle`, at most every tenth of `session_idle_seconds` (it writes: polling
        it as often as the queue would take the store's write lock every poll)."""
        now = time.monotonic()
        if now < self._idle_checked + self.cfg.session_idle_seconds / 10:
            return [], []
        self._idle_checked = now
        return await self.store.end_idle(self.cfg.run, idle_seconds=self.cfg.session_idle_seconds)

    async def _run_status(self) -> RunStatus | None:
        """The run's status as the operator set it (None once the run is deleted)."""
        try:
            return RunStatus((await self.store.get_run(self.cfg.run)).status)
        except NotFoundError:
            return None

    async def _step(self, claimed: Claimed) -> None:
        t0 = time.perf_counter()
        batch = claimed.trajectories
        ids = [t.session.id for t in batch]
        async with self._leased(ids):
            version = self.version
            done = await self.update(batch, claimed.stale_versions)
            if not done.sequences:  # nothing trainable: no new version, but never in silence
                if self.is_leader:
                    await self._settle_dropped(done.built)
                    row = self._emit(
                        {"step": self.step, "version": self.version, "trained": 0}
                        | self._outcome_counts(done.built)
                    )
                    log.warning(
                        "a batch of %d trajectories had nothing to train (%s): no step taken",
                        len(batch),
                        ", ".join(
                            f"{k} {v}" for k, v in row.items() if k.startswith("outcome_") and v
                        ),
                    )
                return
            await self._commit(done, version, t0)

    async def update(
        self, batch: list[Trajectory], stale_versions: frozenset[int] = frozenset()
    ) -> Update:
        """One step's math on `batch`, on every rank: sequences (tokens of `stale_versions`
        left out of the loss), proximal and reference logprobs, advantages, then the
        mini-batch optimizer steps. Touches neither the store, the checkpoints nor the
        engines."""
        cfg = self.cfg
        built = build_sequences(
            batch,
            self.algo,
            max_tokens=cfg.max_tokens,
            discount=cfg.discount,
            temperature=cfg.temperature,
            fresh=(lambda v: v not in stale_versions) if stale_versions else None,
        )
        if not built.sequences:
            return Update(built, [], {})
        seqs = await self._with_side_logprobs(built.sequences)
        mismatch = self._mismatch(seqs)
        seqs, constrained = self._constrained(seqs)
        seqs, adv_stats = await self._advantages(built, seqs)
        stats = await self._optimize(seqs)
        return Update(built, seqs, adv_stats | mismatch | constrained | stats)

    def _mismatch(self, seqs: list[TrainSequence]) -> dict[str, float]:
        """The engine-vs-trainer logprob mismatch on the trained tokens sampled by the weights
        being trained (the proximal logprobs are theirs): `mismatch_*` and how many tokens."""
        import torch

        if not self.algo.needs_proximal:
            return {}
        age = _ages(self.lineage, seqs, self.version)
        rows = [
            (p, b)
            for s in seqs
            for p, b, v, m, c in zip(
                s.prox_logprobs or [],
                s.behav_logprobs,
                s.versions,
                s.loss_mask,
                s.constrained or [False] * len(s),
                strict=False,
            )
            if m and v >= 0 and age[v] == 0 and not c
        ]
        out = {"mismatch_tokens": float(len(rows))}
        if rows:
            prox, behav = (
                torch.tensor([r[k] for r in rows], dtype=torch.float64)[None] for k in (0, 1)
            )
            stats = logprob_mismatch(prox, behav, torch.ones_like(prox, dtype=torch.bool))
            out |= {k: float(v) for k, v in stats.items()}
        return out

    def _constrained(
        self, seqs: list[TrainSequence]
    ) -> tuple[list[TrainSequence], dict[str, float]]:
        """Tokens sampled under a grammar take the proximal logprob as their behaviour logprob
        (`store.run_config`, "Constrained turns"): `constrained_tokens` of them, and the mean
        log Z (recorded minus proximal logprob, negated) of those the trained weights sampled."""
        if not any(s.constrained for s in seqs):
            return seqs, {}
        age = _ages(self.lineage, seqs, self.version)
        out, count, mass = [], 0, []
        for s in seqs:
            if not s.constrained:
                out.append(s)
                continue
            assert s.prox_logprobs is not None
            behav = list(s.behav_logprobs)
            for t, (c, m) in enumerate(zip(s.constrained, s.loss_mask, strict=True)):
                if c and m:
                    count += 1
                    if s.versions[t] >= 0 and age[s.versions[t]] == 0:
                        mass.append(s.prox_logprobs[t] - behav[t])
                    behav[t] = s.prox_logprobs[t]
            out.append(dataclasses.replace(s, behav_logprobs=behav))
        stats = {"constrained_tokens": float(count)}
        if mass:
            stats["constrained_log_mass"] = sum(mass) / len(mass)
        return out, stats

    async def _with_side_logprobs(self, seqs: list[TrainSequence]) -> list[TrainSequence]:
        """Proximal (the current weights) and reference logprobs, as the algorithm needs them
        (proximal ones too for a batch with constrained tokens, `_constrained`)."""
        cfg, algo = self.cfg, self.algo
        prox = ref = None
        if algo.needs_proximal or any(s.constrained for s in seqs):
            prox = await on_torch_thread(
                self.backend.forward_logprobs, seqs, cfg.temperature, token_budget=cfg.token_budget
            )
        if algo.needs_reference:
            assert self.reference is not None
            ref = await on_torch_thread(
                self.reference.forward_logprobs,
                seqs,
                cfg.temperature,
                token_budget=cfg.token_budget,
            )
        return [
            dataclasses.replace(
                s,
                prox_logprobs=prox[i] if prox is not None else None,
                ref_logprobs=ref[i] if ref is not None else None,
            )
            for i, s in enumerate(seqs)
        ]

    async def _advantages(
        self, built: Built, seqs: list[TrainSequence]
    ) -> tuple[list[TrainSequence], dict[str, float]]:
        """KL in the reward, then GAE (critic) or the reward-to-go, then normalisation."""
        algo, stats = self.algo, {}
        kl = None
        if algo.kl_in_reward:
            ref = [s.ref_logprobs or [] for s in seqs]
            kl, stats["kl_ref"] = kl_token_rewards(seqs, ref, algo)
        if not algo.use_critic:
            return with_advantages(seqs, algo, kl, built.discounts), stats
        assert self.critic is not None
        assert built.token_rewards is not None
        values = await on_torch_thread(
            self.critic.forward_values, seqs, token_budget=self.cfg.token_budget
        )
        seqs = with_gae(seqs, built.token_rewards, values, algo, kl, built.discounts)
        stats["explained_variance"] = _explained_variance(seqs)
        return seqs, stats

    async def _optimize(self, seqs: list[TrainSequence]) -> dict[str, float]:
        """`ppo_epochs` passes over the mini-batches, one optimizer step of the policy (and of
        the critic) each; the LR schedule advances once, after the last."""
        cfg, algo = self.cfg, self.algo
        # Each epoch its own split, seeded alike on every rank, so mini-batches mix anew.
        units = minibatch_units(
            seqs, algo.ppo_minibatch_split, algo.ppo_n_minibatches, trees=cfg.backend.packs_trees
        )
        lengths = [len(s) for s in seqs]
        epochs = [
            split_minibatches(
                lengths,
                algo.ppo_n_minibatches,
                seed=f"{cfg.optim.seed}:{self.step}:{e}",
                units=units,
            )
            for e in range(algo.ppo_epochs)
        ]
        parts = epochs[0]
        updates: list[tuple[int, dict[str, float]]] = []
        total = algo.ppo_epochs * len(parts)
        for k in range(total):
            chosen = [seqs[i] for i in epochs[k // len(parts)][k % len(parts)]]
            n_tokens = sum(s.num_loss_tokens for s in chosen)
            norm = loss_normalizer(algo.agg, num_tokens=n_tokens, num_seqs=len(chosen))
            last = k == total - 1
            stats = await on_torch_thread(
                self.backend.train_step,
                chosen,
                self.loss_fn,
                temperature=cfg.temperature,
                token_budget=cfg.token_budget,
                global_norm=norm,
                entropy=algo.entropy_mode,
                step_schedule=last,
            )
            if self.critic is not None and algo.use_critic:
                value = await on_torch_thread(
                    self.critic.train_step,
                    chosen,
                    self.value_loss_fn,
                    temperature=cfg.temperature,
                    token_budget=cfg.token_budget,
                    global_norm=norm,
                    step_schedule=last,
                )
                stats |= {
                    "value_loss": value.pop("loss"),
                    "critic_grad_norm": value.pop("grad_norm"),
                    "critic_lr": value.pop("lr"),
                    # the critic's own stats; one the policy reports too is the critic's by name
                    # (an MoE critic's router statistics: critic_moe_balance_loss)
                    **{(f"critic_{k}" if k in stats else k): v for k, v in value.items()},
                }
            updates.append((n_tokens, stats))
        return merge_update_stats(updates) | {"minibatches": float(len(parts))}

    @contextlib.asynccontextmanager
    async def _leased(self, ids: list[str]) -> AsyncIterator[None]:
        """Renew the lease of the step's sessions every third of `lease_seconds` while the step
        runs (leader only), so a step longer than the lease keeps its claim."""
        if not self.is_leader:
            yield
            return

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.cfg.lease_seconds / 3)
                await self.store.renew(ids, owner=self.owner, lease_seconds=self.cfg.lease_seconds)

        task = asyncio.create_task(renew(), name="rlgateway-lease")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _settle_dropped(self, built: Built) -> None:
        """Rank 0: the batch's trajectories left out, each with its outcome, at step -1."""
        for outcome, ids in _by_outcome(_dropped_outcomes(built)).items():
            await self.store.mark_consumed(ids, owner=self.owner, step=-1, outcome=outcome)

    def _outcome_counts(self, built: Built) -> dict[str, Any]:
        """The outcome counts of a metrics row: this batch's, and the sessions settled while
        collecting it (reset here)."""
        counts = {
            "outcome_trained": len(built.used),
            "outcome_filtered": len(built.filtered),
            "outcome_untrainable": len(built.untrainable),
            "outcome_stale": len(built.stale) + self.settled[Outcome.STALE],
            "outcome_incomplete": self.settled[Outcome.INCOMPLETE],
            "outcome_orphaned": self.settled[Outcome.ORPHANED],
            "stale_tokens": built.stale_tokens,
            "untrainable_turns": built.untrainable_turns,
            "aborted_turns": built.aborted_turns,
            "side_turns": built.side_turns,
            "truncated_turns": built.truncated_turns,
        }
        self.settled.clear()
        return counts

    async def _commit(self, done: Update, version: int, t0: float) -> None:
        """Checkpoint (every `checkpoint_every` steps and at the last), mark the sessions
        consumed, publish the next version, record the step (with the seconds of its parts:
        the update's math, the checkpoint, the publish)."""
        update_s = time.perf_counter() - t0  # the step began at t0 and its update just ended
        cfg, backend, built = self.cfg, self.backend, done.built
        self.step += 1
        step, new_version = self.step, self.version + 1
        used = [t.session.id for t in built.used]
        dropped = _dropped_outcomes(built)
        saved, checkpoint_s, publish_s = None, 0.0, 0.0
        t_checkpoint = time.perf_counter()
        if step % cfg.checkpoint_every == 0 or step >= cfg.max_steps:
            saved = await on_torch_thread(
                checkpoint.save,
                self.root,
                backend,
                checkpoint.CheckpointMeta(step, used, dropped, version=new_version),
                keep=cfg.keep_checkpoints,
                is_writer=self.is_leader,
                critic=self.critic if self.algo.use_critic else None,
            )
            checkpoint_s = time.perf_counter() - t_checkpoint
        self.version = new_version
        if not self.is_leader:
            serve_weight_passes(backend)  # the publisher on rank 0 reads the weights from all
            return
        with ShardedWeights(backend) as weights:
            await self.store.mark_consumed(used, owner=self.owner, step=step)
            await self._settle_dropped(built)
            if self.publisher is not None:
                t_publish = time.perf_counter()
                self.version = await self.publisher.publish(weights, new_version)
                publish_s = time.perf_counter() - t_publish
        elapsed = time.perf_counter() - t0
        seqs = done.sequences
        n_tokens = sum(s.num_loss_tokens for s in seqs)
        age = _ages(self.lineage, seqs, version)
        staleness = [
            age[v] for s in seqs for v, m in zip(s.versions, s.loss_mask, strict=True) if m
        ]
        rewards = built.rewards
        row = self._emit(
            {
                "step": step,
                "version": self.version,
                "trajectories": len(built.used),
                "dropped": len(built.dropped),
                **self._outcome_counts(built),
                "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
                "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
                "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
                "staleness_max": max(staleness, default=0),
                "tokens": n_tokens,
                "tokens_per_s": n_tokens / elapsed if elapsed > 0 else 0.0,
                "step_seconds": elapsed,
                "update_seconds": update_s,
                "checkpoint_seconds": checkpoint_s,
                "publish_seconds": publish_s,
                **done.stats,
            }
        )
        await self.store.record_step(
            cfg.run,
            step,
            version=self.version,
            metrics=row,
            checkpoint=str(saved.resolve()) if saved is not None else None,
        )

    # -- reporting ---------------------------------------------------------------------------

    def _emit(self, row: dict[str, Any]) -> dict[str, Any]:
        self.sink.emit(row)
        return row

    def close(self) -> None:
        """Flush and close the metric writers (TensorBoard, W&B)."""
        self.sink.close()


@dataclass(frozen=True, slots=True)
class Claimed:
    """A batch as rank 0 hands it to every rank: the trajectories, and the policy versions
    whose tokens are too old to train (left out of the loss, `stale_tokens: mask`)."""

    trajectories: list[Trajectory]
    stale_versions: frozenset[int] = frozenset()


def _ages(tree: lineage.Lineage, seqs: list[TrainSequence], current: int) -> dict[int, int]:
    """Steps from each version that sampled a trained token to `current`: one walk of the
    lineage per distinct version, not per token."""
    versions = {v for s in seqs for v, m in zip(s.versions, s.loss_mask, strict=True) if m}
    return {v: tree.age(v, current) for v in versions}


def _sampled_versions(t: Trajectory) -> set[int]:
    return {v for seg in t.segments for v, m in zip(seg.versions, seg.loss_mask, strict=True) if m}


def _dropped_outcomes(built: Built) -> dict[str, str]:
    """Session id -> outcome of every trajectory of the batch left out."""
    return (
        {t.session.id: Outcome.FILTERED.value for t in built.filtered}
        | {t.session.id: Outcome.UNTRAINABLE.value for t in built.untrainable}
        | {t.session.id: Outcome.STALE.value for t in built.stale}
    )


def _by_outcome(dropped: dict[str, str]) -> dict[Outcome, list[str]]:
    out: dict[Outcome, list[str]] = defaultdict(list)
    for sid, outcome in dropped.items():
        out[Outcome(outcome)].append(sid)
    return dict(out)


def merge_update_stats(updates: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """One step's stats from its optimizer steps' (`trainer.stats.merge_stats`, weighted by
    trained tokens): `loss` and the grad norms their means (and `grad_norm_max`), `lr` the first
    (the schedule advances once per step)."""
    if not updates:
        return {}
    out = merge_stats(
        updates,
        averaged={"loss", "grad_norm", "value_loss", "critic_grad_norm"},
        first={"lr", "critic_lr"},
    )
    norms = [stats["grad_norm"] for _, stats in updates if "grad_norm" in stats]
    if norms:
        out["grad_norm_max"] = max(norms) if all(math.isfinite(x) for x in norms) else math.inf
    return out


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


def _share(batch: Claimed | None) -> Claimed | None:
    """Rank 0's batch on every rank (a no-op in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return batch
    box: list[Any] = [batch]
    dist.broadcast_object_list(box, src=0)
    shared: Claimed | None = box[0]
    return shared


def _print_report(row: dict[str, Any]) -> None:
    keys = (
        "reward_mean",
        "loss",
        "entropy",
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
