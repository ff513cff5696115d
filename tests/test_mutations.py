"""Mutation tests over real files' headers (issue 66): the tiny checkpoints' config.json, safetensors
header and tokenizer.json, and a tiny GGUF's metadata and tensor infos, each changed by Hypothesis; and
embeddings padded past their tokenizer. Every
case must load and generate (as the reference does, where it loads the same files cleanly) or end in one
ValueError of one line: never another exception, never a hang, nothing left in the weights folder, no
model or open file kept once the case is over.

A short fixed search runs with the suite; a long one by hand, e.g.
    MINISPEC_HOSTILE_EXAMPLES=5000 python -m pytest -q -s -p no:cacheprovider tests/test_mutations.py -k mutated
(-s lets the counts of cases run and refused through pytest's capture, for the report).
"""

import collections
import copy
import gc
import json
import math
import os
import shutil
import signal
import struct
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGUFValueType as V  # test-only: the GGUF files' writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import minispec
from conftest import make_reference, save_reference
from minispec.models.base import CachedLM

EXAMPLES = int(os.environ.get("MINISPEC_HOSTILE_EXAMPLES", "50"))
LONG = "MINISPEC_HOSTILE_EXAMPLES" in os.environ
SEARCH = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not LONG, print_blob=LONG,
                  suppress_health_check=list(HealthCheck))
SECONDS = 60  # a case that takes longer hangs (a tiny model loads and generates in well under a second idle)
PROMPT = [5, 17, 33, 8, 61, 40, 12, 77, 3, 50, 21, 9]  # longer than the small sliding windows drawn below
NEW_TOKENS = 4
DELETE = object()  # a mutation that removes the key

HOSTILE = st.one_of(
    st.sampled_from([None, True, False, "", "x", "llama", [], {}, [1], {"a": 1}, 0.5, -0.0, 1e-30, 1e30,
                     math.nan, math.inf, -math.inf, -1, 0, 1, 2, 3, 95, 96, 97, 2**31 - 1, 2**31, 2**63, 10**30]),
    st.integers(-3, 40), st.floats(), st.text(max_size=6), st.lists(st.integers(-2, 100), max_size=3),
)


class Hang(Exception):
    pass


@contextmanager
def bounded(seconds):
    def alarm(signum, frame):
        raise Hang(f"no answer in {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def weights_folder(monkeypatch):
    """An empty weights folder (where GGUF files are converted) for one case."""
    with tempfile.TemporaryDirectory() as folder:
        monkeypatch.setenv("MINISPEC_WEIGHTS", folder)
        yield Path(folder)


COUNTS = collections.Counter()  # (test, "ran" or "refused"): what the search met, for the long run's report


class Refused(str):
    """A case's clean refusal: the ValueError's message (not the error, whose traceback would keep the model)."""


def outcome(source, weights, prompt=PROMPT):
    """The tokens minispec generates greedily from checkpoint `source`, or Refused(why) where it refuses
    the checkpoint (which must leave the weights folder as it was) or the prompt (the model loaded)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
    model = None
    try:
        with bounded(SECONDS):
            model = minispec.load(source, device="cpu")
            tokens = minispec.generate(model, prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, gamma=1).tokens
        COUNTS[test, "ran"] += 1
        return tokens
    except ValueError as error:
        message = Refused(error)
    assert message.strip() and "\n" not in message and "Traceback" not in message, f"not one line: {message!r}"
    if model is None:
        assert list(weights.iterdir()) == [], f"refused ({message}) but left {list(weights.iterdir())}"
    COUNTS[test, "refused"] += 1
    return message


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    if LONG:  # past pytest's capture: the counts go into the closing note
        print("\n".join(f"{test}: {kind} {n}" for (test, kind), n in sorted(COUNTS.items())), file=sys.__stderr__)


def open_files():
    return len(os.listdir("/proc/self/fd"))


def models_alive():
    gc.collect()
    return sum(issubclass(type(thing), CachedLM) for thing in gc.get_objects())


@pytest.fixture
def nothing_kept():
    """Whatever the cases did, no model and no open file outlives them."""
    models, files = models_alive(), open_files()
    yield
    assert models_alive() <= models, "a case's model is still referenced"
    assert open_files() <= files, "a case left files open"


def copy_of(directory, into):
    target = Path(tempfile.mkdtemp(dir=into))
    shutil.copytree(directory, target, dirs_exist_ok=True)
    return target


def fresh(value):
    """A value of its own: Hypothesis may hand one object to two mutations, which would nest it in itself."""
    return value if value is DELETE else copy.deepcopy(value)


def mutate(table, mutations):
    for key, value in mutations:
        value = fresh(value)
        table.pop(key, None) if value is DELETE else table.__setitem__(key, value)
    return table


# ---------------------------------------------------------------------------------------------
# config.json: minispec reads each family's keys as transformers does

KINDS = ("llama", "qwen2", "gpt2", "t5_v1_1")
# Keys a family's reference reads (or that another family reads) that the tiny configs may not carry.
EXTRA_KEYS = ["model_type", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "head_dim",
              "attention_bias", "mlp_bias", "rope_theta", "rope_scaling", "rope_parameters", "num_key_value_heads",
              "tie_word_embeddings", "decoder_start_token_id", "bos_token_id", "n_inner", "scale_decoder_outputs"]
CONFIG_VALUES = st.one_of(
    st.just(DELETE), HOSTILE, st.integers(1, 16), st.sampled_from(["llama", "mistral", "qwen2", "gpt2", "t5"]),
    st.lists(st.sampled_from(["full_attention", "sliding_attention"]), min_size=1, max_size=3),
    st.fixed_dictionaries({"rope_type": st.sampled_from(["default", "linear", "yarn", "llama3", "dynamic"]),
                           "factor": st.sampled_from([0.5, 1.0, 2.0, -1.0, "2"]), "rope_theta": HOSTILE}),
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {kind: save_reference(make_reference(kind), tmp_path_factory.mktemp(kind)) for kind in KINDS}


def reference_tokens(directory, tokens):
    """The reference's greedy choice after the prompt and each of `tokens` but the last (one forward, as
    its model code reads the config: no generate, whose cache cuts a Llama's keys to a sliding_window that
    its attention ignores), or None where transformers does not run the checkpoint cleanly: an error, or
    weights it would draw at random."""
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
        if any(info.get(key) for key in ("missing_keys", "mismatched_keys")):
            return None
        with torch.no_grad():
            logits = model.eval()(torch.tensor([PROMPT + tokens[:-1]]), use_cache=False).logits[0, len(PROMPT) - 1:]
    except Exception:  # the reference failing is no finding: any clean minispec answer stands
        return None
    return logits.argmax(-1).tolist()


# Fields a family's reference reads differently from another's (issue 66, class 4): a window that the
# reference ignores, or one it applies; each case checked against the reference's own logits.
AS_THE_REFERENCE = {
    "llama ignores sliding_window": ("llama", {"sliding_window": 4}),
    "llama ignores layer_types": ("llama", {"sliding_window": 4, "layer_types": ["sliding_attention"] * 2}),
    "mistral slides every layer": ("llama", {"model_type": "mistral", "sliding_window": 4}),
    "mistral by layer_types, as Ministral": ("llama", {"model_type": "mistral", "sliding_window": 4,
                                                       "layer_types": ["sliding_attention", "full_attention"]}),
    "mistral sliding_window absent": ("llama", {"model_type": "mistral", "layer_types": ["sliding_attention"] * 2}),
    "qwen2 without use_sliding_window": ("qwen2", {"sliding_window": 4, "layer_types": None, "max_window_layers": 0}),
    "qwen2 from max_window_layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "layer_types": None,
                                               "max_window_layers": 1}),
    "qwen2 max_window_layers absent": ("qwen2", {"use_sliding_window": True, "sliding_window": 4,
                                                 "layer_types": None, "max_window_layers": DELETE}),
    "rope_scaling replaces rope_parameters whole": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                                              "rope_theta": 500.0}),
    "rope_type before type": ("llama", {"rope_scaling": {"rope_type": "linear", "type": "default", "factor": 2.0}}),
    "qwen2 by layer_types": ("qwen2", {"use_sliding_window": True, "sliding_window": 4,
                                       "layer_types": ["full_attention", "sliding_attention"]}),
}
REFUSED = {  # values the reference accepts, or fails on later, that minispec refuses naming them
    "qwen2 use_sliding_window 'yes'": ("qwen2", {"use_sliding_window": "yes"},
                                       "use_sliding_window must be true or false, got 'yes'"),
    "qwen2 max_window_layers -1": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "layer_types": None,
                                             "max_window_layers": -1}, "max_window_layers must be .*, got -1"),
    "qwen2 sliding layers without a window": ("qwen2", {"layer_types": ["sliding_attention"] * 2},
                                              "no sliding_window is in use"),
    "t5 decoder_start_token_id beyond the vocabulary": ("t5_v1_1", {"decoder_start_token_id": 96},
                                                        "decoder_start_token_id 96 is outside the vocabulary"),
    "t5 relative_attention_max_distance 1": ("t5_v1_1", {"relative_attention_max_distance": 1},
                                             "relative_attention_num_buckets 8 and relative_attention_max_distance 1"),
    "t5 relative_attention_num_buckets 2": ("t5_v1_1", {"relative_attention_num_buckets": 2},
                                            "relative_attention_num_buckets 2 and"),
}


def edited(checkpoints, kind, changes, into):
    """A copy of the tiny `kind` checkpoint with config.json `changes` (DELETE removes a key), and no
    generation_config.json (whose token ids would override config.json's, in both implementations)."""
    directory = copy_of(checkpoints[kind], into)
    (directory / "generation_config.json").unlink()
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(mutate(config, changes.items())))
    return directory


@pytest.mark.parametrize("case", AS_THE_REFERENCE)
def test_config_read_as_the_reference_reads_it(case, checkpoints, tmp_path):
    kind, changes = AS_THE_REFERENCE[case]
    directory = edited(checkpoints, kind, changes, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    model = minispec.load(directory, device="cpu")
    model.setup_caches(1, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.prefill(torch.tensor([PROMPT]))[0],
                                   reference(torch.tensor([PROMPT])).logits[0], atol=1e-3, rtol=0)


def test_t5_starts_from_bos_without_decoder_start_token_id(checkpoints, tmp_path):
    directory = edited(checkpoints, "t5_v1_1", {"decoder_start_token_id": DELETE, "bos_token_id": 7}, tmp_path)
    reference = transformers.T5ForConditionalGeneration.from_pretrained(directory).eval()
    expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
    assert expected[0] == 7
    model = minispec.load(directory, device="cpu")
    assert model.config.decoder_start_token_id == 7
    assert minispec.generate(model, PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True).tokens == expected[1:]


@pytest.mark.parametrize("case", REFUSED)
def test_config_values_refused(case, checkpoints, tmp_path):
    kind, changes, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        minispec.load(edited(checkpoints, kind, changes, tmp_path), device="cpu")


@given(kind=st.sampled_from(KINDS), data=st.data())
@SEARCH
def test_mutated_config(kind, data, checkpoints, tmp_path, monkeypatch, nothing_kept):
    config = json.loads((checkpoints[kind] / "config.json").read_text())
    keys = st.sampled_from(sorted(set(config) | set(EXTRA_KEYS)))
    mutations = data.draw(st.lists(st.tuples(keys, CONFIG_VALUES), min_size=1, max_size=3), "mutations")
    directory = copy_of(checkpoints[kind], tmp_path)
    (directory / "config.json").write_text(json.dumps(mutate(config, mutations)))
    with weights_folder(monkeypatch) as weights:
        tokens = outcome(directory, weights)
    if isinstance(tokens, list) and not kind.startswith("t5"):
        expected = reference_tokens(directory, tokens)
        assert expected is None or tokens == expected, f"minispec {tokens}, the reference {expected}"


# ---------------------------------------------------------------------------------------------
# model.safetensors: its JSON header and the length before it

DTYPES = ["F32", "F16", "BF16", "F64", "I8", "U8", "I32", "I64", "BOOL", "F8_E4M3", "Q4", "", 3, None]
HEADER_MUTATIONS = st.one_of(
    st.tuples(st.just("dtype"), st.integers(0, 100), st.sampled_from(DTYPES)),
    st.tuples(st.just("shape"), st.integers(0, 100), st.one_of(
        HOSTILE, st.lists(st.one_of(st.integers(-1, 70), st.sampled_from([2**31, 2**62, 2**64, "32", 32.0])),
                          max_size=3))),
    st.tuples(st.just("data_offsets"), st.integers(0, 100), st.one_of(
        HOSTILE, st.lists(st.one_of(st.integers(-8, 70000), st.sampled_from([2**63, 2**64, 1.5])), max_size=3))),
    st.tuples(st.just("entry"), st.integers(0, 100), HOSTILE),  # a whole tensor entry replaced or removed
    st.tuples(st.just("__metadata__"), st.just(0), HOSTILE),
    st.tuples(st.just("length"), st.just(0), st.sampled_from([-9, -1, 1, 7, 2**20, 2**63])),
    st.tuples(st.just("byte"), st.integers(0, 10**6), st.integers(0, 255)),
)


def mutated_safetensors(data, mutations):
    (length,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8:8 + length]), data[8 + length:]
    names = sorted(name for name in header if name != "__metadata__")
    raw, shift = None, 0
    for kind, index, value in mutations:
        name, value = names[index % len(names)], fresh(value)
        if kind in ("dtype", "shape", "data_offsets") and isinstance(header.get(name), dict):
            header[name][kind] = value
        elif kind == "entry":
            header.pop(name, None) if value is None else header.__setitem__(name, value)
        elif kind == "__metadata__":
            header[kind] = value
        elif kind == "length":
            shift = value
        elif kind == "byte":
            raw = (index, value)
    text = bytearray(json.dumps(header).encode())
    if raw:
        text[raw[0] % len(text)] = raw[1]
    return struct.pack("<Q", max(0, min(len(text) + shift, 2**64 - 1))) + bytes(text) + body


@given(kind=st.sampled_from(KINDS), mutations=st.lists(HEADER_MUTATIONS, min_size=1, max_size=2))
@SEARCH
def test_mutated_safetensors_header(kind, mutations, checkpoints, tmp_path, monkeypatch, nothing_kept):
    directory = copy_of(checkpoints[kind], tmp_path)
    weights_file = directory / "model.safetensors"
    weights_file.write_bytes(mutated_safetensors(weights_file.read_bytes(), mutations))
    with weights_folder(monkeypatch) as weights:
        outcome(directory, weights)


# ---------------------------------------------------------------------------------------------
# tokenizer.json

TOKENIZER_PATHS = [
    ("model", "type"), ("model", "vocab"), ("model", "merges"), ("model", "unk_token"), ("model", "byte_fallback"),
    ("model", "ignore_merges"), ("model", "vocab", "the"), ("model", "vocab", "Ġ"), ("model", "merges", 0),
    ("model", "merges", 0, 0), ("added_tokens",), ("added_tokens", 0), ("added_tokens", 0, "id"),
    ("added_tokens", 0, "content"), ("added_tokens", 0, "special"), ("normalizer",), ("pre_tokenizer",),
    ("pre_tokenizer", "type"), ("pre_tokenizer", "add_prefix_space"), ("post_processor",), ("decoder",),
    ("decoder", "type"), ("truncation",), ("padding",), ("version",),
]
TOKENIZER_VALUES = st.one_of(
    st.just(DELETE), HOSTILE, st.sampled_from(["BPE", "WordPiece", "Unigram", "ByteLevel", "Metaspace", "Sequence"]),
    st.fixed_dictionaries({"type": st.sampled_from(["ByteLevel", "Split", "Metaspace", "NFC", "Sequence", "Nope"])}),
    st.lists(st.sampled_from(["t h", "th e", "a", "Ġ Ġ", "x y z", ""]), max_size=3),
)


def set_path(table, path, value):
    """table with the value at `path` (keys and list indices) replaced; a path that is not there is no change."""
    *inner, last = path
    value = fresh(value)
    for key in inner:
        if isinstance(table, dict) and key in table or isinstance(table, list) and isinstance(key, int) and key < len(table):
            table = table[key]
        else:
            return
    if isinstance(table, dict):
        table.pop(last, None) if value is DELETE else table.__setitem__(last, value)
    elif isinstance(table, list) and isinstance(last, int) and last < len(table):
        table.pop(last) if value is DELETE else table.__setitem__(last, value)


@given(mutations=st.lists(st.tuples(st.sampled_from(TOKENIZER_PATHS), TOKENIZER_VALUES), min_size=1, max_size=2))
@SEARCH
def test_mutated_tokenizer(mutations, llama_with_tokenizer, tmp_path, monkeypatch, nothing_kept):
    directory = copy_of(llama_with_tokenizer, tmp_path)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    for path, value in mutations:
        set_path(tokenizer, path, value)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    with weights_folder(monkeypatch) as weights:
        outcome(directory, weights, prompt="the cat sat, Grüße 東京 😀")


# ---------------------------------------------------------------------------------------------
# GGUF: metadata values, and the tensor infos and counts of the file's header

GGUF_KEYS = ["llama.context_length", "llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
             "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.layer_norm_rms_epsilon",
             "llama.rope.freq_base", "llama.rope.dimension_count", "llama.attention.key_length",
             "llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.rope.scaling.original_context_length",
             "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "general.architecture", "general.file_type",
             "tokenizer.ggml.model", "tokenizer.ggml.tokens"]
GGUF_VALUES = st.one_of(
    st.tuples(st.sampled_from([0, 1, 2, 4, 8, 31, 32, 95, 96, 2**31, 2**32 - 1]), st.just(V.UINT32)),
    st.tuples(st.integers(-2**31, 2**31 - 1), st.just(V.INT32)),
    st.tuples(st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1]), st.just(V.UINT64)),
    st.tuples(st.floats(width=32), st.just(V.FLOAT32)),
    st.tuples(st.booleans(), st.just(V.BOOL)),
    st.tuples(st.sampled_from(["", "llama", "qwen2", "gpt2", "yarn", "linear", "none", "é"]), st.just(V.STRING)),
    st.tuples(st.lists(st.integers(0, 100), max_size=3), st.just(V.ARRAY)),
)
TENSORS = ["token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output_norm.weight", "output.weight"]
INFO_FIELDS = st.one_of(  # (what, which tensor, new value)
    st.tuples(st.just("n_dims"), st.sampled_from(TENSORS), st.sampled_from([0, 1, 3, 4, 5, 2**31, 2**32 - 1])),
    st.tuples(st.just("dim"), st.sampled_from(TENSORS), st.sampled_from([0, 1, 31, 33, 2**31, 2**63, 2**64 - 1])),
    st.tuples(st.just("type"), st.sampled_from(TENSORS), st.sampled_from([1, 2, 8, 12, 14, 30, 39, 99, 2**32 - 1])),
    st.tuples(st.just("offset"), st.sampled_from(TENSORS), st.sampled_from([0, 1, 32, 2**40, 2**63, 2**64 - 1])),
    st.tuples(st.just("header"), st.sampled_from([4, 8, 16]), st.sampled_from([0, 1, 2, 3, 4, 2**31, 2**63])),
)


@pytest.fixture(scope="module")
def gguf_llama():
    from test_gguf import model_to_gguf

    model = make_reference("llama")

    def write(path, metadata=()):
        return model_to_gguf(model, path, metadata=metadata)
    return write


def mutated_infos(data, mutations):
    """A GGUF file's bytes with fields of its header (version, tensor and value counts: at 4, 8 and 16)
    or of tensor infos (each: name, n_dims u32, dims u64 each, type u32, offset u64) replaced."""
    data = bytearray(data)
    for what, where, value in mutations:
        if what == "header":
            size = 4 if where == 4 else 8
            data[where:where + size] = (value % 2**(8 * size)).to_bytes(size, "little")
            continue
        name = where.encode()
        at = data.find(struct.pack("<Q", len(name)) + name)
        if at < 0:  # an earlier mutation moved it out of reach
            continue
        at += 8 + len(name)
        (n_dims,) = struct.unpack_from("<I", data, at)
        field_at, size = {"n_dims": (at, 4), "dim": (at + 4, 8), "type": (at + 4 + 8 * n_dims, 4),
                          "offset": (at + 8 + 8 * n_dims, 8)}[what]
        data[field_at:field_at + size] = value.to_bytes(size, "little")
    return bytes(data)


@given(metadata=st.dictionaries(st.sampled_from(GGUF_KEYS), GGUF_VALUES, max_size=2),
       infos=st.lists(INFO_FIELDS, max_size=2))
@SEARCH
def test_mutated_gguf(metadata, infos, gguf_llama, tmp_path, monkeypatch, nothing_kept):
    path = gguf_llama(Path(tempfile.mkdtemp(dir=tmp_path)) / "model.gguf", metadata)
    path.write_bytes(mutated_infos(path.read_bytes(), infos))
    with weights_folder(monkeypatch) as weights:
        outcome(path, weights)


def test_the_harness_tells_a_traceback_from_a_clean_error(checkpoints, tmp_path, monkeypatch):
    """outcome() itself: a clean refusal returns, anything else fails the case."""
    directory = copy_of(checkpoints["llama"], tmp_path)
    (directory / "config.json").write_text(json.dumps({**json.loads((directory / "config.json").read_text()),
                                                       "hidden_size": "32"}))
    with weights_folder(monkeypatch) as weights:
        assert isinstance(outcome(directory, weights), Refused)
        monkeypatch.setattr(minispec, "load", lambda *args, **kwargs: [][1])
        with pytest.raises(IndexError):
            outcome(directory, weights)


# ---------------------------------------------------------------------------------------------
# Weights that are not numbers (issue 66, class 7): refused naming the tensor, not decoded into nonsense

@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5_v1_1", "gguf"])
def test_weights_that_are_not_numbers(kind, value, checkpoints, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    if kind == "gguf":
        from test_gguf import model_to_gguf

        model = make_reference("llama")
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight[3, 5] = value
        source, names = model_to_gguf(model, tmp_path / "model.gguf"), ("blk.1.ffn_up", "layers.1.mlp.up_proj")
    else:
        source = copy_of(checkpoints[kind], tmp_path)
        weights = load_file(source / "model.safetensors")
        name = sorted(weights)[len(weights) // 2]
        weights[name][(0,) * weights[name].dim()] = value
        save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
        names = (name,)
    with weights_folder(monkeypatch) as folder:
        result = outcome(source, folder)
    assert isinstance(result, Refused) and any(name in result for name in names), result


@given(kind=st.sampled_from(KINDS), data=st.data())
@SEARCH
def test_a_weight_anywhere_that_is_not_a_number_is_refused_naming_it(kind, data, checkpoints, tmp_path, monkeypatch,
                                                                     nothing_kept):
    """The same at any tensor, any position, in any float dtype the file may hold."""
    from safetensors.torch import load_file

    source = copy_of(checkpoints[kind], tmp_path)
    weights = load_file(source / "model.safetensors")
    name = data.draw(st.sampled_from(sorted(weights)), "tensor")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), "dtype")
    tensor = weights[name].to(dtype)
    tensor.view(-1)[data.draw(st.integers(0, tensor.numel() - 1), "position")] = data.draw(
        st.sampled_from([math.nan, math.inf, -math.inf]), "value")
    save_file({**weights, name: tensor}, source / "model.safetensors", metadata={"format": "pt"})
    with weights_folder(monkeypatch) as folder:
        result = outcome(source, folder)
    assert isinstance(result, Refused) and name in result, (name, result)


# ---------------------------------------------------------------------------------------------
# An embedding padded past its tokenizer (class 8), by any number of rows holding anything: the loader
# cuts it to the tokenizer's ids, so it decodes exactly what the unpadded checkpoint decodes.

PADDING_VALUES = st.sampled_from([0.0, 1.0, -1.0, 1e4, -1e4, 3e38])


@pytest.fixture(scope="module")
def unpadded(tmp_path_factory):
    """A tiny llama whose 64 rows are its letters tokenizer's ids, its tensors, and its tokens (greedy
    and sampled)."""
    from test_vocab import IDS, PROMPT, letters_tokenizer

    reference = make_reference("llama")
    directory = save_reference(reference, tmp_path_factory.mktemp("unpadded"))
    config = json.loads((directory / "config.json").read_text())
    tensors = {name: tensor[:IDS].clone() if name in ("model.embed_tokens.weight", "lm_head.weight") else tensor
               for name, tensor in reference.state_dict().items()}
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": IDS}))
    save_file(tensors, directory / "model.safetensors")
    letters_tokenizer(directory, IDS)
    model = minispec.load(directory)
    tokens = [minispec.generate(model, PROMPT, max_new_tokens=8, ignore_eos=True, **sampling).tokens
              for sampling in ({}, {"temperature": 1.0, "seed": 0})]
    return directory, config, tensors, tokens


@given(rows=st.integers(1, 200), value=PADDING_VALUES, noise=st.booleans())
@SEARCH
def test_padded_past_the_tokenizer_decodes_as_unpadded(rows, value, noise, unpadded, tmp_path):
    from test_vocab import IDS, PROMPT

    directory, config, tensors, expected = unpadded
    padded = copy_of(directory, tmp_path)
    generator = torch.Generator().manual_seed(rows)
    grown = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        pad = torch.full((rows, tensors[name].shape[1]), value)
        grown[name] = torch.cat([tensors[name], pad + torch.randn(pad.shape, generator=generator) if noise else pad])
    (padded / "config.json").write_text(json.dumps({**config, "vocab_size": IDS + rows}))
    save_file({**tensors, **grown}, padded / "model.safetensors")
    model = minispec.load(padded)
    for sampling, tokens in zip(({}, {"temperature": 1.0, "seed": 0}), expected):
        assert minispec.generate(model, PROMPT, max_new_tokens=8, ignore_eos=True, **sampling).tokens == tokens
