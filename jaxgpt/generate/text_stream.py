"""Streamed text: token ids arriving in pieces turned into text that can be shown at once (`StreamDecoder`), cut
just before the first stop string (`first_stop`, `StopFilter`).

`jaxgpt sample` prints its samples with it (`print_stream`, which the train command's closing sample uses too),
chat replies decode with it, and the server's choices cut their text with its rule (`jaxgpt.serve.choices`): where
a stop string cuts, and how much text waits to show whether it begins one, is written once, here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from jaxgpt.data.tokenizer import Tokenizer


class Decodes(Protocol):
    """What `StreamDecoder` needs of a tokenizer (a GPT's, or an encoder-decoder's target text: `PairText`)."""

    def decode(self, ids: Sequence[int]) -> str: ...


class StreamDecoder:
    """Turns token ids arriving in pieces into text that can be printed at once, decoding only what is new.

    A BPE token can end in the middle of a UTF-8 character, which decodes to U+FFFD until the rest arrives, so
    trailing replacement characters are held back until the next piece (or the end). A push decodes the ids from
    a point where those before it ended on a whole character (later ids cannot change their text), not all the
    ids, so a long stream costs linear time rather than quadratic. That point stays one such push behind the new
    ids because a word tokenizer puts a space between words: the space is new text, which only decoding the word
    before it shows.
    """

    def __init__(self, tokenizer: Decodes, prompt: Sequence[int] = ()) -> None:
        """`prompt`: ids whose text is already printed; new ids are decoded after them."""
        self.tokenizer, self.ids = tokenizer, list(prompt)
        text = tokenizer.decode(self.ids)
        # ids[start:] are decoded at each push, `shown` characters of their text are given; `whole`: where the
        # last push that ended on a whole character ended (or 0), the next window's start
        self.start, self.shown, self.whole = 0, len(text), 0 if text.endswith("\ufffd") else len(self.ids)

    def push(self, ids: Iterable[int], final: bool = False) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids[self.start:])
        stable = text if final else text.rstrip("\ufffd")
        new, self.shown = stable[self.shown:], max(self.shown, len(stable))
        if len(self.ids) > self.whole and not text.endswith("\ufffd"):  # all given: start the window further on
            self.start, self.whole = self.whole, len(self.ids)
            self.shown = len(self.tokenizer.decode(self.ids[self.start:]))
        return new


def until_eot(ids: Iterable[int], eot: int | None) -> list[int]:
    ids = [int(i) for i in ids]
    return ids[: ids.index(eot)] if eot is not None and eot in ids else ids


def first_stop(text: str, stops: Sequence[str], new_from: int = 0) -> int | None:
    """Where the earliest occurrence of any stop string begins in `text`, or None. With `new_from`, the text before
    it is known to hold none, so only occurrences that reach past it are looked for."""
    found = [i for stop in stops if (i := text.find(stop, max(new_from - len(stop) + 1, 0))) >= 0]
    return min(found) if found else None


def held_back(stops: Sequence[str]) -> int:
    """How many characters at the end of streamed text wait for the next piece: a stop string may straddle two
    pieces, so the last len(longest stop) - 1 characters may begin one."""
    return max((len(s) for s in stops), default=1) - 1


class StopFilter:
    """Streamed text cut just before the first stop string.

    The last `held_back(stops)` characters wait until the next chunk shows whether they begin a stop string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops, self.text, self.shown, self.stopped = list(stops), "", 0, False
        self.hold = held_back(self.stops)

    def push(self, new: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        self.text += new
        cut = first_stop(self.text, self.stops)
        self.stopped = cut is not None
        end = cut if cut is not None else len(self.text) if final else max(self.shown, len(self.text) - self.hold)
        out, self.shown = self.text[self.shown:end], max(self.shown, end)
        return out


def print_stream(tokens: Iterable[np.ndarray], tokenizer: Tokenizer, text: str, stops: Sequence[str],
                 prompt: Sequence[int] = ()) -> None:
    """One sample, printed as its chunks of tokens arrive; stops generating at a stop string."""
    out, cut = StreamDecoder(tokenizer, prompt), StopFilter(stops)
    print(text, end="", flush=True)
    for chunk_BN in tokens:
        print(cut.push(out.push(until_eot(chunk_BN[0], tokenizer.eot_token))), end="", flush=True)
        if cut.stopped:
            break
    print(cut.push(out.push([], final=True), final=True))
