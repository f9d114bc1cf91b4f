"""The scheduler's order rules in isolation (RequestQueues): FIFO with bounded bypass, chunk rotation,
protected resume, victims; and the request record's lifecycle."""

from __future__ import annotations

import pytest
from ninfer.contracts.errors import EngineFailure
from ninfer.contracts.sampling import SamplingParams
from ninfer.engine.handle import RequestControl
from ninfer.engine.queues import RequestQueues
from ninfer.engine.requests import RequestRecord, RequestState
from ninfer.engine.scheduler import ScheduledUnit


def rec(ticket: int, state: RequestState = RequestState.WAITING, prompt: int = 3, output: int = 0) -> RequestRecord:
    r = RequestRecord(ticket=ticket, request_id=f"r{ticket}", prompt=tuple(range(2, 2 + prompt)),
                      params=SamplingParams(seed=ticket), session=None,  # type: ignore[arg-type]
                      control=RequestControl(f"r{ticket}", lambda: None, lambda: None), submit_time=0.0,
                      deadline=None)
    r.state = state
    r.output_tokens = list(range(output))
    return r


def test_admission_is_fifo_with_bounded_bypass():
    s = RequestQueues(max_running=4, bypass_limit=2)
    waiting = [rec(t) for t in (3, 1, 2, 4, 5)]
    for r in waiting:
        s.enqueue(r)
    assert [r.ticket for r in s.waiting] == [1, 2, 3, 4, 5]  # ticket order, not arrival order
    assert [r.ticket for r in s.admission_order()] == [1, 2, 3]  # head + 2 bypass candidates
    # The head does not fit; two later ones are admitted ahead of it: the allowance is used up.
    for t in (2, 3):
        r = next(x for x in s.waiting if x.ticket == t)
        r.state = RequestState.PREFILL
        s.add_resident(r)
        s.note_bypass()
    assert [r.ticket for r in s.admission_order()] == [1]
    # Once the head is admitted the next head gets a fresh allowance.
    head = s.waiting[0]
    head.state = RequestState.PREFILL
    s.add_resident(head)
    assert [r.ticket for r in s.admission_order()] == [4, 5]
    assert not s.full and len(s.residents) == s.max_running - 1  # one running place left


def test_strict_fifo_when_bypass_limit_is_zero():
    s = RequestQueues(max_running=2, bypass_limit=0)
    for t in range(3):
        s.enqueue(rec(t))
    assert [r.ticket for r in s.admission_order()] == [0]


def test_no_fresh_admission_while_a_request_is_paused():
    s = RequestQueues(max_running=2, bypass_limit=2)
    s.enqueue(rec(5))
    p = rec(1, RequestState.PREFILL)
    s.add_resident(p)
    s.pause(p)
    assert s.admission_order() == []
    assert s.resume_candidate() is p


def test_one_protected_resume_at_a_time():
    s = RequestQueues(max_running=3, bypass_limit=0)
    a, b = rec(1, RequestState.DECODE_READY), rec(2, RequestState.DECODE_READY)
    for r in (a, b):
        s.add_resident(r)
        s.pause(r)
    assert s.resume_candidate() is a  # oldest first
    a.state, a.protected = RequestState.REPLAY, True
    s.add_resident(a)
    assert s.resume_candidate() is None  # a still protected
    a.protected = False
    assert s.resume_candidate() is b


def test_chunk_rotation_and_protected_first():
    s = RequestQueues(max_running=4, bypass_limit=0)
    rs = [rec(t, RequestState.PREFILL) for t in range(3)] + [rec(3, RequestState.DECODE_READY)]
    for r in rs:
        s.add_resident(r)
    order = []
    for _ in range(4):
        first = s.chunk_candidates()[0]
        order.append(first.ticket)
        s.note_chunk(first)
    assert order == [0, 1, 2, 0]
    assert 3 not in [r.ticket for r in s.chunk_candidates()]  # decode-ready rows take no chunk
    rs[2].protected = True
    assert s.chunk_candidates()[0] is rs[2]


def test_victim_is_youngest_unprotected_resident():
    s = RequestQueues(max_running=4, bypass_limit=0)
    rs = [rec(t, RequestState.DECODE_READY) for t in (4, 7, 2)]
    for r in rs:
        s.add_resident(r)
    assert s.victim().ticket == 7
    rs[1].protected = True
    assert s.victim().ticket == 4


def test_record_rejects_illegal_transitions():
    r = rec(0)
    r.move(RequestState.MATERIALIZING)
    r.move(RequestState.PREFILL)
    with pytest.raises(EngineFailure, match="illegal transition prefill -> waiting"):
        r.move(RequestState.WAITING)
    r.move(RequestState.PAUSING)
    r.move(RequestState.PAUSED)
    r.move(RequestState.SETTLED)
    with pytest.raises(EngineFailure):
        r.move(RequestState.MATERIALIZING)


def test_remaining_budget_is_the_tighter_of_max_tokens_and_context():
    r = rec(0, prompt=10, output=3)
    r.params = SamplingParams(max_tokens=8, seed=0)
    assert r.remaining(max_context=100) == 5
    assert r.remaining(max_context=15) == 2


class _Masks:
    """A session whose token mask is ``mask``."""

    def __init__(self, mask) -> None:
        self.mask = mask

    def token_mask(self):
        return self.mask


class _MaskOnly:
    def fill_bitmask(self, words) -> None:
        words.fill_(-1)


class _FollowsDrafts(_MaskOnly):
    def fill_bitmask_after(self, tokens, words) -> bool:
        words.fill_(-1)
        return True


def test_only_rows_whose_mask_can_follow_drafts_draft():
    """A decode row keeps its drafts when unconstrained (logprobs or not) or when its mask is a
    DraftMaskProvider; a mask that cannot look past drafts makes it a plain decode row."""
    sessions = [None, None, _FollowsDrafts(), _MaskOnly()]
    records = []
    for t, mask in enumerate(sessions):
        r = rec(t, RequestState.DECODE_READY, output=2)
        r.seq, r.session = 10 + t, _Masks(mask)
        if t == 1:
            r.params = SamplingParams(seed=1, logprobs=True, top_logprobs=2)
        records.append(r)
    unit = ScheduledUnit(tuple(records), drafts=(3, 2, 3, 3)).execution_unit()
    assert [(row.seq, row.drafts) for row in unit.decode] == [(10, 3), (11, 2), (12, 3), (13, 0)]
    assert unit.decode[2].sampling.mask is sessions[2] and unit.decode[3].sampling.mask is sessions[3]
