"""minispec.loading.tokenizer against the references: byte-level BPEs trained with the `tokenizers` library in
the styles of GPT-2, Qwen2, Llama 3 and SmolLM, saved by transformers (real tokenizer.json and
tokenizer_config.json); and tiny SentencePiece models (BPE as Llama's, unigram as T5's) compared with
the sentencepiece library plus the Hugging Face BOS/EOS conventions (transformers cannot convert
SentencePiece models here: that needs protobuf)."""

import copy
import gc
import json
import shutil
import time
import unicodedata
import weakref

import pytest
import sentencepiece
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from minispec.loading.checkpoint import load_tokenizer
from minispec.loading.spm import SentencePieceTokenizer
from minispec.loading.tokenizer import ByteLevelBPE, IncrementalDecoder

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "It's what they'd've said: I'M SURE you'll see, we're 'quoted' -- OK?",
    "Café naïve résumé, Ångström, Straße; 東京タワー 北京; 😀👍🏽 🇫🇷; Привет, мир!",
    "combining: e\u0301 A\u030angstro\u0308m n\u0303; x²+y³=z⁴, Ⅻ o'clock, ½ ① ٣",
    "3.14159 26535897932384626433 and 1,000,000 or 2024-01-31T12:00",
    "  leading, trailing   \t\ttabs\n\nnew lines\r\nwindows\r\n   \n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nprint(fib(10))  # 55\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "special<|endoftext|>glued<|endoftext|><|endoftext|> spaced <|endoftext|> end<|end|<|end",
    "ſ 'S 'Ll \u00a0nbsp\u2003em\u3000ideographic \x1c\x1d separators \u0085nel\u2028 <mask> x[SEP]  y",
    "",
    " ",
    "a" * 300,
]
PROSE = """Speculative decoding runs a small draft model ahead of a large target model. The draft proposes
a few tokens; the target checks all of them in one forward pass and keeps the longest prefix it agrees
with, so the output is exactly what the target alone would have produced, only faster. It works best
when the two models share a tokenizer, when the draft is much cheaper, and when the text is predictable:
code, lists, translations. Beautiful is better than ugly; explicit is better than implicit; simple is
better than complex; readability counts. There should be one obvious way to do it, although that way
may not be obvious at first. Now is better than never, although never is often better than right now."""
TRAIN = PROSE.splitlines() + TEXTS[:7] * 3

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def split_regex(pattern):
    return pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)


BYTE_LEVEL = {  # name: (normalizer, pre-tokenizer, special tokens, extra added tokens, BOS template)
    "gpt2": (None, pre_tokenizers.ByteLevel(add_prefix_space=False), ["<|endoftext|>", "<|end"], [], False),
    "gpt2_prefix_space": (None, pre_tokenizers.ByteLevel(add_prefix_space=True), ["<|endoftext|>"], [], False),
    "qwen2": (
        normalizers.NFC(),
        pre_tokenizers.Sequence([split_regex(QWEN2_PATTERN), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        [  # matched after normalization; swallowing the space on their left / right
            AddedToken("Ångström", normalized=True, special=False),
            AddedToken("<mask>", lstrip=True, normalized=False, special=True),
            AddedToken("[SEP]", rstrip=True, normalized=False, special=True),
        ],
        False,
    ),
    "llama3": (
        None,
        pre_tokenizers.Sequence([split_regex(LLAMA3_PATTERN), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], [], True,
    ),
    "smollm": (
        None,
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], [], False,
    ),
}
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def build_byte_level(directory, name):
    normalizer, pre_tokenizer, specials, extra, bos_template = BYTE_LEVEL[name]
    tok = Tokenizer(models.BPE(ignore_merges=name == "llama3"))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre_tokenizer, decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN, trainer)
    tok.add_tokens(extra)
    post = processors.ByteLevel(trim_offsets=False)
    if bos_template:  # as Llama 3: <|begin_of_text|> before every sequence
        bos = specials[0]
        template = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
        post = processors.Sequence([post, template])
    tok.post_processor = post
    names = {"bos_token": specials[0], "eos_token": specials[-1]} if bos_template else {"eos_token": specials[0]}
    if name == "qwen2":
        names["pad_token"] = "<|endoftext|>"
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def byte_level_dirs(tmp_path_factory):
    return {name: build_byte_level(tmp_path_factory.mktemp(name), name) for name in BYTE_LEVEL}


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_byte_level_encode_matches_reference(byte_level_dirs, name):
    directory = byte_level_dirs[name]
    ours = load_tokenizer(directory)
    assert isinstance(ours, ByteLevelBPE)
    reference = Tokenizer.from_file(str(directory / "tokenizer.json"))
    hf = PreTrainedTokenizerFast.from_pretrained(directory)
    for text in TEXTS:
        for add_special_tokens in (True, False):
            expected = reference.encode(text, add_special_tokens=add_special_tokens).ids
            assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, (name, text)
        assert ours.encode(text) == hf(text)["input_ids"], (name, text)
    assert len(ours.encode(TEXTS[0])) < len(TEXTS[0]) / 2  # merges were applied, not just bytes


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_byte_level_decode(byte_level_dirs, name):
    directory = byte_level_dirs[name]
    ours = load_tokenizer(directory)
    reference = Tokenizer.from_file(str(directory / "tokenizer.json"))
    normalize = (lambda t: unicodedata.normalize("NFC", t)) if name == "qwen2" else (lambda t: t)
    prefix = " " if name == "gpt2_prefix_space" else ""
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        if name in ("gpt2", "smollm", "llama3"):  # only these keep every character and space as is
            assert ours.decode(ids) == text
        for skip in (False, True):
            # The reference passes added tokens through the byte-level decoder, which garbles non-ASCII
            # ones ("Ångström"); minispec keeps the text of an added token beyond the model's vocab as is.
            if name != "qwen2" or "Ångström" not in normalize(text):
                assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    text = "A\u030angstro\u0308m e\u0301 東京😀"
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == prefix + normalize(text)
    # Pieces of one character spread over several tokens decode together, not as replacement characters.
    assert len(ours.encode("😀", add_special_tokens=False)) > 1
    assert "\ufffd" not in ours.decode(ours.encode("東京😀" * 3))
    special = ours.encode(TEXTS[7] if name in ("qwen2", "smollm") else "a<|endoftext|>b" if "gpt2" in name else "<|eot_id|>b")
    assert ours.decode(special, skip_special_tokens=True) == reference.decode(special, skip_special_tokens=True)
    assert "<|" not in ours.decode(special, skip_special_tokens=True)
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        ours.decode([ours.vocab_size + 5])


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_byte_level_attributes(byte_level_dirs, name):
    directory = byte_level_dirs[name]
    ours = load_tokenizer(directory)
    hf = PreTrainedTokenizerFast.from_pretrained(directory)
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert ours.eos_token_id is not None
    assert ours.chat_template == CHAT_TEMPLATE
    assert ours.fingerprint == load_tokenizer(directory).fingerprint
    assert len(ours.fingerprint) == 16


def test_fingerprints_differ(byte_level_dirs):
    prints = {load_tokenizer(directory).fingerprint for directory in byte_level_dirs.values()}
    assert len(prints) == len(byte_level_dirs)


def test_folders_with_the_same_tokenizer_files_share_one_tokenizer(byte_level_dirs, tmp_path):
    """A draft's tokenizer files are usually its target's, and checking a large vocabulary costs a second: while
    a tokenizer is alive, a folder whose vocabulary and settings are the same bytes gets it again (with its own
    chat template, where that differs, the vocabulary still shared); a byte changed in the vocabulary's file, or
    none alive, and the folder's own files are read and checked."""
    source = byte_level_dirs["qwen2"]
    copy_dir = tmp_path / "copy"
    shutil.copytree(source, copy_dir)
    first = load_tokenizer(source)
    assert load_tokenizer(copy_dir) is first
    (copy_dir / "chat_template.jinja").write_text("{{ 'changed' }}")
    changed = load_tokenizer(copy_dir)
    assert changed.chat_template == "{{ 'changed' }}" != first.chat_template and changed.tokenizer is first.tokenizer
    assert load_tokenizer(source).chat_template == first.chat_template
    spec = json.loads((copy_dir / "tokenizer.json").read_text())
    (copy_dir / "tokenizer.json").write_text(json.dumps(spec, indent=1))  # the same tokenizer in other bytes
    other = load_tokenizer(copy_dir)
    assert other.tokenizer is not first.tokenizer and other.chat_template == "{{ 'changed' }}"
    gone = weakref.ref(first)
    del first, changed, other
    gc.collect()
    assert gone() is None  # the cache holds no tokenizer alive


def test_llama3_bos_from_post_processor(byte_level_dirs):
    ours = load_tokenizer(byte_level_dirs["llama3"])
    assert ours.bos_token_id is not None
    assert ours.encode("hi")[0] == ours.bos_token_id
    assert ours.encode("hi") == [ours.bos_token_id] + ours.encode("hi", add_special_tokens=False)
    assert ours.bos_token_id not in ours.encode("hi", add_special_tokens=False)
    assert ours.decode(ours.encode("hi")) == "<|begin_of_text|>hi"
    assert ours.decode(ours.encode("hi"), skip_special_tokens=True) == "hi"


def test_added_tokens_longest_match_first(byte_level_dirs):
    ours = load_tokenizer(byte_level_dirs["gpt2"])
    end, endoftext = ours.encode("<|end"), ours.encode("<|endoftext|>")
    assert len(end) == len(endoftext) == 1 and end != endoftext
    assert ours.encode("<|endoftext|><|end") == endoftext + end


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_split_special_tokens_matches_reference(byte_level_dirs, name):
    """split_special_tokens=True: special tokens' text is ordinary text, other added tokens are still cut
    out, as the reference's encode_special_tokens (transformers' split_special_tokens)."""
    ours = load_tokenizer(byte_level_dirs[name])
    reference = Tokenizer.from_file(str(byte_level_dirs[name] / "tokenizer.json"))
    reference.encode_special_tokens = True
    for text in TEXTS:
        assert ours.encode(text, split_special_tokens=True) == reference.encode(text).ids, (name, text)
    eos = ours.id_to_token[ours.eos_token_id]
    assert ours.encode(eos, add_special_tokens=False) == [ours.eos_token_id]
    assert ours.eos_token_id not in ours.encode(eos, add_special_tokens=False, split_special_tokens=True)


def test_merges_as_strings(byte_level_dirs, tmp_path):
    """Older tokenizer.json files store merges as "a b" strings instead of [a, b] pairs."""
    spec = json.loads((byte_level_dirs["gpt2"] / "tokenizer.json").read_text())
    spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    ours, reference = load_tokenizer(tmp_path), load_tokenizer(byte_level_dirs["gpt2"])
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text)


@pytest.mark.parametrize("ignore_merges", [False, True])
def test_ignore_merges(tmp_path, ignore_merges):
    """Llama 3's ignore_merges: a pre-token that is itself in the vocab is one token, whatever the merges."""
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())} | {"ab": 256, "abc": 257}
    tok = Tokenizer(models.BPE(vocab, [("a", "b")], ignore_merges=ignore_merges))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    expected = [257] if ignore_merges else [256, vocab["c"]]
    assert load_tokenizer(tmp_path).encode("abc") == tok.encode("abc").ids == expected


# --- Split patterns --------------------------------------------------------------------------------

# Every code point Python's Unicode database knows.
ALL_CHARACTERS = "".join(chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) not in ("Cn", "Cs"))


def split_tokenizers(directory, pattern, behavior="Isolated", invert=False):
    """tiny_spec() with `pattern` as its Split pre-tokenizer's, saved in `directory`: (ours, the reference)."""
    spec = tiny_spec()
    spec["pre_tokenizer"]["pretokenizers"][0].update(pattern={"Regex": pattern}, behavior=behavior, invert=invert)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return load_tokenizer(directory), Tokenizer.from_file(str(directory / "tokenizer.json"))


@pytest.mark.parametrize("pattern", [
    r"\p{L}+", r"\p{N}+", r"\s+", r"\S+", r"\d+", r"\p{Lu}+\p{Ll}*", r"\p{M}+", r"\P{L}+",
    r"[^\s\p{L}\p{N}]+", r"[\p{Lt}\p{Lm}\p{Lo}]+", r"[^\r\n\p{L}\p{N}]?\p{L}+",
    r"\w+", r"[a[b]]+",  # Oniguruma's \w and nested classes, which Python's re reads differently
])
def test_split_patterns_match_reference(tmp_path, pattern):
    """Every code point falls on the same side of the pattern as in the reference's Oniguruma."""
    ours, reference = split_tokenizers(tmp_path, pattern)
    expected = reference.pre_tokenizer.pre_tokenize_str(ALL_CHARACTERS)
    assert ours.tokenizer.pre_tokenizer.pre_tokenize_str(ALL_CHARACTERS) == expected


@pytest.mark.parametrize("behavior", ["Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"])
@pytest.mark.parametrize("invert", [False, True])
def test_split_behaviors_match_reference(tmp_path, behavior, invert):
    ours, reference = split_tokenizers(tmp_path, "-", behavior, invert)
    for text in ["the-final--countdown", "-a--b---", "---", "abc", "-", "ab-c a-bc"]:
        expected = reference.pre_tokenizer.pre_tokenize_str(text)
        assert ours.tokenizer.pre_tokenizer.pre_tokenize_str(text) == expected, text
        assert ours.encode(text) == reference.encode(text).ids, text


# --- SentencePiece -------------------------------------------------------------------------------


def train_sentencepiece(prefix, **options):
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN), model_prefix=str(prefix), minloglevel=2, hard_vocab_limit=False, **options
    )
    return sentencepiece.SentencePieceProcessor(model_file=f"{prefix}.model")


@pytest.fixture(scope="module")
def sentencepiece_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sentencepiece")
    llama = train_sentencepiece(  # Llama 1/2: BPE, byte fallback, text kept as is
        root / "llama", model_type="bpe", vocab_size=500, byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
    )
    t5 = train_sentencepiece(  # T5: unigram, NFKC, pad 0 / eos 1 / unk 2, no BOS
        root / "t5", model_type="unigram", vocab_size=200, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
    )
    dirs = {}
    user = {"content": "<|user|>", "lstrip": False, "normalized": False, "rstrip": True, "single_word": False, "special": True}
    configs = {
        "llama": ("tokenizer.model", {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                                      "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
                                      "added_tokens_decoder": {str(llama.get_piece_size()): user}}),
        "llama_no_bos": ("tokenizer.model", {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False}),
        "t5": ("spiece.model", {"tokenizer_class": "T5Tokenizer", "eos_token": "</s>", "pad_token": "<pad>", "extra_ids": 100}),
        "t5_bare": ("spiece.model", None),
    }
    for name, (file_name, config) in configs.items():
        directory = root / name
        directory.mkdir()
        source = root / ("t5.model" if file_name == "spiece.model" else "llama.model")
        (directory / file_name).write_bytes(source.read_bytes())
        if config is not None:
            (directory / "tokenizer_config.json").write_text(json.dumps(config))
        dirs[name] = directory
    return dirs, {"llama": llama, "t5": t5}


SPECIAL_FREE = [t for t in TEXTS if "<" not in t]


def test_sentencepiece_llama(sentencepiece_dirs):
    dirs, models_ = sentencepiece_dirs
    sp = models_["llama"]
    ours = load_tokenizer(dirs["llama"])
    assert isinstance(ours, SentencePieceTokenizer)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, None)
    size = sp.get_piece_size()
    assert ours.vocab_size == size + 1  # <|user|> from tokenizer_config.json's added_tokens_decoder
    assert ours.chat_template == CHAT_TEMPLATE
    for text in SPECIAL_FREE:
        assert ours.encode(text) == [1] + sp.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == sp.encode(text)
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == sp.decode(sp.encode(text)) == text
    # Byte fallback: characters outside the vocabulary become <0x..> pieces and decode back together.
    assert any(sp.id_to_piece(i).startswith("<0x") for i in ours.encode("𝔘𝔫𝔦"))
    assert ours.decode(ours.encode("𝔘𝔫𝔦 東京"), skip_special_tokens=True) == "𝔘𝔫𝔦 東京"
    # Control symbols in the text are cut out first, as the reference's special tokens; the text between
    # them is encoded piece by piece (with SentencePiece's dummy prefix, the "legacy" Llama behaviour).
    ids = ours.encode("hi</s>there <s> x")
    assert ids == [1] + sp.encode("hi") + [2] + sp.encode("there ") + [1] + sp.encode(" x")
    assert ours.decode(ids) == "<s>hi</s>there <s> x"  # each run drops its dummy prefix, as SentencePiece does
    assert ours.decode(ids, skip_special_tokens=True) == "hithere  x"
    # split_special_tokens: control symbols' text is text, which SentencePiece encodes as any other.
    assert ours.encode("hi</s>there", split_special_tokens=True) == [1] + sp.encode("hi</s>there")
    assert 2 not in ours.encode("hi</s>there", split_special_tokens=True)
    # An added token from tokenizer_config.json, which swallows the whitespace on its right (rstrip).
    assert ours.encode("say<|user|>\n hi") == [1] + sp.encode("say") + [size] + sp.encode("hi")
    assert load_tokenizer(dirs["llama_no_bos"]).encode("hi") == sp.encode("hi")


def test_sentencepiece_t5(sentencepiece_dirs):
    dirs, models_ = sentencepiece_dirs
    sp = models_["t5"]
    size = sp.get_piece_size()
    for name in ("t5", "t5_bare"):
        ours = load_tokenizer(dirs[name])
        assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (None, 1, 0)
        assert ours.vocab_size == size + 100  # the reference adds 100 sentinels <extra_id_N>
        for text in SPECIAL_FREE:
            assert ours.encode(text) == sp.encode(text) + [1], text  # encoder inputs end with </s>
            assert ours.decode(ours.encode(text), skip_special_tokens=True) == sp.decode(sp.encode(text))
        # <extra_id_0> is the last id, <extra_id_99> the first after the model's pieces.
        ids = ours.encode("a <extra_id_0> b<extra_id_99>", add_special_tokens=False)
        assert ids == sp.encode("a ") + [size + 99] + sp.encode(" b") + [size]
        assert ours.decode(ids) == "a<extra_id_0>b<extra_id_99>"
    assert load_tokenizer(dirs["t5"]).fingerprint == load_tokenizer(dirs["t5_bare"]).fingerprint
    assert load_tokenizer(dirs["t5"]).fingerprint != load_tokenizer(dirs["llama"]).fingerprint


def test_sentencepiece_t5_named_tokenizer_model(sentencepiece_dirs, tmp_path):
    """A T5 SentencePiece file saved as tokenizer.model, with no tokenizer_config.json: only config.json's
    model_type (which the loader passes on) tells it from a Llama one."""
    dirs, models_ = sentencepiece_dirs
    (tmp_path / "tokenizer.model").write_bytes((dirs["t5_bare"] / "spiece.model").read_bytes())
    sp = models_["t5"]
    assert load_tokenizer(tmp_path, "t5").encode("hello") == sp.encode("hello") + [1]
    assert load_tokenizer(tmp_path, "t5").fingerprint == load_tokenizer(dirs["t5_bare"]).fingerprint
    assert load_tokenizer(tmp_path, "llama").encode("hello") != sp.encode("hello") + [1]


def test_sentencepiece_style_tokenizer_json_falls_back_to_model(sentencepiece_dirs, tmp_path):
    """Llama 2's tokenizer.json is a SentencePiece-style BPE (Metaspace, byte fallback), not byte-level:
    the tokenizer.model beside it is used."""
    dirs, models_ = sentencepiece_dirs
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="byte_fallback"):
        load_tokenizer(tmp_path)  # and without it: a clear error
    (tmp_path / "tokenizer.model").write_bytes((dirs["llama"] / "tokenizer.model").read_bytes())
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, SentencePieceTokenizer)
    assert ours.encode("hello") == [1] + models_["llama"].encode("hello")


def test_no_tokenizer_and_bad_input(tmp_path, byte_level_dirs):
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_tokenizer(tmp_path)
    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0, False))
    unigram.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="Unigram"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ValueError, match="not a valid SentencePiece model"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="expects a str"):
        load_tokenizer(byte_level_dirs["gpt2"]).encode([1, 2])


# --- Malformed files --------------------------------------------------------------------------------


def bytes_to_unicode():
    """GPT-2's table byte -> printable character: printable Latin-1 bytes stand for themselves, the
    others (control characters, space ...) for the characters from U+0100 on, so no token holds a space."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(shifted)}}


def added(i, content, special=True):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": special}


def tiny_spec():
    """A valid byte-level BPE tokenizer.json with every part that minispec reads."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()} | {"ab": 256, "abc": 257, "<s>": 258}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [added(258, "<s>"), added(259, "<|im_end|>")],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r" ?\p{L}+|\p{N}|\s+"}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [258], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [["a", "b"], ["ab", "c"]]},
    }


def test_tiny_spec_is_valid(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(tiny_spec()))
    reference = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in ["abc abd <|im_end|>x 12", *TEXTS]:
        assert load_tokenizer(tmp_path).encode(text) == reference.encode(text).ids


def test_symbols_outside_the_vocab(tmp_path):
    """A symbol missing from the vocab is dropped when unk is no token (the reference would fail on the
    text), and becomes unk when it is one."""
    spec = tiny_spec()
    del spec["model"]["vocab"]["x"]
    spec["model"]["unk_token"] = "<unk>"
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert load_tokenizer(tmp_path).encode("ax", add_special_tokens=False) == [ord("a")]
    spec["model"]["vocab"]["<unk>"] = 300
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert load_tokenizer(tmp_path).encode("ax", add_special_tokens=False) == [ord("a"), 300]


def mutated(change):
    def edit(spec):
        change(spec)
        return spec
    return edit


def pre_tokenizer(n):
    return lambda spec: spec["pre_tokenizer"]["pretokenizers"][n]


NOT_AN_ID = "must be a token id (an integer from 0 to 2^32 - 1), got"
# (what is wrong, the edit of tiny_spec(), what the message says besides the file's path)
MALFORMED_SPECS = [
    ("an array", lambda spec: [spec], "its top level must be an object, got [{"),
    ("no model", mutated(lambda s: s.pop("model")), "model is missing"),
    ("no vocab", mutated(lambda s: s["model"].pop("vocab")), "model.vocab is missing"),
    ("vocab a list", mutated(lambda s: s["model"].update(vocab=list(s["model"]["vocab"]))),
     "model.vocab must be an object, got ['"),
    ("id a string", mutated(lambda s: s["model"]["vocab"].update(abc="257")),
     f"model.vocab['abc'] {NOT_AN_ID} '257'"),
    ("id a boolean", mutated(lambda s: s["model"]["vocab"].update(abc=True)), f"model.vocab['abc'] {NOT_AN_ID} True"),
    ("id negative", mutated(lambda s: s["model"]["vocab"].update(abc=-1)), f"model.vocab['abc'] {NOT_AN_ID} -1"),
    ("id too large", mutated(lambda s: s["model"]["vocab"].update(abc=2**40)), f"model.vocab['abc'] {NOT_AN_ID} 1099511627776"),
    ("id twice", mutated(lambda s: s["model"]["vocab"].update(abc=256)), "model.vocab gives id 256 to both"),
    ("no merges", mutated(lambda s: s["model"].pop("merges")), "model.merges is missing"),
    ("merges integers", mutated(lambda s: s["model"].update(merges=[1, 2])), "model.merges[0] must be a pair of tokens, got 1"),
    ("merge of three", mutated(lambda s: s["model"].update(merges=["a b c"])), "model.merges[0] must be a pair of tokens, got 'a b c'"),
    ("merge of one", mutated(lambda s: s["model"]["merges"].append(["a"])), "model.merges[2] must be a pair of tokens, got ['a']"),
    ("merge outside vocab", mutated(lambda s: s["model"]["merges"].append(["x", "y"])),
     "model.merges[2] ['x', 'y'] makes 'xy', which is not in model.vocab"),
    ("ignore_merges a string", mutated(lambda s: s["model"].update(ignore_merges="yes")),
     "model.ignore_merges must be true or false, got 'yes'"),
    ("unk_token a number", mutated(lambda s: s["model"].update(unk_token=3)), "model.unk_token must be a string, got 3"),
    ("WordPiece", mutated(lambda s: s["model"].update(type="WordPiece")), "model type 'WordPiece' is not BPE"),
    ("normalizer a string", mutated(lambda s: s.update(normalizer="NFC")), "normalizer must be an object, got 'NFC'"),
    ("normalizer unknown", mutated(lambda s: s["normalizer"]["normalizers"].append({"type": "Lowercase"})),
     "normalizer 'Lowercase' is not supported"),
    ("normalizers missing", mutated(lambda s: s["normalizer"].pop("normalizers")), "normalizer.normalizers is missing"),
    ("pre-tokenizer without type", mutated(lambda s: pre_tokenizer(0)(s).pop("type")),
     "pre_tokenizer.pretokenizers[0].type is missing"),
    ("pre-tokenizer unknown", mutated(lambda s: pre_tokenizer(0)(s).update(type="Whitespace")),
     "pre-tokenizer 'Whitespace' is not supported"),
    ("pre-tokenizers an object", mutated(lambda s: s["pre_tokenizer"].update(pretokenizers={})),
     "pre_tokenizer.pretokenizers must be a list, got {}"),
    ("regex a number", mutated(lambda s: pre_tokenizer(0)(s).update(pattern={"Regex": 5})),
     "pre_tokenizer.pretokenizers[0].pattern.Regex must be a string, got 5"),
    ("no pattern", mutated(lambda s: pre_tokenizer(0)(s).update(pattern={})),
     "pre_tokenizer.pretokenizers[0].pattern.String is missing"),
    ("behavior unknown", mutated(lambda s: pre_tokenizer(0)(s).update(behavior="Sideways")),
     "Split behavior 'Sideways' is not supported"),
    ("invert a string", mutated(lambda s: pre_tokenizer(0)(s).update(invert="no")),
     "pre_tokenizer.pretokenizers[0].invert must be true or false, got 'no'"),
    ("type null", mutated(lambda s: pre_tokenizer(1)(s).update(type=None)),
     "pre_tokenizer.pretokenizers[1].type must be a string, got None"),
    ("regex invalid", mutated(lambda s: pre_tokenizer(0)(s).update(pattern={"Regex": "(a"})),
     "tokenizer regex '(a' does not compile"),
    ("added tokens an object", mutated(lambda s: s.update(added_tokens={})), "added_tokens must be a list, got {}"),
    ("added token a string", mutated(lambda s: s["added_tokens"].append("<x>")), "added_tokens[2] must be an object, got '<x>'"),
    ("added id a string", mutated(lambda s: s["added_tokens"][1].update(id="259")),
     f"added_tokens[1].id {NOT_AN_ID} '259'"),
    ("added id negative", mutated(lambda s: s["added_tokens"][1].update(id=-3)), f"added_tokens[1].id {NOT_AN_ID} -3"),
    ("added content a number", mutated(lambda s: s["added_tokens"][1].update(content=7)),
     "added_tokens[1].content must be a string, got 7"),
    ("added content empty", mutated(lambda s: s["added_tokens"][1].update(content="")), "added_tokens[1].content is empty"),
    ("added flag a string", mutated(lambda s: s["added_tokens"][1].update(special="yes")),
     "added_tokens[1].special must be true or false, got 'yes'"),
    ("added id of a vocab token", mutated(lambda s: s["added_tokens"][1].update(id=257)),
     "added_tokens[1] gives id 257 to '<|im_end|>', which is 'abc''s"),
    ("added id twice", mutated(lambda s: s["added_tokens"].append(added(259, "<|im_start|>"))),
     "added_tokens[2] gives id 259 to '<|im_start|>', which is '<|im_end|>''s"),
    ("template id unknown", mutated(lambda s: s["post_processor"]["special_tokens"]["<s>"].update(ids=[9999])),
     "post_processor.special_tokens.<s>.ids[0] is 9999, which is no token's id"),
    ("template token missing", mutated(lambda s: s["post_processor"]["special_tokens"].clear()),
     "post_processor.special_tokens.<s> is missing"),
    ("template item a list", mutated(lambda s: s["post_processor"]["single"].append([])),
     "post_processor.single[2] must be an object, got []"),
    ("post-processor unknown", mutated(lambda s: s["post_processor"].update(type="BertProcessing")),
     "post-processor 'BertProcessing' is not supported"),
]


@pytest.mark.parametrize("edit, message", [case[1:] for case in MALFORMED_SPECS], ids=[case[0] for case in MALFORMED_SPECS])
def test_malformed_tokenizer_json_is_a_one_line_error(tmp_path, edit, message):
    (tmp_path / "tokenizer.json").write_text(json.dumps(edit(copy.deepcopy(tiny_spec()))))
    with pytest.raises(ValueError) as error:
        load_tokenizer(tmp_path)
    assert str(error.value).startswith(f"{tmp_path / 'tokenizer.json'}: ")
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("depth", [300, 480, 490, 495, 500, 2000])
def test_deeply_nested_steps_load_or_are_one_line_errors(tmp_path, depth):
    """Sequences in Sequences: as deep as the JSON parser goes, and no deeper (a RecursionError either way)."""
    spec = json.dumps(tiny_spec())
    step = '{"type": "Sequence", "normalizers": [' * depth + '{"type": "NFC"}' + "]}" * depth
    spec = spec.replace('{"type": "Sequence", "normalizers": [{"type": "NFC"}]}', step, 1)
    (tmp_path / "tokenizer.json").write_text(spec)
    try:
        assert load_tokenizer(tmp_path).encode("abc") == [258, 257]
    except ValueError as error:
        assert str(error).startswith(f"{tmp_path / 'tokenizer.json'}") and "\n" not in str(error)


# (what is wrong, the file and its text, what the message says besides the file's path)
MALFORMED_FILES = [
    ("config an array", "tokenizer_config.json", "[]", "its top level must be an object, got []"),
    ("eos a list", "tokenizer_config.json", '{"eos_token": ["</s>"]}', "eos_token must be a string or an object, got ['</s>']"),
    ("eos without content", "special_tokens_map.json", '{"eos_token": {"lstrip": false}}', "eos_token.content is missing"),
    ("template a number", "tokenizer_config.json", '{"chat_template": 3}', "chat_template must be a string or a list, got 3"),
    ("template list of strings", "tokenizer_config.json", '{"chat_template": ["x"]}', "chat_template[0] must be an object, got 'x'"),
    ("decoder key not an id", "tokenizer_config.json", '{"added_tokens_decoder": {"x": {"content": "<x>"}}}',
     "added_tokens_decoder has key 'x', not a token id"),
    ("decoder without content", "tokenizer_config.json", '{"added_tokens_decoder": {"5": {"special": true}}}',
     "added_tokens_decoder.5.content is missing"),
    ("add_bos a string", "tokenizer_config.json", '{"add_bos_token": "true"}', "add_bos_token must be true or false, got 'true'"),
    ("a billion extra ids", "tokenizer_config.json", '{"extra_ids": 1000000000}', "extra_ids must be an integer from 0 to 1000, got 1000000000"),
    ("not UTF-8", "tokenizer_config.json", b'{"eos_token": "\xff"}', "is not valid JSON"),
    ("nested too deeply", "tokenizer.json", "[" * 100000, "is not valid JSON"),
    ("an integer too long", "tokenizer.json", '{"x": ' + "9" * 5000 + "}", "is not valid JSON"),
    ("template not UTF-8", "chat_template.jinja", b"\xff{{ messages }}", "is not UTF-8 text"),
]


@pytest.mark.parametrize("name, text, message", [case[1:] for case in MALFORMED_FILES],
                         ids=[case[0] for case in MALFORMED_FILES])
def test_malformed_tokenizer_files_are_one_line_errors(tmp_path, name, text, message):
    (tmp_path / "tokenizer.json").write_text(json.dumps(tiny_spec()))
    (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as error:
        load_tokenizer(tmp_path)
    assert str(error.value).startswith(str(tmp_path / name))
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("pattern", [r"(a+)+$", r"(?:a|aa)*$", r"((ab)*c)+", r"(a?){2,}", r"(?:[ab]+\s)*x"])
def test_exponential_regex_is_refused(tmp_path, pattern):
    """Oniguruma backtracks on these for ages, until it gives up and the reference panics ((a+)+$ on 25
    characters, (?:a|aa)*$ on 1000): the file is refused when it is loaded, at once."""
    spec = tiny_spec()
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": pattern}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    start = time.perf_counter()
    with pytest.raises(ValueError, match="repeats a group holding a quantifier or an alternation"):
        load_tokenizer(tmp_path)
    assert time.perf_counter() - start < 2


@pytest.mark.parametrize("pattern", [
    QWEN2_PATTERN, LLAMA3_PATTERN, r"(ab)+", r"(?i:'s|'t)?x", r"[(a+)+]+", r"\(a+\)+", r"(?!\s+)a", r"(a|b)c+",
    r"(?:\p{L}\p{N})+", r"[[a-z]+]+",
    (  # GPT-4o's (o200k)
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
])
def test_regexes_that_repeat_no_ambiguous_group_are_accepted(tmp_path, pattern):
    text = "(a+)+ aaaaaaaaaaaaaaaaaaaaaaaaaaab it's 12345 \n\n  x"
    ours, reference = split_tokenizers(tmp_path, pattern)
    start = time.perf_counter()
    assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    assert time.perf_counter() - start < 1
    assert ours.encode(text) == reference.encode(text).ids


@pytest.mark.parametrize("kind, name", [("byte_level", n) for n in BYTE_LEVEL] + [("sentencepiece", "llama"),
                                                                               ("sentencepiece", "t5")])
def test_incremental_decoding_joins_to_the_whole_text(request, kind, name):
    """Token ids pushed one at a time, and in steps of 2-5 as accepted guesses arrive: the pieces join to
    the decoded whole, and no piece ends in a broken character, even where a character's UTF-8 bytes
    span several tokens (the emoji and CJK text here, rare in the training text) or a piece's text
    depends on the one before (SentencePiece's leading space)."""
    dirs = request.getfixturevalue(f"{kind}_dirs")
    tokenizer = load_tokenizer((dirs if kind == "byte_level" else dirs[0])[name], "t5" if name == "t5" else "")
    text = " ".join(TEXTS[:4]) + " 🦜🧬 ẞ"
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    if name != "t5":  # (its unigram model has no byte fallback: unknown characters are <unk>)
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some character spans tokens
    for sizes in ([1], [2, 3, 5, 1, 4]):
        decoder, pieces, start, step = IncrementalDecoder(tokenizer), [], 0, 0
        while start < len(ids):
            size = sizes[step % len(sizes)]
            pieces.append(decoder.push(ids[start:start + size]))
            start, step = start + size, step + 1
        pieces.append(decoder.flush())
        assert "".join(pieces) == whole
        assert not any("\ufffd" in piece for piece in pieces)
