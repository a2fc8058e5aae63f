"""`pdspec serve --launcher local` as a user runs it: signals stop every process it started, and
its processes die with it when it is killed outright."""

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

CONFIG = {"engine": {"num_kv_blocks": 64, "max_num_seqs": 2, "speculative": {"method": "none"}},
          "router": {"port": 0}, "prefill": {"replicas": 0}, "decode": {"replicas": 0}, "aggregated": {"replicas": 1}}


def _serve(tmp_path: Path, ignore_sigint: bool = False) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """Start serve and wait until it is ready; returns it and the processes it started."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    args = [sys.executable, "-m", "deploy.cli", "serve", "--config", str(config), "--launcher", "local"]
    if ignore_sigint:
        # A shell's background job starts with SIGINT ignored; a signal disposition survives exec. Set
        # in a process of its own, not by a preexec_fn: with one, Python forks instead of vforking,
        # and gRPC's fork handlers (this test process has run gRPC) aborted the child now and then
        # ("epoll_wait error: Bad file descriptor", grpc/grpc#43055).
        args = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "os.execv(sys.argv[1], sys.argv[1:])", *args]
    serve = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    for line in serve.stdout:
        if "router ready" in line:
            break
        output.append(line)
    else:
        pytest.fail(f"serve exited ({serve.wait()}) before it was ready; its output ended:\n" + "".join(output[-20:]))
    children = psutil.Process(serve.pid).children()
    assert len(children) == 2  # the router and the aggregated worker
    return serve, children


def _gone(processes: list[psutil.Process], timeout_s: float = 60.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return alive


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_serve_and_every_process_it_started(tmp_path, sig):
    serve, children = _serve(tmp_path, ignore_sigint=True)
    serve.send_signal(sig)
    assert serve.wait(timeout=60) == 0
    assert _gone(children, timeout_s=5) == []


def test_processes_die_with_a_killed_serve(tmp_path):
    serve, children = _serve(tmp_path)
    serve.kill()
    serve.wait()
    assert _gone(children) == []


def test_a_router_that_cannot_start_is_reported_at_once_with_its_log(tmp_path):
    """Its HTTP port taken: the launcher says so from the router's log, instead of waiting out
    the start-up timeout for a health check that can never pass."""
    import socket

    from deploy.config import parse_config
    from deploy.local import LocalCluster

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = parse_config({**CONFIG, "router": {**CONFIG.get("router", {}), "port": 0,
                                                    "http_port": taken.getsockname()[1]}})
        with pytest.raises(RuntimeError, match=r"router exited during start-up(.|\n)*router.http_port"):
            LocalCluster(config, 0, log_dir=tmp_path).start(timeout_s=120)
