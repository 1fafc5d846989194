"""A model directory's tokenizer and chat template, read with `tokenizers` and `jinja2` alone.

`load_chat_tokenizer(model_dir)` gives the gateway what it uses of a Hugging Face fast tokenizer
(`apply_chat_template(..., tokenize=False)`, `encode`, `decode`, `convert_ids_to_tokens`,
`added_tokens_decoder`, `backend_tokenizer`, `len`) without importing torch or transformers, so a
gateway on vLLM/SGLang servers is a light process. Each answer equals transformers'
(`AutoTokenizer.from_pretrained`) on the same directory:
`tests/integration/gateway/test_chat_tokenizer.py` compares them on every chat template and
tokenizer the tests know.

What transformers does and this mirrors (transformers 5): the template is `chat_template.jinja`,
else `tokenizer_config.json`'s `chat_template` (a string, or named templates of which `default`
is used); it renders in a sandboxed jinja2 environment with `trim_blocks`, `lstrip_blocks`, loop
controls, a `tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`, and a no-op
`{% generation %}` block, given the named special tokens (`bos_token`, `eos_token`, ...) and the
caller's keyword arguments; decoding cleans up tokenization spaces only where the config asks
and the model is not BPE.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The named special tokens a template is given (transformers' `SPECIAL_TOKENS_ATTRIBUTES`)."""


class ChatTokenizer:
    """A fast tokenizer (`tokenizer.json`) with the directory's chat template and special tokens,
    shaped as the parts of `PreTrainedTokenizerFast` the gateway calls."""

    def __init__(
        self,
        backend: Tokenizer,
        chat_template: str | None,
        special_tokens_map: dict[str, str],
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens_map = special_tokens_map
        """Named special tokens (`eos_token`: its text), as templates read them."""
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        """transformers skips the clean-up on BPE models, which it would corrupt."""

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    @cached_property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self.backend_tokenizer.get_added_tokens_decoder())

    def encode(self, text: str, add_special_tokens: bool = True, **_: object) -> list[int]:
        ids: list[int] = self.backend_tokenizer.encode(
            text, add_special_tokens=add_special_tokens
        ).ids
        return ids

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        text = str(
            self.backend_tokenizer.decode(
                [ids] if isinstance(ids, int) else list(ids),
                skip_special_tokens=skip_special_tokens,
            )
        )
        return _clean_up(text) if self._clean_up else text

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        token: str | None = self.backend_tokenizer.id_to_token(token_id)
        return token

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str:
        """The template's text for `conversation` (`tokenize=False` only: the gateway encodes the
        text itself). A template's own refusal is a `jinja2.TemplateError`."""
        if tokenize:
            raise ValueError("apply_chat_template renders text only here (tokenize=False)")
        if not self.chat_template:
            raise ValueError("the model's tokenizer has no chat template")
        return _compile(self.chat_template).render(
            messages=conversation,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )


def load_chat_tokenizer(model_dir: str | Path) -> ChatTokenizer:
    """The tokenizer of a model directory holding `tokenizer.json` (every fast tokenizer's save)."""
    root = Path(model_dir)
    path = root / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{root} has no tokenizer.json: the gateway reads fast (Rust) tokenizers; save yours "
            "with transformers' save_pretrained, which writes one"
        )
    config = _json(root / "tokenizer_config.json")
    named = {**_json(root / "special_tokens_map.json"), **config}
    specials = {
        name: text
        for name in SPECIAL_TOKEN_NAMES
        if (text := _content(named.get(name))) is not None
    }
    backend = Tokenizer.from_file(str(path))
    # as transformers does: the config's special tokens are the tokenizer's special added tokens
    extra = [
        _content(t)
        for key in ("extra_special_tokens", "additional_special_tokens")
        for t in _listed(named.get(key))
    ]
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [t for t in [*specials.values(), *extra] if t is not None and t not in known]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    return ChatTokenizer(
        backend,
        _chat_template(root, config),
        specials,
        bool(config.get("clean_up_tokenization_spaces", False)),
    )


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _content(token: object) -> str | None:
    """A special token as configs write it: its text, or an AddedToken's fields."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _listed(tokens: object) -> list[object]:
    """A config's extra special tokens: a list, or (transformers 5) names -> tokens."""
    if isinstance(tokens, dict):
        return list(tokens.values())
    return list(tokens) if isinstance(tokens, list) else []


def _chat_template(root: Path, config: dict[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _clean_up(text: str) -> str:
    for spaced, tight in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, tight)
    return text


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (templates that mark the assistant's tokens for
    training masks): its body, unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it so)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENVIRONMENT = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
)
_ENVIRONMENT.filters["tojson"] = _tojson
_ENVIRONMENT.globals["raise_exception"] = _raise_exception
_ENVIRONMENT.globals["strftime_now"] = _strftime_now
_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    template = _TEMPLATES.get(source)
    if template is None:
        template = _TEMPLATES[source] = _ENVIRONMENT.from_string(source)
    return template
