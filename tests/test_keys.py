"""Token authorization as docs/operations.md#keys and docs/api.md describe it, on a real TorchServe.

TorchServe, not the handler, checks the keys, so only a real server shows what clients get: a request
without a key or with a wrong one is refused (400, TorchServe's InvalidKeyException); renewing the
inference key with the API key puts the new one in key_file.json and stops the old one at once; a new
key is stamped to expire `token_expiration_min` after it is made (1 minute here; waiting for it took a
minute of the suite, and the expiry itself is TorchServe's); the documented client, which reads key_file.json again when refused, keeps working across a renewal; the
README's OpenAI example runs as written from the folder TorchServe started in.
"""

from __future__ import annotations

import http.client
import json
import re
from datetime import datetime, timezone
from pathlib import Path

import pytest

from deploy.server_config import connection
from tests.support.serving_util import TorchServe

REPO = Path(__file__).resolve().parents[1]
REFUSED = "Token Authorization failed"
PROMPT = {"prompt": "Once upon a time", "max_new_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(synthetic_checkpoint, serve):
    with serve(synthetic_checkpoint("llama3", mp=1), tp=1, torchrun={"OMP_NUMBER_THREADS": 1},
               extra_config=["token_expiration_min=1"]) as ts:
        yield ts


def key_file(ts: TorchServe) -> dict:
    return json.loads((ts.workdir / "key_file.json").read_text())


def predict(ts: TorchServe, key: str | None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", ts.inference_port, timeout=120)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        conn.request("POST", f"/predictions/{ts.name}", body=json.dumps(PROMPT).encode(), headers=headers)
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        conn.close()


def renew(ts: TorchServe) -> str:
    """POST /token?type=inference with the API key, as docs/operations.md shows; the new inference key."""
    old = key_file(ts)["inference"]["key"]
    conn = connection(ts.management_address, timeout=30)
    try:
        conn.request("POST", "/token?type=inference", headers={"Authorization": f"Bearer {key_file(ts)['API']['key']}"})
        response = conn.getresponse()
        body = response.read().decode(errors="replace")
    finally:
        conn.close()
    assert response.status == 200, body
    new = key_file(ts)["inference"]["key"]
    assert new != old, "key_file.json still holds the old inference key"
    return new


def expires_in_s(ts: TorchServe) -> float:
    stamp = key_file(ts)["inference"]["expiration time"]
    return (datetime.fromisoformat(stamp.replace("Z", "+00:00")) - datetime.now(timezone.utc)).total_seconds()


def test_no_key_and_a_wrong_key_are_refused_with_400(server: TorchServe) -> None:
    for key in (None, "not-the-key", key_file(server)["API"]["key"], key_file(server)["management"]["key"]):
        status, body = predict(server, key)
        assert status == 400 and REFUSED in body and "InvalidKeyException" in body, (key, status, body)


def test_renewal_stops_the_old_key_at_once_and_the_new_one_serves(server: TorchServe) -> None:
    old = key_file(server)["inference"]["key"]
    new = renew(server)
    status, body = predict(server, old)
    assert status == 400 and REFUSED in body, body
    status, body = predict(server, new)
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 4
    # token_expiration_min from config.properties: the new key lives 1 minute, not TorchServe's 60.
    assert 30 < expires_in_s(server) <= 61, key_file(server)["inference"]


def documented_python(page: Path, heading: str) -> str:
    """The first ```python block after `heading` on a page."""
    text = page.read_text()
    block = re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S)
    assert block, f"no python block after {heading!r} in {page.name}"
    return block.group(1)


def test_the_documented_client_reads_the_key_again_after_a_renewal(server: TorchServe,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(server.workdir)  # the folder TorchServe started in holds key_file.json
    code = documented_python(REPO / "docs" / "operations.md", "### Keys")
    namespace: dict = {}
    exec(compile(code.replace("8080", str(server.inference_port)), "operations.md", "exec"), namespace)
    assert isinstance(namespace["complete"]("Hello"), str)
    renew(server)
    assert isinstance(namespace["complete"]("Hello again"), str)  # refused once, then the new key


def test_the_readme_openai_example_runs_as_written(server: TorchServe, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(server.workdir)
    renew(server)  # a fresh key: the one before may be near its minute
    code = documented_python(REPO / "README.md", "**OpenAI-compatible**")
    exec(compile(code.replace("8080", str(server.inference_port)), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip(), "the example printed no completion"
