"""Spark tests: one broker process and one local SparkSession per module (see harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

from typing import Any

import pytest

from tests.spark.harness import Broker, spark_session, start_broker, stop_broker


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    running = start_broker(tmp_path_factory.mktemp("broker"))
    try:
        yield running
    finally:
        stop_broker(running)


@pytest.fixture(scope="module")
def spark(request: pytest.FixtureRequest) -> Iterator[Any]:
    """local[2], or the master a module names in its SPARK_MASTER."""
    session = spark_session(getattr(request.module, "SPARK_MASTER", "local[2]"))
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def queue(request: pytest.FixtureRequest, broker: Broker) -> str:
    """A fresh queue named after the test."""
    from tests.spark.harness import declare

    name: str = request.node.name.replace("[", "-").replace("]", "")[:200]
    declare(broker.url, name)
    return name


