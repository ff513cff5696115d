"""minispec.decoding.stopping on its own, with a byte-level tokenizer of one token per byte: how much
text a stream holds back, at what cost, and stop strings that are special tokens' text. (Stops in
generate and stream, with models: tests/test_api.py.)"""

import random
import time

import pytest

from minispec.decoding.stopping import Stop
from minispec.loading.tokenizer import ByteLevelBPE, IncrementalDecoder
from test_tokenizer import bytes_to_unicode

SPECIAL, PLAIN = 256, 258  # ids of "<|im_end|>" (special) and "<tool>" (an added token that is not)


@pytest.fixture(scope="module")
def tokenizer():
    added = [{"id": 256, "content": "<|im_end|>", "special": True}, {"id": 257, "content": "<|im_start|>", "special": True},
             {"id": 258, "content": "<tool>", "special": False}]
    spec = {"model": {"type": "BPE", "vocab": {char: byte for byte, char in bytes_to_unicode().items()}, "merges": []},
            "pre_tokenizer": {"type": "ByteLevel"}, "added_tokens": added}
    return ByteLevelBPE(spec, {"eos_token": "<|im_end|>"}, None)


def brute_force_held_back(strings, text):
    return max((n for s in strings for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def test_held_back_is_the_longest_end_that_may_begin_a_stop_string(tokenizer):
    rng = random.Random(0)
    for _ in range(300):
        strings = ["".join(rng.choices("ab", k=rng.randint(1, 8))) for _ in range(rng.randint(1, 3))]
        stop, text = Stop([], strings, tokenizer), ""
        for _ in range(rng.randint(1, 12)):
            text += "".join(rng.choices("ab", k=rng.randint(0, 5)))  # as a stream's text grows
            assert stop.held_back(text) == brute_force_held_back(strings, text), (strings, text)
        other = "".join(rng.choices("ab", k=rng.randint(0, 20)))  # a text that is no continuation
        assert stop.held_back(other) == brute_force_held_back(strings, other), (strings, other)


def test_held_back_stays_fast_for_a_long_stop_string(tokenizer):
    """Trying every prefix of a 100k-character stop string against the text's end took 0.6 s per token
    (two minutes for these 200); following the partial match costs each character O(1)."""
    stop_string = "ab" * 50_000
    stop, text = Stop([], [stop_string], tokenizer), IncrementalDecoder(tokenizer)
    deadline = time.perf_counter() + 3
    for token in tokenizer.encode("ab" * 100, add_special_tokens=False):
        assert stop.cut([token]) == ([token], False)
        text.push([token])
        assert stop.held_back(text.text) == len(text.text)  # all of it may begin the stop string
        assert time.perf_counter() < deadline


def test_a_stop_string_that_is_a_special_token_stops_at_it(tokenizer):
    """Special tokens decode to no text: the string is matched as the token, which is kept as a stop token."""
    tokens = tokenizer.encode("ab", add_special_tokens=False) + [SPECIAL] + tokenizer.encode("cd", add_special_tokens=False)
    stop = Stop([], ["<|im_end|>"], tokenizer)
    assert stop.cut(tokens) == (tokens[:3], True)
    assert stop.text_end is None and stop.text.text == "ab"
    # The same characters written out as ordinary tokens are matched as text, and cut off.
    written = tokenizer.encode("ab<|im_end|>cd", add_special_tokens=False, split_special_tokens=True)
    stop = Stop([], ["<|im_end|>"], tokenizer)
    assert stop.cut(written) == (written[:12], True)
    assert stop.text.text[:stop.text_end] == "ab"


def test_a_stop_string_holding_a_special_token_among_other_text_is_refused(tokenizer):
    with pytest.raises(ValueError, match=r"stop string '\\n<\|im_end\|>' holds the special token '<\|im_end\|>'"):
        Stop([], ["no such text", "\n<|im_end|>"], tokenizer)
    # An added token that is not special decodes to its text: it is matched as text.
    tokens = tokenizer.encode("x<tool>y", add_special_tokens=False)
    assert PLAIN in tokens
    stop = Stop([], ["x<tool>"], tokenizer)
    assert stop.cut(tokens) == (tokens[:2], True) and stop.text_end == 0
