"""Which script variables the rest of a training loop can read before writing them.

A checkpoint stores the script's variables (:mod:`cfrun.rank.frames`) so that a resumed run
reads what the uninterrupted one read. A variable the loop assigns before any read, on every
path from the point where the resume puts the values back (``logits = model(x)`` at the top of
the body), needs no storing: whatever the restarted script holds there is overwritten before
anyone looks. Storing it anyway costs checkpoint bytes, and one too large to store was reported
as a reason the resume "may not be exact" at every resume (issue 27, item 7).

:func:`live_names` answers, for a script frame stopped at the head of a loop, with the classic
backward liveness analysis (a variable is live at a point if some path from there reads it
before writing it) over the ``ast`` of the frame's function, loops iterated to a fixed point.
The points where the resume writes the frame's values back are the loop heads around the
checkpoint's point in that function (the step loop's, and the epoch loops' the resume jumps:
:mod:`cfrun.rank.resume`), so the answer is the union of the live sets at all of them.

It errs on the side of "live" wherever it cannot be sure:

* only kills it is sure of count: a plain name assigned by ``=``, a ``for`` target, an annotated
  assignment with a value; every other write (``with ... as``, imports, ``def``, walrus,
  ``except ... as``) is ignored, and ``del x`` counts as a read (it needs ``x`` bound);
* every statement in a ``try`` body may jump to its handlers, every exit of a ``try`` passes
  through its ``finally``, a ``with`` body may continue after the ``with`` (a suppressing
  ``__exit__``);
* names that code defined elsewhere can read at another time are always live: for a function,
  its variables captured by nested functions, lambdas, generator expressions and classes (the
  ``symtable``), and its free variables; for the module, every global any function, lambda or
  class of the script reads;
* the targets of the ``for`` loops around the point are always live (the resume reads them to
  find the loop's position);
* a function that calls ``locals``, ``vars``, ``eval``, ``exec``, ``globals`` or ``dir``, or
  touches frames (``_getframe``, ``f_locals``, ``currentframe``), a statement kind it does not
  know, a point not at a loop head, or source it cannot read or parse: no answer (None: every
  variable is live).
"""

from __future__ import annotations

import ast
import functools
import os
import symtable
import types
from dataclasses import dataclass, replace

_INTROSPECTION = frozenset({"locals", "vars", "eval", "exec", "globals", "dir", "breakpoint",
                            "_getframe", "f_locals", "currentframe", "getframeinfo", "stack",
                            "f_back", "settrace"})
"""Names (called or read as attributes) by which code may read a frame's variables unseen."""

_COMPREHENSIONS = frozenset({"listcomp", "setcomp", "dictcomp"})
"""symtable scopes run at once where they stand (their reads are read in place)."""

_SIMPLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Pass, ast.Break,
           ast.Continue, ast.Return, ast.Raise, ast.Assert, ast.Delete, ast.Import,
           ast.ImportFrom, ast.Global, ast.Nonlocal)


class _Unknown(Exception):
    """A construct the analysis does not follow: no answer."""


@dataclass(frozen=True)
class _Ctx:
    """Where control goes from a statement besides the next one: live sets at the targets."""

    brk: frozenset[str] = frozenset()
    cont: frozenset[str] = frozenset()
    ret: frozenset[str] = frozenset()
    exc: frozenset[str] = frozenset()


def _reads(*nodes: ast.AST | None) -> set[str]:
    """Every name an expression loads or deletes (nested lambdas and comprehensions included:
    their own parameters count too, which only keeps more live)."""
    out: set[str] = set()
    for node in nodes:
        if node is None:
            continue
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store):
                out.add(n.id)
    return out


def _kills(target: ast.AST) -> set[str]:
    """Names a target surely binds: a name, or names in (starred) tuples and lists of them."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_kills(e) for e in target.elts))
    if isinstance(target, ast.Starred):
        return _kills(target.value)
    return set()


def _target_reads(target: ast.AST) -> set[str]:
    """Names a target's evaluation reads (``a[i] = ...`` reads ``a`` and ``i``)."""
    if isinstance(target, ast.Name):
        return set()
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_target_reads(e) for e in target.elts))
    if isinstance(target, ast.Starred):
        return _target_reads(target.value)
    return _reads(target)


class _Liveness:
    """Backward liveness over one function's statements; records the live set at the head of
    every loop (:attr:`heads`) and before every statement (:attr:`before`), by node id."""

    def __init__(self) -> None:
        self.heads: dict[int, frozenset[str]] = {}
        self.before: dict[int, frozenset[str]] = {}

    def block(self, stmts: list[ast.stmt], out: frozenset[str], ctx: _Ctx) -> frozenset[str]:
        live = out
        for stmt in reversed(stmts):
            live = self.stmt(stmt, live, ctx) | ctx.exc
            self.before[id(stmt)] = live
        return live

    def stmt(self, s: ast.stmt, out: frozenset[str], ctx: _Ctx) -> frozenset[str]:
        if isinstance(s, ast.Assign):
            kill = set().union(*(_kills(t) for t in s.targets))
            gen = _reads(s.value).union(*(_target_reads(t) for t in s.targets))
            return frozenset(gen | (out - kill))
        if isinstance(s, ast.AnnAssign):
            kill = _kills(s.target) if s.value is not None else set()
            gen = _reads(s.value, s.annotation) | _target_reads(s.target)
            return frozenset(gen | (out - kill))
        if isinstance(s, ast.AugAssign):
            return frozenset(_kills(s.target) | _reads(s.target, s.value) | out)
        if isinstance(s, (ast.Expr, ast.Assert, ast.Delete, ast.Import, ast.ImportFrom,
                          ast.Global, ast.Nonlocal, ast.Pass)):
            return frozenset(_reads(s) | out)
        if isinstance(s, ast.Break):
            return ctx.brk
        if isinstance(s, ast.Continue):
            return ctx.cont
        if isinstance(s, ast.Return):
            return frozenset(_reads(s.value) | ctx.ret)
        if isinstance(s, ast.Raise):
            return frozenset(_reads(s.exc, s.cause) | ctx.exc)
        if isinstance(s, ast.If):
            return frozenset(_reads(s.test) | self.block(s.body, out, ctx)
                             | self.block(s.orelse, out, ctx))
        if isinstance(s, (ast.For, ast.AsyncFor, ast.While)):
            return self.loop(s, out, ctx)
        if isinstance(s, (ast.With, ast.AsyncWith)):
            body = self.block(s.body, out, replace(ctx, exc=ctx.exc | out))
            return frozenset(_reads(*s.items) | body)
        if isinstance(s, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            return self.try_(s, out, ctx)  # type: ignore[arg-type]
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = s.args
            return frozenset(_reads(*s.decorator_list, *a.defaults, *a.kw_defaults, s.returns,
                                    *(x.annotation for x in a.posonlyargs + a.args
                                      + a.kwonlyargs), a.vararg and a.vararg.annotation,
                                    a.kwarg and a.kwarg.annotation) | out)
        if isinstance(s, ast.ClassDef):
            return frozenset(_reads(*s.decorator_list, *s.bases, *s.keywords) | out)
        if isinstance(s, ast.Match):
            gen = _reads(s.subject).union(*(_reads(c.pattern, c.guard) for c in s.cases))
            return frozenset(gen | out).union(*(self.block(c.body, out, ctx) for c in s.cases))
        raise _Unknown(type(s).__name__)

    def loop(self, s: ast.For | ast.AsyncFor | ast.While, out: frozenset[str],
             ctx: _Ctx) -> frozenset[str]:
        exit_live = self.block(s.orelse, out, ctx)
        if isinstance(s, ast.While):
            kill: set[str] = set()
            gen = _reads(s.test)
        else:
            kill, gen = _kills(s.target), _target_reads(s.target)
        head = frozenset(exit_live | gen)
        while True:
            body = self.block(s.body, head, replace(ctx, brk=out, cont=head))
            new = frozenset(exit_live | gen | (body - kill) | head)
            if new == head:
                break
            head = new
        self.heads[id(s)] = head
        return head if isinstance(s, ast.While) else frozenset(head | _reads(s.iter))

    def try_(self, s: ast.Try, out: frozenset[str], ctx: _Ctx) -> frozenset[str]:
        inner, after = ctx, out
        if s.finalbody:
            through = self.block(s.finalbody, out | ctx.brk | ctx.cont | ctx.ret | ctx.exc, ctx)
            inner = _Ctx(brk=through, cont=through, ret=through, exc=through)
            after = through
        handlers = frozenset().union(*(_reads(h.type) | self.block(h.body, after, inner)
                                       for h in s.handlers))
        orelse = self.block(s.orelse, after, inner)
        return self.block(s.body, orelse, replace(inner, exc=inner.exc | handlers))


@functools.lru_cache(maxsize=8)
def _source(path: str) -> tuple[ast.Module, symtable.SymbolTable] | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return ast.parse(text, path), symtable.symtable(text, path, "exec")
    except (OSError, SyntaxError, ValueError):
        return None


def _own_nodes(body: list[ast.stmt]) -> list[ast.AST]:
    """Every node of ``body`` outside nested function and class bodies."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _introspects(tree: ast.AST) -> bool:
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and n.id in _INTROSPECTION:
            return True
        if isinstance(n, ast.Attribute) and n.attr in _INTROSPECTION:
            return True
    return False


def _escaping(table: symtable.SymbolTable, module: bool) -> set[str]:
    """Names of ``table``'s scope that code running at another time may read: the module's
    globals read by any nested scope; a function's variables free in a nested scope. A list,
    set or dict comprehension runs in place (its reads are read where it stands): only what
    it nests counts."""
    out: set[str] = set()
    for child in table.get_children():
        if child.get_name() in _COMPREHENSIONS:
            out |= _escaping(child, module)
        elif module:
            out |= _globals_read(child)
        else:
            out |= {sym.get_name() for sym in child.get_symbols() if sym.is_free()}
    return out


def _globals_read(table: symtable.SymbolTable) -> set[str]:
    out = {sym.get_name() for sym in table.get_symbols()
           if sym.is_global() or sym.is_declared_global()}
    for child in table.get_children():
        out |= _globals_read(child)
    return out


def _function(tree: ast.Module, table: symtable.SymbolTable, name: str, firstlineno: int
              ) -> tuple[list[ast.stmt], symtable.SymbolTable] | None:
    """The body and symbol table of the function ``name`` whose code starts at
    ``firstlineno`` (a decorator's line, if decorated); the module's for ``<module>``."""
    if name == "<module>":
        return tree.body, table
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name \
                and firstlineno in {node.lineno, *(d.lineno for d in node.decorator_list)}:
            todo = [table]
            while todo:
                t = todo.pop()
                if t.get_type() == "function" and t.get_name() == node.name \
                        and t.get_lineno() == node.lineno:
                    return node.body, t
                todo.extend(t.get_children())
    return None


def _loops_around(body: list[ast.stmt], line: int) -> list[ast.For | ast.AsyncFor | ast.While]:
    """The loops of ``body`` (not of nested functions) whose span holds ``line``, outermost
    first."""
    loops = [n for n in _own_nodes(body) if isinstance(n, (ast.For, ast.AsyncFor, ast.While))
             and n.lineno <= line <= (n.end_lineno or 0)]
    return sorted(loops, key=lambda n: n.lineno)


def _header_end(loop: ast.For | ast.AsyncFor | ast.While) -> int:
    expr = loop.test if isinstance(loop, ast.While) else loop.iter
    return expr.end_lineno or loop.lineno


def _followable(path: str, name: str, firstlineno: int
                ) -> tuple[list[ast.stmt], symtable.SymbolTable] | None:
    """The body and symbol table of the function (``<module>``: the module) when its source
    reads and parses and it does not introspect its frame; None otherwise."""
    parsed = _source(path)
    if parsed is None:
        return None
    found = _function(*parsed, name, firstlineno)
    if found is None or any(_introspects(n) for n in found[0]):
        return None
    return found


@functools.lru_cache(maxsize=64)
def _live_at(path: str, name: str, firstlineno: int, line: int, freevars: tuple[str, ...]
             ) -> frozenset[str] | None:
    found = _followable(path, name, firstlineno)
    if found is None:
        return None
    body, scope = found
    loops = _loops_around(body, line)
    if not loops:
        return None
    inner = loops[-1]
    first = inner.body[0]
    at_body = (line == first.lineno and isinstance(first, _SIMPLE)
               and not any(isinstance(n, ast.stmt) and n is not first and n.lineno == line
                           for n in _own_nodes(body)))
    if not (inner.lineno <= line <= _header_end(inner) or at_body):
        return None
    analysis = _Liveness()
    try:
        analysis.block(body, frozenset(), _Ctx())
    except _Unknown:
        return None
    live = set(analysis.before.get(id(first), frozenset())) if at_body else set()
    for loop in loops:
        live |= analysis.heads.get(id(loop), frozenset())
        if isinstance(loop, ast.While):
            live |= _reads(loop.test)
        else:
            live |= _reads(loop.iter) | _kills(loop.target) | _target_reads(loop.target)
    live |= _escaping(scope, name == "<module>") | set(freevars)
    return frozenset(live)


def live_names(frame: types.FrameType) -> frozenset[str] | None:
    """The variables of ``frame`` (a script frame at a checkpoint) that the script can read
    before writing them from the points where a resume puts them back: the heads of the loops
    around the frame's current line in its function (module docstring). None when that is
    not known (every variable counts as live then): the frame is not at a loop head (or at
    the first line of its body), or its source cannot be read or followed.

    Called on the training thread at a checkpoint boundary; the answer is cached per (file,
    function, line), so a checkpoint pays the analysis once per loop.
    """
    code = frame.f_code
    return _live_at(os.path.realpath(code.co_filename), code.co_name, code.co_firstlineno,
                    frame.f_lineno, tuple(code.co_freevars))



def warm(frames: list[types.FrameType]) -> int:
    """Work out now what :func:`live_names` will answer at the first checkpoint, so that the
    checkpoint finds it cached: for each of ``frames`` (the script's, innermost first, at an
    optimizer step) its current line, and the header and first body line of every loop around
    that line, where the checkpoint's boundary stops (issue 23: parsing the script and its
    symbol table and the analysis cost the first checkpoint 16-23 ms of stall on a 2-core
    machine; every later one ~1 ms). Training thread, at this process's first step (a start-up
    cost, paid once, like the script's own imports). Returns how many answers it cached.
    Never raises (a failure only leaves the work to the first checkpoint)."""
    count = 0
    for frame in frames:
        try:
            code = frame.f_code
            path, name = os.path.realpath(code.co_filename), code.co_name
            lines = {frame.f_lineno}
            found = _followable(path, name, code.co_firstlineno)
            if found is not None:
                for loop in _loops_around(found[0], frame.f_lineno):
                    lines.update(range(loop.lineno, _header_end(loop) + 1))
                    lines.add(loop.body[0].lineno)
            for line in sorted(lines):
                _live_at(path, name, code.co_firstlineno, line, tuple(code.co_freevars))
                count += 1
        except Exception:  # the first checkpoint works it out instead
            continue
    return count


@functools.lru_cache(maxsize=64)
def _assigned_at(path: str, name: str, firstlineno: int, line: int, freevars: tuple[str, ...]
                 ) -> frozenset[str] | None:
    found = _followable(path, name, firstlineno)
    if found is None:
        return None
    body, scope = found
    out = _written_elsewhere(scope, name == "<module>") | set(freevars)
    for loop in _loops_around(body, line)[:1]:  # the outermost: it holds the others
        for node in ast.walk(loop):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                out.add(node.id)
            elif isinstance(node, ast.alias):
                out.add((node.asname or node.name).partition(".")[0])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                out.add(node.name)
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                out.update(node.names)
    return frozenset(out)


def _written_elsewhere(table: symtable.SymbolTable, module: bool) -> set[str]:
    """Names of ``table``'s scope that nested code assigns: the module's globals a function
    declares ``global`` and assigns; a function's variables a nested one declares
    ``nonlocal``."""
    out: set[str] = set()
    for child in table.get_children():
        for sym in child.get_symbols():
            if sym.is_assigned() and ((module and sym.is_declared_global())
                                      or (not module and sym.is_nonlocal())):
                out.add(sym.get_name())
        out |= _written_elsewhere(child, module)
    return out


def loop_assigned(frame: types.FrameType) -> frozenset[str] | None:
    """The variables of ``frame`` that the loops around its current line may assign (every
    kind of write, nested functions' included), plus those nested code assigns (``global``,
    ``nonlocal``). A variable
    outside this set holds what the script computed before its loop: on a resume on another
    world size (:mod:`cfrun.codec.reshard`) the live value (``rank``, ``world_size``,
    ``device``) is right and the checkpoint's is the old world's. None: not known (source
    unreadable, or the function introspects its frame): every variable counts as assigned.
    Training thread, at the resume."""
    code = frame.f_code
    return _assigned_at(os.path.realpath(code.co_filename), code.co_name, code.co_firstlineno,
                        frame.f_lineno, tuple(code.co_freevars))
