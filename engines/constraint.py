"""A sequence's grammar state in the local engine (and the test servers): the tokens a JSON schema
or a grammar allows next, as a mask over the vocabulary (`engines.grammar` says what is constrained
and why llguidance)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import torch

from engines.grammar import GrammarError, constraint_grammar


class Grammars:
    """Matchers for one model: its tokenizer read once, on the first constrained request."""

    def __init__(self, model_dir: str | Path, vocab_size: int) -> None:
        self._model_dir = str(model_dir)
        self._vocab = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                hf: Any = AutoTokenizer.from_pretrained(self._model_dir)
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self._vocab)
            return self._tokenizer

    def matcher(self, json_schema: str | None, grammar: str | None) -> Constraint | None:
        """A fresh matcher for one sequence held to `json_schema` or `grammar`
        (`SamplingParams`' fields; None when neither is set); `GrammarError` when it does not
        compile."""
        compiled = constraint_grammar(json_schema, grammar)
        if compiled is None:
            return None
        tokenizer = self._ll_tokenizer()
        m = llguidance.LLMatcher(tokenizer, compiled)
        if m.is_error():
            raise GrammarError(f"the grammar cannot be used: {m.get_error()}")
        return Constraint(m, self._vocab, int(tokenizer.eos_token))


class Constraint:
    """One sequence's grammar state: which tokens may come next (`allowed`), then the one drawn
    (`accept`)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, grammar_eos: int) -> None:
        self._m = matcher
        self._vocab = vocab_size
        self._eos = grammar_eos
        self._shifts = torch.arange(32, dtype=torch.int32)

    @property
    def done(self) -> bool:
        """The JSON is complete and nothing may extend it."""
        return bool(self._m.is_stopped())

    def allowed(self, stops: frozenset[int]) -> torch.Tensor:
        """[V] bool: the tokens that keep the output valid; `stops` (the request's end tokens)
        only where the JSON is complete."""
        if self.done:
            allow = torch.zeros(self._vocab, dtype=torch.bool)
        else:
            # one bit per token, 32 to a word (llguidance.torch would compile a kernel at import)
            words = torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.int32)
            allow = ((words[:, None] >> self._shifts) & 1).bool().reshape(-1)[: self._vocab]
            allow[self._eos] = False  # the grammar's end is the request's stops, below
        complete = self.done or bool(self._m.is_accepting())
        ids = [t for t in stops if 0 <= t < self._vocab]
        if ids:
            allow[ids] = complete
        return allow

    def accept(self, token: int) -> None:
        """Advance past a drawn token that is not an end token."""
        if not self._m.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._m.get_error()}")
