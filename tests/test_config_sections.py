"""The configuration is megatron-core's own: each section an instance of the class the seed page names as its base,
and nothing a user could say before the sections moved onto those classes lost on the way (the flag set and a
run_config.yaml, both recorded before the move in tests/fixtures/config_before/)."""

import os

import config

BEFORE = os.path.join(os.path.dirname(__file__), "fixtures", "config_before")


def test_every_flag_of_before_the_move_is_still_a_flag():
    before = open(os.path.join(BEFORE, "flags.txt")).read().split()
    now = {o for action in config.build_parser()._actions for o in action.option_strings}
    assert len(before) > 400 and [f for f in before if f not in now] == []


def test_a_run_config_yaml_written_before_the_move_still_loads():
    path = os.path.join(BEFORE, "run_config.yaml")
    cfg = config.parse_args(["--config-file", path], world_size=1, gpu=False)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.train_iters) == (2, 64, 5)
    assert (cfg.scheduler.lr_warmup_iters, cfg.checkpoint.save_interval, cfg.train.exit_signal_handler) == (2, 3, True)
    # What the file says comes back as it was written (derived values included), section by section, but for the
    # settings that moved: the evaluation settings are the validation section's (train's are Bridge's deprecated
    # spellings, copied there), the straggler switch is megatron-core's negative one, and megatron-core's post-init
    # makes the async strategy mcore without --async-save.
    import yaml
    written = yaml.safe_load(open(path))
    again = yaml.safe_load(config.to_yaml(cfg))
    differ = {s: {k: v for k, v in written[s].items() if again[s].get(k) != v} for s in written if written[s]}
    assert {s: d for s, d in differ.items() if d} == {
        "validation": {"eval_iters": None, "eval_interval": None, "skip_train": None},
        "straggler": {"enable_straggler_on_startup": True}, "checkpoint": {"async_strategy": "nvrx"}}
    t = written["train"]
    assert (cfg.validation.eval_iters, cfg.validation.eval_interval, cfg.validation.skip_train) == (
        t["eval_iters"], t["eval_interval"], t["skip_train"])
    assert cfg.straggler.disable_straggler_on_startup is False and cfg.checkpoint.async_strategy == "mcore"
