"""Bad input gives one line, not a traceback (DESIGN.md §14).

Every user mistake in the table ends the real ``streamrl train | serve | config`` with exit code
2 and a last stderr line ``streamrl: config error: ...`` that names the key or file and the
value, with no traceback, before Ray starts. Every case runs through the CLI's ``main`` in one
runner process (the imports are paid once); a case that gets as far as Ray has failed.

Two mistakes are counted, not fatal: a prompt longer than ``task.max_prompt_length`` is a
skipped row, and a Redis entry that does not decode is a dead letter (unit tests at the end).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrl.config import TaskConfig
from streamrl.data import make_prompt_source
from streamrl.data.toy import load_toy_source
from tests.support import free_port

CASE_TIMEOUT_S = 90
PREFIX = "streamrl: config error: "


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    expect: tuple[str, ...]
    """Texts the last stderr line holds; ``{model}``, ``{files}``, ``{dead}`` (a Redis URL
    nobody listens on) and ``{redis}`` (a live one) are filled in."""
    redis: bool = False


def case(id: str, argv: str, *expect: str, redis: bool = False) -> Case:
    return Case(id, tuple(argv.split()), expect, redis)


M = "model.path={model}"
CASES = [
    # -- overrides and validation: fail before anything heavy is imported -----------------------
    case("lr-not-a-float", "train actor.optim.lr=abc", "actor.optim.lr='abc'", "expected float"),
    case("int-not-an-int", "train rollout.n=1.5", "rollout.n='1.5'", "expected int"),
    case("bool-not-a-bool", "train rollout.enforce_eager=maybe", "rollout.enforce_eager='maybe'",
         "expected bool"),
    case("list-not-a-list", "train trainer.logger=console", "trainer.logger='console'",
         "expected tuple"),
    case("unknown-key", "train actor.optim.lrr=1e-4", "actor.optim.lrr='1e-4'",
         "did you mean actor.optim.lr?"),
    case("unknown-section", "train +bogus.key=1", "bogus.key='1'", "no such config key"),
    case("wrong-enum", "train trainer.mode=bogus", "trainer.mode='bogus'", "fully_async"),
    case("wrong-backend", "train rollout.backend=tpu", "rollout.backend='tpu'", "vllm"),
    case("unknown-preset", "train algorithm=nosuch", "algorithm='nosuch'", "grpo"),
    case("override-without-equals", "train rollout.n", "'rollout.n'", "key=value"),
    case("override-bad-grammar", "train task.train_files=[a.parquet",
         "task.train_files=[a.parquet", "[a,b]"),
    case("negative-batch-size", "train task.train_batch_size=-4", "task.train_batch_size=-4",
         "must be > 0"),
    case("renamed-key", "train rollout.response_length=4", "rollout.response_length",
         "rollout.max_new_tokens"),
    case("broken-interpolation", "train trainer.experiment_name=${nope}",
         "trainer.experiment_name='${nope}'", "'nope' not found"),
    case("unknown-toy-task", "train task.name=nosuch", "task.name='nosuch'", "'rep'"),
    case("zero-cpus-per-replica", "train runtime.cpus_per_replica=0",
         "runtime.cpus_per_replica=0.0", "must be > 0"),
    case("wrong-placement-strategy", "train runtime.rollout_pool.strategy=spread",
         "runtime.rollout_pool.strategy='spread'", "STRICT_SPREAD"),
    case("missing-checkpoint", "train trainer.resume={files}/no_ckpt",
         "trainer.resume='{files}/no_ckpt'", "checkpoint dir"),
    case("config-command", "config rollout.top_p=2", "rollout.top_p=2.0", "(0, 1]"),
    case("serve-public-without-key", "serve serve.host=0.0.0.0", "serve.host='0.0.0.0'",
         "serve.api_key"),
    # -- up-front runtime checks: fail before Ray starts ---------------------------------------
    case("model-path-missing", "train model.path={files}/no_model",
         "model.path='{files}/no_model'", "model.path=tiny"),
    case("model-path-not-a-model", "train model.path={files}", "model.path='{files}'",
         "config.json"),
    case("tokenizer-path-missing", f"train {M} model.tokenizer_path={{files}}/no_tok",
         "model.tokenizer_path='{files}/no_tok'", "not a directory"),
    case("data-file-missing", f"train {M} task.source=parquet "
         "task.train_files=[{files}/none.parquet]", "task.train_files", "{files}/none.parquet",
         "does not exist"),
    case("data-file-corrupt", f"train {M} task.source=parquet "
         "task.train_files=[{files}/corrupt.parquet]", "task.train_files",
         "{files}/corrupt.parquet", "not a readable parquet file"),
    case("data-file-without-prompt", f"train {M} task.source=parquet "
         "task.train_files=[{files}/no_prompt.parquet]", "task.train_files",
         "{files}/no_prompt.parquet", "lacks the column(s) prompt"),
    case("every-prompt-too-long", f"train {M} task.max_prompt_length=1",
         "task.max_prompt_length=1", "prompt longer than max_prompt_length"),
    case("unknown-reasoning-gym-dataset", f"train {M} task=reasoning_gym task.name=no_such_ds",
         "task.name='no_such_ds'", "not registered"),
    case("reward-file-missing", f"train {M} reward.name=custom "
         "reward.custom_path={files}/none.py", "reward.custom_path='{files}/none.py'",
         "no such file"),
    case("reward-syntax-error", f"train {M} reward.name=custom "
         "reward.custom_path={files}/syntax.py", "reward.custom_path='{files}/syntax.py'",
         "SyntaxError", "syntax.py:1"),
    case("reward-import-error", f"train {M} reward.custom_path={{files}}/imports_missing.py",
         "reward.custom_path='{files}/imports_missing.py'", "No module named",
         "imports_missing.py:1"),
    case("reward-function-missing", f"train {M} reward.name=custom "
         "reward.custom_path={files}/no_function.py", "reward.custom_name='compute_score'",
         "{files}/no_function.py"),
    case("agent-module-missing", f"train {M} rollout.agent=no_such_pkg.envs:Env",
         "rollout.agent='no_such_pkg.envs:Env'", "No module named 'no_such_pkg'"),
    case("redis-unreachable", f"train {M} buffer=redis buffer.redis_url={{dead}}",
         "buffer.redis_url='{dead}'", "redis-server"),
    case("redis-url-malformed", f"train {M} buffer=redis buffer.redis_url=localhost:6379",
         "buffer.redis_url='localhost:6379'", "redis://"),
    case("redis-run-of-another-shape", f"train {M} buffer=redis buffer.redis_url={{redis}} "
         "buffer.run=clash", "buffer.run='clash'", "groups_per_step=3", "task.train_batch_size",
         redis=True),
    case("cpus-do-not-fit", f"train {M} rollout.num_replicas=2 runtime.num_cpus=2",
         "need 3 CPUs", "has 2", "rollout.num_replicas=2", "runtime.cpus_per_replica",
         "runtime.cpus_per_learner", "runtime.num_cpus"),
    case("serve-cpus-do-not-fit", f"serve {M} serve.train=false rollout.num_replicas=3 "
         "runtime.num_cpus=2", "need 3 CPUs", "has 2", "rollout.num_replicas=3"),
]


@dataclass(frozen=True)
class Result:
    returncode: int | None
    """None: killed after CASE_TIMEOUT_S."""
    stderr: str
    seconds: float
    expect: tuple[str, ...]


# Runs ``streamrl.cli.main`` (what ``python -m streamrl.cli`` runs) once per argv read from
# stdin, in one interpreter, so the imports are paid once; prints one JSON line per case: the
# exit code and stderr, with the traceback of any exception that escaped ``main``.
RUNNER = """
import contextlib, io, json, logging, sys, time, traceback
from streamrl.cli import main
for line in sys.stdin:
    err, start = io.StringIO(), time.monotonic()
    logging.root.handlers.clear()  # main's basicConfig then logs to this case's stderr
    with contextlib.redirect_stderr(err):
        try:
            code = main(json.loads(line))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    print(json.dumps([code, err.getvalue(), time.monotonic() - start]), flush=True)
"""


def _run_cli(argvs: list[list[str]]) -> list[tuple[int | None, str, float]]:
    """Each argv through the CLI's ``main`` in one runner process; a case that does not end
    within CASE_TIMEOUT_S (it got as far as Ray) is None, and so is every case after it."""
    proc = subprocess.Popen([sys.executable, "-c", RUNNER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("".join(json.dumps(a) + "\n" for a in argvs))
    proc.stdin.close()
    runs: list[tuple[int | None, str, float]] = []
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(runs) < len(argvs) and sel.select(timeout=CASE_TIMEOUT_S):
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("["):
                code, err, seconds = json.loads(line)
                runs.append((code, err, seconds))
    with contextlib.suppress(ProcessLookupError):  # whatever a hung case started goes too
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return runs + [(None, "", 0.0)] * (len(argvs) - len(runs))


def _write_files(root: Path) -> None:
    (root / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    pq.write_table(pa.Table.from_pylist([{"question": "1+1?", "answer": "2"}]),
                   root / "no_prompt.parquet")
    (root / "syntax.py").write_text("def compute_score(:\n")
    (root / "imports_missing.py").write_text("import streamrl_no_such_module\n")
    (root / "no_function.py").write_text("def other(*args):\n    return 0.0\n")


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tiny_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result | None]:
    """Every selected case's CLI run (None: skipped, it needs redis-server)."""
    selected = {item.callspec.params["case"].id for item in request.session.items
                if getattr(item, "originalname", "") == "test_bad_input_is_one_line"}
    cases = [c for c in CASES if c.id in selected]
    files = tmp_path_factory.mktemp("bad-input")
    _write_files(files)
    fill = {"{model}": str(tiny_model_dir), "{files}": str(files),
            "{dead}": f"redis://127.0.0.1:{free_port()}/0"}
    runnable = [c for c in cases if not c.redis or shutil.which("redis-server")]
    clash = None
    if any(c.redis for c in runnable):
        from streamrl.buffer.redis import RedisBuffer

        fill["{redis}"] = request.getfixturevalue("redis_url")
        # The run exists with another batch size than the CLI's default (16).
        clash = RedisBuffer(fill["{redis}"], "clash", groups_per_step=3, max_staleness=1)

    def filled(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    try:
        runs = _run_cli([[filled(a) for a in c.argv] for c in runnable])
        out: dict[str, Result | None] = {
            c.id: Result(*run, tuple(filled(e) for e in c.expect))
            for c, run in zip(runnable, runs)
        }
    finally:
        if clash is not None:
            clash.purge()
    return {c.id: out.get(c.id) for c in cases}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line(case: Case, results: dict[str, Result | None]) -> None:
    result = results[case.id]
    if result is None:
        pytest.skip("needs redis-server")
    tail = result.stderr[-3000:]
    assert result.returncode == 2, f"exit {result.returncode} after {result.seconds:.0f} s:\n{tail}"
    assert "Traceback" not in result.stderr, tail
    assert "Started a local Ray instance" not in result.stderr, "checked only after Ray started"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(PREFIX), tail
    for text in result.expect:
        assert text in last, f"{text!r} not in {last!r}"


# -- counted, not fatal ------------------------------------------------------------------------

def _row(content: str) -> dict:
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": "1"}}


def test_a_prompt_over_max_prompt_length_is_a_counted_skip(tmp_path: Path,
                                                           tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist([_row("1+0?"), _row("the " * 200), _row("2+0?")]), path)
    source = make_prompt_source(TaskConfig(source="parquet", train_files=(str(path),),
                                           max_prompt_length=64), tokenizer)
    assert len(source) == 2
    assert source.skipped == {"prompt longer than max_prompt_length": 1}
    # The toy task counts the same way (its prompts are two tokens: a digit and '=').
    assert len(load_toy_source("rep", 8, 0, tokenizer, max_prompt_length=2)) == 8
    toy = load_toy_source("rep", 8, 0, tokenizer, max_prompt_length=1)
    assert len(toy) == 0 and toy.skipped == {"prompt longer than max_prompt_length": 8}


def test_an_undecodable_redis_entry_is_a_counted_dead_letter(redis_url: str) -> None:
    import redis

    from streamrl.buffer.redis import RedisBuffer
    from streamrl.testing import make_group

    run = f"bad-input-{uuid.uuid4().hex[:8]}"
    buf = RedisBuffer(redis_url, run, groups_per_step=1, max_staleness=1)
    client = redis.Redis.from_url(redis_url)
    try:
        client.xadd(f"streamrl:{run}:groups", {"group_id": "x", "data": b"\xc1 not msgpack"})
        assert buf.try_admit()
        buf.put(make_group(0, "good"))
        assert [g.group_id for g in buf.take(1, 0, timeout=5)] == ["good"]
        assert buf.stats().malformed == 1
        assert client.xlen(f"streamrl:{run}:dead") == 1
    finally:
        buf.purge()
        client.close()
