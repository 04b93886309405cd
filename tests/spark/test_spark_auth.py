"""The data source against a broker that makes everyone log in (no loopback user) and serves TLS: a batch
write over flowbroker+tls:// with the password from an environment variable and the test CA from
tlsCaFile, a streaming read with the password from a file, and a wrong password failing the job with the
broker's refusal rather than hanging."""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from flowbroker.broker.users import User, write_users
from flowbroker.client import blocking
from flowbroker.protocol.scram import StoredCredential
from tests.spark.harness import Broker, start_broker, stop_broker

PASSWORD = "spark-s3cret"
ENV = "FLOWBROKER_TEST_SPARK_PASSWORD"
# Set at import (collection), before any test starts Spark's JVM: its Python workers, where the tasks
# connect, inherit the JVM's environment (on a cluster: spark.executorEnv, docs/spark.md).
os.environ[ENV] = PASSWORD


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[Broker]:
    tmp = tmp_path_factory.mktemp("auth-broker")
    users = tmp / "users.json"
    write_users(users, {"spark": User("spark", StoredCredential.from_password(PASSWORD))})
    cert = ca.issue_cert("localhost")
    cert.private_key_pem.write_to_path(str(tmp / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp / "cert.pem"))
    config = (f'[auth]\nusers_file = "{users}"\nloopback_user = ""\nfailed_login_delay = 0.1\n'
              f'[tls]\nenabled = true\nport = 0\ncert_file = "{tmp / "cert.pem"}"\nkey_file = "{tmp / "key.pem"}"\n')
    running = start_broker(tmp, config)
    try:
        yield running
    finally:
        stop_broker(running)


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> str:
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def tls_url(broker: Broker) -> str:
    return f"flowbroker+tls://localhost:{broker.tls_port}"


def connect(broker: Broker, ca_file: str) -> blocking.BlockingConnection:
    return blocking.connect(tls_url(broker), auth=("spark", PASSWORD), timeout=10,
                            ssl_context=ssl.create_default_context(cafile=ca_file))


def test_a_batch_write_logs_in_over_tls_with_the_password_from_the_environment(spark: Any, broker: Broker,
                                                                                ca_file: str) -> None:
    df = spark.range(0, 300, numPartitions=2).selectExpr("cast(id as string) as value")
    (df.write.format("flowbroker").option("url", tls_url(broker)).option("queue", "secure-in")
     .option("user", "spark").option("passwordEnv", ENV).option("tlsCaFile", ca_file).mode("append").save())
    with connect(broker, ca_file) as conn, conn.consumer("secure-in", prefetch=300) as consumer:
        got: list[blocking.BlockingMessage] = []
        while len(got) < 300:
            messages = consumer.receive_many(300, 10)
            assert messages, "the rows did not arrive"
            got += messages
            consumer.ack_many(messages)
    assert sorted(int(m.body) for m in got) == list(range(300))
    identities = {c["identity"] for c in broker.api("/api/connections")["connections"]}
    assert identities <= {"spark"}


def test_a_streaming_read_logs_in_with_the_password_from_a_file(spark: Any, broker: Broker, ca_file: str,
                                                                tmp_path: Path) -> None:
    with connect(broker, ca_file) as conn:
        conn.declare_queue("secure-out")
        with conn.producer(routing_key="secure-out") as producer:
            producer.send_batch([(b"%d" % i, None, None) for i in range(100)], timeout=30)
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    query = (spark.readStream.format("flowbroker").option("url", f"flowbroker://127.0.0.1:{broker.port}")
             .option("queue", "secure-out").option("user", "spark").option("passwordFile", str(secret))
             .option("prefetch", "100").load()
             .writeStream.format("memory").queryName("secure_out").start())
    try:
        deadline = time.monotonic() + 120
        while spark.sql("select count(*) from secure_out").first()[0] < 100:
            assert time.monotonic() < deadline, "the source did not deliver 100 messages in 120 s"
            assert query.exception() is None, query.exception()
            time.sleep(0.2)
    finally:
        query.stop()
    assert sorted(int(r.value) for r in spark.sql("select value from secure_out").collect()) == list(range(100))


def test_a_wrong_password_fails_the_write_with_the_refusal(spark: Any, broker: Broker, ca_file: str) -> None:
    df = spark.range(0, 10, numPartitions=1).selectExpr("cast(id as string) as value")
    with pytest.raises(Exception) as info:
        (df.write.format("flowbroker").option("url", tls_url(broker)).option("queue", "secure-in")
         .option("user", "spark").option("password", "wrong").option("tlsCaFile", ca_file).mode("append").save())
    assert "UNAUTHORIZED" in str(info.value) or "authentication failed" in str(info.value)
