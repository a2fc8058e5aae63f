"""The `pdspec` command line."""

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from engine.config import EAGLE3_DEFAULTS, EngineConfig, SpeculativeConfig
from deploy.flags import add_field_flags, field_values, flags_for, seconds
from deploy.logs import LOG_LEVELS, configure_logging
from deploy.supervisor import die_with_parent
from engine.params import SamplingParams
from serving.roles import WORKER_ROLES
from tools.eagle3_training.command import add_train_eagle3

# The engine fields `generate` and `bench spec` expose, and every speculative field (two renamed).
_ENGINE_FLAGS = {"model": "--model", "dtype": "--dtype", "max_model_len": "--max-model-len"}
_SPECULATIVE_FLAGS = flags_for(SpeculativeConfig, renamed={"method": "--speculative", "model": "--draft"})


def _add_engine_args(p: argparse.ArgumentParser, method: str | None = None) -> None:
    """`method`: the command's own default for --speculative (bench spec's is eagle3)."""
    add_field_flags(p, EngineConfig, _ENGINE_FLAGS)
    # With eagle3 the device picks these (EAGLE3_DEFAULTS); the schema's value holds otherwise.
    defaults = {name: f"with eagle3 {value} on cpu, {EAGLE3_DEFAULTS['cuda'][name]} on cuda; else "
                      f"{SpeculativeConfig.model_fields[name].default}"
                for name, value in EAGLE3_DEFAULTS["cpu"].items()}
    add_field_flags(p, SpeculativeConfig, _SPECULATIVE_FLAGS, defaults | ({"method": method} if method else {}))


def _engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(**field_values(args, _ENGINE_FLAGS), speculative=field_values(args, _SPECULATIVE_FLAGS),
                        **overrides)


def _sampling(**flags) -> SamplingParams:
    """The flags' sampling options, checked before any model loads; a bad one named as a flag."""
    try:
        return SamplingParams(**flags)
    except ValidationError as e:
        error = e.errors()[0]
        raise ValueError(f"--{str(error['loc'][0]).replace('_', '-')}: {error['msg']}, got {error['input']!r}") from None


def _generate(args: argparse.Namespace) -> int:
    import torch

    from engine.engine import Engine

    if args.raw and args.system is not None:
        raise ValueError("--system: a raw prompt has no chat template to put it in; leave out --raw or --system")
    params = _sampling(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed)
    engine = Engine(_engine_config(args))
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
    messages.append({"role": "user", "content": args.prompt})
    prompt_ids = engine.tokenizer.encode(args.prompt) if args.raw else engine.tokenizer.encode_chat(messages)
    text, token_ids, last = [], [], None
    start = time.perf_counter()
    with torch.inference_mode():  # held for the whole answer: each step would enter it again (engine/inference.py)
        for last in engine.generate(prompt_ids, params):
            text.append(last.text)
            token_ids.extend(last.token_ids)
            if not args.json:
                print(last.text, end="", flush=True)
    elapsed = time.perf_counter() - start
    if not args.json:
        print()
        return 0
    result = {
        "text": "".join(text),
        "token_ids": token_ids,
        "num_prompt_tokens": len(prompt_ids),
        "num_generated_tokens": len(token_ids),
        "finish_reason": last.finish_reason,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(len(token_ids) / elapsed, 2) if elapsed > 0 else None,
    }
    if last.acceptance is not None:
        result["acceptance"] = last.acceptance.to_dict()
    print(json.dumps(result))
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="answer one chat prompt with the local engine, streaming the text")
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="system message (default: the model's own template default)")
    p.add_argument("--raw", action="store_true", help="feed --prompt as plain text, without the chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (or below 1e-5) = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    _add_engine_args(p)
    p.set_defaults(func=_generate)


def _bench_spec(args: argparse.Namespace) -> int:
    from engine.engine import Engine
    from tools.evaluate import evaluate
    from tools.prompts import read_prompts

    if args.speculative == "none":
        raise ValueError("--speculative: choose eagle3 or ngram to compare against plain decoding")
    for name in ("rounds", "batch_size", "max_prompts"):
        if (value := getattr(args, name)) is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be at least 1, got {value}")
    _sampling(max_tokens=args.max_tokens, temperature=args.temperature)  # before two engines load
    texts = read_prompts(Path(args.prompts))[: args.max_prompts]
    if not texts:
        raise ValueError(f"--prompts {args.prompts} with --max-prompts {args.max_prompts}: no prompts to run")
    blocks = {"num_kv_blocks": 256 * args.batch_size, "max_num_seqs": args.batch_size}
    spec = Engine(_engine_config(args, **blocks))
    base = Engine(_engine_config(args, **blocks).model_copy(update={"speculative": SpeculativeConfig()}))
    prompts = [spec.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in texts]
    result = evaluate(base, spec, prompts, args.max_tokens, args.batch_size, args.temperature, args.rounds)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:<30} {value}")
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from tools.loadgen import make_workload, print_table, run_load, summarize
    from tools.prompts import read_prompts

    for name, least in (("num_requests", 1), ("max_tokens", 1), ("rate", 0), ("num_prefixes", 0)):
        if not (math.isfinite(value := getattr(args, name)) and value >= least):  # nan: a burst before
            raise ValueError(f"--{name.replace('_', '-')}: must be a finite number of at least {least}, got {value}")
    workload = make_workload(read_prompts(Path(args.prompts)), args.num_requests, args.num_prefixes,
                             args.prefix_tokens, args.seed)
    target = args.http or args.router
    summary = summarize(*run_load(target, workload, args.rate, args.max_tokens, args.seed,
                                  api_key=_api_key(args)))
    if args.json:
        print(json.dumps(summary))
    else:
        print_table({target: summary}, list(summary))
    if summary["errors"] == summary["requests"]:  # a run that measured nothing does not end as a success
        raise RuntimeError(f"every request failed; the first: {summary['first_error']}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("spec", help="speculative vs plain decoding on a prompt file, in one run")
    p.add_argument("--prompts", required=True, help="JSONL with 'prompt' or MT-bench style 'turns' (first turn)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    p.add_argument("--rounds", type=int, default=1, help="passes over the prompts (more batches for the interval)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", action="store_true")
    _add_engine_args(p, method="eagle3; none is refused: there is nothing to compare")
    p.set_defaults(func=_bench_spec, speculative="eagle3")
    p = bench.add_parser("serve", help="Poisson load against a running router: TTFT, inter-token latency, throughput")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--router", help="HOST:PORT of the router's gRPC API")
    target.add_argument("--http", metavar="URL", help="base URL of the router's OpenAI API, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--prompts", required=True, help="JSONL with 'prompt' or MT-bench style 'turns' (first turn)")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second, Poisson arrivals; 0: one at a time")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (EOS ignored: equal work per request)")
    p.add_argument("--num-prefixes", type=int, default=0, help="long shared system prompts, each request gets one at random")
    p.add_argument("--prefix-tokens", type=int, default=600, help="approximate length of each shared prefix")
    p.add_argument("--seed", type=int, default=0, help="arrival times")
    _add_api_key(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench_serve)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _catch_signals() -> None:
    """From now on Ctrl-C (SIGINT), SIGTERM and SIGHUP (the terminal closed) raise
    KeyboardInterrupt in the main thread: installed before a server starts, so a signal during
    start-up stops what has started instead of killing the process with its children running."""
    # SIGINT explicitly too: a shell starts a background job with SIGINT ignored, and Python then
    # leaves it ignored, so `kill -INT` would not stop it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


def _wait_for_signal() -> None:
    """Block until one of the signals `_catch_signals` catches."""
    try:
        while True:
            # Short naps: the kernel may deliver the signal to any thread (gRPC's, OpenMP's), and
            # Python runs the handler only when this, the main thread, next wakes up.
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass


def _serve(args: argparse.Namespace) -> int:
    from deploy.config import load_config
    from deploy.local import LocalCluster

    if args.api_key is not None and args.once is None:
        raise ValueError("--api-key: the key of the request --once sends; without --once serve sends none")
    config = _with_router_ports(load_config(Path(args.config)), args.port, args.http_port)
    port = config.router.port
    if args.launcher == "local":
        if args.address is not None:
            raise ValueError("--address: a Ray cluster address needs --launcher ray")
        cluster = LocalCluster(config, port, config.router.host, log_level=args.log_level)
    else:
        from deploy.ray_launch import RayCluster

        # On a cluster we connect to, the deployment outlives this command (`pdspec stop` ends
        # it); a Ray we start ourselves ends with it.
        cluster = RayCluster(config, port, args.address, detached=args.address is not None, log_level=args.log_level)
    try:
        cluster.start(args.start_timeout)
        logs = f" (logs in {cluster.log_dir})" if args.launcher == "local" else ""
        http = f", OpenAI API at {cluster.http_url}" if cluster.http_url else ""
        print(f"pdspec: router ready at {cluster.router_address}{http}{logs}", flush=True)
        if args.once is not None:
            from deploy.client import answer

            answer(cluster.router_address, args.once, cluster.tls, _api_key(args))
        elif args.launcher == "ray" and cluster.detached:
            cluster.disconnect()  # stop() below then has nothing left to end
            print("pdspec: deployed on the Ray cluster; `pdspec stop --address ADDR` ends it", flush=True)
        else:
            _wait_for_signal()
    finally:
        cluster.stop()
    return 0


def _with_router_ports(config, port: int | None, http_port: int | None):
    """--port and --http-port override router.port and router.http_port, checked as the config's own
    (a clash with internal_port names the fields, not a taken address)."""
    from deploy.config import with_router

    given = {field: value for field, value in (("port", port), ("http_port", http_port)) if value is not None}
    return with_router(config, " and ".join(f"--{f.replace('_', '-')}" for f in given), **given) if given else config


def _stop(args: argparse.Namespace) -> int:
    from deploy.ray_launch import stop_deployment

    names = stop_deployment(args.address)
    print(f"pdspec: stopped {', '.join(names)}" if names else "pdspec: no pdspec deployment on that Ray cluster",
          flush=True)
    return 0


def _add_api_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=None, help="a key of the router's api_key_file (default: $PDSPEC_API_KEY)")


def _api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("PDSPEC_API_KEY")


def _chat(args: argparse.Namespace) -> int:
    from deploy.client import answer
    from proto.tls import Tls

    answer(args.router, args.prompt, Tls.load(None, None, args.ca_file) if args.ca_file else None, _api_key(args))
    return 0


def _router(args: argparse.Namespace) -> int:
    from deploy.config import load_config
    from engine.model_dir import resolve_model_dir
    from router.main import run_router

    config = _with_router_ports(load_config(Path(args.config)), args.port, args.http_port)
    tokenizer_dir = resolve_model_dir(config.engine.model, tokenizer_only=True)
    router = run_router(config.router, config.token(), tokenizer_dir, config.served_model_name(),
                        tls=config.tls_identity())
    _wait_for_signal()
    router.stop(config.router.drain_timeout_s)
    return 0


def _worker(args: argparse.Namespace) -> int:
    from deploy.config import load_config
    from deploy.worker import start_worker

    config = load_config(Path(args.config))
    worker = start_worker(config, args.role, args.router, args.host, args.advertise_host, args.worker_id)
    _wait_for_signal()
    worker.stop(drain_timeout_s=getattr(config, args.role).drain_timeout_s)
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from deploy.config import load_config

    config = load_config(Path(args.config))
    workers = ", ".join(f"{role} x{getattr(config, role).replicas}" for role in WORKER_ROLES
                        if getattr(config, role).replicas)
    print(f"{args.config}: valid ({workers})")
    return 0


def _add_cluster(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the router and every worker of a config (Ray actors or local processes)")
    p.add_argument("--config", required=True, help="deployment YAML (see deploy/configs/)")
    p.add_argument("--port", type=int, default=None, help="router port (default: the config's router.port)")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI API port (default: the config's router.http_port; 0: any free port)")
    p.add_argument("--launcher", choices=["ray", "local"], default="ray",
                   help="ray: one Ray actor per process (default); local: plain processes on this machine")
    p.add_argument("--address", default=None,
                   help="Ray cluster to deploy on (HOST:PORT or auto); the deployment then runs on after this "
                        "command returns, until `pdspec stop`. Default: a private Ray on this machine, on loopback")
    p.add_argument("--once", default=None, metavar="PROMPT",
                   help="answer this chat prompt through the router, then shut down (instead of serving until Ctrl-C)")
    _add_api_key(p)
    p.add_argument("--start-timeout", type=seconds, default=900.0, metavar="SECONDS",
                   help="how long every process may take to come up: loading a large model, converting a GGUF")
    p.set_defaults(func=_serve)
    p = sub.add_parser("stop", help="end the pdspec deployment on a Ray cluster (one started with serve --address)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: the one `ray start` recorded here)")
    p.set_defaults(func=_stop)
    p = sub.add_parser("chat", help="send one chat prompt to a running router and stream the answer")
    p.add_argument("--router", default="127.0.0.1:50051")
    p.add_argument("--prompt", required=True)
    p.add_argument("--ca-file", default=None, help="the router's CA (PEM): talk TLS, as a router with tls set needs")
    _add_api_key(p)
    p.set_defaults(func=_chat)
    p = sub.add_parser("check-config", help="check a deployment YAML as serve, router and worker read it, and "
                       "exit: 0 if valid, else 2 with the field, its value and what is allowed")
    p.add_argument("--config", required=True)
    p.set_defaults(func=_check_config)
    p = sub.add_parser("router", help="run the router (one process)")
    p.add_argument("--config", required=True)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--http-port", type=int, default=None)
    p.set_defaults(func=_router)
    p = sub.add_parser("worker", help="run one worker (one process)")
    p.add_argument("--role", required=True, choices=WORKER_ROLES)
    p.add_argument("--config", required=True)
    p.add_argument("--router", required=True, help="the router's registry: host:router.internal_port")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind")
    p.add_argument("--advertise-host", default=None, help="host other workers reach this one at (default: --host)")
    p.add_argument("--worker-id", default=None)
    p.set_defaults(func=_worker)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdspec", description="disaggregated prefill/decode serving with EAGLE3")
    parser.add_argument("--log-level", default=None, type=str.upper, choices=LOG_LEVELS,
                        help="DEBUG, INFO, WARNING, ERROR (default: INFO for servers' own logs, else WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench(sub)
    add_train_eagle3(sub)
    _add_cluster(sub)
    die_with_parent()  # a process the local launcher started: before anything else
    args = parser.parse_args(argv)
    server = args.command in ("serve", "router", "worker")
    configure_logging(args.log_level, server=server)
    if server:
        _catch_signals()
    try:
        return args.func(args)
    except KeyboardInterrupt:  # cut short (a server's start-up or `serve --once`: what had started was stopped on
        return 130  # the way out): a recipe must not go on as if it ended; a running server's signal returns 0
    except (ValueError, RuntimeError, FileNotFoundError, TimeoutError) as e:  # (a start-up that timed out too)
        print(f"pdspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
