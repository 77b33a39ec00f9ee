"""Whether a pipelined exchange runs TLS, decided on the driver before launch.

A pipelined exchange moves the user's rows over connections of its own, outside Spark's network stack, so
Spark's encryption does not cover them. When the session encrypts its own traffic
(``spark.network.crypto.enabled``, Spark's AES-based RPC encryption, or ``spark.ssl.enabled``) the
exchange follows it with mutual TLS (:mod:`spark_credit_shuffle.transport.tls`), as Flink's data plane
does with ``security.ssl.internal.enabled``; the ``ssl`` setting (``spark.creditShuffle.ssl``) turns it on
or off whatever the session does. A blocking exchange stores its buffers in Spark's shuffle, which Spark's
own settings protect (``spark.io.encryption.enabled`` for the files, ``spark.network.crypto.enabled`` for
the fetches): the setting does not concern it.

Asked for and impossible here (no ``cryptography`` to make the key pair, or a Python without TLS 1.3), the
exchange is refused with :class:`~spark_credit_shuffle.errors.ConfigError` before any Spark job.
"""

from __future__ import annotations

import logging
from typing import Any

from ..config import NetworkConfig
from ..errors import ConfigError
from ..transport.tls import tls_unavailable_reason

__all__ = ["SESSION_ENCRYPTION_KEYS", "session_encrypts", "use_tls"]

log = logging.getLogger("spark_credit_shuffle")

#: The session settings that say the cluster encrypts its own traffic (either one turns TLS on in 'auto').
SESSION_ENCRYPTION_KEYS = ("spark.network.crypto.enabled", "spark.ssl.enabled")


def session_encrypts(spark: Any) -> str | None:
    """The first of :data:`SESSION_ENCRYPTION_KEYS` the session sets to true (its conf, which holds the
    SparkContext's settings too; also on Spark Connect), or None."""
    for key in SESSION_ENCRYPTION_KEYS:
        try:
            value = spark.conf.get(key, None)
        except Exception:  # a conf that cannot be read says nothing
            value = None
        if value is not None and str(value).strip().lower() == "true":
            return key
    return None


def use_tls(config: NetworkConfig, spark: Any, mode: str) -> bool:
    """Whether an exchange of ``mode`` with ``config`` on ``spark`` runs TLS; raises ConfigError if it
    must and cannot."""
    if mode != "pipelined" or config.ssl == "off":
        if mode == "pipelined":
            encrypting = session_encrypts(spark)
            if encrypting is not None:
                log.warning(
                    "the session sets %s=true but ssl=off (spark.creditShuffle.ssl): this pipelined exchange "
                    "sends its rows unencrypted",
                    encrypting,
                )
        return False
    reason_on = "ssl=on" if config.ssl == "on" else None
    if reason_on is None:
        encrypting = session_encrypts(spark)
        if encrypting is None:
            return False
        reason_on = f"{encrypting}=true in the session (ssl=auto)"
    missing = tls_unavailable_reason()
    if missing is not None:
        raise ConfigError(
            "ssl",
            config.ssl,
            "'off' (spark.creditShuffle.ssl=false), or TLS made possible here",
            f"TLS is asked for by {reason_on}, but {missing}; install it with pip install cryptography",
        )
    return True
