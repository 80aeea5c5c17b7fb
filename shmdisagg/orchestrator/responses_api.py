"""`POST /v1/responses`: answered 501, because released TensorRT-LLM workers cannot split it.

TensorRT-LLM's newest orchestrator routes `/v1/responses` through its disaggregated service
(`tensorrt_llm/serve/openai_disagg_server.py`, file id 70144234291: `self._service.openai_responses`
and `guard_responses_stream`), added by PR #18497 ("Responses API: support disaggregated
serving", open when read). Disaggregating it needs the worker to run a Responses request as a
context-only phase that returns the KV handoff and as a generation-only phase that takes it, and
the released worker does neither: its `openai_responses` handler never reads
`disaggregated_params` (`tensorrt_llm/serve/openai_server.py`@fb31828e, the worker copy in
`shared/trtllm_worker`), `ResponsesRequest` accepts unknown fields and so would silently run a
"context-only" request to completion, and `ResponsesResponse` has no field to carry the handoff
(`openai_protocol.py`@0076e939). The PR's service side (what each leg sends, how the context
answer carries the handoff, `RelayedResponseSnapshot`) is not in any stored upstream file, so it
cannot be matched exactly either. Until both are available the route says so, with a 501 in the
`ErrorResponse` shape, rather than sending requests workers would run twice.
"""

from __future__ import annotations

from shmdisagg.orchestrator.asgi import Receive, Scope, Send, send_bytes
from shmdisagg.orchestrator.errors import error_body

NOT_DISAGGREGATED = (
    "POST /v1/responses is not supported by this disaggregated server: TensorRT-LLM's workers cannot yet run a "
    "Responses "
    "request as separate context and generation phases (their Responses handler takes no disaggregated_params). "
    "Use POST /v1/chat/completions (or POST /v1/messages) instead."
)


async def responses(scope: Scope, receive: Receive, send: Send) -> None:
    """Answer one `POST /v1/responses` with 501."""
    await send_bytes(send, 501, error_body(501, NOT_DISAGGREGATED))
