"""Console logging with the rank in every line; workers log warnings only unless asked."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str = "info", rank: int = 0) -> None:
    wanted = getattr(logging, level.upper())
    if rank != 0 and wanted > logging.DEBUG:
        wanted = max(wanted, logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[hybridrl r{rank} %(asctime)s] %(levelname)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    root = logging.getLogger("hybridrl")
    root.handlers[:] = [handler]
    root.setLevel(wanted)
    root.propagate = False
