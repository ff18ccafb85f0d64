"""`kvfuzz mutate`: the command's function (its options are declared in fuzz/cli.py)."""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from fuzz.errors import UsageError
from fuzz.targets import releases

MIB = 1 << 20


def mutate(args: argparse.Namespace, out: TextIO) -> int:
    from fuzz.mutate.report import render, to_dict
    from fuzz.mutate.session import MutateOptions, run_session

    options = MutateOptions(functions=tuple(args.function or ()), budget=args.budget, jobs=args.jobs, seed=args.seed, device=args.device,
                            synthetic=not args.no_synthetic, case_timeout=args.case_timeout, max_memory=args.max_memory * MIB,
                            session=args.session, max_mutants=args.max_mutants)
    source = releases.resolve(args.vllm)
    def progress(line: str) -> None:
        if not args.json:
            print(f"kvfuzz: {line}", file=out, flush=True)

    try:
        session = run_session(source, options, progress=progress)
    except LookupError as error:
        raise UsageError(str(error)) from None
    print(json.dumps(to_dict(session), indent=1) if args.json else render(session), file=out)
    return 0
