"""The GPU path: megatron-core's DDP, optimizer (bf16, distributed optimizer), schedules and dist_checkpointing.

These run only where CUDA is available; on a CPU machine they are skipped with the reason below."""

import os

import pytest
import torch

from conftest import PRINTED, TINY, log_lines, torchrun

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: megatron-core's DDP, optimizer, schedules and dist_checkpointing hard-code CUDA")


def test_bf16_distributed_optimizer_trains_saves_and_resumes(tmp_path):
    common = [*TINY, "--mock-data", "--bf16", "--use-distributed-optimizer", "--log-interval", "5",
              "--eval-interval", "10", "--eval-iters", "2", "--save", str(tmp_path / "ckpt"), "--num-workers", "0",
              "--data-cache-path", str(tmp_path / "cache")]
    first = torchrun([*common, "--train-iters", "20", "--save-interval", "10"], nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]
    losses = [l[3] for l in log_lines(first.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "20"
    assert "metadata.json" in os.listdir(tmp_path / "ckpt" / "iter_0000020")  # dist_checkpointing (torch_dist)

    resumed = torchrun([*common, "--train-iters", "30", "--load", str(tmp_path / "ckpt"),
                        "--override-opt-param-scheduler"], nproc=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [l[0] for l in log_lines(resumed.stdout)] == [25, 30]


def test_sdpa_attention_matches_megatron_local_attention_on_gpu():
    """SDPAttention (flash kernels through PyTorch SDPA) computes what megatron-core's DotProductAttention does."""
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    import config

    import checks
    from model import SDPAttention, set_random_seed, transformer_config

    torch.distributed.init_process_group("nccl", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        # megatron-core's DotProductAttention forks the RNG tracker's model-parallel stream for its dropout on a GPU
        set_random_seed(1234)
        cfg = checks.parse_args(["--attention-dropout", "0", "--num-query-groups", "2"], world_size=1, gpu=True)
        tc = transformer_config(cfg)
        ours = SDPAttention(tc, 1, AttnMaskType.causal).cuda()
        ref = DotProductAttention(tc, 1, AttnMaskType.causal, "self").cuda()
        s, b, h, g, d = 64, 2, cfg.model.num_attention_heads, 2, cfg.model.kv_channels
        q = torch.randn(s, b, h, d, device="cuda")
        k, v = torch.randn(s, b, g, d, device="cuda"), torch.randn(s, b, g, d, device="cuda")
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device="cuda"), 1)[None, None]
        # A GPU's fused attention kernels (flash, memory-efficient) block the softmax and its sums otherwise, and
        # may compute the scores in TF32 (10-bit mantissa, 2^-11 relative of products of order 1 over 64 terms):
        # within 1e-4 of order-1 outputs.
        torch.testing.assert_close(ours(q, k, v, None), ref(q, k, v, mask), rtol=1e-4, atol=1e-4)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_overlap_param_gather_toggles_forward_pre_hooks_and_trains_as_without(tmp_path):
    """--overlap-param-gather: megatron DDP's forward pre-hooks gather the distributed optimizer's parameter
    shards during the next forward. train() keeps them off for the first step and around evaluations and saves
    (train.should_disable_forward_pre_hook / disable_forward_pre_hook / enable_forward_pre_hook); a run with
    them gives the losses of the same run without overlap, and its checkpoints resume."""
    nproc = min(2, torch.cuda.device_count())  # 2 ranks: the all-gather has shards to gather
    common = [*TINY, "--mock-data", "--bf16", "--use-distributed-optimizer", "--log-interval", "1", "--eval-interval",
              "3", "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
              "--global-batch-size", str(4 * nproc), "--data-cache-path", str(tmp_path / "cache")]
    plain = torchrun([*common, "--train-iters", "8"], nproc=nproc)
    assert plain.returncode == 0, plain.stderr[-3000:]
    overlap_flags = ["--overlap-grad-reduce", "--overlap-param-gather"]
    overlap = torchrun([*common, *overlap_flags, "--train-iters", "8", "--save", str(tmp_path / "ckpt"),
                        "--save-interval", "4"], nproc=nproc)
    assert overlap.returncode == 0, overlap.stderr[-3000:]
    plain_losses, overlap_losses = [l[3] for l in log_lines(plain.stdout)], [l[3] for l in log_lines(overlap.stdout)]
    assert len(overlap_losses) == 8
    # The overlapped reduce runs nccl's kernels beside the backward's, which may group some fp32 sums otherwise (the
    # REORDERED argument, per iteration); 1e-3 separates that from a step taken with stale parameters, which moves
    # the loss by the step's own change, ~1e-2 relative per iteration here.
    assert overlap_losses == pytest.approx(plain_losses, rel=1e-3)
    resumed = torchrun([*common, *overlap_flags, "--train-iters", "8", "--load", str(tmp_path / "ckpt"),
                        "--ckpt-step", "4"], nproc=nproc)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [l[3] for l in log_lines(resumed.stdout)] == pytest.approx(overlap_losses[4:], rel=1e-3)  # as above


def test_async_save_with_dist_checkpointing_publishes_and_resumes_exactly(tmp_path):
    """--async-save through megatron-core's AsyncCallsQueue: the checkpoint of iteration 6 is published
    while training goes on, and resuming from it gives the straight run's losses for 7-12."""
    args = [*TINY, "--mock-data", "--bf16", "--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0", "--data-cache-path", str(tmp_path / "cache"), "--train-iters", "12",
            "--save", str(tmp_path / "ckpt"), "--save-interval", "6", "--async-save"]
    straight = torchrun(args, nproc=1)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "successfully saved checkpoint from iteration       6" in straight.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert "metadata.json" in os.listdir(tmp_path / "ckpt" / "iter_0000006")
    resumed = torchrun([a for a in args if a != "--async-save"] + ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "6",
                                                                   "--save", str(tmp_path / "ckpt2")], nproc=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first, second = log_lines(straight.stdout), log_lines(resumed.stdout)
    assert [l[0] for l in second] == list(range(7, 13))
    assert [l[3] for l in second] == pytest.approx([l[3] for l in first[6:]], rel=PRINTED)  # same kernels, inputs, device


def test_flash_decoding_gives_the_plain_cached_decodings_logits_on_gpu():
    """generate.py's flash decoding on a GPU, on the local layers, in bf16 (flash-attn's own kernel takes fp16 and
    bf16 only; device.py's, where flash-attn is missing, any): the kernel runs at every layer and decode step
    (cached_steps counts it), and the prefill's and every step's logits are megatron-core's plain cached decoding's
    to bf16's rounding."""
    from conftest import LLAMA_FLAGS
    from test_generate import cached_steps, one_process_world_ends, random_model

    try:
        model = random_model([*LLAMA_FLAGS, "--transformer-impl", "local", "--bf16"], gpu=True)
        assert next(model.parameters()).is_cuda and next(model.parameters()).dtype == torch.bfloat16
        flash, plain = cached_steps(model, True).float(), cached_steps(model, False).float()
        # Two bf16 attention kernels: each output rounds to bf16 (2^-8 relative) at each of the 2 layers, and the
        # logits add the two layers' differences through the residual stream: within 2 x 2^-7 of the largest logit.
        torch.testing.assert_close(flash, plain, rtol=0, atol=2 ** -6 * plain.abs().max().item())
    finally:
        one_process_world_ends()


def test_an_external_device_mapping_binds_device_0_whatever_the_local_rank(monkeypatch):
    """Bridge's dist.external_gpu_device_mapping: the launcher gave each process its own GPU (CUDA_VISIBLE_DEVICES),
    so device 0 is the rank's, not the LOCAL_RANK-th."""
    import device

    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))  # no such device: binding by rank would fail
    device.bind_local_gpu(True, external_mapping=True)
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("flags", [["--use-megatron-fsdp"],
                                   ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],
                                   ["--use-megatron-fsdp", "--bf16", "--megatron-fsdp-main-grads-dtype", "fp32"],
                                   ["--use-megatron-fsdp", "--bf16"],
                                   ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--bf16"]],
                         ids=["megatron_fsdp", "torch_fsdp2", "megatron_fsdp_bf16_fp32_grads", "megatron_fsdp_bf16",
                              "torch_fsdp2_bf16"])
def test_fsdp_trains_saves_and_resumes_on_a_gpu(tmp_path, flags):
    """What the CPU runs otherwise (docs/cpu.md): Megatron FSDP's gradient reduction with its division fused into
    NCCL's PREMUL_SUM, its parameter all-gather asynchronous, FSDP2 on a "cuda" mesh; and their checkpoints
    (fsdp_dtensor, torch_dist) from GPU memory, the first save's collectives on NCCL (checkpoint._fill_empty_shards
    reduces on the GPU). A run saved at 5 and resumed gives the straight run's losses for 6-10 within REORDERED (a
    GPU's kernels may order their sums otherwise from one launch to the next); under bf16 within 2^-8 (a weight's bf16
    copy may round to its neighbour: test_fsdp's bf16 argument)."""
    from conftest import REORDERED

    common = [*TINY, "--mock-data", "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
              "--attention-dropout", "0", "--num-workers", "0", "--train-iters", "10",
              "--data-cache-path", str(tmp_path / "cache"), *flags]
    straight = torchrun([*common, "--save", str(tmp_path / "ckpt"), "--save-interval", "5"], nproc=1)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert ".metadata" in os.listdir(tmp_path / "ckpt" / "iter_0000005")
    resumed = torchrun([*common, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "5"], nproc=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ours = {l[0]: float(l[3]) for l in log_lines(resumed.stdout)}
    theirs = {l[0]: float(l[3]) for l in log_lines(straight.stdout)}
    assert sorted(ours) == [6, 7, 8, 9, 10]
    rel = 2 ** -8 if "--bf16" in flags else REORDERED + PRINTED
    assert all(ours[it] == pytest.approx(theirs[it], rel=rel) for it in ours)
