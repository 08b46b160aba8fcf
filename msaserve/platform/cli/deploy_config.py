"""`msaserve deploy-config CONFIG.yaml`: validate a ServeConfig and print KubeRay's serveConfigV2.

`--values` prints a values file for the Helm chart (`serve:` block) instead;
`--write-values-schema PATH` refreshes the `serve` part of the chart's values.schema.json;
`--write-config-reference PATH` rewrites docs/configuration.md.
"""

import argparse
import sys
from pathlib import Path

from msaserve.platform.config import ConfigError, ServeConfig
from msaserve.platform.config_reference import write_reference
from msaserve.platform.serve_config_v2 import (
    cluster_problems,
    serve_config_v2_yaml,
    sync_values_schema,
    values_snippet_yaml,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "deploy-config",
        help="Validate a ServeConfig YAML and print the RayService serveConfigV2 (or Helm values).",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", nargs="?", help="ServeConfig YAML file.")
    parser.add_argument(
        "--values", action="store_true", help="Print a Helm values file (`serve:` block) instead."
    )
    parser.add_argument("-o", "--output", help="Write to this file instead of stdout.")
    parser.add_argument(
        "--no-api-keys",
        action="store_true",
        help="The chart runs with apiKeys.enabled=false (skip the api_keys_env check).",
    )
    parser.add_argument(
        "--skip-cluster-checks",
        action="store_true",
        help="Only validate the schema; skip the checks the chart applies (loopback host, ...).",
    )
    parser.add_argument(
        "--write-values-schema",
        metavar="PATH",
        help="Rewrite the `serve` part of the chart's values.schema.json from ServeConfig and exit.",
    )
    parser.add_argument(
        "--write-config-reference",
        metavar="PATH",
        help="Rewrite the Markdown configuration reference (docs/configuration.md) and exit.",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.write_config_reference:
        changed = write_reference(args.write_config_reference)
        print(f"{args.write_config_reference}: {'updated' if changed else 'already up to date'}")
        return 0
    if args.write_values_schema:
        changed = sync_values_schema(args.write_values_schema)
        print(f"{args.write_values_schema}: {'updated' if changed else 'already up to date'}")
        return 0
    if not args.config:
        print("deploy-config: give a ServeConfig YAML file (or --write-values-schema PATH)", file=sys.stderr)
        return 2
    try:
        config = ServeConfig.from_yaml(args.config)
    except (ConfigError, OSError) as e:
        print(f"deploy-config: {e}", file=sys.stderr)
        return 2
    if not args.skip_cluster_checks:
        problems = cluster_problems(config, api_keys_enabled=not args.no_api_keys)
        if problems:
            for problem in problems:
                print(f"deploy-config: {args.config}: {problem}", file=sys.stderr)
            return 2
    text = values_snippet_yaml(config) if args.values else serve_config_v2_yaml(config)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
