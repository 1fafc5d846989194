"""Reward shaping and filtering before advantages: DAPO's overlong penalty and dynamic sampling.

Legend: N = trajectories, G = groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.algorithms.advantages import group_index


def overlong_shaping(
    reward_N: torch.Tensor,
    length_N: torch.Tensor,
    *,
    max_len: int,
    overlong_buffer: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, AReaL's formula bounded at the penalty it reaches at
    `max_len`: `r + clamp(-(L - (max_len - overlong_buffer)) / overlong_buffer * penalty_factor,
    -penalty_factor, 0)`.

    No penalty up to `max_len - overlong_buffer` tokens, then a linear one reaching
    `-penalty_factor` at `max_len` (the run's max_tokens), and no more beyond it: a response
    longer than the budget (one the gateway did not cap) is punished as one that filled it, not
    without bound. `length_N` is the response length the budget applies to (the sampled tokens
    of the completion).
    """
    if not 0 < overlong_buffer <= max_len:
        raise ValueError(
            f"overlong_buffer must be in (0, max_len={max_len}], got {overlong_buffer}: it is the "
            "number of tokens before max_len over which the penalty grows"
        )
    if reward_N.shape != length_N.shape:
        raise ValueError(f"reward_N {reward_N.shape} and length_N {length_N.shape} differ")
    start = max_len - overlong_buffer
    penalty_N = -(length_N.to(reward_N.dtype) - start) / overlong_buffer * penalty_factor
    return reward_N + penalty_N.clamp(min=-penalty_factor, max=0.0)


def drop_uniform_groups(reward_N: torch.Tensor, group_ids: Sequence[str | None]) -> torch.Tensor:
    """Dynamic sampling (DAPO): a bool keep-mask that drops every group whose rewards are all
    equal (exactly), since its group-baselined advantages are all zero.

    Groups are keyed by id, not by row order; a group of one (every None id) is uniform and is
    dropped, consistent with its zero group advantage.
    """
    if reward_N.ndim != 1 or reward_N.shape[0] != len(group_ids):
        raise ValueError(
            f"reward_N has shape {tuple(reward_N.shape)} but there are {len(group_ids)} group ids"
        )
    g_N, n_groups = group_index(group_ids)
    g_N = g_N.to(reward_N.device)
    r_N = reward_N.detach()
    empty_G = torch.zeros(n_groups, dtype=r_N.dtype, device=r_N.device)
    min_G = empty_G.scatter_reduce(0, g_N, r_N, reduce="amin", include_self=False)
    max_G = empty_G.scatter_reduce(0, g_N, r_N, reduce="amax", include_self=False)
    return (max_G > min_G)[g_N]
