"""TLS for the connections of a pipelined exchange: mutual, pinned to a key pair made for that exchange.

Flink protects its data plane with mutual TLS (``security.ssl.internal.enabled``: every TaskManager
presents the internal certificate and trusts only it). Here the driver makes one key pair per exchange
(:meth:`TlsIdentity.generate`, an elliptic-curve P-256 key and a self-signed certificate for it) and ships
it to the tasks with the plan, as it ships the exchange's secret. Every connection of the exchange, task to
task and task to the driver's address service, then runs TLS 1.3 with:

* both sides presenting that certificate (``CERT_REQUIRED`` on both ends: mutual);
* that certificate as the only one either side trusts, and the peer's certificate compared byte for byte
  with it after the handshake (:func:`check_pinned`): a peer holding any other key, whoever signed it, is
  refused;
* no session tickets (nothing to resume from).

The exchange's secret handshake (:mod:`spark_credit_shuffle.protocol.handshake`) still runs inside TLS.
Host names are not checked: the certificate names the exchange, not a host, and pinning makes a name
check say nothing more.

The private key lives in the plan's closure (as the secret does) and in memory; Python's ``ssl`` loads a
key only from a file, so making a context writes it for the moment of loading into a private temporary
directory (mode 0700) and removes it at once.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import ssl
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, ProtocolError

__all__ = ["TlsIdentity", "check_pinned", "tls_unavailable_reason"]

#: How long the exchange's certificate is valid. It is pinned, so its dates protect nothing; they only need
#: to cover every later run of the same exchange object (its plan, key pair and secret are made once).
_VALIDITY = datetime.timedelta(days=3650)


def tls_unavailable_reason() -> str | None:
    """Why TLS cannot be provided here (None: it can): the ``cryptography`` package that makes the
    exchange's key pair is missing, or Python's ``ssl`` lacks TLS 1.3."""
    if not getattr(ssl, "HAS_TLSv1_3", False):
        return f"this Python's ssl module ({ssl.OPENSSL_VERSION}) has no TLS 1.3"
    try:
        import cryptography.x509  # noqa: F401
    except ImportError as exc:
        return f"the 'cryptography' package, which makes the exchange's key pair, cannot be imported ({exc})"
    return None


@dataclass(frozen=True)
class TlsIdentity:
    """The key pair of one exchange: ``certificate`` and ``private_key`` in PEM. Picklable (it travels to
    the tasks in the plan's closure); its repr never shows the key."""

    certificate: bytes
    private_key: bytes = field(repr=False)

    @classmethod
    def generate(cls, name: str) -> TlsIdentity:
        """A new P-256 key and a self-signed certificate for it naming exchange ``name`` (on the driver).

        Raises :class:`ConfigError` (setting ``ssl``) if it cannot be made here.
        """
        reason = tls_unavailable_reason()
        if reason is not None:
            raise ConfigError(
                "ssl", "on", "off, unless TLS can be provided", f"{reason}; install it with pip install cryptography"
            )
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"spark-credit-shuffle {name}"[:64])])
        now = datetime.datetime.now(datetime.timezone.utc)
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(
            certificate.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )

    @property
    def certificate_der(self) -> bytes:
        """The certificate in DER, as ``getpeercert(binary_form=True)`` returns a peer's."""
        return ssl.PEM_cert_to_DER_cert(self.certificate.decode("ascii"))

    def server_context(self, **options: Any) -> ssl.SSLContext:
        """A context for the accepting side: presents the certificate, requires the peer's."""
        return self._context(server_side=True, **options)

    def client_context(self) -> ssl.SSLContext:
        """A context for the connecting side: presents the certificate, requires the peer's."""
        return self._context(server_side=False)

    def _context(self, *, server_side: bool, sni_callback: Any = None) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False  # pinned to one certificate (check_pinned); it names no host
        # A client ends its side with TCP's half-close (the transport's end of a connection), without a
        # close_notify: the server must take that as the end of the stream, not answer it with an alert.
        # Truncation shows anyway: a cut frame fails the decoder and a channel without its end of partition
        # fails the consumer.
        context.options |= getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=self.certificate.decode("ascii"))
        with tempfile.TemporaryDirectory(prefix="credit-shuffle-tls-") as directory:  # mode 0700
            path = os.path.join(directory, "identity.pem")
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as f:
                f.write(self.private_key + self.certificate)
            try:
                context.load_cert_chain(path)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        if server_side:
            context.num_tickets = 0
            if sni_callback is not None:
                context.sni_callback = sni_callback
        return context


def check_pinned(sock: ssl.SSLSocket | ssl.SSLObject, identity: TlsIdentity, peer: str) -> None:
    """Raise :class:`ProtocolError` unless the peer of ``sock`` presented the exchange's own certificate."""
    presented = sock.getpeercert(binary_form=True)
    if presented is None or presented != identity.certificate_der:
        raise ProtocolError(f"TLS peer {peer} did not present the exchange's certificate")
