"""The deployment schema: one pydantic model that YAML files, the CLI and the Helm chart's
values all map onto. Unknown fields are errors; every error names the field, the value and
what is allowed.
"""

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.config import EngineConfig
from engine.model_dir import model_name
from proto.rpc import free_port
from proto.tls import Tls
from router.config import DAY_S, RouterConfig
from serving.roles import WORKER_ROLES


class _Strict(BaseModel):
    # No inf or NaN anywhere: a time of inf passed validation and later overflowed a wait.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # bind every interface: no address a peer can dial
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class Resources(_Strict):
    """What one replica asks its scheduler (Ray, Kubernetes) for."""

    cpus: float = Field(1.0, gt=0, description="CPU cores per replica")
    gpus: int = Field(0, ge=0, description="GPUs per replica (tensor_parallel_size of them on one node)")
    memory_gb: float | None = Field(None, gt=0, description="memory per replica")
    custom: dict[str, float] = Field(default_factory=dict,
                                     description="Ray custom resources, e.g. {node_kind_prefill: 1} to pin a role to nodes")

    @model_validator(mode="after")
    def _custom_resources(self) -> "Resources":
        for name, amount in self.custom.items():
            if name in _RAY_BUILTIN_RESOURCES:
                raise ValueError(f"custom: {name!r} is one of Ray's own resources; set cpus, gpus or memory_gb instead")
            if amount < 0:
                raise ValueError(f"custom.{name}: {amount:g} is negative; a resource amount is >= 0")
        return self


class RoleConfig(_Strict):
    replicas: int = Field(0, ge=0)
    resources: Resources = Field(default_factory=Resources)
    tensor_parallel_size: int = Field(1, ge=1, description="shard the target over this many devices")
    num_threads: int | None = Field(None, ge=1, description="CPU threads per process: each of a replica's "
                                    "tensor_parallel_size ranks gets this many (default: split the cores)")
    kv_transfer: Literal["nixl", "grpc"] = Field("nixl", description="how decode workers pull KV from prefill workers")
    port: int = Field(0, ge=0, le=65535, description="internal gRPC port (0: any free port)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port (0: any free port)")
    drain_timeout_s: float = Field(30.0, ge=0, le=DAY_S, description="on SIGTERM: after deregistering, time to "
                                   "finish what runs before exiting")

    @model_validator(mode="after")
    def _distinct_ports(self) -> "RoleConfig":
        if self.port and self.port == self.metrics_port:
            raise ValueError(f"port and metrics_port are both {self.port}: a replica listens on each (gRPC and "
                             "/metrics); give them different ports, or 0 (any free port)")
        return self


class TlsConfig(_Strict):
    """PEM files every process of the deployment reads (Helm mounts them from a Secret), and reads
    again when they change (a renewal): new connections, served and opened, use the new certificate."""

    cert_file: Path = Field(description="this process's certificate chain, signed by ca_file's CA")
    key_file: Path = Field(description="the certificate's private key")
    ca_file: Path = Field(description="the cluster's CA: internal peers must present a certificate it signed")
    server_name: str | None = Field(None, min_length=1, description="the name in the certificates' subjectAltName "
                                    "that peers check instead of the address they dial (pod IPs change; null: "
                                    "the address's host must be in the certificate)")

    def load(self) -> Tls:
        return Tls.load(self.cert_file, self.key_file, self.ca_file, self.server_name)


class DeploymentConfig(_Strict):
    engine: EngineConfig = Field(default_factory=EngineConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    prefill: RoleConfig = Field(default_factory=lambda: RoleConfig(replicas=1),
                                description="default: 1 replica, none when only aggregated is given")
    decode: RoleConfig = Field(default_factory=lambda: RoleConfig(replicas=1),
                               description="default: 1 replica, none when only aggregated is given")
    aggregated: RoleConfig = Field(default_factory=RoleConfig)
    pin_timeout_s: float = Field(30.0, gt=0, le=3600, description="prefill blocks stay pinned this long awaiting the decode side")
    cluster_token: str | None = Field(None, description="shared secret of internal RPCs (default: $PDSPEC_CLUSTER_TOKEN)")
    tls: TlsConfig | None = Field(None, description="TLS on the public ports (gRPC and HTTP), mutual TLS on every "
                                  "internal one (null: plaintext, for loopback and trusted networks)")

    def served_model_name(self) -> str:
        """The model's name in the HTTP API: router.served_model_name, else the model's own."""
        return self.router.served_model_name or model_name(self.engine.model)

    def http_url(self, host: str) -> str | None:
        """The OpenAI API's base URL on `host` (None: router.http_port is off); https with tls."""
        port = self.router.http_port
        return None if port is None else f"{'https' if self.tls else 'http'}://{host}:{port}/v1"

    def tls_identity(self) -> Tls | None:
        """The TLS files' contents (None: plaintext); a file that cannot be read is a ValueError naming its field."""
        return self.tls.load() if self.tls else None

    def longest_drain_timeout_s(self) -> float:
        """The longest drain_timeout_s of the router and the worker roles: what stopping them all may take."""
        return max(self.router.drain_timeout_s, *(getattr(self, role).drain_timeout_s for role in WORKER_ROLES))

    def token(self) -> str | None:
        """The cluster token: the config's, else $PDSPEC_CLUSTER_TOKEN."""
        if self.cluster_token:
            return self.cluster_token
        token = os.environ.get("PDSPEC_CLUSTER_TOKEN")
        problem = _token_problem(token) if token else None
        if problem:
            raise ConfigError(f"$PDSPEC_CLUSTER_TOKEN: {problem}")
        return token

    @field_validator("cluster_token")
    @classmethod
    def _token_shape(cls, token: str | None) -> str | None:
        problem = _token_problem(token) if token else None
        if problem:
            raise ValueError(problem)
        return token

    @model_validator(mode="before")
    @classmethod
    def _role_replicas(cls, data: Any) -> Any:
        """A prefill or decode section without `replicas` has the role's default, 1 (RoleConfig's
        0 is aggregated's: the section refused as none, or ran no such worker). `aggregated` given
        alone means aggregated workers alone: the disaggregated roles' default replica each ran
        beside them (a config asking for 2 workers started 4)."""
        if not isinstance(data, dict):
            return data
        data = {**data, **{role: {**data[role], "replicas": 1} for role in ("prefill", "decode")
                           if isinstance(data.get(role), dict) and "replicas" not in data[role]}}
        if {"prefill", "decode"} & data.keys():
            return data
        aggregated = data.get("aggregated")
        replicas = aggregated.get("replicas") if isinstance(aggregated, dict) else getattr(aggregated, "replicas", None)
        return {**data, "prefill": {"replicas": 0}, "decode": {"replicas": 0}} if replicas else data

    @model_validator(mode="after")
    def _roles(self) -> "DeploymentConfig":
        # In a deployment these are per role (each replica its own threads and shards): one place.
        # (A default value is fine: a dumped config lists every field.)
        for field in ("num_threads", "tensor_parallel_size"):
            value = getattr(self.engine, field)
            if value != EngineConfig.model_fields[field].default:
                raise ValueError(f"engine.{field}: set it per role in a deployment "
                                 f"(prefill.{field}, decode.{field}, aggregated.{field}), not under engine (got {value})")
        disaggregated = self.prefill.replicas + self.decode.replicas
        if disaggregated and (not self.prefill.replicas or not self.decode.replicas):
            raise ValueError(
                f"prefill.replicas ({self.prefill.replicas}) and decode.replicas ({self.decode.replicas}) "
                "must both be >= 1 for disaggregated serving, or both 0 with aggregated.replicas >= 1"
            )
        if not disaggregated and not self.aggregated.replicas:
            raise ValueError("no workers: set prefill.replicas and decode.replicas, or aggregated.replicas")
        for role in ("prefill", "decode"):
            if getattr(self, role).replicas and getattr(self, role).tensor_parallel_size > 1:
                raise ValueError(
                    f"{role}.tensor_parallel_size: {getattr(self, role).tensor_parallel_size} is not supported for "
                    "disaggregated roles yet (KV transfer between sharded workers is not implemented); "
                    "allowed: 1, or use aggregated workers for tensor parallelism"
                )
        if self.aggregated.kv_transfer != RoleConfig.model_fields["kv_transfer"].default:
            raise ValueError(f"aggregated.kv_transfer: {self.aggregated.kv_transfer!r} does nothing, an aggregated worker "
                             "moves no KV; leave it unset (prefill.kv_transfer and decode.kv_transfer choose)")
        if disaggregated and self.prefill.kv_transfer != self.decode.kv_transfer:
            raise ValueError(
                f"prefill.kv_transfer ({self.prefill.kv_transfer!r}) and decode.kv_transfer "
                f"({self.decode.kv_transfer!r}) must match: decode workers pull the way prefill workers serve"
            )
        return self


class ConfigError(ValueError):
    """A deployment config that cannot start; the message names the field, value and what is allowed."""


def load_config(path: Path) -> DeploymentConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:  # its own text quotes the line, which may hold the cluster token
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML: {where}{getattr(e, 'problem', None) or type(e).__name__}") from None
    if raw is None:  # taken for {} it started the default deployment: likely not the file meant
        raise ConfigError(f"{path}: the file is empty; write {{}} for the default deployment")
    return parse_config(raw, source=str(path))


def parse_config(raw: dict, source: str = "config") -> DeploymentConfig:
    try:
        return DeploymentConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{source}: " + "; ".join(_describe(err) for err in e.errors())) from None


def with_router(config: DeploymentConfig, source: str, **fields) -> DeploymentConfig:
    """`config` with router fields replaced (e.g. from a CLI flag named `source`), validated as a file is."""
    raw = config.model_dump(mode="json")
    raw["router"].update(fields)
    return parse_config(raw, source=source)


def with_fixed_ports(config: DeploymentConfig, any_internal_port: bool) -> DeploymentConfig:
    """`config` with router.http_port and router.internal_port 0 ("any") replaced by ports free
    now: a launcher reports where the API is and tells workers, restarted ones too, where to
    register. `any_internal_port`: a free internal port in place of the default one too (a launcher
    asked for any public port, as tests do, must not collide on it); one set otherwise stays, as
    workers started by hand dial it."""
    rc, fields = config.router, {}
    if rc.http_port == 0:
        fields["http_port"] = free_port(rc.host)
    default = type(rc).model_fields["internal_port"].default
    if rc.internal_port == 0 or (any_internal_port and rc.internal_port == default):
        fields["internal_port"] = free_port(rc.host)
    return with_router(config, "router ports", **fields) if fields else config


def _token_problem(token: str) -> str | None:
    """What makes `token` unusable as gRPC metadata (a Secret made from a file keeps its trailing
    newline, and every internal call then failed "INTERNAL: Invalid metadata"), or None. The
    token itself is never named: error output reaches logs."""
    if re.fullmatch(r"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?", token):  # gRPC's values: spaces inside only
        return None
    return ("must be printable ASCII, without line breaks or spaces at either end (a file's trailing newline, if "
            "the token was read from one); the value is not shown")


def _describe(err: dict) -> str:
    field = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err.get("type") == "extra_forbidden":  # its value is not shown: a misspelt cluster_token's is the secret
        return f"{field}: not a field here; allowed: {', '.join(_fields_at(err['loc'][:-1]))}"
    secret = err["loc"][:1] == ("cluster_token",)  # never echoed: error output reaches logs
    value = (f" (got {err['input']!r})" if err.get("type") != "missing" and not isinstance(err.get("input"), dict)
             and not secret else "")
    return f"{field}: {err['msg']}{value}"


def _fields_at(loc: tuple) -> list[str]:
    """The field names of the model at `loc` (a path of field names and indices) in the schema."""
    model: Any = DeploymentConfig
    for name in loc:
        if isinstance(name, int) or not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue  # an index into a list, or a value inside a field: the model found so far
        annotation = model.model_fields[name].annotation
        model = next((a for a in (annotation, *getattr(annotation, "__args__", ()))
                      if isinstance(a, type) and issubclass(a, BaseModel)), annotation)
    return sorted(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def check_launchable(config: DeploymentConfig) -> None:
    """What the schema cannot know, checked before any process starts: the model and draft paths
    exist and every role's tensor_parallel_size divides the model's heads. Raises ConfigError."""
    from engine.config import ModelConfig, ModelConfigError, check_divisible
    from engine.model_dir import resolve_model_dir

    try:
        model_dir = resolve_model_dir(config.engine.model)
        model = ModelConfig.from_dir(model_dir)
    except ModelConfigError as e:
        raise ConfigError(f"engine.model: {e}") from None
    draft = config.engine.speculative.model
    if config.engine.speculative.method == "eagle3" and draft is not None and not Path(draft).is_dir():
        raise ConfigError(f"engine.speculative.model: EAGLE3 draft directory {draft} does not exist")
    for role in WORKER_ROLES:
        rc = getattr(config, role)
        if rc.replicas:
            try:
                check_divisible(model, rc.tensor_parallel_size)
            except ModelConfigError as e:
                raise ConfigError(f"{role}.{e}") from None
