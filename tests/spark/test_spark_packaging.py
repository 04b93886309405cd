"""The Spark data source is an optional extra: the SDK and the broker install and run without pyspark or
pyarrow, and `import flowbroker.spark` without them says what to install."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Python started with pyspark and pyarrow made unimportable, as in an install without the extra.
WITHOUT_SPARK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('pyspark', 'pyarrow', 'py4j'):
            raise ImportError(f'No module named {name!r} (blocked)')
sys.meta_path.insert(0, Block())
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_SPARK + code], capture_output=True, text=True, timeout=60)


def test_spark_and_arrow_are_only_in_the_spark_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith(("pyspark", "pyarrow")) for d in project["dependencies"])
    assert {d.split(">")[0] for d in project["optional-dependencies"]["spark"]} == {"pyspark", "pyarrow"}


def test_the_sdk_and_the_broker_run_without_spark(tmp_path):
    done = _run(
        "import trio, flowbroker.client as fc\n"
        "from flowbroker.broker.config import load_config\n"
        "from flowbroker.broker.server import BrokerServer\n"
        "async def main():\n"
        "    server = BrokerServer(load_config(None, {'server': {'port': 0}, 'admin': {'enabled': False},\n"
        "                                             'udp': {'enabled': False}}))\n"
        "    async with trio.open_nursery() as nursery:\n"
        "        port = await nursery.start(server.serve)\n"
        "        async with await fc.connect(f'flowbroker://127.0.0.1:{port}') as conn:\n"
        "            await conn.declare_queue('q')\n"
        "            producer = conn.producer(routing_key='q')\n"
        "            await producer.send(b'hi')\n"
        "            await producer.flush(timeout=5)\n"
        "        nursery.cancel_scope.cancel()\n"
        "    print('ran', 'pyspark' in sys.modules)\n"
        "trio.run(main)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ran", "False"]


def test_importing_the_data_source_without_the_extra_names_it():
    done = _run("import flowbroker.spark")
    assert done.returncode != 0
    assert "pip install 'flowbroker[spark]'" in done.stderr
