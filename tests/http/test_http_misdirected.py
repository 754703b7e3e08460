"""A misdirected Host header is refused before routing (421 BAD_REQUEST) in the error shape of the API its path
is under: Ollama's `{"error", "code"}` under /api, OpenAI's elsewhere (issue 36's leftover)."""

from __future__ import annotations

from test_http_edges import front

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_misdirected_host_gets_ollama_shape_under_api_and_openai_shape_elsewhere(tmp_path):
    with front(tmp_path) as (_, client):
        evil = {"Host": "evil.example"}
        for answer in (client.get("/api/tags", headers=evil), client.post("/api/chat", json=CHAT, headers=evil),
                       client.get("/api", headers=evil), client.get("/api/nowhere", headers=evil)):
            body = answer.json()
            assert answer.status_code == 421 and set(body) == {"error", "code"}, answer.text
            assert body["code"] == "BAD_REQUEST" and "Host 'evil.example' is not served here" in body["error"]
        for path in ("/v1/models", "/apiary", "/health"):
            answer = client.get(path, headers=evil)
            error = answer.json()["error"]
            assert (answer.status_code, error["code"], error["type"]) == (421, "BAD_REQUEST", "invalid_request_error")
        assert client.get("/api/version").status_code == 200  # a loopback Host is served
