"""The tokenizer routes in vLLM's shapes and GET /v1/models/{id}, on the router (relayed to
P, the tokenizer of record) and on a worker: the same answers, 400/404 for what is not served."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.pd.clients import client
from tests.e2e.pd.conftest import MAX_MODEL_LEN, MODEL, PDCluster


@pytest.mark.slow
def test_tokenize_detokenize_and_info_equal_on_router_and_worker(pd_cluster: PDCluster) -> None:
    answers = []
    for base in (pd_cluster.router_url, pd_cluster.mixed_url):
        text = httpx.post(f"{base}/tokenize", json={"prompt": "hi there"}, timeout=30).json()
        plain = {"model": MODEL, "prompt": "hi there", "add_special_tokens": False}
        bare = httpx.post(f"{base}/tokenize", json=plain, timeout=30).json()
        messages = {"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}
        chat = httpx.post(f"{base}/tokenize", json=messages, timeout=30).json()
        back = httpx.post(f"{base}/detokenize", json={"tokens": bare["tokens"]}, timeout=30)
        info = httpx.get(f"{base}/tokenizer_info", timeout=30).json()
        answers.append((text, bare, chat, back.json(), info))
        # the tiny tokenizer: a bos, then one token per byte
        assert bare["tokens"] == list(b"hi there") and bare["count"] == 8
        assert text["tokens"][1:] == bare["tokens"] and text["max_model_len"] == MAX_MODEL_LEN
        assert "".join(chat["token_strs"]) and len(chat["token_strs"]) == chat["count"]
        assert back.json() == {"prompt": "hi there"}
        assert info["model_max_length"] == MAX_MODEL_LEN and info["chat_template"]
        wrong = httpx.post(f"{base}/tokenize", json={"model": "gpt-4", "prompt": "x"}, timeout=30)
        assert (wrong.status_code, wrong.json()["error"]["code"]) == (400, "model_not_found")
        bad = httpx.post(f"{base}/detokenize", json={"tokens": [-1]}, timeout=30)
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "tokens")
        missing = httpx.post(f"{base}/tokenize", json={"prompt": 5}, timeout=30)
        assert missing.status_code == 400
    assert answers[0] == answers[1]


@pytest.mark.slow
def test_models_retrieve(pd_cluster: PDCluster) -> None:
    for base in (pd_cluster.router_url, pd_cluster.mixed_url):
        card = client(base).models.retrieve(MODEL)
        assert (card.id, card.object) == (MODEL, "model")
        with pytest.raises(openai.NotFoundError) as info:
            client(base).models.retrieve("gpt-4")
        assert info.value.body["code"] == "model_not_found"  # type: ignore[index]
