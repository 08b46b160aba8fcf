"""`msaserve serve --model DIR` on a tiny MiniMax-M3 checkpoint, asked through the official
`openai` client: the greedy reply is transformers' greedy continuation of the checkpoint's own chat
template, and an image sent to this text-only model gets an error that says what to do."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from local_serve_app import free_port

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from m3_checkpoint import write_m3_checkpoint

from msaserve.platform.tools_minimax import MINIMAX

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a local Ray cluster

MSASERVE = [str(Path(sys.executable).parent / "msaserve")]
MAX_TOKENS = 24
START_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(openai client, served model name, checkpoint directory, transformers model)."""
    root = tmp_path_factory.mktemp("m3serve")
    directory, oracle = write_m3_checkpoint(root / "m3-tiny", vl=False, seed=2)
    port, dashboard = free_port(), free_port()
    log_path = root / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed below; the process writes to it)
    repo = str(Path(__file__).parents[2])
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    process = subprocess.Popen(
        [*MSASERVE, "serve", "--model", str(directory), "--port", str(port),
         "--dashboard-port", str(dashboard)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ready in" not in (text := log_path.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, text[-3000:]
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        yield client, directory, oracle
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def test_served_model_is_listed_by_directory_name(server) -> None:
    client, directory, _ = server
    assert directory.name in [model.id for model in client.models.list().data]


def test_chat_reply_is_transformers_greedy_text(server) -> None:
    client, directory, oracle = server
    messages = [{"role": "user", "content": "Name three colours."}]
    reply = client.chat.completions.create(
        model=directory.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                              do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert expected and reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == ids.shape[1]


def test_named_tool_choice_returns_a_call_in_the_templates_format(server) -> None:
    """The checkpoint's template defines MiniMax's <minimax:tool_call> format: the reply is forced
    to start the named invoke, and what the model writes after it is parsed as in transformers'
    greedy continuation of the same prompt."""
    client, directory, oracle = server
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.chat.completions.create(
        model=directory.name, messages=messages, tools=tools, max_tokens=MAX_TOKENS, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    prefix = MINIMAX.call_prefix("get_weather")
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt + prefix, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                              do_sample=False)
    continuation = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    expected = MINIMAX.forced_call(prefix + continuation, "get_weather")
    assert choice.message.tool_calls[0].function.arguments == expected.arguments


def test_image_to_text_only_model_says_how_to_serve_one_with_vision(server) -> None:
    client, directory, _ = server
    pixel = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwAD"
             "hgGAWjR9awAAAABJRU5ErkJggg==")
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=directory.name, max_tokens=4,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": pixel}}]}],
        )
    message = str(error.value)
    assert "no vision tower" in message and "vision_config" in message
