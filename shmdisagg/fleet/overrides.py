"""What the coordinator resolved from its command line for every fleet worker.

Passed as environment variables, so a replacement worker and the warm standby get the same:
`SHMDISAGG_PUBLIC_PORT` (the port picked for `port: 0`), `SHMDISAGG_LEG_TIMEOUT_S`
(`trtllm-serve disaggregated -r/--request_timeout`, TensorRT-LLM's timeout of each call to an
executor; 0: none), `SHMDISAGG_LOG_LEVEL` (`-l` or `TLLM_LOG_LEVEL`) and
`SHMDISAGG_METADATA_SERVER` (`-m`: the config lists no urls).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shmdisagg.config import DisaggConfig
from shmdisagg.trtllm_env import LOG_LEVELS

DEFAULT_LEG_TIMEOUT_S = 180.0  # TensorRT-LLM's -r default


@dataclass(frozen=True)
class FleetOverrides:
    """What the coordinator resolved from its command line for every fleet worker (environment
    variables, so a replacement or the warm standby gets the same)."""

    public_port: int | None = None  # SHMDISAGG_PUBLIC_PORT: the port picked for `port: 0`
    leg_timeout_s: float | None = DEFAULT_LEG_TIMEOUT_S  # SHMDISAGG_LEG_TIMEOUT_S: `-r`; 0 in the variable: none
    log_level: str | None = None  # SHMDISAGG_LOG_LEVEL: a trtllm_env.LOG_LEVELS name
    # SHMDISAGG_METADATA_SERVER=1: `-m`: the config lists no urls (config.load_config)
    metadata_server: bool = False

    def to_environ(self) -> dict[str, str]:
        env = {"SHMDISAGG_LEG_TIMEOUT_S": repr(self.leg_timeout_s or 0)}
        if self.metadata_server:
            env["SHMDISAGG_METADATA_SERVER"] = "1"
        if self.public_port is not None:
            env["SHMDISAGG_PUBLIC_PORT"] = str(self.public_port)
        if self.log_level is not None:
            env["SHMDISAGG_LOG_LEVEL"] = self.log_level
        return env

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> FleetOverrides:
        env = os.environ if environ is None else environ
        port = env.get("SHMDISAGG_PUBLIC_PORT")
        timeout = float(env.get("SHMDISAGG_LEG_TIMEOUT_S", repr(DEFAULT_LEG_TIMEOUT_S)))
        level = env.get("SHMDISAGG_LOG_LEVEL")
        return cls(
            int(port) if port else None,
            timeout if timeout > 0 else None,
            level if level in LOG_LEVELS else None,
            env.get("SHMDISAGG_METADATA_SERVER") == "1",
        )

    def apply(self, config: DisaggConfig) -> DisaggConfig:
        """The config with the picked public port (its shared-memory names and socket paths
        follow the port, so they agree with the coordinator's)."""
        return config if self.public_port is None else config.model_copy(update={"port": self.public_port})
