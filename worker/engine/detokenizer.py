"""Incremental detokenization for streaming: UTF-8 safe text deltas and stop strings.

Contract. For one request fed output token ids ``o`` (in any chunking), the deltas returned by
`IncrementalDetokenizer.update` plus the one returned by `flush` concatenate to exactly::

    tokenizer.decode(o, skip_special_tokens=..., clean_up_tokenization_spaces=False)

cut at the first stop string (or just after it with ``include_stop_str_in_output``).

* ``clean_up_tokenization_spaces`` is never applied: it rewrites spaces around punctuation across
  token boundaries (so it cannot be incremental), it corrupts byte-level BPE text, and transformers 5
  already ignores it for BPE tokenizers such as SmolLM2's.
* A delta never ends inside a multi-byte character: bytes of a character split across tokens are held
  until the character is complete. Bytes that never form a valid character (a random model can emit
  them) come out as U+FFFD exactly where the full decode has them, at the latest at `flush`.
* The prompt is not used as decoding context, so the text is that of the output ids alone, as in
  Hugging Face ``decode(output_ids)`` (a SentencePiece tokenizer's leading space is dropped there too).

Two decoding strategies share one small interface (`push` ids -> settled text, `flush`):

* `_ByteLevelStream` for tokenizers whose decoder is exactly ByteLevel (GPT-2 style: SmolLM2, Llama 3,
  Qwen, the tiny test models). Decoding is then "concatenate each token's bytes, UTF-8 decode with
  replacement", so we keep a per-tokenizer id -> bytes table and Python's incremental UTF-8 decoder:
  O(1) per token, exact by construction, and a run of invalid bytes costs nothing extra.
* `_WindowStream` for every other decoder (SentencePiece/Metaspace, byte fallback, WordPiece): the
  prefix/read offset scheme of vLLM and ``tokenizers.decoders.DecodeStream``. It decodes a short window
  of recent ids and emits the text past that of the window's context ids, holding text that ends in
  U+FFFD. `tokenizers`' DecodeStream does the same in Rust but has no flush for a tail that never
  becomes valid, so we keep our own (measured: byte-level ~0.6 µs/token, window ~2, DecodeStream ~0.6
  on SmolLM2's tokenizer; see tests/unit/test_detokenizer.py).
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from worker.engine.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


class _TextStream(Protocol):
    def push(self, ids: Sequence[int]) -> str:
        """Take new ids; return the text that is now final (never a partial character)."""
        ...

    def flush(self) -> str:
        """Return the text still held back (the end of the output)."""
        ...


# --- byte-level BPE ---------------------------------------------------------------------------


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: char -> byte value."""
    ranges = (("!", "~"), ("¡", "¬"), ("®", "ÿ"))
    printable = [b for lo, hi in ranges for b in range(ord(lo), ord(hi) + 1)]
    chars = dict(zip(printable, printable))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_CHAR_TO_BYTE = _byte_level_alphabet()


class _ByteTable(dict):
    """token id -> the bytes the ByteLevel decoder produces for it; filled lazily, shared per tokenizer.

    Mirrors tokenizers' decode: an id is looked up among added tokens, then in the model vocabulary
    (unknown ids decode to nothing); with ``skip_special_tokens`` a token whose content is a special
    added token is dropped; a token made only of byte-alphabet characters maps to those bytes, any
    other token (e.g. an added token containing a real space) to its own UTF-8 encoding.
    """

    def __init__(self, backend: Any, skip_special_tokens: bool) -> None:
        super().__init__()
        self._backend = backend
        self._skip: frozenset[str] = frozenset()
        if skip_special_tokens:
            added = backend.get_added_tokens_decoder().values()
            self._skip = frozenset(t.content for t in added if t.special)

    def __missing__(self, token_id: int) -> bytes:
        token = self._backend.id_to_token(token_id) if token_id >= 0 else None
        if token is None or token in self._skip:
            data = b""
        else:
            try:
                data = bytes(_CHAR_TO_BYTE[c] for c in token)
            except KeyError:
                data = token.encode()
        self[token_id] = data
        return data


# tokenizer object -> {skip_special_tokens: table}; the tables live as long as the tokenizer does.
_TABLES: weakref.WeakKeyDictionary[Any, dict[bool, _ByteTable]] = weakref.WeakKeyDictionary()


def _byte_table(tokenizer: Any, backend: Any, skip_special_tokens: bool) -> _ByteTable:
    try:
        per_tok = _TABLES.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no sharing across requests, still correct
        per_tok = {}
    table = per_tok.get(skip_special_tokens)
    if table is None:
        table = per_tok[skip_special_tokens] = _ByteTable(backend, skip_special_tokens)
    return table


class _ByteLevelStream:
    def __init__(self, table: _ByteTable) -> None:
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, ids: Sequence[int]) -> str:
        table = self._table
        data = table[ids[0]] if len(ids) == 1 else b"".join([table[i] for i in ids])
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# --- any other decoder -------------------------------------------------------------------------


class _WindowStream:
    """Decode a short window of ids; emit what lies past the window's context text.

    The window is the ids already turned into text at the last emission (the context) plus the ids
    since. Its text minus the context's text is the new text, unless it ends in U+FFFD (a character
    still incomplete), in which case it is held. The context makes decoders that treat the first token
    specially (SentencePiece strips its leading space) decode the new ids as inside the full sequence.
    """

    # A character needs at most 4 byte tokens; ids held longer than this (bytes that will never become
    # valid, or a run of skipped special tokens) are let go so the window and the cost stay bounded.
    MAX_HELD = 32

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []  # the window
        self._read = 0  # ids before this index are the context
        self._context_text = ""  # decode(self._ids[: self._read])

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        text = self._decode(self._ids)
        grew = len(text) > len(self._context_text) and not text.endswith(_REPLACEMENT)
        if grew or len(self._ids) - self._read > self.MAX_HELD:
            return self._advance(text)
        return ""

    def flush(self) -> str:
        if self._read == len(self._ids):
            return ""
        return self._advance(self._decode(self._ids))

    def _advance(self, text: str) -> str:
        delta = text[len(self._context_text) :]
        del self._ids[: self._read]  # the ids just emitted become the next context
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)
        return delta


def _make_stream(tokenizer: Any, skip_special_tokens: bool, strategy: str) -> _TextStream:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "id_to_token"):  # a bare tokenizers.Tokenizer
        backend = tokenizer
    if strategy == "auto":
        from tokenizers import decoders

        byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
        strategy = "byte_level" if byte_level else "window"
    if strategy == "byte_level":
        return _ByteLevelStream(_byte_table(tokenizer, backend, skip_special_tokens))
    if strategy != "window":
        raise ValueError(f"unknown detokenizer strategy {strategy!r}")
    if backend is not None:
        decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    else:  # a slow tokenizer: correct, only slower
        decode = lambda ids: tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
    return _WindowStream(decode)


# --- the per-request detokenizer ---------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns one request's output ids into streamed text deltas and watches for stop strings.

    Stop strings follow vLLM: the output stops at the first stop string and its text ends right before
    it (or right after it with `include_stop_str_in_output`). When several stop strings occur, the one
    that is completed first in the text wins (then the longest), so the result does not depend on how
    the ids were chunked. Without `include_stop_str_in_output` the last ``max(len(stop)) - 1``
    characters are held back while streaming, so no delta ever shows text that a stop later removes.
    Each update searches only the new text plus that many characters before it. As in vLLM, a stop
    string counts only when it ends in text of output tokens after the first `min_tokens`.

    Feed the ids the text should contain: to leave EOS / a stop token id out of the text (vLLM's
    behaviour), do not pass it, or decode with ``skip_special_tokens``.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        strategy: str = "auto",
    ) -> None:
        """`tokenizer`: a fast tokenizer as loaded by AutoTokenizer (or a bare `tokenizers.Tokenizer`).

        `prompt_token_ids` is accepted for the engine's convenience and not used (see the module doc).
        `strategy` ("auto", "byte_level", "window") exists for tests and benchmarks.
        """
        del prompt_token_ids
        self._stream = _make_stream(tokenizer, skip_special_tokens, strategy)
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._include_stop = include_stop_str_in_output
        self._lookback = max((len(s) for s in self._stops), default=1) - 1
        self._hold = 0 if include_stop_str_in_output else self._lookback
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._chunks: list[str] = []  # emitted deltas
        self._tail = ""  # the last `_lookback` characters of the text so far
        self._held = 0  # how many characters at the end of `_tail` are not emitted yet
        self.stop_reason: str | None = None
        self._finished = False

    @classmethod
    def from_sampling_params(
        cls, tokenizer: Any, prompt_token_ids: Sequence[int] | None, params: SamplingParams
    ) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    @property
    def stopped(self) -> bool:
        """A stop string matched; the text is final and later ids are ignored."""
        return self.stop_reason is not None

    @property
    def finished(self) -> bool:
        """A stop string matched or `flush` was called."""
        return self._finished

    @property
    def output_text(self) -> str:
        """All text so far, including characters still held back; after `flush` (or a stop) it equals
        the concatenation of every delta."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        emitted = self._chunks[0] if self._chunks else ""
        return emitted + self._tail[len(self._tail) - self._held :]

    def update(self, new_token_ids: Sequence[int] | int) -> str:
        """Feed newly generated ids; return the text that can be shown now ("" if none)."""
        if self._finished:
            return ""
        ids = [new_token_ids] if isinstance(new_token_ids, int) else new_token_ids
        if not ids:
            return ""
        cut = self._min_tokens - self._num_tokens
        if 0 < cut < len(ids):  # stop strings start to count inside this chunk
            return self._update(ids[:cut]) + self._update(ids[cut:])
        return self._update(ids)

    def flush(self) -> str:
        """End of output (EOS, length, abort): return everything still held back."""
        if self._finished:
            return ""
        rest = self._stream.flush()
        out = self._accept(rest) if rest else ""
        if not self._finished:
            out += self._emit(self._tail[len(self._tail) - self._held :])
            self._held = 0
            self._finished = True
        return out

    def _update(self, ids: Sequence[int]) -> str:
        self._num_tokens += len(ids)
        new = self._stream.push(ids)
        return self._accept(new) if new else ""

    def _accept(self, new: str) -> str:
        """Add settled text; check it for stop strings; return the part that may be emitted now."""
        if not self._stops:
            return self._emit(new)
        window = self._tail + new
        start = len(self._tail) - self._held  # first character of `window` not emitted yet
        hit = self._find_stop(window, len(self._tail)) if self._num_tokens > self._min_tokens else None
        if hit is not None:
            pos, stop = hit
            end = pos + len(stop) if self._include_stop else pos
            self.stop_reason = stop
            self._finished = True
            self._held = 0
            self._tail = ""
            return self._emit(window[start:end])
        self._tail = window[max(0, len(window) - self._lookback) :]
        self._held = min(self._hold, len(window) - start)
        return self._emit(window[start : len(window) - self._held])

    def _find_stop(self, window: str, new_from: int) -> tuple[int, str] | None:
        """Earliest-completed stop string that ends inside `window[new_from:]`: (start, stop)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            pos = window.find(stop, max(0, new_from - len(stop) + 1))
            if pos < 0:
                continue
            key = (pos + len(stop), pos, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text
