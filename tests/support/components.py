"""The gateway's components on an engine and a store the test made, for apps built in-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.tiny_model import load_tokenizer
from gateway.deps import Components
from store import Store


def tiny_components(engine: Any, store: Store, model_dir: Path) -> Components:
    """`engine` (a local or process engine on `model_dir`) and `store`, with the model's
    tokenizer and end ids; the test keeps ownership of both."""
    return Components(
        engine=engine,
        store=store,
        tokenizer=load_tokenizer(model_dir),
        eos_token_ids=engine.eos_token_ids,
        model_name="tiny",
    )
