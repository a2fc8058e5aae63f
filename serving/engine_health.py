"""A worker's gRPC health follows its engine loop: every service and the "" (liveness) one answer
NOT_SERVING while the loop is in trouble (its thread dead, stuck in a step, or failing every step:
engine/loop.py), asked at each check. Without it the checks said SERVING whatever the engine did:
the router's probe after a failed call kept a broken worker in routing (idle, the least loaded, it
took every first attempt), and Kubernetes' liveness probe never restarted it."""

from grpc_health.v1 import health, health_pb2

from engine.loop import EngineLoop


class EngineHealth(health.HealthServicer):
    """`ready_service` (the worker's own service: readiness) answers SERVING only while the router
    knows the worker (`registered`): a worker the router refuses (another cluster token, a KV
    layout its peers cannot take) or cannot reach answered SERVING everywhere, and a Kubernetes
    rollout counted a pod that served nothing as ready. Liveness ("") follows the engine alone:
    restarting a worker would not bring its router back."""

    def __init__(self, loop: EngineLoop, ready_service: str):
        super().__init__()
        self.loop, self.ready_service = loop, ready_service
        self.known = False  # by the router

    def registered(self, known: bool) -> None:
        """The router knows the worker now (or no longer)."""
        self.known = known
        self.set(self.ready_service, health_pb2.HealthCheckResponse.SERVING if known
                 else health_pb2.HealthCheckResponse.NOT_SERVING)

    def live(self) -> bool:
        """Liveness: the engine loop serves (the HTTP /health on the metrics port asks too)."""
        return not self.loop.trouble()

    def ready(self) -> bool:
        """Readiness: live, and the router knows the worker (the HTTP /ready)."""
        return self.live() and self.known

    def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:
        if not self.live():
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return super().Check(request, context)
