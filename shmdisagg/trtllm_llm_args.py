"""Names TensorRT-LLM knows in a disaggregated config (generated; do not edit by hand).

`LLM_ARG_NAMES`: the LLM arguments (the public fields of the `*LlmArgs` classes, the
removed-but-accepted arguments of `_TORCH_LLMARGS_REMOVED_ARG_CHECKS`, the legacy spellings
`update_llm_args_with_extra_dict` accepts, the parameters of `get_llm_args`). A disaggregated
config's unknown top-level and section keys are LLM arguments for the executors (TensorRT-LLM
inherits top-level ones into both sections); `config_warnings` names any key that is none of these.

`NESTED_CONFIG_NAMES`: for each LLM argument that takes one of TensorRT-LLM's StrictBaseModel
config classes (`NESTED_CONFIG_CLASSES`: `kv_cache_config` is a `KvCacheConfig`), the fields of
that class and their aliases. trtllm-serve refuses any other key of such a mapping at start-up;
`config_warnings` names one, and the simulator refuses it as trtllm-serve does.

Source: NVIDIA/TensorRT-LLM `tensorrt_llm/llmapi/llm_args.py` at commit 0004396720054fd8e205cbf616f21f0b57c6b412
and `tensorrt_llm/commands/serve.py` (`get_llm_args`) at commit 00209af149e7774406881a37283dce303571eb11.

Taken from excerpts of those two files as the code index stores them (no TensorRT-LLM checkout on
the machine that wrote it; llm_args.py was read whole, serve.py up to get_llm_args):
`DynamicBatchConfig`, `SchedulerConfig`, `KvCacheConfig` and `CacheTransceiverConfig` whole and
verbatim; the annotated statements of `BaseLlmArgs` and `TorchLlmArgs` (values elided);
`_TORCH_LLMARGS_REMOVED_ARG_CHECKS` and `update_llm_args_with_extra_dict` verbatim; `get_llm_args`
verbatim. The other config classes were not copied, so only these arguments' mappings are checked.
With a checkout, regenerate from it (with --serve-commit where the two commits differ).

Regenerate: `python scripts/gen_trtllm_llm_args.py TRTLLM_CHECKOUT > shmdisagg/trtllm_llm_args.py`.
"""

LLM_ARG_NAMES = frozenset(
    {
        "allreduce_strategy",
        "attention_dp_config",
        "attn_backend",
        "backend",
        "batch_wait_max_tokens_ratio",
        "batch_wait_timeout_iters",
        "batch_wait_timeout_ms",
        "batched_logits_processor",
        "cache_transceiver_config",
        "checkpoint_format",
        "checkpoint_io_policy",
        "checkpoint_loader",
        "context_parallel_size",
        "cp_config",
        "cuda_graph_config",
        "custom_tokenizer",
        "decoding_config",
        "disable_mm_encoder",
        "disable_overlap_scheduler",
        "dtype",
        "dwdp_config",
        "enable_attention_dp",
        "enable_autotuner",
        "enable_chunked_prefill",
        "enable_early_first_token_response",
        "enable_encoder_decoder_mixed_cuda_graph",
        "enable_energy_metrics",
        "enable_in_graph_sampling",
        "enable_iter_perf_stats",
        "enable_iter_req_stats",
        "enable_layerwise_nvtx_marker",
        "enable_lm_head_tp_in_adp",
        "enable_lora",
        "enable_low_latency_host_dispatch",
        "enable_min_latency",
        "enable_mla_skip_correction",
        "enable_resource_governor",
        "enable_speculative_beam_history_d2h",
        "encode_only",
        "encoder_cuda_graph_config",
        "encoder_max_batch_size",
        "encoder_max_num_tokens",
        "env_overrides",
        "fail_fast_on_attention_window_too_large",
        "force_dynamic_quantization",
        "free_gpu_memory_fraction",
        "garbage_collection_gen0_threshold",
        "gather_generation_logits",
        "generation_config",
        "gms_config",
        "gpus_per_node",
        "guided_decoding_backend",
        "hf_revision",
        "iter_stats_max_iterations",
        "kv_cache_compression_config",
        "kv_cache_config",
        "kv_connector_config",
        "layer_wise_benchmarks_config",
        "load_format",
        "lora_config",
        "max_batch_size",
        "max_beam_width",
        "max_input_len",
        "max_num_tokens",
        "max_seq_len",
        "max_stats_len",
        "mla_skip_correction_threshold",
        "mm_encoder_only",
        "model",
        "model_kwargs",
        "moe_cluster_parallel_size",
        "moe_config",
        "moe_expert_parallel_size",
        "moe_tensor_parallel_size",
        "mpi_session",
        "multimodal_config",
        "mx_config",
        "num_postprocess_workers",
        "num_serve_frontends",
        "nvfp4_gemm_config",
        "orchestrator_type",
        "otlp_traces_endpoint",
        "peft_cache_config",
        "perf_metrics_max_requests",
        "perf_metrics_output_dir",
        "pipeline_parallel_size",
        "post_processor_hook",
        "postprocess_tokenizer_dir",
        "pp_partition",
        "prefill_capture_num_tokens",
        "prefill_cuda_graph_backend",
        "print_iter_log",
        "prometheus_metrics_config",
        "ray_placement_config",
        "ray_worker_extension_cls",
        "ray_worker_nsight_options",
        "reasoning_parser",
        "reorder_policy_config",
        "request_stats_max_iterations",
        "return_perf_metrics",
        "revision",
        "sampler_force_async_worker",
        "sampler_type",
        "scheduler_config",
        "skip_tokenizer_init",
        "sleep_config",
        "sparse_attention_config",
        "speculative_config",
        "stream_interval",
        "telemetry_config",
        "tensor_parallel_size",
        "tokenizer",
        "tokenizer_mode",
        "tokenizer_revision",
        "torch_compile_config",
        "trust_remote_code",
        "use_cute_dsl_bf16_bmm",
        "use_cute_dsl_bf16_gemm",
        "use_cute_dsl_blockscaling_bmm",
        "use_cute_dsl_blockscaling_mm",
        "use_fine_grained_sync",
    }
)

NESTED_CONFIG_CLASSES = {
    "cache_transceiver_config": "CacheTransceiverConfig",
    "kv_cache_config": "KvCacheConfig",
    "scheduler_config": "SchedulerConfig",
}

NESTED_CONFIG_NAMES = {
    "cache_transceiver_config": frozenset(
        {
            "backend",
            "enable_pipelined_transfer",
            "kv_cache_bounce_size_mb",
            "kv_transfer_poll_interval_ms",
            "kv_transfer_sender_future_timeout_ms",
            "kv_transfer_timeout_ms",
            "max_tokens_in_buffer",
            "transceiver_runtime",
        }
    ),
    "kv_cache_config": frozenset(
        {
            "attention_dp_events_gather_period_ms",
            "avg_seq_len",
            "block_reuse_config",
            "copy_on_partial_reuse",
            "cross_kv_cache_fraction",
            "disk_cache_path",
            "disk_cache_size",
            "disk_prefetch_num_reqs",
            "dtype",
            "enable_block_reuse",
            "enable_kv_pool_rebalance",
            "enable_partial_reuse",
            "enable_swa_scratch_reuse",
            "event_buffer_max_size",
            "fp8_context_mla_kv_len_cap",
            "free_gpu_memory_fraction",
            "host_cache_size",
            "iteration_stats_interval",
            "kv_cache_event_hash_algo",
            "kv_events_config",
            "kv_pool_rebalance_check_interval",
            "kv_pool_rebalance_cooldown_secs",
            "kv_pool_rebalance_min_sampled_kv_caches",
            "kv_pool_rebalance_moving_average_decay",
            "kv_pool_rebalance_ratio_threshold",
            "kv_pool_rebalance_target_ratio_update_interval",
            "mamba_ssm_cache_dtype",
            "mamba_ssm_philox_rounds",
            "mamba_ssm_stochastic_rounding",
            "mamba_state_cache_interval",
            "mamba_state_config",
            "max_attention_window",
            "max_gpu_total_bytes",
            "max_tokens",
            "max_util_for_resume",
            "pool_ratio",
            "secondary_offload_min_priority",
            "sink_token_length",
            "tokens_per_block",
            "use_kv_cache_manager_v2",
            "use_uvm",
        }
    ),
    "scheduler_config": frozenset(
        {
            "capacity_scheduler_policy",
            "context_chunking_policy",
            "dynamic_batch_config",
            "enable_prefix_aware_scheduling",
            "use_python_scheduler",
            "waiting_queue_policy",
        }
    ),
}
