"""Named GPU + model profiles: the constants the timing model runs on.

Owns the data only (model shapes, GPU datasheet figures, efficiency factors) and the sizes
derived from them (KV bytes per token, default KV pool size). The formulas that turn a batch
into seconds live in `timing.py`. Every constant's source is in README.md ("Profiles").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shmdisagg.executors.sim.errors import ConfigError

GB = 1e9
GIB = float(1 << 30)
TERA = 1e12


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer, from its Hugging Face `config.json`."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: float
    vocab_size: int
    max_position_embeddings: int


@dataclass(frozen=True)
class GpuSpec:
    """Per-GPU peak figures from NVIDIA's datasheet (dense BF16, no sparsity)."""

    name: str
    bf16_dense_flops: float  # FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: float


@dataclass(frozen=True)
class Profile:
    """One executor: a model on `tp` GPUs, plus the efficiency factors the timing model uses.

    Fields after `tp` are calibration constants (see README.md for where each comes from):
    `prefill_mfu` / `decode_mbu` scale the GPU peaks, `gpu_step_overhead_s` is the fixed GPU time
    of one engine iteration, `host_step_overhead_s` the scheduler's CPU time per iteration (hidden
    by the overlap scheduler), `request_overhead_s` the per-request fixed latency before a request
    reaches the scheduler, `kv_transfer_bandwidth` / `kv_transfer_latency_s` the context-to-
    generation KV move.
    """

    name: str
    model: ModelSpec
    gpu: GpuSpec
    tp: int
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_element: float = 2.0
    prefill_mfu: float = 0.40
    decode_mbu: float = 0.70
    gpu_step_overhead_s: float = 0.004
    host_step_overhead_s: float = 0.004
    request_overhead_s: float = 0.050
    kv_transfer_bandwidth: float = 100 * GB
    kv_transfer_latency_s: float = 0.001
    runtime_reserve_bytes: float = 4 * GIB

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes one token occupies on one GPU (K and V, all layers, this GPU's heads)."""
        m = self.model
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * self.kv_bytes_per_element / self.tp

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.model.num_params * self.weight_bytes_per_param / self.tp

    def default_num_blocks(self, tokens_per_block: int, free_gpu_memory_fraction: float = 0.9) -> int:
        """KV pool size the way TensorRT-LLM sizes it: a fraction of the memory left after weights."""
        free = self.gpu.hbm_bytes - self.weight_bytes_per_gpu - self.runtime_reserve_bytes
        if free <= 0:
            raise ConfigError(f"profile {self.name}: weights do not fit on {self.gpu.name} at tp={self.tp}")
        return max(1, int(free * free_gpu_memory_fraction // (self.kv_bytes_per_token * tokens_per_block)))

    def with_tp(self, tp: int) -> Profile:
        if tp < 1:
            raise ConfigError(f"tp_size must be >= 1, got {tp}")
        return self if tp == self.tp else replace(self, tp=tp)


LLAMA_3_1_8B = ModelSpec(
    name="meta-llama/Llama-3.1-8B-Instruct",
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_kv_heads=8,
    head_dim=128,
    num_params=8.03e9,
    vocab_size=128256,
    max_position_embeddings=131072,
)

LLAMA_3_1_70B = ModelSpec(
    name="meta-llama/Llama-3.1-70B-Instruct",
    num_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_kv_heads=8,
    head_dim=128,
    num_params=70.6e9,
    vocab_size=128256,
    max_position_embeddings=131072,
)

H100_SXM = GpuSpec(name="H100 SXM5 80GB", bf16_dense_flops=989 * TERA, hbm_bandwidth=3.35 * TERA, hbm_bytes=80 * GB)
H200_SXM = GpuSpec(name="H200 SXM 141GB", bf16_dense_flops=989 * TERA, hbm_bandwidth=4.8 * TERA, hbm_bytes=141 * GB)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(name="h100-sxm-llama-3.1-8b", model=LLAMA_3_1_8B, gpu=H100_SXM, tp=1),
        Profile(name="h200-llama-3.1-8b", model=LLAMA_3_1_8B, gpu=H200_SXM, tp=1),
        Profile(name="h100-sxm-llama-3.1-70b-tp4", model=LLAMA_3_1_70B, gpu=H100_SXM, tp=4),
        Profile(name="h200-llama-3.1-70b-tp4", model=LLAMA_3_1_70B, gpu=H200_SXM, tp=4),
    )
}

DEFAULT_PROFILE = "h100-sxm-llama-3.1-8b"


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None


def guess_profile(model: str, tp: int) -> str:
    """The profile for a `trtllm-serve MODEL` path: same model family and size, tp preferred."""
    key = model.lower().replace("_", "-")
    size = "70b" if "70b" in key else "8b"
    matches = [p for p in PROFILES.values() if p.model.name.lower().endswith(f"-{size}-instruct")]
    for p in matches:
        if p.tp == tp:
            return p.name
    return matches[0].name if matches else DEFAULT_PROFILE
