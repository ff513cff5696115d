"""The settings of a generate() or stream() call, one list from which run.py's flags and the server's
fields are made. Free of torch, so that the command lines build and check their flags before loading it."""

import argparse
import json
from dataclasses import dataclass, field, fields

from .models.checks import Check, SettingError, integer, is_integer, is_number, is_text

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the dtypes a model loads in (loading/weights.py's DTYPES)
GAMMA_MAX = 16  # "auto" chooses among 0..GAMMA_MAX guesses: chains copied from a prompt or earlier text run long
TREE_MAX = 64  # the most guesses a step's token tree may hold (decoding/tree.py)
# Below this a temperature is refused, not rounded to greedy: dividing logits by it overflows towards
# 1e-38 (every token id 0), and well above that sampling is already greedy but for float ties.
TEMPERATURE_MIN = 1e-5
TEMPERATURE = Check(lambda v: is_number(v) and (v == 0 or v >= TEMPERATURE_MIN),
                    f"must be a number >= 0 (0 = greedy; else at least {TEMPERATURE_MIN:g})")
TOP_K = Check(integer(0), "must be an integer >= 0 (0 = off)")
TOP_P = Check(lambda v: is_number(v) and 0 < v <= 1, "must be a number in (0, 1]")
MIN_P = Check(lambda v: is_number(v) and 0 <= v <= 1, "must be a number in [0, 1] (0 = off)")
PENALTY = Check(lambda v: is_number(v) and -2 <= v <= 2, "must be a number in [-2, 2] (0 = off)")
# Logits are divided or multiplied by it in float32: past these bounds a logit becomes infinite (NaN once sampled).
REPETITION_PENALTY = Check(lambda v: is_number(v) and 0.01 <= v <= 100, "must be a number in [0.01, 100] (1 = off)")
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
GAMMA_LIMIT = 64  # a fixed γ's bound: a step verifies γ + 1 positions in one forward; no acceptance pays more
LOGPROBS_MAX = 20  # the most alternatives a token's log-probabilities list (OpenAI's bound)
N_MAX = 32  # the most answers of one prompt (n; the server's best_of): each is a cache row
# The settings beam search cannot honour (at other than their defaults), and why.
NO_BEAMS = {**{name: "beam search scores the model's own log-probabilities" for name in PENALTIES},
            "logprobs": "beam search reports its sequences' scores",
            "n": "beam search returns its hypotheses: sequences",
            "on_states": "beam search keeps no one sequence of states"}


def setting(value, check, help=None, **flag):
    """A Settings field: its default value, its check (a Check; None: checked where it is used), and
    run.py's flag for it: its help (None: no flag) and argparse options (its default: the field's)."""
    return field(default=value, metadata={"check": check, "help": help, "flag": flag})


def flag_type(parse, expected, explain=False):
    """An argparse type: parse(text), or argparse's one-line error saying what was expected."""
    def convert(text):
        try:
            return parse(text)
        except ValueError as error:
            why = f" ({error})" if explain else ""
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}{why}") from None
    return convert


# --gamma: "auto" or a number of guesses per step; --tree: "auto", "off" (None: chains) or a node budget
gamma_setting = flag_type(lambda text: text if text == "auto" else int(text), "'auto' or an integer")
tree_setting = flag_type(lambda text: None if text == "off" else text if text == "auto" else int(text),
                         "'auto', 'off' or an integer")
token_ids = flag_type(lambda text: [int(x) for x in text.split(",") if x.strip()], "comma-separated integers")
grammar_setting = flag_type(json.loads, "a JSON object", explain=True)  # --grammar, as Settings.grammar takes it


GRAMMARS = ("json_schema", "regex", "grammar")  # Settings.grammar's kinds beside OpenAI's response_format


def is_grammar(value):
    """{kind: text} of a GRAMMARS kind (a JSON Schema also as an object), or OpenAI's response_format."""
    if not isinstance(value, dict) or len(value) != 1 and "type" not in value:
        return False
    if "type" in value:
        kind = value["type"]
        return kind in ("text", "json_object") and len(value) == 1 or kind == "json_schema" and set(value) <= {
            "type", "json_schema"} and isinstance(value.get("json_schema"), dict)
    (kind, text), = value.items()
    return kind in GRAMMARS and (is_text(text) or kind == "json_schema" and isinstance(text, dict))


def optional(test):
    return lambda value: value is None or test(value)


def is_word(value, *words):
    return isinstance(value, str) and value in words


@dataclass(frozen=True)
class Settings:
    """The settings of a generate() or stream() call: the one list, each with its default, its check and its
    help, from which run.py's flags and the server's fields are made. Checked once, before any work (SettingError
    names a bad one)."""
    draft: object = setting(None, None)  # a model or a drafter's name: run.py's --draft loads it
    gamma: object = setting("auto", Check(lambda v: is_word(v, "auto") or integer(1, GAMMA_LIMIT)(v), "(draft "
                                          f"tokens per step) must be 'auto' or an integer in [1, {GAMMA_LIMIT}]"),
                            "draft tokens guessed per target call, or 'auto' (the default): chosen before each "
                            f"step, 0 to {GAMMA_MAX}, from the pair's costs measured on this machine and its "
                            "acceptance rate", type=gamma_setting)
    max_new_tokens: int = setting(64, Check(integer(1), "must be an integer >= 1"),
                                  "the most tokens generated (fewer where EOS or a stop comes first)", type=int)
    temperature: float = setting(0.0, TEMPERATURE, "0 (the default) is greedy", type=float)
    top_k: int = setting(0, TOP_K, "keep the k most likely tokens (0: all)", type=int)
    top_p: float = setting(1.0, TOP_P, "nucleus sampling mass (1: all)", type=float)
    min_p: float = setting(0.0, MIN_P, "drop tokens less likely than this times the most likely one (0: off)",
                           type=float)
    presence_penalty: float = setting(0.0, PENALTY, "subtract this from the logit of every token generated before "
                                      "(OpenAI's; 0: off)", type=float)
    frequency_penalty: float = setting(0.0, PENALTY, "subtract this from a token's logit once per time it was "
                                       "generated (OpenAI's; 0: off)", type=float)
    repetition_penalty: float = setting(1.0, REPETITION_PENALTY, "divide the positive logits of tokens in the prompt "
                                        "or output by this, multiply the negative ones (1: off)", type=float)
    seed: int | None = setting(None, Check(optional(integer(0, 2**63 - 1)), "must be an integer in [0, 2**63) or None"),
                               "the seed of sampling's random draws (the command line's default: 0)", type=int,
                               default=0)
    coupling: str = setting("gumbel", Check(lambda v: is_word(v, "gumbel", "rejection"), "must be 'gumbel' or "
                            "'rejection'"), "sampled verification, both exact: 'gumbel' (the default): a seed gives "
                            "the same output with any draft, gamma, tree or batch; 'rejection': Algorithm 1's test",
                            choices=("gumbel", "rejection"))
    lenience: float = setting(1.0, Check(lambda v: is_number(v) and 0 < v <= 1, "must be in (0, 1]"),
                              "accept drafts more easily (paper A.5); 1 keeps the target's exact distribution",
                              type=float)
    ignore_eos: bool = setting(False, Check(lambda v: isinstance(v, bool), "must be True or False"),
                               "always generate --max-new-tokens tokens", action="store_true")
    beams: int = setting(1, Check(integer(1), "(the beam width w) must be an integer >= 1"),
                         "beam search of this width w (1: no beam search); with --draft, speculative beam search "
                         "(paper A.4) with the same result", type=int)
    draft_beams: int | None = setting(None, Check(optional(integer(1)), "(the draft's beam width u) must be an "
                                                  "integer >= 1 or None"),
                                      "the draft's beam width u >= w in speculative beam search (default: --beams)",
                                      type=int)
    stop: object = setting(None, Check(optional(lambda v: is_text(v) or isinstance(v, (list, tuple)) and all(
                               is_text(s) for s in v)), "must be a string or a list of strings"),
                           "end the output just before this text (repeat the flag for several)", action="append",
                           metavar="TEXT")
    stop_token_ids: object = setting(None, Check(optional(lambda v: isinstance(v, (list, tuple)) and all(
                                         integer(0)(token) for token in v)), "must be a list of token ids"),
                                     "comma-separated token ids that end the output as EOS does", type=token_ids,
                                     metavar="IDS")
    tree: object = setting("auto", Check(lambda v: v is None or is_word(v, "auto", "off") or integer(1, TREE_MAX)(v),
                                         "(the most guesses a step's token tree holds) must be 'auto', 'off' or an "
                                         f"integer in [1, {TREE_MAX}] (None: 'off')"),
                           "verify a token tree of up to N guesses per target call instead of a chain (any --draft: "
                           "ngram, lookup, suffix, a model, int8/int4 or a head folder); 'auto' (the default; with "
                           "--gamma auto): a tree or a chain each step, whichever is expected to be faster; 'off': "
                           "chains",
                           type=tree_setting, metavar="off|auto|N")
    n: int = setting(1, Check(integer(1, N_MAX), f"(answers of each prompt) must be an integer in [1, {N_MAX}]"),
                     "this many sampled answers of the prompt, decoded together, each with its own seed (--json)",
                     type=int)
    logprobs: int | None = setting(None, Check(optional(integer(0, LOGPROBS_MAX)), "must be None or an integer in "
                                               f"[0, {LOGPROBS_MAX}] (the alternatives listed per token)"),
                                   "report each token's log-probability and its N most likely alternatives (--json)",
                                   type=int, metavar="N")
    grammar: object = setting(None, Check(optional(is_grammar), "must be None, {kind: text} with kind one of "
                                          f"{', '.join(GRAMMARS)} (a JSON Schema also as an object), or OpenAI's "
                                          "response_format ({'type': 'text' | 'json_object' | 'json_schema', ...})"),
                              "constrain the output: a JSON object {\"json_schema\": SCHEMA}, {\"regex\": \"...\"}, "
                              "{\"grammar\": \"Lark or GBNF\"} or OpenAI's response_format (needs minispec[grammar])",
                              type=grammar_setting, metavar="JSON")
    on_states: object = setting(None, Check(optional(callable), "must be a function (i, tokens, states)"))
    state_layers: object = setting(None, None)  # checked against the target (state_layers_of)

    def __post_init__(self):
        for spec in fields(self):
            if spec.metadata["check"] is not None:
                spec.metadata["check"](spec.name, getattr(self, spec.name))
        if is_integer(self.tree) and not self.drafting:
            raise SettingError("tree", f"token trees need a drafter ('ngram', 'lookup', 'suffix', a draft model, "
                                       f"'int8' / 'int4' or a draft head), not {self.draft!r}")
        if is_integer(self.tree) and (self.lenience != 1 or self.searching):
            raise SettingError("tree", "token trees are verified exactly (lenience=1), without beams")
        if self.searching and self.stop:
            raise SettingError("stop", "beam search cannot stop at stop strings (its hypotheses end in stop tokens); "
                                       "use stop_token_ids")
        if self.on_states is None and self.state_layers is not None:
            raise SettingError("state_layers", "state_layers says which states on_states receives: give on_states too")
        if self.grammar is not None and (self.searching or self.ignore_eos):
            raise SettingError("grammar", "a grammar needs decoding without beams, ending at EOS (not ignore_eos)")
        given = next((name for name in NO_BEAMS if getattr(self, name) != getattr(Settings, name)), None)
        if given is not None and self.searching:
            raise SettingError(given, f"{given} needs decoding without beams ({NO_BEAMS[given]})")

    @classmethod
    def of(cls, caller, settings):
        """Settings from a call's keywords; one it does not know is named (a TypeError, as Python's)."""
        unknown = next((name for name in settings if name not in SETTING_CHECKS), None)
        if unknown is not None:
            raise TypeError(f"{caller}() got an unknown setting {unknown!r}; the settings are "
                            f"{', '.join(SETTING_CHECKS)}")
        return cls(**settings)

    @property
    def trees(self):
        """A request's token trees: a node budget, "auto" (the policy's choice per step, where trees can
        be verified: with a drafter, exactly, without beams), or None (chains)."""
        if self.tree == "auto":
            return "auto" if self.drafting and self.lenience == 1 and not self.searching else None
        return None if self.tree == "off" else self.tree

    @property
    def drafting(self):
        return self.draft is not None and not (isinstance(self.draft, str) and self.draft == "none")

    @property
    def searching(self):
        return self.beams != 1 or self.draft_beams is not None


SETTING_CHECKS = {spec.name: spec.metadata["check"] for spec in fields(Settings)}
