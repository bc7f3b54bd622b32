"""Plain text to token ids and back, for the agent loop and the gateway, at the tokenizers library's cost.

A Hugging Face fast tokenizer's `encode(text, add_special_tokens=False)` and `decode(ids)` are the Rust
tokenizer's (`tokenizer.backend_tokenizer`) behind a wrapper that first re-applies the tokenizer's settings
(truncation, padding, whether special-token strings are split) and builds a `BatchEncoding`; on the short
texts of a turn the wrapper costs about as much again as the tokenizing (e.g. 26 us against 12 us for a
turn's delta, 4.3 us against 1.3 us to decode a 16-token answer). `TokenCodec` calls the Rust tokenizer
itself when the result is the wrapper's by construction: its truncation and padding are off, it splits
special tokens exactly when the wrapper would, and (decoding) no clean-up of spaces is asked for. A
tokenizer without a Rust backend, or one whose settings say otherwise at the time of the call, goes
through the wrapper. At construction the two paths are compared on a few texts (special-token strings,
Unicode, spaces); if they differ anywhere the wrapper is used for everything.

`encode_whole(text)` tokenizes a whole conversation again (the gateway's check that its captured ids are the
template's tokenization) without paying for all of it every request. The tokenizers library cuts a text at
its added tokens before anything else and tokenizes each piece on its own (normalizer, pre-tokenizer and
model never see across a cut), so a text's ids are its pieces' ids end to end. Cut at the special tokens
that are matched exactly as written (no stripping of the spaces beside them, not normalized, not
single-word, and no other added token that could swallow one), the pieces of a growing conversation repeat
from request to request (each earlier message between its turn markers), and their ids are kept
(`PIECES_KEPT` at most); only new pieces are tokenized.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

PIECES_KEPT = 8192
_PROBES = ("", " ", "Hello, world!", "  two  spaces\n\nand lines\t", "naïve café — 東京 🙂", "x = 1+2*3; print(x)")


class TokenCodec:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # a fast tokenizer's Rust backend (transformers' documented `backend_tokenizer`); slow ones have none
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._split = bool(getattr(tokenizer, "split_special_tokens", False))
        self._backend = backend if backend is not None and self._agrees(backend) else None
        self.fast = self._backend is not None
        self._cuts = _cut_pattern(tokenizer) if self.fast and not self._split else None
        self._pieces: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        """`text` as token ids, no special tokens added (special-token strings in it are their tokens)."""
        if not text:
            return []
        backend = self._backend
        if backend is not None and backend.truncation is None and backend.padding is None \
                and backend.encode_special_tokens == self._split:
            return backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_whole(self, text: str) -> list[int]:
        """`encode(text)` for a long text that mostly repeats earlier ones, from the ids of its pieces."""
        if self._cuts is None or self._backend.encode_special_tokens:
            return self.encode(text)
        out: list[int] = []
        kept = self._pieces
        for piece in self._cuts.split(text):
            if piece:
                ids = kept.get(piece)
                if ids is None:
                    if len(kept) >= PIECES_KEPT:
                        kept.clear()
                    ids = kept[piece] = self.encode(piece)
                out += ids
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens included."""
        if self._backend is not None and not self.tokenizer.clean_up_tokenization_spaces:
            return self._backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _agrees(self, backend: Any) -> bool:
        """Whether the Rust tokenizer gives the wrapper's ids and text on the probe texts (and the
        tokenizer's special-token strings), with the tokenizer's settings as they are now."""
        if backend.truncation is not None or backend.padding is not None:
            return False
        specials = [str(t) for t in self.tokenizer.get_added_vocab()][:8]
        texts = [*_PROBES, "".join(specials), " ".join(f"a{s}b" for s in specials)]
        for text in texts:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            if backend.encode(text, add_special_tokens=False).ids != ids:
                return False
            if not self.tokenizer.clean_up_tokenization_spaces and \
                    backend.decode(ids, skip_special_tokens=False) != self.tokenizer.decode(ids, skip_special_tokens=False):
                return False
        return True


def _cut_pattern(tokenizer: Any) -> re.Pattern | None:
    """A pattern that splits a text at (and keeps) the special tokens the tokenizers library always cuts at,
    or None when there are none. A token qualifies when it is matched exactly as written (no lstrip,
    rstrip, single_word, normalized) and no other added token contains it or ends with one of its prefixes
    (one that starts earlier and would be matched first)."""
    added = [t for t in tokenizer.added_tokens_decoder.values() if str(t)]
    contents = [str(t) for t in added]
    cuts = []
    for token in added:
        text = str(token)
        if not token.special or token.lstrip or token.rstrip or token.single_word or token.normalized:
            continue
        if any(other != text and (text in other or any(other.endswith(text[:k]) for k in range(1, len(text))))
               for other in contents):
            continue
        cuts.append(text)
    if not cuts:
        return None
    return re.compile("(" + "|".join(re.escape(c) for c in sorted(cuts, key=len, reverse=True)) + ")")
