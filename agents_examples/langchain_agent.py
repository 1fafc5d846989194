"""An agent written with LangChain, unmodified except for its base_url and key: a prompt template,
`ChatOpenAI` and an output parser, as LangChain's own tutorials build them.

    pip install langchain-openai langchain-anthropic
    python agents_examples/langchain_agent.py --base-url SESSION_BASE_URL --api-key SESSION_KEY
    python agents_examples/langchain_agent.py ... --api responses   # the Responses API instead
    python agents_examples/langchain_agent.py ... --api messages    # ChatAnthropic, Messages

Every call LangChain makes goes through the gateway's `/v1/chat/completions` (or, with
`--api responses`, `/v1/responses`; with `--api messages`, Anthropic's `/v1/messages`) and is
recorded into the session. Prints one JSON line with
the answers; the session's reward is posted by whoever grades it (here: the agent itself, 1 point
per right answer, averaged).
"""

from __future__ import annotations

import argparse
import json

import httpx
from langchain_core.language_models import BaseChatModel
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_openai import ChatOpenAI

QUESTIONS = [("after", "k", "l"), ("before", "q", "p")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the session's base_url (.../sessions/ID/v1)")
    p.add_argument("--api-key", required=True, help="the session's api_key")
    p.add_argument("--model", default="demo")
    p.add_argument("--api", choices=["chat", "responses", "messages"], default="chat")
    args = p.parse_args()

    llm: BaseChatModel
    if args.api == "messages":
        from langchain_anthropic import ChatAnthropic

        # Anthropic's client takes the base URL without /v1, and the key as x-api-key
        llm = ChatAnthropic(  # type: ignore[call-arg]
            model=args.model,
            base_url=args.base_url.rstrip("/").removesuffix("/v1"),
            api_key=args.api_key,
            temperature=1.0,
            max_tokens=4,
        )
    else:
        llm = ChatOpenAI(
            model=args.model,
            base_url=args.base_url,
            api_key=args.api_key,
            temperature=1.0,
            max_completion_tokens=4,
            use_responses_api=args.api == "responses",
        )
    prompt = ChatPromptTemplate.from_messages([("user", "What letter comes {where} {letter}?")])
    chain = prompt | llm
    chain = chain | StrOutputParser()
    answers = chain.batch([{"where": w, "letter": c} for w, c, _ in QUESTIONS])
    score = sum(a.strip() == want for a, (_, _, want) in zip(answers, QUESTIONS, strict=True))
    reward = score / len(QUESTIONS)

    session_url = args.base_url.rstrip("/").removesuffix("/v1")
    auth = {"Authorization": f"Bearer {args.api_key}"}
    httpx.post(f"{session_url}/reward", json={"reward": reward}, headers=auth).raise_for_status()
    httpx.post(f"{session_url}/end", headers=auth).raise_for_status()
    print(json.dumps({"answers": answers, "reward": reward}))


if __name__ == "__main__":
    main()
