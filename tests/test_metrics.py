"""metrics.py: each formula against an independent count, each report's keys and arithmetic."""

import math
import re
from types import SimpleNamespace

import pytest
import torch

import config
import checks
import metrics
from conftest import REORDERED, torchrun



# rel=1e-12 below: two float64 evaluations of one closed-form count (exact integers up to 2^53; each of a few dozen
# operations rounds at 2^-53 ~ 1e-16 at most).
def _cfg(*flags, world_size=1, gpu=False):
    cfg = checks.parse_args(list(flags), world_size=world_size, gpu=gpu)
    cfg.padded_vocab_size = 384
    return cfg


def _matmul_flops(cfg, batch):
    """Forward matmul FLOPs counted layer by layer (2 per multiply-add), times 3 for forward + backward."""
    m = cfg.model
    s, h, f, V = m.seq_length, m.hidden_size, m.ffn_hidden_size, cfg.padded_vocab_size
    kv = 2 * h * m.num_query_groups // m.num_attention_heads
    per_layer = (2 * s * h * (h + kv)  # query, key, value projections
                 + 2 * s * s * h * 2 / 2  # scores and the weighted sum of values: the causal mask's unmasked half
                 + 2 * s * h * h  # output projection
                 + 2 * s * h * f * (3 if m.swiglu or m.quick_geglu else 2))  # MLP: gate, up, down (gated) or up, down
    return 3 * batch * (m.num_layers * per_layer + 2 * s * h * V)


@pytest.mark.parametrize("flags", [[], ["--swiglu", "--num-query-groups", "2"], ["--ffn-hidden-size", "300"],
                                   ["--quick-geglu"]])
def test_flops_match_a_layer_by_layer_count(flags):
    """--quick-geglu builds the gated MLP as --swiglu does (three matrices), where Megatron-LM's formula counts two."""
    cfg = _cfg("--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64", *flags)
    assert metrics.num_floating_point_operations(cfg, 8, 384) == pytest.approx(_matmul_flops(cfg, 8), rel=1e-12)


def _megatron_lm_flops(cfg, batch):
    """Megatron-LM's dense-GPT count in its newest form, written out here on its own: megatron/training/
    training.py, num_floating_point_operations -> transformer_flops (NVIDIA/Megatron-LM d98e8a64, 2026), per
    token T = batch x s and per squared sequence length S2 = batch x s^2, each GEMM 3 (forward, wgrad, dgrad)
    x 2 (multiply-add); core attention 3 x 2 x q / 2 (the causal mask) x 2 (QK^T and (QK^T)V)."""
    m = cfg.model
    h, L, V = m.hidden_size, m.num_layers, cfg.padded_vocab_size
    q, kv = m.kv_channels * m.num_attention_heads, m.kv_channels * m.num_query_groups
    ffn_factor = 3 if m.swiglu else 2
    tokens, seq_squared = batch * m.seq_length, batch * m.seq_length ** 2
    attention_linear = 3 * 2 * (h * (q + 2 * kv) + q * h)
    attention_core = 3 * 2 * q / 2 * 2
    return (tokens * (3 * 2 * h * m.ffn_hidden_size * ffn_factor * L + attention_linear * L + 3 * 2 * h * V)
            + seq_squared * attention_core * L)


@pytest.mark.parametrize("flags", [
    ["--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512"],
    ["--hidden-size", "512", "--num-attention-heads", "8", "--num-query-groups", "2", "--swiglu", "--seq-length", "1024",
     "--kv-channels", "80", "--num-layers", "6"],
])
def test_flops_equal_megatron_lm_with_the_causal_half(flags):
    cfg = _cfg(*flags)
    assert metrics.num_floating_point_operations(cfg, 4, 384) == pytest.approx(_megatron_lm_flops(cfg, 4), rel=1e-12)


def test_mfu_uses_the_datasheet_peak_and_says_n_a_otherwise():
    assert metrics.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4  # dense, not the 1979 sparse figure
    assert metrics.peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert metrics.peak_tflops(None, "bf16") is None  # a CPU
    assert metrics.peak_tflops("Some Future Accelerator", "bf16") is None
    assert metrics.mfu(494.7, 989.4) == "50.0%" and metrics.mfu(1.0, None) == "n/a"


def test_report_throughput_rolling_window():
    train_cfg = SimpleNamespace(global_batch_size=8)
    history = [0.5 * i for i in range(1, 11)]  # one iteration every 0.5 s
    assert metrics.report_throughput(train_cfg, 3, 64, history[:3], window_size=5) == {}  # window not full
    r = metrics.report_throughput(train_cfg, 10, 64, history, window_size=5)
    assert r["throughput/batches_per_sec"] == pytest.approx(2.0)
    assert r["throughput/samples_per_sec"] == pytest.approx(16.0)
    assert r["throughput/tokens_per_sec"] == pytest.approx(16.0 * 64)
    assert r["throughput/device/samples_per_sec"] == pytest.approx(16.0)  # world of one
    with pytest.warns(UserWarning, match="at iteration 7"):
        assert metrics.report_throughput(train_cfg, 7, 64, [1.0] * 5, window_size=5) == {}


def test_report_runtime_estimates_from_this_jobs_rate(monkeypatch):
    ts = SimpleNamespace(step=30, consumed_train_samples=240)
    monkeypatch.setattr(metrics.time, "time", lambda: 1000.0 + 60.0)
    r = metrics.report_runtime(ts, 1000.0, 64, 100, time_unit="minutes", start_step=20)
    # 10 iterations in this job took 1 minute: 70 left take 7 minutes.
    assert r == {"time/remaining_estimate": 7.0, "time/tokens": 240 * 64, "time/samples": 240, "time/batches": 30,
                 "time/total": 1.0}


def test_report_memory_on_cpu_is_process_memory_under_its_own_names(single_rank_groups):
    r = metrics.report_memory()
    assert set(r) == {"memory/cpu_rss_mem", "memory/cpu_peak_rss_mem"}
    assert 0 < r["memory/cpu_rss_mem"] <= r["memory/cpu_peak_rss_mem"] < 64


def test_norms_on_one_rank(single_rank_groups):
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    from model import build_model, set_random_seed

    cfg = _cfg("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4")
    set_random_seed(cfg.rng.seed)  # the RNG tracker's streams, which the forward's dropout draws from
    model = build_model(cfg, 100)
    params = list(model[0].parameters())
    expected = torch.cat([p.detach().flatten() for p in params]).norm().item()
    # One sum of n ~ 10^5 squares, grouped per parameter there and at once here: log2(n) x 2^-24 ~ 1e-6 relative.
    assert metrics.calc_params_l2_norm(model) == pytest.approx(expected, rel=1e-5)
    model[0](torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None], None,
             labels=torch.ones(1, 8, dtype=torch.long)).sum().backward()
    r = metrics.report_l2_norm_grad(model)
    layer_keys = [k for k in r if k != "l2_norm/grad/global"]
    assert len(layer_keys) == len(params) and "l2_norm/grad/decoder.layers.0.mlp.linear_fc1.weight" in r
    # The same squares summed per layer then over layers (float64 here): fp32's log2(n) x 2^-24 ~ 1e-6 relative.
    assert r["l2_norm/grad/global"] == pytest.approx(math.sqrt(sum(r[k] ** 2 for k in layer_keys)), rel=1e-5)
    # megatron-core's own gradient norm (what its optimizer clips with) agrees, to the same fp32 sums' rounding.
    assert r["l2_norm/grad/global"] == pytest.approx(get_grad_norm_fp32([p.grad for p in params]), rel=1e-5)
    assert metrics.param_is_not_shared(params[0])
    params[0].shared = True
    assert not metrics.param_is_not_shared(params[0])


@pytest.mark.parametrize("dtype", [[], ["--bf16"], ["--fp16", "--initial-loss-scale", "1024"]],
                         ids=["fp32", "bf16", "fp16"])
def test_the_gradient_norms_a_fork_reads_are_before_clipping_and_unscaled(dtype, tmp_path):
    """--log-l2-norm-grad's norms at each dtype, clipped hard (--clip-grad 0.01, so every step clips): taken before
    the step, `l2_norm/grad/global` is the log line's grad norm (the norm megatron-core clips by), and times
    metrics.clip_coefficient it is the clip, the norm the optimizer stepped with. Taken after the step they were
    the clipped norm at fp32 and bf16 and the loss-scaled unclipped one at fp16. fp16 starts at a loss scale of
    1024, which these gradients do not overflow (the default 2^32 skips the first steps, which have no grad norm)."""
    from conftest import TINY, train_here
    from layouts import tensorboard_scalars

    train_here([*TINY, "--mock-data", "--train-iters", "3", "--global-batch-size", "4", "--eval-iters", "0",
                "--num-workers", "0", "--clip-grad", "0.01", "--log-l2-norm-grad", "--tensorboard-dir",
                str(tmp_path / "tb"), "--data-cache-path", str(tmp_path / "cache"), *dtype])
    tb = tensorboard_scalars(tmp_path / "tb")
    assert sorted(tb["grad-norm"]) == [1, 2, 3] and min(tb["grad-norm"].values()) > 0.1  # every step clipped
    for it, grad_norm in tb["grad-norm"].items():
        # The same fp32 squares of the same gradients, summed per parameter then over them here and in buckets by
        # megatron-core (log2(n) x 2^-24 for n ~ 10^5 terms, ~3e-7); fp16's divided by a power of 2, exactly
        assert tb["l2_norm/grad/global"][it] == pytest.approx(grad_norm, rel=REORDERED)
        clipped = tb["l2_norm/grad/global"][it] * metrics.clip_coefficient(grad_norm, 0.01)
        assert clipped == pytest.approx(0.01, rel=1e-5)  # 0.01 x norm / (norm + 1e-6): 1e-6 / norm ~ 1e-6 off
    assert metrics.clip_coefficient(0.5, 1.0) == 1.0 and metrics.clip_coefficient(2.0, 0.0) == 1.0


def test_dtensor_norm(single_rank_groups):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(12.0).reshape(3, 4)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    assert metrics.calc_dtensor_params_l2_norm([dt, torch.ones(4)]) == pytest.approx(
        math.sqrt(full.pow(2).sum().item() + 4))


def test_parameter_count_of_the_memory_estimate_matches_the_built_model(single_rank_groups):
    """With no biases and no position table (the formula counts neither), the estimate's parameter count
    is exactly megatron-core's GPTModel's."""
    from model import build_model

    for flags in (["--swiglu", "--num-query-groups", "2"], ["--untie-embeddings-and-output-weights"],
                  ["--quick-geglu"]):  # gated as --swiglu
        cfg = _cfg("--num-layers", "3", "--hidden-size", "128", "--num-attention-heads", "4", "--disable-bias-linear",
                   "--position-embedding-type", "rope", *flags)
        model = build_model(cfg, 384)
        n = sum(p.numel() for p in model[0].parameters())
        assert metrics.compute_weight_and_optimizer_memory(cfg) == pytest.approx(16 * n)  # fp32: weight, grad, Adam
        cfg.model.bf16 = True
        assert metrics.compute_weight_and_optimizer_memory(cfg) == pytest.approx(18 * n)  # Megatron-LM's 18 bytes
        cfg.optimizer.use_distributed_optimizer, cfg.data_parallel_size = True, 4
        assert metrics.compute_weight_and_optimizer_memory(cfg) == pytest.approx((6 + 12 / 4) * n)
        cfg.model.context_parallel_size = 2  # the distributed optimizer shards over data x context parallel ranks
        assert metrics.compute_weight_and_optimizer_memory(cfg) == pytest.approx((6 + 12 / 8) * n)
        cfg.optimizer.use_distributed_optimizer, cfg.model.context_parallel_size = False, 1
        cfg.trainable_fraction = 0.1  # PEFT: frozen weights keep only their 16-bit weight
        assert metrics.compute_weight_and_optimizer_memory(cfg) == pytest.approx((0.1 * 18 + 0.9 * 2) * n)


def test_weight_memory_takes_the_most_loaded_pipeline_stage():
    base = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4", "--pipeline-model-parallel-size",
            "2", "--disable-bias-linear"]
    h, V = 128, 384
    per_layer = 2 * h * h * (2 + 4 + 2 / h)  # attention (q, k, v, out) + MLP 4h + two norms
    even = _cfg(*base, world_size=2)
    # 4 + 4: the embedding on the first stage, its (tied) copy on the last; the final norm in the even split (Bridge's).
    assert metrics.compute_weight_and_optimizer_memory(even) == pytest.approx(16 * (4 * per_layer + 2 * h / 2 + h * V))
    # 2 + 6: the last stage holds 6 layers and its copy of the (tied) output weights.
    uneven = _cfg(*base, "--decoder-first-pipeline-num-layers", "2", world_size=2)
    assert metrics.compute_weight_and_optimizer_memory(uneven) == pytest.approx(16 * (6 * per_layer + 2 * h / 2 + h * V))


@pytest.mark.parametrize("layout, world_size, num_microbatches", [
    (["--pipeline-model-parallel-size", "2"], 4, 8),
    (["--pipeline-model-parallel-size", "2"], 4, 1),                                    # fewer microbatches than stages
    (["--untie-embeddings-and-output-weights"], 2, 4),                                  # one stage: the output layer too
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"], 8, 4),  # interleaved
])
def test_theoretical_memory_is_bridges_under_its_assumptions(layout, world_size, num_microbatches):
    """Bridge's theoretical_memory_utils (the seed page) assumes mixed precision, sequence parallelism and selective
    recomputation: weights and optimizer = (layers / pp + the embedding) / tp parameters, the final norm counted in
    the layers (+ the output layer with one untied stage), at 6 + 12 / dp bytes with the distributed optimizer;
    activations = Korthikanti et al.'s sbh (18 + 4 ffn / h) for all L layers (pp stages, pp microbatches in flight)
    + the embedding's 8sb + sbh per microbatch in flight, times the interleaving penalty or min(1, microbatches /
    pp), + the output layer's 4sbh (1 + V / h) with one stage, all over tp. Written out here, the same numbers."""
    s, b, h, a, L, V, tp = 64, 2, 128, 4, 8, 384, 2
    cfg = _cfg("--num-layers", str(L), "--hidden-size", str(h), "--num-attention-heads", str(a), "--seq-length", str(s),
               "--micro-batch-size", str(b), "--bf16", "--use-distributed-optimizer", "--sequence-parallel",
               "--tensor-model-parallel-size", str(tp), "--recompute-granularity", "selective", "--global-batch-size",
               "64", *layout, world_size=world_size)  # on the CPU path: sequence parallelism runs there too
    m, pp, dp = cfg.model, cfg.model.pipeline_model_parallel_size, cfg.data_parallel_size
    untied, vp = m.untie_embeddings_and_output_weights, m.virtual_pipeline_model_parallel_size
    layers = 2 * L * h * h * ((1 + 1) * 1 + 4 + 2 / h + 1 / (L * h))
    most_loaded = (layers / pp + h * V) / tp + (h * V / tp if untied and pp == 1 else 0)
    assert metrics.compute_weight_and_optimizer_memory(cfg) == pytest.approx(most_loaded * (6 + 12 / dp), rel=1e-12)
    activation = s * b * h * (18 + 4 * 4) * L + 8 * s * b * pp + s * b * h * pp
    if vp:
        activation *= 1 + (pp - 1) / (pp * vp)
    elif pp > 1:
        activation *= min(1, num_microbatches / pp)
    if pp == 1:
        activation += s * b * h * 4 * (1 + V / h)
    assert metrics.compute_activation_memory(cfg, num_microbatches) == pytest.approx(activation / tp, rel=1e-12)


def test_activation_memory_is_table_2_of_korthikanti_et_al():
    """Korthikanti et al. 2022, Table 2 (16-bit activations, t = 1): 34 sbh per layer, plus 5as^2b for the
    attention scores unless selective recomputation drops them; full recomputation keeps 2sbh per layer."""
    s, b, h, a, L, V = 64, 2, 128, 4, 4, 384
    base = ["--num-layers", str(L), "--hidden-size", str(h), "--num-attention-heads", str(a), "--seq-length", str(s),
            "--micro-batch-size", str(b)]
    embedding, output = 8 * s * b + s * b * h, s * b * h * 4 * (1 + V / h)
    layer = 34 * s * b * h + 5 * a * s * s * b
    assert metrics.compute_activation_memory(_cfg(*base), 1) == pytest.approx(L * layer + embedding + output)
    selective = _cfg(*base, "--recompute-granularity", "selective")
    assert metrics.compute_activation_memory(selective, 1) == pytest.approx(L * 34 * s * b * h + embedding + output)
    full = _cfg(*base, "--recompute-granularity", "full", "--recompute-method", "uniform")
    assert metrics.compute_activation_memory(full, 1) == pytest.approx(L * 2 * s * b * h + layer + embedding + output)
    block = _cfg(*base, "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1")
    assert metrics.compute_activation_memory(block, 1) == pytest.approx(
        2 * s * b * h + 3 * layer + layer + embedding + output)
    # Two stages, interleaved: the first stage's 2 layers x 2 microbatches in flight, times 1 + (2-1)/(2x2).
    vpp = _cfg(*base, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
               "--global-batch-size", "8", world_size=2)
    assert metrics.compute_activation_memory(vpp, 4) == pytest.approx((2 * layer + embedding) * 2 * 1.25)
    # Context parallelism splits the sequence: each rank keeps half of every activation (a CPU run's config).
    cp = _cfg(*base, "--context-parallel-size", "2", "--cp-comm-type", "all_gather", world_size=2)
    assert metrics.compute_activation_memory(cp, 1) == pytest.approx((L * layer + embedding + output) / 2)


def test_sequence_and_context_parallelism_change_no_flops():
    """A step's FLOPs are the model's and the batch's (Bridge's flop_utils): splitting the sequence over tensor-parallel
    (SP) or context-parallel ranks changes where they run, not their number."""
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]
    flops = {name: metrics.num_floating_point_operations(_cfg(*base, *flags, world_size=4), 8, 384) for name, flags in (
        ("tp2", ["--tensor-model-parallel-size", "2"]), ("tp2_sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("cp2", ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]), ("dp4", []))}
    assert len(set(flops.values())) == 1 and flops["dp4"] > 0, flops


def test_progress_log_restarts_on_another_world_size(tmp_path):
    lines = ["2026-01-01 00:00:00\tJob ID: 1\t# GPUs: 8\tStarting job",
             "2026-01-01 01:00:00\tJob ID: 1\t# GPUs: 8\tSaved checkpoint\tIteration: 10\tJob throughput: 1.0 TFLOP/s/GPU\t"
             "Cumulative throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: 1.00e+15\tTokens (in billions): 0.01",
             "2026-01-02 00:00:00\tJob ID: 2\t# GPUs: 4\tStarting job",
             "2026-01-03 00:00:00\tJob ID: 3\t# GPUs: 8\tStarting job",
             "2026-01-03 02:00:00\tJob ID: 4\t# GPUs: 8\tStarting job"]
    (tmp_path / "progress.txt").write_text("\n".join(lines) + "\n")
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(save=str(tmp_path)), world_size=8)
    start, flops = metrics.get_start_time_from_progress_log(cfg)
    assert str(start) == "2026-01-03 00:00:00" and flops == 1e15  # the 4-GPU job broke the run of 8-GPU jobs
    cfg.world_size = 2
    with pytest.raises(ValueError, match="no 'Starting job' line for world size 2"):
        metrics.get_start_time_from_progress_log(cfg)


def test_progress_log_of_a_run(mock_run):
    lines = (mock_run["dir"] / "ckpt" / "progress.txt").read_text().splitlines()
    assert lines[0].endswith("# GPUs: 2\tStarting job")
    saved = [l.split("\t") for l in lines[1:]]
    assert [t[4] for t in saved] == ["Iteration: 15", "Iteration: 30"]
    flops = [float(t[7].split(": ")[1]) for t in saved]
    # progress.txt prints "%.2e": each figure within half a unit of its third digit, 0.5% at worst (1.00e..).
    assert flops[1] == pytest.approx(2 * flops[0], rel=1e-2)
    assert all("TFLOP/s/GPU" in t[5] and "TFLOP/s/GPU" in t[6] for t in saved)


def test_tensorboard_reports_of_a_run(mock_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(mock_run["dir"] / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for key in ["throughput/tokens_per_sec", "throughput/device/samples_per_sec", "memory/cpu_rss_mem",
                "time/remaining_estimate", "time/tokens", "l2_norm/grad/global", "params-norm", "params-norm vs samples",
                "forward-backward-time", "optimizer-time", "throughput"]:
        assert key in tags, key
    assert not any(t.startswith("memory/current_allocated") for t in tags)  # no GPU keys on a CPU
    assert [e.value for e in acc.Scalars("time/tokens")][-1] == 30 * 8 * 64
    # The log line carries TFLOP/s and, on a CPU, MFU n/a.
    assert " MFU: n/a |" in mock_run["stdout"] and "(min, max) time across ranks (ms):" in mock_run["stdout"]
    # The timers' rows in megatron-core's own format (timers.py:349), as Megatron-LM prints them: the name padded
    # with dots to 48 columns, then the (min, max) over ranks.
    rows = re.findall(r"\n    (forward-backward \.+): \(\d+\.\d\d, \d+\.\d\d\)\n", mock_run["stdout"])
    assert rows and all(len(r) == 48 for r in rows), rows


def test_timing_log_option_picks_megatron_cores_timer_block(single_rank_groups):
    """--timing-log-option is Megatron-LM's flag, and megatron-core's LoggerConfig field: the log line's timer block
    is the max over ranks, their (min, max) (the default) or every rank's time (timers.py:339-361)."""
    import device
    import train

    heads = {}
    for option in (None, "max", "minmax", "all"):
        flags = ["--timing-log-level", "1"] + (["--timing-log-option", option] if option else [])
        state = train.GlobalState(checks.parse_args(flags, world_size=1, gpu=False))
        with device.shim():
            state.timers("forward-backward", log_level=1).start()
            state.timers("forward-backward").stop()
            heads[option] = state.timers.get_all_timers_string(metrics.TIMERS_TO_LOG, normalizer=1).splitlines()[0]
    assert heads == {None: "(min, max) time across ranks (ms):", "max": "max time across ranks (ms):",
                     "minmax": "(min, max) time across ranks (ms):", "all": "times across ranks (ms):"}, heads


@pytest.mark.full  # the fast command: the layouts' norms (test_engine, test_moe)
def test_model_parallel_reductions_over_two_ranks():
    proc = torchrun([], nproc=2, script="tests/scripts/mp_reductions.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(l for l in proc.stdout.splitlines() if l.startswith("rank"))
    assert [l.split(" (")[0] for l in lines] == [  # the figures in brackets: the two norms, for a failure's message
        "rank 0: max=3.0 none=None and=False norm_tp2_equals_tp1=True dist_opt_norm_equals_plain=True",
        "rank 1: max=3.0 none=None and=False norm_tp2_equals_tp1=True dist_opt_norm_equals_plain=True"], lines


@pytest.mark.full  # the fast command: the layouts' norms (test_engine, test_moe)
def test_params_norm_as_megatron_lms():
    """--log-params-norm (tests/scripts/params_norm.py): at TP=2 with EP=2 and expert TP 1, Megatron-LM's own
    calc_params_l2_norm's figure (rank 1's expert linear_fc2 biases counted); under fp16 the norm of the fp16 weights,
    bitwise, not of the fp32 main copies (Megatron-LM reads those under bf16 only, common_utils.py:63-77)."""
    proc = torchrun([], nproc=2, script="tests/scripts/params_norm.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(l.split(" (")[0] for l in proc.stdout.splitlines() if l.startswith("rank"))
    assert lines == [f"rank {r}: {check}" for r in (0, 1) for check in (
        "fp16_weights=True mains_differ=True", "moe_tp2_ep2_same=True")], proc.stdout


def test_peft_flops_count_frozen_weights_without_their_weight_gradient():
    """Frozen GEMMs: forward + input gradient (2 of 3); core attention as before; adapters in full (3 x 2 x dim x
    (in + out) per token and layer). Written out for --lora-dim 8 on the four default targets."""
    base = ["--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64", "--num-layers", "2"]
    plain = _cfg(*base)
    lora = _cfg(*base, "--peft", "lora", "--lora-dim", "8", "--pretrained-checkpoint", "x")
    s, h, L, V, b = 64, 128, 2, 384, 4
    weight_gemms = 3 * 2 * b * s * L * (h * 3 * h + h * h + 2 * h * 4 * h) + 3 * 2 * b * s * h * V
    core = 3 * 2 * b * s * s * h * L  # causal half of QK^T and AV
    adapters = 3 * 2 * b * s * L * 8 * ((h + 3 * h) + (h + h) + (h + 4 * h) + (4 * h + h))
    assert metrics.num_floating_point_operations(plain, b, V) == pytest.approx(weight_gemms + core, rel=1e-12)
    assert metrics.num_floating_point_operations(lora, b, V) == pytest.approx(
        weight_gemms * 2 / 3 + core + adapters, rel=1e-12)


@pytest.mark.parametrize("step, start, interval, expected", [
    (10, 0, 5, 5),   # a full interval
    (12, 10, 5, 2),  # resumed at 10: two iterations into the interval
    (15, 12, 5, 3),  # resumed at 12: the first line covers 13-15, not 5 iterations
    (15, 0, 1, 1),
])
def test_a_log_line_divides_its_interval_by_the_iterations_it_covers(step, start, interval, expected):
    """Bridge 0.6's training_log: the time per iteration (and the timers) of a job that resumed between two log lines
    are the interval's time over the iterations this job ran in it, not over --log-interval."""
    import metrics

    assert metrics.iterations_since_last_log(step, start, interval) == expected


def test_the_params_norm_counts_a_parameter_reduced_outside_the_data_parallel_group(single_rank_groups):
    """Bridge's unit test: a dense model (no MoE) with one `allreduce = False` parameter [3, 4] has params norm 5.0.
    Such parameters were counted only in MoE models, so this printed 0.0."""
    param = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    param.allreduce = False
    model = torch.nn.Module()
    model.weight = param
    assert metrics.calc_params_l2_norm([model]) == pytest.approx(5.0, rel=2 ** -23)  # fp32: one rounding of sqrt(25)


def test_the_log_lines_interval_averages_under_fp16_skips_are_megatron_lms(tmp_path, capsys):
    """fp16 from a loss scale of 2^19, whose first steps overflow and are skipped, and a NaN loss at iteration 6 (its
    gradients NaN: skipped too), with MoE and MTP losses; log lines every 4 iterations. As Megatron-LM's training_log
    (training.py:2597-2617, 2782-2802, 2876-2883): the lm loss summed over the iterations that advanced, the MoE and
    MTP losses over all of them (megatron-core's trackers add them either way), each sum divided by the iterations
    advanced, and only a skipped iteration's NaN loss counted as a nan iteration. The sums are of the float32 values
    TensorBoard holds, added in the same order as metrics.accumulate_losses adds them: the printed figures are
    equal, digit for digit."""
    import train
    from conftest import TINY, tensorboard_scalars
    from test_training import MOE_MTP

    def forward_step(state, data_iterator, model):
        output, loss_func = train.forward_step(state, data_iterator, model)
        return (output * float("nan") if state.train_state.step == 5 else output), loss_func

    cfg = checks.parse_args([*TINY, *MOE_MTP, "--mock-data", "--num-workers", "0", "--eval-iters", "0",
                             "--data-cache-path", str(tmp_path / "cache"), "--fp16", "--initial-loss-scale", str(2 ** 19),
                             "--train-iters", "8", "--log-interval", "4", "--tensorboard-dir", str(tmp_path / "tb")],
                            world_size=1, gpu=False)
    train.pretrain(cfg, forward_step)
    out = capsys.readouterr().out
    tb = tensorboard_scalars(tmp_path / "tb")
    # A skipped step leaves the scheduler where it was: its learning rate is the one before (0 before any step).
    lr = {0: 0.0, **tb["learning-rate"]}
    skipped = {it: lr[it] == lr[it - 1] for it in range(1, 9)}
    assert skipped[1] and skipped[6] and not skipped[8], list(skipped.values())
    for end in (4, 8):
        interval = range(end - 3, end + 1)
        advanced = max(1, sum(not skipped[it] for it in interval))
        line = next(line for line in out.splitlines() if f" iteration {end:8d}/" in line)
        expected = {name: sum(tb[name][it] for it in interval) / advanced
                    for name in ("load_balancing_loss", "mtp_1 loss")}
        if not all(skipped[it] for it in interval):
            expected["lm loss"] = sum(tb["lm loss"][it] for it in interval if not skipped[it]) / advanced
        for name, value in expected.items():
            assert f"| {name}: {value:.6E} |" in line, (name, line)
        assert f"| number of skipped iterations: {sum(skipped[it] for it in interval):3d} |" in line
        assert f"| number of nan iterations: {int(end == 8):3d} |" in line  # iteration 6's NaN loss


def test_a_nan_loss_on_an_iteration_that_advanced_is_no_nan_iteration(tmp_path, capsys):
    """With the NaN check off, iteration 2's loss NaN and its step taken (fp32: nothing skips it): as Megatron-LM's
    training_log, the NaN goes into the interval's sum, whose average is then left off the line (training.py:2881),
    and it is no nan iteration (those are counted on skipped iterations only, training.py:2610-2616)."""
    import train
    from conftest import TINY

    def forward_step(state, data_iterator, model):
        output, loss_func = train.forward_step(state, data_iterator, model)
        return (output * float("nan") if state.train_state.step == 1 else output), loss_func

    cfg = checks.parse_args([*TINY, "--mock-data", "--num-workers", "0", "--eval-iters", "0", "--train-iters", "2",
                             "--data-cache-path", str(tmp_path / "cache"), "--log-interval", "2",
                             "--no-check-for-nan-in-loss-and-grad"], world_size=1, gpu=False)
    train.pretrain(cfg, forward_step)
    line = next(line for line in capsys.readouterr().out.splitlines() if " iteration        2/" in line)
    assert "lm loss" not in line and "| number of skipped iterations:   0 | number of nan iterations:   0 |" in line
