"""The chart, its value sets and the real helm binary's calls: what the Helm tests share."""

import subprocess
from pathlib import Path

import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "pdspec"
VALUE_SETS = {"default": None, "multi-gpu": CHART / "values-multi-gpu.yaml"}
WORKER_ROLES = ("prefill", "decode", "aggregated")
# The oldest Kubernetes the chart declares (gRPC probes are GA there) and the newest schemas known.
K8S_VERSIONS = ("1.27", kubernetes_validate.latest_version())


def run_helm(helm: Path, *args: str, values: dict | None = None, tmp_path: Path | None = None
             ) -> subprocess.CompletedProcess:
    """helm with `values` (if any) passed as one more -f file, last so it wins."""
    extra = []
    if values is not None:
        path = tmp_path / "override.yaml"
        path.write_text(yaml.safe_dump(values))
        extra = ["-f", str(path)]
    return subprocess.run([str(helm), *args, *extra], capture_output=True, text=True)


def value_args(name: str) -> list[str]:
    return ["-f", str(VALUE_SETS[name])] if VALUE_SETS[name] else []


def render(helm: Path, *args: str, values: dict | None = None, tmp_path: Path | None = None) -> list[dict]:
    result = run_helm(helm, "template", "rel", str(CHART), *args, values=values, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
