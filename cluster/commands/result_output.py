"""Where a command's result goes: stdout, and nothing else there (`dsa-serve bench KIND`, `dsa-serve generate`).

A bench run prints its result (one JSON document with --json) at the end, `generate` one line per request. Other
things print to stdout while they run: Ray's driver prints the cluster's error messages there ("(raylet) Task
ServeController.graceful_shutdown failed ..." when a bench stops the server it started), and so may any library.
`results_only_on_stdout` sends all of that to stderr for the run; `print_result` writes to the stdout the command
started with, so `dsa-serve bench KIND --json > result.json` (or `| jq`) gets exactly the result.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from typing import Callable, Iterator, TextIO

_RESULT_STREAM: contextvars.ContextVar[TextIO | None] = contextvars.ContextVar("command_result_stream", default=None)


@contextlib.contextmanager
def results_only_on_stdout() -> Iterator[None]:
    """For the block: `print_result` writes to the current stdout, every other write to stdout goes to stderr."""
    token = _RESULT_STREAM.set(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _RESULT_STREAM.reset(token)


def print_result(text: str) -> None:
    """A command's result (JSON or its summary): to the command's stdout, also inside `results_only_on_stdout`."""
    print(text, file=_RESULT_STREAM.get() or sys.stdout, flush=True)


def with_results_only_on_stdout(run: Callable) -> Callable:
    """A command's `run(args)`, run inside `results_only_on_stdout`."""

    @functools.wraps(run)
    def run_command(args):
        with results_only_on_stdout():
            return run(args)

    return run_command
