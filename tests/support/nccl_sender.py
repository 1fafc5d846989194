"""The trainer's side of vLLM's NCCL weight transfer, for the GPU test (run with vLLM's Python).

    python -m tests.support.nccl_sender MASTER_ADDR MASTER_PORT WORLD_SIZE

Joins the weight-transfer group as rank 0 (vLLM's workers sit at 1..WORLD_SIZE-1), prints
"ready", then for each safetensors file path read from stdin broadcasts its tensors one by one in
sorted-name order (the unpacked wire format) and prints "sent".
"""

from __future__ import annotations

import sys

import torch
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group


def main(address: str, port: str, world_size: str) -> None:
    device = torch.device("cuda:0")
    comm = stateless_init_process_group(address, int(port), 0, int(world_size), device)
    print("ready", flush=True)
    for line in sys.stdin:
        state = load_file(line.strip(), device="cuda:0")
        for name in sorted(state):
            comm.broadcast(state[name], src=0, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        print("sent", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
