"""shmdisagg: single-host disaggregated LLM serving with routing state in POSIX shared memory."""

__version__ = "0.1.0"
