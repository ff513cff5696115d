"""When a request ends before max_new_tokens: at a stop token (kept as the last token), or where the text
first contains a stop string (the output ends just before it, even inside a run of accepted guesses). A
stop string that is a special token's text also stops at that token, kept as stop tokens are."""

import functools
import reprlib

from ..loading.tokenizer import IncrementalDecoder


class Stop:
    def __init__(self, token_ids, strings=(), tokenizer=None):
        self.strings = list(strings)
        if any(not isinstance(s, str) or not s for s in self.strings):
            raise ValueError(f"stop strings must be non-empty strings, got {reprlib.repr(strings)}")
        if self.strings and tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer files, to read the text")
        self.token_ids = set(token_ids) | (special_token_stops(tokenizer, self.strings) if self.strings else set())
        self.text = IncrementalDecoder(tokenizer) if self.strings else None
        self.text_end = None  # where the text ends when a stop string ended it
        self.partial = [PartialMatch(s) for s in self.strings]

    def cut(self, tokens):
        """A step's new tokens up to the first stop, and whether the request stops there."""
        for i, token in enumerate(tokens):
            if token in self.token_ids or self.text is not None and self.completes_a_string(token):
                return tokens[: i + 1], True
        return tokens, False

    def completes_a_string(self, token):
        """Does the text, with this token, contain a stop string? Only its new end is searched."""
        start = max(len(self.text.text) - max(map(len, self.strings)), 0)
        self.text.push([token])
        found = [i for i in (self.text.text.find(s, start) for s in self.strings) if i >= 0]
        if found:
            self.text_end = min(found)
        return bool(found)

    def held_back(self, text):
        """How much of the end of `text` could still start a stop string: a stream holds it back."""
        return max((partial.length(text) for partial in self.partial), default=0)


def special_token_stops(tokenizer, strings):
    """The ids of the special tokens that are stop strings; a stop string holding one's text among other
    text could never match (special tokens decode to nothing), so it is refused."""
    specials = {tokenizer.added[i]["content"]: i for i in tokenizer.special_ids}
    for string in strings:
        inside = None if string in specials else next((content for content in specials if content in string), None)
        if inside is not None:
            raise ValueError(f"stop string {reprlib.repr(string)} holds the special token {inside!r}, whose text "
                             f"is not in the output; stop at {inside!r} alone")
    return {specials[s] for s in strings if s in specials}


class PartialMatch:
    """The longest end of a growing text that is a proper prefix of `string`, followed as the text grows
    (Knuth-Morris-Pratt): O(1) amortized a character, where a long stop string would cost minutes a token."""

    def __init__(self, string):
        self.string = string
        self.text, self.matched = "", 0  # the text followed so far, and the answer for it

    @functools.cached_property
    def borders(self):
        """borders[n]: the longest proper prefix of string[:n] that is also its suffix."""
        borders, k = [0] * (len(self.string) + 1), 0
        for i in range(1, len(self.string)):
            k = borders[i + 1] = self.matched_after(k, self.string[i], borders)
        return borders

    def matched_after(self, k, char, borders):
        """How much of the string a matched prefix of length k followed by `char` leaves matched."""
        while k and char != self.string[k]:
            k = borders[k]
        return k + 1 if char == self.string[k] else k

    def length(self, text):
        """The length of the longest end of `text` that is a proper prefix of the string."""
        string, borders = self.string, self.borders
        start, k = (len(self.text), self.matched) if text.startswith(self.text) else (0, 0)
        if len(text) - start >= len(string):  # only the last len(string) - 1 characters can matter
            start, k = len(text) - len(string) + 1, 0
        for char in text[start:]:
            k = self.matched_after(k, char, borders)
            if k == len(string):  # the whole string: what of it is still a prefix
                k = borders[k]
        self.text, self.matched = text, k
        return k
