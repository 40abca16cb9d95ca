"""What the engine counts since it started (benchmarks, tests and the engine log read it): steps, tokens,
speculation, time."""

from __future__ import annotations

from dataclasses import dataclass, field

from cp_router.plans import RequestOutput, StepResult


@dataclass(frozen=True)
class StepSpeculation:
    """One step's speculative decoding: `drafts` verifications (one per request per verify step) proposing
    `draft_tokens` tokens, of which `accepted_per_position[j]` were accepted at draft position j."""

    drafts: int
    draft_tokens: int
    accepted_per_position: list[int]


def placeholder_ids(step) -> set[str]:
    """Requests whose output this step is a non-final prefill chunk's token (never used, never sent)."""
    return {piece.request_id for piece in step.prefill.pieces if not piece.final} if step.prefill else set()


def drafts_of(out: RequestOutput) -> int:
    """Verifications in one output: each proposes k = len(accepted_per_position) draft tokens."""
    return out.drafted // len(out.accepted_per_position) if out.accepted_per_position else 0


@dataclass
class EngineStats:
    steps: int = 0
    generated: int = 0
    prefilled: int = 0  # prompt tokens run through prefill (every chunk; recomputed ones again)
    drafts: int = 0  # verifications: mean acceptance length = 1 + accepted / drafts
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    preemptions: int = 0
    decode_calls: int = 0  # (step, rank) pairs that decoded: divides `drafted` / k into verify steps
    step_wall_s: float = 0.0
    worker_compute_s: float = 0.0  # max over ranks of each step's compute time, summed
    # Decode-only steps (no prefill in the step): engine time from the previous step's end, and the time
    # of the slowest rank's model forwards; 1 - model / wall is the per-step engine overhead.
    decode_only_steps: int = 0
    decode_only_wall_s: float = 0.0
    decode_only_model_s: float = 0.0
    decode_model_s: dict[str, float] = field(default_factory=dict)  # plain / draft / verify, summed over ranks
    decode_loop_steps: dict[str, int] = field(default_factory=dict)  # plain / speculative, summed over ranks

    def record(self, step, results: list[StepResult], outputs: dict[str, RequestOutput], wall_s: float,
               since_last_s: float) -> StepSpeculation:
        """Counts one finished step; returns its speculation counts."""
        self.steps, self.step_wall_s = self.steps + 1, self.step_wall_s + wall_s
        self._record_decode_time(step, results, since_last_s)
        self.preemptions += len(step.preempted)
        self.worker_compute_s += max(r.compute_s for r in results)
        self.decode_calls += sum(bool(step.plans[r.cp_rank].decode) for r in results)
        self.prefilled += sum(piece.extend_len for piece in step.prefill.pieces) if step.prefill else 0
        placeholders, per_position = placeholder_ids(step), [0] * len(self.accepted_per_position)
        drafts = drafted = 0
        for request_id, out in outputs.items():
            if request_id not in placeholders:  # a non-final prefill chunk's token is never used
                self.generated += len(out.token_ids)
            drafts, drafted = drafts + drafts_of(out), drafted + out.drafted
            for j, count in enumerate(out.accepted_per_position):
                per_position[j] += count
        self.accepted_per_position = [a + b for a, b in zip(self.accepted_per_position, per_position)]
        self.drafts, self.drafted = self.drafts + drafts, self.drafted + drafted
        self.accepted += sum(per_position)
        return StepSpeculation(drafts, drafted, per_position)

    def _record_decode_time(self, step, results: list[StepResult], since_last_s: float) -> None:
        """Model-forward time of the step's decode batches; decode-only steps also count toward the overhead."""
        for result in results:
            for phase, seconds in result.decode_model_s.items():
                self.decode_model_s[phase] = self.decode_model_s.get(phase, 0.0) + seconds
            for phase, count in result.decode_steps.items():
                self.decode_loop_steps[phase] = self.decode_loop_steps.get(phase, 0) + count
        if any(plan.prefill is not None for plan in step.plans.values()):
            return
        self.decode_only_steps += 1
        self.decode_only_wall_s += since_last_s
        self.decode_only_model_s += max(sum(r.decode_model_s.values()) for r in results)
