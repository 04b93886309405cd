"""One vocabulary: each package says what it exports, and every wire name has one definition that the
broker, its CLI and admin API, and the SDK all take."""

from __future__ import annotations

import importlib
import subprocess
import sys

import click
import pytest

from flowbroker.broker import cli, core, views
from flowbroker.broker.config import QueueDefaults
from flowbroker.broker.exchange import ExchangeKind
from flowbroker.policies import CreditPolicy, OverflowPolicy
from flowbroker.protocol import names

PACKAGES = ["broker", "client", "policies", "protocol", "spark", "transport", "transport.udp"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_lists_what_it_exports(package: str) -> None:
    module = importlib.import_module(f"flowbroker.{package}")
    exported = module.__all__
    assert exported and len(set(exported)) == len(exported)
    missing = [name for name in exported if getattr(module, name, None) is None]
    assert missing == []


def test_the_broker_package_does_not_import_the_server_until_asked() -> None:
    code = ("import sys, flowbroker.broker as b; before = 'trio' in sys.modules; b.BrokerServer; "
            "print(before, 'trio' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False", "True"]


def _choices(command: click.Command, option: str) -> tuple[str, ...]:
    [param] = [p for p in command.params if p.name == option]
    assert isinstance(param.type, click.Choice)
    return tuple(param.type.choices)


def test_the_enums_take_their_values_from_the_wire_names() -> None:
    assert tuple(p.value for p in OverflowPolicy) == names.OVERFLOW_POLICIES
    assert tuple(k.value for k in ExchangeKind) == names.EXCHANGE_KINDS
    assert QueueDefaults().overflow == names.OVERFLOW_REJECT


def test_the_broker_and_its_admin_api_use_the_wire_names() -> None:
    assert core.QUEUE_ARGUMENTS is names.QUEUE_ARGUMENTS and views.THRESHOLD_KEYS is names.QUEUE_ARGUMENTS
    assert core.BUILTIN_EXCHANGES == {name for name, _ in names.BUILTIN_EXCHANGES}
    assert set(names.STOP_THRESHOLDS) == {"flow_stop_count", "flow_stop_size", "flow_stop_drain_time",
                                          "flow_stop_age", "admin", "memory", "disk"}
    assert set(names.TIME_QUEUE_ARGUMENTS) < set(names.QUEUE_ARGUMENTS)


def test_the_sdk_declares_every_queue_argument() -> None:
    """Each DECLARE_QUEUE argument is a keyword of the SDK's declare_queue (the time thresholds too)."""
    import inspect

    from flowbroker.client.connection import Connection

    params = inspect.signature(Connection.declare_queue).parameters
    assert set(names.QUEUE_ARGUMENTS) <= set(params)


def test_the_cli_offers_exactly_the_names_the_broker_takes() -> None:
    queue_set = cli.main.commands["queue"].commands["set"]  # type: ignore[attr-defined]
    exchange_declare = cli.main.commands["exchange"].commands["declare"]  # type: ignore[attr-defined]
    policy_set = cli.main.commands["policy"].commands["set"]  # type: ignore[attr-defined]
    assert _choices(queue_set, "overflow") == names.OVERFLOW_POLICIES
    assert _choices(exchange_declare, "kind") == names.EXCHANGE_KINDS
    assert _choices(policy_set, "name") == tuple(p.value for p in CreditPolicy)
    assert _choices(cli.main.commands["serve"], "credit_policy") == tuple(p.value for p in CreditPolicy)
    assert cli.THRESHOLD_OPTIONS == names.QUEUE_ARGUMENTS
