"""Write the Helm chart's values.schema.json: `config` is DeploymentConfig's own JSON schema, so
Helm rejects a bad config (naming the field) before it renders anything, and the rest are the
chart's Kubernetes-only values. Generated, never edited: tests/test_helm.py fails when stale.

    python -m tools.helm_schema
"""

import json
from pathlib import Path

from deploy.config import DeploymentConfig
from serving.roles import WORKER_ROLES

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "pdspec" / "values.schema.json"

# Kubernetes objects (tolerations, volumes, ...) are checked by the API server; here they only
# need the right shape, so a typo'd key at the chart's level still fails early.
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_OBJECTS = {"type": "array", "items": {"type": "object"}}
# A Kubernetes label key: an optional DNS-subdomain prefix and `/`, then a name.
_LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
_QUANTITY = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPEm])?$"}


def _strict(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": properties,
            **({"required": list(required)} if required else {})}


def _named_objects(*required: str) -> dict:
    return {"type": "array", "items": {"type": "object", "required": list(required)}}


_PLACEMENT = _strict({"nodeSelector": _STR_MAP, "tolerations": _OBJECTS, "affinity": {"type": "object"}})

CHART_PROPERTIES = {
    "image": _strict({
        "repository": {"type": "string", "minLength": 1},
        "tag": {"type": "string", "description": "empty: appVersion, plus -cpu when config.engine.device is cpu"},
        "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    }, required=("repository",)),
    "imagePullSecrets": _named_objects("name"),
    "clusterToken": _strict({
        "existingSecret": {"type": "string", "description": "use this Secret and create none"},
        "key": {"type": "string", "pattern": r"^[-._a-zA-Z0-9]+$"},
        # Its salted hash is in every pod's annotations (a new token rolls them): a short one could be
        # guessed offline by anyone who reads pods. And it is gRPC metadata: no spaces or line breaks.
        "value": {"type": "string", "pattern": r"^([\x21-\x7e][\x20-\x7e]{14,}[\x21-\x7e])?$",
                  "description": "empty: generated once, kept across upgrades; else 16 or more printable ASCII "
                  "characters, no spaces at either end"},
    }, required=("key",)),
    "apiKeys": _strict({
        "existingSecret": {"type": "string", "description": "a Secret of public API keys; empty: the API is open"},
        "key": {"type": "string", "pattern": r"^[-._a-zA-Z0-9]+$"},
    }, required=("key",)),
    "tls": _strict({
        "existingSecret": {"type": "string", "description": "a Secret with tls.crt, tls.key and ca.crt for every pod; "
                           "empty: plaintext"},
        "serverName": {"type": "string", "minLength": 1, "description": "the certificates' DNS name peers check"},
    }, required=("serverName",)),
    "logLevel": {"enum": ["", "DEBUG", "INFO", "WARNING", "ERROR"]},
    "configCheck": _strict({
        "enabled": {"type": "boolean", "description": "check the config with pdspec before installs and upgrades"},
        "timeoutSeconds": {"type": "integer", "minimum": 1},
    }),
    "service": _strict({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}, "annotations": _STR_MAP}),
    "routerResources": {"type": "object"},
    "placement": _strict({role: _PLACEMENT for role in ("router", *WORKER_ROLES)}),
    "podAnnotations": _STR_MAP,
    "podSecurityContext": {"type": "object"},
    "securityContext": {"type": "object"},
    "startupProbe": _strict({
        "periodSeconds": {"type": "integer", "minimum": 1},
        "failureThreshold": {"type": "integer", "minimum": 1},
    }),
    "shmSizeLimit": _QUANTITY,
    "extraEnv": _named_objects("name"),
    "volumes": _named_objects("name"),
    "volumeMounts": _named_objects("name", "mountPath"),
    "podDisruptionBudget": _strict({
        "enabled": {"type": "boolean"},
        "maxUnavailable": {"anyOf": [{"type": "integer", "minimum": 0},
                                     {"type": "string", "pattern": r"^[0-9]+%$"}]},
    }),
    "serviceMonitor": _strict({
        "enabled": {"type": "boolean"},
        "interval": {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h))+$"},
        "labels": _STR_MAP,
    }),
    "grafanaDashboard": _strict({
        "enabled": {"type": "boolean"},
        "label": {"type": "string", "pattern": _LABEL_KEY},
        "labelValue": {"type": "string", "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"},
        "namespace": {"type": "string", "pattern": r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
                      "description": "empty: the release's"},
        "annotations": _STR_MAP,
    }),
    # Helm adds `global` to a chart's values when it is used as a subchart.
    "global": {"type": "object"},
}


def build_schema() -> dict:
    # draft-07 with #/definitions refs: what both Helm's current and older validators understand.
    config = DeploymentConfig.model_json_schema(ref_template="#/definitions/{model}")
    definitions = config.pop("$defs")
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "pdspec Helm chart values",
        "type": "object",
        "additionalProperties": False,
        "required": ["config", "image", "clusterToken"],
        "properties": {"config": config, **CHART_PROPERTIES},
        "definitions": definitions,
    }


def render() -> str:
    return json.dumps(build_schema(), indent=2) + "\n"


def main() -> None:
    SCHEMA_PATH.write_text(render())
    print(f"wrote {SCHEMA_PATH}")


if __name__ == "__main__":
    main()
