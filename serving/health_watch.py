"""A worker's gRPC health follows its engine loop: every service and the "" (liveness) one answer
NOT_SERVING while the loop is in trouble (its thread dead, stuck in a step, or failing every step:
engine/loop.py), SERVING again once it serves. Without it the health checks said SERVING whatever
the engine did: the router's probe after a failed call kept a broken worker in routing (idle, the
least loaded, it took every first attempt), and Kubernetes' liveness probe never restarted it."""

import logging
import threading

from grpc_health.v1 import health, health_pb2

from engine.loop import EngineLoop

log = logging.getLogger(__name__)
INTERVAL_S = 1.0


class HealthWatch:
    def __init__(self, loop: EngineLoop, servicer: health.HealthServicer, services: list[str]):
        self.loop, self.servicer, self.services = loop, servicer, ["", *services]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        serving = True
        while not self._stop.wait(INTERVAL_S):
            trouble = self.loop.trouble()
            if bool(trouble) != serving:
                continue
            serving = not trouble
            if trouble:
                log.error("%s: health checks answer NOT_SERVING until it serves again", trouble)
            else:
                log.warning("the engine serves again: health checks answer SERVING")
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in self.services:
                self.servicer.set(name, status)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
