"""The tree a Hugging Face Space receives, built from `git archive HEAD` (no history) and checked offline: the README's
front matter against the Spaces configuration reference, LFS patterns for every file over 1 MB, the total size, and
what the Space installs against what the app imports. `make space` runs `python -m tools.space build/space`."""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import yaml
from huggingface_hub import SpaceHardware

from tools.install_set import Check, check_imports, check_requirements

ROOT = Path(__file__).resolve().parents[1]
LFS_ABOVE = 1_000_000  # bytes: the Hub refuses plain binary files over 1 MB on a push (huggingface_hub issue 687)
# The Hub sets no size per Space repository (docs/hub/storage-limits.md: "no per-repo size limit"; a Space's disk is
# 50 GB, docs/hub/spaces-overview.md). This budget is ours: code, the shipped head and the recorded runs take 12 MB,
# and a model's weights or a data set committed by mistake would exceed it.
SIZE_LIMIT = 50_000_000
REFERENCE = "https://huggingface.co/docs/hub/spaces-config-reference"

# The Spaces configuration reference (huggingface/hub-docs, docs/hub/spaces-config-reference.md, 2026-08).
COLORS = ("red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray")
# Hardware: huggingface_hub's SpaceHardware holds the reference's list and the flavours added since (zero-a10g,
# rtx-pro-6000...), and it is what `hf repos create --flavor` accepts.
HARDWARE = tuple(flavor.value for flavor in SpaceHardware)
CUSTOM_HEADERS = ("cross-origin-embedder-policy", "cross-origin-opener-policy", "cross-origin-resource-policy")
SHORT_DESCRIPTION = 60  # characters, the most the Hub's own check of a README accepts; the reference names no figure


# Front matter: each key of the reference (and `license`, `duplicated_from` of huggingface_hub's SpaceCardData), what
# its value must be, and the test.
def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _one_of(values: tuple[str, ...]) -> tuple[str, Callable[[object], bool]]:
    return f"one of {', '.join(values)}", lambda value: value in values


TEXT = ("a string", lambda value: isinstance(value, str))
FLAG = ("true or false", lambda value: isinstance(value, bool))
TEXTS = ("a list of strings", _strings)
FRONT_MATTER: dict[str, tuple[str, Callable[[object], bool]]] = {
    "title": TEXT,
    "emoji": ("emoji only", lambda v: isinstance(v, str) and v != "" and not re.search(r"[\x00-\x7f]", v)),
    "colorFrom": _one_of(COLORS),
    "colorTo": _one_of(COLORS),
    "sdk": _one_of(("gradio", "docker", "static")),
    "python_version": (
        'a quoted "3.x" or "3.x.x"',
        lambda v: isinstance(v, str) and re.fullmatch(r"3\.\d+(\.\d+)?", v),
    ),
    "sdk_version": ('a quoted "x.y.z"', lambda v: isinstance(v, str) and re.fullmatch(r"\d+\.\d+\.\d+", v)),
    "suggested_hardware": _one_of(HARDWARE),
    "suggested_storage": _one_of(("small", "medium", "large")),
    "app_file": TEXT,
    "app_build_command": TEXT,
    "app_port": ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "base_path": ("a path starting with /", lambda v: isinstance(v, str) and v.startswith("/")),
    "fullWidth": FLAG,
    "header": _one_of(("mini", "default")),
    "short_description": (
        f"a string of at most {SHORT_DESCRIPTION} characters",
        lambda v: isinstance(v, str) and len(v) <= SHORT_DESCRIPTION,
    ),
    "models": TEXTS,
    "datasets": TEXTS,
    "tags": TEXTS,
    "thumbnail": TEXT,
    "pinned": FLAG,
    "hf_oauth": FLAG,
    "hf_oauth_scopes": TEXTS,
    "hf_oauth_expiration_minutes": (
        "a whole number of minutes up to 43,200",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 43_200,
    ),
    "hf_oauth_authorized_org": ("a string or a list of strings", lambda v: isinstance(v, str) or _strings(v)),
    "disable_embedding": FLAG,
    "startup_duration_timeout": ('a duration such as "30m" or "1h"', lambda v: re.fullmatch(r"(\d+[smhd])+", str(v))),
    "custom_headers": (
        f"lowercase values for {', '.join(CUSTOM_HEADERS)}",
        lambda v: isinstance(v, dict) and all(k in CUSTOM_HEADERS and str(x).islower() for k, x in v.items()),
    ),
    "preload_from_hub": (
        'a list of "repository [file,file [commit]]"',
        lambda v: _strings(v) and all(0 < len(item.split()) <= 3 for item in v),
    ),
    "license": TEXT,
    "duplicated_from": TEXT,
}


def build_tree(root: Path, out: Path, revision: str = "HEAD") -> str:
    """Unpack `git archive` of the revision into out, which must be empty or absent; returns the commit."""
    assert not out.exists() or not any(out.iterdir()), f"{out} is not empty"
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", revision], cwd=root, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(out, filter="data")
    return git(root, "rev-parse", "--short", revision)


def git(root: Path, *arguments: str) -> str:
    return subprocess.run(["git", *arguments], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def files_of(tree: Path) -> dict[str, int]:
    """Every file of the tree, by its path in the Space, with its size in bytes."""
    return {
        path.relative_to(tree).as_posix(): path.stat().st_size for path in sorted(tree.rglob("*")) if path.is_file()
    }


def front_matter(tree: Path) -> dict:
    """The README's YAML block: the Space's configuration. An empty dict when there is none."""
    text = (tree / "README.md").read_text()
    if not text.startswith("---\n") or "\n---\n" not in text:
        return {}
    block = yaml.safe_load(text[4 : text.index("\n---\n")])
    return block if isinstance(block, dict) else {}


def check_front_matter(tree: Path, files: dict[str, int]) -> Check:
    config = front_matter(tree)
    if not config:
        return Check(
            "front matter", "none", ["README.md has no front matter, so the Hub cannot build a Space from it."]
        )
    problems = [
        f"README.md's front matter has {key}, which the Spaces configuration reference does not list ({REFERENCE})."
        for key in config
        if key not in FRONT_MATTER
    ]
    for key, value in config.items():
        if key in FRONT_MATTER and not FRONT_MATTER[key][1](value):
            problems.append(f"README.md's front matter sets {key} to {value!r}, which is not {FRONT_MATTER[key][0]}.")
    if "sdk" not in config:
        problems.append("README.md's front matter names no sdk, so the Hub does not know how to run the Space.")
    if config.get("sdk") == "gradio" and config.get("app_file", "app.py") not in files:
        problems.append(f"README.md's front matter names app_file {config.get('app_file', 'app.py')}, not in the tree.")
    return Check("front matter", f"{len(config)} keys, each in the Spaces configuration reference", problems)


def lfs_files(tree: Path, paths: Iterable[str]) -> set[str]:
    """The paths the tree's own .gitattributes sends through LFS, as git itself matches them (in an empty repository,
    with no global or system attributes)."""
    paths = list(paths)
    if not paths:
        return set()
    with tempfile.TemporaryDirectory() as git_dir:
        git(Path(git_dir), "init", "-q", "--bare")
        environment = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "PATH": "/usr/bin:/bin"}
        checked = subprocess.run(
            ["git", f"--git-dir={git_dir}", f"--work-tree={tree}", "check-attr", "--stdin", "filter"],
            input="\n".join(paths),
            env=environment,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return {line.rsplit(": filter: ", 1)[0] for line in checked.splitlines() if line.endswith(": filter: lfs")}


def check_lfs(tree: Path, files: dict[str, int]) -> Check:
    large = [path for path, size in files.items() if size > LFS_ABOVE]
    covered = lfs_files(tree, large)
    problems = [
        f"{path} has {files[path]:,} bytes and no filter=lfs pattern of .gitattributes matches it."
        for path in large
        if path not in covered
    ]
    problems += [  # a pointer has about 130 bytes: where git stores one, git archive writes it without git-lfs
        f"{path} is an LFS pointer, not the file: fetch its content with git-lfs and build the tree again."
        for path, size in files.items()
        if size < 1024 and (tree / path).read_bytes().startswith(b"version https://git-lfs.github.com/spec/")
    ]
    return Check("LFS", f"{len(large)} files over {LFS_ABOVE:,} bytes: {', '.join(large) or 'none'}", problems)


def check_size(files: dict[str, int]) -> Check:
    total = sum(files.values())
    summary = f"{total:,} bytes in {len(files)} files, limit {SIZE_LIMIT:,}"
    if total <= SIZE_LIMIT:
        return Check("size", summary)
    return Check("size", summary, [f"The tree holds {total:,} bytes, over the {SIZE_LIMIT:,} this project allows."])


def check_tree(tree: Path) -> list[Check]:
    """Every check of the tree a Space receives, in the order `make space` prints them."""
    files, config = files_of(tree), front_matter(tree)
    requirements, installed = check_requirements(tree, config)
    return [
        check_front_matter(tree, files),
        check_lfs(tree, files),
        check_size(files),
        requirements,
        check_imports(tree, config, installed),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="an empty or absent folder, ignored by git (make space: build/space)")
    parser.add_argument("--revision", default="HEAD")
    arguments = parser.parse_args(argv)
    out = arguments.out
    commit = build_tree(ROOT, out, arguments.revision)
    files = files_of(out)
    for path, size in files.items():
        print(f"{size:>12,}  {path}")
    print(f"{sum(files.values()):>12,}  bytes in {len(files)} files: the tree of {commit}, in {out}")
    if git(ROOT, "status", "--porcelain", "--untracked-files=no"):
        print("The working tree has changes not committed: the Space receives the commit, without them.")
    checks = check_tree(out)
    for check in checks:
        print(f"{check.name}: {'FAILED' if check.problems else 'ok'} ({check.summary})")
    problems = [problem for check in checks for problem in check.problems]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
