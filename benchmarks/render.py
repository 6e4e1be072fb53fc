"""Every benchmark table in the docs, rendered from the result files (``benchmarks/results/*.json``).

A page asks for a block by name between two markers, and this script writes the block there::

    <!-- generated: demo.seeds -->
    ... (rewritten by this script; never edited by hand)
    <!-- /generated -->

One small function per result file renders that file's blocks (``RENDERERS``, ``@renders("demo.json")``); it
may read a training record under ``benchmarks/prior_runs/`` as well. A file without its provenance (code commit,
machine, per-seed paths: ``accelerate_ssl.results.provenance_problems``) is refused, and every block closes with the
file, commit and machine it came from.

A result file's figure, the PNG its benchmark drew from the same JSON (``budget_vit.json`` -> ``budget_vit.png``), is
the block ``<stem>.figure``: place it beside the file's tables as any other block, and this script writes the image
with its source line there (the link runs from the page to ``benchmarks/results/``; ``docs/hooks.py`` serves the PNG
with the site)::

    <!-- generated: budget_vit.figure -->
    <!-- /generated -->

    python benchmarks/render.py           # rewrite every generated block of README.md and docs/
    python benchmarks/render.py --check   # exit 1 naming each block that differs from what the files give now

``tests/test_docs_results.py`` runs the check, and ``make docs`` runs it before building the site.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Callable, NamedTuple, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate_ssl.atomic import atomic_write_text  # noqa: E402
from accelerate_ssl import demo as demo_module  # noqa: E402  (the priors' training records)
from accelerate_ssl.results import provenance_problems  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: a block's opening and closing markers, whatever their spacing (written back as ``<!-- generated: NAME -->`` and
#: ``<!-- /generated -->``); anything else that starts like a marker is a marker that matches no block
OPEN = re.compile(r"<!--\s*generated\s*:\s*(?P<name>[\w.-]+)\s*-->", re.I)
CLOSE = re.compile(r"<!--\s*/\s*generated\s*-->", re.I)
LIKE_A_MARKER = re.compile(r"<!--\s*/?\s*generated\b", re.I)
#: what a page shows verbatim (fenced code, inline code): a marker written there is text about markers, not a block
CODE = re.compile(r"^[ \t]*(`{3,}|~{3,}).*?^[ \t]*\1|(`+)(?:(?!\2)[^\n]|\n(?!\n))+?\2", re.S | re.M)

#: the name ending of a figure block (``<stem>.figure``); every result file with a PNG has one, placed where wanted
FIGURE = ".figure"
#: in a rendered figure block, the folder of the PNGs as seen from the page (written per page by :func:`render_page`)
FIGURE_DIR = "{results}"

#: result file name -> the function rendering its blocks ``{block name: markdown}``
RENDERERS: dict[str, Callable[["Result"], dict[str, str]]] = {}

#: what each prior of the Fashion-MNIST benchmarks is to them: a prior trained on these very images, or with their
#: labels, is an upper bound for what a user's public prior gives
PRIOR_KIND = {
    "random:convnet": "untrained",
    "shipped:digits-byol": "other data, no labels",
    "shipped:fashion-mnist-byol": "upper bound: these images, no labels",
    "shipped:fashion-mnist-byol-20k": "upper bound: these images, no labels",
    "shipped:fashion-mnist-supervised": "upper bound: these images' labels",
    "checkpoint:benchmarks/prior_runs/supervised_small/prior.safetensors": "upper bound: these images' labels",
    "checkpoint:benchmarks/teachers/canvas48-supervised.safetensors": "upper bound: labels of other scenes of the same kind",
}

#: the training record of each prior trained here (``benchmarks/prior_runs``, ``benchmarks/results``)
PRIOR_RECORDS = {spec: path for spec, (path, _) in demo_module.PRIOR_RECORDS.items()}


def shown(path: Path) -> str:
    """A file as the docs name it: relative to the repository (``benchmarks/results/<name>`` for a copy elsewhere)."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else f"benchmarks/results/{path.name}"


class Result(dict):
    """A result file's JSON, refused when its provenance is incomplete, with the file's name and its source line."""

    def __init__(self, path: Path):
        super().__init__(json.loads(path.read_text()))
        problems = provenance_problems(dict(self))
        if problems:
            raise ValueError(f"{shown(path)}: {'; '.join(problems)} (fix the file's provenance block; "
                             "new results get it from accelerate_ssl.results.write_results)")
        self.path = path

    def source(self, note: str = "", command: Optional[str] = None) -> str:
        """The line closing every block: the file, its commit and machine, the command that measures it again
        (``command``: for a file that recorded another process's command line)."""
        block, machine = self["provenance"], self["provenance"]["machine"]
        commit = block["commit"][:10] if len(block["commit"]) == 40 else block["commit"]
        device = machine["device"] if machine["device"] in ("cpu",) or "NVIDIA" in str(machine["device"]) else "see file"
        torch = machine["torch"] if isinstance(machine["torch"], str) else "?"
        capability = machine.get("cpu_capability")
        where = device + (f" ({'' if device == 'cpu' else 'CPU '}{capability})" if isinstance(capability, str)
                          and not capability.startswith("not") else "")
        command = runnable(command or self.get("command") or (self.get("settings") or {}).get("command"))
        text = f"*Source: `{shown(self.path)}` · commit `{commit}` · {where}, torch {torch}"
        text += f" · `{command}`*" if command else "*"
        return text + (f" {note}" if note else "")


def record(rel: str) -> Result:
    """A result or training record by its path under ``benchmarks/`` (provenance checked like any result)."""
    return Result(ROOT / "benchmarks" / rel)


def benchmark(name: str):
    """A benchmark script of this folder as a module (for the names it gives its settings)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def runnable(command: Optional[str]) -> Optional[str]:
    """A recorded command line as a reader runs it from the repository: ``python benchmarks/x.py ...`` whichever
    interpreter path or none the run was started with."""
    if not command:
        return command
    command = re.sub(r"^\S*python3?\s+", "", command.strip())
    return f"python {command}" if command.startswith("benchmarks/") else command


def renders(name: str):
    def register(fn):
        assert name not in RENDERERS, f"two renderers for {name}"
        RENDERERS[name] = fn
        return fn
    return register


# ---------------------------------------------------------------------------------------------- formatting
def f2(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.2f}"


def pm(mean: float, sd: Optional[float]) -> str:
    return f"{mean:.2f} ± {sd:.2f}" if sd is not None else f"{mean:.2f}"


def xs(x: Optional[float], lower: bool = False) -> str:
    return "–" if x is None else ("> " if lower else "") + f"{x:.2f}x"


def sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def interval(values: list[float]) -> str:
    """The 95 % prediction interval for one more run (Student's t on the logs; the demo's own function)."""
    from accelerate_ssl.demo import prediction_interval

    values = [v for v in values if v is not None]
    if len(values) < 2:
        return "–"
    lo, hi = prediction_interval(values)
    return f"{lo:.2f}-{hi:.2f}x"


def table(header: list[str], rows: list[list[str]], align: Optional[str] = None) -> str:
    align = align or "-" * len(header)
    marks = {"-": "---", "r": "---:", "l": ":---"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def gib(b: float) -> str:
    return f"{b / 2 ** 30:.2f}"


def human_bytes(b: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def prior_kind(spec: str) -> str:
    return PRIOR_KIND.get(spec, "")


# ---------------------------------------------------------------------------------------------- the demo
@renders("demo.json")
def demo(r: Result) -> dict[str, str]:
    """``accelerate-ssl demo --seeds ...``: each seed's comparison at equal CPU time, and the mean curves'."""
    s, seeds = r["settings"], r["per_seed"]

    def frac(x: Optional[float]) -> str:
        return "not reached" if x is None else f"{x:.2f}"

    def gain(c: dict) -> str:
        return "–" if c["gain"] is None else f"{c['gain']:+.2f}"

    rows = [[str(p["seed"]), f2(p["cpu"]["rela_top1"]), f2(p["cpu"]["plain_top1_at_equal_compute"]), gain(p["cpu"]),
             f2(p["cpu"]["plain_top1"]), frac(p["cpu"]["compute_to_plain"]), f"{p['cpu']['compute_fraction']:.2f}"]
            for p in seeds]
    c = r["cpu"]
    rows.append(["**mean curves**", f2(c["rela_top1"]), f2(c["plain_top1_at_equal_compute"]), f"**{gain(c)}**",
                 f2(c["plain_top1"]), f"**{frac(c['compute_to_plain'])}**", f"{c['compute_fraction']:.2f}"])
    fractions = [p["cpu"]["compute_to_plain"] for p in seeds]
    if None not in fractions and len(fractions) > 1:
        rows.append(["95 % interval for one more run", "", "", "", "", interval(fractions).replace("x", ""), ""])
    recipe = "the library's default schedule" if r["default"] else "the schedule"
    summary = (f"With the prior `{s['prior']}` ({prior_kind(s['prior'])}) and {recipe} `{r['schedule']}`, BYOL + ReLA "
               f"ends at **{f2(c['rela_top1'])} %** after {s['budget']} steps, at {c['compute_fraction']:.2f} of plain "
               f"BYOL's CPU time (the precompute of the targets included); plain BYOL was at "
               f"{f2(c['plain_top1_at_equal_compute'])} % at the same CPU time (**{gain(c)} points**) and ends at "
               f"{f2(c['plain_top1'])} % after its {s['budget']} steps, which ReLA reached at "
               f"**{frac(c['compute_to_plain'])}** of plain BYOL's CPU time (mean curves of {len(seeds)} seeds).\n\n"
               + r.source())
    return {
        "demo.seeds": table(["seed", "ReLA top-1 % at its end", "plain BYOL at the same CPU time %", "gain, points",
                             "plain BYOL at its end %", "compute to plain's end accuracy", "ReLA's compute / plain's"],
                            rows, "lrrrrrr")
        + "\n\nCompute is CPU seconds of training (ReLA's with its precompute), as a fraction of plain BYOL's for the "
          "same steps; the interval is where one more seed lands 95 % of the time (Student's t on the logs).\n\n"
        + r.source(),
        "demo.summary": summary,
    }


# ---------------------------------------------------------------------------------------------- head to head
METHOD = {"plain": "plain SSL", "cached": "ReLA, cached targets", "online": "online teacher, same loss and head",
          "lightly-train": "lightly-train `distillation`, its defaults (untuned here)"}
CLOCK = {"side_by_side": "side-by-side wall-clock", "cpu": "CPU time", "wall": "each run's own wall-clock"}


def h2h_blocks(r: Result, key: str, clocks=("side_by_side", "cpu")) -> dict[str, str]:
    a, s = r["analysis"], r["settings"]
    blocks = {}
    gap = a["gap"]
    blocks[f"{key}.room"] = table(
        ["probe", "untrained %", "plain SSL at its end %", "room, points"],
        [[name, f2(g["untrained"]), pm(g["plain_final"], g["plain_final_sd"]), f"+{g['plain_final'] - g['untrained']:.2f}"]
         for name, g in (("linear, all labels", gap["top1"]), ("kNN (k = 20)", gap["knn_top1"]),
                         ("linear, 100 labels per class", gap["few_label_top1"]))], "lrrr") + "\n\n" + r.source()
    for clock in clocks:
        methods = [m for m in a["methods"] if m in a["equal_clock"][clock][0]["top1"]]
        rows = []
        for point in a["equal_clock"][clock]:
            t = point["top1"]
            diff = point.get("cached_minus_online")
            rows.append([str(point["cached_step"]), f"{point['seconds']:.0f}"]
                        + [pm(t[m]["mean"], t[m]["sd"]) if m in t and t[m] else "–" for m in methods]
                        + [f"{diff['mean']:+.2f} ± {diff['sd_of_difference']:.2f}" if diff else ""])
        blocks[f"{key}.{clock}"] = table(["ReLA steps", "s"] + [METHOD[m] for m in methods]
                                         + ["cached - online, points (per-seed differences: mean ± sd)"], rows, "rr" + "r" * len(methods) + "r") + (
            f"\n\nTop-1 % (mean ± sd over {len(s['seeds'])} seeds) read at the seconds of each probe of the cached run "
            f"({CLOCK[clock]}, its precompute included).\n\n" + r.source())
    reach = a["reach_plain_final"]
    rows = []
    for clock in clocks:
        for m, v in reach[clock].items():
            if m == "plain":
                continue
            iv = v["speedup_interval"]
            reached = f"{iv['reached']} of {iv['of']}"
            rows.append([METHOD[m], CLOCK[clock], reached,
                         xs(iv["geomean"]) if iv["reached"] == iv["of"] else
                         ("not reached" if not iv["reached"] else "not reached by every seed"),
                         f"{iv['low']:.2f}-{iv['high']:.2f}x" if iv["reached"] == iv["of"] else "–"])
    blocks[f"{key}.reach"] = table(["method", "clock", "seeds reaching plain's final accuracy", "speed-up (geometric mean)",
                                    "95 % interval for one more run"], rows, "lllrr") + "\n\n" + r.source()
    k = r["timing"]["kinds"]
    blocks[f"{key}.steps"] = table(
        ["step (interleaved, medians)", "ms", "/ plain step", "/ online step"],
        [[m, f"{v['median_step_seconds'] * 1e3:.0f}", f"{v['median_step_seconds'] / k['plain']['median_step_seconds']:.2f}",
          f"{v['median_step_seconds'] / k['online']['median_step_seconds']:.2f}"] for m, v in k.items()], "lrrr") + (
        f"\n\nPrecompute: {r['timing']['precompute_seconds_per_image'] * 1e3:.2f} ms per image side by side.\n\n"
        + r.source())
    return blocks


def teacher_line(spec: str) -> str:
    rec = record(PRIOR_RECORDS[spec]) if spec in PRIOR_RECORDS else None
    if rec is None:
        return f"`{spec}` ({prior_kind(spec)})"
    return f"`{spec}` ({prior_kind(spec)}; trained {rec['steps']:,} steps, {minutes(rec['train_seconds'])} on one CPU thread)"


@renders("head_to_head_vit.json")
def head_to_head_vit(r: Result) -> dict[str, str]:
    blocks = h2h_blocks(r, "h2h_vit")
    a, s = r["analysis"], r["settings"]
    end = a["equal_clock"]["side_by_side"][-1]
    t = end["top1"]
    own_end = {m: statistics.fmean(a["curves"][m][str(seed)]["top1"][-1] for seed in s["seeds"]) for m in a["methods"]}
    lt_cpu = a["equal_clock"]["cpu"][-1]
    lt = next(u["lightly_train"] for u in r["units"].values() if u.get("lightly_train"))
    rec = record(PRIOR_RECORDS[s["prior"]])
    plain_clock = a["reach_plain_final"]["side_by_side"]["plain"]["seconds"][0]
    rows = [
        ["ReLA, cached targets", f"**{pm(t['cached']['mean'], t['cached']['sd'])}**", ""],
        ["online teacher, same loss and head (our loop)", pm(t["online"]["mean"], t["online"]["sd"]),
         f"its own end: {f2(own_end['online'])}"],
        ["plain VICReg, no teacher", pm(t["plain"]["mean"], t["plain"]["sd"]), f"its own end: {f2(own_end['plain'])}"],
        [f"lightly-train {lt['lightly_train']} `distillation`, its defaults, untuned here (at equal CPU time)",
         pm(lt_cpu["top1"]["lightly-train"]["mean"], lt_cpu["top1"]["lightly-train"]["sd"]),
         f"its own end: {f2(own_end['lightly-train'])}"],
    ]
    blocks["h2h_vit.headline"] = table(
        [f"at {end['seconds']:.0f} s side by side (the cached run's end, precompute included)",
         "linear probe top-1 %", ""], rows, "lrl") + (
        f"\n\nA 4-block ViT student (width 64) on Fashion-MNIST, VICReg, {s['steps']} steps, {len(s['seeds'])} seeds. "
        f"The teacher is {teacher_line(s['prior'])}: in-domain and trained "
        f"{rec['train_seconds'] / plain_clock:.0f}x as long as the plain run's {plain_clock:.0f} s, so these rows are "
        "an upper bound for what a public prior gives. The lightly-train row ran lightly-train's own loss, views, optimiser "
        f"and schedule at their defaults, which were not tuned for this student: `distillation` is its v3 (the default "
        f"since lightly-train 0.15.0), where lightly-train's documentation recommends `distillationv1` for purely global "
        f"tasks such as classification.\n\n" + r.source())
    return blocks


@renders("head_to_head.json")
def head_to_head(r: Result) -> dict[str, str]:
    blocks = h2h_blocks(r, "h2h_canvas")
    blocks["h2h_canvas.teacher"] = f"Teacher: {teacher_line(r['settings']['prior'])}.\n\n" + r.source()
    return blocks


@renders("head_to_head_gpu.json")
def head_to_head_gpu(r: Result) -> dict[str, str]:
    blocks = h2h_blocks(r, "h2h_gpu")
    blocks["h2h_gpu.teacher"] = (f"Teacher: `{r['settings']['prior']}`, the ConvNet 32/64/128 the sweep below trained "
                                 "with labels on 50,000 other scenes (an upper bound). On this GPU:\n\n" + r.source())
    return blocks


@renders("room.json")
def room(r: Result) -> dict[str, str]:
    rows = []
    for name, u in r["units"].items():
        if "curve" in u:
            first, last = u["curve"][0], u["curve"][-1]
            rows.append([name, f"{first['linear_top1']:.1f} / {first['knn_top1']:.1f} / {first['few_label_top1']:.1f}",
                         f"{last['linear_top1']:.1f} / {last['knn_top1']:.1f} / {last['few_label_top1']:.1f} (step {last['step']})",
                         f"{last['linear_top1'] - first['linear_top1']:+.1f} / {last['knn_top1'] - first['knn_top1']:+.1f} / "
                         f"{last['few_label_top1'] - first['few_label_top1']:+.1f}"])
        else:
            p = u["probe"]
            rows.append([f"{name} (frozen)", "", f"{p['linear_top1']:.1f} / {p['knn_top1']:.1f} / {p['few_label_top1']:.1f}", ""])
    return {"room.table": table(["unit", "untrained: linear / kNN / 100 per class %", "end", "gain, points"], rows,
                                "lrrr") + "\n\nOne seed each.\n\n" + r.source()}


# ---------------------------------------------------------------------------------------------- cost of a step
@renders("overhead.json")
def overhead(r: Result) -> dict[str, str]:
    med = r["step_seconds_median"]
    return {"overhead.summary": table(
        ["step", "median s", "memory MB"],
        [["plain BYOL", f"{med['plain']:.3f}", f"{r['memory_bytes']['plain'] / 1e6:.0f}"],
         ["the same with `rela.wrap` (both losses computed)", f"{med['rela']:.3f}", f"{r['memory_bytes']['rela'] / 1e6:.0f}"],
         ["ratio", f"**{r['time_ratio']:.3f}**", f"**{r['memory_ratio']:.3f}**"]], "lrr")
        + f"\n\n{r['settings']['repeats']} repeats, batch {r['settings']['batch_size']}, memory: {r['memory_measure']}.\n\n"
        + r.source()}


@renders("cost_model.json")
def cost_model(r: Result) -> dict[str, str]:
    names = {"resnet50": "ResNet-50", "dinov2_vit_s14": "DINOv2 ViT-S/14", "dinov2_vit_b14": "DINOv2 ViT-B/14",
             "dinov2_vit_l14": "DINOv2 ViT-L/14", "clip_vit_b32": "CLIP ViT-B/32"}
    rows = []
    for p in r["model"]["pairs"]:
        q = p["ratios"]
        rows.append([p["student"], f"{names.get(p['prior'], p['prior'])} ({p['prior_params'] / 1e6:.0f} M)",
                     f"{q['rela_mixed_over_plain_flops']:.4f}, {q['rela_mixed_over_plain_memory']:.3f}",
                     f"{q['rela_lambda1_over_online']:.2f}, {q['rela_lambda1_one_view_over_online']:.2f}",
                     f"{r['model']['priors'][p['prior']]['precompute_flops_per_image'] / 1e9:.1f}"])
    return {"cost_model.table": table(
        ["student", "prior (parameters)", "ReLA mixed / plain: FLOPs, memory",
         "ReLA at λ = 1 / online teacher: two views, one view", "prior GFLOPs per image (once)"], rows, "llrrr")
        + f"\n\nCounted, not timed: batch {r['batch']}, {r['image_size']} px, on the meta device. A counted ratio predicted "
        f"measured CPU step times with Pearson r = {r['validation']['pearson_r_time_vs_flop_ratio']:.2f} over "
        f"{len(r['validation']['points'])} small steps.\n\n" + r.source()}


GPU_KINDS = {"plain": "plain BYOL", "rela_mixed": "ReLA mixed (0 < λ < 1), targets on the device",
             "rela_lambda1": "ReLA at λ = 1, two views", "rela_lambda1_one_view": "ReLA at λ = 1, one view",
             "plain_loader": "plain BYOL from a DataLoader (8 workers, pinned)",
             "rela_mixed_host_prefetch": "ReLA mixed, host store read through the prefetcher, same loader",
             "online_teacher:dinov2_vit_s14": "online teacher, DINOv2 ViT-S/14-sized, both views every step",
             "online_teacher:dinov2_vit_b14": "online teacher, DINOv2 ViT-B/14-sized, both views every step",
             "plain_again": "plain BYOL again (timing noise)"}


def gpu_tests(r: Result, label: str) -> list[list[str]]:
    return [[label, f"`pytest -m {run['marker']!r}`" if run["marker"] == "cuda" else "device-relevant fast-suite files",
             run["summary"].split(" in ")[0]] for run in r["tests"]["runs"]]


@renders("gpu.json")
def gpu(r: Result) -> dict[str, str]:
    st = r["steps"]
    k, ratio, mem = st["kinds"], st["time_ratio_to_plain"], st["memory_ratio_to_plain"]
    counted = r["cost_model"]["rows"]
    rows = [[GPU_KINDS.get(n, n), f"{v['step_s'] * 1e3:.1f}", f"{ratio[n]:.3f}", f"{gib(v['peak_bytes'])} ({mem[n]:.3f})",
             f"{counted[n]['counted_flops']:.3f}" if n in counted else "",
             f"{100 * counted[n]['error']:+.1f} %" if n in counted else ""] for n, v in k.items()]
    two = k["rela_lambda1"]["step_s"]
    like = ", ".join(f"{GPU_KINDS[n].split(',')[1].strip()} teacher {k[n]['step_s'] / two:.2f}x"
                     for n in ("online_teacher:dinov2_vit_s14", "online_teacher:dinov2_vit_b14"))
    comp = r["compiled"]
    steps = table(["step", "ms", "/ plain BYOL", "peak GiB (/ plain)", "counted FLOP ratio", "measured / counted - 1"],
                  rows, "lrrrrr") + (
        f"\n\nResNet-50 student, batch {st['batch_per_view']} per view, {st['image_size']} px, {st['autocast']} autocast, "
        f"channels_last; median of {k['plain']['steps_timed']} steps. Like for like (both on two views), an online "
        f"step costs: {like} of a cached ReLA step at λ = 1; a one-view online step was not measured. Compiled "
        f"({comp['backend']}): ReLA mixed / plain {comp['time_ratio']:.3f}x time, {comp['memory_ratio']:.3f}x "
        f"memory.\n\n" + r.source())
    pre = r["precompute"]
    pre_rows = [[name, f"{v['precompute_img_per_s']:.0f}", f"{v['bare_forward_img_per_s']:.0f}", f"{v['ratio']:.2f}"]
                for name, v in pre["priors"].items()]
    sync = r["no_host_sync"]
    return {
        "gpu.steps": steps,
        "gpu.precompute": table(["prior (random weights)", "precompute img/s", "bare forward img/s", "ratio"], pre_rows,
                                "lrrr") + f"\n\n{pre['images']} synthetic {pre['image_size']} px images, batch "
        f"{pre['batch']}, {pre['precision']}, {pre['num_workers']} loader workers.\n\n" + r.source(),
        "gpu.tests": table(["run", "tests", "result"], gpu_tests(r, "first run"), "lll") + "\n\n" + r.source(),
        "gpu.sync": ", ".join(f"{name.replace('_', ' ')}: {v['steps']} steps {'passed' if v['passed'] else 'FAILED'}"
                              for name, v in sync.items()) + "\n\n" + r.source(),
    }


@renders("gpu_rerun.json")
def gpu_rerun(r: Result) -> dict[str, str]:
    pre = r["precompute"]
    return {
        "gpu_rerun.tests": table(["run", "tests", "result"], gpu_tests(r, "second run"), "lll") + "\n\n" + r.source(),
        "gpu_rerun.precompute": table(
            ["prior (random weights)", "precompute img/s", "bare forward img/s", "ratio", "input pipeline alone img/s"],
            [[n, f"{v['precompute_img_per_s']:.0f}", f"{v['bare_forward_img_per_s']:.0f}", f"{v['ratio']:.2f}",
              f"{v['input_pipeline_img_per_s']:.0f}"] for n, v in pre["priors"].items()], "lrrrr") + "\n\n" + r.source(),
    }


@renders("gpu_demo.json")
def gpu_demo(r: Result) -> dict[str, str]:
    seeds = r["per_seed"]
    return {"gpu_demo.summary": (
        f"ReLA reaches {f2(r['rela_top1'])} % at {r['settings']['budget']} steps in {r['rela']['train_seconds']:.2f} s "
        f"of training + {r['targets']['precompute']['seconds']:.2f} s of precompute; plain BYOL ends at "
        f"{f2(r['plain']['curve'][-1]['top1'])} % after {r['plain']['curve'][-1]['step']} steps. Speed-up in wall-clock "
        f"{xs(r['speedup_wall']['speedup'])} on the mean curves (seeds "
        f"{', '.join(xs(p['speedup_wall']['speedup']) for p in seeds)}), {xs(r['speedup']['speedup'])} in steps; a ReLA "
        f"step is {r['step_time_ratio']:.2f}x a plain step.\n\n"
        # (the demo ran inside gpu.py's study section, and recorded gpu.py's arguments as its own command)
        + r.source("The study section runs `accelerate-ssl demo --device cuda`.",
                   command="python benchmarks/gpu.py --sections study"))}


# ---------------------------------------------------------------------------------------------- target stores
@renders("scale.json")
def scale(r: Result) -> dict[str, str]:
    pre = r["precompute"]
    rows = [[f"{p['rows']:,}", f"{p['peak_anon_bytes'] / 2 ** 20:.0f} MiB", human_bytes(p["store_bytes"]),
             f"{p['rows_per_second']:.0f}"] for p in pre]
    big = r["write_big"]
    rows.append([f"{big['rows']:,} (rows written directly, no prior)", f"{big['peak_anon_bytes'] / 2 ** 20:.0f} MiB",
                 human_bytes(big["store_bytes"]), f"{big['rows'] / big['seconds']:.0f}"])
    look = [[f"{x['rows']:,}", f"{x['lookup_seconds_median']['cold'] * 1e3:.2f} / {x['lookup_seconds_median']['warm'] * 1e3:.2f}",
             f"{x['pca_seconds']:.1f} s, {x['pca_peak_anon_bytes'] / 2 ** 20:.0f} MiB"] for x in r["lookup"]]
    res = r["resume_after_kill"]
    return {"scale.table": table(["rows", "precompute peak anonymous memory", "store on disk", "rows/s"], rows, "rrrr")
            + "\n\n" + table(["rows", "lookup + PCA of 256 random rows, cold / warm ms", "batch PCA fit"], look, "rrr")
            + f"\n\nKilled after {res['chunks_kept_after_kill']} of {res['chunks_total']} chunks, the same call recomputed "
            f"the other {res['rows_recomputed']:,} rows in {res['resume_seconds']:.0f} s; same sha256 as the "
            f"uninterrupted store: {yes(res['same_sha256_as_uninterrupted'])}. Prior `{r['prior']}` ({r['dim']}-d).\n\n"
            + r.source()}


@renders("precompute.json")
def precompute(r: Result) -> dict[str, str]:
    rows = [[r["priors"][x["prior"]], r["data"][x["data"]], f"{x['bare_forward_img_s']:.1f}",
             f"{x['input_pipeline_img_s']:.0f}", f"{x['precompute_img_s']:.1f}", f"**{x['ratio']:.2f}**",
             f"{x['ratio_cpu_time']:.2f}", f"{100 * x['pipeline_share']:.1f} %"] for x in r["results"]]
    parts = [f"{r['priors'][x['prior']]} on the {x['data']}: read {x['parts_us_per_image'].get('read', 0):.0f} µs, "
             f"decode {x['parts_us_per_image'].get('decode', 0):.0f} µs, resize / crop / normalise "
             f"{x['parts_us_per_image']['preprocess']:.0f} µs per image, against {x['us_per_image']['forward']:.0f} µs "
             f"for its forward" for x in r["results"] if x["data"] == "folder"]
    loads = [v for x in r["results"] for v in x["load_avg_1min"]]
    first = r["results"][0]
    return {"precompute.table": table(["prior", "data", "bare forward img/s", "input pipeline alone img/s",
                                       "precompute img/s", "precompute / bare forward", "the same in CPU time",
                                       "the pipeline's share"], rows, "llrrrrrr")
            + f"\n\n{first['images']:,} images, batch {first['batch']}, {first['precision']}, {r['provenance']['machine']['torch_threads']} torch "
            f"thread; each figure the median of {r['rounds']} rounds, each round timing the bare forward just before and "
            f"just after the precompute (1-minute load average {min(loads):.1f} to {max(loads):.1f} on the machine's "
            f"{r['provenance']['machine']['cpu_count']} cores). Per image on the JPEG folders: " + "; ".join(parts)
            + ".\n\n" + r.source()}


@renders("precompute_batch.json")
def precompute_batch(r: Result) -> dict[str, str]:
    by: dict[str, dict[int, float]] = {}
    for x in r["results"]:
        by.setdefault(f"`{x['prior']}`" + (f" {x['options']}" if x["options"] else "") + f", {x['n']:,} images", {})[
            x["batch_size"]] = x["img_s"]
    sizes = sorted({b for v in by.values() for b in v})
    rows = [[name] + [f"{v[b]:.1f}" if b in v else "" for b in sizes] for name, v in by.items()]
    return {"precompute_batch.table": table(["prior", *map(str, sizes)], rows, "l" + "r" * len(sizes))
            + "\n\nImages per second of `precompute_targets` by batch size, best of "
            f"{r['rounds']} interleaved rounds, one thread.\n\n" + r.source()}


@renders("priors.json")
def priors(r: Result) -> dict[str, str]:
    rows = [[f"`{x['spec']}`", str(x["output_dim"]), f"{x['params'] / 1e6:.1f} M", str(x["input_size"]),
             f"{x['images_per_second']:.1f}"] for x in r["rows"]]
    return {"priors.table": table(["spec", "output dim", "parameters", "input px", "CPU precompute img/s"], rows, "lrrrr")
            + f"\n\n{r['dataset']}; random weights of each architecture (speed does not depend on the values), one "
            "thread.\n\n" + r.source()}


@renders("compact_store.json")
def compact_store(r: Result) -> dict[str, str]:
    rows = []
    for x in r["stores"]:
        tops = [u["top1"] for u in x["runs"]]
        rows.append([x["store"], x["dtype"], str(x["components"] or x["dim"]), f"{x['bytes_per_sample']:.0f}",
                     f"{x['lookup_ms_warm']:.2f} / {x['lookup_ms_cold']:.2f}",
                     f"{pm(statistics.fmean(tops), sd(tops))} ({', '.join(f2(t) for t in tops)})"])
    return {"compact_store.table": table(["store", "dtype", "values per row", "bytes per sample",
                                          "lookup ms (warm / cold)", "ReLA top-1 % (seeds)"], rows, "llrrrr")
            + f"\n\nPrior `{r['settings']['prior']}` ({prior_kind(r['settings']['prior'])}), the demo's ReLA run for "
            f"{r['settings']['budget']} steps per store and seed.\n\n" + r.source()}


@renders("prefetch.json")
def prefetch(r: Result) -> dict[str, str]:
    s = r["settings"]
    return {"prefetch.table": table(
        ["step, file dropped from the page cache before every step", "direct read ms", "prefetched ms"],
        [["median", f"{r['step_ms_cold']['direct']:.0f}", f"{r['step_ms_cold']['prefetch']:.0f}"],
         ["90th percentile", f"{r['step_ms_cold_p90']['direct']:.0f}", f"{r['step_ms_cold_p90']['prefetch']:.0f}"],
         ["warm page cache, median", f"{r['step_ms_warm']['direct']:.0f}", f"{r['step_ms_warm']['prefetch']:.0f}"]], "lrr")
        + f"\n\nA {human_bytes(s['store_bytes'])} store ({s['rows']:,} rows of {s['dim']}), batch {s['batch']}; "
        f"prefetch hits {r['prefetch_hits']}, misses {r['prefetch_misses']}.\n\n" + r.source()}


@renders("streams.json")
def streams(r: Result) -> dict[str, str]:
    s, t, b, p = r["settings"], r["training"], r["bytes_per_sample"], r["precompute_2proc"]
    rows = [
        ["2 gloo ranks, uninterrupted", f"{p['sidecars']} sidecars, {p['seconds']:.0f} s ({p['images_per_s']:.0f} img/s)"],
        ["killed after some sidecars, then rerun", f"{r['kill']['sidecars_when_killed']} of {s['shards']} were done; "
         f"all byte-identical to the uninterrupted run: {yes(p['identical_after_kill_and_resume'])}"],
        ["precompute / bare prior forward over the same stream", f"{r['throughput']['ratio']:.2f}"],
        ["bytes per sample: " + " / ".join(b), " / ".join(f"{v:.0f}" for v in b.values())],
        ["training step with sidecar targets joined / without targets (medians)",
         f"{t['ratio_median']:.2f} ({t['step_s_with_targets']:.3f} vs {t['step_s_without_targets']:.3f} s, "
         f"{t['steps_each']} steps each); ReLA on in-memory rows, no join: {t['ratio_rela_term_only_median']:.2f}"],
    ]
    return {"streams.table": table(["measured", "result"], rows, "ll")
            + f"\n\nA synthetic WebDataset of {s['images']:,} images in {s['shards']} tar shards. The file records no "
            "machine block beyond what its provenance says.\n\n" + r.source()}


# ---------------------------------------------------------------------------------------------- targets for the view
@renders("view_targets.json")
def view_targets(r: Result) -> dict[str, str]:
    names = {"cnn": "shipped ConvNet (3x3 map)", "vit_trained": "small ViT trained on Fashion-MNIST (7x7)",
             "vit_random": "DINOv2 ViT-S/14 architecture, random weights (8x8)"}
    rows = []
    for prior, scales in r["fidelity"].items():
        for scale_name, v in scales.items():
            rows.append([names.get(prior, prior), scale_name, f"{v['pooled']:.3f}", f"{v['whole_store_row']:.3f}",
                         f"{v['pooled'] - v['whole_store_row']:+.3f}"])
    return {"view_targets.table": table(["prior", "crop scale", "pooled from the map", "whole image's row",
                                         "pooled - whole"], rows, "llrrr")
            + f"\n\nCosine between the target a crop gets and the prior's own embedding of that crop "
            f"({r['settings']['k']} components).\n\n" + r.source()}


@renders("per_view.json")
def per_view(r: Result) -> dict[str, str]:
    a = r["analysis"]
    labels = {"whole": "the whole image's row", "whole-map": "the stored map's mean", "per-view": "each view's box, pooled"}
    rows = [[labels[k], pm(a[k]["top1"]["mean"], a[k]["top1"]["sd"]),
             ", ".join(f2(v) for v in a[k]["top1"]["seeds"]), xs(a[k]["speedup_wall"]["mean"])] for k in labels]
    return {"per_view.table": table(["targets", f"top-1 % at {r['settings']['budget']} steps", "seeds",
                                     "speed-up in wall-clock (mean)"], rows, "lrrr")
            + f"\n\nThe demo's recipe, prior `{r['settings']['prior']}`; plain BYOL "
            f"{pm(a['plain_at_budget']['mean'], a['plain_at_budget']['sd'])} % at the same steps.\n\n" + r.source()}


def dense_labels(r: Result) -> dict:
    return r["analysis"].get("labels", {})


@renders("dense.json")
def dense(r: Result) -> dict[str, str]:
    rows = []
    for m, v in r["analysis"]["equal_cpu"].items():
        rows.append([dense_labels(r).get(m, m), f"{v['seconds']['mean']:.0f}",
                     f"{v['miou']['difference']['mean']:+.2f} ± {v['miou']['difference']['sd']:.2f}",
                     f"{v['top1']['difference']['mean']:+.2f} ± {v['top1']['difference']['sd']:.2f}"])
    n = len(r["settings"]["seeds"])
    return {"dense.table": table(["method", "CPU s", "mIoU over plain, points", "top-1 over plain, points"], rows, "lrrr")
            + f"\n\nAt equal CPU time (plain VICReg read at each run's seconds); mean ± sd over {n} seeds. The file keeps "
            "means and sds only, so no claim about a single seed is made from it.\n\n" + r.source()}


@renders("dense_reductions.json")
def dense_reductions(r: Result) -> dict[str, str]:
    end = str(r["settings"]["steps"])
    at = r["analysis"]["at_steps"]
    stores = r["analysis"]["stores"]

    def cell(method: str) -> str:
        if method not in at:
            return "–"
        v = at[method][end]
        return f"{pm(v['miou']['mean'], v['miou']['sd'])}, {pm(v['top1']['mean'], v['top1']['sd'])}"

    def vs_all(method: str, red: str) -> str:
        if f"{method} {red}" not in at or f"{method} all" not in at:
            return ""
        a, b = at[f"{method} {red}"][end], at[f"{method} all"][end]
        return f"{a['miou']['mean'] - b['miou']['mean']:+.2f}, {a['top1']['mean'] - b['top1']['mean']:+.2f}"

    rows = [[f"K={red}" if red != "all" else "all channels", f"{stores[red]['bytes_per_image']:,.0f}",
             cell(f"dense {red}"), vs_all("dense", red), cell(f"dense-only {red}"), vs_all("dense-only", red)]
            for red in stores]
    n = len(r["settings"]["seeds"])
    return {"dense_reductions.table": table(
        ["stored map", "bytes per image", "global + dense: mIoU %, top-1 %", "vs all channels (difference of means)",
         "dense only: mIoU %, top-1 %", "vs all channels"], rows, "lrrrrr")
        + f"\n\nAfter {end} steps, mean ± sd over {n} seeds. The file keeps means and sds only, so the differences are "
        "differences of means, not per-seed differences.\n\n" + r.source()}


# ---------------------------------------------------------------------------------------------- several priors
@renders("several_priors.json")
def several_priors(r: Result) -> dict[str, str]:
    rows, used, specs = [], [], r["settings"]["priors"]
    for name, c in r["cells"].items():
        priors, std, balance = name.split("|")
        used += [n for n in priors.split("+") if n not in used]
        tops = [p["top1"] for p in c["per_seed"]]
        rows.append([priors, std, balance, f"{pm(c['top1'], c['top1_std'])} ({', '.join(f2(t) for t in tops)})",
                     xs(c["steps"]["speedup"])])
    return {"several_priors.table": table(["priors", "standardisation", "balance", "top-1 % at 250 steps (seeds)",
                                           "speed-up in steps"], rows, "lllrr")
            + f"\n\nPriors: {', '.join(f'{n} = `{specs[n]}`' for n in used)}. This study shared the cores "
            "with other jobs, so only its accuracies and steps compare; its wall-clock speed-ups are in the file.\n\n"
            + r.source()}


@renders("several_priors_canvas.json")
def several_priors_canvas(r: Result) -> dict[str, str]:
    a = r["analysis"]
    rows = [["plain VICReg", "", a["plain"]["device"], pm(a["plain"]["final"]["mean"], a["plain"]["final"]["sd"]), "", ""]]
    for name, v in a["settings"].items():
        last = v["curve"][str(max(int(k) for k in v["curve"]))]
        steps = v["steps_to_plain_final"]
        rows.append([name, "as written" if v["raw"] else "standardised", v["device"], pm(last["mean"], last["sd"]),
                     ", ".join("–" if s is None else f"{s:.0f}" for s in steps),
                     xs(v["speedup_geomean"]) if all(s is not None for s in steps) else "not reached by every seed"])
    return {"several_priors_canvas.table": table(
        ["setting", "rows", "ran on", "top-1 % at the end (mean ± sd)", "steps to plain's final (seeds)",
         "speed-up, side by side"], rows, "lllrrr") + "\n\n" + r.source()}


# ---------------------------------------------------------------------------------------------- the checks
@renders("alignment.json")
def alignment(r: Result) -> dict[str, str]:
    def num(x, fmt: str) -> str:
        return "–" if x is None or x != x else format(x, fmt)  # (NaN: not measured in that case)

    rows = [[x["case"], str(x["runs"]), str(x["witness_alarms"]), num(x["witness_median_step"], ".1f"),
             str(x["witness_said"]), num(x["witness_said_median_step"], ".1f"), str(x["head_alarms"]),
             num(x["head_median_batch"], ".0f"), num(x["rows_rank"], ".3f"), num(x["view_rank"], ".3f"),
             num(x["own_box"], ".2f"), x["witness_status"]] for x in r["summary"]]
    c, fa = r["cost"], r["false_alarms"]
    return {"alignment.table": table(["case", "runs", "witness stops", "median step", "witness says it cannot refute",
                                      "median step", "head check warns", "median batch", "own row's rank",
                                      "another view's rank", "closer to its own box", "witness status"],
                                     rows, "lrrrrrrrrrrl")
            + f"\n\nEach run {r['settings']['steps']} optimiser steps at batch {r['settings']['batch']} (student ConvNet "
            f"{'/'.join(map(str, r['settings']['student_widths']))}) unless its case says. False alarms "
            f"over the {fa['aligned_runs']} aligned runs ({fa['one_view_runs']} of them one-view loops, "
            f"{fa['per_view_runs']} per-view, {fa['short_runs']} of 10 steps): {fa['witness_stops']} witness stops, "
            f"{fa['head_warnings']} head-check warnings. Cost of both checks (the demo's student, ConvNet 16/32/64, "
            f"batch 128), interleaved step by step: {c['ratio_of_means']:.4f}x ({c['steps']} steps). A rank is 0 when a "
            "sample's own row comes first among the "
            "batch's rows and 0.5 on average for other samples' rows; \"closer to its own box\" is the share of samples "
            "whose view is closer to its own box's row than to the other view's (per-view cases).\n\n" + r.source(),
            "alignment.detections": table(
                ["misaligned case", "witness stopped at step (each seed)", "head check warned at batch (each seed)"],
                [[case, ", ".join("–" if d["witness_step"] is None else str(d["witness_step"]) for d in found),
                  ", ".join("–" if d["head_batch"] is None else str(d["head_batch"]) for d in found)]
                 for case, found in r["detections"].items()], "lll")
            + "\n\n– : not stopped (warned) within the run.\n\n" + r.source()}


@renders("folder_identity.json")
def folder_identity(r: Result) -> dict[str, str]:
    import statistics

    def cpu(runs) -> float:
        return statistics.median(x["cpu"] for x in runs)

    rows = []
    for x in r["results"]:
        pre, op, full = x["precompute"], x["open"], x["full_check"]
        runs = op["runs"]
        before, now = cpu(runs["before"]), cpu(runs["contents"])
        rows.append([f"{x['files']:,}", f"{pre['wall']:.0f} s",
                     f"{op['median_wall_names_only']:.2f} s ({cpu(runs['names only']):.2f} s)",
                     f"{op['median_wall_before']:.2f} s ({before:.2f} s)",
                     f"{op['median_wall_contents']:.2f} s ({now:.2f} s)",
                     f"{1e6 * (now - before) / x['files']:+.1f} µs/file",
                     f"{x['copied_folder_open']['wall']:.2f} s ({x['copied_folder_open']['cpu']:.2f} s)",
                     f"{full['wall']:.2f} s ({full['cpu']:.2f} s)"])
    s = r["settings"]
    read = r["results"][0]["open"]["files_read_at_open"]
    header = ["files", "precompute", "open, names only",
              f"open before: size and time of every file, {read} read", f"open now: + change time and inode, {read} read",
              "now - before (CPU)", "a copied folder's open", "every file's bytes (`store verify --data`)"]
    return {"folder_identity.table": table(header, rows, "rrrrrrrr")
            + f"\n\nWall time (CPU time in brackets), median of {s['repeats']} opens each way, interleaved; files of "
            f"{r['results'][0]['mean_file_bytes']:.0f} bytes on average (Fashion-MNIST images as PNG), the prior "
            f"`{s['prior']}`; \"before\" is the code at commit `{s['before']}` opening the same store with its record of "
            "sizes, times and digests, \"now\" this code opening the store that also records change times and inodes; "
            f"warm page cache, 1 thread. The machine was shared (load average {r['load_average_start'][0]:.1f} at the "
            "start): the wall times carry the wait for a core, the CPU times are what an open costs.\n\n" + r.source()}


# ---------------------------------------------------------------------------------------------- warm-start sets, priors
@renders("distill.json")
def distill(r: Result) -> dict[str, str]:
    cost = r["cost"]["per_round_seconds_per_image"]["cpu"]
    rows = []
    for name, v in r["rows"].items():
        acc = [100 * a for a in v["accuracies"]]
        per_image = cost.get(name)
        rows.append([name, pm(100 * v["accuracy_mean"], 100 * v["accuracy_std"]), ", ".join(f"{a:.1f}" for a in acc),
                     f"{statistics.median(per_image):.2f}" if per_image else "–"])
    return {"distill.table": table(["method", "student top-1 % (mean ± population sd)", "seeds",
                                    "synthesis CPU s per image"], rows, "lrrr")
            + f"\n\nDWA / SRe2L++ cost: {r['cost']['dwa_over_sre2lpp']:.2f}x.\n\n" + r.source()}


@renders("compact.json")
def compact(r: Result) -> dict[str, str]:
    names = {"random_init_student": "the random-init student", "a_random_real": "(a) random real images + targets",
             "b_krr_st": "(b) KRR-ST distilled pairs", "c_param": "(c) bases only",
             "c_full": "(c) bases + rotations + approximation nets", "teacher": "the teacher itself"}
    floats = {"a_random_real": "a_random_real_floats", "b_krr_st": "b_krr_st_floats", "c_param": "c_param_floats",
              "c_full": "c_full_floats"}
    rows = [[names.get(k, k), f"{r['storage'][floats[k]]:,}" if k in floats else "–", pm(v["mean"], v["std"]),
             ", ".join(f2(x) for x in v["values"])] for k, v in r["summary_top1"].items()]
    return {"compact.table": table(["row", "floats stored", "probe top-1 %", "seeds"], rows, "lrrr")
            + f"\n\nA budget of {r['storage']['budget_floats']:,} floats.\n\n" + r.source()}


@renders("train_demo_prior.json")
def train_demo_prior(r: Result) -> dict[str, str]:
    rows = []
    for spec, rel in PRIOR_RECORDS.items():
        rec = r if rel == "results/train_demo_prior.json" else record(rel)
        rows.append([f"`{spec}`", prior_kind(spec), f"{rec['steps']:,}", minutes(rec["train_seconds"]),
                     f2(rec["linear_probe_top1"]), f"`{rec['command']}`"])
    return {"train_demo_prior.table": table(["prior", "to the Fashion-MNIST benchmarks", "steps", "training time",
                                             "linear probe %", "command"], rows, "llrrrl")
            + "\n\nOne CPU thread each; the probe is on Fashion-MNIST (first 20,000 training images, the 10,000 test "
            "images).\n\n" + r.source("Each row's own record is under `benchmarks/prior_runs/`.")}


# ---------------------------------------------------------------------------------------------- against timm's KD
@renders("timm_kd.json")
def timm_kd(r: Result) -> dict[str, str]:
    """``timm_kd.json`` (``timm_kd.py``): who leads where in words, top-1 and compute per budget, at equal compute,
    and the cost of each kind of step."""
    return {f"timm_kd.{name}": text + "\n\n" + r.source()
            for name, text in benchmark("timm_kd").tables(r).items()}


# ---------------------------------------------------------------------------------------------- the budget study
def budget_tables(r: Result) -> dict[str, str]:
    """``budget_<student>.json`` (``budget.py``): its tables by name (``budget.tables``), each closed by its source."""
    note = "" if r.get("complete", True) else (f"Incomplete: {r['runs_done']} of {r['runs_planned']} runs finished; a "
                                               "cell shows how many seeds it has when fewer than 5.")
    return {f"{r.path.stem}.{name}": text + "\n\n" + r.source(note)
            for name, text in benchmark("budget").tables(r).items()}


def handover_tables(r: Result) -> dict[str, str]:
    """``handover_<study>_<student>_<prior>.json`` (``handover.py``): the study's table."""
    note = "" if r.get("complete", True) else "Some of the study's runs had not finished: the table holds the others."
    return {f"{r.path.stem}.table": benchmark("handover").tables(r) + "\n\n" + r.source(note)}


for _path in sorted(RESULTS.glob("budget_*.json")):
    renders(_path.name)(budget_tables)
for _path in sorted(RESULTS.glob("handover_*.json")):
    renders(_path.name)(handover_tables)


# ---------------------------------------------------------------------------------------------- the script
def figure(r: Result) -> str:
    """A result file's figure block: the PNG its benchmark drew from it, and the file's source line."""
    png = r.path.with_suffix(".png")
    return f"![The figure {png.name}, drawn from {r.path.name}]({FIGURE_DIR}/{png.name})\n\n" + r.source()


def blocks() -> dict[str, str]:
    """Every block, by name, rendered from the result files now (with each file's figure block, if it has a PNG)."""
    missing = sorted(p.name for p in RESULTS.glob("*.json") if p.name not in RENDERERS)
    if missing:
        raise ValueError(f"result files without a renderer in benchmarks/render.py: {missing}")
    out: dict[str, str] = {}
    for name, fn in RENDERERS.items():
        result = Result(RESULTS / name)
        made = fn(result)
        if result.path.with_suffix(".png").is_file():
            made[result.path.stem + FIGURE] = figure(result)
        for block, text in made.items():
            assert block not in out, f"block {block} rendered twice"
            out[block] = text.strip()
    return out


class Block(NamedTuple):
    """One generated block of a page: its name, where it starts and ends (markers included) and its text."""

    name: str
    start: int
    end: int
    text: str


def parse_blocks(text: str) -> tuple[list[Block], list[str]]:
    """The generated blocks of a page's ``text`` (markers outside code, whatever their spacing), and every marker
    that cannot be matched to a block: an opening without its closing, a closing without its opening, a comment that
    starts like a marker but is neither (each named with its line)."""
    code = [m.span() for m in CODE.finditer(text)]

    def in_code(i: int) -> bool:
        return any(a <= i < b for a, b in code)

    def line(i: int) -> int:
        return text.count("\n", 0, i) + 1

    marks = []  # (position, kind, match) outside code, in page order
    for kind, pattern in (("open", OPEN), ("close", CLOSE)):
        marks += [(m.start(), kind, m) for m in pattern.finditer(text) if not in_code(m.start())]
    known = {pos for pos, _, _ in marks}
    problems = [f"line {line(m.start())}: {text[m.start():text.find('-->', m.start()) + 3 or m.end()]!r} starts like "
                "a generated-block marker but is neither '<!-- generated: NAME -->' nor '<!-- /generated -->'"
                for m in LIKE_A_MARKER.finditer(text) if m.start() not in known and not in_code(m.start())]
    blocks, opened = [], None
    for pos, kind, m in sorted(marks, key=lambda x: x[0]):
        if kind == "open":
            if opened is not None:
                problems.append(f"line {line(opened.start())}: block {opened.group('name')!r} has no closing "
                                "'<!-- /generated -->' before the next block opens")
            opened = m
        elif opened is None:
            problems.append(f"line {line(pos)}: '<!-- /generated -->' closes no block")
        else:
            blocks.append(Block(opened.group("name"), opened.start(), m.end(), text[opened.start():m.end()]))
            opened = None
    if opened is not None:
        problems.append(f"line {line(opened.start())}: block {opened.group('name')!r} has no closing "
                        "'<!-- /generated -->'")
    return blocks, problems


def block_text(name: str, rendered: dict[str, str], page: str = "") -> str:
    """Block ``name`` as this script writes it on the page ``page`` (relative to the repository): its markers and what
    the result files give now, a figure's link relative to the page."""
    import posixpath

    body = rendered[name].replace(FIGURE_DIR, posixpath.relpath("benchmarks/results", posixpath.dirname(page) or "."))
    return f"<!-- generated: {name} -->\n\n{body}\n\n<!-- /generated -->"


def render_page(text: str, rendered: dict[str, str], page: str = "") -> str:
    """``text`` (the page ``page``, relative to the repository; default: one at its root) with every generated block
    rewritten from ``rendered``; a marker that matches no block, or a block no renderer makes, raises naming it."""
    blocks, problems = parse_blocks(text)
    unknown = [b.name for b in blocks if b.name not in rendered]
    if problems or unknown:
        raise KeyError(f"{page}: " + "; ".join(problems + [f"no renderer makes the block {n!r} (benchmarks/render.py)"
                                                           for n in unknown]))
    out, last = [], 0
    for b in blocks:
        out += [text[last:b.start], block_text(b.name, rendered, page)]
        last = b.end
    return "".join(out + [text[last:]])


def strip_blocks(text: str) -> str:
    """A page's ``text`` without its generated blocks (what was written by hand)."""
    blocks, _ = parse_blocks(text)
    out, last = [], 0
    for b in blocks:
        out.append(text[last:b.start])
        last = b.end
    return "".join(out + [text[last:]])


def check() -> list[str]:
    """What differs: every block of every page that is not what the files give now (a marker's spacing included),
    every block no renderer makes, every marker that matches no block, blocks placed nowhere."""
    rendered, problems, used = blocks(), [], set()
    for page in PAGES:
        where = str(page.relative_to(ROOT))
        found, unmatched = parse_blocks(page.read_text())
        problems += [f"{where}: {p}" for p in unmatched]
        used |= {b.name for b in found}
        unknown = [b.name for b in found if b.name not in rendered]
        problems += [f"{where}: block {n!r} is made by no renderer (benchmarks/render.py); its numbers cannot be "
                     "checked" for n in unknown]
        stale = [b.name for b in found if b.name in rendered and b.text != block_text(b.name, rendered, where)]
        if stale:
            problems.append(f"{where}: {', '.join(stale)} differ from the result files "
                            "(run: python benchmarks/render.py)")
    problems += [f"block {name} is rendered but placed on no page" for name in sorted(set(rendered) - used)
                 if not name.endswith(FIGURE)]  # (a figure is placed where it helps)
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="do not write: exit 1 naming each block that differs")
    args = p.parse_args(argv)
    if args.check:
        problems = check()
        print("\n".join(problems) if problems else "every generated block matches the result files")
        return 1 if problems else 0
    rendered = blocks()
    for page in PAGES:
        text = page.read_text()
        new = render_page(text, rendered, str(page.relative_to(ROOT)))
        if new != text:
            atomic_write_text(page, new)
            print(f"wrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
