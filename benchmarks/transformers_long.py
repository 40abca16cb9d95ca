"""The `transformers` side of `bench serve --workload long`: one long prompt at a time, and the queue it implies.

Batching 8k-token prompts does not fit this machine's memory, so each distinct prompt of a length runs once,
one after another: greedy `generate` with exactly M new tokens (min_new_tokens = max_new_tokens) and
torch threads = os.cpu_count() (restored after). A streamer times every generated token; the first `put`
carries the prompt and is not a token. Concurrency C is derived from those runs (`queued_timings`) and
summarized by load.py's `summarize`, as the served runs are. The runs happen in a child process with an
address-space limit, so a length that does not fit in memory fails there (recorded as skipped) instead of
taking the machine's memory from everything else; a child that dies anyway is replaced for the next length.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path

from cluster.bench.load import RequestTiming, summarize
from benchmarks.transformers_baseline import baseline_dtypes, load_model

QUEUE_DEFINITION = (
    "transformers runs each distinct prompt of a length once, one after another (a batch of 8k-token prompts does "
    "not fit in memory). Run i takes duration d_i (generate call to return) and TTFT t_i (to the streamer's put of "
    "its first generated token, not the prompt's). Concurrency 1 is those runs as they are. Concurrency C is the "
    "queue they form when C clients in a closed loop send the requests to one sequential server: requests 0..C-1 "
    "arrive together at 0 and request i >= C arrives when request i-C finishes; request i starts at d_0 + ... + "
    "d_{i-1}, so with num_prompts = C request i's TTFT = the sum of the earlier runs' durations + t_i; its tokens "
    "keep their own gaps (ITL); throughput = total tokens / total time (the sum of all durations).")
MEMORY_SHARE = 0.9  # of MemAvailable when the child starts: its address-space limit on top of what it maps then


class TokenClock:
    """A `generate` streamer: the perf_counter time of every put after the first (which carries the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def timed_generate(model, prompt: list[int], max_tokens: int, device: str) -> dict:
    """One greedy generate of exactly `max_tokens` tokens: tokens, ttft_s, e2e_s, token_offsets_s (from the call)."""
    import torch

    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.tensor([prompt], device=device)
    clock = TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad_id, streamer=clock)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    e2e_s = time.perf_counter() - start
    return {"tokens": out.shape[1] - ids.shape[1], "ttft_s": clock.times[0] - start, "e2e_s": e2e_s,
            "token_offsets_s": [t - start for t in clock.times]}


_LOADED: dict[tuple, object] = {}  # in the child: the last model loaded, by (folder, dtype, device)


def sequential_runs(model_dir: str, dtype: str, device: str, prompts: list[list[int]], max_tokens: int,
                    threads: int) -> list[dict]:
    """(In the child.) Each prompt once, in order, after a short untimed warm-up; torch threads set and restored."""
    import torch

    key = (model_dir, dtype, device)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = load_model(Path(model_dir), dtype, device)
    model, previous = _LOADED[key], torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timed_generate(model, prompts[0][:16], 2, device)
        return [timed_generate(model, prompt, max_tokens, device) for prompt in prompts]
    finally:
        torch.set_num_threads(previous)


def limit_memory(share: float = MEMORY_SHARE) -> None:
    """(The child's initializer.) Address space capped at what it maps now + `share` of MemAvailable, so an
    allocation past the machine's free memory raises in torch rather than waking the OOM killer (Linux only)."""
    try:
        import resource

        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        mapped, available = (int(text.split()[0]) * 1024 for text in (status["VmSize"], meminfo["MemAvailable"]))
        resource.setrlimit(resource.RLIMIT_AS, (mapped + int(share * available), resource.RLIM_INFINITY))
    except (ImportError, OSError, KeyError, ValueError):
        pass


class ChildRunner:
    """`run(...)` = `sequential_runs(...)` in a spawned child (a fresh one after a child died)."""

    def __init__(self):
        self.pool: ProcessPoolExecutor | None = None

    def run(self, *args) -> list[dict]:
        if self.pool is None:
            self.pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=limit_memory)
        try:
            return self.pool.submit(sequential_runs, *args).result()
        except BrokenProcessPool:
            self.close()
            raise RuntimeError("the transformers process died (killed, e.g. out of memory)") from None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None


def queued_timings(runs: list[dict], concurrency: int, num_requests: int) -> tuple[list[RequestTiming], float]:
    """The closed loop of `concurrency` clients over the sequential runs (request i = runs[i % len(runs)]), on the
    clock of one server that runs them back to back (QUEUE_DEFINITION); and the total time."""
    ordered = [runs[i % len(runs)] for i in range(num_requests)]
    starts, ends, clock = [], [], 0.0
    for run in ordered:
        starts.append(clock)
        clock += run["e2e_s"]
        ends.append(clock)
    timings = [RequestTiming(0.0 if i < concurrency else ends[i - concurrency],
                             [starts[i] + t for t in run["token_offsets_s"]], run["tokens"])
               for i, run in enumerate(ordered)]
    return timings, clock


def probe_dtypes(runner: ChildRunner, model_dir: Path, dtype: str, device: str, prompt: list[int], max_tokens: int,
                 threads: int) -> dict[str, dict]:
    """Per candidate dtype (`baseline_dtypes`): the timing of one run of `prompt`, or the error it raised."""
    tried = {}
    for candidate in baseline_dtypes(dtype, device):
        try:
            (run,) = runner.run(str(model_dir), candidate, device, [prompt], max_tokens, threads)
            tried[candidate] = {"ttft_s": run["ttft_s"], "e2e_s": run["e2e_s"]}
        except Exception as exc:  # noqa: BLE001 - a dtype transformers cannot run is not a candidate
            tried[candidate] = {"error": repr(exc)}
    return tried


def length_entry(length: int, runs: list[dict], plan: dict[int, int]) -> dict:
    """One length's sequential runs (without their per-token offsets) and the summary per concurrency."""
    levels = {c: summarize(*queued_timings(runs, c, n)) for c, n in plan.items()}
    kept = [{k: v for k, v in run.items() if k != "token_offsets_s"} for run in runs]
    return {"prompt_len": length, "skipped": False, "runs": kept, "levels": levels}


def run_long_baseline(model_dir: Path, prompts: dict[int, list[list[int]]], plan: dict[int, int], max_tokens: int,
                      dtype: str, device: str) -> dict:
    """The `transformers` block of the long workload: probe, chosen dtype, one entry per length (shortest
    first; a length that fails is skipped with its error), or skipped altogether with the reason."""
    try:
        import transformers
    except ImportError as exc:
        return {"skipped": True, "reason": f"transformers is not importable: {exc}"}
    threads, runner = os.cpu_count() or 1, ChildRunner()
    lengths = sorted(prompts)
    try:
        tried = probe_dtypes(runner, model_dir, dtype, device, prompts[lengths[0]][0], max_tokens, threads)
        usable = [d for d, probe in tried.items() if "error" not in probe]
        if not usable:
            return {"skipped": True, "reason": f"transformers generate failed in every dtype: {tried}"}
        chosen = min(usable, key=lambda d: tried[d]["e2e_s"])
        entries = []
        for length in lengths:
            try:
                runs = runner.run(str(model_dir), chosen, device, prompts[length], max_tokens, threads)
                entries.append(length_entry(length, runs, plan))
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory at this length: the others still run
                entries.append({"prompt_len": length, "skipped": True, "reason": repr(exc)})
    finally:
        runner.close()
    return {"skipped": False, "transformers_version": transformers.__version__, "threads": threads,
            "probe_prompt_len": lengths[0], "dtypes_tried": tried, "dtype": chosen, "lengths": entries}
