"""What the routes share: the gateway's components and services, and the dependency that hands
them to a route (`GatewayDep`).

`app.py` wires routes to these; routes import this module, never `app.py`, so the wiring and the
routes do not import each other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from engines.base import Engine
from gateway.auth import SessionDirectory
from gateway.core.chat_render import ChatRenderer
from gateway.core.recorder import Recorder
from gateway.core.segments import SegmentTracker
from gateway.core.turn import TurnCore
from gateway.core.turn_types import Parsers
from gateway.metrics import GatewayMetrics
from gateway.protocols.anthropic.adapter import MessagesService
from gateway.protocols.openai.chat import ChatService
from gateway.protocols.openai.completions import CompletionService
from gateway.protocols.responses.adapter import ResponsesService
from gateway.protocols.responses.kept import KeptResponses
from gateway.run_configs import RunConfigs
from gateway.settings import GatewaySettings
from store import Store

log = logging.getLogger(__name__)

RunConfigCheck = Callable[[dict[str, Any]], None]
"""Validates a run's config (`POST /runs {"config": ...}`); raises ValueError with a message that
names the field (`config.algo.eps_low: ...`), which becomes the 400's message. The trainer's own
check is passed in by whoever composes the gateway with a trainer (`rlgateway.app`); the gateway
alone checks only the run-owned fields it reads itself (`check_run_fields`)."""


def check_run_fields(config: dict[str, Any]) -> None:
    """The check of a gateway composed without a trainer: the run-owned fields the gateway reads
    (`store.run_config.RunConfig`) must be valid; other keys are the trainer's business."""
    from pydantic import ValidationError

    from store.run_config import run_config_of

    try:
        run_config_of(config)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ValueError(f"config.{where}: {first['msg']} (got {first.get('input')!r})") from None


@dataclass(slots=True)
class Components:
    """What the gateway runs on. `eos_token_ids` are the model's end-of-turn ids."""

    engine: Engine
    store: Store
    tokenizer: Any
    eos_token_ids: frozenset[int]
    model_name: str


@dataclass(slots=True)
class Gateway:
    settings: GatewaySettings
    components: Components
    renderer: ChatRenderer
    recorder: Recorder
    chat: ChatService
    completions: CompletionService
    responses: ResponsesService
    messages: MessagesService
    sessions: SessionDirectory
    run_configs: RunConfigs
    metrics: GatewayMetrics
    check_run_config: RunConfigCheck
    parsers: Parsers

    @property
    def store(self) -> Store:
        return self.components.store

    @property
    def engine(self) -> Engine:
        return self.components.engine


def parsers_of(settings: GatewaySettings, tokenizer: Any) -> Parsers:
    """The model family's parsers: from the settings, or (auto) from its chat template."""
    from gateway.core.reasoning_parsers import build_reasoning_parser
    from gateway.core.tool_parsers import TOOL_PARSERS, NoToolParser, build_tool_parser

    template = str(getattr(tokenizer, "chat_template", None) or "")
    parsers = Parsers(
        build_tool_parser(settings.tool_parser, template),
        build_reasoning_parser(settings.reasoning_parser, template),
    )
    how = "from the chat template" if settings.tool_parser == "auto" else "--tool-parser"
    if isinstance(parsers.tools, NoToolParser):
        log.warning(
            "the chat template writes tool calls in no format the gateway knows: requests that "
            "ask for tool calls get a 400 until --tool-parser names one (%s)",
            ", ".join(TOOL_PARSERS),
        )
    else:
        log.info("tool-call parser: %s (%s)", parsers.tools.name, how)
    log.info("reasoning parser: %s", parsers.reasoning_name)
    return parsers


def build_gateway(
    settings: GatewaySettings,
    c: Components,
    metrics: GatewayMetrics | None = None,
    check_run_config: RunConfigCheck = check_run_fields,
) -> Gateway:
    metrics = metrics or GatewayMetrics()
    renderer = ChatRenderer(c.tokenizer, c.eos_token_ids)
    recorder = Recorder(c.store, SegmentTracker(c.store), on_commit=metrics.observe_records)
    parsers = parsers_of(settings, c.tokenizer)
    core = TurnCore(c.engine, renderer, recorder, c.model_name, parsers)
    return Gateway(
        settings=settings,
        components=c,
        renderer=renderer,
        recorder=recorder,
        chat=ChatService(core),
        completions=CompletionService(core),
        responses=ResponsesService(core, KeptResponses(c.store)),
        messages=MessagesService(core),
        sessions=SessionDirectory(c.store),
        run_configs=RunConfigs(c.store),
        metrics=metrics,
        check_run_config=check_run_config,
        parsers=parsers,
    )


async def get_gateway(request: Request) -> Gateway:
    # async on purpose: FastAPI runs a plain-def dependency in a worker thread, one hop per request
    gw: Gateway = request.app.state.gateway
    return gw


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
