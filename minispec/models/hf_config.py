"""Values read from a checkpoint's config.json, checked before a model is built from them: a wrong type
or an absurd size is a one-line error naming the key and the value, rather than a traceback from deep
inside a layer, a model silently built wrong, or memory exhausted building it."""

import math
import reprlib

REQUIRED = object()  # get()'s default for the keys a config must have


def is_int(value):  # JSON's true and false arrive as bools, which Python counts as ints
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value):  # JSON also has NaN and Infinity
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


# (test, what the error says was wanted). 2^31 bounds sizes and ids far beyond any real model's, and
# keeps products of them (a weight's element count) within torch's 64-bit sizes.
COUNT = (lambda v: is_int(v) and 0 < v < 2**31, "an integer from 1 to 2^31 - 1")
INDEX = (lambda v: is_int(v) and 0 <= v < 2**31, "an integer from 0 to 2^31 - 1")
POSITIVE = (lambda v: is_number(v) and v > 0, "a positive number")
NUMBER = (is_number, "a finite number")
FLAG = (lambda v: isinstance(v, bool), "true or false")
TEXT = (lambda v: isinstance(v, str), "a string")
TABLE = (lambda v: isinstance(v, dict), "a JSON object")
TOKEN_IDS = (lambda v: INDEX[0](v) or isinstance(v, list) and all(map(INDEX[0], v)),
             "a token id (an integer from 0 to 2^31 - 1) or a list of them")


def get(hf, key, kind, default=REQUIRED, name=None):
    """hf[key], or a ValueError naming the key (as `name`, if given) and the value when `kind` refuses
    it. An absent or null key gives `default`, or a KeyError if it is REQUIRED."""
    value = hf.get(key)
    if value is None:
        if default is REQUIRED:
            raise KeyError(key)
        return default
    test, wanted = kind
    if not test(value):
        raise ValueError(f"{name or key} is {reprlib.repr(value)}, not {wanted}")
    return value
