"""`build_workflow`: a workflow spec as the object that runs episodes (a registry of the
built-in kinds; `custom` imports the user's class or object)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlgateway.experiment.imports import import_target
from rlgateway.experiment.spec import AgentSpec, CustomSpec, MultiTurnSpec, SingleTurnSpec
from rlgateway.experiment.workflows import AgentProgram, MultiTurn, SingleTurn, Workflow


def _single(spec: Any, base_dir: Path) -> Workflow:
    return SingleTurn(prompt=spec.prompt, system=spec.system)


def _multi(spec: Any, base_dir: Path) -> Workflow:
    return MultiTurn(
        prompt=spec.prompt,
        system=spec.system,
        feedback=spec.feedback,
        max_turns=spec.max_turns,
        solved=spec.solved,
    )


def _agent(spec: Any, base_dir: Path) -> Workflow:
    argv = list(spec.command)
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    argv = [str(base_dir / a) if _is_local_file(base_dir, a) else a for a in argv]
    return AgentProgram(tuple(argv), timeout=spec.timeout, prompt=spec.prompt, env=spec.env)


def _custom(spec: Any, base_dir: Path) -> Workflow:
    target = import_target(spec.target, base_dir=base_dir, what="workflow.target")
    obj = target(**spec.args) if isinstance(target, type) else target
    if spec.args and not isinstance(target, type):
        raise ValueError(f"workflow.args are for a class; {spec.target} is not one")
    if not callable(getattr(obj, "arun_episode", None)):
        raise ValueError(
            f"workflow.target {spec.target} has no `async arun_episode(client, row, episode)`"
        )
    workflow: Workflow = obj
    return workflow


def _is_local_file(base_dir: Path, arg: str) -> bool:
    return not Path(arg).is_absolute() and not arg.startswith("-") and (base_dir / arg).is_file()


WORKFLOWS: dict[type, Callable[[Any, Path], Workflow]] = {
    SingleTurnSpec: _single,
    MultiTurnSpec: _multi,
    AgentSpec: _agent,
    CustomSpec: _custom,
}


def build_workflow(spec: Any, *, base_dir: Path) -> Workflow:
    return WORKFLOWS[type(spec)](spec, base_dir)
