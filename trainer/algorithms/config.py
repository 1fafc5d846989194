"""Algorithm configuration: one model of every knob, and named algorithms as presets over it.

The pipeline these knobs describe (the trainer applies it in this order, as AReaL does):

1. shaping: no task reward for a turn `max_tokens` cut (`zero_truncated_reward`), DAPO
   overlong penalty (`overlong_buffer`), dynamic sampling (`dynamic_sampling`);
2. per-trajectory baseline against its group (`group_baseline`);
3. token advantages: GAE with a critic (`use_critic`, `lam`), otherwise the discounted
   reward-to-go (GAE with V = 0, lam = 1); a KL penalty goes into the token rewards when
   `kl_placement` is "reward". The discount is the run's one per-turn `discount` (a run
   setting, not a knob here): 1 between the tokens of a turn, `discount` from one turn to the
   next, for the returns, GAE and the KL reward-to-go alike;
4. batch normalisation of the advantages (`adv_norm`);
5. the update: the batch in `ppo_n_minibatches` mini-batches (split by `ppo_minibatch_split`),
   one optimizer step each, for `ppo_epochs` passes;
6. the loss: PPO clip (`eps_low`, `eps_high`, `dual_clip_c`), decoupled (`decoupled`), the
   engine/trainer mismatch correction of its behaviour weight (`behav_imp_weight_cap`,
   `behav_imp_weight_mode`), token or sequence ratio (`importance_level`), aggregation (`agg`),
   KL to a reference (`kl_coef`, `kl_kind`) and an entropy bonus (`entropy_coef`).

Preset values follow AReaL's algorithm matrix and example YAMLs (examples/math/gsm8k_*.yaml); the
exceptions are noted beside each preset. Every example uses the decoupled loss with the cap at 5
and clips at 0.4 except DAPO, so the presets do too; the field defaults (0.2) are AReaL's code
defaults and PPO's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.algorithms.kinds import AggMode, BehavWeightMode, GroupMode, ImportanceLevel, KLKind


class AlgorithmConfig(BaseModel):
    """Every knob of the advantage and loss computation; build one with `algorithm_config`."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    group_baseline: GroupMode = "mean_std"
    """Per-group reward baseline: mean_std (GRPO), mean (Dr.GRPO), leave_one_out (RLOO), none."""
    adv_norm: Literal["batch", "none"] = "batch"
    """Normalise token advantages over the batch's sampled tokens (mean 0, unbiased std 1)."""
    norm_eps: float = Field(default=1e-5, gt=0)
    """eps added to every std divisor (AReaL's default)."""
    use_critic: bool = False
    """Train a value model and use GAE (PPO); otherwise V = 0."""
    lam: float = Field(default=1.0, ge=0, le=1)
    """GAE lambda (used only with a critic)."""
    value_clip: float | None = Field(default=0.5, gt=0)
    """Critic value clip around the old values (AReaL's critic eps_clip); None: no clip."""

    eps_low: float = Field(default=0.2, ge=0, lt=1)
    """PPO clip below: the ratio is clipped at 1 - eps_low."""
    eps_high: float = Field(default=0.2, ge=0)
    """PPO clip above: 1 + eps_high (DAPO's clip-higher sets it above eps_low)."""
    dual_clip_c: float | None = Field(default=None, gt=1)
    """Dual clip: cap the loss of negative-advantage tokens at c * |A| (c > 1); None: off."""
    decoupled: bool = True
    """Decoupled PPO (AReaL): ratio against recomputed proximal logprobs, weighted by
    pi_prox / pi_behaviour; needs one extra forward pass per step."""
    behav_imp_weight_cap: float | None = 5.0
    """Decoupled only: the bound c > 1 on w = pi_prox / pi_behaviour; None: w applied uncapped."""
    behav_imp_weight_mode: BehavWeightMode = "mask"
    """How the cap corrects w (one bound for all three): mask drops tokens with w > c (MIS,
    AReaL's), truncate uses min(w, c) (TIS), icepop drops tokens with w outside [1/c, c]."""
    importance_level: ImportanceLevel = "token"
    """Ratio per token (PPO) or per sequence as the geometric mean (GSPO)."""
    agg: AggMode = "token_mean"
    """How per-token losses become one number (see trainer.algorithms.losses)."""
    norm_len: int | None = Field(default=None, ge=1)
    """The constant length seq_mean_token_sum divides each sequence's sum by (e.g. max_tokens)."""

    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL to the reference model; 0 means no reference model is needed."""
    kl_kind: KLKind = "k3"
    """KL estimator: k1 = d, k2 = d^2/2, k3 = exp(-d) - 1 + d, with d = logp - ref_logp."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """Add the KL as a loss term, or subtract it from the token rewards (AReaL, REINFORCE++)."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus (subtracted from the loss); 0: off."""

    ppo_n_minibatches: int = Field(default=4, ge=1)
    """Mini-batches per batch (AReaL's name and default): the proximal logprobs are computed once
    per batch, then one optimizer step per mini-batch, so from the second mini-batch on the
    policy has moved away from the proximal one and the clip binds. A batch of fewer sequences
    has one mini-batch per sequence."""
    ppo_minibatch_split: Literal["auto", "sequences", "prefixes"] = "auto"
    """How the batch's sequences go into its mini-batches (shuffled, each to the mini-batch with
    the fewest tokens so far): `sequences` one by one; `prefixes` the sequences that begin with
    the same prompt (`trainer.prefix.prefix_units`: a GRPO group, a multi-turn group's episodes)
    together, so that a backend packing prefix-shared trees (`backend.prefix_sharing`) runs
    each prompt once per mini-batch and not once per sequence scattered over them; auto:
    `prefixes` where the backend packs trees, else `sequences`."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over the batch's mini-batches per step (each pass steps once per mini-batch)."""

    overlong_buffer: int | None = Field(default=None, ge=1)
    """DAPO overlong shaping: penalise the last this many tokens before max_tokens; None: off."""
    overlong_penalty_factor: float = Field(default=1.0, ge=0)
    """The overlong penalty reached at max_tokens."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal."""
    zero_truncated_reward: bool = False
    """AReaL's `mask_no_eos_with_zero`: a turn whose sampling `max_tokens` (or the context) cut
    (finish reason `length`) earns no task reward, whatever its grader gave; the final reward
    counts as 0 too when the last turn was cut. Applied first: shaping and dynamic sampling see
    the rewards without them."""

    # -- what the algorithm needs: the loop builds and runs only these -------------------------

    @property
    def needs_reference(self) -> bool:
        """A reference model (the initial policy) and its logprobs every step: a KL term."""
        return self.kl_coef > 0

    @property
    def needs_proximal(self) -> bool:
        """Proximal logprobs recomputed with the current weights before the update (decoupled)."""
        return self.decoupled

    @property
    def kl_in_reward(self) -> bool:
        return self.kl_coef > 0 and self.kl_placement == "reward"

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_coef > 0 and self.kl_placement == "loss"

    @property
    def entropy_mode(self) -> Literal["metric", "loss"]:
        """The policy's entropy is always measured; it is differentiated only for a bonus."""
        return "loss" if self.entropy_coef > 0 else "metric"

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        cap, mode = self.behav_imp_weight_cap, self.behav_imp_weight_mode
        if cap is not None and cap <= 1:
            raise ValueError(
                f"behav_imp_weight_cap={cap} is not above 1: it bounds w = pi_prox / "
                "pi_behaviour, which is 1 on policy, so it would mask or truncate tokens the "
                "engine and trainer agree on: set it above 1 (AReaL uses 5.0), or to null to "
                "apply w uncapped"
            )
        if mode != "mask" and cap is None:
            raise ValueError(
                f"behav_imp_weight_mode={mode} needs the bound it applies: set "
                "behav_imp_weight_cap (e.g. 5.0)"
            )
        if mode != "mask" and not self.decoupled:
            raise ValueError(
                f"behav_imp_weight_mode={mode} corrects the decoupled loss's behaviour weight: "
                "set decoupled=true, or leave the mode at mask"
            )
        if self.agg == "seq_mean_token_sum" and self.norm_len is None:
            raise ValueError(
                "agg=seq_mean_token_sum divides each sequence's loss sum by a constant: set "
                "norm_len (e.g. the run's max_tokens)"
            )
        return self


PRESETS: dict[str, AlgorithmConfig] = {
    # gsm8k_ppo.yaml: critic with eps_clip 0.5, GAE with AReaL's default lam = 1 (the discount is
    # the run's per-turn `discount`, 1 by default as AReaL's).
    "ppo": AlgorithmConfig(group_baseline="none", use_critic=True, eps_low=0.4, eps_high=0.4),
    # Matrix: group mean/std reward norm, batch adv norm, decoupled + cap 5, eps_clip 0.4.
    "grpo": AlgorithmConfig(group_baseline="mean_std", eps_low=0.4, eps_high=0.4),
    # Matrix: clip 0.2 / 0.28, overlong penalty 512 tokens factor 1.0, dynamic sampling, no KL.
    "dapo": AlgorithmConfig(
        group_baseline="mean_std",
        eps_low=0.2,
        eps_high=0.28,
        overlong_buffer=512,
        overlong_penalty_factor=1.0,
        dynamic_sampling=True,
        kl_coef=0.0,
    ),
    # Matrix: group leave-one-out mean, no std.
    "rloo": AlgorithmConfig(group_baseline="leave_one_out", eps_low=0.4, eps_high=0.4),
    # Matrix: as GRPO with a sequence-level ratio. The clip is the GSPO paper's 3e-4 / 4e-4 (a
    # geometric-mean ratio moves far less than a token's); AReaL's example keeps 0.4.
    "gspo": AlgorithmConfig(
        group_baseline="mean_std", importance_level="sequence", eps_low=3e-4, eps_high=4e-4
    ),
    # Matrix: group mean, no std; AReaL's global token mean already drops GRPO's 1/|o|. For the
    # paper's exact constant-length form set agg=seq_mean_token_sum and norm_len=max_tokens.
    "dr_grpo": AlgorithmConfig(group_baseline="mean", eps_low=0.4, eps_high=0.4),
    # gsm8k_reinforce.yaml: no reward norm, k1 KL at 0.001 in the token rewards, batch adv norm.
    "reinforce_pp": AlgorithmConfig(
        group_baseline="none",
        kl_coef=0.001,
        kl_kind="k1",
        kl_placement="reward",
        eps_low=0.4,
        eps_high=0.4,
    ),
}


def algorithm_config(name: str, **overrides: Any) -> AlgorithmConfig:
    """The named preset with `overrides` applied (any field); validated as a whole."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm {name!r}: choose one of {', '.join(PRESETS)}")
    return AlgorithmConfig.model_validate({**PRESETS[name].model_dump(), **overrides})
