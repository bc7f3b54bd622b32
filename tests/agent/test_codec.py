"""TokenCodec: the Rust tokenizer's own encode/decode where they are the wrapper's, the wrapper otherwise."""

from __future__ import annotations

import random
from types import SimpleNamespace

from hybridrl.agent.codec import TokenCodec

PIECES = ["<|im_start|>", "<|im_end|>", "<answer>", "</answer>", "<calc>", "12 * 34", " ", "\n", "\n\n", "  ", "é",
          "東京", "🙂", "x=1+2", "Hello", ", world", "\t", "408", "error: division by zero"]


def texts(seed: int, n: int = 200) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12))) for _ in range(n)]


def test_the_fast_path_gives_the_wrappers_ids_and_text(tokenizer):
    codec = TokenCodec(tokenizer)
    assert codec.fast                                     # the shipped tokenizer has a Rust backend
    for text in texts(0):
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        assert codec.encode(text) == ids, text
        assert codec.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)


def test_a_backend_left_truncating_by_another_caller_is_not_trusted(tokenizer):
    codec = TokenCodec(tokenizer)
    text = "Hello, world " * 20
    whole = list(tokenizer.encode(text, add_special_tokens=False))
    tokenizer.backend_tokenizer.enable_truncation(5)
    try:
        assert codec.encode(text) == whole and len(whole) > 5
    finally:
        tokenizer.backend_tokenizer.no_truncation()


def test_a_tokenizer_whose_backend_disagrees_goes_through_the_wrapper():
    class Backend:
        truncation = padding = None
        encode_special_tokens = False

        def encode(self, text, add_special_tokens=False):
            return SimpleNamespace(ids=[len(text) + 1])          # not what the wrapper gives

        def decode(self, ids, skip_special_tokens=False):
            return "?"

    class Wrapper:
        backend_tokenizer = Backend()
        clean_up_tokenization_spaces = False

        def encode(self, text, add_special_tokens=False):
            return [len(text)]

        def decode(self, ids, skip_special_tokens=False):
            return "x" * sum(ids)

        def get_added_vocab(self):
            return {}

    codec = TokenCodec(Wrapper())
    assert not codec.fast and codec.encode("abc") == [3] and codec.decode([2]) == "xx"
    slow = SimpleNamespace(encode=lambda text, add_special_tokens=False: [7], clean_up_tokenization_spaces=False,
                           decode=lambda ids, skip_special_tokens=False: "seven", get_added_vocab=dict)
    codec = TokenCodec(slow)                             # no Rust backend at all
    assert not codec.fast and codec.encode("abc") == [7] and codec.decode([7]) == "seven" and codec.encode("") == []


def test_a_whole_conversation_from_its_pieces_is_its_tokenization(tokenizer):
    """encode_whole == encode on growing conversations (the pieces of earlier requests reused), on texts with
    turn markers anywhere (inside words, doubled, at the ends)."""
    codec = TokenCodec(tokenizer)
    assert codec.encode_whole("a<|im_end|>b") == list(tokenizer.encode("a<|im_end|>b", add_special_tokens=False))
    messages = [{"role": "user", "content": "What is 12 * 34?"}]
    for i, text in enumerate(texts(1, 30)):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": text})
        whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert codec.encode_whole(whole) == list(tokenizer.encode(whole, add_special_tokens=False))
    for text in texts(2):
        assert codec.encode_whole(text) == list(tokenizer.encode(text, add_special_tokens=False)), text
    assert len(codec._pieces) > 0


def test_only_tokens_matched_exactly_as_written_cut_a_text():
    from hybridrl.agent.codec import _cut_pattern

    def token(content, special=True, **flags):
        return SimpleNamespace(content=content, special=special, lstrip=flags.get("lstrip", False),
                               rstrip=flags.get("rstrip", False), single_word=False,
                               normalized=flags.get("normalized", False))

    class Added(SimpleNamespace):
        def __str__(self):
            return self.content

    def tok(*tokens):
        return SimpleNamespace(added_tokens_decoder={i: Added(**vars(t)) for i, t in enumerate(tokens)})

    cut = _cut_pattern(tok(token("<|im_end|>"), token("<|im_start|>"), token("<tool>", special=False),
                           token("<s>", rstrip=True), token("<n>", normalized=True)))
    assert cut.split("a<|im_end|>b<tool><s> c<n>") == ["a", "<|im_end|>", "b<tool><s> c<n>"]
    # "<|x" ends another token that would be matched first: "<|x" is not a cut, "<|y|>" still is
    assert _cut_pattern(tok(token("<|x|>"), token("ab<|x", special=False), token("<|y|>"))).pattern == r"(<\|y\|>)"
    assert _cut_pattern(tok(token("<x>", rstrip=True))) is None
