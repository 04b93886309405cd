"""Streaming writes: every row of every micro-batch lands once, also when a batch is replayed from the
checkpoint after the query failed half way through writing it."""

from __future__ import annotations

from pathlib import Path


from tests.spark.harness import drain


def _files(folder: Path, batches: int, rows: int) -> None:
    folder.mkdir()
    for b in range(batches):
        (folder / f"part-{b}.txt").write_text("".join(f"{b * rows + i}\n" for i in range(rows)))


def _stream(spark, folder: Path):
    return (spark.readStream.option("maxFilesPerTrigger", 1).text(str(folder))
            .repartition(2))  # two tasks, so two producers, per micro-batch


def test_every_row_of_every_micro_batch_arrives_once(spark, broker, queue, tmp_path):
    _files(tmp_path / "in", 3, 200)
    query = (_stream(spark, tmp_path / "in").writeStream.format("flowbroker").option("url", broker.url)
             .option("queue", queue).option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(120)
    assert query.exception() is None
    assert sorted(int(m.body) for m in drain(broker.url, queue)) == list(range(600))
    assert len(query.recentProgress) == 3
