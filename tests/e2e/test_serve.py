# SPDX-License-Identifier: Apache-2.0
"""`vllm serve --kv-manager infinigen` answers OpenAI requests and exports counters."""

from __future__ import annotations

import re
import subprocess

import pytest
import requests

from benchmarks.harness.paths import BUNDLED_MODEL
from benchmarks.harness.servers import SERVE_FLAGS, VLLM, start_server, stop_server

pytestmark = pytest.mark.slow
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # Its 182-token prompt is short: start_server selects there too (min context 0).
    # No recent window: the metrics test checks the budget alone (the window on
    # top of it: test_sparse_budget.py).
    server = start_server(log, "--kv-manager", "infinigen", "--infinigen-budget", "0.2",
                          "--infinigen-recent-tokens", "0", "--chat-template", str(template))
    yield server.base_url
    assert stop_server(server) is not None, "vllm serve did not stop on SIGINT"


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused")


LONG_PROMPT = "Once upon a time, there was a little girl named Lily. " * 12


def test_completion(client):
    out = client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=24,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 24
    assert out.choices[0].text.strip()


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model="tiny", prompt=LONG_PROMPT, max_tokens=20, temperature=0.0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == whole


def test_chat(client):
    messages = [{"role": "user", "content": LONG_PROMPT}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16
    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                            temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == out.choices[0].message.content


def test_metrics_exported(client, server):
    client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=8, temperature=0.0)
    text = requests.get(f"{server}/metrics", timeout=10).text
    values = {}
    for name in ("selected_tokens", "candidate_tokens", "selected_kv_bytes"):
        pattern = rf'^vllm:infinigen_{name}_total\{{.*layer="(\d+)".*\}} ([0-9.e+]+)$'
        values[name] = {m[0]: float(m[1]) for m in re.findall(pattern, text, re.M)}
    assert sorted(values["candidate_tokens"]) == ["2", "3", "4"]
    for layer, candidates in values["candidate_tokens"].items():
        assert 0 < values["selected_tokens"][layer] <= 0.2 * candidates
        assert values["selected_kv_bytes"][layer] > 0


@pytest.mark.parametrize("body", [
    {"prompt": "Once upon a time " * 400, "max_tokens": 4},  # longer than the model
    {"prompt": "Once upon a time", "max_tokens": 4096},  # beyond max_model_len
    {"prompt": "", "max_tokens": 4},
])
def test_bad_requests_get_400_and_serving_goes_on(server, client, body):
    response = requests.post(f"{server}/v1/completions", json={"model": "tiny", **body},
                             timeout=60)
    assert response.status_code == 400, response.text
    assert response.json().get("error", {}).get("message")
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4


def _start_error(tmp_path, skew_file: str) -> str:
    proc = subprocess.run(
        [VLLM, "serve", str(BUNDLED_MODEL), "--kv-manager", "infinigen",
         "--infinigen-speculation-keys", "partial", "--infinigen-skew-file", skew_file,
         *SERVE_FLAGS],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode != 0
    return proc.stdout + proc.stderr


def test_corrupt_skew_file_stops_start_up_naming_it(tmp_path):
    from vllm_infinigen.skewing.calibration import compute_skew_tables
    from vllm_infinigen.skewing.tables import save_skew_tables

    good = tmp_path / "good.safetensors"
    save_skew_tables(compute_skew_tables(str(BUNDLED_MODEL), 0.2), str(good))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    output = _start_error(tmp_path, str(truncated))
    assert "--infinigen-skew-file" in output and str(truncated) in output


def test_skew_file_of_another_model_stops_start_up(tmp_path, tiny_models):
    from vllm_infinigen.skewing.calibration import compute_skew_tables
    from vllm_infinigen.skewing.tables import save_skew_tables

    other = tmp_path / "other.safetensors"
    save_skew_tables(compute_skew_tables(tiny_models["llama-gqa"], 0.2), str(other))
    output = _start_error(tmp_path, str(other))
    assert "written for another model" in output and str(other) in output
