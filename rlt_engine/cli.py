"""Command-line entry points: `python -m rlt_engine.cli serve|generate|bench|worker …`.

Every console script is a thin alias of one subcommand here.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from rlt_engine.config import EngineConfig, check_device_visible

if TYPE_CHECKING:
    from rlt_engine.http_api.process import HttpProcess

log = logging.getLogger("rlt.serve")


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (on/off for switches), unless the text states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text  # None defaults are explained in the text ("default: cuda when a GPU is visible")
        if isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"


def add_engine_options(parser: argparse.ArgumentParser, **defaults: object) -> None:
    """One flag per EngineConfig field (`max_num_seqs` → `--max-num-seqs`); `defaults` override some."""
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        default, help_text = defaults.get(field.name, field.default), field.metadata.get("help", "")
        if isinstance(default, bool) or field.type == "bool | None":  # None: the text says what auto means
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if field.name in ("max_loops", "num_blocks"):
                kind = int
            parser.add_argument(flag, type=kind, default=default, help=help_text)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed flags describe."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


class _Stopped(Exception):
    """A signal arrived before the engine was ready."""


def serve_parser() -> argparse.ArgumentParser:
    """The command line of `rlt-serve`."""
    parser = argparse.ArgumentParser(prog="rlt-serve", description=serve_main.__doc__,
                                     formatter_class=DefaultsFormatter)
    add_engine_options(parser)
    parser.add_argument("--ipc", metavar="PATH", default=None,
                        help="unix socket path (default: rlt.sock in a new private temporary directory)")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds a SIGTERM/SIGINT lets running requests finish before aborting them")
    parser.add_argument("--max-pending", type=int, default=1024,
                        help="live requests admitted at once; beyond it requests get an `overload` error")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="stderr log level")
    parser.add_argument("--http-port", type=int, default=None,
                        help="also serve the OpenAI-compatible HTTP API and /metrics on this port "
                             "(0: any free port; default: off)")
    parser.add_argument("--http-host", default="127.0.0.1",
                        help="the HTTP API's address (default loopback; 0.0.0.0 to serve other hosts)")
    return parser


def serve_main(argv: list[str] | None = None) -> int:
    """`rlt-serve`: run an engine and serve clients on ipc://PATH until SIGTERM or SIGINT."""
    parser = serve_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, force=True,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = engine_config(args).resolved()
        check_device_visible(config.device or "cpu")
    except ValueError as exc:
        parser.error(str(exc))
    from rlt_engine.engine import LLMEngine
    from rlt_engine.errors import WorkerStartupError
    from rlt_engine.frontend import AddressInUseError, Frontend, prepare_ipc_path
    from rlt_engine.http_api.process import HttpBindError

    private_dir = tempfile.mkdtemp(prefix="rlt-serve-") if args.ipc is None else None
    path = os.path.join(private_dir, "rlt.sock") if private_dir else os.path.abspath(args.ipc)
    address = f"ipc://{path}"
    http = None
    try:
        prepare_ipc_path(path)  # fail before paying for worker start-up
        frontend = None
        if args.http_port is not None:  # bound now: a port in use fails before worker start-up
            http = _start_http(args, address, args.model)  # the name the user gave is the API's model id

        def on_signal(signum: int, frame: object) -> None:
            if frontend is None:
                raise _Stopped(signal.Signals(signum).name)
            log.warning("%s: %s", signal.Signals(signum).name,
                        "draining" if not frontend.draining else "aborting what is left")
            frontend.request_stop(args.shutdown_timeout)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        log.info("starting %d worker(s) for %s on %s (%s)", config.workers, args.model, config.device, config.dtype)
        engine = LLMEngine(config)
        try:
            frontend = Frontend(engine, address, max_pending=args.max_pending)
            print(f"rlt-serve listening on {address}", flush=True)
            if http is not None:
                print(f"rlt-serve http on {http.url}", flush=True)
            print(f"rlt-serve ready on {address} (model {args.model}, {config.workers} worker(s), "
                  f"{config.device}, {config.dtype})", flush=True)
            code = frontend.serve(on_tick=http.check if http is not None else None)
        finally:
            if http is not None:
                http.stop()  # after the drain: its responses are complete
            engine.close()
            if frontend is not None:
                frontend.close()
        log.info("rlt-serve stopped (exit code %d)", code)
        return code
    except _Stopped as exc:
        log.warning("%s before the engine was ready: stopped", exc)
        return 0
    except (AddressInUseError, HttpBindError, ValueError, WorkerStartupError) as exc:
        print(f"rlt-serve: {exc}", file=sys.stderr)
        return 1
    finally:
        if http is not None:
            http.stop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if private_dir:
            shutil.rmtree(private_dir, ignore_errors=True)


def _start_http(args: argparse.Namespace, address: str, model: str) -> HttpProcess:
    """Bind the HTTP socket and start the HTTP server process (an IPC client of this server)."""
    from rlt_engine.http_api.process import HttpProcess

    http = HttpProcess(args.http_host, args.http_port, address, model, args.log_level)
    log.info("HTTP API on %s", http.url)
    return http.start()


def generate_parser() -> argparse.ArgumentParser:
    """The command line of `rlt-generate`."""
    parser = argparse.ArgumentParser(prog="rlt-generate", description=generate_main.__doc__,
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("prompt")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--connect", metavar="ADDRESS",
                      help="an rlt-serve address (ipc://PATH); no default: give it or --offline")
    mode.add_argument("--offline", action="store_true", help="run the engine in this process")
    parser.add_argument("--token-ids", action="store_true", help="print token ids and exit depths, not text")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, 0 for greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of "
                        "tokens whose probability reaches this (1.0: off)")
    parser.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: off)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end the text where this string starts (repeatable; default: none)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: drawn and printed)")
    parser.add_argument("--exit-threshold", type=float, default=None,
                        help="exit as soon as the policy's signal crosses this (Ouro: exit CDF; default: never early)")
    add_engine_options(parser, workers=0)
    return parser


def generate_main(argv: list[str] | None = None) -> int:
    """`rlt-generate --connect ipc://PATH PROMPT` (or `--offline`): stream the generated text to stdout."""
    parser = generate_parser()
    args = parser.parse_args(argv)
    from protocol.messages import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, stop=args.stop, seed=args.seed, exit_threshold=args.exit_threshold)
        config = None if args.connect else engine_config(args).resolved()  # a bad model or device fails here
        if config is not None:
            check_device_visible(config.device or "cpu")
    except ValueError as exc:
        parser.error(str(exc))
    try:
        if args.connect:
            return _generate_remote(args.connect, args.prompt, params, args.token_ids)
        return _generate_offline(config, args.prompt, params, args.token_ids)
    except KeyboardInterrupt:  # the stream's `with` (or the LLM's) has aborted the request on the way out
        print("\nrlt-generate: interrupted; the request was aborted", file=sys.stderr)
        return 130


def _generate_offline(config: EngineConfig, prompt: str, params: object, token_ids: bool) -> int:
    from rlt_engine.llm import LLM

    with LLM(**dataclasses.asdict(config)) as llm:
        output = llm.generate([prompt], params, use_tqdm=False)[0]  # type: ignore[arg-type]
    if token_ids:
        print("token_ids:", output.token_ids)
        print("exit_depths:", output.exit_depths)
    else:
        print(output.text)
    _summary(output)
    return 0


def _generate_remote(address: str, prompt: str, params: object, token_ids: bool) -> int:
    from rlt_engine.client import Client, EngineDeadError, RequestError

    with Client(address) as client:
        try:
            with client.stream(prompt, params) as stream:  # type: ignore[arg-type]
                for delta in stream:
                    if not token_ids:
                        sys.stdout.write(delta.text)
                        sys.stdout.flush()
        except (EngineDeadError, RequestError) as exc:
            print(f"\nrlt-generate: {exc}", file=sys.stderr)
            return 1
    output = stream.output
    if token_ids:
        print("token_ids:", output.token_ids)
        print("exit_depths:", output.exit_depths)
    else:
        print()
    _summary(output)
    return 0 if output.finish_reason != "error" else 1


def _summary(output: Any) -> None:
    mean = sum(output.exit_depths) / max(len(output.exit_depths), 1)
    print(f"[{len(output.token_ids)} tokens, mean loops/token {mean:.2f}, finish: {output.finish_reason}, "
          f"seed {output.seed}]", file=sys.stderr)


# `rlt-bench NAME …`: each benchmark is a module with main(argv) -> exit status.
BENCHMARKS = {
    "throughput": "rlt_engine.bench.throughput",
    "ipc": "rlt_engine.bench.ipc",
    "quality": "rlt_engine.bench.quality",
    "greedy": "rlt_engine.bench.greedy",
}


def bench_main(argv: list[str] | None = None) -> int:
    """`rlt-bench throughput|ipc|quality|greedy …`: run one benchmark (`rlt-bench NAME --help` for its options)."""
    import importlib

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: rlt-bench {{{'|'.join(BENCHMARKS)}}} …", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])


def worker_main(argv: list[str] | None = None) -> int:
    """`rlt-worker --connect tcp://HOST:PORT --curve-key FILE`: a worker for an engine on another host."""
    # The one place besides the executors where the engine package reaches into the worker's.
    from rlt_worker.worker_process import main as worker_process_main

    return worker_process_main(sys.argv[1:] if argv is None else argv)


COMMANDS = {"serve": serve_main, "generate": generate_main, "bench": bench_main, "worker": worker_main}


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
