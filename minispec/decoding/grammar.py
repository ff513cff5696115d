"""Structured output (a JSON Schema, regex, Lark or GBNF grammar, or OpenAI's response_format) through the
optional llguidance: tokens the grammar forbids after a position's path get -inf logits (a forbidden guess
has p = 0), a draft's q is masked alike, and tokens the grammar forces are the step's guesses.
"""

import json
import re
import weakref

import torch

from ..models.checks import SettingError

TOKENIZERS = weakref.WeakKeyDictionary()  # target -> its tokenizer as llguidance's, built once (it reads every token)
BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte token
ALLOWED = bytes.maketrans(bytes(range(256)), bytes(1) + bytes([1]) * 255)  # compute_logit_bias' 0 or 200 -> 0 or 1


def engine():
    try:
        import llguidance  # the grammar engine: an optional extra, read only when a request has a grammar
    except ImportError:
        raise SettingError("grammar", "grammars need the llguidance package: pip install 'minispec[grammar]'") from None
    return llguidance


def grammar_text(spec):
    """Settings.grammar -> the llguidance grammar, or None (plain text)."""
    kind = spec.get("type")
    if kind == "text":
        return None
    if kind is not None:  # OpenAI's response_format: json_object is any object, a json_schema without schema any JSON
        spec = {"json_schema": {"type": "object"} if kind == "json_object" else spec["json_schema"].get("schema", {})}
    (kind, value), = spec.items()
    try:
        return engine().grammar_from(kind, value if isinstance(value, str) else json.dumps(value))
    except (ValueError, TypeError) as error:
        raise SettingError("grammar", f"grammar: {one_line(error)}") from None


def compile_grammar(spec, target):
    """A request's grammar checked against the target: a fresh Matcher, or None for plain text."""
    text = grammar_text(spec) if spec is not None else None
    if text is None:
        return None
    if target.tokenizer is None or not target.eos_token_ids:
        raise SettingError("grammar", f"a grammar needs a tokenizer and an EOS token; {target.name} lacks one")
    llguidance = engine()
    if target not in TOKENIZERS:  # the grammar ends at any of the target's EOS tokens
        source = wrapped(target.tokenizer, target.vocab_size, target.eos_token_ids[0])
        TOKENIZERS[target] = llguidance.LLTokenizer(llguidance.TokenizerWrapper(source), n_vocab=target.vocab_size,
                                                    eos_token=list(target.eos_token_ids))
    matcher = llguidance.LLMatcher(TOKENIZERS[target], text, log_level=0)
    if matcher.is_error():
        raise SettingError("grammar", f"grammar: {one_line(matcher.get_error())}")
    return Matcher(matcher, target.vocab_size)


def one_line(error):
    return " ".join(str(error).split())


def wrapped(tokenizer, vocab_size, eos):
    """minispec's tokenizer as llguidance's TokenizerWrapper reads one."""
    byte_level = getattr(tokenizer, "tokenizer", None) is not None and '"ByteLevel"' in tokenizer.tokenizer.to_str()
    table = byte_level_table()
    byte_strings = [b""] * vocab_size
    for i, token in tokenizer.id_to_token.items():
        if i < vocab_size:
            byte_strings[i] = token_bytes(token, i in tokenizer.special_ids, i in tokenizer.added, byte_level, table)

    class Source:
        eos_token_id, bos_token_id, tokens = eos, tokenizer.bos_token_id, byte_strings
        special_token_ids = sorted(i for i in tokenizer.special_ids if i < vocab_size)

        def __call__(self, text):
            if byte_level:
                return tokenizer.encode(text, add_special_tokens=False)
            # SentencePiece puts a space before a text's first piece; after a newline (cut off again) it puts none
            newline, ids = (tokenizer.encode(t, add_special_tokens=False) for t in ("\n", "\n" + text))
            return ids[len(newline):] if ids[:len(newline)] == newline else ids

    return Source()


def token_bytes(token, special, added, byte_level, table):
    """A token's bytes, special tokens marked with a leading 0xFF as llguidance reads them."""
    if special:
        return b"\xff" + token.encode()
    if added:
        return token.encode()
    if byte_level and all(c in table for c in token):
        return bytes(table[c] for c in token)
    byte = BYTE.fullmatch(token)
    return bytes([int(byte[1], 16)]) if byte else token.replace("\u2581", " ").encode()


def byte_level_table():
    """Byte-level BPE's characters -> the bytes they stand for."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


class Matcher:
    """A row's grammar state: after the tokens it emitted so far."""

    def __init__(self, matcher, vocab_size):
        self.matcher, self.vocab_size = matcher, vocab_size

    def copy(self):
        """A row's own matcher: a request's may be decoded more than once."""
        return Matcher(self.matcher.deep_copy(), self.vocab_size)

    def mask(self, logits, guesses, parents):
        """logits [m+1, vocab] at a step's root and guesses, -inf where the grammar forbids a token there."""
        rows = [self.allowed_after(path) or b"\1" * self.vocab_size for path in paths(guesses.tolist(), parents)]
        return masked(logits, rows)

    def mask_after(self, logits, guesses):
        """A draft's logits for its next guess after `guesses` this step."""
        allowed = self.allowed_after([int(x) for x in guesses])
        return logits if allowed is None else masked(logits, [allowed])[0]

    def allowed_after(self, path):
        """The tokens the grammar allows after `path` (a byte each, 1 or 0), or None where it forbids the path."""
        if self.matcher.validate_tokens(path) < len(path):
            return None
        self.matcher.consume_tokens(path)
        allowed = self.matcher.compute_logit_bias()[:self.vocab_size].translate(ALLOWED)
        self.matcher.rollback(len(path))
        return allowed

    def valid(self, guesses):
        """How many of a chain's guesses (device tokens) the grammar allows, one after another."""
        return self.matcher.validate_tokens(guesses.tolist())

    def forced(self, most):
        """Up to `most` tokens the grammar forces next (guesses that need no drafter)."""
        return self.matcher.compute_ff_tokens()[:most] if most > 0 else []

    def advance(self, tokens):
        if not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"the grammar refused emitted tokens {tokens}: {self.matcher.get_error()}")


def masked(logits, rows):
    """logits [m, vocab] -> -inf where rows (allowed_after's bytes) hold 0."""
    allowed = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.bool).view(len(rows), -1)
    return torch.where(allowed.to(logits.device), logits, float("-inf"))


def paths(guesses, parents):
    """The guesses before each position of a step: none at its root, then each guess's path."""
    out = [[]]
    for j, parent in enumerate(range(-1, len(guesses) - 1) if parents is None else parents):
        out.append(out[parent + 1] + [guesses[j]])  # out[0]: the root's
    return out
