"""The README's user-facing commands run the way a user runs them: as subprocesses of the installed ``hierspec``.

``make demo`` broke once while every in-process test stayed green (the demo built its drafter without the target),
so these tests go through the console script, with the default model and default method where the README does.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hierspec.demo import DEMO_PROMPTS
from tiny import save_model_dir

MAX_TOKENS = "12"
#: one worker runs the whole module (the test command distributes tests one by one, groups whole): the demo runs once
pytestmark = pytest.mark.xdist_group("entry-points")


def _hierspec() -> str:
    """The installed console script (the one ``make demo`` calls), next to this interpreter."""
    beside = Path(sys.executable).with_name("hierspec")
    found = str(beside) if beside.is_file() else shutil.which("hierspec")
    if found is None:
        pytest.fail("the hierspec console script is not installed (pip install -e .)")
    return found


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([_hierspec(), *args], capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


@pytest.fixture(scope="module")
def demo():
    """``hierspec demo`` with its defaults (the default model and method), fewer tokens."""
    return _run("demo", "--max-new-tokens", MAX_TOKENS)


@pytest.mark.slow
def test_demo_with_defaults_prints_its_table(demo):
    assert demo.returncode == 0, demo.stderr
    lines = demo.stdout.splitlines()
    assert lines[0].startswith("model: SmolLM2-135M-Instruct")
    assert lines[1].split()[:3] == ["prompt", "ar", "tok/s"] and "hd tok/s" in lines[1]
    rows = [line.split() for line in lines[2:2 + len(DEMO_PROMPTS)]]
    assert [row[0] for row in rows] == [str(i) for i in range(1, len(DEMO_PROMPTS) + 1)]
    assert all(row[-1] == "yes" for row in rows), demo.stdout
    assert f"outputs identical on {len(DEMO_PROMPTS)}/{len(DEMO_PROMPTS)} prompts" in demo.stdout
    assert "Traceback" not in demo.stderr


@pytest.mark.slow
def test_generate_with_the_default_method_equals_plain_decoding_and_the_demo(demo):
    assert demo.returncode == 0, demo.stderr
    prompt = DEMO_PROMPTS[-1]
    default = _run("generate", prompt, "--max-new-tokens", MAX_TOKENS, "--json")
    plain = _run("generate", prompt, "--max-new-tokens", MAX_TOKENS, "--method", "ar", "--json")
    assert default.returncode == 0 and plain.returncode == 0, default.stderr + plain.stderr
    ours, reference = json.loads(default.stdout), json.loads(plain.stdout)
    assert len(ours["token_ids"]) == int(MAX_TOKENS)
    assert ours["token_ids"] == reference["token_ids"]
    assert ours["text"].strip()
    assert demo.stdout.rstrip().endswith(ours["text"].rstrip())  # the demo's last answer, same prompt and length


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(save_model_dir(tmp_path_factory.mktemp("tiny-serve"), vocab_size=64, seed=5, max_positions=128))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_command_answers_like_generate(tiny_model):
    """``hierspec serve`` (default method hd) started as a user starts it answers a completion with the text that
    ``hierspec generate --raw`` prints for the same prompt."""
    port = _free_port()
    server = subprocess.Popen([_hierspec(), "serve", "--model", tiny_model, "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        model_id = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        reply = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": model_id, "prompt": "w1 w2 w3 w1 w2", "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text
        served = reply.json()["choices"][0]["text"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    generated = _run("generate", "w1 w2 w3 w1 w2", "--model", tiny_model, "--raw", "--max-new-tokens", "8", "--json")
    assert generated.returncode == 0, generated.stderr
    assert served == json.loads(generated.stdout)["text"]


def test_demo_command_on_another_model_and_method(tiny_model):
    """The demo's options reach the drafter the same way as generate's (``--method``, ``--datastore``)."""
    done = _run("demo", "--model", tiny_model, "--method", "pld", "--max-new-tokens", "6")
    assert done.returncode == 0, done.stderr
    assert "pld tok/s" in done.stdout and "outputs identical on 3/3 prompts" in done.stdout
    refused = _run("demo", "--model", tiny_model, "--method", "rest")
    assert refused.returncode == 2
    assert "needs a 'suffix' datastore" in refused.stderr and "Traceback" not in refused.stderr
