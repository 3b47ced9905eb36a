"""`errors.one_line` and `tokenizer_base.out_of_range`: what one-line errors quote of a message or of bad ids."""

import numpy as np

from jaxgpt.errors import one_line


def test_a_message_is_one_line_cut_at_a_word_past_the_limit() -> None:
    error = ValueError("bad  shape\n  (3, 4)\n\texpected (4, 3)")
    assert one_line(error) == "bad shape (3, 4) expected (4, 3)"
    assert one_line(error, 12) == "bad shape ..."  # the limit falls inside "(3,": cut before the word
    assert one_line(error, 32) == "bad shape (3, 4) expected (4, 3)"  # exactly the limit: kept whole


def test_ids_outside_the_vocabulary_are_quoted_whatever_their_size() -> None:
    from jaxgpt.data.tokenizer_base import out_of_range

    assert out_of_range([0, 10**30, -1, 4, 10**30], 5) == [-1, 10**30]  # past int64: reported, not overflowed
    assert out_of_range(np.array([[0, 7], [9, 1]], np.int32), 5) == [7, 9] and out_of_range([], 5) == []
