"""models/checks: the one check of a value from outside, and its one message form."""

import math

import pytest

from minispec.models.checks import COUNT, FLAG, NUMBER, SettingError, check, is_integer, is_number


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None])
def test_a_bool_or_a_float_is_no_integer(value):
    assert not is_integer(value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, "1", None])
def test_nan_infinities_and_bools_are_no_number(value):
    assert not is_number(value) and not NUMBER.test(value)


def test_one_message_form_naming_the_key_and_the_value():
    with pytest.raises(SettingError, match=r"^GGUF metadata n must be an integer from 1 to 2\^31 - 1, got True$") as error:
        check({"n": True}, "n", COUNT, where="GGUF metadata ")
    assert error.value.field == "GGUF metadata n"
    with pytest.raises(SettingError, match=r"^model\.vocab is missing$"):
        check({}, "vocab", COUNT, where="model.")


def test_null_is_the_default_but_never_a_required_value():
    assert check({"flag": None}, "flag", FLAG, True) is True and check({}, "flag", FLAG, False) is False
    with pytest.raises(SettingError, match="^flag must be true or false, got None$"):
        check({"flag": None}, "flag", FLAG)
