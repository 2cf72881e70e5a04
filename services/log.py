"""Logging set-up shared by all services: one line per record, service name included."""

from __future__ import annotations

import logging
import re
import sys

_FORMAT = "%(asctime)s %(levelname)s [{service}] %(name)s: %(message)s"
# A line of _FORMAT (asctime is "date time"), read back by the launcher while a service starts.
_LINE = re.compile(r"^\S+ \S+ [A-Z]+ \[[^]]+\] \S+?: (.*)$")


def setup_logging(service: str, level: str = "INFO") -> logging.Logger:
    """Configures the root logger once for this process and returns the service logger."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(service=service)))
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Third-party chatter at INFO would drown request logs.
    for noisy in ("httpx", "urllib3", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(service)


def logged_message(line: str) -> str | None:
    """The message of a line `setup_logging`'s format wrote; None for any other line (a
    library's warning printed to stderr, a traceback)."""
    match = _LINE.match(line)
    return match.group(1) if match else None
