"""The trainer's side of the weight group: new weights broadcast to remote inference servers.

The trainer is rank 0 of a `torch.distributed` group that the servers' workers join (ranks 1 ..
world_size - 1), so the weights reach them without a filesystem both sides see. Per publish:

1. ask the gateway how many ranks its servers take and whether the group they joined last is
   intact (`GET /admin/weights/group`); if not, form a new one: open the rendezvous on a free
   port and have every server join it (`POST /admin/weights/group`) at the same time;
2. cut the state dict into buckets of at most `bucket_bytes` (a tensor larger than that goes
   alone), tell the gateway what comes (`POST /admin/weights/broadcast`: names, dtypes and
   shapes per bucket, the version), and meanwhile broadcast the tensors in that order, one
   at a time (only one tensor's copy is made at a time).

Every phase is bounded by `timeout_s`. A version that fails over the group (a server that does
not join, dies, or refuses a bucket; a timeout) is published through `fallback` instead (from
disk: the cold re-sync), and the next publish forms the group again; the servers, all or none,
serve either the old weights or the new ones (`engines.router`, `_broadcast`).

The rendezvous's keys are laid out as SGLang's `init_custom_process_group` lays them out (a
`TCPStore` at the master address, its keys prefixed by the group's name, then by the device),
so SGLang servers join as they are. vLLM's NCCL weight-transfer engine opens a group of its own
making (vLLM's `StatelessProcessGroup` with PyNccl), which a trainer joins only through vLLM's
trainer-side engine: with vLLM servers, publish from disk (docs/architecture.md, "Weights").

`GroupSink` is the gateway's half as the publisher sees it: `AdminSink` over HTTP (`rlgateway
train`), `EngineSink` for a gateway in this process (`serve --train`).
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import queue
import threading
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from engines.base import Broadcast, Engine, WeightGroup, WeightGroupMember, WeightUpdate
from engines.launch import free_port
from trainer.publish import GatewayAdmin, WeightPublisher
from trainer.weights import Weights, buckets_of

log = logging.getLogger(__name__)


class GroupSender:
    """Rank 0 of `group`: opens the rendezvous and waits (up to the group's timeout) for every
    other rank in the constructor, so build it in a thread beside the servers' join."""

    def __init__(self, group: WeightGroup) -> None:
        from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

        self.group = group
        timeout = datetime.timedelta(seconds=group.timeout_s)
        store = TCPStore(
            "0.0.0.0", group.master_port, group.world_size, is_master=True, timeout=timeout
        )
        device = "cuda" if group.backend == "nccl" else "cpu"
        prefixed = PrefixStore(
            f"{device}/", PrefixStore(f"{group.name}/", PrefixStore(group.name, store))
        )
        self._store = store
        self.device = torch.device(device)
        self.pg: Any
        if group.backend == "nccl":
            import torch.distributed as dist

            nccl: Any = dist.ProcessGroupNCCL  # CUDA builds only
            opts = nccl.Options()
            opts._timeout = timeout
            self.pg = nccl(prefixed, 0, group.world_size, opts)
        else:
            self.pg = ProcessGroupGloo(prefixed, 0, group.world_size, timeout)

    def send(self, tensors: Iterable[torch.Tensor]) -> None:
        """Broadcast each tensor in order (one copy on the group's device at a time)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for t in tensors:
            out = t.detach().to(self.device).contiguous()
            self.pg.broadcast([out], opts).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def send_buckets(self, handoff: queue.Queue[dict[str, torch.Tensor] | None]) -> None:
        """`send` every bucket `handoff` brings, until it brings None."""
        while (bucket := handoff.get()) is not None:
            self.send(bucket.values())


def _gather_pass(
    weights: Weights,
    bucket_bytes: int,
    handoff: queue.Queue[dict[str, torch.Tensor] | None],
    abandon: threading.Event,
) -> None:
    """One pass over `weights`, each bucket handed to the sender, then None; once `abandon` is
    set the rest of the pass is still read (a sharded trainer's other ranks gather each bucket
    with this one) but no longer handed over."""
    for bucket in itertools.chain(weights.buckets(bucket_bytes), [None]):
        while not abandon.is_set():
            try:
                handoff.put(bucket, timeout=0.1)
                break
            except queue.Full:
                continue


class GroupSink(Protocol):
    """The gateway's half of the weight group."""

    async def group_size(self) -> tuple[int, bool]:
        """(world_size: the trainer's rank and the servers', intact: the last group still
        holds every server)."""
        ...

    async def join(self, group: WeightGroup) -> None: ...

    async def receive(self, broadcast: Broadcast, version: int) -> int:
        """The servers receive `broadcast` as `version` (the trainer sends meanwhile)."""
        ...

    async def served(self) -> int: ...


class AdminSink:
    """The gateway's admin API (`gateway.routes.admin`)."""

    def __init__(self, admin: GatewayAdmin) -> None:
        self.admin = admin

    async def group_size(self) -> tuple[int, bool]:
        body = await self.admin.call("GET", "/admin/weights/group")
        return int(str(body["world_size"])), bool(body["intact"])

    async def join(self, group: WeightGroup) -> None:
        body: dict[str, object] = {
            "master_address": group.master_address,
            "master_port": group.master_port,
            "world_size": group.world_size,
            "backend": group.backend,
            "name": group.name,
            "timeout_s": group.timeout_s,
        }
        wait = group.timeout_s + 30
        await self.admin.call("POST", "/admin/weights/group", body, read_s=wait, retry=False)

    async def receive(self, broadcast: Broadcast, version: int) -> int:
        body: dict[str, object] = {
            "version": version,
            "buckets": [
                [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in bucket]
                for bucket in broadcast.buckets
            ],
        }
        answer = await self.admin.call(
            "POST", "/admin/weights/broadcast", body, read_s=3600, retry=False
        )
        return int(str(answer["version"]))

    async def served(self) -> int:
        return await self.admin.served()


class EngineSink:
    """A gateway engine in this process (`serve --train` in front of vLLM/SGLang servers)."""

    def __init__(self, engine: Engine) -> None:
        if not isinstance(engine, WeightGroupMember):
            raise ValueError(
                f"publish.mode collective needs vLLM or SGLang servers (--engine vllm|sglang); "
                f"the gateway's engine is {type(engine).__name__}"
            )
        self.engine = engine
        self.member: WeightGroupMember = engine

    async def group_size(self) -> tuple[int, bool]:
        return 1 + await self.member.weight_group_ranks(), self.member.weight_group_intact()

    async def join(self, group: WeightGroup) -> None:
        await self.member.join_weight_group(group)

    async def receive(self, broadcast: Broadcast, version: int) -> int:
        return await self.engine.update_weights(WeightUpdate(broadcast=broadcast, version=version))

    async def served(self) -> int:
        return self.engine.version()


class CollectivePublisher:
    """A `trainer.publish.WeightPublisher` over the weight group (module docstring)."""

    def __init__(
        self,
        sink: GroupSink,
        fallback: WeightPublisher,
        *,
        master_address: str,
        backend: str = "gloo",
        bucket_bytes: int = 512 << 20,
        timeout_s: float = 300.0,
        name: str = "rlgateway-weights",
    ) -> None:
        self.sink = sink
        self.fallback = fallback
        self.master_address = master_address
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.name = name
        self._sender: GroupSender | None = None
        self.broadcasts = 0
        """Versions that reached the servers over the group (the rest went through `fallback`)."""

    async def served(self) -> int:
        return await self.sink.served()

    async def publish(self, weights: Weights, version: int) -> int:
        if version == await self.sink.served():
            return version
        try:
            served = await self._broadcast(weights, version)
        except Exception as exc:  # any failure over the group: this version goes from disk
            self._sender = None
            log.warning(
                "version %d did not reach the servers over the weight group (%s); publishing it "
                "through %s instead",
                version,
                exc,
                type(self.fallback).__name__,
            )
            return await self.fallback.publish(weights, version)
        self.broadcasts += 1
        return served

    async def _broadcast(self, weights: Weights, version: int) -> int:
        world, intact = await self.sink.group_size()
        sender = self._sender
        if sender is None or not intact or sender.group.world_size != world:
            sender = await self._form(world)
        broadcast = Broadcast(buckets_of(weights.metas(), self.bucket_bytes))
        # One thread reads the buckets (gathering them from a sharded trainer's ranks), another
        # broadcasts them: a failed broadcast leaves its thread blocked until the group's timeout,
        # but the pass over the weights ends at once, so the fallback can read them again.
        handoff: queue.Queue[dict[str, torch.Tensor] | None] = queue.Queue(maxsize=1)
        abandon = threading.Event()
        reading = asyncio.create_task(
            asyncio.to_thread(_gather_pass, weights, self.bucket_bytes, handoff, abandon)
        )
        sending = asyncio.create_task(asyncio.to_thread(sender.send_buckets, handoff))
        receiving = asyncio.create_task(self.sink.receive(broadcast, version))
        try:
            done, _ = await asyncio.wait({sending, receiving}, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:  # without a failure both are done
                if (failure := task.exception()) is not None:
                    raise failure
            served = receiving.result()
        except BaseException:
            abandon.set()
            receiving.cancel()
            sending.add_done_callback(_quiet)  # times out on its own: it cannot be interrupted
            await reading
            raise
        await reading
        return served

    async def _form(self, world: int) -> GroupSender:
        self._sender = None
        group = WeightGroup(
            master_address=self.master_address,
            master_port=free_port("0.0.0.0"),
            world_size=world,
            backend=self.backend,
            name=self.name,
            timeout_s=self.timeout_s,
        )
        opening = asyncio.create_task(asyncio.to_thread(GroupSender, group))
        try:
            await self.sink.join(group)
        except BaseException:
            opening.add_done_callback(_quiet)
            raise
        self._sender = await opening
        log.info("formed the weight group: %d ranks at %s", world, self.master_address)
        return self._sender


def _quiet(task: asyncio.Task[object]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a sender left waiting times out, and that is expected
