"""The experiment's dataset: every format read to the same rows, the field mapping, the splits,
each mistake's message as the user sees it, and the seeded, resumable epoch stream."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rlgateway.experiment.dataset import (
    Cursor,
    DatasetError,
    DatasetSpec,
    DataStream,
    Splits,
    load,
)

ROWS = [
    {"question": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3} for i in range(10)
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_disk(path: Path, splits: dict[str, list[dict[str, Any]]] | list[dict[str, Any]]) -> Path:
    import datasets

    def table(rows: list[dict[str, Any]]) -> Any:
        return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in ROWS[0]})

    if isinstance(splits, list):
        table(splits).save_to_disk(str(path))
    else:
        datasets.DatasetDict({name: table(rows) for name, rows in splits.items()}).save_to_disk(
            str(path)
        )
    return path


def spec(path: str | Path, **kw: Any) -> DatasetSpec:
    kw.setdefault("fields", {"prompt": "question"})
    return DatasetSpec(path=str(path), **kw)


def by_prompt(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: r["prompt"])


EXPECTED = by_prompt(
    [{"prompt": r["question"], "answer": r["answer"], "level": r["level"]} for r in ROWS]
)


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet, write_disk])
def test_every_typed_format_reads_the_same_rows(tmp_path: Path, writer: Any) -> None:
    suffix = {write_jsonl: ".jsonl", write_parquet: ".parquet", write_disk: ""}[writer]
    path = writer(tmp_path / f"data{suffix}", ROWS)
    splits = load(spec(path))
    assert isinstance(splits, Splits)
    assert by_prompt(splits.train) == EXPECTED
    assert splits.eval == []
    assert all(type(row) is dict for row in splits.train)


def test_csv_reads_every_cell_as_text(tmp_path: Path) -> None:
    splits = load(spec(write_csv(tmp_path / "data.csv", ROWS)))
    assert by_prompt(splits.train) == [{**r, "level": str(r["level"])} for r in EXPECTED]


def test_a_datasetdict_directory_gives_train_and_eval_splits(tmp_path: Path) -> None:
    path = write_disk(tmp_path / "gsm", {"train": ROWS[:7], "test": ROWS[7:]})
    splits = load(spec(path, eval_split="test"))
    assert {r["prompt"] for r in splits.train} == {r["question"] for r in ROWS[:7]}
    assert {r["prompt"] for r in splits.eval} == {r["question"] for r in ROWS[7:]}
    # another split as train
    assert len(load(spec(path, split="test")).train) == 3


def test_a_separate_eval_file(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", ROWS[:6])
    write_csv(tmp_path / "eval.csv", ROWS[6:])
    splits = load(spec("train.jsonl", eval_path="eval.csv"), base_dir=tmp_path)
    assert len(splits.train) == 6
    assert by_prompt(splits.eval) == [{**r, "level": str(r["level"])} for r in EXPECTED[6:]]


def test_relative_paths_resolve_against_base_dir(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "rows.jsonl", ROWS)
    assert len(load(spec("data/rows.jsonl"), base_dir=tmp_path).train) == 10


def test_fields_rename_and_unmapped_columns_pass_through(tmp_path: Path) -> None:
    rows = [{"q": "one", "a": "1", "prompt": "shadowed", "extra": [1, 2]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    [row] = load(spec(path, fields={"prompt": "q", "answer": "a"})).train
    # the mapped name wins over a column of the same name; renamed columns are not kept twice
    assert row == {"prompt": "one", "answer": "1", "extra": [1, 2]}


def test_one_column_may_feed_two_names(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "x"}])
    [row] = load(spec(path, fields={"prompt": "q", "question": "q"})).train
    assert row == {"prompt": "x", "question": "x"}


def test_eval_size_holds_out_a_seeded_sample(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    a = load(spec(path, eval_size=3, seed=1))
    assert len(a.train) == 7
    assert len(a.eval) == 3
    assert by_prompt(a.train + a.eval) == EXPECTED
    assert load(spec(path, eval_size=3, seed=1)) == a
    assert load(spec(path, eval_size=3, seed=2)).eval != a.eval
    # without shuffling the train rows keep the file's order; the held-out sample is the same
    b = load(spec(path, eval_size=3, seed=1, shuffle=False))
    assert b.eval == a.eval
    assert [r["prompt"] for r in b.train] == [
        r["question"] for r in ROWS if r["question"] not in {e["prompt"] for e in a.eval}
    ]


def test_shuffle_is_seeded_and_limit_takes_the_first_rows_after_it(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    in_order = [r["question"] for r in ROWS]
    first = [r["prompt"] for r in load(spec(path, seed=3)).train]
    assert first == [r["prompt"] for r in load(spec(path, seed=3)).train]
    assert first != in_order
    assert sorted(first) == sorted(in_order)
    assert [r["prompt"] for r in load(spec(path, shuffle=False)).train] == in_order
    assert [r["prompt"] for r in load(spec(path, seed=3, limit=4)).train] == first[:4]
    assert len(load(spec(path, limit=100)).train) == 10


# --- the mistakes a user makes, as the user reads them ------------------------------------------


def error(tmp_path: Path, s: DatasetSpec) -> str:
    with pytest.raises(DatasetError) as info:
        load(s, base_dir=tmp_path)
    return str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    assert error(tmp_path, spec("nope.jsonl")) == f"dataset file not found: {tmp_path}/nope.jsonl"
    write_jsonl(tmp_path / "t.jsonl", ROWS)
    message = error(tmp_path, spec("t.jsonl", eval_path="gone.parquet"))
    assert message == f"dataset file not found: {tmp_path}/gone.parquet"


def test_unknown_format(tmp_path: Path) -> None:
    (tmp_path / "d.json").write_text("[]")
    message = error(tmp_path, spec("d.json"))
    assert message.startswith(f"unknown dataset format '.json' of {tmp_path}/d.json: use a ")
    assert ".jsonl, .parquet, .csv" in message
    (tmp_path / "folder").mkdir()
    assert "not one written by datasets' save_to_disk" in error(tmp_path, spec("folder"))


def test_a_mapped_column_the_file_lacks(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    message = error(tmp_path, spec("d.jsonl", fields={"prompt": "problem"}))
    assert message == (
        f"fields maps 'prompt' to column 'problem', which {tmp_path}/d.jsonl does not have; "
        "its columns: question, answer, level"
    )


def test_a_mapped_column_some_rows_lack(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"question": "a"}, {"q": "b"}])
    message = error(tmp_path, spec("d.jsonl"))
    assert message == (
        f"row 2 of {tmp_path}/d.jsonl has no column 'question' (mapped to 'prompt'); its columns: q"
    )


def test_a_required_field_no_row_has(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    message = error(tmp_path, DatasetSpec(path="d.jsonl"))
    assert message == (
        f"required field 'prompt' is not in {tmp_path}/d.jsonl: map it to one of its columns "
        "with `fields: {prompt: COLUMN}`; its columns: question, answer, level"
    )
    message = error(tmp_path, spec("d.jsonl", required=["prompt", "solution"]))
    assert "required field 'solution' is not in" in message


def test_a_required_field_some_rows_leave_null(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"question": "a"}, {"question": None}, {"question": "c"}])
    assert error(tmp_path, spec("d.jsonl")) == (
        f"required field 'prompt' is missing or null in 1 of the 3 rows of {tmp_path}/d.jsonl "
        "(rows 2)"
    )


def test_empty_splits(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    assert error(tmp_path, spec("empty.jsonl")) == (
        f"the train split is empty: {tmp_path}/empty.jsonl has no rows"
    )
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "empty.csv").write_text("question,answer\n")
    assert error(tmp_path, spec("d.jsonl", eval_path="empty.csv")) == (
        f"the eval split is empty: {tmp_path}/empty.csv has no rows"
    )


def test_eval_size_must_leave_train_rows(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert error(tmp_path, spec("d.jsonl", eval_size=10)) == (
        f"eval_size 10 would hold out every row of {tmp_path}/d.jsonl, which has 10: "
        "set eval_size below 10"
    )


def test_an_unknown_split(tmp_path: Path) -> None:
    write_disk(tmp_path / "dd", {"train": ROWS[:5], "validation": ROWS[5:]})
    assert error(tmp_path, spec("dd", eval_split="test")) == (
        f"{tmp_path}/dd has no split 'test' (eval_split): its splits are train, validation"
    )
    write_disk(tmp_path / "nt", {"first": ROWS})
    assert error(tmp_path, spec("nt")) == (
        f"{tmp_path}/nt has no split 'train' (split): its splits are first"
    )


def test_a_split_of_a_single_table(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert error(tmp_path, spec("d.jsonl", eval_split="test")) == (
        f"eval_split names a split of a DatasetDict directory, but {tmp_path}/d.jsonl is a "
        "single table: drop eval_split and set eval_path or eval_size"
    )
    write_disk(tmp_path / "ds", ROWS)
    assert "drop split" in error(tmp_path, spec("ds", split="train"))


def test_jsonl_errors_name_the_line(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"question": "a"}\n\n{"question": \n')
    assert error(tmp_path, spec("bad.jsonl")) == (
        f"{tmp_path}/bad.jsonl line 3 is not valid JSON: Expecting value (column 13)"
    )
    (tmp_path / "list.jsonl").write_text('{"question": "a"}\n["a", "b"]\n')
    assert error(tmp_path, spec("list.jsonl")) == (
        f"{tmp_path}/list.jsonl line 2 is a JSON list, not an object: each line of a JSONL "
        'dataset is one row, {"column": value, ...}'
    )


def test_csv_row_with_too_many_cells(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("question,answer\na,1\nb,2,3\n")
    assert error(tmp_path, spec("d.csv")) == (
        f"{tmp_path}/d.csv line 3 has more cells than the header has columns"
    )


def test_eval_size_with_another_eval_source_is_refused_at_validation() -> None:
    with pytest.raises(ValidationError, match="set one of them, not both"):
        DatasetSpec(path="d.jsonl", eval_path="e.jsonl", eval_size=5)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        DatasetSpec.model_validate({"path": "d.jsonl", "feilds": {}})


# --- the stream ------------------------------------------------------------------------------


FIVE = [{"i": i} for i in range(5)]


def draw(stream: DataStream, n: int) -> list[int]:
    return [stream.next()[1]["i"] for _ in range(n)]


def test_each_epoch_is_a_seeded_permutation_reshuffled_per_epoch() -> None:
    stream = DataStream(FIVE, seed=7)
    epochs = [draw(stream, 5) for _ in range(4)]
    assert all(sorted(e) == [0, 1, 2, 3, 4] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1
    concatenated = [i for epoch in epochs for i in epoch]
    assert draw(DataStream(FIVE, seed=7), 20) == concatenated
    assert draw(DataStream(FIVE, seed=8), 20) != concatenated
    assert draw(DataStream(FIVE, seed=7, shuffle=False), 7) == [0, 1, 2, 3, 4, 0, 1]


def test_next_returns_the_position_it_handed_out_and_advances() -> None:
    stream = DataStream(FIVE, seed=0)
    positions = [stream.next()[0] for _ in range(6)]
    assert positions[0] == Cursor(epoch=0, index=0)
    assert positions[4] == Cursor(epoch=0, index=4)
    assert positions[5] == Cursor(epoch=1, index=0)
    assert stream.position == Cursor(epoch=1, index=1)
    assert stream.epoch == 1


def test_resuming_from_a_saved_position_continues_exactly() -> None:
    whole = draw(DataStream(FIVE, seed=3), 10)
    first = DataStream(FIVE, seed=3)
    before = draw(first, 7)
    saved = Cursor.model_validate_json(first.position.model_dump_json())
    assert saved == Cursor(epoch=1, index=2)
    after = draw(DataStream(FIVE, seed=3, start=saved), 3)
    assert before + after == whole


def test_rows_handed_out_are_copies() -> None:
    stream = DataStream(FIVE, seed=0, shuffle=False)
    stream.next()[1]["i"] = 99
    assert FIVE[0] == {"i": 0}


def test_a_stream_refuses_no_rows_and_a_position_past_the_end() -> None:
    with pytest.raises(DatasetError, match="at least one row"):
        DataStream([], seed=0)
    with pytest.raises(DatasetError, match="the dataset changed since the checkpoint"):
        DataStream(FIVE, seed=0, start=Cursor(epoch=2, index=5))
