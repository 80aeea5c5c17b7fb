"""Regenerate `shmdisagg/trtllm_llm_args.py`: the names of every LLM argument TensorRT-LLM knows.

    python scripts/gen_trtllm_llm_args.py TRTLLM_CHECKOUT [COMMIT] > shmdisagg/trtllm_llm_args.py

TRTLLM_CHECKOUT is a TensorRT-LLM source tree (`git clone https://github.com/NVIDIA/TensorRT-LLM`);
COMMIT is what the header cites (default: `git -C TRTLLM_CHECKOUT rev-parse HEAD`). The names are
read with `ast`, nothing is imported (TensorRT-LLM needs CUDA to import):

- from `tensorrt_llm/llmapi/llm_args.py`: every public annotated field of the classes whose name
  ends in `LlmArgs` (`BaseLlmArgs`, `TorchLlmArgs`, and `TrtLlmArgs` where it still exists), the
  keys of `_TORCH_LLMARGS_REMOVED_ARG_CHECKS` (removed arguments still accepted on input), and the
  legacy spellings `update_llm_args_with_extra_dict` tests for (`'hf_revision' in llm_args_dict`);
- from `tensorrt_llm/commands/serve.py`: the parameters of `get_llm_args`, which the disaggregated
  MPI launcher calls with a section's keys (`get_llm_args(**server_cfg.other_args)`), so keys such
  as `free_gpu_memory_fraction` are accepted there although they are no `LlmArgs` field.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py"
SERVE = "tensorrt_llm/commands/serve.py"


def llm_args_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name.endswith("LlmArgs"):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    name = item.target.id
                    if not name.startswith("_") and name != "model_config":
                        names.add(name)
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "_TORCH_LLMARGS_REMOVED_ARG_CHECKS"
        ):
            if isinstance(node.value, ast.Dict):
                names.update(
                    k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
                )
        elif isinstance(node, ast.FunctionDef) and node.name == "update_llm_args_with_extra_dict":
            for cmp in ast.walk(node):
                if (
                    isinstance(cmp, ast.Compare)
                    and isinstance(cmp.left, ast.Constant)
                    and isinstance(cmp.left.value, str)
                    and isinstance(cmp.ops[0], ast.In)
                    and isinstance(cmp.comparators[0], ast.Name)
                    and cmp.comparators[0].id == "llm_args_dict"
                ):
                    names.add(cmp.left.value)
    return names


def get_llm_args_params(tree: ast.Module) -> set[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_llm_args":
            args = node.args
            return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    return set()


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    commit = (
        argv[1]
        if len(argv) == 2
        else subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    names = llm_args_names(ast.parse((root / LLM_ARGS).read_text()))
    serve = root / SERVE
    if serve.exists():
        names |= get_llm_args_params(ast.parse(serve.read_text()))
    body = "\n".join(f"    {name!r}," for name in sorted(names))
    print(f'''"""Names of the LLM arguments TensorRT-LLM knows (generated; do not edit by hand).

Source: NVIDIA/TensorRT-LLM `{LLM_ARGS}` and `{SERVE}` (`get_llm_args`) at commit {commit}.
Regenerate: `python scripts/gen_trtllm_llm_args.py TRTLLM_CHECKOUT > shmdisagg/trtllm_llm_args.py`.
A disaggregated config's unknown top-level and section keys are LLM arguments for the executors
(TensorRT-LLM inherits top-level ones into both sections); `config_warnings` names any key that
is none of these.
"""

LLM_ARG_NAMES = frozenset({{
{body}
}})''')
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
