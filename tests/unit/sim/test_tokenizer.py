from __future__ import annotations

import json
import os
import subprocess
import sys

from shmdisagg.executors.sim.sampler import output_token, output_tokens, prompt_seed
from shmdisagg.executors.sim.tokenizer import BOS_ID, EOS_ID, GEN_VOCAB, SPECIAL_TOKENS, Tokenizer, render_chat

TEXT = "Hello, world! The year 2024 had 366 days; naïve café  spaces\n\nnew paragraph."


def test_encoding_is_the_same_in_another_process_with_another_hash_seed():
    here = Tokenizer().encode(TEXT)
    code = (
        "import json,sys; from shmdisagg.executors.sim.tokenizer import Tokenizer; "
        f"print(json.dumps(Tokenizer().encode({TEXT!r})))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == here


def test_encoding_splits_words_numbers_punctuation_and_whitespace():
    tok = Tokenizer()
    ids = tok.encode("a b, 1234")
    assert len(ids) == 5  # "a", " b", ",", " 123", "4"
    assert tok.encode("a b, 1234", add_bos=True) == [BOS_ID, *ids]
    assert all(0 <= t < 128000 for t in ids)


def test_special_tokens_map_to_their_fixed_ids():
    tok = Tokenizer()
    assert tok.encode("<|begin_of_text|>hi<|eot_id|>") == [BOS_ID, tok.encode("hi")[0], EOS_ID]
    assert tok.decode([SPECIAL_TOKENS["<|start_header_id|>"]]) == "<|start_header_id|>"


def test_generated_words_re_encode_to_the_same_ids():
    tok = Tokenizer()
    ids = list(GEN_VOCAB[:50])
    assert tok.encode(tok.decode(ids)) == ids
    assert tok.decode([5]) == "<5>"  # not a generation word, not special


def test_chat_template_renders_the_documented_llama3_shape():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {}}]},
    ]
    assert render_chat(messages) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render_chat(messages, add_generation_prompt=False).endswith("Hi<|eot_id|>")


def test_output_tokens_are_a_pure_function_of_prompt_position_and_seed():
    prompt = Tokenizer().encode(TEXT)
    first = output_tokens(prompt, 8)
    assert first == output_tokens(list(prompt), 8)
    assert [output_token(prompt, k) for k in range(8)] == first
    assert output_tokens(prompt, 8, seed=1) != first
    assert output_tokens(prompt + [5], 8) != first
    assert len(set(output_tokens(prompt, 200))) > 50
    assert all(t in GEN_VOCAB and t != EOS_ID for t in output_tokens(prompt, 200))
    assert prompt_seed(prompt) == prompt_seed(tuple(prompt))
