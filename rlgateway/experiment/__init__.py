"""The experiment API: datasets, reward functions and workflows as decoupled parts, tied by one
spec and run through the gateway (`rlgateway run SPEC.yaml`, or `Experiment` from Python)."""

from rlgateway.experiment.dataset import Cursor, DatasetSpec, DataStream, Splits
from rlgateway.experiment.rewards import RewardOutcome, RewardRunner
from rlgateway.experiment.runner import Experiment
from rlgateway.experiment.spec import ExperimentSpec, load_spec, parse_spec
from rlgateway.experiment.workflows import (
    AgentProgram,
    Episode,
    MultiTurn,
    Rewards,
    SingleTurn,
    Workflow,
)

__all__ = [
    "AgentProgram",
    "Cursor",
    "DataStream",
    "DatasetSpec",
    "Episode",
    "Experiment",
    "ExperimentSpec",
    "MultiTurn",
    "RewardOutcome",
    "RewardRunner",
    "Rewards",
    "SingleTurn",
    "Splits",
    "Workflow",
    "load_spec",
    "parse_spec",
]
