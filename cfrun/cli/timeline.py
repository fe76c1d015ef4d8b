"""``cfrun status --plot PNG``: the job's timeline and its checkpoints, as a picture (issue 35).

Top: one row per attempt on the job's wall clock, its start-up or restart (lost time, from
the previous attempt's end to its first optimizer step) and its training, the commits as ticks
and the failures as red marks with their cause, and the ETTR with the time lost per cause in
the title (:func:`cfrun.contract.goodput.timeline`, :func:`cfrun.contract.goodput.goodput`).
Bottom: each checkpoint's stall and PGT by step, and the step time the policy measured.
matplotlib (Agg) draws it; without matplotlib, one line and exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cfrun.contract.errors import BadInputError
from cfrun.contract.goodput import CAUSES, goodput, timeline

COLOURS = {"startup": "tab:orange", "restart": "tab:red", "training": "tab:green"}


def plot(events: list[dict[str, Any]], name: str, out: Path) -> None:
    """Write the PNG ``out`` for the job ``name`` from its ``events``.

    Raises:
        BadInputError: matplotlib is missing (``pip install matplotlib``).
        OSError: ``out`` cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInputError("--plot needs matplotlib; pip install matplotlib") from None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5),
                                      gridspec_kw={"height_ratios": [1, 1.4]})
    _timeline(top, events)
    _checkpoints(bottom, events)
    fig.suptitle(f"cfrun {name}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _timeline(ax: Any, events: list[dict[str, Any]]) -> None:
    tl = timeline(events)
    if tl is None:
        ax.set_title("no attempt yet")
        return
    shown: set[str] = set()
    for s in tl["spans"]:
        label = s["kind"] if s["kind"] not in shown else None
        shown.add(s["kind"])
        ax.broken_barh([(s["t0_s"], max(s["t1_s"] - s["t0_s"], 1e-3))], (s["attempt"] - 0.3, 0.6),
                       color=COLOURS[s["kind"]], label=label)
    rows = {s["t0_s"]: s["attempt"] for s in tl["spans"]}
    attempt_at = sorted(rows.items())

    def row(t: float) -> int:
        att = 0
        for t0, a in attempt_at:
            if t0 <= t:
                att = a
        return att

    if tl["commits"]:
        ax.plot([t for t, _ in tl["commits"]], [row(t) + 0.4 for t, _ in tl["commits"]], "|",
                color="black", markersize=8, label="commit")
    for t, att, cause in tl["failures"]:
        ax.plot([t], [att if isinstance(att, int) else row(t)], "x", color="red", markersize=10)
        ax.annotate(str(cause or "failure")[:40], (t, (att if isinstance(att, int) else 0) + 0.3),
                    fontsize=7, color="red")
    g = goodput(events)
    if g is not None and g["ettr"] is not None:
        lost = ", ".join(f"{c} {g['lost_s'][c]:.1f} s" for c in CAUSES if g["lost_s"][c] > 0)
        ax.set_title(f"ETTR {100 * g['ettr']:.1f}% of {g['wall_s']:.1f} s; lost: {lost or '-'}",
                     fontsize=9)
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("attempt")
    ax.set_yticks(sorted({s["attempt"] for s in tl["spans"]}))
    ax.legend(fontsize=7, loc="upper left")


def _checkpoints(ax: Any, events: list[dict[str, Any]]) -> None:
    ck = [e for e in events if e.get("event") == "checkpoint"]
    ax.plot([e["step"] for e in ck], [1000 * e["stall_s"] for e in ck], "o-", label="stall (ms)")
    ax.plot([e["step"] for e in ck], [1000 * e["pgt_s"] for e in ck], "s-", label="PGT (ms)")
    for e in events:
        if e.get("event") == "failure" and e.get("step") is not None:
            ax.axvline(e["step"], color="red", linestyle="--")
    windows = [e for e in events if e.get("event") == "adapt"]
    if windows:  # step time per adaptation window (the policy measures it)
        ax.plot([e["step"] for e in windows], [1000 * e["mean_iter_s"] for e in windows], "^-",
                label="step time (ms, window mean)")
    ax.set_xlabel("step (red: a failure)")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
