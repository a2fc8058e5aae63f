"""Public API keys (router.api_key_file): who may call Generate and Abort.

The file holds one key per line (blank lines and '#' comments ignored) and is re-read when it
changes, so keys are added and revoked without a restart. Clients send `authorization: Bearer
<key>` (gRPC metadata, or the HTTP header the OpenAI front forwards). A request is owned by its
key: Abort ends only requests made with the same one. Health, reflection and /metrics stay open.
"""

import hashlib
import hmac
import logging
import threading
import time
from pathlib import Path

from proto.rpc import MetadataGate

log = logging.getLogger(__name__)
AUTHORIZATION_METADATA_KEY = "authorization"
_RECHECK_S = 1.0  # how often the file's modification time is looked at


class ApiKeys:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._keys = self._read()  # a bad file fails the router's start, naming the field

    def owner(self, authorization: str) -> str | None:
        """The caller's identity (a digest of its key) for an `authorization` value, or None if it
        holds no current key."""
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = hashlib.sha256(key.strip().encode()).hexdigest()
        keys = self._current()
        return digest if any(hmac.compare_digest(digest, k) for k in keys) else None

    def gate(self, names: set[str]) -> MetadataGate:
        def refusal(metadata: dict[str, str]) -> str | None:
            if self.owner(metadata.get(AUTHORIZATION_METADATA_KEY, "")) is not None:
                return None
            return "missing or unknown API key: send the metadata 'authorization: Bearer <key>' with a key of " \
                   "router.api_key_file"

        return MetadataGate(names, refusal)

    def _current(self) -> frozenset[str]:
        now = time.monotonic()
        with self._lock:
            if now - self._checked >= _RECHECK_S:
                self._checked = now
                try:
                    if self._stat() != self._stamp:
                        self._keys = self._read()
                        log.info("re-read %d API keys from %s", len(self._keys), self._path)
                except (OSError, ValueError) as e:  # keep serving with the keys we had
                    log.warning("router.api_key_file: keeping the previous keys: %s", e)
            return self._keys

    def _stat(self) -> tuple[int, int]:
        st = self._path.stat()
        return st.st_mtime_ns, st.st_size

    def _read(self) -> frozenset[str]:
        try:
            self._stamp = self._stat()
            lines = self._path.read_text().splitlines()
        except OSError as e:
            raise ValueError(f"router.api_key_file: cannot read {self._path}: {e.strerror}") from None
        keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise ValueError(f"router.api_key_file: {self._path} holds no key (one per line)")
        return frozenset(hashlib.sha256(k.encode()).hexdigest() for k in keys)
