"""mlmlab's Python API: the few names a user's own code needs, as ``mlmlab/__init__.py`` hands them out.

Each one lives where the layer map puts it (docs/architecture.md); this module, at the top floor beside the
command line, only gathers them, and adds the two calls that join floors: ``pretrain`` (training with its held-out
evaluation, as ``mlmlab pretrain``) and ``run_study`` (as ``mlmlab study``). docs/api.md shows each one at work.
Each name ``mlmlab.__all__`` lists is bound here (``import x as x``: handed on); what only ``pretrain`` and
``run_study`` need is imported when they are called, so that a collator does not wait for the study runner.
"""

from collections.abc import Sequence

from mlmlab.config import Config, load_config
from mlmlab.config import MaskingConfig as MaskingConfig
from mlmlab.errors import UserError
from mlmlab.evaluate.held_out import evaluate_masked_lm as evaluate_masked_lm
from mlmlab.masking.collator import MaskingCallback as MaskingCallback
from mlmlab.masking.collator import MaskingCollator as MaskingCollator


def pretrain(
    config: Config | str | None = None,
    overrides: Sequence[str] = (),
    *,
    resume: str | None = None,
    show_progress: bool = True,
) -> dict:
    """Pretrain as ``mlmlab pretrain`` does: mlmlab's own loop (every masking strategy, ADM included), held-out
    evaluation under the fixed masks, checkpoints, a model folder in the run's ``model/``.

    ``config``: a Config (``load_config``'s), a preset name or YAML file, or None for the defaults; ``overrides``:
    ``"section.key=value"`` strings on top of it. ``resume``: a checkpoint folder to resume from (the run folder's
    newest is taken anyway when the same config runs again). Returns the run's summary (what ``mlmlab pretrain
    --json`` writes: steps, tokens, time, the final held-out evaluation under "eval").
    """
    if not isinstance(config, Config):
        config = load_config(config, list(overrides))
    elif overrides:
        raise UserError(
            "pretrain() takes overrides with a preset name or YAML file, not with a Config: "
            "pretrain('tiny', ['train.max_steps=100']), or load_config('tiny', [...]) for the Config"
        )
    from mlmlab.evaluate.perplexity import evaluate_mlm
    from mlmlab.train.loop import Trainer

    return Trainer(config, evaluator=evaluate_mlm, resume=resume, show_progress=show_progress).train()


def run_study(study: str, *, out_dir: str | None = None, show_progress: bool = True) -> list[dict]:
    """Run a study as ``mlmlab study`` does: every arm on every seed not yet in its results.jsonl, each run trained,
    evaluated and written as one row. ``study``: a study YAML file or a bundled study's name; ``out_dir``: its
    folder (default: the study file's out_dir, else studies/<name>). Returns the rows this call wrote; ``mlmlab
    report`` turns the folder's results.jsonl into report.md."""
    from mlmlab.experiments.running import runner
    from mlmlab.experiments.study import load_study

    return runner.run_study(load_study(study, out_dir=out_dir), show_progress=show_progress)
