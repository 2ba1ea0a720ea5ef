"""Token texts for logprobs: each token's text and UTF-8 bytes, as OpenAI's logprobs entries show them.

`bytes` of a token: the bytes the tokenizer's decoder makes of that token alone. With byte-level BPE
(GPT-2 style: SmolLM2, Llama 3, Qwen, the tiny test models) a multi-byte character may be split over
several tokens, so a token's bytes need not be valid UTF-8 on their own.

`text` of a sampled token: the text its bytes add after the sample's earlier tokens, i.e. what decodes
so far. A token that ends inside a multi-byte character has text "" (its bytes are held), and the token
that completes the character carries the whole character; bytes that can never form a character come out
as U+FFFD, exactly as the detokenizer puts them in the output text. So the sampled tokens' texts
concatenate to the output text, and their bytes to its UTF-8 bytes, except that: special tokens show
their own text, as vLLM shows them (``<|im_end|>``, the EOS that ended a sample), where the text skips
them; a stop string cuts the text, not the tokens; and a character still incomplete when the output
ends is U+FFFD in the text and in no token's text.
A top-logprob alternative's text is what it would have added at that position (the same held bytes
before it).

Cost: one dict lookup per token and alternative in the usual case (no bytes held); the incremental
decoder only runs just after a token that ends inside a character. Measured in docs/gateway.md ("Logprobs").
"""

from __future__ import annotations

import codecs
import re
import weakref
from typing import Any

from worker.engine.detokenizer import _byte_table

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_new_decoder = codecs.getincrementaldecoder("utf-8")


class TokenTexts(dict):
    """token id -> (its bytes, their text and held tail from nothing held, whether it is special);
    filled lazily, one table per tokenizer (`for_tokenizer`)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self._utf8 = _new_decoder("replace")  # reset before each use (the engine's one thread uses it)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None and hasattr(tokenizer, "id_to_token"):  # a bare tokenizers.Tokenizer
            backend = tokenizer
        self._special: frozenset[int] = frozenset()
        if backend is not None:
            added = backend.get_added_tokens_decoder()
            self._special = frozenset(i for i, t in added.items() if t.special)
        elif hasattr(tokenizer, "all_special_ids"):
            self._special = frozenset(tokenizer.all_special_ids)
        self._bytes_of = self._generic(tokenizer, backend)
        if backend is not None:
            from tokenizers import decoders

            if isinstance(backend.decoder, decoders.ByteLevel):  # special tokens keep their text
                self._bytes_of = _byte_table(tokenizer, backend, skip_special_tokens=False).__getitem__

    @staticmethod
    def _generic(tokenizer: Any, backend: Any):
        """Any other decoder (SentencePiece, byte fallback, WordPiece): a byte-fallback token is its
        byte; another token is the text it adds after a copy of itself (decoders drop the leading space
        of a sequence's first token only)."""
        decode = (
            (lambda ids: backend.decode(ids, skip_special_tokens=False))
            if backend is not None
            else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
        )
        to_token = backend.id_to_token if backend is not None else tokenizer.convert_ids_to_tokens

        def bytes_of(token_id: int) -> bytes:
            piece = to_token(token_id) if token_id >= 0 else None
            if piece is None:
                return b""
            m = _BYTE_FALLBACK.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            one, two = decode([token_id]), decode([token_id, token_id])
            return (two[len(one) :] if two.startswith(one) else one).encode()

        return bytes_of

    def __missing__(self, token_id: int) -> tuple[bytes, str, bytes, bool]:
        """(bytes, the text they decode to from nothing held, the bytes they leave held, special)."""
        data = self._bytes_of(token_id)
        special = token_id in self._special
        if special:
            text, tail = data.decode("utf-8", "replace"), b""
        else:
            dec = self._utf8
            dec.reset()
            text = dec.decode(data)
            tail = dec.getstate()[0]
        entry = self[token_id] = (data, text, tail, special)
        return entry

    def sampled(self, held: bytes, token_id: int) -> tuple[str, bytes, bytes]:
        """(text, bytes) of a sampled token after `held` bytes (an incomplete character), and the bytes
        held after it. A special token shows its own text and leaves held bytes held (the output text
        leaves it out, or sets it apart)."""
        data, text, tail, special = self[token_id]
        if special:
            return text, data, held
        if not held:
            return text, data, tail
        dec = self._utf8
        dec.reset()
        text = dec.decode(held + data)
        return text, data, dec.getstate()[0]

    def alternative(self, held: bytes, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of a top-logprob token at a position after `held` bytes."""
        data, text, _, special = self[token_id]
        if special or not held:
            return text, data
        self._utf8.reset()
        return self._utf8.decode(held + data), data

    def step(
        self, held: bytes, token_id: int, top: list[tuple[int, float]]
    ) -> tuple[str, bytes, bytes, list[str], list[bytes]]:
        """One position: the sampled token's (text, bytes), the bytes held after it, and its top
        alternatives' texts and bytes. Nothing held (the usual case): table lookups only."""
        if not held:
            data, text, tail, _ = self[token_id]
            entries = [self[t] for t, _ in top]
            return text, data, tail, [e[1] for e in entries], [e[0] for e in entries]
        text, data, after = self.sampled(held, token_id)
        alts = [self.alternative(held, t) for t, _ in top]
        return text, data, after, [a[0] for a in alts], [a[1] for a in alts]


_TABLES: weakref.WeakKeyDictionary[Any, TokenTexts] = weakref.WeakKeyDictionary()


def for_tokenizer(tokenizer: Any) -> TokenTexts:
    """The tokenizer's table, shared by every request (built on first use)."""
    try:
        table = _TABLES.get(tokenizer)
        if table is None:
            table = _TABLES[tokenizer] = TokenTexts(tokenizer)
        return table
    except TypeError:  # not weak-referenceable: a table of its own
        return TokenTexts(tokenizer)
