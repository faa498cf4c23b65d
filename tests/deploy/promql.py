"""PromQL walking for the dashboard tests: parse with ``promql-parser`` (the Rust parser
Prometheus-compatible tools use) and name the shapes the dashboards rely on.

* a **zero filter** ``x > 0`` (a filter, not ``> bool``) drops zeros, NaN and so empty
  windows: under a division it keeps 0/0 from reaching a panel as NaN, after a quantile
  it drops the NaN of a window without observations, after a failure count it keeps
  the legend to the series that moved;
* a **zero fallback** ``x or on () max(kvroute_build_info{...}) * 0`` reads 0 where ``x``
  is empty, but only while a router is scraped (no router: still no data, not a
  made-up 0).
"""

from __future__ import annotations

from typing import Any

import promql_parser

from tests.deploy.conftest import Query, substitute


def parse(q: Query, values: dict[str, str] | None = None) -> Any:
    try:
        return promql_parser.parse(substitute(q.expr, values))
    except Exception as exc:
        raise AssertionError(f"{q.source}: {q.expr!r} does not parse: {exc}") from exc


def nodes(ast: Any) -> list[Any]:
    found: list[Any] = []
    promql_parser.walk(ast, lambda n: found.append(n))
    return found


def selectors(ast: Any) -> list[Any]:
    return [n for n in nodes(ast) if isinstance(n, promql_parser.VectorSelector)]


def unparen(ast: Any) -> Any:
    while isinstance(ast, promql_parser.ParenExpr):
        ast = ast.expr
    return ast


def is_binary(ast: Any, op: str) -> bool:
    return isinstance(ast, promql_parser.BinaryExpr) and str(ast.op) == op


def is_number(ast: Any, value: float) -> bool:
    ast = unparen(ast)
    return isinstance(ast, promql_parser.NumberLiteral) and ast.val == value


def is_zero_filter(ast: Any) -> bool:
    """``x > 0`` as a filter (``> bool 0`` keeps the zeros, as 0)."""
    ast = unparen(ast)
    if not is_binary(ast, ">") or not is_number(ast.rhs, 0):
        return False
    return not (ast.modifier is not None and ast.modifier.return_bool)


def is_quantile(ast: Any) -> bool:
    ast = unparen(ast)
    return isinstance(ast, promql_parser.Call) and ast.func.name == "histogram_quantile"


def nan_problems(ast: Any) -> list[str]:
    """What in ``ast`` can evaluate to NaN: a division whose denominator is not
    zero-filtered (0/0 in an idle window), a quantile not zero-filtered (a window
    without observations)."""
    problems = []
    filtered = {str(unparen(n).lhs) for n in nodes(ast) if is_zero_filter(n)}
    for n in nodes(ast):
        if is_binary(n, "/") and not is_zero_filter(n.rhs):
            problems.append(f"denominator {n.rhs} is not filtered with > 0")
        if is_quantile(n) and str(n) not in filtered:
            problems.append(f"{n} is not filtered with > 0")
    return problems


def is_ratio_or_quantile(ast: Any) -> bool:
    """Queries that have no value in a window without traffic (rather than 0)."""
    return any(is_binary(n, "/") or is_quantile(n) for n in nodes(ast))


def zero_fallback(ast: Any) -> Any | None:
    """The fallback selector of ``x or on () max(kvroute_build_info{...}) * 0``, or None
    when ``ast`` does not end in one."""
    ast = unparen(ast)
    if not is_binary(ast, "or") or ast.modifier is None or ast.modifier.matching is None:
        return None
    on = ast.modifier.matching
    if on.type != promql_parser.LabelModifierType.Include or list(on.labels):
        return None  # only "on ()" matches every left-hand series, whatever its labels
    rhs = unparen(ast.rhs)
    if not is_binary(rhs, "*") or not is_number(rhs.rhs, 0):
        return None
    agg = unparen(rhs.lhs)
    if not isinstance(agg, promql_parser.AggregateExpr) or agg.modifier is not None:
        return None  # one series with no labels, however many replicas
    sel = unparen(agg.expr)
    if not isinstance(sel, promql_parser.VectorSelector) or sel.name != "kvroute_build_info":
        return None
    return sel


def filters_zeros_then_falls_back(ast: Any) -> bool:
    """``x > 0 or on () <zero fallback>``."""
    return zero_fallback(ast) is not None and is_zero_filter(unparen(ast).lhs)


def matcher_values(sel: Any) -> dict[str, str]:
    """Label name -> value of a selector's matchers (``__name__`` left out)."""
    out = {}
    for m in sel.matchers.matchers:
        if m.name != "__name__":
            out[m.name] = m.value
    for group in sel.matchers.or_matchers or []:
        for m in group:
            out[m.name] = m.value
    return out
