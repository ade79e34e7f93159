"""Declarations the host shares with the kernels, read from the CUDA headers in cuda_src/, the one
place they are written: Params structs (-> ctypes mirrors), integer constants (`constexpr`), enums
with their comments (the phase names of ErrorRecord), and the constexpr members of templated
structs (buffer header offsets, evaluated for given template arguments).

Pure Python: reads text, compiles nothing. The grammar is the small subset the headers use (plain
struct fields of scalar and pointer types, integer constant expressions); anything else raises
ValueError naming the header. tests/compile/test_cuda_decls.py and the other compile tests check every mirror
against the compiler (offsetof / static_assert).
"""
from __future__ import annotations

import ast
import ctypes
import functools
import operator
import re
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

from .compiler import cuda_src_dir

_SCALARS = {"bool": ctypes.c_bool, "char": ctypes.c_char, "int": ctypes.c_int, "unsigned int": ctypes.c_uint,
            "unsigned": ctypes.c_uint, "uint32_t": ctypes.c_uint32, "long long": ctypes.c_longlong,
            "unsigned long long": ctypes.c_ulonglong, "uint64_t": ctypes.c_uint64, "float": ctypes.c_float}
_STRUCT = re.compile(r"\bstruct\s+(\w+)\s*(?::[^{;]*)?\{")
_ENUM = re.compile(r"\benum\s+(\w+)\s*(?::\s*\w+\s*)?\{")
_CONSTANT = re.compile(r"\b(?:static\s+)?constexpr\s+(?:int|long long|unsigned int|unsigned|uint32_t)\s+"
                       r"(k\w+\s*=[^;]+);")
_BRACES = re.compile(r"[{}]")
_INCLUDE = re.compile(r'#include\s+"([^"]+)"')
_INT_SUFFIX = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b")


class EnumEntry(NamedTuple):
    name: str
    value: int
    comment: str   # the `//` comment after the entry (and the comment lines below it), joined


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def _braced(text: str, start: int) -> Tuple[str, int]:
    """The text between the `{` at `start` and its matching `}`, and the index after that `}`."""
    depth = 0
    for brace in _BRACES.finditer(text, start):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[start + 1:brace.start()], brace.end()
    raise ValueError("unbalanced braces")


def _split_top_level(text: str, sep: str = ",") -> List[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "(<"
        depth -= ch in ")>"
        if ch == sep and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return parts + [current]


def _constants(code: str) -> Dict[str, str]:
    """name -> expression text of every integer constexpr in `code` (comments stripped)."""
    out = {}
    for match in _CONSTANT.finditer(code):
        for item in _split_top_level(match.group(1)):
            name, expr = item.split("=", 1)
            out[name.strip()] = expr.strip()
    return out


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
           ast.BitAnd: operator.and_}


def _c_div(a: int, b: int) -> int:   # C++ integer division truncates toward zero
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


class Header:
    """The declarations of one header of cuda_src/ (and, for constants, of the headers it includes)."""

    def __init__(self, root: str, path: str):
        self.path = path
        self._root = root
        self._member_memo: Dict[tuple, int] = {}
        self._raw = (Path(root) / path).read_text()
        code = _strip_comments(self._raw)
        self._includes = [m.group(1) for m in _INCLUDE.finditer(code)]
        self._enum_names = [m.group(1) for m in _ENUM.finditer(code)]
        self._structs: Dict[str, str] = {}
        outside, pos = "", 0
        for match in _STRUCT.finditer(code):
            if match.start() < pos:
                continue   # a struct nested in one already taken
            body, end = _braced(code, match.end() - 1)
            self._structs.setdefault(match.group(1), body)
            outside += code[pos:match.start()]
            pos = end
        outside += code[pos:]
        self._constants = _constants(outside)

    def _fail(self, what: str) -> ValueError:
        return ValueError(f"cuda_src/{self.path}: {what}")

    # ---- structs -------------------------------------------------------------------------------
    @functools.lru_cache(maxsize=None)
    def struct(self, name: str) -> type:
        """A ctypes.Structure subclass with the fields of `struct name` in order (pointers as void *,
        a field of a struct type of this header as that struct's mirror, `T f[N]` with N a literal or
        a constant as an array); ctypes pads and aligns as the C++ compiler does, so no padding
        fields are written."""
        body = self._structs.get(name)
        if body is None:
            raise self._fail(f"no struct {name}")
        fields = []
        for decl in body.split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            array = re.fullmatch(r"(\w[\w ]*?) (\w+) ?\[ ?(\w+) ?\]", decl)
            if array:
                base, field, bound = array.groups()
                count = int(bound) if bound.isdigit() else self.constant(bound)
                element = _SCALARS.get(base) or (self.struct(base) if base in self._structs else None)
                if element is None:
                    raise self._fail(f"struct {name}: field {field} has type {base!r}, not mirrored")
                fields.append((field, element * count))
                continue
            if "(" in decl or "[" in decl or "constexpr" in decl:
                raise self._fail(f"struct {name}: only scalar, pointer, struct and array fields are "
                                 f"mirrored, got {decl!r}")
            first, *rest = decl.split(",")
            words = first.replace("*", " * ").split()
            base = " ".join(w for w in words[:-1] if w not in ("const", "*"))
            for declarator in [" ".join(words[len(words) - 1 - _trailing_stars(words):])] + rest:
                field = declarator.replace("*", " ").split()[-1]
                if "*" in declarator:
                    fields.append((field, ctypes.c_void_p))
                elif base in _SCALARS:
                    fields.append((field, _SCALARS[base]))
                elif base in self._structs:
                    fields.append((field, self.struct(base)))
                else:
                    raise self._fail(f"struct {name}: field {field} has type {base!r}, not mirrored")
        return type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"Mirror of {name} ({self.path})."})

    # ---- constants -----------------------------------------------------------------------------
    def constant(self, name: str, **template_args: int) -> int:
        """The value of a namespace-scope integer constexpr or enumerator `name` (looked up here,
        then in the headers this one includes)."""
        return self._eval_name(name, {}, template_args)

    def member(self, struct: str, name: str, **template_args: int) -> int:
        """The value of `struct<template_args...>::name`, a static constexpr integer member;
        remembered per template arguments: layouts are read on per-call host paths (parsing the
        expression costs hundreds of microseconds) and a header does not change under a process."""
        key = (struct, name, tuple(sorted(template_args.items())))
        value = self._member_memo.get(key)
        if value is None:
            value = self._member_memo[key] = self._member(struct, name, template_args)
        return value

    def _member(self, struct: str, name: str, template_args: Dict[str, int]) -> int:
        body = self._structs.get(struct)
        if body is None:
            raise self._fail(f"no struct {struct}")
        scope = _constants(body)
        if name not in scope:
            raise self._fail(f"struct {struct} has no constexpr {name}")
        return self._eval_name(name, scope, template_args)

    def _lookup(self, name: str) -> Optional[Tuple["Header", str]]:
        if name in self._constants:
            return self, self._constants[name]
        for enum in self._enum_names:
            for entry in self.enum(enum):
                if entry.name == name:
                    return self, str(entry.value)
        for inc in self._includes:
            found = header(inc, self._root)._lookup(name) if (Path(self._root) / inc).is_file() else None
            if found is not None:
                return found
        return None

    def _eval_name(self, name: str, scope: Dict[str, str], args: Dict[str, int]) -> int:
        if name in args:
            return args[name]
        if name in scope:
            return self._eval(scope[name], scope, args)
        found = self._lookup(name)
        if found is None:
            raise self._fail(f"no integer constexpr {name}")
        owner, expr = found
        return owner._eval(expr, {}, args)

    def _eval(self, expr: str, scope: Dict[str, str], args: Dict[str, int]) -> int:
        text = _INT_SUFFIX.sub(r"\1", expr.strip())
        ternary = re.fullmatch(r"([^?:]+)\?([^?:]+):([^?:]+)", text)
        if ternary:
            text = "({1}) if ({0}) else ({2})".format(*ternary.groups())
        tree = ast.parse(text, mode="eval").body

        def value(node) -> int:
            if isinstance(node, ast.Constant) and isinstance(node.value, int):
                return node.value
            if isinstance(node, ast.Name):
                return {"true": 1, "false": 0}.get(node.id) if node.id in ("true", "false") else \
                    self._eval_name(node.id, scope, args)
            if isinstance(node, ast.IfExp):
                return value(node.body) if value(node.test) else value(node.orelse)
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                return -value(node.operand)
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                return _c_div(value(node.left), value(node.right))
            if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
                return _BINOPS[type(node.op)](value(node.left), value(node.right))
            raise self._fail(f"cannot evaluate {expr!r}")
        return value(tree)

    # ---- enums ---------------------------------------------------------------------------------
    @functools.lru_cache(maxsize=None)
    def enum(self, name: str) -> Tuple[EnumEntry, ...]:
        """The entries of `enum name` in order, with their values and comments."""
        match = re.search(rf"\benum\s+{name}\s*(?::\s*\w+\s*)?\{{", self._raw)
        if match is None:
            raise self._fail(f"no enum {name}")
        body, _ = _braced(self._raw, match.end() - 1)
        entries: List[list] = []
        following = 0
        for line in body.split("\n"):
            code, _, comment = line.partition("//")
            names = [item.strip() for item in code.split(",") if item.strip()]
            for item in names:
                entry, _, value = item.partition("=")
                following = self._eval(value, {}, {}) if value.strip() else following
                entries.append([entry.strip(), following, ""])
                following += 1
            if comment.strip() and entries:
                entries[-1][2] = (entries[-1][2] + " " + comment.strip()).strip()
        return tuple(EnumEntry(*e) for e in entries)

    def enum_names(self, name: str, prefix: str) -> List[str]:
        """The entries of `enum name` named `prefix` + a capitalised word (kTrFirstData, not
        kTraceSlots), indexed by value, as snake_case names without the prefix (first_data)."""
        entries = [e for e in self.enum(name) if re.match(re.escape(prefix) + "[A-Z]", e.name)]
        if [e.value for e in entries] != list(range(len(entries))):
            raise self._fail(f"enum {name}: the {prefix}* entries must be 0, 1, 2, ...")
        return [_snake(e.name[len(prefix):]) for e in entries]

    def enum_comments(self, name: str) -> List[str]:
        """The comments of `enum name`, indexed by value (the enum must count 0, 1, 2, ...)."""
        entries = self.enum(name)
        if [e.value for e in entries] != list(range(len(entries))) or not all(e.comment for e in entries):
            raise self._fail(f"enum {name}: entries must be 0, 1, 2, ... each with a comment")
        return [e.comment for e in entries]


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def _trailing_stars(words: List[str]) -> int:
    """How many '*' precede the last word (the first declarator's pointer level)."""
    n = 0
    for w in reversed(words[:-1]):
        if w != "*":
            break
        n += 1
    return n


@functools.lru_cache(maxsize=None)
def _header(path: str, root: str) -> Header:
    return Header(root, path)


def header(path: str, root: Optional[str] = None) -> Header:
    """The declarations of cuda_src/<path> (memoised per cuda_src directory)."""
    return _header(path, str(cuda_src_dir()) if root is None else root)
