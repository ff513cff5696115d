"""Tokenizers, handwritten: byte-level BPE read from tokenizer.json (GPT-2, SmolLM, Qwen2, Llama 3)
and SentencePiece models (Llama 1/2, Mistral, T5) run by the sentencepiece library.

Both follow the Hugging Face tokenizers: added/special tokens are cut out of the text first (longest
match first), the rest is normalized, pre-tokenized and split into model tokens, and BOS/EOS are
added around the result (byte-level: as tokenizer.json's post-processor says; SentencePiece: as the
family's convention and tokenizer_config.json say, each stretch of text between added tokens encoded
on its own as Llama's "legacy" tokenizer does).
"""

import functools
import hashlib
import heapq
import itertools
import json
import re
import reprlib
import unicodedata
from pathlib import Path


class UnsupportedTokenizer(ValueError):
    """A tokenizer.json this module cannot reproduce exactly; the message names the component."""


def load_tokenizer(directory, model_type=""):
    """The tokenizer of a checkpoint directory, or None when it has no tokenizer files. `model_type`
    (config.json's) tells a T5 SentencePiece model from others when the file names do not.

    tokenizer.json is used when it describes a byte-level BPE; otherwise (e.g. a SentencePiece-style
    BPE or Unigram tokenizer.json) the SentencePiece model next to it, tokenizer.model or spiece.model.
    A malformed file is a ValueError naming it and the key.
    """
    directory = Path(directory)
    config = read_config(directory)
    chat_template = read_chat_template(directory, config)
    sentencepiece_file = next((directory / n for n in ("tokenizer.model", "spiece.model") if (directory / n).is_file()), None)
    spec_file = directory / "tokenizer.json"
    if spec_file.is_file():
        spec = read_json(spec_file)
        try:
            return ByteLevelBPE(spec, config, chat_template)
        except ValueError as error:
            if not isinstance(error, UnsupportedTokenizer) or sentencepiece_file is None:
                raise type(error)(f"{spec_file}: {error}") from error
        except RecursionError as error:
            raise ValueError(f"{spec_file}: nested too deeply") from error
    if sentencepiece_file is not None:
        t5 = sentencepiece_file.name == "spiece.model" or "T5" in str(config.get("tokenizer_class")) or "t5" in model_type
        return SentencePieceTokenizer(sentencepiece_file, config, chat_template, t5)
    return None


def read_json(path):
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:  # also invalid UTF-8, and integers too long to convert
        raise ValueError(f"{path} is not valid JSON: {error}") from error


REQUIRED = object()
JSON_NAMES = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number",
              bool: "a boolean", type(None): "null"}
MAX_EXTRA_IDS = 1000  # T5's sentinel tokens (<extra_id_N>): 100 in every T5; each is an added token


def expect(value, kinds, name):
    """`value` when it is one of the JSON types `kinds` (a boolean is no integer); otherwise a
    ValueError naming it (its key's path in the file) and what it is."""
    if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):
        return value
    shown = JSON_NAMES.get(type(value), type(value).__name__)
    if not isinstance(value, (dict, list, type(None))):
        shown += f" ({reprlib.repr(value)})"
    raise ValueError(f"{name} is {shown}, not {' or '.join(JSON_NAMES[kind] for kind in kinds)}")


def field(obj, key, kinds, where="", default=REQUIRED):
    """obj[key] (or `default` when absent), which must be one of the JSON types `kinds`; `where` is the
    path of `obj` in its file, for the message."""
    name = f"{where}.{key}" if where else key
    if key not in obj:
        if default is REQUIRED:
            raise ValueError(f"{name} is missing")
        return default
    return expect(obj[key], kinds, name)


def valid_id(value, name):
    """A token id from a tokenizer file: an integer in the reference's range (it stores them as u32)."""
    if not 0 <= expect(value, (int,), name) < 2**32:
        raise ValueError(f"{name} is {value}, not a token id (0 to 2**32 - 1)")
    return value


def read_config(directory):
    """special_tokens_map.json and tokenizer_config.json merged (the latter wins), each value this module
    reads checked."""
    config = {}
    for path in (directory / "special_tokens_map.json", directory / "tokenizer_config.json"):
        part = read_json(path)
        try:
            expect(part, (dict,), "its top level")
            for key in ("bos_token", "eos_token", "pad_token"):
                if isinstance(field(part, key, (str, dict, type(None)), default=None), dict):
                    field(part[key], "content", (str,), key)
            templates = field(part, "chat_template", (str, list, type(None)), default=None)
            for n, template in enumerate(templates if isinstance(templates, list) else []):
                field(expect(template, (dict,), f"chat_template[{n}]"), "name", (str,), f"chat_template[{n}]")
                field(template, "template", (str,), f"chat_template[{n}]")
            for key, token in field(part, "added_tokens_decoder", (dict,), default={}).items():
                if not key.isdecimal():
                    raise ValueError(f"added_tokens_decoder has key {reprlib.repr(key)}, not a token id")
                check_added_token(token, f"added_tokens_decoder.{key}")
            for key in ("add_bos_token", "add_eos_token"):
                field(part, key, (bool, type(None)), default=None)
            if not 0 <= field(part, "extra_ids", (int,), default=0) <= MAX_EXTRA_IDS:
                raise ValueError(f"extra_ids is {part['extra_ids']}, not 0 to {MAX_EXTRA_IDS}")
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from error
        config |= part
    return config


def check_added_token(token, where):
    """An added token as tokenizer.json and tokenizer_config.json store it: {content, special, lstrip ...}."""
    content = field(expect(token, (dict,), where), "content", (str,), where)
    if not content:  # it would match everywhere
        raise ValueError(f"{where}.content is empty")
    for flag in ("special", "lstrip", "rstrip", "normalized", "single_word"):
        field(token, flag, (bool,), where, None)
    return content


def read_chat_template(directory, config):
    """chat_template.jinja (newer transformers) or tokenizer_config.json's "chat_template" (a string, or a
    list of named templates of which "default" is the one applied), or None."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{jinja} is not UTF-8 text: {error}") from error
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def token_content(value):
    """A special token as tokenizer_config.json stores it: a string, an AddedToken dict, or null."""
    return value.get("content") if isinstance(value, dict) else value


# --- Unicode classes -----------------------------------------------------------------------------
# tokenizer.json regexes are Oniguruma patterns: \p{L}, \p{N} ... do not exist in Python's `re`, and
# \s means a slightly different set there (Python's also has U+001C..U+001F). They become explicit
# code point ranges, so that `re` matches what the reference matches (for every character that
# Python's Unicode database knows: the reference's may be a newer Unicode version).

ONIG_SHORTHANDS = {  # Oniguruma's Unicode definitions: (general categories, extra code point ranges)
    "s": (("Zs", "Zl", "Zp"), [(0x09, 0x0D), (0x85, 0x85)]),
}


@functools.cache
def category_ranges():
    """{general category: [(first, last) code point runs]} over all of Unicode, computed once."""
    ranges, start = {}, 0
    for category, run in itertools.groupby(map(unicodedata.category, map(chr, range(0x110000)))):
        length = sum(1 for _ in run)
        ranges.setdefault(category, []).append((start, start + length - 1))
        start += length
    return ranges


@functools.cache
def char_class(name, negated):
    """Body of a `re` character class (no brackets) for \\p{name} or a shorthand like \\s."""
    if name in ONIG_SHORTHANDS:
        categories, ranges = ONIG_SHORTHANDS[name]
    else:
        categories, ranges = [c for c in category_ranges() if c.startswith(name)], []
        if len(name) > 2 or not categories:
            raise UnsupportedTokenizer(f"unknown Unicode property \\p{{{name}}} in a tokenizer regex")
    ranges = sorted(ranges + [r for c in categories for r in category_ranges()[c]])
    merged = []
    for first, last in ranges:
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(last, merged[-1][1]))
        else:
            merged.append((first, last))
    if negated:  # the complement, as ranges too, so it also works inside another class
        bounds = [-1] + [b for r in merged for b in r] + [0x110000]
        merged = [(bounds[i] + 1, bounds[i + 1] - 1) for i in range(0, len(bounds), 2) if bounds[i] + 1 < bounds[i + 1]]
    return "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in merged)


# \d means Unicode decimal digits (Nd) in both; \w differs (Oniguruma's follows the Alphabetic property,
# which Python's unicodedata does not expose), so it is refused rather than matched differently.
CLASS_ESCAPE = re.compile(r"\\(?:([pP])\{(\^?)(\w+)\}|([sSwW]))")


# Python's `re` backtracks with no limit (Oniguruma gives up after 10^7 retries): a repeated group that can
# match the same text in several ways, as "(a+)+$" or "(a|aa)*$", takes time exponential in the text's
# length (15 s for 27 characters). Such a group holds a quantifier or an alternation; real tokenizers'
# patterns (GPT-2's, Llama 3's, Qwen2's, GPT-4o's) repeat only characters and classes, so a pattern with
# one is refused. (Overlapping quantifiers side by side, as in "\s*[\r\n]+", which real patterns have,
# backtrack polynomially at worst.)
REPEATS = ("*", "+", "{")


def translate_regex(pattern):
    """An Oniguruma pattern from tokenizer.json as an equivalent compiled Python `re` pattern."""
    out, i, in_class = [], 0, False
    groups = []  # for each group open at i: does its body so far hold a quantifier or an alternation?
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            escape = CLASS_ESCAPE.match(pattern, i)
            if escape is None:  # any other escape means the same in both
                out.append(pattern[i : i + 2])
                i += 2
                continue
            p, caret, name, shorthand = escape.groups()
            if shorthand in ("w", "W"):
                raise UnsupportedTokenizer(f"\\{shorthand} in tokenizer regex {pattern!r} is not supported")
            negated = (p == "P") != bool(caret) if p else shorthand.isupper()
            body = char_class(name or shorthand.lower(), negated)
            out.append(body if in_class else f"[{body}]")
            i = escape.end()
            continue
        if char == "[":
            if in_class:
                raise UnsupportedTokenizer(f"nested character classes in tokenizer regex {pattern!r}")
            in_class = True
            out.append(pattern[i : i + 2] if pattern.startswith("[^", i) else char)  # so "[^]..." stays a literal "]"
            i += len(out[-1])
            continue
        if char == "]" and in_class:
            in_class = False
        elif not in_class and char == "(":
            groups.append(False)
            if pattern.startswith("(?", i):  # "(?:", "(?i:", "(?!" ...: that "?" is no quantifier
                char = "(?"
        elif not in_class and char == ")" and groups:
            ambiguous = groups.pop()
            if ambiguous and pattern[i + 1 : i + 2] in REPEATS:
                raise UnsupportedTokenizer(f"tokenizer regex {pattern!r} repeats a group holding a quantifier or "
                                           "an alternation, which can take exponential time")
            if groups:
                groups[-1] |= ambiguous
        elif not in_class and char in ("|", "?", *REPEATS) and groups:
            groups[-1] = True
        out.append(char)
        i += len(char)
    try:
        return re.compile("".join(out))
    except re.error as error:
        raise UnsupportedTokenizer(f"tokenizer regex {pattern!r} does not translate to Python: {error}") from error


# --- Splitting text ------------------------------------------------------------------------------

MERGE_RULES = {  # tokenizers' SplitDelimiterBehavior (besides Isolated, Removed): when a piece joins the one before
    "MergedWithPrevious": lambda is_match, previous_match: is_match and not previous_match,
    "MergedWithNext": lambda is_match, previous_match: previous_match and not is_match,
    "Contiguous": lambda is_match, previous_match: is_match == previous_match,
}


def split(regex, text, behavior="Isolated", invert=False):
    """Cut `text` at the matches of `regex`, keeping or merging the matches as `behavior` says."""
    pieces, start = [], 0  # (text, is it a match)
    for match in regex.finditer(text):
        if match.end() > match.start():
            if match.start() > start:
                pieces.append((text[start : match.start()], invert))
            pieces.append((match.group(), not invert))
            start = match.end()
    if start < len(text):
        pieces.append((text[start:], invert))
    if behavior in ("Isolated", "Removed"):
        return [piece for piece, is_match in pieces if not (is_match and behavior == "Removed")]
    out, previous_match = [], False
    for piece, is_match in pieces:
        if out and MERGE_RULES[behavior](is_match, previous_match):
            out[-1] += piece
        else:
            out.append(piece)
        previous_match = is_match
    return out


def added_token_regex(tokens):
    """One regex matching any of the added tokens, longest first, as the reference's leftmost-longest
    search; lstrip/rstrip tokens also swallow the whitespace beside them. Group k is tokens[k - 1]."""
    if not tokens:
        return None
    space = f"[{char_class('s', False)}]*"
    return re.compile("|".join(
        f"({space if t.get('lstrip') else ''}{re.escape(t['content'])}{space if t.get('rstrip') else ''})"
        for t in tokens
    ))


def added_token_matchers(tokens):
    """{split_special_tokens: (regex, tokens)}: what cuts added tokens out of the text, all of them or
    (split_special_tokens=True) only those that are not special."""
    tokens = sorted(tokens, key=lambda t: -len(t["content"]))
    plain = [t for t in tokens if not t.get("special")]
    return {False: (added_token_regex(tokens), tokens), True: (added_token_regex(plain), plain)}


def split_added(text, regex, tokens):
    """Yield (text, None) for stretches of ordinary text and (content, id) for each added token."""
    start = 0
    for match in regex.finditer(text) if regex else ():
        if match.start() > start:
            yield text[start : match.start()], None
        token = tokens[match.lastindex - 1]
        yield token["content"], token["id"]
        start = match.end()
    if start < len(text):
        yield text[start:], None


# --- Tokenizers ----------------------------------------------------------------------------------


class Tokenizer:
    """What minispec needs of a tokenizer. A subclass encodes the text between added tokens
    (`encode_ordinary`) and decodes (`decode`)."""

    def __init__(self, id_to_token, added_tokens, config, chat_template, raw_tokens=None):
        """id_to_token: every id's token string; added_tokens: [{id, content, special, lstrip, rstrip}],
        of which raw_tokens (default: all) are matched in the raw text, before normalization."""
        self.id_to_token = id_to_token
        self.added = {t["id"]: t for t in added_tokens}
        self.special_ids = {t["id"] for t in added_tokens if t.get("special")}
        self.raw_matchers = added_token_matchers(added_tokens if raw_tokens is None else raw_tokens)
        token_to_id = {token: i for i, token in id_to_token.items()}
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            token_to_id.get(token_content(config.get(key))) for key in ("bos_token", "eos_token", "pad_token")
        )
        self.chat_template = chat_template
        self.vocab_size = len(id_to_token)
        mapping = json.dumps(sorted(id_to_token.items()), ensure_ascii=False).encode()
        self.fingerprint = hashlib.sha256(mapping).hexdigest()[:16]
        self.prefix, self.suffix = [], []  # ids that add_special_tokens puts around the text (BOS, EOS)

    def encode(self, text, add_special_tokens=True, split_special_tokens=False):
        """Token ids of `text`. split_special_tokens: special tokens' text in it is encoded as ordinary
        text, not as those tokens (the reference's option of that name), as for text from an untrusted user."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids = []
        for piece, token_id in split_added(text, *self.raw_matchers[split_special_tokens]):
            ids.extend([token_id] if token_id is not None else self.encode_ordinary(piece, split_special_tokens))
        return self.prefix + ids + self.suffix if add_special_tokens else ids

    def encode_ordinary(self, text, split_special_tokens):
        """Token ids of text between added tokens; split_special_tokens as encode's."""
        raise NotImplementedError

    def decode(self, ids, skip_special_tokens=False):
        raise NotImplementedError

    def check_ids(self, ids):
        ids = [int(i) for i in ids]
        unknown = [i for i in ids if i not in self.id_to_token]
        if unknown:
            raise ValueError(f"token id {unknown[0]} is not in the tokenizer's vocabulary ({self.vocab_size} ids)")
        return ids


@functools.cache
def bytes_to_unicode():
    """GPT-2's table byte -> printable character: printable Latin-1 bytes stand for themselves, the
    others (control characters, space ...) for the characters from U+0100 on, so no token holds a space."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(shifted)}}


# The regex of tokenizers' ByteLevel pre-tokenizer (use_regex=true), GPT-2's.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


class ByteLevelBPE(Tokenizer):
    """Byte-level BPE from a tokenizer.json: text -> bytes shown as GPT-2's printable characters ->
    merges applied by rank within each pre-token."""

    def __init__(self, spec, config, chat_template):
        model = field(expect(spec, (dict,), "its top level"), "model", (dict,))
        if model.get("type") != "BPE":
            raise UnsupportedTokenizer(f"model type {model.get('type')!r} is not BPE")
        for option in ("continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
            if model.get(option):
                raise UnsupportedTokenizer(f"BPE option {option} is not byte-level BPE")
        self.vocab = field(model, "vocab", (dict,), "model")
        id_to_token = {i: token for token, i in self.vocab.items() if type(i) is int and 0 <= i < 2**32}
        if len(id_to_token) < len(self.vocab):  # an id that is none, or one given to two tokens
            for token, i in self.vocab.items():
                if id_to_token.get(valid_id(i, f"model.vocab[{reprlib.repr(token)}]")) != token:
                    raise ValueError(f"model.vocab gives id {i} to both {reprlib.repr(token)} and {reprlib.repr(id_to_token[i])}")
        self.ranks = {}
        for rank, merge in enumerate(field(model, "merges", (list,), "model")):
            pair = merge.split(" ") if isinstance(merge, str) else merge  # older files: "a b"
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], str)):
                raise ValueError(f"model.merges[{rank}] is {reprlib.repr(merge)}, not a pair of tokens")
            if pair[0] + pair[1] not in self.vocab:  # the reference refuses such a file too
                raise ValueError(f"model.merges[{rank}] {reprlib.repr(merge)} makes {reprlib.repr(pair[0] + pair[1])}, "
                                 "which is not in model.vocab")
            self.ranks.setdefault(tuple(pair), rank)
        self.ignore_merges = field(model, "ignore_merges", (bool,), "model", False)  # a pre-token in the vocab stays whole
        unk_token = field(model, "unk_token", (str, type(None)), "model", None)
        self.unk_id = self.vocab.get(unk_token) if unk_token else None
        self.normalizers = self.build_normalizers(spec.get("normalizer"), "normalizer")
        self.byte_level = False  # set by a ByteLevel pre-tokenizer, which this class requires
        self.pre_tokenizers = self.build_pre_tokenizers(spec.get("pre_tokenizer"), "pre_tokenizer")
        if not self.byte_level:
            raise UnsupportedTokenizer("BPE without a ByteLevel pre-tokenizer is not byte-level")
        self.byte_decoder = {char: bytes([byte]) for byte, char in bytes_to_unicode().items()}
        added = field(spec, "added_tokens", (list,), default=[])
        for n, token in enumerate(added):
            content = check_added_token(token, f"added_tokens[{n}]")
            i = valid_id(field(token, "id", (int,), f"added_tokens[{n}]"), f"added_tokens[{n}].id")
            if id_to_token.setdefault(i, content) != content:
                raise ValueError(f"added_tokens[{n}] gives id {i} to {reprlib.repr(content)}, "
                                 f"which is {reprlib.repr(id_to_token[i])}'s")
        raw = [t for t in added if not t.get("normalized")]
        super().__init__(id_to_token, added, config, chat_template, raw_tokens=raw)
        self.normalized_matchers = added_token_matchers([t for t in added if t.get("normalized")])
        self.prefix, self.suffix = self.template(spec.get("post_processor"), "post_processor")
        self.bpe = functools.lru_cache(maxsize=1 << 16)(self.bpe)  # words repeat: merge each once

    # Each pipeline step is read from tokenizer.json once into plain functions; `where` is the step's
    # path in the file, for messages.
    def build_normalizers(self, spec, where):
        if spec is None:
            return []
        kind = field(expect(spec, (dict,), where), "type", (str,), where)
        if kind == "Sequence":
            steps = field(spec, "normalizers", (list,), where)
            return [n for k, s in enumerate(steps) for n in self.build_normalizers(s, f"{where}.normalizers[{k}]")]
        if kind in ("NFC", "NFD", "NFKC", "NFKD"):
            return [functools.partial(unicodedata.normalize, kind)]
        raise UnsupportedTokenizer(f"normalizer {kind!r} is not supported")

    def build_pre_tokenizers(self, spec, where):
        if spec is None:
            return []
        kind = field(expect(spec, (dict,), where), "type", (str,), where)
        if kind == "Sequence":
            steps = field(spec, "pretokenizers", (list,), where)
            return [p for k, s in enumerate(steps) for p in self.build_pre_tokenizers(s, f"{where}.pretokenizers[{k}]")]
        if kind == "Split":
            pattern, behavior = field(spec, "pattern", (dict,), where), field(spec, "behavior", (str,), where)
            invert = field(spec, "invert", (bool,), where, False)
            if behavior not in ("Isolated", "Removed", *MERGE_RULES):
                raise UnsupportedTokenizer(f"Split behavior {behavior!r} is not supported")
            if "Regex" in pattern:
                regex = translate_regex(field(pattern, "Regex", (str,), f"{where}.pattern"))
            else:
                regex = re.compile(re.escape(field(pattern, "String", (str,), f"{where}.pattern")))
            return [lambda text: split(regex, text, behavior, invert)]
        if kind == "Digits":  # Rust's char::is_numeric: categories Nd, Nl, No
            individual = field(spec, "individual_digits", (bool,), where, False)
            regex, behavior = translate_regex(r"\p{N}"), "Isolated" if individual else "Contiguous"
            return [lambda text: split(regex, text, behavior)]
        if kind == "ByteLevel":
            self.byte_level = True
            regex = translate_regex(GPT2_PATTERN) if field(spec, "use_regex", (bool,), where, True) else None
            add_prefix_space = field(spec, "add_prefix_space", (bool,), where, False)
            return [functools.partial(self.byte_level_split, regex, add_prefix_space)]
        raise UnsupportedTokenizer(f"pre-tokenizer {kind!r} is not supported")

    def byte_level_split(self, regex, add_prefix_space, text):
        # The prefix space goes before every piece of text, also those after an added token: as the reference.
        if add_prefix_space and not text.startswith(" "):
            text = " " + text
        pieces = split(regex, text) if regex else [text]
        return [piece.encode().decode("latin-1").translate(bytes_to_unicode()) for piece in pieces]

    def template(self, spec, where):
        """(prefix ids, suffix ids) that the post-processor adds around a single sequence."""
        if spec is None:
            return [], []
        kind = field(expect(spec, (dict,), where), "type", (str,), where)
        if kind == "ByteLevel":  # ByteLevel only adjusts offsets
            return [], []
        if kind == "Sequence":
            steps = field(spec, "processors", (list,), where)
            parts = [self.template(s, f"{where}.processors[{k}]") for k, s in enumerate(steps)]
            return [i for p, _ in parts for i in p], [i for _, s in parts for i in s]
        if kind != "TemplateProcessing":
            raise UnsupportedTokenizer(f"post-processor {kind!r} is not supported")
        special_tokens = field(spec, "special_tokens", (dict,), where)
        prefix, suffix, seen_text = [], [], False
        for k, item in enumerate(field(spec, "single", (list,), where)):
            if "Sequence" in expect(item, (dict,), f"{where}.single[{k}]"):
                seen_text = True
                continue
            name = field(field(item, "SpecialToken", (dict,), f"{where}.single[{k}]"), "id", (str,),
                         f"{where}.single[{k}].SpecialToken")
            token = field(special_tokens, name, (dict,), f"{where}.special_tokens")
            for n, i in enumerate(field(token, "ids", (list,), f"{where}.special_tokens.{name}")):
                if valid_id(i, f"{where}.special_tokens.{name}.ids[{n}]") not in self.id_to_token:
                    raise ValueError(f"{where}.special_tokens.{name}.ids[{n}] is {i}, which is no token's id")
                (suffix if seen_text else prefix).append(i)
        return prefix, suffix

    def encode_ordinary(self, text, split_special_tokens):
        for normalize in self.normalizers:
            text = normalize(text)
        ids = []
        for piece, token_id in split_added(text, *self.normalized_matchers[split_special_tokens]):
            if token_id is not None:
                ids.append(token_id)
                continue
            pieces = [piece]
            for pre_tokenize in self.pre_tokenizers:
                pieces = [out for p in pieces for out in pre_tokenize(p)]
            for word in pieces:
                ids.extend(self.bpe(word))
        return ids

    def bpe(self, word):
        """Token ids of one pre-token: repeatedly merge the adjacent pair with the lowest merge rank
        (leftmost first among equals). A heap of candidate pairs over a linked list of symbols keeps long
        words O(n log n); heap entries whose pair has since changed are skipped when popped."""
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        parts, n = list(word), len(word)
        following = list(range(1, n + 1))  # index of the next live symbol (n: none)
        preceding = list(range(-1, n - 1))  # index of the previous live symbol (-1: none)

        def candidate(i):  # the heap entry for the pair starting at symbol i, if it has a merge
            j = following[i]
            rank = self.ranks.get((parts[i], parts[j])) if 0 <= i and j < n else None
            return [] if rank is None else [(rank, i, parts[i], parts[j])]

        heap = [entry for i in range(n - 1) for entry in candidate(i)]
        heapq.heapify(heap)
        while heap:
            rank, i, left, right = heapq.heappop(heap)
            j = following[i]
            if parts[i] != left or j >= n or parts[j] != right:
                continue
            parts[i], parts[j] = left + right, None
            following[i] = following[j]
            if following[i] < n:
                preceding[following[i]] = i
            for entry in candidate(preceding[i]) + candidate(i):
                heapq.heappush(heap, entry)
        parts = [p for p in parts if p is not None]
        # A symbol missing from the vocab becomes unk, or is dropped when there is none: as the reference.
        ids = [self.vocab.get(p, self.unk_id) for p in parts]
        return [i for i in ids if i is not None]

    def decode(self, ids, skip_special_tokens=False):
        # Bytes of the whole sequence first, then UTF-8: a character may span several tokens.
        data = bytearray()
        for i in self.check_ids(ids):
            if skip_special_tokens and i in self.special_ids:
                continue
            token = self.id_to_token[i]
            if self.vocab.get(token) != i:  # an added token beyond the model's vocab: its text as is
                data += token.encode()
            else:
                data += b"".join(self.byte_decoder.get(c, c.encode()) for c in token)
        return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (tokenizer.model, spiece.model) with the Hugging Face conventions:
    Llama-style models add BOS, T5 appends EOS; added tokens (tokenizer_config.json's
    added_tokens_decoder, T5's <extra_id_N>, and the model's control symbols) are cut out of the text."""

    def __init__(self, model_file, config, chat_template, t5):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(str(model_file))
        except (OSError, RuntimeError) as error:
            raise ValueError(f"{model_file} is not a valid SentencePiece model: {error}") from error
        size = self.sp.get_piece_size()
        id_to_token = {i: self.sp.id_to_piece(i) for i in range(size)}
        added = {i: {"id": i, "content": id_to_token[i], "special": True}
                 for i in range(size) if self.sp.is_control(i) or self.sp.is_unknown(i)}
        for i, token in config.get("added_tokens_decoder", {}).items():
            added[int(i)] = dict(token, id=int(i))
        extra_ids = config.get("extra_ids", 100 if t5 else 0)  # T5's sentinels, after the model's pieces
        contents = {t["content"] for t in added.values()}
        for n in range(extra_ids):
            if f"<extra_id_{n}>" not in contents:
                added[size + extra_ids - 1 - n] = {"id": size + extra_ids - 1 - n, "content": f"<extra_id_{n}>", "special": True}
        id_to_token |= {i: t["content"] for i, t in added.items()}
        super().__init__(id_to_token, list(added.values()), config, chat_template)
        own = {"bos_token_id": self.sp.bos_id(), "eos_token_id": self.sp.eos_id(), "pad_token_id": self.sp.pad_id()}
        for name, i in own.items():  # the model's own ids where the config names none
            if getattr(self, name) is None and i >= 0:
                setattr(self, name, i)
        add_bos, add_eos = config.get("add_bos_token", not t5), config.get("add_eos_token", t5)
        self.prefix = [self.bos_token_id] if add_bos and self.bos_token_id is not None else []
        self.suffix = [self.eos_token_id] if add_eos and self.eos_token_id is not None else []

    def encode_ordinary(self, text, split_special_tokens):
        return self.sp.encode(text)  # which reads no special token's text as that token

    def decode(self, ids, skip_special_tokens=False):
        # Runs of model pieces are decoded together (byte-fallback pieces may form one character).
        out, run = [], []
        for i in self.check_ids(ids) + [None]:
            if i is None or i in self.added:
                out.append(self.sp.decode(run))
                run = []
                if i is not None and not (skip_special_tokens and i in self.special_ids):
                    out.append(self.added[i]["content"])
            else:
                run.append(i)
        return "".join(out)


class IncrementalDecoder:
    """The text of a growing sequence of token ids, a piece at a time, exactly as decoding the whole
    sequence gives it: never a broken character. A character can span tokens (byte-level BPE splits
    UTF-8 into bytes), and a token's text can depend on its neighbours (SentencePiece drops the space
    of a sequence's first piece), so each push decodes a short window: the tokens since the last
    emitted piece, with those of the piece before as context, and emits what the new tokens added,
    holding it back while it ends in an incomplete character (U+FFFD)."""

    def __init__(self, tokenizer, skip_special_tokens=True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids = []
        self.context = 0  # ids[context:emitted] were decoded before: they give the window its context
        self.emitted = 0  # ids before this have their text emitted
        self.text = ""

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids):
        """Add token ids; the text they complete (possibly empty)."""
        self.ids.extend(ids)
        before = self.decode(self.ids[self.context:self.emitted])
        after = self.decode(self.ids[self.context:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.context, self.emitted = self.emitted, len(self.ids)
        self.text += after[len(before):]
        return after[len(before):]

    def flush(self):
        """What is held back at the end of the sequence (an incomplete character decodes as U+FFFD)."""
        before = self.decode(self.ids[self.context:self.emitted])
        rest = self.decode(self.ids[self.context:])[len(before):]
        self.context = self.emitted = len(self.ids)
        self.text += rest
        return rest
