"""mlmlab: pretrain BERT-style encoders and compare masking strategies.

The Python API (docs/api.md) is the names in ``__all__``. They live in ``mlmlab.api``, the top floor of the layer
map, and are imported from there when first used: ``import mlmlab`` stays light (the ``mlmlab`` command imports
this package before it knows whether it needs torch), and no floor below imports the API through the package.
"""

__version__ = "0.1.0"

__all__ = [
    "MaskingCallback",
    "MaskingCollator",
    "MaskingConfig",
    "evaluate_masked_lm",
    "load_config",
    "pretrain",
    "run_study",
]


def __getattr__(name: str):
    """A name of ``__all__``, from mlmlab.api on first use (PEP 562); anything else is no attribute."""
    if name not in __all__:
        raise AttributeError(f"module 'mlmlab' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module("mlmlab.api"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
