"""config.py: flags generated from the dataclasses, YAML under flags, and every validation error as one line, before
any process group."""

import math
import os
import re
import subprocess
import sys

import pytest

import checks
import config
from megatron.training.determinism import DETERMINISM_ENV_VAR_DEFAULTS
from conftest import ROOT, config_error


def parse(argv, world_size=1, gpu=False):
    return checks.parse_args(argv, world_size=world_size, gpu=gpu)


def test_defaults_and_derived_values():
    cfg = parse([])
    assert cfg.model.num_layers == 4 and cfg.model.ffn_hidden_size == 4 * cfg.model.hidden_size
    assert cfg.model.num_query_groups == cfg.model.num_attention_heads
    assert cfg.train.global_batch_size == cfg.train.micro_batch_size  # one data-parallel rank
    assert cfg.train.train_iters == 300 and cfg.checkpoint.ckpt_format == "torch_dist"
    assert cfg.model.transformer_impl == "local" and not cfg.use_gpu


def test_megatron_flags_map_to_their_sections():
    cfg = parse(["--num-layers", "6", "--hidden-size", "384", "--num-attention-heads", "6", "--num-query-groups", "2",
                 "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--micro-batch-size", "2",
                 "--global-batch-size", "16", "--train-samples", "1600", "--lr", "2e-4", "--min-lr", "2e-5",
                 "--lr-decay-style", "linear", "--lr-warmup-samples", "160", "--no-save-optim", "--bf16",
                 "--tensor-model-parallel-size", "2"], world_size=4)
    assert (cfg.model.num_layers, cfg.model.num_query_groups, cfg.model.swiglu) == (6, 2, True)
    assert cfg.model.add_bias_linear is False and cfg.model.untie_embeddings_and_output_weights
    assert cfg.model.ffn_hidden_size == 1024  # SwiGLU: 2/3 of 4h, rounded down to a multiple of 64
    assert cfg.data_parallel_size == 2 and cfg.train.global_batch_size // (cfg.train.micro_batch_size * 2) == 4
    assert cfg.train.train_iters == 100  # 1600 samples / 16 per step
    assert cfg.checkpoint.save_optim is False and cfg.model.bf16
    # Scheduler lengths are in samples: megatron-core's scheduler is stepped by the global batch size.
    assert cfg.scheduler.lr_warmup_steps == 10 * 16 and cfg.scheduler.lr_decay_steps == 1600


def test_every_field_has_help_and_a_flag():
    parser = config.build_parser()
    text = parser.format_help()
    for section, f, meta in config._cli_fields():
        assert meta["help"], f"{section}.{f.name} is undocumented"
        flag = meta["flag"]
        assert flag in text
    for flag in ["--num-layers", "--micro-batch-size", "--global-batch-size", "--train-iters", "--save", "--load",
                 "--data-path", "--mock-data", "--tensorboard-dir", "--exit-signal-handler", "--log-throughput"]:
        assert flag in text


def test_a_parse_not_asked_for_help_has_every_flag_as_the_help_parser():
    """A run's parse does not read megatron-core's docstrings (checks.asks_for_help): its parser has every flag of
    the one `--help` prints, with the same destination, default, type, choices and arity; only help texts differ."""
    def shape(parser):
        return [(a.option_strings, a.dest, a.default, getattr(a.type, "__qualname__", a.type), a.choices, a.nargs,
                 a.const, a.metavar) for a in parser._actions]

    with_help, without = config.build_parser(), config.build_parser(help_texts=False)
    assert shape(without) == shape(with_help)
    differ = [a.option_strings[0] for a, b in zip(with_help._actions, without._actions) if a.help != b.help]
    assert "--hidden-size" in differ and "--mock-data" not in differ  # megatron-core's field; this trainer's own
    assert checks.asks_for_help(["--num-layers", "2", "--help"]) and not checks.asks_for_help(["--num-layers", "2"])


def test_yaml_file_with_flags_overriding(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  num_layers: 8\n  hidden_size: 128\ntrain:\n  train_iters: 50\n")
    cfg = parse(["--config-file", str(path), "--num-layers", "3"])
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 128 and cfg.train.train_iters == 50


def test_run_config_yaml_round_trips(tmp_path):
    cfg = parse(["--num-layers", "3", "--swiglu"])
    path = tmp_path / "run_config.yaml"
    path.write_text(config.to_yaml(cfg))
    again = parse(["--config-file", str(path)])
    assert again.to_dict() == cfg.to_dict()


def test_pipeline_p2p_settings_follow_megatron_lm():
    """--no-overlap-p2p-communication and its derived batch_p2p_comm, as Megatron-LM's validate_args and
    core_transformer_config_from_args set them: overlapped isend/irecv under the interleaved schedule by default,
    batched 1F1B without virtual stages, and batched interleaving from 3 pipeline stages on."""
    import config

    def p2p(argv, world_size):
        m = checks.parse_args(argv, world_size=world_size, gpu=False).model
        return m.overlap_p2p_comm, m.batch_p2p_comm

    vpp = ["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "16"]
    assert p2p(["--pipeline-model-parallel-size", "2", *vpp], 2) == (True, False)
    assert p2p(["--pipeline-model-parallel-size", "2"], 2) == (False, True)
    assert p2p(["--pipeline-model-parallel-size", "4", *vpp, "--no-overlap-p2p-communication"], 4) == (False, True)


def test_megatron_lm_cpu_command_line_switches_are_accepted_and_named_as_inert(single_rank_groups):
    """The 7 switches a CPU or no-TE Megatron-LM GPT command line carries: 6 turn off fused GPU kernels the local
    layers never use (one line names them), and --use-cpu-initialization means what it means in megatron-core."""
    import io

    from model import transformer_config

    switches = ["--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion"]
    cfg = checks.parse_args([*switches, "--use-cpu-initialization"], world_size=1, gpu=True)
    out = io.StringIO()
    checks.print_config(cfg, out)
    assert out.getvalue().count(" inert here (fused GPU kernels the local layers never use): "
                                + " ".join(switches) + "\n") == 1
    assert transformer_config(cfg).use_cpu_initialization
    tc = transformer_config(checks.parse_args([], world_size=1, gpu=False))  # the fusions stay off either way
    assert not (tc.persist_layer_norm or tc.gradient_accumulation_fusion or tc.masked_softmax_fusion
                or tc.bias_activation_fusion or tc.bias_dropout_fusion or tc.apply_rope_fusion)


@pytest.mark.parametrize("argv, world_size, gpu, message", [
    (["--global-batch-size", "10", "--micro-batch-size", "4"], 2, False, "not a multiple of --micro-batch-size 4 x data-parallel size 2"),
    (["--hidden-size", "100", "--num-attention-heads", "3"], 1, False, "does not divide --hidden-size"),
    (["--num-query-groups", "3"], 1, False, "must divide --num-attention-heads"),
    (["--tensor-model-parallel-size", "2"], 3, False, "do not divide the world size 3"),
    (["--tensor-model-parallel-size", "8"], 8, False, "must divide the number of query groups 4"),  # so the heads too
    (["--pipeline-model-parallel-size", "3"], 3, True, "must divide --num-layers"),
    (["--distributed-backend", "nccl"], 2, False, "needs a GPU"),
    (["--use-distributed-optimizer", "--ckpt-format", "torch"], 1, False, "use --ckpt-format torch_dist"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2, False,
     "must divide the 2 layers of each pipeline stage"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 1, False, "add --pipeline-model-parallel-size 2"),
    # megatron-core batches both directions to the one peer of 2 pipeline ranks (README: defects)
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--no-overlap-p2p-communication"], 2, False, "swaps activations and gradients (megatron-core batches"),
    (["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1",
      "--no-overlap-p2p-communication", "--overlap-p2p-communication-warmup-flush", "--global-batch-size", "16"], 4,
     False, "megatron-core's TransformerConfig refuses these settings: Pipeline parallel communication overlapping in "
     "warmup and flush is only compatible with overlap_p2p_comm but not batch_p2p_comm."),
    # impossible layouts stop before any model is built: 8 ranks that do not factor, a stage split that is not whole
    (["--tensor-model-parallel-size", "3", "--num-attention-heads", "6", "--hidden-size", "96"], 8, False,
     "= 3 do not divide the world size 8"),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "3", "--num-layers", "6"], 8, False,
     "= 6 do not divide the world size 8"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "6", "--num-layers-per-virtual-pipeline-stage", "2"], 8,
     False, "must divide the 3 layers of each pipeline stage"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--decoder-last-pipeline-num-layers", "0",
      "--mtp-num-layers", "1", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope"], 2, False, "megatron-core's TransformerConfig refuses these settings: "
     "num_layers_in_last_pipeline_stage must be larger than 0"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--decoder-first-pipeline-num-layers", "0"], 2,
     False, "megatron-core's TransformerConfig refuses these settings: num_layers_in_first_pipeline_stage must be "
     "larger than 0"),
    # context parallelism on the local layers is SDPAttention's all-gather of keys and values (model.py)
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p"], 2, False, "--cp-comm-type p2p is transformer-engine's "
     "context-parallel attention; the local layers gather keys and values: add --cp-comm-type all_gather"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a"], 2, False, "--cp-comm-type a2a is transformer-engine's "
     "context-parallel attention"),
    (["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--attention-backend", "local"], 2, False,
     "--attention-backend local runs in megatron-core's DotProductAttention, which refuses --context-parallel-size 2"),
    (["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--window-size", "8,0"], 2, False,
     "--window-size runs in megatron-core's DotProductAttention, which refuses --context-parallel-size 2"),
    (["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--seq-length", "250"], 2, False,
     "--seq-length 250 must be a multiple of 2 x --context-parallel-size = 4"),
    # transformer-engine layers bring their own core attention: the local choice would be silently ignored
    (["--transformer-impl", "transformer_engine", "--attention-backend", "local"], 1, True,
     "add --transformer-impl local to use it"),
    (["--bf16", "--fp16"], 1, True, "Only one of self.fp16: True and self.bf16 True should be True."),
    # megatron-core's own refusals (TransformerConfig.__post_init__), run last, in its words
    (["--recompute-granularity", "full"], 1, False, 'recompute_method must be "block" or "uniform"'),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2"], 2, True, "Bias in Moe is only supported when ETP==1"),
    (["--train-iters", "10", "--train-samples", "100"], 1, False, "exclusive"),
    (["--mock-data", "--data-path", "x"], 1, False, "exclusive"),
    (["--data-path", "/nonexistent/corpus"], 1, False, "/nonexistent/corpus.bin not found"),
    (["--split", "a,b"], 1, False, "--split a,b"),
    (["--min-lr", "1", "--lr", "0.1"], 1, False, "--min-lr 1.0 must be between"),
    (["--exit-signal", "SIGFOO"], 1, False, "not a signal name"),
    (["--seq-length", "512", "--max-position-embeddings", "256"], 1, False, "shorter than --seq-length"),
    (["--tokenizer-type", "NullTokenizer", "--mock-data"], 1, False, "needs --vocab-size"),
    (["--dataloader-type", "batch"], 1, False, "--dataloader-type batch pads variable-length examples: it needs --sft"),
    (["--sft"], 1, False, "--sft needs --data-path"),
    (["--sft", "--data-path", "/nonexistent.jsonl"], 1, False, "/nonexistent.jsonl not found; with --sft"),
    (["--num-layers", "four"], 1, False, "invalid int value"),
    (["--no-such-flag"], 1, False, "unrecognized arguments: --no-such-flag"),
    # a dense model too: megatron-core builds the expert groups whatever the model
    (["--expert-tensor-parallel-size", "999999999999"], 1, False,
     "expert tensor (999999999999) x expert (1) x pipeline (1) parallel sizes = 999999999999 do not divide the world"),
])
def test_validation_errors_are_one_line_with_exit_code_2(argv, world_size, gpu, message, capsys):
    err = config_error(argv, capsys, world_size=world_size, gpu=gpu)
    assert message in err, err


def test_yaml_unknown_setting_is_named(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  num_layerz: 3\n")
    with pytest.raises(SystemExit):
        parse(["--config-file", str(path)])
    assert "'model' has no setting 'num_layerz'" in capsys.readouterr().err


# train.py as a user runs it, reporting whether a process group existed when it exited: config.py imports
# megatron-core's config classes (and torch with them), but a bad flag or --help answers before any process group,
# model or dataset exists.
_CLI = ("import runpy, sys\nfor argv in %r:\n    sys.argv = ['train.py'] + argv\n"
        "    try:\n        runpy.run_path('train.py', run_name='__main__')\n"
        "    except SystemExit as e:\n        print('exit', e.code, 'process group:', sys.modules['torch.distributed'].is_initialized(), flush=True)\n"
        "        print('END', file=sys.stderr, flush=True)\n")


def _run_cli(*argvs):
    """Each command line in turn, in one process (megatron-core's import, ~5 s, paid once): (stdout lines, stderr of
    each command line)."""
    run = subprocess.run([sys.executable, "-c", _CLI % (list(argvs),)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, WORLD_SIZE="1"))
    return run.stdout, run.stderr.split("END\n")[:-1]


def test_help_and_errors_answer_before_any_process_group():
    out, errs = _run_cli(["--help"], ["--num-attention-heads", "3"])
    assert "--num-layers" in out and "exit 0 process group: False" in out
    assert "Transformer hidden size." in " ".join(out.split())  # megatron-core's docstring: asked for, read
    assert "exit 2 process group: False" in out
    assert errs[1].strip().startswith("train.py: error: --num-attention-heads 3 does not divide")
    assert "Traceback" not in errs[1]


OUT_OF_RANGE = [  # each once crashed with a traceback after the model was built (torch's AdamW/SGD, init, MLP)
    (["--adam-beta1", "-1"], "--adam-beta1 -1.0 is out of range: it must lie in [0, 1)"),
    (["--adam-beta2", "1.5"], "--adam-beta2 1.5 is out of range: it must lie in [0, 1)"),
    (["--adam-eps", "-0.5"], "--adam-eps -0.5 is out of range: it must lie in [0, inf)"),
    (["--init-method-std", "-1"], "--init-method-std -1.0 is out of range: it must lie in [0, inf)"),
    (["--ffn-hidden-size", "-1"], "--ffn-hidden-size -1 is out of range: it must lie in (0, inf)"),
    (["--sgd-momentum", "-1"], "--sgd-momentum -1.0 is out of range: it must lie in [0, inf)"),
    (["--adam-beta1", "nan"], "--adam-beta1 nan is out of range"),
    (["--num-workers", "999999999999"], "--num-workers 999999999999 would fork more DataLoader processes"),
    # sizes that validation accepts one by one but no machine holds: once 128 TB asked of the allocator, a traceback
    (["--make-vocab-size-divisible-by", "999999999999"], "the model needs at least 8,192,000.1 GB for its weights"),
    # (with the learned position table --seq-length sizes too: 999,999,999 x 256 parameters, 4,096 GB)
    (["--seq-length", "999999999"], "the model needs at least 43,008.1 GB"),
    (["--micro-batch-size", "999999999"], "the model needs at least 2,490,368.1 GB"),
    # ... and sample counts whose dataset index no machine holds (megatron-core's builder died with a traceback)
    (["--train-iters", "999999999999"], "4,400,000,000,036 samples (3,999,999,999,996 to train: --train-iters "
                                        "999999999999 x --global-batch-size 4; --eval-iters 10"),
    (["--eval-iters", "999999999999"], "20,000,000,001,180 samples (1,200 to train"),
]


def test_out_of_range_numbers_stop_before_any_process_group():
    """train.py as a user runs it, each hostile value in turn: a one-line error and exit 2, before any process group."""
    out, errs = _run_cli(*[argv for argv, _ in OUT_OF_RANGE])
    assert out.splitlines() == ["exit 2 process group: False"] * len(OUT_OF_RANGE), out
    for err, (argv, message) in zip(errs, OUT_OF_RANGE):
        assert err.startswith(f"train.py: error: {message}") and err.count("\n") == 1, (argv, err)


def test_context_parallelism_alone_gathers_keys_and_values_on_the_local_layers():
    """--context-parallel-size 2 without --cp-comm-type: Megatron-LM's p2p is transformer-engine's ring, so on the
    local layers all_gather is derived and named in the printed config; without CP the default stays p2p."""
    cfg = checks.parse_args(["--context-parallel-size", "2"], world_size=2, gpu=False)
    assert cfg.model.cp_comm_type == ["all_gather"]
    assert "--context-parallel-size 2 on the local layers" in cfg.derived["model.cp_comm_type"][1]
    plain = checks.parse_args([], world_size=1, gpu=False)
    assert plain.model.cp_comm_type == ["p2p"] and "Megatron-LM's default" in plain.derived["model.cp_comm_type"][1]


def test_a_model_that_cannot_fit_names_the_figures_and_the_flags(capsys):
    """One line with what the run needs, what the machine has, and the flags that made the size."""
    err = config_error(["--make-vocab-size-divisible-by", "999999999999"], capsys, run=True)
    assert "a vocabulary padded to 999,999,999,999 rows by --make-vocab-size-divisible-by 999999999999" in err
    assert " GB of RAM on this machine; make it smaller or split it over more devices" in err
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert f"more than the {ram / 1e9:,.1f} GB of RAM" in err
    # The same model on 2 ranks of this machine needs twice the weights: the machine's RAM is shared.
    one = int(re.search(r"needs at least ([\d,]+)", config_error(["--hidden-size", "60000", "--num-attention-heads", "4"],
                                                                 capsys, run=True))[1].replace(",", ""))
    two = int(re.search(r"needs at least ([\d,]+)", config_error(["--hidden-size", "60000", "--num-attention-heads", "4"],
                                                                 capsys, world_size=2, run=True))[1].replace(",", ""))
    # The message gives whole GB (the decimals are not read): each side within 1 GB of ~230 (the 4 layers' attention
    # weights, bounded before the rest), 0.5% at most.
    assert two == pytest.approx(2 * one, rel=0.01)


def test_the_fit_counts_the_experts_each_rank_builds(capsys):
    """512 experts of an 8192-wide model (2 layers) are 2 x 512 x 2 x 8192 x 32768 = 550 B parameters, 8.8 TB to
    train: refused, where the dense estimate (one MLP a layer, 1.6 B parameters) was not. Split over 8 expert-parallel
    ranks, each rank builds an eighth of the experts and all of the attention."""
    flags = ["--mock-data", "--num-layers", "2", "--hidden-size", "8192", "--num-attention-heads", "8", "--num-experts",
             "512", "--global-batch-size", "8"]
    err = config_error(flags, capsys, run=True)
    params = int(re.search(r"\(([\d,]+) parameters", err)[1].replace(",", ""))
    experts = 2 * 512 * 2 * 8192 * 32768
    assert experts < params < experts * 1.01, err
    assert "--num-experts 512 x --moe-ffn-hidden-size 32768 over --expert-model-parallel-size 1" in err
    import metrics

    cfg = checks.parse_args(flags, world_size=1, gpu=False)  # a config alone: accepted
    [(dense, experts)] = metrics.parameters_per_stage(cfg, 512)[2]  # one stage's (non-expert, expert) on a rank
    cfg.model.expert_model_parallel_size, cfg.model.expert_tensor_parallel_size = 8, 1
    [(dense_ep8, experts_ep8)] = metrics.parameters_per_stage(cfg, 512)[2]
    assert experts_ep8 == experts / 8 and dense_ep8 == dense


def test_a_config_larger_than_this_machine_is_accepted_and_its_run_refused(capsys):
    """LLaMA-3 70B's shape (80 layers, 8192 wide, 64 heads in 8 groups, SwiGLU 28672, 128,256-token vocabulary):
    its config parses here, so its FLOPs and theoretical memory can be computed; train.py's run of it is refused in
    one line."""
    import metrics

    flags = ["--mock-data", "--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
             "--num-query-groups", "8", "--ffn-hidden-size", "28672", "--swiglu", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "128255", "--make-vocab-size-divisible-by", "128",
             "--seq-length", "8192", "--global-batch-size", "8", "--bf16"]
    cfg = checks.parse_args(flags, world_size=1, gpu=False)
    params = metrics.parameters_per_stage(cfg, 128256)[1]
    assert 70.5e9 < params < 70.6e9  # 70.55 B, LLaMA-3 70B's count (its 8192 x 128256 embeddings untied)
    assert metrics.num_floating_point_operations(cfg, 1, 128256) > 6 * params * 8192  # 6 N per token, and attention
    err = config_error(flags, capsys, run=True)
    assert "the model needs at least" in err and "RAM on this machine" in err


def test_a_run_that_does_not_train_needs_room_for_its_weights_alone():
    """generate.py and hf.py's import (--train-iters 0) hold no gradients nor optimizer state: a model whose weights
    fit this machine's RAM is accepted there, and refused for training, where it needs four times as much."""
    import math

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    hidden = int(math.sqrt(ram / 8 / 24)) // 64 * 64  # 2 layers of ~12 h^2 parameters: weights ~ RAM / 2
    flags = ["--num-layers", "2", "--hidden-size", str(hidden), "--num-attention-heads", "4", "--mock-data"]
    checks.check_fits_in_memory(checks.config_from_flags([*flags, "--train-iters", "0"], world_size=1, gpu=False))
    with pytest.raises(config.ConfigError, match="for its weights, gradients, optimizer state and one microbatch"):
        checks.check_fits_in_memory(checks.config_from_flags(flags, world_size=1, gpu=False))


def test_the_fit_check_and_the_theoretical_memory_report_are_one_count(capsys):
    """The fit check refuses a run exactly when the theoretical memory report's weights and optimizer state (the most
    loaded shard; one stage, one rank here) and the activation floor exceed this machine's RAM, and names the report's
    parameter count. bf16 with SGD: 14 bytes a parameter (16-bit weight, fp32 gradient, fp32 main copy, momentum);
    the largest hidden size that fits is accepted, the next refused."""
    import metrics

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def cfg_of(hidden):
        return checks.config_from_flags(
            ["--mock-data", "--num-layers", "2", "--hidden-size", str(hidden), "--num-attention-heads", "4", "--bf16",
             "--optimizer", "sgd", "--position-embedding-type", "rope", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "1000", "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "1",
             "--train-iters", "1"], world_size=1, gpu=False)

    def report(hidden):  # what the report prints at setup, where the tokenizer's 1,001 rows are padded to 1,024
        cfg = cfg_of(hidden)
        cfg.padded_vocab_size = 1024
        return metrics.compute_weight_and_optimizer_memory(cfg, verbose=True) + metrics.activation_floor(cfg, 1024)

    hidden = int(math.sqrt(ram / (14 * 24))) // 64 * 64  # 2 layers of 12 h^2 parameters at 14 bytes ~ RAM
    while report(hidden) > ram:
        hidden -= 64
    while report(hidden + 64) <= ram:
        hidden += 64
    checks.check_fits_in_memory(cfg_of(hidden))
    with pytest.raises(config.ConfigError, match="for its weights, gradients, optimizer state") as refused:
        checks.check_fits_in_memory(cfg_of(hidden + 64))
    report(hidden + 64)
    printed = re.findall(r"total: ([\d.]+)M", capsys.readouterr().out)[-1]  # the report's count, in millions
    named = int(re.search(r"\(([\d,]+) parameters", str(refused.value))[1].replace(",", ""))
    assert f"{named / 1e6:.2f}" == printed


# Tensors sized by a flag that the fit check once left out, each then asked of the CPU allocator (a traceback): the
# learned position table, megatron-core's dataset's attention masks, a LoRA adapter, and the list of the layers the
# check counts itself. Sizes that no machine holds (terabytes), on a model whose weights and activations fit any.
SMALL = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "2"]
FIT_MISSES = {
    "position_table": (["--max-position-embeddings", "999999999999"],
                       "a table of --max-position-embeddings 999999999999 learned positions"),
    "attention_mask": (["--reset-attention-mask", "--seq-length", "3000000", "--max-position-embeddings", "3000000",
                        "--position-embedding-type", "rope"],
                       "--reset-attention-mask's 3,000,000 x 3,000,000 attention mask of a sample"),
    "lora": (["--peft", "lora", "--pretrained-checkpoint", "base", "--lora-dim", "999999999999"],
             "an adapter of --lora-dim 999999999999"),
    "layers": (["--num-layers", "999999999999"], "--num-layers 999999999999"),
}


@pytest.mark.parametrize("name", list(FIT_MISSES))
def test_every_tensor_a_flag_sizes_is_in_the_fit(name, capsys):
    flags, named = FIT_MISSES[name]
    err = config_error([*SMALL, *flags], capsys, run=True)
    assert err.startswith("train.py: error: ") and named in err and "RAM on this machine" in err, err


def test_rotary_positions_build_no_table_whatever_the_longest_position():
    """megatron-core builds the position table for learned absolute positions only (LanguageModelEmbedding); RoPE's
    angles are computed for the sequence given: the same --max-position-embeddings is accepted."""
    checks.parse_args([*SMALL, "--max-position-embeddings", "999999999999", "--position-embedding-type", "rope"],
                      world_size=1, gpu=False, run=True)


# --- scheduler lengths, compatibility checks, determinism, the config summary, NVIDIA service configs -----------


@pytest.mark.parametrize("argv, expected", [
    # iteration-based: lengths are iterations x global batch (8); no warmup by default, as Megatron-LM
    ([], dict(lr_decay_steps=800, lr_warmup_steps=0, wd_incr_steps=800, wsd_decay_steps=None)),
    (["--lr-decay-iters", "50", "--lr-warmup-iters", "5"], dict(lr_decay_steps=400, lr_warmup_steps=40, wd_incr_steps=800)),
    (["--lr-warmup-fraction", "0.15"], dict(lr_decay_steps=800, lr_warmup_steps=120.0, wd_incr_steps=800)),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "10"], dict(lr_decay_steps=800, wsd_decay_steps=80)),
    (["--lr-decay-style", "WSD"], dict(wsd_decay_steps=800)),  # the whole decay, as Bridge
    (["--train-iters", "2", "--lr-warmup-iters", "20"], dict(lr_decay_steps=16, lr_warmup_steps=15, wd_incr_steps=16)),  # warmup capped
    # sample-based: sample counts as given
    (["--train-samples", "1000"], dict(lr_decay_steps=1000, lr_warmup_steps=0, wd_incr_steps=1000)),
    (["--train-samples", "1000", "--lr-decay-samples", "600", "--lr-warmup-samples", "64"],
     dict(lr_decay_steps=600, lr_warmup_steps=64, wd_incr_steps=1000)),
    (["--train-samples", "1000", "--lr-warmup-fraction", "0.25"], dict(lr_decay_steps=1000, lr_warmup_steps=250.0)),
    (["--train-samples", "1000", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "200"],
     dict(lr_decay_steps=1000, wsd_decay_steps=200)),
])
def test_scheduler_steps_for_iteration_and_sample_based_training(argv, expected):
    """Megatron-LM's get_optimizer_param_scheduler / Bridge's _calculate_scheduler_steps, in samples."""
    argv = argv if "--train-samples" in argv or "--train-iters" in argv else ["--train-iters", "100", *argv]
    cfg = parse(["--micro-batch-size", "4", "--global-batch-size", "8", *argv])
    assert {k: getattr(cfg.scheduler, k) for k in expected} == expected
    if "--train-samples" in argv:
        assert cfg.train.train_iters == 1000 // 8


def test_sample_based_run_config_yaml_round_trips(tmp_path):
    cfg = parse(["--train-samples", "1000", "--global-batch-size", "8", "--micro-batch-size", "4"])
    path = tmp_path / "run_config.yaml"
    path.write_text(config.to_yaml(cfg))  # holds train_samples and the train_iters derived from it
    assert parse(["--config-file", str(path)]).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("argv, world_size, gpu, message", [
    # training/scheduler compatibility (Bridge _validate_training_scheduler_compatibility, Megatron-LM validate_args)
    (["--train-samples", "100", "--lr-decay-iters", "10"], 1, False,
     "--lr-decay-iters is for iteration-based training; with --train-samples use --lr-decay-samples"),
    (["--train-samples", "100", "--lr-warmup-iters", "5"], 1, False, "with --train-samples use --lr-warmup-samples"),
    (["--train-iters", "10", "--lr-decay-samples", "100"], 1, False,
     "--lr-decay-samples is for sample-based training (--train-samples); with --train-iters use --lr-decay-iters"),
    (["--lr-warmup-samples", "16"], 1, False, "with --train-iters use --lr-warmup-iters"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], 1, False, "are exclusive"),
    (["--train-samples", "100", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "8"], 1, False, "are exclusive"),
    (["--lr-decay-iters", "0"], 1, False, "--lr-decay-iters must be positive"),
    (["--start-weight-decay", "0.1", "--end-weight-decay", "0.01", "--weight-decay-incr-style", "linear"], 1, False,
     "weight decay can only grow"),
    (["--lr-warmup-init", "0.1", "--lr", "0.01"], 1, False, "--lr-warmup-init 0.1 is above --lr 0.01"),
    # context parallelism (Bridge _validate_cp_comm_type and validate)
    (["--context-parallel-size", "2", "--seq-length", "250"], 2, True,
     "--seq-length 250 must be a multiple of 2 x --context-parallel-size = 4"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], 2, True, "needs --hierarchical-context-parallel-sizes"),
    (["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "3"], 4, True,
     "multiply to 6, not --context-parallel-size 4"),
    (["--cp-comm-type", "p2p", "a2a"], 1, False, "give one for all layers or one per layer (--num-layers 4)"),
    (["--cp-comm-type", "ring"], 1, False, "--cp-comm-type ring: expected p2p, all_gather, a2a, a2a+p2p"),
    # determinism, logging
    (["--deterministic-mode", "--cross-entropy-loss-fusion"], 1, False,
     "--deterministic-mode: --cross-entropy-loss-fusion is not deterministic; drop it"),
    (["--logging-level", "-1"], 1, False, "--logging-level must be a logging level"),
    # NVIDIA service configs: their own constraints
    (["--calc-ft-timeouts"], 1, False, "need --enable-ft-package"),
    (["--inprocess-restart", "--inprocess-soft-timeout", "100"], 1, False,
     "--inprocess-soft-timeout 100.0 must be below --inprocess-hard-timeout 90.0"),
    (["--inprocess-restart", "--inprocess-active-world-size", "4"], 2, False, "must be between 1 and the world size 2"),
])
def test_compatibility_errors_are_one_line(argv, world_size, gpu, message, capsys):
    err = config_error(argv, capsys, world_size=world_size, gpu=gpu)
    assert message in err, err


@pytest.mark.parametrize("name, value", [("NCCL_ALGO", "Tree"), ("NCCL_ALGO", "Ring,Tree"),
                                         ("CUBLAS_WORKSPACE_CONFIG", ":0:0"), ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")])
def test_deterministic_mode_refuses_a_nondeterministic_environment(name, value, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    parse([])  # only --deterministic-mode cares
    err = config_error(["--deterministic-mode"], capsys)
    assert f"--deterministic-mode: {name}={value}" in err, err


def test_deterministic_mode_accepts_the_deterministic_environment(monkeypatch):
    for name, value in DETERMINISM_ENV_VAR_DEFAULTS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NCCL_ALGO", "Ring,^NVLS")
    assert parse(["--deterministic-mode"]).model.deterministic_mode


SERVICES = [  # (how it is enabled, the package named)
    (["--enable-ft-package"], None, "nvidia-resiliency-ext"),
    (["--inprocess-restart"], None, "nvidia-resiliency-ext"),
    ([], "nvrx_straggler:\n  enabled: true\n", "nvidia-resiliency-ext"),
    ([], "tensor_inspect:\n  enabled: true\n", "nvdlfw-inspect"),
]


@pytest.mark.parametrize("argv, yaml_text, package", SERVICES)
def test_enabling_an_nvidia_service_names_its_package(argv, yaml_text, package, tmp_path, capsys):
    if checks.package_installed(package.replace("-", "_")):
        pytest.skip(f"{package} is installed here; the message then says this loop does not run the service")
    if yaml_text:
        (tmp_path / "services.yaml").write_text(yaml_text)
        argv = argv + ["--config-file", str(tmp_path / "services.yaml")]
    err = config_error(argv, capsys)
    assert f"pip install {package}" in err, err


def test_nvidia_services_are_off_by_default_and_load_from_yaml(tmp_path):
    cfg = parse([])
    assert not (cfg.ft.enable_ft_package or cfg.nvrx_straggler.enabled or cfg.inprocess_restart.enabled
                or cfg.tensor_inspect.enabled)
    path = tmp_path / "bridge.yaml"
    path.write_text("nvrx_straggler:\n  enabled: false\n  report_time_interval: 60\n"
                    "inprocess_restart:\n  soft_timeout: 30\ntensor_inspect:\n  features: {a: 1}\n")
    cfg = parse(["--config-file", str(path), "--inprocess-hard-timeout", "45"])
    assert cfg.nvrx_straggler.report_time_interval == 60 and cfg.tensor_inspect.features == {"a": 1}
    assert (cfg.inprocess_restart.soft_timeout, cfg.inprocess_restart.hard_timeout) == (30, 45)
    assert "nvrx_straggler:" in config.to_yaml(cfg)


def test_log_non_default_values_switches_the_printed_config():
    import io

    argv = ["--num-layers", "2", "--train-samples", "64", "--global-batch-size", "8", "--micro-batch-size", "4"]
    full, summary = io.StringIO(), io.StringIO()
    checks.print_config(parse(argv), file=full)
    checks.print_config(parse(argv + ["--log-non-default-values"], world_size=2), file=summary)
    full, summary = full.getvalue(), summary.getvalue()
    assert "  model.hidden_size ...." in full and "Non-Default" not in full
    assert "[model] Non-default values:\n" in summary and "  num_layers: 2  (default: 4)\n" in summary
    assert "  train_samples: 64  (default: None)\n" in summary  # and the values validation filled in:
    assert "  train_iters: 8  (default: None)\n" in summary and "  data_parallel_size: 2\n" in summary
    assert "  num_microbatches: 1\n" in summary and "  scheduler.lr_decay_steps: 64\n" in summary
    assert "  hidden_size:" not in summary and "[ft]" not in summary  # left at their defaults
    assert len(summary.splitlines()) < len(full.splitlines()) / 2


# --- Bridge's section names: mixed_precision, validation, comm_overlap, the dataset classes -----------------


def _yaml(tmp_path, text, *flags):
    path = tmp_path / "bridge.yaml"
    path.write_text(text)
    return checks.parse_args(["--config-file", str(path), *flags], world_size=1, gpu=False)


def test_a_bridge_style_yaml_with_each_section_loads(tmp_path):
    cfg = _yaml(tmp_path, "mixed_precision: bf16_mixed\n"
                          "validation:\n  eval_iters: 3\n  eval_interval: 7\n"
                          "comm_overlap:\n  tp_comm_overlap: false\n  overlap_grad_reduce: true\n"
                          "dataset:\n  dataloader_type: cyclic\n  num_workers: 1\n  mock_data: true\n")
    assert cfg.model.bf16 and not cfg.model.fp16 and cfg.ddp.grad_reduce_in_fp32
    assert (cfg.validation.eval_iters, cfg.validation.eval_interval) == (3, 7)
    assert cfg.ddp.overlap_grad_reduce
    assert (cfg.dataset.dataloader_type, cfg.dataset.num_workers, cfg.dataset.mock) == ("cyclic", 1, True)
    # The resolved config written to run_config.yaml reads back the same.
    again = _yaml(tmp_path, config.to_yaml(cfg))
    assert again.to_dict() == cfg.to_dict()


def test_mixed_precision_as_fields_and_the_fp16_recipe(tmp_path):
    from model import megatron_ddp_config

    cfg = _yaml(tmp_path, "mixed_precision:\n  fp16: true\n  initial_loss_scale: 1024\n  hysteresis: 3\n")
    assert cfg.model.fp16 and cfg.optimizer.initial_loss_scale == 1024 and cfg.optimizer.hysteresis == 3
    recipe = _yaml(tmp_path, "mixed_precision: fp16-mixed\n")  # Bridge's hyphen alias
    assert recipe.model.fp16 and megatron_ddp_config(recipe).grad_reduce_in_fp32 is False  # as Bridge's fp16_mixed
    # Megatron-LM reduces fp16 gradients in fp16 unless --accumulate-allreduce-grads-in-fp32 (bf16: in fp32).
    assert megatron_ddp_config(_yaml(tmp_path, "model:\n  fp16: true\n")).grad_reduce_in_fp32 is False
    assert megatron_ddp_config(_yaml(tmp_path, "model:\n  bf16: true\n")).grad_reduce_in_fp32 is True


@pytest.mark.parametrize("text, message", [
    ("validation:\n  eval_iterz: 3\n", "'validation' has no setting 'eval_iterz'"),
    ("mixed_precision:\n  bf17: true\n", "'mixed_precision' has no setting 'bf17'"),
    ("comm_overlap:\n  tp_comm_overlapp: true\n", "'comm_overlap' has no setting 'tp_comm_overlapp'"),
    ("mixed_precision: bf8_mixed\n", "mixed_precision: 'bf8_mixed' is not a recipe"),
    ("mixed_precision: bf16_with_fp8_delayed_scaling_mixed\n", "needs transformer-engine's fp8/fp4 on a GPU"),
    ("comm_overlap:\n  tp_comm_overlap: true\n", "comm_overlap.tp_comm_overlap needs transformer-engine's userbuffers "
                                                 "on GPUs (none visible here)"),
    ("comm_overlap:\n  bucket_size: 1000\n", "comm_overlap.bucket_size 1000 is not supported by this trainer"),
    ("validation:\n  full_validation: true\n", "validation.full_validation True is not supported by this trainer"),
])
def test_bridge_sections_refuse_with_one_line_naming_the_section(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert message in config_error(["--config-file", str(path)], capsys)


def test_bridge_dataset_classes_and_runtime_config_update():
    mock = config.ConfigContainer(dataset=config.MockGPTDatasetConfig(num_workers=0))
    assert checks.runtime_config_update(mock, world_size=1, gpu=False) is mock
    assert mock.dataset.mock and isinstance(mock.dataset, config.GPTDatasetConfig)
    sft = config.FinetuningDatasetConfig(data_path=["train.jsonl"])
    assert sft.sft and isinstance(sft, config.DataloaderConfig) and sft.num_workers == 2
    assert config.get_mixed_precision_config("bf16_mixed").bf16


def test_help_says_each_default_this_trainer_decides_and_why():
    """One table decides a default that differs from megatron-core's (config.DEFAULTS), and --help prints its reason;
    no flag whose value the run picks says "(default: None)"; a signal is shown by its name."""
    import dataclasses

    parser = config.build_parser()
    helps = {dest: " ".join(a.help.split()) for dest, a in checks.flag_actions(parser).items()}
    decided = [key for key in config.DEFAULTS if key in helps]
    assert len(decided) > 40
    for key in decided:  # the command line's own default where it is Megatron-LM's (FLAG_DEFAULTS)
        value, why = config.FLAG_DEFAULTS.get(key) or config.DEFAULTS[key]
        assert " ".join(why.split()) in helps[key] and "(default: None)" not in helps[key], key
    for argv, world_size in (([], 1), (["--num-experts", "4", "--swiglu", "--train-samples", "64", "--context-parallel-size", "2"], 2)):
        cfg = checks.config_from_flags(argv, world_size=world_size, gpu=False)
        for setting in cfg.filled_in:
            assert "(default: None)" not in helps.get(setting, ""), setting
    assert "(default: SIGTERM)" in helps["train.exit_signal"] and "(default: 15)" not in helps["train.exit_signal"]
    assert parser._option_string_actions["--ckpt-format"].choices == ["torch", "torch_dist", "fsdp_dtensor", "torch_dcp"]
    assert "biases and norms" in helps["optimizer.weight_decay"]
    assert "None is refused" in helps["validation.eval_interval"] and "will not run" not in helps["validation.eval_iters"]
    # megatron-core's fields whose default Bridge's class changes take it from DEFAULTS, where the reason is
    for section, name in (("checkpoint", "use_persistent_ckpt_worker"), ("checkpoint", "strict_fsdp_dtensor_load"),
                          ("rerun_state_machine", "rerun_mode")):
        sub = getattr(config.ConfigContainer(), section)
        assert f"{section}.{name}" in config.DEFAULTS
        assert "help" not in next(f for f in dataclasses.fields(sub) if f.name == name).metadata
        assert getattr(sub, name) == config.DEFAULTS[f"{section}.{name}"][0]


def test_one_line_of_defaults_changes_the_default_of_every_section(monkeypatch):
    """config.DEFAULTS applies to each section the container builds (docs/fork.md: a default changed in one place):
    a changed entry for one plain field of every section is that section's default in ConfigContainer(), which the
    run starts from. Not covered: fields that megatron-core's __post_init__ derives from others."""
    import dataclasses

    sections = [f for f in dataclasses.fields(config.ConfigContainer)
                if f.metadata.get("section", True) and f.default_factory is not dataclasses.MISSING]
    changed = {}
    for f in sections:
        sub = getattr(config.ConfigContainer(), f.name)
        if not dataclasses.is_dataclass(sub):
            continue
        plain = next((x for x in dataclasses.fields(sub) if x.init and type(getattr(sub, x.name)) in (bool, int)), None)
        if plain is None:
            continue
        value = getattr(sub, plain.name)
        changed[(f.name, plain.name)] = (not value) if type(value) is bool else value + 7
        monkeypatch.setitem(config.DEFAULTS, f"{f.name}.{plain.name}", (changed[(f.name, plain.name)], "a test's"))
    assert {"rng", "profiling", "straggler", "train", "model"} <= {section for section, _ in changed}
    built = config.ConfigContainer()
    assert {key: getattr(getattr(built, key[0]), key[1]) for key in changed} == changed


def test_the_generated_flags_megatron_lm_does_not_have_are_not_flags():
    flags = {o for a in config.build_parser()._actions for o in a.option_strings}
    assert {"--no-save-optim", "--no-save-rng", "--no-load-optim", "--no-load-rng", "--no-mmap-bin-files"} <= flags
    assert not {"--disable-save-optim", "--disable-save-rng", "--disable-load-optim", "--disable-load-rng",
                "--disable-mmap-bin-files"} & flags
