"""A byte-level BPE tokenizer trained locally, with a ChatML chat template.

Digits are always single tokens (arithmetic stays learnable for tiny models); the tags the
agent tasks use (<calc>, <answer>, <tool_call>, ...) are single added tokens; any text round
trips through byte-level encoding.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from hybridrl.assets.corpus import corpus

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = ("<calc>", "</calc>", "<answer>", "</answer>", "<tool_call>", "</tool_call>",
              "<tool_response>", "</tool_response>", "<think>", "</think>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# ChatML with four roles. A tool result is its own `tool` turn; `tools` (a list of JSON schemas)
# is rendered into the system turn when given. Unknown roles are an error, never silently dropped.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- 'Tools:\\n' -}}{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- if not (tools and loop.first and message['role'] == 'system') -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def train_tokenizer(vocab_size: int = 512, seed: int = 0, num_documents: int = 4000) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(num_documents, seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TAG_TOKENS])
    return tok
