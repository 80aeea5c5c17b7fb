"""Config loading: TensorRT-LLM files load unchanged; bad files get one line naming the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shmdisagg.config import ConfigError, config_warnings, load_config, parse_config

TRTLLM_EXAMPLE = """
hostname: localhost
port: 8000
num_workers: 4
backend: pytorch
context_servers:
  num_instances: 2
  urls: ["localhost:8001", "localhost:8002"]
  router:
    type: kv_cache_aware
  tensor_parallel_size: 1
  cache_transceiver_config:
    backend: UCX
  kv_cache_config:
    tokens_per_block: 64
    enable_block_reuse: true
  disable_overlap_scheduler: true
generation_servers:
  num_instances: 1
  urls: ["localhost:8003"]
  router:
    type: load_balancing
    use_tokens: true
"""


def test_trtllm_config_loads_unchanged_with_llm_args_kept(tmp_path: Path) -> None:
    path = tmp_path / "disagg.yaml"
    path.write_text(TRTLLM_EXAMPLE)
    cfg = load_config(path)
    assert cfg.num_workers == 4
    assert cfg.context_servers.addresses() == [("localhost", 8001), ("localhost", 8002)]
    assert cfg.context_servers.model_extra["cache_transceiver_config"] == {"backend": "UCX"}
    assert cfg.model_extra == {"backend": "pytorch"}
    # TensorRT-LLM copies kv_cache_config.tokens_per_block into the router args
    assert cfg.context_servers.router_args().tokens_per_block == 64
    assert cfg.generation_servers.router_args().use_tokens is True
    assert cfg.schedule_style == "context_first"
    assert cfg.shmdisagg.executors is None


def _error(data: object) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "cfg.yaml")
    msg = str(info.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda d: d["generation_servers"].update(num_instances=3),
            "generation_servers: 1 urls but num_instances is 3",
        ),
        (lambda d: d["context_servers"].update(urls=["nohost"]), "context_servers.urls"),
        (
            lambda d: d["context_servers"].update(urls=["127.0.0.1:0", "127.0.0.1:8001", "nohost"]),
            "context_servers.urls: '127.0.0.1:0': the port must be 1-65535; 'nohost' is not host:port",
        ),
        (lambda d: d["context_servers"].update(urls=["127.0.0.1:\uff18\uff10\uff10\uff11"]), "is not host:port"),
        (
            lambda d: d.update(shmdisagg={"health_check_interval_s": float("inf")}),
            "shmdisagg.health_check_interval_s: Input should be a finite number",
        ),
        (
            lambda d: d["context_servers"]["router"].update(load_cap=float("inf")),
            "context_servers.router.load_cap: Input should be a finite number",
        ),
        (
            lambda d: d.update(shmdisagg={"index": {"routed_ttl_s": float("nan")}}),
            "shmdisagg.index.routed_ttl_s: Input should be a finite number",
        ),
        (
            lambda d: d.update(shmdisagg={"executors": {"sim": {"speedup": float("inf")}}}),
            "shmdisagg.executors.sim.speedup: Input should be a finite number",
        ),
        (
            lambda d: d["generation_servers"].update(urls=["https://gen0:8002"]),
            "generation_servers.urls: 'https://gen0:8002': https executors are not supported (plain HTTP on this host)",
        ),
        (lambda d: d["generation_servers"]["router"].update(type="fastest"), "generation_servers.router.type"),
        (
            lambda d: [d.pop("context_servers"), d.pop("generation_servers")],
            "context_servers, generation_servers: both missing; a deployment needs at least one executor of each "
            "role: list them under context_servers.urls and generation_servers.urls as host:port",
        ),
        (
            lambda d: d.pop("generation_servers"),
            "generation_servers: missing; a deployment needs at least one generation executor",
        ),
        (
            lambda d: d["context_servers"].update(kv_cache_config={"free_gpu_memory_fraction": float("nan")}),
            "context_servers.kv_cache_config.free_gpu_memory_fraction: nan is no value TensorRT-LLM can use",
        ),
        (
            lambda d: d["generation_servers"].update(max_attention_window=[1024, float("inf")]),
            "generation_servers.max_attention_window.1: inf is no value TensorRT-LLM can use",
        ),
        (
            lambda d: d.update(context_servers=None),
            "context_servers: must be a mapping of keys, not null (an empty value)",
        ),
        (
            lambda d: d["generation_servers"].update(router=5),
            "generation_servers.router: must be a mapping of keys, not 5",
        ),
        (
            lambda d: d.update(context_server=d.pop("context_servers")),
            "context_servers: missing (is 'context_server' a misspelling of it?)",
        ),
        (
            lambda d: d.update(conditional_disagg_config={"max_local_prefill_length": 64}),
            "conditional_disagg_config: needs a kv_cache_aware generation router (generation_servers.router.type "
            "is load_balancing)",
        ),
        (lambda d: d["generation_servers"]["router"].update(use_tokenz=True), "generation_servers.router.use_tokenz"),
        (lambda d: d.update(port=70000), "port:"),
        (lambda d: d.update(num_workers=0), "num_workers:"),
        (lambda d: d.update(schedule_style="whenever"), "schedule_style:"),
        (lambda d: d.update(allow_request_chat_template="yes"), "allow_request_chat_template: must be true or false"),
        (lambda d: d.update(shmdisagg={"executors": {"backend": "vllm"}}), "shmdisagg.executors.backend"),
        (lambda d: d.update(shmdisagg={"shm": {"prefix": "has/slash"}}), "shmdisagg.shm.prefix"),
        (
            lambda d: d.update(shmdisagg={"timeout_graceful_shutdown_s": -1}),
            "shmdisagg.timeout_graceful_shutdown_s: Input should be greater than or equal to 0",
        ),
        (
            lambda d: d.update(shmdisagg={"timeout_graceful_shutdown_s": True}),
            "shmdisagg.timeout_graceful_shutdown_s: must be a number, got true",
        ),
    ],
)
def test_bad_config_names_the_key(mutate, expected: str) -> None:
    data = yaml.safe_load(TRTLLM_EXAMPLE)
    mutate(data)
    assert expected in _error(data)


@pytest.mark.parametrize("grace", [None, 0, 30.5])
def test_each_stop_timeout_leaves_room_for_the_one_inside_it(grace: float | None) -> None:
    """A worker's grace period, then uvicorn's own cut-off, then the supervisor's SIGKILL, then
    the launcher's SIGKILL of the coordinator: each outer wait outlasts the inner one."""
    from shmdisagg.coordinator.supervisor import STOP_MARGIN_S
    from shmdisagg.fleet.worker import END_MARGIN_S
    from shmdisagg.launch import STOP_TIMEOUT_S, coordinator_stop_timeout

    data = yaml.safe_load(TRTLLM_EXAMPLE)
    if grace is not None:
        data["shmdisagg"] = {"timeout_graceful_shutdown_s": grace}
    cfg = parse_config(data)
    g = cfg.shmdisagg.timeout_graceful_shutdown_s
    assert g == (5.0 if grace is None else grace)
    assert g + END_MARGIN_S + 1 < g + STOP_MARGIN_S < coordinator_stop_timeout(cfg) - 1
    if grace is None:  # the default keeps the launcher's earlier 15 s bound
        assert coordinator_stop_timeout(cfg) == STOP_TIMEOUT_S


def test_not_a_mapping_and_not_yaml(tmp_path: Path) -> None:
    assert "top level must be a mapping" in _error([1, 2])
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_cli_exits_2_with_one_line_for_a_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("generation_servers:\n  urls: ['localhost:8003']\n  router: {type: fastest}\n")
    for command in ("launch", "check-config", "serve"):
        out = subprocess.run(
            [sys.executable, "-m", "shmdisagg.cli", command, "-c", str(bad)], capture_output=True, text=True
        )
        assert out.returncode == 2, (command, out)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "generation_servers.router.type" in lines[0], out.stderr


def test_near_miss_keys_are_reported_as_probable_typos(tmp_path: Path, hf_tokenizer_dir: str) -> None:
    from shmdisagg.config import config_warnings

    data = yaml.safe_load(TRTLLM_EXAMPLE)
    data["num_workrs"] = 2
    data["generation_servers"]["max_batch_siz"] = 8
    warnings = config_warnings(parse_config(data))
    assert any("num_workrs" in w and "num_workers" in w for w in warnings)
    assert any("generation_servers.max_batch_siz" in w and "max_batch_size" in w for w in warnings)
    # genuine LLM arguments are not flagged
    assert not config_warnings(parse_config(yaml.safe_load(TRTLLM_EXAMPLE)))
    bad = tmp_path / "typo.yaml"
    data["context_servers"]["router"]["tokenizer_dir"] = (
        hf_tokenizer_dir  # kv_cache_aware: check-config loads the executors' tokenizer
    )
    bad.write_text(yaml.safe_dump(data))
    out = subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", "check-config", "-c", str(bad)], capture_output=True, text=True
    )
    assert out.returncode == 0 and "did you mean num_workers" in out.stderr


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        # an executor on the public address: the fleet and the executor cannot both listen there
        (
            lambda d: d["context_servers"].update(urls=["localhost:8001", "localhost:8000"]),
            "context_servers.urls: 'localhost:8000' is the public address (hostname:port localhost:8000) the "
            "fleet listens on",
        ),
        (
            lambda d: d["generation_servers"].update(urls=["http://127.0.0.1:8000"]),
            "generation_servers.urls: 'http://127.0.0.1:8000' is the public address",
        ),
        (
            lambda d: d.update(hostname="0.0.0.0", port=8003),
            "generation_servers.urls: 'localhost:8003' is the public address",
        ),
        # one executor in both roles, or twice in one role, however it is spelt
        (
            lambda d: d["generation_servers"].update(urls=["localhost:8002"]),
            "generation_servers.urls: 'localhost:8002' is also a context_servers url ('localhost:8002'): an "
            "executor serves one role",
        ),
        (
            lambda d: d["generation_servers"].update(urls=["http://127.0.0.1:8001/"]),
            "generation_servers.urls: 'http://127.0.0.1:8001/' is also a context_servers url",
        ),
        (
            lambda d: d["generation_servers"].update(urls=["0.0.0.0:8001"]),
            "generation_servers.urls: '0.0.0.0:8001' is also a context_servers url",
        ),
        # room for the fleet, and socket paths the kernel accepts
        (
            lambda d: d.update(num_workers=2, shmdisagg={"shm": {"max_workers": 1}}),
            "shmdisagg.shm.max_workers: 1 is fewer than num_workers (2)",
        ),
        (
            lambda d: d.update(shmdisagg={"coordinator_socket": "/nonexistent/dir/x.sock"}),
            "shmdisagg.coordinator_socket: directory /nonexistent/dir does not exist",
        ),
        (
            lambda d: d.update(shmdisagg={"coordinator_socket": "/tmp/" + "x" * 120 + ".sock"}),
            "shmdisagg.coordinator_socket: '/tmp/xxx",
        ),
        (
            lambda d: d["context_servers"].update(urls=["localhost:8001", "localhost:8001"]),
            "context_servers.urls: 'localhost:8001' is listed twice",
        ),
        (
            lambda d: d["context_servers"].update(urls=["localhost:8001", "http://127.0.0.1:8001"]),
            "context_servers.urls: 'http://127.0.0.1:8001' is listed twice (as 'localhost:8001')",
        ),
        # the public host must be one a listener can bind
        (lambda d: d.update(hostname="not a host!"), "hostname: 'not a host!' is not a host name or IP address"),
        (lambda d: d.update(hostname=""), "hostname: '' is not a host name or IP address"),
        (lambda d: d.update(hostname="[::1]"), "hostname: '[::1]' is not a host name or IP address"),
        # the native index takes a power of two up to 2**32 slots, capacity <= max_capacity
        (
            lambda d: d.update(shmdisagg={"index": {"capacity": 2**40, "max_capacity": 2**40}}),
            "shmdisagg.index.capacity: Input should be less than or equal to 4294967296",
        ),
        (
            lambda d: d.update(shmdisagg={"index": {"max_capacity": 2**33}}),
            "shmdisagg.index.max_capacity: Input should be less than or equal to 4294967296",
        ),
        (
            lambda d: d.update(shmdisagg={"index": {"capacity": 2**23}}),
            "shmdisagg.index.capacity: 8388608 exceeds max_capacity (4194304)",
        ),
        # a deployment needs an executor of each role
        (
            lambda d: d.pop("context_servers"),
            "cfg.yaml: context_servers: missing; a deployment needs at least one context executor: list it under "
            "context_servers.urls as host:port",
        ),
        (
            lambda d: d["context_servers"].pop("urls") and d["context_servers"].pop("num_instances"),
            "context_servers.urls: none listed; a deployment needs at least one context executor",
        ),
        (
            lambda d: d["generation_servers"].update(num_instances=0, urls=[]),
            "generation_servers.urls: none listed; a deployment needs at least one generation executor",
        ),
    ],
)
def test_executor_addresses_and_public_host_are_checked(mutate, expected: str) -> None:
    data = yaml.safe_load(TRTLLM_EXAMPLE)
    mutate(data)
    assert expected in _error(data)


@pytest.mark.parametrize(
    "hostname", ["localhost", "127.0.0.1", "0.0.0.0", "::", "::1", "node-3.cluster.local", "my_service"]
)
def test_valid_hostnames_and_the_largest_index_load(hostname: str) -> None:
    data = yaml.safe_load(TRTLLM_EXAMPLE)
    data["hostname"] = hostname
    data["shmdisagg"] = {"index": {"capacity": 2**32, "max_capacity": 2**32}}
    assert parse_config(data).hostname == hostname


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda d: d.pop("context_servers"),
            "context_servers: missing; a deployment needs at least one context executor",
        ),
        (lambda d: d.update(hostname="not a host!"), "hostname: 'not a host!' is not a host name or IP address"),
        (
            lambda d: d["shmdisagg"].update(index={"capacity": 2**40, "max_capacity": 2**40}),
            "shmdisagg.index.capacity:",
        ),
        (
            lambda d: d["generation_servers"].update(urls=[f"localhost:{d['port']}"]),
            "generation_servers.urls: 'localhost:",
        ),
        (
            lambda d: d["context_servers"]["kv_cache_config"].update(tokens_per_block="abc"),
            "context_servers.kv_cache_config.tokens_per_block: must be a positive integer, got 'abc'",
        ),
        (
            lambda d: d["context_servers"]["kv_cache_config"].update(tokens_per_block=-5),
            "context_servers.kv_cache_config.tokens_per_block: must be a positive integer, got -5",
        ),
    ],
)
def test_check_config_and_launch_refuse_alike_in_one_line(tmp_path: Path, shm_prefix: str, edit, expected: str) -> None:
    from tests.conftest import free_port

    data = yaml.safe_load(TRTLLM_EXAMPLE)
    data["port"] = free_port()
    data["shmdisagg"] = {
        "executors": {"backend": "sim"},
        "shm": {"prefix": shm_prefix},
        "coordinator_socket": str(tmp_path / "coord.sock"),
    }
    edit(data)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    for command in ("check-config", "launch"):
        out = subprocess.run(
            [sys.executable, "-m", "shmdisagg.cli", command, "-c", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, (command, out)
        lines = out.stderr.strip().splitlines()
        # one line per problem (capacity and max_capacity are two), the expected one first
        assert lines[0].startswith(f"shmdisagg: config error: {path}: {expected}"), (command, out.stderr)
        assert all(line.startswith(f"shmdisagg: config error: {path}: ") for line in lines), out.stderr
        assert "ok" not in out.stdout


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        # what the launcher hands the simulator (--tokens-per-block, --max-batch-size, ...)
        *[
            (
                lambda d, v=v: d["generation_servers"].update(kv_cache_config={"tokens_per_block": v}),
                f"generation_servers.kv_cache_config.tokens_per_block: must be a positive integer, got {v!r}",
            )
            for v in ("abc", -5, 0, True, None, 1.5)
        ],
        (
            lambda d: d["context_servers"].update(max_batch_size=True),
            "context_servers.max_batch_size: must be a number, got true",
        ),
        (
            lambda d: d["context_servers"].update(max_num_tokens=0),
            "context_servers.max_num_tokens: Input should be greater than or equal to 1",
        ),
        (
            lambda d: d.update(shmdisagg={"executors": {"sim": {"tokens_per_block": 0}}}),
            "shmdisagg.executors.sim.tokens_per_block: Input should be greater than or equal to 1",
        ),
        (
            lambda d: d.update(shmdisagg={"executors": {"sim": {"num_blocks": True}}}),
            "shmdisagg.executors.sim.num_blocks: must be a number, got true",
        ),
        (
            lambda d: d.update(shmdisagg={"executors": {"sim": {"speedup": False}}}),
            "shmdisagg.executors.sim.speedup: must be a number, got false",
        ),
    ],
)
def test_executor_options_the_launcher_interprets_are_checked(mutate, expected: str) -> None:
    data = yaml.safe_load(TRTLLM_EXAMPLE)
    mutate(data)
    assert _error(data) == f"cfg.yaml: {expected}"


def test_the_simulator_gets_the_sections_tokens_per_block_else_the_sim_default() -> None:
    from shmdisagg.executors.plan import build_plan

    data = yaml.safe_load(TRTLLM_EXAMPLE)
    data["shmdisagg"] = {"executors": {"backend": "sim", "sim": {"tokens_per_block": 16}}}
    data["context_servers"]["kv_cache_config"]["tokens_per_block"] = 1

    def flag(argv: list[str]) -> str:
        return argv[argv.index("--tokens-per-block") + 1]

    plan = build_plan(parse_config(data))
    assert [flag(i.argv) for i in plan.instances] == ["1", "1", "16"]


def _section(**section: object) -> object:
    base = {
        "hostname": "localhost",
        "port": 8000,
        "context_servers": {"num_instances": 1, "urls": ["localhost:8001"]},
        "generation_servers": {"num_instances": 1, "urls": ["localhost:8002"]},
    }
    base["generation_servers"].update(section)  # type: ignore[attr-defined]
    return parse_config(base, "t.yaml").generation_servers


def test_the_section_s_max_batch_size_and_max_num_tokens_win_over_the_router_s_as_in_extract_router_config():
    # TensorRT-LLM llmapi/disagg_utils.py extract_router_config: args[key] = server_cfg[key]
    both = _section(
        max_batch_size=8,
        max_num_tokens=1024,
        router={"type": "kv_cache_aware", "max_batch_size": 64, "max_num_tokens": 99},
    )
    assert both.router_args({}).max_batch_size == 8 and both.router_args({}).max_num_tokens == 1024
    router_only = _section(router={"type": "kv_cache_aware", "max_batch_size": 16})
    assert router_only.router_args({}).max_batch_size == 16
    assert _section(router={"type": "kv_cache_aware"}).router_args({}).max_batch_size == 64


def test_the_router_s_tokens_per_block_wins_over_kv_cache_config_and_the_environment_over_both():
    env = {"TRTLLM_KVCACHE_AWARE_ROUTER_HASH_TOKENS_PER_BLOCK": "16"}
    kv = _section(kv_cache_config={"tokens_per_block": 64}, router={"type": "kv_cache_aware", "tokens_per_block": 128})
    assert kv.router_args({}).tokens_per_block == 128
    assert (
        _section(kv_cache_config={"tokens_per_block": 64}, router={"type": "kv_cache_aware"})
        .router_args({})
        .tokens_per_block
        == 64
    )
    assert (
        _section(router={"type": "kv_cache_aware"}).router_args({}).tokens_per_block is None
    )  # unset: adopt the executors'
    assert kv.router_args(env).tokens_per_block == 16
    # the conversation router takes it too (both call BlockHashMixin._init_block_hashing); others ignore it
    assert _section(router={"type": "conversation"}).router_args(env).tokens_per_block == 16
    assert _section(router={"type": "round_robin"}).router_args(env).tokens_per_block is None


def _top(**top: object) -> dict[str, object]:
    data: dict[str, object] = {
        "hostname": "localhost",
        "port": 8000,
        "context_servers": {"urls": ["localhost:8001"]},
        "generation_servers": {"urls": ["localhost:8002"]},
    }
    data.update(top)
    return data


def test_top_level_section_keys_reach_both_routers_as_tensorrt_llm_inherits_them():
    # extract_disagg_cfg copies every top-level key it does not name into both sections before
    # extract_router_config reads `router`, `max_batch_size` and kv_cache_config.tokens_per_block
    cfg = parse_config(
        _top(
            router={"type": "kv_cache_aware", "load_weight": 0.5},
            max_batch_size=7,
            max_num_tokens=512,
            kv_cache_config={"tokens_per_block": 64},
        ),
        "t.yaml",
    )
    for section in (cfg.context_servers, cfg.generation_servers):
        args = section.router_args({})
        assert (args.type, args.load_weight, args.max_batch_size, args.max_num_tokens, args.tokens_per_block) == (
            "kv_cache_aware",
            0.5,
            7,
            512,
            64,
        )
    # router is no LLM argument: it leaves the top level, so it is neither warned of nor passed on
    assert "router" not in (cfg.model_extra or {})
    assert cfg.model_extra == {"max_batch_size": 7, "max_num_tokens": 512, "kv_cache_config": {"tokens_per_block": 64}}
    assert config_warnings(cfg) == []


def test_a_section_that_repeats_a_top_level_key_with_the_same_value_is_accepted():
    cfg = parse_config(
        _top(
            kv_cache_config={"tokens_per_block": 64},
            generation_servers={"urls": ["localhost:8002"], "kv_cache_config": {"tokens_per_block": 64}},
        ),
        "t.yaml",
    )
    assert cfg.generation_servers.kv_cache_config == {"tokens_per_block": 64}


@pytest.mark.parametrize(
    ("key", "top", "own"),
    [
        ("kv_cache_config", {"tokens_per_block": 64}, {"tokens_per_block": 32}),
        ("router", {"type": "kv_cache_aware"}, {"type": "round_robin"}),
        ("max_batch_size", 8, 16),
        ("disable_overlap_scheduler", True, False),  # an LLM argument for the executors
    ],
)
def test_a_section_that_sets_a_top_level_key_otherwise_is_refused_naming_it(key: str, top: object, own: object):
    data = _top(**{key: top})
    data["generation_servers"] = {"urls": ["localhost:8002"], key: own}
    with pytest.raises(ConfigError) as info:
        parse_config(data, "t.yaml")
    assert str(info.value).startswith(
        f"t.yaml: generation_servers.{key}: differs from the top-level {key}, which TensorRT-LLM gives both sections"
    )


@pytest.mark.parametrize(
    ("top", "expected"),
    [
        ({"kv_cache_config": "x"}, "t.yaml: kv_cache_config: Input should be a valid dictionary"),
        ({"kv_cache_config": None}, "t.yaml: kv_cache_config: Input should be a valid dictionary"),
        ({"kv_cache_config": {"tokens_per_block": 0}}, "t.yaml: kv_cache_config.tokens_per_block: must be a positive"),
        ({"router": 5}, "t.yaml: router: must be a mapping of keys, not 5"),
    ],
)
def test_a_bad_inherited_value_is_named_once_where_the_file_sets_it(top: dict[str, object], expected: str):
    with pytest.raises(ConfigError) as info:
        parse_config(_top(**top), "t.yaml")
    assert info.value.problems[0].startswith(expected) and len(info.value.problems) == 1


def test_router_types_are_read_in_any_case_and_an_empty_conditional_disagg_config_is_off():
    # create_router looks up router_type.lower(); extract_disagg_cfg: ConditionalDisaggConfig(**c) if c else None
    data = _top(conditional_disagg_config={})
    data["generation_servers"] = {"urls": ["localhost:8002"], "router": {"type": "KV_Cache_Aware"}}
    cfg = parse_config(data, "t.yaml")
    assert cfg.generation_servers.router.type == "kv_cache_aware" and cfg.conditional_disagg_config is None
    assert parse_config(_top(conditional_disagg_config={}), "t.yaml").conditional_disagg_config is None


def test_the_conversation_routers_block_size_is_128_unset_and_32_when_null():
    from shmdisagg.routing.conversation import ConversationPolicy

    def tpb(router: dict[str, object]) -> int:
        args = parse_config(_top(router=router), "t.yaml").context_servers.router_args({})
        return ConversationPolicy(None, 0, 0, args, None).tpb  # type: ignore[arg-type]

    assert tpb({"type": "conversation"}) == 128  # ConversationRouter's default
    assert tpb({"type": "conversation", "tokens_per_block": None}) == 32  # _init_block_hashing(None)
    assert tpb({"type": "conversation", "tokens_per_block": 64}) == 64


@pytest.mark.parametrize(
    ("top", "expected"),
    [
        (
            {"kv_cache_config": {"enable_block_reuse": "maybe"}},
            "kv_cache_config.enable_block_reuse: must be true or false",
        ),
        ({"enable_chunked_prefill": "x"}, "enable_chunked_prefill: must be true or false"),
        (
            {"router": {"type": "kv_cache_aware", "tokenizer_dir": "/x"}},
            "router.tokenizer_dir: the executors are simulators",
        ),
    ],
)
def test_the_launch_plan_names_an_inherited_value_where_the_file_sets_it(top: dict[str, object], expected: str):
    from pathlib import Path

    from shmdisagg.executors.plan import build_plan
    from shmdisagg.tokenizer_source import routing_source

    cfg = parse_config(_top(**top, shmdisagg={"executors": {"backend": "sim", "model": "m"}}), "t.yaml")
    with pytest.raises(ConfigError) as info:
        build_plan(cfg, Path("/run/dir"), {})
        routing_source(cfg)
    assert str(info.value).startswith(expected), info.value
    own = _top(shmdisagg={"executors": {"backend": "sim", "model": "m"}})
    own["generation_servers"] = {"urls": ["localhost:8002"], **top}  # the section's own: named there
    with pytest.raises(ConfigError) as info:
        cfg = parse_config(own, "t.yaml")
        build_plan(cfg, Path("/run/dir"), {})
        routing_source(cfg)
    assert str(info.value).startswith(f"generation_servers.{expected}"), info.value


def test_block_reuse_off_under_a_kv_cache_aware_router_is_warned_of():
    cfg = parse_config(_top(router={"type": "kv_cache_aware"}, kv_cache_config={"enable_block_reuse": False}), "t.yaml")
    assert config_warnings(cfg) == [  # once, though both roles route on it
        "kv_cache_config.enable_block_reuse: false under a kv_cache_aware router: the executors reuse no cached "
        "block, so no prefix the router matches is a hit; it balances load only"
    ]
    assert config_warnings(parse_config(_top(kv_cache_config={"enable_block_reuse": False}), "t.yaml")) == []


def test_a_cluster_config_without_sections_takes_the_top_level_router():
    cfg = parse_config(
        {"hostname": "localhost", "port": 8000, "router": {"type": "kv_cache_aware"},
         "disagg_cluster": {"cluster_uri": "http://localhost:8000"}},
        "t.yaml",
    )  # fmt: skip
    assert cfg.context_servers.router_args({}).type == cfg.generation_servers.router_args({}).type == "kv_cache_aware"


def test_the_simulators_are_started_with_the_inherited_block_size_and_batch_size():
    from shmdisagg.executors.plan import executor_command

    cfg = parse_config(
        _top(kv_cache_config={"tokens_per_block": 64}, max_batch_size=7, shmdisagg={"executors": {"backend": "sim"}}),
        "t.yaml",
    )
    argv, _ = executor_command(cfg.shmdisagg.executors, "generation", cfg.generation_servers, "localhost", 8002)
    assert argv[argv.index("--tokens-per-block") + 1] == "64" and argv[argv.index("--max-batch-size") + 1] == "7"


@pytest.mark.parametrize("value", ["", "abc", "0", "-32", "1.5"])
def test_a_bad_tokens_per_block_environment_override_is_refused_by_name(value: str) -> None:
    with pytest.raises(
        ConfigError, match=r"^TRTLLM_KVCACHE_AWARE_ROUTER_HASH_TOKENS_PER_BLOCK: .* is not a positive integer"
    ):
        _section(router={"type": "kv_cache_aware"}).router_args(
            {"TRTLLM_KVCACHE_AWARE_ROUTER_HASH_TOKENS_PER_BLOCK": value}
        )


def test_check_config_exits_2_naming_a_bad_tokens_per_block_override(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "hostname": "127.0.0.1",
                "port": 8000,
                "context_servers": {
                    "num_instances": 1,
                    "urls": ["127.0.0.1:8001"],
                    "router": {"type": "kv_cache_aware"},
                },
                "generation_servers": {"num_instances": 1, "urls": ["127.0.0.1:8002"]},
            }
        )
    )
    env = {**os.environ, "TRTLLM_KVCACHE_AWARE_ROUTER_HASH_TOKENS_PER_BLOCK": "lots"}
    r = subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", "check-config", "-c", str(cfg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2
    assert "TRTLLM_KVCACHE_AWARE_ROUTER_HASH_TOKENS_PER_BLOCK: 'lots' is not a positive integer" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("text", ["a: &a [*a]\n", "context_servers:\n  foo: &x [*x]\n"])
def test_a_yaml_value_that_contains_itself_is_one_line(tmp_path: Path, text: str) -> None:
    """An alias inside its own anchor: safe_load builds a cycle, and validating it recursed to a traceback."""
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"a value contains itself \(a YAML alias inside its own anchor\)$"):
        load_config(path)
