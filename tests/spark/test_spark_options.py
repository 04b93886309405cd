"""Options and the row layout, checked without Spark (they run on the driver before any task)."""

from __future__ import annotations

import json

import pytest

from flowbroker.spark.messages import Layout, LayoutError
from flowbroker.spark.options import OptionError, ReadOptions, WriteOptions


def test_queue_routes_by_its_name_and_options_ignore_case():
    options = WriteOptions.parse({"URL": "flowbroker://h:1", "queue": "orders", "BatchSize": "50", "arrow": "false"})
    assert (options.url, options.exchange, options.routing_key, options.batch_size, options.arrow) == (
        "flowbroker://h:1", "", "orders", 50, False)


@pytest.mark.parametrize("given, message", [
    ({}, "exactly one of the options queue and exchange"),
    ({"queue": "q", "exchange": "x"}, "exactly one"),
    ({"queue": "q", "routingKey": "k"}, "go with exchange"),
    ({"exchange": "x", "routingKey": "k", "routingKeyColumn": "c"}, "at most one"),
    ({"queue": "q", "timeout": "soon"}, "timeout must be a number"),
    ({"queue": "q", "window": "0"}, "window must be a finite number >= 1"),
    ({"queue": "q", "timeout": "inf"}, "timeout must be a finite number >= 0"),
    ({"queue": "q", "jobId": "x" * 201}, "1 to 200 characters"),
    ({"queue": "q", "routingKeyColum": "c"}, "unknown flowbroker option"),
])
def test_write_options_are_refused_with_a_reason(given, message):
    with pytest.raises(OptionError, match=message):
        WriteOptions.parse(given)


def test_a_batch_is_at_most_half_the_prefetch():
    assert ReadOptions.parse({"queue": "q", "prefetch": "100"}).max_batch_size == 50
    with pytest.raises(OptionError, match="half the prefetch"):
        ReadOptions.parse({"queue": "q", "prefetch": "100", "maxBatchSize": "51"})
    with pytest.raises(OptionError, match="queue is required"):
        ReadOptions.parse({})


def test_a_value_column_is_the_body_and_key_and_headers_are_headers():
    layout = Layout.of(["value", "key", "headers", "rk"], {"value": "binary", "rk": "string"}, "rk")
    columns: dict[str, list[object]] = {"value": [b"a", "b", None], "key": ["k", None, b"x"], "headers": [[("h", "1")], {"j": b"2"}, None],
               "rk": ["r1", "r2", "r3"]}
    assert layout.messages(columns, 3) == [
        (b"a", {"h": "1", "key": "k"}, "r1"), (b"b", {"j": b"2"}, "r2"), (b"", {"key": b"x"}, "r3")]


def test_without_a_value_column_the_row_is_json_and_key_is_an_ordinary_column():
    layout = Layout.of(["id", "key"], {"id": "bigint", "key": "string"}, None)
    [(body, headers, key)] = layout.row_messages([(1, "k")])
    assert json.loads(body) == {"id": 1, "key": "k"} and headers is None and key is None


def test_a_layout_that_cannot_work_fails_on_the_driver():
    with pytest.raises(LayoutError, match="binary or string"):
        Layout.of(["value"], {"value": "int"}, None)
    with pytest.raises(LayoutError, match="not a column"):
        Layout.of(["value"], {"value": "binary"}, "region")


def test_credentials_and_tls_options_are_checked_and_read_where_the_connection_is_made(tmp_path, monkeypatch):
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    read = ReadOptions.parse({"queue": "q", "User": "u", "passwordFile": str(secret)})
    assert "from-file" not in repr(read)
    assert read.connect_arguments()["auth"].password == "from-file"  # read now, the newline dropped
    options = WriteOptions.parse({"queue": "q", "user": "u", "passwordEnv": "FB_TEST_PW"})
    with pytest.raises(OptionError, match="environment variable FB_TEST_PW is not set"):
        options.connect_arguments()
    monkeypatch.setenv("FB_TEST_PW", "from-env")
    auth = options.connect_arguments()["auth"]
    assert (auth.username, auth.password) == ("u", "from-env")
    options = WriteOptions.parse({"queue": "q", "user": "u", "password": "inline"})
    assert "inline" not in repr(options) and options.connect_arguments()["auth"].password == "inline"
    assert WriteOptions.parse({"queue": "q"}).connect_arguments() == {}
    with pytest.raises(OptionError, match="passwordFile: .*No such file"):
        ReadOptions.parse({"queue": "q", "user": "u", "passwordFile": str(tmp_path / "none")}).connect_arguments()


@pytest.mark.parametrize("given, message", [
    ({"user": "u"}, "exactly one of password, passwordEnv and passwordFile"),
    ({"user": "u", "password": "p", "passwordEnv": "E"}, "exactly one"),
    ({"password": "p"}, "option password needs the option user"),
    ({"user": ""}, "user must not be empty"),
    ({"tlsCaFile": "ca.pem"}, "tlsCaFile is for a flowbroker\\+tls:// url"),
    ({"url": "flowbroker+tls://h:1", "tlsCertFile": "c.pem"}, "tlsCertFile and tlsKeyFile go together"),
    ({"url": "http://h"}, "option url"),
])
def test_connection_options_are_refused_with_a_reason(given, message):
    for parse in (WriteOptions.parse, ReadOptions.parse):
        with pytest.raises(OptionError, match=message):
            parse({"queue": "q", **given})


def test_tls_options_make_the_context(tmp_path):
    import trustme

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert = ca.issue_cert("client.example")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "client.pem"))
    options = WriteOptions.parse({"url": "flowbroker+tls://localhost:5671", "queue": "q",
                                  "tlsCaFile": str(tmp_path / "ca.pem"), "tlsCertFile": str(tmp_path / "client.pem"),
                                  "tlsKeyFile": str(tmp_path / "client.pem")})
    context = options.connect_arguments()["ssl_context"]
    assert context.check_hostname and len(context.get_ca_certs()) == 1
