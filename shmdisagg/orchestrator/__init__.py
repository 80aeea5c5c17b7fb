"""The request path a fleet worker runs: the disaggregated orchestrator.

A request from its bytes (`asgi.py`, `validation.py`, `tokenization.py`, `chat_render.py`) to a
flow (`service.py`: admission, deadline, disconnect, shutdown, every way it ends), its context
and generation legs (`flows.py`: context-first, generation-first, conditional; `legs.py`: pick,
send, retry, release exactly once; `wire.py`: what goes on the wire to an executor), the answer
back to the client (`exchange.py`, `answers.py`: what never leaves), and what it tells the
coordinator off the path (`reporting.py`). `ids.py` mints the `disagg_request_id`,
`directory.py` is a worker's view of the table's server slots, `errors.py` the OpenAI error
bodies, `responses_api.py` the `/v1/responses` refusal. The routing policies it calls are in
`shmdisagg/routing/`, the process that runs it in `shmdisagg/fleet/`.
"""
