"""User code for tests/integration/experiments/test_experiment.py, as a user's spec names it
(`parts.py:fn`)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

_tries: Counter[str] = Counter()
_tries_lock = threading.Lock()


def even_length(prompt: str, completion: str, row: dict[str, Any]) -> float:
    """A reward the tiny model's random answers earn about half the time."""
    return float(len(completion) % 2 == 0)


def slow_even_length(prompt: str, completion: str, row: dict[str, Any]) -> float:
    """`even_length` after half a second: episodes stay in flight long enough to be cut short."""
    time.sleep(0.5)
    return float(len(completion) % 2 == 0)


def flaky(prompt: str, completion: str, row: dict[str, Any]) -> float:
    """Raises on rows marked `boom`, hangs on rows marked `hang`, else rewards even lengths."""
    if row.get("mode") == "boom":
        raise RuntimeError("the grader broke on this row")
    if row.get("mode") == "hang":
        time.sleep(30)
    return float(len(completion) % 2 == 0)


def every_second_try(prompt: str, completion: str, row: dict[str, Any]) -> float:
    """Wrong on a prompt's first, third, ... grading, right on its second, fourth, ...: whatever the
    model says, the first episode graded on each prompt needs another turn (thread executor: one
    process keeps the count). Rows marked `never` are never right."""
    if row.get("mode") == "never":
        return 0.0
    with _tries_lock:
        _tries[prompt] += 1
        return float(_tries[prompt] % 2 == 0)
