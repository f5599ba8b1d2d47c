"""The optimizer: weight decay per parameter group (megatron-core's grouping, overridable), agreeing on a step's
success across model-parallel ranks, the grad norm's sync, deferred config post-init, forward pre-hook rules."""

import dataclasses
import types
import json

import pytest
import torch

import checks
import config
from conftest import TINY, config_error, torchrun


def parse(argv, world_size=1, gpu=False):
    return checks.parse_args(argv, world_size=world_size, gpu=gpu)


def build(cfg):
    """The real GPT, its data-parallel wrapper, optimizer and scheduler, as setup() builds them (after seeding, which
    gives megatron-core's RNG tracker the streams dropout draws from)."""
    import train
    from model import build_model, build_optimizer, set_random_seed, wrap_model

    set_random_seed(cfg.rng.seed)
    model = wrap_model(cfg, build_model(cfg, 256))
    optimizer = build_optimizer(cfg, model)
    return model, optimizer, train.build_scheduler(cfg, optimizer)


CONSTANT_LR = [*TINY, "--weight-decay", "0.1", "--lr-warmup-iters", "0", "--lr-decay-style", "constant"]


def no_decay(name, p):
    return p.ndim == 1 or name.endswith(".bias")


def test_no_weight_decay_on_biases_and_norms_and_a_real_step_decays_only_matrices(single_rank_groups):
    from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides

    from model import megatron_optimizer_config

    cfg = parse(CONSTANT_LR)
    model, optimizer, _ = build(cfg)
    named = list(model[0].named_parameters())
    assert {no_decay(n, p) for n, p in named} == {True, False}  # both kinds are there
    assert any("layernorm" in n for n, p in named) and any(n.endswith(".bias") for n, p in named)
    weight_decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    for name, p in named:
        assert weight_decay[id(p)] == (0.0 if no_decay(name, p) else 0.1), name

    # The default provider groups exactly as megatron-core's own standard overrides (what a GPU run
    # without a provider would get from get_megatron_optimizer, which passes them from megatron-core 0.19 on:
    # optimizer/__init__.py:1031-1032).
    standard = _get_param_groups(model, megatron_optimizer_config(cfg), get_standard_config_overrides(
        megatron_optimizer_config(cfg)))
    assert [sorted(id(p) for p in g["params"]) for g in standard] == \
        [sorted(id(p) for p in g["params"]) for g in optimizer.param_groups]

    # A real AdamW step with zero gradients: only the decoupled weight decay moves anything.
    before = {n: p.detach().clone() for n, p in named}
    model[0].zero_grad_buffer()  # megatron DDP's gradient buffers, which the optimizer reads
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful and grad_norm == 0.0
    lr = cfg.optimizer.lr
    for name, p in named:
        expected = before[name] if no_decay(name, p) else before[name] * (1 - lr * 0.1)
        # One fp32 multiplication each side, by the same factor, of weights below ~0.1 (init std 0.02): each rounds by
        # at most 2^-24 x 0.1 ~ 6e-9, so within 1e-7.
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-7, msg=name)


@dataclasses.dataclass
class EmbeddingOverrides(config.OptimizerConfigOverrideProvider):
    """Twice the learning rate and half the weight decay on the word embeddings; Megatron's defaults elsewhere."""

    def build_config_overrides(self, context):
        from megatron.core.optimizer import ParamGroupOverride, ParamKey

        overrides = super().build_config_overrides(context)
        lr = context.optimizer_config.lr
        overrides[ParamKey(name="*word_embeddings.weight")] = ParamGroupOverride(max_lr=2 * lr, min_lr=2 * lr,
                                                                                 wd_mult=0.5)
        return overrides


def test_override_provider_changes_a_groups_lr_and_weight_decay(single_rank_groups):
    cfg = parse(CONSTANT_LR)
    cfg.optimizer_config_override_provider = EmbeddingOverrides()
    model, optimizer, scheduler = build(cfg)
    from megatron.core.utils import unwrap_model

    embedding = unwrap_model(model[0]).embedding.word_embeddings.weight
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    assert group_of[id(embedding)]["params"] == [embedding]  # a group of its own
    for _ in range(3):  # the scheduler keeps writing each group's own lr and decay
        scheduler.step(increment=8)
        for name, p in model[0].named_parameters():
            g = group_of[id(p)]
            if p is embedding:
                assert (g["lr"], g["weight_decay"]) == pytest.approx((2 * cfg.optimizer.lr, 0.05))
            else:
                assert (g["lr"], g["weight_decay"]) == pytest.approx((cfg.optimizer.lr, 0.0 if no_decay(name, p) else 0.1))

    # {} means no overrides at all: weight decay on everything, one group.
    class NoOverrides(config.OptimizerConfigOverrideProvider):
        def build_config_overrides(self, context):
            return {}

    cfg.optimizer_config_override_provider = NoOverrides()
    _, optimizer, _ = build(cfg)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1]


def test_a_failed_step_is_skipped_and_leaves_the_model_and_schedule_alone(single_rank_groups):
    """check_optimizer_step_success on a real train_step: an Inf loss makes every gradient NaN, which megatron-core's
    mixed-precision optimizer finds while unscaling (fp16) and refuses to apply."""
    import train

    cfg = parse([*TINY, "--mock-data", "--no-check-for-nan-in-loss-and-grad", "--fp16", "--loss-scale", "1"])
    state = train.GlobalState(cfg)
    model, optimizer, scheduler = build(cfg)
    batches = iter([{"tokens": torch.randint(0, 256, (2, 64)), "labels": torch.randint(0, 256, (2, 64)),
                     "loss_mask": torch.ones(2, 64), "position_ids": torch.arange(64).repeat(2, 1)}] * 2)

    def inf_loss(data_iterator, model):
        output, loss_func = train.forward_step(state, data_iterator, model)

        def times_inf(output_tensor):
            loss, num_tokens, report = loss_func(output_tensor)
            return loss * float("inf"), num_tokens, report

        return output, times_inf

    batches = train.attach_rerun_state_machine(state, batches)  # as setup() does (disabled mode: a no-op)
    before = [p.detach().clone() for p in model[0].parameters()]
    steps_before = scheduler.num_steps
    try:
        _, skipped_iter, _, should_exit, _, grad_norm, _ = train.train_step(inf_loss, batches, model, optimizer,
                                                                            scheduler, state)
        assert skipped_iter == 1 and not should_exit
        assert all(torch.equal(a, b) for a, b in zip(before, model[0].parameters()))
        assert scheduler.num_steps == steps_before
        _, skipped_iter, *_ = train.train_step(train.prepare_forward_step_func(train.forward_step, state), batches,
                                               model, optimizer, scheduler, state)
        assert skipped_iter == 0 and scheduler.num_steps == steps_before + cfg.train.global_batch_size
    finally:
        train.mcore_rerun.destroy_rerun_state_machine()  # registered process-wide by megatron-core's design


@pytest.mark.full  # the fast command: the layouts' grad norms (test_engine)
def test_tensor_parallel_ranks_agree_on_steps_and_grad_norms(tmp_path):
    """A tensor-parallel pair over gloo, real train_steps: the grad norm is one number (megatron-core's
    global norm, computed over both ranks' shards) whether or not the reported value is synced; a step
    whose loss is NaN on rank 1 only is skipped on both ranks (fp16: megatron-core's optimizer checks for Inf/NaN
    over the model-parallel group while unscaling), parameters and schedule untouched."""
    proc = torchrun([str(tmp_path), *TINY, "--mock-data", "--train-iters", "5", "--tensor-model-parallel-size", "2",
                     "--no-check-for-nan-in-loss-and-grad", "--fp16", "--loss-scale", "1", "--num-workers", "0",
                     "--eval-iters", "0",
                     "--data-cache-path", str(tmp_path / "cache")], nproc=2, script="tests/scripts/optimizer_tp2.py")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["synced"]["skipped_iter"] == r["skipped"]["skipped_iter"] == 0
        assert r["nan"]["skipped_iter"] == 1 and r["nan"]["params_unchanged"]
        assert r["nan"]["scheduler_steps"] == r["skipped"]["scheduler_steps"] == 2 * r["synced"]["scheduler_steps"]
        assert 0 < r["synced"]["grad_norm"] and 0 < r["skipped"]["grad_norm"]
    # Unsynced, each rank reports its own optimizer's norm: the same global norm on both.
    assert ranks[0]["skipped"]["grad_norm"] == ranks[1]["skipped"]["grad_norm"]
    assert ranks[0]["synced"]["grad_norm"] == ranks[1]["synced"]["grad_norm"]


def test_finalize_runs_megatron_cores_post_init_when_asked():
    from megatron.core.distributed import DistributedDataParallelConfig as CoreDDPConfig
    from megatron.core.optimizer import OptimizerConfig as CoreOptimizerConfig

    import model

    # megatron-core checks at construction; the deferred configs accept any field values until finalize().
    with pytest.raises(AssertionError):
        CoreOptimizerConfig(main_grads_dtype=torch.bfloat16)
    c = config.OptimizerConfig(main_grads_dtype=torch.bfloat16)
    assert not hasattr(c, "use_precision_aware_optimizer_no_fp8_or_ds_fp8")  # derived field: not yet computed
    with pytest.raises(AssertionError, match="main_grads_dtype can only be fp32"):
        c.finalize()
    c.main_grads_dtype = torch.float32
    c.finalize()
    assert c.use_precision_aware_optimizer_no_fp8_or_ds_fp8 is False

    with pytest.raises(AssertionError):
        CoreDDPConfig(reuse_grad_buf_for_mxfp8_param_ag=True)
    d = config.DistributedDataParallelConfig(reuse_grad_buf_for_mxfp8_param_ag=True)
    with pytest.raises(AssertionError, match="Reuse grad buffer only when keeping params in MXFP8"):
        d.finalize()
    d.fp8_param_gather = True
    d.finalize()

    # What train.py builds from the flags is finalized and carries them.
    cfg = parse(["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], gpu=True)
    assert model.megatron_optimizer_config(cfg).use_distributed_optimizer
    ddp = model.megatron_ddp_config(cfg)
    assert (ddp.use_distributed_optimizer, ddp.overlap_grad_reduce, ddp.overlap_param_gather) == (True, True, True)


def test_distributed_optimizer_setting_is_kept_in_sync_between_ddp_and_optimizer(capsys):
    cfg = parse(["--use-distributed-optimizer"], gpu=True)
    assert cfg.ddp.use_distributed_optimizer and cfg.optimizer.use_distributed_optimizer
    cfg = config.ConfigContainer()
    cfg.ddp.use_distributed_optimizer = True  # as a YAML file or Python could set it
    checks.validate(cfg, world_size=1, gpu=True)
    assert cfg.optimizer.use_distributed_optimizer
    assert "disagreed; using the distributed optimizer for both" in capsys.readouterr().err
    cfg = config.ConfigContainer()
    checks.validate(cfg, world_size=1, gpu=True)
    assert not cfg.ddp.use_distributed_optimizer and not cfg.optimizer.use_distributed_optimizer
    cfg = config.ConfigContainer()
    cfg.ddp.use_distributed_optimizer = True  # on CPU too: megatron-core's distributed optimizer runs there
    checks.validate(cfg, world_size=1, gpu=False)
    assert cfg.optimizer.use_distributed_optimizer


@pytest.mark.parametrize("argv, gpu, message", [
    (["--overlap-param-gather"], False, "needs --use-distributed-optimizer"),
    (["--overlap-param-gather", "--overlap-grad-reduce"], True, "needs --use-distributed-optimizer"),
    (["--overlap-param-gather", "--use-distributed-optimizer"], True, "needs --overlap-grad-reduce"),
])
def test_overlap_param_gather_errors_are_one_line(argv, gpu, message, capsys):
    err = config_error(argv, capsys, gpu=gpu)
    assert message in err, err


def test_forward_pre_hook_rules():
    import train

    # Only megatron DDP's distributed optimizer with --overlap-param-gather (and not under FSDP) has the hooks.
    table = {(fsdp, dist, overlap): train.should_disable_forward_pre_hook(fsdp, dist, overlap)
             for fsdp in (False, True) for dist in (False, True) for overlap in (False, True)}
    assert [k for k, v in table.items() if v] == [(False, True, True)]
    # A megatron DDP chunk without --overlap-param-gather has no hooks: pausing them is a no-op.
    model = [types.SimpleNamespace(remove_forward_pre_hook_handles={})]
    assert not train.forward_pre_hooks_enabled(model)
    with train.forward_pre_hooks_paused(model):
        pass


OPTIMIZERS = next(a.choices for a in config.build_parser()._actions if "--optimizer" in a.option_strings)
RESUMED = [*TINY, "--mock-data", "--global-batch-size", "4", "--train-iters", "5", "--log-interval", "1",
           "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0"]


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    from conftest import Launches

    return Launches(tmp_path_factory.mktemp("resumes"), RESUMED, ("lm loss", "grad-norm"))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_resumes_bitwise(resumes, name):
    """Each --optimizer the parser accepts: a one-rank run saved at 3 and resumed there gives the uninterrupted run's
    losses and grad norms bit for bit (its state, momentum buffers included, is in the checkpoint). --optimizer sgd's
    load raised TypeError in megatron-core 0.19.2, which gives SGD no init_state_fn."""
    from conftest import assert_bitwise

    flags = ["--optimizer", name, *{"dist_muon": ["--bf16"],  # megatron-core's layer-wise optimizer is bf16 only
                                    "soap": ["--ckpt-format", "torch"]}.get(name, [])]  # (model.check_optimizer_state)
    straight = resumes(name, 1, *flags, *resumes.saving(name, 3))
    resumed = resumes.resume(f"{name}_resumed", 1, name, 3, *flags)
    assert resumed["iterations"] == [4, 5]
    assert_bitwise(resumed, straight, [4, 5], ("lm loss", "grad-norm"))


@pytest.mark.parametrize("flags, expected", [
    (["--optimizer", "sgd", "--use-distributed-optimizer"], "--optimizer sgd with --use-distributed-optimizer: "
     "megatron-core's distributed optimizer shards Adam's and Lion's state only; drop --use-distributed-optimizer"),
    (["--optimizer", "signsgd", "--use-distributed-optimizer"], "--optimizer signsgd with --use-distributed-optimizer"),
    (["--optimizer", "signsgd", "--fp16"], "--optimizer signsgd with --fp16: megatron-core's emerging-optimizer path, "
                                           "which builds it, does not support fp16; use --bf16"),
    (["--optimizer", "soap"], "--optimizer soap with --ckpt-format torch_dist: megatron-core saves an optimizer's "
                              "state shaped as its weights, and SOAP's preconditioners are not; add --ckpt-format torch"),
])
def test_what_megatron_core_cannot_build_or_save_is_one_line_before_any_model(flags, expected, tmp_path, capsys):
    """megatron-core 0.19.2's DistributedOptimizer asserts for SGD at construction, its emerging-optimizer path raises
    for fp16, and its torch_dist save of SOAP's state asserts at the first save: one line instead, exit 2, before
    any process group or model."""
    import train

    cfg = parse([*RESUMED, *flags, "--save", str(tmp_path / "ck")])
    assert train.main(cfg) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"train.py: error: {expected}") and err.count("\n") == 1, err
    assert "number of parameters" not in out and not (tmp_path / "ck").exists()
