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
    # What the file says comes back as it was written (derived values included), section by section.
    import yaml
    written = yaml.safe_load(open(path))
    again = yaml.safe_load(config.to_yaml(cfg))
    differ = {s: {k: v for k, v in written[s].items() if again[s].get(k) != v} for s in written if written[s]}
    assert differ == {s: {} for s in written if written[s]}
