"""Training a draft head by self-distillation (`python -m minispec.tools.train_heads --help`): the target
answers prompts, its states are kept from those forwards (generate's on_states), and the head learns from them
with its paper's loss at positions inside the answers (EAGLE, Medusa: heads/training.py, EAGLE's noise on the
input states teaching it to draft on from its own; EAGLE-3: eagle3_loss). The head is saved into DIR after every
epoch, where `--draft DIR` finds it; DIR/training/ keeps what a resumed run needs."""

import argparse
import json
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm import tqdm

from minispec import CheckpointError, chat_prompt, generate, load
from minispec.api import prompt_tensor
from minispec.cli import AT_LEAST_ONE, check_values, read_prompts_file
from minispec.heads import eagle, eagle3, load_weights, medusa, save_draft_head
from minispec.heads.training import (accuracy_of, bfloat16_products, eagle_loss, medusa_loss, padded_batch,
                                     soft_cross_entropy, target_probabilities, training, update)
from minispec.loading.chat import user_turn_start
from minispec.loading.weights import DTYPES, save_safetensors, write_whole
from minispec.models.kernels import query_rows_mask
from minispec.models.llama import LlamaConfig

# The default prompts: templates over subjects, none of them those of docs/chat-prompts.txt (the bench's).
TEMPLATES = (
    "Explain {} in simple terms.", "Write a short story about {}.", "What are the pros and cons of {}?",
    "Give me five interesting facts about {}.", "Write a short poem about {}.", "How does {} work?",
    "Summarize the history of {} in a paragraph.", "Describe {} to a curious child.",
    "Write a friendly email inviting a colleague to learn about {}.", "List some practical tips about {}.",
    "What are common misconceptions about {}?", "Write a Python function related to {}, with a docstring.",
    "Why does {} matter?", "Write a haiku about {}.", "Give three tips for a beginner interested in {}.",
    "Write a short dialogue between two friends talking about {}.", "Compare {} today with fifty years ago.",
    "Write a short quiz with answers about {}.", "What would a day working with {} look like?",
    "Explain {} to an expert in one paragraph.", "Write a tweet announcing a surprising fact about {}.",
    "What questions should I ask to learn more about {}?", "Write a product description inspired by {}.",
    "Tell me a fun story for kids that involves {}.",
)
SUBJECTS = (
    "volcanoes", "the printing press", "black holes", "honey bees", "electric cars", "the Roman Empire",
    "machine learning", "coffee brewing", "the human heart", "solar panels", "chess openings", "rainforests",
    "the stock market", "origami", "jazz music", "earthquakes", "the internet", "bread baking", "penguins",
    "time management", "the moon landing", "public libraries", "bicycles", "compound interest",
    "the water cycle", "ancient Egypt", "sorting algorithms", "gardening in small spaces", "tides",
    "the violin", "recycling", "sleep", "mountain climbing", "renewable energy", "dinosaurs",
    "the French Revolution", "hash tables", "meditation", "city planning", "octopuses",
    "the Great Wall of China", "glaciers", "submarines", "wind turbines", "coral reefs", "the Olympic Games",
    "credit scores", "linked lists", "cloud computing", "the Renaissance", "tornadoes", "butterflies",
    "3D printing", "podcasts", "board games", "the Silk Road", "nuclear power", "elephants", "blockchains",
    "marathon training", "photography", "the Industrial Revolution", "deserts", "airplanes", "DNA",
    "volunteering", "public speaking", "smartphones", "cheese making", "lighthouses", "the metric system",
    "regular expressions", "wolves", "budgeting", "the Amazon river", "space telescopes", "pottery",
    "video game design", "composting", "the periodic table",
)
PROMPT_TOKENS = 64  # the longest user message own_prompts keeps
OWN_PROMPTS = 1000  # the messages own_prompts tries for
DRAFT_VOCAB = 8192  # answers use few tokens: the most said ones cover nearly all at a fraction of the cost
HELD_OUT = 20  # every 20th answer is held out: its accuracy tells learning from memorising
EPOCHS = {"eagle": 10, "eagle3": 5, "medusa": 5}  # an EAGLE-3 epoch costs about two EAGLE ones
TTT_STEPS = 2  # guesses EAGLE-3 learns to draft on its own states: trained on one, its second is far worse


def default_prompts(target, chat, generator, batch_size):
    """Every template over every subject; for a chat target, every other subject and the messages it
    writes itself (own_prompts), closer to what its users ask: the mix trains at least as well as either."""
    subjects = SUBJECTS[::2] if chat else SUBJECTS
    templated = [template.format(subject) for subject in subjects for template in TEMPLATES]
    return templated + own_prompts(target, OWN_PROMPTS, generator, batch_size) if chat else templated


def own_prompts(target, count, generator, batch_size):
    """Up to `count` user messages the target writes, continued from the start of a user's turn (Magpie,
    Xu et al. 2024), sampled (top-k 50); one not ended within PROMPT_TOKENS, and a repeat, is dropped."""
    start, tokenizer = user_turn_start(target.tokenizer), target.tokenizer
    ends = {*tokenizer.encode("<|im_end|>", add_special_tokens=False), tokenizer.eos_token_id}
    seeds = torch.randint(2**62, (count,), generator=generator).tolist()
    messages = {}
    # 4 batches a call: rows that end early make room for others
    for first in tqdm(range(0, count, 4 * batch_size), "the target writes prompts"):
        chunk = seeds[first:first + 4 * batch_size]
        for written in generate(target, [start] * len(chunk), max_new_tokens=PROMPT_TOKENS, temperature=1.0,
                                top_k=50, seed=chunk, stop_token_ids=[*ends - {None}], batch_size=batch_size):
            text = tokenizer.decode(written.tokens[:-1]).strip()
            if written.tokens[-1] in ends and text:
                messages.setdefault(text)
    return list(messages)


def answer(target, prompts, max_new_tokens, batch_size, chat, taps=None):
    """Per prompt answered with more than one token: (the ids a forward saw, where the answer starts),
    and the target's states there, from the forwards of its greedy answer."""
    ids = [chat_prompt(target.tokenizer, text) if chat else text for text in prompts]
    sequences, records = [], []
    seen = forwards(target, ids, max_new_tokens, batch_size, taps, "the target answers")
    for prompt, (tokens, states) in zip(ids, seen):
        start = prompt_tensor(target, prompt).shape[-1]  # the ids generate() decoded from
        if len(tokens) > start:  # an answer of one token (EOS at once) has nothing to learn from
            sequences.append((tokens, start))
            records.append(states)
    return sequences, records


def record(target, sequences, taps=None, batch_size=16):
    """The target's states over the sequences as `answer` keeps them, for a resumed run (only the
    answers are kept): the forward generate makes for a single new token."""
    prompts = [tokens.tolist() for tokens, _ in sequences]
    return [states for _, states in forwards(target, prompts, 1, batch_size, taps, "recording the target's states")]


def forwards(target, prompts, max_new_tokens, batch_size, taps, what):
    """Per prompt, what the target's forwards saw as it generated: (token ids, states_of those)."""
    hidden, out = None if taps is None else [*taps, len(target.layers)], []
    for start in tqdm(range(0, len(prompts), batch_size), what):
        seen = [[] for _ in prompts[start:start + batch_size]]
        generate(target, prompts[start:start + batch_size], max_new_tokens=max_new_tokens, batch_size=len(seen),
                 state_layers=hidden, on_states=lambda i, tokens, states: seen[i].append((tokens.cpu(), states.cpu())))
        out += [(torch.cat([tokens for tokens, _ in pieces]),
                 states_of(target, torch.cat([states for _, states in pieces]), taps)) for pieces in seen]
    return out


def states_of(target, states, taps):
    """The states a head learns from, [length, dim] (with taps: those states, then the normed last)."""
    if taps is not None:
        tapped, last = states.split([len(taps) * target.hidden_size, target.hidden_size], -1)
        states = torch.cat([tapped, target.norm(last.to(target.device)).cpu()], -1)
    return states.float()


def load_data(file):
    data = load_file(file)
    pieces = data["tokens"].split(data["lengths"].tolist())
    return list(zip(pieces, data["answer_starts"].tolist()))


def batch_groups(sequences, indices, tokens_per_batch, generator=None):
    """The sequences at `indices` in batches of about `tokens_per_batch` padded tokens, shuffled by `generator`."""
    groups, batch = [], []
    order = indices if generator is None else [indices[i] for i in torch.randperm(len(indices), generator=generator)]
    for index in order:
        batch.append(index)
        if max(len(sequences[i][0]) for i in batch) * len(batch) >= tokens_per_batch:
            groups.append(batch)
            batch = []
    return groups + ([batch] if batch else [])


def most_said(sequences, vocab_size, size):
    """The `size` token ids the target said most often in its answers, sorted: a head's draft vocabulary. Ties
    go to the lower ids: a BPE vocabulary numbers its tokens roughly from the most frequent."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens, start in sequences:
        counts += torch.bincount(tokens[start:], minlength=vocab_size)
    return torch.argsort(counts, descending=True, stable=True)[:size].sort().values


def eagle3_loss(head, tokens, states, mask, generator, noise=None, steps=TTT_STEPS):
    """EAGLE-3's loss: q against p over pairs (fc(tapped states at i), x_{i+1}), then `steps` - 1 more
    steps drafted on the head's own states as decoding drafts (unrolled_attention), step j weighing
    0.8^j; the accuracy is the first guess's."""
    tapped, last = states.split([states.shape[-1] - head.config.dim, head.config.dim], -1)
    inputs = F.pad(head.fuse(tapped[:, :-1]), (0, 0, 0, 1))  # pair i's state; a pad pair: whole key blocks
    total, accuracy = 0.0, None
    with unrolled_attention(head) as attend_step:
        for j in range(steps):
            # chain i's pair at step j: (its state, x_{i+1+j}); the target's p at position i+1+j, in the answer
            inputs = attend_step(head.layer_input(head.embed_tokens(shifted(tokens, 1 + j)).to(head.dtype), inputs), j)
            keep = shifted(mask, 1 + j)
            if not keep.any():
                break
            p = target_probabilities(head.target, shifted(last, 1 + j)[keep], head.draft_vocab)
            logits = head.lm_head(head.norm(inputs[keep])).float()
            total = total + soft_cross_entropy(logits, p).mean() * 0.8 ** j
            if j == 0:
                accuracy = accuracy_of(head, logits, shifted(tokens, 2)[keep], shifted(mask, 2)[keep])
    return total, accuracy


def shifted(batch, by):
    """batch [b, T, ...] moved `by` positions to the left along T, zeros (False) coming in at the end."""
    return torch.cat([batch[:, by:], batch.new_zeros(batch.shape[0], min(by, batch.shape[1]), *batch.shape[2:])], dim=1)


@contextmanager
def unrolled_attention(head):
    """attend_step(x, j): the head's layer over step j's pairs x [b, W, 2 dim] (chain i at position
    i + j), attending to step 0's keys at positions <= i and to chain i's own keys of steps 1..j."""
    block = head.layers[0]
    attention, cache = block.attention, block.attention.kv_cache
    kept = Unrolled()
    attention.kv_cache = kept
    group = attention.n_heads // attention.n_kv_heads

    def attend_step(x, j):
        width = x.shape[1]
        chain = torch.arange(width, device=x.device)
        readable = [chain[None] <= chain[:, None]] + [torch.eye(width, dtype=torch.bool, device=x.device)] * j
        mask = query_rows_mask(torch.cat(readable, dim=-1), group)
        positions = chain + j
        return block(x, positions, head.rope_cos[positions], head.rope_sin[positions], mask, None)

    try:
        yield attend_step
    finally:
        attention.kv_cache = cache


class Unrolled(torch.nn.Module):
    """The keys and values of every unrolled step so far, side by side (unrolled_attention)."""
    first_row = 0

    def __init__(self):
        super().__init__()
        self.k, self.v = [], []

    def update(self, input_pos, k, v):
        self.k.append(k.contiguous())
        self.v.append(v.contiguous())
        return torch.cat(self.k, dim=2), torch.cat(self.v, dim=2)


def new_head(kind, target, heads, draft_vocab=None):
    """A fresh head for `target` and its config.json, starting as the identity on the state: EAGLE's
    layers the target's last (a Llama's), Medusa's output heads the target's; q over `draft_vocab` (None: all)."""
    width = target.hidden_size
    if kind == "medusa":
        module = medusa.MedusaHeads(width, target.vocab_size, heads, 1, target).to(target.dtype)
        with torch.no_grad():
            for head in module.heads:
                head[0].linear.weight.zero_()
                head[0].linear.bias.zero_()
                head[-1].weight.copy_(target.head.weight if hasattr(target.head, "weight") else head[-1].weight)
        return module, {"medusa_num_heads": heads, "medusa_num_layers": 1, "hidden_size": width,
                        "vocab_size": target.vocab_size}
    like = target.config if isinstance(getattr(target, "config", None), LlamaConfig) else None
    hf = {"hidden_size": width, "intermediate_size": like.intermediate_size if like else 4 * width,
          "num_attention_heads": like.n_heads if like else max(width // 64, 1),
          "num_key_value_heads": like.n_kv_heads if like else max(width // 64, 1),
          "head_dim": like.head_dim if like else 64 if width >= 64 else width,
          "rms_norm_eps": like.norm_eps if like else 1e-6, "rope_theta": like.rope_theta if like else 10000.0,
          "max_position_embeddings": 1 << 16, "vocab_size": target.vocab_size, "num_hidden_layers": 1,
          "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True}
    if kind == "eagle3":
        return new_eagle3(target, hf, draft_vocab)
    if draft_vocab is not None:
        hf["minispec_draft_vocab"] = len(draft_vocab)
    module = eagle.build(hf, target).to(target.dtype)
    with torch.no_grad():
        module.fc.bias.zero_()
        if like is not None:  # the target's last layer, whose input is much like the states' neighbourhood
            last = target.layers[-1].state_dict()
            module.layers[0].load_state_dict({k: v for k, v in last.items() if not k.startswith("attention_norm")},
                                             strict=False)
        start_as_identity(module, draft_vocab)
    return module, hf


def start_as_identity(module, draft_vocab):
    """An EAGLE or EAGLE-3 head made to start as f̂_{i+1} = f_i: fc the identity on the last state, the
    layer's output projections zeroed (its whole output would swamp the normed states); q on `draft_vocab`."""
    width = module.fc.weight.shape[0]
    if draft_vocab is not None:
        module.draft_vocab.copy_(draft_vocab)
    module.fc.weight.zero_()
    module.fc.weight[:, -width:].copy_(torch.eye(width))
    module.layers[0].attention.wo.weight.zero_()
    module.layers[0].feed_forward.w2.weight.zero_()


def new_eagle3(target, hf, draft_vocab):
    """new_head's EAGLE-3 head (a Llama target's), in EAGLE-3's published layout."""
    taps = eagle3.training_taps(len(target.layers))
    hf = {**{k: v for k, v in hf.items() if k != "bias"}, "architectures": ["LlamaForCausalLMEagle3"],
          "draft_vocab_size": target.vocab_size if draft_vocab is None else len(draft_vocab),
          "eagle_aux_hidden_state_layer_ids": list(taps), "tie_word_embeddings": False}
    module = eagle3.build(hf, target).to(target.dtype)
    last, block = target.layers[-1], module.layers[0]
    with torch.no_grad():
        block.load_state_dict({k: v for k, v in last.state_dict().items() if "wqkv" not in k}, strict=False)
        block.hidden_norm.weight.copy_(last.attention_norm.weight)
        # q/k/v read [embedding, state]: the last layer's own on each half, halved
        block.attention.wqkv.weight.copy_(torch.cat([last.attention.wqkv.weight] * 2, dim=1) / 2)
        module.norm.weight.copy_(target.norm.weight)
        module.lm_head.weight.copy_(eagle.head_rows(target, draft_vocab))
        start_as_identity(module, draft_vocab)  # as its highest tap
    return module, hf


def train(target, out, kind="eagle", prompts=None, epochs=None, max_new_tokens=128, lr=2e-3, heads=4,
          batch_size=64, tokens_per_batch=512, chat=True, seed=0, draft_vocab=DRAFT_VOCAB):
    """Train a draft head for `target` into folder `out` (resuming what is there); returns the head.
    draft_vocab: q covers that many most said tokens (0: all); epochs 0: the untrained head, unsaved."""
    epochs = EPOCHS.get(kind) if epochs is None else epochs
    check_settings(target, kind, epochs, lr, heads, draft_vocab)
    out = Path(out)
    state = out / "training"
    state.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    data_file = state / "data.safetensors"
    taps = eagle3.training_taps(len(target.layers)) if kind == "eagle3" else None
    if data_file.is_file():  # a resumed run: its answers are kept, their states (gigabytes) are not
        with resuming(out):
            sequences = load_data(data_file)
            if not sequences or max(int(tokens.max()) for tokens, _ in sequences) >= target.vocab_size:
                raise ValueError(f"{data_file} holds no answers, or token ids of another target")
        records = None  # recorded once the resume files are read: a run that cannot resume fails at once
    else:
        chat = chat and target.tokenizer is not None and target.tokenizer.chat_template is not None
        prompts = prompts or default_prompts(target, chat, generator, batch_size)
        sequences, records = answer(target, prompts, max_new_tokens, batch_size, chat, taps)
        tokens, starts = zip(*sequences)
        save_safetensors({"tokens": torch.cat(tokens), "lengths": torch.tensor([len(t) for t in tokens]),
                          "answer_starts": torch.tensor(starts)}, data_file, sync=True)
    reduced = kind != "medusa" and 0 < draft_vocab < target.vocab_size
    head, hf = new_head(kind, target, heads, most_said(sequences, target.vocab_size, draft_vocab) if reduced else None)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95))
    done = resume(out, head, optimizer)
    records = record(target, sequences, taps, batch_size) if records is None else records
    loss_of = {"eagle": eagle_loss, "eagle3": eagle3_loss, "medusa": medusa_loss}[kind]
    longest = max(len(s) for s, _ in sequences) + 32 + TTT_STEPS  # RoPE's positions: whole key blocks, unrolled steps
    held = list(range(HELD_OUT - 1, len(sequences), HELD_OUT)) if len(sequences) >= 2 * HELD_OUT else []
    learn = sorted(set(range(len(sequences))) - set(held))
    steps_per_epoch = len(batch_groups(sequences, learn, tokens_per_batch))
    total, first = max(epochs * steps_per_epoch, 1), done * steps_per_epoch
    # a warmup over 5% of the steps, then a cosine decay: the first steps' large gradients throw a head off
    warmup = max(total // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min((first + step + 1) / warmup, 1) * 0.5 * (
        1 + math.cos(math.pi * min((first + step) / total, 1))))
    for epoch in range(done, epochs):
        accuracies = []
        groups = tqdm(batch_groups(sequences, learn, tokens_per_batch, generator), f"epoch {epoch + 1}/{epochs}")
        with training(head, longest):
            for step, group in enumerate(groups):
                batch = [tensor.to(target.device) for tensor in padded_batch(sequences, records, group)]
                loss, accuracy = update(head, optimizer, loss_of, batch, generator)
                if not torch.isfinite(loss):  # the last finished epoch's head stays as it was saved
                    raise ValueError(f"training diverged at epoch {epoch + 1}, step {step + 1} (loss {loss.item()}); "
                                     f"{out} keeps the head of the last finished epoch: try a lower lr")
                schedule.step()
                accuracies.append(float(accuracy))
                groups.set_postfix_str(f"loss {loss.item():.3f}, next-token accuracy "
                                       f"{sum(accuracies[-20:]) / len(accuracies[-20:]):.2f}")
            if held:
                with torch.no_grad(), bfloat16_products(target.device):
                    scores = [float(loss_of(head, *[t.to(target.device) for t in padded_batch(sequences, records, g)],
                                            None, noise=0)[1]) for g in batch_groups(sequences, held, tokens_per_batch)]
                sys.stderr.write(f"epoch {epoch + 1}/{epochs}: next-token accuracy on the {len(held)} held-out "
                                 f"answers {sum(scores) / len(scores):.2f}\n")
        save_draft_head(head, hf, out)
        # AdamW's moments and step counts by parameter index, as tensors: safetensors, not pickle
        moments = {f"{i}.{name}": value for i, kept in optimizer.state_dict()["state"].items()
                   for name, value in kept.items()}
        save_safetensors(moments, state / "optimizer.safetensors", sync=True)
        progress_text = json.dumps({"epochs_done": epoch + 1, "kind": kind}) + "\n"
        write_whole(state / "progress.json", lambda file: file.write_text(progress_text), sync=True)
    return head


def check_settings(target, kind, epochs, lr, heads, draft_vocab):
    """A ValueError naming a setting training could only fail or learn nothing with, before answering."""
    if kind not in EPOCHS:
        raise ValueError(f"kind must be eagle, eagle3 or medusa, got {kind!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be an integer >= 0, got {epochs!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    if kind == "eagle3":
        eagle3.check_target(target)
    if target.quantization is not None:  # a head starts from the target's float weights (its layer, its head)
        raise ValueError("a head is trained on a float target: load it without quantize (a head loaded beside "
                         "a quantized target is quantized then)")
    if kind == "medusa" and not (isinstance(heads, int) and heads >= 1):
        raise ValueError(f"a Medusa head needs heads >= 1, got {heads!r}")
    if draft_vocab < 0:
        raise ValueError(f"draft_vocab must be a token count >= 0 (0: the whole vocabulary), got {draft_vocab}")
    if target.dtype == torch.float16:  # its gradients under- and overflow without loss scaling: NaN heads
        raise ValueError("training in float16 is not supported: train in float32 or bfloat16 (--dtype); the "
                         "head then drafts for a float16 target too")


def resume(out, head, optimizer):
    """Epochs an earlier run finished in `out`, after loading its head and optimizer state (0: none); a
    CheckpointError naming the file when what is there cannot be resumed from."""
    progress_file = out / "training" / "progress.json"
    if not progress_file.is_file():
        return 0
    with resuming(out):
        progress = json.loads(progress_file.read_text())
        done = progress["epochs_done"]
        if progress["kind"] != head.kind or not (isinstance(done, int) and done >= 0):
            raise ValueError(f"{progress_file} is a {progress['kind']} head's, not this {head.kind} head's")
        load_weights(head, out)  # copied in: the optimizer holds these parameters
        state = {}
        for name, value in load_file(out / "training" / "optimizer.safetensors").items():
            index, _, key = name.partition(".")  # "<parameter index>.<its state's name>"
            if not index.isdigit() or not key:
                raise ValueError(f"{out}/training/optimizer.safetensors is another head's")
            state.setdefault(int(index), {})[key] = value
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        if sorted(state) != list(range(len(parameters))) or any(
                value.dim() and value.shape != parameters[i].shape for i in state for value in state[i].values()):
            raise ValueError(f"{out}/training/optimizer.safetensors is another head's")
        # onto the parameters' devices (the file's tensors load on the CPU)
        optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    return done


@contextmanager
def resuming(out):
    """An unreadable resume file (missing, cut short, another head's) as one CheckpointError."""
    try:
        yield
    except (OSError, ValueError, KeyError, TypeError, SafetensorError, RuntimeError) as error:
        raise CheckpointError(f"cannot resume the training in {out} ({error}); remove {out / 'training'} to start "
                              "afresh") from None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minispec.tools.train_heads",
                                     description="Train a draft head for a target (resumes an interrupted run).")
    parser.add_argument("--target", required=True, help="the target, as run.py's --target")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--out", required=True, help="the head's folder (made if missing)")
    parser.add_argument("--kind", choices=("eagle", "eagle3", "medusa"), default="eagle")
    parser.add_argument("--prompts", help="a file of prompts, one per line (default: templates, and for a chat "
                        "target prompts it writes itself)")
    parser.add_argument("--epochs", type=int, help=f"default: {EPOCHS['eagle']} (eagle3: {EPOCHS['eagle3']})")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's answers")
    parser.add_argument("--heads", type=int, default=4, help="Medusa: how many heads")
    parser.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB, metavar="N",
                        help="EAGLE, EAGLE-3: the head guesses among the target's N most said tokens (0: all)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--no-chat", action="store_true", help="answer the prompts as raw text, not chat turns")
    args = parser.parse_args(argv)
    try:
        # train(epochs=0) only returns the untrained head: nothing would be written
        check_values(args, {"--epochs": AT_LEAST_ONE})
        prompts = read_prompts_file(args.prompts, "--prompts") if args.prompts else None
        target = load(args.target, device=args.device, dtype=DTYPES.get(args.dtype))
        train(target, args.out, args.kind, prompts, args.epochs, args.max_new_tokens, args.lr, args.heads,
              chat=not args.no_chat, draft_vocab=args.draft_vocab)
    except (ValueError, OSError, CheckpointError) as error:
        print(f"minispec: {error}", file=sys.stderr)
        return 2
    print(f"minispec: the head is in {args.out}; use it with --draft {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
