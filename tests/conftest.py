"""Tiny random-init checkpoints built with the reference implementation (transformers), saved as
Hugging Face-layout safetensors directories, for tests to load into minispec and compare against.

Default initialization (std 0.02) makes tiny models collapse into repeating one token, which would
make greedy-equivalence tests weak; `spread_init` draws weights with std 3/sqrt(fan_in) instead,
so logits are far from uniform and greedy outputs vary.
"""

import math
import os

import pytest
import torch
import transformers

# Tiny models are all overhead: one thread avoids OpenMP hand-offs that cost far more than the math
# (and that stall badly when other processes share the two cores).
torch.set_num_threads(1)

# gamma="auto" keeps what it learns about a pair in a file (minispec/decoding/profiles.py); tests start
# from nothing (or from what they write themselves), and never write into the user's weights folder.
# Set here, so that the command lines the tests start inherit it.
os.environ["MINISPEC_PROFILES"] = "off"

VOCAB = 96

TINY_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=4,
        bos_token_id=1, eos_token_id=2,
    ),
    "llama": lambda: transformers.LlamaConfig(  # multi-head attention, untied head
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    ),
    "llama_gqa": lambda: transformers.LlamaConfig(  # grouped-query attention, llama3 rope scaling, tied head
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=500000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "qwen2": lambda: transformers.Qwen2Config(  # q/k/v bias, GQA
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    ),
    "qwen3": lambda: transformers.Qwen3Config(  # per-head q/k norm, GQA, head_dim apart from hidden_size, tied head
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(  # sliding layers (window 8) around a global one, two RoPE
        # bases, linear scaling on the global one; untied head (a tied one repeats its input token)
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, query_pre_attn_scalar=24,
        sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    ),
    "gemma2": lambda: transformers.Gemma2Config(  # even layers sliding (window 8), soft-capped attention and
        # logits (caps low enough to bite), no q/k norm, one RoPE base
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, query_pre_attn_scalar=24,
        sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    ),
    "t5_v1_0": lambda: transformers.T5Config(  # ReLU feed-forward, tied head (output scaled by d_model^-0.5)
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
        feed_forward_proj="relu", tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ),
    "t5_v1_1": lambda: transformers.T5Config(  # gated GELU feed-forward, untied head
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ),
}

MODEL_CLASSES = {
    "gpt2": transformers.GPT2LMHeadModel,
    "llama": transformers.LlamaForCausalLM,
    "llama_gqa": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "gemma3": transformers.Gemma3ForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
    "t5_v1_0": transformers.T5ForConditionalGeneration,
    "t5_v1_1": transformers.T5ForConditionalGeneration,
}


def spread_init(model, seed, gain=3.0):
    """Re-draw every weight so tiny random models produce varied, confident predictions."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                # GPT-2's Conv1D stores [in, out]; everything else [out, in].
                fan_in = param.shape[0] if any(k in name for k in ("c_attn", "c_fc", "c_proj")) else param.shape[1]
                std = gain / math.sqrt(fan_in)
                if any(k in name for k in ("wte", "wpe", "embed", "shared", "relative_attention_bias")):
                    std = 1.0
                if name.endswith(".q.weight"):  # T5 has no 1/sqrt(d) in attention: keep its softmax soft
                    std *= 0.35
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            else:  # norm weights
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
    return model


# Seeds whose greedy continuations vary (checked by the model tests' distinct-token asserts).
SEEDS = {"gpt2": 0, "llama": 0, "llama_gqa": 0, "qwen2": 0, "qwen3": 3, "gemma3": 0, "gemma2": 2, "t5_v1_0": 1, "t5_v1_1": 2}
# T5 v1.1 at gain 3 has logits of ~30, where float32 rounding alone exceeds the 1e-4 tolerance.
GAINS = {"t5_v1_1": 2.0}


def make_reference(kind, seed=None):
    """A tiny transformers model of `kind` (a key of TINY_CONFIGS) in eval mode, fp32."""
    seed = SEEDS[kind] if seed is None else seed
    torch.manual_seed(seed)
    model = spread_init(MODEL_CLASSES[kind](TINY_CONFIGS[kind]()).eval(), seed, GAINS.get(kind, 3.0))
    return gemma_init(model) if kind.startswith("gemma") else model


def gemma_init(model):
    """spread_init's weights as Gemma reads them: its norms scale by 1 + weight (the same scales around 1
    as the others'), its embeddings by sqrt(hidden) (drawn smaller, or each token predicts itself)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.sub_(1.0)
            elif "embed" in name:
                param.mul_(0.3)
    return model


def save_reference(model, directory):
    """Save a transformers model as config.json + model.safetensors; returns the directory."""
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def noisy_copy(model, seed, scale=0.02):
    """The same weights plus small noise: a draft model that agrees with the target most of the time."""
    generator = torch.Generator().manual_seed(seed)
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std().clamp(min=1e-3))
    return copy


def target_and_drafts(kind, tmp_path_factory):
    """A loaded target of `kind` and three drafts for it: its own weights ("same"), a noisy copy
    (mostly accepted) and an independently drawn model (mostly rejected); plus the reference model."""
    import minispec

    reference = make_reference(kind)
    directory = save_reference(reference, tmp_path_factory.mktemp(kind))
    return {
        "reference": reference,
        "target": minispec.load(directory),
        "same": minispec.load(directory),
        "noisy": minispec.load(save_reference(noisy_copy(reference, seed=1, scale=0.01), tmp_path_factory.mktemp("noisy"))),
        "independent": minispec.load(save_reference(make_reference(kind, seed=7), tmp_path_factory.mktemp("indep"))),
    }


@pytest.fixture(scope="session")
def reference_dirs(tmp_path_factory):
    """Every tiny kind saved once per test session: {kind: (transformers model, checkpoint dir)}."""
    out = {}
    for kind in TINY_CONFIGS:
        model = make_reference(kind)
        out[kind] = (model, save_reference(model, tmp_path_factory.mktemp(kind)))
    return out


@pytest.fixture(params=["native", "pytorch"])
def attention(request, monkeypatch):
    """Attention over the cache through minispec's own CPU kernel (minispec/native/attention.cpp), or through
    the PyTorch operations that serve where it cannot be built: both must keep every invariance."""
    from minispec import native
    from minispec.models import kernels

    if request.param == "native" and not native.available():
        pytest.skip("minispec's CPU kernels cannot be built here")
    if request.param == "pytorch":
        monkeypatch.setattr(kernels, "native_attention", lambda: False)
    return request.param


class Kept(list):
    """A mode's [tokens, seconds] that steps do not move (known_costs)."""

    def __setitem__(self, index, value):
        pass


@pytest.fixture
def known_costs(monkeypatch):
    """gamma="auto" believing, and keeping, fixed costs: a guess at a tenth of a verification, whose
    cost does not grow with its width, and a draft model's chain steps measured faster than its tree
    steps, these no faster than plain ones (so its trees come only as the policy's counted tries, not
    as the machine's timings happen to fall). The tiny models' real costs make speculation pointless
    (a draft as large as its target), so without this "auto" would mostly decide not to guess."""
    from minispec.decoding import costs, policy

    def stored_profile(profile):  # as if a former process had measured these
        profile.t_verify, profile.t_draft = [0.0] + [1.0] * (policy.GAMMA_MAX + 1), 0.1
        profile.modes = {"chain": Kept([2.0, 1.0, 1.0]), "tree": Kept([1.0, 1.0, 1.0]), "plain": Kept([1.0, 1.0, 1.0])}

    monkeypatch.setattr(policy, "stored_profile", stored_profile)
    monkeypatch.setattr(costs, "TIME_SMOOTHING", 0.0)
    monkeypatch.setattr(policy.VerifyCost, "add", lambda self, width, seconds: 1.0)  # nothing rescaled
    monkeypatch.setattr(policy, "PROFILES", policy.weakref.WeakKeyDictionary())


@pytest.fixture(scope="session")
def llama_with_tokenizer(tmp_path_factory):
    """A tiny random llama whose checkpoint has a byte-level BPE tokenizer, trained here on a few lines
    so that the model's random output is full of characters split across tokens (their UTF-8 bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("llama_tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = ["the cat sat on the mat.", "a dog ran in the park\n\nthen it slept.", "Grüße aus Köln, 東京, 😀!"]
    tokenizer.train_from_iterator(lines * 4, trainer)
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    hf_tokenizer.save_pretrained(directory)
    config = transformers.LlamaConfig(vocab_size=len(hf_tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = spread_init(transformers.LlamaForCausalLM(config).eval(), seed=0, gain=2.0)
    return save_reference(model, directory)
