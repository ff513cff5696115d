"""Tokenizers: what minispec needs of one (Tokenizer), and byte-level BPE from tokenizer.json, checked, then
run by the `tokenizers` library as the reference runs it. SentencePiece models are loading/spm.py's."""

import hashlib
import json
import re
import reprlib
import threading

import tokenizers

from ..models.checks import FLAG, LIST, TABLE, TEXT, Check, check, integer
from .weights import read_json


class UnsupportedTokenizer(ValueError):
    """A tokenizer.json that is no byte-level BPE this module knows (the message names the part)."""


MAX_EXTRA_IDS = 1000  # T5's sentinel tokens (<extra_id_N>): 100 in every T5; each is an added token
EXTRA_IDS = Check(integer(0, MAX_EXTRA_IDS), f"must be an integer from 0 to {MAX_EXTRA_IDS}")
TOKEN_ID = Check(integer(0, 2**32 - 1), "must be a token id (an integer from 0 to 2^32 - 1)")  # the reference's u32
TEXT_OR_TABLE = Check(lambda v: isinstance(v, (str, dict)), "must be a string or an object")
TEXT_OR_LIST = Check(lambda v: isinstance(v, (str, list)), "must be a string or a list")


def read_config(directory):
    """special_tokens_map.json and tokenizer_config.json merged (the latter wins), each value read checked."""
    config = {}
    for path in (directory / "special_tokens_map.json", directory / "tokenizer_config.json"):
        part = read_json(path) if path.is_file() else {}
        try:
            for key in ("bos_token", "eos_token", "pad_token"):
                if isinstance(check(part, key, TEXT_OR_TABLE, None), dict):
                    check(part[key], "content", TEXT, where=f"{key}.")
            templates = check(part, "chat_template", TEXT_OR_LIST, None)
            for n, template in enumerate(templates if isinstance(templates, list) else []):
                check(TABLE(f"chat_template[{n}]", template), "name", TEXT, where=f"chat_template[{n}].")
                check(template, "template", TEXT, where=f"chat_template[{n}].")
            for key, token in check(part, "added_tokens_decoder", TABLE, {}).items():
                if not key.isdecimal():
                    raise ValueError(f"added_tokens_decoder has key {reprlib.repr(key)}, not a token id")
                check_added_token(token, f"added_tokens_decoder.{key}")
            for key in ("add_bos_token", "add_eos_token"):
                check(part, key, FLAG, None)
            check(part, "extra_ids", EXTRA_IDS, 0)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from error
        config |= part
    return config


def check_added_token(token, where):
    content = check(TABLE(where, token), "content", TEXT, where=f"{where}.")
    if not content:  # it would match everywhere
        raise ValueError(f"{where}.content is empty")
    for flag in ("special", "lstrip", "rstrip", "normalized", "single_word"):
        check(token, flag, FLAG, None, f"{where}.")
    return content


def read_chat_template(directory, config):
    """chat_template.jinja, or tokenizer_config.json's "chat_template" (a string, or named ones), or None."""
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


class Tokenizer:
    """What minispec needs of a tokenizer. A subclass encodes (`encode_text`: without BOS/EOS), decodes a run
    of model tokens (`decode_run`) and names `literal_ids`, the tokens whose text is their content."""

    def __init__(self, id_to_token, added_tokens, config, chat_template):
        self.id_to_token = id_to_token
        self.added = {t["id"]: t for t in added_tokens}
        self.special_ids = {t["id"] for t in added_tokens if t.get("special")}
        token_to_id = {token: i for i, token in id_to_token.items()}
        # each as tokenizer_config.json stores it: a string, an AddedToken dict, or null
        specials = [config.get(key) for key in ("bos_token", "eos_token", "pad_token")]
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            token_to_id.get(token.get("content") if isinstance(token, dict) else token) for token in specials)
        self.chat_template = chat_template
        self.vocab_size = len(id_to_token)
        self.n_ids = max(id_to_token, default=-1) + 1  # the logits a model needs: ids past it have no token
        mapping = json.dumps([sorted(id_to_token.items()), sorted(self.special_ids)], ensure_ascii=False).encode()
        self.fingerprint = hashlib.sha256(mapping).hexdigest()[:16]
        self.prefix, self.suffix = [], []  # ids that add_special_tokens puts around the text (BOS, EOS)

    def encode(self, text, add_special_tokens=True, split_special_tokens=False):
        """Token ids of `text`; split_special_tokens: special tokens' text in it is plain text (an untrusted user's)."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids = self.encode_text(text, split_special_tokens)
        return self.prefix + ids + self.suffix if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens=False):
        ids = [int(i) for i in ids]
        unknown = [i for i in ids if i not in self.id_to_token]
        if unknown:
            raise ValueError(f"token id {unknown[0]} is not in the tokenizer's vocabulary ({self.vocab_size} ids)")
        # Runs of model tokens are decoded together: a character's bytes may span several tokens.
        out, run = [], []
        for i in ids + [None]:
            if i is None or i in self.literal_ids:
                out.append(self.decode_run(run))
                run = []
                if i is not None and not (skip_special_tokens and i in self.special_ids):
                    out.append(self.id_to_token[i])
            elif not (skip_special_tokens and i in self.special_ids):
                run.append(i)
        return "".join(out)

    def describe(self, i):
        content = self.id_to_token.get(i)
        return "no token" if content is None else reprlib.repr(content) + " (special)" * (i in self.special_ids)

    def first_difference(self, other):
        """The first id whose token, or whose being special, is not `other`'s (None: the same tokenizer)."""
        def entry(tokenizer, i):
            return tokenizer.id_to_token.get(i), i in tokenizer.special_ids
        ids = self.id_to_token.keys() | other.id_to_token.keys()
        return min((i for i in ids if entry(self, i) != entry(other, i)), default=None)


# Oniguruma backtracks: a repeated group that can match the same text in several ways, as "(a+)+$", takes
# exponential time. Such a group holds a quantifier or an alternation, which real tokenizers' patterns never repeat.
REGEX_ATOM = re.compile(r"\\(?:[pP]\{[^}]*\}|.?)|\[\^?|\(\??|.", re.DOTALL)  # an escape, a class's or group's start


def check_regex(pattern):
    """`pattern` if Oniguruma compiles it and it repeats no group holding a quantifier or an alternation."""
    try:
        tokenizers.Regex(pattern)
    except Exception as error:  # the library raises a plain Exception
        raise ValueError(f"tokenizer regex {pattern!r} does not compile: {error}") from error
    groups, classes = [], 0  # for each group open: does its body so far hold a quantifier or an alternation?
    for atom in REGEX_ATOM.finditer(pattern):
        atom, following = atom.group(), pattern[atom.end() : atom.end() + 1]
        if atom.startswith("["):  # classes nest in Oniguruma
            classes += 1
        elif classes:
            classes -= atom == "]"
        elif atom.startswith("("):
            groups.append(False)
        elif atom == ")" and groups:
            ambiguous = groups.pop()
            if ambiguous and following in ("*", "+", "{"):
                raise UnsupportedTokenizer(f"tokenizer regex {pattern!r} repeats a group holding a quantifier or "
                                           "an alternation, which can take exponential time")
            if groups:
                groups[-1] |= ambiguous
        elif atom in ("|", "?", "*", "+", "{") and groups:
            groups[-1] = True
    return pattern


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
SPACES = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}  # SentencePiece-style's normalizer
# SentencePiece-style: "▁" back to spaces, <0xNN> tokens to their bytes, the pieces joined
BYTE_FALLBACK = {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                                                  {"type": "ByteFallback"}, {"type": "Fuse"}]}


def flattened(spec, where, key, step):
    """The steps of a normalizer, pre-tokenizer or post-processor, each as step(kind, spec, where) reads it,
    Sequences under `key` flattened (so that steps nested deeper than the library's JSON reader goes still load)."""
    if spec is None:
        return []
    kind = check(TABLE(where, spec), "type", TEXT, where=f"{where}.")
    if kind == "Sequence":
        steps = check(spec, key, LIST, where=f"{where}.")
        return [x for k, s in enumerate(steps) for x in flattened(s, f"{where}.{key}[{k}]", key, step)]
    return step(kind, spec, where)


def normalizer_step(kind, spec, where):
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return [{"type": kind}]
    if kind == "Replace":
        pattern = check(check(spec, "pattern", TABLE, where=f"{where}."), "String", TEXT, where=f"{where}.pattern.")
        return [{"type": kind, "pattern": {"String": pattern}, "content": check(spec, "content", TEXT, where=f"{where}.")}]
    raise UnsupportedTokenizer(f"normalizer {kind!r} is not supported")


def pre_tokenizer_step(kind, spec, where):
    if kind == "Split":
        pattern = check(spec, "pattern", TABLE, where=f"{where}.")
        behavior = check(spec, "behavior", TEXT, where=f"{where}.")
        if behavior not in ("Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"):
            raise UnsupportedTokenizer(f"Split behavior {behavior!r} is not supported")
        key = "Regex" if "Regex" in pattern else "String"
        text = check(pattern, key, TEXT, where=f"{where}.pattern.")
        pattern = {key: check_regex(text) if key == "Regex" else text}
        return [{"type": kind, "pattern": pattern, "behavior": behavior,
                 "invert": check(spec, "invert", FLAG, False, f"{where}.")}]
    if kind == "Digits":
        return [{"type": kind, "individual_digits": check(spec, "individual_digits", FLAG, False, f"{where}.")}]
    if kind == "ByteLevel":
        return [{**BYTE_LEVEL, "use_regex": check(spec, "use_regex", FLAG, True, f"{where}."),
                 "add_prefix_space": check(spec, "add_prefix_space", FLAG, False, f"{where}.")}]
    raise UnsupportedTokenizer(f"pre-tokenizer {kind!r} is not supported")


class ByteLevelBPE(Tokenizer):
    """Byte-level BPE from a tokenizer.json, or SentencePiece-style BPE as a GGUF import writes Gemma's, run by
    `tokenizers` once rebuilt from the parts checked here, so that a bad file is a one-line error naming its key."""

    def __init__(self, spec, config, chat_template):
        model = check(TABLE("its top level", spec), "model", TABLE)
        if model.get("type") != "BPE":
            raise UnsupportedTokenizer(f"model type {model.get('type')!r} is not BPE")
        for option in ("continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(option):
                raise UnsupportedTokenizer(f"BPE option {option} is not byte-level BPE")
        byte_fallback = check(model, "byte_fallback", FLAG, False, "model.")
        if byte_fallback and spec.get("normalizer") != SPACES:  # e.g. Llama 2's (Metaspace): its tokenizer.model
            raise UnsupportedTokenizer("BPE option byte_fallback is only read with the normalizer writing spaces as '\u2581'")
        vocab = check(model, "vocab", TABLE, where="model.")
        id_to_token = {i: token for token, i in vocab.items() if TOKEN_ID.test(i)}
        if len(id_to_token) < len(vocab):  # an id that is none, or one given to two tokens
            for token, i in vocab.items():
                if id_to_token.get(TOKEN_ID(f"model.vocab[{reprlib.repr(token)}]", i)) != token:
                    raise ValueError(f"model.vocab gives id {i} to both {reprlib.repr(token)} and {reprlib.repr(id_to_token[i])}")
        merges = check(model, "merges", LIST, where="model.")
        for rank, merge in enumerate(merges):
            pair = merge.split(" ") if isinstance(merge, str) else merge  # older files: "a b"
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], str)):
                raise ValueError(f"model.merges[{rank}] must be a pair of tokens, got {reprlib.repr(merge)}")
            if pair[0] + pair[1] not in vocab:
                raise ValueError(f"model.merges[{rank}] {reprlib.repr(merge)} makes {reprlib.repr(pair[0] + pair[1])}, "
                                 "which is not in model.vocab")
        unk_token = check(model, "unk_token", TEXT, None, "model.")
        # A symbol missing from the vocab becomes unk, or is dropped when unk is none (the library would
        # fail on each text that has one when unk is no token).
        bpe = {"type": "BPE", "vocab": vocab, "merges": merges, "unk_token": unk_token if unk_token in vocab else None,
               "ignore_merges": check(model, "ignore_merges", FLAG, False, "model."), "byte_fallback": byte_fallback,
               "fuse_unk": check(model, "fuse_unk", FLAG, False, "model.")}
        added = [self.added_token(token, f"added_tokens[{n}]", id_to_token)
                 for n, token in enumerate(check(spec, "added_tokens", LIST, []))]
        normalizers = flattened(spec.get("normalizer"), "normalizer", "normalizers", normalizer_step)
        pre_tokenizers = flattened(spec.get("pre_tokenizer"), "pre_tokenizer", "pretokenizers", pre_tokenizer_step)
        if not byte_fallback and not any(step["type"] == "ByteLevel" for step in pre_tokenizers):
            raise UnsupportedTokenizer("BPE without a ByteLevel pre-tokenizer is not byte-level")
        rebuilt = {"added_tokens": added, "normalizer": {"type": "Sequence", "normalizers": normalizers},
                   "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
                   "decoder": BYTE_FALLBACK if byte_fallback else BYTE_LEVEL, "model": bpe}
        try:
            self.tokenizer = tokenizers.Tokenizer.from_str(json.dumps(rebuilt))
        except Exception as error:  # what the checks above do not foresee; the library raises a plain Exception
            raise ValueError(f"the tokenizers library refuses it: {error}") from error
        self.lock = threading.Lock()  # encode_special_tokens is the library tokenizer's state, set per encode
        super().__init__(id_to_token, added, config, chat_template)  # added_token put the added tokens in
        self.literal_ids = {t["id"] for t in added if vocab.get(t["content"]) != t["id"]}  # beyond the model's vocab
        parts = flattened(spec.get("post_processor"), "post_processor", "processors", self.template)
        self.prefix, self.suffix = [i for p, _ in parts for i in p], [i for _, s in parts for i in s]

    @staticmethod
    def added_token(token, where, id_to_token):
        content = check_added_token(token, where)
        i = check(token, "id", TOKEN_ID, where=f"{where}.")
        if id_to_token.setdefault(i, content) != content:
            raise ValueError(f"{where} gives id {i} to {reprlib.repr(content)}, which is {reprlib.repr(id_to_token[i])}'s")
        flags = {flag: token.get(flag, False) for flag in ("single_word", "lstrip", "rstrip", "normalized", "special")}
        return {"id": i, "content": content, **flags}

    def template(self, kind, spec, where):
        """[(prefix ids, suffix ids)] that a post-processor step adds around a single sequence."""
        if kind == "ByteLevel":  # ByteLevel only adjusts offsets
            return []
        if kind != "TemplateProcessing":
            raise UnsupportedTokenizer(f"post-processor {kind!r} is not supported")
        special_tokens = check(spec, "special_tokens", TABLE, where=f"{where}.")
        prefix, suffix, seen_text = [], [], False
        for k, item in enumerate(check(spec, "single", LIST, where=f"{where}.")):
            if "Sequence" in TABLE(f"{where}.single[{k}]", item):
                seen_text = True
                continue
            name = check(check(item, "SpecialToken", TABLE, where=f"{where}.single[{k}]."), "id", TEXT,
                         where=f"{where}.single[{k}].SpecialToken.")
            token = check(special_tokens, name, TABLE, where=f"{where}.special_tokens.")
            for n, i in enumerate(check(token, "ids", LIST, where=f"{where}.special_tokens.{name}.")):
                if TOKEN_ID(f"{where}.special_tokens.{name}.ids[{n}]", i) not in self.id_to_token:
                    raise ValueError(f"{where}.special_tokens.{name}.ids[{n}] is {i}, which is no token's id")
                (suffix if seen_text else prefix).append(i)
        return [(prefix, suffix)]

    def encode_text(self, text, split_special_tokens):
        with self.lock:
            self.tokenizer.encode_special_tokens = split_special_tokens
            return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode_run(self, ids):
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=False)


class IncrementalDecoder:
    """The text of a growing sequence of token ids a piece at a time, exactly as decoding the whole gives it:
    each push decodes the new tokens with the piece before as context, and holds back an incomplete character."""

    def __init__(self, tokenizer, skip_special_tokens=True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids = []
        self.context = 0  # ids[context:emitted] were decoded before: they give the window its context
        self.emitted = 0  # ids before this have their text emitted
        self.text = ""

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids, final=False):
        """Add token ids; the text they complete (possibly empty), or with `final` all that is left."""
        self.ids.extend(ids)
        before = self.decode(self.ids[self.context:self.emitted])
        after = self.decode(self.ids[self.context:])
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        self.context, self.emitted = len(self.ids) if final else self.emitted, len(self.ids)
        self.text += after[len(before):]
        return after[len(before):]

    def flush(self):
        """What is held back at the end of the sequence (an incomplete character decodes as U+FFFD)."""
        return self.push([], final=True)
