"""The executor simulator: a process that speaks trtllm-serve's HTTP protocol without a GPU.

Start it with `python -m shmdisagg.executors.sim` (see README.md in this folder). Tests import
`output_token` to predict generated tokens and `Tokenizer` to predict prompt ids.
"""

from shmdisagg.executors.sim.cli import main
from shmdisagg.executors.sim.sampler import output_token, output_tokens
from shmdisagg.executors.sim.tokenizer import Tokenizer

__all__ = ["Tokenizer", "main", "output_token", "output_tokens"]
