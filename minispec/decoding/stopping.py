"""When a request ends before max_new_tokens: at a stop token (the model's EOS, or the caller's
stop_token_ids), which is kept as the last token, or where the text first contains a stop string,
which is not: the output ends just before it, and no token after the one completing it is emitted,
even when that token sits inside a run of accepted guesses."""

from ..loading.tokenizer import IncrementalDecoder


class Stop:
    def __init__(self, token_ids, strings=(), tokenizer=None):
        self.token_ids = set(token_ids)
        self.strings = [s for s in strings]
        if any(not isinstance(s, str) or not s for s in self.strings):
            raise ValueError(f"stop strings must be non-empty strings, got {strings!r}")
        if self.strings and tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer files, to read the text")
        self.text = IncrementalDecoder(tokenizer) if self.strings else None
        self.text_end = None  # where the text ends when a stop string ended it

    def cut(self, tokens):
        """A step's new tokens up to the first stop, and whether the request stops there."""
        for i, token in enumerate(tokens):
            if token in self.token_ids:
                return tokens[: i + 1], True
            if self.text is not None and self.completes_a_string(token):
                return tokens[: i + 1], True
        return tokens, False

    def completes_a_string(self, token):
        """Does the text, with this token, contain a stop string? Only its new end is searched: a string
        found there ends within the token's text or the few characters before it."""
        start = max(len(self.text.text) - max(map(len, self.strings)), 0)
        self.text.push([token])
        found = [i for i in (self.text.text.find(s, start) for s in self.strings) if i >= 0]
        if found:
            self.text_end = min(found)
        return bool(found)

    def held_back(self, text):
        """How much of the end of `text` could still turn out to start a stop string: a stream holds
        it back until the next tokens tell."""
        return max((n for s in self.strings for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
