"""The README stays true without anyone remembering to check it (issue 30): every figure in it is a
figure of benchmarks/RESULTS.md, each figure of its figures table names its machine, it stays under
300 lines, every relative link in it and in docs/ resolves (anchors included), and its two top
commands are the ones .ci/run runs. Text only: no processes."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
MAX_README_LINES = 300
TOP_COMMANDS = ["bash .ci/setup && .venv/bin/torchrun --nproc_per_node 2 examples/train_gpt.py --tp 2 --steps 50",
                "bash .ci/setup && .venv/bin/python -m pytest -q"]

# A decimal (0.94, 1.1 in "1.1B"), not a piece of a version such as 2.28.9.
DECIMAL = re.compile(r"(?<![\d.])(\d+\.\d+)(?!\.?\d)")
# An integer with a unit (160 ms, 14 %, 64 KiB, 10 s); "2×H100" names a machine, not a ratio.
UNITS = r"(ms|µs|us|s|min|GiB|MiB|KiB|GB/s|%|×)"
INTEGER_WITH_UNIT = re.compile(r"(?<![\d.,])(\d+(?:,\d{3})*)\s?" + UNITS + r"(?![\w/])(?!\s?H\d)")
# Versions are requirements, not measurements: "Python ≥ 3.10", "torch 2.11", "Apache-2.0".
VERSION_BEFORE = re.compile(r"(Python|torch|NCCL|CUDA|nvcc|transformers|setuptools|driver|Apache-)\s*(≥|>=|==)?\s*$")
SAME_UNIT = {"us": "µs", "µs": "µs"}


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _prose(text):
    """Markdown without fenced code, HTML comments and link targets: where figures are stated."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return re.sub(r"\]\([^)]*\)", "]", text)


def figures(text):
    """(number, unit or None) for every figure stated in `text`'s prose."""
    prose = _prose(text)
    found = [(m.group(1), None) for m in DECIMAL.finditer(prose) if not VERSION_BEFORE.search(prose[:m.start()])]
    found += [(m.group(1), m.group(2)) for m in INTEGER_WITH_UNIT.finditer(prose)
              if not VERSION_BEFORE.search(prose[:m.start()])]
    return found


def in_results(number, unit, results):
    pattern = r"(?<![\d.,])" + re.escape(number)
    if unit is None:
        pattern += r"(?!\.?\d)"
    else:
        unit = SAME_UNIT.get(unit, unit)
        pattern += r"\s?" + ("(µs|us)" if unit == "µs" else re.escape(unit)) + r"(?![\w/])"
    return re.search(pattern, results) is not None


def test_every_readme_figure_is_in_results():
    results = _read(RESULTS)
    found = figures(_read(README))
    assert len(found) >= 30, f"the figure scanner found only {found}"
    missing = sorted({f"{n} {u or ''}".strip() for n, u in found if not in_results(n, u, results)})
    assert not missing, f"README figures not in benchmarks/RESULTS.md: {missing}"


@pytest.mark.parametrize("text, expected", [
    ("0.94 × torch's, 2×H100, torch ≥ 2.11, NCCL 2.28.9, 160 ms and +14 %, 1.1B, `2.0784`.",
     [("0.94", None), ("1.1", None), ("2.0784", None), ("160", "ms"), ("14", "%")]),
    ("```\n--lr 0.5 3.3 ms\n```\n[x](a/1.5.md) <!-- 9.9 --> 10 s and 7 steps", [("10", "s")]),
])
def test_figure_scanner(text, expected):
    assert sorted(figures(text)) == sorted(expected)
    assert in_results("0.94", None, "ratio 0.94 x") and not in_results("0.94", None, "ratio 0.945")
    assert in_results("160", "ms", "took 160 ms") and not in_results("160", "ms", "160.2 ms")


def test_figures_table_names_a_machine_in_every_figure():
    text = _read(README)
    table = text.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|") and not line.startswith("|---")][1:]
    assert len(rows) >= 8
    for row in rows:
        for cell in [c.strip() for c in row.strip("|").split("|")][1:]:
            if re.search(r"\d", cell):
                assert re.search(r"\d×H(100|200)", cell), f"a figure without its machine (e.g. 2×H100): {cell!r}"


def test_readme_is_short():
    lines = _read(README).count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines, expected at most {MAX_README_LINES}"


def _slug(heading):
    """GitHub's anchor for a heading."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(path):
    text = re.sub(r"^```.*?^```", "", _read(path), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def _markdown_files():
    return [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + \
        sorted(glob.glob(os.path.join(ROOT, "benchmarks", "RESULTS*.md")))


def broken_links(path):
    text = re.sub(r"^```.*?^```", "", _read(path), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue                       # http(s):, mailto:
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not os.path.exists(dest):
            broken.append(f"{target} (no {os.path.relpath(dest, ROOT)})")
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor})")
    return broken


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
    assert not broken_links(path), f"{os.path.relpath(path, ROOT)}: broken links {broken_links(path)}"


def test_link_checker_sees_missing_files_and_anchors(tmp_path):
    (tmp_path / "b.md").write_text("# Title here\n## Tests\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#tests) [gone](c.md) [bad](b.md#nope) [web](https://x.org/y) `[code](z.md)`\n")
    assert broken_links(str(page)) == ["c.md (no " + os.path.relpath(str(tmp_path / "c.md"), ROOT) + ")",
                                       "b.md#nope (no heading #nope)"]


def test_top_commands_are_what_ci_runs():
    blocks = re.findall(r"^```bash\n(.*?)^```", _read(README), flags=re.S | re.M)
    assert blocks and [line for line in blocks[0].splitlines() if line.strip()] == TOP_COMMANDS
    ci = [line.strip() for line in _read(os.path.join(ROOT, ".ci", "run")).splitlines()]
    assert "bash .ci/setup" in ci
    assert TOP_COMMANDS[1].split(" && ")[1] in ci                 # .ci/run's test command is the README's
    assert ci.index("bash .ci/setup") < ci.index(TOP_COMMANDS[1].split(" && ")[1])
    script = _read(os.path.join(ROOT, "examples", "train_gpt.py"))
    for flag in ("--tp", "--steps"):
        assert f'"{flag}"' in script, f"examples/train_gpt.py has no {flag}"
    setup = _read(os.path.join(ROOT, ".ci", "setup"))
    # .venv/bin/torchrun comes with torch, which .ci/setup installs into .venv
    assert "-m venv .venv" in setup and re.search(r"pip_ install [^\n]*\btorch\$TORCH_PIN", setup)
