"""An agent program for tests/integration/experiments/test_experiment.py: reads its row on
stdin, asks the model once through OPENAI_BASE_URL with the openai SDK, prints the answer; crashes
on rows marked `crash`."""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI

row = json.loads(sys.stdin.read())
if row.get("mode") == "crash":
    print("the agent fell over", file=sys.stderr)
    sys.exit(3)
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY: its session
reply = client.chat.completions.create(
    model=os.environ["RLGATEWAY_MODEL"],
    messages=[{"role": "user", "content": row["prompt"]}],
    temperature=float(os.environ["RLGATEWAY_TEMPERATURE"]),
    max_tokens=int(os.environ["RLGATEWAY_MAX_TOKENS"]),
)
print(reply.choices[0].message.content)
