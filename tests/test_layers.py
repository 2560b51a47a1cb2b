"""The package's shape: imports only point down the layers, and each set of choices is named once."""

import ast
from pathlib import Path

import pytest

from mlmlab import choices

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mlmlab"

# Bottom up (DESIGN.md). A module may import from its own layer or below, function-local imports included.
LAYERS = [
    ("mlmlab.errors", "mlmlab.choices", "mlmlab.utils", "mlmlab"),
    ("mlmlab.config", "mlmlab.architectures"),  # config validation asks the architecture's adapter
    ("mlmlab.data",),
    ("mlmlab.model", "mlmlab.model_folder", "mlmlab.flops", "mlmlab.head_loss", "mlmlab.fused_qkv"),
    ("mlmlab.masking",),
    ("mlmlab.train",),
    ("mlmlab.evaluate",),
    ("mlmlab.experiments",),
    ("mlmlab.show", "mlmlab.cli"),
]


def layer_of(module: str) -> int:
    """The layer of a dotted module name: its longest listed prefix decides."""
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


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every mlmlab import anywhere in the file; ``from mlmlab import x`` names mlmlab.x."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("mlmlab")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlmlab"):
            if node.module == "mlmlab":
                found += [(node.lineno, f"mlmlab.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layers(path):
    importer = module_name(path)
    upward = [f"line {line}: {target} (layer {layer_of(target)})" for line, target in imported_modules(ast.parse(path.read_text()))
              if layer_of(target) > layer_of(importer)]
    assert not upward, f"{importer} (layer {layer_of(importer)}) imports upward: {upward}"


def test_the_layer_check_sees_function_local_imports():
    tree = ast.parse("def f():\n    from mlmlab.cli import main\n")
    assert imported_modules(tree) == [(2, "mlmlab.cli")]
    assert layer_of("mlmlab.cli") > layer_of("mlmlab.model.x") > layer_of("mlmlab.config")


CHOICE_NAMES = set(choices.STRATEGIES + choices.SCORERS + choices.ADAPT_SCHEDULES + choices.RATE_SCHEDULES
                   + choices.OBJECTIVES + choices.ARCHITECTURES)
# Strings that equal a choice name but name something else.
NOT_CHOICES = {
    ("mlmlab/masking/scorers.py", "context"): "state-dict prefix of the context loss table (checkpoint format)",
    ("mlmlab/train/loop.py", "grad_norm"): "the gradient-norm metrics key",
}


def string_constants(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, value) of string constants that are not docstrings."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


@pytest.mark.parametrize("path", SOURCES + sorted((ROOT / "benchmarks").glob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_choice_names_are_spelled_only_in_choices(path):
    relative = str(path.relative_to(ROOT))
    if relative == "mlmlab/choices.py":
        return
    spelled = [f"line {line}: {value!r}" for line, value in string_constants(ast.parse(path.read_text()))
               if value in CHOICE_NAMES and (relative, value) not in NOT_CHOICES]
    assert not spelled, f"{relative} spells choice names instead of importing them from mlmlab.choices: {spelled}"
