"""The parallel strategy and its allocation string: what parses, the rule each bad string breaks
(named at config load), the fit to a world and to a model, and what the backends refuse."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from trainer.backends.config import (
    DATA_PARALLEL,
    ArchonBackendConfig,
    FSDPBackendConfig,
    check_implemented,
)
from trainer.config import TrainConfig, validate_config
from trainer.parallel.strategy import (
    Allocation,
    ParallelStrategy,
    parse_allocation,
    validate_for_model,
    validate_world,
)


@pytest.mark.parametrize(
    ("text", "backend", "sizes", "data_fills", "canonical"),
    [
        ("fsdp", "fsdp", {}, True, "fsdp"),
        ("fsdp:d2t2", "fsdp", {"data": 2, "tensor": 2}, False, "fsdp:d2t2"),
        ("fsdp:t2d2", "fsdp", {"data": 2, "tensor": 2}, False, "fsdp:d2t2"),
        ("archon:d2e2", "archon", {"data": 2, "expert": 2}, False, "archon:d2e2"),
        ("fsdp:d2c2", "fsdp", {"data": 2, "context": 2}, False, "fsdp:d2c2"),
        ("megatron:d1t2p2", "megatron", {"tensor": 2, "pipeline": 2}, False, "megatron:d1t2p2"),
        ("megatron:p2t2", "megatron", {"tensor": 2, "pipeline": 2}, True, "megatron:t2p2"),
        ("fsdp:d1", "fsdp", {}, False, "fsdp:d1"),
        ("fsdp:t1", "fsdp", {}, True, "fsdp"),
        ("archon:c2e4", "archon", {"context": 2, "expert": 4}, True, "archon:c2e4"),
        ("fsdp:d16", "fsdp", {"data": 16}, False, "fsdp:d16"),
    ],
)
def test_an_allocation_parses_and_writes_back(
    text: str, backend: str, sizes: dict[str, int], data_fills: bool, canonical: str
) -> None:
    allocation = parse_allocation(text)
    assert allocation.backend == backend
    assert allocation.strategy == ParallelStrategy(**sizes)
    assert allocation.data_fills is data_fills
    assert str(allocation) == canonical
    assert parse_allocation(canonical) == allocation
    assert Allocation.model_validate(text) == allocation  # a config field takes the string


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "names no backend"),
        (":d2", "names no backend"),
        ("fsdp:d2:t2", "more than one ':'"),
        ("deepspeed:d2", "unknown backend 'deepspeed' in 'deepspeed:d2' (known: archon, fsdp, "),
        ("FSDP", "unknown backend 'FSDP'"),
        ("fsdp:", "no sizes after ':'"),
        ("fsdp:2d", "must start with a dimension letter, not '2'"),
        ("fsdp:x2", "unknown dimension 'x' in 'fsdp:x2' (known: d data, t tensor, c context, "),
        ("fsdp:D2", "unknown dimension 'D'"),
        ("fsdp:d2t2d4", "dimension 'd' appears twice in 'fsdp:d2t2d4'"),
        ("fsdp:d", "dimension 'd' in 'fsdp:d' has no size"),
        ("fsdp:dt2", "dimension 'd' in 'fsdp:dt2' has no size"),
        ("fsdp:d0", "the size of 'd' in 'fsdp:d0' is 0: every size is at least 1"),
        ("fsdp:t00", "the size of 't' in 'fsdp:t00' is 0"),
        ("fsdp:d1.5", "the size of 'd' in 'fsdp:d1.5' is '1.5', not a positive integer"),
        ("fsdp:d-1", "is '-1', not a positive integer"),
        ("fsdp:d 2", "is ' 2', not a positive integer"),
        ("fsdp:d2e4", "expert size 4 must divide data x context = 2 (d2e4)"),
        ("archon:d1e2", "expert size 2 must divide data x context = 1"),
    ],
)
def test_a_bad_allocation_names_the_rule_it_breaks(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)) as raised:
        parse_allocation(text)
    assert not isinstance(raised.value, ValidationError)  # the message alone, no pydantic dump
    with pytest.raises(ValueError, match=r"^config: backend: ") as at_load:
        validate_config({"backend": text})
    assert str(at_load.value) == f"config: backend: {raised.value}"


def test_expert_parallelism_adds_no_ranks() -> None:
    assert ParallelStrategy(data=2, tensor=2, context=3, pipeline=5).world_size == 60
    assert ParallelStrategy(data=4, expert=4).world_size == 4
    assert str(ParallelStrategy()) == "d1"
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ParallelStrategy(tensor=0)


@pytest.mark.parametrize(
    ("text", "world", "expected"),
    [
        ("fsdp", 1, ParallelStrategy()),
        ("fsdp", 8, ParallelStrategy(data=8)),
        ("fsdp:t2", 8, ParallelStrategy(data=4, tensor=2)),
        ("megatron:t2p2", 4, ParallelStrategy(tensor=2, pipeline=2)),
        ("archon:c2e4", 4, ParallelStrategy(data=2, context=2, expert=4)),
        ("fsdp:d2c2", 4, ParallelStrategy(data=2, context=2)),
    ],
)
def test_an_allocation_fills_the_world(text: str, world: int, expected: ParallelStrategy) -> None:
    assert parse_allocation(text).for_world(world) == expected
    validate_world(expected, world)


@pytest.mark.parametrize(
    ("text", "world", "fragment"),
    [
        (
            "fsdp:d2",
            1,
            "strategy d2 spans 2 ranks (data x tensor x context x pipeline), but the world has 1",
        ),
        ("fsdp:d2t2", 8, "spans 4 ranks"),
        ("fsdp:t2", 3, "fsdp:t2: 3 ranks do not split into data x 2"),
        ("archon:e3", 4, "expert size 3 must divide data x context = 4 (d4e3)"),
    ],
)
def test_an_allocation_that_does_not_fit_the_world(text: str, world: int, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        parse_allocation(text).for_world(world)


def test_validate_world_checks_the_expert_rule_of_a_built_strategy() -> None:
    with pytest.raises(ValueError, match=r"expert size 2 must divide data x context = 1"):
        validate_world(ParallelStrategy(tensor=2, expert=2), 2)


@pytest.mark.parametrize(
    ("sizes", "heads", "kv_heads", "experts"),
    [
        ({}, 7, 1, None),
        ({"tensor": 2}, 14, 2, None),
        ({"tensor": 2, "context": 2}, 12, 2, None),
        ({"context": 4}, 8, 2, None),  # fewer key-value heads than the group: repeated
        ({"context": 2}, 8, 4, None),
        ({"data": 2, "expert": 2}, 8, 8, 64),
    ],
)
def test_a_model_that_splits(
    sizes: dict[str, int], heads: int, kv_heads: int, experts: int | None
) -> None:
    validate_for_model(
        ParallelStrategy(**sizes),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_experts=experts,
    )


@pytest.mark.parametrize(
    ("sizes", "heads", "kv_heads", "experts", "fragment"),
    [
        ({"tensor": 4}, 14, 2, None, "t4 splits the attention heads, but 14 heads do not divide "),
        ({"tensor": 4}, 16, 2, None, "t4 splits the key-value heads, but 2 key-value heads"),
        (
            {"tensor": 2, "context": 4},
            12,
            2,
            None,
            "12 heads do not divide by tensor x context = 8",
        ),
        ({"context": 4}, 12, 3, None, "each tensor rank's 3 key-value heads"),
        ({"data": 2, "expert": 2}, 8, 8, None, "e2 needs a mixture-of-experts model"),
        ({"data": 4, "expert": 4}, 8, 8, 6, "e4 splits the experts, but 6 experts do not divide"),
    ],
)
def test_a_model_that_does_not_split(
    sizes: dict[str, int], heads: int, kv_heads: int, experts: int | None, fragment: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        validate_for_model(
            ParallelStrategy(**sizes),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            num_experts=experts,
        )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fsdp:c2p2", "fsdp: pipeline parallel is not implemented yet (p2 in 'fsdp:c2p2')"),
        ("fsdp:t2p2", "fsdp: pipeline parallel is not implemented yet (p2 in 'fsdp:t2p2')"),
        ("fsdp:d2p2", "fsdp: pipeline parallel is not implemented yet (p2 in 'fsdp:d2p2')"),
        ("fsdp:d2e2", "fsdp: expert parallel is not implemented yet (e2 in 'fsdp:d2e2')"),
        ("archon:d2t2", "archon: tensor parallel is not implemented yet (t2 in 'archon:d2t2')"),
        ("archon:c2e2", "archon: context parallel is not implemented yet (c2 in 'archon:c2e2')"),
        ("megatron:c2", "megatron: context parallel is not implemented yet (c2 in 'megatron:c2')"),
        (
            "megatron:d2e2",
            "megatron: expert parallel is not implemented yet (e2 in 'megatron:d2e2')",
        ),
    ],
)
def test_what_no_backend_implements_is_refused_at_load(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_implemented(parse_allocation(text))
    with pytest.raises(ValueError, match=f"^{re.escape(f'config: backend: {message}')}$"):
        validate_config({"backend": text})


@pytest.mark.parametrize(
    "text",
    [
        "fsdp",
        "fsdp:d1",
        "fsdp:d8",
        "fsdp:t1",
        "fsdp:t2",
        "fsdp:d2t2",
        "fsdp:t4d2",
        "fsdp:c2",
        "fsdp:d2c2",
        "fsdp:t2c2d2",
    ],
)
def test_data_tensor_and_context_parallel_fsdp_is_accepted(text: str) -> None:
    assert check_implemented(parse_allocation(text)) == parse_allocation(text)
    assert str(validate_config({"backend": text}).backend) == str(parse_allocation(text))


def test_the_run_config_hands_its_allocation_to_the_backend() -> None:
    default = TrainConfig(run="r")
    assert str(default.backend) == "fsdp"
    assert default.backend_config("m").allocation == DATA_PARALLEL == parse_allocation("fsdp")
    # a bare fsdp keeps data parallelism over every rank, however many torchrun starts
    assert all(DATA_PARALLEL.for_world(w) == ParallelStrategy(data=w) for w in (1, 2, 8))
    pinned = TrainConfig(run="r", backend="fsdp:d4").backend_config("m")
    assert pinned.allocation == parse_allocation("fsdp:d4")
    critic = TrainConfig(run="r", backend="fsdp:d4", critic={"lr": 1e-4})
    assert critic.critic_backend_config("m").allocation == pinned.allocation


@pytest.mark.parametrize("text", ["archon", "archon:e2", "archon:d4e2", "archon:d2e1"])
def test_data_and_expert_parallel_archon_is_accepted(text: str) -> None:
    assert check_implemented(parse_allocation(text)) == parse_allocation(text)
    assert str(validate_config({"backend": text}).backend) == str(parse_allocation(text))


def test_the_run_config_builds_the_moe_backend_with_its_settings() -> None:
    section = {"allocation": "archon:e2", "aux_loss_coef": 0.01}
    config = TrainConfig(run="r", backend=section)
    built = config.backend_config("m")
    assert isinstance(built, ArchonBackendConfig)
    assert (built.type, built.aux_loss_coef) == ("archon", 0.01)
    assert built.allocation == parse_allocation("archon:e2")
    critic = config.critic_backend_config("m")
    assert isinstance(critic, ArchonBackendConfig)
    assert critic.aux_loss_coef == 0.01
    assert isinstance(TrainConfig(run="r").backend_config("m"), FSDPBackendConfig)
    # the section with its type, and the spelling of configs stored before it (moe:) read alike
    typed = {"type": "archon", **section}
    assert TrainConfig(run="r", backend=typed).backend == config.backend
    legacy = TrainConfig(run="r", backend="archon:e2", moe={"aux_loss_coef": 0.01})
    assert legacy.backend == config.backend
    # a setting the backend would not read is refused, by name
    with pytest.raises(ValueError, match=r"backend.aux_loss_coef: unknown key \(known here: "):
        validate_config({"backend": {"aux_loss_coef": 0.01}})
    with pytest.raises(ValueError, match=r"backend.aux_loss_coef: unknown key"):
        validate_config({"moe": {"aux_loss_coef": 0.01}})
    with pytest.raises(ValidationError, match="allocation names 'fsdp': use archon"):
        ArchonBackendConfig(model_dir="m", allocation="fsdp")


def test_the_fsdp_config_takes_only_what_fsdp_implements() -> None:
    assert FSDPBackendConfig(model_dir="m", allocation="fsdp:d2").allocation.strategy.data == 2
    with pytest.raises(ValidationError, match="allocation names 'megatron': use fsdp"):
        FSDPBackendConfig(model_dir="m", allocation="megatron:d2")
    assert FSDPBackendConfig(model_dir="m", allocation="fsdp:t2").allocation.strategy.tensor == 2
    assert FSDPBackendConfig(model_dir="m", allocation="fsdp:t2c2").allocation.strategy.context == 2
    with pytest.raises(ValidationError, match=r"context parallel c2 runs Ulysses attention .*"):
        FSDPBackendConfig(model_dir="m", allocation="fsdp:t2c2", attention="sdpa")
    with pytest.raises(ValidationError, match=r"pipeline parallel is not implemented yet"):
        FSDPBackendConfig(model_dir="m", allocation="fsdp:c2p2")


def test_a_context_parallel_run_config_needs_the_varlen_attention() -> None:
    assert str(validate_config({"backend": "fsdp:c2"}).backend) == "fsdp:c2"
    message = "context parallel c2 runs Ulysses attention around the varlen kernel, not 'sdpa'"
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_config({"backend": {"allocation": "fsdp:c2", "attention": "sdpa"}})
    with pytest.raises(ValueError, match=re.escape(message)):  # as configs stored before said it
        validate_config({"backend": "fsdp:c2", "optim": {"attention": "sdpa"}})
    with pytest.raises(ValidationError, match=r"unknown dimension 'q'"):
        FSDPBackendConfig(model_dir="m", allocation="fsdp:q2")


def test_an_allocation_whose_world_sets_data_gives_no_data_size() -> None:
    with pytest.raises(ValidationError, match="data is 2 but data_fills says the world sets it"):
        Allocation(backend="fsdp", strategy=ParallelStrategy(data=2))
    assert Allocation(backend="fsdp", strategy=ParallelStrategy(data=2), data_fills=False) == (
        parse_allocation("fsdp:d2")
    )
