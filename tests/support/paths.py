"""Where things are, for tests at any depth: the repository root and the support folder."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
"""tests/support: helpers, fake packages, chat templates, torchrun workers."""
REPO_ROOT = SUPPORT.parents[1]
WORKERS = SUPPORT / "workers"
