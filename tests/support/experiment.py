"""What the experiment tests share: a spec on the tiny model over rows a test writes, the
user parts it names (`experiment_files/parts.py`: graders that raise, hang or answer on the
second try; `agent.py`: an agent program), and readers of a finished run's outputs (its
metrics, the sessions its SQLite store recorded, the data rows answered)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import yaml

FILES = Path(__file__).resolve().parent / "experiment_files"
"""The user parts experiment specs in tests name: `parts.py` (graders), `agent.py`."""


def write_spec(folder: Path, rows: list[dict[str, Any]], **over: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "eval.jsonl").write_text(
        "".join(json.dumps({"q": f"eval {i}", "mode": "ok"}) + "\n" for i in range(3))
    )
    spec: dict[str, Any] = {
        "name": "exp",
        "model": "tiny",
        "dataset": {
            "path": "rows.jsonl",
            "eval_path": "eval.jsonl",
            "fields": {"prompt": "q"},
            "seed": 7,
        },
        "workflow": {"type": "single_turn", "prompt": "{prompt}"},
        "reward": {"fn": str(FILES / "parts.py") + ":even_length", "timeout": 1.0},
        "train": {
            "group_size": 2,
            "batch_size": 4,
            "max_steps": 2,
            "max_tokens": 6,
            "optim": {"lr": 1e-3},
        },
        "concurrency": 2,
        "eval": {"every": 1},
    }
    for key, value in over.items():
        spec[key] = value if not isinstance(value, dict) else {**spec.get(key, {}), **value}
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def store_sessions(out: Path, run_id: str) -> list[dict[str, Any]]:
    with sqlite3.connect(out / "store.db") as db:
        db.row_factory = sqlite3.Row
        rows = db.execute(
            "SELECT id, group_id, metadata, ended_at, outcome, failure FROM sessions "
            "WHERE run_id = ? ORDER BY created_at",
            (run_id,),
        )
        return [dict(r) | {"metadata": json.loads(r["metadata"])} for r in rows]


def open_sessions(out: Path, run_id: str) -> list[str]:
    with sqlite3.connect(out / "store.db") as db:
        q = "SELECT id FROM sessions WHERE run_id = ? AND ended_at IS NULL"
        return [r[0] for r in db.execute(q, (run_id,))]


def trained_steps(out: Path, run_id: str) -> int:
    """The steps the run's trainer has recorded in the store."""
    with sqlite3.connect(out / "store.db") as db:
        q = "SELECT COUNT(*) FROM train_steps WHERE run_id = ?"
        return int(db.execute(q, (run_id,)).fetchone()[0])


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def answered_rows(out: Path) -> list[tuple[int, int]]:
    """(epoch, index) of each group that got an answer, in creation order."""
    state = json.loads((out / "experiment.json").read_text())
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in store_sessions(out, state["run_id"]):
        groups.setdefault(s["group_id"], []).append(s)
    return [
        (g[0]["metadata"]["epoch"], g[0]["metadata"]["index"])
        for g in groups.values()
        if any(s["ended_at"] is not None and s["outcome"] != "failed" for s in g)
    ]
