"""A trained policy out of a checkpoint: its weights as a Hugging Face model directory.

A checkpoint (`trainer.checkpoint`) holds the FSDP backend's DCP files of model and optimizer
state under the keys `model.<HF name>` and `optim.*`. `read_weights` loads only the model's
tensors, in the dtype they were saved in, in this process and without a process group: the
optimizer state, twice the model's size under AdamW, is never read. `export` writes them as
`model.safetensors` beside the base model's non-weight files (config, tokenizer, chat template,
generation config), which the checkpoint's meta names, so that transformers and vLLM load the
directory like the base model; and `rlgateway_policy.json` (`engines.policy`) records the policy
version the checkpoint publishes, so that an engine serving the directory samples at that version.

The directory appears whole or not at all: it is written beside `out` and renamed into place.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.policy import PolicyFile
from trainer import checkpoint

if TYPE_CHECKING:
    import torch

MODEL_KEY = "model"
"""The top-level key of the model's state in the backend's DCP files (`FSDPBackend.save`)."""
WEIGHTS_FILE = "model.safetensors"
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".safetensors.index.json",
    ".bin.index.json",
)
"""Base-model files that hold (or index) weights: the export has its own. An index left behind
would point loaders (vLLM filters safetensors files by it) at shards the export does not have."""


class ExportError(ValueError):
    """The source or destination of an export is unusable; the message says what to do."""


def find_checkpoint(source: Path) -> Path:
    """`source` when it is a checkpoint directory, else the newest complete checkpoint under it
    (a run's `checkpoint_dir`)."""
    if not source.exists():
        raise ExportError(
            f"{source} does not exist: give a checkpoint directory (step-NNNNNN) or the run's "
            "checkpoint_dir"
        )
    if checkpoint.is_checkpoint(source):
        return source
    found = checkpoint.latest(source) if source.is_dir() else None
    if found is None:
        raise ExportError(
            f"{source} is not a checkpoint (no {checkpoint.META}) and holds no complete "
            "checkpoint (step-NNNNNN/ with one): give a checkpoint directory or the run's "
            "checkpoint_dir, after the trainer has saved a step"
        )
    return found[0]


def base_model_of(ckpt: Path, model: Path | None = None) -> Path:
    """The model directory whose config and tokenizer go with `ckpt`'s weights: `model` when
    given, else the one the checkpoint records."""
    if model is None:
        recorded = checkpoint.read_meta(ckpt).model
        if recorded is None:
            raise ExportError(
                f"checkpoint {ckpt} does not record its base model (it was written by an older "
                "rlgateway): pass --model DIR, the model directory the run trained"
            )
        model = Path(recorded)
        if not (model / "config.json").is_file():
            raise ExportError(
                f"the base model {model} that checkpoint {ckpt} records is gone (no "
                "config.json there): pass --model DIR, a copy of the model directory the run "
                "trained"
            )
    elif not (model / "config.json").is_file():
        raise ExportError(f"{model} is not a Hugging Face model directory (no config.json)")
    return model


def read_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The policy's full weights in checkpoint `ckpt`: Hugging Face names, the saved dtype, CPU
    (what `TrainBackend.full_state_dict` returned when it was saved). A Megatron backend's
    checkpoint is converted back from its tensor and pipeline shards."""
    import torch

    from trainer.backends.megatron import hf_weights, is_megatron_checkpoint

    if is_megatron_checkpoint(ckpt):
        return hf_weights(ckpt)
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    prefix = MODEL_KEY + "."
    metadata = FileSystemReader(str(ckpt)).read_metadata()
    weights = {
        key.removeprefix(prefix): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not weights:
        raise ExportError(f"checkpoint {ckpt} holds no model weights: was it written by rlgateway?")
    with warnings.catch_warnings():
        # DCP warns that it loads in one process: that is the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load({MODEL_KEY: weights}, checkpoint_id=str(ckpt), no_dist=True)
    return weights


def check_fits(weights: dict[str, torch.Tensor], model_dir: Path) -> None:
    """Raise `ExportError` unless `weights` are exactly the parameters and buffers of the model
    that `model_dir`'s config describes (same names and shapes), i.e. `--model` is the right
    base. The model is built on the meta device: nothing is allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if got == expected:
        return
    differences = {
        "missing": sorted(expected.keys() - got.keys()),
        "unexpected": sorted(got.keys() - expected.keys()),
        "other shapes": sorted(k for k in expected.keys() & got.keys() if expected[k] != got[k]),
    }
    listed = "; ".join(f"{what}: {_some(names)}" for what, names in differences.items() if names)
    raise ExportError(
        f"the checkpoint's weights do not fit the model {model_dir} describes ({listed}): pass "
        "--model DIR, the model directory the run trained"
    )


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def export(ckpt: Path, out: Path, *, model: Path | None = None, force: bool = False) -> PolicyFile:
    """Write checkpoint `ckpt` as a Hugging Face model directory `out` (see the module doc),
    with the base model `base_model_of(ckpt, model)`. `out` must be missing or empty unless
    `force`, which replaces it. Returns the policy file written into it."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory: choose another output directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(
            f"{out} is not empty: choose a new directory, or pass --force to replace it"
        )
    base = base_model_of(ckpt, model)
    meta = checkpoint.read_meta(ckpt)
    weights = read_weights(ckpt)
    check_fits(weights, base)
    policy = PolicyFile(version=meta.policy_version, step=meta.step, source=str(ckpt.resolve()))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        for f in base.iterdir():
            # rlgateway_*.json describe the base directory (a tiny-model build, an earlier
            # export's version), not this one.
            if (
                f.is_file()
                and not f.name.endswith(_WEIGHT_SUFFIXES)
                and not (f.name.startswith("rlgateway_") and f.suffix == ".json")
            ):
                shutil.copyfile(f, tmp / f.name)
        if not (tmp / "generation_config.json").is_file():  # the end ids engines stop at
            config = AutoConfig.from_pretrained(str(base))
            GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
        tensors = {k: v.contiguous() for k, v in weights.items()}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        policy.write(tmp)
        # mkdtemp and safetensors make theirs private; a model directory is meant to be shared.
        tmp.chmod(0o755)
        (tmp / WEIGHTS_FILE).chmod(0o644)
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return policy


def _replace(new: Path, out: Path) -> None:
    """Rename directory `new` to `out`, which is missing, empty or (forced) to be replaced."""
    if out.is_dir() and any(out.iterdir()):
        old = out.with_name(f".{out.name}.replaced")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        new.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.replace(out)  # an empty directory is replaced in one rename
