"""A multi-turn tool-calling agent: the `openai` SDK's tools API and a calculator, rewarded at the
end of the episode.

The model may call `add(a, b)` any number of times; the agent runs each call and sends the result
back as a `tool` message, until the model answers in text (or `--max-turns` is reached). The
episode's reward is 1 when the final answer contains the right number. The gateway records the
whole conversation as one segment: each turn's prompt is the previous turn's exact tokens plus the
new tool message, so the model's own tokens are never re-tokenized.

    python agents_examples/tool_agent.py --base-url SESSION_BASE_URL --api-key SESSION_KEY \
        --question "What is 2 plus 3?" --answer 5

Prints one JSON line: the turns taken, the tool calls made, the final answer and the reward.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx
from openai import OpenAI

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {}, "b": {}}},
        },
    }
]


def add(a: float, b: float) -> float:
    return a + b


def run_tool(name: str, arguments: str) -> str:
    """The tool's result as text, or an error the model can read (bad calls are its mistake)."""
    try:
        args = json.loads(arguments or "{}")
        if name != "add":
            return f"error: unknown tool {name!r}"
        total = add(float(args["a"]), float(args["b"]))
        return str(int(total) if total.is_integer() else total)
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the session's base_url (.../sessions/ID/v1)")
    p.add_argument("--api-key", required=True, help="the session's api_key")
    p.add_argument("--question", default="What is 2 plus 3?")
    p.add_argument("--answer", default="5", help="the right number, for the reward")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default="demo")
    args = p.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    messages: list[Any] = [{"role": "user", "content": args.question}]
    calls = []
    final = ""
    turns = 0
    while turns < args.max_turns:
        turns += 1
        reply = client.chat.completions.create(
            model=args.model,
            messages=messages,
            tools=TOOLS,
            max_tokens=64,
            temperature=args.temperature,
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            final = message.content or ""
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            if call.type != "function":
                continue
            result = run_tool(call.function.name, call.function.arguments)
            calls.append({"name": call.function.name, "arguments": call.function.arguments})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

    reward = 1.0 if args.answer in final else 0.0
    session_url = args.base_url.rstrip("/").removesuffix("/v1")
    auth = {"Authorization": f"Bearer {args.api_key}"}
    httpx.post(f"{session_url}/reward", json={"reward": reward}, headers=auth).raise_for_status()
    httpx.post(f"{session_url}/end", headers=auth).raise_for_status()
    print(json.dumps({"turns": turns, "tool_calls": calls, "answer": final, "reward": reward}))


if __name__ == "__main__":
    main()
