"""What the Helm chart refuses, naming the field: values its schema rejects (generated from the
deployment config) and values its templates or the config's own rules cannot work with."""

import tomllib

import pytest
import yaml

from tests.helm_chart import CHART, ROOT, run_helm
from tools import helm_schema


@pytest.mark.parametrize("command", ["template", "lint"])
@pytest.mark.parametrize("override, field", [
    ({"engine": {"speculative": {"method": "medusa"}}}, "config.engine.speculative.method"),
    ({"router": {"policy": "lru"}}, "config.router.policy"),
    ({"prefill": {"resources": {"cpus": 0}}}, "config.prefill.resources.cpus"),
    ({"engine": {"block_sise": 16}}, "config.engine"),
    ({"router": {"request_timeout_s": 1e12}}, "config.router.request_timeout_s"),  # a wait that overflows
    # Its salted hash is in the pods' annotations: a short one is guessed offline. A file's newline broke every call.
    ({"clusterToken": {"value": "short-token"}}, "clusterToken.value"),
    ({"clusterToken": {"value": "a-long-enough-token-but\n"}}, "clusterToken.value"),
])
def test_values_schema_rejects_a_bad_config_naming_the_field(helm, tmp_path, command, override, field):
    values = override if "clusterToken" in override else {"config": override}
    result = run_helm(helm, command, *(["rel"] if command == "template" else []), str(CHART), values=values,
                      tmp_path=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "don't meet the specifications of the schema" in output
    assert f"- {field}:" in output


@pytest.mark.parametrize("override, field", [
    ({"config": {"router": {"host": "127.0.0.1"}}}, "config.router.host"),
    ({"config": {"router": {"host": "::"}}}, "config.router.host"),  # the router binds IPv4 or host names
    ({"config": {"tls": {"cert_file": "/c", "key_file": "/k", "ca_file": "/ca"}}}, "config.tls"),  # the Secret's way
    ({"config": {"decode": {"port": 0}}}, "config.decode.port"),
    ({"config": {"prefill": {"metrics_port": 0}}}, "config.prefill.metrics_port"),
    ({"config": {"cluster_token": "oops"}}, "config.cluster_token"),
    ({"config": {"router": {"api_key_file": "/keys"}}}, "config.router.api_key_file"),
    ({"config": {"router": {"http_port": 0}}}, "config.router.http_port"),
    ({"config": {"router": {"http_port": 50051}}}, "config.router.http_port"),  # the gRPC port
    ({"image": {"pullPolicy": "Sometimes"}}, "image.pullPolicy"),
    ({"config": {"engine": {"device": "cuda"}}}, "config.prefill.resources.gpus"),  # no GPU requested: crashed at start
    # The config's own cross-field rules (deploy/config.py's validators): the schema cannot hold them.
    ({"config": {"prefill": {"replicas": 0}}}, "config.prefill.replicas (0) and config.decode.replicas (1)"),
    ({"config": {"prefill": {"replicas": 0}, "decode": {"replicas": 0}}}, "config.aggregated.replicas: no workers"),
    ({"config": {"engine": {"num_threads": 4}}}, "config.engine.num_threads"),
    ({"config": {"engine": {"tensor_parallel_size": 2}}}, "config.engine.tensor_parallel_size"),
    ({"config": {"prefill": {"tensor_parallel_size": 2}}}, "config.prefill.tensor_parallel_size"),
    ({"config": {"decode": {"kv_transfer": "grpc"}}}, "config.prefill.kv_transfer (nixl) and config.decode.kv_transfer (grpc)"),
    ({"config": {"aggregated": {"kv_transfer": "grpc"}}}, "config.aggregated.kv_transfer"),
    ({"config": {"router": {"internal_port": 50051}}}, "config.router.internal_port"),
    ({"config": {"router": {"internal_port": 8000}}}, "config.router.internal_port"),  # the HTTP port
    ({"config": {"router": {"heartbeat_timeout_s": 0.5}}}, "config.router.heartbeat_timeout_s (0.5)"),
    ({"config": {"decode": {"port": 9400, "metrics_port": 9400}}}, "config.decode: port and metrics_port are both 9400"),
])
def test_chart_rejects_values_that_cannot_work_in_kubernetes(helm, tmp_path, override, field):
    result = run_helm(helm, "template", "rel", str(CHART), values=override, tmp_path=tmp_path)
    assert result.returncode != 0
    assert field in result.stderr


def test_values_schema_is_generated_from_the_deployment_config():
    committed = (CHART / "values.schema.json").read_text()
    assert committed == helm_schema.render(), "stale: run `python -m tools.helm_schema`"


def test_chart_app_version_is_the_project_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
