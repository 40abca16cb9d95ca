"""The CP worker: the body of one rank (a Ray actor = one process per CP rank: cluster/launch.py; or, at C = 1, an
object in the engine's own process: cluster/local_worker.py). It imports no Ray.

It loads the checkpoint (attention replicated on every rank; with expert parallelism only its own block of
routed experts), holds a paged cache and the CP group, and runs one `StepPlan` per step: its shard of a prefill
batch, then its own decode batch. Under expert parallelism every rank runs every step's forwards in lockstep:
a rank outside a one-rank prefill, or without requests of its own, joins the MoE exchanges with zero rows.
It never allocates KV pages: every plan names the pages each request writes (the engine's scheduler owns
them). Between steps it keeps only what the model needs of the requests it owns: their sampling parameters
and MTP draft state. A rank that raises inside a step breaks the group (`comm.abort`) so that no peer waits
in a collective; the engine then re-forms it (`rejoin`).
"""

from __future__ import annotations

import resource
import time
from contextlib import nullcontext

import torch

from cp_router.console_log import configure_console_logging
from cp_router.plans import PrefillShard, RequestOutput, StepPlan, StepResult
from model_workers.checkpoint.draft_vocab import resolve_token_map
from model_workers.checkpoint.loader import LoadReport, load_model_with_report
from model_workers.comm import CollectiveError, LocalComm, ProcessGroupComm
from model_workers.cp_prefill import PrefillContext, drafts_needed, run_prefill
from model_workers.decode_loop import DecodeClock, DecodeState, HeldRequest, run_decode
from model_workers.grammar.rank_grammars import RankGrammars
from model_workers.grammar.request_grammar import MASK_CLOCK
from model_workers.expert_parallel import ExpertExchange, ForwardRows, cp_forward_rows, dp_forward_rows
from model_workers.kernels.registry import kernel_set
from model_workers.kv_handoff import HANDOFF_CLOCK, export_handoff, import_handoff
from model_workers.host_memory import bound_onednn_caches, keep_large_allocations_on_heap, release_free_heap
from model_workers.page_table import PageTable
from model_workers.load_progress import LoadProgress
from model_workers.kernels.torch.batch_invariant import BatchInvariantMode
from model_workers.kernels.torch.cpu_prepack import prepack_linear_weights
from model_workers.models.common.draft_dtype import draft_dtype
from model_workers.phase_clock import PhaseClock
from model_workers.plan_checks import plan_has_collectives, plan_is_idle, plan_problem
from model_workers.precision import compute_dtype, set_draft_precision, storage_dtype
from model_workers.runner import ModelRunner
from model_workers.spec import RankSpec


class CPWorker:
    def __init__(self, cp_rank: int, cp_size: int, num_threads: int | None = 1, console_logging: bool = False):
        """`console_logging`: this process's dsa_serve lines (load progress) go to stderr, which a launcher such as
        Ray forwards to the server's console (cluster/launch.py sets it for its rank actors)."""
        if console_logging:
            configure_console_logging()
        if num_threads is not None:  # None: keep the process's setting (an in-process worker)
            torch.set_num_threads(num_threads)
        bound_onednn_caches()  # before this process's first matmul (host_memory.py)
        keep_large_allocations_on_heap()
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.comm: LocalComm = LocalComm()
        self.runner: ModelRunner | None = None
        self.held: dict[str, HeldRequest] = {}
        self.prefilling: set[str] = set()  # requests mid chunked prefill here (V4 keeps their state meanwhile)
        self.exchange: ExpertExchange | None = None
        self.load_report: LoadReport | None = None
        self.grammars: RankGrammars | None = None  # structured outputs: compiled on this rank's first constraint

    def init_comm(self, master_addr: str, master_port: int) -> None:
        """Joins the CP group (blocks until every rank has joined)."""
        if self.cp_size > 1:
            self.comm = ProcessGroupComm(master_addr, master_port, self.cp_rank, self.cp_size, self.device)
            if self.exchange is not None:
                self.exchange.comm = self.comm

    def rejoin(self, master_addr: str, master_port: int) -> None:
        """Leaves the group (broken by a failed step, or a peer lost) and joins a new one; drops every held
        request (its rank-side state too)."""
        self.comm.destroy()
        if self.runner is not None:
            self.free([*self.held, *self.prefilling])
            self.runner.cache.clear_states()  # the engine restarts every request; its snapshots' pages are free
        self.held, self.prefilling = {}, set()
        self.init_comm(master_addr, master_port)

    def load(self, spec: RankSpec) -> dict:
        """(Re)loads the checkpoint and a fresh cache as `spec` says (model_workers/spec.py: resolved once at the
        edge, so nothing here reads config.json); requests held so far are dropped. With spec.ep_size = cp_size
        this rank loads and runs only its block of every MoE layer's routed experts; spec.deterministic runs every
        step batch-invariant (kernels/torch/batch_invariant.py); spec.attention_backend picks the kernel set."""
        if spec.ep_size not in (1, self.cp_size):
            raise ValueError(f"ep_size must be 1 or cp_size={self.cp_size}, got {spec.ep_size}")
        model_dir = str(spec.model.path)
        storage, progress = storage_dtype(spec.dtype), LoadProgress(self.cp_rank, model_dir)  # lines on the console
        kernels = kernel_set(spec.attention_backend, self.device.type, spec.deterministic)  # `auto`: by device, mode
        model, self.load_report = load_model_with_report(
            spec.model, dtype=compute_dtype(storage, self.device), device=self.device, progress=False,
            ep_rank=self.cp_rank if spec.ep_size > 1 else 0, ep_size=spec.ep_size, on_read=progress.read)
        progress.done(self.load_report.total_bytes)
        if model.num_mtp_layers:
            set_draft_precision(model, self.device)  # on a CPU the draft computes in float32
            model.set_draft_vocab(resolve_token_map(spec.speculative_token_map, model_dir, model.config.vocab_size))
        prepacked = prepack_linear_weights(model)  # bf16 on a CPU with native bf16: oneDNN's layout, packed once
        self.exchange = ExpertExchange(self.comm, kernels.experts, spec.deterministic) if spec.ep_size > 1 else None
        graph_shape = spec.graph_shape if self.device.type == "cuda" else None
        self.runner = ModelRunner(model, num_pages=spec.num_pages, page_size=spec.page_size, device=self.device,
                                  kv_dtype=storage, exchange=self.exchange, kv_cache_dtype=spec.kv_cache_dtype,
                                  deterministic=spec.deterministic, kernels=kernels, graph_shape=graph_shape)
        self.held, self.prefilling = {}, set()
        self.grammars = RankGrammars(model_dir, model.config.vocab_size)
        return {"cp_rank": self.cp_rank, "device": str(self.device), "threads": torch.get_num_threads(),
                "compute_dtype": str(model.model.embed_tokens.weight.dtype).removeprefix("torch."),
                "draft_vocab_size": model.draft_vocab.size if model.draft_vocab is not None else None,
                "draft_dtype": str(draft_dtype(model)).removeprefix("torch."),
                "attention_backend": kernels.name, "cuda_graphs": self.runner.decode_graphs is not None,
                "prepacked_weights": prepacked, **self.weights_info()}

    def weights_info(self) -> dict:
        """What this rank holds: its routed experts, checkpoint bytes read (total and by weight class), and the
        bytes of its loaded parameters."""
        model = self.runner.model
        experts = next((m.mlp.experts.expert_ids for m in model.model.layers if hasattr(m.mlp, "experts")), range(0))
        return {"experts": [experts.start, experts.stop], "weight_bytes_read": self.load_report.total_bytes,
                "weight_bytes_by_class": self.load_report.bytes_by_class(),
                "parameter_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values())}

    def step(self, plan: StepPlan) -> StepResult:
        """Runs this rank's prefill shard (if any), then its decode batch; reports outputs of owned requests.

        A step with collectives starts with every rank checking its plan and all ranks agreeing (one small
        all-gather): a plan one rank cannot run fails the step on every rank before any forward, the group
        intact. An error later in the step breaks the group first, so peers fail too instead of waiting."""
        self.free(list(plan.free))
        self.runner.cache.drop_snapshots(plan.drop_snapshots)  # their pages were evicted (prefix caching)
        problem = self._import(plan.imports) or plan_problem(plan, self.runner.cache, self.held)
        if plan_has_collectives(plan):
            rejected = [r for r, (bad,) in enumerate(self._vote(problem is not None)) if bad]
            if rejected and problem is None:
                raise RuntimeError(f"cp_rank {self.cp_rank} left the step: cp_rank(s) {rejected} rejected their plan")
        if problem is not None:
            raise RuntimeError(f"cp_rank {self.cp_rank} rejected its step plan: {problem}")
        if plan.free and plan_is_idle(plan) and not self.held and not self.prefilling:
            release_free_heap()  # its last requests just dropped, nothing to run: hand the freed heap to the OS
        try:
            with BatchInvariantMode() if self.runner.deterministic else nullcontext():
                return self._step(plan)
        except CollectiveError as exc:
            self.comm.abort()
            raise RuntimeError(f"cp_rank {self.cp_rank} left the step: {exc} (another rank failed first)") from exc
        except Exception as exc:
            self.comm.abort()
            raise RuntimeError(f"cp_rank {self.cp_rank} failed the step: {type(exc).__name__}: {exc}") from exc

    def _vote(self, rejects: bool) -> list[list[int]]:
        """Every rank's verdict on its plan; a peer gone before the step breaks the group here."""
        try:
            return self.comm.all_gather_ints([rejects])
        except CollectiveError as exc:
            self.comm.abort()
            raise RuntimeError(f"cp_rank {self.cp_rank} left the step: {exc} (another rank failed first)") from exc

    def _step(self, plan: StepPlan) -> StepResult:
        start, cpu_start = time.perf_counter(), time.process_time()
        result = StepResult(cp_rank=self.cp_rank)
        with_draft = drafts_needed(plan.num_speculative_steps, plan.return_logits)  # the MTP layer at prefill
        if plan.prefill is not None:
            clock = PhaseClock() if plan.time_prefill_phases else None
            with clock.attached(self.runner.model, self.runner.backend) if clock is not None else nullcontext():
                result.outputs.update(self._prefill(plan.prefill, plan.return_logits, plan.group_prefill_rows,
                                                    with_draft))
            if clock is not None:
                result.prefill_phase_s = clock.split(time.perf_counter() - start, self.comm.stats.seconds)
            result.handoffs = self._hand_off(plan.prefill, result.outputs)
        elif plan.group_prefill_rows:
            self._join_prefill(plan.group_prefill_rows, with_draft)
        if plan.decode or plan.group_decode:
            clock = DecodeClock()
            result.outputs.update(self._decode(plan, clock))
            result.decode_model_s, result.decode_steps = dict(clock.seconds), dict(clock.steps)
        wall_s = time.perf_counter() - start
        stats = self.comm.reset_stats()
        result.comm_s, result.num_collectives = stats.seconds, stats.calls
        result.comm_bytes, result.kv_comm_bytes = stats.total_bytes, stats.bytes_by_tag.get("kv", 0)
        result.comm_bytes_by_tag = dict(stats.bytes_by_tag)
        result.compute_s, result.cpu_s = wall_s - stats.seconds, time.process_time() - cpu_start
        result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        result.grammar_mask_s, result.grammar_masks = MASK_CLOCK.take()
        result.handoff_s = HANDOFF_CLOCK.take()[0]
        return result

    def free(self, request_ids: list[str]) -> None:
        """Drops the state of requests this rank owned or was prefilling (unknown ids are ignored)."""
        for request_id in request_ids:
            self.held.pop(request_id, None)
            self.prefilling.discard(request_id)  # preempted or aborted between two prefill chunks
            self.runner.cache.release(request_id)  # DeepSeek-V4: its per-request state

    def _import(self, items) -> str | None:
        """Disaggregation: hand-offs from a prefill group written into this rank's pages, held from now on; what
        made one impossible, or None."""
        for item in items:
            grammars = self.grammars.cache_for((item,)) if item.sampling.grammar is not None else None
            try:
                self.held[item.handoff.request_id] = import_handoff(
                    self.runner.cache, item, grammars, self.runner.model.config.eos_token_ids, self.device)
            except ValueError as exc:
                return f"ValueError: {exc}"
        return None

    def _hand_off(self, shard: PrefillShard, outputs: dict[str, RequestOutput]) -> dict:
        """Disaggregation: the prefilled requests this rank owns that go on elsewhere, read out and dropped here
        (their pages stay with the scheduler, which frees or caches them)."""
        handoffs, meta = {}, shard.meta
        for s, (req, pages) in enumerate(zip(shard.requests, shard.page_tables)):
            rid = req.request_id
            if req.handoff and rid in self.held and outputs[rid].finish_reason is None:
                table = PageTable(list(pages), meta.prefix_lens[s] + meta.extend_lens[s], rid)
                handoffs[rid] = export_handoff(self.runner.cache, table, self.held.pop(rid), self.runner.page_size)
                self.runner.cache.release(rid)
        return handoffs

    def ping(self) -> int:
        """The health probe: answers with this worker's cp_rank."""
        return self.cp_rank

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token occupies on this rank, over every cache layer (target + MTP)."""
        return self.runner.cache.bytes_per_token()

    def held_requests(self) -> list[str]:
        return sorted(self.held)

    def export_kv(self, pages: list[int], num_tokens: int,
                  request_id: str | None = None) -> dict[str, list[torch.Tensor | None]]:
        """The cached keys of positions 0..num_tokens-1 stored in `pages` (a request's page table), per layer;
        `request_id` names the request whose per-request state (DeepSeek-V4) to read."""
        return self.runner.cache.rows(PageTable(list(pages), num_tokens, request_id))

    def export_draft_state(self, request_id: str) -> dict[str, torch.Tensor | None]:
        """The MTP draft state this rank keeps of an owned request: hidden [D] at its last cached position,
        and (MTP index sharing) the top-k slots recorded there."""
        held = self.held[request_id]
        return {"draft_hidden": held.draft_hidden, "draft_topk": held.draft_topk}

    def shutdown(self) -> None:
        self.held, self.prefilling = {}, set()
        self.comm.destroy()

    @torch.inference_mode()
    def _prefill(self, shard: PrefillShard, return_logits: bool, group_rows: tuple[int, ...],
                 with_draft: bool) -> dict[str, RequestOutput]:
        comm = self.comm if shard.meta.cp_size > 1 else LocalComm()
        if self.exchange is not None:  # target and MTP forward alike: this batch's rows on every rank
            self.runner.begin_forward(0, True, self._prefill_rows(group_rows, shard.meta))
        tables = [PageTable(list(pages), prefix, req.request_id)
                  for req, pages, prefix in zip(shard.requests, shard.page_tables, shard.meta.prefix_lens)]
        ctx = PrefillContext(self.runner.model, self.runner.family, self.runner.backend, comm, self.cp_rank, tables,
                             self.runner.page_size, self.device, grammar_cache=self.grammars.cache_for(shard.requests))
        outputs = run_prefill(ctx, shard, return_logits, with_draft)
        for req, pages, prefix, extend in zip(shard.requests, shard.page_tables, shard.meta.prefix_lens,
                                              shard.meta.extend_lens):
            if req.snapshot_state:  # prefix caching: the state at this chunk's end, for later hits (V4)
                self.runner.cache.snapshot_state(PageTable(list(pages), prefix + extend, req.request_id),
                                                 prefix + extend)
            if not req.final_chunk:  # the owner keeps what decoding needs
                self.prefilling.add(req.request_id)
                continue
            self.prefilling.discard(req.request_id)
            if req.owner_rank == self.cp_rank:
                self.held[req.request_id] = HeldRequest(req.sampling, ctx.draft_hidden.get(req.request_id),
                                                        ctx.draft_topk.get(req.request_id),
                                                        ctx.histories.get(req.request_id),
                                                        ctx.grammars.get(req.request_id))
            else:
                self.runner.cache.release(req.request_id)  # DeepSeek-V4: a non-owner's copy of its state
        return outputs

    def _prefill_rows(self, group_rows: tuple[int, ...], meta) -> ForwardRows:
        """CP prefill: every rank padded to the CP collective size; a one-rank prefill: DP rows (SUM_LEN)."""
        if meta is not None and meta.cp_size > 1:
            return cp_forward_rows(list(group_rows), meta.collective_rows)
        return dp_forward_rows(list(group_rows), self.cp_rank, is_extend=True)

    @torch.inference_mode()
    def _join_prefill(self, group_rows: tuple[int, ...], with_draft: bool) -> None:
        """Another rank prefills alone: join its target forward's (and MTP forward's) expert exchanges."""
        self.runner.begin_forward(0, True, self._prefill_rows(group_rows, None))
        self.runner.model.join_experts(self.runner.backend)
        if with_draft and self.runner.model.num_mtp_layers > 0:
            self.runner.model.join_experts(self.runner.backend, 0)

    @torch.inference_mode()
    def _decode(self, plan: StepPlan, clock: DecodeClock) -> dict[str, RequestOutput]:
        """Owned requests only, no collectives: `plan.num_steps` plain or speculative decode steps."""
        states = [
            DecodeState(item.request_id, self.held[item.request_id],
                        PageTable(list(item.pages), item.num_cached, item.request_id),
                        item.token_id, item.num_generated, item.max_new)
            for item in plan.decode
        ]
        return run_decode(self.runner, states, plan.num_steps, plan.num_speculative_steps, plan.return_logits, clock)

