"""The documentation stays true where it is read: README.md and every docs/*.md page.

(a) Citations. Every `name.py:N` or `name.py:N-M` of the project's own files (a top-level module or tests/...)
    points at lines the file has. Any other `name.py:N` must name its package path (`megatron/core/...`,
    `torch/...`), and that path and line must exist in the installed package. Every `tests/...` path exists, and
    every `tests/test_x.py::test_name` is a test of that file. Every `module.name` of the project's modules is a
    top-level name of that module.
(b) Flags. Every `--flag` the pages name is one of train.py's parser (with Megatron-LM's inert, refused and
    unsupported flags), of the project's other commands (generate.py, hf.py, data.py, peft.py), of torchrun, or of
    the few other tools the pages run (EXTERNAL_FLAGS).
(c) Links. Every relative link resolves to a file, and its anchor to a heading of that file.

Light: nothing here imports torch or megatron-core; the installed packages are read as files.
"""

import ast
import glob
import importlib.util
import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT

PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
MODULES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py")))
# Flags of tools other than the project's and torchrun's that the pages show in a command.
EXTERNAL_FLAGS = {"--index-url": "pip", "--no-deps": "pip", "--log_samples": "lm_eval", "--logdir": "tensorboard", "--capture-range": "nsys",
                  "--capture-range-end": "nsys", "--durations": "pytest", "--nonblocking": "py-spy", "--idle": "py-spy",
                  "--threads": "py-spy"}
# `module.name` spans that are not the project's: transformers' module path of DeepSeek-V3's layer 61.
NOT_OURS = {"model.layers"}


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
        return fh.read()


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def line_count(path: str) -> int:
    with open(path, encoding="utf-8") as fh:
        return len(fh.read().splitlines())


def cited_lines(spec: str) -> list:
    """'12', '12-15', '12,30-31' -> [12, 15, 31]: the last line of each part (the first is smaller)."""
    lines = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        assert not last or int(first) <= int(last), f"a backwards range: {spec}"
        lines.append(int(last or first))
    return lines


CITATION = re.compile(r"(?<![\w.-])((?:[\w.-]+/)*[\w-]+\.py):(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)")


def package_root(package: str) -> str:
    """The installed package's folder, found without importing it."""
    spec = importlib.util.find_spec(package)
    return os.path.dirname(spec.origin) if spec.origin else list(spec.submodule_search_locations)[0]


def citation_problems(page: str, text: str) -> list:
    problems = []
    roots = {"megatron": os.path.dirname(package_root("megatron.core")), "torch": package_root("torch"),
             "emerging_optimizers": package_root("emerging_optimizers"), "lm_eval": package_root("lm_eval")}
    for path, spec in CITATION.findall(text):
        top = path.split("/", 1)[0]
        if "/" not in path and path[:-3] in MODULES or path.startswith("tests/"):
            file = os.path.join(ROOT, path)
        elif top in roots and "/" in path:
            file = os.path.join(roots[top], path.split("/", 1)[1])
        else:
            problems.append(f"{page}: {path}:{spec} is no file of the project; name its package "
                            f"(megatron/core/..., torch/...)")
            continue
        if not os.path.isfile(file):
            problems.append(f"{page}: {path}:{spec}: no such file ({file})")
            continue
        n = line_count(file)
        if any(line < 1 or line > n for line in cited_lines(spec)):
            problems.append(f"{page}: {path}:{spec} points past the end of {path} ({n} lines)")
    # A package path cited without a line must exist too.
    for path in re.findall(r"`((?:megatron|torch)/[\w/]+\.py)`", text):
        top, rest = path.split("/", 1)
        if not os.path.isfile(os.path.join(roots[top], rest)):
            problems.append(f"{page}: {path}: no such file in the installed {top}")
    return problems


def top_level_names(module: str) -> set:
    tree = ast.parse(read(f"{module}.py" if module != "conftest" else "tests/conftest.py"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


# What `model.x` may also be: a file name's extension, or a setting of the config section of that name
# (`model.hidden_size`, `checkpoint.load`, `train.train_iters` in YAML).
EXTENSIONS = {"py", "md", "json", "jsonl", "yaml", "safetensors", "txt", "pt"}


def section_settings() -> dict:
    import dataclasses

    import config

    cfg = config.ConfigContainer()
    return {f.name: {g.name for g in dataclasses.fields(getattr(cfg, f.name))} for f in dataclasses.fields(cfg)
            if dataclasses.is_dataclass(getattr(cfg, f.name))}


def name_problems(page: str, text: str) -> list:
    """`module.name` at the start of an inline code span, and in the pages' Python blocks."""
    problems, cache, settings = [], {}, section_settings()
    modules = "|".join(MODULES + ["conftest"])
    spans = re.findall(r"`([^`\n]+)`", without_code_blocks(text))
    spans += re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
    for span in spans:
        for module, name in re.findall(rf"(?<![\w./-])({modules})\.([A-Za-z_]\w*)", span):
            if name in EXTENSIONS or name in settings.get(module, ()) or f"{module}.{name}" in NOT_OURS:
                continue
            if module not in cache:
                cache[module] = top_level_names(module)
            if name not in cache[module]:
                problems.append(f"{page}: {module}.{name}: {module}.py has no top-level {name}")
    return problems


def missing_tests_and_paths(page: str, text: str) -> list:
    problems = []
    for path, _, name in re.findall(r"(?<![\w/])(tests/[\w./-]*\w)(::(\w+))?", text):
        file = os.path.join(ROOT, path)
        if not os.path.exists(file):
            problems.append(f"{page}: {path}: no such file")
        elif name and not re.search(rf"^(?:async )?def {name}\(", read(path), re.M):
            problems.append(f"{page}: {path} has no test {name}")
    return problems


# --- (a) citations ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_every_file_line_citation_points_at_lines_that_exist(page):
    text = read(page)
    assert citation_problems(page, text) == []


@pytest.mark.parametrize("page", PAGES)
def test_every_module_name_test_and_tests_path_the_pages_give_exists(page):
    text = read(page)
    assert name_problems(page, text) + missing_tests_and_paths(page, text) == []


# --- (b) flags ----------------------------------------------------------------------------------------------------


def argument_flags(path: str) -> set:
    """The `--flags` a file's argparse calls declare (add_argument's string arguments), read without importing it."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    return {arg.value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) in ("add_argument", "addoption", "_addoption")
            for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}


def known_flags() -> set:
    import config
    import megatron_lm_flags

    known = {o for action in config.build_parser()._actions for o in action.option_strings}
    known |= {flag for _, flags in megatron_lm_flags.MEGATRON_LM_INERT_FLAGS for flag, _ in flags}
    known |= {flag for prefixes, _ in megatron_lm_flags.MEGATRON_LM_REFUSED_FLAGS for flag in prefixes}
    for module in ("generate", "hf", "data", "peft", "bench", "downstream", "layouts"):
        known |= argument_flags(os.path.join(ROOT, f"{module}.py"))
    known |= argument_flags(os.path.join(package_root("torch"), "distributed", "run.py"))  # torchrun
    known |= argument_flags(os.path.join(ROOT, "tests", "conftest.py"))  # the suite's own: pytest --full
    known |= argument_flags(os.path.join(package_root("xdist"), "plugin.py"))  # pytest-xdist's: -n, --dist
    return known | set(EXTERNAL_FLAGS)


# Flags a recipe of docs/fork.md adds to a copy of the code (tests/test_fork.py makes the edit and runs them)
FORK_RECIPE_FLAGS = {"--mish"}


def flag_problems(page: str, text: str, known: set) -> list:
    import config
    import megatron_lm_flags

    problems = []
    for flag in sorted(set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9_-]*[a-z0-9])", text))):
        if flag in known or flag in ("--inprocess", "--fp8"):  # the families --inprocess-* and --fp8-*
            continue
        if page == "docs/fork.md" and flag in FORK_RECIPE_FLAGS:
            continue
        if megatron_lm_flags.unsupported_flag(flag) is not None:  # a Megatron-LM flag refused by name, one line
            continue
        problems.append(f"{page}: {flag} is a flag of no command here")
    return problems


def test_every_flag_the_pages_name_exists():
    known = known_flags()
    assert {"--hidden-size", "--prompt", "--hf", "--output-prefix", "--nproc-per-node"} <= known
    problems = [p for page in PAGES for p in flag_problems(page, read(page), known)]
    assert problems == []


# --- (c) links ----------------------------------------------------------------------------------------------------


def anchors(text: str) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens; repeats get -1, -2, ..."""
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6} (.+)$", without_code_blocks(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def link_problems(page: str, text: str) -> list:
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code_blocks(text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        if not os.path.exists(file):
            problems.append(f"{page}: ({target}): no such file")
        elif anchor and anchor not in anchors(open(file, encoding="utf-8").read()):
            problems.append(f"{page}: ({target}): no heading #{anchor} in {os.path.relpath(file, ROOT)}")
    return problems


@pytest.mark.parametrize("page", PAGES)
def test_every_link_resolves(page):
    assert link_problems(page, read(page)) == []


def test_the_readme_maps_every_page_and_each_page_says_what_it_answers():
    readme = read("README.md")
    for page in PAGES[1:]:
        assert f"]({page})" in readme, f"README.md does not link {page}"
        assert "What this page answers" in read(page), f"{page} does not start with what it answers"


def test_the_readmes_test_commands_are_what_ci_runs():
    """The fast command, then the full proof: .ci/run's last two lines, both in the README's quick start."""
    ci = [line for line in read(".ci/run").splitlines() if line.strip() and not line.startswith("#")][-2:]
    assert ci == ["python -m pytest -q -n 2 tests", "python -m pytest -q -n 2 tests --full"]
    assert f"&& {ci[0]}\n{ci[1]}\n" in read("README.md")
    install = "pip install -r requirements.txt && pip install --no-deps -r requirements-tasks.txt"
    assert f"python3.12 -m venv .venv && . .venv/bin/activate && {install} && torchrun --nproc-per-node 2 train.py" \
        in read("README.md")
    assert f"python3.12 -m venv .venv && . .venv/bin/activate && {install} && {ci[0]}" in read("README.md")
    assert [f"python -m {command.replace('pip install', 'pip install -q')}" for command in install.split(" && ")] == \
        [line for line in read(".ci/run").splitlines() if line.startswith("python -m pip install -q -") and
         not line.endswith(" pip")]  # (pip's own upgrade first)


def test_python_version_names_the_readmes_python_and_pyenv_finds_it_in_the_clone():
    """.python-version names the Python of the README's install line. Where pyenv manages the Pythons and has a 3.12,
    `python3.12` runs in the clone whatever version is selected elsewhere (without the file, pyenv's shim answers
    "pyenv: python3.12: command not found" when another one is)."""
    pyenv = shutil.which("pyenv")
    root = pyenv and subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
    if root and glob.glob(os.path.join(root, "versions", "3.12*")):
        # As in a fresh shell: no PYENV_VERSION (it overrides the file), no virtual environment (pyenv-virtualenv
        # answers with its python3.12).
        env = {k: v for k, v in os.environ.items() if k not in ("PYENV_VERSION", "VIRTUAL_ENV")}
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                      if not os.path.isfile(os.path.join(p, "activate")))
        proc = subprocess.run([pyenv, "exec", "python3.12", "--version"], cwd=ROOT, env=env, capture_output=True,
                              text=True)
        assert proc.returncode == 0 and proc.stdout.startswith("Python 3.12."), proc.stderr
    assert read(".python-version") == "3.12\n"
    assert "\npython3.12 -m venv .venv && " in read("README.md")


def test_the_checks_catch_what_they_are_for():
    """Each check fails on what it is for. The issue that made these pages: `schedules.py:334-335` meant megatron-core's
    pipeline_parallel/schedules.py, and a reader opened the project's own 36-line schedules.py first."""
    assert citation_problems("x.md", "`schedules.py:334-335`")  # past the end of the project's schedules.py
    assert citation_problems("x.md", "`router.py:96`")  # megatron-core's, without its package path
    assert citation_problems("x.md", "`megatron/core/transformer/moe/router.py:999999`")
    assert citation_problems("x.md", "`megatron/core/no_such_file.py:1`")
    assert not citation_problems("x.md", "`megatron/core/pipeline_parallel/schedules.py:334-335`, `train.py:1`")
    assert name_problems("x.md", "`model.NoSuchClass`") and not name_problems("x.md", "`model.SequentialExperts`")
    assert missing_tests_and_paths("x.md", "`tests/test_moe.py::test_no_such_test`")
    assert missing_tests_and_paths("x.md", "`tests/test_no_such_file.py`")
    known = known_flags()
    assert flag_problems("x.md", "`--no-such-flag`", known) and not flag_problems("x.md", "`--lr`", known)
    assert link_problems("docs/x.md", "[a](no_such_page.md)")
    assert link_problems("docs/x.md", "[a](moe.md#no-such-heading)")
    assert not link_problems("docs/x.md", "[a](moe.md#where-the-experts-live) [b](../README.md#quick-start)")


def test_the_readmes_defects_table_is_docs_defects_page():
    """The README's defects table keeps one row per defect of docs/defects.md, with the same upstream citation and
    test: every worked-around upstream defect is named in the README with its file:line and its test."""
    table = read("README.md").split("## Upstream defects", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| .+? \| `([^`]+)` \| `([^`]+)` \| (.+) \|$", table, re.M)
    page = read("docs/defects.md")
    sections = re.split(r"^## (?=\d+\. )", page, flags=re.M)[1:]
    assert [int(n) for n, *_ in rows] == list(range(1, len(sections) + 1)) and len(rows) >= 14
    for (n, upstream, workaround, tests), section in zip(rows, sections):
        assert section.startswith(f"{n}. ")
        assert upstream.split(":")[0] in section, (n, upstream)
        assert workaround in section, (n, workaround)
        for test in re.findall(r"`(tests/[^`]+)`", tests):
            assert test.split("::")[-1] in section, (n, test)


def test_the_readmes_fork_recipes_are_the_pages():
    """The README's table row for fork.md lists each recipe of the page, and the page has no recipe the row lacks."""
    row = next(line for line in read("README.md").splitlines() if line.startswith("| [fork.md](docs/fork.md) |"))
    own = lambda text: text.replace(" of your own", "")  # noqa: E731
    items = [re.sub(r"^(a|an) ", "", own(item.strip().lower())) for item in re.split(r"[,;]", row.split("|")[2])]
    headings = [own(h.lower()) for h in re.findall(r"^## (.*)$", read("docs/fork.md"), re.M)]
    assert all(any(item in h for h in headings) for item in items), (items, headings)
    assert all(any(item in h for item in items) for h in headings), (items, headings)


# --- (e) where each model setting is read ---------------------------------------------------------------------------

# A model setting read as `cfg.model.NAME`, `state.cfg.model.NAME` or `m.NAME` (the modules' name for cfg.model).
SETTING_READ = re.compile(r"(?:\bm|\.model)\.([a-z_][a-z0-9_]*)\b")
READS_TABLE = "<!-- the table below is tests/test_docs.py's setting_reads() -->"


def setting_reads() -> dict:
    """{model setting: the top-level modules that read it}, for GPTModelProvider's fields and its mlp_fields()."""
    import dataclasses

    import config

    names = {f.name for f in dataclasses.fields(config.GPTModelProvider)} | {"mlp_fields"}
    reads: dict = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "*.py"))):
        for name in set(SETTING_READ.findall(open(path).read())) & names:
            reads.setdefault(name, []).append(os.path.basename(path)[:-3])
    return reads


def reads_table(reads: dict) -> str:
    return "\n".join(["| setting | read by |", "| --- | --- |",
                      *[f"| `{name}` | {', '.join(f'`{m}.py`' for m in modules)} |" for name, modules in
                        sorted(reads.items(), key=lambda item: (-len(item[1]), item[0]))]])


def test_the_model_page_lists_every_module_that_reads_each_model_setting():
    """docs/model.md's table of where each model setting is read is the code's (print it again with
    `cd tests && python -c "import test_docs as t; print(t.reads_table(t.setting_reads()))"`):
    a fork that resembles a setting finds every module it must look at. Not covered: reads under another name than
    cfg.model or m (a getattr, a copy of the config)."""
    page = read("docs/model.md")
    assert READS_TABLE in page
    shown = page.split(READS_TABLE, 1)[1].strip().split("\n\n", 1)[0].strip()
    assert shown == reads_table(setting_reads())
