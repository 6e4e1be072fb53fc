"""Make a finished ``accelerate-ssl demo --seeds ...`` run the demo's reference (``benchmarks/results/demo.json``,
against which every later demo places its own run): its JSON and PNG copied, and its reference text rewritten as the
demo would write it for a run with these numbers against this reference (the text the run wrote placed it against the
previous reference).

    accelerate-ssl demo --seeds 0 1 2 3 4 --out /tmp/demo     # the default settings; an interrupted run resumes
    python benchmarks/demo_reference.py /tmp/demo
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accelerate_ssl import demo  # noqa: E402
from accelerate_ssl.atomic import atomic_write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the demo's --out folder (demo.json, demo.png)")
    a = p.parse_args(argv)
    result = json.loads((a.out / "demo.json").read_text())
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    if not result.get("default") or len(result.get("per_seed") or []) < 2 or \
            any(result["settings"][k] != defaults[k] for k in demo.NUMERIC_SETTINGS):
        p.error(f"{a.out / 'demo.json'} is not a run of the default settings over several seeds: the reference must be "
                "`accelerate-ssl demo --seeds 0 1 2 ...` with no other option but --out.")
    shutil.copyfile(a.out / "demo.png", demo.REFERENCE_FILE.with_suffix(".png"))
    atomic_write_json(demo.REFERENCE_FILE, result, indent=2)  # reference() reads the seeds from this file
    args = argparse.Namespace(**{**defaults, **result["settings"], "seeds": [0]})
    result["reference"] = demo.reference(args, {k: result[k] for k in ("cpu", "machine")})
    result["prior_training"] = demo.prior_training(result["settings"]["prior_spec"])  # from its record, as now
    atomic_write_json(demo.REFERENCE_FILE, result, indent=2)
    print(f"wrote {demo.REFERENCE_FILE} ({len(result['per_seed'])} seeds): {result['reference']['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
