"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the
disaggregated chat flow, as TensorRT-LLM's orchestrator serves it
(`tensorrt_llm/serve/openai_disagg_server.py`, file id 70144234291: `anthropic_messages`,
`anthropic_count_tokens`).

- `protocol.py`: the request models (pydantic) and the error envelope;
- `convert.py`: an Anthropic request to a chat completion request, a chat answer back;
- `stream.py`: a chat SSE stream reframed, chunk by chunk, into Anthropic's event sequence;
- `route.py`: the ASGI routes, which run the converted request through `DisaggService.handle`.
"""
