"""The deployment schema refuses what it would otherwise have to override."""

import pytest

from deploy.config import ConfigError, load_config, parse_config


@pytest.mark.parametrize("field", ["num_threads", "tensor_parallel_size"])
def test_per_role_engine_fields_are_refused_under_engine(field):
    with pytest.raises(ConfigError, match=rf"engine.{field}: set it per role in a deployment \(prefill.{field}"):
        parse_config({"engine": {field: 2}})
    roles = {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "aggregated": {"replicas": 1, field: 2}}
    assert getattr(parse_config(roles).aggregated, field) == 2


def test_aggregated_workers_alone_are_what_a_config_naming_only_them_starts():
    """Asking for 2 aggregated workers started 4: the disaggregated roles' default replica each too."""
    roles = lambda c: (c.prefill.replicas, c.decode.replicas, c.aggregated.replicas)  # noqa: E731
    assert roles(parse_config({"aggregated": {"replicas": 2}})) == (0, 0, 2)
    assert roles(parse_config({})) == (1, 1, 0)
    assert roles(parse_config({"aggregated": {"replicas": 2}, "decode": {"replicas": 2}})) == (1, 2, 2)  # mixed: said so
    config = parse_config({"aggregated": {"replicas": 2}})
    assert parse_config(config.model_dump()) == config


def test_a_dumped_config_parses_again():
    """Launchers hand workers the config as YAML with every field listed, defaults included (a
    static tree's own draft_top_k and draft_tree_width among them)."""
    config = parse_config({"engine": {"num_kv_blocks": 64}, "decode": {"replicas": 2, "num_threads": 1}})
    assert parse_config(config.model_dump()) == config
    tree = parse_config({"engine": {"speculative": {"method": "eagle3", "speculative_token_tree": [[0], [1], [0, 0]]}}})
    assert parse_config(tree.model_dump()) == tree


@pytest.mark.parametrize("router, message", [
    ({"heartbeat_interval_s": 5.0}, r"heartbeat_timeout_s \(3\) must exceed heartbeat_interval_s \(5\)"),
    ({"port": 50051, "internal_port": 50051}, r"port \(50051\), internal_port \(50051\) and http_port"),
    ({"port": 8000, "http_port": 8000}, "must differ"),
    ({"host": "::"}, r"router.host: .*IPv6 addresses \(::\) are not supported"),
])
def test_router_settings_that_cannot_work_together_are_refused_by_name(router, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"router": router})
    parse_config({"router": {"port": 0, "internal_port": 0, "http_port": 0}})  # any free ones: fine


@pytest.mark.parametrize("config, message", [
    ({"router": {"request_timeout_s": float("inf")}}, r"router.request_timeout_s: Input should be a finite number"),
    ({"router": {"drain_timeout_s": 1e12}}, r"router.drain_timeout_s: Input should be less than or equal to 86400"),
    ({"pin_timeout_s": float("nan")}, "pin_timeout_s: Input should be a finite number"),
    ({"engine": {"speculative": {"method": "eagle3", "draft_confidence_threshold": float("nan")}}},
     "engine.speculative.draft_confidence_threshold: Input should be a finite number"),
    ({"decode": {"replicas": 1, "port": 7000, "metrics_port": 7000}}, "decode: .*port and metrics_port are both 7000"),
    ({"router": {"host": ""}}, "router.host: String should have at least 1 character"),
    ({"prefill": {"replicas": 1, "resources": {"custom": {"CPU": 2}}}}, "prefill.resources: .*'CPU' is one of Ray's own"),
    ({"decode": {"replicas": 1, "resources": {"custom": {"fast": -1}}}}, "decode.resources: .*custom.fast: -1 is negative"),
    # Checked by every worker as it loaded, so `check-config` and Helm's pre-install check passed them
    ({"engine": {"quantization": "int8", "dtype": "bfloat16"}}, "engine: .*quantization: int8 runs on device cpu"),
    ({"engine": {"model": "/models/other", "speculative": {"method": "eagle3"}}},
     "engine: .*speculative.model: an EAGLE3 draft directory is required for target /models/other"),
])
def test_values_that_would_fail_later_are_refused_by_name(config, message):
    """An inf request_timeout_s once passed and then killed the router's watchdog thread (its wait
    overflowed), leaving stalled streams holding their slots."""
    with pytest.raises(ConfigError, match=message):
        parse_config(config)


def test_a_cluster_token_of_the_wrong_type_is_not_echoed():
    with pytest.raises(ConfigError, match="cluster_token") as e:
        parse_config({"cluster_token": 123456789})
    assert "123456789" not in str(e.value)


def test_a_misspelt_field_names_the_fields_allowed_there_and_not_its_value():
    """A misspelt cluster_token's value is the secret: it was echoed into logs ("got 's3cr3t'")."""
    with pytest.raises(ConfigError, match="cluster-token: not a field here; allowed: aggregated, cluster_token") as e:
        parse_config({"cluster-token": "s3cr3t-9f8e7d"})
    assert "s3cr3t" not in str(e.value)
    with pytest.raises(ConfigError, match=r"router\.prot: not a field here; allowed: .*internal_port.*, port,"):
        parse_config({"router": {"prot": 1}})


def test_a_cluster_token_that_cannot_be_sent_is_refused_by_name(tmp_path, monkeypatch):
    """A Secret made from a file keeps its trailing newline: every internal call then failed
    "INTERNAL: Invalid metadata", naming neither the token nor where it came from."""
    assert parse_config({"cluster_token": "two words-0123456"}).token() == "two words-0123456"  # inner spaces: fine
    with pytest.raises(ConfigError, match="cluster_token: .*printable ASCII, without line breaks") as e:
        parse_config({"cluster_token": "s3cr3t-9f8e7d\n"})
    assert "s3cr3t" not in str(e.value)
    monkeypatch.setenv("PDSPEC_CLUSTER_TOKEN", "s3cr3t-9f8e7d\n")
    with pytest.raises(ConfigError, match=r"\$PDSPEC_CLUSTER_TOKEN: .*printable ASCII") as e:
        parse_config({}).token()
    assert "s3cr3t" not in str(e.value)


def test_a_yaml_error_names_its_line_but_does_not_quote_it(tmp_path):
    """PyYAML's message quotes the line, which may hold the cluster token."""
    path = tmp_path / "bad.yaml"
    path.write_text("cluster_token: s3cr3t-9f8e7d: x\n")
    with pytest.raises(ConfigError, match="not valid YAML: line 1, column 29: mapping values are not allowed here") as e:
        load_config(path)
    assert "s3cr3t" not in str(e.value)


def test_eagle3_left_unset_takes_the_devices_measured_best_and_explicit_fields_stay():
    import argparse
    from pathlib import Path

    import yaml

    from deploy.cli import _add_engine_args, _engine_config
    from engine.config import EAGLE3_DEFAULTS, EngineConfig

    def chosen(spec) -> dict:
        return {k: getattr(spec, k) for k in EAGLE3_DEFAULTS["cpu"]}

    for device in ("cpu", "cuda"):
        assert chosen(EngineConfig(device=device, speculative={"method": "eagle3"}).speculative) == EAGLE3_DEFAULTS[device]
    explicit = EngineConfig(speculative={"method": "eagle3", "draft_top_k": 1, "disable_by_batch_size": None}).speculative
    assert (explicit.draft_top_k, explicit.disable_by_batch_size, explicit.draft_confidence_threshold) == (1, None, None)
    assert EngineConfig(speculative={"method": "ngram"}).speculative.draft_top_k == 1  # eagle3's alone
    parser = argparse.ArgumentParser()  # the CLI: `--speculative eagle3` and nothing else
    _add_engine_args(parser)
    assert chosen(_engine_config(parser.parse_args(["--speculative", "eagle3"])).speculative) == EAGLE3_DEFAULTS["cpu"]
    for name in ("local.yaml", "aggregated.yaml"):  # the configs get them from the one place
        spec = yaml.safe_load((Path(__file__).parent.parent / "deploy" / "configs" / name).read_text())["engine"]["speculative"]
        assert not set(spec) & set(EAGLE3_DEFAULTS["cpu"]), name


def test_a_static_token_tree_comes_from_the_command_line_as_vllm_writes_it():
    import argparse

    from deploy.cli import _add_engine_args, _engine_config

    parser = argparse.ArgumentParser()
    _add_engine_args(parser)
    args = ["--speculative", "eagle3", "--speculative-token-tree", "[(0,), (1,), (0, 0)]"]
    assert _engine_config(parser.parse_args(args)).speculative.speculative_token_tree == [[0], [1], [0, 0]]
    parser.exit = lambda status=0, message=None: (_ for _ in ()).throw(ValueError(message))
    with pytest.raises(ValueError, match=r"expected a list such as \[\[0\], \[1\], \[0, 0\]\]"):
        parser.parse_args(["--speculative-token-tree", "[(0,), (1,)"])
    assert parse_config({"engine": {"speculative": {"method": "eagle3", "speculative_token_tree": [[0], [0, 0]]}}})


@pytest.mark.parametrize("roles, cores, expected", [
    ({"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "aggregated": {"replicas": 1}}, 2, 1),
    ({"prefill": {"replicas": 1}, "decode": {"replicas": 1}}, 2, 1),
    ({"prefill": {"replicas": 1}, "decode": {"replicas": 1}}, 1, 1),
    ({"prefill": {"replicas": 1}, "decode": {"replicas": 1}}, 9, 4),
    ({"prefill": {"replicas": 1}, "decode": {"replicas": 1, "num_threads": 3}}, 9, 4),
])
def test_a_local_cluster_leaves_a_core_to_its_router_and_fronts(roles, cores, expected):
    from deploy.local import default_threads

    config = parse_config(roles)
    threads = default_threads(config, cores)
    assert threads["prefill"] == expected
    assert threads["decode"] == (roles["decode"].get("num_threads") or expected)
    assert threads["aggregated"] == expected
    tensor_parallel = parse_config({"prefill": {"replicas": 0}, "decode": {"replicas": 0},
                                    "aggregated": {"replicas": 1, "tensor_parallel_size": 2}})
    assert default_threads(tensor_parallel, cores)["aggregated"] == max(1, (cores - 1) // 2)  # per rank


def test_a_local_cluster_gives_each_cuda_replica_its_own_gpus():
    """Without CUDA_VISIBLE_DEVICES per process, every replica ran on GPU 0."""
    from deploy.local import cuda_devices

    def visible(roles: dict, devices: str) -> dict[str, str]:
        config = parse_config({"engine": {"device": "cuda"}, **roles})
        return {name: env["CUDA_VISIBLE_DEVICES"] for name, env in
                cuda_devices(config, {"CUDA_VISIBLE_DEVICES": devices}).items()}

    assert visible({"prefill": {"replicas": 1}, "decode": {"replicas": 2}}, "4,5,6,7") == {
        "prefill-0": "4", "decode-0": "5", "decode-1": "6"}
    assert visible({"prefill": {"replicas": 0}, "decode": {"replicas": 0},
                    "aggregated": {"replicas": 2, "tensor_parallel_size": 2}}, "0,1,2,3") == {
        "aggregated-0": "0,1", "aggregated-1": "2,3"}
    with pytest.raises(ConfigError, match="the replicas need 3 GPUs .* this machine shows 2"):
        visible({"prefill": {"replicas": 1}, "decode": {"replicas": 2}}, "0,1")
    assert cuda_devices(parse_config({}), {}) == {}  # cpu: nothing set


def test_a_local_cluster_refuses_a_fixed_port_two_of_its_processes_would_share():
    from deploy.local import check_one_machine_ports

    with pytest.raises(ConfigError, match="decode.metrics_port: 9400 is fixed, but the 2 replicas on this machine"):
        check_one_machine_ports(parse_config({"decode": {"replicas": 2, "metrics_port": 9400}}))
    check_one_machine_ports(parse_config({"decode": {"replicas": 1, "port": 6000}}))  # one replica: fine
    with pytest.raises(ConfigError, match="decode.port: 6000 is prefill.port too, on this machine"):
        check_one_machine_ports(parse_config({"prefill": {"replicas": 1, "port": 6000},
                                              "decode": {"replicas": 1, "port": 6000}}))
    with pytest.raises(ConfigError, match="prefill.metrics_port: 8000 is router.http_port too"):
        check_one_machine_ports(parse_config({"router": {"http_port": 8000},
                                              "prefill": {"replicas": 1, "metrics_port": 8000}}))


def test_a_local_cluster_under_a_wildcard_router_host_uses_loopback_within():
    """The router listens on every interface (its config); its workers listen and register on
    loopback, not on 0.0.0.0, and the addresses printed are loopback's."""
    from deploy.local import LocalCluster

    cluster = LocalCluster(parse_config({"router": {"host": "0.0.0.0"}}), 0, "0.0.0.0")
    assert cluster.host == "127.0.0.1" and cluster.router_address.startswith("127.0.0.1:")
    assert cluster.config.router.host == "0.0.0.0"


def test_a_setting_that_would_do_nothing_is_refused():
    with pytest.raises(ConfigError, match="aggregated.kv_transfer: 'grpc' does nothing"):
        parse_config({"prefill": {"replicas": 0}, "decode": {"replicas": 0},
                      "aggregated": {"replicas": 1, "kv_transfer": "grpc"}})


def test_a_field_whose_none_means_something_takes_none_from_the_command_line():
    """'none' for no batch-size limit (the cpu default is 2) and for the priced threshold."""
    import argparse

    from deploy.cli import _add_engine_args, _engine_config

    parser = argparse.ArgumentParser()
    _add_engine_args(parser)
    args = parser.parse_args(["--speculative", "eagle3", "--disable-by-batch-size", "none",
                              "--draft-confidence-threshold", "None", "--num-speculative-tokens", "3"])
    spec = _engine_config(args).speculative
    assert (spec.disable_by_batch_size, spec.draft_confidence_threshold, spec.num_speculative_tokens) == (None, None, 3)
    parser.exit = lambda status=0, message=None: (_ for _ in ()).throw(ValueError(message))
    with pytest.raises(ValueError, match="invalid int value: 'many'"):
        parser.parse_args(["--disable-by-batch-size", "many"])


def test_a_forward_budget_below_the_batch_size_is_refused():
    """Each running sequence takes one token of a forward's budget: below max_num_seqs, the
    sequences past it held their KV and never decoded until others finished."""
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens: 32 is below max_num_seqs \(64\)"):
        parse_config({"engine": {"max_num_seqs": 64, "max_num_batched_tokens": 32}})
    assert parse_config({"engine": {"max_num_seqs": 32, "max_num_batched_tokens": 32}})


def test_a_tree_that_the_devices_eagle3_defaults_cannot_draft_is_refused():
    """On cuda eagle3 drafts K = 3 by default: a static tree needing 4 passed the check made against
    the field's default (5), and the config failed only when a launcher parsed its dump again."""
    chain = [[0] * depth for depth in range(1, 6)]
    with pytest.raises(ConfigError, match="num_speculative_tokens must be at least 4 .*num_speculative_tokens 3"):
        parse_config({"engine": {"device": "cuda", "speculative": {"method": "eagle3", "speculative_token_tree": chain,
                                                                    "draft_confidence_threshold": 0.0}}})
    assert parse_config({"engine": {"device": "cuda", "speculative": {
        "method": "eagle3", "speculative_token_tree": chain, "num_speculative_tokens": 4}}})


@pytest.mark.parametrize("text, message", [("", "the file is empty; write {} for the default deployment"),
                                           ("[]", r"\(top level\): Input should be a valid dictionary"),
                                           ("false", r"\(top level\): Input should be a valid dictionary")])
def test_a_config_file_that_is_no_mapping_is_refused(tmp_path, text, message):
    """It read as {} (falsy, `or {}`), so a wrong or emptied file started the default deployment."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    path.write_text("{}\n")
    assert load_config(path).prefill.replicas == 1


def test_a_prefill_or_decode_section_without_replicas_has_one():
    """The roles' documented default; a section given for another field took RoleConfig's 0."""
    config = parse_config({"prefill": {"resources": {"cpus": 4}}, "decode": {"kv_transfer": "nixl"}})
    assert (config.prefill.replicas, config.decode.replicas, config.aggregated.replicas) == (1, 1, 0)
    both = parse_config({"prefill": {"kv_transfer": "grpc"}, "decode": {"kv_transfer": "grpc"}, "aggregated": {"replicas": 1}})
    assert (both.prefill.replicas, both.decode.replicas, both.aggregated.replicas) == (1, 1, 1)
    assert parse_config({"aggregated": {"replicas": 2}}).prefill.replicas == 0  # aggregated alone: as before



def test_any_public_port_keeps_an_internal_port_set_by_hand():
    """Asked for any router port (0), a launcher also took any internal port in place of one set,
    which workers started by hand dial; only the default one is replaced (it may be taken)."""
    from deploy.config import with_fixed_ports
    from proto.rpc import free_port

    mine = free_port()
    fixed = with_fixed_ports(parse_config({"router": {"port": 0, "internal_port": mine}}), any_internal_port=True)
    assert fixed.router.internal_port == mine
    default = parse_config({"router": {"port": 0}})
    assert with_fixed_ports(default, any_internal_port=True).router.internal_port != default.router.internal_port


@pytest.mark.parametrize("text, message", [('{"architectures": ["LlamaForCausalLM"]}', "'num_attention_heads' is missing"),
                                           ("{'architectures': 1}", "not valid JSON"),
                                           ("[]", "expected a JSON object"),
                                           # the C attention divided by zero (2 // 4 heads a group), or left rows unwritten
                                           ('{"architectures": ["LlamaForCausalLM"], "num_attention_heads": 6, '
                                            '"num_key_value_heads": 4}', r"num_key_value_heads \(4\) must divide")])
def test_a_malformed_model_config_names_the_field_and_the_file(tmp_path, text, message):
    """A KeyError or a JSON error came out as such (a traceback, or a message naming neither)."""
    from deploy.config import check_launchable

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=f"engine.model: {tmp_path}/config.json: {message}"):
        check_launchable(parse_config({"engine": {"model": str(tmp_path)}}))
