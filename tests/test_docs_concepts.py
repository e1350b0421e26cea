"""docs/concepts.md cannot rot: every python snippet runs (its asserts check the answer's claims), every link to
a posttrain function names one that exists, and every question has both."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "concepts.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
CODE_LINK = re.compile(r"\[`([A-Za-z_][A-Za-z0-9_]*)`\]\((\.\./posttrain/[^)]+\.py)\)")
DOC_LINK = re.compile(r"\]\(([a-z_]+\.md)\)")


def sections() -> list[tuple[str, str, int]]:
    """(heading, body, line number of the heading) of each `## ` section."""
    text = DOC.read_text()
    starts = [m for m in re.finditer(r"^## (.+)$", text, re.M)]
    out = []
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        out.append((m.group(1), text[m.start():end], text.count("\n", 0, m.start()) + 1))
    return out


def snippets() -> list[tuple[str, str, int]]:
    out = []
    for heading, body, line in sections():
        for m in FENCE.finditer(body):
            out.append((heading, m.group(1), line + body.count("\n", 0, m.start()) + 1))
    return out


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40]


SNIPPETS = snippets()


def test_every_question_has_a_link_to_its_code_and_a_snippet():
    assert len(sections()) >= 10
    for heading, body, _ in sections():
        assert CODE_LINK.search(body), f"'{heading}': no link to the posttrain function that implements it"
        assert FENCE.search(body), f"'{heading}': no python snippet"


@pytest.mark.parametrize("name, path", sorted({m.groups() for m in CODE_LINK.finditer(DOC.read_text())}))
def test_linked_functions_exist(name, path):
    file = (DOC.parent / path).resolve()
    assert file.is_file(), f"{path} does not exist"
    if name == file.stem:  # a link to a module
        return
    pattern = rf"^(def|class) {name}\b|^{name} ="
    assert re.search(pattern, file.read_text(), re.M), f"{path} defines no '{name}'"


def test_linked_docs_exist():
    for page in DOC_LINK.findall(DOC.read_text()):
        assert (DOC.parent / page).is_file(), page


@pytest.mark.timeout(300)
@pytest.mark.parametrize("heading, code, line", SNIPPETS, ids=[f"L{s[2]}-{slug(s[0])}" for s in SNIPPETS])
def test_snippet_runs(heading, code, line, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{DOC}:{line}", "exec"), {"__name__": "__concepts__"})
