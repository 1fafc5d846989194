"""What each part of a launched topology runs: pure functions from the spec and the addresses the
launcher has learnt to a `Command` (`rlgateway.launch.host.ProcessHost.start` runs it).

- an engine server: vLLM's or SGLang's command line as `rlgateway serve --engine-launch` builds
  it (`engines.vllm_launch`, `engines.sglang_launch`), on every interface of its node;
- a gateway replica: `rlgateway serve` on the spec's PostgreSQL, on its own engine servers or its
  embedded local engine, telling agents its own address unless the spec says otherwise;
- a trainer node: `rlgateway train` (under torchrun when the trainer has more than one rank),
  publishing to the first replica, which every replica follows through the store.

The admin token travels in the environment (`RLGATEWAY_ADMIN_TOKEN`), never on a command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from engines.sglang_launch import ORIGINAL_LOGPROB_ENV, SGLangLaunchConfig, sglang_command
from engines.vllm_launch import VLLMLaunchConfig, vllm_command
from rlgateway.launch.spec import LaunchSpec

TRAINER_CONFIG = "config.yaml"


@dataclass(frozen=True, slots=True)
class Command:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    files: dict[str, str] = field(default_factory=dict)
    model: str | None = None
    """Resolved on the part's node (`{model}` in argv)."""


def engine_command(spec: LaunchSpec, port: int) -> Command:
    engines = spec.engines
    assert engines is not None
    common = {
        "model": "{model}",
        "python": engines.python or "python3",
        "host": "0.0.0.0",
        "port": port,
        "served_model_name": spec.served_model_name,
        "extra_args": tuple(engines.args),
    }
    if engines.kind == "vllm":
        argv = vllm_command(VLLMLaunchConfig(**common), port)  # type: ignore[arg-type]
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
        return Command(argv, env | engines.env, model=spec.model)
    argv = sglang_command(SGLangLaunchConfig(**common), port)  # type: ignore[arg-type]
    env = {"HF_HUB_OFFLINE": "1"} | engines.env
    return Command(argv, env, unset=(ORIGINAL_LOGPROB_ENV,), model=spec.model)


def gateway_command(
    spec: LaunchSpec, ip: str, port: int, engine_urls: list[str], admin_token: str
) -> Command:
    argv = ["{python}", "-m", "rlgateway.cli", "serve", "--host", "0.0.0.0", "--port", str(port)]
    argv += ["--database-url", spec.database_url, "--served-model-name", spec.served_model_name]
    model = None
    if spec.model != "tiny":  # tiny: the gateway's own default build
        argv += ["--model", "{model}"]
        model = spec.model
    if spec.engines is not None:
        argv += ["--engine", spec.engines.kind]
        for url in engine_urls:
            argv += ["--engine-url", url]
    argv += spec.gateways.args
    env = {"RLGATEWAY_ADMIN_TOKEN": admin_token, "RLGATEWAY_PUBLIC_URL": f"http://{ip}:{port}"}
    return Command(argv, env | spec.gateways.env, model=model)


def trainer_command(
    spec: LaunchSpec,
    *,
    run_id: str,
    node_rank: int,
    master: tuple[str, int],
    gateway_url: str,
    admin_token: str,
) -> Command:
    t = spec.trainer
    train = ["-m", "rlgateway.cli", "train", "--config", "{dir}/" + TRAINER_CONFIG]
    train += ["--gateway-url", gateway_url]
    if t.nnodes * t.nproc_per_node == 1:
        argv = ["{python}", *train]
    else:
        argv = ["{python}", "-m", "torch.distributed.run", "--nnodes", str(t.nnodes)]
        argv += ["--node-rank", str(node_rank), "--nproc-per-node", str(t.nproc_per_node)]
        argv += ["--master-addr", master[0], "--master-port", str(master[1]), *train]
    config = {**t.config, **spec.decided(run_id)}
    files = {TRAINER_CONFIG: yaml.safe_dump(config, sort_keys=True)}
    env = {"RLGATEWAY_ADMIN_TOKEN": admin_token} | t.env
    return Command(argv, env, files=files)
