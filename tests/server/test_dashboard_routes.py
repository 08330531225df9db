"""The live dashboard and profiling on a running server: the page and its JSON snapshot,
a profile started and stopped while requests are served, its trace and report."""

import httpx


def test_the_dashboard_and_a_profile_taken_while_serving(served):
    with served.client() as client:
        page = client.get("/dashboard", params={"model": "probe"})
        assert page.status_code == 200 and "<html" in page.text.lower()
        snapshot = client.get("/dashboard.json", params={"model": "probe"}).json()
        assert snapshot and "profile" in snapshot
        assert client.get("/profile/trace.json", params={"model": "probe"}).status_code == 404
        assert client.post("/start_profile", params={"model": "probe"}).status_code == 200
        chat = {"model": "probe", "messages": [{"role": "user", "content": "two words"}]}
        for _ in range(3):
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
        assert client.post("/stop_profile", params={"model": "probe"}).status_code == 200
        trace = client.get("/profile/trace.json", params={"model": "probe"}).json()
        steps = [e for e in trace["traceEvents"] if e["name"] == "talk step"]
        assert len({c["request"] for s in steps for c in s["args"]["calls"]}) == 3
        report = client.get("/profile/report.html", params={"model": "probe"})
        assert report.status_code == 200 and "<html" in report.text.lower()
        unknown = client.get("/dashboard", params={"model": "nope"})
        assert unknown.status_code == 404 and "served:" in unknown.json()["error"]["message"]


def test_dashboard_routes_are_not_in_the_openapi_schema(served):
    schema = httpx.get(f"{served.base}/openapi.json").json()
    assert not any(p.startswith(("/dashboard", "/profile", "/st")) for p in schema["paths"])


def test_start_profile_takes_a_gpu_field_and_says_why_a_cpu_pipeline_cannot(served):
    with served.client() as client:
        url, model = "/start_profile", {"model": "probe"}
        refused = client.post(url, params=model, json={"gpu": True})
        assert refused.status_code == 400
        assert "on the CPU" in refused.json()["error"]["message"]
        unknown = client.post(url, params=model, json={"gpu": True, "kernels": 1})
        assert unknown.status_code == 400 and "kernels" in unknown.json()["error"]["message"]
        assert client.post(url, params=model, json={"gpu": False}).status_code == 200
        assert client.post("/stop_profile", params=model).status_code == 200


def test_start_profile_narrows_to_stages_and_request_id_prefixes(served):
    model = {"model": "probe"}
    chat = {**model, "messages": [{"role": "user", "content": "two words"}]}

    def talk_steps(client, narrowed: dict) -> list[dict]:
        assert client.post("/start_profile", params=model, json=narrowed).status_code == 200
        ids = {client.post("/v1/chat/completions", json=chat).headers["x-request-id"]}
        ids.add(client.post("/v1/chat/completions", json=chat).headers["x-request-id"])
        assert client.post("/stop_profile", params=model).status_code == 200
        trace = client.get("/profile/trace.json", params=model).json()
        steps = [e for e in trace["traceEvents"] if e["name"] == "talk step"]
        assert {c["request"] for s in steps for c in s["args"]["calls"]} <= ids
        return steps

    with served.client() as client:
        assert talk_steps(client, {"stages": ["talk"], "requests": ["chatcmpl-"]})
        assert talk_steps(client, {"requests": ["img-"]}) == []  # no chat request matches
        refused = client.post("/start_profile", params=model, json={"stages": ["talker"]})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "stages" and "its stages: talk" in error["message"]
