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
import unicodedata
from pathlib import Path


class UnsupportedTokenizer(ValueError):
    """A tokenizer.json this module cannot reproduce exactly; the message names the component."""


def load_tokenizer(directory, model_type=""):
    """The tokenizer of a checkpoint directory, or None when it has no tokenizer files. `model_type`
    (config.json's) tells a T5 SentencePiece model from others when the file names do not.

    tokenizer.json is used when it describes a byte-level BPE; otherwise (e.g. a SentencePiece-style
    BPE or Unigram tokenizer.json) the SentencePiece model next to it, tokenizer.model or spiece.model.
    """
    directory = Path(directory)
    config = {**read_json(directory / "special_tokens_map.json"), **read_json(directory / "tokenizer_config.json")}
    chat_template = read_chat_template(directory, config)
    sentencepiece_file = next((directory / n for n in ("tokenizer.model", "spiece.model") if (directory / n).is_file()), None)
    if (directory / "tokenizer.json").is_file():
        try:
            return ByteLevelBPE(read_json(directory / "tokenizer.json"), config, chat_template)
        except UnsupportedTokenizer:
            if sentencepiece_file is None:
                raise
    if sentencepiece_file is not None:
        t5 = sentencepiece_file.name == "spiece.model" or "T5" in str(config.get("tokenizer_class")) or "t5" in model_type
        return SentencePieceTokenizer(sentencepiece_file, config, chat_template, t5)
    return None


def read_json(path):
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error


def read_chat_template(directory, config):
    """chat_template.jinja (newer transformers) or tokenizer_config.json's "chat_template" (a string, or a
    list of named templates of which "default" is the one applied), or None."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
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


def translate_regex(pattern):
    """An Oniguruma pattern from tokenizer.json as an equivalent compiled Python `re` pattern."""
    out, i, in_class = [], 0, False
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
        out.append(char)
        i += 1
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
        self.raw_tokens = sorted(added_tokens if raw_tokens is None else raw_tokens, key=lambda t: -len(t["content"]))
        self.raw_regex = added_token_regex(self.raw_tokens)
        token_to_id = {token: i for i, token in id_to_token.items()}
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            token_to_id.get(token_content(config.get(key))) for key in ("bos_token", "eos_token", "pad_token")
        )
        self.chat_template = chat_template
        self.vocab_size = len(id_to_token)
        mapping = json.dumps(sorted(id_to_token.items()), ensure_ascii=False).encode()
        self.fingerprint = hashlib.sha256(mapping).hexdigest()[:16]
        self.prefix, self.suffix = [], []  # ids that add_special_tokens puts around the text (BOS, EOS)

    def encode(self, text, add_special_tokens=True):
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids = []
        for piece, token_id in split_added(text, self.raw_regex, self.raw_tokens):
            ids.extend([token_id] if token_id is not None else self.encode_ordinary(piece))
        return self.prefix + ids + self.suffix if add_special_tokens else ids

    def encode_ordinary(self, text):
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
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise UnsupportedTokenizer(f"tokenizer.json model type {model.get('type')!r} is not BPE")
        for option in ("continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
            if model.get(option):
                raise UnsupportedTokenizer(f"BPE option {option} is not byte-level BPE")
        self.vocab = model["vocab"]
        self.ranks = {}
        for rank, merge in enumerate(model["merges"]):
            pair = tuple(merge.split(" ") if isinstance(merge, str) else merge)
            if len(pair) != 2:
                raise ValueError(f"tokenizer.json: malformed merge {merge!r}")
            self.ranks.setdefault(pair, rank)
        self.ignore_merges = model.get("ignore_merges", False)  # a pre-token in the vocab stays whole
        self.unk_id = self.vocab.get(model["unk_token"]) if model.get("unk_token") else None
        self.normalizers = self.build_normalizers(spec.get("normalizer"))
        self.byte_level = False  # set by a ByteLevel pre-tokenizer, which this class requires
        self.pre_tokenizers = self.build_pre_tokenizers(spec.get("pre_tokenizer"))
        if not self.byte_level:
            raise UnsupportedTokenizer("tokenizer.json BPE without a ByteLevel pre-tokenizer is not byte-level")
        self.byte_decoder = {char: bytes([byte]) for byte, char in bytes_to_unicode().items()}
        added = spec.get("added_tokens", [])
        id_to_token = {i: token for token, i in self.vocab.items()} | {t["id"]: t["content"] for t in added}
        raw = [t for t in added if not t.get("normalized")]
        super().__init__(id_to_token, added, config, chat_template, raw_tokens=raw)
        self.normalized_tokens = sorted([t for t in added if t.get("normalized")], key=lambda t: -len(t["content"]))
        self.normalized_regex = added_token_regex(self.normalized_tokens)
        self.prefix, self.suffix = self.template(spec.get("post_processor"))
        self.bpe = functools.lru_cache(maxsize=1 << 16)(self.bpe)  # words repeat: merge each once

    # Each pipeline step is read from tokenizer.json once into plain functions.
    def build_normalizers(self, spec):
        if spec is None:
            return []
        if spec["type"] == "Sequence":
            return [n for s in spec["normalizers"] for n in self.build_normalizers(s)]
        if spec["type"] in ("NFC", "NFD", "NFKC", "NFKD"):
            return [functools.partial(unicodedata.normalize, spec["type"])]
        raise UnsupportedTokenizer(f"normalizer {spec['type']} is not supported")

    def build_pre_tokenizers(self, spec):
        if spec is None:
            return []
        kind = spec["type"]
        if kind == "Sequence":
            return [p for s in spec["pretokenizers"] for p in self.build_pre_tokenizers(s)]
        if kind == "Split":
            pattern, behavior, invert = spec["pattern"], spec["behavior"], spec.get("invert", False)
            if behavior not in ("Isolated", "Removed", *MERGE_RULES):
                raise UnsupportedTokenizer(f"Split behavior {behavior} is not supported")
            regex = translate_regex(pattern["Regex"]) if "Regex" in pattern else re.compile(re.escape(pattern["String"]))
            return [lambda text: split(regex, text, behavior, invert)]
        if kind == "Digits":  # Rust's char::is_numeric: categories Nd, Nl, No
            regex, behavior = translate_regex(r"\p{N}"), "Isolated" if spec.get("individual_digits") else "Contiguous"
            return [lambda text: split(regex, text, behavior)]
        if kind == "ByteLevel":
            self.byte_level = True
            regex = translate_regex(GPT2_PATTERN) if spec.get("use_regex", True) else None
            return [functools.partial(self.byte_level_split, regex, spec.get("add_prefix_space", False))]
        raise UnsupportedTokenizer(f"pre-tokenizer {kind} is not supported")

    def byte_level_split(self, regex, add_prefix_space, text):
        # The prefix space goes before every piece of text, also those after an added token: as the reference.
        if add_prefix_space and not text.startswith(" "):
            text = " " + text
        pieces = split(regex, text) if regex else [text]
        return [piece.encode().decode("latin-1").translate(bytes_to_unicode()) for piece in pieces]

    def template(self, spec):
        """(prefix ids, suffix ids) that the post-processor adds around a single sequence."""
        if spec is None or spec["type"] == "ByteLevel":  # ByteLevel only adjusts offsets
            return [], []
        if spec["type"] == "Sequence":
            parts = [self.template(s) for s in spec["processors"]]
            return [i for p, _ in parts for i in p], [i for _, s in parts for i in s]
        if spec["type"] != "TemplateProcessing":
            raise UnsupportedTokenizer(f"post-processor {spec['type']} is not supported")
        prefix, suffix, seen_text = [], [], False
        for item in spec["single"]:
            if "Sequence" in item:
                seen_text = True
            else:
                (suffix if seen_text else prefix).extend(spec["special_tokens"][item["SpecialToken"]["id"]]["ids"])
        return prefix, suffix

    def encode_ordinary(self, text):
        for normalize in self.normalizers:
            text = normalize(text)
        ids = []
        for piece, token_id in split_added(text, self.normalized_regex, self.normalized_tokens):
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

    def encode_ordinary(self, text):
        return self.sp.encode(text)

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
