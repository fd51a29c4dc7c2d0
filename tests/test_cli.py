"""The command lines a user meets first: --help, a bad --model or --device, rlt-generate's flags."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlt_engine.checkpoints import BUILT_IN, SHIPPED
from rlt_engine.cli import DefaultsFormatter, engine_config, generate_parser, serve_parser


@pytest.mark.parametrize("make", [serve_parser, generate_parser], ids=["rlt-serve", "rlt-generate"])
def test_help_shows_every_default(make):
    parser = make()
    formatter = DefaultsFormatter(parser.prog)
    missing = [a.option_strings[0] for a in parser._actions
               if a.option_strings and a.help != "show this help message and exit"
               and "default" not in formatter._expand_help(a) if a.help is not None]
    assert not missing, f"options whose --help gives no default: {missing}"
    text = parser.format_help()
    assert "(default: off)" in text and "(default: 16)" in text  # a switch; --block-size
    if make is generate_parser:
        workers = next(a for a in parser._actions if "--workers" in a.option_strings)
        assert workers.default == 0 and "(default: 0)" in formatter._expand_help(workers)


def test_built_in_model_names_are_the_workers():
    from rlt_worker.models.loader import SYNTHETIC_MODELS, TOY_MODELS

    assert set(BUILT_IN) == {*SHIPPED, *TOY_MODELS, *SYNTHETIC_MODELS}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,expected", [
    (["serve", "--model", "no-such-model", "--device", "cpu"], list(BUILT_IN)),
    (["generate", "--offline", "--model", "no-such-model", "--device", "cpu", "hi"], list(BUILT_IN)),
    (["serve", "--model", "toy-ouro", "--device", "gpu"], ["cpu, cuda or cuda:N"]),
])
def test_a_bad_model_or_device_fails_before_any_worker_starts(tmp_path, args, expected):
    """The check runs on the parsed options, so the command exits 2 with one usage error and
    starts no worker (a worker would log "ready" to stderr)."""
    done = subprocess.run([sys.executable, "-m", "rlt_engine.cli", *args, *(["--ipc", str(tmp_path / "s")]
                           if args[0] == "serve" else [])], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert all(name in last for name in expected), last
    assert "Traceback" not in done.stderr and "ready" not in done.stderr


def test_generate_passes_top_p_top_k_and_stop():
    args = generate_parser().parse_args(["--connect", "ipc:///x", "--top-p", "0.5", "--top-k", "7",
                                         "--stop", "\n\n", "--stop", "END", "hi"])
    assert (args.top_p, args.top_k, args.stop) == (0.5, 7, ["\n\n", "END"])


def test_prefix_caching_is_on_by_default_and_a_flag_turns_it_off():
    assert engine_config(serve_parser().parse_args([])).enable_prefix_caching
    assert not engine_config(serve_parser().parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in serve_parser().format_help()
