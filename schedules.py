"""schedules.py: learning-rate schedules of your own, beside megatron-core's (constant, linear, cosine,
inverse-square-root, WSD, which its OptimizerParamScheduler computes).

Names here are this project's own; `--lr-decay-style` and the built-in styles are megatron-core's.

A schedule is one function of where the run is, and one entry in LR_SCHEDULES: its name becomes a choice of
`--lr-decay-style` (config.py reads the names from here) and train.py's scheduler calls the function for it.
megatron-core's scheduler still does everything else: the weight-decay schedule, the per-group learning rates
(`--decoupled-lr`), checkpointing (the style is saved, and a resume checks it). Pure Python: config.py imports
this before torch.

    def my_schedule(step, warmup_steps, decay_steps, max_lr, min_lr, init_lr):
        ...
    LR_SCHEDULES["my-schedule"] = my_schedule          # --lr-decay-style my-schedule

Steps count samples, as megatron-core's scheduler does: `step` is the samples consumed so far, and the lengths
are `--lr-warmup-iters`/`--lr-decay-iters` times the global batch (or the `--*-samples` flags as given).
"""

import math


def step_decay(step: float, warmup_steps: float, decay_steps: float, max_lr: float, min_lr: float,
               init_lr: float) -> float:
    """Linear warmup from init_lr, then max_lr divided by 10 at one third and again at two thirds of the decay,
    never below min_lr (the multi-step schedule of image classification, e.g. He et al. 2016, sec. 3.4): an
    example of a schedule megatron-core does not have; any function of this signature works the same way."""
    if warmup_steps > 0 and step <= warmup_steps:
        return init_lr + (max_lr - init_lr) * step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(decay_steps - warmup_steps, 1))
    return max(min_lr, max_lr * 0.1 ** min(2, math.floor(3 * progress)))


LR_SCHEDULES = {
    "step": step_decay,
}
