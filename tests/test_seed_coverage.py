"""docs/bridge-map.md's table of Megatron Bridge's functions and classes: every place it names exists, and every
name the specification's documentation pages list is in it."""

import ast
import glob
import os
import re

import pytest

from conftest import ROOT

SEEDS = os.path.join(os.path.dirname(ROOT), "shared", "seeds")
ROW = re.compile(r"^\| `(\w+)` \| (?:`(\w+)\.py:(\w+)`|—) \|(.*)\|$", re.M)


def readme_rows() -> dict:
    text = open(os.path.join(ROOT, "docs", "bridge-map.md")).read()
    section = text.split("# Where each Bridge function and class lives", 1)[1].split("\n## ", 1)[0]
    # a row the pattern does not read (say `module.py:Class.method`) would silently drop out of both tests
    unread = [line for line in section.splitlines() if line.startswith("| `") and not ROW.match(line)]
    assert not unread, f"rows of docs/bridge-map.md not in the form | `name` | `module.py:symbol` or — | note |: {unread}"
    return {m[0]: (m[1], m[2], m[3]) for m in ROW.findall(section)}


def top_level_names(module: str) -> set:
    tree = ast.parse(open(os.path.join(ROOT, f"{module}.py")).read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def seed_names() -> set:
    """Functions and classes the seed pages document: `bridge.training.<module>.<name>` entries, and the
    entry points' page (pretrain, finetune, forward_step, masked_token_loss, GlobalState)."""
    names = set()
    for path in glob.glob(os.path.join(SEEDS, "*.txt")):
        text = open(path, encoding="utf-8").read()
        for module, name in re.findall(r"^(?:class )?bridge\.training\.([\w.]+)\.(\w+)(?:\(|#)", text, re.M):
            if not module.endswith(("config", "train", "train_utils", "theoretical_memory_utils")):
                continue
            names.add(name)
        names.update(re.findall(r"bridge\.training\.(?:pretrain|finetune|gpt_step|losses|state)\.(\w+)", text))
    return names - {"train_utils", "theoretical_memory_utils"}


def test_every_place_in_the_table_exists():
    rows = readme_rows()
    assert len(rows) > 60
    for name, (module, symbol, note) in rows.items():
        if module:
            assert symbol in top_level_names(module), f"{name}: {module}.py has no {symbol}"
        else:  # not here: the note must say why
            assert len(note.strip()) > 10, name


@pytest.mark.skipif(not os.path.isdir(SEEDS), reason="the specification (../shared/seeds) is not beside the checkout")
def test_every_seed_name_is_in_the_table():
    documented = seed_names()
    assert {"train", "training_log", "ConfigContainer", "pretrain", "compute_activation_memory"} <= documented
    missing = documented - set(readme_rows())
    assert not missing, f"seed names missing from the table of docs/bridge-map.md: {sorted(missing)}"
