"""The FSDP2 training backend: a Hugging Face causal LM sharded with `fully_shard`.

One process or many under `torchrun` (gloo on CPU, NCCL on CUDA). Without torchrun it forms a
process group of one, so a single process runs the same sharded code path as many. The backend
takes an `Allocation` (`trainer.parallel.strategy`) and builds its mesh (`trainer.parallel.mesh`):
FSDP2 implements data, tensor and context parallelism (`trainer.backends.config`), so the mesh is
`dp`, with `cp` and `tp` inside it where their sizes are above 1.

Tensor parallelism. With a tensor size above 1 the model is first split over the `tp` submesh
(`trainer.parallel.tensor`: Megatron's colwise/rowwise split of every layer, the LM head over the
vocabulary), then `fully_shard` shards every parameter over the `dp` submesh as without it. The
logits stay split over the vocabulary: logprobs and entropies come from the slices
(`trainer.parallel.vocab`), equal on every tensor rank. The heads must divide by the tensor size;
the backend checks that (`check_model_fits`) before it loads any weights.

Context parallelism (Ulysses). With a context size c above 1 the c ranks of a context group train
the same sequences, each holding a contiguous 1/c slice of every packed row (padded at its end to
a multiple of c; `trainer.parallel.context`): embedding, norms, MLP, LM head and the per-position
logprobs and entropies run on the slice, and attention trades tokens for heads in all-to-alls
around the per-sequence kernel (`trainer.parallel.ulysses`, registered as an attention
implementation, so the Hugging Face code is unchanged). Heads, key-value heads repeated where
fewer, split over the context ranks as `check_model_fits` checks. The slices' per-position values
are gathered into the whole row (differentiably), so the loss callback sees the whole
micro-batch, the same on every context rank, and each rank back-propagates it through its own
slice only. FSDP shards and averages over data x context ranks (`dp_cp`).

Data parallelism. Every rank is called with the full batch and takes its data rank's share:
sequences sorted longest first (ties by index), data rank r of D taking every D-th from r; the
tensor and context ranks of one data rank train the same sequences. Each rank packs its share into
token-budget micro-batches, and ranks with fewer micro-batches than the busiest one run empty
forward/backward passes so that the collectives line up (every rank can plan every rank's
micro-batches, so this needs no communication). The loss callback divides by a normaliser of the
whole batch; FSDP averages gradients over the D data ranks (D x C with context parallelism), so
each rank scales its loss by D (D x C) to turn that average into the sum the global normaliser
expects: a context rank's gradient is its slice's share of its micro-batches' loss, and the C
shares add up to that loss's gradient. Stats and scores are gathered over the data ranks (the
context ranks of one hold the same). One process and many therefore compute the same gradient
up to float summation order.

Checkpoints are torch.distributed.checkpoint (DCP) directories of model and optimizer state
(resharded on load, so the world size may change) plus `trainer_state.json` with the step and the
LR schedule.
"""

from __future__ import annotations

import atexit
import gc
import math
import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from engines.base import TensorMeta
from trainer.backends.base import EntropyMode, LossFn
from trainer.backends.config import (
    DATA_PARALLEL,
    OPTIMIZER_DEFAULTS,
    check_context_attention,
    check_implemented,
    check_prefix_sharing,
)
from trainer.backends.update import (
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
    pack_rows,
    plan_rows,
    token_entropy,
    token_logprobs,
    tree_shards,
    unpack_token_values,
)
from trainer.parallel.context import ContextGroup, RowSlice, gather_row, slice_row
from trainer.parallel.mesh import build_mesh, context_mesh, data_mesh, tensor_mesh
from trainer.parallel.strategy import Allocation
from trainer.parallel.tensor import apply_tensor_parallel, check_model_fits
from trainer.parallel.ulysses import UlyssesRow
from trainer.parallel.ulysses import register as register_ulysses
from trainer.parallel.vocab import (
    VocabShard,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_shard,
)
from trainer.weights import buckets_of, tensor_meta

MixedPrecision = Literal["fp32", "bf16"]
Attention = Literal["varlen", "sdpa", "eager", "flash_attention_2"]

_T = TypeVar("_T")


def init_distributed(device_type: str) -> tuple[int, int]:
    """Joins (or forms) the default process group and returns (rank, world size).

    Under torchrun (RANK and WORLD_SIZE set) it joins the launched group; otherwise it forms a group
    of one from an in-memory store. An existing default group is reused.
    """
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            store = dist.HashStore()  # type: ignore[attr-defined]
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
        # the end of a program that does not call it itself (`rlgateway train` does)
        atexit.register(shutdown_distributed)
    return dist.get_rank(), dist.get_world_size()


_meshes: list[weakref.ref[DeviceMesh]] = []
"""The root meshes of the backends' parameters (`_hold_meshes`), for `shutdown_distributed`."""


def shutdown_distributed() -> None:
    """Destroys every process group and frees it, joining its threads (idempotent). Call it on
    every rank once every collective is done and the backends are dropped: `rlgateway train` does
    at its end; an atexit hook does otherwise.

    `destroy_process_group` only unregisters the groups. A gloo group's worker threads run until
    the group object is freed, and other holders keep it: each root mesh (torch's
    `DeviceMesh._pg_registry`; DTensor's caches keep the meshes after their backends) and the
    backends themselves, in reference cycles through FSDP's module state, until the collector
    runs. Freed in the interpreter's finalization instead, a group may still have a worker thread
    releasing its last collective's tensors, whose Python objects need the GIL; granted it once the
    interpreter is finalizing, the thread ends by pthread_exit inside a noexcept destructor:
    std::terminate ("terminate called without an active exception", SIGABRT) after the run's work
    is done. Here they are freed with the interpreter intact (torch frees a group with the GIL
    released, so its workers finish). Groups that megatron-core's parallel state holds (the
    Megatron backend's) are not released here."""
    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    for ref in _meshes:
        mesh = ref()
        if mesh is not None:
            mesh._pg_registry.clear()
    _meshes.clear()
    gc.collect()


def _hold_meshes(meshes: Iterable[DeviceMesh]) -> None:
    """Has `shutdown_distributed` release the groups of `meshes`' roots (where they are kept)."""
    _meshes[:] = [ref for ref in _meshes if ref() is not None]
    roots = {id(root): root for root in (mesh._get_root_mesh() for mesh in meshes)}
    _meshes.extend(weakref.ref(root) for root in roots.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    """The full value of a possibly sharded tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class FSDPBackend:
    """A `TrainBackend` over FSDP2. Every rank constructs it with the same arguments."""

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
        attention: Attention = "varlen",
        prefix_sharing: bool = False,
        allocation: Allocation = DATA_PARALLEL,
    ) -> None:
        from transformers import AutoConfig
        from transformers.utils import logging as hf_logging

        if lr < 0 or total_steps < 1 or warmup_steps < 0:
            raise ValueError("lr must be at least 0, total_steps >= 1 and warmup_steps >= 0")
        if mixed_precision not in ("fp32", "bf16"):
            raise ValueError(f"mixed_precision must be fp32 or bf16, not {mixed_precision!r}")
        cuda = torch.cuda.is_available()
        if mixed_precision == "bf16" and cuda and not torch.cuda.is_bf16_supported():
            raise ValueError("this GPU has no bfloat16 support: use mixed_precision fp32")
        check_implemented(allocation)
        check_model_fits(allocation.strategy, AutoConfig.from_pretrained(str(model_dir)))
        check_context_attention(allocation, attention)
        check_prefix_sharing(allocation, attention, prefix_sharing)
        self.prefix_sharing = prefix_sharing
        """Pack prefix-shared trees (`trainer.prefix`) instead of whole sequences."""

        device_type = "cuda" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        self.rank, self.world_size = init_distributed(device_type)
        self.strategy = allocation.for_world(self.world_size)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        )
        self.model_dir = Path(model_dir)
        torch.manual_seed(seed)  # for models whose config enables dropout

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        if attention == "varlen":
            from trainer.attention import register

            attn_implementation = register()
            if allocation.strategy.context > 1:  # Ulysses around the per-sequence kernel
                attn_implementation = register_ulysses()
        else:
            attn_implementation = attention
        model = self._load_model(str(model_dir), attn_implementation)
        model.config.use_cache = False
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )

        self.mesh = build_mesh(self.strategy, device_type)
        mesh = data_mesh(self.mesh)
        # FSDP averages gradients over these ranks (dp, or dp x cp)
        self._reduce_size = mesh.size()
        dp_mesh = self.mesh["dp"]
        self.dp_rank, self.dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
        self._dp_group = dp_mesh.get_group()
        cp_mesh = context_mesh(self.mesh)
        # this rank's place among the ranks that split each row's tokens (context parallel)
        self.context: ContextGroup | None = None
        if cp_mesh is not None:
            self.context = ContextGroup(
                cp_mesh.get_local_rank(), cp_mesh.size(), cp_mesh.get_group()
            )
        tp_mesh = tensor_mesh(self.mesh)
        # this rank's slice of the vocabulary where the logits are split over it (tensor parallel)
        self.vocab: VocabShard | None = None
        if tp_mesh is not None:
            apply_tensor_parallel(model, tp_mesh, self._head_plan())
            self.vocab = self._vocab_shard(model, tp_mesh)
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if mixed_precision == "bf16"
            else MixedPrecisionPolicy()
        )
        self._shard(model, mesh, mp)
        # every mesh the model's shards live on (a subclass's expert mesh too)
        _hold_meshes(
            [self.mesh, *(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))]
        )
        self.model = model

        self.grad_clip = grad_clip
        # foreach: a few multi-tensor kernels per step instead of a Python loop over parameters
        # (PyTorch's default on CPU); 25-30% off a demo-sized step (BENCHMARKS.md, "The demo")
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, foreach=True
        )
        self.schedule = LRSchedule(schedule, warmup_steps, total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        self.step = 0

    def _shard(self, model: Any, mesh: DeviceMesh, mp: MixedPrecisionPolicy) -> None:
        """FSDP2 over `mesh`: one unit per decoder layer (the classes HF says must not be
        split), then the rest (a subclass shards some modules over another mesh first)."""
        layer_classes = set(model._no_split_modules or ())
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)

    def _load_model(self, model_dir: str, attn_implementation: str) -> Any:
        """The HF model to train, in float32 (a subclass trains another head)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=attn_implementation
        )

    def _head_plan(self) -> dict[str, ParallelStyle]:
        """How tensor parallelism splits the output head: the LM head over the vocabulary, its
        logits left as this rank's slice (a subclass with another head overrides this)."""
        return {"lm_head": ColwiseParallel()}

    def _vocab_shard(self, model: Any, tp_mesh: DeviceMesh) -> VocabShard | None:
        """This rank's slice of the LM head's vocabulary, after `_head_plan` split it."""
        shard = vocab_shard(model.config.vocab_size, tp_mesh)
        rows = model.get_output_embeddings().weight.to_local().shape[0]
        assert rows == shard.end - shard.start, f"{rows} LM-head rows here, slice {shard}"
        return shard

    def _per_position(
        self, logits: torch.Tensor, targets_1T: torch.Tensor, temp: float | torch.Tensor
    ) -> torch.Tensor:
        """What the loss sees at each position of `logits` [1, T, V], [1, T] float32: here the
        logprob of the position's target at its temperature (a subclass returns values)."""
        if self.vocab is not None:
            return vocab_parallel_logprobs(logits, targets_1T, self.vocab, temp)
        return token_logprobs(logits, targets_1T, temp)

    def _entropy(
        self, logits: torch.Tensor, temp: float | torch.Tensor, mode: EntropyMode
    ) -> torch.Tensor | None:
        """The policy's entropy at each position of `logits` (see `LossFn`), or None when off."""
        if mode == "off":
            return None
        if mode == "loss":
            return self._token_entropy(logits, temp)
        with torch.no_grad():
            return self._token_entropy(logits.detach(), temp)

    def _token_entropy(self, logits: torch.Tensor, temp: float | torch.Tensor) -> torch.Tensor:
        if self.vocab is not None:
            return vocab_parallel_entropy(logits, self.vocab, temp)
        return token_entropy(logits, temp)

    # -- data parallelism ------------------------------------------------------------------------

    def _shards(self, seqs: Sequence[TrainSequence], token_budget: int) -> list[list[int]]:
        """Indices into `seqs` that each data rank trains on (its tensor ranks all do); with
        prefix sharing whole trees go to a rank, so the sequences that share stay together."""
        if self.prefix_sharing and self.dp_size > 1:
            return tree_shards(seqs, self.dp_size, token_budget)
        return data_shards([len(s) for s in seqs], self.dp_size)

    def _plan(
        self, seqs: Sequence[TrainSequence], token_budget: int
    ) -> tuple[list[int], list[MicroBatch], int]:
        """This rank's share of `seqs` (indices), its micro-batches, and the number of passes
        every rank runs (the busiest rank's micro-batches): every rank's rows planned once."""
        shards = self._shards(seqs, token_budget)
        plans = [
            plan_rows([seqs[i] for i in shard], token_budget, prefix_sharing=self.prefix_sharing)
            for shard in shards
        ]
        ids = shards[self.dp_rank]
        micro = pack_rows([seqs[i] for i in ids], plans[self.dp_rank])
        return ids, micro, max(len(plan) for plan in plans)

    def _forward(
        self, input_ids_1T: torch.Tensor, position_ids_1T: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids_1T, position_ids=position_ids_1T, use_cache=False, **kwargs
        )
        logits: torch.Tensor = out.logits
        return logits

    def _forward_slice(self, part: RowSlice) -> torch.Tensor:
        """The logits of this context rank's slice of a row (Ulysses attention over the row)."""
        assert self.context is not None
        row = UlyssesRow(self.context.group, self.context.size, part.row_position_ids_1P)
        return self._forward(part.input_ids_1L, part.position_ids_1L, ulysses=row)

    def _row(
        self, mb: MicroBatch, temperature: float, entropy: EntropyMode
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of `mb`: `_per_position` and `_entropy` at every position of its row,
        [1, T] each, on every rank. Context ranks each run their slice of the row
        (`trainer.parallel.context`) and gather the results (differentiably)."""
        if self.context is None:
            logits = self._forward(mb.input_ids_1T, mb.position_ids_1T)
            temp = mb.temperature_1T if mb.temperature_1T is not None else temperature
            entropy_1T = self._entropy(logits, temp, entropy)
            return self._per_position(logits, mb.targets_1T, temp), entropy_1T
        context = self.context
        part = slice_row(
            mb.input_ids_1T,
            mb.position_ids_1T,
            mb.targets_1T,
            mb.temperature_1T,
            context.size,
            context.rank,
        )
        logits = self._forward_slice(part)
        temp_l = part.temperature_1L if part.temperature_1L is not None else temperature
        entropy_1L = self._entropy(logits, temp_l, entropy)
        out_1T = gather_row(self._per_position(logits, part.targets_1L, temp_l), part, context)
        if entropy_1L is None:
            return out_1T, None
        return out_1T, gather_row(entropy_1L, part, context)

    def _empty_pass(self, backward: bool) -> None:
        """A one-token pass that changes nothing, so this rank joins FSDP's collectives (and,
        context parallel, its group's all-to-alls: a row of one token per context rank)."""
        one = torch.zeros((1, 1), dtype=torch.int64, device=self.device)
        if self.context is None:
            logits = self._forward(one, one)
        else:
            part = slice_row(one, one, one, None, self.context.size, self.context.rank)
            logits = self._forward_slice(part)
        if backward:
            torch.autograd.backward(logits.sum() * 0.0)

    def _gather(self, obj: _T) -> list[_T]:
        """`obj` of every data rank (a small picklable value), in data-rank order; the tensor
        and context ranks of a data rank hold the same one."""
        if self.dp_size == 1:
            return [obj]
        out: list[Any] = [None] * self.dp_size
        dist.all_gather_object(out, obj, group=self._dp_group)
        return out

    # -- the TrainBackend protocol ---------------------------------------------------------------

    def forward_logprobs(
        self, seqs: Sequence[TrainSequence], temperature: float, *, token_budget: int = 8192
    ) -> list[list[float]]:
        return self._score(seqs, temperature, token_budget)

    def _score(
        self, seqs: Sequence[TrainSequence], temperature: float, token_budget: int
    ) -> list[list[float]]:
        """`_per_position` of every sequence without grad, unpacked per token, on every rank."""
        ids, micro, passes = self._plan(seqs, token_budget)
        results: dict[int, list[float]] = {}
        self.model.eval()
        with torch.no_grad():
            for k in range(passes):
                if k >= len(micro):
                    self._empty_pass(backward=False)
                    continue
                mb = micro[k].to(self.device)
                out_1T, _ = self._row(mb, temperature, "off")
                for j, values in zip(mb.seq_ids, unpack_token_values(out_1T, mb), strict=True):
                    results[ids[j]] = values
        for part in self._gather(results):
            results |= part
        return [results[i] for i in range(len(seqs))]

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
        _, micro, passes = self._plan(seqs, token_budget)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        records: list[StepRecord] = []
        for k in range(passes):
            if k >= len(micro):
                self._empty_pass(backward=True)
                continue
            mb = micro[k].to(self.device)
            out_1T, entropy_1T = self._row(mb, temperature, entropy)
            loss, stats = loss_fn(out_1T, mb, global_norm, entropy_1T)
            auxiliary = self._auxiliary_loss(len(seqs))
            if auxiliary is not None:
                loss = loss + auxiliary
            # FSDP averages gradients over the data (and context) ranks; the global normaliser
            # wants their sum (a context rank's gradient is its slice's share of this loss).
            torch.autograd.backward(loss * self._reduce_size)
            values = {key: float(v) for key, v in stats.items()}
            records.append((mb.num_loss_tokens, float(loss.detach()), values))

        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        grad_norm = self._clip_grad_norm(max_norm)
        lr = apply_update(self.optimizer, self.scheduler, grad_norm, self.step, step_schedule)
        self.step += 1

        gathered = [r for part in self._gather(records) for r in part]
        return step_stats(gathered, grad_norm, lr)

    def _auxiliary_loss(self, num_seqs: int) -> torch.Tensor | None:
        """A term the model adds to the loss of the micro-batch just run forward (a subclass's
        router balance loss), already divided by the batch's share; None: nothing."""
        return None

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Clips the gradients to `max_norm` and returns their norm before clipping."""
        return float(_local(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)))

    def weight_metas(self) -> list[TensorMeta]:
        return [tensor_meta(name, t) for name, t in self.model.state_dict().items()]

    def weight_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        state = self.model.state_dict()  # this rank's shards (DTensors), HF names
        for bucket in buckets_of([tensor_meta(name, t) for name, t in state.items()], bucket_bytes):
            out: dict[str, torch.Tensor] = {}
            for meta in bucket:
                # gathered over its mesh (FSDP, tensor and expert shards), one at a time
                full = _local(state[meta.name]).detach()
                if self.rank == 0:  # a copy: an unsharded tensor is the live parameter
                    out[meta.name] = full.to("cpu", copy=True)
                del full
            yield out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=options))

    def save(self, path: str | Path) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
        if self.rank == 0:
            write_state(Path(path), self.step, self.schedule, self.scheduler)
        dist.barrier()

    def load(self, path: str | Path) -> None:
        state = read_state(Path(path), self.schedule)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        loaded: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp_load(loaded, checkpoint_id=str(path))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=loaded["model"],
            optim_state_dict=loaded["optim"],
        )
        restore_scheduler(self.scheduler, state)
        self.step = int(state["step"])
