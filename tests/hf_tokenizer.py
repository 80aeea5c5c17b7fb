"""A small Hugging Face tokenizer built offline for the tests and benchmarks (no downloads).

A byte-level BPE trained with `tokenizers` on a fixed corpus (so any text, unicode included,
encodes), Llama-3's special tokens (`<|begin_of_text|>` is BOS, prepended with
`add_special_tokens=True`; `<|eot_id|>` is EOS) and a Llama-3.1-style chat template written for
these tests: a system block with the tools (as JSON), documents, the `date_string` and
`reasoning` template kwargs, tool calls and tool results, and the generation prompt.
`build_tokenizer(dir)` writes `tokenizer.json`, `tokenizer_config.json` and, with `model_type`,
a `config.json`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|reserved_special_token_0|>",
]

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set date_string = date_string | default('1 Jan 2025') %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n' }}"
    "{%- if reasoning is defined %}{{- 'Reasoning: ' + reasoning + '\\n' }}{%- endif %}"
    "{%- if tools %}{{- 'You may call these functions:\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=2) + '\\n' }}{%- endfor %}{%- endif %}"
    "{%- if documents %}{%- for d in documents %}"
    "{{- 'Document ' + loop.index | string + ': ' + d['title'] + '\\n' + d['text'] + '\\n' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '\\n' + system_message + '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- elif m.get('tool_calls') %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for c in m['tool_calls'] %}"
    "{{- '{\"name\": \"' + c['function']['name'] + '\", \"parameters\": ' + c['function']['arguments'] | tojson "
    "+ '}' }}"
    "{%- endfor %}{{- '<|eom_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_WORDS = (
    "the of and to in is was for that with as on by at from this are be had have which an or not their one all but "
    "has more been first new who also they after its into two other when time there can would some only over world "
    "weather city forecast rain sunny cloudy temperature tool function call result answer question please brief "
    "hello how are you today tomorrow system user assistant document title text summary report data value name"
).split()
_EXTRA = [
    "Grüße aus München, café déjà vu, naïve façade",
    "日本語のテキストと中文字符",
    "emoji 🙂🚀 and symbols ±×÷→",
    '{"location": "Paris", "unit": "celsius"}',
    "def main():\n    return 42\n",
    "numbers 0 1 2 3 10 42 100 2025 3.14",
    "Today Date: 1 Jan 2025\nYou may call these functions:\n",
    "Document 1: Reasoning: high low medium",
]


def corpus(lines: int = 2000, seed: int = 11) -> list[str]:
    """A fixed training corpus: pseudo-sentences over a small vocabulary, plus unicode, JSON and code."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        if i % 7 == 0:
            words.append(rng.choice(_EXTRA))
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","]))
    return out + _EXTRA * 20


def build_tokenizer(
    out_dir: str | Path,
    vocab_size: int = 2048,
    lines: int = 2000,
    model_type: str | None = "llama",
    training_text: list[str] | None = None,
) -> Path:
    """Write the tokenizer to `out_dir` (created) and return it; `vocab_size` includes the
    256 byte symbols and the special tokens. `training_text`: the corpus (default: `corpus(lines)`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(training_text if training_text is not None else corpus(lines), trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "pad_token": "<|end_of_text|>",
                "clean_up_tokenization_spaces": False,
                "model_max_length": 131072,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    if model_type is not None:
        (out / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": tok.get_vocab_size()}))
    return out
