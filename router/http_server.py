"""uvicorn serving the OpenAI API from a thread of the router's process, over TLS when the
router's gRPC ports are."""

import asyncio
import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from proto.tls import Tls

log = logging.getLogger(__name__)
TLS_CHECK_S = 5.0  # how often the HTTP API looks for renewed certificate files


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int, tls: Tls | None = None) -> None:
        # log_config=None: keep the process's own (structured) logging instead of uvicorn's.
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on")
        if tls is not None:  # the router's identity; clients need no certificate (API keys authenticate them)
            config.load()
            config.ssl = tls.ssl_server_context()
        self._tls = tls
        self._host, self._port = host, port
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> int:
        """Serve; returns the bound port once it accepts connections. Binding here (not in
        uvicorn's thread) turns a taken port into an error the caller sees."""
        # IPPROTO_TCP named, as getaddrinfo would: asyncio sets TCP_NODELAY only on sockets that say
        # so, and without it a response's second write waits out the client's delayed ACK (~40 ms).
        sock = socket.socket(socket.AF_INET6 if ":" in self._host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"router.http_port: cannot listen on {self._host}:{self._port}: {e.strerror}") from None
        self._thread = threading.Thread(target=self._run, args=(sock,), name="http-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP API did not start on {self._host}:{self._port}; see the log")
            time.sleep(0.01)
        return sock.getsockname()[1]

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop accepting connections; open ones (a streaming answer) get `grace_s` to finish."""
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=grace_s + 10)

    def _run(self, sock: socket.socket) -> None:
        """uvicorn's Server.run, with the certificate check beside the server on its loop."""
        with asyncio.Runner(loop_factory=self._server.config.get_loop_factory()) as runner:
            runner.run(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> None:
        reloading = asyncio.create_task(self._reload_tls()) if self._tls is not None else None
        try:
            await self._server.serve(sockets=[sock])
        finally:
            if reloading is not None:
                reloading.cancel()

    async def _reload_tls(self) -> None:
        """New certificate files (a renewal) into the live context, for new connections. On this
        loop's thread, the one that starts every connection's TLS session from the context, so
        none starts while the context changes."""
        while True:
            await asyncio.sleep(TLS_CHECK_S)
            try:
                fresh = self._tls.reloaded()
                if fresh is not self._tls:
                    fresh.load_into(self._server.config.ssl)
                    self._tls = fresh
            except Exception:  # the next check tries again; a dead task would never reload
                log.exception("the HTTP API could not take the renewed certificate files")
