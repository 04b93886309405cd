"""Rows to messages, and messages to rows (no pyspark here: plain Python values in, tuples out).

The layout is decided once on the driver from the DataFrame's column names (`Layout.of`): a `value`
column is the body (binary as is, string in UTF-8), an optional `key` column becomes the header `key`
(Kafka's message key, carried for consumers; the *routing* key is the `routingKey` or `routingKeyColumn`
option), an optional `headers` column becomes the headers (a map, or an array of `{key, value}`
structs as the Kafka source produces). Without a `value` column the whole row is the body, as one JSON
object (binary values in base64, dates and times in ISO 8601, decimals as strings), so a DataFrame of
ordinary columns needs no preparation. Both the Arrow writer (columns) and the row writer (rows) go
through `Layout.messages`, so the two cannot disagree.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flowbroker.protocol import Headers

__all__ = ["Layout", "OutMessage", "LayoutError", "to_body", "json_body", "SOURCE_COLUMNS"]

OutMessage = tuple[bytes, Headers | None, str | None]
"""(body, headers, routing key or None for the writer's), what `BlockingProducer.send_batch` takes."""

SOURCE_COLUMNS = ("value", "headers", "exchange", "routingKey", "redelivered")
"""The streaming source's columns: body (binary), headers (map<string,string>: values as text), the
exchange and routing key it was published with, and whether the broker delivered it before."""


class LayoutError(ValueError):
    """The DataFrame's columns cannot become messages (raised on the driver)."""


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, (datetime.date, datetime.datetime, datetime.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, datetime.timedelta)):
        return str(value)
    if hasattr(value, "asDict"):  # a nested pyspark Row
        return value.asDict(recursive=True)
    raise TypeError(f"a value of type {type(value).__name__} has no JSON form")


def json_body(row: Mapping[str, Any]) -> bytes:
    """One row as a compact JSON object, its columns in order."""
    return json.dumps(row, default=_json_default, separators=(",", ":"), ensure_ascii=False).encode()


def to_body(value: Any) -> bytes:
    """A `value` cell as a body: bytes as they are, text in UTF-8, null as empty."""
    if value is None:
        return b""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    raise LayoutError(f"the value column must be binary or string, not {type(value).__name__}")


def _headers(cell: Any, key: Any) -> Headers | None:
    headers: dict[str, Any] = {}
    if cell is not None:
        pairs: Any
        if isinstance(cell, Mapping):
            pairs = cell.items()
        else:  # Arrow gives a map as a list of (key, value); a Kafka-style array of structs as dicts or Rows
            pairs = [(p["key"], p["value"]) if not isinstance(p, tuple) else p for p in cell]
        for k, v in pairs:
            if v is None or isinstance(v, (str, bytes, int, float, bool)):
                headers[str(k)] = v
            elif isinstance(v, (bytearray, memoryview)):
                headers[str(k)] = bytes(v)
            else:
                headers[str(k)] = str(v)
    if key is not None:
        headers["key"] = key if isinstance(key, (str, bytes)) else str(key)
    return headers or None


@dataclass(frozen=True)
class Layout:
    """Which columns carry what (see the module's docstring); picklable, made on the driver."""

    columns: tuple[str, ...]
    value: bool
    key: bool
    headers: bool
    routing_key_column: str | None

    @classmethod
    def of(cls, columns: Sequence[str], value_types: Mapping[str, str], routing_key_column: str | None) -> Layout:
        """`value_types`: the simple type name of each column (`binary`, `string`, ...)."""
        names = tuple(columns)
        if routing_key_column is not None and routing_key_column not in names:
            raise LayoutError(f"routingKeyColumn {routing_key_column!r} is not a column (columns: {', '.join(names)})")
        if routing_key_column is not None and value_types.get(routing_key_column) != "string":
            raise LayoutError(f"routingKeyColumn {routing_key_column!r} must be a string column")
        value = "value" in names
        if value and value_types.get("value") not in ("binary", "string"):
            raise LayoutError(f"the value column must be binary or string, not {value_types.get('value')}")
        return cls(names, value, value and "key" in names, value and "headers" in names, routing_key_column)

    def messages(self, columns: Mapping[str, Sequence[Any]], count: int) -> list[OutMessage]:
        """The messages of `count` rows given column by column (an Arrow batch's `to_pydict()`)."""
        keys: Sequence[Any] = columns[self.routing_key_column] if self.routing_key_column else [None] * count
        if not self.value:
            names = self.columns
            cells = [columns[name] for name in names]
            return [(json_body(dict(zip(names, row))), None, key) for row, key in zip(zip(*cells), keys)]
        values = columns["value"]
        if not self.key and not self.headers:
            return [(to_body(v), None, k) for v, k in zip(values, keys)]
        message_keys: Sequence[Any] = columns["key"] if self.key else [None] * count
        header_cells: Sequence[Any] = columns["headers"] if self.headers else [None] * count
        return [
            (to_body(v), _headers(h, mk), k) for v, h, mk, k in zip(values, header_cells, message_keys, keys)
        ]

    def row_messages(self, rows: Sequence[Sequence[Any]]) -> list[OutMessage]:
        """The messages of rows given as tuples in column order (pyspark Rows are tuples)."""
        if not self.value:  # nested structs are Rows, tuples that json would write as arrays
            key_at = self.columns.index(self.routing_key_column) if self.routing_key_column else None
            return [
                (json_body(row.asDict(recursive=True) if hasattr(row, "asDict") else dict(zip(self.columns, row))),
                 None, None if key_at is None else row[key_at])
                for row in rows
            ]
        columns = {name: [row[i] for row in rows] for i, name in enumerate(self.columns)}
        return self.messages(columns, len(rows))
