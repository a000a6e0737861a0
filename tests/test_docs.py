"""The docs stay true to the code: generated parts are current, links resolve, the README stays short, and the code
cites the repository's own docs (lab slugs and reference pages), never notebook section numbers or outside files."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def _tracked(*patterns: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot list the tracked files")
    return [ROOT / p for p in out.splitlines() if (ROOT / p).is_file()]


def _anchors(path: Path) -> set[str]:
    """GitHub's heading slugs: lowercase, punctuation dropped (hyphens, underscores kept), spaces -> '-', repeats numbered."""
    out, seen = set(), {}
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    for line in text.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
            slug = re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    out.update(re.findall(r'<a\s+(?:name|id)="([^"]+)"', text))
    return out


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= 160, f"README.md has {n} lines; keep it <= 160 (details belong in docs/reference/)"


def test_method_reference_is_generated_from_the_code():
    from wushkv.methods.reference import render

    path = ROOT / "docs" / "reference" / "methods.md"
    text = path.read_text(encoding="utf-8")
    assert render(text) == text, "docs/reference/methods.md is stale: python -m wushkv.methods.reference docs/reference/methods.md"


def test_every_relative_link_resolves():
    bad = []
    for f in _tracked("README.md", "docs/*.md", "docs/**/*.md", "benchmarks/*.md", "experiments/*.md"):
        text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", f.read_text(encoding="utf-8")))
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                bad.append(f"{f.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{f.relative_to(ROOT)}: {target}: no such heading")
    assert not bad, "\n".join(bad)


def test_code_cites_the_repository_docs():
    """Citations in code name lab slugs and reference pages that exist; no notebook section numbers, no METHOD §."""
    stale = re.compile(r"ABLATIONS|GENERATION\.md|RESULTS\.md|SIMULATION\.md|PERFORMANCE\.md|FORMAT\.md|DESIGN\.md|"
                       r"INTEGRATIONS\.md|METHOD ?§|\bsections? \d+")
    cite = re.compile(r"docs/[\w./-]+\.md")
    bad = []
    for f in _tracked("src/*.py", "src/**/*.py", "tests/*.py", "tests/**/*.py", "benchmarks/*.py", "experiments/*.py", "Makefile"):
        if f.name == "test_docs.py":
            continue
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if stale.search(line):
                bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
            for c in cite.findall(line):
                if not (ROOT / c).is_file():
                    bad.append(f"{f.relative_to(ROOT)}:{i}: cites {c}, which does not exist")
    assert not bad, "\n".join(bad)


def test_selection_page_lists_the_default_candidates():
    """docs/reference/selection.md's table of candidates is the list `wushkv select` runs by default: every default
    candidate by its full name, and no recipe row that is not one."""
    from wushkv.eval.select import DEFAULT_CANDIDATES

    text = (ROOT / "docs" / "reference" / "selection.md").read_text(encoding="utf-8")
    table = text[text.index("| recipe | what it is |"):]
    table = table[: table.index("\n\n")]
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    listed = [name for row in rows for name in re.findall(r"`([^`]+)`", row)]
    assert sorted(listed) == sorted(DEFAULT_CANDIDATES), (listed, DEFAULT_CANDIDATES)
