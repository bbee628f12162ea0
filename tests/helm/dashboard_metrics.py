"""The Prometheus metric names a Grafana dashboard's queries use.

`dashboard_metric_names(path)` reads every `expr` of the dashboard's panel targets (rows'
nested panels included) and every query of its template variables, and returns the metric
names they select, with the histogram suffixes `_bucket`, `_sum` and `_count` stripped, so
the set can be compared with the names a real scrape exports.

The PromQL scan is lexical, which suffices for dashboard queries: strings, label matchers
(`{...}`), range/subquery selectors (`[...]`), grouping lists (`by (...)`, `on (...)`, ...),
durations and numbers are removed; an identifier that is not followed by `(` (a function)
and is not a PromQL keyword is a metric name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "atan2", "inf", "nan",
}
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
_GRAFANA_VARS = re.compile(r"\$\{[^}]*\}|\$\w+")
_NUMBER = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?[a-z]*)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NAME_MATCHER = re.compile(r'__name__\s*=\s*"([^"]+)"')
_LABEL_VALUES = re.compile(r"label_values\(\s*([^,)]*?)\s*(?:,[^)]*)?\)\s*$", re.DOTALL)


def strip_histogram_suffix(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def promql_metric_names(expr: str) -> set[str]:
    """Metric names selected by one PromQL expression (histogram suffixes kept)."""
    names = set(_NAME_MATCHER.findall(expr))  # {__name__="metric"}
    text = _STRING.sub(" ", expr)
    text = _GRAFANA_VARS.sub(" ", text)
    while True:  # innermost first, so nested braces/brackets go too
        reduced = _BRACKETS.sub(" ", _BRACES.sub(" ", text))
        if reduced == text:
            break
        text = reduced
    text = _GROUPING.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    for m in _IDENT.finditer(text):
        ident = m.group(0)
        rest = text[m.end():].lstrip()
        if rest.startswith("(") or ident.lower() in _KEYWORDS:
            continue
        names.add(ident)
    return names


def _walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels or []:
        yield panel
        yield from _walk_panels(panel.get("panels", []))


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every query of the dashboard: panel targets' `expr` and query variables' PromQL."""
    exprs = []
    for panel in _walk_panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []) or []:
            if target.get("expr"):
                exprs.append(target["expr"])
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        query = query or var.get("definition") or ""
        m = _LABEL_VALUES.search(query)
        if m:  # label_values(selector, label): the selector is the PromQL part
            if m.group(1):
                exprs.append(m.group(1))
        elif query.startswith("query_result(") and query.endswith(")"):
            exprs.append(query[len("query_result("):-1])
        elif query and not query.startswith(("label_names(", "metrics(")):
            exprs.append(query)
    return exprs


def dashboard_metric_names(path: str | Path) -> set[str]:
    """Metric names used by the dashboard JSON at `path` (without `_bucket/_sum/_count`)."""
    dashboard = json.loads(Path(path).read_text())
    names: set[str] = set()
    for expr in dashboard_exprs(dashboard):
        names |= {strip_histogram_suffix(n) for n in promql_metric_names(expr)}
    return names
