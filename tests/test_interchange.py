"""Megatron-LM's and Bridge's checkpoints resume here, and ours holds what their loaders read.

The fixtures (tests/fixtures/interchange/, its README says how they were made) are tiny checkpoints written by
Megatron-LM's own pretrain_gpt.py and Bridge's own pretrain() at iteration 5, each with the losses its program
printed when it went on from that checkpoint to iteration 10. train.py loads each as it is, with the program's
command line, and must print the same losses: to the log line's 7 digits on the machine that made the fixture, and
within conftest.ELSEWHERE on another CPU.
"""

import argparse
import json
import os
import re
import shutil

import pytest
import torch
import yaml

from conftest import ELSEWHERE, PRINTED, ROOT, checkpoint_keys, same_printed_grad_norm, tensorboard_scalars, torchrun

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "interchange")


def _printed(program):
    with open(os.path.join(FIXTURES, program, "printed.json")) as fh:
        return json.load(fh)


# megatron_lm_v3_muon: Megatron-LM's DeepSeek-V3-shaped GPT (4 layers, MLA, MoE from the second layer with the sigmoid
# router, expert bias, group top-k, shared expert and seq_aux_loss, one MTP layer), trained with Muon at EP=2.
V3 = "megatron_lm_v3_muon"
FSDP = "megatron_lm_fsdp"
# Their printed losses compared, each program's: the lm loss; MoE's load-balancing loss; the MTP layer's loss.
LOSSES = {"megatron_lm": ["lm loss"], "bridge": ["lm loss"], "megatron_lm_moe": ["lm loss", "load_balancing_loss"],
          # its load_balancing_loss is 0 (README); its seq_load_balancing_loss is averaged over the decoder's 3 MoE
          # layers and the MTP layer's, as Megatron-LM's training.py:2792 (core_v0.19.0) has the tracker count them
          V3: ["lm loss", "load_balancing_loss", "seq_load_balancing_loss", "mtp_1 loss"],
          # megatron_lm_fsdp: megatron_lm's run under --use-megatron-fsdp (ZeRO-3), its checkpoint in fsdp_dtensor
          FSDP: ["lm loss"]}


@pytest.fixture(scope="module", params=["megatron_lm", "bridge", "megatron_lm_moe", V3, FSDP])
def continued(request, tmp_path_factory, warm_torchrun):
    """train.py going on from the program's checkpoint with the program's own flags, saving at iteration 10."""
    program, out = request.param, tmp_path_factory.mktemp(request.param)
    printed = _printed(program)
    shutil.copytree(os.path.join(FIXTURES, program, "ckpt"), out / "theirs")
    proc = warm_torchrun([*printed["flags"], "--load", str(out / "theirs"), "--save", str(out / "ours"),
                     "--tensorboard-dir", str(out / "tb"), "--data-cache-path", str(out / "cache")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return dict(program=program, printed=printed, out=out, stdout=proc.stdout, tb=tensorboard_scalars(out / "tb"))


def _assert_their_losses(continued, losses):
    theirs, ours = continued["printed"]["continued"], continued["tb"]
    for step in range(6, 11):
        for loss in losses:
            want = float(theirs[str(step)][loss])
            got = ours[loss][step]
            if continued["program"].startswith("megatron_lm") and step == 7:
                # Megatron-LM (0.19 as 0.16) prints the first iteration of a run on its own, then the mean of the interval
                # since the start, that first iteration included: with --log-interval 1, iteration 7 is mean(6, 7).
                got = (ours[loss][6] + ours[loss][7]) / 2
            assert got == pytest.approx(want, rel=ELSEWHERE), (loss, step, got, want)  # their machine's digits


def test_their_checkpoint_continues_with_their_losses(continued):
    """megatron_lm_moe: Megatron-LM's MoE GPT (4 experts, top-2, aux loss) saved by 2 ranks at EP=2 with the alltoall
    dispatcher; its load-balancing loss is compared too. megatron_lm_v3_muon: its sequence-wise balancing loss and
    its MTP loss too."""
    theirs, ours = continued["printed"]["continued"], continued["tb"]
    assert sorted(map(int, theirs)) == sorted(ours["lm loss"]) == [6, 7, 8, 9, 10]
    _assert_their_losses(continued, LOSSES[continued["program"]])
    for step in range(6, 11):
        assert same_printed_grad_norm(ours["grad-norm"][step], theirs[str(step)]["grad norm"]), step


def test_their_progress_and_tokenizer_are_read(continued):
    out = continued["stdout"]
    assert f"loaded checkpoint {continued['out'] / 'theirs' / 'iter_0000005'} at iteration 5" in out
    assert " iteration        6/      10 | consumed samples:           48 |" in out
    if continued["program"] == "bridge":  # its NullTokenizer leaves tokenizer/ empty (and git keeps no empty folder)
        assert "names no tokenizer: reading it with the flags' {'class': 'NullTokenizer', 'vocab_size': 60, " \
               "'eod_id': 59}" in out
    else:
        assert "names no tokenizer" not in out  # Megatron-LM's `args` name it, and it matches the flags


def test_our_checkpoint_holds_what_their_loaders_read(continued):
    """What Megatron-LM's load_checkpoint (checkpointing.py, core_v0.19.0) and Bridge's (training/checkpointing.py,
    0.6.2) read, each of the type they read it as: the common state through megatron-core's load_common_state_dict, which
    unpickles it with torch.load(weights_only=True) and megatron-core's safe globals."""
    from megatron.core import dist_checkpointing

    save = continued["out"] / "ours"
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "10"
    it = save / "iter_0000010"
    if continued["program"] == FSDP:  # fsdp_dtensor: as Megatron-LM's rank 0 reads it (checkpointing.py:1761-1765)
        common = {"args": None, "iteration": None, "checkpoint_version": None, "num_floating_point_operations_so_far": None}
        torch.distributed.checkpoint.load(common, checkpoint_id=str(it), no_dist=True)
        common["opt_param_scheduler"] = {k for k in checkpoint_keys(it) if k.startswith("opt_param_scheduler.")}
    else:
        common = dist_checkpointing.load_common_state_dict(str(it))  # as theirs loads it
    assert common["iteration"] == 10 and common["checkpoint_version"] == 3.0
    assert isinstance(common["num_floating_point_operations_so_far"], float)
    args = common["args"]
    assert isinstance(args, argparse.Namespace)
    expected = {"num_layers": 4 if continued["program"] == V3 else 2, "hidden_size": 16, "num_attention_heads": 2,
                "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "world_size": 2,
                "data_parallel_size": 2, "consumed_train_samples": 80, "skipped_train_samples": 0,
                "consumed_valid_samples": 0, "no_save_rng": False, "no_save_optim": False,
                # Megatron-LM's --no-position-embedding switch, which its loader compares with its own command line's
                # (checkpointing.py:171): True unless given, under RoPE too
                "add_position_embedding": True, "tokenizer_type": "NullTokenizer", "vocab_size": 60,
                "padded_vocab_size": 64 if continued["program"].startswith("megatron_lm") else 128}
    for name, value in expected.items():
        assert getattr(args, name) == value and type(getattr(args, name)) is type(value), name
    if continued["program"] in ("megatron_lm_moe", V3):
        # Every tensor and object Megatron-LM's MoE checkpoint holds, under its names (the experts as one sharded
        # tensor per weight, its random states one per (PP, TP) rank; V3's MLA, MTP layer and Muon's momentum).
        assert (args.num_experts, args.expert_model_parallel_size, args.moe_router_topk) == (4, 2, 2)
        if continued["program"] == V3:
            assert (args.multi_latent_attention, args.mtp_num_layers, args.optimizer) == (True, 1, "muon")
        theirs = checkpoint_keys(os.path.join(FIXTURES, continued["program"], "ckpt", "iter_0000005"))
        # Megatron-LM 0.17 on also writes its rerun state machine's state, which it reads only where it is there.
        theirs = {k for k in theirs if not k.startswith("rerun_state_machine_state/")}
        assert checkpoint_keys(it) == theirs and "rng_state/shard_0.0_1.1" in theirs
    elif continued["program"] == FSDP:
        # Every tensor and object Megatron-LM's fsdp_dtensor checkpoint holds, under its names: the main weights, each
        # parameter's Adam state and group settings, the random states of (PP, TP) rank (0, 0), `args` and the rest.
        assert (args.use_megatron_fsdp, args.data_parallel_sharding_strategy, args.ckpt_format) == (
            True, "optim_grads_params", "fsdp_dtensor")
        theirs = checkpoint_keys(os.path.join(FIXTURES, FSDP, "ckpt", "iter_0000005"))
        theirs = {k for k in theirs if not k.startswith("rerun_state_machine")}
        assert checkpoint_keys(it) == theirs and "rng_state.(0, 0).0.torch_rng_state" in theirs
    else:  # the random states as both keep them: one object per (PP, TP) rank, here (1, 1)
        assert "rng_state/shard_0.0_1.1" in checkpoint_keys(it)
    assert "opt_param_scheduler" in common and any(k.startswith("optimizer.") for k in checkpoint_keys(it))
    # Bridge's train_state.pt: 0-d tensors under its eight names.
    state = torch.load(it / "train_state.pt")
    assert set(state) == {"step", "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples",
                          "floating_point_operations_so_far", "do_train", "do_valid", "do_test"}
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in state.values())
    assert state["step"].item() == 10 and state["do_train"].item() is True and state["do_valid"].item() is False
    assert torch.load(save / "latest_train_state.pt")["step"].item() == 10
    # Bridge's run_config.yaml reads: the TP/PP sizes and what was saved.
    run_config = yaml.safe_load((it / "run_config.yaml").read_text())
    assert run_config["model"]["tensor_model_parallel_size"] == 1 and run_config["model"]["pipeline_model_parallel_size"] == 1
    assert run_config["checkpoint"]["save_rng"] is True and run_config["checkpoint"]["save_optim"] is True
    assert json.loads((it / "tokenizer" / "identity.json").read_text()) == {"class": "NullTokenizer", "vocab_size": 60,
                                                                          "eod_id": 59}


def test_megatron_lm_continues_our_grouped_query_checkpoint_with_our_losses(tmp_path, warm_torchrun):
    """Megatron-LM builds --num-query-groups only with --group-query-attention (arguments.py:1348-1351). train.py's
    checkpoint of a grouped-query model made with --num-query-groups 2 alone carries the switch in its args, and
    Megatron-LM's pretrain_gpt.py went on from it (fixture megatron_lm_gqa: its printed losses, 6-10) with the losses
    train.py prints going on from the same checkpoint, written again here."""
    with open(os.path.join(FIXTURES, "megatron_lm_gqa", "printed.json")) as fh:
        printed = json.load(fh)
    flags, cache = [*printed["flags"], "--data-cache-path", str(tmp_path / "cache")], tmp_path / "ck"
    first = warm_torchrun([*flags, "--save", str(cache), "--save-interval", "5", "--exit-interval", "5",
                      "--tensorboard-dir", str(tmp_path / "tb1")])
    assert first.returncode == 0, first.stderr[-3000:]
    from megatron.core import dist_checkpointing

    args = dist_checkpointing.load_common_state_dict(str(cache / "iter_0000005"))["args"]
    assert args.group_query_attention is True and args.num_query_groups == 2 and args.num_attention_heads == 4
    assert "derived: model.group_query_attention = True (--num-query-groups 2: grouped-query attention" in first.stdout
    written = tensorboard_scalars(tmp_path / "tb1")["lm loss"]
    assert [written[i] for i in range(1, 6)] == pytest.approx(
        [float(printed["first_run"][str(i)]["lm loss"]) for i in range(1, 6)], rel=ELSEWHERE)  # their machine's digits
    second = warm_torchrun([*flags, "--load", str(cache), "--no-save", "--tensorboard-dir", str(tmp_path / "tb2")])
    assert second.returncode == 0, second.stderr[-3000:]
    ours, theirs = tensorboard_scalars(tmp_path / "tb2"), printed["continued"]
    for step in range(6, 11):
        got = ours["lm loss"][step] if step != 7 else (ours["lm loss"][6] + ours["lm loss"][7]) / 2  # its mean(6, 7)
        assert got == pytest.approx(float(theirs[str(step)]["lm loss"]), rel=ELSEWHERE), step  # their machine's digits
        assert same_printed_grad_norm(ours["grad-norm"][step], theirs[str(step)]["grad norm"]), step


def test_a_checkpoint_of_megatron_core_0_16_continues_with_its_losses(tmp_path, warm_torchrun):
    """Checkpoints move forward: train.py's own checkpoint written on megatron-core 0.16.1 (its common state in a
    common.pt, two writer files on rank 0; fixture megatron_core_0_16, default dropout 0.1) goes on here from
    iteration 5 with the lm loss and grad norm that the 0.16.1 stack printed going on from it, and the checkpoint
    saved now is 0.19's form (the common state inside the torch_dist files, no common.pt)."""
    fixture = os.path.join(ROOT, "tests", "fixtures", "megatron_core_0_16")
    with open(os.path.join(fixture, "printed.json")) as fh:
        printed = json.load(fh)
    shutil.copytree(os.path.join(fixture, "ckpt"), tmp_path / "old")
    assert (tmp_path / "old" / "iter_0000005" / "common.pt").is_file()
    # Its NullTokenizer of 60 counted the end-of-document apart (megatron-core <= 0.16): 61 ids in today's meaning.
    flags = printed["flags"]
    flags = [*flags[:flags.index("--vocab-size")], "--vocab-size", "61", *flags[flags.index("--vocab-size") + 2:]]
    proc = warm_torchrun([*flags, "--load", str(tmp_path / "old"), "--save", str(tmp_path / "new"),
                     "--data-cache-path", str(tmp_path / "cache")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = [[i, loss, norm] for i, loss, norm in
           ((int(m[0]), float(m[1]), float(m[2])) for m in
            re.findall(r"iteration +(\d+)/ +\d+ \|.*?lm loss: ([\d.E+-]+) \|.*?grad norm: ([\d.]+) \|", proc.stdout))]
    assert [g[0] for g in got] == [6, 7, 8, 9, 10]
    for (step, loss, norm), (_, want_loss, want_norm) in zip(got, printed["continued"]):
        # Printed by the 0.16.1 stack on the machine that made the fixture (the same arithmetic on another CPU), and
        # ours read from our log line: both sides printed, so a PRINTED more, and a whole unit of the grad norm's
        # third decimal (each side rounds it by half a unit).
        assert loss == pytest.approx(want_loss, rel=ELSEWHERE + PRINTED), step
        assert abs(norm - want_norm) <= 1e-3 + ELSEWHERE * want_norm, step
    it = tmp_path / "new" / "iter_0000010"
    assert not (it / "common.pt").exists() and "common_state/shard_0_1" in checkpoint_keys(it)


def test_a_null_tokenizer_of_megatron_core_0_16_is_told_apart_in_one_line():
    """megatron-core 0.17 changed what --vocab-size means for a NullTokenizer (the end-of-document is now the last of
    the V ids; before, the next one): the 0.16 checkpoint's NullTokenizer of 60 is 61 ids now, and the old flags are
    refused before any weight loads, naming what the weights were trained with."""
    import checkpoint
    import data

    directory = os.path.join(ROOT, "tests", "fixtures", "megatron_core_0_16", "ckpt", "iter_0000005")
    checkpoint.check_tokenizer(data.NullTokenizer(61), directory, {})
    with pytest.raises(checkpoint.CheckpointError, match=r"identity.json: the weights were trained with tokenizer "
                       r"\{'class': 'NullTokenizer', 'vocab_size': 61, 'eod_id': 60\} but the flags give "
                       r"\{'class': 'NullTokenizer', 'vocab_size': 60, 'eod_id': 59\}"):
        checkpoint.check_tokenizer(data.NullTokenizer(60), directory, {})
