"""EAGLE (Li, Wei, Zhang & Zhang, ICML 2024): the target drafts for itself at the feature level. One
decoder layer of the target's shape predicts the target's next last hidden state f from the current one
and the token that followed, and the target's own output head reads it:

    f̂_{i+1} = Layer(fc([embed(x_{i+1}), f_i])),    q_{i+2} = softmax(target.logits(f̂_{i+1}))

It drafts through drafters.py's loop, with its own KV cache; a reduced draft vocabulary (EAGLE-3's idea)
cuts the output head, q then being zero outside it. Checkpoints: EAGLE-1/2 heads as published (fc.* and
layers.0.* in Hugging Face names, no input norm in layer 0), and heads trained here.
"""

import torch
from torch import nn

from ..decoding.drafters import ModelDrafter
from ..loading.weights import CheckpointError
from ..models.base import CachedLM, Embedding, Linear
from ..models.kernels import can_pack, pack
from ..models.checks import FLAG, Check, check, integer
from ..models.llama import Llama, LlamaConfig, TransformerBlock, convert_hf_weights


class EagleHead(Llama):
    """A one-layer Llama over fc([embed(token), the target's state]), with the target's embedding and head."""

    kind = "eagle"

    def __init__(self, config, bias, target, draft_vocab_size=None):
        CachedLM.__init__(self)
        self.config = config
        self.fc = Linear(2 * config.dim, config.dim, bias=bias)
        self.layers = nn.ModuleList(TransformerBlock(config, None) for _ in range(config.n_layers))
        self.layers[0].attention_norm = nn.Identity()  # fc's output goes in as it is (EAGLE's layer 0)
        self.__dict__["target"] = target  # not a submodule: its weights are the target's, loaded once
        # the target token ids q may be non-zero on (None: all); their head rows are taken at first use
        self.register_buffer("draft_vocab", None if draft_vocab_size is None else
                             torch.zeros(draft_vocab_size, dtype=torch.long))
        self.__dict__["reduced"] = None

    @property
    def vocab_size(self):
        return self.target.vocab_size

    @property
    def head(self):
        return self.target.head

    def embed_tokens(self, tokens):
        return self.target.embed_tokens(tokens)

    def logits(self, hidden):
        if self.draft_vocab is None:
            return self.target.logits(hidden)
        return self.spread(self.reduced_head()(hidden).float())

    def spread(self, drafted):
        """Logits over the draft vocabulary -> over the target's, -inf outside it."""
        logits = drafted.new_full((*drafted.shape[:-1], self.vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.draft_vocab, drafted)

    def reduced_head(self):
        """A Linear of the draft vocabulary's rows of the target's output head."""
        if self.reduced is None:
            reduced = nn.utils.skip_init(Linear, self.config.dim, len(self.draft_vocab), bias=False,
                                         device=self.device, dtype=self.dtype)
            reduced.weight = nn.Parameter(head_rows(self.target, self.draft_vocab).to(self.dtype).contiguous(),
                                          requires_grad=False)
            if can_pack(self.dtype, self.device):
                pack(reduced.weight)
                reduced.packed = True
            self.__dict__["reduced"] = reduced
        return self.reduced

    def features(self, tokens, input_pos, layout=None, keys=None, last=None, inputs=None):
        """The predicted next states of the pairs (inputs[:, j], tokens[:, j]); zeros stand in for no inputs."""
        embedded = self.embed_tokens(tokens).to(self.dtype)
        inputs = torch.zeros_like(embedded) if inputs is None else inputs.to(self.dtype)
        x = self.blocks(self.layer_input(embedded, inputs), input_pos, layout, keys)
        return x if last is None else x[:, x.shape[1] - last:]

    def layer_input(self, embedded, states):
        return self.fc(torch.cat([embedded, states], dim=-1))

    def drafter(self):
        return EagleDrafter(self)


def head_rows(target, ids=None):
    """The rows of the target's output head for token ids (None: all) [n, dim]: the float weight, or for any
    other head (quantized, sharded) its logits of the identity."""
    head = target.head
    if type(head) in (Linear, Embedding) and head.weight.is_floating_point():
        return head.weight if ids is None else head.weight[ids]
    rows = target.logits(torch.eye(target.hidden_size, dtype=target.dtype, device=target.device)).T
    return rows if ids is None else rows[ids]


class EagleDrafter(ModelDrafter):
    """Guesses for one request through an EagleHead, in its own row of the head's cache."""

    name = "eagle"
    reads_states = True

    def start(self, prompt_ids, sampling=None, row=0):
        super().start(prompt_ids, row=row)
        self.unseen = None  # nothing to draft from before the target's first forward gives its states
        self.held = None  # a stored prefix's pairs (decoding/prefix.py): they go first, with the first states

    def accept(self, tokens, tokens_on_device, seen=None):
        # each state seen pairs with the token after it; pairs waiting from steps that drafted nothing go first
        fed, states = seen
        self.length -= self.fed_guesses  # the guesses' pairs held predicted states: the real ones follow
        new = torch.cat([fed[1:], tokens_on_device[-1:]])
        if self.held is not None:  # then the pairs are those of a cold run's prompt, and fed as its are
            new, states = torch.cat([self.held[0].to(new.device), new]), torch.cat([self.held[1], states])
            self.held = None
        states = self.inputs(states)
        self.unseen = new if self.unseen is None else torch.cat([self.unseen, new])
        self.unseen_states = states if self.unseen_states is None else torch.cat([self.unseen_states, states])
        self.next_logits = None

    def inputs(self, states):
        """The target's states -> what the head reads beside each token."""
        return states


def llama_config(hf, target):
    """The head's LlamaConfig, its vocabulary the target's."""
    config = LlamaConfig.from_hf({"vocab_size": target.vocab_size, "max_position_embeddings": 1 << 20, **hf})
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"the head's vocab_size {config.vocab_size} is not the target's ({target.vocab_size})")
    return config


def build(hf, target):
    """The head for config.json `hf`, checked against `target`."""
    config = llama_config(hf, target)
    if config.dim != target.hidden_size:
        raise ValueError(f"an EAGLE head of hidden_size {config.dim} cannot draft for {target.name}, whose "
                         f"hidden states have {target.hidden_size}")
    size = check(hf, "minispec_draft_vocab", Check(integer(1, target.vocab_size),
                                                   f"must be a token count in 1..{target.vocab_size}"), None)
    return EagleHead(config, check(hf, "bias", FLAG, True), target, size)


def check_draft_vocab(head, source):
    """A CheckpointError when the loaded draft vocabulary is not distinct target token ids."""
    ids = head.draft_vocab
    if ids is not None and (ids.min() < 0 or ids.max() >= head.vocab_size or len(ids.unique()) != len(ids)):
        stored = "d2t (EAGLE-3's offsets to target ids)" if head.kind == "eagle3" else "draft_vocab"
        raise CheckpointError(f"{source}: {stored} must give distinct token ids below {head.vocab_size}")


def convert_weights(weights, head):
    """Published names -> ours: layers.0.* as a Llama's; a copy of the target's embedding dropped."""
    weights = {name.removeprefix("model."): tensor for name, tensor in weights.items()
               if not name.endswith("embed_tokens.weight")}
    return convert_hf_weights(weights, head.config)


def published(head):
    """Our tensors under the published names (convert_weights' inverse)."""
    c, out = head.config, {}
    for name, tensor in head.state_dict().items():
        layer, _, rest = name.partition(".attention.")
        if rest.startswith("wqkv."):
            kind = rest.split(".")[-1]
            parts = tensor.split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim])
            out.update({f"{layer}.self_attn.{p}_proj.{kind}": part for p, part in zip("qkv", parts)})
            continue
        layer, _, rest = name.partition(".feed_forward.")
        if rest.startswith("w13."):
            gate, up = tensor.chunk(2)
            out.update({f"{layer}.mlp.gate_proj.{rest[4:]}": gate, f"{layer}.mlp.up_proj.{rest[4:]}": up})
            continue
        for ours, theirs in ((".attention.wo.", ".self_attn.o_proj."), (".feed_forward.w2.", ".mlp.down_proj."),
                             (".ffn_norm.", ".post_attention_layernorm."), (".attention_norm.", ".input_layernorm.")):
            name = name.replace(ours, theirs)
        out[name] = tensor
    return out
