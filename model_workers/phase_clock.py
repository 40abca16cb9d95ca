"""Where a prefill's time goes: indexer, compressor (DeepSeek-V4), attention, MLP / MoE, communication, the rest.

`PhaseClock.attached(model, backend)` times module forwards with hooks and the backend's top-k, KV store
and (V4) window / compressed-entry calls by wrapping them, and the methods modules name in `timed_methods` (V4's
indexer selection), for the duration of a `with` block; nothing is left installed afterwards. A model module says
which phase its forward is by a `timing_phase` attribute (MLA / V4 attention, the DSA indexer, MLP / MoE), so the
clock knows no family.
Times are host wall clock, which equals device time on CPU (synchronous); on CUDA they measure launch
time only unless the caller synchronizes, so the split is a CPU measurement.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from torch import nn

PHASES = ("indexer", "compressor", "attention", "mlp", "communication", "other")
BACKEND_PHASES = {"select_topk": "indexer", "store_kv": "kv_store", "window_rows": "kv_store",
                  "compressed_entries": "compressor"}


class PhaseClock:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)  # raw totals: indexer, attention_total, kv_store, mlp
        self._starts: dict[int, float] = {}

    @contextlib.contextmanager
    def attached(self, model: nn.Module, backend):
        handles = []
        nested = {id(m.shared_experts) for m in model.modules()
                  if getattr(m, "shared_experts", None) is not None}  # timed with their MoE
        for module in model.modules():
            kind = phase_of(module)
            if kind is not None and id(module) not in nested:
                handles.append(module.register_forward_pre_hook(self._start_hook))
                handles.append(module.register_forward_hook(self._stop_hook(kind)))
        wrapped = [(backend, name, kind) for name, kind in BACKEND_PHASES.items() if hasattr(backend, name)]
        wrapped += [(m, name, kind) for m in model.modules() for name, kind in getattr(m, "timed_methods", {}).items()]
        for owner, name, kind in wrapped:
            setattr(owner, name, self._timed(getattr(owner, name), kind))
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            for owner, name, _ in wrapped:
                delattr(owner, name)  # back to the class's method

    def split(self, wall_s: float, comm_s: float) -> dict[str, float]:
        """Seconds per phase of `PHASES`: attention excludes its indexer, compressor and KV store (gathers)
        calls; communication is every collective of the step (`comm_s`); other is what is left of `wall_s`."""
        indexer, compressor = self.seconds["indexer"], self.seconds["compressor"]
        attention = self.seconds["attention_total"] - indexer - compressor - self.seconds["kv_store"]
        parts = {"indexer": indexer, "compressor": compressor, "attention": attention, "mlp": self.seconds["mlp"],
                 "communication": comm_s}
        parts["other"] = max(0.0, wall_s - sum(parts.values()))
        return parts

    def _start_hook(self, module, args):
        self._starts[id(module)] = time.perf_counter()

    def _stop_hook(self, kind: str):
        def hook(module, args, output):
            self.seconds[kind] += time.perf_counter() - self._starts.pop(id(module))
        return hook

    def _timed(self, method, kind: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start
        return timed


def phase_of(module: nn.Module) -> str | None:
    """The phase a module's forward counts in: its `timing_phase` (None: not timed on its own)."""
    return getattr(module, "timing_phase", None)
