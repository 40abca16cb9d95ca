"""What the engine counts since it started (benchmarks and tests read it): steps, tokens, speculation, time."""

from __future__ import annotations

from dataclasses import dataclass, field

from cp_router.plans import RequestOutput, StepResult


@dataclass
class EngineStats:
    steps: int = 0
    generated: int = 0
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
               since_last_s: float) -> tuple[int, int]:
        """Counts one finished step; returns the (drafted, accepted) tokens of the step."""
        self.steps, self.step_wall_s = self.steps + 1, self.step_wall_s + wall_s
        self._record_decode_time(step, results, since_last_s)
        self.preemptions += len(step.preempted)
        self.worker_compute_s += max(r.compute_s for r in results)
        self.decode_calls += sum(bool(step.plans[r.cp_rank].decode) for r in results)
        drafted = accepted = 0
        placeholders = {piece.request_id for piece in step.prefill.pieces if not piece.final} if step.prefill else set()
        for request_id, out in outputs.items():
            if request_id not in placeholders:  # a non-final prefill chunk's token is never used
                self.generated += len(out.token_ids)
            drafted, accepted = drafted + out.drafted, accepted + sum(out.accepted_per_position)
            for j, count in enumerate(out.accepted_per_position):
                self.accepted_per_position[j] += count
        self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted
        return drafted, accepted

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
