"""A `BrokerCore` with a journal, wired as broker/journalshell.py wires them, without the committer task
or a clock of its own (the core harness's fake clock): for tests of what the journal writes and what
recovery rebuilds from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowbroker.broker.core import BrokerCore
from flowbroker.broker.journal import Journal
from flowbroker.broker.journalstore import JournalStore
from flowbroker.broker.message import Message
from flowbroker.broker.queue import Queue
from flowbroker.broker.recovery import read_journal, restore, topology_records
from flowbroker.broker.session import Session
from flowbroker.broker.store import MemoryStore, QueueStore
from flowbroker.protocol.frames import Bind, DeclareExchange, Unbind

from tests.broker.coreharness import Harness

__all__ = ["Broker"]


class Broker:
    """A core with a journal (`walks` counts the journal's reads of the core's topology); `commit` writes
    what is buffered, `restore` recovers the directory into the core."""

    def __init__(self, directory: Path, segment_size: int = 64 << 20):
        self.h = Harness(server={"max_queues": 1 << 20, "max_bindings": 1 << 20, "max_exchanges": 1 << 16})
        self.core: BrokerCore = self.h.core
        journal = self.journal = Journal(directory, segment_size, False, 0, 0)
        core = self.core
        self.walks = 0

        def topology() -> list[list[Any]]:
            self.walks += 1
            return topology_records(core)

        journal.topology = topology
        core.journal = journal

        def store_factory(name: str, durable: bool) -> QueueStore:
            return JournalStore(journal, journal.new_queue_id()) if durable else MemoryStore()

        core.store_factory = store_factory
        self.session: Session = self.h.consumer("admin").session

    def restore(self) -> None:
        restore(self.core, self.journal, read_journal(self.journal))

    def commit(self) -> None:
        journal = self.journal
        if journal.pending:
            batch = journal.take_batch()
            journal.write_batch(batch)
            journal.committed(batch)

    def exchange(self, name: str, kind: str) -> None:
        self.core._req_declare_exchange(self.session, DeclareExchange(1, name, kind))

    def bind(self, queue: str, exchange: str, key: str, bound: bool = True) -> None:
        if bound:
            self.core._req_bind(self.session, Bind(1, queue, exchange, key))
        else:
            self.core._req_unbind(self.session, Unbind(1, queue, exchange, key))

    def send(self, queue: Queue, n: int = 1, size: int = 10) -> None:
        for _ in range(n):
            queue.add(Message("", queue.name, b"x" * size, None, size + 512), None, self.h.now)

    def settle_all(self, queue: Queue) -> None:
        store = queue.store
        while len(store):
            msg = store.take()
            store.settle(msg)
            queue.count -= 1
            queue.size -= msg.size
