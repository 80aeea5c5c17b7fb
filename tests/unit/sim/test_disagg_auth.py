"""`internal_request_auth_key` checks as TensorRT-LLM's serve/disagg_auth.py (file id 68525723387)."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from shmdisagg.executors.sim import disagg_auth
from shmdisagg.executors.sim.errors import RequestError

FIELDS = {"encoded_opaque_state": "b3BhcXVl", "ctx_info_endpoint": "tcp://10.0.0.1:5000"}


def test_the_signature_is_an_hmac_of_the_canonical_json_of_the_protected_fields():
    payload = b'{"ctx_info_endpoint":"tcp://10.0.0.1:5000","encoded_opaque_state":"b3BhcXVl"}'
    assert disagg_auth.sign("secret", FIELDS) == "sha256=" + hmac.new(b"secret", payload, hashlib.sha256).hexdigest()
    # a list endpoint (as /server_info advertises it) signs as its first element
    assert disagg_auth.sign("secret", {**FIELDS, "ctx_info_endpoint": ["tcp://10.0.0.1:5000"]}) == disagg_auth.sign(
        "secret", FIELDS
    )
    only_state = json.dumps(
        {"ctx_info_endpoint": None, "encoded_opaque_state": "b3BhcXVl"}, separators=(",", ":")
    ).encode()
    assert disagg_auth.sign("k", {"encoded_opaque_state": "b3BhcXVl", "ctx_info_endpoint": None}) == (
        "sha256=" + hmac.new(b"k", only_state, hashlib.sha256).hexdigest()
    )


def test_a_request_with_the_right_signature_passes_and_any_other_is_refused():
    disagg_auth.validate("secret", FIELDS, disagg_auth.sign("secret", FIELDS))
    for provided in (
        None,
        "",
        disagg_auth.sign("other", FIELDS),
        disagg_auth.sign("secret", {**FIELDS, "ctx_info_endpoint": "h:1"}),
    ):
        with pytest.raises(RequestError, match="^Invalid internal disaggregated request authentication$") as info:
            disagg_auth.validate("secret", FIELDS, provided)
        assert info.value.status == 400


def test_without_protected_fields_nothing_is_checked_and_without_a_key_it_only_warns():
    disagg_auth.validate("secret", None, None)
    disagg_auth.validate("secret", {"encoded_opaque_state": None, "ctx_info_endpoint": None}, None)
    with pytest.warns(FutureWarning, match="internal_request_auth_key will be enforced"):
        disagg_auth.validate(None, FIELDS, None)


def test_the_header_is_read_case_insensitively_from_asgi_headers():
    assert disagg_auth.header_value([(b"X-TRTLLM-Disagg-Auth", b"sha256=ab")]) == "sha256=ab"
    assert disagg_auth.header_value([(b"content-type", b"application/json")]) is None
