"""The CP worker: the body of one Ray actor = one process = one CP rank.

It loads the checkpoint (attention replicated on every rank), owns a paged cache and the CP group, and
runs one `StepPlan` per step: its shard of a CP prefill batch, then its own decode batch. During prefill
a rank holds pages for every request of the batch; after a request's final chunk only its owner keeps
them (target and MTP KV) and decodes it alone, with no collectives.
"""

from __future__ import annotations

import resource
import time

import torch

from cp_router.plans import PrefillShard, RequestOutput, StepPlan, StepResult

from model_workers.comm import LocalComm, ProcessGroupComm, free_port
from model_workers.backends.cp_backend import CPBackend
from model_workers.cp_prefill import PrefillContext, run_prefill
from model_workers.kv_cache import OutOfPages, PageTable
from model_workers.checkpoint.loader import load_model
from model_workers.phase_clock import PhaseClock
from model_workers.precision import compute_dtype, storage_dtype
from model_workers.decode_loop import DecodeClock, DecodeState, HeldRequest, run_decode
from model_workers.runner import ModelRunner


class CPWorker:
    def __init__(self, cp_rank: int, cp_size: int, num_threads: int | None = 1):
        if num_threads is not None:  # None: keep the process's setting (an in-process worker)
            torch.set_num_threads(num_threads)
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.comm: LocalComm = LocalComm()
        self.runner: ModelRunner | None = None
        self.backend: CPBackend | None = None
        self.held: dict[str, HeldRequest] = {}

    def rendezvous_address(self) -> tuple[str, int]:
        """Called on cp_rank 0: this node's address and a free port for the group's rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def init_comm(self, master_addr: str, master_port: int) -> None:
        """Joins the CP group (blocks until every rank has joined)."""
        if self.cp_size > 1:
            self.comm = ProcessGroupComm(master_addr, master_port, self.cp_rank, self.cp_size, self.device)

    def load(self, model_dir: str, dtype: str = "float32", num_pages: int = 256, page_size: int = 64) -> dict:
        """(Re)loads a checkpoint and a fresh cache; requests held so far are dropped."""
        storage = storage_dtype(dtype)
        model = load_model(model_dir, dtype=compute_dtype(storage, self.device), device=self.device,
                           progress=False)
        self.runner = ModelRunner(model, num_pages=num_pages, page_size=page_size, device=self.device,
                                  kv_dtype=storage)
        self.backend = CPBackend(self.runner.cache)
        self.held = {}
        return {"cp_rank": self.cp_rank, "device": str(self.device), "threads": torch.get_num_threads(),
                "compute_dtype": str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")}

    def step(self, plan: StepPlan) -> StepResult:
        """Runs this rank's prefill shard (if any), then its decode batch; reports outputs of owned requests."""
        start, cpu_start = time.perf_counter(), time.process_time()
        result = StepResult(cp_rank=self.cp_rank)
        self.free(list(plan.free))
        if plan.prefill is not None:
            clock = PhaseClock()
            with clock.attached(self.runner.model, self.backend):
                result.outputs.update(self._prefill(plan.prefill, plan.return_logits))
            prefill_wall_s = time.perf_counter() - start
            phases = clock.split(prefill_wall_s, self.comm.stats.seconds)
        if plan.decode:
            clock = DecodeClock()
            result.outputs.update(self._decode(plan, clock))
            result.decode_model_s, result.decode_steps = dict(clock.seconds), dict(clock.steps)
        wall_s = time.perf_counter() - start
        stats = self.comm.reset_stats()
        result.comm_s, result.num_collectives = stats.seconds, stats.calls
        result.comm_bytes, result.kv_comm_bytes = stats.total_bytes, stats.bytes_by_tag.get("kv", 0)
        result.compute_s, result.cpu_s = wall_s - stats.seconds, time.process_time() - cpu_start
        result.free_pages = self.runner.cache.allocator.num_free
        result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        if plan.prefill is not None:
            result.prefill_phase_s = phases
        return result

    def free(self, request_ids: list[str]) -> None:
        """Releases the pages of requests this rank holds (unknown ids are ignored: non-owners hold nothing)."""
        for request_id in request_ids:
            held = self.held.pop(request_id, None)
            if held is not None:
                self.runner.release(held.table)

    def free_pages(self) -> int:
        return self.runner.cache.allocator.num_free

    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token occupies on this rank, over every cache layer (target + MTP)."""
        return self.runner.cache.bytes_per_token()

    def held_requests(self) -> list[str]:
        return sorted(self.held)

    def export_kv(self, request_id: str) -> dict[str, list[torch.Tensor | None]]:
        """The request's cached keys per cache layer: latent [n, latent_dim], index key [n, index_dim] or None."""
        table, cache = self.held[request_id].table, self.runner.cache
        slots = table.slots(0, table.num_tokens, cache.page_size).to(self.device)  # [n]
        return {
            "latent": [layer[slots].cpu() for layer in cache.latent],
            "index_keys": [None if layer is None else layer[slots].cpu() for layer in cache.index_keys],
        }

    def shutdown(self) -> None:
        self.held = {}
        self.comm.destroy()

    @torch.inference_mode()
    def _prefill(self, shard: PrefillShard, return_logits: bool) -> dict[str, RequestOutput]:
        comm = self.comm if shard.meta.cp_size > 1 else LocalComm()
        tables = self._reserve_everywhere(shard, comm)
        ctx = PrefillContext(self.runner.model, self.backend, comm, self.cp_rank, tables, self.runner.page_size, self.device)
        try:
            outputs = run_prefill(ctx, shard, return_logits)
        except Exception:
            self.free([req.request_id for req in shard.requests])
            raise
        self.free([req.request_id for req in shard.requests if req.owner_rank != self.cp_rank and req.final_chunk])
        for request_id, hidden in ctx.draft_hidden.items():
            self.held[request_id].draft_hidden = hidden
            self.held[request_id].draft_topk = ctx.draft_topk.get(request_id)
        return outputs

    def _reserve_everywhere(self, shard: PrefillShard, comm: LocalComm) -> list[PageTable]:
        """Reserves on every rank of the batch or on none: a rank that cannot must not leave others waiting."""
        failure = None
        try:
            tables = self._reserve(shard)
        except (OutOfPages, ValueError) as exc:
            failure = exc
        ok_local = torch.tensor([[failure is None]], dtype=torch.int32, device=self.device)  # [1, 1]
        ok_ranks = comm.all_gather_rows(ok_local, "control").flatten().tolist()  # [cp_size]
        if failure is not None:
            raise failure
        if not all(ok_ranks):
            self.free([req.request_id for req in shard.requests])
            failed = [r for r, ok in enumerate(ok_ranks) if not ok]
            raise OutOfPages(f"prefill batch rejected: cp_rank(s) {failed} could not reserve its pages")
        return tables

    def _reserve(self, shard: PrefillShard) -> list[PageTable]:
        """This rank's table of every request of the batch, grown to prefix + extend (all or nothing)."""
        meta, created = shard.meta, []
        try:
            for s, req in enumerate(shard.requests):
                if req.request_id not in self.held:
                    self.held[req.request_id] = HeldRequest(PageTable(), req.sampling)
                    created.append(req.request_id)
                table = self.held[req.request_id].table
                if table.num_tokens != meta.prefix_lens[s]:
                    raise ValueError(
                        f"request {req.request_id}: prefix_len={meta.prefix_lens[s]} but cp_rank {self.cp_rank}"
                        f" holds {table.num_tokens} tokens"
                    )
                self.runner.cache.reserve(table, meta.prefix_lens[s] + meta.extend_lens[s])
        except (OutOfPages, ValueError):
            self.free(created)
            raise
        return [self.held[req.request_id].table for req in shard.requests]

    @torch.inference_mode()
    def _decode(self, plan: StepPlan, clock: DecodeClock) -> dict[str, RequestOutput]:
        """Owned requests only, no collectives: `plan.num_steps` plain or speculative decode steps."""
        states = [
            DecodeState(item.request_id, self.held[item.request_id], item.token_id, item.num_generated, item.max_new)
            for item in plan.decode
        ]
        return run_decode(self.runner, states, plan.num_steps, plan.num_speculative_steps, plan.return_logits, clock)
