"""Secrets stay out of the logs at the default level: a worker and a gateway on a password-protected
redis-server, with API keys, serve good and bad requests (a wrong key, a refused body, a failed
request, a cancelled one); neither log holds the Redis password, an API key or a prompt's text."""

from __future__ import annotations

import json

import openai
import pytest

from producer_sdk.contract.connection import connect
from tests.gateway.gateway_proc import GatewayProc, request
from tests.service.worker_proc import WorkerProc
from worker.service.redis_proc import RedisProcess

pytestmark = [pytest.mark.single_node]

PASSWORD = "redis-pw-7f3a9c1e"
API_KEY = "sk-tenant-secret-4b8d2e"
PROMPT = "prompt-text-that-must-not-be-logged"


def test_no_password_key_or_prompt_in_the_logs(llama_dir, tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({API_KEY: {"tenant": "team-s"}}))
    with RedisProcess() as server:
        connect(server.url, asyncio=False, socket_timeout=10).config_set("requirepass", PASSWORD)
        url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
        worker = WorkerProc(llama_dir, url, "--max-model-len", "256").start()
        gw = GatewayProc(url, "--api-keys", str(keys_file)).start()
        try:
            client = openai.OpenAI(base_url=gw.base_url, api_key=API_KEY, max_retries=0)
            client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": PROMPT}], max_tokens=3
            )
            client.responses.create(model="default", input=PROMPT, max_output_tokens=3)
            with pytest.raises(openai.BadRequestError):  # the worker refuses it: over the model's length
                client.completions.create(model="default", prompt=PROMPT * 200, max_tokens=3)
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": PROMPT}], max_tokens=3, top_p=7
                )
            wrong = request(
                gw.port,
                "POST",
                "/v1/chat/completions",
                {"model": "default"},
                headers={"Authorization": f"Bearer {API_KEY}-wrong"},
            )
            assert wrong[0] == 401
        finally:
            gw.stop()
            worker.stop()
        logs = {"gateway": gw.log(), "worker": worker.log()}
    assert all(logs.values()), "both processes logged something"
    for name, text in logs.items():
        for secret in (PASSWORD, API_KEY, PROMPT):
            assert secret not in text, f"{name} log holds {secret!r}"
