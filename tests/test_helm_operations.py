"""The chart's operations settings: public API keys from a Secret the router's pod mounts as a
directory (so the kubelet updates it and the router re-reads it), named by the config's
router.api_key_file; and each worker pod's grace period, its drain time before SIGKILL."""

import shutil

import yaml

from tests.helm_chart import CHART, run_helm
from tests.test_helm import by_kind, render


def test_api_keys_come_from_a_secret_mounted_in_the_router_only(helm, tmp_path):
    docs = render(helm, values={"apiKeys": {"existingSecret": "keys", "key": "k"}}, tmp_path=tmp_path)
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["rel-pdspec-config"]["data"]["config.yaml"])
    path = config["router"]["api_key_file"]
    for name, deployment in by_kind(docs, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        if not name.endswith("-router"):
            assert "api-keys" not in mounts and "api-keys" not in volumes
            continue
        mount, volume = mounts["api-keys"], volumes["api-keys"]
        assert mount["readOnly"] and "subPath" not in mount  # a subPath mount never sees the Secret's updates
        assert volume["secret"]["secretName"] == "keys"
        (item,) = volume["secret"]["items"]
        assert item["key"] == "k" and f"{mount['mountPath']}/{item['path']}" == path


def test_without_a_secret_the_api_is_open(helm, tmp_path):
    docs = render(helm, tmp_path=tmp_path)
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["rel-pdspec-config"]["data"]["config.yaml"])
    assert config["router"].get("api_key_file") is None


def test_worker_pods_get_their_drain_time_before_sigkill(helm, tmp_path):
    """The template's fallback is the schema's default; a set drain_timeout_s is honoured, 0 too
    (`default` took it for unset)."""
    from deploy.config import RoleConfig

    def graces(config: dict) -> dict[str, int]:
        docs = render(helm, values={"config": config}, tmp_path=tmp_path)
        return {name.rsplit("-", 1)[1]: d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
                for name, d in by_kind(docs, "Deployment").items()}

    set_or_not = graces({"decode": {"drain_timeout_s": 90}})
    assert set_or_not["decode"] == 90 + 15
    assert set_or_not["prefill"] == RoleConfig().drain_timeout_s + 15
    zero = graces({"decode": {"drain_timeout_s": 0}, "router": {"drain_timeout_s": 0}})
    assert zero["decode"] == zero["router"] == 15


def test_tls_comes_from_a_secret_every_pod_mounts_where_the_config_says(helm, tmp_path):
    docs = render(helm, values={"tls": {"existingSecret": "certs", "serverName": "pdspec.example"}}, tmp_path=tmp_path)
    tls = yaml.safe_load(by_kind(docs, "ConfigMap")["rel-pdspec-config"]["data"]["config.yaml"])["tls"]
    assert tls["server_name"] == "pdspec.example"
    for deployment in by_kind(docs, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
        assert next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]["secretName"] == "certs"
        for field, key in (("cert_file", "tls.crt"), ("key_file", "tls.key"), ("ca_file", "ca.crt")):
            assert tls[field] == f"{mount['mountPath']}/{key}"
        # The kubelet's gRPC probes cannot speak TLS: they would fail every pod. The router's HTTP
        # API answers HTTPS probes, its readiness following its route, and a worker's metrics port
        # plain HTTP ones, following its engine and its registration (a port open said nothing).
        probes = {probe: container[probe] for probe in ("startupProbe", "readinessProbe", "livenessProbe")}
        if deployment["metadata"]["name"].endswith("-router"):
            assert probes["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http", "scheme": "HTTPS"}
            assert probes["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
        else:
            assert probes["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
            assert probes["livenessProbe"]["httpGet"] == probes["startupProbe"]["httpGet"] == {"path": "/health",
                                                                                             "port": "metrics"}
    plain = render(helm, tmp_path=tmp_path)
    assert "tls" not in yaml.safe_load(by_kind(plain, "ConfigMap")["rel-pdspec-config"]["data"]["config.yaml"])
    assert all("grpc" in d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
               for d in by_kind(plain, "Deployment").values())


def test_under_tls_prometheus_scrapes_the_routers_https_with_the_secrets_ca(helm, tmp_path):
    """The router's /metrics is on its HTTP API, which TLS makes https; the workers' metrics ports
    stay plain."""
    values = {"tls": {"existingSecret": "certs", "serverName": "pdspec.example"}, "serviceMonitor": {"enabled": True}}
    (monitor,) = by_kind(render(helm, values=values, tmp_path=tmp_path), "ServiceMonitor").values()
    endpoints = {e["port"]: e for e in monitor["spec"]["endpoints"]}
    assert endpoints["http"]["scheme"] == "https" and "scheme" not in endpoints["metrics"]
    assert endpoints["http"]["tlsConfig"] == {"ca": {"secret": {"name": "certs", "key": "ca.crt"}},
                                              "serverName": "pdspec.example"}


def test_a_roles_placement_reaches_its_pods_and_the_config_check_runs_where_the_router_does(helm, tmp_path):
    """nodeSelector, tolerations and affinity from placement.<role>; the config-check Job took the
    router's first two but not its affinity (so it could be scheduled where the router cannot)."""
    def placement(zone: str) -> dict:
        return {"nodeSelector": {"pool": zone}, "tolerations": [{"key": zone, "operator": "Exists"}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": [zone]}]}]}}}}

    docs = render(helm, values={"placement": {"router": placement("front"), "decode": placement("gpu")}}, tmp_path=tmp_path)
    pods = {name: d["spec"]["template"]["spec"] for name, d in {**by_kind(docs, "Deployment"), **by_kind(docs, "Job")}.items()}
    for name, zone in (("rel-pdspec-router", "front"), ("rel-pdspec-config-check", "front"), ("rel-pdspec-decode", "gpu")):
        assert {k: pods[name].get(k) for k in ("nodeSelector", "tolerations", "affinity")} == placement(zone), name
    assert not {"nodeSelector", "tolerations", "affinity"} & pods["rel-pdspec-prefill"].keys()


def test_scaling_or_sizing_a_role_restarts_no_pod_and_a_config_change_restarts_all(helm, tmp_path):
    """The config's hash rolls the pods; it covered each role's replicas and resources, which no
    process reads, so scaling decode restarted every pod (the router's Recreate: an outage)."""
    def checksums(config: dict) -> dict[str, str]:
        docs = render(helm, values={"config": config}, tmp_path=tmp_path)
        return {name: d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                for name, d in by_kind(docs, "Deployment").items()}

    before = checksums({})
    assert checksums({"decode": {"replicas": 3, "resources": {"cpus": 3}}}) == before
    changed = checksums({"decode": {"drain_timeout_s": 90}})
    assert changed.keys() == before.keys() and all(changed[name] != before[name] for name in before)


def _notes(helm, tmp_path, values: dict, name: str) -> str:
    """NOTES.txt as helm renders it (`helm template` leaves NOTES.txt out: a copy of the chart holds
    it under another name, whose text --debug prints before failing to parse it as YAML)."""
    chart = tmp_path / name
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "templates" / "notes.txt")
    result = run_helm(helm, "template", "rel", str(chart), "--show-only", "templates/notes.txt", "--debug",
                      values=values, tmp_path=tmp_path)
    return result.stdout.split("# Source: pdspec/templates/notes.txt", 1)[1]


def test_the_notes_commands_speak_tls_when_it_is_on(helm, tmp_path):
    """They said grpcurl -plaintext and http:// under TLS, which the router's public port refuses."""
    tls = _notes(helm, tmp_path, {"tls": {"existingSecret": "certs", "serverName": "pdspec.example"}}, "tls")
    assert "grpcurl -cacert ca.crt -authority pdspec.example localhost:50051 list" in tls
    assert ("curl -s --cacert ca.crt --connect-to pdspec.example:8000:localhost:8000 "
            "https://pdspec.example:8000/v1/models") in tls
    assert "-plaintext" not in tls and "http://" not in tls
    plain = _notes(helm, tmp_path, {}, "plain")
    assert "grpcurl -plaintext localhost:50051 list" in plain and "curl -s http://localhost:8000/v1/models" in plain
