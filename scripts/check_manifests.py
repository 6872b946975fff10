#!/usr/bin/env python3
"""Offline checks of the manifests under configs/ (driven by scripts/check-manifests.sh).

Subcommands (each prints what it checked and exits non-zero on a problem):
  yaml DIR                 every *.yaml / *.yml under DIR (Helm templates excepted) parses,
                           with no duplicate keys, and every document has apiVersion, kind
                           and metadata.name
  crs DIR CRD_DIR          every custom resource under DIR matches the structural schema of
                           its CRD (types, required fields, enums, bounds, patterns, unknown
                           fields); inline Wasm modules (`file`) are well-formed
  chart CHART OUT          renders the Helm chart with a small Go-template interpreter (the
                           subset of Go templates + Sprig the chart uses) for several value
                           sets, writes OUT/<set>.yaml, and checks the result
  discovery CRD_DIR OUT    writes a kubeconfig and a kubectl discovery cache for an offline
                           `kubectl create --dry-run=client` (built-in kinds + our CRDs)

CEL rules (x-kubernetes-validations) are not evaluated here.
"""

import base64
import copy
import json
import os
import re
import shutil
import subprocess
import sys

import yaml


class Problem(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# YAML loading with duplicate-key detection (the API server's decoder rejects duplicates).


class StrictLoader(yaml.SafeLoader):
    pass


def _mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_docs(text, where):
    try:
        return [d for d in yaml.load_all(text, Loader=StrictLoader) if d is not None]
    except yaml.YAMLError as e:
        raise Problem(f"{where}: {e}")


def chart_template_dirs(root):
    """templates/ of every Helm chart under root: Go templates, not YAML."""
    found = set()
    for dirpath, _, filenames in os.walk(root):
        if "Chart.yaml" in filenames:
            found.add(os.path.join(dirpath, "templates"))
    return found


def yaml_files(root, skip_dirs=None):
    if skip_dirs is None:
        skip_dirs = chart_template_dirs(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if os.path.join(dirpath, d) not in skip_dirs
        )
        for f in sorted(filenames):
            if f.endswith((".yaml", ".yml")):
                out.append(os.path.join(dirpath, f))
    return out


def is_kustomization(doc):
    return isinstance(doc, dict) and doc.get("kind") in ("Kustomization", "Component") and str(
        doc.get("apiVersion", "")
    ).startswith("kustomize.config.k8s.io/")


DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def check_object_shape(doc, where):
    if not isinstance(doc, dict):
        raise Problem(f"{where}: a document is not a mapping")
    for key in ("apiVersion", "kind"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise Problem(f"{where}: a document has no {key}")
    if is_kustomization(doc):
        return
    name = (doc.get("metadata") or {}).get("name")
    if not isinstance(name, str) or len(name) > 253 or not DNS_SUBDOMAIN.match(name):
        raise Problem(f"{where}: {doc['kind']} has a missing or invalid metadata.name {name!r}")


def cmd_yaml(root):
    chart_templates = chart_template_dirs(root)
    files = yaml_files(root, skip_dirs=chart_templates)
    docs = 0
    for path in files:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        if "\t" in text:
            raise Problem(f"{path}: contains a tab character")
        loaded = load_docs(text, path)
        if not loaded:
            raise Problem(f"{path}: no YAML document")
        name = os.path.basename(path)
        for doc in loaded:
            if name in ("Chart.yaml", "values.yaml"):
                if not isinstance(doc, dict):
                    raise Problem(f"{path}: not a mapping")
                continue
            check_object_shape(doc, path)
        docs += len(loaded)
    print(f"  yaml: {len(files)} files, {docs} documents parse (no duplicate keys, all named)")
    for path in files:
        if os.path.basename(path) == "kustomization.yaml":
            check_kustomization(path)
    for t in sorted(chart_templates):
        print(f"  yaml: skipped Go templates in {t} (rendered by the chart check)")


def check_kustomization(path):
    """Every listed resource exists, and every YAML file beside it is listed."""
    base = os.path.dirname(path)
    with open(path, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    listed = doc.get("resources", [])
    for r in listed:
        if not os.path.exists(os.path.join(base, r)):
            raise Problem(f"{path}: resource {r} does not exist")
    for f in sorted(os.listdir(base)):
        if f.endswith((".yaml", ".yml")) and f != "kustomization.yaml" and f not in listed:
            raise Problem(f"{path}: {f} is beside it but not listed under resources")
    print(f"  yaml: {path} lists {len(listed)} resources, all present, none left out")


# ---------------------------------------------------------------------------------------------
# Structural schema checks of custom resources.


def load_crds(crd_dir):
    crds = {}
    for path in yaml_files(crd_dir):
        with open(path, encoding="utf-8") as fh:
            for doc in load_docs(fh.read(), path):
                if doc.get("kind") != "CustomResourceDefinition":
                    continue
                spec = doc["spec"]
                for version in spec["versions"]:
                    key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                    crds[key] = {
                        "crd": doc,
                        "schema": version["schema"]["openAPIV3Schema"],
                        "file": path,
                    }
    return crds


def validate(value, schema, path, errors, byte_fields):
    """A subset of Kubernetes structural-schema validation (no CEL, no defaulting)."""
    if value is None:
        if not schema.get("nullable"):
            errors.append(f"{path}: null is not allowed")
        return
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            errors.append(f"{path}: must be an integer or a string")
            return
        if isinstance(value, str):
            check_string(value, schema, path, errors)
        return
    typ = schema.get("type")
    preserve = schema.get("x-kubernetes-preserve-unknown-fields")
    if typ is None:
        if not preserve and schema:
            errors.append(f"{path}: schema without type (internal)")
        return
    if typ == "object":
        if not isinstance(value, dict):
            errors.append(f"{path}: must be an object")
            return
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        for req in schema.get("required", []):
            if req not in value:
                errors.append(f"{path}.{req}: required")
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            errors.append(f"{path}: more than {schema['maxProperties']} properties")
        for k, v in value.items():
            if props is not None and k in props:
                validate(v, props[k], f"{path}.{k}", errors, byte_fields)
            elif isinstance(addl, dict):
                validate(v, addl, f"{path}.{k}", errors, byte_fields)
            elif not preserve:
                errors.append(f"{path}.{k}: unknown field (the API server would drop it)")
    elif typ == "array":
        if not isinstance(value, list):
            errors.append(f"{path}: must be a list")
            return
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        for i, item in enumerate(value):
            validate(item, schema.get("items", {}), f"{path}[{i}]", errors, byte_fields)
    elif typ == "string":
        if not isinstance(value, str):
            errors.append(f"{path}: must be a string (quote it)")
            return
        check_string(value, schema, path, errors)
        if schema.get("format") == "byte":
            byte_fields.append((path, value))
    elif typ == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"{path}: must be an integer")
            return
        check_number(value, schema, path, errors)
    elif typ == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.append(f"{path}: must be a number")
            return
        check_number(value, schema, path, errors)
    elif typ == "boolean":
        if not isinstance(value, bool):
            errors.append(f"{path}: must be true or false")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")


def check_string(value, schema, path, errors):
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append(f"{path}: longer than {schema['maxLength']}")
    if "minLength" in schema and len(value) < schema["minLength"]:
        errors.append(f"{path}: shorter than {schema['minLength']}")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if schema.get("format") == "date-time" and not re.match(
        r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$", value
    ):
        errors.append(f"{path}: not an RFC 3339 time")


def check_number(value, schema, path, errors):
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: below {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: above {schema['maximum']}")


def leb128(data, pos):
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 28:
            raise ValueError("truncated LEB128")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, pos


def wasm_sections(data):
    """Walks a Wasm binary's sections; raises ValueError when it is malformed."""
    if data[:4] != b"\0asm":
        raise ValueError("no \\0asm magic")
    if data[4:8] != b"\x01\0\0\0":
        raise ValueError("not Wasm binary version 1")
    pos, ids = 8, []
    while pos < len(data):
        sid = data[pos]
        if sid > 13:
            raise ValueError(f"unknown section id {sid} at byte {pos}")
        size, pos = leb128(data, pos + 1)
        if pos + size > len(data):
            raise ValueError(f"section {sid} at byte {pos} runs past the end")
        ids.append(sid)
        pos += size
    return ids


def wasm_validate_with_node(modules):
    """Asks node's WebAssembly.validate about each module, when node is installed."""
    node = shutil.which("node")
    if not node or not modules:
        return None
    script = (
        "const ms = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "const bad = ms.filter(m => !WebAssembly.validate(Buffer.from(m[1], 'base64')));"
        "process.stdout.write(JSON.stringify(bad.map(m => m[0])));"
    )
    out = subprocess.run(
        [node, "-e", script], input=json.dumps(modules), capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:
        raise Problem(f"node could not check the Wasm modules: {out.stderr.strip()}")
    return json.loads(out.stdout)


def check_builtin(where, doc, errors):
    """Checks kubectl's client-side dry run cannot see: RBAC references."""
    if doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
        ref = doc.get("roleRef") or {}
        allowed = ("Role", "ClusterRole") if doc["kind"] == "RoleBinding" else ("ClusterRole",)
        if ref.get("kind") not in allowed or ref.get("apiGroup") != "rbac.authorization.k8s.io":
            errors.append(f"{where}: {doc['kind']} roleRef must be an rbac.authorization.k8s.io {' or '.join(allowed)}")
        for s in doc.get("subjects") or []:
            if s.get("kind") == "ServiceAccount" and not s.get("namespace"):
                errors.append(f"{where}: ServiceAccount subject {s.get('name')} has no namespace")


def check_crs_in_docs(docs, crds, errors, counts, modules):
    builtin = {(gv, k) for gv, rs in BUILTIN.items() for _, k, _ in rs}
    for where, doc in docs:
        api, kind = doc.get("apiVersion"), doc.get("kind")
        entry = crds.get((api, kind))
        if entry is None:
            if (api, kind) not in builtin:
                errors.append(f"{where}: {api} {kind} is neither one of our CRDs nor a known built-in kind")
            else:
                check_builtin(where, doc, errors)
            continue
        if "status" in doc:
            errors.append(f"{where}: {kind} sets status (written by the operator only)")
        byte_fields = []
        local = []
        schema = entry["schema"]
        top = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata", "status")}
        validate(
            top,
            {
                "type": "object",
                "properties": {k: v for k, v in schema.get("properties", {}).items() if k != "status"},
                "required": schema.get("required", []),
            },
            f"{where}: {kind}/{doc['metadata']['name']}",
            local,
            byte_fields,
        )
        errors.extend(local)
        for path, b64 in byte_fields:
            try:
                raw = base64.b64decode(b64, validate=True)
            except ValueError as e:
                errors.append(f"{path}: not base64 ({e})")
                continue
            if raw[:4] == b"\0asm":
                try:
                    wasm_sections(raw)
                except ValueError as e:
                    errors.append(f"{path}: malformed Wasm module: {e}")
                    continue
                modules.append([path, b64])
        counts[kind] = counts.get(kind, 0) + 1


def collect_docs(root):
    docs = []
    for path in yaml_files(root):
        if os.path.basename(path) in ("Chart.yaml", "values.yaml"):
            continue
        with open(path, encoding="utf-8") as fh:
            for doc in load_docs(fh.read(), path):
                if isinstance(doc, dict) and not is_kustomization(doc):
                    docs.append((path, doc))
    return docs


def report_crs(errors, counts, modules, label):
    checked = wasm_validate_with_node(modules)
    if checked:
        errors.extend(f"{p}: node's WebAssembly.validate rejects this module" for p in checked)
    if errors:
        raise Problem("\n".join(errors))
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"
    print(f"  crs: {label}: {summary} match their CRD schemas (CEL rules not evaluated)")
    print("  crs: every other object is a known built-in kind; RBAC bindings refer to roles properly")
    how = "node WebAssembly.validate" if checked is not None else "section walk only (no node)"
    if modules:
        print(f"  crs: {len(modules)} inline Wasm modules well-formed ({how})")


def cmd_crs(root, crd_dir):
    crds = load_crds(crd_dir)
    errors, counts, modules = [], {}, []
    check_crs_in_docs(collect_docs(root), crds, errors, counts, modules)
    report_crs(errors, counts, modules, root)


# ---------------------------------------------------------------------------------------------
# A Go-template interpreter for the chart: text/template actions, Helm's include/toYaml/
# required/fail and the Sprig functions the chart uses. Anything else is an error, so a
# template that needs more fails loudly here instead of rendering wrongly.


class TemplateError(Problem):
    pass


ACTION = re.compile(r"\{\{(-[ \t\r\n])?(.*?)([ \t\r\n]-)?\}\}", re.S)
TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<raw>`[^`]*`)
    | (?P<num>-?\d+(?:\.\d+)?)
    | (?P<decl>:=)
    | (?P<assign>=)
    | (?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
    | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
    | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<punct>[()|,])
    )""",
    re.X,
)


def tokenize(src, where):
    src = src.strip()
    pos, out = 0, []
    while pos < len(src):
        m = TOKEN.match(src, pos)
        if not m or m.end() == pos:
            raise TemplateError(f"{where}: cannot read {src[pos:]!r}")
        pos = m.end()
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
    return out


def lex(text, where):
    """Splits a template into ('text', s) and ('action', tokens, src) items, applying trims."""
    items, pos = [], 0
    for m in ACTION.finditer(text):
        chunk = text[pos:m.start()]
        if m.group(1):
            chunk = chunk.rstrip(" \t\r\n")
        items.append(["text", chunk])
        body = m.group(2)
        if body.strip().startswith("/*"):
            if not body.strip().endswith("*/"):
                raise TemplateError(f"{where}: unterminated comment")
        else:
            items.append(["action", tokenize(body, where), body.strip()])
        pos = m.end()
        if m.group(3):
            rest = text[pos:]
            pos += len(rest) - len(rest.lstrip(" \t\r\n"))
    items.append(["text", text[pos:]])
    if "{{" in "".join(i[1] for i in items if i[0] == "text"):
        raise TemplateError(f"{where}: an action is not closed")
    return items


class Parser:
    def __init__(self, items, where, defines):
        self.items, self.i, self.where, self.defines = items, 0, where, defines

    def parse(self, stop=()):
        nodes = []
        while self.i < len(self.items):
            item = self.items[self.i]
            if item[0] == "text":
                self.i += 1
                if item[1]:
                    nodes.append(("text", item[1]))
                continue
            toks, src = item[1], item[2]
            head = toks[0][1] if toks and toks[0][0] == "ident" else None
            if head in stop:
                return nodes, head
            self.i += 1
            if head in ("if", "with"):
                branches, els = [(toks[1:], None)], None
                body, end = self.parse(("else", "end"))
                branches[0] = (toks[1:], body)
                while end == "else":
                    etoks = self.items[self.i][1]
                    self.i += 1
                    if len(etoks) > 1 and etoks[1] == ("ident", "if") and head == "if":
                        body, end = self.parse(("else", "end"))
                        branches.append((etoks[2:], body))
                    else:
                        els, end = self.parse(("end",))
                self.expect_end(end, src)
                nodes.append((head, branches, els))
            elif head == "range":
                body, end = self.parse(("else", "end"))
                els = None
                if end == "else":
                    self.i += 1
                    els, end = self.parse(("end",))
                self.expect_end(end, src)
                nodes.append(("range", toks[1:], body, els))
            elif head == "define":
                name = literal(toks[1], self.where)
                body, end = self.parse(("end",))
                self.expect_end(end, src)
                self.defines[name] = body
            elif head == "template":
                nodes.append(("template", literal(toks[1], self.where), toks[2:]))
            elif head in ("block", "break", "continue"):
                raise TemplateError(f"{self.where}: {{{{ {head} }}}} is not supported here")
            else:
                nodes.append(("action", toks))
        if stop:
            raise TemplateError(f"{self.where}: missing {{{{ end }}}}")
        return nodes, None

    def expect_end(self, end, src):
        if end != "end":
            raise TemplateError(f"{self.where}: {{{{ {src} }}}} has no {{{{ end }}}}")
        self.i += 1


def literal(tok, where):
    if tok[0] == "str":
        return json.loads(tok[1])
    if tok[0] == "raw":
        return tok[1][1:-1]
    raise TemplateError(f"{where}: expected a string, got {tok[1]!r}")


def truthy(v):
    if v is None or v is False:
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v != 0
    if isinstance(v, (str, list, dict, tuple)):
        return len(v) > 0
    return True


def to_text(v):
    if v is None:
        return ""
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, float):
        return repr(int(v)) if v.is_integer() else repr(v)
    if isinstance(v, (dict, list)):
        raise TemplateError(f"printing a {type(v).__name__} directly (use toYaml)")
    return str(v)


def go_printf(fmt, *args):
    args = list(args)
    out, i = [], 0
    while i < len(fmt):
        c = fmt[i]
        if c != "%":
            out.append(c)
            i += 1
            continue
        verb = fmt[i + 1]
        i += 2
        if verb == "%":
            out.append("%")
            continue
        if not args:
            raise TemplateError(f"printf {fmt!r}: too few arguments")
        a = args.pop(0)
        if verb in "sv":
            out.append(to_text(a))
        elif verb == "d":
            if isinstance(a, bool) or not isinstance(a, int):
                raise TemplateError(f"printf %d of {a!r}")
            out.append(str(a))
        elif verb == "q":
            out.append(json.dumps(to_text(a)))
        else:
            raise TemplateError(f"printf verb %{verb} not supported")
    if args:
        raise TemplateError(f"printf {fmt!r}: too many arguments")
    return "".join(out)


def to_yaml(v):
    if v is None:
        return "null"
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n")


def to_int(v):
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return int(v)
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            return 0
    return 0


def indent(n, s):
    pad = " " * int(n)
    return pad + to_text(s).replace("\n", "\n" + pad)


def go_and(*a):
    for v in a:
        if not truthy(v):
            return v
    return a[-1]


def go_or(*a):
    for v in a:
        if truthy(v):
            return v
    return a[-1]


def fail(msg):
    raise TemplateError(f"fail: {msg}")


def required(msg, v):
    if v is None or (isinstance(v, str) and v == ""):
        raise TemplateError(f"required: {msg}")
    return v


FUNCS = {
    "toYaml": to_yaml,
    "nindent": lambda n, s: "\n" + indent(n, s),
    "indent": indent,
    # Sprig skips nil arguments: `quote nil` prints nothing.
    "quote": lambda *a: " ".join(json.dumps(to_text(x)) for x in a if x is not None),
    "squote": lambda *a: " ".join("'" + to_text(x) + "'" for x in a if x is not None),
    "default": lambda d, *v: v[0] if v and truthy(v[0]) else d,
    "trunc": lambda n, s: s[: int(n)] if n >= 0 else s[int(n):],
    "trimSuffix": lambda suf, s: s[: -len(suf)] if suf and s.endswith(suf) else s,
    "trimPrefix": lambda pre, s: s[len(pre):] if pre and s.startswith(pre) else s,
    "replace": lambda old, new, s: s.replace(old, new),
    "printf": go_printf,
    "print": lambda *a: "".join(to_text(x) for x in a),
    "contains": lambda sub, s: sub in s,
    "hasPrefix": lambda pre, s: s.startswith(pre),
    "has": lambda item, lst: item in (lst or []),
    "hasKey": lambda d, k: k in d,
    "list": lambda *a: list(a),
    "dict": lambda *a: dict(zip(a[::2], a[1::2])),
    "eq": lambda a, *b: any(a == x for x in b),
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "gt": lambda a, b: a > b,
    "and": go_and,
    "or": go_or,
    "not": lambda v: not truthy(v),
    "empty": lambda v: not truthy(v),
    "int": to_int,
    "toString": to_text,
    "upper": lambda s: s.upper(),
    "lower": lambda s: s.lower(),
    "len": lambda v: len(v),
    "ternary": lambda a, b, c: a if truthy(c) else b,
    "b64enc": lambda s: base64.b64encode(to_text(s).encode()).decode(),
    "fail": fail,
    "required": required,
}


class Renderer:
    def __init__(self, defines, where):
        self.defines, self.where = defines, where

    def render(self, nodes, dot, scope):
        out = []
        for node in nodes:
            kind = node[0]
            if kind == "text":
                out.append(node[1])
            elif kind == "action":
                v = self.pipeline(node[1], dot, scope)
                if v is not _NO_OUTPUT:
                    out.append(to_text(v))
            elif kind in ("if", "with"):
                for cond, body in node[1]:
                    v = self.pipeline(cond, dot, scope)
                    if truthy(v):
                        out.append(self.render(body, v if kind == "with" else dot, dict(scope)))
                        break
                else:
                    if node[2] is not None:
                        out.append(self.render(node[2], dot, dict(scope)))
            elif kind == "range":
                toks = node[1]
                names = []
                if any(t[0] == "decl" for t in toks):
                    cut = [t[0] for t in toks].index("decl")
                    names = [t[1] for t in toks[:cut] if t[0] == "var"]
                    toks = toks[cut + 1:]
                coll = self.pipeline(toks, dot, scope)
                if isinstance(coll, dict):
                    pairs = [(k, coll[k]) for k in sorted(coll)]
                elif isinstance(coll, list):
                    pairs = list(enumerate(coll))
                elif coll is None:
                    pairs = []
                else:
                    raise TemplateError(f"{self.where}: range over {coll!r}")
                if not pairs and node[3] is not None:
                    out.append(self.render(node[3], dot, dict(scope)))
                for k, v in pairs:
                    inner = dict(scope)
                    if len(names) == 1:
                        inner[names[0]] = v
                    elif len(names) == 2:
                        inner[names[0]], inner[names[1]] = k, v
                    out.append(self.render(node[2], v, inner))
            elif kind == "template":
                data = self.pipeline(node[2], dot, scope) if node[2] else None
                out.append(self.include(node[1], data))
        return "".join(out)

    def include(self, name, data):
        if name not in self.defines:
            raise TemplateError(f"{self.where}: no template named {name!r}")
        return self.render(self.defines[name], data, {"$": data})

    def pipeline(self, toks, dot, scope):
        decl = None
        if len(toks) >= 2 and toks[0][0] == "var" and toks[1][0] in ("decl", "assign"):
            decl, toks = toks[0][1], toks[2:]
        cmds, cur, depth = [], [], 0
        for t in toks:
            if t == ("punct", "|") and depth == 0:
                cmds.append(cur)
                cur = []
                continue
            if t == ("punct", "("):
                depth += 1
            elif t == ("punct", ")"):
                depth -= 1
            cur.append(t)
        cmds.append(cur)
        value, piped = None, False
        for cmd in cmds:
            if not cmd:
                raise TemplateError(f"{self.where}: empty command in a pipeline")
            value = self.command(cmd, dot, scope, value if piped else _NO_ARG)
            piped = True
        if decl is not None:
            scope[decl] = value
            return _NO_OUTPUT
        return value

    def command(self, toks, dot, scope, piped):
        args, i = [], 0
        while i < len(toks):
            t = toks[i]
            if t == ("punct", "("):
                depth, j = 1, i + 1
                while depth:
                    if j >= len(toks):
                        raise TemplateError(f"{self.where}: unbalanced parenthesis")
                    depth += {("punct", "("): 1, ("punct", ")"): -1}.get(toks[j], 0)
                    j += 1
                args.append(("value", self.pipeline(toks[i + 1:j - 1], dot, scope)))
                i = j
                continue
            args.append(("tok", t))
            i += 1
        head = args[0]
        if head[0] == "tok" and head[1][0] == "ident" and head[1][1] not in ("true", "false", "nil"):
            name = head[1][1]
            vals = [self.operand(a, dot, scope) for a in args[1:]]
            if piped is not _NO_ARG:
                vals.append(piped)
            if name == "include":
                if len(vals) != 2:
                    raise TemplateError(f"{self.where}: include takes a name and a value")
                return self.include(vals[0], vals[1])
            fn = FUNCS.get(name)
            if fn is None:
                raise TemplateError(f"{self.where}: function {name!r} is not supported here")
            try:
                return fn(*vals)
            except TemplateError:
                raise
            except Exception as e:  # wrong arity or types
                raise TemplateError(f"{self.where}: {name} {vals!r}: {e}")
        if len(args) != 1 or piped is not _NO_ARG:
            raise TemplateError(f"{self.where}: cannot call a non-function {args!r}")
        return self.operand(head, dot, scope)

    def operand(self, arg, dot, scope):
        if arg[0] == "value":
            return arg[1]
        kind, text = arg[1]
        if kind in ("str", "raw"):
            return literal(arg[1], self.where)
        if kind == "num":
            return float(text) if "." in text else int(text)
        if kind == "ident":
            return {"true": True, "false": False, "nil": None}[text]
        if kind == "field":
            return self.walk(dot, text.split(".")[1:], text)
        if kind == "var":
            name, *fields = text.split(".")
            if name not in scope:
                raise TemplateError(f"{self.where}: undefined variable {name}")
            return self.walk(scope[name], fields, text)
        raise TemplateError(f"{self.where}: unexpected {text!r}")

    def walk(self, value, fields, text):
        for i, f in enumerate(fields):
            if not f:
                continue
            if value is None:
                raise TemplateError(
                    f"{self.where}: nil pointer evaluating {text} (at .{'.'.join(fields[:i + 1])})"
                )
            if not isinstance(value, dict):
                raise TemplateError(f"{self.where}: can't evaluate field {f} in {text}")
            value = value.get(f)
        return value


_NO_ARG = object()
_NO_OUTPUT = object()


def deep_merge(base, override):
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# Value sets that exercise every branch of the chart's templates.
VALUE_SETS = {
    "defaults": {},
    "tls-namespaced": {
        "watchNamespace": "edge",
        "domainId": "factory",
        "channelId": "line-1",
        "scheduler": "priority",
        "lastSeenThreshold": "45s",
        "livelinessInterval": "15s",
        "statusFlushInterval": "2s",
        "taskTimeout": "30m",
        "logFormat": "text",
        "tls": {"enabled": True, "secretName": "propeller-tls", "clientCA": True, "disablePlain": True},
        "credentialsSecret": "propeller-clients",
        "extraArgs": ["--lease-name=custom"],
        "extraEnv": [{"name": "RUST_LOG", "value": "debug"}],
        "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}},
        "serviceAccount": {"annotations": {"example.com/role": "propeller"}},
        "imagePullSecrets": [{"name": "regcred"}],
        "podAnnotations": {"prometheus.io/scrape": "true"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "edge", "operator": "Exists", "effect": "NoSchedule"}],
        "image": {"tag": ""},
        "fullnameOverride": "prop",
    },
    "no-rbac-no-leader": {
        "rbac": {"create": False},
        "serviceAccount": {"create": False, "name": "existing"},
        "leaderElect": False,
        "resources": {},
    },
}

# Value sets the chart must refuse.
BAD_VALUE_SETS = {
    "unknown scheduler": {"scheduler": "random"},
    "tls without secret": {"tls": {"enabled": True}},
    "no listener": {"tls": {"disablePlain": True}},
    "bad log format": {"logFormat": "xml"},
}


def render_chart(chart_dir, values, release="propeller", namespace="propeller-system"):
    with open(os.path.join(chart_dir, "Chart.yaml"), encoding="utf-8") as fh:
        chart = yaml.safe_load(fh)
    ctx = {
        "Values": values,
        "Release": {
            "Name": release,
            "Namespace": namespace,
            "Service": "Helm",
            "IsInstall": True,
            "IsUpgrade": False,
            "Revision": 1,
        },
        "Chart": {
            "Name": chart["name"],
            "Version": chart["version"],
            "AppVersion": chart.get("appVersion", ""),
            "Description": chart.get("description", ""),
        },
        "Capabilities": {"KubeVersion": {"Version": "v1.33.0", "Major": "1", "Minor": "33"}},
    }
    tdir = os.path.join(chart_dir, "templates")
    defines, parsed = {}, {}
    for f in sorted(os.listdir(tdir)):
        path = os.path.join(tdir, f)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        nodes, _ = Parser(lex(text, path), path, defines).parse()
        parsed[f] = (path, nodes)
    out = {}
    for f, (path, nodes) in parsed.items():
        if f.startswith("_"):
            continue
        r = Renderer(defines, path)
        ctx["Template"] = {"Name": f"{chart['name']}/templates/{f}", "BasePath": f"{chart['name']}/templates"}
        out[f] = r.render(nodes, ctx, {"$": ctx})
    return out


def cmd_chart(chart_dir, out_dir):
    with open(os.path.join(chart_dir, "Chart.yaml"), encoding="utf-8") as fh:
        chart = yaml.safe_load(fh)
    if chart.get("apiVersion") != "v2":
        raise Problem(f"{chart_dir}/Chart.yaml: apiVersion must be v2")
    for key in ("name", "version"):
        if not chart.get(key):
            raise Problem(f"{chart_dir}/Chart.yaml: {key} is missing")
    with open(os.path.join(chart_dir, "values.yaml"), encoding="utf-8") as fh:
        defaults = yaml.load(fh, Loader=StrictLoader)
    os.makedirs(out_dir, exist_ok=True)
    for name, override in VALUE_SETS.items():
        values = deep_merge(defaults, override)
        rendered = render_chart(chart_dir, values)
        notes = rendered.pop("NOTES.txt", "")
        if "{{" in notes or not notes.strip():
            raise Problem(f"chart ({name}): NOTES.txt did not render")
        docs = []
        stream = []
        for f, text in sorted(rendered.items()):
            for doc in load_docs(text, f"chart ({name}) templates/{f}"):
                check_object_shape(doc, f"chart ({name}) templates/{f}")
                docs.append((f"chart ({name}) templates/{f}", doc))
                stream.append(doc)
        try:
            check_rendered(name, values, docs)
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            raise Problem(f"chart ({name}): rendered objects are malformed ({type(e).__name__}: {e}); "
                          f"look at the indentation of the templates")
        errors = []
        for where, doc in docs:
            check_builtin(where, doc, errors)
        if errors:
            raise Problem("\n".join(errors))
        with open(os.path.join(out_dir, f"{name}.yaml"), "w", encoding="utf-8") as fh:
            fh.write(yaml.safe_dump_all(stream, sort_keys=False))
        kinds = ", ".join(sorted(d["kind"] for _, d in docs))
        print(f"  chart: values '{name}' render {len(docs)} objects: {kinds}")
    for name, override in BAD_VALUE_SETS.items():
        try:
            render_chart(chart_dir, deep_merge(defaults, override))
        except TemplateError as e:
            if "fail:" not in str(e):
                raise
            continue
        raise Problem(f"chart: values '{name}' should be refused but rendered")
    print(f"  chart: {len(BAD_VALUE_SETS)} invalid value sets are refused with a message")
    crd_src = os.path.join(os.path.dirname(os.path.dirname(chart_dir)), "crd")
    copies = sorted(f for f in os.listdir(os.path.join(chart_dir, "crds")) if f.endswith(".yaml"))
    originals = sorted(
        f for f in os.listdir(crd_src) if f.endswith(".yaml") and f != "kustomization.yaml"
    )
    if copies != originals:
        raise Problem(f"chart: crds/ has {copies}, configs/crd has {originals}")
    for f in copies:
        with open(os.path.join(chart_dir, "crds", f), "rb") as a, open(os.path.join(crd_src, f), "rb") as b:
            if a.read() != b.read():
                raise Problem(f"chart: crds/{f} differs from configs/crd/{f}; run: cp configs/crd/{f} {chart_dir}/crds/")
    print(f"  chart: crds/ holds the same {len(copies)} CRDs as configs/crd/")


def check_rendered(name, values, docs):
    by_kind = {}
    for _, d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    deps = by_kind.get("Deployment", [])
    if len(deps) != 1:
        raise Problem(f"chart ({name}): expected one Deployment, got {len(deps)}")
    dep = deps[0]
    tmpl = dep["spec"]["template"]
    sel = dep["spec"]["selector"]["matchLabels"]
    labels = tmpl["metadata"]["labels"]
    if any(labels.get(k) != v for k, v in sel.items()):
        raise Problem(f"chart ({name}): the Deployment's selector does not match its pod labels")
    for svc in by_kind.get("Service", []):
        if any(labels.get(k) != v for k, v in svc["spec"]["selector"].items()):
            raise Problem(f"chart ({name}): Service {svc['metadata']['name']} selects no pod")
        ports = {p["name"] for p in tmpl["spec"]["containers"][0]["ports"]}
        for p in svc["spec"]["ports"]:
            if p["targetPort"] not in ports:
                raise Problem(f"chart ({name}): Service port {p['name']} targets a missing container port")
    c = tmpl["spec"]["containers"][0]
    mounts = {m["name"] for m in c.get("volumeMounts", [])}
    vols = {v["name"] for v in tmpl["spec"].get("volumes", [])}
    if mounts - vols:
        raise Problem(f"chart ({name}): mounts without volumes: {sorted(mounts - vols)}")
    env = {e["name"] for e in c.get("env", [])}
    for need in ("PROPELLER_WATCH_NAMESPACE", "PROPELLER_LEASE_NAMESPACE"):
        if need not in env:
            raise Problem(f"chart ({name}): env {need} missing")
    sa = tmpl["spec"]["serviceAccountName"]
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        for b in by_kind.get(kind, []):
            for s in b["subjects"]:
                if s["name"] != sa:
                    raise Problem(f"chart ({name}): {kind} binds {s['name']}, pods run as {sa}")
    if values["rbac"]["create"]:
        roles = {r["metadata"]["name"] for r in by_kind.get("ClusterRole", []) + by_kind.get("Role", [])}
        for kind in ("RoleBinding", "ClusterRoleBinding"):
            for b in by_kind.get(kind, []):
                if b["roleRef"]["name"] not in roles:
                    raise Problem(f"chart ({name}): {kind} refers to missing role {b['roleRef']['name']}")
        if values["watchNamespace"]:
            scoped = [b for b in by_kind.get("RoleBinding", []) if b["metadata"]["namespace"] == values["watchNamespace"]]
            if not scoped or by_kind.get("ClusterRoleBinding"):
                raise Problem(f"chart ({name}): watchNamespace must bind the role in that namespace only")


# ---------------------------------------------------------------------------------------------
# Offline discovery for kubectl.

BUILTIN = {
    "v1": [
        ("namespaces", "Namespace", False),
        ("serviceaccounts", "ServiceAccount", True),
        ("services", "Service", True),
        ("secrets", "Secret", True),
        ("configmaps", "ConfigMap", True),
        ("pods", "Pod", True),
        ("events", "Event", True),
    ],
    "apps/v1": [("deployments", "Deployment", True)],
    "batch/v1": [("jobs", "Job", True)],
    "rbac.authorization.k8s.io/v1": [
        ("clusterroles", "ClusterRole", False),
        ("clusterrolebindings", "ClusterRoleBinding", False),
        ("roles", "Role", True),
        ("rolebindings", "RoleBinding", True),
    ],
    "coordination.k8s.io/v1": [("leases", "Lease", True)],
    "events.k8s.io/v1": [("events", "Event", True)],
    "apiextensions.k8s.io/v1": [
        ("customresourcedefinitions", "CustomResourceDefinition", False)
    ],
}
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


def cmd_discovery(crd_dir, out_dir):
    resources = {gv: list(rs) for gv, rs in BUILTIN.items()}
    for (gv, kind), entry in sorted(load_crds(crd_dir).items()):
        spec = entry["crd"]["spec"]
        resources.setdefault(gv, []).append(
            (spec["names"]["plural"], kind, spec["scope"] == "Namespaced")
        )
    host = "127.0.0.1:1"  # nothing listens there; kubectl only reads the cache
    cache = os.path.join(out_dir, "cache", "discovery", host.replace(":", "_"))
    groups = {}
    for gv, rs in resources.items():
        group, version = gv.rsplit("/", 1) if "/" in gv else ("", gv)
        groups.setdefault(group, []).append(version)
        d = os.path.join(cache, gv)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "serverresources.json"), "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "kind": "APIResourceList",
                    "apiVersion": "v1",
                    "groupVersion": gv,
                    "resources": [
                        {"name": n, "singularName": k.lower(), "namespaced": ns, "kind": k, "verbs": VERBS}
                        for n, k, ns in rs
                    ],
                },
                fh,
            )
    with open(os.path.join(cache, "servergroups.json"), "w", encoding="utf-8") as fh:
        json.dump(
            {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": g,
                        "versions": [
                            {"groupVersion": f"{g}/{v}" if g else v, "version": v} for v in vs
                        ],
                        "preferredVersion": {"groupVersion": f"{g}/{vs[0]}" if g else vs[0], "version": vs[0]},
                    }
                    for g, vs in sorted(groups.items())
                ],
            },
            fh,
        )
    with open(os.path.join(out_dir, "kubeconfig"), "w", encoding="utf-8") as fh:
        fh.write(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: offline\n  cluster:\n    server: https://{host}\n"
            "contexts:\n- name: offline\n  context: {cluster: offline, user: offline, namespace: default}\n"
            "current-context: offline\n"
            "users:\n- name: offline\n  user: {token: offline}\n"
        )
    n = sum(len(r) for r in resources.values())
    print(f"  discovery: offline kubectl cache with {n} resource types in {len(resources)} group versions")


def main(argv):
    try:
        if len(argv) == 2 and argv[0] == "yaml":
            cmd_yaml(argv[1])
        elif len(argv) == 3 and argv[0] == "crs":
            cmd_crs(argv[1], argv[2])
        elif len(argv) == 3 and argv[0] == "chart":
            cmd_chart(argv[1], argv[2])
        elif len(argv) == 3 and argv[0] == "discovery":
            cmd_discovery(argv[1], argv[2])
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except Problem as e:
        print(f"FAIL {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
