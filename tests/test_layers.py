"""The package's shape: imports only point down the layers, and each set of choices is named once."""

import ast
from pathlib import Path

import pytest

from mlmlab import choices

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mlmlab"

# Bottom up, as docs/architecture.md's layer map draws them. A module may import from its own layer or below,
# function-local imports included.
LAYERS = [
    ("mlmlab.errors", "mlmlab.choices", "mlmlab.utils", "mlmlab"),
    ("mlmlab.config",),
    ("mlmlab.data",),
    ("mlmlab.model",),
    ("mlmlab.masking",),
    ("mlmlab.train",),
    ("mlmlab.evaluate",),
    ("mlmlab.experiments",),  # what running a study and reporting on it share: the study file, its rows, budgets, gates
    ("mlmlab.experiments.running", "mlmlab.experiments.reporting"),  # two rooms: ROOMS keeps them apart
    ("mlmlab.show", "mlmlab.cli", "mlmlab.api"),  # mlmlab.api: the Python API, which the package hands out lazily
]
# Packages of one layer that never import each other: the report reads rows and metrics files, never runs anything.
ROOMS = ("mlmlab.experiments.running", "mlmlab.experiments.reporting")


def public_names() -> set[str]:
    """The package's ``__all__``: the API names ``mlmlab/__init__.py`` hands out from mlmlab.api."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    (names,) = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [ast.unparse(target) for target in node.targets] == ["__all__"]
    ]
    return set(ast.literal_eval(names))


API = "mlmlab.api"


def layer_of(module: str) -> int:
    """The layer of a dotted module name: its longest listed prefix decides. A public name of the package
    (``from mlmlab import MaskingCollator``) is mlmlab.api's, whatever floor imports it."""
    if module.removeprefix("mlmlab.") in public_names() and module.count(".") == 1:
        module = API
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (index, prefix)
    assert best is not None, f"{module} is in no layer; add it to LAYERS"
    return best[0]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(
    tree: ast.AST, annotations_too: bool = False, modules: frozenset[str] = frozenset()
) -> list[tuple[int, str]]:
    """(line, module) of every mlmlab import anywhere in the file; ``from mlmlab import x`` names mlmlab.x, and so
    does ``from mlmlab.p import x`` where ``modules`` holds mlmlab.p.x (a module, not a name the package defines).
    Those under ``if TYPE_CHECKING:`` only with ``annotations_too``."""
    found, type_only = [], set() if annotations_too else type_checking_imports(tree)
    for node in ast.walk(tree):
        if node in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("mlmlab")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlmlab"):
            if node.module == "mlmlab":
                found += [(node.lineno, f"mlmlab.{alias.name}") for alias in node.names]
            else:
                named = [f"{node.module}.{alias.name}" for alias in node.names]
                found += [(node.lineno, name) for name in named if name in modules]
                if not all(name in modules for name in named):  # a name the package itself defines
                    found.append((node.lineno, node.module))
    return found


def type_checking_imports(tree: ast.AST) -> set[ast.AST]:
    """Imports under ``if TYPE_CHECKING:``: they serve annotations only and never run, so they bind no layers."""
    return {
        node
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for statement in block.body
        for node in ast.walk(statement)
    }


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layers(path):
    importer = module_name(path)
    upward = [
        f"line {line}: {target} (layer {layer_of(target)})"
        for line, target in imported_modules(ast.parse(path.read_text()))
        if layer_of(target) > layer_of(importer)
    ]
    assert not upward, f"{importer} (layer {layer_of(importer)}) imports upward: {upward}"


def room_of(module: str) -> str | None:
    return next((room for room in ROOMS if module == room or module.startswith(room + ".")), None)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_rooms_do_not_import_each_other(path):
    importer = room_of(module_name(path))
    crossing = [
        f"line {line}: {target}"
        for line, target in imported_modules(ast.parse(path.read_text()))
        if importer and room_of(target) not in (None, importer)
    ]
    assert not crossing, f"{module_name(path)} ({importer}) imports from another room: {crossing}"


def test_the_package_hands_out_its_api_lazily_from_the_top_floor():
    """mlmlab/__init__.py is the bottom floor (every module imports it first), yet its public names live in mlmlab.api
    at the top: the package imports nothing of its own at import time, and resolves each name from mlmlab.api when
    first used (PEP 562). A lower floor that imports a public name counts as importing mlmlab.api."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not top_level, f"mlmlab/__init__.py imports at import time: {[ast.unparse(n) for n in top_level]}"
    assert f'import_module("{API}")' in (PACKAGE / "__init__.py").read_text()
    api = ast.parse((PACKAGE / "api.py").read_text())
    bound = {
        alias.asname or alias.name for node in ast.walk(api) if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    bound |= {node.name for node in api.body if isinstance(node, ast.FunctionDef)}
    assert public_names() <= bound, f"mlmlab.api lacks {sorted(public_names() - bound)}"
    assert layer_of("mlmlab.MaskingCollator") == layer_of(API) > layer_of("mlmlab.choices") == layer_of("mlmlab")


def test_the_layer_check_sees_function_local_imports():
    tree = ast.parse("def f():\n    from mlmlab.cli import main\n")
    assert imported_modules(tree) == [(2, "mlmlab.cli")]
    assert layer_of("mlmlab.cli") > layer_of("mlmlab.model.x") > layer_of("mlmlab.config")


def modules_in_cycles(imports: dict[str, set[str]]) -> list[str]:
    """The modules that reach themselves again through ``imports`` (module -> the modules it imports)."""

    def reachable(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for target in imports.get(stack.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        return seen

    return sorted(module for module in imports if module in reachable(module))


def test_no_module_imports_itself_back():
    """Within one layer imports may point either way, but never round in a circle (function-local ones and those for
    annotations only included): a cycle means two modules are one concept split in two, or a third module belongs
    above both."""
    names = {module_name(path): path for path in SOURCES}
    imports = {
        name: {
            target
            for _, target in imported_modules(ast.parse(path.read_text()), annotations_too=True, modules=set(names))
            if target in names
        }
        for name, path in names.items()
    }
    assert not modules_in_cycles(imports), f"import cycle through {modules_in_cycles(imports)}"


def test_the_cycle_check_reads_a_module_imported_from_its_package():
    """``from mlmlab.train import run_folder`` imports mlmlab.train.run_folder, not only mlmlab/train/__init__.py."""
    tree = ast.parse("from mlmlab.train import run_folder\nfrom mlmlab.model.pretraining import build_model\n")
    modules = frozenset({"mlmlab.train", "mlmlab.train.run_folder", "mlmlab.model.pretraining"})
    assert imported_modules(tree, modules=modules) == [(1, "mlmlab.train.run_folder"), (2, "mlmlab.model.pretraining")]


def test_the_cycle_check_counts_imports_for_annotations_only():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mlmlab.config import Config\n")
    assert imported_modules(tree) == [] and imported_modules(tree, annotations_too=True) == [(3, "mlmlab.config")]


def test_the_cycle_check_sees_a_cycle_through_a_third_module():
    assert modules_in_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c"]


CHOICE_NAMES = {
    *choices.STRATEGIES,
    *choices.SCORERS,
    *choices.ADAPT_SCHEDULES,
    *choices.RATE_SCHEDULES,
    *choices.OBJECTIVES,
    *choices.ARCHITECTURES,
}
# Strings that equal a choice name but name something else.
NOT_CHOICES = {
    ("mlmlab/masking/scorers.py", "context"): "state-dict prefix of the context loss table (checkpoint format)",
    ("mlmlab/train/loop.py", "grad_norm"): "the gradient-norm metrics key",
}


def string_constants(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, value) of string constants that are not docstrings."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


@pytest.mark.parametrize(
    "path", SOURCES + sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_choice_names_are_spelled_only_in_choices(path):
    relative = str(path.relative_to(ROOT))
    if relative == "mlmlab/choices.py":
        return
    spelled = [
        f"line {line}: {value!r}"
        for line, value in string_constants(ast.parse(path.read_text()))
        if value in CHOICE_NAMES and (relative, value) not in NOT_CHOICES
    ]
    assert not spelled, f"{relative} spells choice names instead of importing them from mlmlab.choices: {spelled}"


def test_imports_for_annotations_only_bind_no_layers():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mlmlab.cli import Thing\n"
        "from mlmlab.config import Config\n"
    )
    assert [module for _, module in imported_modules(tree)] == ["mlmlab.config"]
