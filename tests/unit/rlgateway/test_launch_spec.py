"""The launch spec (`rlgateway/launch/spec.py`) and what each part runs
(`rlgateway/launch/topology.py`): checked whole with messages that name the field, and turned into
the command lines of the engine servers, the gateway replicas and the trainer's nodes."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from engines.sglang_launch import ORIGINAL_LOGPROB_ENV
from rlgateway.cli import main
from rlgateway.launch.spec import LaunchSpec, load_launch_spec, parse_launch_spec
from rlgateway.launch.topology import (
    TRAINER_CONFIG,
    engine_command,
    gateway_command,
    trainer_command,
)
from tests.support.paths import REPO_ROOT

DB = "postgresql://u@db:5432/rl"


def spec(**kw: Any) -> LaunchSpec:
    return parse_launch_spec({"name": "r", "database_url": DB, **kw})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"database_url": "sqlite:///x.db"}, "database_url"),
        ({"gateways": {"replicas": 0}}, "gateways.replicas"),
        ({"gateways": {"resources": {"CPU": -1}}}, "must not be negative"),
        ({"engines": {"kind": "tgi"}}, "engines.kind"),
        ({"trainer": {"nodes": 2}}, "trainer.nodes"),
        ({"trainer": {"config": {"optim": {"lr": "fast"}}}}, "trainer.config: optim.lr"),
        ({"trainer": {"config": {"run": "run_1"}}}, "trainer.config.run: the launch sets it"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        parse_launch_spec({"name": "r", "database_url": DB, **data}, "launch.yaml")


def test_overrides_set_the_spec_and_the_run_config(tmp_path: Path) -> None:
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "database_url": DB}))
    loaded = load_launch_spec(path, ["gateways.replicas=3", "trainer.config.max_steps=7"])
    assert loaded.gateways.replicas == 3
    assert loaded.run_config().max_steps == 7
    assert load_launch_spec(path).run_config().max_steps == 100


def test_the_topology_decides_the_run_the_store_and_an_absolute_checkpoint_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    decided = spec(work_dir="w").decided("run_9")
    assert decided == {
        "run": "run_9",
        "database_url": DB,
        "checkpoint_dir": str(tmp_path / "w" / "checkpoints"),
    }
    given = spec(model="/m", trainer={"config": {"checkpoint_dir": "ck"}}).decided("run_9")
    assert given["checkpoint_dir"] == str(tmp_path / "ck")
    assert given["model"] == "/m"


def test_engine_servers_listen_on_every_interface_with_the_adapters_flags() -> None:
    s = spec(model="smollm2", engines={"kind": "vllm", "python": "/venv/bin/python",
                                       "args": ["--max-num-seqs", "8"]})  # fmt: skip
    cmd = engine_command(s, 8100)
    assert cmd.argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd.argv)
    assert "--model {model} " in joined
    assert "--host 0.0.0.0 --port 8100" in joined
    assert "--logprobs-mode processed_logprobs" in joined
    assert cmd.argv[-2:] == ["--max-num-seqs", "8"]
    assert cmd.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert cmd.model == "smollm2"  # resolved (built) on the server's node
    sglang = engine_command(spec(engines={"kind": "sglang"}), 30000)
    assert sglang.argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert sglang.unset == (ORIGINAL_LOGPROB_ENV,)


def test_a_replica_serves_its_own_servers_and_says_its_own_address() -> None:
    s = spec(engines={"kind": "vllm"}, gateways={"args": ["--max-batch", "8"]})
    cmd = gateway_command(s, "10.0.0.5", 8000, ["http://10.0.0.7:81", "http://10.0.0.8:81"], "tok")
    joined = " ".join(cmd.argv)
    assert "--engine vllm --engine-url http://10.0.0.7:81 --engine-url http://10.0.0.8:81" in joined
    assert f"--database-url {DB}" in joined
    assert "--model" not in cmd.argv  # tiny: each replica's own build
    assert cmd.argv[-2:] == ["--max-batch", "8"]
    assert "tok" not in joined  # the token is in the environment, never on a command line
    assert cmd.env == {
        "RLGATEWAY_ADMIN_TOKEN": "tok",
        "RLGATEWAY_PUBLIC_URL": "http://10.0.0.5:8000",
    }
    local = gateway_command(spec(model="/models/m"), "h", 1, [], "tok")
    assert "--engine" not in local.argv
    assert local.argv[local.argv.index("--model") + 1] == "{model}"


def test_a_trainer_of_several_nodes_runs_torchrun_on_each_with_rank_zero_as_rendezvous() -> None:
    s = spec(trainer={"nnodes": 2, "nproc_per_node": 4, "config": {"batch_size": 8}})
    cmd = trainer_command(s, run_id="run_1", node_rank=1, master=("10.0.0.1", 29500),
                          gateway_url="http://10.0.0.5:8000", admin_token="tok")  # fmt: skip
    joined = " ".join(cmd.argv)
    assert "-m torch.distributed.run --nnodes 2 --node-rank 1 --nproc-per-node 4" in joined
    assert "--master-addr 10.0.0.1 --master-port 29500" in joined
    assert f"train --config {{dir}}/{TRAINER_CONFIG} --gateway-url http://10.0.0.5:8000" in joined
    config = yaml.safe_load(cmd.files[TRAINER_CONFIG])
    assert (config["run"], config["database_url"], config["batch_size"]) == ("run_1", DB, 8)
    single = trainer_command(spec(), run_id="run_1", node_rank=0, master=("h", 1),
                             gateway_url="http://g", admin_token="tok")  # fmt: skip
    assert single.argv[:4] == ["{python}", "-m", "rlgateway.cli", "train"]
    assert single.env == {"RLGATEWAY_ADMIN_TOKEN": "tok"}


def test_the_checked_in_example_loads() -> None:
    loaded = load_launch_spec(REPO_ROOT / "configs" / "launch" / "ray-vllm.yaml")
    assert loaded.engines is not None
    assert (loaded.gateways.replicas, loaded.engines.per_gateway) == (2, 2)
    assert loaded.run_config().group_size == 8


def test_launch_says_when_no_ray_cluster_answers_and_when_the_spec_is_bad(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "database_url": DB}))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert main(["launch", str(path), "--ray", f"127.0.0.1:{port}"]) == 2
    assert f"no Ray cluster at '127.0.0.1:{port}'" in capsys.readouterr().err
    assert main(["launch", str(path), "--ray", "auto", "gateways.replicas=0"]) == 2
    assert "gateways.replicas" in capsys.readouterr().err
