"""The official `openai` SDK's clients on a gateway session (sync, async, the admin's), and small
helpers the SDK tests share."""

from __future__ import annotations

import time
from typing import Any

import openai

from tests.support.gateway_server import GatewayHandle


def sync_client(session: dict[str, Any], **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], **kw)


def async_client(session: dict[str, Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])


def admin_client(gw: GatewayHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=gw.admin_token)


def completion_id(choice: Any) -> str:
    extra = choice.model_extra or {}
    assert "completion_id" in extra, f"choice has no completion_id: {choice}"
    cid: str = extra["completion_id"]
    return cid


def wait_for(predicate: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}
