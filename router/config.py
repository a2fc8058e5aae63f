"""The router's section of the deployment schema (deploy/config.py composes it with the others)."""

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The longest time a config may set (a request's deadline, a drain): a time is a wait somewhere,
# and threading's waits raise OverflowError past their limit (an inf killed the watchdog thread).
DAY_S = 86400.0


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # an inf time overflowed the watchdog's wait

    host: str = Field("127.0.0.1", min_length=1, description="the address the router listens on (0.0.0.0: every "
                      "interface)")
    port: int = Field(50051, ge=0, le=65535, description="public gRPC port (0: pick a free one)")
    internal_port: int = Field(50052, ge=0, le=65535, description="the internal Registry's gRPC port, where "
                               "workers register (mutual TLS when tls is set; 0: pick a free one)")
    http_port: int | None = Field(None, ge=0, le=65535,
                                  description="OpenAI-compatible HTTP API port (null: off; 0: pick a free one)")
    served_model_name: str | None = Field(None, min_length=1, description="the model name the HTTP API serves "
                                          "(default: the model directory's name; the embedded model's own name)")
    api_key_file: Path | None = Field(None, description="public API keys, one per line, re-read on change (emptied "
                                      "or removed: no key is accepted); clients send 'authorization: Bearer <key>' "
                                      "(null: the public API is open)")
    policy: Literal["kv", "round_robin", "random"] = "kv"
    overlap_weight: float = Field(1.0, ge=0.0, description="weight of prefill blocks to compute in the kv cost")
    temperature: float = Field(0.0, ge=0.0, description="softmax temperature over -cost; 0 = always the cheapest")
    heartbeat_interval_s: float = Field(0.5, gt=0, le=60)
    heartbeat_timeout_s: float = Field(3.0, gt=0, le=3600, description="a worker silent this long is evicted")
    request_timeout_s: float = Field(120.0, gt=0, le=DAY_S, description="deadline of a whole request: its prefill/decode calls, "
                                     "retries and stream (a stream still open 10 s past it, its client not reading, "
                                     "is cancelled)")
    max_retries: int = Field(2, ge=0, description="retries on another worker when one fails before the first token")
    max_queued_requests: int = Field(128, ge=0, le=1024, description="requests waiting for a running slot (the "
                                     "decoding workers' max_num_seqs, together) beyond which new ones are refused "
                                     "at once")
    max_queue_seconds: float = Field(30.0, gt=0, le=3600, description="longest wait for a running slot; a request expected "
                                     "to wait longer is refused at once (RESOURCE_EXHAUSTED, HTTP 429)")
    drain_timeout_s: float = Field(30.0, ge=0, le=DAY_S, description="on SIGTERM: new requests are refused and running ones "
                                   "get this long to finish before the router exits")

    @field_validator("host")
    @classmethod
    def _ipv4_or_name(cls, host: str) -> str:
        if ":" in host:
            raise ValueError(f"IPv6 addresses ({host}) are not supported; use an IPv4 address or a host name, e.g. "
                             "0.0.0.0 for every interface")
        return host

    @model_validator(mode="after")
    def _check(self) -> "RouterConfig":
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must exceed heartbeat_interval_s "
                             f"({self.heartbeat_interval_s:g}): a worker would be evicted between its heartbeats")
        ports = [p for p in (self.port, self.internal_port, self.http_port) if p]
        if len(set(ports)) != len(ports):
            raise ValueError(f"port ({self.port}), internal_port ({self.internal_port}) and http_port "
                             f"({self.http_port}) must differ (0: pick a free one)")
        return self
