"""How a leg's request goes on the wire to an executor: body encoding, headers, internal auth.

- Body: JSON (orjson) by default; msgpack (`msgspec`) with header `X-TRTLLM-Msgpack: 1` when
  `TRTLLM_SERVE_ENABLE_MSGSPEC=1`, as TensorRT-LLM's orchestrator client does
  (`tensorrt_llm/serve/openai_client.py`; the worker decodes msgpack bodies only with the same
  variable set, `tensorrt_llm/serve/openai_server.py`). Either way `Content-Type:
  application/json`, as upstream sends it.
- `internal_request_auth_key`: a leg whose `disaggregated_params` carry `encoded_opaque_state`
  or `ctx_info_endpoint` (the protected fields) gets header `x-trtllm-disagg-auth:
  sha256=<hex>`, the HMAC-SHA256 under the key of the canonical JSON
  `{"ctx_info_endpoint": <first element if a list>, "encoded_opaque_state": ...}` (sorted keys,
  no spaces), exactly as `tensorrt_llm/serve/disagg_auth.py` signs it; workers holding the key
  reject unsigned or mis-signed handoffs. Without a key no header is sent and a warning is
  logged once (upstream warns with a FutureWarning that the key will become required).
- A request nested deeper than a leg can carry is the client's error, a 400
  (`too_deep_error`): orjson reads 1,024 levels but writes 254, and msgspec stops at the
  interpreter's recursion limit. TensorRT-LLM's own JSON encoder goes as deep as that limit.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import Any

import msgspec

from shmdisagg.orchestrator import splice
from shmdisagg.orchestrator.errors import RequestError
from shmdisagg.upstream import Body

log = logging.getLogger("shmdisagg.service")

AUTH_HEADER = b"x-trtllm-disagg-auth"
PROTECTED_FIELDS = ("encoded_opaque_state", "ctx_info_endpoint")
_JSON = (b"content-type", b"application/json")
_MSGPACK = (b"x-trtllm-msgpack", b"1")
Headers = list[tuple[bytes, bytes]]
ORJSON_WRITE_DEPTH = 254  # orjson.dumps: "Recursion limit reached" past this many levels


def too_deep_error() -> RequestError:
    """The 400 for a request whose leg could not be encoded for its nesting depth."""
    return RequestError(
        400,
        "request body nests too deeply for a leg to the executors "
        f"(JSON legs carry up to {ORJSON_WRITE_DEPTH} levels of arrays and objects)",
        "invalid_request",
    )


def auth_signature(key: str, params: dict[str, Any]) -> str:
    """`sha256=<hex>` over the protected fields of `params` (disagg_auth.py's `_sign_fields`)."""
    endpoint = params.get("ctx_info_endpoint")
    if isinstance(endpoint, list):
        endpoint = endpoint[0] if endpoint else None
    payload = {"ctx_info_endpoint": endpoint, "encoded_opaque_state": params.get("encoded_opaque_state")}
    encoded = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return "sha256=" + hmac.new(key.encode("utf-8"), encoded, hashlib.sha256).hexdigest()


class Wire:
    """Encodes leg requests for one fleet worker. `msgpack`: TRTLLM_SERVE_ENABLE_MSGSPEC is set;
    `auth_key`: the config's `internal_request_auth_key` (None: not configured)."""

    def __init__(self, msgpack: bool = False, auth_key: str | None = None) -> None:
        self.msgpack = msgpack
        self.auth_key = auth_key
        self._encoder = msgspec.msgpack.Encoder() if msgpack else None
        self._warned = False

    def body(self, req: dict[str, Any]) -> Body:
        """The request as the executor reads it (`splice.Raw` values written as their bytes, each
        a piece of the body: `splice.dumps`). Raises `RequestError(400)` (`too_deep_error`) for
        a request nested deeper than the encoder writes."""
        try:
            if self._encoder is not None:
                return self._encoder.encode(splice.decoded(req))
            return splice.dumps(req)
        except RecursionError:  # msgspec, past the interpreter's recursion limit
            raise too_deep_error() from None
        except TypeError as err:  # orjson's one failure on what orjson decoded
            if "Recursion limit" in str(err):
                raise too_deep_error() from None
            raise

    def encode(self, req: dict[str, Any]) -> tuple[Body, Headers]:
        """`body(req)` and `headers(req)` together: a leg sent once."""
        return self.body(req), self.headers(req)

    def headers(self, req: dict[str, Any]) -> Headers:
        """The headers of a leg carrying `req`: content type, msgpack flag, auth signature."""
        out = [_JSON, _MSGPACK] if self.msgpack else [_JSON]
        params = req.get("disaggregated_params")
        if isinstance(params, dict) and any(params.get(f) is not None for f in PROTECTED_FIELDS):
            if self.auth_key:
                out.append((AUTH_HEADER, auth_signature(self.auth_key, params).encode("ascii")))
            elif not self._warned:
                self._warned = True
                log.warning(
                    "internal_request_auth_key is not set: generation legs carry the context "
                    "executor's handoff unsigned (TensorRT-LLM will require the key in a future release)"
                )
        return out
