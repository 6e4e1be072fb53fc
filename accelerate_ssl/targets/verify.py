"""``accelerate-ssl store verify PATH [--data SPEC]``: read every row of a target folder (a TargetStore or a sidecar
folder) and its recorded checksums; with ``--data``, check that row i belongs to item i (a store) or that every shard,
key and content digest belongs to the stream (sidecars). Exit 1 names the damage."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..data.spec import data_spec, fraction_arg
from .sidecar import SIDECARS, ShardedTargets, SidecarError
from .store import TargetStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    verbs = parser.add_subparsers(dest="store_verb", metavar="VERB", required=True)
    verify = verbs.add_parser("verify", help="read a store once: its file checksum, every row finite, and (--data) "
                                             "every row against its data set item",
                              description="Read a target store once: compare the targets file's sha256 with the one "
                                          "recorded when it was written, and check that every row is finite. With "
                                          "--data, also check item by item that row i belongs to item i of that data "
                                          "set (for a folder: every file name and every file's bytes against the "
                                          "contents recorded at precompute), naming the rows that do not. A sidecar "
                                          "folder (streamed data): every sidecar's sha256, key list and rows; with "
                                          "--data wds:/hf:, every shard, key and image digest of that stream against "
                                          "its sidecar.")
    verify.add_argument("path", help="the store folder, or a sidecar folder of streamed data (written by "
                                     "`accelerate-ssl precompute --out`)")
    verify.add_argument("--data", default=None, type=data_spec,
                        help="also check, item by item, that row i belongs to item i of this data set (the --data "
                             "given to precompute; every file name and file's bytes, array row or image is compared); "
                             "for a sidecar "
                             "folder, the stream (wds:/hf:) it was computed on: every shard, key and image digest")
    verify.add_argument("--split", default="train", help="with --data (and hf:): as for precompute")
    verify.add_argument("--data-root", default=None, help="with --data: as for precompute")
    verify.add_argument("--limit", type=int, default=None, help="with --data: as for precompute")
    verify.add_argument("--fraction", type=fraction_arg, default=None, help="with --data: as for precompute")
    verify.add_argument("--json", action="store_true", help="print the result as JSON")
    verify.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    if (Path(args.path) / SIDECARS).is_file():  # a sidecar folder (streamed data)
        return _run_sidecars(args, ShardedTargets, SidecarError)
    try:
        store = TargetStore.open(args.path)
        summary = store.verify(progress=not args.no_progress)
        if args.data is not None:
            from ..data.spec import open_data

            dataset = open_data(args.data, args.split, root=args.data_root, limit=args.limit, fraction=args.fraction)
            summary.update(store.verify_rows(dataset, progress=not args.no_progress))  # names the rows that differ
            store.check_dataset(dataset)
    except (FileNotFoundError, ValueError) as err:  # the store's errors, and a data set that cannot be read
        if args.json:
            print(json.dumps({"path": args.path, "ok": False, "error": str(err)}))
        print(f"accelerate-ssl store verify: error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"path": args.path, "ok": True, **summary}))
    else:
        note = "checksum matches" if summary["checksum"] == "ok" else "no checksum recorded (an older store): rows only"
        rows = ""
        if args.data is not None:
            how = summary["kind"]
            if "files_read" in summary:
                how = f"file name and bytes, {summary['files_read']} files read"
            elif how == "files":
                how = ("file names only: this store records no file contents (written by an older accelerate-ssl); "
                       "recompute it to compare the files' bytes")
            rows = f", every row belongs to its item of {args.data} (compared by {how})"
        maps = f" (maps on a {summary['grid'][0]}x{summary['grid'][1]} grid)" if "grid" in summary else ""
        print(f"{args.path}: ok, {summary['rows']} rows x {summary['dim']}{maps}, every row finite, {note}{rows}")
    return 0


def _run_sidecars(args: argparse.Namespace, sharded, error) -> int:
    """`store verify <sidecar folder> [--data wds:... / hf:...]`: every sidecar read with its checks (sha256, keys,
    rows finite); with --data, every shard, key and content digest against that stream."""
    from ..data.streams import is_stream_spec

    try:
        unused = [f"--{name.replace('_', '-')}" for name in ("data_root", "limit", "fraction") if getattr(args, name) is not None]
        if unused:
            raise ValueError(f"{' and '.join(unused)} select items of a map-style data set; a sidecar folder is checked "
                             "against its whole stream: drop them.")
        if args.data is not None and not is_stream_spec(args.data):
            raise ValueError(f"{args.path} is a sidecar folder of streamed data; --data {args.data} is not a stream. "
                             "Pass the stream it was computed on: --data wds:<shard pattern> or --data hf:<path or name>.")
        targets = sharded.open(args.path)
        summary = targets.verify(progress=not args.no_progress)
        if args.data is not None:
            summary.update(targets.verify_stream(args.data, split=args.split, progress=not args.no_progress))
    except (FileNotFoundError, ImportError, ValueError, error) as err:
        print(json.dumps({"path": args.path, "ok": False, "error": str(err)}) if args.json else
              f"accelerate-ssl store verify: error: {err}", file=sys.stdout if args.json else sys.stderr)
        return 1
    print(json.dumps({"path": args.path, "ok": True, **summary}) if args.json else
          f"{args.path}: ok, {summary['shards']} sidecar shard(s), {summary['rows']} rows x {summary['dim']}, every "
          "checksum and key list matches" + (f", every sample of {args.data} has its own row (key and content, "
                                             f"{summary['samples_checked']} samples)" if args.data is not None else ""))
    return 0
