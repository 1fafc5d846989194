"""The Megatron training backend: megatron-core's GPT, tensor, pipeline and data parallel.

AReaL's engine for the largest dense models. The policy is megatron-core's `GPTModel` (local layer
spec, `trainer.megatron.model`), built from the Hugging Face config and loaded from the Hugging
Face weights (`trainer.megatron.convert`), so the trained model, its published weights and its
exports are Hugging Face's. megatron-core is an optional extra (`pip install -e '.[megatron]'`)
and is written for CUDA: on a CPU the backend runs only where a harness has redirected its CUDA
calls (tests/support/megatron_cpu.py, which the tests apply), and refuses otherwise.

Parallelism. The world is data x tensor x pipeline ranks (`megatron:d1t2p2`), laid out by
megatron-core's `parallel_state` (tensor ranks consecutive, then data, then pipeline stages). A
tensor rank holds its heads' slice of every layer and its slice of the (padded) vocabulary; the
logprobs come from the vocabulary slices (`trainer.parallel.vocab`, Megatron's vocab-parallel
cross entropy), never from a gathered vocabulary. A pipeline stage holds consecutive layers and
megatron-core's schedule (1F1B; no pipelining with one stage) runs the micro-batches through the
stages, passing activations between them; the loss callback runs on the last stage. Data ranks
take shares of the batch as FSDP's do (`trainer.batch.data_shards`), each packing its share into
token-budget micro-batches; after the schedule the gradients are summed over the data ranks (the
loss callback already divides by the whole batch's normaliser), so one process and many compute
the same gradient up to summation order. Every data rank holds the whole (tensor- and
pipeline-split) model and AdamW state: no optimizer sharding.

Grad clipping takes one norm over every rank's parameters (a tensor-split parameter's slices
summed over the tensor ranks, a replicated one, such as a norm's weight, counted once, stages
summed), with `torch.nn.utils.clip_grad_norm_`'s formula, so the step equals the FSDP backend's
(tests/integration/trainer/test_megatron.py: loss, grad norm and parameters to 1e-5).

Checkpoints: each (tensor rank, stage) writes its parameters and AdamW state (`torch.save`; data
ranks hold copies, data rank 0 writes), plus `trainer_state.json` with the step, the LR schedule
and the layout, so a checkpoint resumes bit-exactly on the same tensor and pipeline sizes (any
data size) and `hf_weights` turns it into Hugging Face weights without megatron-core (export).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engines.base import TensorMeta
from trainer.backends.base import EntropyMode, LossFn
from trainer.backends.config import OPTIMIZER_DEFAULTS, check_implemented
from trainer.backends.fsdp import MixedPrecision, init_distributed
from trainer.backends.update import (
    STATE_FILE,
    LRSchedule,
    Schedule,
    StepRecord,
    apply_update,
    check_step,
    read_state,
    restore_scheduler,
    step_stats,
    write_state,
)
from trainer.batch import (
    MicroBatch,
    TrainSequence,
    data_shards,
    pack,
    token_entropy,
    token_logprobs,
    unpack_token_values,
)
from trainer.megatron.convert import (
    Layout,
    full_shape,
    megatron_names,
    merge_tensor_ranks,
    split_of,
    to_hf,
    to_megatron,
    vocab_range,
)
from trainer.megatron.model import build_stage, packed_mask
from trainer.parallel.strategy import Allocation
from trainer.parallel.vocab import VocabShard, vocab_parallel_entropy, vocab_parallel_logprobs
from trainer.weights import buckets_of

LAYOUT_KEY = "megatron_layout"
"""`trainer_state.json`'s record of the checkpoint's `Layout`."""


MEGATRON = Allocation(backend="megatron")
"""A bare `megatron`: data parallel over every rank, no tensor or pipeline split."""


def _shard_file(path: Path, rank: int, stage: int) -> Path:
    return path / f"megatron-t{rank}-p{stage}.pt"


def import_megatron() -> Any:
    """megatron.core with the parts the backend uses, or ImportError saying how to install it.
    Their import warns that Apex and Transformer Engine are missing (the local layer spec needs
    neither) and that torch.jit is deprecated: those warnings are silenced here, once."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core
            import megatron.core.models.gpt
            import megatron.core.pipeline_parallel
    except ImportError as exc:
        raise ImportError(
            "the megatron backend needs megatron-core: pip install -e '.[megatron]'"
        ) from exc
    return megatron.core


class _LazyTensors(Mapping[str, torch.Tensor]):
    """The tensors of a Hugging Face model directory's safetensors files, each read when asked."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        self._files: dict[str, Any] = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            handle: Any = safe_open(str(f), framework="pt")
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                self._files[key] = handle
        if not self._files:
            raise ValueError(f"{model_dir} holds no *.safetensors weights")

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._files[key].get_tensor(key)  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


class MegatronBackend:
    """A `TrainBackend` over megatron-core. Every rank constructs it with the same arguments."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        lr: float = OPTIMIZER_DEFAULTS.lr,
        weight_decay: float = OPTIMIZER_DEFAULTS.weight_decay,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = OPTIMIZER_DEFAULTS.grad_clip,
        warmup_steps: int = OPTIMIZER_DEFAULTS.warmup_steps,
        total_steps: int = 1,
        schedule: Schedule = OPTIMIZER_DEFAULTS.schedule,
        mixed_precision: MixedPrecision = OPTIMIZER_DEFAULTS.mixed_precision,
        gradient_checkpointing: bool = OPTIMIZER_DEFAULTS.gradient_checkpointing,
        seed: int = OPTIMIZER_DEFAULTS.seed,
        allocation: Allocation = MEGATRON,
    ) -> None:
        from transformers import AutoConfig

        core = import_megatron()
        from megatron.core import parallel_state

        if lr < 0 or total_steps < 1 or warmup_steps < 0:
            raise ValueError("lr must be at least 0, total_steps >= 1 and warmup_steps >= 0")
        if mixed_precision != "fp32":
            raise ValueError(
                f"the megatron backend trains in fp32; mixed_precision {mixed_precision!r} is not "
                "implemented (megatron-core's bf16 needs its Float16Module and distributed "
                "optimizer): use fp32, or fsdp for bf16"
            )
        check_implemented(allocation)
        self.model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(str(model_dir))
        strategy = allocation.strategy
        layout = Layout.of(config, strategy.tensor, strategy.pipeline)
        if layout.tied and layout.pipeline > 1:
            raise ValueError(
                "pipeline parallel needs untied input and output embeddings (they sit on the "
                "first and the last stage); this model ties them: use tensor parallel only"
            )
        self.layout = layout
        cuda = torch.cuda.is_available()
        if not cuda and not getattr(core, "_rlgateway_cpu_shim", False):
            raise RuntimeError(
                "the megatron backend runs on CUDA GPUs (megatron-core calls torch.cuda "
                "directly); on a CPU train with fsdp"
            )

        device_type = "cuda" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        self.rank, self.world_size = init_distributed(device_type)
        self.strategy = allocation.for_world(self.world_size)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        )
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tensor,
                pipeline_model_parallel_size=layout.pipeline,
            )
        torch.manual_seed(seed)
        if cuda:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.stage_index = parallel_state.get_pipeline_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self._tp_group = parallel_state.get_tensor_model_parallel_group()
        self._dp_group = parallel_state.get_data_parallel_group()
        self._mp_group = parallel_state.get_model_parallel_group()
        self._pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.is_last_stage = self.stage_index == layout.pipeline - 1
        start, end = vocab_range(layout, self.tp_rank)
        self.vocab_columns = (start, end)
        """The vocabulary ids [start, end) of this tensor rank's first logit columns."""
        self._vocab_columns = end - start
        self.vocab: VocabShard | None = None
        if layout.tensor > 1:
            self.vocab = VocabShard(start=start, end=end, size=layout.vocab, group=self._tp_group)

        stage = build_stage(config, layout, self.stage_index, recompute=gradient_checkpointing)
        hf = _LazyTensors(self.model_dir)
        weights = {
            name: t.to(torch.float32)
            for name, t in to_megatron(hf, layout, self.tp_rank, self.stage_index).items()
        }
        missing, unexpected = stage.module.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        assert not missing, missing
        assert not unexpected, unexpected
        self.stage = stage.to(self.device)

        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(
            self.stage.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, foreach=True
        )
        self.schedule = LRSchedule(schedule, warmup_steps, total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        self.step = 0

    # -- forward ---------------------------------------------------------------------------------

    def _logits(self, mb: MicroBatch) -> torch.Tensor:
        """The stage's output for `mb`: hidden states, or on the last stage logits [T, 1, v]."""
        mask = packed_mask(mb.position_ids_1T)
        return self.stage(mb.input_ids_1T, mb.position_ids_1T, mask)  # type: ignore[no-any-return]

    def _per_position(
        self, logits_T1V: torch.Tensor, mb: MicroBatch, temperature: float, entropy: EntropyMode
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs [1, T] of `mb`'s targets (and entropies, as `entropy` says) from this tensor
        rank's logits, the vocabulary padding dropped."""
        logits = logits_T1V.transpose(0, 1)[..., : self._vocab_columns]
        temp = mb.temperature_1T if mb.temperature_1T is not None else temperature
        if self.vocab is not None:
            logp = vocab_parallel_logprobs(logits, mb.targets_1T, self.vocab, temp)
        else:
            logp = token_logprobs(logits, mb.targets_1T, temp)
        if entropy == "off":
            return logp, None
        source = logits if entropy == "loss" else logits.detach()
        with torch.set_grad_enabled(entropy == "loss" and torch.is_grad_enabled()):
            if self.vocab is not None:
                return logp, vocab_parallel_entropy(source, self.vocab, temp)
            return logp, token_entropy(source, temp)

    def _run(self, micro: list[MicroBatch], loss_of: Any, *, forward_only: bool) -> None:
        """megatron-core's schedule over `micro`: forward (and backward) through the stages,
        `loss_of(logits, mb)` -> (loss, stats) on the last stage."""
        if not micro:
            return
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data)
            out = self._logits(mb)

            def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
                loss = loss_of(logits, mb)
                return loss, torch.tensor(mb.num_loss_tokens), {}

            return out, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[self.stage],
            num_microbatches=len(micro),
            seq_length=max(mb.num_tokens for mb in micro),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _mine(self, seqs: Sequence[TrainSequence]) -> list[int]:
        return data_shards([len(s) for s in seqs], self.dp_size)[self.dp_rank]

    def _from_last_stage(self, obj: Any) -> list[Any]:
        """`obj` of the last stage's first tensor rank of every data rank, on every rank."""
        mine = obj if self.is_last_stage and self.tp_rank == 0 else None
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, mine)
        return [x for x in out if x is not None]

    # -- the TrainBackend protocol ---------------------------------------------------------------

    def forward_logprobs(
        self, seqs: Sequence[TrainSequence], temperature: float, *, token_budget: int = 8192
    ) -> list[list[float]]:
        ids = self._mine(seqs)
        micro = [mb.to(self.device) for mb in pack([seqs[i] for i in ids], token_budget)]
        results: dict[int, list[float]] = {}

        def score(logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
            logp, _ = self._per_position(logits, mb, temperature, "off")
            for j, values in zip(mb.seq_ids, unpack_token_values(logp, mb), strict=True):
                results[ids[j]] = values
            return logp.new_zeros(())

        self.stage.eval()
        with torch.no_grad():
            self._run(micro, score, forward_only=True)
        merged: dict[int, list[float]] = {}
        for part in self._from_last_stage(results):
            merged |= part
        return [merged[i] for i in range(len(seqs))]

    def train_step(
        self,
        seqs: Sequence[TrainSequence],
        loss_fn: LossFn,
        *,
        temperature: float,
        token_budget: int,
        global_norm: float,
        entropy: EntropyMode = "off",
        step_schedule: bool = True,
    ) -> dict[str, float]:
        check_step(seqs, global_norm)
        micro = [
            mb.to(self.device) for mb in pack([seqs[i] for i in self._mine(seqs)], token_budget)
        ]
        records: list[StepRecord] = []

        def loss_of(logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
            logp, entropy_1T = self._per_position(logits, mb, temperature, entropy)
            loss, stats = loss_fn(logp, mb, global_norm, entropy_1T)
            values = {key: float(v) for key, v in stats.items()}
            records.append((mb.num_loss_tokens, float(loss.detach()), values))
            return loss

        self.stage.train()
        self.optimizer.zero_grad(set_to_none=True)
        self._run(micro, loss_of, forward_only=False)
        self._reduce_gradients()
        grad_norm = self._clip_grad_norm(self.grad_clip if self.grad_clip > 0 else math.inf)
        lr = apply_update(self.optimizer, self.scheduler, grad_norm, self.step, step_schedule)
        self.step += 1
        return step_stats(
            [r for part in self._from_last_stage(records) for r in part], grad_norm, lr
        )

    def _reduce_gradients(self) -> None:
        """Every parameter's gradient summed over the data ranks (zeros where a rank had none),
        and the q/k norms' over the tensor ranks: a tensor rank's q/k norm (one weight shared by
        every head) sees only its own heads (megatron-core's `finalize_model_grads` does the
        same)."""
        named = list(self.stage.module.named_parameters())
        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.layout.tensor > 1 and self.layout.qk_norm:
            for name, p in named:
                if "q_layernorm" in name or "k_layernorm" in name:
                    assert p.grad is not None
                    dist.all_reduce(p.grad, group=self._tp_group)
        if self.dp_size > 1:
            for _, p in named:
                assert p.grad is not None
                dist.all_reduce(p.grad, group=self._dp_group)

    def _clip_grad_norm(self, max_norm: float) -> float:
        """The global gradient norm over every stage and tensor slice (a replicated parameter
        once); gradients scaled by `clip_grad_norm_`'s coefficient. Returns the norm."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        params = list(self.stage.parameters())
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in params:
            if param_is_not_tensor_parallel_duplicate(p) or self.tp_rank == 0:
                assert p.grad is not None
                squares += p.grad.detach().float().pow(2).sum()
        dist.all_reduce(squares, group=self._mp_group)
        norm = squares.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            assert p.grad is not None
            p.grad.mul_(coef.to(p.grad.dtype))
        return float(norm)

    # -- weights ---------------------------------------------------------------------------------

    def _hf_metas(self) -> list[tuple[TensorMeta, str, int]]:
        """(HF meta, Megatron tensor, stage) of every weight, stage by stage."""
        out = []
        for stage in range(self.layout.pipeline):
            for name in megatron_names(self.layout, stage):
                shape = full_shape(self.layout, name)
                for hf_name, t in to_hf(
                    self.layout, name, stage, torch.empty(shape, device="meta")
                ).items():
                    out.append((TensorMeta(hf_name, "float32", tuple(t.shape)), name, stage))
        return out

    def weight_metas(self) -> list[TensorMeta]:
        return [meta for meta, _, _ in self._hf_metas()]

    def _gather(
        self, name: str, stage: int, state: Mapping[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """Stage `stage`'s full Megatron tensor `name` on global rank 0 (None elsewhere): an
        all-gather over that stage's tensor ranks (data rank 0's) of their part in `state` (this
        rank's state dict), then sent to rank 0."""
        full: torch.Tensor | None = None
        if self.stage_index == stage and self.dp_rank == 0:
            local = state[name].detach()
            if split_of(name) == "replicated" or self.layout.tensor == 1:
                full = local
            else:
                parts = [torch.empty_like(local) for _ in range(self.layout.tensor)]
                dist.all_gather(parts, local.contiguous(), group=self._tp_group)
                full = merge_tensor_ranks(name, parts)
        if stage == 0:
            return full if self.rank == 0 else None
        source = dist.get_global_rank(self._pp_group, stage) if self.rank == 0 else -1
        if self.rank == 0:
            shape = full_shape(self.layout, name)
            received = torch.empty(shape, dtype=torch.float32, device=self.device)
            dist.recv(received, src=source)
            return received
        if full is not None and self.tp_rank == 0:
            dist.send(full.contiguous(), dst=0)
        return None

    def weight_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        placed = {meta.name: (name, stage) for meta, name, stage in self._hf_metas()}
        state = self.stage.module.state_dict()
        cached: tuple[str, int, dict[str, torch.Tensor]] | None = None
        for bucket in buckets_of(self.weight_metas(), bucket_bytes):
            out: dict[str, torch.Tensor] = {}
            for meta in bucket:
                name, stage = placed[meta.name]
                if cached is None or cached[:2] != (name, stage):
                    full = self._gather(name, stage, state)
                    parts = {} if full is None else to_hf(self.layout, name, stage, full)
                    cached = (name, stage, parts)
                if self.rank == 0:
                    out[meta.name] = cached[2][meta.name].to("cpu", copy=True)
            yield out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for bucket in self.weight_buckets(2**62):
            out |= bucket
        return out

    # -- checkpoints -----------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        path = Path(path)
        # the checkpoint writer (rank 0) may be making the directory afresh: after it
        dist.barrier()
        if self.dp_rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            model = {
                k: v
                for k, v in self.stage.module.state_dict().items()
                if not k.endswith("_extra_state")
            }
            state = {"model": model, "optim": self.optimizer.state_dict()}
            torch.save(state, _shard_file(path, self.tp_rank, self.stage_index))
        if self.rank == 0:
            write_state(
                path, self.step, self.schedule, self.scheduler, **{LAYOUT_KEY: asdict(self.layout)}
            )
        dist.barrier()

    def load(self, path: str | Path) -> None:
        path = Path(path)
        state = read_state(path, self.schedule)
        saved = Layout(**state.get(LAYOUT_KEY, {}))
        if saved != self.layout:
            raise ValueError(
                f"checkpoint {path} was saved by the megatron backend split t{saved.tensor} "
                f"p{saved.pipeline}; this one is t{self.layout.tensor} p{self.layout.pipeline}: "
                "resume with the same tensor and pipeline sizes"
            )
        shard = torch.load(
            _shard_file(path, self.tp_rank, self.stage_index), map_location=self.device
        )
        missing, unexpected = self.stage.module.load_state_dict(shard["model"], strict=False)
        assert not unexpected, unexpected
        assert all(k.endswith("_extra_state") for k in missing), missing
        self.optimizer.load_state_dict(shard["optim"])
        restore_scheduler(self.scheduler, state)
        self.step = int(state["step"])


def is_megatron_checkpoint(path: Path) -> bool:
    """Whether checkpoint directory `path` was written by `MegatronBackend.save`."""
    state = path / STATE_FILE
    return state.is_file() and LAYOUT_KEY in json.loads(state.read_text())


def hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """The Hugging Face weights of the Megatron checkpoint `path` (no megatron-core needed):
    every (tensor rank, stage) file read, tensor ranks merged, converted back."""
    layout = Layout(**json.loads((path / STATE_FILE).read_text())[LAYOUT_KEY])
    out: dict[str, torch.Tensor] = {}
    for stage in range(layout.pipeline):
        shards = [
            torch.load(_shard_file(path, r, stage), map_location="cpu", weights_only=True)["model"]
            for r in range(layout.tensor)
        ]
        for name in megatron_names(layout, stage):
            full = merge_tensor_ranks(name, [s[name] for s in shards])
            out |= {k: v.clone() for k, v in to_hf(layout, name, stage, full).items()}
    return out
