"""Which tokenizer a deployment routes with, and loading it: the executors' own.

A role tokenizes for routing when its router is `kv_cache_aware`, or `conversation` with
`use_token_ids`. For such a role:

- **Simulator executors** (`shmdisagg.executors.backend: sim`, the default of a
  `shmdisagg.executors` section: `launch` starts simulators, and `serve` is told its executors
  are simulators) tokenize with the simulator's built-in tokenizer; `tokenizer_dir` and
  `model_path` are refused there (the simulator would not tokenize with them).
- **Any other executors** (`backend: trtllm`, or no `shmdisagg.executors` section: executors
  started elsewhere, as for `trtllm-serve disaggregated`) need their Hugging Face tokenizer, from
  the first of the router's `tokenizer_dir`, the router's `model_path`, the section's `model`,
  `shmdisagg.executors.model` (backend trtllm, when set) and the top-level `model`: a local
  directory, or a hub id already in the local Hugging Face cache (nothing is downloaded). Without
  one, start-up is refused naming `router.tokenizer_dir`: ids from any other tokenizer would be
  ids the model does not understand.

Loading follows TensorRT-LLM's router (`serve/router_utils.py` `BlockHashMixin._get_tokenizer`
@00d403d7): `TransformersTokenizer.from_pretrained(tokenizer_dir or model, trust_remote_code=
tokenizer_dir is not None)`, i.e. `AutoTokenizer.from_pretrained` with those two arguments, plus
`local_files_only=True`. (Upstream takes the model from each request's `model` and uses
`model_path` only for the model type; here both come from the config, where the operator names
them.) Refused by name, with the reason:
- `custom_tokenizer`: upstream's `load_custom_tokenizer` loads TensorRT-LLM's own tokenizer
  classes (`tensorrt_llm/tokenizer/`), which this router does not carry;
- `use_harmony: true`, or a checkpoint whose `config.json` model type is `gpt_oss` with
  `use_harmony` unset (upstream's `uses_harmony_tokenization`; `DISABLE_HARMONY_ADAPTER=1` turns
  it off): upstream renders those with the `openai-harmony` encoding through its
  `harmony_adapter`, which is not re-implemented here. `use_harmony: false` routes on the chat
  template's ids, as upstream does, which are then estimates and never written back.
`check_routing_tokenizer` loads the tokenizer once, so `check-config`, `launch`, `serve` and
`bench --launch` refuse a tokenizer that would not load before anything starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from shmdisagg.config import ConfigError, DisaggConfig, RouterConfig
from shmdisagg.orchestrator.tokenization import HFTokenizer, RoutingTokenizer, SimTokenizer

ROLE_KEYS = ("context_servers", "generation_servers")


def tokenizes(args: RouterConfig) -> bool:
    """Whether a role's router needs the prompt's token ids (its policy's `needs_tokens`)."""
    return args.type == "kv_cache_aware" or (args.type == "conversation" and args.use_token_ids)


def executors_are_simulators(config: DisaggConfig) -> bool:
    spec = config.shmdisagg.executors
    return spec is not None and spec.backend == "sim"


@dataclass(frozen=True)
class Source:
    """Where a role's routing tokenizer comes from: `path` (a directory or a hub id), named by
    `key` (the dotted config key) in every message about it."""

    role: str  # "context_servers" | "generation_servers"
    key: str
    path: str
    trust_remote_code: bool
    model_type_path: str  # where config.json (the model type) is looked for


def _role_source(config: DisaggConfig, role: str, args: RouterConfig) -> Source | None:
    router = config.key_of(role, "router")
    if args.custom_tokenizer:
        raise ConfigError(
            f"{router}.custom_tokenizer: TensorRT-LLM's custom tokenizers "
            "(tensorrt_llm.tokenizer.load_custom_tokenizer) "
            "are TensorRT-LLM code this router does not carry; remove it, or use a router that does not tokenize "
            "(load_balancing, round_robin, conversation without use_token_ids)"
        )
    if args.use_harmony:
        raise _harmony(router, "use_harmony: true")
    if executors_are_simulators(config):
        for name in ("tokenizer_dir", "model_path"):
            if getattr(args, name):
                raise ConfigError(
                    f"{router}.{name}: the executors are simulators (shmdisagg.executors.backend: sim), which "
                    "tokenize with their built-in tokenizer, and so does the router; remove it"
                )
        return None
    section = getattr(config, role)
    spec = config.shmdisagg.executors
    candidates = (
        (f"{router}.tokenizer_dir", args.tokenizer_dir),
        (f"{router}.model_path", args.model_path),
        (f"{role}.model", (section.model_extra or {}).get("model")),
        ("shmdisagg.executors.model", spec.model if spec is not None and "model" in spec.model_fields_set else None),
        ("model", (config.model_extra or {}).get("model")),
    )
    for key, value in candidates:
        if isinstance(value, str) and value.strip():
            trust = key == f"{router}.tokenizer_dir"  # only an operator-configured directory runs remote code
            return Source(role, key, value, trust, args.model_path or args.tokenizer_dir or value)
    raise ConfigError(
        f"{router}.tokenizer_dir: the {args.type} router tokenizes prompts and the executors are not simulators; "
        "set it (or router.model_path, or the top-level model) to the executors' Hugging Face tokenizer: a local "
        "directory, or a hub id in the local Hugging Face cache (executors started as `shmdisagg sim`: say so "
        "with shmdisagg.executors.backend: sim, and the simulator's tokenizer is used)"
    )


def _harmony(router: str, why: str) -> ConfigError:
    return ConfigError(
        f"{router}.use_harmony: {why}: TensorRT-LLM renders such chats with the openai-harmony encoding "
        "(its harmony_adapter), which this router does not re-implement; set use_harmony: false to route on "
        "the chat template's ids (estimates, never written back), or use a router that does not tokenize"
    )


def routing_source(config: DisaggConfig) -> Source | None:
    """The tokenizer every tokenizing role routes with; None when no role tokenizes or the
    executors are simulators. Raises `ConfigError` naming the key (module docstring); the two
    roles must agree (one deployment serves one model)."""
    chosen: Source | None = None
    for role in ROLE_KEYS:
        args = getattr(config, role).router_args()
        if not tokenizes(args):
            continue
        source = _role_source(config, role, args)
        if source is None:
            continue
        if chosen is None:
            chosen = source
        elif source.path != chosen.path:
            raise ConfigError(
                f"{source.key}: {source.path!r} differs from {chosen.key} ({chosen.path!r}); both roles' "
                "executors serve one model: route both on one tokenizer"
            )
        elif source.trust_remote_code and not chosen.trust_remote_code:
            chosen = source  # the same files, named by a tokenizer_dir: trusted as upstream trusts it
    return chosen


def load_routing_tokenizer(config: DisaggConfig) -> RoutingTokenizer | None:
    """The deployment's routing tokenizer (None when no role tokenizes). Raises `ConfigError`
    naming the key, in one line."""
    if not any(tokenizes(getattr(config, role).router_args()) for role in ROLE_KEYS):
        return None
    source = routing_source(config)
    if source is None:
        return SimTokenizer()
    tokenizer = _load_hf(source)
    model_type = _model_type(source.model_type_path)
    if model_type == "gpt_oss" and _harmony_on(config):
        raise _harmony(f"{source.role}.router", f"the model type of {source.model_type_path} is gpt_oss")
    return HFTokenizer(tokenizer, model_type)


def check_routing_tokenizer(config: DisaggConfig) -> None:
    """Load the routing tokenizer once, as a fleet worker will. Raises `ConfigError`."""
    load_routing_tokenizer(config)


def _harmony_on(config: DisaggConfig) -> bool:
    """Upstream's `uses_harmony_tokenization` for a gpt_oss checkpoint: on unless a tokenizing
    router sets `use_harmony: false` or `DISABLE_HARMONY_ADAPTER=1`."""
    if os.environ.get("DISABLE_HARMONY_ADAPTER", "0") == "1":
        return False
    for role in ROLE_KEYS:
        args = getattr(config, role).router_args()
        if tokenizes(args) and "use_harmony" not in args.model_fields_set:
            return True
    return False


def _transformers() -> Any:
    # transformers announces at import that it has no PyTorch (a tokenizer needs none): keep
    # check-config's output to its one line unless the user asked for more.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers

    return transformers


def _load_hf(source: Source) -> Any:
    try:
        transformers = _transformers()
    except ImportError:
        raise ConfigError(
            f"{source.key}: routing on token ids needs the 'hf' extra: pip install 'shmdisagg[hf]'"
        ) from None
    try:
        return transformers.AutoTokenizer.from_pretrained(
            source.path, trust_remote_code=source.trust_remote_code, local_files_only=True
        )
    except Exception as err:  # OSError, ValueError, ImportError (a missing tokenizer library), ...
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(
            f"{source.key}: cannot load a Hugging Face tokenizer from {source.path!r} (a local directory, or a hub id "
            f"in the local Hugging Face cache; nothing is downloaded): {reason}"
        ) from None


def _model_type(path: str) -> str | None:
    """The checkpoint's `config.json` model type (upstream's `resolve_model_type_from_config`), or
    None when there is none."""
    try:
        config, _ = _transformers().PretrainedConfig.get_config_dict(path, local_files_only=True)
    except Exception:  # no config.json: a tokenizer-only directory
        return None
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) else None
