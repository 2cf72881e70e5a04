"""Status codes carried inside stream messages: the numbers are gRPC's, both ways."""

from __future__ import annotations

import grpc

from services.errors import Code, error_from_status, status_number


def test_every_code_has_grpcs_number_and_comes_back() -> None:
    for code in Code:
        number = status_number(code)
        assert number == getattr(grpc.StatusCode, code.value).value[0]
        error = error_from_status(number, "m", "field")
        assert (error.code, error.message, error.param) == (code, "m", "field")


def test_unknown_or_unmapped_number_is_internal() -> None:
    assert error_from_status(99, "m").code is Code.INTERNAL
    assert error_from_status(0, "ok is not an error").code is Code.INTERNAL  # OK has no Code
    assert error_from_status(12, "m").code is Code.INTERNAL  # UNIMPLEMENTED: not in Code
