"""A stand-in for `python -m sglang.launch_server`: takes SGLang's launcher flags and serves the
fake SGLang server (`tests.support.fake_sglang`, generating with the tiny model) on them, so that
`rlgateway serve --engine sglang --engine-launch` runs end to end without SGLang. It records its
argv and the environment the launcher must set or clear in `$FAKE_SGLANG_RECORD` (one JSON line
per start), when that is set."""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args, _ = parser.parse_known_args()
    record = os.environ.get("FAKE_SGLANG_RECORD")
    if record:
        keys = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "HF_HUB_OFFLINE")
        line = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}
        with open(record, "a") as out:
            out.write(json.dumps(line) + "\n")
    from tests.support import fake_sglang

    sys.argv = [sys.argv[0], "--model", args.model_path, "--port", str(args.port)]
    fake_sglang.main()


if __name__ == "__main__":
    main()
