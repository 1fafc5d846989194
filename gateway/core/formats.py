"""Structured outputs as the protocols ask for them: chat's `response_format`, the Responses API's
`text.format`, Anthropic's `output_format` and `output_config.format`, each read into the one JSON
schema the engine holds the reply to (`SamplingParams.json_schema`, `engines.grammar`), or a 400
that names the parameter. `json_object` is any JSON object; `text` (or nothing) is no constraint.
"""

from __future__ import annotations

from typing import Any

from engines.grammar import JSON_OBJECT_SCHEMA, GrammarError, check_json_schema, schema_of
from gateway.errors import invalid_input


def format_schema(fmt: Any, param: str, *, nested: bool) -> str | None:
    """The JSON schema (JSON text) that a structured-output format asks the reply to follow, or
    None for plain text. Chat's `response_format` nests the schema under `json_schema` (`nested`);
    the Responses API's `text.format` and Anthropic's `output_format`/`output_config.format` do
    not. A format of another kind, a missing schema or one
    the grammar compiler cannot use is a 400 naming `param` (`invalid_input`)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_input(f"{param} must be an object", param)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise invalid_input(
            f"{param}.type {kind!r} is not served: use text, json_object or json_schema", param
        )
    where = fmt.get("json_schema") if nested else fmt
    inner = f"{param}.json_schema" if nested else param
    if not isinstance(where, dict) or not isinstance(where.get("schema"), dict):
        raise invalid_input(f"{inner}.schema is required: the JSON schema of the reply", param)
    schema = schema_of(where["schema"])
    try:
        check_json_schema(schema)
    except GrammarError as exc:
        raise invalid_input(f"{inner}.schema: {exc}", param) from None
    return schema
