"""The names an algorithm's settings choose among, torch-free: `config.py` validates a run's
`algo` section with them without importing the tensor math they select."""

from __future__ import annotations

from typing import Literal

GroupMode = Literal["mean", "mean_std", "leave_one_out", "none"]
"""How a group's rewards become a baseline (`advantages.group_baseline`)."""
AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum"]
"""How token losses reduce to one number (`aggregation.aggregate`)."""
KLKind = Literal["k1", "k2", "k3"]
ImportanceLevel = Literal["token", "sequence"]
BehavWeightMode = Literal["mask", "truncate", "icepop"]
