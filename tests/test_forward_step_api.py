"""The forward-step API of Megatron Bridge's train_utils, and the three loss-function return patterns."""

from __future__ import annotations

import functools

import pytest
import torch

import train
from train import GlobalState, maybe_inject_state, needs_global_state_injection, prepare_forward_step_func


# --- detection rules --------------------------------------------------------------------------------------


def annotated(s: GlobalState, data_iterator, model):  # annotation, any name (a string here: postponed annotations)
    return s


def named_state(state, data_iterator, model):
    return state


def named_global_state(global_state, data_iterator, model, return_schedule_plan=False):
    return global_state


def plain(data_iterator, model):
    return None


def plain_with_plan(data_iterator, model, return_schedule_plan=False):
    return None


def state_not_first(data_iterator, state, model):  # a name only counts in first position
    return None


class Functor:
    def __init__(self):
        self.calls = 0

    def __call__(self, state: GlobalState, data_iterator, model):
        self.calls += 1
        return state


class PlainFunctor:
    def __call__(self, data_iterator, model):
        return None


@pytest.mark.parametrize("func, expected", [
    (annotated, True), (named_state, True), (named_global_state, True), (plain, False),
    (plain_with_plan, False), (state_not_first, False), (Functor(), True), (PlainFunctor(), False),
])
def test_needs_global_state_injection(func, expected):
    assert needs_global_state_injection(func) is expected


def test_annotation_with_the_class_object():
    def f(st: train.GlobalState, data_iterator, model):
        return st
    f.__annotations__["st"] = train.GlobalState  # a real class, not a string
    assert needs_global_state_injection(f)


def test_injection_binds_the_live_state():
    state = object.__new__(GlobalState)
    state.train_state = train.TrainState()
    wrapped = maybe_inject_state(named_state, state)
    assert isinstance(wrapped, functools.partial) and wrapped.args == (state,)
    state.train_state.step = 7  # the partial holds a reference: later progress is visible
    assert wrapped("it", "model").train_state.step == 7
    assert maybe_inject_state(plain, state) is plain
    assert maybe_inject_state(named_state, state, needs_injection=False) is named_state


def test_functor_keeps_its_own_state():
    state = object.__new__(GlobalState)
    functor = Functor()
    wrapped = prepare_forward_step_func(functor, state)
    wrapped(None, None)
    wrapped(None, None)
    assert functor.calls == 2 and wrapped(None, None) is state


# --- the loss-function return patterns, through the CPU schedule and the train_step reduction ------------


def _microbatches():
    # Two microbatches with different numbers of counted tokens: 4 and 1.
    x = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, 0.0, 0.0, 0.0])]
    mask = [torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([1.0, 0.0, 0.0, 0.0])]
    return iter(list(zip(x, mask)))


class _Scale(torch.nn.Module):
    """A one-weight model with the `config` megatron-core's schedules read their hooks from."""

    def __init__(self):
        from megatron.core.transformer import TransformerConfig

        super().__init__()
        from megatron.core.enums import ModelType

        self.config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
        self.model_type = ModelType.encoder_or_decoder

        self.weight = torch.nn.Parameter(torch.tensor(1.0))

    def set_input_tensor(self, tensor):  # the schedules hand a pipeline stage its input here; one stage has none
        pass


def _run(loss_func, forward_only=False, collect=False):
    """megatron-core's own no-pipelining schedule, as train_step runs it, over two microbatches."""
    import model as _  # noqa: F401  (installs device.py's shim on a machine without CUDA)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    scale = _Scale()

    def forward_step(data_iterator, model):
        x, mask = next(data_iterator)
        return model.weight * x, functools.partial(loss_func, mask)

    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=_microbatches(), model=[scale],
                                      num_microbatches=2, seq_length=4, micro_batch_size=1, forward_only=forward_only,
                                      collect_non_loss_data=collect)
    return out, scale.weight.grad


def test_token_weighted_pattern(single_rank_groups):
    def loss_func(mask, output):
        total = (output * mask).sum()
        n = mask.sum().to(torch.int)
        return total, n, {"lm loss": torch.stack([total.detach(), n.float()])}

    reports, grad = _run(loss_func)
    reduced = train.reduce_losses(reports)
    # Token-weighted: (1+2+3+4+10) / 5 tokens = 4.0, not the mean of per-microbatch means (2.5+10)/2.
    assert reduced["lm loss"].item() == pytest.approx(4.0)
    # Gradient: each microbatch's loss divided by its tokens, averaged over the 2 microbatches.
    assert grad.item() == pytest.approx((10 / 4 + 10 / 1) / 2)


def test_legacy_scalar_pattern(single_rank_groups):
    def loss_func(mask, output):
        loss = (output * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

    reports, grad = _run(loss_func)
    reduced = train.reduce_losses(reports)
    assert reduced["lm loss"].item() == pytest.approx((2.5 + 10.0) / 2)  # averaged over microbatches
    assert grad.item() == pytest.approx((2.5 + 10.0) / 2)


def test_non_loss_data_pattern(single_rank_groups):
    def loss_func(mask, output, non_loss_data=False):
        assert non_loss_data
        return {"masked": (output * mask).tolist()}

    collected, grad = _run(loss_func, forward_only=True, collect=True)
    assert collected == [{"masked": [1.0, 2.0, 3.0, 4.0]}, {"masked": [10.0, 0.0, 0.0, 0.0]}]
    assert grad is None  # forward only: nothing backpropagated


@pytest.mark.full  # the fast command: the loss patterns in one process
def test_scalar_reports_are_each_ranks_mean_over_its_microbatches(tmp_path):
    """Two data-parallel ranks of two microbatches each, whose loss function reports 10 x rank + the microbatch's
    place: the log line and the validation block (printed by the last rank, rank 1) show rank 1's mean, 10.5, as
    Megatron-LM's train_step and evaluate average a scalar over the microbatches only (training.py's `numel() == 1`
    branches), not over the ranks (5.5)."""
    from conftest import TINY, torchrun

    proc = torchrun([*TINY, "--mock-data", "--num-workers", "0", "--train-iters", "2", "--global-batch-size", "8",
                     "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
                     "--data-cache-path", str(tmp_path / "cache")], script="tests/scripts/scalar_loss_reports.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("| rank report: 1.050000E+01 |") == 2, proc.stdout[-3000:]
    assert "| rank report value: 1.050000E+01 |" in proc.stdout  # the validation block
