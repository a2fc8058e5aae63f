"""The chart's operations settings: public API keys from a Secret the router's pod mounts as a
directory (so the kubelet updates it and the router re-reads it), named by the config's
router.api_key_file; and each worker pod's grace period, its drain time before SIGKILL."""

import yaml

from tests.test_helm import by_kind, helm, render  # noqa: F401 (helm: the fixture)


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
    """The template's fallback is the schema's default; a set drain_timeout_s is honoured."""
    from deploy.config import RoleConfig

    docs = render(helm, values={"config": {"decode": {"drain_timeout_s": 90}}}, tmp_path=tmp_path)
    graces = {name.rsplit("-", 1)[1]: d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
              for name, d in by_kind(docs, "Deployment").items() if not name.endswith("-router")}
    assert graces["decode"] == 90 + 15
    assert graces["prefill"] == RoleConfig().drain_timeout_s + 15
