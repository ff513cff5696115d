"""SentencePiece tokenizers (tokenizer.model, spiece.model), read only by checkpoints that have no byte-level
tokenizer.json, and run by the sentencepiece library: converting one for `tokenizers`, as transformers does,
needs protobuf to read its normalization rules."""
import re

from .tokenizer import Tokenizer

# What an lstrip/rstrip token swallows beside it: Unicode's White_Space, as the reference (Python's \s also
# holds U+001C..U+001F).
WHITESPACE = "[\t-\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]*"


def added_token_regex(tokens):
    """One regex matching any of `tokens` (longest first: the reference's leftmost-longest search) with the
    whitespace lstrip/rstrip tokens swallow; group k is tokens[k - 1]. For no tokens, one that never matches."""
    return re.compile("|".join(
        f"({WHITESPACE if t.get('lstrip') else ''}{re.escape(t['content'])}{WHITESPACE if t.get('rstrip') else ''})"
        for t in tokens) or "(?!)")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model with the Hugging Face conventions: Llama-style models add BOS, T5 appends EOS; added
    tokens (added_tokens_decoder, T5's <extra_id_N>, the model's control symbols) are cut out of the text first,
    each stretch of text between them encoded on its own as Llama's "legacy" tokenizer does."""

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
        self.literal_ids = set(self.added)
        tokens = sorted(added.values(), key=lambda t: -len(t["content"]))
        plain = [t for t in tokens if not t.get("special")]
        # what cuts added tokens out of the text: all of them, or with split_special_tokens the plain ones
        self.matchers = {False: (added_token_regex(tokens), tokens), True: (added_token_regex(plain), plain)}
        own = {"bos_token_id": self.sp.bos_id(), "eos_token_id": self.sp.eos_id(), "pad_token_id": self.sp.pad_id()}
        for name, i in own.items():  # the model's own ids where the config names none
            if getattr(self, name) is None and i >= 0:
                setattr(self, name, i)
        add_bos, add_eos = config.get("add_bos_token", not t5), config.get("add_eos_token", t5)
        self.prefix = [self.bos_token_id] if add_bos and self.bos_token_id is not None else []
        self.suffix = [self.eos_token_id] if add_eos and self.eos_token_id is not None else []

    def encode_text(self, text, split_special_tokens):
        # SentencePiece reads no special token's text as that token: split_special_tokens needs nothing more.
        regex, tokens = self.matchers[split_special_tokens]
        ids, start = [], 0
        for match in regex.finditer(text):
            ids += self.sp.encode(text[start:match.start()]) + [tokens[match.lastindex - 1]["id"]]
            start = match.end()
        return ids + self.sp.encode(text[start:])

    def decode_run(self, ids):
        return self.sp.decode(ids)  # dropping the space of the run's first piece, as SentencePiece does
