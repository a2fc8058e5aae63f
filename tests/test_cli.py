"""`pdspec generate` and `pdspec bench spec` as a user runs them: a subprocess on the embedded default model."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.waiting import wait_until


def _pdspec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_json_reports_the_answer():
    result = _pdspec("generate", "--prompt", "Name three primary colors.", "--max-tokens", "24", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "Blue" in out["text"]
    assert out["finish_reason"] in ("stop", "length")
    assert out["num_generated_tokens"] == len(out["token_ids"]) > 0
    assert out["num_prompt_tokens"] > 10  # the chat template's default system prompt is there


def test_generate_streams_text():
    result = _pdspec("generate", "--prompt", "Say hi.", "--max-tokens", "8", "--seed", "1", "--temperature", "0.7")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_bad_model_path_is_a_clear_error(tmp_path):
    result = _pdspec("generate", "--prompt", "hi", "--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "does not exist" in result.stderr


def test_bench_spec_reports_a_lossless_comparison(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name three colours."}) + "\n"
                       + json.dumps({"turns": ["What is 12 times 7?", "And times 8?"]}) + "\n"
                       + json.dumps({"prompt": "Say hello in French."}) + "\n")
    result = _pdspec("bench", "spec", "--prompts", str(prompts), "--max-tokens", "12", "--max-prompts", "2",
                     "--speculative", "eagle3", "--num-speculative-tokens", "3", "--disable-by-batch-size", "1",
                     "--rounds", "2", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["num_prompts"] == 2 and out["rounds"] == 2 and out["lossless"] is True
    assert out["disable_by_batch_size"] == 1  # batch 1 is within the limit: drafting goes on
    assert out["drafted"] > 0 and 1.0 <= out["tau"] <= 4.0
    low, high = out["speedup_ci95"]  # four batches (two prompts, twice): the pooled speedup lies within
    assert low <= out["speedup"] <= high  # (equal when all ran at the same speed ratio)
    assert out["tokens_per_s_spec"] > 0 and out["tokens_per_s_base"] > 0
    split = out["drafting_step_ms"]  # where a drafting step's time went
    assert out["drafting_steps"] > 0 and set(split) == {"draft", "verify", "bookkeeping"} and min(split.values()) > 0
    assert 1.0 <= out["verify_rows_per_token"] <= 4.0  # each drafting step verified its drafts plus one row


def test_bench_spec_usage_errors_are_clear(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    result = _pdspec("bench", "spec", "--prompts", str(prompts), "--speculative", "none")
    assert result.returncode == 2
    assert "--speculative" in result.stderr
    # Each named by its flag before any model loads (--max-prompts -1 dropped the last prompt; a
    # bad --temperature or --batch-size failed after loading two engines, in the schema's words)
    for flags, message in ((["--max-prompts", "0"], "--max-prompts: must be at least 1, got 0"),
                           (["--max-prompts", "-1"], "--max-prompts: must be at least 1, got -1"),
                           (["--rounds", "0"], "--rounds: must be at least 1, got 0"),
                           (["--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
                           (["--temperature", "3"], "--temperature: Input should be less than or equal to 2, got 3.0")):
        result = _pdspec("bench", "spec", "--prompts", str(prompts), *flags)
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_generate_checks_its_flags_before_loading_the_model():
    for flags, message in ((["--max-tokens", "0"], "--max-tokens: Input should be greater than or equal to 1, got 0"),
                           (["--raw", "--system", "Be brief."], "--system: a raw prompt has no chat template")):
        result = _pdspec("generate", "--prompt", "Hi", *flags)
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_port_flag_is_checked_as_the_configs_own_port(tmp_path):
    """--port is router.port: one that clashes with router.internal_port names the fields before
    anything starts (it failed to bind, naming an address)."""
    config = tmp_path / "cluster.yaml"
    config.write_text("router: {port: 50061, internal_port: 50062}\n")
    result = _pdspec("serve", "--config", str(config), "--port", "50062")
    assert result.returncode == 2, result.stderr
    assert "--port" in result.stderr and "internal_port (50062)" in result.stderr and "must differ" in result.stderr


def test_a_cluster_that_does_not_start_in_time_is_a_clear_error(tmp_path):
    """A traceback and status 1 before; the processes it started are stopped either way."""
    config = tmp_path / "cluster.yaml"
    config.write_text("router: {host: 127.0.0.1, port: 0, http_port: null}\nengine: {num_kv_blocks: 64}\n")
    result = _pdspec("serve", "--config", str(config), "--launcher", "local", "--start-timeout", "0.5")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("pdspec: error: ") and "Traceback" not in result.stderr, result.stderr


def test_a_serve_stopped_before_it_answered_does_not_end_as_a_success(tmp_path):
    """SIGTERM during start-up (or --once) ended with status 0, as if the answer had been given:
    `pdspec serve --once X && next` went on."""
    config = tmp_path / "cluster.yaml"
    config.write_text("router: {host: 127.0.0.1, port: 0, http_port: null}\nengine: {num_kv_blocks: 64}\n")
    run = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--config", str(config), "--launcher",
                            "local", "--once", "Hi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        children = Path(f"/proc/{run.pid}/task/{run.pid}/children")
        wait_until(lambda: children.read_text().split(), "the launcher started no process", 120)  # start-up under way
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=120) == 130
    finally:
        run.kill()
        run.communicate()


@pytest.mark.parametrize("flags, message", [
    (["--log-level", "LOUD", "check-config", "--config", "c.yaml"], "--log-level: invalid choice: 'LOUD'"),
    (["serve", "--config", "c.yaml", "--start-timeout", "-1"], "--start-timeout: expected seconds above 0, got '-1'"),
    (["serve", "--config", "c.yaml", "--start-timeout", "nan"], "--start-timeout: expected seconds above 0, got 'nan'"),
])
def test_a_bad_log_level_or_start_timeout_names_the_flag(flags, message):
    """A bad level was a traceback from the logging set-up; a negative or nan timeout failed later, oddly."""
    result = _pdspec(*flags)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_worker_on_every_interface_must_say_where_peers_reach_it(tmp_path):
    """It registered 0.0.0.0:port, which the router and decode workers then dialled on their own hosts."""
    config = tmp_path / "cluster.yaml"
    config.write_text("engine: {num_kv_blocks: 64}\n")
    result = _pdspec("worker", "--role", "prefill", "--config", str(config), "--router", "127.0.0.1:1",
                     "--host", "0.0.0.0")
    assert result.returncode == 2 and "--advertise-host: required with --host 0.0.0.0" in result.stderr, result.stderr


def test_the_log_level_reaches_the_router_and_workers_a_launch_starts(tmp_path):
    """--log-level set the launcher's own logging only: its router and workers kept their defaults."""
    config = tmp_path / "cluster.yaml"
    config.write_text("router: {host: 127.0.0.1, port: 0, http_port: null}\n"
                      "engine: {num_kv_blocks: 64, max_num_seqs: 2}\n")
    result = _pdspec("--log-level", "WARNING", "serve", "--config", str(config), "--launcher", "local",
                     "--once", "Say hi.")
    assert result.returncode == 0, result.stderr
    log_dir = Path(re.search(r"logs in (\S+)\)", result.stdout).group(1))
    for name in ("router", "prefill-0", "decode-0"):  # servers' own start-up lines are INFO by default
        assert "level=INFO" not in (log_dir / f"{name}.log").read_text(), name


def test_stop_without_a_ray_cluster_is_a_clear_error(tmp_path):
    """It ended in Ray's traceback (status 1). RAY_TMPDIR: no `ray start` recorded there."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "stop"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "pdspec: error: cannot connect to the Ray cluster (--address auto)" in result.stderr


def _bench_serve(tmp_path, *flags: str, **popen) -> subprocess.Popen:
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Hi"}\n')
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", "bench", "serve", "--prompts",
                             str(tmp_path / "prompts.jsonl"), *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def test_bench_serve_that_measured_nothing_fails_and_a_nan_rate_is_refused(tmp_path):
    """Every request failing ended with status 0; --rate nan sent every request at once."""
    run = _bench_serve(tmp_path, "--router", "127.0.0.1:1", "--num-requests", "2", "--rate", "0", "--json")
    out, err = run.communicate(timeout=120)
    assert run.returncode == 2 and json.loads(out)["errors"] == 2, err
    assert "pdspec: error: every request failed; the first: UNAVAILABLE" in err
    run = _bench_serve(tmp_path, "--router", "127.0.0.1:1", "--rate", "nan")
    _, err = run.communicate(timeout=120)
    assert run.returncode == 2 and "--rate: must be a finite number" in err, err


def test_an_interrupted_bench_serve_exits_without_waiting_out_its_requests(tmp_path):
    """Ctrl-C joined every request in flight (each with a 600 s timeout): it hung, a second
    Ctrl-C too. Against a server that accepts and never answers."""
    accepted = []

    def accept(server: socket.socket) -> None:
        while True:
            try:
                accepted.append(server.accept()[0])  # held open: the request waits on it
            except OSError:  # closed: the test is over
                return

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        threading.Thread(target=accept, args=(silent,), daemon=True).start()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        run = _bench_serve(tmp_path, "--http", url, "--num-requests", "3", "--rate", "100",
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            wait_until(lambda: accepted, "no request reached the server", 60)
            run.send_signal(signal.SIGINT)
            assert run.wait(timeout=60) == 130
        finally:
            run.kill()
            run.communicate()
            for connection in accepted:
                connection.close()


def test_the_help_gives_the_defaults_a_command_runs_with():
    """bench spec runs eagle3 (its help said none, which it refuses); with eagle3 the device picks
    K, top-k, the threshold and the batch limit (the help gave the schema's plain values)."""
    help_text = " ".join(_pdspec("bench", "spec", "--help").stdout.split())
    assert "(default: eagle3; none is refused" in help_text
    assert "(default: with eagle3 4 on cpu, 1 on cuda; else 1)" in help_text  # --draft-top-k


def test_run_sh_reads_paths_from_the_callers_directory(tmp_path):
    """It ran every command from the repository, so a path given relative to where the user
    stood was not found there."""
    (tmp_path / "mine.yaml").write_text("{}\n")
    result = subprocess.run(["bash", str(Path(__file__).parents[1] / "scripts" / "run.sh"), "check-config", "--config",
                             "mine.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "mine.yaml: valid" in result.stdout, result.stderr


@pytest.mark.parametrize("flag, message", [
    (["--snapshot-tokens", "inf"], "--snapshot-tokens: each must be a finite count of at least 1, got inf"),
    (["--lr", "nan"], "--lr: must be a positive number, got nan"),
    (["--ttt-steps", "0"], "--ttt-steps: must be a positive number, got 0"),
])
def test_train_eagle3_checks_its_flags_before_distilling(tmp_path, flag, message):
    """They were read only by the training stage, after the distillation's hours (inf a traceback)."""
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Hi"}\n')
    result = _pdspec("train-eagle3", "--prompts", str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / "run"), *flag)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_serve_refuses_an_api_key_it_would_not_send(tmp_path):
    """--api-key is the key of the request --once sends; without --once it did nothing, silently."""
    result = _pdspec("serve", "--config", str(tmp_path / "unread.yaml"), "--api-key", "k")
    assert result.returncode == 2 and "--api-key: the key of the request --once sends" in result.stderr, result.stderr
