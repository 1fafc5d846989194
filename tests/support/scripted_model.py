"""A tiny model fine-tuned (supervised, under a minute on 2 idle cores) to follow a fixed tool-use
script.

Greedy decoding then really produces tool calls, so the gateway's tool-call parsing, the agent's
echo of them, and the token-exact multi-turn recording are tested on a real model and engine:

- a user turn (with tools) -> `<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}`
- a tool result            -> `The sum is 5.`
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from engines.tiny_model import build_tiny_model, load_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {}, "b": {}}},
        },
    }
]
CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}
ANSWER = "The sum is 5."
THOUGHT = "They want a sum."
"""The thinking variant's reasoning before every reply (`<think>THOUGHT</think>`)."""
QUESTIONS = ["What is 2 plus 3?", "Add two and three.", "2+3=?", "hi"]


def _assistant_call() -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c",
                "type": "function",
                "function": {"name": "add", "arguments": json.dumps(CALL["arguments"])},
            }
        ],
    }


def _examples(thinking: bool = False) -> list[tuple[list[dict[str, Any]], str]]:
    """(messages, the exact assistant text that must follow), covering up to 3 rounds, each
    question's examples in order (each history extends the one before); with `thinking`, each
    reply starts with `<think>\nTHOUGHT\n</think>\n\n`."""
    think = f"<think>\n{THOUGHT}\n</think>\n\n" if thinking else ""
    call_text = f"{think}<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
    out = []
    for q in QUESTIONS:
        history: list[dict[str, Any]] = []
        for round_ in range(3):
            history = [
                *history,
                {
                    "role": "user",
                    "content": QUESTIONS[(QUESTIONS.index(q) + round_) % len(QUESTIONS)],
                },
            ]
            out.append((list(history), call_text))
            history = [
                *history,
                _assistant_call(),
                {"role": "tool", "tool_call_id": "c", "content": "5"},
            ]
            out.append((list(history), think + ANSWER))
            history = [*history, {"role": "assistant", "content": ANSWER}]
    return out


def _thinking_rows(tok: Any, im_end: int) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) of the thinking script, each prompt made as the gateway makes
    it: a continuation holds the earlier turns' exact tokens, their reasoning included (the
    template never renders it)."""
    from gateway.core.chat_render import ChatRenderer

    r = ChatRenderer(tok, frozenset({im_end}))
    rows: list[tuple[list[int], int]] = []
    tokens: list[int] = []
    transcript: list[dict[str, Any]] = []
    for messages, reply in _examples(thinking=True):
        cont = None
        if transcript and messages[: len(transcript)] == transcript:
            cont = r.continuation(tokens, transcript, messages, TOOLS)
        p_ids = cont if cont is not None else r.prompt(messages, TOOLS)
        r_ids = [*r.encode(reply), im_end]
        rows.append((p_ids + r_ids, len(p_ids)))
        tokens = p_ids + r_ids
        said = reply.split("</think>\n\n", 1)[1]
        if said.startswith("<tool_call>"):
            transcript = [*messages, _assistant_call()]
        else:
            transcript = [*messages, {"role": "assistant", "content": said}]
    return rows


MAX_STEPS = 2000
"""Fine-tuning steps after which a model that still does not follow its script is an error."""
CHECK_EVERY = 20
"""Steps between checks of the script once the first `steps` are done."""


def _follows_script(
    model: Any, ids_BT: torch.Tensor, attn_BT: torch.Tensor, labels_BT: torch.Tensor
) -> bool:
    """Whether the model's argmax is the script's next token at every reply position (so greedy
    decoding writes every reply exactly)."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids_BT, attention_mask=attn_BT).logits
    predicted, target = logits[:, :-1].argmax(-1), labels_BT[:, 1:]
    graded = target != -100
    return bool((predicted[graded] == target[graded]).all())


Graded = list[tuple[int, int]]
"""Spans [start, end) of a row whose tokens are the script's replies."""


def merge_prefixes(rows: list[tuple[list[int], int]]) -> list[tuple[list[int], Graded]]:
    """(token ids, prompt length) rows as fewer rows with several graded spans: a row that is
    the exact start of a longer one (a multi-turn history and its continuation) is graded inside
    the longer row, where causal attention gives its positions the same predictions. The same
    examples, each prefix's tokens computed once a step."""
    out: list[tuple[list[int], Graded]] = []
    for ids, n_prompt in sorted(rows, key=lambda r: -len(r[0])):
        span = (n_prompt, len(ids))
        home = next((o for o in out if o[0][: len(ids)] == ids), None)
        if home is None:
            out.append((ids, [span]))
        else:
            home[1].append(span)
    return out


def build_scripted_model(
    out_dir: Path, *, steps: int = 80, batch: int = 8, seed: int = 0, thinking: bool = False
) -> Path:
    """Fine-tune the test-sized tiny model on the script; returns the model directory. The
    script's 24 examples are 4 conversations whose earlier turns are the start of the later
    ones (`merge_prefixes`): each step trains on all of them. Measured on 2 busy cores, the
    model followed its script after 100 steps (110 for the thinking variant); before the merge,
    random batches of 8 of the 24 rows needed 210."""
    from transformers import AutoModelForCausalLM

    base = out_dir.parent / f"{out_dir.name}-base"
    if base.exists():
        shutil.rmtree(base)
    build_tiny_model(base, seed=seed)
    tok = load_tokenizer(base)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    rows = _thinking_rows(tok, im_end) if thinking else []
    for messages, reply in [] if thinking else _examples():
        prompt = tok.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
        )
        p_ids = tok.encode(prompt, add_special_tokens=False)
        r_ids = [*tok.encode(reply, add_special_tokens=False), im_end]
        rows.append((p_ids + r_ids, len(p_ids)))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    merged = merge_prefixes(rows)
    width = max(len(ids) for ids, _ in merged)
    ids_BT = torch.zeros(len(merged), width, dtype=torch.long)
    labels_BT = torch.full((len(merged), width), -100, dtype=torch.long)
    attn_BT = torch.zeros(len(merged), width, dtype=torch.long)
    for b, (ids, graded) in enumerate(merged):
        ids_BT[b, : len(ids)] = torch.tensor(ids)
        for start, end in graded:
            labels_BT[b, start:end] = torch.tensor(ids[start:end])
        attn_BT[b, : len(ids)] = 1
    gen = torch.Generator().manual_seed(seed)
    done = 0
    # `steps` at least, then on until greedy decoding follows the script token for token (how
    # many steps that takes varies with the machine's float kernels), `MAX_STEPS` at most
    while done < steps or not _follows_script(model, ids_BT, attn_BT, labels_BT):
        if done >= MAX_STEPS:
            raise RuntimeError(f"the scripted model does not follow its script after {done} steps")
        model.train()
        for _ in range(CHECK_EVERY if done >= steps else steps):
            rows_b = torch.randperm(len(merged), generator=gen)[:batch]
            loss = model(
                input_ids=ids_BT[rows_b], attention_mask=attn_BT[rows_b], labels=labels_BT[rows_b]
            ).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        done += CHECK_EVERY if done >= steps else steps
    model.eval()
    model.save_pretrained(out_dir)
    for f in base.iterdir():
        if f.name not in {"model.safetensors", "config.json"}:
            shutil.copy(f, out_dir / f.name)
    shutil.rmtree(base)
    return out_dir


def scripted_model_dir(*, thinking: bool = False) -> Path:
    """The scripted model, built once per machine (under a minute on 2 idle cores) and cached; with
    `thinking`, the variant that reasons first (serve it with `--reasoning-parser think`: its
    template does not write `<think>` itself)."""
    ingredients: list[Any] = [TOOLS, CALL, ANSWER, QUESTIONS, 80, 8, 0, "until it follows"]
    ingredients += ["prefixes merged", CHECK_EVERY]
    if thinking:
        ingredients += [THOUGHT, "prompts as the gateway continues them"]
    recipe = json.dumps(ingredients).encode()
    tag = hashlib.sha256(recipe).hexdigest()[:12]
    root = Path(os.environ.get("RLGATEWAY_CACHE_DIR") or Path.home() / ".cache" / "rlgateway")
    target = root / "models" / f"scripted{'-thinking' if thinking else ''}-{tag}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".scripted-", dir=target.parent))
    built = build_scripted_model(work / "model", thinking=thinking)
    with contextlib.suppress(OSError):  # another process finished first: use theirs
        os.replace(built, target)
    shutil.rmtree(work, ignore_errors=True)
    return target
