"""TensorRT-LLM's config keys: each has TensorRT-LLM's effect, is refused by name, or (an unknown
key, no LLM argument either) is named in a warning; check-config lists every problem and warning."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shmdisagg.config import ConfigError, config_warnings, parse_config
from tests.conftest import free_port

BASE: dict[str, Any] = {
    "hostname": "localhost",
    "port": 8000,
    "backend": "pytorch",
    "context_servers": {"num_instances": 1, "urls": ["localhost:8001"], "tensor_parallel_size": 1},
    "generation_servers": {"num_instances": 1, "urls": ["localhost:8002"]},
}

# TensorRT-LLM's EPD example (examples/disaggregated/multimodal, index id 50070208710), unchanged.
EPD_EXAMPLE = """
hostname: localhost
port: 8000
backend: pytorch
multimodal_servers:
  num_instances: 1
  urls:
      - "localhost:8001"
generation_servers:
  num_instances: 1
  urls:
      - "localhost:8002"
"""


def _base(**top: Any) -> dict[str, Any]:
    data = yaml.safe_load(yaml.safe_dump(BASE))
    data.update(top)
    return data


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "cfg.yaml")
    assert "\n" not in str(info.value)
    return info.value.problems


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_unknown_keys_are_each_named_in_a_warning_and_llm_arguments_are_not() -> None:
    data = _base(
        warp_factor=9,
        otlp_config={"otlp_traces_endpoint": "http://x:4317"},
        internal_request_auth_key="k",
        print_iter_log=True,
        cuda_graph_config={"enable_padding": True},
        free_gpu_memory_fraction=0.8,
    )
    data["context_servers"]["kv_cache_config"] = {"enable_block_reuse": True}
    data["context_servers"]["moe_config"] = {"backend": "CUTLASS"}
    data["context_servers"]["flux_capacitor"] = True
    data["generation_servers"]["tensor_paralel_size"] = 2
    warnings = config_warnings(parse_config(data))
    assert len(warnings) == 3, warnings
    assert warnings[0].startswith("warp_factor: unknown key (no TensorRT-LLM disaggregated-config key or LLM argument")
    assert warnings[1].startswith("context_servers.flux_capacitor: unknown key (")
    assert warnings[2].startswith(
        "generation_servers.tensor_paralel_size: unknown key, did you mean tensor_parallel_size?"
    )


KNOWN_KV = {"tokens_per_block": 64, "enable_block_reuse": True, "event_buffer_max_size": 1024}


@pytest.mark.parametrize(
    ("where", "typo", "named", "meant"),
    [
        ("top", "tokens_per_blok", "kv_cache_config.tokens_per_blok", "tokens_per_block"),
        (
            "context_servers",
            "event_buffer_max_sise",
            "context_servers.kv_cache_config.event_buffer_max_sise",
            "event_buffer_max_size",
        ),
        (
            "generation_servers",
            "enable_blok_reuse",
            "generation_servers.kv_cache_config.enable_blok_reuse",
            "enable_block_reuse",
        ),
    ],
)
def test_unknown_kv_cache_config_keys_are_named_once_where_the_file_sets_them(
    where: str, typo: str, named: str, meant: str
) -> None:
    """KvCacheConfig is a StrictBaseModel: trtllm-serve refuses the typo, shmdisagg would silently
    keep the default; a top-level kv_cache_config both sections inherit is named once, there."""
    kv = {**KNOWN_KV, "free_gpu_memory_fraction": 0.8, typo: 64}
    data = _base()
    if where == "top":
        data["kv_cache_config"] = kv
    else:
        data[where]["kv_cache_config"] = kv
        other = "generation_servers" if where == "context_servers" else "context_servers"
        data[other]["kv_cache_config"] = dict(KNOWN_KV)  # known fields only: no warning
    warnings = config_warnings(parse_config(data))
    assert len(warnings) == 1, warnings
    assert warnings[0] == (
        f"{named}: unknown key, did you mean {meant}? (no TensorRT-LLM KvCacheConfig field: "
        "trtllm-serve executors would refuse it, shmdisagg serve ignores it)"
    ), warnings


@pytest.mark.parametrize(
    "where, arg, typo, named, meant, cls",
    [
        (
            "top",
            "cache_transceiver_config",
            "kv_transfer_timeout_msec",
            "cache_transceiver_config.kv_transfer_timeout_msec",
            "kv_transfer_timeout_ms",
            "CacheTransceiverConfig",
        ),
        (
            "context_servers",
            "cache_transceiver_config",
            "backnd",
            "context_servers.cache_transceiver_config.backnd",
            "backend",
            "CacheTransceiverConfig",
        ),
        (
            "generation_servers",
            "scheduler_config",
            "capacity_scheduler_polcy",
            "generation_servers.scheduler_config.capacity_scheduler_polcy",
            "capacity_scheduler_policy",
            "SchedulerConfig",
        ),
    ],
)
def test_unknown_keys_of_the_other_strict_config_mappings_are_named(
    where: str, arg: str, typo: str, named: str, meant: str, cls: str
) -> None:
    """CacheTransceiverConfig and SchedulerConfig are StrictBaseModels too (llm_args.py)."""
    mapping = {"backend": "UCX", typo: 1} if arg == "cache_transceiver_config" else {typo: "MAX_UTILIZATION"}
    data = _base()
    (data if where == "top" else data[where])[arg] = mapping
    warnings = config_warnings(parse_config(data))
    assert warnings == [
        f"{named}: unknown key, did you mean {meant}? (no TensorRT-LLM {cls} field: "
        "trtllm-serve executors would refuse it, shmdisagg serve ignores it)"
    ]


def test_the_kv_cache_config_options_shmdisagg_reads_are_kv_cache_config_fields() -> None:
    from shmdisagg.executors.plan import SIM_LLM_OPTIONS
    from shmdisagg.trtllm_llm_args import NESTED_CONFIG_NAMES

    KV_CACHE_CONFIG_NAMES = NESTED_CONFIG_NAMES["kv_cache_config"]

    read = {name.split(".", 1)[1] for name in SIM_LLM_OPTIONS if name.startswith("kv_cache_config.")}
    assert read == {"enable_block_reuse", "event_buffer_max_size", "kv_cache_event_hash_algo"}
    assert read | {"tokens_per_block", "free_gpu_memory_fraction", "max_tokens"} <= KV_CACHE_CONFIG_NAMES
    data = _base(kv_cache_config={**dict.fromkeys(sorted(KV_CACHE_CONFIG_NAMES)), "tokens_per_block": 32})
    assert config_warnings(parse_config(data)) == []


def test_check_config_prints_every_warning_and_still_passes(tmp_path: Path) -> None:
    data = _base(warp_factor=9, num_workrs=2)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    out = _cli("check-config", "-c", str(path))
    assert out.returncode == 0, out
    lines = out.stderr.strip().splitlines()
    assert [line.split(": ")[3] for line in lines] == ["num_workrs", "warp_factor"], out.stderr
    assert "did you mean num_workers?" in lines[0]


def test_the_epd_example_is_refused_naming_multimodal_servers(tmp_path: Path) -> None:
    path = tmp_path / "epd.yaml"
    path.write_text(EPD_EXAMPLE)
    out = _cli("check-config", "-c", str(path))
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"shmdisagg: config error: {path}: multimodal_servers: multimodal encoder servers (EPD) are not supported"
    )
    assert "context_servers" not in lines[0].split("multimodal_servers:", 1)[0]
    assert "missing" not in out.stderr


@pytest.mark.parametrize(
    ("top", "expected"),
    [
        (
            {"multimodal_servers": {"urls": ["localhost:8005"]}},
            "multimodal_servers: multimodal encoder servers (EPD) are not supported",
        ),
        (
            {"conversation_affinity_header_for_subagents": "X-Dynamo-Parent-Session-ID"},
            "conversation_affinity_header_for_subagents: sub-agent parent-session affinity is not supported",
        ),
        (
            {"subagent_affinity_scope": "both"},
            "subagent_affinity_scope: sub-agent parent-session affinity is not supported",
        ),
        (
            {"bind_host": "0.0.0.0"},
            "bind_host: a bind address apart from the advertised hostname is not supported; set hostname",
        ),
        (
            {"disagg_coordinator_url": "http://host:8332"},
            "disagg_coordinator_url: an external coordinator is not supported",
        ),
        ({"node_id": "7"}, "node_id: Input should be a valid integer"),
        ({"node_id": 256}, "node_id: Input should be less than 256"),
        ({"port": 0, "num_workers": 2}, "port: 0 (a port the kernel picks) needs num_workers: 1, not 2"),
    ],
)
def test_trtllm_keys_shmdisagg_does_not_honour_are_refused_by_name(top: dict[str, Any], expected: str) -> None:
    problems = _problems(_base(**top))
    assert len(problems) == 1 and problems[0].startswith(f"cfg.yaml: {expected}"), problems


def test_more_than_256_executors_are_refused_in_check_config_and_serve_in_one_line(tmp_path: Path) -> None:
    data = _base()
    data["context_servers"] = {"urls": [f"127.0.0.1:{20000 + i}" for i in range(200)]}
    data["generation_servers"] = {"urls": [f"127.0.0.1:{21000 + i}" for i in range(57)]}
    listed = {*range(20000, 20200), *range(21000, 21057)}
    # free_port may return a listed executor's port: then the config error names that clash first
    data["hostname"], data["port"] = "127.0.0.1", next(p for p in iter(free_port, None) if p not in listed)
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(data))
    for command in ("check-config", "serve"):
        out = _cli(command, "-c", str(path))
        assert out.returncode == 2, (command, out)
        assert "Traceback" not in out.stderr
        lines = out.stderr.strip().splitlines()
        assert lines == [
            f"shmdisagg: config error: {path}: context_servers.urls/generation_servers.urls: 257 executors "
            "(200 context + 57 generation), more than the 256 one deployment can route to (the widest shared "
            "table's server sets); split them over deployments"
        ], (command, out.stderr)
    data["generation_servers"]["urls"].pop()
    assert parse_config(data).max_servers == 256  # 256 load, in a table of 256 slots


@pytest.mark.parametrize(("listed", "slots"), [(2, 64), (64, 64), (65, 128), (129, 192), (256, 256)])
def test_the_table_is_sized_from_the_executors_listed(listed: int, slots: int) -> None:
    data = _base()
    data["context_servers"] = {"urls": [f"127.0.0.1:{20000 + i}" for i in range(listed - 1)]}
    data["generation_servers"] = {"urls": ["127.0.0.1:21000"]}
    assert parse_config(data).max_servers == slots


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (100, "shmdisagg.shm.max_servers: must be a multiple of 64 in 64..256, not 100"),
        (512, "shmdisagg.shm.max_servers: must be a multiple of 64 in 64..256, not 512"),
        (0, "shmdisagg.shm.max_servers: must be a multiple of 64 in 64..256, not 0"),
        (64, "shmdisagg.shm.max_servers: 64 is fewer than the 66 executors listed"),
    ],
)
def test_a_bad_max_servers_is_one_line_naming_the_key(value: int, expected: str) -> None:
    data = _base(shmdisagg={"shm": {"max_servers": value}})
    data["context_servers"] = {"urls": [f"127.0.0.1:{20000 + i}" for i in range(65)]}
    problems = _problems(data)
    assert len(problems) == 1 and problems[0].startswith(f"cfg.yaml: {expected}"), problems


def test_max_servers_sizes_a_table_for_executors_that_register_themselves() -> None:
    cluster = {"cluster_uri": "etcd://127.0.0.1:2379", "cluster_name": "c"}
    data = _base(disagg_cluster=cluster)
    data["context_servers"], data["generation_servers"] = {}, {}
    assert parse_config(data).max_servers == 64
    data["shmdisagg"] = {"shm": {"max_servers": 256}}
    assert parse_config(data).max_servers == 256


def test_check_config_lists_every_problem_of_a_file(tmp_path: Path) -> None:
    data = _base(multimodal_servers={"urls": ["localhost:8009"]}, bind_host="0.0.0.0", port="eighty", num_workers=0)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    out = _cli("check-config", "-c", str(path))
    assert out.returncode == 2, out
    keys = [
        line.removeprefix(f"shmdisagg: config error: {path}: ").split(":")[0]
        for line in out.stderr.strip().splitlines()
    ]
    assert keys == ["multimodal_servers", "bind_host", "port", "num_workers"], out.stderr


def test_port_0_and_the_trtllm_log_level_names_load() -> None:
    cfg = parse_config(_base(port=0, num_workers=1, shmdisagg={"log_level": "verbose"}))
    assert cfg.port == 0 and cfg.shmdisagg.log_level == "verbose"
    assert any(
        w.startswith("port: 0 lets the kernel pick the port; only shmdisagg serve --report_addr")
        for w in config_warnings(cfg)
    )
    assert parse_config(_base(node_id=0)).node_id == 0 and parse_config(_base(node_id=255)).node_id == 255


def test_the_llm_argument_names_are_regenerated_by_the_script(tmp_path: Path) -> None:
    """The generator reads a TensorRT-LLM tree with ast: LlmArgs fields, removed-but-accepted and
    legacy names, get_llm_args' parameters; KvCacheConfig's fields and their aliases (no
    ClassVar, private name or model_config); the committed lists hold what TensorRT-LLM's own
    examples use."""
    from shmdisagg.trtllm_llm_args import LLM_ARG_NAMES, NESTED_CONFIG_CLASSES, NESTED_CONFIG_NAMES

    (tmp_path / "tensorrt_llm/llmapi").mkdir(parents=True)
    (tmp_path / "tensorrt_llm/commands").mkdir(parents=True)
    (tmp_path / "tensorrt_llm/llmapi/llm_args.py").write_text(
        "class KvCacheConfig(StrictBaseModel, PybindMirror):\n    model_config = None\n    tokens_per_block: int = 32\n"
        "    kind: ClassVar[str] = 'kv'\n    _pybind: int = 0\n"
        "    old: int = Field(default=0, alias='older')\n"
        "    new: int = Field(0, validation_alias=AliasChoices('new', 'newer', AliasPath('newest', 0)))\n"
        "class BaseTransceiverConfig(StrictBaseModel):\n    backend: str = 'UCX'\n"
        "class CacheTransceiverConfig(BaseTransceiverConfig):\n    max_tokens_in_buffer: int = 0\n"
        "class NotStrict(BaseModel):\n    x: int = 0\n"
        "class BaseLlmArgs:\n    model_config = None\n    model: str\n    _hidden: int = 0\n    max_batch_size: "
        "int = 2048\n    kv_cache_config: KvCacheConfig = ...\n"
        "    cache_transceiver_config: Optional[CacheTransceiverConfig] = ...\n    loose: NotStrict | None = None\n"
        "    either: Optional[Union[KvCacheConfig, CacheTransceiverConfig]] = None\n"
        "_TORCH_LLMARGS_REMOVED_ARG_CHECKS: dict = {'sampler_type': print}\n"
        "class TorchLlmArgs(BaseLlmArgs):\n    print_iter_log: bool = False\n"
        "def update_llm_args_with_extra_dict(llm_args, llm_args_dict):\n    if 'hf_revision' in llm_args_dict:\n "
        "       pass\n"
    )
    (tmp_path / "tensorrt_llm/commands/serve.py").write_text(
        "def get_llm_args(model, free_gpu_memory_fraction=0.9, **rest):\n    pass\n"
    )
    out = subprocess.run(
        [sys.executable, "scripts/gen_trtllm_llm_args.py", str(tmp_path), "abc123", "--serve-commit", "def456"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
        check=True,
    )
    namespace: dict[str, Any] = {}
    exec(compile(out.stdout, "generated", "exec"), namespace)
    assert namespace["LLM_ARG_NAMES"] == {
        "model",
        "max_batch_size",
        "sampler_type",
        "print_iter_log",
        "hf_revision",
        "free_gpu_memory_fraction",
        "kv_cache_config",
        "cache_transceiver_config",
        "loose",
        "either",
    }
    # one StrictBaseModel class (or Optional of one), its bases' fields included; not a union, not a plain BaseModel
    assert namespace["NESTED_CONFIG_CLASSES"] == {
        "kv_cache_config": "KvCacheConfig",
        "cache_transceiver_config": "CacheTransceiverConfig",
    }
    assert namespace["NESTED_CONFIG_NAMES"] == {
        "kv_cache_config": {"tokens_per_block", "old", "older", "new", "newer", "newest"},
        "cache_transceiver_config": {"backend", "max_tokens_in_buffer"},
    }
    assert "commit abc123" in out.stdout and "commit def456" in out.stdout
    assert {
        "kv_cache_config",
        "cache_transceiver_config",
        "tensor_parallel_size",
        "moe_expert_parallel_size",
        "enable_attention_dp",
        "cuda_graph_config",
        "speculative_config",
        "disable_overlap_scheduler",
        "print_iter_log",
        "backend",
        "model",
        "free_gpu_memory_fraction",
        "max_seq_len",
        "trust_remote_code",
        "stream_interval",
    } <= LLM_ARG_NAMES
    assert {
        "tokens_per_block",
        "enable_block_reuse",
        "event_buffer_max_size",
        "free_gpu_memory_fraction",
        "kv_cache_event_hash_algo",
        "max_tokens",
        "host_cache_size",
        "enable_partial_reuse",
        "dtype",
    } <= NESTED_CONFIG_NAMES["kv_cache_config"]
    assert {"backend", "kv_transfer_timeout_ms", "max_tokens_in_buffer"} <= NESTED_CONFIG_NAMES[
        "cache_transceiver_config"
    ]
    # the committed file is the script's output (its lists as the script writes them), which ruff leaves as it is
    root = Path(__file__).resolve().parents[3]
    committed = (root / "shmdisagg/trtllm_llm_args.py").read_text()
    script = runpy.run_path(str(root / "scripts/gen_trtllm_llm_args.py"))
    nested = {arg: (NESTED_CONFIG_CLASSES[arg], set(names)) for arg, names in NESTED_CONFIG_NAMES.items()}
    assert committed.startswith('"""Names TensorRT-LLM knows in a disaggregated config (generated; do not edit')
    assert committed[committed.index("\nLLM_ARG_NAMES = ") + 1 :] == (
        script["_frozenset"]("LLM_ARG_NAMES", set(LLM_ARG_NAMES)) + "\n" + script["_nested"](nested)
    )
    (tmp_path / "tensorrt_llm/llmapi/llm_args.py").write_text("class BaseLlmArgs:\n    model: str\n")
    missing = subprocess.run(
        [sys.executable, "scripts/gen_trtllm_llm_args.py", str(tmp_path), "abc123"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert missing.returncode == 1 and "no kv_cache_config argument of a StrictBaseModel class" in missing.stderr


def _cluster(**cluster: Any) -> dict[str, Any]:
    data = _base(disagg_cluster={"cluster_uri": "etcd://127.0.0.1:2379", **cluster})
    for key in ("context_servers", "generation_servers"):
        data[key] = {k: v for k, v in data[key].items() if k not in ("urls", "num_instances")}
    return data


def test_disagg_cluster_is_read_with_tensorrt_llms_names_and_defaults() -> None:
    cfg = parse_config(_cluster(cluster_name="prod", minimal_instances={"context_servers": 2}), "cfg.yaml")
    cluster = cfg.disagg_cluster
    assert cluster is not None and cluster.is_etcd
    assert (cluster.cluster_name, cluster.heartbeat_interval_sec, cluster.inactive_timeout_sec) == ("prod", 5, 10)
    assert (cluster.minimal_instances.context_servers, cluster.minimal_instances.generation_servers) == (2, 1)
    # None keeps the default, as TensorRT-LLM's update_dataclass does
    assert parse_config(_cluster(cluster_name=None), "cfg.yaml").disagg_cluster.cluster_name == ""  # type: ignore[union-attr]
    two = parse_config(_cluster(cluster_uri="etcd://a:2379,etcd://b:2380"), "cfg.yaml").disagg_cluster
    assert two is not None and two.endpoints() == [("a", 2379), ("b", 2380)]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {**_cluster(), "context_servers": {"urls": ["127.0.0.1:8001"]}},
            "context_servers.urls: not used with disagg_cluster",
        ),
        (_cluster(cluster_uri="zk://h:1"), "disagg_cluster.cluster_uri: 'zk://h:1' is not an etcd"),
        (_cluster(cluster_uri="https://h:8000"), "disagg_cluster.cluster_uri: 'https://h:8000': an https"),
        (_cluster(cluster_uri="etcd://h"), "disagg_cluster.cluster_uri: 'etcd://h' is not etcd://host:port"),
        (
            _cluster(cluster_uri="http://localhost:9999"),
            "disagg_cluster.cluster_uri: 'http://localhost:9999': the http",
        ),
        (_cluster(watch_interval=3), "disagg_cluster.watch_interval: Extra inputs are not permitted"),
        (_cluster(minimal_instances={"context": 1}), "disagg_cluster.minimal_instances.context: Extra inputs"),
    ],
)
def test_disagg_cluster_settings_it_cannot_honour_are_refused_by_name(data: dict[str, Any], expected: str) -> None:
    problems = _problems(data)
    assert len(problems) == 1 and problems[0].startswith(f"cfg.yaml: {expected}"), problems


def test_an_http_cluster_store_on_the_public_port_is_accepted() -> None:
    data = _cluster(cluster_uri="http://localhost:8000")
    data["port"] = 8000
    assert parse_config(data, "cfg.yaml").disagg_cluster is not None
