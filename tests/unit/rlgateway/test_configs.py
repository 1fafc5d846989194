"""The checked-in run configs under configs/: each loads, means what its name says, and the
demo's is what `rlgateway demo` really trains with, so none goes stale."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlgateway.cli import build_parser
from rlgateway.commands.demo import demo_options
from rlgateway.demo.run import train_config
from tests.support.paths import REPO_ROOT
from trainer.algorithms.config import PRESETS, algorithm_config
from trainer.config import TrainConfig, load_config

ROOT = REPO_ROOT
CONFIGS = ROOT / "configs"
PLACED = {"run", "database_url", "model", "checkpoint_dir"}
"""Fields a command fills in itself (the demo from --out; train from the command line)."""


def test_every_preset_has_a_config_and_every_config_is_known() -> None:
    names = {p.stem for p in CONFIGS.glob("*.yaml")}
    assert names == set(PRESETS) | {"demo", "separate-trainer"}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_preset_config_loads_as_its_algorithm(preset: str) -> None:
    cfg = load_config(CONFIGS / f"{preset}.yaml", ["run=r"])
    assert cfg.algorithm == preset
    expected = algorithm_config(preset, **cfg.algo)
    if cfg.max_tokens is not None:
        expected = expected.model_copy(update={"norm_len": cfg.max_tokens})
    assert cfg.algorithm_config() == expected
    if PRESETS[preset].group_baseline != "none":
        assert cfg.group_size > 1, "a group baseline needs groups"
    assert cfg.batch_size % cfg.group_size == 0


def test_the_demo_config_is_what_the_demo_trains_with() -> None:
    options = demo_options(build_parser().parse_args(["demo"]))
    demo = train_config(options, "", "sqlite:///x")
    checked_in = load_config(CONFIGS / "demo.yaml")
    assert demo.model_dump(exclude=PLACED) == checked_in.model_dump(exclude=PLACED)


def test_the_demo_config_changes_with_the_demo_flags() -> None:
    options = demo_options(build_parser().parse_args(["demo", "--algorithm", "dapo", "eta=3"]))
    demo = train_config(options, "", "sqlite:///x")
    checked_in = load_config(CONFIGS / "demo.yaml")
    assert (demo.algorithm, demo.eta) == ("dapo", 3)
    assert demo.model_dump(exclude=PLACED) != checked_in.model_dump(exclude=PLACED)


def test_the_separate_trainer_example_names_its_store_and_needs_a_run() -> None:
    cfg = load_config(CONFIGS / "separate-trainer.yaml", ["run=abc"])
    assert cfg.database_url.startswith("postgresql://")
    assert isinstance(cfg, TrainConfig)
    assert load_config(CONFIGS / "separate-trainer.yaml").run == ""  # train refuses that


def test_validating_every_config_imports_no_torch() -> None:
    """A bad config fails before anything heavy loads: `rlgateway train --config` and `POST
    /runs` validate without torch (the algorithm presets' names live in
    `trainer/algorithms/kinds.py`; the tensor math loads on first use)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from trainer.config import load_config\n"
        f"for path in sorted(Path({str(CONFIGS)!r}).glob('*.yaml')):\n"
        "    load_config(path, ['run=r']).algorithm_config()\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
