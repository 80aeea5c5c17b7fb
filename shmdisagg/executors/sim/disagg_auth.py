"""`internal_request_auth_key`: the HMAC a worker checks on requests that carry protected
disaggregated fields, as TensorRT-LLM's `tensorrt_llm/serve/disagg_auth.py` (file id
68525723387; the key is a worker LLM-API option, `internal_request_auth_key` in the
extra_llm_api_options YAML, e.g. the deployment guide file id 66400875655).

- Protected fields: `disaggregated_params.encoded_opaque_state` and `.ctx_info_endpoint`. A
  request with neither set needs no signature.
- Signature: `"sha256=" + hex(HMAC-SHA256(key, payload))`, payload the canonical JSON
  (`json.dumps(sort_keys=True, separators=(",", ":"))`) of `{"ctx_info_endpoint": <the
  endpoint, a list's first element>, "encoded_opaque_state": <the state>}` (None as null).
  Header `x-trtllm-disagg-auth`, compared in constant time.
- With a key: a missing or wrong signature is a ValueError "Invalid internal disaggregated
  request authentication", which the worker answers with 400 `ErrorResponse`.
- Without a key: the request passes, with a `FutureWarning` (the requirement "will be
  enforced" in a future release).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import warnings
from collections.abc import Mapping
from typing import Any

from shmdisagg.executors.sim.errors import RequestError

INTERNAL_DISAGG_AUTH_HEADER = "x-trtllm-disagg-auth"
_HEADER_BYTES = INTERNAL_DISAGG_AUTH_HEADER.encode()
_SIGNATURE_PREFIX = "sha256="
MISSING_AUTH_KEY_WARNING = (
    "Internal disaggregated authentication key is required for protected disaggregated request fields. In a "
    "future release the requirement to use internal_request_auth_key will be enforced. Please update workflow "
    "accordingly."
)
INVALID_AUTH_MESSAGE = "Invalid internal disaggregated request authentication"


def _payload(fields: Mapping[str, Any]) -> bytes:
    endpoint = fields.get("ctx_info_endpoint")
    if isinstance(endpoint, list):
        endpoint = endpoint[0] if endpoint else None
    payload = {"encoded_opaque_state": fields.get("encoded_opaque_state"), "ctx_info_endpoint": endpoint}
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")


def sign(key: str, fields: Mapping[str, Any]) -> str:
    """The `x-trtllm-disagg-auth` value for these protected fields (what an orchestrator sends)."""
    return _SIGNATURE_PREFIX + hmac.new(key.encode("utf-8"), _payload(fields), hashlib.sha256).hexdigest()


def header_value(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The `x-trtllm-disagg-auth` header of an ASGI request, None when absent."""
    for name, value in headers:
        if name.lower() == _HEADER_BYTES:
            return value.decode("latin-1")
    return None


def validate(key: str | None, fields: Mapping[str, Any] | None, provided: str | None) -> None:
    """Raise `RequestError` (400) unless the request may pass: no protected field, no key (then a
    FutureWarning), or `provided` equal to `sign(key, fields)`."""
    if not fields or all(v is None for v in fields.values()):
        return
    if not key:
        warnings.warn(MISSING_AUTH_KEY_WARNING, FutureWarning, stacklevel=2)
        return
    if provided is None or not hmac.compare_digest(provided.encode("utf-8"), sign(key, fields).encode("utf-8")):
        raise RequestError(INVALID_AUTH_MESSAGE)
