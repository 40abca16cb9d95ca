"""What a rank checks of a step plan before it runs it (cp_worker.py), and how it classifies one."""

from __future__ import annotations

from cp_router.plans import StepPlan
from model_workers.page_table import PageTable


def plan_problem(plan: StepPlan, cache, held) -> str | None:
    """What makes `plan` impossible on this rank (pages too few or outside the cache, a decode of a request this
    rank does not hold), or None."""
    try:
        if plan.prefill is not None:
            meta = plan.prefill.meta
            for pages, prefix, extend in zip(plan.prefill.page_tables, meta.prefix_lens, meta.extend_lens):
                cache.check_room(PageTable(list(pages), prefix), prefix + extend)
        growth = plan.num_steps * (plan.num_speculative_steps + 1)  # what the scheduler grew pages for
        for item in plan.decode:
            if item.request_id not in held:
                raise KeyError(f"decode of request {item.request_id!r}, which this rank does not hold")
            cache.check_room(PageTable(list(item.pages), item.num_cached), item.num_cached + growth)
    except (KeyError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def plan_is_idle(plan: StepPlan) -> bool:
    """A step that runs no forward on this rank (it only frees requests' state)."""
    return plan.prefill is None and not plan.decode and not plan.group_prefill_rows and not plan.group_decode


def plan_has_collectives(plan: StepPlan) -> bool:
    """A step this rank runs with others: a CP prefill, or any forward under expert parallelism."""
    cp_prefill = plan.prefill is not None and plan.prefill.meta.cp_size > 1
    return cp_prefill or bool(plan.group_prefill_rows) or plan.group_decode
