"""User code for tests/integration/test_experiment.py, as a user's spec names it (`parts.py:fn`)."""

from __future__ import annotations

import time
from typing import Any


def even_length(prompt: str, completion: str, row: dict[str, Any]) -> float:
    """A reward the tiny model's random answers earn about half the time."""
    return float(len(completion) % 2 == 0)


def flaky(prompt: str, completion: str, row: dict[str, Any]) -> float:
    """Raises on rows marked `boom`, hangs on rows marked `hang`, else rewards even lengths."""
    if row.get("mode") == "boom":
        raise RuntimeError("the grader broke on this row")
    if row.get("mode") == "hang":
        time.sleep(30)
    return float(len(completion) % 2 == 0)
