"""The top layer: configuration, Ray launch and placement, the Serve app, the HTTP layer, the CLI commands.

Ray's driver folds log lines that look alike across processes (words with digits ignored) into one "[repeated Nx
across cluster]" line, printed once more lines arrive: two ranks' weight-loading lines or two replicas' status
lines would show late and as one. The dsa_serve loggers' lines are exempt (Ray reads the setting when it is
first imported, so `dsa-serve serve`, whose entry point is here, gets it)."""

import os

os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", "dsa_serve[.]")
