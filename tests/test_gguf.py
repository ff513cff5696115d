"""GGUF import: dequantization against the `gguf` package's reference, tiny llama/qwen2/qwen3 models
written the way llama.cpp's converter writes them and imported back (logits against transformers),
the rebuilt tokenizer against the original, and clear errors for bad files."""

import copy
import json
import math
import os
import subprocess
import sys

import gguf  # test-only: writes the files and holds the reference dequantizers
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, GGUFWriter, TokenType, quants
from safetensors.torch import load_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

import minispec
from conftest import TINY_CONFIGS, gemma_init, make_reference, spread_init
from minispec.loading import gguf as minigguf
from minispec.loading.checkpoint import load_model
from minispec.loading.gguf import convert_gguf, dequantize, llama3_rope_scaling, read_gguf, stored_form
from minispec.loading.checkpoint import load_tokenizer
from minispec import native
from minispec.models import quant
from minispec.models.llama import convert_hf_weights


def write_gguf(path, arch, tensors, setup=lambda writer: None):
    """tensors: {name: (array, ggml type or None)}; arrays are floats, or raw uint8 blocks of a quantized type."""
    writer = GGUFWriter(str(path), arch)
    setup(writer)
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------
# Dequantization

QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # gguf has no quantizer for these: random blocks with sane scales
RMS_ERROR = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 0.05, Q.Q5_1: 0.05, Q.Q4_0: 0.1, Q.Q4_1: 0.1}
SHAPE = (2, 3, 512)  # three dims, to check that GGUF's innermost-first dims are reversed


def random_k_blocks(qtype, n_blocks, rng):
    """Random blocks whose largest scale multiplier is where llama.cpp's quantizers put it: 63 for
    Q4_K/Q5_K's 6-bit scales and mins (sub-block 0's here), -128 for Q6_K's signed 8-bit ones."""
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, size=(n_blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        blocks[:, -2:] = scales[:, :2]  # d is last
        blocks[:, 193:208] = np.maximum(blocks[:, 193:208].view(np.int8), -127).view(np.uint8)
        blocks[:, 192] = 0x80
    else:
        blocks[:, :4] = scales  # d, dmin come first
        blocks[:, 4] |= 0x3F  # scale 0
        blocks[:, 8] |= 0x3F  # min 0
    return blocks


@pytest.fixture(scope="module")
def quantized_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    original = rng.standard_normal(SHAPE).astype(np.float32)
    tensors = {qtype.name: (quants.quantize(original, qtype), None if qtype in (Q.F32, Q.F16) else qtype)
               for qtype in QUANTIZABLE}
    n_blocks = math.prod(SHAPE) // 256
    for qtype in K_QUANTS:
        tensors[qtype.name] = (random_k_blocks(qtype, n_blocks, rng).reshape(*SHAPE[:-1], -1), qtype)
    path = write_gguf(tmp_path_factory.mktemp("quants") / "quants.gguf", "llama", tensors)
    return path, original, tensors


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda q: q.name)
def test_dequantize_matches_reference(quantized_file, qtype):
    path, original, tensors = quantized_file
    _, read = read_gguf(path)
    tensor = read[qtype.name]
    assert tensor.type == qtype.name and tensor.shape == SHAPE
    ours = dequantize(tensor).float()
    reference = torch.from_numpy(quants.dequantize(tensors[qtype.name][0], qtype).astype(np.float32))
    assert ours.shape == SHAPE
    assert torch.equal(ours, reference.reshape(SHAPE))  # bit-exact against ggml's reference
    if qtype in RMS_ERROR:  # and close to the floats it was quantized from
        error = (ours - torch.from_numpy(original)).pow(2).mean().sqrt() / original.std()
        assert error <= RMS_ERROR[qtype]


@pytest.mark.parametrize("qtype", [q for q in QUANTIZABLE + K_QUANTS if q not in (Q.F32, Q.F16, Q.BF16)],
                         ids=lambda q: q.name)
def test_kept_quantized_dequantizes_bit_exactly(quantized_file, qtype, monkeypatch):
    """Each quantized type kept quantized (int8 for Q8_0, Q5_x, Q6_K; int4 for Q4_x) gives back exactly
    what the dequantizer gives, also when converted in several chunks."""
    _, read = read_gguf(quantized_file[0])
    tensor = read[qtype.name]
    monkeypatch.setattr(minigguf, "CHUNK_BLOCKS", 5)  # 12 or 48 blocks: chunks of 5
    parts = stored_form(tensor)
    assert parts["qweight"].dtype == (torch.uint8 if qtype.name.startswith("Q4") else torch.int8)
    assert torch.equal(quant.dequantize(parts), dequantize(tensor).reshape(SHAPE[0], -1))


@pytest.mark.skipif(not native.available(), reason="minispec's CPU kernel cannot be built here")
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_k_quants_kept_in_two_levels(quantized_file, qtype, monkeypatch):
    """A K-quant layer for minispec's CPU kernel keeps its scales as int8 multiples of each super-block's
    step (fewer bytes a step), with the outputs of the float32 scales bit for bit."""
    parts = stored_form(read_gguf(quantized_file[0])[1][qtype.name])
    layer = (quant.Int4Linear if quant.is_int4(parts) else quant.Int8Linear)(parts)
    monkeypatch.setattr(native, "two_level", lambda values, group: None)
    one_level = (quant.Int4Linear if quant.is_int4(parts) else quant.Int8Linear)(parts)
    assert layer.steps is not None and one_level.steps is None
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(layer(x), one_level(x))


def test_dequantize_in_chunks(quantized_file, monkeypatch):
    path, _, tensors = quantized_file
    _, read = read_gguf(path)
    whole = dequantize(read["Q4_K"])
    monkeypatch.setattr(minigguf, "CHUNK_BLOCKS", 5)  # 12 blocks: chunks of 5, 5, 2
    assert torch.equal(dequantize(read["Q4_K"]), whole)


def test_custom_alignment(tmp_path):
    first, second = np.arange(3, dtype=np.float32), np.arange(5, dtype=np.float32) + 10  # 12 bytes: padding needed
    path = write_gguf(tmp_path / "aligned.gguf", "llama", {"a": (first, None), "b": (second, None)},
                      lambda writer: writer.add_custom_alignment(64))
    metadata, tensors = read_gguf(path)
    assert metadata["general.alignment"] == 64
    assert dequantize(tensors["b"]).tolist() == second.tolist()
    assert tensors["b"].data.storage_offset() % 64 == 0


# ---------------------------------------------------------------------------------------------
# Models written as llama.cpp's convert_hf_to_gguf.py writes them

def permute(weight, n_head):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (rotate-half rows -> interleaved pairs)."""
    heads = weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
    return heads.swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_freqs(head_dim, theta, scaling):
    """llama.cpp's convert_hf_to_gguf.py: Llama 3 rope scaling becomes per-frequency divisors."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            out.append(1)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def model_to_gguf(model, path, qtype=Q.F32, vocab=None, extra_tensors=(), metadata=()):
    """Write a transformers llama/qwen2/qwen3/gemma3 model like llama.cpp does; `vocab` adds tokenizer metadata,
    `metadata` ({key: (value, GGUFValueType)}) replaces or adds values last."""
    config, arch = model.config, model.config.model_type.removesuffix("_text")
    gemma = arch == "gemma3"  # RoPE by layer type, the global layers' in the file
    rope = config.rope_parameters["full_attention"] if gemma else config.rope_parameters
    theta = rope["rope_theta"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    tensors = {}
    for hf_name, weight in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "llama" and "q_proj" in hf_name:
            weight = permute(weight, config.num_attention_heads)
        if arch == "llama" and "k_proj" in hf_name:
            weight = permute(weight, config.num_key_value_heads)
        if gemma and hf_name.endswith("norm.weight"):  # stored as the 1 + w Gemma's norms scale by
            weight = weight + 1
        array = weight.numpy()
        # llama.cpp keeps 1-D tensors (norms, biases) in F32 whatever the file type.
        kind = qtype if weight.dim() == 2 else Q.F32
        data = quants.quantize(array, kind)
        tensors[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = (data, None if kind == Q.F32 else kind)
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = (llama3_rope_freqs(head_dim, theta, config.rope_parameters), None)
    tensors.update(extra_tensors)

    def setup(writer):
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_freq_base(theta)
        writer.add_rope_dimension_count(head_dim)
        if arch in ("qwen3", "gemma3"):  # llama.cpp writes their head size, which need not be hidden_size / heads
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        if gemma:
            writer.add_sliding_window(config.sliding_window)
            if config.final_logit_softcapping:
                writer.add_final_logit_softcapping(config.final_logit_softcapping)
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        writer.add_file_type(int(qtype))
        if config.rope_parameters.get("rope_type") == "yarn":  # llama.cpp writes Qwen2's YaRN this way
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(config.rope_parameters["factor"])
            writer.add_rope_scaling_orig_ctx_len(config.rope_parameters["original_max_position_embeddings"])
        if vocab is not None:
            vocab(writer)
        else:
            writer.add_bos_token_id(config.bos_token_id)
            writer.add_eos_token_id(config.eos_token_id)
        for key, (value, value_type) in dict(metadata).items():
            if value_type == GGUFValueType.ARRAY:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, value_type)

    return write_gguf(path, arch, tensors, setup)


def reference_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


PROMPT = [1, 5, 17, 42, 3, 88, 64, 9, 30, 71]


@pytest.mark.parametrize("kind", ["llama", "llama_gqa", "qwen2", "qwen3"])
def test_f32_model_matches_transformers(kind, tmp_path):
    reference = make_reference(kind)
    out = convert_gguf(model_to_gguf(reference, tmp_path / "model.gguf"), tmp_path / "converted", progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "conversion-complete", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == reference.config.model_type
    assert config["tie_word_embeddings"] == reference.config.tie_word_embeddings
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["rms_norm_eps"] == reference.config.rms_norm_eps  # 1e-6, not float32's 9.99999997e-07
    if kind == "llama_gqa":
        assert config["rope_scaling"] == {key: value for key, value in reference.config.rope_parameters.items()
                                          if key != "rope_theta"}

    imported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    for name, weight in reference.state_dict().items():  # q/k un-permuted, qwen2 biases and qwen3 q/k norms kept
        assert torch.equal(imported.state_dict()[name], weight), name
    torch.testing.assert_close(reference_logits(imported, PROMPT), reference_logits(reference, PROMPT),
                               atol=1e-4, rtol=0)


def gemma3_reference(**changes):
    """A tiny Gemma 3 as llama.cpp's reads one: every 6th layer global, the sliding layers' RoPE base 10000,
    queries scaled by head_dim^-0.5; with linear RoPE scaling on the global layers and soft-capped logits."""
    config = {**TINY_CONFIGS["gemma3"]().to_dict(), "num_hidden_layers": 6, "layer_types": None, "sliding_window": 4,
              "query_pre_attn_scalar": 16, "final_logit_softcapping": 5.0, "tie_word_embeddings": True,
              "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}, **changes}
    torch.manual_seed(0)
    return gemma_init(spread_init(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**config)).eval(), 0))


def test_gemma3_file_converts_to_the_reference(tmp_path):
    """Its norms stored as 1 + w, the layer pattern and the sliding layers' RoPE base implied by the
    architecture: the converted folder loads in minispec and in the reference with the reference's logits."""
    reference = gemma3_reference()
    out = convert_gguf(model_to_gguf(reference, tmp_path / "model.gguf"), tmp_path / "converted", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["layer_types"] == reference.config.layer_types
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0} and config["final_logit_softcapping"] == 5.0
    tokens = PROMPT * 2  # past the window
    model = load_model(out, dtype=torch.float32)
    model.setup_caches(1, 32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), torch.arange(len(tokens)))[0]
    torch.testing.assert_close(logits, reference_logits(reference, tokens), atol=1e-4, rtol=0)
    imported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(reference_logits(imported, tokens), reference_logits(reference, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "llama_gqa", "qwen2", "qwen3"])
def test_minispec_loads_converted_model(kind, tmp_path):
    reference = make_reference(kind)
    out = convert_gguf(model_to_gguf(reference, tmp_path / "model.gguf"), tmp_path / "converted", progress=False)
    model = load_model(out, dtype=torch.float32)
    model.setup_caches(1, 32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))[0]
    torch.testing.assert_close(logits, reference_logits(reference, PROMPT), atol=1e-4, rtol=0)


def test_yarn_rope_scaling_converts_and_loads(tmp_path):
    """A Qwen2 with YaRN context extension: its GGUF converts to a config minispec loads, with the
    reference's logits past the original context."""
    config = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                      rope_theta=1000.0, bos_token_id=1, eos_token_id=2,
                                      rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    reference = spread_init(transformers.Qwen2ForCausalLM(config).eval(), seed=0)
    out = convert_gguf(model_to_gguf(reference, tmp_path / "model.gguf"), tmp_path / "converted", progress=False)
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    model = load_model(out, dtype=torch.float32)
    tokens = torch.randint(3, 96, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    model.setup_caches(1, 128)
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), torch.arange(len(tokens)))[0]
    # against the reference in float64, to twice the reference's own float32 rounding: logits of ~30
    # past the original context, where two float32 computations differ by 1e-4 for rounding alone
    float32 = reference_logits(reference, tokens)
    exact = reference_logits(copy.deepcopy(reference).double(), tokens).float()
    atol = max(1e-4, 2 * (float32 - exact).abs().max().item())
    torch.testing.assert_close(logits, exact, atol=atol, rtol=0)


def test_q8_0_model_close_to_original(tmp_path, capsys, monkeypatch):
    reference = make_reference("llama")
    path = model_to_gguf(reference, tmp_path / "model.gguf", qtype=Q.Q8_0)
    monkeypatch.setattr(minigguf, "PROGRESS_MIN_BYTES", 0)  # report even for this tiny file
    out = convert_gguf(path, tmp_path / "converted", progress=True)
    lines = capsys.readouterr().err.splitlines()  # progress lines go to stderr
    assert len(lines) > 1 and lines[-1].startswith("minispec: converted 100% of")
    imported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert imported.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # exact dequantized values
    # q_proj, read back and re-permuted, is exactly ggml's dequantization of the stored blocks.
    _, tensors = read_gguf(path)
    q_raw = tensors["blk.0.attn_q.weight"].data.numpy().reshape(32, -1)
    torch.testing.assert_close(permute(imported.model.layers[0].self_attn.q_proj.weight.detach(), 4),
                               torch.from_numpy(quants.dequantize(q_raw, Q.Q8_0)), atol=0, rtol=0)
    ours, theirs = reference_logits(imported, PROMPT), reference_logits(reference, PROMPT)
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()  # 8-bit noise; near-ties may still flip


def test_keep_quantized_model(tmp_path, monkeypatch):
    """A Q4_1 file whose layer 0 has a Q8_0 v projection (q, k, v fused in one layer: stored in one form,
    int8 with offsets) and whose layer 1 has an F32 up projection (gate and up then stay float):
    converted keeping its quantized tensors, every one dequantizes to the float conversion's tensor
    bit for bit, and the checkpoint loads as a quantized model whose logits are the float one's but for
    the kernels' arithmetic (a gain-1 model, which that does not flip): PyTorch's bfloat16 2% of the
    largest, minispec's inputs rounded to int8 blocks 6% (tests/test_quant.py)."""
    reference = spread_init(make_reference("llama"), seed=0, gain=1.0)
    state = reference.state_dict()
    extra = {"blk.0.attn_v.weight": (quants.quantize(state["model.layers.0.self_attn.v_proj.weight"].numpy(), Q.Q8_0),
                                     Q.Q8_0),
             "blk.1.ffn_up.weight": (state["model.layers.1.mlp.up_proj.weight"].numpy(), None)}
    path = model_to_gguf(reference, tmp_path / "model.gguf", qtype=Q.Q4_1, extra_tensors=extra)
    floats = convert_gguf(path, tmp_path / "float", progress=False)
    kept = convert_gguf(path, tmp_path / "kept", progress=False, keep_quantized=True)
    assert json.loads((kept / "config.json").read_text())["quantization_config"] == {"quant_method": "minispec"}
    float_weights = load_file(floats / "model.safetensors")
    stored = quant.take_stored(load_file(kept / "model.safetensors"))
    for name, parts in stored.items():
        assert torch.equal(quant.dequantize(parts), float_weights[f"{name}.weight"]), name
    layer0, layer1 = "model.layers.0.self_attn", "model.layers.1.mlp"
    assert {stored[f"{layer0}.{p}_proj"]["qweight"].dtype for p in "qkv"} == {torch.int8}  # one form
    assert f"{layer1}.up_proj" not in stored and f"{layer1}.gate_proj" not in stored  # float with the F32 one
    assert stored["model.layers.1.self_attn.q_proj"]["qweight"].dtype == torch.uint8  # Q4_1: int4
    assert len(stored) == 2 * 7 + 2 - 2  # 7 projections per layer, embedding and head, but layer 1's gate, up

    model, float_model = load_model(kept), load_model(floats)
    assert isinstance(model.layers[0].attention.wqkv, quant.Int8Linear)
    assert isinstance(model.layers[1].attention.wqkv, quant.Int4Linear)
    assert isinstance(model.layers[1].feed_forward.w13, torch.nn.Linear)
    ours, theirs = logits_of(model, PROMPT), logits_of(float_model, PROMPT)
    assert (ours - theirs).abs().max() <= (0.06 if model.head.native else 0.02) * theirs.abs().max()

    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path / "weights"))  # a .gguf path with quantize=: kept
    quantized = load_model(path, quantize="int4")
    [kept_folder] = (tmp_path / "weights").glob("model-*-quantized")
    assert (kept_folder / "config.json").is_file()
    assert isinstance(quantized.layers[1].feed_forward.w13, quant.Int4Linear)  # the float one, quantized


@pytest.mark.parametrize("kind", ["llama", "llama_gqa"])
def test_an_int4_draft_from_a_gguf_file_runs_every_layer_in_int4(kind, tmp_path, monkeypatch):
    """--draft-quantize int4 on a GGUF draft requantizes the layers the file keeps in its own types (here Q8_0)
    and its head to int4 in the widest groups the width divides into, its logits within int4's error of the
    kept ones, the tied embedding int8 for lookups; speculative greedy output is still the target's."""
    from minispec.loaders import load_draft
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path / "weights"))
    path = model_to_gguf(spread_init(make_reference(kind), seed=0, gain=1.0), tmp_path / "model.gguf", qtype=Q.Q8_0)
    kept, target = load_model(path, quantize="int4"), load_model(path)
    draft = load_draft(str(path), target, draft_quantize="int4")
    linears = [m for m in draft.modules() if isinstance(m, quant.Quantized) and not isinstance(m, quant.Int8Embedding)]
    assert {type(m) for m in linears} == {quant.Int4Linear}
    assert all(m.group == max(size for size in quant.GROUP_SIZES if m.in_features % size == 0) for m in linears)
    assert max(m.group for m in linears) > quant.DEFAULT_GROUP_SIZE
    assert len(linears) == 4 * len(draft.layers) + 1 and isinstance(draft.tok_embeddings, quant.Int8Embedding)
    assert {type(m) for m in kept.modules() if isinstance(m, quant.Quantized)} == {quant.Int8Linear, quant.Int8Embedding}
    assert draft.fingerprint != kept.fingerprint
    with_int4, with_kept = logits_of(draft, PROMPT), logits_of(kept, PROMPT)
    assert 0 < (with_int4 - with_kept).abs().max() <= 0.3 * with_kept.abs().max()
    prompt = [5, 17, 33, 8, 90, 41]
    plain = minispec.generate(target, prompt, max_new_tokens=24, ignore_eos=True)
    out = minispec.generate(target, prompt, draft=draft, gamma=3, max_new_tokens=24, ignore_eos=True)
    assert out.tokens == plain.tokens and out.stats["accepted"] > 0


def test_an_int4_draft_is_kept_and_mapped_by_later_loads(tmp_path, monkeypatch):
    """The int4 draft's layers, made once, are kept in the weights folder: a later load maps them from that
    file instead of requantizing (the same logits), and a draft file changed since is requantized again."""
    from minispec.loaders import load_draft
    from minispec.loading import checkpoint
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path / "weights"))
    monkeypatch.setattr(checkpoint, "KEEP_MIN_BYTES", 0)
    path = model_to_gguf(spread_init(make_reference("llama"), seed=0, gain=1.0), tmp_path / "model.gguf", qtype=Q.Q8_0)
    target = load_model(path)
    first = load_draft(str(path), target, draft_quantize="int4")
    if not first.head.native:
        pytest.skip("the native kernels' layout is what a kept draft holds")
    [kept] = [f for f in (tmp_path / "weights" / "kept").glob("*.safetensors")
              if checkpoint.kept_metadata(f).get("made_from", "").startswith(first.fingerprint.split()[0])]
    made = []
    monkeypatch.setattr(quant, "int4_draft", lambda model: made.append(model) or [])
    again = load_draft(str(path), target, draft_quantize="int4")
    assert not made and again.fingerprint == first.fingerprint
    linears = [m for m in again.modules() if isinstance(m, quant.Int4Linear)]
    assert len(linears) == 4 * len(again.layers) + 1 and all(mapped_from(m.weight, kept) for m in linears)
    assert torch.equal(logits_of(again, PROMPT), logits_of(first, PROMPT))
    model_to_gguf(spread_init(make_reference("llama"), seed=1, gain=1.0), path, qtype=Q.Q8_0)  # another file
    load_draft(str(path), target, draft_quantize="int4")  # converted again, so requantized again
    assert len(made) == 1


def mapped_from(tensor, file):
    """Whether the tensor's memory lies in this process's mapping of `file`."""
    with open("/proc/self/maps") as maps:
        spans = [line.split()[0].split("-") for line in maps if line.split()[-1] == str(file.resolve())]
    return any(int(start, 16) <= tensor.data_ptr() < int(end, 16) for start, end in spans)


@pytest.mark.skipif(not native.available(), reason="the kernels' layout is kept where they build")
def test_a_kept_quantized_conversion_holds_the_kernels_layout_and_loads_mapped(tmp_path, monkeypatch):
    """A .gguf loaded with quantize= is converted once into the layout the native kernels read: no larger
    than the file, loaded without repacking (its layers' tensors are the file's mapped memory), with the
    same logits as the stored form packed at load; and its layers unpack to the stored form exactly,
    which other devices and a model without these kernels load."""
    reference = spread_init(make_reference("llama"), seed=0, gain=1.0)
    path = model_to_gguf(reference, tmp_path / "model.gguf", qtype=Q.Q4_1)
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path / "weights"))
    model = load_model(path, quantize="int4")
    [folder] = (tmp_path / "weights").glob("model-*-quantized")
    converted = folder / "model.safetensors"
    header = 8 + int.from_bytes(converted.read_bytes()[:8], "little")  # a tiny model's is most of its file
    assert converted.stat().st_size - header <= sum(t.data.numel() * t.data.element_size()
                                                    for t in read_gguf(path)[1].values())
    wqkv = model.layers[0].attention.wqkv
    assert wqkv.native and mapped_from(wqkv.weight, folder / "model.safetensors")
    stored = convert_gguf(path, tmp_path / "stored", progress=False, keep_quantized=True)  # packed at load
    assert torch.equal(logits_of(model, PROMPT), logits_of(load_model(stored), PROMPT))
    expected = quant.take_stored(convert_hf_weights(load_file(stored / "model.safetensors"), model.config))
    packed = quant.take_stored(load_file(folder / "model.safetensors"))
    assert packed.keys() == expected.keys()
    for name, parts in packed.items():
        rows = model.get_submodule(name).out_features
        assert torch.equal(quant.dequantize(native.unpack(parts, rows)), quant.dequantize(expected[name])), name
    monkeypatch.setenv("MINISPEC_NATIVE", "0")  # PyTorch's kernels: the layout unpacked at load
    assert torch.equal(logits_of(load_model(path, quantize="int4"), PROMPT), logits_of(load_model(stored), PROMPT))


@pytest.mark.skipif(not native.available(), reason="the kernels' layout is kept where they build")
def test_a_k_quant_conversion_is_no_larger_than_its_file_and_exact(tmp_path, monkeypatch):
    """A file of Q6_K tensors (a Q4_K_M file's head, v and down projections) converted into the kernels'
    layout: its tensors take no more bytes than the file's (the super-block scales as the file's float16,
    none for the offsets Q6_K has not), and the head, embedding and a layer unpack to exactly the values
    the file dequantizes to."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    reference = transformers.LlamaForCausalLM(config).eval()
    floats = read_gguf(model_to_gguf(reference, tmp_path / "floats.gguf"))[1]
    rng = np.random.default_rng(3)
    extra = {name: (random_k_blocks(Q.Q6_K, t.data.numel() // 4 // 256, rng).reshape(t.shape[0], -1), Q.Q6_K)
             for name, t in floats.items() if len(t.shape) == 2}
    path = model_to_gguf(reference, tmp_path / "model.gguf", extra_tensors=extra)
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path / "weights"))
    load_model(path, quantize="int4")
    [converted] = (tmp_path / "weights").glob("model-*-quantized/model.safetensors")
    header = 8 + int.from_bytes(converted.read_bytes()[:8], "little")
    tensors = read_gguf(path)[1]
    assert converted.stat().st_size - header <= sum(t.data.numel() * t.data.element_size() for t in tensors.values())
    packed = quant.take_stored(load_file(converted))
    for name, source in [("output", "output.weight"), ("tok_embeddings", "token_embd.weight"),
                         ("layers.0.feed_forward.w2", "blk.0.ffn_down.weight")]:
        assert packed[name]["packed_steps"].dtype == torch.float16, name
        unpacked = native.unpack(packed[name], tensors[source].shape[0])
        assert torch.equal(quant.dequantize(unpacked), dequantize(tensors[source])), name


def test_a_gguf_file_is_never_loaded_as_another_ones_conversion(tmp_path, monkeypatch):
    """Files of one name in two folders, and a file replaced in place, each load their own content's
    conversion: the converted folder is found by the file's SHA-256, not its name, size or time (the
    replaced file holds the second one's bytes: it loads that one's conversion, converting nothing)."""
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path / "weights"))
    small, large = make_reference("llama"), make_reference("qwen2")
    first = model_to_gguf(small, (tmp_path / "a").mkdir() or tmp_path / "a" / "model.gguf")
    second = model_to_gguf(large, (tmp_path / "b").mkdir() or tmp_path / "b" / "model.gguf")
    expected = {path: reference_logits(reference, PROMPT) for path, reference in ((first, small), (second, large))}
    for path in (first, second, first):
        torch.testing.assert_close(logits_of(load_model(path), PROMPT), expected[path], atol=1e-4, rtol=0)
    model_to_gguf(large, first.with_suffix(".new"))
    first.with_suffix(".new").replace(first)  # replaced in place: the same name and folder
    torch.testing.assert_close(logits_of(load_model(first), PROMPT), expected[second], atol=1e-4, rtol=0)
    assert len(list((tmp_path / "weights").iterdir())) == 2


def test_a_conversion_in_an_older_layout_is_made_again(tmp_path, monkeypatch, capsys):
    """A conversion whose mark holds the file's hash but not this minispec's layout (one made before its
    steps were float16) is converted again, not loaded: its tensors would not be what the kernels read."""
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path / "weights"))
    path = model_to_gguf(make_reference("llama"), tmp_path / "model.gguf", qtype=Q.Q4_1)
    load_model(path, quantize="int4")
    [folder] = (tmp_path / "weights").glob("model-*-quantized")
    mark = folder / minigguf.COMPLETE
    digest = mark.read_text().partition(" ")[0]
    assert mark.read_text() == f"{digest} layout {minigguf.LAYOUT}"
    mark.write_text(digest)  # an older minispec's mark
    capsys.readouterr()
    load_model(path, quantize="int4")
    assert "converting it again" in capsys.readouterr().err
    assert mark.read_text() == f"{digest} layout {minigguf.LAYOUT}"


def test_a_gguf_rewritten_with_the_same_size_and_time_is_converted_again(tmp_path, monkeypatch):
    """A file rewritten in place with other weights of the same shapes, and its size and modification
    time put back, loads its new content, never the old content's conversion."""
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path / "weights"))
    old, new = make_reference("llama"), spread_init(make_reference("llama"), seed=1)
    path = model_to_gguf(old, tmp_path / "model.gguf")
    torch.testing.assert_close(logits_of(load_model(path), PROMPT), reference_logits(old, PROMPT), atol=1e-4, rtol=0)
    stat = path.stat()
    model_to_gguf(new, path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    torch.testing.assert_close(logits_of(load_model(path), PROMPT), reference_logits(new, PROMPT), atol=1e-4, rtol=0)


def nan_weight_gguf(path):
    reference = make_reference("llama")
    with torch.no_grad():
        reference.model.layers[1].mlp.down_proj.weight[3, 5] = math.nan
    return model_to_gguf(reference, path)


def test_nan_weights_refused_with_the_tensor_name(tmp_path, monkeypatch):
    """A conversion is loaded back before it is kept: a file with a NaN weight is refused naming the
    tensor, and nothing of it stays in the weights folder (nor, through the command, where it would go)."""
    weights = tmp_path / "weights"
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(weights))
    path = nan_weight_gguf(tmp_path / "model.gguf")
    with pytest.raises(ValueError, match="tensor model.layers.1.mlp.down_proj.weight holds NaN") as error:
        load_model(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value) and ".partial" not in str(error.value)
    assert list(weights.iterdir()) == []
    bad = subprocess.run([sys.executable, "-m", "minispec.convert", str(path), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "down_proj.weight holds NaN" in bad.stderr and bad.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "weights"]


def test_a_conversion_that_does_not_load_is_not_kept(good_file, tmp_path, monkeypatch):
    """Weights written wrong (here: cut short, as a failing disk would) are found when the conversion is
    loaded back, before it is renamed into place: the next run converts afresh."""
    weights = tmp_path / "weights"
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(weights))
    save = minigguf.save_safetensors

    def save_cut_short(tensors, file, **kwargs):
        save(tensors, file, **kwargs)
        with open(file, "r+b") as written:
            written.truncate(file.stat().st_size - 100)

    monkeypatch.setattr(minigguf, "save_safetensors", save_cut_short)
    with pytest.raises(ValueError, match="its conversion does not load: .*model.safetensors"):
        load_model(good_file)
    assert list(weights.iterdir()) == []
    monkeypatch.setattr(minigguf, "save_safetensors", save)
    assert load_model(good_file).vocab_size == 96


def logits_of(model, tokens):
    model.setup_caches(1, 32)
    with torch.no_grad():
        return model(torch.tensor([tokens]), torch.arange(len(tokens)))[0]


def test_convert_casts_to_dtype(tmp_path):
    reference = make_reference("llama")
    out = convert_gguf(model_to_gguf(reference, tmp_path / "model.gguf", qtype=Q.Q8_0), tmp_path / "converted",
                       dtype=torch.bfloat16, progress=False)
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 and Llama 3.2
def test_llama3_rope_scaling_recovered(factor):
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    freqs = llama3_rope_freqs(128, 500000.0, scaling)
    assert llama3_rope_scaling(freqs.tolist(), 128, 500000.0) == scaling
    with pytest.raises(ValueError, match="not Llama 3 rope scaling"):
        llama3_rope_scaling((freqs * np.linspace(1, 2, 64)).tolist(), 128, 500000.0)


# ---------------------------------------------------------------------------------------------
# Tokenizer

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = QWEN2_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def split_bytes(regex):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# The pre-tokenization of the model families' own tokenizer.json files, by tokenizer.ggml.pre.
ORIGINAL_PRE_TOKENIZERS = {
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False)]),
    "qwen2": lambda: split_bytes(QWEN2_REGEX),
    "llama-bpe": lambda: split_bytes(LLAMA3_REGEX),
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world! Hello, hello. HELLO wOrLd",
    "The year 2024 has 366 days; pi is 3.14159 and 1234567 is big.",
    "naïve café — 日本語のテキスト, Ünïcödé, emoji 🎉🎉, ＦＵＬＬ width, decomposed cafe\u0301",
    "    indented\n\n\ttabs\tand   spaces   \n\n\n",
    "def f(x):\n    return x ** 2  # square\n\nclass A(B):\n    pass\r\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "a <tool> call and another<tool>",
    "It's we'll they've I'M you'D",
]


def train_tokenizer(pre):
    """A byte-level BPE whose merges cross every pre-tokenizer's boundaries (trained on whole lines),
    so that encoding the corpus with the wrong pre-tokenizer gives different tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 3, trainer=trainer)
    tokenizer.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    tokenizer.pre_tokenizer = ORIGINAL_PRE_TOKENIZERS[pre]()
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    return tokenizer


def vocab_writer(tokenizer, pre, add_bos):
    """Tokenizer metadata as llama.cpp's converter writes it for a byte-level BPE vocabulary."""
    inverse = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_tokens_decoder()
    tokens = [added[i].content if i in added else inverse[i] for i in range(tokenizer.get_vocab_size())]
    types = [(TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED) if i in added else TokenType.NORMAL
             for i in range(len(tokens))]
    merges = [" ".join(merge) for merge in json.loads(tokenizer.to_str())["model"]["merges"]]

    def write(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(tokenizer.token_to_id("<|im_start|>"))
        writer.add_eos_token_id(tokenizer.token_to_id("<|im_end|>"))
        writer.add_pad_token_id(tokenizer.token_to_id("<|endoftext|>"))
        writer.add_add_bos_token(add_bos)
        writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")

    return write


def expected_ids(original, text):
    return original.encode(text, add_special_tokens=False).ids


def test_qwen3_file_with_its_tokenizer(tmp_path):
    """A Qwen3 file as llama.cpp writes one (its tokenizer's pre-tokenization 'qwen2', its head size in
    key_length): the checkpoint it converts to gives the reference's logits and the original's tokens.
    Heads of hidden_size / heads dimensions: config.json still names them, as Qwen3 reads an absent
    head_dim as 128."""
    original = train_tokenizer("qwen2")
    config = TINY_CONFIGS["qwen3"]()
    config.vocab_size, config.head_dim = original.get_vocab_size(), 8
    torch.manual_seed(0)
    reference = spread_init(transformers.Qwen3ForCausalLM(config).eval(), seed=0)
    path = model_to_gguf(reference, tmp_path / "model.gguf", vocab=vocab_writer(original, "qwen2", False))
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    assert json.loads((out / "config.json").read_text())["head_dim"] == 8
    model = load_model(out, dtype=torch.float32)
    model.setup_caches(1, 32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))[0]
    torch.testing.assert_close(logits, reference_logits(reference, PROMPT), atol=1e-4, rtol=0)
    ours = load_tokenizer(out)
    for text in CORPUS:
        assert ours.encode(text, add_special_tokens=False) == expected_ids(original, text), text


def test_gemma3_sentencepiece_vocabulary(tmp_path):
    """A Gemma file's vocabulary (tokenizer.ggml.model 'llama': SentencePiece pieces ranked by position, no
    merges, runs of spaces spelled as spaces, bytes as <0xNN> tokens): the converted tokenizer gives the
    reference's ids for the file itself, and decodes them back to the text."""
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n", "  ", "   "]
    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "ll", "\u2581he", "llo", "\u2581hello", "or",
              "\u2581w", "\u2581wor", "ld", "\u2581world", "lo", "\u2581wo"]
    tokens = control + user + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = ([TokenType.CONTROL] * len(control) + [TokenType.USER_DEFINED] * len(user) + [TokenType.BYTE] * 256
             + [TokenType.NORMAL] * len(pieces))

    def write(writer):
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores([-1000.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))])
        writer.add_token_types(types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)

    path = model_to_gguf(gemma3_reference(vocab_size=len(tokens)), tmp_path / "model.gguf", vocab=write)
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = load_tokenizer(out)
    texts = ["hello world", "  hello\n\nworld", "héllo wörld 😀<start_of_turn>hello<end_of_turn>\n", "hello   world  ",
             " lol dr. who"]
    for text in texts:
        ids = reference(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == reference.decode(ids) == "<bos>" + text
    # merged pieces, a run of spaces and bytes outside the vocabulary were all on the way
    assert {tokens.index("\u2581world"), tokens.index("  "), tokens.index("<0xC3>")} <= set(ours.encode("".join(texts)))


@pytest.mark.parametrize("pre", list(ORIGINAL_PRE_TOKENIZERS))
def test_tokenizer_matches_original(pre, tmp_path):
    original = train_tokenizer(pre)
    vocab_size = original.get_vocab_size()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=64)).eval()
    add_bos = pre == "llama-bpe"
    path = model_to_gguf(model, tmp_path / "model.gguf", vocab=vocab_writer(original, pre, add_bos))
    out = convert_gguf(path, tmp_path / "converted", progress=False)

    imported = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    for text in CORPUS:
        expected = expected_ids(original, text)
        assert imported.encode(text, add_special_tokens=False) == expected, text
        for skip in (False, True):  # "<tool>" is added but not special: it survives skip_special_tokens
            decoded = original.decode(expected, skip_special_tokens=skip)
            assert imported.decode(expected, skip_special_tokens=skip) == decoded
    bos, eos = original.token_to_id("<|im_start|>"), original.token_to_id("<|im_end|>")
    assert imported.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)[0] == bos

    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|im_start|>" and tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["pad_token"] == "<|endoftext|>"
    assert tokenizer_config["add_bos_token"] is add_bos
    assert tokenizer_config["chat_template"].startswith("{% for m in messages %}")
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (bos, eos)
    assert config["vocab_size"] == vocab_size

    with_bos = ([bos] if add_bos else []) + expected_ids(original, CORPUS[0])
    ours = load_tokenizer(out)  # minispec's own tokenizer reads the files the same way
    for text in CORPUS:
        assert ours.encode(text, add_special_tokens=False) == expected_ids(original, text), text
    assert ours.encode(CORPUS[0]) == with_bos
    auto = transformers.AutoTokenizer.from_pretrained(out)  # the directory loads as a whole, too
    assert auto.encode(CORPUS[0]) == with_bos
    assert auto.eos_token == "<|im_end|>"


# ---------------------------------------------------------------------------------------------
# Bad input

@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    return model_to_gguf(make_reference("llama"), tmp_path_factory.mktemp("good") / "model.gguf")


def assert_converts_to_error(path, out, match):
    with pytest.raises(ValueError, match=match) as error:
        convert_gguf(path, out, progress=False)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no staging leftovers


def test_bad_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    assert_converts_to_error(path, tmp_path / "out", "not a GGUF file")
    path.write_bytes(b"")
    assert_converts_to_error(path, tmp_path / "out", "not a GGUF file")


def test_truncated_header(good_file, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(good_file.read_bytes()[:200])
    assert_converts_to_error(path, tmp_path / "out", "truncated GGUF file")


def test_truncated_data(good_file, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(good_file.read_bytes()[:-16])
    assert_converts_to_error(path, tmp_path / "out", r"truncated GGUF file \(tensor '.*' needs bytes up to")


def test_unsupported_version(good_file, tmp_path):
    data = bytearray(good_file.read_bytes())
    data[4:8] = (1).to_bytes(4, "little")
    path = tmp_path / "model.gguf"
    path.write_bytes(bytes(data))
    assert_converts_to_error(path, tmp_path / "out", "unsupported GGUF version 1")


def test_unsupported_quantization_type(tmp_path):
    blocks = np.random.default_rng(0).integers(0, 256, size=(4, 66), dtype=np.uint8)  # IQ2_XXS: 66 bytes / 256
    path = model_to_gguf(make_reference("llama"), tmp_path / "model.gguf",
                         extra_tensors={"blk.0.attn_q.weight": (blocks, Q.IQ2_XXS)})
    _, tensors = read_gguf(path)  # parsing works; reading the values does not
    with pytest.raises(ValueError, match="unsupported quantization type IQ2_XXS"):
        dequantize(tensors["blk.0.attn_q.weight"])
    assert_converts_to_error(path, tmp_path / "out", "IQ2_XXS")


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "model.gguf", "gpt2", {"token_embd.weight": (np.zeros((8, 4), np.float32), None)})
    assert_converts_to_error(path, tmp_path / "out", "unsupported GGUF architecture 'gpt2'")


def test_sentencepiece_vocab_not_supported(tmp_path):
    def vocab(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(93)])

    path = model_to_gguf(make_reference("llama"), tmp_path / "model.gguf", vocab=vocab)
    assert_converts_to_error(path, tmp_path / "out", "SentencePiece .* not supported yet")


U32, I32, F32, STR, ARR = (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32,
                           GGUFValueType.STRING, GGUFValueType.ARRAY)
VOCAB = 96  # the tiny llama's


def byte_vocab(writer):
    """A byte-level BPE vocabulary of the tiny llama's size."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_types([TokenType.NORMAL] * VOCAB)
    writer.add_eos_token_id(2)


@pytest.mark.parametrize("metadata, message", [
    ({"llama.attention.head_count": (0, U32)}, "llama.attention.head_count must be an integer from 1 to .*, got 0"),
    ({"llama.embedding_length": ("32", STR)}, "llama.embedding_length must be an integer from 1 to .*, got '32'"),
    ({"llama.block_count": (True, GGUFValueType.BOOL)}, "llama.block_count must be an integer from 1 to .*, got True"),
    ({"llama.attention.layer_norm_rms_epsilon": (math.nan, F32)}, "epsilon must be a positive finite number, got nan"),
    ({"llama.rope.freq_base": ([1.0], ARR)}, r"rope.freq_base must be a positive finite number, got \[1.0\]"),
    ({"general.architecture": (["llama"], ARR)}, r"general.architecture must be a string, got \['llama'\]"),
    # Bounded by the blocks the file holds, not trusted: 2^31 - 1 blocks converted, then hung at load.
    ({"llama.block_count": (2**31 - 1, U32)}, "block_count is 2147483647, but the file holds tensors of 2 blocks"),
    ({"llama.block_count": (1, U32)}, "block_count is 1, but the file holds tensors of 2 blocks, numbered up to 1"),
    ({"llama.feed_forward_length": (48, U32)}, r"'blk.0.ffn_gate.weight' has shape \(64, 32\), but the metadata implies \(48, 32\)"),
    ({"llama.attention.head_count_kv": (3, U32)}, "head_count 4 is not a multiple of llama.attention.head_count_kv 3"),
    ({"llama.attention.head_count": (32, U32)}, "attention heads of 1 dimensions; rotary embeddings need a positive even"),
    ({"tokenizer.ggml.eos_token_id": (-1, I32)}, "eos_token_id must be a token id from 0 to 95, got -1"),
    ({"tokenizer.ggml.bos_token_id": (VOCAB, U32)}, "bos_token_id must be a token id from 0 to 95, got 96"),
    ({"tokenizer.ggml.eot_token_id": ("2", STR)}, "eot_token_id must be a token id.*, got '2'"),
])
def test_bad_metadata(metadata, message, tmp_path):
    """A metadata value of the wrong type or out of range is named, with the file, in one line: not a
    ZeroDivisionError, a TypeError, a hang, or a token id of -1 taken as the last token."""
    path = model_to_gguf(make_reference("llama"), tmp_path / "model.gguf", metadata=metadata)
    assert_converts_to_error(path, tmp_path / "out", message)


@pytest.mark.parametrize("metadata, message", [
    ({"tokenizer.ggml.token_type": ([1] * (VOCAB + 1), ARR)}, "token_type holds 97 types for 96 tokens"),
    ({"tokenizer.ggml.token_type": ([1] * (VOCAB - 1), ARR)}, "token_type holds 95 types for 96 tokens"),
    ({"tokenizer.ggml.tokens": ([f"t{i}" for i in range(VOCAB + 1)], ARR)},
     "tokens holds 97 tokens, but token_embd.weight has 96 rows"),
    ({"tokenizer.ggml.tokens": ([1, 2], ARR)}, r"tokenizer.ggml.tokens must be a list of strings, got \[1, 2\]"),
    ({"tokenizer.ggml.merges": ([1, 2], ARR)}, "merges must be a list of strings, got .*"),
    ({"tokenizer.ggml.add_bos_token": (1, U32)}, "add_bos_token must be true or false, got 1"),
    ({"tokenizer.chat_template": (7, U32)}, "chat_template must be a string, got 7"),
    ({"tokenizer.ggml.eos_token_id": (VOCAB - 1, U32), "tokenizer.ggml.tokens": (["a", "b"], ARR),
      "tokenizer.ggml.token_type": ([1, 1], ARR)}, "eos_token_id must be a token id from 0 to 1, got 95"),
])
def test_bad_tokenizer_metadata(metadata, message, tmp_path):
    def vocab(writer):
        byte_vocab(writer)
        for key, (value, value_type) in metadata.items():
            if value_type == ARR:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, value_type)

    path = model_to_gguf(make_reference("llama"), tmp_path / "model.gguf", vocab=vocab)
    assert_converts_to_error(path, tmp_path / "out", message)


def test_missing_vocabulary(tmp_path):
    path = model_to_gguf(make_reference("llama"), tmp_path / "model.gguf",
                         vocab=lambda writer: (writer.add_tokenizer_model("gpt2"), writer.add_tokenizer_pre("gpt-2")))
    assert_converts_to_error(path, tmp_path / "out", "GGUF metadata tokenizer.ggml.tokens is missing")


def patched(good_file, tmp_path, old, new):
    data = good_file.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    path = tmp_path / "model.gguf"
    path.write_bytes(data.replace(old, new))
    return path


def test_duplicates(good_file, tmp_path):
    """A tensor or metadata key twice: refused, not the last one silently taken."""
    path = patched(good_file, tmp_path, b"blk.1.attn_norm.weight", b"blk.0.attn_norm.weight")
    assert_converts_to_error(path, tmp_path / "out", "tensor 'blk.0.attn_norm.weight' appears twice")
    path = patched(good_file, tmp_path, b"llama.context_length", b"general.architecture")
    assert_converts_to_error(path, tmp_path / "out", "metadata key 'general.architecture' appears twice")


def test_missing_and_unexpected_tensors(tmp_path):
    reference = make_reference("llama")
    path = patched(model_to_gguf(reference, tmp_path / "good.gguf"), tmp_path, b"blk.1.ffn_up.weight", b"blk.1.ffn_xx.weight")
    assert_converts_to_error(path, tmp_path / "out", "lacks tensor.s. blk.1.ffn_up.weight")
    bias = {"blk.1.attn_q.bias": (np.zeros(32, np.float32), None)}  # a llama with biases in layer 1 only
    path = model_to_gguf(reference, tmp_path / "bias.gguf", extra_tensors=bias)
    assert_converts_to_error(path, tmp_path / "out", "unexpected tensor 'blk.1.attn_q.bias'")


def test_data_offset_beyond_the_file(good_file, tmp_path):
    name = b"output_norm.weight"
    data = bytearray(good_file.read_bytes())
    at = data.index(name) + len(name) + 4 + 8 + 4  # dims count, one dim, type: then the offset
    data[at:at + 8] = (1 << 40).to_bytes(8, "little")
    path = tmp_path / "model.gguf"
    path.write_bytes(bytes(data))
    assert_converts_to_error(path, tmp_path / "out", r"truncated GGUF file \(tensor 'output_norm.weight' needs bytes")


def test_nested_arrays_refused(tmp_path):
    """An array of arrays, each a few bytes, would recurse as deep as the file asks; llama.cpp refuses them too."""
    path = write_gguf(tmp_path / "model.gguf", "llama", {"a": (np.zeros(4, np.float32), None)},
                      lambda writer: writer.add_key_value("x", [[1]], ARR, sub_type=ARR))
    assert_converts_to_error(path, tmp_path / "out", "corrupt GGUF file .an array of arrays")


def test_header_values_are_bounded(good_file, tmp_path, monkeypatch):
    """gguf's reader makes a numpy object of each value the header holds: a file holding more than
    MAX_HEADER_VALUES is refused before they take the memory (a hostile array of a billion bytes)."""
    monkeypatch.setattr(minigguf, "MAX_HEADER_VALUES", 1000)
    read_gguf(good_file)  # under the bound
    path = write_gguf(tmp_path / "model.gguf", "llama", {"a": (np.zeros(4, np.float32), None)},
                      lambda writer: writer.add_array("x", [7] * 2000))
    assert_converts_to_error(path, tmp_path / "out", "corrupt GGUF file .its header holds more than 1000 values")


def test_deeply_nested_arrays_refused(tmp_path):
    """Arrays of arrays a thousand deep, 12 bytes a level: gguf's reader recurses into them; refused in one line."""
    path = write_gguf(tmp_path / "model.gguf", "llama", {"a": (np.zeros(4, np.float32), None)},
                      lambda writer: writer.add_key_value("x", [1], ARR, sub_type=U32))
    data = path.read_bytes()
    level = (9).to_bytes(4, "little") + (1).to_bytes(8, "little")  # an array of one array
    at = data.index((1).to_bytes(8, "little") + b"x") + 9 + 4  # key "x", then its type: an array
    path.write_bytes(data[:at] + level * 5000 + data[at:])
    assert_converts_to_error(path, tmp_path / "out", "corrupt GGUF file .arrays of arrays nested too deep")


@pytest.mark.parametrize("cut", [0.3, 0.7, 0.9])
def test_garbage_in_the_header_is_one_error(good_file, tmp_path, cut):
    """Random bytes over part of the header: whatever gguf's reader makes of them ends in one line naming
    the file (a ValueError), never another exception."""
    data = np.frombuffer(good_file.read_bytes(), np.uint8)
    end = good_file.read_bytes().index(b"output_norm.weight")
    rng = np.random.default_rng(int(cut * 10))
    for seed in range(40):
        damaged = data.copy()
        damaged[rng.integers(8, end, size=3)] = rng.integers(0, 256, size=3, dtype=np.uint8)
        path = tmp_path / "model.gguf"
        path.write_bytes((damaged[:int(len(damaged) * cut)] if seed % 2 else damaged).tobytes())
        try:
            read_gguf(path)
        except ValueError as error:
            assert str(path) in str(error) and "\n" not in str(error)


def test_failed_write_leaves_nothing(good_file, tmp_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(minigguf, "save_safetensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        convert_gguf(good_file, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_not_overwritten(good_file, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        convert_gguf(good_file, tmp_path / "out", progress=False)


def test_convert_command(good_file, tmp_path):
    """`python -m minispec.convert FILE DIR` prints the directory and nothing else (no warning from
    running a module the package imports); bad input is one error line."""
    command = [sys.executable, "-m", "minispec.convert"]
    done = subprocess.run([*command, str(good_file), str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, str(tmp_path / "out"), "")
    assert load_model(tmp_path / "out").vocab_size == make_reference("llama").config.vocab_size
    (tmp_path / "bad.gguf").write_bytes(b"GGML")
    bad = subprocess.run([*command, str(tmp_path / "bad.gguf"), str(tmp_path / "bad")], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1
    hostile = model_to_gguf(make_reference("llama"), tmp_path / "hostile.gguf",
                            metadata={"llama.attention.head_count": (0, U32)})
    bad = subprocess.run([*command, str(hostile), str(tmp_path / "bad")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr == f"error: {hostile}: GGUF metadata llama.attention.head_count must be an " \
                                                "integer from 1 to 2^31 - 1, got 0\n"
