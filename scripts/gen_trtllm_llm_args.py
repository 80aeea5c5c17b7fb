"""Regenerate `shmdisagg/trtllm_llm_args.py`: the names of every LLM argument TensorRT-LLM knows,
and of the fields of the config classes that LLM arguments such as `kv_cache_config` take.

    python scripts/gen_trtllm_llm_args.py TRTLLM_CHECKOUT [COMMIT] [--serve-commit COMMIT]
        [--note TEXT] > shmdisagg/trtllm_llm_args.py

TRTLLM_CHECKOUT is a TensorRT-LLM source tree (`git clone https://github.com/NVIDIA/TensorRT-LLM`);
COMMIT is what the header cites (default: `git -C TRTLLM_CHECKOUT rev-parse HEAD`), for
`commands/serve.py` too unless `--serve-commit` names another; `--note` adds a paragraph to the
header (how the sources were taken, when not from one checkout). The names are read with `ast`,
nothing is imported (TensorRT-LLM needs CUDA to import):

- `LLM_ARG_NAMES`, from `tensorrt_llm/llmapi/llm_args.py`: every public annotated field of the
  classes whose name ends in `LlmArgs` (`BaseLlmArgs`, `TorchLlmArgs`, and `TrtLlmArgs` where it
  still exists), the keys of `_TORCH_LLMARGS_REMOVED_ARG_CHECKS` (removed arguments still
  accepted on input), and the legacy spellings `update_llm_args_with_extra_dict` tests for
  (`'hf_revision' in llm_args_dict`); from `tensorrt_llm/commands/serve.py`: the parameters of
  `get_llm_args`, which the disaggregated MPI launcher calls with a section's keys
  (`get_llm_args(**server_cfg.other_args)`), so keys such as `free_gpu_memory_fraction` are
  accepted there although they are no `LlmArgs` field;
- `NESTED_CONFIG_NAMES` and `NESTED_CONFIG_CLASSES`, from `tensorrt_llm/llmapi/llm_args.py`: for
  each LLM argument (a field of a `*LlmArgs` class) whose type is one class of that file, or
  `Optional` of one, which is a `StrictBaseModel` (directly or through bases of the file): the
  class's name, and every public annotated field of it and of its bases in the file, with the
  input aliases a field declares (`alias="..."`, `validation_alias="..."` or
  `validation_alias=AliasChoices("...", ...)`). A StrictBaseModel forbids other keys: such a key
  of `kv_cache_config` or `cache_transceiver_config` is refused when the LLM arguments are built.
  `kv_cache_config` (`KvCacheConfig`) must be among them.

A pydantic `ClassVar` annotation and `model_config` are no field, nor is a name starting with `_`.
The output is formatted as `ruff format` writes it.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import textwrap
from pathlib import Path

LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py"
SERVE = "tensorrt_llm/commands/serve.py"
STRICT_BASE = "StrictBaseModel"


def _is_classvar(annotation: ast.expr) -> bool:
    target = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return (isinstance(target, ast.Name) and target.id == "ClassVar") or (
        isinstance(target, ast.Attribute) and target.attr == "ClassVar"
    )


def _fields(cls: ast.ClassDef) -> list[ast.AnnAssign]:
    """The class's own annotated statements that pydantic makes fields."""
    return [
        item
        for item in cls.body
        if isinstance(item, ast.AnnAssign)
        and isinstance(item.target, ast.Name)
        and not item.target.id.startswith("_")
        and item.target.id != "model_config"
        and not _is_classvar(item.annotation)
    ]


def _aliases(value: ast.expr | None) -> set[str]:
    """The input names a `Field(..., alias=..., validation_alias=...)` call declares."""
    out: set[str] = set()
    if not isinstance(value, ast.Call):
        return out
    for kw in value.keywords:
        if kw.arg not in ("alias", "validation_alias"):
            continue
        if isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
            out.add(kw.value.value)
        elif isinstance(kw.value, ast.Call):  # AliasChoices("a", "b", AliasPath("c", 0))
            for arg in kw.value.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    out.add(arg.value)
                elif (
                    isinstance(arg, ast.Call)
                    and arg.args
                    and isinstance(arg.args[0], ast.Constant)
                    and isinstance(arg.args[0].value, str)
                ):
                    out.add(arg.args[0].value)  # AliasPath's first step is the key of the mapping
    return out


def llm_args_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name.endswith("LlmArgs"):
            names.update(item.target.id for item in _fields(node) if isinstance(item.target, ast.Name))
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


def _single_class(annotation: ast.expr) -> str | None:
    """`X`, `Optional[X]` or `X | None` as written: the name X; None for anything else."""
    if isinstance(annotation, ast.Name):
        return annotation.id
    if (
        isinstance(annotation, ast.Subscript)
        and isinstance(annotation.value, ast.Name)
        and annotation.value.id == "Optional"
        and isinstance(annotation.slice, ast.Name)
    ):
        return annotation.slice.id
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        sides = [annotation.left, annotation.right]
        names = [s.id for s in sides if isinstance(s, ast.Name)]
        nones = [s for s in sides if isinstance(s, ast.Constant) and s.value is None]
        if len(names) == 1 and len(nones) == 1:
            return names[0]
    return None


def _bases(cls: ast.ClassDef) -> list[str]:
    return [b.id for b in cls.bases if isinstance(b, ast.Name)]


def nested_config_names(tree: ast.Module) -> dict[str, tuple[str, set[str]]]:
    """{LLM argument: (its StrictBaseModel class, the class's field names and aliases)}."""
    classes = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}

    def lineage(name: str) -> list[ast.ClassDef]:  # the class and its bases defined in the file
        out, todo = [], [name]
        while todo:
            cls = classes.get(todo.pop())
            if cls is not None and cls not in out:
                out.append(cls)
                todo.extend(_bases(cls))
        return out

    def strict(name: str) -> bool:
        return any(STRICT_BASE in _bases(cls) for cls in lineage(name))

    out: dict[str, tuple[str, set[str]]] = {}
    for cls in classes.values():
        if not cls.name.endswith("LlmArgs"):
            continue
        for item in _fields(cls):
            assert isinstance(item.target, ast.Name)
            name = _single_class(item.annotation)
            if name is None or name.endswith("LlmArgs") or not strict(name):
                continue
            fields: set[str] = set()
            for part in lineage(name):
                for field in _fields(part):
                    assert isinstance(field.target, ast.Name)
                    fields.add(field.target.id)
                    fields |= _aliases(field.value)
            out[item.target.id] = (name, fields)
    return out


def get_llm_args_params(tree: ast.Module) -> set[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_llm_args":
            args = node.args
            return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    return set()


def _frozenset(name: str, names: set[str]) -> str:
    body = "".join(f'        "{n}",\n' for n in sorted(names))
    return f"{name} = frozenset(\n    {{\n{body}    }}\n)\n"


def _paragraph(text: str) -> str:
    return textwrap.fill(text, width=99, break_long_words=False, break_on_hyphens=False)


def _nested(nested: dict[str, tuple[str, set[str]]]) -> str:
    classes = "".join(f'    "{arg}": "{nested[arg][0]}",\n' for arg in sorted(nested))
    names = "".join(
        f'    "{arg}": frozenset(\n        {{\n'
        + "".join(f'            "{n}",\n' for n in sorted(nested[arg][1]))
        + "        }\n    ),\n"
        for arg in sorted(nested)
    )
    return f"NESTED_CONFIG_CLASSES = {{\n{classes}}}\n\nNESTED_CONFIG_NAMES = {{\n{names}}}\n"


def render(
    names: set[str], nested: dict[str, tuple[str, set[str]]], commit: str, serve_commit: str | None, note: str | None
) -> str:
    serve = f"`{SERVE}` (`get_llm_args`) at commit {serve_commit}" if serve_commit else f"no `{SERVE}`"
    paragraphs = [
        "Names TensorRT-LLM knows in a disaggregated config (generated; do not edit by hand).",
        _paragraph(
            "`LLM_ARG_NAMES`: the LLM arguments (the public fields of the `*LlmArgs` classes, the "
            "removed-but-accepted arguments of `_TORCH_LLMARGS_REMOVED_ARG_CHECKS`, the legacy spellings "
            "`update_llm_args_with_extra_dict` accepts, the parameters of `get_llm_args`). A disaggregated "
            "config's unknown top-level and section keys are LLM arguments for the executors (TensorRT-LLM "
            "inherits top-level ones into both sections); `config_warnings` names any key that is none of these."
        ),
        _paragraph(
            "`NESTED_CONFIG_NAMES`: for each LLM argument that takes one of TensorRT-LLM's StrictBaseModel "
            "config classes (`NESTED_CONFIG_CLASSES`: `kv_cache_config` is a `KvCacheConfig`), the fields of "
            "that class and their aliases. trtllm-serve refuses any other key of such a mapping at start-up; "
            "`config_warnings` names one, and the simulator refuses it as trtllm-serve does."
        ),
        f"Source: NVIDIA/TensorRT-LLM `{LLM_ARGS}` at commit {commit}\nand {serve}.",
    ]
    if note:
        paragraphs.append(_paragraph(note))
    paragraphs.append(
        "Regenerate: `python scripts/gen_trtllm_llm_args.py TRTLLM_CHECKOUT > shmdisagg/trtllm_llm_args.py`."
    )
    header = '"""' + "\n\n".join(paragraphs) + '\n"""\n'
    return f"{header}\n{_frozenset('LLM_ARG_NAMES', names)}\n{_nested(nested)}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path)
    parser.add_argument("commit", nargs="?")
    parser.add_argument("--serve-commit", help=f"the commit of `{SERVE}`, when another than COMMIT")
    parser.add_argument("--note", help="a paragraph for the header: how the sources were taken")
    args = parser.parse_args(argv)
    root: Path = args.checkout
    commit = (
        args.commit
        or subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    tree = ast.parse((root / LLM_ARGS).read_text())
    names = llm_args_names(tree)
    nested = nested_config_names(tree)
    if not nested.get("kv_cache_config", ("", set()))[1]:
        print(f"{root / LLM_ARGS}: no kv_cache_config argument of a StrictBaseModel class with fields", file=sys.stderr)
        return 1
    serve = root / SERVE
    serve_commit = None
    if serve.exists():
        names |= get_llm_args_params(ast.parse(serve.read_text()))
        serve_commit = args.serve_commit or commit
    sys.stdout.write(render(names, nested, commit, serve_commit, args.note))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
