"""Lines a person reads on the server's console: the `dsa_serve.*` loggers at INFO on stderr, which Ray forwards
from every Serve replica and rank actor to the `dsa-serve serve` driver (it starts Ray with log_to_driver)."""

from __future__ import annotations

import logging

CONSOLE_LOGGER = "dsa_serve"


def configure_console_logging() -> None:
    """One stderr handler on the `dsa_serve` logger (once per process), INFO and above."""
    logger = logging.getLogger(CONSOLE_LOGGER)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
