"""The Grafana dashboard the chart ships: rendered only when asked for, labelled for Grafana's
sidecar, a well-formed dashboard model, and every query names samples and labels pdspec's code
exports."""

import json
import re
from types import SimpleNamespace

from engine.stats import EngineStats
from proto.pdspec.v1 import common_pb2, router_pb2
from router.metrics import RouterMetrics
from serving.metrics import EngineCollector, HandoffMetrics
from tests.test_helm import CHART, by_kind, merged_values, render

def exported_samples() -> dict[str, set[str]]:
    """Every sample pdspec's code exports, name -> label names: the router's request metrics after
    one served request and one refused (prometheus-client shows a labelled metric only once a label
    set is used),
    a decode worker's KV hand-off, and a worker's engine gauges over a stats snapshot."""
    router = RouterMetrics("m", lambda: (0, 0))
    request = router.start()
    request.on_response(router_pb2.GenerateResponse(token_ids=[1], prefill_worker="p", decode_worker="d"))
    request.on_response(router_pb2.GenerateResponse(token_ids=[2, 3]))
    request.on_response(router_pb2.GenerateResponse(
        token_ids=[4], finish_reason="stop",
        usage=common_pb2.Usage(prompt_tokens=9, completion_tokens=4, cached_prompt_tokens=4, queue_seconds=0.01),
        acceptance=common_pb2.Acceptance(steps=2, drafted=4, accepted=1, accepted_per_position=[1, 0])))
    request.finish("OK")
    router.refusal("http")("401")
    handoff = HandoffMetrics("w")
    handoff.observe(0.002, 1 << 20)
    stats = EngineStats(kv_blocks_used=3, kv_blocks_total=512, running=1, waiting=0, pinned=0, kv_blocks_waiting=0,
                        counters={"generated_tokens": 4})
    engine = EngineCollector(SimpleNamespace(stats=lambda: stats), "decode", "w")
    families = [*router.registry.collect(), *handoff.registry.collect(), *engine.collect()]
    assert all(family.samples for family in families), [f.name for f in families if not f.samples]
    samples: dict[str, set[str]] = {}
    for family in families:
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


def dashboard_config_map(docs: list[dict]) -> dict:
    return by_kind(docs, "ConfigMap")["rel-pdspec-dashboard"]


def test_dashboard_is_off_by_default(helm):
    assert "rel-pdspec-dashboard" not in by_kind(render(helm), "ConfigMap")
    # the multi-GPU example turns it on, so the Kubernetes schema test validates its ConfigMap
    assert merged_values("multi-gpu")["grafanaDashboard"]["enabled"]


def test_dashboard_config_map_is_labelled_for_the_grafana_sidecar(helm, tmp_path):
    docs = render(helm, "--set", "grafanaDashboard.enabled=true")
    config_map = dashboard_config_map(docs)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "namespace" not in config_map["metadata"]  # the release's
    assert config_map["data"]["pdspec.json"] == (CHART / "dashboards" / "pdspec.json").read_text().rstrip("\n")
    values = {"grafanaDashboard": {"enabled": True, "label": "example.com/dashboard", "labelValue": "pdspec",
                                   "namespace": "monitoring", "annotations": {"grafana_folder": "LLM"}}}
    metadata = dashboard_config_map(render(helm, values=values, tmp_path=tmp_path))["metadata"]
    assert metadata["labels"]["example.com/dashboard"] == "pdspec" and "grafana_dashboard" not in metadata["labels"]
    assert (metadata["namespace"], metadata["annotations"]) == ("monitoring", {"grafana_folder": "LLM"})


def test_dashboard_is_a_grafana_dashboard_model(helm):
    dashboard = json.loads(dashboard_config_map(render(helm, "--set", "grafanaDashboard.enabled=true"))["data"]["pdspec.json"])
    assert dashboard["uid"] == "pdspec" and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()  # grid cells taken: panels lie within the 24 columns and never overlap
    for panel in panels:
        g = panel["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh") and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, panel["title"]
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries" and panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"], panel["title"]


def test_every_dashboard_query_names_metrics_pdspec_exports(helm):
    """Each metric a query names is a sample the code exports (histogram quantiles read the
    family's `_bucket` samples; counters their `_total`), and each label it groups, selects or
    ignores by is one of those samples' labels."""
    dashboard = json.loads(dashboard_config_map(render(helm, "--set", "grafanaDashboard.enabled=true"))["data"]["pdspec.json"])
    samples = exported_samples()
    queries = [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queries += [(f"${v['name']}", v["definition"]) for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(queries) > 20
    for title, expr in queries:
        expr = re.sub(r"\$\w+", "", expr)  # $model, $__rate_interval: Grafana's, not names
        metrics = set(re.findall(r"pdspec_[a-z0-9_]+", expr))
        assert metrics, (title, expr)
        assert metrics <= samples.keys(), (title, metrics - samples.keys())
        labels = set().union(*(samples[m] for m in metrics))
        used = {name.strip() for group in re.findall(r"\b(?:by|ignoring)\s*\(([^)]*)\)", expr)
                for name in group.split(",") if name.strip()}
        used |= set(re.findall(r"(\w+)\s*=~?", expr))  # selectors: {model=~"..."}
        used |= set(re.findall(r"label_values\(\s*\w+\s*,\s*(\w+)\s*\)", expr))
        assert used <= labels, (title, used - labels)
