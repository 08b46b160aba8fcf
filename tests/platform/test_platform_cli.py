"""`msaserve serve` / `chat` / `bench` as a user runs them, and the load generator's pieces."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_serve_app import free_port

from msaserve.platform.cli.bench import format_table
from msaserve.platform.loadgen import (
    TRACE_BLOCK_TOKENS,
    LevelResult,
    RequestResult,
    percentile,
    trace_requests,
)

MSASERVE = [str(Path(sys.executable).parent / "msaserve")]


def test_the_metrics_port_is_never_one_ray_takes_by_default(monkeypatch) -> None:
    """`serve`'s metrics exporter port comes from the OS; one that Ray's dashboard agent (52365) or
    another fixed default takes, or the API's or dashboard's, is drawn again (a clean-clone run drew
    52365 once and `ray.init` refused to start)."""
    from msaserve.platform.cli import serve as serve_cli

    drawn = iter([52365, 8265, 8000, 41234])

    class FakeSocket:
        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

        def bind(self, _address):
            self.port = next(drawn)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(serve_cli.socket, "socket", FakeSocket)
    assert serve_cli._free_port(frozenset({8000})) == 41234


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99.0


def test_trace_replay_shares_prefix_blocks(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000, "input_length": 700, "output_length": 50, "hash_ids": [7, 8]},
        {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [7, 9]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    first, second = trace_requests(path, limit=10, max_input=650, max_output=20, time_scale=2.0)
    assert (len(first.prompt_token_ids), first.max_tokens, first.send_at_s) == (650, 20, 0.0)
    assert (len(second.prompt_token_ids), second.max_tokens, second.send_at_s) == (600, 5, 1.0)
    block = TRACE_BLOCK_TOKENS
    assert first.prompt_token_ids[:block] == second.prompt_token_ids[:block]  # shared hash id 7
    assert first.prompt_token_ids[block:600] != second.prompt_token_ids[block:600]


def test_bench_table_lists_every_level() -> None:
    level = LevelResult(
        "c=4", wall_s=2.0, results=[RequestResult(True, 0.1, 1.1, 11, 64), RequestResult(False)]
    )
    summary = level.summary()
    assert summary["failed"] == 1 and summary["output_tokens_per_s"] == 5.5
    assert summary["tpot_p50_s"] == pytest.approx(0.1)
    table = format_table([summary])
    assert "c=4" in table and "TTFT p50" in table and "100.0" in table


@pytest.mark.slow
def test_serve_then_chat_then_ctrl_c(tmp_path: Path) -> None:
    port, dashboard = free_port(), free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed below; the process writes to it)
    server = subprocess.Popen(
        [*MSASERVE, "serve", "--model", "tiny", "--port", str(port), "--dashboard-port", str(dashboard)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while "Ready in" not in (text := (tmp_path / "serve.log").read_text()):
            assert server.poll() is None and time.monotonic() < deadline, text[-3000:]
            time.sleep(0.5)
        assert f"http://127.0.0.1:{port}/v1" in text and f"http://127.0.0.1:{dashboard}" in text
        assert "auth_token" in text or "RAY_AUTH" in text  # how to sign in to the dashboard
        chat = subprocess.run(
            [*MSASERVE, "chat", "--url", f"http://127.0.0.1:{port}/v1", "--once", "hi", "--max-tokens", "3"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert chat.returncode == 0, chat.stderr
    finally:
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=90)
        log.close()
    assert code == 0
    assert "Shutting down" in (tmp_path / "serve.log").read_text()


def _status(app_message: str, **deployments: str):
    from types import SimpleNamespace

    apps = {"msaserve": SimpleNamespace(
        message=app_message,
        deployments={name: SimpleNamespace(message=message) for name, message in deployments.items()},
    )}
    return SimpleNamespace(applications=apps)


def test_a_deploy_that_waits_says_what_serve_says_about_it() -> None:
    """`serve.run` waits in silence while a replica cannot be scheduled (two SmolLM2 replicas and the
    gateway on 2 CPUs waited forever, printing nothing); Serve's own messages now show meanwhile."""
    import io
    import threading

    from msaserve.platform.cli.serve import deploy_with_progress

    stuck = "1 replicas that have taken more than 30s to be scheduled. Resources required: {\"CPU\": 0.5}"
    statuses = iter([_status(""), _status("", Gateway=stuck, Model=""), _status("", Gateway=stuck)])
    release = threading.Event()

    def status():
        try:
            return next(statuses)
        except StopIteration:
            release.set()
            return _status("")

    out = io.StringIO()
    deploy_with_progress(lambda: release.wait(10), status, "msaserve", poll_s=0.01, out=out)
    assert out.getvalue() == f"  Gateway: {stuck}\n"  # once, though Serve said it twice

    def fails():
        raise RuntimeError("Deploying app 'msaserve' failed")

    with pytest.raises(RuntimeError, match="failed"):
        deploy_with_progress(fails, lambda: _status(""), "msaserve", poll_s=0.01, out=out)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["bench", "--concurrency", "1,x"], "--concurrency: must be comma-separated integers ≥ 1"),
        (["bench", "--concurrency", "0"], "--concurrency: must be comma-separated integers ≥ 1"),
        (["bench", "--max-tokens", "-3"], "--max-tokens: must be an integer ≥ 1, got -3"),
        (["bench", "--time-scale", "nan"], "--time-scale: must be a number > 0, got nan"),
        (["generate", "--max-tokens", "abc"], "--max-tokens: must be an integer ≥ 1, got 'abc'"),
    ],
)
def test_a_bad_option_value_is_a_usage_error_naming_it(argv: list[str], words: str, capsys) -> None:
    """`--concurrency 1,x` and the like were tracebacks (a ValueError from int()) once the run began."""
    from msaserve.platform.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_bench_without_a_server_says_so(capsys) -> None:
    from msaserve.platform.cli import main

    assert main(["bench", "--url", f"http://127.0.0.1:{free_port()}/v1", "--concurrency", "1"]) == 1
    assert "msaserve bench: cannot reach" in capsys.readouterr().err
    assert main(["bench", "--trace", "/nonexistent.jsonl"]) == 2
    assert "--trace=/nonexistent.jsonl is not a file" in capsys.readouterr().err


def test_serve_refuses_a_model_it_cannot_find_before_starting_ray(tmp_path: Path, capsys) -> None:
    """Both were tracebacks from the readiness probe, after Ray and the whole app had started."""
    from msaserve.platform.cli import main

    assert main(["serve", "--model", str(tmp_path / "nothing")]) == 2
    assert "msaserve serve: model.spec: model" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "x.gguf")]) == 2
    assert "GGUF file" in capsys.readouterr().err


def test_a_checkpoint_whose_config_lacks_fields_names_them(tmp_path: Path) -> None:
    from msaserve.engine.model_loading import CheckpointMismatch, load_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with pytest.raises(CheckpointMismatch, match=r"config\.json does not describe a MSAConfig: "
                       r"hidden_size: Field required; .*head_dim: Field required") as info:
        load_model(str(tmp_path), progress=False)
    assert "errors.pydantic.dev" not in str(info.value) and "vocab_size" not in str(info.value)
