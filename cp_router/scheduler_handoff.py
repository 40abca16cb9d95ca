"""Prefill/decode disaggregation in the decode group's scheduler: room reserved before the prefill group starts,
and the delivered hand-off imported with the request's first decode step (docs/disaggregation.md).

A request's way through here: `reserve` (RESERVING, FCFS in `Scheduler.reserving`) -> `admit_reservations` gives it
pages for its prompt on the rank with the most free pages (RESERVED: the prefill group may start) -> `deliver`
files the prefill group's hand-off -> `start_imports` turns it into a decoding request whose plan carries the
hand-off (`StepPlan.imports`), written into its pages before that step's decode. After that it is an ordinary
decoding request: a preemption or a lost rank recomputes it here (prompt + output so far, `resume_token`).
A rank lost while a request is reserved sends it back to RESERVING (its delivered hand-off, if any, kept).
"""

from __future__ import annotations

from cp_router.handoff import ImportItem, RequestHandoff
from cp_router.pages import pages_for
from cp_router.request_state import DECODING, RESERVED, RESERVING, RequestState
from cp_router.sampling import SamplingParams


def reserve(scheduler, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
    """Queues a request whose prefill runs elsewhere for room here (the same checks as `Scheduler.add`)."""
    scheduler.add(request_id, prompt_ids, sampling)
    scheduler.waiting.remove(request_id)
    scheduler.requests[request_id].status = RESERVING
    scheduler.reserving.append(request_id)


def admit_reservations(scheduler) -> list[str]:
    """FCFS: a reservation gets pages for its prompt (and its first decode position) on the rank with the most
    free pages, while one has room and fewer than `max_num_seqs` requests run; returns the ids now RESERVED."""
    cfg, admitted = scheduler.config, []
    while scheduler.reserving and scheduler.num_running() < cfg.max_num_seqs:
        seq = scheduler.requests[scheduler.reserving[0]]
        cp_rank = max(range(cfg.cp_size), key=lambda r: scheduler.allocators[r].num_free)
        need = pages_for(len(seq.prompt_ids) + 1, cfg.page_size)
        if not scheduler.allocators[cp_rank].can_allocate(need):
            break
        scheduler.reserving.popleft()
        seq.owner, seq.pages, seq.status = cp_rank, {cp_rank: scheduler.allocators[cp_rank].allocate(need)}, RESERVED
        admitted.append(seq.request_id)
    return admitted


def deliver(scheduler, request_id: str, handoff: RequestHandoff, output_ids: tuple[int, ...],
            cached_tokens: int) -> bool:
    """Files a reserved request's hand-off (imported at its next step); False if it is no longer reserved here
    (aborted)."""
    seq = scheduler.requests.get(request_id)
    if seq is None or seq.status not in (RESERVING, RESERVED) or seq.delivered is not None:
        return False
    seq.delivered, seq.output_ids, seq.cached_tokens = handoff, list(output_ids), cached_tokens
    return True


def start_imports(scheduler) -> list[RequestState]:
    """Reserved requests whose hand-off arrived start decoding this step (their KV is written first)."""
    started = [s for s in scheduler.requests.values() if s.status == RESERVED and s.delivered is not None]
    for seq in started:
        seq.status, seq.num_cached = DECODING, seq.delivered.num_tokens
    return started


def import_items(started: list[RequestState]) -> dict[int, list[ImportItem]]:
    """Per owner rank: the imports of the requests started this step that still decode (not preempted)."""
    items: dict[int, list[ImportItem]] = {}
    for seq in started:
        if seq.status == DECODING:
            items.setdefault(seq.owner, []).append(ImportItem(seq.delivered, tuple(seq.pages[seq.owner]),
                                                              seq.sampling, tuple(seq.output_ids)))
        seq.delivered = None
    return items


def requeue_reservations(scheduler) -> None:
    """After the ranks lost every request's state: reserved requests wait for room again (pages were reset)."""
    held = sorted((s for s in scheduler.requests.values() if s.status in (RESERVING, RESERVED)),
                  key=lambda s: s.arrival)
    for seq in held:
        seq.status, seq.owner, seq.pages = RESERVING, None, {}
    scheduler.reserving.clear()
    scheduler.reserving.extend(s.request_id for s in held)
