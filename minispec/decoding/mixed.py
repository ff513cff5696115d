"""draft=[model, "suffix"]: a model's (or head's) guesses and a cheap drafter's chain, up to its first guess
under HALF sure, in one tree (the cheap tokens fixed candidates after the model's draws: exact); a SURE first
cheap guess goes alone. The policy prices the mix apart (`mixed_with`).
"""

from ..models.kernels import to_device
from .tree import add_path, tree_or_chain

HALF = 0.5
SURE = 1.0
CHEAP = ("lookup", "suffix")  # deterministic guesses (q one-hot), previewed for free


def forwarded(name):
    """The model drafter's attribute, read and set through the mixed one."""
    return property(lambda self: getattr(self.main, name), lambda self, value: setattr(self.main, name, value))


class MixedDrafter:
    """A model drafter (ModelDrafter, a head, Medusa) and a cheap one, as one drafter (drafters.py's interface)."""

    preview = None  # the model's guesses cannot be previewed: the policy sizes them by measured speed

    def __init__(self, parts, target):
        cheap = [part for part in parts if part.name in CHEAP]
        if len(parts) != 2 or len(cheap) != 1 or any(isinstance(part, MixedDrafter) for part in parts):
            raise ValueError("several drafters in one tree: give two, a model (or head, 'int8', 'int4', 'ngram') "
                             f"and one of {', '.join(map(repr, CHEAP))}, e.g. draft=[model, 'suffix']")
        self.cheap, self.main = cheap[0], next(part for part in parts if part is not cheap[0])
        self.name, self.model = f"{self.main.name}+{self.cheap.name}", self.main.model
        self.weights, self.reads_states = getattr(self.main, "weights", None), self.main.reads_states
        self.chain = None  # the model's last chain, host ids (None: it drafted a tree, or nothing)
        self.target = target
        self.mixed_with = (self.cheap.name,)  # gamma="auto" prices the mix apart from the model (policy, profiles)

    calls, encoder_calls = forwarded("calls"), forwarded("encoder_calls")
    # the engine's and the prefix cache's
    row, length, unseen, held = forwarded("row"), forwarded("length"), forwarded("unseen"), forwarded("held")

    def start(self, prompt_ids, sampling, row=0):
        self.main.start(prompt_ids, sampling, row)
        self.cheap.start(prompt_ids, sampling, row)
        # prompt tokens the target's cache row does not hold (an encoder's: its decoder starts from one token)
        self.encoded = prompt_ids.shape[-1] - 1 if self.target.is_encoder_decoder else 0

    def cheap_chain(self, depth):
        """The step's cheap chain (host ids) and whether the model sits it out."""
        guesses, sure = self.cheap.preview(depth) if depth > 0 else ([], [])
        n = next((i for i, confidence in enumerate(sure) if confidence < HALF), len(sure))
        return guesses[:n], n > 0 and sure[0] >= SURE

    @staticmethod
    def propose_rows(asks, propose_all):
        """Every row's Proposal: the model's from one propose_all over the rows, merged with each cheap chain."""
        chains = [ask.drafter.cheap_chain(ask.depth or ask.k) for ask in asks]
        inner = propose_all([ask._replace(drafter=ask.drafter.main, k=0 if alone else ask.k)
                             for ask, (_, alone) in zip(asks, chains)])
        return [ask.drafter.merge(proposal, chain) for ask, proposal, (chain, _) in zip(asks, inner, chains)]

    def merge(self, proposal, chain):
        """The model's proposal and the cheap chain in one tree of at most max(its nodes, room)."""
        self.chain = None
        if not chain:
            return proposal
        tokens = proposal.drafts.tolist()
        m = len(tokens)
        self.chain = list(tokens) if proposal.parents is None else None
        parents = list(range(-1, m - 1)) if proposal.parents is None else list(proposal.parents)
        room = self.target.cache_max_seq_len - (len(self.cheap.context) - self.encoded)  # the target row's free slots
        add_path(tokens, parents, chain, max(m, room))
        if len(tokens) == m:  # the model had drafted the chain already
            return proposal
        drafts = to_device(tokens, proposal.drafts.device)  # with q, a tree even if a chain: the model's rows
        return proposal._replace(drafts=drafts, parents=tree_or_chain(parents) if proposal.q is None else parents)

    def accept(self, tokens, tokens_on_device, seen=None):
        main = self.main
        if self.chain is not None and hasattr(main, "fed_guesses"):
            # the draft's cache holds its chain's fed guesses: those the accepted path shares stay
            agreed = next((i for i, (a, b) in enumerate(zip(tokens[:-1], self.chain)) if a != b),
                          min(len(tokens) - 1, len(self.chain)))
            agreed = min(agreed, main.fed_guesses)
            main.length -= main.fed_guesses - agreed
            main.fed_guesses = agreed
        main.accept(tokens, tokens_on_device, seen)
        self.cheap.accept(tokens, tokens_on_device, seen)

    def finish(self, output):
        if hasattr(self.cheap, "finish"):  # the suffix drafter's store learns the request
            self.cheap.finish(output)

