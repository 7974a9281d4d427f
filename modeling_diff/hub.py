"""Share a DiffLlama on the Hugging Face Hub as a self-contained *remote-code* repository.

`save_for_hub(model, folder)` writes what `model.save_pretrained` writes (config.json, safetensors weights,
generation config) plus:
- the model's source code as FLAT files (`modeling_diff_llama.py`, `diff_attention.py`,
  `configuration_diff_llama.py`, ...) whose package-relative imports are rewritten to `from .x import y`;
- `auto_map` in config.json naming those files, for every Auto class the package registers (the models through
  `remote_code.py`, which also makes the registration with Liger that `import modeling_diff` makes);
- a model card (README.md).
The folder then loads with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` in a Python
that does not have `modeling_diff` installed. `push_to_hub(model, repo_id)` uploads that folder.

Why flat files: transformers' remote-code loader copies the module named in `auto_map` into one flat package
together with the files named by its `from .x import y` lines (recursively), and nothing else. The package
itself is nested (`modeling_diff.configuration` is another folder), so its code is carried by following the
import graph from the modules of the exported classes: every internal import, also lazy ones inside functions
or try blocks (optional kernels), is resolved to the module that *defines* the imported name, and that module
is carried under its own name; a package `__init__` that does more than re-export (e.g. registers an attention
implementation) is carried itself, under the package's name.
"""

import ast
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers.models.auto import modeling_auto

from .atomic import atomic_directory, save_tokenizer, writes_on_this_rank

# ---------------------------------------------------------------------------------------------------------------------
# Flattening the import graph


def _spec(module_name: str):
    try:
        return importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # a parent that is not a package, or a name that is not a module
        return None


def _is_package(module_name: str) -> bool:
    spec = _spec(module_name)
    return spec is not None and spec.submodule_search_locations is not None


def _source(module_name: str) -> str:
    spec = _spec(module_name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ValueError(f"module {module_name!r} has no Python source file to export")
    return Path(spec.origin).read_text(encoding="utf-8")


def _flat_name(module_name: str) -> str:
    """`a.b.c` is carried as `c.py` (a package's `__init__` as the package's last name)."""
    return module_name.rpartition(".")[2]


class _ImportFlattener:
    """Collects the internal modules reachable from `roots` and their sources with flat relative imports.

    Internal = inside the top-level package of the roots (e.g. `modeling_diff`, which includes
    `modeling_diff.configuration`). An internal `from <module> import name` becomes
    `from .<flat module defining name> import name`; an import of an internal *module* object becomes two lines,
    one that names the file for transformers' loader (which only follows `from .x import`) and one that binds it.
    """

    def __init__(self, roots: list[str]):
        self.package = roots[0].partition(".")[0]
        if any(root.partition(".")[0] != self.package for root in roots):
            raise ValueError(f"roots must lie in one top-level package, got {roots}")
        self.sources: dict[str, str] = {}  # flat name -> rewritten source
        self.modules: dict[str, str] = {}  # flat name -> module name, to detect two modules with one flat name
        self.pending = list(roots)

    def run(self) -> dict[str, str]:
        while self.pending:
            self._visit(self.pending.pop())
        return self.sources

    def _claim(self, module_name: str) -> str:
        flat = _flat_name(module_name)
        other = self.modules.setdefault(flat, module_name)
        if other != module_name:
            raise ValueError(f"modules {other!r} and {module_name!r} would both be exported as {flat}.py; rename one")
        return flat

    def _visit(self, module_name: str) -> None:
        flat = self._claim(module_name)
        if flat in self.sources:
            return
        source = _source(module_name)
        package = module_name if _is_package(module_name) else module_name.rpartition(".")[0]
        lines = source.splitlines(keepends=True)
        # Rewrite bottom-up so that earlier line numbers stay valid.
        for node in sorted(self._internal_imports(ast.parse(source), module_name), key=lambda n: -n.lineno):
            indent = lines[node.lineno - 1][: node.col_offset]
            comment = lines[node.end_lineno - 1][node.end_col_offset :].rstrip("\r\n")
            if indent.strip() or not (comment.strip() == "" or comment.strip().startswith("#")):
                raise ValueError(
                    f"{module_name} line {node.lineno}: an internal import must stand on its own line(s) to be "
                    "rewritten for export"
                )
            new_lines = self._rewrite(node, package, module_name)
            new_lines[-1] += comment
            lines[node.lineno - 1 : node.end_lineno] = ["".join(indent + line + "\n" for line in new_lines)]
        self.sources[flat] = "".join(lines)

    def _internal_imports(self, tree: ast.AST, module_name: str) -> list[ast.ImportFrom]:
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.partition(".")[0] == self.package for a in node.names):
                raise ValueError(
                    f"{module_name} line {node.lineno}: `import {self.package}...` cannot be exported as flat "
                    f"remote code; write `from .module import name`"
                )
            if isinstance(node, ast.ImportFrom) and (
                node.level > 0 or (node.module or "").partition(".")[0] == self.package
            ):
                found.append(node)
        return found

    def _rewrite(self, node: ast.ImportFrom, package: str, module_name: str) -> list[str]:
        base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
        out, names = [], {}  # names: flat module -> "name [as local]" imported from it, in order
        for alias in node.names:
            if alias.name == "*":
                raise ValueError(f"{module_name} line {node.lineno}: `import *` cannot be exported; name the imports")
            local = alias.asname or alias.name
            if _spec(f"{base}.{alias.name}") is not None:  # the imported name is a module
                flat = self._carry(f"{base}.{alias.name}")
                out += [
                    f"from .{flat} import __name__ as _{flat}_module  # lets transformers' loader carry {flat}.py",
                    f"from . import {flat}" + (f" as {local}" if local != flat else ""),
                ]
            else:
                defining_module, original = self._definition(base, alias.name, module_name)
                flat = self._carry(defining_module)
                names.setdefault(flat, []).append(original + (f" as {local}" if local != original else ""))
        return out + [f"from .{flat} import {', '.join(imported)}" for flat, imported in names.items()]

    def _carry(self, module_name: str) -> str:
        flat = self._claim(module_name)
        if flat not in self.sources:
            self.pending.append(module_name)
        return flat

    def _definition(self, module_name: str, name: str, importer: str) -> tuple[str, str]:
        """(module, name) where `name`, as seen in `module_name`, is defined: follows a package's re-exports."""
        if _spec(module_name) is None:
            raise ValueError(f"{importer} imports {name!r} from {module_name!r}, which is not a module")
        if not _is_package(module_name) or not _only_reexports(module_name):
            return module_name, name  # an __init__ that does more than re-export (registers something) is carried
        for node in ast.parse(_source(module_name)).body:
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        base = importlib.util.resolve_name("." * node.level + (node.module or ""), module_name)
                        if _spec(f"{base}.{alias.name}") is not None:
                            return module_name, name  # a submodule bound in the package: carry the __init__ itself
                        return self._definition(base, alias.name, importer)
        return module_name, name  # defined in the __init__ itself


def _only_reexports(module_name: str) -> bool:
    """Whether a module's top level holds nothing but imports, a docstring and `__all__`: importing it has no
    effect of its own, so its names can be taken from the modules that define them."""
    for node in ast.parse(_source(module_name)).body:
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        dunder_all = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
        if not (isinstance(node, (ast.Import, ast.ImportFrom)) or docstring or dunder_all):
            return False
    return True


def flatten_modules(roots: list[str]) -> dict[str, str]:
    """Sources of the modules reachable from `roots` (module names) through internal imports, keyed by flat
    file name (without `.py`), every internal import rewritten to `from .<flat> import <name>`."""
    return _ImportFlattener(list(roots)).run()


# ---------------------------------------------------------------------------------------------------------------------
# The exported folder


def registered_classes(config_class) -> dict[str, type]:
    """{"AutoConfig": config_class, "AutoModel...": model class} for every `AutoModel*` class that `config_class`
    is registered with (`import modeling_diff` registers them)."""
    classes = {"AutoConfig": config_class}
    for auto_name in modeling_auto.__all__:
        mapping = getattr(getattr(modeling_auto, auto_name), "_model_mapping", None)
        # _extra_content holds what `register` added; a lookup by key would also match the built-in class of the
        # same name (transformers' own DiffLlamaConfig).
        registered = getattr(mapping, "_extra_content", {})
        if config_class in registered:
            classes[auto_name] = registered[config_class]
    return classes


# The module that auto_map names for the models: their classes, and what the folder's code registers as it loads
REMOTE_CODE = "modeling_diff.remote_code"


def _entry_module(cls: type) -> str:
    """The module auto_map names for `cls`: REMOTE_CODE where it exports the class, else the class's own."""
    return REMOTE_CODE if getattr(importlib.import_module(REMOTE_CODE), cls.__name__, None) is cls else cls.__module__


def auto_map(model) -> dict[str, str]:
    """`auto_map` of config.json: each registered class as `<flat module>.<class name>`."""
    classes = registered_classes(type(model.config))
    return {auto: f"{_flat_name(_entry_module(cls))}.{cls.__name__}" for auto, cls in classes.items()}


def check_repo_id(repo_id, name: str = "repo_id") -> None:
    """A ValueError naming the argument `name` unless `repo_id` is a Hub repository id, as `huggingface_hub`'s
    `validate_repo_id` checks it: the model card pastes it into its title and loading snippet (a quote or a newline
    would break the snippet or inject YAML front matter)."""
    try:
        if not isinstance(repo_id, str):
            raise HFValidationError("not a string")
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(
            f"{name} must be a Hub repository id ('name' or 'namespace/name' of at most 96 ASCII letters, digits, "
            f"'-', '_' and '.', neither starting nor ending with '-' or '.', without '--' or '..', not ending in "
            f"'.git'), got {repo_id!r}"
        ) from error


def model_card(model, repo_id: str | None = None) -> ModelCard:
    if repo_id is not None:
        check_repo_id(repo_id)
    config = model.config
    variant = {
        "v1": "DIFF Transformer V1 (Ye et al., 2024, arXiv 2410.05258)",
        "v2": "DIFF Transformer V2 (microsoft/unilm Diff-Transformer-V2)",
        "dex": "DEX retrofit of a pretrained Llama (Kong, Jang, Kwak, 2025, arXiv 2505.16333)",
    }[config.diff_mode]
    name = repo_id or "path/to/this/folder"
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["differential-attention", "diff-transformer", f"diff-{config.diff_mode}", "custom_code"],
    )
    content = f"""---
{data.to_yaml()}
---

# {repo_id.split("/")[-1] if repo_id else "DiffLlama"}

A Llama-architecture causal language model with differential attention: {variant}.
Exported by `modeling_diff` (distribution `modeling-diff`, not published on PyPI); the model code is included in
this repository, so loading it needs only `transformers` and `trust_remote_code=True`.

| field | value |
|---|---|
| `diff_mode` | `{config.diff_mode}` |
| parameters | {model.num_parameters():,} |
| layers | {config.num_hidden_layers} |
| hidden size | {config.hidden_size} |
| attention heads / key-value heads | {config.num_attention_heads} / {config.num_key_value_heads} |
| head dim | {config.head_dim} |
| vocabulary | {config.vocab_size} |

```python
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)
```

With `modeling_diff` installed from its source tree (`pip install .` in a checkout of the repository),
`import modeling_diff` and load without `trust_remote_code` to use the package's classes instead of the code in
this repository.
"""
    return ModelCard(content)


def own_class(model) -> type:
    """The model's class; under FSDP2's `fully_shard` the class it made the model an instance of, `FSDP<class>`, is a
    subclass of FSDPModule and the model's own class, made on the fly."""
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp_module is not None and isinstance(model, fsdp_module):
        return next(base for base in type(model).__bases__ if base is not fsdp_module)
    return type(model)


def gathers_from_every_rank(model) -> bool:
    """Whether `save_pretrained` of `model` gathers its weights in collectives that every rank must join: a model
    that transformers sharded (`tp_plan`, `DistributedConfig`) or whose parameters are DTensors."""
    if getattr(model.config, "distributed_config", None) is not None:
        return True
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def save_for_hub(model, save_directory: str | os.PathLike, tokenizer=None, repo_id: str | None = None,
                 overwrite: bool | str = False, protect: tuple = (), **save_pretrained_kwargs) -> Path:
    """Write `model` (and `tokenizer`, if given) to `save_directory` as a self-contained remote-code folder,
    through `atomic_directory`: never half-written; an existing non-empty folder is replaced only with
    `overwrite=True` and only if it is an earlier output (holds a config.json), any folder with `overwrite="force"`;
    `save_directory` may not be, contain or lie inside a path of `protect` (the checkpoint it was loaded from), and
    must be valid UTF-8 (`check_destination`). `repo_id`, named in the model card, must be a Hub repository id
    (`check_repo_id`). In a distributed run every rank may call it, as `save_pretrained`: only the main process
    (`is_main_process`, and rank 0 where torch.distributed is initialized) writes; the others take part in what
    `save_pretrained` gathers from every rank (a tensor-parallel model's or transformers' FSDP model's weights)
    and write nothing. A model sharded with FSDP2's `fully_shard` is saved with its full `state_dict=` passed."""
    if save_pretrained_kwargs.get("push_to_hub"):  # save_pretrained would upload its staging folder, code-less
        raise ValueError("push_to_hub=True is no save_for_hub argument: save_pretrained would upload the staging "
                         "folder before the model code, auto_map and model card are in it; upload with "
                         "modeling_diff.hub.push_to_hub(model, repo_id)")
    if save_pretrained_kwargs.get("distributed_checkpoint"):  # every rank writes its shards into the folder
        raise ValueError("distributed_checkpoint=True is no save_for_hub argument: each rank would write its own "
                         "shards into a folder that only the main process stages; save_for_hub gathers a sharded "
                         "model's weights into one plain folder (from_pretrained loads it, sharded again with "
                         "tp_plan or fully_shard)")
    if repo_id is not None:
        check_repo_id(repo_id)
    classes = registered_classes(type(model.config))
    if own_class(model) not in classes.values():
        if type(model).__module__.startswith("transformers_modules."):  # the copy of an exported folder's code
            raise ValueError(f"model is a {type(model).__name__} of remote code ({type(model).__module__}), loaded "
                             f"from an exported folder with trust_remote_code=True: load it with modeling_diff's "
                             f"class (modeling_diff.DiffLlamaForCausalLM.from_pretrained(folder)) to export it again")
        registered = sorted(cls.__name__ for name, cls in classes.items() if name != "AutoConfig")
        raise ValueError(f"model must be of a class registered with an Auto class {registered}, got "
                         f"{type(model).__module__}.{type(model).__name__}")
    sources = flatten_modules(sorted({_entry_module(cls) for cls in classes.values()}))
    if not writes_on_this_rank(save_pretrained_kwargs.get("is_main_process", True)):
        if gathers_from_every_rank(model):  # save_pretrained's collectives; it writes nothing (5.25) or elsewhere
            with tempfile.TemporaryDirectory(prefix="diffllama-rank-") as elsewhere:
                model.save_pretrained(elsewhere, **{**save_pretrained_kwargs, "is_main_process": False})
        return Path(save_directory).resolve()

    with atomic_directory(save_directory, overwrite, protect, name="save_directory",
                          expected=("config.json",)) as staging:
        model.save_pretrained(staging, **save_pretrained_kwargs)
        if tokenizer is not None:
            save_tokenizer(tokenizer, staging)
        clashes = sorted(f"{flat}.py" for flat in sources if (staging / f"{flat}.py").exists())
        if clashes:
            raise ValueError(f"model code files {clashes} would overwrite files written by save_pretrained")
        for flat, source in sources.items():
            (staging / f"{flat}.py").write_text(source, encoding="utf-8")
        config_path = staging / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["auto_map"] = auto_map(model)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        model_card(model, repo_id).save(staging / "README.md")
    return Path(save_directory).resolve()


def push_to_hub(model, repo_id: str, tokenizer=None, *, private: bool | None = None, token: str | None = None,
                revision: str | None = None, commit_message: str = "Upload DiffLlama with remote code",
                create_pr: bool = False, api: HfApi | None = None):
    """Upload `model` (and `tokenizer`) to the Hub repository `repo_id` as a self-contained remote-code repository:
    the folder of `save_for_hub`, uploaded in one commit by `huggingface_hub`'s `upload_folder`.
    Returns the `CommitInfo` of that commit. In a distributed run every rank may call it, as `save_for_hub`: rank 0
    uploads, the others take part in the save's gather and return None (each had uploaded a commit of its own, or,
    writing no folder, failed)."""
    check_repo_id(repo_id)
    api = api if api is not None else HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="diffllama-hub-") as tmp:
        folder = save_for_hub(model, Path(tmp) / "export", tokenizer=tokenizer, repo_id=repo_id)
        if not writes_on_this_rank(True):
            return None
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        return api.upload_folder(
            repo_id=repo_url.repo_id,
            folder_path=folder,
            repo_type="model",
            revision=revision,
            commit_message=commit_message,
            create_pr=create_pr,
        )


__all__ = ["auto_map", "check_repo_id", "flatten_modules", "model_card", "push_to_hub", "registered_classes",
           "save_for_hub"]
