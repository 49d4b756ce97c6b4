"""The house's layers, read from the source (nothing is imported): no import circle in
pipeline/ or tools/, and no import from a lower layer to a higher one. Every import counts,
a lazy one inside a function too: it is a circle all the same, only hidden.

Layers, bottom first: the shared modules (cli, errors, files, figures) < pipeline.ordering (the
order of samples: arithmetic on positions, no bytes read) < pipeline.data < pipeline.writers <
pipeline.stream (the streaming API) < pipeline.train < tools. A module may import its own layer and
those below. Inside pipeline.data, its folders are layers of their own, bottom first: store < shards <
decoding < fields < manifests < streams < handover (docs/layout.md). Tests never import each other, and
no module of pipeline/ or tools/ passes 500 lines.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOTTOM = {"pipeline", "pipeline.cli", "pipeline.errors", "pipeline.files", "pipeline.figures"}
ORDER = ["bottom", "pipeline.ordering", "pipeline.data", "pipeline.writers", "pipeline.stream", "pipeline.train", "tools"]
# pipeline.topology only stands for pipeline.ordering.topology; pipeline.stream is the streaming API, above
# the writers because its resolve indexes on first use (pipeline.writers.autoindex)
STAND_INS = {"pipeline.topology": "pipeline.ordering"}


def module_files():
    """{module name: path} of every .py file under pipeline/ and tools/. A tool imports another
    tool by its bare name (tools/ is on its sys.path): `tools.` is added here to tell them apart."""
    out = {}
    for top in ("pipeline", "tools"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name, path, modules):
    """[(imported module, line)] of the project's modules that `path` (module `name`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]  # a submodule, else a name in `base`
        else:
            continue
        for target in dict.fromkeys(resolve(t, name, modules) for t in targets):
            if target:
                found.append((target, node.lineno))
    return found


def resolve(target, importer, modules):
    """The project module `target` names (the longest known prefix), or None for the outside world."""
    candidates = [target]
    if importer.startswith("tools."):
        candidates.append(f"tools.{target}")
    for candidate in candidates:
        parts = candidate.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in modules and (n > 1 or parts[0] == "pipeline"):
                return ".".join(parts[:n])
    return None


def layer(module):
    if module in BOTTOM:
        return "bottom"
    if module in STAND_INS:
        return STAND_INS[module]
    for top in ORDER[1:]:
        if module == top or module.startswith(top + "."):
            return top
    raise AssertionError(f"{module}: in no layer; add it to one in tests/test_layers.py")


def graph():
    modules = module_files()
    return {name: imports(name, path, modules) for name, path in modules.items()}


def circles(edges):
    """The strongly connected parts of more than one module (or one that imports itself), each
    as a list of 'a -> b (line n)' ties (Tarjan)."""
    index, low, stack, on, parts = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _ in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1 or any(w == v for w, _ in edges[v]):
                parts.append([f"{a} -> {b} (line {line})" for a in sorted(part) for b, line in edges[a] if b in part])

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return parts


def test_the_reader_sees_the_imports_it_should():
    edges = graph()
    assert [m for m, _ in edges["pipeline.files"]] == ["pipeline.errors"]
    assert {"pipeline.data.decoding.labelling", "pipeline.data.manifests.manifest", "pipeline.data.store.remote"} <= {
        m for m, _ in edges["pipeline.writers.make_shards"]}
    assert "pipeline.data.store.remote" in [m for m, _ in edges["pipeline.data.manifests.manifest"]]
    assert "tools.bench_peers" in [m for m, _ in edges["tools.bench_loader"]]
    assert {"pipeline", "pipeline.data", "pipeline.train", "pipeline.writers.make_shards", "tools.make_shards"} <= set(edges)
    assert [m for m, _ in edges["tools.make_shards"]] == ["pipeline.writers.make_shards"]  # the tool is its entry point


def test_no_import_circle():
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join("  " + "; ".join(c) for c in found)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    up = [f"{a} (line {line}) imports {b}: {layer(a)} may not import {layer(b)}"
          for a, targets in graph().items() for b, line in targets
          if ORDER.index(layer(a)) < ORDER.index(layer(b))]
    assert not up, "imports that run up the layers:\n" + "\n".join("  " + u for u in up)


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": [("b", 1)], "b": [("c", 2)], "c": [("a", 3)], "d": [("a", 4)]}) == [
        ["a -> b (line 1)", "b -> c (line 2)", "c -> a (line 3)"]]
    assert circles({"a": [("a", 7)]}) == [["a -> a (line 7)"]]
    assert circles({"a": [("b", 1)], "b": []}) == []


# The data path's folders, bottom first: a module of pipeline.data may import its own folder and
# those below it, never one above (docs/layout.md draws them). The hand-over is on top.
DATA_FOLDERS = ["store", "shards", "decoding", "fields", "manifests", "streams", "handover"]


def data_folder(module):
    """The folder of pipeline.data that `module` lies in, or None outside pipeline.data's folders."""
    parts = module.split(".")
    if parts[:2] == ["pipeline", "data"] and len(parts) > 2:
        return parts[2]
    return None


def test_every_data_module_lies_in_a_folder_of_the_data_path():
    loose = [m for m in graph() if m.startswith("pipeline.data.") and data_folder(m) not in DATA_FOLDERS]
    assert not loose, f"modules of pipeline.data in no folder of {DATA_FOLDERS}: {loose}"


def test_no_data_folder_imports_one_above_it():
    up = [f"{a} (line {line}) imports {b}: {data_folder(a)} may not import {data_folder(b)}"
          for a, targets in graph().items() if data_folder(a) in DATA_FOLDERS for b, line in targets
          if data_folder(b) in DATA_FOLDERS and DATA_FOLDERS.index(data_folder(a)) < DATA_FOLDERS.index(data_folder(b))]
    assert not up, "imports that run up the data path:\n" + "\n".join("  " + u for u in up)


def test_nothing_below_the_hand_over_reaches_it_through_the_public_modules():
    """pipeline.stream joins the stream and the loader for the user; no data module may import it
    (or pipeline.topology's stand-in for the order) to reach the hand-over by a side door."""
    side = [f"{a} (line {line}) imports {b}" for a, targets in graph().items() if a.startswith("pipeline.data.")
            for b, line in targets if b == "pipeline.stream"]
    assert not side, "data modules that import the public module:\n" + "\n".join("  " + s for s in side)


def test_no_test_module_imports_another():
    """Tests share their builders through tests/helpers.py and conftest.py, never by importing
    each other: a test module imported by another runs its module-level code twice."""
    tests = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name} (line {node.lineno}) imports {n}" for n in names
                      if n.rpartition(".")[2] in tests or n.partition(".")[0] in tests]
    assert not found, "test modules importing test modules:\n" + "\n".join("  " + f for f in found)


def test_no_module_over_500_lines_in_pipeline_or_tools():
    """A module that grows past 500 lines holds more than one concern: split it by concern."""
    long = {str(p.relative_to(ROOT)): n for p in module_files().values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert not long, f"modules over 500 lines: {long}"
