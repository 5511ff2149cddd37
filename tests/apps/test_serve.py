"""`hf-specformer serve`, live on 127.0.0.1 with the real `openai` client: greedy answers equal plain `generate`,
streamed and not; seeded answers independent of the batch; stop strings; cancellation; overload; bad input."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import uvicorn
from conftest import CHAT_PROMPTS, make_drafter, tiny_chat_target

from hf_specformer.apps.serve import Engine, build_app

KEY = "test-key"
MAX_TOKENS = 24


@contextlib.contextmanager
def live_server(engine: Engine, **app_kwargs):
    """`engine` behind a live server on a free port of 127.0.0.1; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "tiny", **app_kwargs), host="127.0.0.1", port=port,
                                           log_level="warning"))
    engine.start()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        engine.stop(10)


@pytest.fixture(scope="module")
def served(tokenizer):
    """A live server: a tiny float64 chat target, a random drafter, 4 rows and 4 waiting, a key, 4 KiB bodies."""
    target = tiny_chat_target(tokenizer)
    engine = Engine(target, tokenizer, make_drafter(target), max_batch_size=4, max_prompt_tokens=64,
                    max_tokens=MAX_TOKENS, max_waiting=4)
    with live_server(engine, api_key=KEY, max_body_bytes=4096) as url:
        yield engine, target, url


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[2] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def http(url: str, body=None, key: str | None = KEY) -> tuple[int, dict, dict]:
    """A plain HTTP call (GET, or POST of `body`: bytes or JSON) -> (status, headers, JSON answer)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(
        {"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def reference(target, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                           do_sample=False)[0, len(prompt_ids):].tolist()


def chat_reference(target, tokenizer, content: str, max_new_tokens: int) -> str:
    text = tokenizer.apply_chat_template(chat(content), tokenize=False, add_generation_prompt=True)
    tokens = reference(target, tokenizer, tokenizer(text, add_special_tokens=False).input_ids, max_new_tokens)
    return tokenizer.decode(tokens, skip_special_tokens=True)


def wait_idle(engine: Engine, seconds: float = 30) -> None:
    end = time.time() + seconds
    while engine.in_flight and time.time() < end:
        time.sleep(0.05)
    assert engine.in_flight == 0


def test_concurrent_greedy_answers_equal_plain_generate(served, client, tokenizer):
    """Eight chat requests at once on 4 rows (so some join the running call), half streamed: each answer is plain
    `generate`'s, and its usage counts its tokens."""
    engine, target, _ = served
    lengths = [5, 24, 9, 17, 24, 3, 12, 20]

    def ask(i: int):
        kwargs = dict(model="tiny", messages=chat(CHAT_PROMPTS[i % len(CHAT_PROMPTS)] + " " * (i // 6)),
                      max_tokens=lengths[i], temperature=0)
        if i % 2:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason, \
                chunks[-1].usage
        answer = client.chat.completions.create(**kwargs)
        return answer.choices[0].message.content, answer.choices[0].finish_reason, answer.usage

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    for i, (text, reason, usage) in enumerate(answers):
        content = CHAT_PROMPTS[i % len(CHAT_PROMPTS)] + " " * (i // 6)
        assert text == chat_reference(target, tokenizer, content, lengths[i]), i
        assert reason == "length" and usage.completion_tokens == lengths[i]
        assert usage.completion_tokens_details.accepted_prediction_tokens >= 0
    assert engine.metrics["peak_rows"] == 4  # rows decoded together, in every slot
    wait_idle(engine)


def test_completions_endpoint_and_models(served, client, tokenizer):
    engine, target, _ = served
    answer = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=10, temperature=0)
    ids = tokenizer("The capital of France is").input_ids
    assert answer.choices[0].text == tokenizer.decode(reference(target, tokenizer, ids, 10), skip_special_tokens=True)
    streamed = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=10,
                                         temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == answer.choices[0].text
    assert [model.id for model in client.models.list()] == ["tiny"]


def test_stop_string_cuts_the_answer(served, client, tokenizer):
    _, target, _ = served
    full = chat_reference(target, tokenizer, CHAT_PROMPTS[1], MAX_TOKENS)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    answer = client.chat.completions.create(model="tiny", messages=chat(CHAT_PROMPTS[1]), max_tokens=MAX_TOKENS,
                                            temperature=0, stop=[stop])
    assert answer.choices[0].message.content == full[: full.find(stop)]
    assert answer.choices[0].finish_reason == "stop"


def test_seeded_sampling_does_not_depend_on_the_batch(served, client):
    """A seeded answer alone, then beside three others: the same text; another seed gives another."""
    engine, _, _ = served

    def ask(seed: int, content: str = CHAT_PROMPTS[2]) -> str:
        return client.chat.completions.create(model="tiny", messages=chat(content), max_tokens=16, temperature=0.9,
                                              top_p=0.95, seed=seed).choices[0].message.content

    alone = ask(7)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda i: ask(7) if i == 0 else ask(i, CHAT_PROMPTS[i]), range(4)))
    assert together[0] == alone
    assert ask(8) != alone
    wait_idle(engine)


def test_a_client_that_leaves_mid_stream_frees_its_slot(served, client, tokenizer):
    """Four long streams, two closed after their first chunks: the slots come free and the others' answers are
    unchanged."""
    engine, target, _ = served
    kwargs = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0, stream=True)

    def ask(i: int):
        stream = client.chat.completions.create(messages=chat(CHAT_PROMPTS[i]), **kwargs)
        if i % 2:
            next(iter(stream))
            stream.close()
            return None
        return "".join(c.choices[0].delta.content or "" for c in stream)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    for i in (0, 2):
        assert answers[i] == chat_reference(target, tokenizer, CHAT_PROMPTS[i], MAX_TOKENS)
    wait_idle(engine)
    assert not engine.requests


def test_a_client_that_leaves_a_whole_answer_frees_its_slot(tokenizer):
    """A non-streamed request for 3,000 plain tokens whose client gives up after 0.3 s: its row ends long before
    its answer would have, and the server answers the next request."""
    target = tiny_chat_target(tokenizer)
    target.config.max_position_embeddings = 4096  # (rotary embeddings do not depend on it)
    engine = Engine(target, tokenizer, max_batch_size=2, max_prompt_tokens=32, max_tokens=3000)
    with live_server(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model="tiny", messages=chat("Hi"), max_tokens=3000, temperature=0)
        wait_idle(engine, 2)
        assert engine.metrics["left"] == 1 and engine.metrics["tokens"] < 1000
        answer = client.with_options(timeout=60).chat.completions.create(model="tiny", messages=chat("Hi"),
                                                                          max_tokens=4, temperature=0)
        assert answer.choices[0].message.content == chat_reference(target, tokenizer, "Hi", 4)


def test_overload_is_answered_with_429(served, tokenizer):
    """More requests than rows and waiting places: the surplus get 429 with Retry-After, the others their answers."""
    engine, target, url = served
    body = {"model": "tiny", "messages": chat(CHAT_PROMPTS[4]), "max_tokens": MAX_TOKENS, "temperature": 0}
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda _: http(url + "/v1/chat/completions", body), range(16)))
    codes = [status for status, _, _ in responses]
    assert set(codes) == {200, 429} and codes.count(200) >= 8
    _, headers, refused = next(response for response in responses if response[0] == 429)
    assert headers["retry-after"] == "1" and refused["error"]["code"] == "rate_limit_exceeded"
    expected = chat_reference(target, tokenizer, CHAT_PROMPTS[4], MAX_TOKENS)
    got = [answer["choices"][0]["message"]["content"] for status, _, answer in responses if status == 200]
    assert got == [expected] * len(got), (expected, got)
    wait_idle(engine)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": "tiny"}, 400, "messages"),
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages"),
    ({"model": "tiny", "messages": chat("Hi"), "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "messages": chat("Hi"), "max_tokens": MAX_TOKENS + 1}, 400, "max_tokens"),
    ({"model": "tiny", "messages": chat("Hi"), "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "messages": chat("word " * 100)}, 400, "messages"),
    ({"model": "other", "messages": chat("Hi")}, 400, "model"),
    ({"model": "tiny", "messages": chat("x" * 5000)}, 413, None),
])
def test_bad_input_is_answered_in_openais_shape(served, body, status, param):
    _, _, url = served
    code, _, answer = http(url + "/v1/chat/completions", body)
    assert code == status
    error = answer["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_the_key_guards_every_endpoint_but_health(served, client):
    _, _, url = served
    assert http(url + "/health", key=None)[0] == 200
    for key in (None, "wrong"):
        for path in ("/v1/models", "/metrics"):
            status, _, answer = http(url + path, key=key)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    metrics = urllib.request.urlopen(request).read().decode()
    assert "hf_specformer_requests_total" in metrics and "hf_specformer_step_seconds_count" in metrics
    assert client.chat.completions.create(model="tiny", messages=chat("Hi"), max_tokens=3).choices[0].message.content \
        is not None  # still answering after the refusals


def test_256_requests_from_32_clients_some_leaving(tokenizer):
    """32 clients send 256 streamed greedy requests (16 prompts, 4 lengths) to 16 rows; one request in ten is
    dropped after its first chunk. None fails or is lost, every completed answer is plain `generate`'s, and the server
    ends with nothing in flight."""
    target = tiny_chat_target(tokenizer)
    engine = Engine(target, tokenizer, make_drafter(target), max_batch_size=16, max_prompt_tokens=64, max_tokens=16,
                    max_waiting=64)
    contents = [f"{prompt} ({i})" for i, prompt in enumerate(CHAT_PROMPTS * 3)][:16]
    expected = {(c, n): chat_reference(target, tokenizer, c, n) for c in contents for n in (4, 8, 12, 16)}
    with live_server(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(i: int):
            content, length = contents[i % 16], (4, 8, 12, 16)[i // 16 % 4]
            stream = client.chat.completions.create(model="tiny", messages=chat(content), max_tokens=length,
                                                    temperature=0, stream=True)
            if i % 10 == 3:
                next(iter(stream))
                stream.close()
                return None
            return content, length, "".join(c.choices[0].delta.content or "" for c in stream)

        started = time.time()
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(ask, range(256)))
        assert time.time() - started < 300
        wait_idle(engine)
    completed = [answer for answer in answers if answer is not None]
    assert len(completed) == 256 - 26 and engine.metrics["failed"] == 0 and engine.metrics["requests"] == 256
    assert all(text == expected[content, length] for content, length, text in completed)


def test_sigterm_lets_the_stream_in_flight_finish(tmp_path, tokenizer):
    """`hf-specformer serve` as a process: SIGTERM during a stream lets the stream end (its last chunk, with its
    finish reason and usage), then the process ends."""
    folder = tmp_path / "tiny"
    tiny_chat_target(tokenizer).float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "hf_specformer.apps.cli", "serve", "--model", str(folder),
                                "--drafter", "untrained", "--port", str(port), "--max-prompt-tokens", "64",
                                "--max-tokens", "400", "--threads", "1"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and process.poll() is None:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(model=str(folder), messages=chat("Hi!"), max_tokens=400,
                                                temperature=0, stream=True)
        chunks = iter(stream)
        next(chunks)
        process.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason in ("length", "stop") and rest[-1].usage.completion_tokens > 1
        assert process.wait(60) in (0, -signal.SIGTERM)  # (uvicorn re-raises the signal once it has drained)
    finally:
        process.kill()
