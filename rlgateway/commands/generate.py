"""`rlgateway generate`: sample from the embedded local engine from the shell."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from engines.base import GenerateRequest, GenerateResult, SamplingParams
from engines.errors import InvalidRequestError
from rlgateway.errors import CLIError


def _sampling(args: argparse.Namespace) -> SamplingParams:
    sp = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_new_tokens=args.max_tokens,
        min_new_tokens=args.min_tokens,
        stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos,
    )
    try:
        sp.validate()
    except InvalidRequestError as exc:
        raise CLIError(str(exc)) from exc
    return sp


def _messages(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    if args.chat is not None:
        return [{"role": "user", "content": args.chat}]
    if args.messages is None:
        return None
    text = args.messages
    if text.startswith("@"):
        path = Path(text[1:])
        if not path.is_file():
            raise CLIError(f"--messages file {path} does not exist")
        text = path.read_text()
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CLIError(f"--messages is not valid JSON ({exc}): give a list of messages") from exc
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m for m in messages
    ):
        raise CLIError('--messages must be a JSON list like [{"role": "user", "content": "hi"}]')
    return messages


def run_generate(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    messages = _messages(args)
    if messages is None and not args.prompt:
        raise CLIError("give a prompt: --prompt TEXT, --chat MESSAGE or --messages JSON")
    if args.n < 1:
        raise CLIError(f"-n must be >= 1, got {args.n}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise CLIError(
            f"{args.model} is not a Hugging Face model directory (no config.json): "
            "build one with `rlgateway model tiny DIR` or point --model at a model"
        )

    from engines.local import LocalEngine, LocalEngineConfig
    from engines.tiny_model import load_tokenizer, tiny_model_dir

    model_dir = Path(args.model) if args.model else tiny_model_dir()
    tokenizer = load_tokenizer(model_dir)
    if messages is not None:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = args.prompt
    prompt_ids = list(tokenizer.encode(text, add_special_tokens=False))
    engine = LocalEngine.load(LocalEngineConfig(model=str(model_dir), device=args.device))
    stream_text = args.n == 1 and not args.json and not args.show_tokens
    try:
        results = asyncio.run(
            _run(engine, tuple(prompt_ids), sampling, args.n, tokenizer, stream_text)
        )
    except InvalidRequestError as exc:
        raise CLIError(str(exc)) from exc
    for i, res in enumerate(results):
        text = str(tokenizer.decode(list(res.token_ids), skip_special_tokens=True))
        if args.json:
            print(json.dumps(_as_json(res, text)))
            continue
        if not stream_text:
            if args.n > 1:
                print(f"--- sample {i} ({res.finish_reason.value}) ---")
            print(text)
        if args.show_tokens:
            _print_tokens(res, tokenizer)
    return 0


async def _run(
    engine: Any,
    prompt_ids: tuple[int, ...],
    sampling: SamplingParams,
    n: int,
    tokenizer: Any,
    stream_text: bool,
) -> list[GenerateResult]:
    from engines.base import collect

    try:
        if stream_text:
            return [await _stream_one(engine, prompt_ids, sampling, tokenizer)]
        requests = []
        for i in range(n):
            seed = None if sampling.seed is None else sampling.seed + i
            sp = SamplingParams(**{**_fields(sampling), "seed": seed})
            requests.append(GenerateRequest(prompt_ids=prompt_ids, sampling=sp))
        return list(await asyncio.gather(*(collect(engine, r) for r in requests)))
    finally:
        await engine.close()


async def _stream_one(
    engine: Any, prompt_ids: tuple[int, ...], sampling: SamplingParams, tokenizer: Any
) -> GenerateResult:
    request = GenerateRequest(prompt_ids=prompt_ids, sampling=sampling)
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    shown = ""
    finish = None
    async for chunk in engine.generate(request):
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        versions += chunk.versions
        finish = chunk.finish_reason or finish
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # hold back a partly decoded UTF-8 character
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")
    assert finish is not None
    return GenerateResult(
        request.request_id, prompt_ids, tuple(ids), tuple(logprobs), tuple(versions), finish
    )


def _fields(sp: SamplingParams) -> dict[str, Any]:
    return {name: getattr(sp, name) for name in sp.__dataclass_fields__}


def _as_json(res: GenerateResult, text: str) -> dict[str, Any]:
    return {
        "text": text,
        "finish_reason": res.finish_reason.value,
        "prompt_ids": list(res.prompt_ids),
        "token_ids": list(res.token_ids),
        "logprobs": list(res.logprobs),
        "versions": list(res.versions),
    }


def _print_tokens(res: GenerateResult, tokenizer: Any) -> None:
    print(f"{'#':>4} {'id':>6} {'token':<14} {'logprob':>9} {'version':>7}")
    for i, (tok, lp, ver) in enumerate(zip(res.token_ids, res.logprobs, res.versions, strict=True)):
        piece = tokenizer.decode([tok])
        print(f"{i:>4} {tok:>6} {piece!r:<14} {lp:>9.4f} {ver:>7}")
    print(f"finish_reason: {res.finish_reason.value}, prompt tokens: {len(res.prompt_ids)}")
