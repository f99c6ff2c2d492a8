"""Train Medusa or EAGLE draft heads for a target by self-distillation, on the CPU, within a time budget.

    python -m experiments.train drafter=medusa                        # SmolLM2-135M, 300 s of training
    python -m experiments.train drafter=eagle train.time_budget_s=480 train.install=true
    python -m experiments.train drafter=medusa train.medusa_num_heads=5 drafter.num_speculative_tokens=5
    python -m experiments.train drafter=eagle logger=wandb train.eval=false

1. **Data** (offline, :mod:`.prompts`, :mod:`.data`, :mod:`.generation`, :mod:`.features`). Prompts:
   the built-in standard-library prompts (:func:`experiments.datasets.load_builtin`) and the built-in
   chat prompts (:func:`experiments.datasets.load_chat`), under the target's chat template. A prompt is
   held out for evaluation when a hash of its id falls below ``data.heldout_fraction``
   (:func:`is_heldout`; :func:`load_heldout_prompts` gives them back). The target answers every prompt
   through ``specdec.LLM`` (greedy by default; ``data.temperature`` > 0 with ``data.n`` samples for
   diversity), then our decoder runs over prompt + response with
   :class:`~specdec.attention.dense.DenseAttention` and ``all_hidden=True`` to get the feature ``f_t``
   (final-norm hidden state) of every position. Token ids, response starts and bfloat16 features are
   cached under ``<specdec cache>/train/<fingerprint>/``, keyed by the model, the prompts' token ids, the
   generation settings and the seed, so a second run (the other method, another budget) skips
   generation.
2. **Training** (:mod:`.loop`, :mod:`.trainers`): AdamW on float32 master weights, linear warm-up then
   cosine decay over the budget (``train.time_budget_s`` and/or ``train.epochs``); losses on response
   positions only; the target's embedding and LM head frozen (:mod:`.target`: the LM head's products in
   bfloat16, its softmax in float32).

   - Medusa (:mod:`.objectives.medusa`; Cai et al. 2024, Medusa-1): head k (1-based) on ``f_t``
     predicts ``x_{t+k+1}``; cross-entropy through the LM head, summed over heads.
   - EAGLE (:mod:`.objectives.eagle`; Li et al. 2024, EAGLE-1): whole sequences through
     :class:`~specdec.drafters.heads.EagleHead` with ``DenseAttention``; row t reads ``(embed(x_{t+1}),
     f_t)`` and predicts ``f_{t+1}``; loss ``SmoothL1(f̂, f) + 0.1 · CE(lm_head(f̂), softmax(lm_head(f)))``,
     optional uniform noise on the input features (EAGLE-1's augmentation), and optionally a second,
     unrolled step (``train.eagle_unroll=2``): row t + 1 then reads the head's own ``f̂_{t+1}``, as when
     drafting a chain, attending to the teacher-forced rows before it and to itself.

   Held-out metrics (:mod:`.evaluate`; every ``train.eval_interval_s`` on a subset, at the end on all of
   it): loss; for Medusa, per head, top-1/top-5 accuracy and the accuracy at each rank r < 10 (the
   fraction of positions whose true token is the head's r-th candidate: the input of a static tree); for
   EAGLE, top-1/top-5 of the first step (teacher-forced) and top-1 of the second (reading its own
   prediction). Logged to ``logger`` (wandb: one run per job, offline by default).
3. **Output** (:mod:`.artefacts`): :func:`~specdec.drafters.heads.save_heads` (``config.json`` with the
   provenance in ``training``, ``model.safetensors`` in bfloat16) and ``COMMAND.md`` (the exact command
   line and the figures) into ``train.out_dir``, or ``specdec/heads/<target>-<method>`` with
   ``train.install=true`` (then loadable by name), or ``<run dir>/<target>-<method>``. The run directory
   gets ``config.yaml``, ``run_info.json`` and ``summary.json`` (:mod:`.pipeline`).
4. **Evaluation** (``train.eval=true``, :func:`evaluate_tau`): τ (tokens per verification step) and
   acceptance per position of ``specdec.LLM`` with the new heads on held-out prompts, greedy, batch 1.

The Hydra entry point is :mod:`.main` (run by ``__main__``).
"""

from experiments.train.artefacts import (
    HEADS_DIR,
    command_line,
    default_out_dir,
    init_provenance,
    initialise_from,
    target_name,
    write_command_md,
)
from experiments.train.data import (
    DATA_FORMAT_VERSION,
    DistilData,
    data_fingerprint,
    default_cache_dir,
    load_data,
    model_identity,
    prepare_data,
    save_data,
)
from experiments.train.evaluate import NUM_RANKS, LLMFactory, evaluate_eagle, evaluate_medusa, evaluate_tau
from experiments.train.features import compute_features
from experiments.train.generation import generate_responses
from experiments.train.loop import Schedule, TrainResult
from experiments.train.main import format_summary, main
from experiments.train.objectives.eagle import EagleBatch, eagle_batches, eagle_forward, eagle_losses
from experiments.train.objectives.medusa import (
    MedusaExamples,
    medusa_examples,
    medusa_head_outputs,
    medusa_step,
)
from experiments.train.pipeline import run_training
from experiments.train.prompts import (
    is_heldout,
    load_heldout_prompts,
    prompt_id_of,
    split_heldout,
    training_prompts,
)
from experiments.train.target import FrozenTarget
from experiments.train.trainers import train_eagle, train_medusa

__all__ = [
    "DATA_FORMAT_VERSION",
    "HEADS_DIR",
    "NUM_RANKS",
    "DistilData",
    "EagleBatch",
    "FrozenTarget",
    "LLMFactory",
    "MedusaExamples",
    "Schedule",
    "TrainResult",
    "command_line",
    "compute_features",
    "data_fingerprint",
    "default_cache_dir",
    "default_out_dir",
    "eagle_batches",
    "eagle_forward",
    "eagle_losses",
    "evaluate_eagle",
    "evaluate_medusa",
    "evaluate_tau",
    "format_summary",
    "generate_responses",
    "init_provenance",
    "initialise_from",
    "is_heldout",
    "load_data",
    "load_heldout_prompts",
    "main",
    "medusa_examples",
    "medusa_head_outputs",
    "medusa_step",
    "model_identity",
    "prepare_data",
    "prompt_id_of",
    "run_training",
    "save_data",
    "split_heldout",
    "target_name",
    "train_eagle",
    "train_medusa",
    "training_prompts",
    "write_command_md",
]
