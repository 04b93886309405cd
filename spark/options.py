"""The data source's options, parsed and checked on the driver (no pyspark here).

Why on the driver: a misspelt or missing option must fail `save()` / `start()` at once with a message
naming it, not every task on every executor. Spark hands options over as strings in a case-insensitive
map, so the names below are matched without regard to case; an option the source does not know is an
error too (a typo such as `routingkeycolum` would otherwise silently route every row to one key).
Every option is documented in docs/spark.md.
"""

from __future__ import annotations

import math
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowbroker.client.credentials import Credentials
from flowbroker.client.url import DEFAULT_URL, parse_url

__all__ = ["WriteOptions", "ReadOptions", "ConnectOptions", "OptionError", "MAX_PRODUCER_ID_BASE"]

MAX_PRODUCER_ID_BASE = 200
"""Characters of a `jobId`: the producer id adds "/" and the partition (and, streaming, the batch id)
and must stay within the broker's 255 characters."""

_CONNECT = {"user", "password", "passwordenv", "passwordfile", "tlscafile", "tlscertfile", "tlskeyfile"}
_WRITE = {"url", "queue", "exchange", "routingkey", "routingkeycolumn", "jobid", "timeout", "batchsize",
          "window", "connecttimeout", "reconnecttimeout", "arrow", "path", *_CONNECT}
_READ = {"url", "queue", "prefetch", "buffersize", "maxbatchsize", "polltimeout", "replaytimeout",
         "connecttimeout", "path", *_CONNECT}


_SPARK = {"checkpointlocation", "queryname"}
"""Spark's own options, which it passes on to the source with ours."""


class OptionError(ValueError):
    """An option is missing, unknown or malformed (raised on the driver, before any task runs)."""


def _lower(options: Mapping[str, str], known: set[str]) -> dict[str, str]:
    given = {k.lower(): v for k, v in options.items()}
    unknown = sorted(set(given) - known - _SPARK)
    if unknown:
        raise OptionError(f"unknown flowbroker option(s) {', '.join(unknown)} (docs/spark.md lists them)")
    return given


def _number(given: dict[str, str], name: str, default: float, *, minimum: float, integer: bool = False) -> float:
    raw = given.get(name.lower())
    if raw is None:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise OptionError(f"option {name} must be {'an integer' if integer else 'a number'}, not {raw!r}") from None
    if not value >= minimum or math.isnan(value) or math.isinf(value):
        # (inf too: a task cannot wait for ever, and the SDK's deadlines are finite seconds)
        raise OptionError(f"option {name} must be a finite number >= {minimum:g}, not {raw!r}")
    return value


def _flag(given: dict[str, str], name: str, default: bool) -> bool:
    raw = given.get(name.lower())
    if raw is None:
        return default
    if raw.lower() in ("true", "1", "yes"):
        return True
    if raw.lower() in ("false", "0", "no"):
        return False
    raise OptionError(f"option {name} must be true or false, not {raw!r}")


@dataclass(frozen=True)
class ConnectOptions:
    """Who the driver and the tasks log in as, and the TLS they use (docs/spark.md, "Authentication and TLS").

    The password is read where a connection is made (driver or executor), from `passwordEnv` (an
    environment variable) or `passwordFile` (a file), so that it is neither in the job's options, which
    Spark shows in its plans and UI, nor pickled into its tasks; `password` itself works too, for a
    notebook. TLS goes with a `flowbroker+tls://` URL: `tlsCaFile` is the CA to trust (default: the
    system's), `tlsCertFile` and `tlsKeyFile` a client certificate for mutual TLS."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    password_env: str | None = None
    password_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    @classmethod
    def parse_connect(cls, given: dict[str, str]) -> dict[str, Any]:
        """The connection options of `given` (lower-cased names) as keyword arguments, checked."""
        out: dict[str, Any] = {
            "user": given.get("user"), "password": given.get("password"), "password_env": given.get("passwordenv"),
            "password_file": given.get("passwordfile"), "tls_ca_file": given.get("tlscafile"),
            "tls_cert_file": given.get("tlscertfile"), "tls_key_file": given.get("tlskeyfile"),
        }
        sources = [name for name, key in (("password", "password"), ("passwordEnv", "password_env"),
                                          ("passwordFile", "password_file")) if out[key] is not None]
        if out["user"] is not None and not out["user"]:
            raise OptionError("option user must not be empty")
        if out["user"] is None and sources:
            raise OptionError(f"option {sources[0]} needs the option user")
        if out["user"] is not None and len(sources) != 1:
            raise OptionError("option user needs exactly one of password, passwordEnv and passwordFile "
                              f"(given: {', '.join(sources) or 'none'})")
        tls = [name for name, key in (("tlsCaFile", "tls_ca_file"), ("tlsCertFile", "tls_cert_file"),
                                      ("tlsKeyFile", "tls_key_file")) if out[key] is not None]
        try:
            secure = parse_url(given.get("url", DEFAULT_URL)).tls
        except ValueError as exc:
            raise OptionError(f"option url: {exc}") from None
        if tls and not secure:
            raise OptionError(f"option {tls[0]} is for a flowbroker+tls:// url")
        if (out["tls_cert_file"] is None) != (out["tls_key_file"] is None):
            raise OptionError("options tlsCertFile and tlsKeyFile go together")
        return out

    def connect_arguments(self) -> dict[str, Any]:
        """`auth` and `ssl_context` for `connect`, the password read now (on the driver or the executor
        that connects). OptionError naming the option when the variable or the file is missing."""
        arguments: dict[str, Any] = {}
        if self.user is not None:
            arguments["auth"] = Credentials(self.user, self._password())
        if self.tls_ca_file is not None or self.tls_cert_file is not None:
            context = ssl.create_default_context(cafile=self.tls_ca_file)
            if self.tls_cert_file is not None:
                context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
            arguments["ssl_context"] = context
        return arguments

    def _password(self) -> str:
        if self.password is not None:
            return self.password
        if self.password_env is not None:
            value = os.environ.get(self.password_env)
            if value is None:
                raise OptionError(f"option passwordEnv: the environment variable {self.password_env} is not set "
                                  "where this connects (set it on the driver before the SparkSession starts, "
                                  "and on the executors, e.g. spark.executorEnv)")
            return value
        assert self.password_file is not None
        try:
            return Path(self.password_file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise OptionError(f"option passwordFile: {self.password_file}: {exc.strerror}") from None


@dataclass(frozen=True)
class WriteOptions(ConnectOptions):
    """Where and how a write sends its rows (docs/spark.md, "Options")."""

    url: str = DEFAULT_URL
    exchange: str = ""
    """"" with `queue`: the default exchange, which routes by queue name."""
    routing_key: str = ""
    routing_key_column: str | None = None
    job_id: str | None = None
    """The base of the producer ids; None: a new one per job, made on the driver."""
    timeout: float = 600.0
    """Seconds a task waits for credit (and for its last completions) before it fails."""
    batch_size: int = 1000
    """Rows handed to the SDK's thread per call."""
    window: int = 10_000
    """The producer's window of uncompleted transfers."""
    connect_timeout: float = 30.0
    reconnect_timeout: float = 30.0
    """Seconds a task's lost connection tries to reconnect (and send again what was not completed)."""
    arrow: bool = True
    """Take the partition as Arrow record batches (`DataSourceArrowWriter`) rather than rows: its own work
    (rows to messages) measured as fast or faster once warm; end to end the broker sets the rate."""

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
        given = _lower(options, _WRITE)
        queue = given.get("queue") or given.get("path")
        exchange = given.get("exchange")
        if (queue is None) == (exchange is None):
            raise OptionError("give exactly one of the options queue and exchange")
        key, key_column = given.get("routingkey"), given.get("routingkeycolumn")
        if queue is not None:
            if key is not None or key_column is not None:
                raise OptionError("routingKey and routingKeyColumn go with exchange; with queue the key is the queue's name")
            exchange, key = "", queue
        elif key is not None and key_column is not None:
            raise OptionError("give at most one of routingKey and routingKeyColumn")
        job_id = given.get("jobid")
        if job_id is not None and not 0 < len(job_id) <= MAX_PRODUCER_ID_BASE:
            raise OptionError(f"option jobId must have 1 to {MAX_PRODUCER_ID_BASE} characters")
        assert exchange is not None
        return cls(
            url=given.get("url", DEFAULT_URL),
            exchange=exchange,
            routing_key=key or "",
            routing_key_column=key_column,
            job_id=job_id,
            timeout=_number(given, "timeout", cls.timeout, minimum=0),
            batch_size=int(_number(given, "batchSize", cls.batch_size, minimum=1, integer=True)),
            window=int(_number(given, "window", cls.window, minimum=1, integer=True)),
            connect_timeout=_number(given, "connectTimeout", cls.connect_timeout, minimum=0),
            reconnect_timeout=_number(given, "reconnectTimeout", cls.reconnect_timeout, minimum=0),
            arrow=_flag(given, "arrow", cls.arrow),
            **cls.parse_connect(given),
        )


@dataclass(frozen=True)
class ReadOptions(ConnectOptions):
    """What the streaming source reads, and how much it lets into Spark at once (docs/spark.md)."""

    url: str = DEFAULT_URL
    queue: str = ""
    prefetch: int = 10_000
    """Messages delivered to Spark and not yet settled, at most: committed batches settle theirs."""
    buffer_size: int = 16 << 20
    """The SDK consumer's byte buffer: bytes the broker may have delivered and the source not taken."""
    max_batch_size: int = 5_000
    """Most messages in one micro-batch (at most half the prefetch: two batches are unsettled at once)."""
    poll_timeout: float = 0.5
    """Seconds a micro-batch waits for its first message before it is planned empty."""
    replay_timeout: float = 60.0
    """Seconds a replayed micro-batch (after a restart) waits for the redelivered messages."""
    connect_timeout: float = 30.0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        given = _lower(options, _READ)
        queue = given.get("queue") or given.get("path")
        if not queue:
            raise OptionError("option queue is required")
        prefetch = int(_number(given, "prefetch", cls.prefetch, minimum=2, integer=True))
        max_batch = int(_number(given, "maxBatchSize", min(cls.max_batch_size, prefetch // 2), minimum=1, integer=True))
        if max_batch > prefetch // 2:
            # Spark plans batch n + 1 before it commits batch n: two batches are unsettled at once, and
            # a batch that found the prefetch spent would be empty, so batch n would never be committed.
            raise OptionError(f"option maxBatchSize ({max_batch}) cannot exceed half the prefetch ({prefetch})")
        return cls(
            url=given.get("url", DEFAULT_URL),
            queue=queue,
            prefetch=prefetch,
            buffer_size=int(_number(given, "bufferSize", cls.buffer_size, minimum=0, integer=True)),
            max_batch_size=max_batch,
            poll_timeout=_number(given, "pollTimeout", cls.poll_timeout, minimum=0),
            replay_timeout=_number(given, "replayTimeout", cls.replay_timeout, minimum=0),
            connect_timeout=_number(given, "connectTimeout", cls.connect_timeout, minimum=0),
            **cls.parse_connect(given),
        )
