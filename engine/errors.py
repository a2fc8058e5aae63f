"""Request errors the serving layer maps to gRPC status codes."""


class InvalidRequest(ValueError):
    """The request itself is wrong (INVALID_ARGUMENT); `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class CapacityExceeded(RuntimeError):
    """The request is valid but cannot fit this worker's resources (RESOURCE_EXHAUSTED)."""


class RequestIdInUse(RuntimeError):
    """The request id still runs here, or its blocks are still held (a retry that arrived before
    its earlier attempt ended): ALREADY_EXISTS, which a router retries elsewhere."""
