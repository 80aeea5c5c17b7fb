"""The timing model: how long one engine iteration, one request's fixed overhead and one KV
transfer take on a `Profile`. Pure functions of the profile and the batch; no clock, no state.

One iteration runs every scheduled prefill chunk and one decode step for every decoding request
(TensorRT-LLM's in-flight batching). Its GPU time is a roofline over the whole batch:

    gpu = gpu_step_overhead + max(flops / (peak_flops * prefill_mfu),
                                  bytes / (hbm_bandwidth * decode_mbu))

    flops = 2 * params/tp * tokens                      (linear layers, every new token)
          + 4 * layers * hidden/tp * sum(new * attended) (QK^T and AV; `attended` is the mean
                                                          context a new token attends to)
    bytes = weights/tp + kv_bytes_per_token * tokens read by attention

so prefill cost grows with uncached tokens (linearly, plus the quadratic attention term) and a
decode step with batch size (flops) and total context (KV bytes). With the overlap scheduler the
host's per-iteration work hides under the GPU's (`max`); without it the two add up.
"""

from __future__ import annotations

from collections.abc import Iterable

from shmdisagg.executors.sim.profiles import Profile


def prefill_chunk_flops(p: Profile, new: int, past: int) -> float:
    """FLOPs on one GPU to prefill `new` tokens after `past` tokens already in the KV cache."""
    m = p.model
    linear = 2.0 * m.num_params * new
    attended = past + (new + 1) / 2.0
    attention = 4.0 * m.num_layers * m.num_attention_heads * m.head_dim * new * attended
    return (linear + attention) / p.tp


def decode_flops(p: Profile, num_decode: int, context_tokens: int) -> float:
    m = p.model
    linear = 2.0 * m.num_params * num_decode
    attention = 4.0 * m.num_layers * m.num_attention_heads * m.head_dim * context_tokens
    return (linear + attention) / p.tp


def iteration_seconds(
    p: Profile,
    prefill_chunks: Iterable[tuple[int, int]],
    num_decode: int,
    decode_context_tokens: int,
    overlap_scheduler: bool = True,
) -> float:
    """One engine iteration: `prefill_chunks` are (new, past) token counts; `num_decode` requests
    each decode one token over `decode_context_tokens` tokens of context in total."""
    flops = decode_flops(p, num_decode, decode_context_tokens) if num_decode else 0.0
    kv_tokens_read = decode_context_tokens
    for new, past in prefill_chunks:
        flops += prefill_chunk_flops(p, new, past)
        kv_tokens_read += past + new
    compute_s = flops / (p.gpu.bf16_dense_flops * p.prefill_mfu)
    memory_s = (p.weight_bytes_per_gpu + p.kv_bytes_per_token * kv_tokens_read) / (p.gpu.hbm_bandwidth * p.decode_mbu)
    gpu_s = p.gpu_step_overhead_s + max(compute_s, memory_s)
    if overlap_scheduler:
        return max(gpu_s, p.host_step_overhead_s)
    return gpu_s + p.host_step_overhead_s


def transfer_seconds(p: Profile, num_tokens: int) -> float:
    """Moving `num_tokens` tokens of KV from a context GPU to a generation GPU (each TP rank
    moves its own shard in parallel, so the per-GPU bytes set the time)."""
    if num_tokens <= 0:
        return 0.0
    return p.kv_transfer_latency_s + num_tokens * p.kv_bytes_per_token / p.kv_transfer_bandwidth


def ttft_seconds(p: Profile, prompt_tokens: int, cached_tokens: int = 0, overlap_scheduler: bool = True) -> float:
    """Time to first token for a lone request on an idle executor (README's headline numbers)."""
    new = max(prompt_tokens - cached_tokens, 1)
    return p.request_overhead_s + iteration_seconds(p, [(new, cached_tokens)], 0, 0, overlap_scheduler)


def itl_seconds(p: Profile, batch: int, context_per_request: int, overlap_scheduler: bool = True) -> float:
    """Inter-token latency with `batch` requests decoding, each over `context_per_request` tokens."""
    return iteration_seconds(p, (), batch, batch * context_per_request, overlap_scheduler)
