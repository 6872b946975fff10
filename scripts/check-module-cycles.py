#!/usr/bin/env python3
"""Fails when the modules of a crate depend on each other in a cycle, at any depth, or when a
non-test module imports or re-exports a whole module of its crate (`use super::*`,
`pub use child::*`), which hides where names come from and the edges between modules.

Each `crate::`, `super::` and `self::` path in a non-test source file (comments and
`#[cfg(test)]` sections left out) is resolved to the module it names. A reference from module
A to module B counts as an edge between the two children of their lowest common ancestor
that contain A and B (a module using its own parent or children is how Rust nests modules,
not a cycle). A cycle among the children of any module is reported with the references that
make it.

    scripts/check-module-cycles.py [CRATE_SRC_DIR ...]   (default: every crate's src/)
"""

import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRATES = ["core/src", "broker/src", "operator/src", "proplet-agent/src"]
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
PATH = re.compile(rf"\b(crate|super|self)((?:::{IDENT})*)(?:::\{{([^{{}}]*)\}})?")


def module_of(src: Path, file: Path) -> tuple:
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts and parts[-1] in ("mod", "lib", "main"):
        parts.pop()
    return tuple(parts)


def code_of(text: str) -> str:
    """The file without comments, strings' contents and its `#[cfg(test)]` sections."""
    cut = text.find("#[cfg(test)]")
    if cut >= 0:
        text = text[:cut]
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def references(module: tuple, code: str):
    """The module paths `code` names, as absolute tuples."""
    for match in PATH.finditer(code):
        head, rest, group = match.group(1), match.group(2), match.group(3)
        base = {"crate": (), "self": module, "super": module[:-1]}[head]
        segments = [s for s in rest.split("::") if s]
        # `super::super::x`: each leading `super` goes one level up.
        while segments and segments[0] == "super":
            base = base[:-1]
            segments.pop(0)
        path = base + tuple(segments)
        if group is None:
            yield path
        else:
            for item in group.split(","):
                item = item.strip().split(" as ")[0].strip()
                if item and item not in ("self", "*"):
                    yield path + tuple(s for s in item.split("::") if s)
                else:
                    yield path


def check(src: Path) -> list:
    files = {module_of(src, f): f for f in sorted(src.rglob("*.rs"))}
    known = set(files)
    edges = defaultdict(lambda: defaultdict(set))  # parent -> (a -> b) -> where
    globs = []
    for module, file in files.items():
        code = code_of(file.read_text(errors="replace"))
        children = set(re.findall(rf"^\s*(?:pub(?:\([^)]*\))?\s+)?mod ({IDENT});", code, re.M))
        for glob in re.findall(rf"^\s*(?:pub(?:\([^)]*\))?\s+)?use ((?:{IDENT}::)+)\*;", code, re.M):
            first = glob.split("::")[0]
            if file.stem.endswith("tests") or (first not in ("crate", "super", "self") and first not in children):
                continue
            globs.append(
                f"{file.relative_to(ROOT)}: `use {glob}*` outside tests hides where its names come "
                "from (and cycles from this check): import or re-export each name by its path"
            )
        for path in references(module, code):
            target = max((path[:n] for n in range(len(path) + 1) if path[:n] in known), key=len)
            common = 0
            while common < min(len(module), len(target)) and module[common] == target[common]:
                common += 1
            if common in (len(module), len(target)):
                continue  # an ancestor or a descendant
            parent = module[:common]
            a, b = module[common], target[common]
            edges[parent][a, b].add(f"{file.relative_to(ROOT)} -> {'::'.join(path)}")
    problems = globs
    for parent, pairs in sorted(edges.items()):
        graph = defaultdict(set)
        for a, b in pairs:
            graph[a].add(b)
        for cycle in strongly_connected(graph):
            inside = sorted((a, b) for a, b in pairs if a in cycle and b in cycle)
            where = "::".join(parent) or "(crate root)"
            lines = [f"{src.relative_to(ROOT)}: a cycle among the children of {where}: {', '.join(sorted(cycle))}"]
            for a, b in inside:
                lines.append(f"  {a} -> {b}: {sorted(pairs[a, b])[0]}")
            problems.append("\n".join(lines))
    return problems


def strongly_connected(graph):
    """Tarjan's components of more than one node."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]
    nodes = set(graph) | {b for bs in graph.values() for b in bs}

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    dirs = [Path(d).resolve() for d in sys.argv[1:]] or [ROOT / c for c in CRATES]
    problems = [p for d in dirs for p in check(d)]
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s): a cycle wants what both sides need moved into a module of its own; a glob wants its names listed")
        return 1
    print(f"no module cycles in {', '.join(str(d.relative_to(ROOT)) for d in dirs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
