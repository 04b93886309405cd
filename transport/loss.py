"""Loss detection on the receiver: decide when to NAK the gap a scan found.

Aeron recovers loss with negative acknowledgements sent by the receiver. Two concerns, kept apart as
in Aeron's ``TermGapScanner`` and ``LossDetector``:

* ``TermRebuilder.scan_for_gap`` (terms.py) walks a term from the rebuild position (the end of contiguous
  data) towards the high-water mark and reports the first hole.
* ``LossDetector`` (here) turns "there is a gap" into NAKs: a new gap is NAK'd after ``nak_delay`` (unicast
  100 us; multicast a random backoff so that many receivers do not all NAK the same loss), and again
  every ``retry_delay`` (unicast 100 x delay = 10 ms) while the same gap persists. It never sends
  anything itself; it returns the NAK to send.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from flowbroker.transport.terms import Gap

__all__ = [
    "DEFAULT_NAK_UNICAST_DELAY_NS",
    "DEFAULT_NAK_RETRY_RATIO",
    "DEFAULT_NAK_MULTICAST_MAX_BACKOFF_NS",
    "Gap",
    "LossDetector",
    "LossScan",
]

#: ``AERON_NAK_UNICAST_DELAY`` default.
DEFAULT_NAK_UNICAST_DELAY_NS = 100_000
#: ``AERON_NAK_UNICAST_RETRY_DELAY_RATIO`` default: retry every 100 x delay.
DEFAULT_NAK_RETRY_RATIO = 100
#: ``AERON_NAK_MULTICAST_MAX_BACKOFF`` default.
DEFAULT_NAK_MULTICAST_MAX_BACKOFF_NS = 10_000_000


class LossScan(NamedTuple):
    """The detector's verdict for one scan: a NAK to send now (if any) and whether a *new* gap appeared."""

    nak: Gap | None
    loss_found: bool


class LossDetector:
    """Times NAKs for the gap a scan reports (Aeron's ``LossDetector`` with its delay generators).

    Args:
        nak_delay_ns: delay before the first NAK of a new gap (unicast: fixed; multicast: the maximum of
            a random backoff drawn from ``rng``).
        retry_delay_ns: interval between NAKs while the same gap persists.
        multicast: draw a random first delay so receivers in a group spread their NAKs.
        rng: the randomness for multicast backoff; pass a seeded one for deterministic tests.
    """

    def __init__(
        self,
        *,
        nak_delay_ns: int = DEFAULT_NAK_UNICAST_DELAY_NS,
        retry_delay_ns: int | None = None,
        multicast: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        if nak_delay_ns < 0:
            raise ValueError("nak_delay_ns must be >= 0")
        self.nak_delay_ns = nak_delay_ns
        self.retry_delay_ns = retry_delay_ns if retry_delay_ns is not None else nak_delay_ns * DEFAULT_NAK_RETRY_RATIO
        if self.retry_delay_ns <= 0:
            raise ValueError("retry_delay_ns must be > 0")
        self.multicast = multicast
        self._rng = rng if rng is not None else random.Random(0)
        self.active_gap: Gap | None = None
        self._expiry_ns = 0
        self.naks_sent = 0
        self.gaps_found = 0

    def _first_delay_ns(self) -> int:
        if self.multicast:
            return int(self._rng.random() * self.nak_delay_ns)
        return self.nak_delay_ns

    def on_scan(self, gap: Gap | None, now_ns: int) -> LossScan:
        """Feed the gap from the latest scan; returns the NAK due now, if any."""
        if gap is None:
            self.active_gap = None
            return LossScan(None, False)
        loss_found = False
        active = self.active_gap
        if active is None or active.term_id != gap.term_id or active.term_offset != gap.term_offset:
            self.active_gap = gap
            self._expiry_ns = now_ns + self._first_delay_ns()
            self.gaps_found += 1
            loss_found = True
        else:
            # Same hole, possibly partly filled at its end: NAK what is still missing.
            self.active_gap = gap
        if now_ns - self._expiry_ns >= 0:
            self._expiry_ns = now_ns + self.retry_delay_ns
            self.naks_sent += 1
            return LossScan(gap, loss_found)
        return LossScan(None, loss_found)

    def deadline_ns(self) -> int | None:
        """When the next NAK is due (so an I/O shell can sleep until then), or ``None``."""
        return self._expiry_ns if self.active_gap is not None else None
