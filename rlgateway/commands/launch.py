"""`rlgateway launch SPEC.yaml --ray ADDRESS [KEY=VALUE ...]`: the topology on a Ray cluster
(`rlgateway.launch`)."""

from __future__ import annotations

import argparse
import os
import secrets

from rlgateway.errors import CLIError


def run_launch(args: argparse.Namespace) -> int:
    from rlgateway.launch.ray_launcher import launch
    from rlgateway.launch.spec import load_launch_spec

    try:
        spec = load_launch_spec(args.spec, list(args.overrides))
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    token = spec.admin_token or os.environ.get("RLGATEWAY_ADMIN_TOKEN")
    if not token:
        token = secrets.token_urlsafe(24)
        print(f"admin token (set RLGATEWAY_ADMIN_TOKEN to choose one): {token}", flush=True)
    return launch(spec, args.ray, token)
