"""Executors: the processes that run the model. `sim/` is the GPU-free simulator of trtllm-serve;
`plan.py` builds the command line that starts one executor for the launcher."""
