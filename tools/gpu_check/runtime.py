"""The run's clock and record: sections and their cases run in order of importance, each catching its own exceptions
into the JSON; one that the global deadline leaves too little time is skipped with the reason; a watchdog writes
what finished and exits when a step overruns the deadline by more than GRACE_S (the check is time-boxed)."""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

GRACE_S = 20.0  # past the deadline: the watchdog stops the run
JSON_NAME = "gpu_check.json"
STICKY_ERRORS = ("illegal memory access", "unspecified launch failure", "misaligned address", "device-side assert",
                 "illegal instruction")  # the process's CUDA context is lost after these


class Skip(Exception):
    """A section or case that cannot run here; its message is the reason recorded."""


class Run:
    def __init__(self, out_dir: Path, budget_s: float, meta: dict):
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.out_dir = out_dir
        self.record: dict = {"meta": {**meta, "budget_s": budget_s}, "sections": {}}
        self.section_end = self.deadline
        self.cleanup: Callable[[], None] = lambda: None  # after each case (frees device memory)
        self.broken: str | None = None  # why this process can no longer use the device
        self._lock = threading.Lock()

    def left(self, until: float | None = None) -> float:
        return (self.deadline if until is None else until) - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def section(self, name: str, fn: Callable[[dict], None], reserve_s: float = 0.0, min_s: float = 1.0,
                in_process: bool = True) -> dict:
        """Runs fn(entry) (entry: the section's dict in the record) until the deadline less `reserve_s`, the time
        kept for the sections after it; skipped when less than `min_s` is left, or when it uses this process's
        device (`in_process`) after an error that lost it."""
        entry: dict = self.record["sections"].setdefault(name, {})
        end = self.deadline - reserve_s
        if in_process and self.broken:
            entry.update(status="skipped", reason=f"the device is unusable in this process after: {self.broken}")
            self.write()
            return entry
        if end - time.monotonic() < min_s:
            entry.update(status="skipped", reason=f"global deadline: {self.left():.0f} s left, {reserve_s:.0f} s "
                                                  f"kept for later sections, this one needs ~{min_s:.0f} s")
            self.write()
            return entry
        self.section_end, started = end, time.monotonic()
        try:
            fn(entry)
            entry["status"] = "ran"
        except Skip as skip:
            entry.update(status="skipped", reason=str(skip))
        except Exception as exc:  # recorded; the next section still runs
            entry.update(status="error", error=self._error(exc), traceback=traceback.format_exc(limit=12)[-4000:])
        entry["elapsed_s"] = round(time.monotonic() - started, 2)
        self._clean()
        self.write()
        return entry

    def case(self, cases: list, name: str, est_s: float, fn: Callable[[], dict], **info) -> dict:
        """Appends one case record to `cases`: fn()'s dict, or the exception, or why it was skipped."""
        record: dict = {"name": name, **info}
        cases.append(record)
        left = self.left(self.section_end)
        if self.broken:
            record.update(status="skipped", reason=f"the device is unusable in this process after: {self.broken}")
            return record
        if left < est_s:
            record.update(status="skipped", reason=f"deadline: {max(left, 0):.0f} s left for this section, the case "
                                                   f"needs ~{est_s:.0f} s")
            return record
        started = time.monotonic()
        try:
            record.update(fn())
            record.setdefault("status", "ran")
        except Skip as skip:
            record.update(status="skipped", reason=str(skip))
        except Exception as exc:
            record.update(status="error", error=self._error(exc), traceback=traceback.format_exc(limit=10)[-3000:])
        record["elapsed_s"] = round(time.monotonic() - started, 2)
        self._clean()
        self.write()
        return record

    def _error(self, exc: BaseException) -> str:
        """The exception as one line; an error that loses the CUDA context marks the process broken."""
        line = f"{type(exc).__name__}: {exc}"[:2000]
        if self.broken is None and any(sticky in line.lower() for sticky in STICKY_ERRORS):
            self.broken = line[:300]
            self.record["meta"]["device_lost"] = self.broken
        return line

    def _clean(self) -> None:
        try:
            self.cleanup()
        except Exception as exc:  # a lost CUDA context fails its synchronize too
            self._error(exc)

    def start_watchdog(self) -> None:
        timer = threading.Timer(max(self.left() + GRACE_S, 1.0), self._abort)
        timer.daemon = True
        timer.start()

    def _abort(self) -> None:
        self.record["meta"]["aborted"] = (f"watchdog: the run was still going {GRACE_S:.0f} s past its deadline; the "
                                          "step in progress and everything after it did not finish")
        self.write()
        print(f"gpu_check: aborted by the watchdog after {self.elapsed():.0f} s; partial record in "
              f"{self.out_dir / JSON_NAME}", flush=True)
        os._exit(3)

    def write(self) -> Path:
        """The record as JSON (atomically: a reader never sees half a file)."""
        path = self.out_dir / JSON_NAME
        with self._lock:
            self.record["meta"]["elapsed_s"] = round(self.elapsed(), 2)
            for _ in range(5):  # the watchdog thread may write while the main thread adds to the record
                try:
                    text = json.dumps(self.record, indent=1, default=str)
                    break
                except RuntimeError:
                    time.sleep(0.01)
            else:
                return path
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text + "\n")
            os.replace(tmp, path)
        return path
