"""Streaming the text of a SentencePiece-style tokenizer (Llama 2's tokenizer.json: words start with "▁", the
decoder strips the text's first space, byte-fallback tokens spell other characters): `StreamDecoder` restarts its
window at each push, and a window that starts with a "▁" word decodes without its space, yet what it gives, piece
by piece, is the whole decoding, whatever the chunking and prompt."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.bos_tokenizer import sentencepiece_tokenizer

from jaxgpt.generate.text_stream import StreamDecoder

pytest.importorskip("tokenizers")
TEXTS = ["hello world and the world says hello", "  two spaces  here ", "the ünï 日本 world!  again ", "a\nb \n c"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_are_the_whole_decoding(text):
    tok = sentencepiece_tokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token and tok.decode(ids[1:]) == text  # (the decoder strips the space it prepended)
    rng = np.random.default_rng(0)
    for trial in range(40):
        cut = int(rng.integers(0, 4)) if trial % 2 else 0  # a prompt of a few ids, or none
        prompt, rest = ids[:cut], ids[cut:]
        stream, out, i = StreamDecoder(tok, prompt), "", 0
        while i < len(rest):
            n = int(rng.integers(0, 4))  # pieces of 0-3 ids: every window restart
            out += stream.push(rest[i:i + n])
            i += n
        out += stream.push([], final=True)
        assert tok.decode(prompt) + out == tok.decode(ids), (trial, prompt)
    words = [i for i in ids if tok.decode([i]) != tok.decode([ids[0], i])[len("<s>"):]]
    assert words, "no token whose leading space a window start strips: the test would prove nothing"
