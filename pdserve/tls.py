"""TLS on every HTTP hop that can cross hosts: client → proxy, proxy → node, and a decode
node's control calls to prefill nodes (`/kv/*`, which carry the cluster secret and release
tokens). The KV bytes themselves go over NIXL/UCX, not HTTP, and are not covered here.

    pdserve serve --ssl-certfile node.pem --ssl-keyfile node.key --ssl-ca-certs ca.pem
        serves HTTPS; reaches its peers (prefill nodes' /kv/*) over HTTPS, verifying
        their certificates against ca.pem (default: the system's CAs). A P/D cluster is
        all TLS or none: a decode node's scheme for prefill nodes is its own.
    pdserve proxy --ssl-certfile … --ssl-keyfile … --ssl-ca-certs ca.pem --prefill https://…
        serves HTTPS to clients; node URLs say each node's scheme, verified against ca.pem.
    pdserve up --tls
        makes a throwaway cluster CA and one certificate for 127.0.0.1/localhost
        (`make_cluster_certs`, needs `pip install pdserve[tls]`) and runs all of it over TLS.

Plain HTTP stays the default; a server bound to a non-loopback address without TLS warns
at start (`warn_if_exposed`). Clients are authenticated by bearer keys, not certificates.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TLSConfig:
    """One process's TLS files (PEM). All None: plain HTTP."""

    certfile: str | None = None
    """This server's certificate chain; set: it serves HTTPS."""
    keyfile: str | None = None
    """Its private key (default: in `certfile`)."""
    ca_certs: str | None = None
    """The CA bundle peers' certificates are verified against; default: the system's."""

    def __post_init__(self) -> None:
        if self.keyfile and not self.certfile:
            raise ConfigError("--ssl-keyfile needs --ssl-certfile")
        for flag, path in (
            ("--ssl-certfile", self.certfile),
            ("--ssl-keyfile", self.keyfile),
            ("--ssl-ca-certs", self.ca_certs),
        ):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{flag}: no such file: {path}")
        if self.certfile:
            try:  # a wrong key or a broken file fails here, not at the first connection
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                    self.certfile, self.keyfile
                )
            except (ssl.SSLError, OSError) as e:
                raise ConfigError(f"--ssl-certfile/--ssl-keyfile cannot be loaded: {e}") from e
        if self.ca_certs:
            self.client_context()  # a broken CA bundle fails at start too

    @property
    def serves(self) -> bool:
        return self.certfile is not None

    @property
    def scheme(self) -> str:
        """This server's scheme, and the one it uses for its peers."""
        return "https" if self.serves else "http"

    def client_context(self) -> ssl.SSLContext:
        """For outgoing HTTPS: verifies the peer's certificate and host name."""
        try:
            return ssl.create_default_context(cafile=self.ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"--ssl-ca-certs cannot be loaded: {e}") from e

    def server_context(self) -> ssl.SSLContext | None:
        """For a server of our own (the vLLM connector's control endpoint); None: plain."""
        if not self.serves:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(self.certfile), self.keyfile)
        return context

    def uvicorn_options(self) -> dict[str, Any]:
        if not self.serves:
            return {}
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile}

    def as_args(self) -> list[str]:
        """The flags that give a child process (`pdserve up`'s nodes) this config."""
        argv: list[str] = []
        for flag, value in (
            ("--ssl-certfile", self.certfile),
            ("--ssl-keyfile", self.keyfile),
            ("--ssl-ca-certs", self.ca_certs),
        ):
            if value is not None:
                argv += [flag, value]
        return argv


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS (docs/multi-host.md)")
    group.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this PEM chain")
    group.add_argument("--ssl-keyfile", default=None, help="its private key (PEM)")
    group.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="verify peers' certificates against this CA bundle (default: the system's)",
    )


def tls_options(args: argparse.Namespace) -> TLSConfig:
    return TLSConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)


def warn_if_exposed(host: str, tls: TLSConfig, what: str) -> None:
    """A server reachable from other hosts over plain HTTP: its bearer keys and release
    tokens travel in the clear. Say so once, at start."""
    if tls.serves or _is_loopback(host):
        return
    logger.warning(
        "%s listens on %s without TLS: API keys, the cluster secret and release tokens "
        "cross the network in the clear. Use --ssl-certfile/--ssl-keyfile (docs/multi-host.md)",
        what,
        host,
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ClusterCerts:
    ca_certs: str
    certfile: str
    keyfile: str

    def config(self) -> TLSConfig:
        return TLSConfig(self.certfile, self.keyfile, self.ca_certs)


class ClusterCA:
    """A throwaway CA that signs server certificates for given hosts (`pdserve up --tls`,
    `pdserve ray up --tls`: the controller issues each node a certificate for its own
    IP), valid 30 days. Needs the cryptography package (`pip install pdserve[tls]`)."""

    def __init__(self) -> None:
        try:
            from cryptography import x509
            from cryptography.hazmat.primitives import hashes
            from cryptography.hazmat.primitives.asymmetric import ec
        except ImportError as e:
            raise ConfigError(
                f"--tls needs the cryptography package ({e}): pip install pdserve[tls]"
            ) from e
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._cert = (
            _builder("pdserve cluster CA", "pdserve cluster CA", self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )

    def ca_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, hosts: tuple[str, ...]) -> tuple[bytes, bytes]:
        """A server certificate for `hosts` (IP addresses or names) and localhost, and its
        private key, both PEM."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID

        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.DNSName("localhost")]
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        cert = (
            _builder("pdserve node", "pdserve cluster CA", key.public_key())
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        key_pem = key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cert.public_bytes(pem), key_pem


def _builder(subject: str, issuer: str, public_key: Any) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
    )


def write_certs(directory: Path, ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> ClusterCerts:
    """The three PEM files in `directory` (the key 0600)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = ClusterCerts(
        str(directory / "ca.pem"), str(directory / "node.pem"), str(directory / "node.key")
    )
    Path(paths.ca_certs).write_bytes(ca_pem)
    Path(paths.certfile).write_bytes(cert_pem)
    fd = os.open(paths.keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    return paths


def make_cluster_certs(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1",)) -> ClusterCerts:
    """A new CA and one server certificate it signs, valid for `hosts` and localhost, in
    `directory`: a quick start (`pdserve up --tls`) and tests."""
    ca = ClusterCA()
    return write_certs(directory, ca.ca_pem(), *ca.issue(hosts))
