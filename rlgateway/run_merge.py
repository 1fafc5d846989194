"""The run owns its config: a trainer's config is merged with the one stored with its run.

`POST /runs` stores a training config with the run; the gateway admits the run's sessions by it
(`eta`, `batch_size`, `max_concurrent`) and samples by it (`temperature`, `client_sampling`).
A trainer started on the run (`rlgateway train`, `serve --train run=ID`) must train under the
same values, so before it starts:

- a run-owned setting both configs give, with different values, is an error that names both
  (`eta: the run's config says 2, --config says 1`): nothing is trained, nothing is changed;
- a setting only the run's config gives is the run's; one only the trainer's gives is the
  trainer's; "gives" is pydantic's `model_fields_set`, key by key inside nested sections
  (`backend`, `optim`, `critic`) and the `algo` overrides;
- the merged config is written back to the run, with every run-owned setting
  (`store.run_config.RunConfig`) spelled out, so that the gateway enforces the values the trainer
  trains under, defaults included. Settings neither config gives stay out of it: a later trainer
  may still choose them.

The process-owned settings (`trainer.config.ProcessSettings`: identity, leases, polling,
checkpoint cadence, logging, publishing) are the trainer's: a value stored with the run is a
default that the trainer's own replaces, never a conflict. `run` and `database_url` say where
the trainer finds the run: never merged nor stored. `max_steps` says how long to train: a later
trainer's value replaces the run's (a run is extended by starting its trainer again with more
steps; the LR schedule refuses a change where it would alter its curve,
`trainer.backends.update`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from store import Store
from store.run_config import RUN_FIELDS
from store.types import JSON
from trainer.config import PROCESS_OWNED, TrainConfig, check_run_config, validate_config
from trainer.parallel.strategy import Allocation

NOT_MERGED = frozenset({"run", "database_url"})
"""Where the trainer finds its run: neither merged nor stored."""
LATEST_WINS = frozenset({"max_steps"}) | (PROCESS_OWNED - NOT_MERGED)
"""Top-level settings a later trainer's config sets for the run, whatever the run says: how long
to train, and the process's own settings."""


def merge_run_config(stored: JSON, cfg: TrainConfig, *, source: str = "--config") -> TrainConfig:
    """`cfg` with what the run's `stored` config gives; ValueError naming every setting the two
    give different values of, or when `stored` is not a training config."""
    try:
        check_run_config(stored)
    except ValueError as exc:
        raise ValueError(
            f"run {cfg.run}'s stored config is not a training config ({exc}): train another run"
        ) from None
    where = {"run": cfg.run, "database_url": cfg.database_url}
    run_side = TrainConfig.model_validate({**stored, **where})
    conflicts: list[str] = []
    merged = _merge_models(run_side, cfg, "", conflicts, source)
    if conflicts:
        raise ValueError(
            "; ".join(conflicts) + f": the run owns its config, so leave these out of {source} "
            "(the run's values are used) or give the run's values"
        )
    return validate_config({**merged, **where}, f"the run's config with {source}")


def stored_form(cfg: TrainConfig) -> JSON:
    """What the run's config becomes: every setting `cfg` was given, and every run-owned one."""
    given = cfg.model_dump(mode="json", exclude_unset=True, exclude=set(NOT_MERGED))
    owned = cfg.model_dump(mode="json", include=set(RUN_FIELDS))
    return {**given, **owned}


async def adopt_run_config(
    store: Store, cfg: TrainConfig, *, source: str = "--config"
) -> TrainConfig:
    """Merge `cfg` with the stored config of its run (`cfg.run`, which must exist) and store the
    result with the run, validated as `POST /runs` validates; returns the merged config.
    ValueError (see `merge_run_config`) leaves the run as it was."""
    run = await store.get_run(cfg.run)
    merged = merge_run_config(run.config, cfg, source=source)
    form = stored_form(merged)
    check_run_config(form)
    if form != run.config:
        await store.set_run_config(run.id, form)
    return merged


def _merge_models(
    run_side: BaseModel, ours: BaseModel, prefix: str, conflicts: list[str], source: str
) -> dict[str, Any]:
    names = run_side.model_fields_set | ours.model_fields_set
    if not prefix:
        names -= NOT_MERGED
    out: dict[str, Any] = {}
    for name in type(ours).model_fields:
        if name not in names:
            continue
        a, b = getattr(run_side, name), getattr(ours, name)
        if name not in ours.model_fields_set:
            out[name] = _given(a)
        elif name not in run_side.model_fields_set or (not prefix and name in LATEST_WINS):
            out[name] = _given(b)
        else:
            out[name] = _merge_values(a, b, f"{prefix}{name}", conflicts, source)
    return out


def _merge_values(a: Any, b: Any, key: str, conflicts: list[str], source: str) -> Any:
    if isinstance(a, BaseModel) and type(a) is type(b) and not isinstance(a, Allocation):
        return _merge_models(a, b, f"{key}.", conflicts, source)
    if isinstance(a, dict) and isinstance(b, dict):  # the `algo` overrides, knob by knob
        return {
            k: _merge_values(a[k], b[k], f"{key}.{k}", conflicts, source)
            if k in a and k in b
            else _given(a[k] if k in a else b[k])
            for k in {**a, **b}
        }
    if _given(a) != _given(b):
        conflicts.append(f"{key}: the run's config says {_show(a)}, {source} says {_show(b)}")
    return _given(a)


def _given(value: Any) -> Any:
    """`value` as JSON, a nested section with only the keys it was given (an allocation is one
    value, written as its string)."""
    if isinstance(value, Allocation):
        return str(value)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_unset=True)
    return to_jsonable_python(value)


def _show(value: Any) -> str:
    given = _given(value)
    return given if isinstance(given, str) else json.dumps(given)
