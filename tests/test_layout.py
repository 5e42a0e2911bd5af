"""The package's layout holds (DESIGN.md section 3): subpackages by concern,
imports that run one way only, and no Python file past 600 lines.

Imports are read from the source (ast), at module level and inside
functions alike, since a deferred import is still a dependency."""
import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "python" / "zero"
MAX_LINES = 600

# The concerns, lowest first: a subpackage may import from those before it
# (and from itself), never from one after it. The top-level modules _C,
# _version, _progress, _warnings and _interrupts sit below them all; zero/__init__.py
# above them all.
LAYERS = ["config", "comm", "parallel", "offload", "sharding", "step", "optim", "checkpoint",
          "engine", "integrations", "rlhf", "deepspeed"]
LEAVES = {"_C", "_version", "_progress", "_warnings", "_interrupts"}


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path, name):
    """The zero modules `path` (module `name`) imports, as dotted names; a
    `from zero.x import y` counts as zero.x (and zero.x.y if that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                if (PACKAGE.parent / (candidate.replace(".", "/") + ".py")).exists() or \
                        (PACKAGE.parent / candidate.replace(".", "/")).is_dir():
                    found.add(candidate)
    return {m for m in found if m == "zero" or m.startswith("zero.")}


def concern(module):
    """The subpackage (or leaf module) a dotted zero.* name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_belongs_to_a_concern():
    loose = [name for path, name in modules()
             if name.count(".") == 1 and path.name != "__init__.py"
             and concern(name) not in LEAVES]
    assert not loose, f"modules outside the subpackages of DESIGN.md: {loose}"
    for path, name in modules():
        if name != "zero":
            assert concern(name) in LAYERS or concern(name) in LEAVES, name


def mapped_paths(text: str) -> set:
    """The files docs/layout.md's tree names, as paths under python/zero:
    a line "  name/" opens a subpackage, deeper lines name its files
    ("utils/x.py" under deepspeed/ is deepspeed/utils/x.py)."""
    tree = text.split("python/zero/\n", 1)[1].split("```", 1)[0]
    found, package = set(), ""
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip())
        # the names column ends where two spaces start the description
        first = re.split(r"\s{2,}", line.strip())[0] if line.strip() else ""
        if indent == 2 and first.endswith("/"):
            package = first
        elif indent == 2:
            found.add(first)
            package = ""
        elif indent >= 4 and first:
            for name in first.rstrip(",").split(","):
                found.add(package + name.strip())
    return found


def test_every_module_is_on_the_map():
    """docs/layout.md maps the package file by file for the next engineer:
    a module it does not name, under its subpackage, is one nobody can find
    from there."""
    text = (PACKAGE.parents[1] / "docs" / "layout.md").read_text()
    mapped = mapped_paths(text)
    unnamed = [str(path.relative_to(PACKAGE)) for path, _ in modules()
               if path.name not in ("__init__.py", "__main__.py") and
               str(path.relative_to(PACKAGE)) not in mapped]
    assert not unnamed, f"add these to docs/layout.md's map: {unnamed}"


def test_no_file_past_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p, _ in modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concern: {long}"


def test_no_module_imports_up():
    """No module imports the top package (`from zero import _C`, `import
    zero`) or the package it sits in; a subpackage imports only from the
    concerns below it."""
    wrong = []
    for path, name in modules():
        if name == "zero":
            continue
        mine = concern(name)
        for target in imported(path, name):
            theirs = concern(target)
            if target == "zero":
                wrong.append(f"{name} imports the top package zero")
            elif target == name.rpartition(".")[0] and path.name != "__init__.py":
                wrong.append(f"{name} imports its own package {target}")
            elif theirs in LEAVES or theirs == mine or mine in LEAVES:
                continue
            elif LAYERS.index(theirs) > LAYERS.index(mine):
                wrong.append(f"{name} ({mine}) imports {target} ({theirs}), a concern above it")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules():
    graph = {name: {t for t in imported(path, name) if t != name} for path, name in modules()}
    # a package's __init__ is a node of its own; a submodule's import of a
    # sibling goes to the sibling, not through the package
    state = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        if state.get(node) == "open":
            cycle = trail[trail.index(node):] + [node]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt in graph:
                visit(nxt, trail + [node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])


def test_check_sees_a_wrong_import(tmp_path):
    """The rules above are not vacuous: the reader finds an upward import."""
    fake = tmp_path / "zero" / "sharding"
    fake.mkdir(parents=True)
    module = fake / "_bad.py"
    module.write_text("from zero import _C\nfrom zero.engine._engine import Engine\n")
    found = imported(module, "zero.sharding._bad")
    assert "zero" in found and "zero.engine._engine" in found


def test_only_comm_and_the_mesh_import_torch_distributed():
    """Every collective goes through comm/_comm.py with the group it is
    given; comm/_world.py makes a default group on a script's request
    (zero.deepspeed.init_distributed); parallel/ builds the groups from
    the user's mesh. torch's model-parallel engines (DTensor:
    torch.distributed.tensor; torch.distributed.pipelining) are parallel/'s
    tensor- and pipeline-parallel modules' alone."""
    found, dtensor = [], []
    for path, name in modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for n in names:
                if n.startswith(("torch.distributed.tensor", "torch.distributed.pipelining")):
                    dtensor.append(name)
                elif n == "torch.distributed" or n.startswith("torch.distributed."):
                    found.append(name)
    assert sorted(set(found)) == ["zero.comm._comm", "zero.comm._world",
                                  "zero.parallel._mesh"], found
    assert sorted(set(dtensor)) == ["zero.parallel._conv1d_styles", "zero.parallel._pipeline",
                                    "zero.parallel._plans", "zero.parallel._tensor_parallel",
                                    "zero.parallel._virtual_stages"]
