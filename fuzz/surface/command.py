"""`kvfuzz surface`: the command's function (its options are declared in fuzz/cli.py)."""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from fuzz.targets import releases


def surface(args: argparse.Namespace, out: TextIO) -> int:
    from fuzz.mutate.tree import tree_root
    from fuzz.surface.report import render, to_dict
    from fuzz.surface.survey import survey

    source = releases.resolve(args.vllm)
    found = survey(source, tree_root(source), args.max_time, seed=args.seed, probe=args.probe)
    print(json.dumps(to_dict(found), indent=1) if args.json else render(found), file=out)
    return 0
