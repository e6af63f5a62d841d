#!/usr/bin/env python3
"""Check that a Grafana dashboard asks only for metrics an exposition has.

    check.py DASHBOARD.json [EXPOSITION]      (no EXPOSITION, or "-": stdin)

EXPOSITION is what binxd's /metrics serves (OpenMetrics text; Prometheus'
older text format reads the same), e.g.

    curl -s 127.0.0.1:8090/metrics > metrics.txt
    deploy/grafana/check.py deploy/helm/binx/dashboards/binx-dashboard.json metrics.txt

Every metric name in every panel target's `expr` (rows and their panels
included) and in the template variables' queries is looked up. PromQL
functions, aggregations, keywords, label names (in `{...}`, `by (...)`,
`on (...)`...), strings, numbers, durations and Grafana variables
(`$job`, `${datasource}`, `$__rate_interval`, `[[x]]`) are not names.

A name is found when a sample of the exposition has it, or when a `# TYPE`
line declares a family whose series it is: a counter `x` has `x_total`
(and `x_created`), a histogram `x` has `x_bucket`, `x_sum`, `x_count`, a
summary `x` has `x`, `x_sum`, `x_count`, a gauge or untyped `x` has `x`.
So a family binxd declares before any traffic (binx_requests_total) counts,
but a histogram that has seen no request has no `# TYPE` line yet: scrape
after some traffic. Series Prometheus adds to every scrape (`up`,
`scrape_*`) are found too; --allow adds more.

Exit status: 0 when every name is found, 1 when some are not (each is
listed, with a hint where the name is a near miss of a family's series),
2 on bad input. Python 3 standard library only.
"""

import argparse
import json
import re
import sys

# Series Prometheus itself adds to every target it scrapes.
SCRAPE_SERIES = {
    "up",
    "scrape_duration_seconds",
    "scrape_samples_scraped",
    "scrape_samples_post_metric_relabeling",
    "scrape_series_added",
}

# PromQL words that are not metric names: aggregations, functions,
# keywords and literals. A word followed by "(" is taken as a function
# anyway; this list catches the ones written without it ("sum by (le)
# (...)", "and", "offset").
PROMQL_WORDS = {
    # aggregation operators
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
    "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio",
    # keywords and set operators
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "atan2", "start", "end",
    # literals
    "inf", "nan",
    # functions
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh",
    "atan", "atanh", "avg_over_time", "ceil", "changes", "clamp", "clamp_max",
    "clamp_min", "cos", "cosh", "count_over_time", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "deg", "delta", "deriv",
    "double_exponential_smoothing", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile",
    "histogram_stddev", "histogram_stdvar", "histogram_sum", "holt_winters",
    "hour", "idelta", "increase", "info", "irate", "label_join",
    "label_replace", "last_over_time", "ln", "log10", "log2",
    "mad_over_time", "max_over_time", "min_over_time", "minute", "month",
    "pi", "predict_linear", "present_over_time", "quantile_over_time", "rad",
    "rate", "resets", "round", "scalar", "sgn", "sin", "sinh", "sort",
    "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt",
    "stddev_over_time", "stdvar_over_time", "sum_over_time", "tan", "tanh",
    "time", "timestamp", "vector", "year",
}

IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$__\w+|\$\w+|\[\[[^\]]*\]\]")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
GROUPING = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
NUMBER = re.compile(
    r"(?<![\w:])(0[xX][0-9a-fA-F]+|\d+(\.\d*)?([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?)"
    r"(ms|s|m|h|d|w|y)?(?![\w:])")


def metric_names(expr):
    """The metric names a PromQL expression (with Grafana variables) reads."""
    text = GRAFANA_VAR.sub(" 0 ", expr)
    text = STRING.sub(' "" ', text)
    text = re.sub(r"\{[^{}]*\}", " ", text)          # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)        # ranges, subqueries
    text = GROUPING.sub(r" \1 ", text)               # by (le, type) ...
    text = re.sub(r"\boffset\s+-?\S+", " ", text)    # offset 5m
    text = re.sub(r"@\s*\S+", " ", text)             # @ start() / @ 1609746000
    text = NUMBER.sub(" ", text)
    names = []
    for m in IDENT.finditer(text):
        word = m.group(0)
        rest = text[m.end():].lstrip()
        if rest.startswith("("):
            continue                                 # a function
        if word.lower() in PROMQL_WORDS:
            continue
        names.append(word)
    return names


def variable_query_names(query):
    """Metric names in a Prometheus template variable's query."""
    if isinstance(query, dict):
        query = query.get("query", "")
    if not isinstance(query, str) or not query.strip():
        return []
    q = query.strip()
    m = re.fullmatch(r"label_values\((.*)\)", q, re.S)
    if m:
        args = m.group(1)
        # label_values(label) names no metric; label_values(metric{...}, label) does.
        depth, cut = 0, None
        for i, ch in enumerate(args):
            if ch in "({[":
                depth += 1
            elif ch in ")}]":
                depth -= 1
            elif ch == "," and depth == 0:
                cut = i
        return metric_names(args[:cut]) if cut is not None else []
    m = re.fullmatch(r"query_result\((.*)\)", q, re.S)
    if m:
        return metric_names(m.group(1))
    if re.fullmatch(r"(label_names|metrics)\(.*\)", q, re.S):
        return []
    return metric_names(q)


def walk_panels(panels):
    for panel in panels or []:
        yield panel
        yield from walk_panels(panel.get("panels"))


def dashboard_references(dashboard):
    """(name, where) for every metric name the dashboard reads."""
    refs = []
    for panel in walk_panels(dashboard.get("panels")):
        for target in panel.get("targets") or []:
            expr = target.get("expr")
            if isinstance(expr, str) and expr.strip():
                where = 'panel %s "%s" %s' % (
                    panel.get("id"), panel.get("title", ""), target.get("refId", ""))
                refs += [(n, where) for n in metric_names(expr)]
    for var in (dashboard.get("templating") or {}).get("list") or []:
        if var.get("type") == "query":
            where = "variable $%s" % var.get("name")
            refs += [(n, where) for n in variable_query_names(var.get("query"))]
    return refs


def read_exposition(text):
    """(families by name -> type, sample names) of an exposition."""
    families, samples = {}, set()
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                families[parts[2]] = parts[3].strip().lower()
            continue
        m = IDENT.match(line)
        if m:
            samples.add(m.group(0))
    return families, samples


def family_series(name, kind):
    """The series names a family of this type has."""
    if kind == "counter":
        # OpenMetrics declares `x` for the series `x_total`; the older text
        # format declares `x_total` itself. Either way the series is `*_total`.
        base = name[: -len("_total")] if name.endswith("_total") else name
        return {base + "_total", base + "_created"}
    if kind == "histogram":
        return {name + s for s in ("_bucket", "_sum", "_count", "_created")}
    if kind == "gaugehistogram":
        return {name + s for s in ("_bucket", "_gsum", "_gcount")}
    if kind == "summary":
        return {name, name + "_sum", name + "_count", name + "_created"}
    if kind == "info":
        return {name + "_info"}
    return {name}                                    # gauge, stateset, unknown, untyped


def hint(name, families):
    """Why a name is a near miss of a declared family, if it is."""
    near = [f for f in families if name == f or name.startswith(f + "_")]
    near = sorted(near, key=len, reverse=True) or sorted(
        (f for f in families if f.startswith(name)), key=len)
    if not near:
        return None
    family = near[0]
    kind = families[family]
    series = family_series(family, kind) - {family + "_created"}
    return "%s is a %s: its series are %s" % (family, kind, ", ".join(sorted(series)))


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Check that a Grafana dashboard's queries name only metrics an exposition has.")
    parser.add_argument("dashboard", help="dashboard JSON model")
    parser.add_argument("exposition", nargs="?", default="-",
                        help="/metrics text (default: stdin)")
    parser.add_argument("--allow", action="append", default=[], metavar="NAME",
                        help="a name to take as present (repeatable); up and scrape_* always are")
    parser.add_argument("--unused", action="store_true",
                        help="also list the exposition's families the dashboard never reads")
    args = parser.parse_args(argv)

    try:
        with open(args.dashboard, encoding="utf-8") as f:
            dashboard = json.load(f)
        if args.exposition == "-":
            exposition = sys.stdin.read()
        else:
            with open(args.exposition, encoding="utf-8") as f:
                exposition = f.read()
    except (OSError, ValueError) as e:
        print("check.py: %s" % e, file=sys.stderr)
        return 2
    if "dashboard" in dashboard and "panels" not in dashboard:
        dashboard = dashboard["dashboard"]           # an API export wrapper

    families, samples = read_exposition(exposition)
    if not families and not samples:
        print("check.py: the exposition has no metrics", file=sys.stderr)
        return 2
    declared = set()
    for family, kind in families.items():
        declared |= family_series(family, kind)
    present = samples | declared | SCRAPE_SERIES | set(args.allow)

    refs = dashboard_references(dashboard)
    if not refs:
        print("check.py: the dashboard names no metric", file=sys.stderr)
        return 2
    names = sorted({n for n, _ in refs})
    missing = [n for n in names if n not in present]
    unsampled = [n for n in names if n in declared and n not in samples]

    print("%d metric names in %d references; exposition: %d families, %d sample names"
          % (len(names), len(refs), len(families), len(samples)))
    for n in unsampled:
        print("  declared by # TYPE, no sample yet: %s" % n)
    if args.unused:
        used = set(names)
        for family, kind in sorted(families.items()):
            if not used & family_series(family, kind):
                print("  not on the dashboard: %s (%s)" % (family, kind))
    if missing:
        print("MISSING from the exposition (%d):" % len(missing))
        for n in missing:
            wheres = sorted({w for m, w in refs if m == n})
            print("  %s  (%s)" % (n, "; ".join(wheres)))
            h = hint(n, families)
            if h:
                print("      hint: %s" % h)
        return 1
    print("OK: every name is in the exposition")
    return 0


if __name__ == "__main__":
    sys.exit(main())
