"""The OpenAI-compatible HTTP server of `rlt-serve --http-port`, end to end with real processes (CPU).

Two servers per module: `toy-ouro` with one worker process, and a checkpoint directory (the toy
weights, a byte-level tokenizer.json and a chat template) with an in-process worker and
--max-pending 2. Both listen on 127.0.0.1 with a port the OS picks (--http-port 0). Every
server tree is stopped by pid at teardown, even after a failure, and the test asserts that no
process and no socket file is left. Token equality uses float64 (SPEC §7a).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import ServerProcess, short_ipc_path

from protocol.messages import SamplingParams
from rlt_engine.client import Client
from rlt_engine.http_api.chat import load_chat_template
from rlt_engine.http_api.process import HttpProcess

# The dev extra installs these; an image without them (the GPU machine's) skips this module.
openai = pytest.importorskip("openai", reason="the HTTP tests need the openai client (pip install -e '.[dev]')")
pytest.importorskip("fastapi", reason="the HTTP server needs fastapi (a runtime dependency)")

log = logging.getLogger("test_http")

HTTP_LINE = "rlt-serve http on "
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


# --------------------------------------------------------------------------- servers


class HttpServer:
    """An rlt-serve process tree with its HTTP URL and an IPC client of the same engine."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        line = next(ln for ln in server.stdout_lines if ln.startswith(HTTP_LINE))
        self.url = line[len(HTTP_LINE):].strip()
        self.ipc = Client(server.address)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def wait_idle(self, timeout: float = 15.0) -> None:
        """Wait until the engine runs nothing and holds no KV block."""
        deadline = time.monotonic() + timeout
        while True:
            report = self.ipc.health()
            if report.running == 0 and report.waiting == 0 and all(w.kv_blocks_used == 0 for w in report.workers):
                return
            assert time.monotonic() < deadline, f"not idle after {timeout} s: {report}"
            time.sleep(0.05)


def _serve(tmp: Path, *args: str, workers: int):  # type: ignore[no-untyped-def]
    server = ServerProcess(short_ipc_path(tmp), "--http-port", "0", *args, workers=workers, log_dir=tmp)
    http = None
    try:
        server.start()
        http = HttpServer(server)
        yield http
    finally:
        if http is not None:
            http.ipc.close()
        server.stop()
        left = server.wait_tree_gone(10)
        assert not left, f"processes left behind: {[p.pid for p in left]}"
        assert not os.path.exists(server.ipc), "socket file left behind"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    yield from _serve(tmp_path_factory.mktemp("http-toy"), workers=1)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (what a byte-level tokenizer.json stores)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def write_chat_checkpoint(directory: Path) -> None:
    """toy-ouro's weights, a byte-level tokenizer.json (id = byte) and a chat template."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from rlt_worker.models.toy import toy_checkpoint

    config, weights = toy_checkpoint("toy-ouro")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])  # ids 256, 257: toy-ouro's BOS and EOS
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}))


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http-chat")
    write_chat_checkpoint(tmp / "ckpt")
    yield from _serve(tmp, "--model", str(tmp / "ckpt"), "--max-pending", "2", "--shutdown-timeout", "60", workers=0)


def metric_values(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed `name{label="v",…}` (also checks that the text parses)."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    values = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


def sse_events(lines: list[str]) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(120)
def test_openai_client_gets_the_ipc_clients_tokens(toy):
    oa = toy.openai()
    extra = {"top_k": 40, "exit_threshold": 0.3, "min_loops": 1}
    cases = [("The loop", 5), ([72, 101, 108, 108, 111], 6)]
    for prompt, seed in cases:
        params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=seed, logprobs=1, **extra)
        want = toy.ipc.generate(prompt, params)
        kwargs = dict(model="toy-ouro", prompt=prompt, max_tokens=12, temperature=0.9, top_p=0.95, seed=seed,
                      logprobs=1, extra_body=extra)
        got = oa.completions.create(**kwargs)
        choice = got.choices[0]
        assert (choice.token_ids, choice.exit_depths, choice.text) == (want.token_ids, want.exit_depths, want.text)
        assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-12)
        assert choice.finish_reason == want.finish_reason and choice.seed == seed
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.prompt_tokens == (len(prompt.encode()) if isinstance(prompt, str) else len(prompt))

        ids, depths, text, chunks = [], [], "", list(oa.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}))
        for chunk in chunks[:-1]:
            (c,) = chunk.choices
            ids += c.token_ids
            depths += c.exit_depths
            text += c.text
        assert (ids, depths, text) == (want.token_ids, want.exit_depths, want.text)
        assert chunks[-2].choices[0].finish_reason == want.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    log.info("exit depths seen: %s", sorted(set(depths)))
    # A stop string cuts the text and ends the request, as on the IPC path.
    base = toy.ipc.generate("stop here", SamplingParams(max_tokens=16, seed=2))
    stop = next((ch for ch in base.text[2:] if ch.isascii() and ch.isprintable()), None)
    if stop is not None:
        want = toy.ipc.generate("stop here", SamplingParams(max_tokens=16, seed=2, stop=[stop]))
        got = oa.completions.create(model="toy-ouro", prompt="stop here", max_tokens=16, seed=2, stop=stop)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, "stop")


@pytest.mark.timeout(120)
def test_batch_prompt_gives_one_choice_each(toy):
    params = SamplingParams(max_tokens=5, seed=9, temperature=0.7)
    prompts = ["one", "two", "three"]
    want = [toy.ipc.generate(p, params).token_ids for p in prompts]
    body = {"prompt": prompts, "max_tokens": 5, "seed": 9, "temperature": 0.7}
    response = httpx.post(f"{toy.url}/v1/completions", json=body, timeout=60).json()
    assert [c["token_ids"] for c in sorted(response["choices"], key=lambda c: c["index"])] == want
    with httpx.stream("POST", f"{toy.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for event in events[:-1]:
        for c in event["choices"]:
            got[c["index"]] += c["token_ids"]
    assert [got[i] for i in range(3)] == want


@pytest.mark.timeout(120)
def test_error_codes(toy):
    url = f"{toy.url}/v1/completions"
    bad = {
        "unknown field": {"prompt": "x", "bogus": 1},
        "wrong type": {"prompt": "x", "max_tokens": "many"},
        "max_tokens < 1": {"prompt": "x", "max_tokens": 0},
        "min_loops > max_loops": {"prompt": "x", "min_loops": 3, "max_loops": 2},
        "max_loops > D": {"prompt": "x", "max_loops": 99},
        "logprobs 5": {"prompt": "x", "logprobs": 5},
        "n 2": {"prompt": "x", "n": 2},
        "too long": {"prompt": "x" * 600},
        "empty prompt": {"prompt": ""},
    }
    for name, body in bad.items():
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (name, error)
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(url, json={"model": "gpt-4", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{toy.url}/v1/nothing", timeout=30).status_code == 404
    big = b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    r = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # The official client maps them to its exception types.
    oa = toy.openai()
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="chat template"):
        oa.chat.completions.create(model="toy-ouro", messages=[{"role": "user", "content": "hi"}])
    toy.wait_idle()


@pytest.mark.timeout(120)
def test_disconnect_mid_stream_aborts_the_request(toy):
    toy.wait_idle()
    before = metric_values(toy.url).get('rlt_requests_total{finish_reason="abort"}', 0.0)
    body = {"prompt": "long one", "max_tokens": 400, "ignore_eos": True, "stream": True, "seed": 1}
    with httpx.stream("POST", f"{toy.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen == 3:
                break
        assert toy.ipc.health().running == 1
    # Leaving the `with` closed the connection mid-stream.
    start = time.monotonic()
    toy.wait_idle()
    log.info("KV back at baseline %.3f s after the disconnect", time.monotonic() - start)
    assert metric_values(toy.url)['rlt_requests_total{finish_reason="abort"}'] == before + 1


@pytest.mark.timeout(120)
def test_fifty_concurrent_streams_complete(toy):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[list[int], str | None, bool]:
        body = {"prompt": f"stream {i}", "max_tokens": 8, "seed": i, "stream": True, "ignore_eos": True}
        ids: list[int] = []
        reason, done = None, False
        async with client.stream("POST", f"{toy.url}/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    (c,) = json.loads(line[6:])["choices"]
                    ids += c["token_ids"]
                    reason = c["finish_reason"] or reason
        return ids, reason, done

    async def run() -> list[tuple[list[int], str | None, bool]]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=90) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    start = time.monotonic()
    results = asyncio.run(run())
    log.info("50 concurrent streams of 8 tokens took %.2f s", time.monotonic() - start)
    assert all(len(ids) == 8 and reason == "length" and done for ids, reason, done in results)
    want = toy.ipc.generate("stream 7", SamplingParams(max_tokens=8, seed=7, ignore_eos=True))
    assert results[7][0] == want.token_ids
    toy.wait_idle()


@pytest.mark.timeout(120)
def test_metrics_move_as_requests_run(toy):
    before = metric_values(toy.url)
    body = {"prompt": "count me", "max_tokens": 6, "ignore_eos": True, "exit_threshold": 0.3, "seed": 4}
    assert httpx.post(f"{toy.url}/v1/completions", json=body, timeout=60).status_code == 200
    after = metric_values(toy.url)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved('rlt_requests_total{finish_reason="length"}') == 1
    assert moved("rlt_prompt_tokens_total") == len(b"count me")
    assert moved("rlt_generation_tokens_total") == 6
    assert moved("rlt_time_to_first_token_seconds_count") == 1
    assert moved("rlt_e2e_request_latency_seconds_count") == 1
    assert moved("rlt_inter_token_latency_seconds_count") >= 1
    assert moved("rlt_loops_per_token_count") == 6
    assert after["rlt_engine_up"] == 1 and after["rlt_workers_alive"] == 1
    assert after['rlt_kv_blocks_total{worker="0"}'] > 0 and 'rlt_kv_usage_ratio{worker="0"}' in after
    for name in ("rlt_worker_restarts_total", "rlt_replays_total", "rlt_preemptions_total",
                 'rlt_requests_rejected_total{status="400"}'):
        assert name in after, name


@pytest.mark.timeout(120)
def test_a_repeated_prompt_reports_its_cached_tokens_and_moves_the_hit_counters(toy):
    """40 prompt tokens, block size 16: the second request finds the two blocks before the last position."""
    before = metric_values(toy.url)
    prompt = [(11 * i) % 256 for i in range(40)]
    usages = [toy.openai().completions.create(model="toy-ouro", prompt=prompt, max_tokens=2, seed=1).usage
              for _ in range(2)]
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, 32]
    after = metric_values(toy.url)
    assert after["rlt_prefix_cache_hits_total"] - before.get("rlt_prefix_cache_hits_total", 0) == 32
    assert after["rlt_prefix_cache_queries_total"] - before.get("rlt_prefix_cache_queries_total", 0) == 80
    assert 0 < after["rlt_prefix_cache_hit_ratio"] <= 1 and after['rlt_kv_blocks_cached{worker="0"}'] > 0
    toy.wait_idle()


@pytest.mark.timeout(120)
def test_health_and_models(toy):
    r = httpx.get(f"{toy.url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert [m.id for m in toy.openai().models.list().data] == ["toy-ouro"]


@pytest.mark.timeout(60)
def test_health_is_503_without_a_ready_engine(tmp_path):
    """The HTTP process alone, its engine not (yet) there: /health answers 503, completions 503."""
    http = HttpProcess("127.0.0.1", 0, f"ipc://{short_ipc_path(tmp_path, 'none.sock')}", "toy-ouro").start()
    try:
        r = httpx.get(f"{http.url}/health", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        assert http.proc is not None
        maps = Path(f"/proc/{http.proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "the HTTP process imported torch"
    finally:
        http.stop()
    assert http.proc is not None and http.proc.poll() is not None


def test_http_port_in_use_fails_fast(tmp_path):
    http = HttpProcess("127.0.0.1", 0, "ipc:///nonexistent", "toy-ouro")  # bound, never started
    try:
        cmd = [sys.executable, "-m", "rlt_engine.cli", "serve", "--device", "cpu", "--http-port", str(http.port),
               "--ipc", short_ipc_path(tmp_path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        http.stop()
    assert done.returncode == 1 and "cannot listen" in done.stderr, done.stderr[-2000:]


@pytest.mark.timeout(120)
def test_chat_completions_with_a_template(chat):
    template = load_chat_template(chat.server.args[chat.server.args.index("--model") + 1])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi!"}]
    prompt = template.render(messages)
    assert prompt == "<s><system>be brief\n<user>Hi!\n<assistant>"
    params = SamplingParams(max_tokens=10, seed=3, temperature=0.8)
    oa = chat.openai()
    model = oa.models.list().data[0].id
    with Client(chat.server.address) as ipc:
        want = ipc.generate(prompt, params)
    got = oa.chat.completions.create(model=model, messages=messages, max_tokens=10, seed=3, temperature=0.8)
    (choice,) = got.choices
    assert (choice.token_ids, choice.message.content, choice.message.role) == (want.token_ids, want.text, "assistant")
    assert got.usage.prompt_tokens == len(prompt.encode()) - len("<s>") + 1  # <s> is one special token
    chunks = list(oa.chat.completions.create(model=model, messages=messages, max_tokens=10, seed=3, temperature=0.8,
                                             stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert sum((c.choices[0].token_ids for c in chunks), []) == want.token_ids


@pytest.mark.timeout(120)
def test_overflowing_ints_and_lone_surrogates_are_400s_and_counted(chat):
    """Well-formed JSON that the engine could never take (ints beyond 64 bits, text with a lone
    surrogate, which the tokenizers library cannot even receive) is a 400 with OpenAI-style JSON,
    and every refusal counts in rlt_requests_rejected_total."""
    url = f"{chat.url}/v1/completions"
    bodies = {
        "max_tokens 10^30": '{"prompt": "hi", "max_tokens": 1000000000000000000000000000000}',
        "lone surrogate": '{"prompt": "\\udc80", "max_tokens": 2}',
        "lone surrogate in a batch": '{"prompt": ["ok", "\\udc80"], "max_tokens": 2}',
        "surrogate in stop": '{"prompt": "hi", "max_tokens": 2, "stop": "\\udc80"}',
        "token id 10^30": '{"prompt": [1, 1000000000000000000000000000000], "max_tokens": 2}',
        "top_k 10^30": '{"prompt": "hi", "max_tokens": 2, "top_k": 1000000000000000000000000000000}',
    }
    before = metric_values(chat.url).get('rlt_requests_rejected_total{status="400"}', 0.0)
    for name, body in bodies.items():
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (name, r.status_code, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (name, error)
    r = httpx.post(f"{chat.url}/v1/chat/completions", timeout=30, headers={"content-type": "application/json"},
                   content='{"messages": [{"role": "user", "content": "\\udc80"}], "max_tokens": 2}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    after = metric_values(chat.url).get('rlt_requests_rejected_total{status="400"}', 0.0)
    assert after - before == len(bodies) + 1
    chat.wait_idle()


@pytest.mark.timeout(120)
def test_over_max_pending_is_429_with_retry_after(chat):
    chat.wait_idle()
    url = f"{chat.url}/v1/completions"
    body = {"prompt": "hold", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, contextlib.ExitStack() as open_streams:
        lines = []  # kept: a dropped line iterator closes its connection, which aborts the request
        for _ in range(2):  # both admitted: their first chunk arrived
            r = open_streams.enter_context(client.stream("POST", url, json=body))
            assert r.status_code == 200
            lines.append(r.iter_lines())
            next(lines[-1])
        r = client.post(url, json={"prompt": "one more", "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
    chat.wait_idle()  # closing the two streams aborted them
    r = httpx.post(url, json={"prompt": "now", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


@pytest.mark.timeout(120)
def test_a_killed_http_process_is_replaced_on_the_same_port(chat):
    (old,) = [p for p in psutil.Process(chat.server.pid).children() if "rlt_engine.http_api" in " ".join(p.cmdline())]
    old.kill()
    start = time.monotonic()
    r = httpx.get(f"{chat.url}/health", timeout=30)  # waits in the listen backlog for the replacement
    log.info("HTTP served again %.2f s after its process was killed", time.monotonic() - start)
    assert r.status_code == 200
    chat.server.refresh_tree()
    assert not old.is_running() or old.status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(120)
def test_sigterm_drains_http_streams_then_exits(chat):
    """Last on `chat`: SIGTERM lets an open stream finish (/health says draining meanwhile), exit 0."""
    chat.wait_idle()
    body = {"prompt": "drain me", "max_tokens": 24, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{chat.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        events = [json.loads(next(lines)[6:])]
        chat.server.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{chat.url}/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "/health never reported the drain"
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        events += sse_events(list(lines))
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 24
    assert chat.server.wait(30) == 0
    assert not chat.server.wait_tree_gone(10)
