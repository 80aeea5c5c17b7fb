"""The kv_cache_aware router's chat key groups requests as TensorRT-LLM's
`KvCacheAwareRouter._content_affinity_key` does: by the first two messages' contents and the
first 256 prompt_token_ids."""

from __future__ import annotations

from shmdisagg.routing.affinity import ROUTE_AFFINITY_TOKEN_PREFIX, content_affinity_key

SYSTEM = {"role": "system", "content": "You are terse."}
FIRST = {"role": "user", "content": "What is a KV cache?"}


def test_a_conversations_turns_share_a_key_and_another_conversation_does_not() -> None:
    turn1 = {"messages": [SYSTEM, FIRST]}
    turn2 = {
        "messages": [SYSTEM, FIRST, {"role": "assistant", "content": "A cache."}, {"role": "user", "content": "More?"}]
    }
    other = {"messages": [SYSTEM, {"role": "user", "content": "What is a block hash?"}]}
    assert content_affinity_key(turn1) == content_affinity_key(turn2) != content_affinity_key(other)
    assert content_affinity_key(turn1) > 0


def test_a_completion_has_no_key() -> None:
    assert content_affinity_key({"prompt": "hello"}) == 0
    assert content_affinity_key({"messages": []}) == 0


def test_only_the_leading_prompt_token_ids_count() -> None:
    ids = list(range(ROUTE_AFFINITY_TOKEN_PREFIX + 10))
    base = {"messages": [FIRST], "prompt_token_ids": ids}
    tail_changed = {"messages": [FIRST], "prompt_token_ids": ids[:-1] + [7]}
    head_changed = {"messages": [FIRST], "prompt_token_ids": [7] + ids[1:]}
    assert content_affinity_key(base) == content_affinity_key(tail_changed) != content_affinity_key(head_changed)


def test_multimodal_contents_are_keyed_by_their_text_form() -> None:
    parts = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]
    same = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]
    other = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": "http://x/b.png"}}]
    key = content_affinity_key({"messages": [{"role": "user", "content": parts}]})
    assert key == content_affinity_key({"messages": [{"role": "user", "content": same}]})
    assert key != content_affinity_key({"messages": [{"role": "user", "content": other}]})


def test_a_chats_key_is_taken_before_the_router_writes_its_token_ids_back() -> None:
    """The simulator's tokenizer writes each chat's ids back into the body, and they grow with
    every turn: keyed after that, no short chat's turns would ever share a key."""
    import asyncio

    from shmdisagg.orchestrator.service import KeyBuilder
    from shmdisagg.orchestrator.tokenization import SimTokenizer

    builder = KeyBuilder(SimTokenizer(), conversations=False, affinity=True)
    turn1 = {"model": "m", "messages": [SYSTEM, FIRST]}
    turn2 = {"model": "m", "messages": [SYSTEM, FIRST, {"role": "assistant", "content": "A cache."}]}
    keys = [asyncio.run(builder.build(req, chat=True)).affinity for req in (turn1, turn2)]
    assert "prompt_token_ids" in turn1 and "prompt_token_ids" in turn2  # written back, as the simulator's router does
    assert keys[0] == keys[1] == content_affinity_key({"messages": [SYSTEM, FIRST]}) > 0
