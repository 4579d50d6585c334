"""``fusedserve import SOURCE REPOSITORY/NAME`` (its flags: ``service.cli``) runs ``import_file``: it prints
the self-check's report, or why the model was refused (exit status 2), naming what to change."""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    from fusedserve.models.importing import UnsupportedModel, import_file

    options = {"version": args.version, "dtype": args.dtype, "allow_pickle": args.allow_pickle,
               "output_activation": args.output_activation}
    if args.activation is not None:
        names = args.activation.split(",")
        options["activations"] = names[0] if len(names) == 1 else names
    try:
        report = import_file(args.source, args.destination, **options)
    except (UnsupportedModel, ValueError, FileNotFoundError, FileExistsError, ImportError) as exc:
        print(f"fusedserve import: {exc}", file=sys.stderr)
        return 2
    print(report)
    return 0
