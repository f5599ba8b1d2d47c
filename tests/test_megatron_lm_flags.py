"""Megatron-LM's command lines (arguments.py, core_v0.19.0) on this trainer: its GPT example scripts parse and
validate (tests/fixtures/megatron_lm_scripts/), the flags those scripts carry mean what they mean there (or are
named once as inert, or refused with one line that says why), flags of machinery this trainer does not have are
refused by name, and every setting that changes what is computed defaults to Megatron-LM's default.

What Megatron-LM's own parser says is written here as data (its defaults, with where each is declared, and the flags
core_v0.19.0 added and dropped since core_v0.16.1): CI has no Megatron-LM checkout. Where megatron-core 0.19's wheel
(which ships megatron.training) is installed, one test also reads its parser."""

import enum
import io
import os
import re
import shlex
import subprocess
import sys

import pytest

import checks
import config
import megatron_lm_flags
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
    real = checks.package_installed
    monkeypatch.setattr(checks, "package_installed", lambda module: module != "transformer_engine" and real(module))


@pytest.fixture
def with_te(monkeypatch):
    """This machine as a GPU machine with transformer-engine installed (validation only looks the package up)."""
    real = checks.package_installed
    monkeypatch.setattr(checks, "package_installed", lambda module: module == "transformer_engine" or real(module))


def printed_config(cfg) -> str:
    out = io.StringIO()
    checks.print_config(cfg, out)
    return out.getvalue()


# --- 1. Megatron-LM's example scripts, shrunk, as test data -------------------------------------------------------


@pytest.mark.parametrize("gpu", [False, True])
def test_gpt3_175b_script_parses_and_validates_for_its_128_rank_layout(tmp_path, gpu):
    argv = script_flags(GPT3, tmp_path)
    assert unknown_flags(argv) == []
    cfg = checks.config_from_flags(argv, world_size=128, gpu=gpu)  # 8 GPUs x 16 nodes: tensor 8 x pipeline 16
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
    cfg = checks.config_from_flags(script_flags(LLAMA3_FP8, tmp_path, drop=("--fp8-",)), world_size=8, gpu=True)
    m, t, s, d = cfg.model, cfg.train, cfg.scheduler, cfg.dataset
    assert m.transformer_impl == "transformer_engine" and m.layernorm_zero_centered_gamma and m.attention_backend == "fused"
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels, m.ffn_hidden_size) == (4, 1, 16, 224)
    assert m.swiglu and not m.add_bias_linear and m.untie_embeddings_and_output_weights and m.rotary_base == 1000000
    assert m.calculate_per_token_loss and m.cross_entropy_loss_fusion and not m.sequence_parallel  # TP 1: nothing to split
    assert m.bf16 and cfg.ddp.grad_reduce_in_fp32 is False  # --grad-reduce-in-bf16
    assert cfg.ddp.use_distributed_optimizer and cfg.ddp.overlap_grad_reduce and cfg.ddp.overlap_param_gather
    assert (cfg.data_parallel_size, t.global_batch_size, t.train_iters) == (8, 16, 20)
    assert (s.lr_decay_steps, s.lr_warmup_steps) == (319, 16)
    assert (cfg.optimizer.decoupled_lr, cfg.optimizer.decoupled_min_lr) == (5e-4, 4.5e-5)
    assert d.mock and d.split == "99,1,0" and cfg.tokenizer.vocab_size == 1024
    assert cfg.profiling.use_nsys_profiler and t.empty_unused_memory_level == 1
    inert = [line for line in printed_config(cfg).splitlines() if line.startswith(" inert here")]
    assert inert == [" inert here (Megatron-LM placement, memory, logging and deprecated switches with no effect in this "
                     "trainer): --use-mcore-models --empty-unused-memory-level 1 "
                     "--no-create-attention-mask-in-dataloader --tiktoken-pattern v2"]
    # With its FP8 lines and transformer-engine installed: still one line, this trainer does not drive FP8.
    err = config_error(script_flags(LLAMA3_FP8, tmp_path), capsys, world_size=8, gpu=True)
    assert "--fp8-format hybrid: this trainer does not drive transformer-engine's FP8" in err


def test_llama3_8b_fp8_script_stops_before_any_process_group(tmp_path):
    """train.py as a user runs it with the whole script: one line, exit 2, before any process group."""
    code = ("import runpy, sys; sys.argv = ['train.py'] + sys.argv[1:]\n"
            "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
            "except SystemExit as e:\n    print('exit', e.code, 'process group:', sys.modules['torch.distributed'].is_initialized())\n")
    run = subprocess.run([sys.executable, "-c", code, *script_flags(LLAMA3_FP8, tmp_path)], cwd=ROOT, text=True,
                         capture_output=True, env=dict(os.environ, WORLD_SIZE="8"), timeout=120)
    assert run.stdout.strip() == "exit 2 process group: False", (run.stdout, run.stderr)
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
    assert checks.parse_args(argv, world_size=1, gpu=False).model.num_query_groups == num_query_groups


@pytest.mark.parametrize("argv, fp32", [
    ([], False),                                          # fp32 training: fp32 gradients either way
    (["--bf16"], True),                                   # Megatron-LM: bf16 accumulates and reduces in fp32
    (["--bf16", "--grad-reduce-in-bf16"], False),
    (["--fp16"], False),                                  # Megatron-LM: fp16 gradients unless asked
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], True),
])
def test_gradient_reduction_dtype_follows_megatron_lm(argv, fp32):
    from model import megatron_ddp_config

    cfg = checks.parse_args(argv, world_size=1, gpu=False)
    assert megatron_ddp_config(cfg).grad_reduce_in_fp32 is fp32


def test_decoupled_lr_gives_the_embedding_and_output_layer_their_own_schedule(single_rank_groups):
    """--decoupled-lr / --decoupled-min-lr as megatron-core's get_standard_config_overrides: the parameters megatron-core
    marks is_embedding_or_output_parameter follow their own peak and final rate; the rest keep --lr / --min-lr."""
    import train
    from megatron.core.utils import unwrap_model
    from model import build_model, build_optimizer, wrap_model

    cfg = checks.parse_args([*TINY, "--untie-embeddings-and-output-weights", "--lr-warmup-iters", "0",
                             "--lr-decay-style", "linear", "--train-iters", "10", "--lr", "1e-3", "--min-lr", "1e-4",
                             "--decoupled-lr", "5e-3", "--decoupled-min-lr", "5e-4"], world_size=1, gpu=False)
    model = wrap_model(cfg, build_model(cfg, 256))
    optimizer = build_optimizer(cfg, model)
    scheduler = train.build_scheduler(cfg, optimizer)
    gpt = unwrap_model(model[0])
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
    assert checks.parse_args(["--recompute-activations"], world_size=1, gpu=False).model.recompute_granularity == "selective"


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
    cfg = checks.parse_args(["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                             tokenizer_json], world_size=1, gpu=False)
    from data import build_tokenizer

    tokenizer = build_tokenizer(cfg)
    assert tokenizer.eod == trained.token_to_id("<|endoftext|>")
    assert tokenizer.detokenize(tokenizer.tokenize("the python language")) == "the python language"


# --- 3. inert switches, megatron-core's TransformerConfig fields, refused machinery ---------------------------------


def test_inert_switches_are_named_once_and_only_where_they_are_inert(with_te):
    fused = ["--no-persist-layer-norm", "--no-rope-fusion"]
    other = ["--use-mcore-models", "--attention-backend", "flash", "--empty-unused-memory-level", "2",
             "--no-create-attention-mask-in-dataloader", "--tiktoken-pattern", "v1"]
    # local layers: SDPA picks its own kernel; --no-mmap-bin-files is megatron-core's mmap_bin_files, which its indexed
    # datasets read: not inert
    cfg = checks.parse_args([*fused, *other, "--no-mmap-bin-files"], world_size=1, gpu=False)
    lines = [line for line in printed_config(cfg).splitlines() if line.startswith(" inert here")]
    assert lines == [" inert here (fused GPU kernels the local layers never use): --no-persist-layer-norm --no-rope-fusion",
                     " inert here (Megatron-LM placement, memory, logging and deprecated switches with no effect in this "
                     "trainer): " + " ".join(other)]
    # transformer-engine layers: --attention-backend picks TE's kernel, it is not inert
    cfg = checks.parse_args(["--attention-backend", "flash"], world_size=1, gpu=True)
    assert cfg.model.transformer_impl == "transformer_engine" and checks.inert_flags(cfg) == []
    assert "inert here" not in printed_config(checks.parse_args([], world_size=1, gpu=False))


def test_the_model_section_is_the_transformer_config_megatron_core_gets(with_te):
    """--calculate-per-token-loss, --apply-layernorm-1p and --attention-backend set megatron-core's TransformerConfig
    fields of the model section, which model.transformer_config hands megatron-core finalized: a copy of the section
    itself, which keeps the settings as given (run_config.yaml's)."""
    from megatron.core.transformer.enums import AttnBackend

    from model import transformer_config

    cfg = checks.parse_args(["--calculate-per-token-loss"], world_size=1, gpu=False)
    tc = transformer_config(cfg)
    assert type(tc) is type(cfg.model) and (tc.calculate_per_token_loss, tc.layernorm_zero_centered_gamma) == (True, False)
    # finalize() filled in megatron-core's fields and this machine's answer on the copy only
    assert (tc.use_cpu_initialization, tc.embedding_init_method_std) == (True, tc.init_method_std)
    assert (cfg.model.use_cpu_initialization, cfg.model.embedding_init_method_std) == (False, None)
    cfg = checks.parse_args(["--apply-layernorm-1p", "--attention-backend", "fused"], world_size=1, gpu=True)
    tc = transformer_config(cfg)
    assert tc.layernorm_zero_centered_gamma and tc.attention_backend == AttnBackend.fused


@pytest.mark.parametrize("argv, machinery", [
    (["--moe-use-upcycling"], "Mixture-of-Experts machinery beyond megatron-core's MoELayer"),
    (["--moe-enable-deepep"], "Mixture-of-Experts machinery beyond megatron-core's MoELayer"),
    (["--overlap-moe-expert-parallel-comm"], "Mixture-of-Experts machinery beyond megatron-core's MoELayer"),
    (["--cache-mla-latents"], "multi-latent attention's cache of latents for flash decoding at inference"),
    (["--mtp-hybrid-override-pattern", "*"], "multi-token prediction in hybrid (Mamba) models"),
    (["--mamba-state-dim", "64"], "Mamba, hybrid and experimental attention layers"),
    (["--grpo-group-size", "4"], "reinforcement learning (GRPO)"),
    (["--inference-max-requests", "4"], "the inference server"),
    (["--img-h", "224"], "vision models"),
    (["--encoder-num-layers", "2"], "T5, BERT, retro and retriever models"),
    (["--fp4-format", "nvfp4"], "FP4 training (transformer-engine's)"),
    (["--cuda-graph-impl", "local"], "CUDA graphs"),
    (["--tp-comm-overlap"], "transformer-engine's userbuffer communication overlap"),
    (["--fsdp-double-buffer"], "FSDP"),
    (["--use-legacy-models"], "Megatron-LM's legacy models"),
    (["--qk-clip"], "Muon's QK-clip"),
    # new in core_v0.19.0
    (["--high-priority-a2a-comm-stream"], "Mixture-of-Experts machinery beyond megatron-core's MoELayer"),
    (["--no-dsa-indexer-scoring-relu"], "Mamba, hybrid and experimental attention layers"),
    (["--num-speculative-tokens", "2"], "the inference server"),
    (["--optimizer-cuda-graph"], "CUDA graphs"),
    (["--megatron-fsdp-max-pool-double-buffer"], "FSDP"),
    (["--activation-offload-fraction", "0.5"], "CPU offloading of optimizer states or activations"),
    (["--fault-injector-seed", "1"], "the fault injector"),
    (["--flight-recorder-trace-buffer-size", "2000"], "the NCCL flight recorder"),
    (["--disable-flight-recorder-dump-on-timeout"], "the NCCL flight recorder"),
    (["--logits-save-dir", "logits"], "logits distillation"),
    (["--use-mup"], "the maximal update parametrization (muP)"),
    (["--mup-width-mult", "2"], "the maximal update parametrization (muP)"),
    (["--tensor-parallel-num-weight-shards", "2"], "weight sharding beyond the tensor-parallel ranks"),
    (["--gpu-sniff-test-interval", "10"], "GPU performance sniff tests"),
])
def test_flags_of_machinery_this_trainer_lacks_are_refused_by_name(argv, machinery, capsys):
    err = config_error(["--num-layers", "2", *argv], capsys)
    flag = argv[0].split("=")[0]
    assert err.startswith(f"train.py: error: {flag} is a Megatron-LM setting of {machinery}"), err
    assert err.endswith("which this trainer does not have; drop it\n"), err


def test_a_flag_nobody_has_is_still_argparses_one_line(capsys):
    assert config_error(["--no-such-flag", "3"], capsys) == \
        "train.py: error: unrecognized arguments: --no-such-flag 3 (see --help)\n"


# --- 4. defaults: Megatron-LM's for every setting that changes what is computed -----------------------------------

# (flag, Megatron-LM's default in our field's terms, where Megatron-LM core_v0.19.0 declares it: file:line).
# arguments.py (megatron/training/arguments.py) builds many flags from config dataclasses (ArgumentGroupFactory):
# TransformerConfig and ModelParallelConfig are megatron-core's (megatron/core/transformer/transformer_config.py,
# megatron/core/model_parallel_config.py); SchedulerConfig, TrainingConfig and TokenizerConfig
# (training_config.py), RNGConfig (common_config.py) and RerunStateMachineConfig (resilience_config.py) Megatron-LM's,
# under megatron/training/config/. No default of these changed from core_v0.16.1 (where --vocab-size was
# _add_tokenizer_args' and the training configs lay in megatron/training/*_config.py).
MEGATRON_LM_DEFAULTS = [
    # model
    ("--make-vocab-size-divisible-by", 128, "arguments.py:2358 _add_network_size_args"),
    ("--hidden-dropout", 0.1, "TransformerConfig.hidden_dropout, transformer_config.py:181"),
    ("--attention-dropout", 0.1, "TransformerConfig.attention_dropout, transformer_config.py:184"),
    ("--init-method-std", 0.02, "TransformerConfig.init_method_std, transformer_config.py:386"),
    ("--untie-embeddings-and-output-weights", False, "arguments.py:2377 _add_network_size_args, store_true"),
    ("--position-embedding-type", "learned_absolute", "arguments.py:2314 _add_network_size_args"),
    ("--rotary-base", 10000, "arguments.py:2335 _add_network_size_args"),
    ("--rotary-percent", 1.0, "arguments.py:2337 _add_network_size_args"),
    ("--normalization", "LayerNorm", "TransformerConfig.normalization, transformer_config.py:249"),
    ("--norm-epsilon", 1e-5, "TransformerConfig.layernorm_epsilon, transformer_config.py:194"),
    ("--swiglu", False, "arguments.py:2367 _add_network_size_args, store_true"),
    ("--openai-gelu", False, "arguments.py:2361 _add_network_size_args, store_true"),
    ("--disable-bias-linear", True, "TransformerConfig.add_bias_linear = True, transformer_config.py:205 (the flag "
                                    "turns it off)"),
    ("--group-query-attention", False, "arguments.py:2299 _add_network_size_args, store_true"),
    ("--apply-layernorm-1p", False, "TransformerConfig.layernorm_zero_centered_gamma, transformer_config.py:199 (its "
                                    "flag)"),
    ("--calculate-per-token-loss", False, "TransformerConfig.calculate_per_token_loss, transformer_config.py:277"),
    ("--attention-backend", "auto", "TransformerConfig.attention_backend = AttnBackend.auto, "
                                    "transformer_config.py:144"),
    ("--tensor-model-parallel-size", 1, "ModelParallelConfig.tensor_model_parallel_size, model_parallel_config.py:55"),
    ("--pipeline-model-parallel-size", 1, "ModelParallelConfig.pipeline_model_parallel_size, "
                                          "model_parallel_config.py:83"),
    ("--context-parallel-size", 1, "ModelParallelConfig.context_parallel_size, model_parallel_config.py:100"),
    ("--sequence-parallel", False, "ModelParallelConfig.sequence_parallel, model_parallel_config.py:94"),
    ("--decoder-first-pipeline-num-layers", None, "arguments.py:2942 _add_distributed_args"),
    ("--decoder-last-pipeline-num-layers", None, "arguments.py:2946 _add_distributed_args"),
    ("--num-layers-per-virtual-pipeline-stage", None, "arguments.py:2961 _add_distributed_args"),
    ("--no-overlap-p2p-communication", True, "arguments.py:2965 _add_distributed_args, store_false: overlap on"),
    ("--overlap-p2p-communication-warmup-flush", False, "ModelParallelConfig.overlap_p2p_comm_warmup_flush, "
                                                        "model_parallel_config.py:422"),
    ("--bf16", False, "ModelParallelConfig.bf16, model_parallel_config.py:180"),
    ("--fp16", False, "ModelParallelConfig.fp16, model_parallel_config.py:177"),
    ("--recompute-granularity", None, "TransformerConfig.recompute_granularity, transformer_config.py:518"),
    ("--recompute-method", None, "TransformerConfig.recompute_method, transformer_config.py:529"),
    ("--recompute-num-layers", None, "TransformerConfig.recompute_num_layers, transformer_config.py:537"),
    ("--recompute-activations", False, "arguments.py:2732 _add_training_args, store_true"),
    ("--deterministic-mode", False, "ModelParallelConfig.deterministic_mode, model_parallel_config.py:229"),
    ("--cross-entropy-loss-fusion", False, "ModelParallelConfig.cross_entropy_loss_fusion, "
                                           "model_parallel_config.py:320"),
    ("--fp8-format", None, "TransformerConfig.fp8, transformer_config.py:566 (its flag)"),
    ("--fp8-recipe", "delayed", "TransformerConfig.fp8_recipe, transformer_config.py:573"),
    ("--fp8-margin", 0, "TransformerConfig.fp8_margin, transformer_config.py:592"),
    ("--fp8-amax-history-len", 1, "TransformerConfig.fp8_amax_history_len, transformer_config.py:600"),
    ("--fp8-amax-compute-algo", "most_recent", "TransformerConfig.fp8_amax_compute_algo, transformer_config.py:603"),
    ("--fp8-param-gather", False, "arguments.py:1935 _add_transformer_engine_args, store_true"),
    ("--add-qkv-bias", False, "TransformerConfig.add_qkv_bias, transformer_config.py:211"),
    ("--qk-layernorm", False, "TransformerConfig.qk_layernorm, transformer_config.py:252"),
    ("--qk-l2-norm", False, "TransformerConfig.qk_l2_norm, transformer_config.py:255"),
    ("--attention-softmax-in-fp32", False, "arguments.py:2919 _add_mixed_precision_args, store_true "
                                           "(TransformerConfig's own attention_softmax_in_fp32 defaults to True)"),
    ("--apply-query-key-layer-scaling", False, "TransformerConfig.apply_query_key_layer_scaling, "
                                               "transformer_config.py:467"),
    ("--fp32-residual-connection", False, "TransformerConfig.fp32_residual_connection, transformer_config.py:187"),
    ("--squared-relu", False, "arguments.py:2365 _add_network_size_args, store_true"),
    ("--quick-geglu", False, "arguments.py:2369 _add_network_size_args, store_true"),
    ("--glu-linear-offset", 0.0, "TransformerConfig.glu_linear_offset, transformer_config.py:224"),
    ("--activation-func-clamp-value", None, "TransformerConfig.activation_func_clamp_value, transformer_config.py:228"),
    ("--rotary-interleaved", False, "TransformerConfig.rotary_interleaved, transformer_config.py:236"),
    ("--no-rope-freq", None, "arguments.py:2345 _add_network_size_args"),
    ("--rope-type", None, "arguments.py:2769 _add_training_args (MLATransformerConfig.rope_type yarn under MLA, "
                          "transformer_config.py:2927)"),
    ("--multi-latent-attention", False, "TransformerConfig.multi_latent_attention, transformer_config.py:281"),
    ("--q-lora-rank", None, "arguments.py:3381 _add_mla_args"),
    ("--kv-lora-rank", 32, "arguments.py:3383 _add_mla_args"),
    ("--qk-head-dim", 128, "arguments.py:3385 _add_mla_args"),
    ("--qk-pos-emb-head-dim", 64, "arguments.py:3387 _add_mla_args"),
    ("--v-head-dim", 128, "arguments.py:3389 _add_mla_args"),
    ("--rotary-scaling-factor", 1.0, "arguments.py:3391 _add_mla_args"),
    ("--mscale", 1.0, "arguments.py:3393 _add_mla_args"),
    ("--mscale-all-dim", 0.0, "arguments.py:3395 _add_mla_args"),
    ("--mtp-num-layers", None, "TransformerConfig.mtp_num_layers, transformer_config.py:68"),
    ("--mtp-loss-scaling-factor", 0.1, "TransformerConfig.mtp_loss_scaling_factor, transformer_config.py:75"),
    ("--no-position-embedding", True, "arguments.py:2354 _add_network_size_args, store_false (add_position_embedding)"),
    ("--embedding-init-method-std", None, "TransformerConfig.embedding_init_method_std, transformer_config.py:396 "
                                          "(then --init-method-std)"),
    ("--init-method-xavier-uniform", False, "arguments.py:2835 _add_initialization_args, store_true"),
    ("--no-initialization", True, "ModelParallelConfig.perform_initialization, model_parallel_config.py:159 (its flag "
                                  "turns it off)"),
    ("--window-size", None, "arguments.py:2301 _add_network_size_args"),
    ("--window-attn-skip-freq", None, "arguments.py:2304 _add_network_size_args"),
    ("--softmax-type", "vanilla", "TransformerConfig.softmax_type, transformer_config.py:163"),
    ("--attention-output-gate", False, "TransformerConfig.attention_output_gate, transformer_config.py:271"),
    ("--disable-bf16-reduced-precision-matmul", False, "TransformerConfig.disable_bf16_reduced_precision_matmul, "
                                                       "transformer_config.py:475"),
    ("--num-virtual-stages-per-pipeline-rank", None, "arguments.py:2963 _add_distributed_args"),
    # train
    ("--global-batch-size", None, "TrainingConfig.global_batch_size, training_config.py:15 (micro batch x "
                                  "data-parallel size)"),
    ("--rampup-batch-size", None, "TrainingConfig.rampup_batch_size, training_config.py:20"),
    ("--train-samples", None, "TrainingConfig.train_samples, training_config.py:69"),
    ("--no-check-for-nan-in-loss-and-grad", True, "arguments.py:2735 _add_training_args, store_false: the check on"),
    # optimizer
    ("--optimizer", "adam", "arguments.py:2776 _add_training_args"),
    ("--min-lr", 0.0, "arguments.py:2854 _add_learning_rate_args"),
    ("--weight-decay", 0.01, "arguments.py:2501 _add_regularization_args"),
    ("--adam-beta1", 0.9, "arguments.py:2507 _add_regularization_args"),
    ("--adam-beta2", 0.999, "arguments.py:2510 _add_regularization_args"),
    ("--adam-eps", 1e-8, "arguments.py:2513 _add_regularization_args"),
    ("--sgd-momentum", 0.9, "arguments.py:2516 _add_regularization_args"),
    ("--clip-grad", 1.0, "arguments.py:2505 _add_regularization_args"),
    ("--use-distributed-optimizer", False, "arguments.py:2997 _add_distributed_args, store_true"),
    ("--loss-scale", None, "arguments.py:2907 _add_mixed_precision_args"),
    ("--initial-loss-scale", 2.0 ** 32, "arguments.py:2911 _add_mixed_precision_args"),
    ("--min-loss-scale", 1.0, "arguments.py:2913 _add_mixed_precision_args"),
    ("--loss-scale-window", 1000, "arguments.py:2915 _add_mixed_precision_args"),
    ("--hysteresis", 2, "arguments.py:2917 _add_mixed_precision_args"),
    # scheduler
    ("--lr-decay-style", "linear", "SchedulerConfig.lr_decay_style, training_config.py:169"),
    ("--lr-decay-iters", None, "SchedulerConfig.lr_decay_iters, training_config.py:175 (--train-iters)"),
    ("--lr-decay-samples", None, "SchedulerConfig.lr_decay_samples, training_config.py:178 (--train-samples)"),
    ("--lr-warmup-iters", 0, "SchedulerConfig.lr_warmup_iters, training_config.py:190"),
    ("--lr-warmup-samples", 0, "SchedulerConfig.lr_warmup_samples, training_config.py:193"),
    ("--lr-warmup-fraction", None, "SchedulerConfig.lr_warmup_fraction, training_config.py:187"),
    ("--lr-warmup-init", 0.0, "SchedulerConfig.lr_warmup_init, training_config.py:196"),
    ("--lr-wsd-decay-style", "exponential", "SchedulerConfig.lr_wsd_decay_style, training_config.py:172"),
    ("--lr-wsd-decay-iters", None, "SchedulerConfig.lr_wsd_decay_iters, training_config.py:181"),
    ("--start-weight-decay", None, "SchedulerConfig.start_weight_decay, training_config.py:221 (--weight-decay)"),
    ("--end-weight-decay", None, "SchedulerConfig.end_weight_decay, training_config.py:224 (--weight-decay)"),
    ("--weight-decay-incr-style", "constant", "SchedulerConfig.weight_decay_incr_style, training_config.py:227"),
    ("--decoupled-lr", None, "arguments.py:2857 _add_learning_rate_args"),
    ("--decoupled-min-lr", None, "arguments.py:2859 _add_learning_rate_args"),
    # dataset, tokenizer, rng
    ("--split", "969,30,1", "arguments.py:654 validate_args: '969, 30, 1' when --data-path comes without --split"),
    ("--dataloader-type", None, "arguments.py:2799 _add_training_args (validate_args, arguments.py:1215: single)"),
    ("--num-workers", 2, "arguments.py:3152 _add_data_args"),
    ("--mock-data", False, "arguments.py:3135 _add_data_args, store_true"),
    ("--reset-position-ids", False, "arguments.py:3154 _add_data_args, store_true"),
    ("--reset-attention-mask", False, "arguments.py:3156 _add_data_args, store_true"),
    ("--eod-mask-loss", False, "arguments.py:3163 _add_data_args, store_true"),
    ("--fim-rate", 0.5, "arguments.py:3189 _add_data_args"),
    ("--fim-spm-rate", 0.5, "arguments.py:3191 _add_data_args"),
    ("--vocab-size", None, "TokenizerConfig.vocab_size, training_config.py:654"),
    ("--seed", 1234, "RNGConfig.seed, common_config.py:10"),
    # ddp
    ("--overlap-grad-reduce", False, "arguments.py:2968 _add_distributed_args, store_true"),
    ("--overlap-param-gather", False, "arguments.py:2989 _add_distributed_args, store_true"),
    ("--accumulate-allreduce-grads-in-fp32", False, "arguments.py:2921 _add_mixed_precision_args (validate_args, "
                                                    "arguments.py:1193: on for bf16)"),
    ("--grad-reduce-in-bf16", False, "arguments.py:2905 _add_mixed_precision_args, store_true"),
    ("--ddp-bucket-size", None, "arguments.py:2972 _add_distributed_args (training.py:1552 resolve_ddp_bucket_size: "
                                "megatron-core's size)"),
    ("--ddp-pad-buckets-for-high-nccl-busbw", False, "arguments.py:2974 _add_distributed_args, store_true"),
    ("--ddp-average-in-collective", False, "arguments.py:2987 _add_distributed_args, store_true"),
    ("--check-for-large-grads", False, "arguments.py:2738 _add_training_args, store_true"),
    ("--num-distributed-optimizer-instances", 1, "arguments.py:3049 _add_distributed_args"),
    # rerun state machine
    ("--error-injection-rate", 0, "RerunStateMachineConfig.error_injection_rate, resilience_config.py:12"),
    ("--error-injection-type", "transient_error", "RerunStateMachineConfig.error_injection_type, "
                                                  "resilience_config.py:16"),
    ("--check-for-spiky-loss", False, "RerunStateMachineConfig.check_for_spiky_loss, resilience_config.py:28"),
]


def _field_of(flag: str):
    """(section, field name) of a flag."""
    for section, f, meta in config._cli_fields():
        if flag in meta["flags"]:
            return section, f.name
    raise KeyError(flag)


@pytest.mark.parametrize("flag, megatron_lm_default, where", MEGATRON_LM_DEFAULTS, ids=[d[0] for d in MEGATRON_LM_DEFAULTS])
def test_settings_that_change_what_is_computed_default_to_megatron_lms(flag, megatron_lm_default, where):
    section, name = _field_of(flag)
    value = getattr(getattr(config.ConfigContainer(), section), name)
    assert (value.name if isinstance(value, enum.Enum) else value) == megatron_lm_default, where  # an enum by its name


def test_defaults_megatron_lm_derives_are_derived_the_same():
    from model import megatron_ddp_config

    cfg = checks.parse_args([], world_size=1, gpu=False)
    m = cfg.model
    # TransformerConfig.__post_init__: 4 x hidden MLP, hidden / heads per head; arguments.py: one key/value group per
    # head without --group-query-attention (core_transformer_config_from_args passes num_query_groups None)
    assert (m.ffn_hidden_size, m.kv_channels, m.num_query_groups) == (4 * m.hidden_size, m.hidden_size // m.num_attention_heads,
                                                                      m.num_attention_heads)
    assert cfg.scheduler.lr_warmup_steps == 0 and cfg.dataset.dataloader_type == "single"
    assert cfg.train.global_batch_size == cfg.train.micro_batch_size * cfg.data_parallel_size
    assert megatron_ddp_config(cfg).grad_reduce_in_fp32 is False and cfg.train.check_for_nan_in_loss_and_grad


# The flags whose default is ours, not Megatron-LM's (docs/flags.md, "Defaults that are ours"): Megatron-LM has none (a
# required setting), or they choose where and how often outputs go, or they depend on the machine.
OURS = {"--num-layers": 4, "--hidden-size": 256, "--num-attention-heads": 4, "--seq-length": 256,
        "--max-position-embeddings": None, "--micro-batch-size": 4, "--lr": 1e-3, "--train-iters": None,
        "--tokenizer-type": "ByteTokenizer", "--transformer-impl": None, "--cp-comm-type": None,
        "--distributed-backend": None, "--save": "checkpoints", "--tensorboard-dir": "runs", "--log-interval": 10, "--eval-interval": 100,
        "--eval-iters": 10, "--rerun-mode": "disabled", "--no-use-persistent-ckpt-worker": True}


def test_the_readme_lists_every_default_that_is_ours():
    with open(os.path.join(ROOT, "docs", "flags.md")) as fh:
        section = fh.read().split("## Defaults that are ours", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^\| `(--[a-z0-9-]+)", section, re.M)
    assert sorted(listed) == sorted(OURS)
    for flag, value in OURS.items():
        section_name, name = _field_of(flag)
        assert getattr(getattr(config.ConfigContainer(), section_name), name) == value, flag


# --- 5. the rest of Megatron-LM's flags: with their meaning, inert, or refused by name ------------------------------

# Every flag of Megatron-LM's arguments.py (core_v0.16.1) that this parser still left to argparse's generic
# "unrecognized arguments" before each was decided: mapped, an alias, inert, or refused by name. (core_v0.19.0's new
# flags are MEGATRON_LM_FLAGS_NEW_IN_0_19 below, decided the same way.)
MEGATRON_LM_FLAGS_DECIDED = """
    --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split --activation-func-clamp-value
    --add-qkv-bias --adlr-autoresume-interval --allow-ambiguous-pad-tokens --apply-query-key-layer-scaling
    --apply-residual-connection-post-layernorm --apply-wd-to-qk-layernorm --attention-output-gate
    --attention-softmax-in-fp32 --auto-detect-ckpt-format --batch-invariant-mode --batch-size --check-for-large-grads
    --check-weight-hash-across-dp-replicas-interval --checkpoint-activations --ckpt-assume-constant-structure
    --ckpt-fully-parallel-load --ckpt-fully-parallel-save --config-logger-dir --create-all-gather-group
    --cross-entropy-fusion-impl --data-args-path --data-parallel-random-init --dataloader-defer-npy-index-mmap
    --dataloader-fast-cache-load --ddp-average-in-collective --ddp-bucket-size --ddp-num-buckets
    --ddp-pad-buckets-for-high-nccl-busbw --ddp-reduce-scatter-with-fp32-accumulation --decrease-batch-size-if-needed
    --defer-embedding-wgrad-compute --delay-wgrad-compute --disable-async-tensor-model-parallel-allreduce
    --disable-bf16-reduced-precision-matmul --disable-ckpt-fully-parallel-save
    --disable-clone-scatter-output-in-embedding --disable-fp8-wgrad --disable-gloo-process-groups --disable-jit-fuser
    --disable-log-loss-scale-to-tensorboard --disable-manual-gc-eval --disable-msc --disable-straggler-on-startup
    --disable-strict-fsdp-dtensor-load --disable-symmetric-registration
    --disable-use-tokenizer-model-from-checkpoint-args --dist-ckpt-format --dist-ckpt-save-pre-mcore-014
    --dist-ckpt-strictness --distrib-optim-fully-reshardable-mem-efficient --distribute-saved-activations
    --distributed-timeout-seconds-after-init --dump-param-to-param-group-map --embedding-init-method-std
    --enable-experimental --exit-on-missing-checkpoint --exit-signal-handler-for-dataloader --fake-process-group
    --fim-eod-token --first-last-layers-bf16 --fp16-lm-cross-entropy --fp32-residual-connection --fp8-interval
    --fp8-quantizer-factory --ft-num-warmup-iters --full-validation --glu-linear-offset --high-priority-stream-groups
    --init-method-xavier-uniform --init-model-with-meta-device --inprocess-empty-cuda-cache --lazy-mpu-init
    --legacy-tokenizer --load-main-params-from-ckpt --local-rank --log-device-memory-used --log-energy
    --log-max-attention-logit --log-memory-interval --log-progress --log-world-size-to-tensorboard
    --max-seqlen-per-dp-cp-rank --microbatch-group-size-per-virtual-pipeline-stage --mid-level-dataset-surplus
    --model-parallel-size --multiple-validation-sets --nccl-communicator-config-path --no-align-grad-reduce
    --no-align-param-gather --no-async-tensor-model-parallel-allreduce --no-barrier-with-level-1-timing
    --no-ckpt-fully-parallel-save --no-clone-scatter-output-in-embedding --no-fp8-wgrad
    --no-gradient-reduce-div-fusion --no-inference-wandb-logging --no-initialization --no-langrl-external-server
    --no-log-loss-scale-to-tensorboard --no-pin-cpu-grads --no-pin-cpu-params --no-position-embedding
    --no-rl-inference-logprobs-is-correction --no-rl-offload-inference-model-weights-when-idle
    --no-rl-offload-kv-cache-during-training --no-rl-partial-rollouts --no-rl-remove-kv-cache-during-training
    --no-rl-reset-cuda-graphs --no-rl-skip-bos-token --no-rl-training-cuda-graphs --no-rl-use-sequence-packing
    --no-rl-verify-model-weights-swap --no-rope-freq --no-scatter-gather-tensors-in-pipeline
    --no-strict-fsdp-dtensor-load --no-use-tokenizer-model-from-checkpoint-args --no-weight-decay-cond-type
    --num-dataset-builder-threads --num-distributed-optimizer-instances --num-layers-at-end-in-bf16
    --num-layers-at-start-in-bf16 --num-virtual-stages-per-pipeline-rank --object-storage-cache-path --onnx-safe
    --overlap-param-gather-with-optimizer-step --override-opt_param-scheduler --padded-vocab-size
    --per-dataset-sequences-path --per-split-data-args-path --persistent-save-interval --phase-transition-iterations
    --pipeline-model-parallel-comm-backend --pipeline-model-parallel-layout --qk-clip --qk-clip-alpha
    --qk-clip-threshold --qk-l2-norm --qk-layernorm --quick-geglu --recompute-modules
    --result-rejected-tracker-filename --reuse-grad-buf-for-mxfp8-param-ag --rope-scaling-factor --rope-type
    --rotary-interleaved --rotary-seq-len-interpolation-factor --sample-rate --save-dgrads-interval
    --save-retain-interval --save-wgrads-interval --sft-tokenizer-prompt-format --sharp-enabled-group --softmax-type
    --spec --squared-relu --straggler-ctrlr-port --symmetric-ar-type --te-precision-config-file --te-rng-tracker
    --tensorboard-queue-size --test-mode --tiktoken-num-special-tokens --tiktoken-special-tokens --timing-log-option
    --tokenizer-hf-include-special-tokens --tokenizer-hf-use-fast --tokenizer-metadata
    --tokenizer-sentencepiece-legacy --tokenizer-special-tokens --train-sync-interval --trust-remote-code
    --use-checkpoint-args --use-checkpoint-opt_param-scheduler --use-dist-ckpt --use-flash-attn
    --use-mp-args-from-checkpoint-args --use-nccl-ub --use-persistent-ckpt-worker --use-ring-exchange-p2p
    --use-rope-scaling --use-rotary-position-embeddings --use-sharp --use-te-activation-func --use-tp-pp-dp-mapping
    --warmup --wgrad-deferral-limit --window-attn-skip-freq --window-size --yaml-cfg
""".split()


# The option strings of core_v0.19.0's parser (add_megatron_arguments, with the flags its ArgumentGroupFactory makes
# from megatron/training/config's dataclasses) that core_v0.16.1's had not: 193 flags.
MEGATRON_LM_FLAGS_NEW_IN_0_19 = """
    --activation-offload-fraction --async-ckpt-cpu-priority --async-ckpt-io-priority --async-ckpt-use-cpu-shm
    --async-strategy --chat-template --ckpt-fully-parallel-load-exchange-algo --ckpt-fully-parallel-load-process-group
    --ckpt-fully-parallel-save-process-group --cpu-offloading-retain-pinned-cpu-buffers --cuda-graph-modules
    --dataloader-inter-document-masking --ddp-param-name-patterns-for-fp32-local-accumulation
    --delay-offload-until-cuda-graph --delta-offload-bytes-across-pp-ranks --disable-align-grad-reduce
    --disable-ckpt-load-validate-sharding-integrity --disable-dsa-indexer-rotate-activation
    --disable-dsa-indexer-scoring-relu --disable-flight-recorder-dump-on-timeout
    --disable-flight-recorder-extra-dump-on-exec --disable-flight-recorder-include-only-active --disable-pad-vocab-size
    --disable-stream-ckpt-dequant --disable-tokenizer-sentencepiece-ignore-extra-whitespaces --dist-ckpt-workers
    --dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32 --dsa-indexer-rope-interleaved --dsa-indexer-skip-topk-offset
    --dsa-indexer-topk-freq --dsa-kernel-backend --enable-msc --eval-global-batch-size --eval-micro-batch-size
    --exit-signal-handler-for-training --expert-tensor-parallel-num-weight-shards --fault-injector-delay-start-iteration
    --fault-injector-fault-delay --fault-injector-fault-probabilities --fault-injector-fault-types
    --fault-injector-mtti-seconds --fault-injector-num-ranks --fault-injector-offset-seconds --fault-injector-ranks
    --fault-injector-seed --fine-grained-offloading-max-inflight-offloads --flash-attention-version
    --flight-recorder-dump-path --flight-recorder-include-stack-trace --flight-recorder-trace-buffer-size
    --fp8-output-proj --freeze-all-layers --fsdp-db-use-persist-buf-on-alloc-fail --fused-residual-rmsnorm
    --gpu-sniff-test-interval --high-priority-a2a-comm-stream --hybrid-layer-pattern --inference-cuda-graph-all-prefills
    --inference-cuda-graph-max-tokens --inference-cuda-graph-scope --inference-disable-ep-consensus
    --inference-disable-triton-nvls-kernels --inference-dynamic-batching-async-sched-mode
    --inference-dynamic-batching-cuda-graph-sizing-distribution --inference-dynamic-batching-logprobs-mode
    --inference-dynamic-batching-mamba-memory-ratio --inference-dynamic-batching-prefix-caching
    --inference-dynamic-batching-prefix-caching-coordinator-policy
    --inference-dynamic-batching-prefix-caching-eviction-policy --inference-dynamic-batching-prefix-caching-mamba-gb
    --inference-dynamic-batching-prefix-caching-routing-alpha --inference-dynamic-batching-sampling-backend
    --inference-dynamic-batching-track-generated-token-events --inference-grouped-gemm-backend
    --inference-moe-disable-fused-quant-kernels --inference-moe-token-dispatcher-type --inference-shards
    --inference-text-gen-server-logging --inference-use-synchronous-zmq-collectives --lion-beta1 --lion-beta2
    --logits-load-decode-threads --logits-load-dir --logits-load-ignore-errors --logits-load-kd-loss-alpha
    --logits-load-msc-prefetch-depth --logits-load-prefetch-factor --logits-save-dir --logits-save-dtype
    --logits-save-top-k --logits-save-top-p --logits-save-top-p-min-k --mamba-inference-conv-states-dtype
    --mamba-inference-ssm-states-dtype --mamba-training-ssm-states-dtype
    --megatron-fsdp-enable-fine-grained-param-gather --megatron-fsdp-grad-comm-dtype --megatron-fsdp-main-grads-dtype
    --megatron-fsdp-main-params-dtype --megatron-fsdp-max-pool-double-buffer --mla-down-proj-fusion
    --mlp-chunks-for-training --moe-expert-rank-capacity-factor --moe-flex-dispatcher-num-sms
    --moe-hybridep-num-blocks-permute --moe-hybridep-num-blocks-unpermute --moe-hybridep-num-sms-preprocessing
    --moe-hybridep-pad-uneven-dispatch-inputs --moe-mlp-glu-interleave-size --moe-ncclep-static-shape
    --moe-ncclep-zero-copy --moe-paged-stash --moe-paged-stash-buffer-size-factor-cpu
    --moe-paged-stash-buffer-size-factor-cuda --moe-paged-stash-page-size --moe-permute-fusion-into-hybridep
    --moe-router-force-biased --moe-router-quantile-balancing-ema --moe-routing-trace-capture-hidden-states
    --moe-routing-trace-capture-logits --moe-routing-trace-dump-weights --moe-routing-trace-max-training-iters
    --moe-routing-trace-path --moe-shared-expert-glu-interleave-size --moe-single-grouped-bias
    --moe-single-grouped-weight --mtp-detach-heads --mtp-hybrid-override-pattern --mtp-use-repeated-layer
    --muon-coefficient-type --muon-nesterov --muon-scalar-optimizer --mup-attn-scale-power --mup-base-head-dim
    --mup-base-hidden-size --mup-embedding-mult --mup-output-mult --mup-width-mult
    --no-ckpt-load-validate-sharding-integrity --no-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu
    --no-flight-recorder-dump-on-timeout --no-flight-recorder-extra-dump-on-exec
    --no-flight-recorder-include-only-active --no-inference-disable-ep-consensus
    --no-inference-dynamic-batching-prefix-caching --no-inference-text-gen-server-logging
    --no-inference-use-synchronous-zmq-collectives --no-pad-vocab-size --no-rl-persist-cuda-graphs
    --no-stream-ckpt-dequant --no-tokenizer-sentencepiece-ignore-extra-whitespaces --no-use-layer-wise-param-layout
    --no-yarn-correction-range-round-to-int --null-tokenizer-eod-id --null-tokenizer-pad-id --num-speculative-tokens
    --nvtx-ranges --optimizer-cuda-graph --overlap-dispatch-backward-with-experts-wgrad --override-ckpt-iteration
    --pytorch-profiler-collect-callstack --pytorch-profiler-collect-chakra --pytorch-profiler-collect-shapes
    --record-shapes --rl-consumption-granularity --rl-generation-lag --rl-inference-parsers
    --rl-kv-cache-management-mode --rl-persist-cuda-graphs --rl-profile --rl-profile-dir --rl-submission-granularity
    --save-activations-interval --save-params-interval --save-tokens-per-expert-interval --start-eval-at-iter
    --step-batch-size-schedule --tensor-parallel-num-weight-shards --tokenizer-hf-no-include-special-tokens
    --tokenizer-hf-no-use-fast --use-grouped-gemm-for-dense-mlp --use-grouped-gemm-for-shared-expert --use-mup
    --use-same-sampling-seed-across-dp-ranks --use-transformer-engine-op-fuser --validation-set-names --verify-integrity
    --yarn-beta-fast --yarn-beta-slow --yarn-correction-range-round-to-int --yarn-original-max-position-embeddings
""".split()

# The option strings core_v0.16.1's parser had and core_v0.19.0's has not: 28 flags. This parser decides them as
# before: the ones it accepted (REMOVED_IN_0_19_STILL_ACCEPTED, all inert) it still accepts, the rest it refuses.
MEGATRON_LM_FLAGS_REMOVED_IN_0_19 = """
    --disable-async-tensor-model-parallel-allreduce --disable-chunked-prefill --disable-ckpt-fully-parallel-save
    --hybrid-attention-ratio --hybrid-mlp-ratio --inference-dynamic-batching-cuda-graph-max-tokens
    --inference-max-batch-size --langrl-external-server --langrl-inference-server-conversation-template
    --langrl-inference-server-type --legacy-tokenizer --moe-extended-tp --moe-use-legacy-grouped-gemm
    --muon-use-nesterov --no-async-tensor-model-parallel-allreduce --no-langrl-external-server
    --no-rl-offload-kv-cache-during-training --no-rl-remove-kv-cache-during-training --no-rl-reset-cuda-graphs
    --no-scatter-gather-tensors-in-pipeline --rl-offload-kv-cache-during-training --rl-parallel-generation-tasks
    --rl-remove-kv-cache-during-training --rl-reset-cuda-graphs --tiktoken-special-tokens
    --tokenizer-hf-include-special-tokens --tokenizer-hf-use-fast --use-legacy-models
""".split()
REMOVED_IN_0_19_STILL_ACCEPTED = [
    "--disable-async-tensor-model-parallel-allreduce", "--disable-ckpt-fully-parallel-save", "--legacy-tokenizer",
    "--no-async-tensor-model-parallel-allreduce", "--no-scatter-gather-tensors-in-pipeline", "--tiktoken-special-tokens",
    "--tokenizer-hf-use-fast"]
# How many option strings each parser has (without -h/--help).
MEGATRON_LM_0_16_FLAG_COUNT, MEGATRON_LM_0_19_FLAG_COUNT = 680, 845


def _known_flags() -> set:
    return {s for action in config.build_parser()._actions for s in action.option_strings}


def test_no_megatron_lm_flag_gets_argparses_generic_error(capsys):
    known = _known_flags()
    assert len(MEGATRON_LM_FLAGS_DECIDED) == 192 and len(MEGATRON_LM_FLAGS_NEW_IN_0_19) == 193
    flags = MEGATRON_LM_FLAGS_DECIDED + MEGATRON_LM_FLAGS_NEW_IN_0_19
    assert [f for f in flags if f not in known and megatron_lm_flags.unsupported_flag(f) is None] == []
    for flag in flags:
        if flag not in known:  # a value after it, for the flags that take one
            err = config_error([flag, "1"], capsys)
            assert err.startswith(f"train.py: error: {flag} ") and "unrecognized arguments" not in err, err


def test_flags_core_v0_19_dropped_are_decided_as_before():
    """The flags core_v0.16.1 had and core_v0.19.0 has not: still accepted where they were (inert), refused by name
    where they were; the new and dropped lists and the two parsers' sizes agree."""
    new, removed = set(MEGATRON_LM_FLAGS_NEW_IN_0_19), set(MEGATRON_LM_FLAGS_REMOVED_IN_0_19)
    assert (len(new), len(removed)) == (193, 28) and not new & removed
    assert MEGATRON_LM_0_19_FLAG_COUNT - len(new) + len(removed) == MEGATRON_LM_0_16_FLAG_COUNT
    known = _known_flags()
    assert [f for f in MEGATRON_LM_FLAGS_REMOVED_IN_0_19 if f in known] == REMOVED_IN_0_19_STILL_ACCEPTED
    assert [f for f in MEGATRON_LM_FLAGS_REMOVED_IN_0_19 if f not in known and not megatron_lm_flags.unsupported_flag(f)] == []
    inert = {flag for _, flags in megatron_lm_flags.MEGATRON_LM_INERT_FLAGS for flag, _ in flags}
    assert set(REMOVED_IN_0_19_STILL_ACCEPTED) <= inert


def _installed_megatron_lm_flags() -> set:
    """The option strings of the Megatron-LM parser that megatron-core 0.19's wheel ships (megatron.training), or a
    skip where it is not installed."""
    import argparse
    import importlib.metadata

    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-core is not installed")
    if not version.startswith("0.19."):
        pytest.skip(f"megatron-core {version}: these lists are core_v0.19.0's")
    try:
        from megatron.training.arguments import add_megatron_arguments
    except ImportError as e:
        pytest.skip(f"megatron.training does not import here: {e}")
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return {s for action in parser._actions for s in action.option_strings} - {"-h", "--help"}


def test_every_flag_of_the_installed_megatron_lm_parser_is_decided():
    """megatron-core 0.19's own parser (its megatron/training/arguments.py is core_v0.19.0's): the lists above are its
    difference from core_v0.16.1's, and each of its flags is accepted or refused by name here."""
    flags = _installed_megatron_lm_flags()
    assert len(flags) == MEGATRON_LM_0_19_FLAG_COUNT
    assert set(MEGATRON_LM_FLAGS_NEW_IN_0_19) <= flags and not flags & set(MEGATRON_LM_FLAGS_REMOVED_IN_0_19)
    assert set(MEGATRON_LM_FLAGS_DECIDED) - flags <= set(MEGATRON_LM_FLAGS_REMOVED_IN_0_19)
    known = _known_flags()
    assert sorted(f for f in flags if f not in known and megatron_lm_flags.unsupported_flag(f) is None) == []


_NOT_YET_OPTIMIZERS = "asks for megatron-core's legacy layer-wise path"
_NOT_YET_MLA = "is a setting of multi-latent attention (MLA) and its YaRN rotary embedding, which are not yet supported"


@pytest.mark.parametrize("argv, message", [
    (["--no-use-layer-wise-param-layout"], f"--no-use-layer-wise-param-layout {_NOT_YET_OPTIMIZERS}"),
    (["--mla-down-proj-fusion"], f"--mla-down-proj-fusion {_NOT_YET_MLA} here; drop it"),
    (["--yarn-beta-fast", "32"], f"--yarn-beta-fast {_NOT_YET_MLA}"),
    (["--no-yarn-correction-range-round-to-int"], f"--no-yarn-correction-range-round-to-int {_NOT_YET_MLA}"),
    (["--mtp-detach-heads"], "--mtp-detach-heads is a variant of multi-token prediction (MTP) that is not yet "
                             "supported here"),
])
def test_core_v0_19_optimizer_mla_and_mtp_flags_are_not_yet_supported(argv, message, capsys):
    err = config_error(argv, capsys)
    assert err.startswith(f"train.py: error: {message}"), err


ARCH = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--hidden-dropout", "0", "--attention-dropout", "0"]


def _attention(gpt, layer=0):
    return gpt.decoder.layers[layer].self_attention


def _named(fn, module: str, name: str) -> bool:
    import importlib

    return fn is getattr(importlib.import_module(module), name)


def _quick_geglu_mlp(gpt, offset: float, clamp: float) -> bool:
    """The first layer's MLP is fc2(quick_gelu(clamp(gate)) * (clamp(linear) + offset)) of fc1's two halves."""
    import torch

    mlp = gpt.decoder.layers[0].mlp
    x = torch.randn(5, 2, 64)
    out, bias = mlp(x)
    gate, linear = (x @ mlp.linear_fc1.weight.t()).chunk(2, dim=-1)
    gate, linear = gate.clamp(max=clamp), linear.clamp(-clamp, clamp)
    expected = (gate * torch.sigmoid(1.702 * gate) * (linear + offset)) @ mlp.linear_fc2.weight.t()
    # The same fp32 formula; megatron-core's fc2 matmul sums the ffn terms in its own order: log2(ffn) x 2^-24
    # relative of outputs of order 1: within allclose's 1e-5.
    return bias is None and torch.allclose(out, expected, atol=1e-5)


# (flags, what megatron-core's TransformerConfig holds, what the GPT built from it shows)
ARCHITECTURE_FLAGS = [
    (["--add-qkv-bias", "--disable-bias-linear"], lambda tc: tc.add_qkv_bias and not tc.add_bias_linear,
     lambda g: _attention(g).linear_qkv.bias is not None and _attention(g).linear_proj.bias is None),
    (["--qk-layernorm"], lambda tc: tc.qk_layernorm,
     lambda g: tuple(_attention(g).q_layernorm.weight.shape) == (16,) and hasattr(_attention(g).k_layernorm, "weight")),
    (["--qk-layernorm", "--normalization", "RMSNorm"], lambda tc: tc.qk_layernorm,
     lambda g: _attention(g).q_layernorm.normalization == "RMSNorm"),  # model.Norm
    (["--qk-l2-norm"], lambda tc: tc.qk_l2_norm,
     lambda g: type(_attention(g).q_layernorm).__name__ == type(_attention(g).k_layernorm).__name__ == "L2Norm"),
    (["--bf16", "--attention-backend", "local"], lambda tc: tc.attention_softmax_in_fp32 is False,  # Megatron-LM's
     lambda g: _attention(g).core_attention.scale_mask_softmax.softmax_in_fp32 is False),
    (["--bf16", "--attention-backend", "local", "--attention-softmax-in-fp32"], lambda tc: tc.attention_softmax_in_fp32,
     lambda g: _attention(g).core_attention.scale_mask_softmax.softmax_in_fp32),
    (["--attention-backend", "local", "--apply-query-key-layer-scaling"],
     lambda tc: tc.apply_query_key_layer_scaling and tc.attention_softmax_in_fp32,
     lambda g: _attention(g, 1).core_attention.scale_mask_softmax.scale == 2
     and _attention(g, 1).core_attention.softmax_scale == pytest.approx(1 / 4 / 2)),
    (["--squared-relu"], lambda tc: _named(tc.activation_func, "megatron.core.activations", "squared_relu")
     and not tc.gated_linear_unit, lambda g: tuple(g.decoder.layers[0].mlp.linear_fc1.weight.shape) == (256, 64)),
    (["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "0.5", "--disable-bias-linear"],
     lambda tc: _named(tc.activation_func, "megatron.core.fusions.fused_bias_geglu", "quick_gelu")
     and tc.gated_linear_unit and (tc.glu_linear_offset, tc.activation_func_clamp_value) == (1.0, 0.5),
     lambda g: _quick_geglu_mlp(g, offset=1.0, clamp=0.5)),
    (["--swiglu", "--glu-linear-offset", "0.5"], lambda tc: tc.glu_linear_offset == 0.5, lambda g: True),
    (["--position-embedding-type", "rope", "--rotary-interleaved"], lambda tc: tc.rotary_interleaved,
     lambda g: g.rotary_pos_emb.rotary_interleaved),
    (["--position-embedding-type", "rope", "--no-rope-freq", "2"], lambda tc: tc.no_rope_freq == [0, 1], lambda g: True),
    (["--position-embedding-type", "rope", "--no-rope-freq", "([1]+[0])*1"], lambda tc: tc.no_rope_freq == [1, 0],
     lambda g: True),
    (["--embedding-init-method-std", "1.0"], lambda tc: tc.embedding_init_method_std == 1.0,
     lambda g: abs(g.embedding.word_embeddings.weight.std().item() - 1.0) < 0.1
     and g.decoder.layers[0].mlp.linear_fc1.weight.std().item() < 0.03),
    (["--init-method-xavier-uniform"], lambda tc: tc.init_method is tc.output_layer_init_method is __import__(
        "torch").nn.init.xavier_uniform_,  # fc1 is 256 x 64: uniform in +-sqrt(6 / 320), std 0.079
     lambda g: 0.06 < g.decoder.layers[0].mlp.linear_fc1.weight.std().item()
     and g.decoder.layers[0].mlp.linear_fc1.weight.abs().max().item() <= (6 / 320) ** 0.5),
    (["--attention-backend", "local", "--window-size", "8,0"], lambda tc: tc.window_size == (8, 0),
     lambda g: _attention(g, 1).core_attention.scale_mask_softmax.window_size == (8, 0)),
    (["--attention-backend", "local", "--window-size", "8,0", "--window-attn-skip-freq", "2"],
     lambda tc: tc.window_attn_skip_freq == 2,  # every 2nd layer full attention
     lambda g: _attention(g, 0).core_attention.scale_mask_softmax.window_size == (8, 0)
     and _attention(g, 1).core_attention.scale_mask_softmax.window_size is None),
    (["--attention-backend", "local", "--softmax-type", "off-by-one"], lambda tc: tc.softmax_type == "off-by-one",
     lambda g: not _attention(g).core_attention.softmax_offset.any()),
    (["--attention-backend", "local", "--softmax-type", "learnable"], lambda tc: tc.softmax_type == "learnable",
     lambda g: _attention(g).core_attention.softmax_offset.requires_grad),
    (["--attention-output-gate"], lambda tc: tc.attention_output_gate,  # queries, gates, keys, values
     lambda g: tuple(_attention(g).linear_qkv.weight.shape) == (4 * 64, 64)),
    (["--bf16", "--disable-bf16-reduced-precision-matmul"], lambda tc: tc.disable_bf16_reduced_precision_matmul,
     lambda g: True),
]


@pytest.mark.parametrize("flags, config_holds, model_shows", ARCHITECTURE_FLAGS,
                         ids=[" ".join(f) for f, _, _ in ARCHITECTURE_FLAGS])
def test_architecture_flags_are_transformer_config_fields_a_cpu_gpt_runs_with(single_rank_groups, flags, config_holds,
                                                                              model_shows):
    """Each architecture flag as Megatron-LM's core_transformer_config_from_args (and gpt_builders' layer spec) sets
    it: the field megatron-core's TransformerConfig holds, the local-layer GPT it builds, and one forward and
    backward pass of that GPT on the CPU."""
    import torch
    from megatron.core.transformer.module import Float16Module

    from model import build_model, set_random_seed, transformer_config

    matmul = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction  # the last case sets it, as Megatron
    try:
        cfg = checks.parse_args([*ARCH, *flags], world_size=1, gpu=False)
        assert config_holds(transformer_config(cfg))
        set_random_seed(0)
        gpt = build_model(cfg, vocab_size=128)[0]
        assert model_shows(gpt)
        run = Float16Module(gpt.config, gpt) if cfg.model.bf16 else gpt  # --bf16: as wrap_model runs it
        tokens = torch.arange(64).reshape(2, 32) % 100
        loss = run(tokens, torch.arange(32).repeat(2, 1), None, labels=(tokens + 1) % 100).float().mean()
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in gpt.parameters() if p.grad is not None)
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = matmul


@pytest.mark.parametrize("flags, initialised", [([], True), (["--no-initialization"], False)])
def test_no_initialization_leaves_the_weights_to_a_checkpoint(single_rank_groups, tmp_path, monkeypatch, flags,
                                                              initialised):
    """megatron-core's init methods (normal_, through init_method_normal) run for every weight, or for none. (With
    learned positions, torch's own nn.Embedding of the table initialises itself either way, in Megatron-LM too.)"""
    import torch

    from model import build_model, transformer_config

    calls = []
    normal = torch.nn.init.normal_
    monkeypatch.setattr(torch.nn.init, "normal_", lambda *a, **k: calls.append(1) or normal(*a, **k))
    cfg = checks.parse_args([*ARCH, *flags, "--position-embedding-type", "rope", "--load", str(tmp_path)], world_size=1,
                            gpu=False)
    assert transformer_config(cfg).perform_initialization is initialised
    build_model(cfg, vocab_size=128)
    assert bool(calls) is initialised


def test_transformer_engine_only_flags_reach_its_config(with_te, monkeypatch):
    """On a GPU with transformer-engine: --fp32-residual-connection and --apply-query-key-layer-scaling (with the
    environment variable transformer-engine reads) go to megatron-core's config; the layer spec gets the q/k norms."""
    from model import transformer_config

    monkeypatch.setenv("NVTE_APPLY_QK_LAYER_SCALING", "1")
    cfg = checks.parse_args(["--bf16", "--fp32-residual-connection", "--apply-query-key-layer-scaling",
                             "--qk-layernorm", "--window-size", "128,0", "--softmax-type", "learnable"],
                            world_size=1, gpu=True)
    assert cfg.model.transformer_impl == "transformer_engine"
    tc = transformer_config(cfg)
    assert tc.fp32_residual_connection and tc.apply_query_key_layer_scaling and tc.qk_layernorm
    assert (tc.window_size, tc.softmax_type) == ((128, 0), "learnable")


@pytest.mark.parametrize("argv, ddp_field, value", [
    (["--overlap-grad-reduce", "--ddp-bucket-size", "5000"], "bucket_size", 5000),
    (["--ddp-pad-buckets-for-high-nccl-busbw"], "pad_buckets_for_high_nccl_busbw", True),
    (["--ddp-average-in-collective"], "average_in_collective", True),
    (["--check-for-large-grads"], "check_for_large_grads", True),
    (["--num-distributed-optimizer-instances", "1"], "num_distributed_optimizer_instances", 1),
    ([], "average_in_collective", False),
])
def test_ddp_flags_are_megatron_core_ddp_config_fields(argv, ddp_field, value):
    from model import megatron_ddp_config

    assert getattr(megatron_ddp_config(checks.parse_args(argv, world_size=1, gpu=False)), ddp_field) == value


def test_ddp_flags_train_on_cpu(single_rank_groups):
    """Small overlapped buckets, padded, averaged in the collective and checked for large gradients: megatron-core's
    DDP trains with them."""
    import torch

    from model import build_model, build_optimizer, get_forward_backward_func, set_random_seed, wrap_model

    cfg = checks.parse_args([*ARCH, "--overlap-grad-reduce", "--ddp-bucket-size", "20000",
                             "--ddp-pad-buckets-for-high-nccl-busbw", "--ddp-average-in-collective",
                             "--check-for-large-grads"], world_size=1, gpu=False)
    set_random_seed(0)
    model = wrap_model(cfg, build_model(cfg, vocab_size=128))
    assert model[0].ddp_config.average_in_collective and model[0].ddp_config.check_for_large_grads
    assert len(model[0].buffers[0].buckets) > 1
    optimizer = build_optimizer(cfg, model)
    tokens = torch.arange(64).reshape(2, 32) % 100

    def forward_step(data_iterator, m):
        out = m(tokens, torch.arange(32).repeat(2, 1), None, labels=(tokens + 1) % 100)
        return out, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})

    fbf, losses = get_forward_backward_func(model, optimizer), []
    for _ in range(4):
        model[0].zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(fbf(forward_step_func=forward_step, data_iterator=iter([]), model=model, num_microbatches=1,
                          seq_length=32, micro_batch_size=2)[0]["lm loss"].item())
        assert optimizer.step()[0]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("argv, section, name, value", [
    (["--use-rotary-position-embeddings"], "model", "position_embedding_type", "rope"),
    (["--disable-manual-gc-eval"], "train", "manual_gc_eval", False),
    (["--persistent-save-interval", "7"], "checkpoint", "save_interval", 7),
    (["--override-opt_param-scheduler"], "scheduler", "override_opt_param_scheduler", True),
    (["--use-checkpoint-opt_param-scheduler"], "scheduler", "use_checkpoint_opt_param_scheduler", True),
    (["--use-persistent-ckpt-worker"], "checkpoint", "use_persistent_ckpt_worker", True),
])
def test_megatron_lm_spellings_set_the_same_setting(argv, section, name, value):
    assert getattr(getattr(checks.parse_args(argv, world_size=1, gpu=False), section), name) == value


def test_virtual_stages_per_pipeline_rank_as_megatron_lm():
    m = checks.parse_args(["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                           "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8"], world_size=2,
                          gpu=False).model
    assert (m.num_layers_per_virtual_pipeline_stage, m.virtual_pipeline_model_parallel_size) == (2, 2)
    assert m.num_virtual_stages_per_pipeline_rank is None  # said once, as layers per stage: what generate.py resets
    m = checks.parse_args(["--num-virtual-stages-per-pipeline-rank", "1"], world_size=1, gpu=False).model
    assert m.virtual_pipeline_model_parallel_size is None  # one virtual stage is none (Megatron-LM: None)


def test_every_inert_flag_is_accepted_and_named_once_as_given():
    argv = []
    for _, flags in megatron_lm_flags.MEGATRON_LM_INERT_FLAGS:
        for flag, takes in flags:
            argv += [flag] if takes is None else [flag, "a", "b"] if takes == "*" else \
                [flag, takes[-1]] if isinstance(takes, list) else [flag, "3"]
    assert unknown_flags(argv) == []
    cfg = checks.parse_args(argv, world_size=1, gpu=False)
    fused, other = [line.split(": ", 1)[1] for line in printed_config(cfg).splitlines() if line.startswith(" inert here")]
    assert fused == ("--disable-jit-fuser --use-te-activation-func --cross-entropy-fusion-impl te "
                     "--flash-attention-version 3 --use-transformer-engine-op-fuser --fused-residual-rmsnorm "
                     "--use-grouped-gemm-for-dense-mlp")
    named = (fused + " " + other).split(" --")
    for _, flags in megatron_lm_flags.MEGATRON_LM_INERT_FLAGS:
        for flag, _ in flags:
            assert sum(1 for given in named if ("--" + given.lstrip("-")).split(" ")[0] == flag) == 1, flag
    assert "--local-rank 3" in other and "--recompute-modules a b" in other


@pytest.mark.parametrize("argv, gpu, inert", [
    (["--position-embedding-type", "rope", "--rope-type", "rope"], False, "--rope-type rope"),
    (["--position-embedding-type", "rope", "--no-position-embedding"], False, "--no-position-embedding"),
    (["--bf16", "--disable-bf16-reduced-precision-matmul"], False, "--disable-bf16-reduced-precision-matmul"),
    (["--bf16", "--disable-bf16-reduced-precision-matmul"], True, None),  # cuBLAS's bf16 reductions: it takes effect
    (["--ddp-bucket-size", "1000"], False, "--ddp-bucket-size 1000"),  # one bucket without overlap, as megatron-core
    (["--ddp-bucket-size", "1000", "--overlap-grad-reduce"], False, None),
    (["--bf16", "--attention-softmax-in-fp32"], False, "--attention-softmax-in-fp32"),  # SDPA picks its precision
    (["--bf16", "--attention-softmax-in-fp32", "--attention-backend", "local"], False, None),
    (["--attention-softmax-in-fp32", "--attention-backend", "local"], False, "--attention-softmax-in-fp32"),  # fp32
    (["--apply-query-key-layer-scaling"], False, "--apply-query-key-layer-scaling"),
    (["--apply-query-key-layer-scaling", "--attention-backend", "local"], False, None),
    (["--fp32-residual-connection"], False, "--fp32-residual-connection"),  # fp32 training: fp32 already
])
def test_settings_named_inert_exactly_where_they_change_nothing(argv, gpu, inert):
    cfg = checks.parse_args([*argv, "--transformer-impl", "local"], world_size=1, gpu=gpu)
    assert checks.inert_flags(cfg) == ([inert] if inert else [])


# Megatron-LM flags refused by name, with what the one line says after the flag.
REFUSED = [
    ("--batch-size", "is no longer valid in Megatron-LM either; use --micro-batch-size"),
    ("--warmup", "is no longer valid in Megatron-LM either; use --lr-warmup-fraction"),
    ("--model-parallel-size", "is no longer valid in Megatron-LM either; use --tensor-model-parallel-size"),
    ("--checkpoint-activations", "is no longer valid in Megatron-LM either; use --recompute-activations"),
    ("--use-rope-scaling", "(Llama 3.x RoPE frequency scaling) is a megatron-core GPTModel argument"),
    ("--fp16-lm-cross-entropy", "(the cross entropy in fp16) is a megatron-core GPTModel argument"),
    ("--data-parallel-random-init", "seeds each data-parallel rank differently"),
    ("--ddp-num-buckets", "sizes buckets from the parameter count"),
    ("--ddp-reduce-scatter-with-fp32-accumulation", "(megatron-core's all-to-all reduce-scatter) is not wired"),
    ("--overlap-param-gather-with-optimizer-step", "needs a training loop that starts the parameter all-gather"),
    ("--pipeline-model-parallel-layout", "(a custom layout of layers over pipeline stages) is not supported"),
    ("--batch-invariant-mode", "(batch-invariant kernels) is not built here"),
    ("--decrease-batch-size-if-needed", "is not supported: the global batch must be a multiple"),
    ("--check-weight-hash-across-dp-replicas-interval", "is not checked by this trainer"),
    ("--use-checkpoint-args", "is not supported: settings come from the command line or --config-file"),
    ("--use-mp-args-from-checkpoint-args", "is not supported: settings come from the command line or --config-file"),
    ("--load-main-params-from-ckpt", "is not supported: the fp32 main weights are made from the loaded weights"),
    ("--exit-on-missing-checkpoint", "is not supported: a --load directory without a checkpoint trains from scratch"),
    ("--auto-detect-ckpt-format", "is not supported: the loader detects the saved format"),
    ("--dist-ckpt-strictness", "is not supported: the loader matches the checkpoint's keys"),
    ("--dist-ckpt-save-pre-mcore-014", "is not supported: checkpoints are saved in megatron-core 0.16's format"),
    ("--save-wgrads-interval", "(gradient dumps) is not written"), ("--save-dgrads-interval", "(gradient dumps)"),
    ("--save-retain-interval", "is not supported; --most-recent-k keeps the newest K checkpoints"),
    ("--test-mode", "(Megatron-LM's functional-test hooks) is not supported"),
    ("--full-validation", "is not supported: evaluation runs --eval-iters batches"),
    ("--multiple-validation-sets", "is not supported: evaluation runs --eval-iters batches"),
    ("--phase-transition-iterations", "(training phases) is not supported"),
    ("--data-args-path", "is not read here; give the prefixes with --data-path"),
    ("--per-split-data-args-path", "is not read here; give the prefixes with --data-path"),
    ("--sample-rate", "(subsampling the training data) is not supported"),
    ("--object-storage-cache-path", "is not supported: datasets are read from the local file system"),
    ("--mid-level-dataset-surplus", "is not supported: blended datasets use megatron-core's default surplus"),
    ("--allow-ambiguous-pad-tokens", "is not supported: pad tokens are masked"),
    ("--fim-eod-token", "is not supported: FIM samples end with the tokenizer's end-of-document token"),
    ("--padded-vocab-size", "is not supported: the vocabulary is padded from the tokenizer's size"),
    ("--tokenizer-metadata", "is not read by the tokenizers here"), ("--tokenizer-special-tokens", "is not read by"),
    ("--tokenizer-hf-include-special-tokens", "is Megatron-LM 0.16's: 0.19, and this trainer, include special"),
    ("--lazy-mpu-init", "is for programs that call Megatron-LM's initialize_megatron"),
    ("--fake-process-group", "(training without collectives, for benchmarks) is not supported"),
    ("--spec", "is not supported: this trainer builds its own layer spec"),
    ("--yaml-cfg", "is not read (Megatron-LM's YAML layout); --config-file takes this trainer's YAML"),
    ("--dump-param-to-param-group-map", "is not supported: parameter groups come from"),
    ("--apply-wd-to-qk-layernorm", "is not supported: 1-D parameters (norms) get no weight decay here"),
    ("--no-weight-decay-cond-type", "is not supported: 1-D parameters (norms) get no weight decay here"),
    *[(flag, "is a setting of transformer-engine's FP8 training, which this trainer does not drive") for flag in (
        "--fp8-quantizer-factory", "--fp8-interval", "--no-fp8-wgrad", "--disable-fp8-wgrad", "--first-last-layers-bf16",
        "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16", "--te-precision-config-file",
        "--reuse-grad-buf-for-mxfp8-param-ag")],
    ("--no-rl-partial-rollouts", "is a Megatron-LM setting of reinforcement learning (GRPO)"),
    ("--no-langrl-external-server", "is a Megatron-LM setting of reinforcement learning (GRPO)"),
    ("--no-inference-wandb-logging", "is a Megatron-LM setting of the inference server"),
    ("--init-model-with-meta-device", "is a Megatron-LM setting of FSDP"),
    ("--qk-clip", "is a Megatron-LM setting of Muon's QK-clip"),
    ("--qk-clip-threshold", "is a Megatron-LM setting of Muon's QK-clip"),
    ("--muon-use-nesterov", "is Megatron-LM core_v0.16's name, gone in core_v0.19; use --muon-nesterov"),
    ("--te-rng-tracker", "is a Megatron-LM setting of CUDA graphs"),
    ("--adlr-autoresume-interval", "is a Megatron-LM setting of ADLR autoresume"),
    # new in core_v0.19.0
    ("--save-params-interval", "(parameter and activation dumps) is not written by this trainer"),
    ("--save-activations-interval", "(parameter and activation dumps) is not written by this trainer"),
    ("--override-ckpt-iteration", "is not supported: a run resumes at its checkpoint's iteration"),
    ("--verify-integrity", "(hashes of the checkpoint files) is not supported"),
    ("--enable-msc", "(the Multi-Storage Client) is not supported: datasets and checkpoints are read from the local"),
    ("--exit-signal-handler-for-training", "is not supported; --exit-signal-handler saves a checkpoint and exits"),
    ("--freeze-all-layers", "is not supported: every layer trains here"),
    ("--step-batch-size-schedule", "(a stepwise batch-size schedule) is not supported; --rampup-batch-size"),
    ("--eval-global-batch-size", "is not supported: evaluation batches are the training ones"),
    ("--eval-micro-batch-size", "is not supported: evaluation batches are the training ones"),
    ("--start-eval-at-iter", "is not supported: evaluation runs every --eval-interval iterations"),
    ("--validation-set-names", "is not supported: evaluation runs --eval-iters batches"),
    ("--dataloader-inter-document-masking", "(attention within each document, from cu_seqlens) is not supported"),
    ("--pytorch-profiler-collect-chakra", "(Chakra execution traces) is not collected by the PyTorch profiler here"),
    ("--no-pad-vocab-size", "is not supported: the vocabulary is always padded from the tokenizer's size"),
    ("--disable-pad-vocab-size", "is not supported: the vocabulary is always padded from the tokenizer's size"),
    ("--null-tokenizer-eod-id", "is not supported: the NullTokenizer here takes ids 0 to --vocab-size - 1, the last "
                                "of them its end-of-document"),
    ("--null-tokenizer-pad-id", "is not supported: the NullTokenizer here"),
    ("--fp8-output-proj", "is a setting of transformer-engine's FP8 training, which this trainer does not drive"),
]


@pytest.mark.parametrize("flag, reason", REFUSED, ids=[r[0] for r in REFUSED])
def test_flags_whose_meaning_cannot_be_given_are_refused_by_name(flag, reason, capsys):
    assert config_error(["--num-layers", "2", flag, "1"], capsys).startswith(f"train.py: error: {flag} {reason}")


@pytest.mark.parametrize("argv, message", [
    (["--swiglu", "--squared-relu"], "--swiglu and --squared-relu each choose the MLP's activation; give one"),
    (["--quick-geglu", "--openai-gelu"], "--quick-geglu and --openai-gelu each choose the MLP's activation"),
    (["--glu-linear-offset", "0.5"], "--glu-linear-offset shifts the linear half of a gated MLP; add --swiglu"),
    (["--swiglu", "--activation-func-clamp-value", "7"], "--activation-func-clamp-value clamps the halves of "
                                                          "--quick-geglu's MLP"),
    (["--qk-layernorm", "--qk-l2-norm"], "--qk-layernorm and --qk-l2-norm each normalize the queries and keys"),
    (["--rope-type", "yarn"], "--rope-type yarn is multi-latent attention's rotary embedding"),
    (["--no-position-embedding"], "--no-position-embedding is deprecated, and Megatron-LM refuses it without rope "
                                  "too (--position-embedding-type learned_absolute); use --position-embedding-type none"),
    (["--rotary-interleaved"], "--rotary-interleaved changes the rotary embedding, but --position-embedding-type is "
                               "learned_absolute"),
    (["--position-embedding-type", "rope", "--num-layers", "4", "--no-rope-freq", "3"],
     "megatron-core's TransformerConfig refuses these settings: no_rope_freq=3 should be divisible by num_layers=4."),
    (["--position-embedding-type", "rope", "--num-layers", "2", "--no-rope-freq", "[0,1,1]"],
     "--no-rope-freq '[0,1,1]' has 3 entries for 2 layers"),
    (["--position-embedding-type", "rope", "--no-rope-freq", "__import__('os').getcwd()"],
     "--no-rope-freq \"__import__('os').getcwd()\" is neither a positive integer nor a list of 0s and 1s"),
    (["--window-attn-skip-freq", "2"], "--window-attn-skip-freq picks the layers of --window-size's sliding window"),
    (["--attention-backend", "local", "--window-size", "8"], "--window-size '8' must be two integers LEFT,RIGHT"),
    (["--window-size", "8,0"], "--window-size 8,0 runs in megatron-core's own core attention, and the local layers "
                               "use PyTorch's SDPA unless asked; add --attention-backend local"),
    (["--softmax-type", "learnable"], "--softmax-type learnable runs in megatron-core's own core attention"),
    (["--bf16", "--fp32-residual-connection"], "--fp32-residual-connection needs transformer-engine layers"),
    (["--num-distributed-optimizer-instances", "2"], "--num-distributed-optimizer-instances 2: partial distributed "
                                                     "optimizers need process groups"),
    (["--ddp-average-in-collective", "--calculate-per-token-loss"], "--ddp-average-in-collective averages over "
                                                                    "data-parallel ranks"),
    (["--num-virtual-stages-per-pipeline-rank", "2"], "--num-virtual-stages-per-pipeline-rank 2 needs "
                                                      "--pipeline-model-parallel-size 2 or more"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     "--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage both set the virtual stages"),
])
def test_what_the_new_flags_cannot_mean_here_is_one_line(argv, message, capsys):
    err = config_error(argv, capsys)
    assert err.startswith(f"train.py: error: {message}"), err


@pytest.mark.parametrize("flag_given, env, message", [
    (True, None, "--apply-query-key-layer-scaling with transformer-engine layers needs NVTE_APPLY_QK_LAYER_SCALING=1"),
    (False, "1", "NVTE_APPLY_QK_LAYER_SCALING asks transformer-engine for query-key layer scaling"),
])
def test_query_key_layer_scaling_agrees_with_transformer_engines_environment(with_te, monkeypatch, capsys, flag_given,
                                                                              env, message):
    monkeypatch.delenv("NVTE_APPLY_QK_LAYER_SCALING", raising=False)
    if env:
        monkeypatch.setenv("NVTE_APPLY_QK_LAYER_SCALING", env)
    argv = ["--apply-query-key-layer-scaling"] if flag_given else []
    assert config_error(argv, capsys, gpu=True).startswith(f"train.py: error: {message}")


def test_rotary_seq_len_interpolation_factor_reaches_megatron_cores_rotary_embedding(single_rank_groups, capsys):
    """As core_v0.19.0's pretrain_gpt.py hands it to GPTModel (its RotaryEmbedding divides the positions by it): the
    same weights give other logits; it needs rope, and no transformers layout has it (the export refuses it)."""
    import torch

    import device
    import hf
    import model
    from megatron.core import tensor_parallel

    flags = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--position-embedding-type",
             "rope", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0"]
    outputs = []
    with device.shim():
        for extra in ([], ["--rotary-seq-len-interpolation-factor", "4"]):
            cfg = checks.parse_args([*flags, *extra], world_size=1, gpu=False)
            torch.manual_seed(0)
            tensor_parallel.model_parallel_cuda_manual_seed(0)
            gpt = model.build_model(cfg, 256)[0]
            assert gpt.rotary_pos_emb.seq_len_interpolation_factor == (4 if extra else None)
            tokens = torch.arange(16).unsqueeze(0)
            with torch.no_grad():
                outputs.append(gpt(tokens, torch.arange(16).unsqueeze(0), attention_mask=None))
    assert not torch.equal(*outputs)
    assert "--rotary-seq-len-interpolation-factor changes the rotary embedding, but --position-embedding-type is " \
           "learned_absolute" in config_error(["--rotary-seq-len-interpolation-factor", "4"], capsys)
    assert "no --rotary-seq-len-interpolation-factor" in hf.layout_mismatches(cfg.model, "llama")


@pytest.mark.parametrize("argv, line", [
    (["--async-save", "--ckpt-format", "torch"], "--async-save writes megatron-core's distributed checkpoint in the "
                                                 "background, and --ckpt-format torch is saved in the foreground"),
    (["--ckpt-format", "torch", "--use-distributed-optimizer"], "Megatron-LM's distrib_optim.pt beside each rank's file"),
    (["--seed", str(2 ** 32)], "--seed 4294967296 is out of range: it must lie in [0, 4294967295]"),
    (["--seed", str(2 ** 32 - 50), "--pipeline-model-parallel-size", "2"], "each pipeline rank seeds numpy with it plus "
                                                                        "100 x its rank"),
    (["--lr", "-1"], "--lr must be non-negative"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout must be in [0, 1]"),
])
def test_what_megatron_lm_refuses_or_this_trainer_cannot_do_is_one_line_saying_why(argv, line, capsys):
    assert line in config_error(argv, capsys, world_size=2)


def test_what_megatron_lm_accepts_is_accepted(tmp_path):
    """--lr 0 (the weights stay: the parameters' norm does not move), seeds from 2^31, dropout 1.0."""
    from conftest import train_here

    for argv in (["--seed", str(2 ** 31)], ["--seed", str(2 ** 32 - 1)], ["--hidden-dropout", "1.0"],
                 ["--attention-dropout", "1.0"], ["--lr", "0"]):
        checks.parse_args(argv, world_size=1, gpu=False)
    out = train_here([*TINY, "--mock-data", "--lr", "0", "--train-iters", "3", "--log-interval", "1", "--eval-iters",
                      "0", "--log-params-norm", "--seed", str(2 ** 32 - 1), "--data-cache-path", str(tmp_path)])
    norms = re.findall(r"params norm: (\S+)", out)
    assert len(norms) == 3 and len(set(norms)) == 1
