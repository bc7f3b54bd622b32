"""`hybridrl cost RUN_DIR [RUN_DIR ...]` and `hybridrl plan [RUN_DIR] [--measure]`."""

from __future__ import annotations

import argparse
import json
import sys


def add_cost_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="RL run directories; several add up to the development cost, the last is the final run")
    p.add_argument("--prices", default=None, metavar="FILE", help="price table (default: configs/prices.yaml)")
    p.add_argument("--device-kind", default=None, metavar="KIND",
                   help="which device_hour price applies (default: cpu for CPU runs, gpu otherwise)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def cost_main(args: argparse.Namespace) -> int:
    from hybridrl.cost.accounting import account
    from hybridrl.cost.prices import PriceError, load_prices
    from hybridrl.cost.report import combine, format_report, run_report

    try:
        prices = load_prices(args.prices)
        reports = [run_report(account(d), prices, args.device_kind) for d in args.run_dirs]
    except (FileNotFoundError, PriceError) as err:
        print(f"hybridrl cost: {err}", file=sys.stderr)
        return 2
    out = combine(reports)
    print(json.dumps(out, indent=1, default=str) if args.json else format_report(out))
    return 0


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from hybridrl.cost.planner import add_arguments

    add_arguments(p)


def plan_main(args: argparse.Namespace) -> int:
    from hybridrl.cost.planner import main

    return main(args)
