"""The OpenAI-compatible server, live on 127.0.0.1 with a tiny model: the official client, bad input, queueing,
disconnects, API keys and a bounded load test."""

import concurrent.futures
import json
import re
import statistics
import threading
import time

import httpx
import numpy as np
import openai
import pytest

import hierspec
from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.drafters.hierarchy import HierarchyDrafter
from hierspec.drafters.base import Drafter
from hierspec.tree import root_only
from live_server import MODEL, LiveServer
from tiny import make_target


class GatedDrafter(Drafter):
    """Plain decoding that waits on a gate at the start of each generation and sleeps a little per step."""

    name = "gated"

    def __init__(self, step_sleep: float = 0.0) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.step_sleep = step_sleep
        self.started = threading.Event()

    def begin(self, prompt) -> None:
        self.started.set()
        self.gate.wait(timeout=30)

    def propose(self, context, budget):
        time.sleep(self.step_sleep)
        return root_only(int(context[-1]))


@pytest.fixture(scope="module")
def target():
    target = make_target("llama", vocab_size=64, seed=5, max_positions=128)
    target.tokenizer.chat_template = "{% for m in messages %}w60 {{ m['content'] }} w61 {% endfor %}w62"
    return target


@pytest.fixture(scope="module")
def endless_target():
    """A target that never stops at end-of-sequence, for generations that must run their full length."""
    target = make_target("llama", vocab_size=64, seed=5, max_positions=256)
    target.eos_token_ids = frozenset()
    return target


@pytest.fixture(scope="module")
def live(target):
    # hd, the default, one drafter per concurrent request (its context DB is per request); requests are batched
    with LiveServer(target, HierarchyDrafter) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _reference(target, ids, max_tokens):
    result = SpeculativeDecoder(target, NoDrafter()).generate(ids, GenerationConfig(max_new_tokens=max_tokens))
    return result


def test_completion_matches_plain_decoding(client, target):
    response = client.completions.create(model=MODEL, prompt="w1 w2 w3 w1 w2", max_tokens=12, temperature=0)
    reference = _reference(target, target.encode_prompt("w1 w2 w3 w1 w2", raw=True), 12)
    assert response.choices[0].text == reference.text
    assert hierspec.generate(target, "w1 w2 w3 w1 w2", method="pld", raw=True, max_new_tokens=12).text == reference.text
    assert response.choices[0].finish_reason == ("length" if reference.finish_reason == "length" else "stop")
    assert response.usage.completion_tokens == len(reference.token_ids)
    assert response.usage.prompt_tokens == 5 and response.usage.total_tokens == 5 + len(reference.token_ids)


def test_chat_matches_plain_decoding_and_streams_the_same_text(client, target):
    messages = [{"role": "user", "content": "w7 w8 w9"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    reference = _reference(target, target.encode_messages(messages), 10)
    assert response.choices[0].message.content == reference.text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.completion_tokens == len(reference.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [response.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(reference.token_ids)


def test_completion_stream_and_stop_strings(client, target):
    reference = _reference(target, target.encode_prompt("w3 w4", raw=True), 16)
    words = reference.text.split()
    assert len(words) > 3
    stop = words[3]
    response = client.completions.create(model=MODEL, prompt="w3 w4", max_tokens=16, temperature=0, stop=[stop])
    assert response.choices[0].finish_reason == "stop"
    assert stop not in response.choices[0].text and reference.text.startswith(response.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="w3 w4", max_tokens=16, temperature=0, stop=stop, stream=True))
    assert streamed == response.choices[0].text


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL, prompt="w2 w9", max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_models_health_and_metrics(client, live):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=3, temperature=0)
    text = httpx.get(f"{live.url}/metrics").text
    for name in ("hierspec_requests_total", "hierspec_generated_tokens_total", "hierspec_mean_accepted_tokens",
                 "hierspec_queue_length", "hierspec_request_latency_seconds_bucket",
                 "hierspec_generation_request_seconds_bucket"):
        assert name in text
    generated = float(re.search(r"^hierspec_generated_tokens_total (\S+)$", text, re.M).group(1))
    assert generated >= 1


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", {"prompt": "w1"}, 400, "model"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": "x"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": -3}, 400, "max_tokens must be >= 1"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": 10_000}, 400, "maximum context length"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1 " * 200}, 400, "context"),
    ("/v1/completions", {"model": MODEL, "prompt": "   "}, 400, "empty"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "w1"}, 404, "does not exist"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "n": 2}, 400, "n = 1"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "at least one message"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "w1"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "w1"}, 400, "messages"),
])
def test_bad_input_gets_openai_error_json(live, path, body, status, fragment):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{live.url}{path}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"]


def test_api_key_is_enforced(target):
    with LiveServer(target, NoDrafter(), api_key="s3cret") as server:
        body = {"model": MODEL, "prompt": "w1", "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 401
        wrong = httpx.post(f"{server.url}/v1/completions", json=body, headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="w1", max_tokens=2, temperature=0).usage.total_tokens > 0
        assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key


def test_full_queue_gives_429_and_requests_run_in_order(target):
    drafter = GatedDrafter()
    drafter.gate.clear()
    with LiveServer(target, drafter, max_queue=1) as server:
        body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 3, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=30)
            assert drafter.started.wait(10)  # the worker holds the first request
            second = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=30)
            deadline = time.monotonic() + 10
            while server.engine.queue_length < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            third = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
            assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
            drafter.gate.set()
            assert first.result().status_code == 200 and second.result().status_code == 200
            assert first.result().json()["choices"][0]["text"] == second.result().json()["choices"][0]["text"]


def test_a_client_disconnect_stops_the_generation(endless_target):
    drafter = GatedDrafter(step_sleep=0.05)
    with LiveServer(endless_target, drafter) as server:
        body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 100, "temperature": 0, "stream": True}
        start = time.monotonic()
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk, then hang up
        quick = httpx.post(f"{server.url}/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "w3", "max_tokens": 2, "temperature": 0})
        assert quick.status_code == 200
        # 100 steps of 50 ms would take 5 s: the abandoned generation was stopped, not finished
        assert time.monotonic() - start < 4.0
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "hierspec_cancelled_generations_total 1.0" in metrics


def test_timeout_gives_504(endless_target):
    with LiveServer(endless_target, GatedDrafter(step_sleep=0.05), timeout_s=0.3) as server:
        response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "w1", "max_tokens": 100, "temperature": 0})
        assert response.status_code == 504 and "timed out" in response.json()["error"]["message"]


class SnapshotDrafter(HierarchyDrafter):
    """HD that records its context database as the first draft step of each request sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.first_views: list[dict] = []
        self._fresh = False

    def begin(self, prompt) -> None:
        super().begin(prompt)
        self._fresh = True

    def propose(self, context, budget):
        if self._fresh:
            self.first_views.append(self.context_db.snapshot())
            self._fresh = False
        return super().propose(context, budget)


def test_per_request_state_does_not_leak(target):
    drafter = SnapshotDrafter()
    with LiveServer(target, drafter) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)
        client.completions.create(model=MODEL, prompt="w1 w2 w3 w1 w2 w3 w4 w5", max_tokens=12, temperature=0)
        client.completions.create(model=MODEL, prompt="w40 w41 w42", max_tokens=12, temperature=0)
    assert len(drafter.first_views) == 2
    fresh = HierarchyDrafter()
    fresh.begin(np.asarray(target.encode_prompt("w40 w41 w42", raw=True), dtype=np.int64))
    assert drafter.first_views[1] == fresh.context_db.snapshot()  # only the second prompt, nothing of the first
    assert drafter.first_views[0] and drafter.first_views[0] != drafter.first_views[1]


def test_bounded_load(live, target):
    """16 concurrent clients, 4 requests each, answered in batches: every answer complete, well formed and equal
    to plain decoding alone; prints throughput."""
    clients, per_client, max_tokens = 16, 4, 8
    before = dict(live.engine.scheduler.batch_sizes)
    prompts = [f"w{i % 50 + 1} w{(i * 3) % 50 + 1} w{(i * 7) % 50 + 1}" for i in range(clients * per_client)]
    expected = {p: _reference(target, target.encode_prompt(p, raw=True), max_tokens).text for p in set(prompts)}

    def worker(index):
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0, timeout=60)
        latencies = []
        for j in range(per_client):
            prompt = prompts[index * per_client + j]
            start = time.perf_counter()
            response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
            latencies.append(time.perf_counter() - start)
            assert response.choices[0].text == expected[prompt]
            assert response.usage.completion_tokens >= 1
        return latencies

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        latencies = [t for result in pool.map(worker, range(clients)) for t in result]
    wall = time.perf_counter() - start
    assert len(latencies) == clients * per_client
    batched = {size: count - before.get(size, 0) for size, count in live.engine.scheduler.batch_sizes.items()}
    assert max(size for size, count in batched.items() if count) > 1, "the concurrent requests were never batched"
    p50, p99 = statistics.median(latencies), float(np.percentile(latencies, 99))
    print(f"\nload: {len(latencies)} requests from {clients} clients in {wall:.2f} s = "
          f"{len(latencies) / wall:.1f} requests/s; latency p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")


def test_streams_of_concurrent_clients_are_batched_and_equal_their_answers_alone(live, target):
    """Eight streaming and eight plain clients at once, with different lengths, while a ninth client drops its stream
    after the first chunk: every other answer is its plain-decoding answer alone, streamed text included, and the
    response carries its own acceptance figures."""
    prompts = [f"w{i + 1} w{(i * 5) % 40 + 2} w{i + 1} w{(i * 5) % 40 + 2}" for i in range(16)]
    lengths = [6 + (i * 7) % 20 for i in range(16)]
    expected = [_reference(target, target.encode_prompt(p, raw=True), n).text for p, n in zip(prompts, lengths)]

    def one(index):
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0, timeout=60)
        if index % 2:
            chunks = client.completions.create(model=MODEL, prompt=prompts[index], max_tokens=lengths[index],
                                               temperature=0, stream=True)
            return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        response = client.completions.with_raw_response.create(model=MODEL, prompt=prompts[index],
                                                               max_tokens=lengths[index], temperature=0)
        figures = json.loads(response.text)["hierspec"]
        assert figures["target_forwards"] >= 1 and figures["mean_accepted_tokens"] >= 1
        return response.parse().choices[0].text

    def dropper():
        with httpx.stream("POST", f"{live.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "w3 w4 w5", "max_tokens": 60, "stream": True}) as reply:
            for _ in reply.iter_lines():
                break  # gone after the first chunk

    before = dict(live.engine.scheduler.batch_sizes)
    with concurrent.futures.ThreadPoolExecutor(17) as pool:
        dropped = pool.submit(dropper)
        answers = list(pool.map(one, range(16)))
        dropped.result()
    assert answers == expected
    batched = {size: count - before.get(size, 0) for size, count in live.engine.scheduler.batch_sizes.items()}
    assert max(size for size, count in batched.items() if count) >= 4
    deadline = time.monotonic() + 10
    while live.engine.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.engine.running == 0, "the dropped stream's generation kept running"


def test_a_failed_batch_step_ends_its_requests_and_takes_them_out_of_the_batch(target):
    """A step that raises (outside the scheduler's own per-request handling) is reported to every running job, and
    their requests leave the batch: nothing generates on for a client that was already told it failed."""
    import asyncio

    from hierspec.batching import BatchConfig, BatchScheduler
    from hierspec.server.engine import Engine

    scheduler = BatchScheduler(target, NoDrafter, BatchConfig(max_batch=4))
    real_step = scheduler.step
    calls = {"n": 0}

    def failing_once():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("the forward broke")
        return real_step()

    scheduler.step = failing_once
    engine = Engine(scheduler, max_queue=8)

    async def run():
        jobs = [engine.submit([1, 2, 3 + i], GenerationConfig(max_new_tokens=200, stop_at_eos=False))
                for i in range(3)]
        outcomes = [[item async for item in job.items()] for job in jobs]
        return outcomes, scheduler.running

    try:
        outcomes, running = asyncio.run(run())
    finally:
        engine.close()
    for items in outcomes:
        assert isinstance(items[-1], RuntimeError) and str(items[-1]) == "the forward broke"
    assert running == 0 and scheduler.idle
    assert calls["n"] == 3  # no step after the failure: the failed requests did not generate on
