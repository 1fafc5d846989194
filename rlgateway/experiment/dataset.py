"""A user's dataset: read once, checked whole, then handed out row by row in seeded epochs.

`load(spec)` reads the train (and eval) rows into plain dicts before anything starts, so every
mistake a user makes in the spec or the file (a missing file, a column the mapping names but the
file lacks, a required field no row has, an empty split) is one `DatasetError` naming the file,
the field and what is there. Formats: JSONL (a JSON object per line), CSV (a header row), Parquet,
and a directory written by Hugging Face `datasets`' `save_to_disk` (a `Dataset`, or a
`DatasetDict` whose splits the spec picks by name). Parquet is read with pyarrow (what `datasets`
reads it with, without the copy `Dataset.from_parquet` writes to its cache), `save_to_disk`
directories with `datasets.load_from_disk`; both are imported only when such a file is read.

`fields` renames: the name the workflow and the reward read -> the file's column; a column the
mapping does not name passes through under its own name. A mapped name wins over a column that
happens to share it.

Evaluation rows come from, in order: `eval_path` (a second file), `eval_split` (another split of
a `DatasetDict`), or `eval_size` rows held out of the train rows (a seeded sample); otherwise
there are none.

`DataStream` hands the train rows out one at a time, epoch after epoch, each epoch in the order of
a permutation seeded by `(seed, epoch)`. Its `position` (epoch, rows of that epoch handed out) is
all a checkpoint needs to continue exactly: the same rows, in the same order, none repeated and
none skipped.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

Row = dict[str, Any]

FORMATS = (".jsonl", ".parquet", ".csv")
"""File suffixes `load` reads; a directory is read as `save_to_disk` output."""


class DatasetError(ValueError):
    """A mistake in the dataset spec or its files; the message names the file and what to fix."""


class DatasetSpec(BaseModel):
    """Where the rows are and how to read them (module docstring)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    path: str
    """The train rows: a `.jsonl`, `.parquet` or `.csv` file, or a `save_to_disk` directory.
    Relative to the spec file's folder."""
    eval_path: str | None = None
    """A separate file (or `save_to_disk` directory) of eval rows."""
    split: str | None = None
    """The split of a `DatasetDict` directory to train on (unset: `train`)."""
    eval_split: str | None = None
    """The split of a `DatasetDict` directory to evaluate on (`test`); of `eval_path` when that is
    set, else of `path`."""
    eval_size: int = Field(0, ge=0)
    """Hold out this many train rows (a sample seeded by `seed`) as eval rows, when neither
    `eval_path` nor `eval_split` is set."""
    fields: dict[str, str] = Field(default_factory=dict)
    """The name a workflow or reward reads -> the file's column (`{prompt: question}`);
    unmapped columns pass through under their own names."""
    required: list[str] = Field(default_factory=lambda: ["prompt"])
    """Names every row must have (after mapping), with a value that is not null."""
    seed: int = 0
    """Seeds the shuffle, the held-out sample and every epoch's order."""
    shuffle: bool = True
    """Shuffle the train rows (once at load, and again each epoch)."""
    limit: int | None = Field(None, ge=1)
    """Train on the first N rows after shuffling (smoke runs)."""

    @model_validator(mode="after")
    def _one_eval_source(self) -> DatasetSpec:
        if self.eval_size and (self.eval_path is not None or self.eval_split is not None):
            raise ValueError(
                "eval_size holds eval rows out of the train rows; with eval_path or eval_split "
                "the eval rows are already given: set one of them, not both"
            )
        return self


@dataclass(frozen=True)
class Splits:
    """The rows `load` read, as plain dicts after the field mapping. `train` is never empty;
    `eval` is empty only when the spec asks for no eval rows."""

    train: list[Row]
    eval: list[Row]


def load(spec: DatasetSpec, *, base_dir: Path | None = None) -> Splits:
    """Read and check the spec's rows (module docstring). Relative paths resolve against
    `base_dir` (the spec file's folder; unset: the working directory). Raises `DatasetError`."""
    train_source = _Source(_resolve(spec.path, base_dir))
    train_label = train_source.label(spec.split or "train")
    train = _rows(train_source, spec.split, default="train", key="split")
    _check_not_empty(train_label, train, "train")
    train = _mapped(train, spec, train_label)

    eval_source: _Source | None = None
    if spec.eval_path is not None:
        eval_source = _Source(_resolve(spec.eval_path, base_dir))
    elif spec.eval_split is not None:
        if not train_source.is_dict:
            raise DatasetError(
                f"eval_split names a split of a DatasetDict directory, but {train_source.path} "
                "is a single table: drop eval_split and set eval_path or eval_size"
            )
        eval_source = train_source
    eval_rows: list[Row] = []
    if eval_source is not None:
        eval_label = eval_source.label(spec.eval_split)
        eval_rows = _rows(eval_source, spec.eval_split, default=None, key="eval_split")
        _check_not_empty(eval_label, eval_rows, "eval")
        eval_rows = _mapped(eval_rows, spec, eval_label)

    order = list(range(len(train)))
    random.Random(spec.seed).shuffle(order)
    if spec.eval_size:
        if spec.eval_size >= len(train):
            raise DatasetError(
                f"eval_size {spec.eval_size} would hold out every row of {train_label}, which "
                f"has {len(train)}: set eval_size below {len(train)}"
            )
        eval_rows = [train[i] for i in order[: spec.eval_size]]
        order = order[spec.eval_size :]
    if not spec.shuffle:
        order.sort()
    return Splits(train=[train[i] for i in order][: spec.limit], eval=eval_rows)


class Cursor(BaseModel):
    """A position in a `DataStream`: the epoch, and how many of its rows were handed out."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    epoch: int = Field(0, ge=0)
    """Epochs completed before this one."""
    index: int = Field(0, ge=0)
    """Rows of this epoch already handed out (the next row is the epoch's `index`-th)."""


class DataStream:
    """The train rows, epoch after epoch: epoch `e` in the order of a permutation drawn from
    `random.Random(f"{seed}:{e}")` (the file order when `shuffle` is false). Deterministic, so a
    stream started at a saved `position` continues exactly where the saved one stopped."""

    def __init__(
        self,
        rows: Sequence[Row],
        *,
        seed: int,
        shuffle: bool = True,
        start: Cursor | None = None,
    ) -> None:
        if not rows:
            raise DatasetError("a data stream needs at least one row")
        start = start or Cursor()
        if start.index >= len(rows):
            raise DatasetError(
                f"the saved data position (epoch {start.epoch}, row {start.index}) is past the "
                f"end of the dataset's {len(rows)} rows: the dataset changed since the checkpoint"
            )
        self._rows = rows
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = start.epoch
        self._index = start.index
        self._order = self._order_of(self._epoch)

    def next(self) -> tuple[Cursor, Row]:
        """The next row (a shallow copy) and the position it was handed out at."""
        at = self.position
        row = dict(self._rows[self._order[self._index]])
        self._index += 1
        if self._index == len(self._rows):
            self._epoch += 1
            self._index = 0
            self._order = self._order_of(self._epoch)
        return at, row

    @property
    def position(self) -> Cursor:
        """Where the next row comes from: what a checkpoint saves, and `start` resumes from."""
        return Cursor(epoch=self._epoch, index=self._index)

    @property
    def epoch(self) -> int:
        """The epoch the next row belongs to (0 first)."""
        return self._epoch

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self._rows)))
        if self._shuffle:
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order


def _resolve(path: str, base_dir: Path | None) -> Path:
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = (base_dir or Path.cwd()) / p
    if not p.exists():
        raise DatasetError(f"dataset file not found: {p}")
    return p


class _Source:
    """One path `load` reads: a file, or a `save_to_disk` directory (a Dataset or DatasetDict)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.is_dict = False
        if path.is_dir():
            self.is_dict = (path / "dataset_dict.json").is_file()
            if not self.is_dict and not (path / "state.json").is_file():
                raise DatasetError(
                    f"{path} is a directory but not one written by datasets' save_to_disk "
                    "(it has neither dataset_dict.json nor state.json)"
                )
        elif path.suffix not in FORMATS:
            raise DatasetError(
                f"unknown dataset format {path.suffix or '(no suffix)'!r} of {path}: use a "
                f"{', '.join(FORMATS)} file or a directory written by datasets' save_to_disk"
            )

    def label(self, split: str | None) -> str:
        return f"split {split!r} of {self.path}" if self.is_dict and split else str(self.path)


def _rows(source: _Source, split: str | None, *, default: str | None, key: str) -> list[Row]:
    path = source.path
    if not source.is_dict and split is not None:
        raise DatasetError(
            f"{key} {split!r} names a split of a DatasetDict directory, but {path} is a single "
            f"table: drop {key}"
        )
    if path.is_dir():
        return _read_disk(path, split or default, key)
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".csv":
        return _read_csv(path)
    # `datasets`' own reader, without the cache copy `Dataset.from_parquet` writes
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    return [dict(row) for row in pq.read_table(path).to_pylist()]


def _read_jsonl(path: Path) -> list[Row]:
    rows: list[Row] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            line = line.rstrip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{path} line {number} is not valid JSON: {exc.msg} (column {exc.colno})"
                ) from None
            if not isinstance(row, dict):
                raise DatasetError(
                    f"{path} line {number} is a JSON {type(row).__name__}, not an object: each "
                    'line of a JSONL dataset is one row, {"column": value, ...}'
                )
            rows.append(row)
    return rows


def _read_csv(path: Path) -> list[Row]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        rows: list[Row] = []
        for row in reader:
            if None in row:
                raise DatasetError(
                    f"{path} line {reader.line_num} has more cells than the header has columns"
                )
            rows.append(dict(row))
    return rows


def _read_disk(path: Path, split: str | None, key: str) -> list[Row]:
    import datasets  # type: ignore[import-untyped]

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            raise DatasetError(
                f"{path} is a DatasetDict: set {key} to one of its splits ({', '.join(loaded)})"
            )
        if split not in loaded:
            raise DatasetError(
                f"{path} has no split {split!r} ({key}): its splits are {', '.join(loaded)}"
            )
        loaded = loaded[split]
    return [dict(row) for row in loaded.to_list()]


def _check_not_empty(label: str, rows: list[Row], role: str) -> None:
    if not rows:
        raise DatasetError(f"the {role} split is empty: {label} has no rows")


def _mapped(rows: list[Row], spec: DatasetSpec, label: str) -> list[Row]:
    """Rename the mapped columns and check the required fields, for every row."""
    columns = list(dict.fromkeys(c for row in rows for c in row))
    for name, column in spec.fields.items():
        if column not in columns:
            raise DatasetError(
                f"fields maps {name!r} to column {column!r}, which {label} does not have; "
                f"its columns: {', '.join(columns)}"
            )
    renamed = set(spec.fields.values())
    out: list[Row] = []
    for number, row in enumerate(rows, start=1):
        mapped = {c: v for c, v in row.items() if c not in renamed}
        for name, column in spec.fields.items():
            if column not in row:
                raise DatasetError(
                    f"row {number} of {label} has no column {column!r} (mapped to {name!r}); "
                    f"its columns: {', '.join(row)}"
                )
            mapped[name] = row[column]
        out.append(mapped)
    for name in spec.required:
        missing = [i for i, row in enumerate(out, start=1) if row.get(name) is None]
        if len(missing) == len(out):
            raise DatasetError(
                f"required field {name!r} is not in {label}: map it to one of its columns "
                f"with `fields: {{{name}: COLUMN}}`; its columns: {', '.join(columns)}"
            )
        if missing:
            shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
            raise DatasetError(
                f"required field {name!r} is missing or null in {len(missing)} of the {len(out)} "
                f"rows of {label} (rows {shown})"
            )
    return out
