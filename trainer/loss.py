"""The loss callbacks the backends call per packed micro-batch, built from an AlgorithmConfig:
the policy's (`make_loss_fn`) and the critic's (`make_value_loss_fn`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from trainer.algorithms.aggregation import aggregate
from trainer.algorithms.config import AlgorithmConfig
from trainer.algorithms.losses import kl_penalty, ppo_policy_loss, value_loss
from trainer.backends.base import LossFn
from trainer.batch import MicroBatch


def make_loss_fn(algo: AlgorithmConfig) -> LossFn:
    """PPO-family policy loss (decoupled with its behaviour weight masked, truncated or
    IcePop-masked at the cap, clip-higher, dual clip, token or sequence ratio), plus
    `kl_coef * KL(current || reference)` when the KL is placed in the loss, minus
    `entropy_coef * entropy` when an entropy bonus is set; every term aggregated by `algo.agg`.
    Stats: the policy loss's, `entropy` (mean over trained tokens, whenever the backend computes
    it), `kl_ref` with a KL loss term, and `neg_logp` (the mean -logp of the trained tokens)."""

    def agg(x_1T: torch.Tensor, mb: MicroBatch, normalizer: float) -> torch.Tensor:
        return aggregate(
            x_1T,
            mb.loss_mask_1T,
            algo.agg,
            norm_len=algo.norm_len,
            normalizer=normalizer,
            seq_index_BT=mb.seq_index_1T,
        )

    def loss_fn(
        logp_1T: torch.Tensor, mb: MicroBatch, normalizer: float, entropy_1T: torch.Tensor | None
    ) -> tuple[torch.Tensor, Mapping[str, float]]:
        mask = mb.loss_mask_1T
        n = mask.sum().clamp(min=1)
        if algo.decoupled:
            assert mb.prox_logp_1T is not None, "decoupled PPO needs proximal logprobs"
            old = mb.prox_logp_1T
        else:
            old = mb.behav_logp_1T
        loss, stats = ppo_policy_loss(
            logp_1T,
            old,
            mb.advantages_1T,
            mask,
            eps_low=algo.eps_low,
            eps_high=algo.eps_high,
            dual_clip_c=algo.dual_clip_c,
            behav_logp_BT=mb.behav_logp_1T if algo.decoupled else None,
            behav_imp_weight_cap=algo.behav_imp_weight_cap if algo.decoupled else None,
            behav_imp_weight_mode=algo.behav_imp_weight_mode,
            level=algo.importance_level,
            agg=algo.agg,
            norm_len=algo.norm_len,
            normalizer=normalizer,
            seq_index_BT=mb.seq_index_1T,
        )
        out = {k: float(v) for k, v in stats.items()}
        if algo.kl_in_loss:
            assert mb.ref_logp_1T is not None, "a KL loss needs reference logprobs"
            kl_1T = kl_penalty(logp_1T, mb.ref_logp_1T, algo.kl_kind)
            loss = loss + algo.kl_coef * agg(kl_1T, mb, normalizer)
            out["kl_ref"] = float((kl_1T.detach() * mask).sum() / n)
        if entropy_1T is not None:
            if algo.entropy_coef > 0:
                loss = loss - algo.entropy_coef * agg(entropy_1T, mb, normalizer)
            out["entropy"] = float((entropy_1T.detach() * mask).sum() / n)
        out["neg_logp"] = float(-(logp_1T.detach() * mask).sum() / n)
        return loss, out

    return loss_fn


def make_value_loss_fn(algo: AlgorithmConfig) -> LossFn:
    """The clipped PPO value loss (`value_loss`, clip `algo.value_clip`) of the critic's values
    against the GAE returns, aggregated like the policy loss (`algo.agg`, same normaliser)."""

    def loss_fn(
        values_1T: torch.Tensor, mb: MicroBatch, normalizer: float, entropy_1T: torch.Tensor | None
    ) -> tuple[torch.Tensor, Mapping[str, float]]:
        missing = "the value loss needs old values and returns (trainer.sequences.with_gae)"
        assert mb.old_values_1T is not None, missing
        assert mb.returns_1T is not None, missing
        loss, stats = value_loss(
            values_1T,
            mb.old_values_1T,
            mb.returns_1T,
            mb.loss_mask_1T,
            value_clip=algo.value_clip,
            agg=algo.agg,
            norm_len=algo.norm_len,
            normalizer=normalizer,
            seq_index_BT=mb.seq_index_1T,
        )
        return loss, {k: float(v) for k, v in stats.items()}

    return loss_fn
