"""megatron_lm_flags.py: the Megatron-LM flags this trainer has no setting for, as data.

Megatron-LM's `arguments.py` (core_v0.19.0, and the few flags core_v0.16.1 had) knows flags for machinery this
trainer does not have. Rather than argparse's "unrecognized arguments", each gets an answer of its own:

    MEGATRON_LM_INERT_FLAGS    accepted, with no effect here, and named once as inert in the printed config
    UNSUPPORTED_FLAGS          refused in one line naming the machinery (a name ending in "-" is a prefix)
    MEGATRON_LM_REFUSED_FLAGS  refused in one line with a reason of their own (read before UNSUPPORTED_FLAGS)

config.build_parser adds the inert flags to the parser; checks.config_from_flags asks `unsupported_flag` about
every flag the parser does not know.
"""

from typing import Optional


# Megatron-LM flags (arguments.py, core_v0.19.0, and the few that core_v0.16.1 had and 0.19.0 dropped) accepted with no
# effect here and named once as inert in the printed config: (why, ((flag, what it takes), ...)). What a flag takes:
# None for a switch, a type for one value, "*" for any number of words, a list for its choices. The first group's are
# printed with the fused-kernel switches.
MEGATRON_LM_INERT_FLAGS = [
    ("a GPU kernel choice the local layers never use", (
        ("--disable-jit-fuser", None), ("--use-te-activation-func", None),
        ("--cross-entropy-fusion-impl", ["native", "te"]), ("--flash-attention-version", int),
        ("--use-transformer-engine-op-fuser", None), ("--fused-residual-rmsnorm", None),
        ("--use-grouped-gemm-for-dense-mlp", None))),
    ("no effect in Megatron-LM's own megatron-core GPT either (deprecated, or never read by megatron-core's "
     "GPTModel and layers)", (
        ("--use-flash-attn", None), ("--no-async-tensor-model-parallel-allreduce", None),
        ("--disable-async-tensor-model-parallel-allreduce", None), ("--use-dist-ckpt", None),
        ("--dist-ckpt-format", str), ("--ckpt-fully-parallel-save", None), ("--apply-residual-connection-post-layernorm", None),
        ("--rope-scaling-factor", float), ("--onnx-safe", str),
        ("--no-use-tokenizer-model-from-checkpoint-args", None),  # with --use-checkpoint-args only
        ("--disable-use-tokenizer-model-from-checkpoint-args", None))),
    ("a GPU placement, overlap, memory or launcher setting: it changes speed and memory, not what is computed", (
        ("--local-rank", int),  # torchrun sets LOCAL_RANK, which is what is read here
        ("--delay-wgrad-compute", None), ("--use-ring-exchange-p2p", None), ("--defer-embedding-wgrad-compute", None),
        ("--wgrad-deferral-limit", int), ("--microbatch-group-size-per-virtual-pipeline-stage", int),
        ("--account-for-embedding-in-pipeline-split", None), ("--account-for-loss-in-pipeline-split", None),
        ("--pipeline-model-parallel-comm-backend", str), ("--max-seqlen-per-dp-cp-rank", int),
        ("--distribute-saved-activations", None), ("--recompute-modules", "*"),
        ("--no-clone-scatter-output-in-embedding", None), ("--disable-clone-scatter-output-in-embedding", None),
        ("--symmetric-ar-type", str), ("--train-sync-interval", int), ("--no-pin-cpu-grads", None),
        ("--no-pin-cpu-params", None), ("--high-priority-stream-groups", "*"), ("--disable-gloo-process-groups", None),
        ("--no-scatter-gather-tensors-in-pipeline", None), ("--no-align-grad-reduce", None),
        ("--no-align-param-gather", None),
        ("--use-nccl-ub", None), ("--disable-symmetric-registration", None), ("--use-sharp", None),
        ("--sharp-enabled-group", ["dp", "dp_replica"]), ("--create-all-gather-group", None),
        ("--nccl-communicator-config-path", str), ("--use-tp-pp-dp-mapping", None),
        ("--distributed-timeout-seconds-after-init", int), ("--inprocess-empty-cuda-cache", None),
        ("--exit-signal-handler-for-dataloader", None), ("--no-ckpt-fully-parallel-save", None),
        ("--disable-ckpt-fully-parallel-save", None), ("--ckpt-fully-parallel-load", None),
        ("--ckpt-assume-constant-structure", None), ("--distrib-optim-fully-reshardable-mem-efficient", None),
        ("--dataloader-fast-cache-load", None), ("--dataloader-defer-npy-index-mmap", None),
        ("--num-dataset-builder-threads", int), ("--per-dataset-sequences-path", str), ("--disable-msc", None),
        ("--disable-align-grad-reduce", None), ("--mlp-chunks-for-training", int),
        ("--async-ckpt-cpu-priority", int), ("--async-ckpt-io-priority", int),
        ("--async-ckpt-use-cpu-shm", None),
        ("--ckpt-fully-parallel-load-exchange-algo", ["broadcast", "gather_rounds", "gather_object"]),
        ("--ckpt-fully-parallel-save-process-group", ["dp", "ep_dp"]),
        ("--ckpt-fully-parallel-load-process-group", ["dp", "ep_dp"]),
        ("--no-ckpt-load-validate-sharding-integrity", None), ("--disable-ckpt-load-validate-sharding-integrity", None),
        ("--no-stream-ckpt-dequant", None), ("--disable-stream-ckpt-dequant", None))),
    ("a tokenizer-library choice with no effect on the tokenizers here", (
        ("--legacy-tokenizer", None), ("--tokenizer-hf-use-fast", None),
        ("--tiktoken-num-special-tokens", int), ("--tiktoken-special-tokens", "*"),
        ("--tokenizer-sentencepiece-legacy", None), ("--sft-tokenizer-prompt-format", str),
        ("--tokenizer-hf-no-use-fast", None),
        ("--no-tokenizer-sentencepiece-ignore-extra-whitespaces", None),
        ("--disable-tokenizer-sentencepiece-ignore-extra-whitespaces", None), ("--chat-template", str))),
    ("a logging setting of Megatron-LM's", (
        ("--log-progress", None), ("--tensorboard-queue-size", int),
        ("--no-log-loss-scale-to-tensorboard", None), ("--disable-log-loss-scale-to-tensorboard", None),
        ("--log-memory-interval", int), ("--log-device-memory-used", None), ("--log-max-attention-logit", None),
        ("--no-barrier-with-level-1-timing", None), ("--log-world-size-to-tensorboard", None), ("--log-energy", None),
        ("--straggler-ctrlr-port", int),
        ("--result-rejected-tracker-filename", str), ("--config-logger-dir", str), ("--ft-num-warmup-iters", int))),
]

# Megatron-LM flags (arguments.py, core_v0.19.0 and core_v0.16.1) of machinery this trainer does not have: a name ending
# in "-" is a prefix. Given one, the error names the flag and the machinery instead of argparse's "unrecognized
# arguments". (MEGATRON_LM_REFUSED_FLAGS' exact names are read first.)
UNSUPPORTED_FLAGS = [
    # The MoE flags that are not GPTModelProvider fields (those are recognised before this list is read).
    (("--moe-", "--overlap-moe-expert-parallel-comm", "--ep-overlap-early-attn-memory-release",
      "--use-fused-weighted-squared-relu", "--high-priority-a2a-comm-stream",
      "--overlap-dispatch-backward-with-experts-wgrad", "--use-grouped-gemm-for-shared-expert",
      "--save-tokens-per-expert-interval"),
     "Mixture-of-Experts machinery beyond megatron-core's MoELayer with SequentialMLP experts (upcycling, latent MoE, "
     "DeepEP and HybridEP dispatch, expert-parallel communication overlap, MoE recomputation)"),
    (("--cache-mla-latents",), "multi-latent attention's cache of latents for flash decoding at inference"),
    (("--mtp-hybrid-override-pattern",), "multi-token prediction in hybrid (Mamba) models"),
    (("--mamba-", "--hybrid-", "--is-hybrid-model", "--disable-mamba-mem-eff-path", "--linear-conv-kernel-dim",
      "--linear-key-head-dim", "--linear-value-head-dim", "--linear-num-key-heads", "--linear-num-value-heads",
      "--linear-attention-freq", "--experimental-attention-variant", "--dsa-", "--no-dsa-", "--disable-dsa-",
      "--heterogeneous-layers-config-"),
     "Mamba, hybrid and experimental attention layers"),
    (("--perform-rl-step", "--rl-", "--no-rl-", "--grpo-", "--langrl-", "--no-langrl-", "--refit-method"),
     "reinforcement learning (GRPO)"),
    (("--inference-", "--no-inference-", "--max-tokens-to-oom", "--use-legacy-static-engine", "--decode-only-cuda-graphs",
      "--nccl-all-reduce-for-prefill", "--enable-chunked-prefill", "--disable-chunked-prefill", "--flash-decode",
      "--mlp-chunks-for-prefill", "--output-bert-embeddings", "--bert-embedder-type", "--num-speculative-tokens",
      "--use-same-sampling-seed-across-dp-ranks"),
     "the inference server (generate.py samples from a checkpoint)"),
    (("--num-classes", "--img-h", "--img-w", "--num-channels", "--patch-dim", "--classes-fraction",
      "--data-per-class-fraction", "--head-lr-mult", "--vision-", "--swin-backbone-type",
      "--mask-type", "--mask-factor", "--iter-per-epoch", "--dino-", "--mrope-section"), "vision models"),
    (("--encoder-num-layers", "--decoder-num-layers", "--encoder-seq-length", "--decoder-seq-length", "--bert-",
      "--t5-", "--retro-", "--mask-prob", "--short-seq-prob", "--vocab-extra-ids", "--ict-", "--biencoder-",
      "--titles-data-path", "--query-in-block-prob", "--use-one-sent-docs", "--evidence-data-path", "--retriever-",
      "--block-data-path", "--embedding-path", "--indexer-batch-size", "--indexer-log-interval",
      "--relative-attention-num-buckets", "--relative-attention-max-distance"), "T5, BERT, retro and retriever models"),
    (("--fp4-",), "FP4 training (transformer-engine's)"),
    (("--cuda-graph-", "--enable-cuda-graph", "--external-cuda-graph", "--te-rng-tracker", "--optimizer-cuda-graph"),
     "CUDA graphs (and transformer-engine's RNG tracker they need)"),
    (("--tp-comm-", "--no-tp-comm-", "--disable-tp-comm-"), "transformer-engine's userbuffer communication overlap"),
    (("--torch-fsdp2-", "--fsdp-",
      "--outer-dp-sharding-strategy", "--enable-full-sharding-in-hsdp", "--suggested-communication-unit-size",
      "--keep-fp8-transpose-cache",
      "--init-model-with-meta-device", "--megatron-fsdp-"),
     "FSDP beyond Megatron FSDP's sharding strategies and torch FSDP2's default (hybrid sharding, the buffers, "
     "meta-device initialisation, FSDP2 without resharding after the forward)"),
    (("--use-legacy-models",), "Megatron-LM's legacy models (megatron-core's GPTModel is the only model)"),
    (("--optimizer-cpu-offload", "--optimizer-offload-fraction", "--use-torch-optimizer-for-cpu-offload",
      "--overlap-cpu-optimizer-d2h-h2d", "--cpu-offloading-num-layers", "--fine-grained-activation-offloading",
      "--offload-modules", "--min-offloaded-tensor-size", "--activation-offload-fraction",
      "--cpu-offloading-retain-pinned-cpu-buffers", "--delay-offload-until-cuda-graph",
      "--delta-offload-bytes-across-pp-ranks", "--fine-grained-offloading-max-inflight-offloads"),
     "CPU offloading of optimizer states or activations"),
    (("--one-logger-", "--no-one-logger", "--app-tag-run-"), "NVIDIA's one-logger"),
    (("--use-kitchen-", "--kitchen-"), "the kitchen extension"),
    (("--qk-clip", "--qk-clip-"), "Muon's QK-clip (transformer-engine's attention)"),
    (("--use-precision-aware-optimizer", "--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype",
      "--exp-avg-sq-dtype"), "transformer-engine's precision-aware optimizer"),
    (("--non-persistent-", "--replication", "--replication-"), "non-persistent and local (replicated) checkpoints"),
    (("--ckpt-convert-",), "checkpoint conversion (hf.py converts to and from Hugging Face)"),
    (("--adlr-autoresume", "--adlr-autoresume-"), "ADLR autoresume (--exit-signal-handler saves and exits on a signal)"),
    (("--run-workload-inspector-server",), "the workload inspector server"),
    (("--fault-injector-",), "the fault injector"),
    (("--flight-recorder-", "--no-flight-recorder-", "--disable-flight-recorder-"),
     "the NCCL flight recorder (PyTorch's TORCH_NCCL_TRACE_BUFFER_SIZE and related environment variables turn it on)"),
    (("--logits-save-", "--logits-load-"), "logits distillation (saving a teacher's logits and training on them)"),
    (("--use-mup", "--mup-"), "the maximal update parametrization (muP)"),
    (("--tensor-parallel-num-weight-shards", "--expert-tensor-parallel-num-weight-shards"),
     "weight sharding beyond the tensor-parallel ranks (GTP weight rematerialization)"),
    (("--gpu-sniff-test-interval",), "GPU performance sniff tests"),
]


_NO_FP8 = "is a setting of transformer-engine's FP8 training, which this trainer does not drive; drop it (--bf16 trains " \
          "without FP8)"
# What is not built yet: megatron-core's layer-wise distributed optimizer for Muon, multi-latent attention and
# multi-token prediction (their flags that core_v0.16.1 had already are refused as machinery in UNSUPPORTED_FLAGS).
_NOT_YET_OPTIMIZERS = "asks for megatron-core's legacy layer-wise path (parameters gathered without a shard-aligned " \
                      "layout), which is not supported here; drop it (the layout is the default)"
_NOT_YET_MLA = "is a setting of multi-latent attention (MLA) and its YaRN rotary embedding, which are not yet supported " \
               "here; drop it"
_NOT_YET_MTP = "is a variant of multi-token prediction (MTP) that is not yet supported here (--mtp-num-layers " \
               "builds separate MTP layers trained with the model); drop it"
# Megatron-LM flags (arguments.py, core_v0.19.0 and core_v0.16.1) refused for a reason of their own: deprecated ones
# Megatron-LM refuses too, settings whose meaning this trainer cannot give, and machinery not built yet. (flags, the
# rest of the one-line error after the flag). unsupported_flag reads these exact names before UNSUPPORTED_FLAGS.
MEGATRON_LM_REFUSED_FLAGS = [
    (("--no-use-layer-wise-param-layout",), _NOT_YET_OPTIMIZERS),
    (("--muon-use-nesterov",), "is Megatron-LM core_v0.16's name, gone in core_v0.19; use --muon-nesterov"),
    (("--mla-down-proj-fusion", "--yarn-original-max-position-embeddings", "--yarn-beta-fast", "--yarn-beta-slow",
      "--yarn-correction-range-round-to-int", "--no-yarn-correction-range-round-to-int"), _NOT_YET_MLA),
    (("--mtp-detach-heads", "--mtp-use-repeated-layer", "--mtp-standalone"), _NOT_YET_MTP),
    (("--batch-size",), "is no longer valid in Megatron-LM either; use --micro-batch-size"),
    (("--warmup",), "is no longer valid in Megatron-LM either; use --lr-warmup-fraction (or --lr-warmup-iters)"),
    (("--model-parallel-size",), "is no longer valid in Megatron-LM either; use --tensor-model-parallel-size"),
    (("--checkpoint-activations",), "is no longer valid in Megatron-LM either; use --recompute-activations, or "
                                    "--recompute-granularity full with --recompute-method"),
    (("--use-rope-scaling",), "(Llama 3.x RoPE frequency scaling) is a megatron-core GPTModel argument that this "
                              "trainer's model builder does not pass; drop it"),
    (("--fp16-lm-cross-entropy",), "(the cross entropy in fp16) is a megatron-core GPTModel argument that this trainer's "
                                   "model builder does not pass; the loss is computed in fp32 here: drop it"),
    (("--data-parallel-random-init",), "seeds each data-parallel rank differently (its dropout too); this trainer "
                                       "seeds every data-parallel rank alike: drop it"),
    (("--ddp-num-buckets",), "sizes buckets from the parameter count, which the DDP config here is built without; "
                             "give --ddp-bucket-size (parameters per bucket) instead"),
    (("--ddp-reduce-scatter-with-fp32-accumulation",), "(megatron-core's all-to-all reduce-scatter) is not wired into "
                                                       "this trainer's gradient reduction; drop it"),
    (("--overlap-param-gather-with-optimizer-step",), "needs a training loop that starts the parameter all-gather "
                                                      "inside the optimizer step, which this one does not; drop it"),
    (("--pipeline-model-parallel-layout",), "(a custom layout of layers over pipeline stages) is not supported; use "
                                            "--decoder-first/last-pipeline-num-layers or --num-virtual-stages-per-"
                                            "pipeline-rank"),
    (("--batch-invariant-mode",), "(batch-invariant kernels) is not built here; --deterministic-mode makes runs "
                                  "reproducible for a given batch size"),
    (("--decrease-batch-size-if-needed",), "is not supported: the global batch must be a multiple of micro batch x "
                                           "data-parallel size here; set --global-batch-size so"),
    (("--check-weight-hash-across-dp-replicas-interval",), "is not checked by this trainer; drop it"),
    (("--use-checkpoint-args", "--use-mp-args-from-checkpoint-args"),
     "is not supported: settings come from the command line or --config-file (a checkpoint's run_config.yaml is "
     "one)"),
    (("--load-main-params-from-ckpt",), "is not supported: the fp32 main weights are made from the loaded weights; "
                                        "drop it"),
    (("--exit-on-missing-checkpoint",), "is not supported: a --load directory without a checkpoint trains from "
                                        "scratch here, as Megatron-LM without the flag; check the path instead"),
    (("--auto-detect-ckpt-format",), "is not supported: the loader detects the saved format and, when it differs, "
                                     "names the --ckpt-format to pass"),
    (("--dist-ckpt-strictness",), "is not supported: the loader matches the checkpoint's keys as checkpoint.py "
                                  "does; drop it"),
    (("--dist-ckpt-save-pre-mcore-014",), "is not supported: checkpoints are saved in megatron-core 0.16's format"),
    (("--save-wgrads-interval", "--save-dgrads-interval"), "(gradient dumps) is not written by this trainer; drop it"),
    (("--save-params-interval", "--save-activations-interval"), "(parameter and activation dumps) is not written by "
                                                                "this trainer; drop it"),
    (("--override-ckpt-iteration",), "is not supported: a run resumes at its checkpoint's iteration and consumed "
                                     "samples; drop it"),
    (("--verify-integrity",), "(hashes of the checkpoint files) is not supported: checkpoints are saved and loaded "
                              "without them; drop it"),
    (("--enable-msc",), "(the Multi-Storage Client) is not supported: datasets and checkpoints are read from the local "
                        "file system"),
    (("--exit-signal-handler-for-training",), "is not supported; --exit-signal-handler saves a checkpoint and exits on "
                                              "the signal"),
    (("--freeze-all-layers",), "is not supported: every layer trains here (--peft lora trains adapters on frozen "
                               "weights); drop it"),
    (("--step-batch-size-schedule",), "(a stepwise batch-size schedule) is not supported; --rampup-batch-size grows the "
                                      "global batch size linearly"),
    (("--eval-global-batch-size", "--eval-micro-batch-size"), "is not supported: evaluation batches are the training "
                                                              "ones (--global-batch-size, --micro-batch-size); drop it"),
    (("--start-eval-at-iter",), "is not supported: evaluation runs every --eval-interval iterations; drop it"),
    (("--dataloader-inter-document-masking",), "(attention within each document, from cu_seqlens) is not supported: the "
                                               "data loader here gives no document boundaries; drop it"),
    (("--pytorch-profiler-collect-chakra",), "(Chakra execution traces) is not collected by the PyTorch profiler here; "
                                             "drop it"),
    (("--save-retain-interval",), "is not supported; --most-recent-k keeps the newest K checkpoints"),
    (("--test-mode",), "(Megatron-LM's functional-test hooks) is not supported; drop it"),
    (("--full-validation", "--multiple-validation-sets", "--validation-set-names"),
     "is not supported: evaluation runs --eval-iters batches of the one validation split; drop it"),
    (("--phase-transition-iterations",), "(training phases) is not supported; drop it"),
    (("--data-args-path", "--per-split-data-args-path"), "is not read here; give the prefixes with --data-path (or "
                                                         "--train-data-path, --valid-data-path, --test-data-path)"),
    (("--sample-rate",), "(subsampling the training data) is not supported; drop it"),
    (("--object-storage-cache-path",), "is not supported: datasets are read from the local file system"),
    (("--mid-level-dataset-surplus",), "is not supported: blended datasets use megatron-core's default surplus; drop it"),
    (("--allow-ambiguous-pad-tokens",), "is not supported: pad tokens are masked as megatron-core's GPTDataset does by "
                                        "default; drop it"),
    (("--fim-eod-token",), "is not supported: FIM samples end with the tokenizer's end-of-document token; drop it"),
    (("--padded-vocab-size",), "is not supported: the vocabulary is padded from the tokenizer's size with "
                               "--make-vocab-size-divisible-by"),
    (("--no-pad-vocab-size", "--disable-pad-vocab-size"), "is not supported: the vocabulary is always padded from the "
                                                          "tokenizer's size with --make-vocab-size-divisible-by"),
    (("--null-tokenizer-eod-id", "--null-tokenizer-pad-id"),
     "is not supported: the NullTokenizer here takes ids 0 to --vocab-size - 1, the last of them its end-of-document "
     "(as Megatron-LM's from core_v0.17), and has no pad id; drop it"),
    (("--tokenizer-metadata", "--tokenizer-special-tokens"), "is not read by the tokenizers here (HuggingFaceTokenizer: "
                                                             "put special tokens in its tokenizer.json)"),
    (("--tokenizer-hf-include-special-tokens",), "is Megatron-LM 0.16's: 0.19, and this trainer, include special "
                                                 "tokens by default (--tokenizer-hf-no-include-special-tokens leaves "
                                                 "them out); drop it"),
    (("--lazy-mpu-init",), "is for programs that call Megatron-LM's initialize_megatron themselves; drop it"),
    (("--fake-process-group",), "(training without collectives, for benchmarks) is not supported; drop it"),
    (("--spec",), "is not supported: this trainer builds its own layer spec from --transformer-impl, --normalization, "
                  "--qk-layernorm and --qk-l2-norm"),
    (("--yaml-cfg",), "is not read (Megatron-LM's YAML layout); --config-file takes this trainer's YAML, one mapping "
                      "per section"),
    (("--dump-param-to-param-group-map",), "is not supported: parameter groups come from "
                                           "cfg.optimizer_config_override_provider"),
    (("--apply-wd-to-qk-layernorm", "--no-weight-decay-cond-type"),
     "is not supported: 1-D parameters (norms) get no weight decay here; subclass OptimizerConfigOverrideProvider to "
     "change that"),
    (("--fp8-quantizer-factory", "--fp8-interval", "--no-fp8-wgrad", "--disable-fp8-wgrad", "--first-last-layers-bf16",
      "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16", "--te-precision-config-file",
      "--reuse-grad-buf-for-mxfp8-param-ag", "--fp8-output-proj"), _NO_FP8),
]


def unsupported_flag(token: str) -> Optional[str]:
    """The one-line reason a Megatron-LM flag is refused here, or None for a flag not in MEGATRON_LM_REFUSED_FLAGS or
    UNSUPPORTED_FLAGS. The exact names of MEGATRON_LM_REFUSED_FLAGS come first (a new --muon-* or --mtp-* flag is not
    yet supported, where UNSUPPORTED_FLAGS' prefixes name the machinery)."""
    name = token.split("=", 1)[0]
    for names, reason in MEGATRON_LM_REFUSED_FLAGS:
        if name in names:
            return f"{name} {reason}"
    for names, machinery in UNSUPPORTED_FLAGS:
        if any(name == n or (n.endswith("-") and name.startswith(n)) for n in names):
            return (f"{name} is a Megatron-LM setting of {machinery}, which this trainer does not have; drop it")
    return None
