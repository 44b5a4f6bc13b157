"""Metric names a Grafana dashboard queries, and metric names a Prometheus text exposition exposes, in one
normal form so the two sets compare: a histogram (or summary) by its base name (``_bucket``, ``_sum`` and
``_count`` stripped), a counter by its ``_total`` sample name, a gauge by its name; the ``_created`` series
prometheus_client adds to counters and histograms are not metrics of their own.

    missing = dashboard_metric_names("ops/grafana/remask-dashboard.json") - exposed_metric_names(text)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

_SUFFIXES = ("_bucket", "_sum", "_count")

# PromQL words that are not metric names where they stand without a following "("
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless",
             "inf", "nan", "atan2", "start", "end"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\]")  # Grafana's $var, ${var[:fmt]}, [[var]]
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_IDENT = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?")
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((.*)\)\s*$", re.S)
_QUERY_RESULT = re.compile(r"^\s*query_result\s*\((.*)\)\s*$", re.S)


def base_name(name: str) -> str:
    """A sample's metric name in the common form: ``_bucket``, ``_sum`` and ``_count`` stripped."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def promql_metric_names(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects (Grafana variables allowed), in the common form."""
    expr = _STRING.sub('""', expr)
    expr = _VARIABLE.sub("1m", expr)  # a variable stands for a duration, a label value or a number
    expr = _GROUPING.sub(" ", expr)
    expr = _MATCHERS.sub(" ", expr)
    expr = _RANGE.sub(" ", expr)
    names = set()
    for m in _IDENT.finditer(expr):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue  # a function or aggregation operator, or a keyword
        names.add(base_name(word))
    return names


def template_metric_names(query: str) -> set[str]:
    """The metric names a Grafana Prometheus template-variable query reads: ``label_values(expr, label)``,
    ``query_result(expr)`` or a bare expression; ``label_values(label)`` and ``metrics(re)`` read none."""
    m = _LABEL_VALUES.match(query)
    if m:
        args = m.group(1)
        head, sep, _label = args.rpartition(",")
        return promql_metric_names(head) if sep else set()
    m = _QUERY_RESULT.match(query)
    if m:
        return promql_metric_names(m.group(1))
    if re.match(r"^\s*(metrics|label_names)\s*\(", query):
        return set()
    return promql_metric_names(query)


def _walk(node) -> Iterator[dict]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def dashboard_metric_names(path: str | Path) -> set[str]:
    """Every metric name the dashboard at ``path`` queries: each panel target's ``expr`` (rows' nested panels
    included) and each query template variable's ``query`` (a string, or an object with a ``query``)."""
    doc = json.loads(Path(path).read_text())
    names: set[str] = set()
    variables = (doc.get("templating") or {}).get("list") or []
    for var in variables:
        if var.get("type") != "query":
            continue
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if isinstance(query, str) and query.strip():
            names |= template_metric_names(query)
    for node in _walk({k: v for k, v in doc.items() if k != "templating"}):
        expr = node.get("expr")
        if isinstance(expr, str) and expr.strip():
            names |= promql_metric_names(expr)
    return names


def exposed_metric_names(text: str) -> set[str]:
    """Every metric name in a Prometheus text exposition, in the common form (see the module's doc)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(text))
    with_created = {f.name for f in families if f.type in ("counter", "histogram", "summary", "gaugehistogram")}
    names: set[str] = set()
    for family in families:
        if family.name.endswith("_created") and family.name[: -len("_created")] in with_created:
            continue  # prometheus_client's creation time of a counter or histogram: exposed as its own gauge
        for sample in family.samples:
            if sample.name.endswith("_created") and family.type in ("counter", "histogram", "summary"):
                continue
            if family.type in ("histogram", "summary", "gaugehistogram"):
                names.add(family.name)
            elif family.type == "counter":
                names.add(sample.name if sample.name.endswith("_total") else sample.name + "_total")
            else:  # a gauge, info, stateset or untyped sample: as the dashboard side would name it
                names.add(base_name(sample.name))
    return names
