"""A stand-in for `python -m vllm.entrypoints.openai.api_server`, to test the launcher's process
handling without vLLM: it serves `GET /health` on `--port` and records its argv and the
environment variables the launcher must set in `$FAKE_VLLM_RECORD` (one JSON line per start)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args, _ = parser.parse_known_args()
    keys = ("VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE")
    record = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}
    with open(os.environ["FAKE_VLLM_RECORD"], "a") as out:
        out.write(json.dumps(record) + "\n")
    HTTPServer((args.host, args.port), Health).serve_forever()


if __name__ == "__main__":
    main()
