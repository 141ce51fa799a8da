"""bench.replay's per-trace tables, its target check and its figure.

- ``policy_rows(summary, results) -> (policies, hints)``: per capacity the hit
  rate of LRU, today's ``freq``, ``adaptive``, the default (``kvstore``),
  Belady and the oracles, with ``vs_best`` = default - max(LRU, freq); and
  per hinted run its hit rate and the share of the LRU -> Belady gap it
  closes beside the same policy's share without hints;
- ``check_target(suite)``: whether ``vs_best >= -TOLERANCE`` everywhere, and
  the worst capacity of each trace;
- ``plot_suite(path, suite, default)``: one panel per trace (policies against
  LRU, Belady and the oracles; hinted runs as points) and one panel of the
  gap each hint type closes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import Row

TOLERANCE = 0.005


def _gap_closed(rate: float, lru: float, belady: float) -> float:
    return (rate - lru) / (belady - lru) if belady > lru + 1e-12 else float("nan")


def policy_rows(summary: Sequence[Row], results: Sequence[tuple[Any, Any]]) -> tuple[list[Row], list[Row]]:
    from kvstore.store.policies import DEFAULT_POLICY

    by: dict[tuple[str, str, float], float] = {(j.kind, j.label, j.capacity_frac): r.hit_rate for j, r in results}
    policies: list[Row] = []
    hints: list[Row] = []
    for s in summary:
        frac = s["cap"]
        kv_rate: float = s["kvstore"]  # typed, so that by.get gives a float
        rates = {name: by.get(("policy", name, frac), kv_rate) for name in ("freq", "adaptive")}
        rates[DEFAULT_POLICY] = s["kvstore"]
        best = max(s["lru"], rates["freq"])
        policies.append(
            {
                "capacity_frac": frac,
                "lru": s["lru"],
                "leaf-lru": s["leaf-lru"],
                "freq": rates["freq"],
                "adaptive": rates["adaptive"],
                "kvstore": s["kvstore"],
                "belady": s["belady"],
                "life-oracle": s["life-oracle"],
                "pop-oracle": s["pop-oracle"],
                "vs_best": s["kvstore"] - best,
                "gap_closed": _gap_closed(s["kvstore"], s["lru"], s["belady"]),
            }
        )
        plain = float(rates["adaptive"])
        for (kind, label, f), rate in sorted(by.items()):
            if kind == "hints" and f == frac:
                hints.append(
                    {
                        "capacity_frac": frac,
                        "policy": label,
                        "hit_rate": rate,
                        "gain": rate - plain,
                        "gap_closed": _gap_closed(rate, s["lru"], s["belady"]),
                        "gap_closed_no_hint": _gap_closed(plain, s["lru"], s["belady"]),
                        "to_belady": s["belady"] - rate,
                    }
                )
    return policies, hints


def check_target(suite: Sequence[tuple[str, list[Row], list[Row]]]) -> dict[str, Any]:
    worst: list[Row] = []
    met = True
    for name, policies, _ in suite:
        row = min(policies, key=lambda r: r["vs_best"])
        met &= row["vs_best"] >= -TOLERANCE
        worst.append(
            {
                "trace": name,
                "capacity_frac": row["capacity_frac"],
                "vs_best": row["vs_best"],
                "kvstore": row["kvstore"],
                "lru": row["lru"],
                "freq": row["freq"],
            }
        )
    return {"rule": f"kvstore >= max(lru, freq) - {TOLERANCE} at every capacity", "met": bool(met), "worst": worst}


_LINES = (
    ("belady", "k-", "Belady"),
    ("life-oracle", "k--", "lifetime oracle"),
    ("pop-oracle", "k:", "popularity oracle"),
    ("adaptive", "C0-o", "adaptive"),
    ("freq", "C1-^", "freq (before)"),
    ("lru", "C3-s", "LRU"),
)
_HINT_MARKS = {"reuse": "C2*", "priority": "C4v", "ttl": "C5P", "all": "C6X"}


def plot_suite(path: Path, suite: Sequence[tuple[str, list[Row], list[Row]]], default: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    panels = len(suite) + 1
    cols = min(panels, 4)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (name, policies, hints) in zip(flat, suite):
        caps = [r["capacity_frac"] for r in policies]
        for key, style, label in _LINES:
            lw = 2.0 if key in ("adaptive", default) else 1.2
            ax.plot(caps, [r[key] for r in policies], style, label=label, lw=lw, ms=4)
        for kind, mark in _HINT_MARKS.items():
            pts = [(h["capacity_frac"], h["hit_rate"]) for h in hints if h["policy"].endswith("+" + kind)]
            if pts:
                ax.plot(*zip(*pts), mark, ls="none", ms=7, label=f"adaptive + {kind} hint")
        ax.set(xscale="log", title=name, xlabel="capacity (fraction of distinct blocks)", ylabel="prefix hit rate")
        ax.set_xticks(caps, [f"{c:g}" for c in caps])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
    flat[0].legend(fontsize=6.5)
    bars = flat[len(suite)]
    kinds = list(_HINT_MARKS)
    labels: list[str] = []
    values: dict[str, list[float]] = {k: [] for k in ["none", *kinds]}
    for name, _, hints in suite:
        for frac in sorted({h["capacity_frac"] for h in hints}):
            at = {h["policy"].split("+", 1)[1]: h for h in hints if h["capacity_frac"] == frac}
            labels.append(f"{name[:10]}\n{frac:g}")
            values["none"].append(next(iter(at.values()))["gap_closed_no_hint"])
            for k in kinds:
                values[k].append(at[k]["gap_closed"] if k in at else float("nan"))
    width = 0.8 / len(values)
    for i, (k, v) in enumerate(values.items()):
        bars.bar([x + i * width for x in range(len(labels))], v, width, label="no hint" if k == "none" else k)
    bars.set_xticks([x + 0.4 for x in range(len(labels))], labels, fontsize=6, rotation=90)
    # where LRU is already within a hair of Belady the share explodes (documents at 10%: -9): clip the axis
    bars.set(title="share of the LRU -> Belady gap closed (axis clipped at -1)", ylabel="gap closed", ylim=(-1, 1.05))
    bars.legend(fontsize=6.5)
    for ax in flat[panels:]:
        ax.axis("off")
    fig.suptitle(f"bench.replay: one tier; default policy '{default}'", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
