"""The one check of "a token id of the vocabulary" the gateway, the tokenizer service and
the engine share (`services.completion_prompt.first_outside_vocab`)."""

from __future__ import annotations

import pytest

from services.completion_prompt import check_token_ids, first_outside_vocab
from services.errors import InvalidArgument

VOCAB = 100


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ([], None),
        ([0, 5, VOCAB - 1], None),
        ([5, VOCAB], (1, VOCAB)),
        ([-1, 5], (0, -1)),
        ([5, True], (1, True)),  # a bool is no token id, though it compares as one
        ([5, 2.0], (1, 2.0)),
        ([5, "7"], (1, "7")),
        ([5, VOCAB + 3, -2], (1, VOCAB + 3)),  # the first offender
    ],
)
def test_first_outside_vocab(tokens: list[object], expected: tuple[int, object] | None) -> None:
    assert first_outside_vocab(tokens, VOCAB) == expected


def test_ints_are_checked_for_their_range_only() -> None:
    assert first_outside_vocab([0, 5, VOCAB - 1], VOCAB, ints=True) is None
    assert first_outside_vocab([5, VOCAB + 3, -2], VOCAB, ints=True) == (1, VOCAB + 3)
    assert first_outside_vocab([-1, 5], VOCAB, ints=True) == (0, -1)


def test_check_token_ids_names_the_field_and_position() -> None:
    check_token_ids(list(range(VOCAB)), VOCAB, "prompt")
    with pytest.raises(
        InvalidArgument, match=r"prompt\[2\] = 100 is outside the vocabulary \[0, 100\)"
    ) as info:
        check_token_ids([1, 2, VOCAB], VOCAB, "prompt")
    assert info.value.param == "prompt"
