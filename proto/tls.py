"""A process's TLS identity, read from PEM files and re-read when they change.

Certificates are short-lived where they are managed (cert-manager renews a Certificate's Secret
at two thirds of its life, and Kubernetes swaps the mounted files in place): a process that read
them once would present its first certificate until it expired, and from then on every handshake
with it, and every one it started, would fail. So each user of an identity asks `reloaded()` when
it opens something new: servers on every new connection (gRPC's certificate fetcher) or every few
seconds (the HTTP API), clients when they open a channel. An identity given as bytes never changes.
"""

import logging
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

_FIELDS = ("cert_file", "key_file", "ca_file")
# Shared by every holder of an identity read from the same files, so that each change is read
# (and logged) once: the latest identity read from them, and their states found unusable.
_latest: dict[tuple, "Tls"] = {}
_refused: set[tuple] = set()


@dataclass(frozen=True)
class Tls:
    """A process's TLS identity (PEM certificate chain and key) and the cluster's CA (PEM), which
    every peer's certificate must chain to; a public client has the CA alone (cert and key None).
    `server_name`: the name servers' certificates are checked against instead of the dialled host
    (workers are dialled at addresses, e.g. pod IPs, that a certificate issued in advance cannot name).
    `files` and `stamps`: where `load` read it, and those files' states then."""

    cert: bytes | None
    key: bytes | None
    ca: bytes
    server_name: str | None = None
    files: tuple[Path | None, ...] = ()
    stamps: tuple = ()

    @classmethod
    def load(cls, cert_file: Path | None, key_file: Path | None, ca_file: Path, server_name: str | None = None) -> "Tls":
        """Raises ValueError naming the field of a file that cannot be read or holds no PEM block,
        or the pair when the key is not the certificate's."""
        files = tuple(Path(p) if p is not None else None for p in (cert_file, key_file, ca_file))
        pems, stamps = {}, []
        for field, path in zip(_FIELDS, files):
            pems[field], stamp = _read(field, path)
            stamps.append(stamp)
        tls = cls(pems["cert_file"], pems["key_file"], pems["ca_file"], server_name, files, tuple(stamps))
        try:  # a CA file cut short fails here, not at every peer's handshake
            ssl.create_default_context(cadata=tls.ca.decode("ascii", "replace"))
        except ssl.SSLError as e:
            raise ValueError(f"tls.ca_file: {ca_file} holds no usable CA certificate ({e.reason})") from None
        if tls.cert is not None and tls.key is not None:
            tls.ssl_server_context()  # so does a key that is not the certificate's
        return tls

    def reloaded(self) -> "Tls":
        """The identity as its files hold it now: self while they are unchanged (or it was given as
        bytes); self too, logged once, while the new files cannot be read or do not pair (a
        rotation caught between writing the certificate and its key)."""
        if not self.files:
            return self
        stamps = tuple(_stamp(path) for path in self.files)
        if stamps == self.stamps:
            return self
        key = (self.files, self.server_name)
        latest = _latest.get(key)
        if latest is not None and latest.stamps == stamps:
            return latest
        if (key, stamps) in _refused:  # until they change again: not read on every call meanwhile
            return self
        try:
            fresh = Tls.load(*self.files, server_name=self.server_name)
        except (ValueError, OSError) as e:
            _refused.add((key, stamps))
            log.error("tls: the changed files are not usable (%s); going on with the identity read before", e)
            return self
        _latest[key] = fresh
        log.info("tls: certificate files changed; new connections use them")
        return fresh

    def server_credentials(self, client_auth: bool) -> grpc.ServerCredentials:
        """Credentials that re-read the files (`reloaded`) before every new connection's handshake."""
        if self.cert is None or self.key is None:
            raise ValueError("tls: a server needs cert_file and key_file")
        presented = [self]

        def fetch() -> grpc.ServerCertificateConfiguration | None:  # gRPC calls it per new connection
            fresh = presented[0].reloaded()
            if fresh is presented[0]:
                return None
            presented[0] = fresh
            return fresh._certificate_configuration()

        return grpc.dynamic_ssl_server_credentials(self._certificate_configuration(), fetch,
                                                   require_client_authentication=client_auth)

    def _certificate_configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=self.ca)

    def ssl_server_context(self) -> ssl.SSLContext:
        """A TLS server context of the identity, for the HTTP API (ssl loads a certificate only
        from files: a private directory's, removed once read)."""
        if self.cert is None or self.key is None:
            raise ValueError("tls: a server needs cert_file and key_file")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.load_into(context)
        return context

    def load_into(self, context: ssl.SSLContext) -> None:
        """The identity's certificate and key into `context` (new handshakes present them)."""
        with tempfile.TemporaryDirectory() as directory:  # created 0700
            cert, key = Path(directory) / "cert.pem", Path(directory) / "key.pem"
            cert.write_bytes(self.cert)
            key.touch(mode=0o600)
            key.write_bytes(self.key)
            try:
                context.load_cert_chain(cert, key)
            except ssl.SSLError as e:
                raise ValueError(f"tls.cert_file, tls.key_file: not a certificate chain and its key ({e.reason})") from None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Presents this process's certificate (internal servers require it; public ones ignore it)."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def current(tls: Tls | None) -> Tls | None:
    """`tls.reloaded()`, None for plaintext."""
    return tls.reloaded() if tls is not None else None


def _stamp(path: Path | None) -> tuple | None:
    """What changes when the file is replaced (a Secret's update swaps a symlink: followed here)."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return ("missing",)
    return st.st_ino, st.st_mtime_ns, st.st_size


def _read(field: str, path: Path | None) -> tuple[bytes | None, tuple | None]:
    if path is None:
        return None, None
    stamp = _stamp(path)  # before reading: a change while reading shows as a change next time
    try:
        pem = path.read_bytes()
    except OSError as e:
        raise ValueError(f"tls.{field}: cannot read {path}: {e.strerror}") from None
    if b"-----BEGIN " not in pem:
        raise ValueError(f"tls.{field}: {path} holds no PEM block")
    return pem, stamp

