"""RequestQueues: the scheduler's three queues and the order rules that pick from them. No Program calls.

Membership (each queue in ticket, that is submission, order):

- ``waiting``: submitted, not admitted yet.
- ``residents``: requests that hold a Program sequence (PREFILL, REPLAY, DECODE_READY); at most
  ``max_running`` of them (``EngineOptions.max_concurrency``).
- ``paused``: preempted requests; they resume before any fresh admission.

Order rules (docs/design.md sections 4 and 5):
- Admission is FIFO with a bounded bypass: when the queue head does not fit yet, at most
  ``bypass_limit`` later requests may be admitted before it; then admission waits for the head.
- At most one protected resume at a time; its chunk comes first in a step.
- Other prefill/Replay chunks rotate among residents, least recently served first (a resident counts as
  served when it became resident; ties in ticket order); a step may run several, within its token
  budget. No resident joins the queue ahead of a waiting one, so each waits at most ``max_running - 1``
  steps in which another non-protected chunk ran first.
- The preemption victim is the youngest (highest ticket) resident that is not protected.
"""

from __future__ import annotations

from ninfer.engine.requests import RequestRecord, RequestState


class RequestQueues:
    def __init__(self, max_running: int, bypass_limit: int) -> None:
        self.max_running = max_running
        self.bypass_limit = bypass_limit
        self.waiting: list[RequestRecord] = []
        self.residents: list[RequestRecord] = []
        self.paused: list[RequestRecord] = []
        self._bypassed_head: int | None = None  # ticket of the head that was overtaken
        self._bypass_count = 0
        self._chunk_clock = 0                  # chunks given so far
        self._served: dict[int, int] = {}      # resident ticket -> the clock at its last chunk (or its arrival)

    # -- membership -----------------------------------------------------------------------------
    def enqueue(self, rec: RequestRecord) -> None:
        _insert_by_ticket(self.waiting, rec)

    def add_resident(self, rec: RequestRecord) -> None:
        if self.full:
            raise RuntimeError("every running place is taken")  # the scheduler checks ``full`` first
        if rec in self.waiting:
            self.waiting.remove(rec)
        if rec in self.paused:
            self.paused.remove(rec)
        _insert_by_ticket(self.residents, rec)
        self._served[rec.ticket] = self._chunk_clock

    def pause(self, rec: RequestRecord) -> None:
        self.residents.remove(rec)
        self._served.pop(rec.ticket, None)
        _insert_by_ticket(self.paused, rec)

    def remove(self, rec: RequestRecord) -> None:
        for group in (self.waiting, self.residents, self.paused):
            if rec in group:
                group.remove(rec)
        self._served.pop(rec.ticket, None)

    @property
    def full(self) -> bool:
        """Every running place is taken: nothing more may become resident now."""
        return len(self.residents) >= self.max_running

    def protected(self) -> RequestRecord | None:
        for rec in self.residents:
            if rec.protected:
                return rec
        return None

    # -- admission --------------------------------------------------------------------------------
    def resume_candidate(self) -> RequestRecord | None:
        """The oldest paused request, when a running place is free and no other resume is protected."""
        if not self.paused or self.full or self.protected() is not None:
            return None
        return self.paused[0]

    def admission_order(self) -> list[RequestRecord]:
        """Waiting requests that may be tried now, in order: the head, then at most the remaining
        bypass allowance of later ones. Fresh admission waits while any request is paused (paused
        ones are older and resume first). The caller reports a bypass with :meth:`note_bypass`."""
        if self.paused or self.full or not self.waiting:
            return []
        head = self.waiting[0]
        if self._bypassed_head != head.ticket:
            self._bypassed_head, self._bypass_count = head.ticket, 0
        allowed = max(0, self.bypass_limit - self._bypass_count)
        return self.waiting[:1 + allowed]

    def note_bypass(self) -> None:
        """A later request was admitted ahead of the waiting head."""
        self._bypass_count += 1

    # -- the step's work --------------------------------------------------------------------------
    def decode_rows(self) -> list[RequestRecord]:
        return [r for r in self.residents if r.state is RequestState.DECODE_READY]

    def chunk_candidates(self) -> list[RequestRecord]:
        """Residents needing prefill/Replay, best first: the protected resume, then the others least
        recently served first (ties in ticket order)."""
        building = [r for r in self.residents if r.state in (RequestState.PREFILL, RequestState.REPLAY)]
        protected = [r for r in building if r.protected]
        rest = [r for r in building if not r.protected]
        rest.sort(key=lambda r: (self._served[r.ticket], r.ticket))
        return protected + rest

    def note_chunk(self, rec: RequestRecord) -> None:
        """``rec`` got a chunk (called for each, in order): it goes to the back of the rotation."""
        self._chunk_clock += 1
        self._served[rec.ticket] = self._chunk_clock

    def victim(self) -> RequestRecord | None:
        """The youngest non-protected resident (may be the row that needs the resources itself)."""
        for rec in reversed(self.residents):
            if not rec.protected:
                return rec
        return None


def _insert_by_ticket(group: list[RequestRecord], rec: RequestRecord) -> None:
    i = len(group)
    while i > 0 and group[i - 1].ticket > rec.ticket:
        i -= 1
    group.insert(i, rec)
