"""`errors.one_line`: how a one-line error quotes a library's message, which can run to paragraphs."""

from jaxgpt.errors import one_line


def test_a_message_is_one_line_cut_at_a_word_past_the_limit() -> None:
    error = ValueError("bad  shape\n  (3, 4)\n\texpected (4, 3)")
    assert one_line(error) == "bad shape (3, 4) expected (4, 3)"
    assert one_line(error, 12) == "bad shape ..."  # the limit falls inside "(3,": cut before the word
    assert one_line(error, 32) == "bad shape (3, 4) expected (4, 3)"  # exactly the limit: kept whole
