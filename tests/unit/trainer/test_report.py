"""Per-step metrics: metrics.jsonl always, W&B when the run config has a `wandb` section (real
wandb in offline mode, its run file read back), and a clear error when wandb is missing."""

from __future__ import annotations

import json
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainer.config import TrainConfig, load_config
from trainer.report import MetricsSink


def wandb_records(path: Path) -> Iterator[bytes]:
    """Records of a W&B run file: a 7-byte header, then the LevelDB log format (32 KiB blocks of
    chunks with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # end, or a record still being written
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            yield pending


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    from wandb.proto import wandb_internal_pb2 as pb

    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = []
    for raw in wandb_records(run_file):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
    return rows


@pytest.mark.slow
def test_metrics_go_to_jsonl_and_wandb_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["run=run-1", "tensorboard=false", "wandb.mode=offline"])
    assert cfg.wandb is not None
    assert cfg.wandb.project == "rlgateway"
    reported: list[dict[str, Any]] = []
    sink = MetricsSink(cfg, tmp_path, reported.append)
    rows = [
        {"step": 1, "loss": 0.5, "value_loss": 2.0, "trajectories": 8},
        {"step": 2, "loss": 0.25, "value_loss": 1.5, "trajectories": 8},
    ]
    for row in rows:
        sink.emit(row)
    sink.close()
    assert reported == rows
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == rows
    deadline = time.monotonic() + 30
    history = wandb_history(tmp_path)
    while len(history) < len(rows) and time.monotonic() < deadline:
        time.sleep(0.1)  # wandb's service process may still be writing the run file
        history = wandb_history(tmp_path)
    assert [(h["_step"], h["train/loss"], h["train/value_loss"]) for h in history] == [
        (1, 0.5, 2.0),
        (2, 0.25, 1.5),
    ]


def test_wandb_configured_but_not_installed_says_how_to_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets without it
    cfg = TrainConfig.model_validate({"run": "r", "wandb": {"project": "p"}})
    with pytest.raises(ValueError, match="pip install wandb"):
        MetricsSink(cfg, tmp_path, print)
    MetricsSink(TrainConfig(run="r"), tmp_path, print)  # no wandb section: no wandb needed


def test_wandb_section_validates() -> None:
    assert TrainConfig().wandb is None
    with pytest.raises(ValueError, match=r"wandb\.mode"):
        load_config(None, ["wandb.mode=cloud"])
