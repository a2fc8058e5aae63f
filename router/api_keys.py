"""Public API keys (router.api_key_file): who may call Generate and Abort.

The file holds one key per line (blank lines and '#' comments ignored) and is re-read when it
changes, so keys are added and revoked without a restart (an emptied, removed or unreadable
file accepts no key). Clients send `authorization: Bearer
<key>` (gRPC metadata, or the HTTP header the OpenAI front forwards). A request is owned by its
key: Abort ends only requests made with the same one. Health, reflection and /metrics stay open.
"""

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from proto.rpc import MetadataGate

log = logging.getLogger(__name__)
AUTHORIZATION_METADATA_KEY = "authorization"
_RECHECK_S = 1.0  # how often the file's modification time is looked at
# gRPC metadata carries printable ASCII, HTTP headers Latin-1 (read back as UTF-8 here): such a
# key could be held and never sent.
_UNSENDABLE = "a key must be printable ASCII (gRPC metadata and HTTP headers carry no other); not echoed"


class ApiKeys:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._checked = 0.0
        try:  # a bad file fails the router's start, naming the field
            self._stamp = self._stat()
            self._keys, unsendable = self._read()
            if unsendable:
                raise ValueError(f"router.api_key_file: {path} line {unsendable[0]}: {_UNSENDABLE}")
        except OSError as e:
            raise ValueError(f"router.api_key_file: cannot read {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"router.api_key_file: {path} is not UTF-8 text (byte {e.start}); one key per line")
        if not self._keys:
            raise ValueError(f"router.api_key_file: {path} holds no key (one per line)")

    def owner(self, authorization: str) -> str | None:
        """The caller's identity (a digest of its key) for an `authorization` value, or None if it
        holds no current key."""
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = hashlib.sha256(key.strip().encode()).hexdigest()
        keys = self._current()
        return digest if any(hmac.compare_digest(digest, k) for k in keys) else None

    def gate(self, names: set[str], refused: Callable[[str], None] = lambda status: None) -> MetadataGate:
        """`refused(status)`: called for each call the gate refuses (the router's metrics count it)."""
        def refusal(metadata: dict[str, str]) -> str | None:
            if self.owner(metadata.get(AUTHORIZATION_METADATA_KEY, "")) is not None:
                return None
            refused("UNAUTHENTICATED")
            return "missing or unknown API key: send the metadata 'authorization: Bearer <key>' with a key of " \
                   "router.api_key_file"

        return MetadataGate(names, refusal)

    def _current(self) -> frozenset[str]:
        """The keys the file holds now. Emptied, it revokes them all; gone or unreadable, no key is
        accepted either (an operator deleting it means to shut the API, and a key leaked is not
        kept working by a file that cannot be read)."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked >= _RECHECK_S:
                self._checked = now
                try:
                    stamp = self._stat()
                    if stamp != self._stamp:
                        self._keys, unsendable = self._read()
                        self._stamp = stamp
                        for line in unsendable:  # the other keys go on working
                            log.error("router.api_key_file: %s line %d: %s; it is ignored", self._path, line, _UNSENDABLE)
                        log.log(logging.INFO if self._keys else logging.WARNING, "re-read %d API keys from %s%s",
                                len(self._keys), self._path, "" if self._keys else ": every call is refused")
                except (OSError, ValueError) as e:  # ValueError: not UTF-8 (a torn write, a Latin-1 comment)
                    if self._stamp is not None:
                        log.error("router.api_key_file: cannot read %s (%s): every call is refused until it can",
                                  self._path, e)
                    self._stamp, self._keys = None, frozenset()
            return self._keys

    def _stat(self) -> tuple[int, int]:
        st = self._path.stat()
        return st.st_mtime_ns, st.st_size

    def _read(self) -> tuple[frozenset[str], list[int]]:
        """The keys' digests, and the numbers of the lines holding a key no client can send."""
        keys, unsendable = [], []
        for number, line in enumerate(self._path.read_text().splitlines(), start=1):
            key = line.strip()
            if not key or key.startswith("#"):
                continue
            if key.isascii() and key.isprintable():
                keys.append(key)
            else:
                unsendable.append(number)
        return frozenset(hashlib.sha256(k.encode()).hexdigest() for k in keys), unsendable
