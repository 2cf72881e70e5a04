"""What a service logs can be read back: the launcher shows a starting service's latest
message, parsed from its log with the format `setup_logging` writes."""

from __future__ import annotations

import logging

import pytest

from services.log import logged_message, setup_logging


def test_a_logged_line_reads_back_as_its_message(capfd: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        setup_logging("worker:decoder").getChild("engine").info("compiling the forward: %d graph", 1)
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
    (line,) = capfd.readouterr().err.splitlines()
    assert logged_message(line) == "compiling the forward: 1 graph"
    assert logged_message("/torch/x.py:12: UserWarning: not a service's line") is None
