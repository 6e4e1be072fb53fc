"""The budget study on the compute axis: accuracy against what a run costs, for plain SSL and ReLA under each schedule.

A step does not cost the same under every schedule: while lambda is 1 and the loop passes its SSL loss to ``wrap`` as a
callable (the README's recipe), the SSL side is skipped (one view, no momentum network), so the step costs a fraction of
a plain one; under a schedule that mixes both losses every step pays the full price. So every run is placed by its
measured **compute**: the CPU seconds of its training (``harness.py``; the prior's precompute counted once), as a
fraction of the full plain run's (the mean over seeds of plain SSL for ``--full`` steps).

Arms (:func:`plan`): plain SSL, and ReLA with a prior (``random``, ``other``, ``indomain``: ``harness.PRIORS``) under a
schedule (a spec ReLA plans for each run; ``default``: the library's default for a loss passed as a callable) with the
loss as a callable or computed eagerly (a loss computed before ``wrap`` gets ``decay`` by default, the arm ``decay``:
under it every step computes the loss, whatever its form), each run for several lengths so that every arm's curve spans 10 % to past 100 % of the full plain run's
compute; every run probed at a quarter, half and three quarters of it and at its end (``harness.probes_along``).

Analysis (:func:`analyse`): an arm's curve for one seed is, at each compute, the best accuracy any of its runs had
reached by then, each run's accuracy linear between its probe points (:func:`envelope`: a run of the arm never lowers
it); per arm the mean ± sd over seeds
at each ``--at`` budget, the best arm there, and ``compute_to_full_plain``: the compute at which each seed's curve first
reaches the full plain run's mean accuracy (null with the reason where it never does), as a fraction of its compute.

One JSON per finished run in ``--runs`` (committed; rerun the same command to resume; ``--worker I/N`` splits the runs
over N processes), then the results JSON and PNG::

    python benchmarks/budget.py --student vit --worker 0/2 & python benchmarks/budget.py --student vit --worker 1/2
    python benchmarks/budget.py --student vit --gather      # the results JSON + PNG from every finished run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402
from harness import PRIOR_LABEL, PROBES, Run, mean_sd, seeds_text  # noqa: E402

from accelerate_ssl.recipes import steps_to_reach, value_at  # noqa: E402
from accelerate_ssl.results import save_figure, write_results  # noqa: E402
from accelerate_ssl.schedules import DEFAULT_SCHEDULE, EAGER_DEFAULT_SCHEDULE, SWITCH_END_FRACTION  # noqa: E402

#: the budgets (fractions of the full plain run's compute) at which every arm is read off
AT = [0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5]
#: the bar the default recipe (prior trained on other data) must clear: the full plain run's accuracy within this
#: fraction of its compute
REACH_BAR = 0.35
#: what each arm is called in the tables
LOSS_LABEL = {"callable": "", "eager": ", loss computed eagerly"}

#: per student, the arms of the study: (tier, prior, schedule, loss form, run lengths as multiples of the full plain
#: run, seeds); prior None is plain SSL, schedule "default" the library's. The lengths cover 10 % to past the full plain
#: run's compute (a lambda-1 step with the loss as a callable costs about 0.4-0.5 of a plain one). Runs go tier by tier
#: (the headline arms first), seed by seed within a tier, so that results gathered early are complete where it matters.
PLANS = {
    "vit": [
        (1, None, None, "callable", [0.1, 0.2, 0.5, 1.0], range(5)),
        (1, "other", "default", "callable", [0.15, 0.3, 0.6, 1.0, 1.5, 2.5], range(5)),
        (1, "other", "constant:1", "callable", [0.25, 0.5, 1.0, 2.5], range(5)),
        (2, "other", "decay", "callable", [0.1, 0.2, 0.5, 1.0], range(3)),
        (2, "random", "default", "callable", [0.15, 0.3, 0.6, 1.0, 2.5], range(3)),
        (2, "other", "switch:0.75", "callable", [0.3, 1.0, 2.5], range(2)),
        (2, "other", "epochs:0.5", "callable", [0.2, 0.5, 1.0], range(2)),
        (2, "indomain", "default", "callable", [0.15, 0.3, 0.6, 1.0, 2.5], range(2)),
        (2, None, None, "callable", [2.0], range(1)),
        (2, "other", "default", "callable", [4.0], range(1)),
        (3, "random", "default", "callable", [0.15, 0.3, 0.6, 1.0, 2.5], range(3, 5)),
        (3, "other", "decay", "callable", [0.1, 0.2, 0.5, 1.0], range(3, 5)),
        (3, "indomain", "default", "callable", [0.15, 0.3, 0.6, 1.0, 2.5], range(2, 5)),
    ],
    "convnet": [
        (1, None, None, "callable", [0.1, 0.2, 0.5, 1.0], range(5)),
        (1, "other", "default", "callable", [0.15, 0.3, 0.6, 1.0, 2.5], range(5)),
        (1, "other", "constant:1", "callable", [0.25, 0.5, 1.0, 2.5], range(5)),
        (2, "other", "decay", "callable", [0.1, 0.2, 0.5, 1.0], range(3)),
        (2, "random", "default", "callable", [0.15, 0.3, 0.6, 1.0, 2.5], range(3)),
    ],
}
#: the full plain run is probed at these fractions of its steps besides its end (its curve, and the budgets)
FULL_PROBES = (0.1, 0.2, 0.35, 0.5, 0.7)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", choices=sorted(harness.RECIPES), default="vit")
    p.add_argument("--full", type=int, help="steps of the full plain run (default: the recipe's)")
    p.add_argument("--arms", nargs="*", help="run only these arms, named as in the tables' keys (e.g. other:default:callable)")
    p.add_argument("--tiers", type=int, nargs="*", help="run only these tiers of the plan (PLANS)")
    p.add_argument("--seeds", type=int, nargs="*", help="run only these seeds (default: each arm's)")
    p.add_argument("--lengths", type=float, nargs="*",
                   help="run only runs of these lengths (multiples of the full plain run, as in PLANS)")
    p.add_argument("--at", type=float, nargs="+", default=AT, help="budgets, fractions of the full plain run's compute")
    p.add_argument("--train-size", type=int, help="training images (default: the recipe's)")
    p.add_argument("--test-size", type=int, help="test images of the probes (default: the recipe's)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--runs", help="one JSON per finished run (default: benchmarks/runs/compute/<student>)")
    p.add_argument("--cache", default=str(ROOT / "benchmarks/cache/budget"), help="target stores, the in-domain prior")
    p.add_argument("--out", help="results JSON (default: benchmarks/results/budget_<student>.json)")
    p.add_argument("--worker", default="0/1", metavar="I/N", help="run units I, I+N, ... only")
    p.add_argument("--gather", action="store_true",
                   help="run nothing: write the results of the runs finished so far (marked incomplete if some are not)")
    p.add_argument("--timing", action="store_true",
                   help="measure the cost of each kind of step and of each prior's precompute side by side (the "
                        "compute model, harness.timing) into <runs>/timing.json, then exit")
    p.add_argument("--timing-steps", type=int, default=30)
    a = p.parse_args(argv)
    a.worker = tuple(map(int, a.worker.split("/")))
    a.runs = Path(a.runs or ROOT / "benchmarks/runs/compute" / a.student)
    a.cache = Path(a.cache)
    a.out = a.out or str(ROOT / f"benchmarks/results/budget_{a.student}.json")
    a.recipe = harness.recipe(a.student, full=a.full, threads=a.threads, device=a.device, train_size=a.train_size,
                              test_size=a.test_size)
    return a


def arm_key(prior, schedule, loss) -> str:
    return "plain" if prior is None else f"{prior}:{schedule}:{loss}"


def resolve(schedule: str) -> str:
    """A schedule of the plan as the explicit spec its runs are named by: ``default`` -> the library's default with
    its planned hand-over written out (``switch:<SWITCH_END_FRACTION>``), so that a run of an earlier default is never
    taken for one of this default."""
    if schedule != "default":
        return schedule
    return f"switch:{SWITCH_END_FRACTION:g}" if DEFAULT_SCHEDULE == "switch" else DEFAULT_SCHEDULE


def plan(a) -> list[tuple[int, str, Run]]:
    """Every run of the study as (tier, arm, Run), tier by tier and seed by seed within a tier (``--tiers``, ``--arms`` and
    ``--seeds`` select)."""
    out = []
    full = a.recipe.full
    arms = PLANS[a.student]
    for tier in sorted({t for t, *_ in arms}):
        if a.tiers and tier not in a.tiers:
            continue
        for seed in sorted({s for t, *_, seeds in arms if t == tier for s in seeds}):
            for t, prior, schedule, loss, lengths, seeds in arms:
                key = arm_key(prior, schedule, loss)
                if t != tier or seed not in seeds or (a.arms and key not in a.arms) or \
                        (a.seeds is not None and seed not in a.seeds):
                    continue
                for steps in (max(1, round(m * full)) for m in lengths if not a.lengths or m in a.lengths):
                    probes = tuple(round(f * full) for f in FULL_PROBES) if prior is None and steps == full else \
                        harness.probes_along(steps)
                    run = Run(None, steps, seed, probes=probes) if prior is None else \
                        Run(prior, steps, seed, resolve(schedule), loss=loss, probes=probes)
                    out.append((tier, key, run))
    return out


# ---------------------------------------------------------------------------------------------- analysis
def points(record: dict, full_cpu: float, timing: dict | None, train_size: int) -> list[tuple[float, dict]]:
    """A run's probe points as (compute, probe values), compute as a fraction of the full plain run's: modelled
    (``timing`` given: each step at its kind's cost measured side by side, the precompute once; ``harness``) or as the
    run measured it (its training CPU seconds to the point plus its prior's precompute)."""
    if timing is not None:
        xs = harness.modelled_compute(record, timing, train_size)
    else:
        pre = (record.get("precompute") or {}).get("cpu_seconds", 0.0)
        xs = [c["train_cpu_seconds"] + pre for c in record["curve"]]
    return [(x / full_cpu, {k: c[k] for k in PROBES}) for x, c in zip(xs, record["curve"])]


def run_best(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The best accuracy one run had reached by each compute: the running maximum of the piecewise-linear curve through
    its probe points (a rising segment that climbs past the earlier best adds the point where it crosses it)."""
    pts = sorted(pts)
    out, best = [pts[0]], pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if y1 > best:
            if y0 < best:
                out.append((x0 + (best - y0) / (y1 - y0) * (x1 - x0), best))
            out.append((x1, y1))
            best = y1
        else:
            out.append((x1, best))
    return out


def _on(curve: list[tuple[float, float]], x: float):
    """A run's best-so-far curve at ``x``: None before its first probe, its last value past its end."""
    if x < curve[0][0]:
        return None
    return curve[-1][1] if x >= curve[-1][0] else value_at(curve, x)


def envelope(runs: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """An arm's curve for one seed: at each compute, the best accuracy any of its runs had reached by then (each run's
    :func:`run_best`; a run counts from its first probe and keeps its best past its end). Exact: the upper envelope of
    the runs' piecewise-linear curves, with the points where two of them cross; where a run starts above the others
    the curve steps up. Adding a run never lowers it."""
    curves = [run_best(r) for r in runs if r]
    xs = sorted({x for c in curves for x, _ in c})
    grid = set(xs)
    for a, b in zip(xs, xs[1:]):  # every curve alive on [a, b] is linear there: add where two of them cross
        lines = [(_on(c, a), _on(c, b)) for c in curves if c[0][0] <= a]
        for i, (ya, yb) in enumerate(lines):
            for za, zb in lines[i + 1:]:
                d = (ya - za) - (yb - zb)
                if d and 0.0 < (ya - za) / d < 1.0:
                    grid.add(a + (ya - za) / d * (b - a))
    out = []
    for x in sorted(grid):
        alive = [(c[0][0], _on(c, x)) for c in curves if c[0][0] <= x]
        top = max(v for _, v in alive)
        before = [v for start, v in alive if start < x]
        if before and max(before) < top:  # a run starts here above the rest: the curve steps up at x
            out.append((x, max(before)))
        out.append((x, top))
    return out


def curve_at(env: list[tuple[float, float]], x: float):
    """The envelope at compute ``x``: interpolated between its points; its last value past its end is not known."""
    if not env or x < env[0][0] or x > env[-1][0]:
        return None
    return value_at(env, x)


def longest(curves: dict, seeds: list, reach: list) -> str:
    """How far the runs of the seeds that never reached the target went: one compute, or the range of them."""
    ends = sorted(curves[s][-1][0] for s, x in zip(seeds, reach) if x is None)
    return f"{ends[0]:.2f}" if f"{ends[0]:.2f}" == f"{ends[-1]:.2f}" else f"{ends[0]:.2f} to {ends[-1]:.2f}"


def analyse(a, runs: dict[str, list[dict]], timing: dict | None) -> dict:
    """Per arm and seed: the curve (:func:`envelope` of its runs by compute) of each probe; per arm the values at each
    budget, compute_to_full_plain; the best arm at each budget. Compute modelled from ``timing`` (None: as each run
    measured it)."""
    full_steps = a.recipe.full
    full = [r for r in runs.get("plain", []) if r["run"]["steps"] == full_steps]
    full_cpu = (full_steps * timing["kinds"]["plain"]["step_cpu_seconds"] if timing is not None
                else statistics.fmean(r["train_cpu_seconds"] for r in full))
    target = {k: statistics.fmean(r["curve"][-1][k] for r in full) for k in PROBES}
    arms = {}
    for key, rs in runs.items():
        seeds = sorted({r["run"]["seed"] for r in rs})
        per_seed = {s: [points(r, full_cpu, timing, a.recipe.train_size) for r in rs if r["run"]["seed"] == s]
                    for s in seeds}
        curves = {k: {s: envelope([[(x, v[k]) for x, v in run] for run in per_seed[s]]) for s in seeds}
                  for k in PROBES}
        at = {}
        for b in a.at:
            vals = [curve_at(curves["top1"][s], b) for s in seeds]
            if all(v is not None for v in vals):
                at[str(b)] = mean_sd(vals)
        reach = [steps_to_reach(curves["top1"][s], target["top1"]) for s in seeds]
        ok = [x for x in reach if x is not None]
        to_full = {"per_seed": reach, "seeds": seeds,
                   "mean": statistics.fmean(ok) if len(ok) == len(reach) else None,
                   "sd": statistics.stdev(ok) if len(ok) == len(reach) and len(ok) > 1 else None,
                   "reason": None if len(ok) == len(reach) else
                   f"{len(reach) - len(ok)} of {len(reach)} seeds never reached {target['top1']:.2f} % within their "
                   f"runs (their longest: {longest(curves['top1'], seeds, reach)} of the compute)"}
        lengths = sorted({r["run"]["steps"] for r in rs})
        ends = {str(n): {k: mean_sd([r["curve"][-1][k] for r in rs if r["run"]["steps"] == n]) for k in PROBES}
                for n in lengths}
        cost = {str(n): mean_sd([points(r, full_cpu, timing, a.recipe.train_size)[-1][0] for r in rs
                                 if r["run"]["steps"] == n]) for n in lengths}
        first = rs[0]["run"]
        arms[key] = {"prior": first["prior"], "schedule": first["schedule"], "loss": first["loss"], "seeds": seeds,
                     "curves": {k: {str(s): c for s, c in v.items()} for k, v in curves.items()},
                     "at": at, "compute_to_full_plain": to_full, "end_by_length": ends, "compute_by_length": cost,
                     "seeds_by_length": {str(n): sorted(r["run"]["seed"] for r in rs if r["run"]["steps"] == n)
                                         for n in lengths},
                     "handover_step": {str(n): [r.get("handover_step") for r in rs if r["run"]["steps"] == n]
                                       for n in lengths},
                     "rela_step_fraction": {str(n): statistics.fmean(r.get("rela_steps", 0) / n for r in rs
                                                                     if r["run"]["steps"] == n) for n in lengths}}
    best = {}
    for b in a.at:
        have = {k: v["at"][str(b)] for k, v in arms.items() if str(b) in v["at"]}
        if have:
            k = max(have, key=lambda k: have[k]["mean"])
            best[str(b)] = {"arm": k, **{q: have[k][q] for q in ("mean", "sd")}}
    return {"axis": "modelled" if timing is not None else "measured", "full_cpu_seconds": full_cpu,
            "full_plain": {"steps": full_steps, "cpu_seconds": mean_sd([r["train_cpu_seconds"] for r in full]),
                           **{k: mean_sd([r["curve"][-1][k] for r in full]) for k in PROBES}},
            "target_top1": target["top1"], "arms": arms, "best_at": best}


def default_arm(prior: str = "other", loss: str = "callable") -> str:
    return arm_key(prior, "default", loss)


def goals(an: dict) -> dict:
    """The study's goals, read off its analysis: the default recipe with the prior trained on other data reaches the
    full plain run's accuracy within :data:`REACH_BAR` of its compute; at every budget it ends within one sd of the
    best arm there (and where it is not judged); what the hand-over bought (the default's longest runs against
    ``constant:1``'s, the same runs up to it); what an untrained prior buys at equal compute."""
    arms, out = an["arms"], {}
    d = arms.get(default_arm())
    if d:
        c = d["compute_to_full_plain"]
        out["reach"] = {"met": c["mean"] is not None and c["mean"] <= REACH_BAR, **c}
        rows = []
        for b, best in an["best_at"].items():
            if b in d["at"]:
                mine, gap = d["at"][b], d["at"][b]["mean"] - best["mean"]
                rows.append({"budget": float(b), "default": mine["mean"], "best_arm": best["arm"], "best": best["mean"],
                             "best_sd": best["sd"], "gap": gap, "within_sd": -gap <= (best["sd"] or 0.0)})
        out["front"] = {"met": bool(rows) and all(r["within_sd"] for r in rows), "budgets": rows,
                        "not_judged": [float(b) for b in an["best_at"] if b not in d["at"]]}
    const = arms.get(arm_key("other", "constant:1", "callable"))
    if d and const:  # the same runs up to the hand-over: what the plain steps after it bought, at their ends
        same = [n for n in d["end_by_length"] if d["seeds_by_length"][n] == const["seeds_by_length"].get(n)]
        if same:
            n = max(same, key=int)
            out["handover"] = {"steps": int(n), "seeds": d["seeds_by_length"][n],
                               "default": d["end_by_length"][n]["top1"], "default_compute": d["compute_by_length"][n],
                               "constant": const["end_by_length"][n]["top1"],
                               "constant_compute": const["compute_by_length"][n]}
    rnd, plain = arms.get(default_arm("random")), arms.get("plain")
    if rnd and plain:
        out["untrained"] = [{"budget": float(b), "random": rnd["at"][b]["mean"], "plain": plain["at"][b]["mean"],
                             "gain": rnd["at"][b]["mean"] - plain["at"][b]["mean"]}
                            for b in rnd["at"] if b in plain["at"]]
    return out


# ---------------------------------------------------------------------------------------------- tables, figure
def arm_label(key: str, arm: dict) -> str:
    if key == "plain":
        return "plain SSL"
    sched = arm["schedule"] + (" (default)" if key.split(":")[1] == "default" else
                               " (the default for a loss computed before wrap)"
                               if arm["schedule"] == EAGER_DEFAULT_SCHEDULE else "")
    return f"{PRIOR_LABEL[arm['prior']]}, `{sched}`{LOSS_LABEL[arm['loss']]}"


def cell(v: dict | None, bold: bool = False) -> str:
    if not v:
        return "–"
    text = f"{v['mean']:.2f}" + (f" ± {v['sd']:.2f}" if v["sd"] is not None else "")
    return f"**{text}**" if bold else text


def seeds_note(arm: dict) -> str:
    return "" if len(arm["seeds"]) >= 5 else f" ({seeds_text(len(arm['seeds']))})"


def tables(result: dict) -> dict[str, str]:
    """The study's tables by name: ``front`` (each arm at each budget of compute, the best in bold), ``reach``
    (compute to the full plain run's accuracy), ``summary`` (the goals in words), ``ends`` (each run length's end
    accuracy and compute), ``cost`` (each kind of step and the precompute, side by side), ``priors`` (each prior's own
    probe, on its embedding and on the rows the student is trained toward)."""
    an = result["analysis"]
    arms, full = an["arms"], an["full_plain"]
    order = sorted(arms, key=lambda k: (k != "plain", arms[k]["prior"] != "other", "default" not in k, k))
    out = {}
    lines = ["| compute (of the full plain run) | " + " | ".join(arm_label(k, arms[k]) + seeds_note(arms[k])
                                                              for k in order) + " |", "|---" * (1 + len(order)) + "|"]
    for b in result["settings"]["at"]:
        best = an["best_at"].get(str(b), {}).get("arm")
        lines.append(f"| {b:g} | " + " | ".join(cell(arms[k]["at"].get(str(b)), k == best) for k in order) + " |")
    out["front"] = "\n".join(lines) + (f"\n\nLinear probe top-1 %, mean ± sd over seeds; the full plain run "
                                       f"({full['steps']} steps) ends at {cell(full['top1'])} %. '–': not every seed's "
                                       "runs reach that compute.")
    lines = ["| arm | compute to reach the full plain run | per seed |", "|---|---|---|"]
    for k in order:
        c = arms[k]["compute_to_full_plain"]
        per = ", ".join("never" if x is None else f"{x:.2f}" for x in c["per_seed"])
        lines.append(f"| {arm_label(k, arms[k])} | {cell(c) if c['mean'] is not None else 'not reached: ' + c['reason']} "
                     f"| {per} |")
    out["reach"] = "\n".join(lines) + (f"\n\nThe compute (a fraction of the full plain run's) at which each seed's curve "
                                       f"first reaches {an['target_top1']:.2f} %, the full plain run's mean accuracy; "
                                       "precompute included.")
    out["summary"] = summary(result)
    lines = ["| arm | steps | compute | hand-over step (per seed) | top-1 % | kNN % | 100 labels/class % |",
             "|---|---:|---:|---|---|---|---|"]
    for k in order:
        arm = arms[k]
        for n, e in sorted(arm["end_by_length"].items(), key=lambda kv: int(kv[0])):
            hand = ", ".join("never" if h is None else str(h) for h in arm["handover_step"][n]) if k != "plain" else ""
            lines.append(f"| {arm_label(k, arm)} | {n} | {arm['compute_by_length'][n]['mean']:.3f} | {hand} | " +
                         " | ".join(cell(e[q]) for q in PROBES) + " |")
    out["ends"] = "\n".join(lines)
    t = result["timing"]
    full_steps = an["full_plain"]["steps"]
    lines = ["| what | CPU s | of a plain step |", "|---|---:|---:|"]
    names = {"plain": "a plain SSL step (also every step after the hand-over)", "mixed": "a step with both losses "
             "(lambda between 0 and 1)", "callable": "a lambda-1 step, the loss passed as a callable (one view)",
             "eager": "a lambda-1 step, the loss computed before `wrap`"}
    for k, name in names.items():
        lines.append(f"| {name} | {t['kinds'][k]['step_cpu_seconds']:.3f} | {t['relative_cpu'][k]:.2f} |")
    plain = t["kinds"]["plain"]["step_cpu_seconds"]
    size = result["settings"]["recipe"]["train_size"]
    for p, v in t["precompute"].items():
        whole = v["cpu_seconds_per_image"] * size
        lines.append(f"| the precompute of {PRIOR_LABEL[p]}'s targets, {size:,} images | {whole:.1f} | "
                     f"{whole / plain:.1f} (that is {whole / (plain * full_steps):.3f} of the full plain run) |")
    out["cost"] = "\n".join(lines) + (f"\n\nMedians of {t['steps_each']} steps of each kind, interleaved one by one "
                                      "in one process (one torch thread); the precompute in chunks between them.")
    priors = result.get("priors") or {}
    if priors:
        lines = ["| prior | its embedding: linear % | kNN % | the rows the student is pulled toward (dims) : linear % | "
                 "kNN % |", "|---|---:|---:|---|---:|"]
        for p, v in priors.items():
            f, r = v["probe"]["full"], v["probe"]["reduced"]
            lines.append(f"| {PRIOR_LABEL[p]} | {f['linear_top1']:.2f} | {f['knn_top1']:.2f} | {r['dim']} components "
                         f"| {r['linear_top1']:.2f} | {r['knn_top1']:.2f} |")
        out["priors"] = "\n".join(lines) + ("\n\nEach prior probed as the students are (its embeddings of the clean "
                                            "images, seed 0); the rows the student is pulled toward are the PCA-reduced, "
                                            "z-scored rows ReLA trains on (ReLA v2 Eq. 41).")
    return out


def summary(result: dict) -> str:
    an = result["analysis"]
    g, lines = goals(an), []
    if not result.get("complete", True):
        tiers = result.get("runs_by_tier") or {}
        seeds = len(an["arms"].get(default_arm(), {}).get("seeds", []))
        lines.append(f"**Incomplete**: {result['runs_done']} of the {result['runs_planned']} planned runs are measured ("
                     + "; ".join(f"tier {t}: {d} of {n}" for t, (d, n) in sorted(tiers.items(), key=lambda kv: int(kv[0])))
                     + f"; the default arm on {seeds} seed{'s' if seeds != 1 else ''}); the figures below are those "
                     "runs', and a column names its seeds when fewer than 5.")
    if "reach" in g:
        r = g["reach"]
        if r["mean"] is not None:
            lines.append(f"The default recipe with the prior trained on other data reaches the full plain run's "
                         f"{an['target_top1']:.2f} % at {r['mean']:.2f} ± {r['sd'] or 0:.2f} of its compute (precompute "
                         f"included): {'within' if r['met'] else '**not** within'} the bar of {REACH_BAR:g} this "
                         "study sets"
                         f"{'' if result.get('complete', True) else ' (on the seeds measured so far)'}.")
        else:
            lines.append(f"The default recipe with the prior trained on other data does not reach the full plain run's "
                         f"accuracy: {r['reason']}.")
    if "front" in g:
        rows = g["front"]["budgets"]
        miss = [x for x in rows if not x["within_sd"]]
        budgets = ", ".join(f"{x['budget']:g}" for x in rows)
        where = f"({budgets} of the full plain run's compute)"
        if not miss:
            lines.append(f"At every budget where each of its seeds is measured {where} it ends within one standard "
                         "deviation of the best arm there.")
        else:
            lines.append(f"Of the budgets where each of its seeds is measured {where}, it ends within one standard "
                         f"deviation of the best arm at {len(rows) - len(miss)}; more than one below it at " + ", ".join(
                             f"{x['budget']:g} ({x['gap']:+.2f} points against "
                             f"{arm_label(x['best_arm'], an['arms'][x['best_arm']])}"
                             f"{seeds_note(an['arms'][x['best_arm']])}, whose sd there is {x['best_sd'] or 0:.2f})"
                             for x in miss) + ".")
        if g["front"]["not_judged"]:
            lines.append("Not judged at " + ", ".join(f"{b:g}" for b in g["front"]["not_judged"]) + ", where another "
                         "arm is measured but not every seed of the default's runs reaches that compute.")
    if g.get("handover"):
        h = g["handover"]
        lines.append(f"What the hand-over bought: the default's {h['steps']}-step runs are `constant:1`'s up to it (the "
                     f"same steps, {seeds_text(len(h['seeds']))}); at their ends the default is at {cell(h['default'])} % "
                     f"for {h['default_compute']['mean']:.2f} of the compute, `constant:1` at {cell(h['constant'])} % "
                     f"for {h['constant_compute']['mean']:.2f}.")
    if g.get("untrained"):
        n = len(an["arms"][default_arm("random")]["seeds"])
        lines.append(f"With an untrained prior ({seeds_text(n)}), the default recipe at equal compute against plain SSL: "
                     + ", ".join(
            f"{x['gain']:+.2f} points at {x['budget']:g}" for x in g["untrained"]) + ".")
    measured = (result.get("measured") or {}).get("arms", {}).get(default_arm(), {}).get("compute_to_full_plain")
    if measured and measured["mean"] is not None:
        lines.append(f"On each run's own CPU seconds instead of the modelled compute (the machine's load moves them): "
                     f"{measured['mean']:.2f} ± {measured['sd'] or 0:.2f}.")
    return " ".join(lines)


def figure(result: dict, path: Path) -> None:
    """Accuracy against compute: each arm's mean over its seeds (where every seed's runs reach that compute), a band of
    one sd around it; the prior trained on other data under each schedule (left), the default recipe with each prior
    (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    an = result["analysis"]
    arms = an["arms"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    groups = [("schedules, prior trained on other data (digits BYOL)",
               [k for k in arms if k == "plain" or arms[k]["prior"] == "other"]),
              ("the default recipe with each prior", [k for k in arms if k == "plain" or
                                                     (k.split(":")[1:] == ["default", "callable"])])]
    for ax, (title, keys) in zip(axes, groups):
        for i, k in enumerate(keys):
            env = arms[k]["curves"]["top1"]
            xs = sorted({x for c in env.values() for x, _ in c})
            pts = [(x, vs) for x in xs if len(vs := [v for c in env.values() if (v := curve_at(c, x)) is not None]) == len(env)]
            if not pts:
                continue
            color = "black" if k == "plain" else f"C{i}"
            label = arm_label(k, arms[k]).replace("`", "")
            if ax is axes[0] and k != "plain":
                label = label.split(", ", 1)[1]
            ax.plot([x for x, _ in pts], [statistics.fmean(v) for _, v in pts], color=color,
                    lw=2.2 if "default" in k else 1.2, ls="--" if k == "plain" else "-",
                    label=f"{label} ({seeds_text(len(env))})")
            if len(env) > 1:
                ax.fill_between([x for x, _ in pts], [statistics.fmean(v) - statistics.stdev(v) for _, v in pts],
                                [statistics.fmean(v) + statistics.stdev(v) for _, v in pts], color=color, alpha=0.12, lw=0)
        ax.axhline(an["target_top1"], color="gray", ls=":", lw=1, label="the full plain run's accuracy")
        ax.axvline(1.0, color="gray", ls=":", lw=0.8)
        ax.set_xlabel("compute, of the full plain run (precompute included)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.25)
    axes[0].set_ylabel("linear probe top-1 %")
    fig.suptitle(f"{result['settings']['recipe']['student']} student, {result['settings']['recipe']['ssl']}: "
                 "accuracy against compute (mean over seeds, band: one sd)", fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> None:
    a = parse_args(argv)
    todo = plan(a)
    data = harness.data(a.recipe)
    timing_file = a.runs / "timing.json"
    if a.timing:
        priors = sorted({run.prior for *_, run in todo if run.prior}, key=list(harness.PRIORS).index)
        for p in priors:
            harness.prepare_prior(a.recipe, data, a.cache, p)
        record = {**harness.timing(a.recipe, data, a.cache, priors, a.timing_steps),
                  "recipe": harness.recipe_settings(a.recipe), "commit": harness.code_commit(ROOT)["commit"]}
        a.runs.mkdir(parents=True, exist_ok=True)
        harness.atomic_write_json(timing_file, record, indent=1)
        print(json.dumps({k: record[k] for k in ("kinds", "precompute", "relative_cpu")}, indent=1))
        return
    if not a.gather:
        for i, (*_, run) in enumerate(todo):
            if i % a.worker[1] == a.worker[0]:
                harness.run_unit(a.recipe, data, run, a.runs, a.cache)
        if a.worker[1] > 1:
            print("budget.py: this worker's runs are done; `--gather` writes the results.")
            return
    files = {run: a.runs / f"{run.name()}.json" for *_, run in todo}
    runs: dict[str, list[dict]] = {}
    for _, key, run in todo:
        if files[run].is_file():
            runs.setdefault(key, []).append(json.loads(files[run].read_text()))
    done = sum(len(v) for v in runs.values())
    by_tier: dict[str, list[int]] = {}
    for tier, _, run in todo:
        by_tier.setdefault(str(tier), [0, 0])[1] += 1
        by_tier[str(tier)][0] += files[run].is_file()
    if not any(r["run"]["steps"] == a.recipe.full for r in runs.get("plain", [])):
        print("budget.py: no full plain run finished yet: nothing to compare with, no results file written.")
        return
    if not timing_file.is_file():
        print(f"budget.py: no {timing_file} yet (the cost of each kind of step, side by side): run with --timing first.")
        return
    timing = json.loads(timing_file.read_text())
    priors = {p: {**json.loads(harness.store_dir(a.recipe, a.cache, p).with_suffix(".json").read_text()),
                  "probe": harness.prior_probe(a.recipe, data, a.cache, p)}
              for p in harness.PRIORS if harness.store_dir(a.recipe, a.cache, p).with_suffix(".json").is_file()}
    result = {"command": "python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "complete": done == len(todo), "runs_done": done, "runs_planned": len(todo), "runs_by_tier": by_tier,
              "settings": {"recipe": harness.recipe_settings(a.recipe), "at": a.at, "default_schedule": DEFAULT_SCHEDULE,
                           "plan": [[t, arm_key(p, s, l), list(n), list(seeds)] for t, p, s, l, n, seeds in PLANS[a.student]],
                           "default_spec": resolve("default")},
              "timing": timing, "analysis": analyse(a, runs, timing), "measured": analyse(a, runs, None),
              "priors": priors,
              "runs": {files[run].stem: r for *_, run in todo if files[run].is_file() for r in [json.loads(files[run].read_text())]}}
    result["analysis"]["goals"] = goals(result["analysis"])
    write_results(a.out, result, device=a.device if a.device != "cpu" else None,
                  per_seed=["runs.*.curve", "analysis.arms.*.compute_to_full_plain.per_seed"])
    figure(result, Path(a.out).with_suffix(".png"))
    print("\n\n".join(tables(result).values()))


if __name__ == "__main__":
    main()
