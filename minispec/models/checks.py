"""The one check of a value from outside (config.json, GGUF metadata, tokenizer files, settings, HTTP bodies):
a kind (Check) is a test and the rule its error states, and a refusal is one line, "{where}{name} {rule}, got
{value}", raised as a SettingError naming the field, before a wrong value can build a model wrong or exhaust memory."""

import math
import reprlib
from typing import Callable, NamedTuple

# Weight-only quantization's modes and int4 group sizes (models/quant.py), here free of torch for the command lines.
QUANT_MODES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32  # GGUF's Q4 group; 64 runs as fast here but is less accurate

REQUIRED = object()  # check()'s default for the keys a mapping must have


class SettingError(ValueError):
    """A value refused before any work; `field` names it (a setting, a request's field, a config key), so that
    callers name it without reading the message."""

    def __init__(self, field, message):
        super().__init__(message)
        self.field = field


def is_integer(value):
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is no token 1, no count 1


def is_number(value):
    """A finite int or float: NaN, infinities (JSON's 1e999 parses as one) and bools are no one's number."""
    return (is_integer(value) or isinstance(value, float)) and math.isfinite(value)


def is_text(value):
    """A string that is text: lone surrogates (undecodable bytes, or a JSON escape) cannot be encoded."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def integer(low, high=math.inf):
    return lambda value: is_integer(value) and low <= value <= high


class Check(NamedTuple):
    """A kind of value: its test, and the rule its error states."""
    test: Callable
    rule: str

    def __call__(self, name, value):
        if not self.test(value):
            raise SettingError(name, f"{name} {self.rule}, got {reprlib.repr(value)}")
        return value


def check(mapping, key, kind, default=REQUIRED, where=""):
    """mapping[key] checked to be `kind`, named `{where}{key}`; absent or null: `default`, unless REQUIRED."""
    value = mapping.get(key)
    if value is None and default is not REQUIRED:
        return default
    if key not in mapping:
        raise SettingError(f"{where}{key}", f"{where}{key} is missing")
    return kind(f"{where}{key}", value)


def list_of(kind, what):
    return Check(lambda v: isinstance(v, list) and all(map(kind.test, v)), f"must be a list of {what}")


# 2^31 bounds sizes and ids far beyond any real model's, and keeps products of them (a weight's element
# count) within torch's 64-bit sizes.
COUNT = Check(integer(1, 2**31 - 1), "must be an integer from 1 to 2^31 - 1")
INDEX = Check(integer(0, 2**31 - 1), "must be an integer from 0 to 2^31 - 1")
POSITIVE = Check(lambda v: is_number(v) and v > 0, "must be a positive finite number")
INTEGER = Check(is_integer, "must be an integer")
NUMBER = Check(is_number, "must be a number")  # NaN and the infinities are none
FLAG = Check(lambda v: isinstance(v, bool), "must be true or false")
TEXT = Check(lambda v: isinstance(v, str), "must be a string")
TABLE = Check(lambda v: isinstance(v, dict), "must be an object")
LIST = Check(lambda v: isinstance(v, list), "must be a list")
TEXTS = list_of(TEXT, "strings")
THETA = Check(lambda v: is_number(v) and v > 1, "must be a number above 1")  # a RoPE base: yarn divides by its log
LAYER_TYPES = Check(lambda v: isinstance(v, list) and all(t in ("full_attention", "sliding_attention") for t in v),
                    "must be a list of 'full_attention' and 'sliding_attention'")
TOKEN_IDS = Check(lambda v: INDEX.test(v) or isinstance(v, list) and all(map(INDEX.test, v)),
                  "must be a token id (an integer from 0 to 2^31 - 1) or a list of them")
