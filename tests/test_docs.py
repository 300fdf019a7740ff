"""The documentation's code runs: every Python block of the README, and every block of the guide (``docs/``)
marked to run on the CPU, is run as a script, so the examples cannot rot.

A block is marked by the line ``<!-- test: cpu -->`` right before its fence (an HTML comment: invisible on GitHub
and on the site). Each block runs alone in a fresh interpreter, in an empty directory, with a deadline; a
multi-rank example starts its ranks itself through the project's launcher (``odc_runtime.launch``), as a user
would run it. Every Python block of the README must carry the mark: the front page shows only code that runs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- test: cpu -->"
FENCE = re.compile(r"^```(\w*)\s*$")


def blocks(path: Path) -> list[tuple[int, str, bool, str]]:
    """(line, language, marked, code) of every fenced block of a Markdown file; a mark that is not followed by a
    Python fence is an error (a misplaced mark would otherwise run nothing, silently)."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == MARK:
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if nxt.strip() != "```python":
                raise AssertionError(f"{path.name}:{i + 1}: {MARK} must be followed by a ```python fence")
        m = FENCE.match(line)
        if m:
            start = i
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            marked = start > 0 and lines[start - 1].strip() == MARK
            out.append((start + 1, m.group(1), marked, "\n".join(lines[start + 1 : i]) + "\n"))
        i += 1
    return out


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runnable() -> list[tuple[str, str]]:
    found = []
    for path in pages():
        for line, lang, marked, code in blocks(path):
            if marked and lang == "python":
                found.append((f"{path.relative_to(ROOT)}:{line}", code))
    return found


def test_every_readme_python_block_is_marked_to_run() -> None:
    readme = blocks(ROOT / "README.md")
    python = [(line, marked) for line, lang, marked, _ in readme if lang == "python"]
    assert python, "the README shows no Python example"
    unmarked = [line for line, marked in python if not marked]
    assert unmarked == [], f"README.md Python blocks at lines {unmarked} are not marked {MARK}: make them run"


def _slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def test_readme_links_reach_existing_pages_and_anchors() -> None:
    """The site's strict build checks the guide's links; the README lies outside it, so its links are checked
    here: every relative target exists, and every #anchor into a guide page names one of its headings."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        target, _, anchor = link.partition("#")
        path = ROOT / target if target else ROOT / "README.md"
        assert path.exists(), f"README.md links to {link}: {target} does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"README.md links to {link}: no such heading"


# A Sphinx role (``:func:`init` ``): mkdocstrings renders Markdown, where it shows up raw on the API reference.
SPHINX_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const|ref):`")
# Notes for the project's own work tracker: a user of the guide cannot follow them.
INTERNAL_NOTE = re.compile(r"\bissues? #?\d+(?![\w-])|\bthis README used to", re.I)


def test_docstrings_use_no_sphinx_roles() -> None:
    """The API reference is generated from the package's docstrings (docs/reference/): code is written ``x``
    (or as a mkdocstrings cross-reference), never as a Sphinx role."""
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for path in sorted([*(ROOT / "odc_runtime").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])
             for i, line in enumerate(path.read_text().splitlines(), 1) if SPHINX_ROLE.search(line)]
    assert found == [], "Sphinx roles render raw on the API reference; write ``name`` instead:\n" + "\n".join(found)


def test_user_pages_hold_no_internal_notes() -> None:
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}" for path in pages()
             for i, line in enumerate(path.read_text().splitlines(), 1) if INTERNAL_NOTE.search(line)]
    assert found == [], "the guide refers to the project's own issues; say what is so instead:\n" + "\n".join(found)


def test_the_checks_catch_what_they_look_for() -> None:
    assert SPHINX_ROLE.search("see :func:`odc_runtime.init`") and SPHINX_ROLE.search(":class:`~.x.Y`")
    assert not SPHINX_ROLE.search("``init`` and ODC_BACKEND=symm: the backend")
    assert INTERNAL_NOTE.search("measured before issue 14") and INTERNAL_NOTE.search("(issues 32)")
    assert not INTERNAL_NOTE.search("it issues 4-wide vector reductions")


def test_a_misplaced_mark_is_an_error(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"{MARK}\n\n```python\nprint(1)\n```\n")
    with pytest.raises(AssertionError, match="must be followed by a"):
        blocks(page)
    page.write_text(f"text\n{MARK}\n```python\nprint(1)\n```\n```bash\nls\n```\n")
    assert [(lang, marked) for _, lang, marked, _ in blocks(page)] == [("python", True), ("bash", False)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("where", "code"), runnable(), ids=[w for w, _ in runnable()])
def test_documented_code_runs(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", ODC_TIMEOUT="60", PYTHONPATH=str(ROOT))
    # A session of its own: on the deadline the whole group goes, the spawned ranks included.
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{where}: did not finish within 120 s\n{out[-3000:]}")
    assert proc.returncode == 0, f"{where}: exit status {proc.returncode}\n{out[-4000:]}"
