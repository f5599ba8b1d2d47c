"""Megatron-LM's command lines (arguments.py, core_v0.16.1) on this trainer: its GPT example scripts parse and
validate (tests/fixtures/megatron_lm_scripts/), the flags those scripts carry mean what they mean there (or are
named once as inert, or refused with one line that says why), flags of machinery this trainer does not have are
refused by name, and every setting that changes what is computed defaults to Megatron-LM's default.

What Megatron-LM's own parser says is written here as data (its defaults, with where each is declared): CI has no
Megatron-LM checkout."""

import dataclasses
import io
import os
import re
import shlex
import subprocess
import sys

import pytest

import config
from conftest import ROOT, TINY, config_error

SCRIPTS = os.path.join(ROOT, "tests", "fixtures", "megatron_lm_scripts")
GPT3 = "train_gpt3_175b_distributed.flags"
LLAMA3_FP8 = "train_llama3_8b_h100_fp8.flags"


def script_flags(name: str, tmp_path, drop: tuple = ()) -> list:
    """The flags of a fixture script, $TMP made tmp_path, without the lines whose flag starts with one of `drop`."""
    with open(os.path.join(SCRIPTS, name)) as fh:
        lines = [line for line in fh.read().replace("$TMP", str(tmp_path)).splitlines()
                 if not (drop and line.startswith(drop))]
    return shlex.split("\n".join(lines), comments=True)


def unknown_flags(argv: list) -> list:
    """What our parser does not recognise in argv (parse_known_args' leftovers)."""
    return config.build_parser().parse_known_args(argv)[1]


@pytest.fixture
def without_te(monkeypatch):
    """This machine as one without transformer-engine, whatever is installed."""
    real = config.package_installed
    monkeypatch.setattr(config, "package_installed", lambda module: module != "transformer_engine" and real(module))


@pytest.fixture
def with_te(monkeypatch):
    """This machine as a GPU machine with transformer-engine installed (validation only looks the package up)."""
    real = config.package_installed
    monkeypatch.setattr(config, "package_installed", lambda module: module == "transformer_engine" or real(module))


def printed_config(cfg) -> str:
    out = io.StringIO()
    config.print_config(cfg, out)
    return out.getvalue()


# --- 1. Megatron-LM's example scripts, shrunk, as test data -------------------------------------------------------


@pytest.mark.parametrize("gpu", [False, True])
def test_gpt3_175b_script_parses_and_validates_for_its_128_rank_layout(tmp_path, gpu):
    argv = script_flags(GPT3, tmp_path)
    assert unknown_flags(argv) == []
    cfg = config.config_from_flags(argv, world_size=128, gpu=gpu)  # 8 GPUs x 16 nodes: tensor 8 x pipeline 16
    m, t, o, s = cfg.model, cfg.train, cfg.optimizer, cfg.scheduler
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, cfg.data_parallel_size) == (8, 16, 1)
    assert (m.num_layers, m.num_attention_heads, m.kv_channels, m.ffn_hidden_size) == (16, 8, 8, 256)
    assert m.fp16 and not t.check_for_nan_in_loss_and_grad  # dynamic loss scaling, as Megatron-LM
    assert cfg.ddp.grad_reduce_in_fp32 is False  # fp16 gradients, as Megatron-LM (no --accumulate-allreduce-grads-in-fp32)
    assert (t.global_batch_size, t.rampup_batch_size, t.train_iters) == (48, [16, 16, 480], 20)
    assert (o.lr, o.min_lr, o.weight_decay, o.adam_beta2, o.clip_grad) == (6e-5, 6e-6, 0.1, 0.95, 1.0)
    assert m.init_method_std == 0.006 and m.attention_backend == "auto"
    assert s.lr_decay_style == "cosine" and s.lr_decay_steps == 17 * 48
    assert s.lr_warmup_steps == pytest.approx(0.001 * 17 * 48)  # --lr-warmup-fraction of the decay
    assert cfg.dataset.split == "949,50,1" and cfg.checkpoint.save == str(tmp_path / "checkpoints")


def test_gpt3_175b_scripts_gpt2_bpe_files_are_one_line_with_the_conversion(tmp_path, capsys):
    """The script's own tokenizer lines (the fixture gives an offline tokenizer instead): accepted by the parser,
    refused by validation with the one command that turns them into a tokenizer.json this trainer reads."""
    vocab, merges = str(tmp_path / "gpt2-vocab.json"), str(tmp_path / "gpt2-merges.txt")
    argv = [a for a in script_flags(GPT3, tmp_path, drop=("--tokenizer-type",))] + [
        "--vocab-file", vocab, "--merge-file", merges]
    assert unknown_flags(argv) == []
    err = config_error(argv, capsys, world_size=128)
    assert f"T('{vocab}', '{merges}').save('tokenizer.json')" in err
    assert "--tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json" in err


def test_llama3_8b_fp8_script_fp8_lines_are_one_line_without_transformer_engine(tmp_path, capsys, without_te):
    argv = script_flags(LLAMA3_FP8, tmp_path)
    assert unknown_flags(argv) == []
    err = config_error(argv, capsys, world_size=8, gpu=True)
    assert err == ("train.py: error: --fp8-format hybrid: FP8 runs in transformer-engine's layers, and "
                   "transformer-engine is not installed; drop the --fp8-* flags (--bf16 trains without them)\n")
    # Without the FP8 lines, the one thing left that needs transformer-engine's layers is --apply-layernorm-1p.
    err = config_error(script_flags(LLAMA3_FP8, tmp_path, drop=("--fp8-",)), capsys, world_size=8, gpu=True)
    assert err.startswith("train.py: error: --apply-layernorm-1p (zero-centred gamma) needs transformer-engine layers")


def test_llama3_8b_fp8_script_validates_without_its_fp8_lines(tmp_path, capsys, with_te):
    """On the GPU machine with transformer-engine the script is written for, every line but the FP8 ones validates,
    and each means what it means in Megatron-LM (or is named once as inert)."""
    cfg = config.config_from_flags(script_flags(LLAMA3_FP8, tmp_path, drop=("--fp8-",)), world_size=8, gpu=True)
    m, t, s, d = cfg.model, cfg.train, cfg.scheduler, cfg.dataset
    assert m.transformer_impl == "transformer_engine" and m.apply_layernorm_1p and m.attention_backend == "fused"
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels, m.ffn_hidden_size) == (4, 1, 16, 224)
    assert m.swiglu and not m.add_bias_linear and m.untie_embeddings_and_output_weights and m.rotary_base == 1000000
    assert m.calculate_per_token_loss and m.cross_entropy_loss_fusion and not m.sequence_parallel  # TP 1: nothing to split
    assert m.bf16 and cfg.ddp.grad_reduce_in_fp32 is False  # --grad-reduce-in-bf16
    assert cfg.ddp.use_distributed_optimizer and cfg.ddp.overlap_grad_reduce and cfg.ddp.overlap_param_gather
    assert (cfg.data_parallel_size, t.global_batch_size, t.train_iters) == (8, 16, 20)
    assert (s.lr_decay_steps, s.lr_warmup_steps, s.decoupled_lr, s.decoupled_min_lr) == (319, 16, 5e-4, 4.5e-5)
    assert d.mock_data and d.split == "99,1,0" and cfg.tokenizer.vocab_size == 1024
    assert cfg.profiling.use_nsys_profiler and t.empty_unused_memory_level == 1
    inert = [line for line in printed_config(cfg).splitlines() if line.startswith(" inert here")]
    assert inert == [" inert here (Megatron-LM placement, memory and deprecated switches with no effect in this "
                     "trainer): --use-mcore-models --empty-unused-memory-level 1 --no-mmap-bin-files "
                     "--no-create-attention-mask-in-dataloader --tiktoken-pattern v2"]
    # With its FP8 lines and transformer-engine installed: still one line, this trainer does not drive FP8.
    err = config_error(script_flags(LLAMA3_FP8, tmp_path), capsys, world_size=8, gpu=True)
    assert "--fp8-format hybrid: this trainer does not drive transformer-engine's FP8" in err


def test_llama3_8b_fp8_script_stops_before_torch_loads(tmp_path):
    """train.py as a user runs it with the whole script: one line, exit 2, torch never imported."""
    code = ("import runpy, sys; sys.argv = ['train.py'] + sys.argv[1:]\n"
            "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
            "except SystemExit as e:\n    print('exit', e.code, 'torch imported:', 'torch' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code, *script_flags(LLAMA3_FP8, tmp_path)], cwd=ROOT, text=True,
                         capture_output=True, env=dict(os.environ, WORLD_SIZE="8"), timeout=120)
    assert run.stdout.strip() == "exit 2 torch imported: False", (run.stdout, run.stderr)
    assert run.stderr.startswith("train.py: error: --fp8-format hybrid") and run.stderr.count("\n") == 1


# --- 2. each flag the example scripts carry that this parser used to reject -----------------------------------------


@pytest.mark.parametrize("flags", [
    ["--use-mcore-models"], ["--vocab-file", "v.json"], ["--merge-file", "m.txt"], ["--group-query-attention"],
    ["--apply-layernorm-1p"], ["--decoupled-lr", "5e-4"], ["--decoupled-min-lr", "4.5e-5"], ["--grad-reduce-in-bf16"],
    ["--calculate-per-token-loss"], ["--empty-unused-memory-level", "1"], ["--fp8-format", "hybrid"],
    ["--fp8-amax-history-len", "1024"], ["--fp8-amax-compute-algo", "max"], ["--fp8-param-gather"],
    ["--tiktoken-pattern", "v2"], ["--no-create-attention-mask-in-dataloader"], ["--no-mmap-bin-files"],
    ["--attention-backend", "fused"], ["--attention-backend", "flash"], ["--attention-backend", "unfused"],
    ["--accumulate-allreduce-grads-in-fp32"], ["--recompute-activations"], ["--tokenizer-type", "GPT2BPETokenizer"],
])
def test_the_example_scripts_flags_are_accepted_by_the_parser(flags):
    assert unknown_flags(flags) == []


@pytest.mark.parametrize("argv, num_query_groups", [
    ([], 4),                                                      # multi-head attention
    (["--group-query-attention"], 1),                             # Megatron-LM's --num-query-groups default
    (["--group-query-attention", "--num-query-groups", "2"], 2),  # Megatron-LM's way
    (["--num-query-groups", "2"], 2),                             # ours: the groups alone suffice
])
def test_group_query_attention_as_megatron_lm(argv, num_query_groups):
    assert config.parse_args(argv, world_size=1, gpu=False).model.num_query_groups == num_query_groups


@pytest.mark.parametrize("argv, fp32", [
    ([], False),                                          # fp32 training: fp32 gradients either way
    (["--bf16"], True),                                   # Megatron-LM: bf16 accumulates and reduces in fp32
    (["--bf16", "--grad-reduce-in-bf16"], False),
    (["--fp16"], False),                                  # Megatron-LM: fp16 gradients unless asked
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], True),
])
def test_gradient_reduction_dtype_follows_megatron_lm(argv, fp32):
    from model import megatron_ddp_config

    cfg = config.parse_args(argv, world_size=1, gpu=False)
    assert megatron_ddp_config(cfg).grad_reduce_in_fp32 is fp32


def test_decoupled_lr_gives_the_embedding_and_output_layer_their_own_schedule(single_rank_groups):
    """--decoupled-lr / --decoupled-min-lr as megatron-core's get_standard_config_overrides: the parameters megatron-core
    marks is_embedding_or_output_parameter follow their own peak and final rate; the rest keep --lr / --min-lr."""
    import train
    from model import build_model, build_optimizer, unwrap, wrap_model

    cfg = config.parse_args([*TINY, "--untie-embeddings-and-output-weights", "--lr-warmup-iters", "0",
                             "--lr-decay-style", "linear", "--train-iters", "10", "--lr", "1e-3", "--min-lr", "1e-4",
                             "--decoupled-lr", "5e-3", "--decoupled-min-lr", "5e-4"], world_size=1, gpu=False)
    model = wrap_model(cfg, build_model(cfg, 256))
    optimizer = build_optimizer(cfg, model)
    scheduler = train.build_scheduler(cfg, optimizer)
    gpt = unwrap(model[0])
    decoupled = {id(gpt.embedding.word_embeddings.weight), id(gpt.output_layer.weight)}
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for _ in range(5):
        scheduler.step(increment=cfg.train.global_batch_size)
    for name, p in gpt.named_parameters():  # halfway down the linear decay
        peak, low = (5e-3, 5e-4) if id(p) in decoupled else (1e-3, 1e-4)
        assert group_of[id(p)]["lr"] == pytest.approx(low + (peak - low) / 2), name


@pytest.mark.parametrize("argv, message", [
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr ends the schedule of --decoupled-lr; add --decoupled-lr"),
    (["--decoupled-lr", "1e-5", "--min-lr", "1e-4"], "--decoupled-lr 1e-05 is below its minimum 0.0001 (--min-lr)"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 reduces the gradients of --bf16 training in bf16; add --bf16"),
    (["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"],
     "--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 are exclusive"),
    (["--recompute-activations", "--recompute-granularity", "full", "--recompute-method", "uniform"],
     "--recompute-activations means --recompute-granularity selective, not full"),
    (["--reset-attention-mask", "--no-create-attention-mask-in-dataloader"],
     "--reset-attention-mask is an attention mask the dataloader builds"),
    (["--fp8-amax-history-len", "1024"], "--fp8-amax-history-len 1024 sets FP8 training, but --fp8-format is not set"),
    (["--fp8-param-gather"], "--fp8-param-gather sets FP8 training, but --fp8-format is not set"),
    (["--mock-data", "--tokenizer-type", "SentencePieceTokenizer"],
     "--tokenizer-type SentencePieceTokenizer is Megatron-LM's and not built in here"),
    (["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8", "--merge-file", "m.txt"],
     "--tokenizer-type GPT2BPETokenizer (--vocab-file, --merge-file) is not built in here"),
    (["--apply-layernorm-1p", "--transformer-impl", "local"], "--apply-layernorm-1p (zero-centred gamma) needs"),
])
def test_what_cannot_mean_its_flag_here_is_one_line(argv, message, capsys):
    err = config_error(argv, capsys, gpu=True)
    assert err.startswith(f"train.py: error: {message}"), err


def test_recompute_activations_is_selective_recomputation():
    assert config.parse_args(["--recompute-activations"], world_size=1, gpu=False).model.recompute_granularity == "selective"


def test_the_gpt2_bpe_conversion_the_error_gives_makes_a_tokenizer_json_that_runs(tmp_path, capsys):
    """The command the GPT2BPETokenizer error prints, run as printed on a GPT-2-style vocab.json and merges.txt,
    writes a tokenizer.json that --tokenizer-type HuggingFaceTokenizer reads, end-of-document token included."""
    tokenizers = pytest.importorskip("tokenizers")
    trained = tokenizers.ByteLevelBPETokenizer()
    trained.train_from_iterator(["the python language, the python documentation"] * 20, vocab_size=300,
                                special_tokens=["<|endoftext|>"])
    vocab, merges = trained.save_model(str(tmp_path))  # vocab.json, merges.txt: what GPT-2's files are
    err = config_error(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges], capsys)
    command = re.search(r'python -c "([^"]+)"', err).group(1)
    subprocess.run([sys.executable, "-c", command], cwd=tmp_path, check=True, timeout=60)
    tokenizer_json = str(tmp_path / "tokenizer.json")
    cfg = config.parse_args(["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                             tokenizer_json], world_size=1, gpu=False)
    from data import build_tokenizer

    tokenizer = build_tokenizer(cfg)
    assert tokenizer.eod == trained.token_to_id("<|endoftext|>")
    assert tokenizer.detokenize(tokenizer.tokenize("the python language")) == "the python language"


# --- 3. inert switches, megatron-core's TransformerConfig fields, refused machinery ---------------------------------


def test_inert_switches_are_named_once_and_only_where_they_are_inert(with_te):
    fused = ["--no-persist-layer-norm", "--no-rope-fusion"]
    other = ["--use-mcore-models", "--attention-backend", "flash", "--empty-unused-memory-level", "2",
             "--no-mmap-bin-files", "--no-create-attention-mask-in-dataloader", "--tiktoken-pattern", "v1"]
    cfg = config.parse_args([*fused, *other], world_size=1, gpu=False)  # local layers: SDPA picks its own kernel
    lines = [line for line in printed_config(cfg).splitlines() if line.startswith(" inert here")]
    assert lines == [" inert here (fused GPU kernels the local layers never use): --no-persist-layer-norm --no-rope-fusion",
                     " inert here (Megatron-LM placement, memory and deprecated switches with no effect in this "
                     "trainer): " + " ".join(other)]
    # transformer-engine layers: --attention-backend picks TE's kernel, it is not inert
    cfg = config.parse_args(["--attention-backend", "flash"], world_size=1, gpu=True)
    assert cfg.model.transformer_impl == "transformer_engine" and config.inert_flags(cfg) == []
    assert "inert here" not in printed_config(config.parse_args([], world_size=1, gpu=False))


def test_transformer_config_extras_are_megatron_core_fields(with_te):
    """transformer_config_extras: the TransformerConfig fields of --calculate-per-token-loss, --apply-layernorm-1p
    and --attention-backend, accepted by megatron-core's TransformerConfig on top of model.transformer_config's."""
    from megatron.core.transformer.enums import AttnBackend

    from model import transformer_config

    cfg = config.parse_args(["--calculate-per-token-loss"], world_size=1, gpu=False)
    extras = config.transformer_config_extras(cfg)
    assert extras == dict(calculate_per_token_loss=True, layernorm_zero_centered_gamma=False)
    assert dataclasses.replace(transformer_config(cfg), **extras).calculate_per_token_loss
    cfg = config.parse_args(["--apply-layernorm-1p", "--attention-backend", "fused"], world_size=1, gpu=True)
    extras = config.transformer_config_extras(cfg)
    assert extras == dict(calculate_per_token_loss=False, layernorm_zero_centered_gamma=True,
                          attention_backend=AttnBackend.fused)
    tc = dataclasses.replace(transformer_config(cfg), **extras)
    assert tc.layernorm_zero_centered_gamma and tc.attention_backend == AttnBackend.fused


@pytest.mark.parametrize("argv, machinery", [
    (["--num-experts", "8"], "Mixture-of-Experts layers"),
    (["--moe-router-topk", "2"], "Mixture-of-Experts layers"),
    (["--expert-model-parallel-size", "2"], "Mixture-of-Experts layers"),
    (["--multi-latent-attention"], "multi-latent attention (MLA)"),
    (["--kv-lora-rank=512"], "multi-latent attention (MLA)"),
    (["--mtp-num-layers", "1"], "multi-token prediction"),
    (["--mamba-state-dim", "64"], "Mamba, hybrid and experimental attention layers"),
    (["--grpo-group-size", "4"], "reinforcement learning (GRPO)"),
    (["--inference-max-requests", "4"], "the inference server"),
    (["--img-h", "224"], "vision models"),
    (["--encoder-num-layers", "2"], "T5, BERT, retro and retriever models"),
    (["--fp4-format", "nvfp4"], "FP4 training (transformer-engine's)"),
    (["--cuda-graph-impl", "local"], "CUDA graphs"),
    (["--tp-comm-overlap"], "transformer-engine's userbuffer communication overlap"),
    (["--use-torch-fsdp2"], "FSDP"),
    (["--use-legacy-models"], "Megatron-LM's legacy models"),
    (["--muon-momentum", "0.9"], "the Muon optimizer"),
])
def test_flags_of_machinery_this_trainer_lacks_are_refused_by_name(argv, machinery, capsys):
    err = config_error(["--num-layers", "2", *argv], capsys)
    flag = argv[0].split("=")[0]
    assert err.startswith(f"train.py: error: {flag} is a Megatron-LM setting of {machinery}"), err
    assert "which this trainer does not have (it trains dense GPT models); drop it" in err


def test_a_flag_nobody_has_is_still_argparses_one_line(capsys):
    assert config_error(["--no-such-flag", "3"], capsys) == \
        "train.py: error: unrecognized arguments: --no-such-flag 3 (see --help)\n"


# --- 4. defaults: Megatron-LM's for every setting that changes what is computed -----------------------------------

# (flag, Megatron-LM's default in our field's terms, where Megatron-LM core_v0.16.1 declares it). arguments.py builds
# many flags from config dataclasses (ArgumentGroupFactory): TransformerConfig and ModelParallelConfig are megatron-core's
# (megatron/core/transformer/transformer_config.py, megatron/core/model_parallel_config.py), SchedulerConfig,
# TrainingConfig, RNGConfig and RerunStateMachineConfig Megatron-LM's (megatron/training/*_config.py).
MEGATRON_LM_DEFAULTS = [
    # model
    ("--make-vocab-size-divisible-by", 128, "arguments.py _add_network_size_args"),
    ("--hidden-dropout", 0.1, "TransformerConfig.hidden_dropout"),
    ("--attention-dropout", 0.1, "TransformerConfig.attention_dropout"),
    ("--init-method-std", 0.02, "TransformerConfig.init_method_std"),
    ("--untie-embeddings-and-output-weights", False, "arguments.py _add_network_size_args, store_true"),
    ("--position-embedding-type", "learned_absolute", "arguments.py _add_network_size_args"),
    ("--rotary-base", 10000, "arguments.py _add_network_size_args"),
    ("--rotary-percent", 1.0, "arguments.py _add_network_size_args"),
    ("--normalization", "LayerNorm", "TransformerConfig.normalization"),
    ("--norm-epsilon", 1e-5, "TransformerConfig.layernorm_epsilon"),
    ("--swiglu", False, "arguments.py _add_network_size_args, store_true"),
    ("--openai-gelu", False, "arguments.py _add_network_size_args, store_true"),
    ("--disable-bias-linear", True, "TransformerConfig.add_bias_linear = True (the flag turns it off)"),
    ("--group-query-attention", False, "arguments.py _add_network_size_args, store_true"),
    ("--apply-layernorm-1p", False, "TransformerConfig.layernorm_zero_centered_gamma (its flag)"),
    ("--calculate-per-token-loss", False, "TransformerConfig.calculate_per_token_loss"),
    ("--attention-backend", "auto", "TransformerConfig.attention_backend = AttnBackend.auto"),
    ("--tensor-model-parallel-size", 1, "ModelParallelConfig.tensor_model_parallel_size"),
    ("--pipeline-model-parallel-size", 1, "ModelParallelConfig.pipeline_model_parallel_size"),
    ("--context-parallel-size", 1, "ModelParallelConfig.context_parallel_size"),
    ("--sequence-parallel", False, "ModelParallelConfig.sequence_parallel"),
    ("--decoder-first-pipeline-num-layers", None, "arguments.py _add_distributed_args"),
    ("--decoder-last-pipeline-num-layers", None, "arguments.py _add_distributed_args"),
    ("--num-layers-per-virtual-pipeline-stage", None, "arguments.py _add_distributed_args"),
    ("--no-overlap-p2p-communication", True, "arguments.py _add_distributed_args, store_false: overlap on"),
    ("--overlap-p2p-communication-warmup-flush", False, "ModelParallelConfig.overlap_p2p_comm_warmup_flush"),
    ("--cp-comm-type", ["p2p"], "arguments.py _add_distributed_args"),
    ("--bf16", False, "ModelParallelConfig.bf16"),
    ("--fp16", False, "ModelParallelConfig.fp16"),
    ("--recompute-granularity", None, "TransformerConfig.recompute_granularity"),
    ("--recompute-method", None, "TransformerConfig.recompute_method"),
    ("--recompute-num-layers", None, "TransformerConfig.recompute_num_layers"),
    ("--recompute-activations", False, "arguments.py _add_training_args, store_true"),
    ("--deterministic-mode", False, "ModelParallelConfig.deterministic_mode"),
    ("--cross-entropy-loss-fusion", False, "ModelParallelConfig.cross_entropy_loss_fusion"),
    ("--fp8-format", None, "TransformerConfig.fp8 (its flag)"),
    ("--fp8-recipe", "delayed", "TransformerConfig.fp8_recipe"),
    ("--fp8-margin", 0, "TransformerConfig.fp8_margin"),
    ("--fp8-amax-history-len", 1, "TransformerConfig.fp8_amax_history_len"),
    ("--fp8-amax-compute-algo", "most_recent", "TransformerConfig.fp8_amax_compute_algo"),
    ("--fp8-param-gather", False, "arguments.py _add_transformer_engine_args, store_true"),
    # train
    ("--global-batch-size", None, "TrainingConfig.global_batch_size (micro batch x data-parallel size)"),
    ("--rampup-batch-size", None, "TrainingConfig.rampup_batch_size"),
    ("--train-samples", None, "TrainingConfig.train_samples"),
    ("--no-check-for-nan-in-loss-and-grad", True, "arguments.py _add_training_args, store_false: the check on"),
    # optimizer
    ("--optimizer", "adam", "arguments.py _add_training_args"),
    ("--min-lr", 0.0, "arguments.py _add_learning_rate_args"),
    ("--weight-decay", 0.01, "arguments.py _add_regularization_args"),
    ("--adam-beta1", 0.9, "arguments.py _add_regularization_args"),
    ("--adam-beta2", 0.999, "arguments.py _add_regularization_args"),
    ("--adam-eps", 1e-8, "arguments.py _add_regularization_args"),
    ("--sgd-momentum", 0.9, "arguments.py _add_regularization_args"),
    ("--clip-grad", 1.0, "arguments.py _add_regularization_args"),
    ("--use-distributed-optimizer", False, "arguments.py _add_distributed_args, store_true"),
    ("--loss-scale", None, "arguments.py _add_mixed_precision_args"),
    ("--initial-loss-scale", 2.0 ** 32, "arguments.py _add_mixed_precision_args"),
    ("--min-loss-scale", 1.0, "arguments.py _add_mixed_precision_args"),
    ("--loss-scale-window", 1000, "arguments.py _add_mixed_precision_args"),
    ("--hysteresis", 2, "arguments.py _add_mixed_precision_args"),
    # scheduler
    ("--lr-decay-style", "linear", "SchedulerConfig.lr_decay_style"),
    ("--lr-decay-iters", None, "SchedulerConfig.lr_decay_iters (--train-iters)"),
    ("--lr-decay-samples", None, "SchedulerConfig.lr_decay_samples (--train-samples)"),
    ("--lr-warmup-iters", 0, "SchedulerConfig.lr_warmup_iters"),
    ("--lr-warmup-samples", 0, "SchedulerConfig.lr_warmup_samples"),
    ("--lr-warmup-fraction", None, "SchedulerConfig.lr_warmup_fraction"),
    ("--lr-warmup-init", 0.0, "SchedulerConfig.lr_warmup_init"),
    ("--lr-wsd-decay-style", "exponential", "SchedulerConfig.lr_wsd_decay_style"),
    ("--lr-wsd-decay-iters", None, "SchedulerConfig.lr_wsd_decay_iters"),
    ("--start-weight-decay", None, "SchedulerConfig.start_weight_decay (--weight-decay)"),
    ("--end-weight-decay", None, "SchedulerConfig.end_weight_decay (--weight-decay)"),
    ("--weight-decay-incr-style", "constant", "SchedulerConfig.weight_decay_incr_style"),
    ("--decoupled-lr", None, "arguments.py _add_learning_rate_args"),
    ("--decoupled-min-lr", None, "arguments.py _add_learning_rate_args"),
    # dataset, tokenizer, rng
    ("--split", "969,30,1", "arguments.py validate_args: '969, 30, 1' when --data-path comes without --split"),
    ("--dataloader-type", None, "arguments.py _add_training_args (validate_args: single)"),
    ("--num-workers", 2, "arguments.py _add_data_args"),
    ("--mock-data", False, "arguments.py _add_data_args, store_true"),
    ("--reset-position-ids", False, "arguments.py _add_data_args, store_true"),
    ("--reset-attention-mask", False, "arguments.py _add_data_args, store_true"),
    ("--eod-mask-loss", False, "arguments.py _add_data_args, store_true"),
    ("--fim-rate", 0.5, "arguments.py _add_data_args"),
    ("--fim-spm-rate", 0.5, "arguments.py _add_data_args"),
    ("--vocab-size", None, "arguments.py _add_tokenizer_args"),
    ("--seed", 1234, "RNGConfig.seed (megatron/training/common_config.py)"),
    # ddp
    ("--overlap-grad-reduce", False, "arguments.py _add_distributed_args, store_true"),
    ("--overlap-param-gather", False, "arguments.py _add_distributed_args, store_true"),
    ("--accumulate-allreduce-grads-in-fp32", False, "arguments.py _add_mixed_precision_args (validate_args: on for bf16)"),
    ("--grad-reduce-in-bf16", False, "arguments.py _add_mixed_precision_args, store_true"),
    # rerun state machine
    ("--error-injection-rate", 0, "RerunStateMachineConfig.error_injection_rate"),
    ("--error-injection-type", "transient_error", "RerunStateMachineConfig.error_injection_type"),
    ("--check-for-spiky-loss", False, "RerunStateMachineConfig.check_for_spiky_loss"),
]


def _field_of(flag: str):
    """(section, field name) of a flag."""
    for section, f, _ in config._cli_fields():
        if (f.metadata["flag"] or "--" + f.name.replace("_", "-")) == flag:
            return section, f.name
    raise KeyError(flag)


@pytest.mark.parametrize("flag, megatron_lm_default, where", MEGATRON_LM_DEFAULTS, ids=[d[0] for d in MEGATRON_LM_DEFAULTS])
def test_settings_that_change_what_is_computed_default_to_megatron_lms(flag, megatron_lm_default, where):
    section, name = _field_of(flag)
    assert getattr(getattr(config.ConfigContainer(), section), name) == megatron_lm_default, where


def test_defaults_megatron_lm_derives_are_derived_the_same():
    from model import megatron_ddp_config

    cfg = config.parse_args([], world_size=1, gpu=False)
    m = cfg.model
    # TransformerConfig.__post_init__: 4 x hidden MLP, hidden / heads per head; arguments.py: one key/value group per
    # head without --group-query-attention (core_transformer_config_from_args passes num_query_groups None)
    assert (m.ffn_hidden_size, m.kv_channels, m.num_query_groups) == (4 * m.hidden_size, m.hidden_size // m.num_attention_heads,
                                                                      m.num_attention_heads)
    assert cfg.scheduler.lr_warmup_steps == 0 and cfg.dataset.dataloader_type == "single"
    assert cfg.train.global_batch_size == cfg.train.micro_batch_size * cfg.data_parallel_size
    assert megatron_ddp_config(cfg).grad_reduce_in_fp32 is False and cfg.train.check_for_nan_in_loss_and_grad


# The flags whose default is ours, not Megatron-LM's (README, "Defaults that are ours"): Megatron-LM has none (a
# required setting), or they choose where and how often outputs go, or they depend on the machine.
OURS = {"--num-layers": 4, "--hidden-size": 256, "--num-attention-heads": 4, "--seq-length": 256,
        "--max-position-embeddings": None, "--micro-batch-size": 4, "--lr": 1e-3, "--train-iters": None,
        "--tokenizer-type": "ByteTokenizer", "--transformer-impl": None, "--distributed-backend": None,
        "--save": "checkpoints", "--tensorboard-dir": "runs", "--log-interval": 10, "--eval-interval": 100,
        "--eval-iters": 10, "--rerun-mode": "disabled", "--no-use-persistent-ckpt-worker": True}


def test_the_readme_lists_every_default_that_is_ours():
    with open(os.path.join(ROOT, "README.md")) as fh:
        section = fh.read().split("### Defaults that are ours", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^\| `(--[a-z0-9-]+)", section, re.M)
    assert sorted(listed) == sorted(OURS)
    for flag, value in OURS.items():
        section_name, name = _field_of(flag)
        assert getattr(getattr(config.ConfigContainer(), section_name), name) == value, flag
