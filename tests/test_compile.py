"""torch.compile'd decoding: identical tokens to eager, no recompilation after warm-up, and (simulated on
CPU) no logits read after CUDA graphs would have reused their memory."""

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

import minispec
from minispec.models.base import Feed
from minispec.decoding import drafters, policy
from minispec import native
from conftest import VOCAB, make_reference, noisy_copy, save_reference, spread_init

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_reference(make_reference("llama_gqa"), tmp_path_factory.mktemp("llama_gqa"))


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen3", "gemma3"])
def test_compiled_decoding_matches_eager_and_never_recompiles(checkpoint, tmp_path, kind):
    checkpoint = checkpoint if kind == "llama_gqa" else save_reference(make_reference(kind), tmp_path)
    eager_target, eager_draft = minispec.load(checkpoint), minispec.load(checkpoint)
    target, draft = minispec.load(checkpoint, compile=True), minispec.load(checkpoint, compile=True)
    settings = {"gamma": 3, "max_new_tokens": 24, "ignore_eos": True}

    # Warm-up compiles one graph per token width: verify (γ+1), draft steps (1, and 2 after a fully
    # accepted block), and the narrower verifies at the end of a request.
    warm = minispec.generate(target, PROMPT, draft=draft, **settings)
    assert warm.tokens == minispec.generate(eager_target, PROMPT, draft=eager_draft, **settings).tokens
    assert warm.stats["acceptance_rate"] == 1.0
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2

    # A new request with another prompt length and a sampled autoregressive run: same graphs only.
    with torch._dynamo.config.patch(error_on_recompile=True):
        longer = PROMPT + [3, 4, 30]
        out = minispec.generate(target, longer, draft=draft, **settings)
        plain = minispec.generate(target, longer, max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=1)
    assert counters["stats"]["unique_graphs"] == graphs
    assert out.tokens == minispec.generate(eager_target, longer, draft=eager_draft, **settings).tokens
    assert plain.tokens == minispec.generate(eager_target, longer, max_new_tokens=24, ignore_eos=True,
                                             temperature=1.0, seed=1).tokens


def test_compiling_on_a_cpu_skips_inductors_instruction_set_probe(checkpoint):
    """Where minispec's kernels built for this CPU, inductor is told its vector instructions work rather
    than building and loading test programs in every process (7 s cold, 1 s warm); a user's own
    setting stands."""
    # Set and restored by hand: through torch 2.14's config proxy monkeypatch reads no old value, so its
    # undo deleted the setting, and every later compile in the session failed to read it.
    config, saved = torch._inductor.config.cpp, torch._inductor.config.cpp.vec_isa_ok
    try:
        config.vec_isa_ok = None
        minispec.load(checkpoint, compile=True)
        assert config.vec_isa_ok is (True if native.available() else None)
        config.vec_isa_ok = False
        minispec.load(checkpoint, compile=True)
        assert config.vec_isa_ok is False
    finally:
        config.vec_isa_ok = saved


def test_compiled_quantized_decoding_matches_eager_and_never_recompiles(checkpoint):
    """Quantized layers compile into the same full graphs (fullgraph=True: no graph break) and, after
    warm-up, never recompile: an int4 target decoding plain and sampled, and a float target drafting
    with its int8 copy (compiled because the target is); the int4 target with `lookup` gives its plain
    greedy tokens. Compiled matches eager, but for minispec's own CPU kernel (minispec/native)
    on the int4 target: it rounds its inputs to int8 in blocks scaled by each block's largest value, so
    the last-bit differences of inductor's norms can move a whole block's rounding."""
    eager_int4 = minispec.load(checkpoint, quantize="int4")
    int4 = minispec.load(checkpoint, quantize="int4", compile=True)
    eager_target, target = minispec.load(checkpoint), minispec.load(checkpoint, compile=True)
    sampled = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 1.0, "seed": 1}
    greedy = {"max_new_tokens": 16, "ignore_eos": True}
    drafted = {"max_new_tokens": 16, "ignore_eos": True, "draft": "int8", "gamma": 3}

    def run(int4_model, target_model, prompt):
        return (minispec.generate(int4_model, prompt, **sampled).tokens,
                minispec.generate(int4_model, prompt, **greedy).tokens,
                minispec.generate(target_model, prompt, **drafted).tokens)

    def same(compiled, eager):
        return compiled == eager if not int4.head.native else compiled[2] == eager[2]

    assert same(run(int4, target, PROMPT), run(eager_int4, eager_target, PROMPT))  # warm-up: compiles
    assert drafters.SELF_DRAFTS[target]["int8"].compiled_forward is not None
    graphs = counters["stats"]["unique_graphs"]
    longer = PROMPT + [3, 4, 30]
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = run(int4, target, longer)
    assert counters["stats"]["unique_graphs"] == graphs
    assert same(compiled, run(eager_int4, eager_target, longer))
    assert minispec.generate(int4, longer, draft="lookup", gamma=3, **greedy).tokens == compiled[1]


def test_compiled_int4_on_pytorchs_kernel_matches_eager(checkpoint, monkeypatch):
    """Where minispec's kernel does not take a layer (MINISPEC_NATIVE=0, no compiler), int4 layers run
    aten's CPU int4 kernel, opaque to torch.compile: inductor's lowering of it failed ("group size must
    be a scalar"). Compiled, the eager model's greedy tokens, plain and with a draft."""
    monkeypatch.setattr(native, "takes", lambda in_features, group: False)
    eager = minispec.load(checkpoint, quantize="int4")
    compiled = minispec.load(checkpoint, quantize="int4", compile=True)
    assert not compiled.layers[0].feed_forward.w13.native
    for settings in ({}, {"draft": "lookup", "gamma": 3}):
        settings = {"max_new_tokens": 12, "ignore_eos": True, **settings}
        assert (minispec.generate(compiled, PROMPT, **settings).tokens ==
                minispec.generate(eager, PROMPT, **settings).tokens)


@pytest.fixture(scope="module")
def three_query_heads_a_group(tmp_path_factory):
    """SmolLM2's grouping (3 query heads to a key/value head): padding its attention rows to a multiple
    of 4 would make a compiled graph guard on the width modulo 4."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    model = spread_init(transformers.LlamaForCausalLM(config).eval(), seed=0)
    return save_reference(model, tmp_path_factory.mktemp("three_a_group"))


def test_one_graph_serves_every_width_above_one_on_a_cpu(three_query_heads_a_group):
    """On a CPU compiled forwards over 2 to 8 tokens share one graph (its token dimension symbolic)
    and a 1-token forward has its own: what gamma="auto" and trees meet is two graphs (a power of two
    of widths each, before: four, each 15-20 s for a 1.5B model). Each gives the eager forward's logits
    (to float tolerance: inductor fuses differently) and writes no cache slot past its tokens."""
    torch._dynamo.reset()  # no graph an earlier test compiled for a model of these shapes
    checkpoint = three_query_heads_a_group
    model, eager = minispec.load(checkpoint, compile=True), minispec.load(checkpoint)
    for m in (model, eager):
        m.setup_caches(1, 64)
        m.prefill(torch.tensor([PROMPT]))
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    counters.clear()
    for n in (3, 4, 3, 5, 8, 2, 7, 6, 1, 3):
        for m in (model, eager):
            m.rollback(len(PROMPT))
        caches = [layer.attention.kv_cache for layer in model.layers]
        for cache in caches:
            cache.k[:, :, len(PROMPT):] = 0
        logits = model.decode(tokens[:, :n])
        assert logits.shape[1] == n
        torch.testing.assert_close(logits, eager.decode(tokens[:, :n]), rtol=1e-4, atol=1e-4)
        assert all(cache.k[0, :, len(PROMPT) + n - 1].any() and not cache.k[0, :, len(PROMPT) + n:].any()
                   for cache in caches)
    # PyTorch's attention (no minispec kernel: MINISPEC_NATIVE=0) pads its rows to a multiple of 4: one
    # graph for 1 token and one for each remainder of the rest (2 to 8 tokens: 3 remainders)
    assert counters["stats"]["unique_graphs"] == (2 if native.available() else 4)


def test_compiled_trees_match_eager_and_never_recompile(checkpoint):
    """A token tree through the compiled forward: the eager forward's logits (to float tolerance), and
    trees further on (their window in other key blocks) run the same graph."""
    torch._dynamo.reset()
    counters.clear()
    model, eager = minispec.load(checkpoint, compile=True), minispec.load(checkpoint)
    parents, tokens = [[-1, 0, 0, 1, -1]], torch.tensor([[3, 1, 4, 1, 5]])
    for length in (7, 45, 80):
        with torch._dynamo.config.patch(error_on_recompile=length > 7):
            logits = []
            for m in (model, eager):
                m.setup_caches(1, 128)
                m.prefill(torch.arange(length)[None] % 50)
                logits.append(m.decode_rows(Feed(tokens, [length], parents=parents)))
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1


def test_a_lone_chain_and_tree_of_one_width_share_a_graph_on_a_cpu(checkpoint):
    """On a CPU a lone request's chain goes through the tree path when compiled: with trees chosen per
    step, one graph instead of two (each 15-20 s for a large model on a CPU). Its logits stay the
    eager chain's."""
    torch._dynamo.reset()
    model, eager = minispec.load(checkpoint, compile=True), minispec.load(checkpoint)
    for m in (model, eager):
        m.setup_caches(1, 64)
        m.prefill(torch.tensor([PROMPT]))
    counters.clear()
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    for parents in (None, [[-1, 0, 0, 1, 1]], None):
        for m in (model, eager):
            m.rollback(len(PROMPT))
        torch.testing.assert_close(model.decode_rows(Feed(tokens, [len(PROMPT)], parents=parents)),
                                   eager.decode_rows(Feed(tokens, [len(PROMPT)], parents=parents)), rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1


def test_auto_trees_fit_the_widest_chain_graph():
    """tree="auto" weighs trees of up to TREE_AUTO guesses, fed with the token before them: that forward
    fits the graph of the widest chain gamma="auto" verifies (GAMMA_MAX guesses and that token), so
    on a GPU, a graph per power of two of widths, trees capture no wider graph."""
    from minispec.decoding.policy import GAMMA_MAX
    from minispec.decoding.tree import TREE_AUTO
    from minispec.models.compiled import compiled_width

    assert compiled_width(TREE_AUTO + 1) <= compiled_width(GAMMA_MAX + 1)


def test_a_step_that_compiles_a_graph_is_not_timed(checkpoint, monkeypatch):
    """The policy prices steps by their wall time, but a compiled forward meeting a new width compiles a
    graph first, seconds to minutes on a CPU that no later step costs again: such a step reaches the
    policy untimed. (Timed, the first plain step's compile set SmolLM2's verify line at 24 s a token,
    and a `lookup` request never guessed.) Every step after the prompt's is timed unless the target's
    or the draft's graphs grew during it (the process's count of graphs), and some did grow."""
    torch._dynamo.reset()  # graphs reused from earlier tests would compile nothing here
    target = minispec.load(checkpoint, compile=True)
    steps = []
    observe = policy.FixedGamma.observe

    def spy(self, k, n, emitted, draft_seconds, step_seconds, nodes=0):
        steps.append((counters["stats"]["unique_graphs"], step_seconds))
        return observe(self, k, n, emitted, draft_seconds, step_seconds, nodes)

    monkeypatch.setattr(policy.FixedGamma, "observe", spy)
    minispec.generate(target, PROMPT, draft="int8", gamma=3, max_new_tokens=24, ignore_eos=True)
    compiled = [after > before for (before, _), (after, _) in zip(steps, steps[1:])]
    assert any(compiled) and not all(compiled)
    assert all((seconds is None) == grew for grew, (_, seconds) in zip(compiled, steps[1:]))


def test_a_beam_step_that_compiles_a_graph_is_not_timed(checkpoint, monkeypatch):
    """The same for speculative beam search, whose steps verify w + u·k rows: untimed where the target's
    or the draft's graphs grew during the step, timed otherwise (the first step is the prompt's)."""
    torch._dynamo.reset()
    target, draft = minispec.load(checkpoint, compile=True), minispec.load(checkpoint, compile=True)
    steps = []
    observe = policy.FixedGamma.observe

    def spy(self, k, n, emitted, draft_seconds, step_seconds, nodes=0):
        steps.append((counters["stats"]["unique_graphs"], step_seconds))
        return observe(self, k, n, emitted, draft_seconds, step_seconds, nodes)

    monkeypatch.setattr(policy.FixedGamma, "observe", spy)
    minispec.generate(target, PROMPT, draft=draft, gamma=2, beams=2, draft_beams=2, max_new_tokens=12, ignore_eos=True)
    compiled = [after > before for (before, _), (after, _) in zip(steps, steps[1:])]
    assert any(compiled) and not all(compiled)
    assert all((seconds is None) == grew for grew, (_, seconds) in zip(compiled, steps[1:]))


class ReusedOutputs:
    """CUDA graphs' memory reuse, on CPU: a replay writes its outputs where earlier replays' outputs
    live (cudagraph trees share one memory pool across graphs), so logits read after a later forward
    are garbage. Every call here first fills the outputs of all earlier calls with NaN."""

    def __init__(self):
        self.outputs = []

    def install(self, model):
        def forward(tokens, input_pos, *rest):  # rest: a tree's layout (chains on a CPU are trees too)
            for old in self.outputs:
                old.fill_(float("nan"))
            self.outputs = [model.forward(tokens, input_pos, *rest)]
            return self.outputs[0]

        model.compiled_forward = forward  # where decode() looks for the compiled forward
        return model


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen3", "gemma3", "t5_v1_1"])
@pytest.mark.parametrize("settings", [
    {"max_new_tokens": 24, "temperature": 1.0, "seed": 1},
    {"max_new_tokens": 24, "gamma": 4},
    {"max_new_tokens": 24, "gamma": 3, "temperature": 1.0, "top_p": 0.9, "seed": 2},
    {"max_new_tokens": 12, "gamma": 3, "beams": 2, "draft_beams": 4},
])
def test_no_logits_read_after_a_later_forward(tmp_path, kind, settings):
    """What tests/test_cuda.py checks with real CUDA graphs, checked in CI: plain, speculative and
    beam-search decoding consume each forward's logits before the next forward of either model."""
    reference = make_reference(kind)
    target_dir = save_reference(reference, tmp_path / "target")
    draft_dir = save_reference(noisy_copy(reference, seed=1, scale=0.1), tmp_path / "draft")
    with_draft = "gamma" in settings

    def run(target, draft):
        return minispec.generate(target, PROMPT * 3, draft=draft if with_draft else None, ignore_eos=True, **settings)

    expected = run(minispec.load(target_dir), minispec.load(draft_dir))
    pool = ReusedOutputs()
    out = run(pool.install(minispec.load(target_dir)), pool.install(minispec.load(draft_dir)))
    assert out.tokens == expected.tokens and out.sequences == expected.sequences
    if with_draft:
        assert 0 < out.stats["accepted"] < out.stats["proposed"]  # rollbacks happened
