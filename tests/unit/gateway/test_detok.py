"""The incremental detokenizer: token by token it must end with exactly the text a full decode
gives, on the Rust fast path and on transformers' path alike, and cut at stop strings."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engines.tiny_model import load_tokenizer, tiny_model_dir
from gateway.core.detok import IncrementalDecoder


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(tiny_model_dir())


class _SlowPath:
    """The tokenizer seen without its Rust backend: the decoder must fall back to `decode`."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))


def _texts() -> list[str]:
    return [
        "Hello, world! 3 + 4 = 7.",
        "naïve café — déjà vu ✓ 東京 🙂🙂",
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
        "  leading spaces\n\nand\ttabs  ",
    ]


@pytest.mark.parametrize("slow", [False, True], ids=["rust", "transformers"])
def test_pushing_token_by_token_gives_the_full_decode(tokenizer: Any, slow: bool) -> None:
    rng = random.Random(0)
    cases = [tokenizer.encode(t, add_special_tokens=False) for t in _texts()]
    cases += [[rng.randrange(tokenizer.vocab_size) for _ in range(40)] for _ in range(20)]
    for ids in cases:
        dec = IncrementalDecoder(_SlowPath(tokenizer) if slow else tokenizer, [], holdback=[])
        assert (dec._backend is None) == slow
        for tok in ids:
            dec.push(tok)
        dec.flush()
        assert dec.text == tokenizer.decode(ids, skip_special_tokens=True)
        assert dec.ids == ids


def test_a_stop_string_cuts_the_text_and_stops(tokenizer: Any) -> None:
    ids = tokenizer.encode("one two STOP three", add_special_tokens=False)
    dec = IncrementalDecoder(tokenizer, ["STOP"], holdback=[])
    for tok in ids:
        dec.push(tok)
        if dec.stopped:
            break
    assert dec.stopped
    assert dec.text == "one two "
    assert len(dec.ids) < len(ids)
