"""The flowbroker daemon: listeners, connections, exchanges, queues with watermarks, delivery, admin, CLI.

The entry points: the configuration (``load_config`` -> ``BrokerConfig``), the sans-IO core
(``BrokerCore(config, clock_ns)``, which refuses requests with ``RequestError``) and the trio server
(``BrokerServer(config).serve()``). The command line is ``flowbroker.broker.cli:main``.

The core and the server are imported on first use (PEP 562), not with the package: the management commands
of the CLI import ``flowbroker.broker.cli`` and must not pay for trio, the admin HTTP server and the protocol
when they only talk HTTP.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flowbroker.broker.config import (
    AdminConfig,
    BrokerConfig,
    ConfigError,
    QueueDefaults,
    ServerConfig,
    load_config,
    parse_size,
)

if TYPE_CHECKING:
    from flowbroker.broker.core import BrokerCore, RequestError
    from flowbroker.broker.server import BrokerServer

__all__ = [
    "AdminConfig",
    "BrokerConfig",
    "BrokerCore",
    "BrokerServer",
    "ConfigError",
    "QueueDefaults",
    "RequestError",
    "ServerConfig",
    "load_config",
    "parse_size",
]

_LAZY = {
    "BrokerCore": "flowbroker.broker.core",
    "RequestError": "flowbroker.broker.core",
    "BrokerServer": "flowbroker.broker.server",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
