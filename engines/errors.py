"""The engines' exception tree. The gateway maps these to HTTP errors at its route edge.

EngineError
├── InvalidRequestError (also a ValueError: the caller's input is wrong)
│   ├── EmptyPromptError
│   ├── PromptTooLongError
│   ├── TokenOutOfRangeError
│   └── InvalidSamplingError
├── EngineUnavailableError (closed, failed, restarting or unreachable; may say when to retry)
│   └── RequestFailedError (the engine failed while serving one request; the others go on)
└── WeightUpdateError (a weight update was refused; the old weights stay in place)
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error an engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request is malformed; retrying it unchanged fails again."""


class EmptyPromptError(InvalidRequestError):
    def __init__(self) -> None:
        super().__init__("the prompt is empty: give at least one token id")


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit the model's context."""

    def __init__(self, prompt_len: int, max_new_tokens: int, max_model_len: int) -> None:
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.max_model_len = max_model_len
        if prompt_len >= max_model_len:
            msg = (
                f"the prompt has {prompt_len} tokens but the model's context is {max_model_len} "
                f"tokens: shorten the prompt to at most {max_model_len - 1} tokens"
            )
        else:
            msg = (
                f"the prompt has {prompt_len} tokens and {max_new_tokens} new tokens were asked "
                f"for, {prompt_len + max_new_tokens} in all, but the model's context is "
                f"{max_model_len} tokens: ask for at most {max_model_len - prompt_len} new tokens"
            )
        super().__init__(msg)


class TokenOutOfRangeError(InvalidRequestError):
    def __init__(self, token_id: int, vocab_size: int) -> None:
        self.token_id = token_id
        self.vocab_size = vocab_size
        super().__init__(
            f"prompt token id {token_id} is outside the vocabulary [0, {vocab_size}): "
            "encode the prompt with this model's tokenizer"
        )


class InvalidSamplingError(InvalidRequestError):
    """A sampling parameter is out of range; the message names it and its valid range."""


class EngineUnavailableError(EngineError):
    """The engine cannot serve now (closed, crashed, restarting, or unreachable); retry elsewhere
    or later. `retry_after`, when set, is how many seconds from now a retry may succeed (an
    engine that is restarting itself); the gateway sends it as `Retry-After`."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailedError(EngineUnavailableError):
    """The engine failed while serving this request (a fault in its computation, not in the
    request's parameters, which were checked); the engine and its other requests go on, so a
    retry may succeed."""


class WeightUpdateError(EngineError):
    """A weight update was refused (unreadable files, wrong names, shapes or dtypes, non-finite
    values, a version out of range); the engine serves the previous weights at the previous
    version."""
