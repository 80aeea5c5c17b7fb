"""`host:port` as a URL's authority writes it: an IPv6 literal in brackets (RFC 3986, 3.2.2),
as config urls and TensorRT-LLM's `WorkerInfo.addr` spell an executor's address."""

from __future__ import annotations


def authority(host: str, port: int) -> str:
    """`host:port`, or `[host]:port` when `host` is an IPv6 literal (it holds a colon)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
