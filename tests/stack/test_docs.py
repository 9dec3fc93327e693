"""README.md and docs/*.md, read as a person reads them: every repository path they name exists (so a renamed
module shows here, not in a reader's shell), every link between them lands on a file and a heading that exist,
and no line is over 200 characters (a table row a person can read). The README's commands, where that is cheap:
each kdtreectl line parses, each POST /mode body is one the sidecar takes, each compose file's header starts it as
the README does, an `.env` edit replaces its line, and the compose version check comes first."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MAX_LINE = 200
# The repository's own top-level names: a path that starts with one of them is a repository path.
TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".git")} | {".ci", ".env.example", "build"}
# Paths the docs name that a checkout does not hold until something makes them: the user's own files and
# build outputs, each ignored by git.
MADE = {
    ".env",
    "models",
    "build",
    "kernel_build/build",
    "kdtree/lib",
    "compose/local.yaml",
    "server.local.env",
    ".whl",
    ".variants",
    "device-out",
    "kdtree-check",
    "bench-out",
}
# A path-like word: folders and a file with an extension, or a folder ending in "/".
PATH = re.compile(
    r"(?<![\w./-])((?:\.?[\w-]+/)+(?:[\w.-]+\.\w+|[\w.-]+/?)?|[\w.-]+\.(?:md|py|yaml|yml|toml|sh|cu|h|json|lock))"
)


def named_paths(text: str) -> set[str]:
    """Repository paths in backticks or markdown links: `kdtree/verify.py`, [x](docs/operations.md#anchor)."""
    spans = re.findall(r"`([^`]+)`", text) + re.findall(r"\]\(([^)#\s]+)", text)
    found = set()
    for span in spans:
        for word in re.split(r"[\s,;:()'\"=]+", span):
            word = word.rstrip(".").removeprefix("./")
            if not word or "://" in word or word.startswith(("/", "~", "$", "-")) or "*" in word:
                continue
            m = PATH.fullmatch(word)
            if m and word.split("/")[0] in TOP:
                found.add(word.rstrip("/"))
    return found


def resolves(doc: Path, path: str) -> bool:
    """From the repository root, or (a link) from the document's folder."""
    if any(path == m or path.startswith(m + "/") for m in MADE):
        return True
    return (REPO / path).exists() or (doc.parent / path).resolve().exists()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_the_docs_name_exists(doc):
    missing = sorted(p for p in named_paths(doc.read_text()) if not resolves(doc, p))
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file: each heading's slug, and each `<a id>`."""
    text = doc.read_text()
    slugs = {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", text, re.M)
    }
    return slugs | set(re.findall(r'<a id="([^"]+)"></a>', text))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_lands_on_a_file_and_heading_that_exist(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{doc.relative_to(REPO)}: links to no file or heading: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_line_is_over_200_characters(doc):
    long = [(n, len(line)) for n, line in enumerate(doc.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, f"{doc.relative_to(REPO)}: lines over {MAX_LINE} characters (line, length): {long}"


def test_the_path_check_sees_a_missing_path(tmp_path):
    """The check above is not vacuous: a renamed module would be caught."""
    doc = tmp_path / "doc.md"
    text = "The mode file: `kdtree/control.py`; gone: `kdtree/no_such_module.py`, [x](docs/nowhere.md#y)."
    assert named_paths(text) >= {"kdtree/control.py", "kdtree/no_such_module.py", "docs/nowhere.md"}
    assert resolves(doc, "kdtree/config.py") and not resolves(doc, "kdtree/no_such_module.py")
    assert "mode-changes" in anchors(REPO / "docs" / "architecture.md")


# ---- the README's commands, kept honest where that is cheap ----------------------------------------------------

README = REPO / "README.md"


def bash_lines(doc: Path) -> list[str]:
    """The command lines of a document's bash blocks (a continued line joined), without comments."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#\s", line.strip(), maxsplit=1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_the_readme_says_which_compose_to_type_before_its_first_compose_command():
    """Where only compose v1 exists, `docker compose -f` fails with Docker's own "unknown shorthand flag: 'f'":
    the README says how to tell, before the first command that would fail so."""
    text = README.read_text()
    check = text.index("`docker compose version`")
    assert text.index("`docker-compose version`") < text.index("```bash\n") and check < text.index(
        "```bash\n"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_an_env_edit_replaces_its_line_and_never_appends_a_second(doc):
    """`echo NAME=... >> .env` alone leaves two NAME lines (.env.example has one): each append deletes it first."""
    for line in doc.read_text().splitlines():
        for name in re.findall(r"echo (\w+)=\S* >> ?\.env", line):
            assert f"sed -i '/^{name}=/d' .env" in line, f"{doc.relative_to(REPO)}: {line.strip()}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_ci_docker_command_the_docs_name_exists(doc):
    script = (REPO / ".ci" / "docker.sh").read_text()
    known = set(re.findall(r"^  (\w+)\)", script.split('case "$COMMAND" in', 1)[1], re.M))
    named = set(re.findall(r"\.ci/docker\.sh (\w+)", doc.read_text()))
    assert named <= known, (
        f"{doc.relative_to(REPO)} names .ci/docker.sh {sorted(named - known)}; it has {known}"
    )


def test_every_kdtreectl_command_in_the_readme_parses():
    """A renamed command or flag shows here, not in a reader's shell."""
    from kdtreectl.cli import build_parser

    commands = [line.split("kdtreectl ", 1)[1] for line in bash_lines(README) if "kdtreectl " in line]
    assert len(commands) >= 10, commands
    for command in commands:
        argv = shlex.split(re.split(r"[|;&]", command, maxsplit=1)[0])
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"README: kdtreectl {command!r} does not parse")


def test_every_post_mode_body_in_the_readme_is_one_the_sidecar_takes():
    from sidecar.api import ModeRequest

    bodies = [
        re.search(r"-d '([^']*)'", line) for line in bash_lines(README) if "localhost:8080/mode" in line
    ]
    assert bodies and all(bodies), bodies
    for body in bodies:
        ModeRequest.model_validate_json(body[1])


def test_each_compose_files_header_starts_it_as_the_readme_does():
    """A file's header and the README write the same `up` for it (`up -d --build` in both, or `up -d` in both)."""
    ups = {}
    for line in bash_lines(README):
        if m := re.fullmatch(r"docker compose ((?:-f \S+ )+)up (.*)", line):
            ups[m[1].strip()] = m[2]
    assert len(ups) >= 3, ups
    for f in sorted((REPO / "compose").glob("*.yaml")):
        header = re.findall(r"^#\s*docker compose ((?:-f \S+ )+)up ([-\w ]*\w)\s*$", f.read_text(), re.M)
        for files, flags in header:
            if files.strip() in ups:
                assert flags == ups[files.strip()], (
                    f"{f.relative_to(REPO)}: up {flags}; README: up {ups[files.strip()]}"
                )
