"""`rlgateway run SPEC.yaml [--out DIR] [--gateway-url URL] [KEY=VALUE ...]`: an experiment."""

from __future__ import annotations

import argparse
import json
import os
import sys

from rlgateway.errors import CLIError


def run_experiment(args: argparse.Namespace) -> int:
    from rlgateway.experiment.runner import Experiment

    try:
        exp = Experiment.from_yaml(
            args.spec,
            list(args.overrides),
            out=args.out,
            gateway_url=args.gateway_url,
            admin_token=args.admin_token or os.environ.get("RLGATEWAY_ADMIN_TOKEN"),
            run_id=args.run,
        )
        exp.prepare().reward.close()  # every part checked before anything starts
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    print(f"experiment {exp.spec.name}: outputs in {exp.out}", flush=True)
    try:
        summary = exp.run()
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    except KeyboardInterrupt:
        print(
            f"experiment {exp.spec.name}: interrupted; its checkpoints and store are in "
            f"{exp.out}: run the same command again to resume",
            file=sys.stderr,
            flush=True,
        )
        return 130
    print(json.dumps(summary, indent=2))
    return 0
