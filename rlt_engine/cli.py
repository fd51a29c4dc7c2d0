"""Command-line entry points: `python -m rlt_engine.cli generate|bench|worker …`.

Every console script is a thin alias of one subcommand here.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from rlt_engine.config import EngineConfig


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`max_num_seqs` → `--max-num-seqs`)."""
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if field.name in ("max_loops", "num_blocks"):
                kind = int
            parser.add_argument(flag, type=kind, default=default, help=f"(default: {default})")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed flags describe."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def generate_main(argv: list[str] | None = None) -> int:
    """`rlt-generate --offline PROMPT`: generate in this process and print the text."""
    from protocol.messages import SamplingParams
    from rlt_engine.llm import LLM

    parser = argparse.ArgumentParser(prog="rlt-generate", description=generate_main.__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--offline", action="store_true", required=True,
                        help="run the engine in this process (the only mode until rlt-serve lands)")
    parser.add_argument("--token-ids", action="store_true", help="print token ids and exit depths, not text")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--exit-threshold", type=float, default=None)
    add_engine_options(parser)
    parser.set_defaults(workers=0)
    args = parser.parse_args(argv)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            exit_threshold=args.exit_threshold)
    config = engine_config(args)
    with LLM(**dataclasses.asdict(config)) as llm:
        output = llm.generate([args.prompt], params, use_tqdm=False)[0]
    if args.token_ids:
        print("token_ids:", output.token_ids)
        print("exit_depths:", output.exit_depths)
    else:
        print(output.text)
    print(f"[{len(output.token_ids)} tokens, mean loops/token "
          f"{sum(output.exit_depths) / len(output.exit_depths):.2f}, finish: {output.finish_reason}]",
          file=sys.stderr)
    return 0


COMMANDS = {"generate": generate_main}


def main(argv: list[str] | None = None) -> int:
    """Dispatch `python -m rlt_engine.cli COMMAND …`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m rlt_engine.cli {{{'|'.join(COMMANDS)}}} …", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
