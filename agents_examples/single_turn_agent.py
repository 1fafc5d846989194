"""A single-turn task agent: the `openai` SDK and nothing else (the demo's agent).

It answers one question per session and, being its own grader here, posts the reward and ends the
session. Point it at any rlgateway session: the gateway records every token it is served.

    # with `rlgateway serve` running and a session created (README: "Record an agent"):
    python agents_examples/single_turn_agent.py --base-url SESSION_BASE_URL --api-key SESSION_KEY \
        --question "Largest of 7 2 9 4?" --answer 9

Prints one JSON line: the reply, the reward and the completion id.
"""

from __future__ import annotations

import argparse
import json

import httpx
from openai import OpenAI


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the session's base_url (.../sessions/ID/v1)")
    p.add_argument("--api-key", required=True, help="the session's api_key")
    p.add_argument("--question", default="Largest of 7 2 9 4?")
    p.add_argument("--answer", default="9", help="the right answer, for the reward")
    p.add_argument("--model", default="demo", help="any name: the gateway serves one model")
    args = p.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    reply = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": args.question}],
        max_tokens=4,
        temperature=1.0,
    )
    text = reply.choices[0].message.content or ""
    reward = 1.0 if text.strip() == args.answer else 0.0

    # Rewards and the episode's end are plain HTTP on the session (base_url minus "/v1").
    session_url = args.base_url.rstrip("/").removesuffix("/v1")
    auth = {"Authorization": f"Bearer {args.api_key}"}
    httpx.post(f"{session_url}/reward", json={"reward": reward}, headers=auth).raise_for_status()
    httpx.post(f"{session_url}/end", headers=auth).raise_for_status()
    print(json.dumps({"reply": text, "reward": reward, "completion_id": reply.id}))


if __name__ == "__main__":
    main()
