"""The Ray Serve application end to end (three applications for the module, deployed together from one config,
on the session's shared Ray cluster: tests/serving.py)."""

from __future__ import annotations

import json
import threading

import pytest

from tests.serving import BASE, delete_apps, deploy, quick_stops, wait_until

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

HF = "/hf"  # a Dream-format checkpoint with a byte-level BPE tokenizer and a ChatML template (tests/checkpoints.py)
HF_MODEL = "dream-tiny"


APPS = ("remask", "remask-tp2", "remask-hf")


@pytest.fixture(scope="module")
def app_url(ray_serve, hf_checkpoints):
    from app.config import denoiser_name

    apps = [
        # two TP-1 replicas: the router spreads requests, and one can be killed
        {"name": "remask", "route_prefix": "/",
         "args": {"engine": {"model": "tiny-bd", "slots": 16, "max_waiting": 64},
                  "http": {"max_tokens_limit": 256}, "resources": {"replicas": {1: 2}}},
         "deployments": quick_stops()},
        # the same model with tensor parallelism 2 (gloo on CPU), as a second application (small queues: the
        # overload test fills them). Its one replica is replaced when a TP worker is killed: its requests wait
        # for the replacement, which can take over 30 s on a loaded 2-core machine; Serve finds the broken
        # replica after 3 failed health checks in a row, checked every second here (the deployment's default is
        # every 5 s): set as a config file sets a deployment's options
        # (Its replica and the real-format one below skip the start-time profile, engine.profile_seconds 0: the
        # first app's two replicas measure theirs as a deployment's do by default, and nothing here reads the
        # other apps' router prices; each measurement is ~3 s of CPU on the set-up's critical path.)
        {"name": "remask-tp2", "route_prefix": "/tp2",
         "args": {"engine": {"model": "tiny-bd", "slots": 2, "max_waiting": 2, "profile_seconds": 0},
                  "http": {"max_tokens_limit": 256}, "router": {"park_s": 150}, "resources": {"tp_degrees": [2]}},
         "deployments": [{**d, "health_check_period_s": 1} if d["name"] == denoiser_name(2) else d
                         for d in quick_stops((2,))]},
        # a real-format checkpoint (random weights): its own tokenizer, chat template and generation_config.json
        {"name": "remask-hf", "route_prefix": HF,
         "args": {"engine": {"model": str(hf_checkpoints["dream"]), "slots": 4, "max_waiting": 16,
                             "profile_seconds": 0},
                  "http": {"served_model_name": HF_MODEL, "max_tokens_limit": 64},
                  "resources": {"cpus_per_replica": 0.25}},
         "deployments": quick_stops()},
    ]
    try:  # the apps are deleted however the module ends, set-up included: the next module finds Serve empty
        # the three at once (as `serve deploy` of a config file does): their replicas start side by side
        deploy(*apps)
        # wait for the apps to answer
        assert wait_until(lambda: all(httpx.get(f"{BASE}{p}/health", timeout=2).status_code == 200
                                      for p in ("", "/tp2", HF))
                          and len(httpx.get(f"{BASE}/debug/instances", timeout=2).json()["instances"]) == 2,
                          limit_s=240), {name: (a.status, a.message) for name, a in serve.status().applications.items()}
        yield BASE
    finally:
        delete_apps(*APPS)


def post(url, path, body, **kw):
    return httpx.post(url + path, content=body if isinstance(body, (bytes, str)) else json.dumps(body),
                      headers={"content-type": "application/json"}, timeout=300, **kw)


def test_health_and_models(app_url):
    assert httpx.get(app_url + "/health").json()["status"] == "ok"
    models = httpx.get(app_url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny-bd"


def test_completion_answers_checkable_prompts(app_url):
    r = post(app_url, "/v1/completions", {"model": "tiny-bd", "prompt": "rev: abcde", "max_tokens": 16})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "edcba" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 5


def test_streaming_chat_yields_sse_chunks(app_url):
    with httpx.stream("POST", app_url + "/v1/chat/completions", timeout=300, json={
        "model": "tiny-bd", "messages": [{"role": "user", "content": "max: a3 b9 c1 d2"}], "stream": True,
        "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "b"
    assert chunks[-1]["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    ({"model": "tiny-bd"}, "prompt"),
    ({"model": "nope", "prompt": "x"}, "model"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ({"prompt": "x", "threshold": 1.5}, "threshold"),
    ({"prompt": "x", "slo_ms": -1}, "slo_ms"),
    ({"prompt": "x" * 600, "max_tokens": 8}, "prompt"),
])
def test_bad_input_gets_openai_errors(app_url, body, param):
    r = post(app_url, "/v1/completions", body)
    assert 400 <= r.status_code < 500
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


def test_concurrent_streams_all_complete_correctly(app_url):
    import tasksuite as tasks

    examples = [e for e in tasks.heldout_set(200) if e.category in ("reverse", "choice")][:50]
    results = [None] * len(examples)

    def run(i, ex):
        r = post(app_url, "/v1/completions", {"prompt": ex.prompt, "max_tokens": 16, "threshold": 0.9})
        results[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(i, e)) for i, e in enumerate(examples)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    correct = sum(e.check(t) for e, t in zip(examples, results))
    assert all(r is not None for r in results)
    assert correct >= 0.9 * len(examples)


def test_openai_client(app_url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=app_url + "/v1", api_key="none")
    out = client.completions.create(model="tiny-bd", prompt="rev: hello", max_tokens=16)
    assert out.choices[0].text == "olleh"
    stream = client.chat.completions.create(model="tiny-bd", messages=[{"role": "user", "content": "rev: abc"}],
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "cba"


def test_tp2_returns_the_same_tokens_as_tp1(app_url):
    import tasksuite as tasks

    # categories without free word choices: no near-ties that summation order could flip
    for ex in [e for e in tasks.heldout_set(20) if e.category != "prose"][:8]:
        body = {"prompt": ex.prompt, "max_tokens": 16, "threshold": 0.9}
        one = post(app_url, "/v1/completions", body).json()
        two = post(app_url, "/tp2/v1/completions", body).json()
        assert one["choices"][0]["text"] == two["choices"][0]["text"]
        assert one["usage"] == two["usage"]


def test_metrics_cover_the_dashboard(app_url):
    """Every metric the Grafana dashboard queries is on a running app's /metrics, labelled with the model."""
    from pathlib import Path

    from tests.dashboard import dashboard_metric_names, exposed_metric_names

    post(app_url, "/v1/completions", {"prompt": "rev: abc", "max_tokens": 8})
    text = httpx.get(app_url + "/metrics").text
    wanted = dashboard_metric_names(Path(__file__).resolve().parent.parent / "ops/grafana/remask-dashboard.json")
    assert wanted and not wanted - exposed_metric_names(text)
    assert 'remask:request_success_total{finished_reason="stop",model_name="tiny-bd"}' in text
    ok = [ln for ln in text.splitlines() if ln.startswith('remask:e2e_request_latency_seconds_count{')]
    assert ok and float(ok[0].split()[-1]) >= 1


def test_overload_sheds_with_429_and_retry_after(app_url):
    # TP-2 app: at most 2 requests wait for a round boundary; a flood of long requests overflows it
    codes, bodies = [], []

    def run():
        r = post(app_url, "/tp2/v1/completions", {"prompt": "story: fox 8", "max_tokens": 96, "threshold": 0.99})
        codes.append(r.status_code)
        bodies.append((r.status_code, r.headers.get("retry-after"), r.json()))

    threads = [threading.Thread(target=run) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(codes) == 40 and set(codes) <= {200, 429}, codes
    shed = [b for b in bodies if b[0] == 429]
    assert shed, "nothing was shed"
    assert all(b[1] is not None and b[2]["error"]["type"] == "rate_limit_error" for b in shed)
    served = [b for b in bodies if b[0] == 200]
    assert served and all(b[2]["choices"][0]["text"].startswith("the fox") for b in served)


def test_disconnect_frees_slot_and_kv(app_url):
    import time

    with httpx.stream("POST", app_url + "/v1/completions", timeout=300, json={
            "prompt": "story: owl 8", "max_tokens": 168, "threshold": 0.999, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up mid-generation
    state = {}
    for _ in range(100):
        views = httpx.get(app_url + "/debug/instances", timeout=30).json()["instances"].values()
        state = {k: sum(v[k] for v in views) for k in ("running", "resident", "kv_reserved_tokens", "requests")}
        if state["running"] == 0 and state["resident"] == 0 and state["kv_reserved_tokens"] == 0:
            break
        time.sleep(0.1)
    assert state["running"] == 0 and state["resident"] == 0 and state["kv_reserved_tokens"] == 0, state
    assert state["requests"] == 0  # the router forgot it too


def test_control_path_is_measured(app_url):
    from tools.bench_control import bench_control

    res = bench_control(app_url, requests=6, concurrency=2)
    assert res["events"] > 6 and res["median_ms"] is not None and res["add_median_ms"] is not None
    text = httpx.get(app_url + "/metrics").text
    assert "remask:control_event_seconds_count" in text


def test_killed_replica_loses_no_request(app_url):
    """Kill the Denoiser replica holding the most requests mid-stream: its requests resume on the other
    replica from their committed tokens, every stream completes, and Serve's replacement joins."""
    import time

    import tasksuite as tasks

    examples = [e for e in tasks.heldout_set(200) if e.category in ("reverse", "choice")][:16]
    # long stories (one token a step) besides: the victim surely still holds requests when it is killed
    stories = [e for e in tasks.heldout_set(200) if e.category == "prose"][:4]
    results = [None] * len(examples)
    long_results = [None] * len(stories)

    def run(i, ex, out=results, max_tokens=16):
        text, finish = "", None
        with httpx.stream("POST", app_url + "/v1/completions", timeout=300, json={
                "prompt": ex.prompt, "max_tokens": max_tokens, "threshold": 0.9999, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        out[i] = (r.status_code, text, finish)

    threads = [threading.Thread(target=run, args=(i, e, long_results, 96)) for i, e in enumerate(stories)]
    threads += [threading.Thread(target=run, args=(i, e)) for i, e in enumerate(examples)]
    for t in threads:
        t.start()
    victim = None
    for _ in range(200):  # the busiest replica, once it holds requests
        views = httpx.get(app_url + "/debug/instances", timeout=30).json()["instances"]
        busy = max(views.values(), key=lambda v: v["requests"])
        if busy["requests"] >= 2:
            victim = busy
            break
        time.sleep(0.02)
    assert victim is not None
    ray.kill(ray.get_actor(victim["actor"], namespace="serve"), no_restart=True)
    for t in threads:
        t.join(300)
    assert all(r is not None and r[0] == 200 and r[2] == "stop" for r in results), results
    assert all(r is not None and r[0] == 200 and r[2] in ("stop", "length") for r in long_results), long_results
    assert sum(e.check(r[1]) for e, r in zip(examples, results)) >= 0.8 * len(examples)
    dispatch = httpx.get(app_url + "/debug/instances", timeout=30).json()["dispatch"]
    assert dispatch["instances_lost"] >= 1 and dispatch["failed_over"] >= 1, dispatch
    for _ in range(600):  # Serve replaces the replica; it registers with the ingress
        views = httpx.get(app_url + "/debug/instances", timeout=30).json()["instances"]
        if len(views) == 2 and victim["replica"] not in {v["replica"] for v in views.values()}:
            break
        time.sleep(0.1)
    assert len(views) == 2, views


def test_killed_tp_worker_fails_over_its_replica(app_url):
    """Kill rank 1 of the TP-2 replica mid-stream: rank 0's round breaks, the replica hangs up without
    failing its requests (they wait for an instance, then resume from their committed tokens), its health
    check fails, and Serve's replacement serves them. Each stream ends with its answer or a clean error."""
    import time

    views = httpx.get(app_url + "/tp2/debug/instances", timeout=30).json()["instances"]
    (victim,) = views.values()
    assert len(victim["workers"]) == 1
    results = [None] * 2  # the TP-2 app has 2 slots

    def run(i):
        text, finish, error = "", None, None
        with httpx.stream("POST", app_url + "/tp2/v1/completions", timeout=300, json={
                "prompt": f"story: {('fox', 'owl')[i]} 8", "max_tokens": 96, "threshold": 0.9999,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]["message"]
                        continue
                    text += chunk["choices"][0]["text"]
                    finish = chunk["choices"][0]["finish_reason"] or finish
        results[i] = (r.status_code, text, finish, error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for _ in range(200):  # once the replica holds them
        if httpx.get(app_url + "/tp2/debug/instances", timeout=30).json()["live"] >= 2:
            break
        time.sleep(0.02)
    ray.kill(ray.get_actor(victim["workers"][0], namespace="serve"), no_restart=True)
    t0 = time.monotonic()
    for t in threads:
        t.join(300)
    assert all(r is not None and r[0] == 200 for r in results), results
    for i, (_, text, finish, error) in enumerate(results):  # completed (resumed text intact), or a clean error
        completed = finish in ("stop", "length") and error is None and text.startswith(f"the {('fox', 'owl')[i]}")
        assert completed or (error is not None and finish is None), results
    dispatch = httpx.get(app_url + "/tp2/debug/instances", timeout=30).json()["dispatch"]
    assert dispatch["instances_lost"] >= 1 and dispatch["failed_over"] >= 1, dispatch
    views = {}
    while time.monotonic() - t0 < 240:  # the broken replica is replaced
        views = httpx.get(app_url + "/tp2/debug/instances", timeout=30).json()["instances"]
        if views and victim["replica"] not in {v["replica"] for v in views.values()}:
            break
        time.sleep(0.2)
    assert views and victim["replica"] not in {v["replica"] for v in views.values()}, views
    r = post(app_url, "/tp2/v1/completions", {"prompt": "rev: abc", "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "cba"


def test_redeploy_with_a_changed_config_drains_in_flight_requests(app_url):
    """``serve.run`` of a changed config (what ``serve deploy`` does) replaces the Ingress and the Denoisers
    while long streams run: the old Ingress lets its streams end, the old Denoisers finish or hand over
    their requests, every stream completes, and the new config serves."""
    import time

    from deployments.builder import build_app

    prompts = [f"story: {a} {n}" for a in ("fox", "owl", "elk", "cat") for n in (6, 8)]
    results = [None] * len(prompts)

    def run(i, prompt):
        text, finish = "", None
        with httpx.stream("POST", app_url + "/v1/completions", timeout=300, json={
                "prompt": prompt, "max_tokens": 200, "threshold": 0.9999, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        finish = f"error: {chunk['error']['message']}"
                        continue
                    text += chunk["choices"][0]["text"]
                    finish = chunk["choices"][0]["finish_reason"] or finish
        results[i] = (r.status_code, text, finish)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for _ in range(200):  # every request is streaming
        if httpx.get(app_url + "/debug/instances", timeout=30).json()["live"] >= len(prompts):
            break
        time.sleep(0.05)
    serve.run(build_app({"engine": {"model": "tiny-bd", "slots": 16, "max_waiting": 64, "profile_seconds": 0},
                         "http": {"served_model_name": "tiny-bd-v2", "max_tokens_limit": 256},
                         "resources": {"replicas": {1: 2}}}),
              name="remask", route_prefix="/", blocking=False)
    for t in threads:
        t.join(300)
    assert all(r is not None and r[0] == 200 and r[2] == "stop" for r in results), results
    assert all(tasks_check(p, r[1]) for p, r in zip(prompts, results)), results
    assert wait_until(lambda: httpx.get(app_url + "/v1/models", timeout=5).json()["data"][0]["id"] == "tiny-bd-v2"
                      and len(httpx.get(app_url + "/debug/instances", timeout=5).json()["instances"]) == 2)
    r = post(app_url, "/v1/completions", {"prompt": "rev: abc", "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "cba"


def tasks_check(prompt: str, text: str) -> bool:
    import tasksuite as tasks

    return tasks.check("prose", prompt, text)


# ---------------------------------------------------------------- a real-format checkpoint, with the openai client


@pytest.fixture(scope="module")
def hf_client(app_url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=app_url + HF + "/v1", api_key="none", max_retries=0)


HF_CHAT = [{"role": "system", "content": "Antworte kurz."}, {"role": "user", "content": "Grüße aus 日本 🙂"},
           {"role": "assistant", "content": "Hallo!"}, {"role": "user", "content": "Und jetzt? 🚀"}]


def test_hf_chat_with_every_role_uses_the_template(app_url, hf_client):
    out = hf_client.chat.completions.create(model=HF_MODEL, messages=HF_CHAT, max_tokens=24)
    assert out.choices[0].finish_reason in ("stop", "length") and isinstance(out.choices[0].message.content, str)
    # the prompt the model read is the template's rendering of all four turns
    tok = post(app_url, HF + "/tokenize", {"model": HF_MODEL, "messages": HF_CHAT}).json()
    assert out.usage.prompt_tokens == tok["count"]
    text = post(app_url, HF + "/detokenize", {"model": HF_MODEL, "tokens": tok["tokens"]}).json()["prompt"]
    assert "Antworte kurz." in text and "Und jetzt? 🚀" in text  # specials skipped: the turns' text, in order
    assert text.index("Antworte") < text.index("Grüße") < text.index("Hallo!") < text.index("Und jetzt")


def test_hf_stream_joins_to_the_non_streamed_text(hf_client):
    body = {"model": HF_MODEL, "messages": HF_CHAT[:2], "max_tokens": 40, "temperature": 0}
    whole = hf_client.chat.completions.create(**body).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in hf_client.chat.completions.create(**body, stream=True)
              if c.choices]
    assert "".join(pieces) == whole and whole
    # no piece carries part of a character: every U+FFFD in the pieces is one the whole text has too
    assert sum(p.count("\ufffd") for p in pieces) == whole.count("\ufffd")


def test_hf_completion_prompt_is_raw_text_and_several_prompts_get_one_choice_each(app_url, hf_client):
    # (the checkpoint's generation_config.json samples at temperature 0.2: greedy asked for, to compare texts)
    out = hf_client.completions.create(model=HF_MODEL, prompt=["Grüße 日本", "café 🙂"], max_tokens=16,
                                       temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1]
    raw = [post(app_url, HF + "/tokenize", {"model": HF_MODEL, "prompt": p}).json() for p in ("Grüße 日本", "café 🙂")]
    assert out.usage.prompt_tokens == raw[0]["count"] + raw[1]["count"]  # no chat template around them
    single = hf_client.completions.create(model=HF_MODEL, prompt="Grüße 日本", max_tokens=16, temperature=0)
    assert single.usage.prompt_tokens == raw[0]["count"]
    ids = hf_client.completions.create(model=HF_MODEL, prompt=raw[0]["tokens"], max_tokens=16, temperature=0)
    assert ids.choices[0].text == single.choices[0].text  # a prompt as token ids


def test_hf_stop_strings_end_the_text_streamed_or_not(hf_client):
    body = {"model": HF_MODEL, "prompt": "Grüße aus 日本", "max_tokens": 48, "seed": 11}  # sampled by default
    whole = hf_client.completions.create(**body).choices[0].text
    at = next(i for i in range(len(whole) // 2, len(whole) - 1) if "\ufffd" not in whole[i:i + 2])
    stop = whole[at:at + 2]
    cut = whole[:whole.index(stop)]
    out = hf_client.completions.create(**body, stop=[stop, "\u2603never"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = list(hf_client.completions.create(**body, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"


def test_hf_seeded_sampling_is_reproducible_and_temperature_changes_the_answer(hf_client):
    body = {"model": HF_MODEL, "prompt": "café 🙂", "max_tokens": 32}
    greedy = hf_client.completions.create(**body, temperature=0).choices[0].text
    a = hf_client.completions.create(**body, temperature=1.0, seed=7).choices[0].text
    b = hf_client.completions.create(**body, temperature=1.0, seed=7).choices[0].text
    c = hf_client.completions.create(**body, temperature=1.0, seed=8).choices[0].text
    assert a == b
    assert a != greedy and a != c


@pytest.mark.parametrize("extra,param", [({"logit_bias": {"5": 10}}, "logit_bias"),
                                         ({"frequency_penalty": 0.5}, "frequency_penalty"),
                                         ({"presence_penalty": 0.5}, "presence_penalty"),
                                         ({"extra_body": {"min_p": 0.1}}, "min_p")])
def test_hf_unsupported_parameters_are_refused(hf_client, extra, param):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        hf_client.chat.completions.create(model=HF_MODEL, messages=HF_CHAT[:2], max_tokens=4, **extra)
    assert info.value.status_code == 400 and info.value.body["param"] == param


def test_hf_models_version_and_model_by_id(app_url, hf_client):
    assert hf_client.models.retrieve(HF_MODEL).id == HF_MODEL
    assert httpx.get(app_url + HF + "/v1/models/nope").status_code == 404
    assert httpx.get(app_url + HF + "/version").json()["version"]


def test_canvas_chunks_only_for_clients_that_ask(app_url, hf_client):
    """stream_options.include_canvas adds a remask_canvas chunk per denoising step (choices empty, so the
    openai client's text is unchanged); without it the stream is ordinary."""
    body = {"model": HF_MODEL, "messages": HF_CHAT[:2], "max_tokens": 24, "temperature": 0}
    plain = list(hf_client.chat.completions.create(**body, stream=True))
    with_canvas = list(hf_client.chat.completions.create(**body, stream=True,
                                                         stream_options={"include_canvas": True}))
    text = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices) for chunks in (plain, with_canvas)]
    assert text[0] == text[1]
    assert not any(getattr(c, "remask_canvas", None) for c in plain)
    views = [c.remask_canvas for c in with_canvas if getattr(c, "remask_canvas", None)]
    assert views and [v["round"] for v in views] == list(range(1, len(views) + 1))
    assert all(not c.choices for c in with_canvas if getattr(c, "remask_canvas", None))
    assert sum(len(v["committed"]) for v in views) >= 1 and views[0]["length"] >= 24


def test_playground_in_a_real_browser(app_url, tmp_path):
    """Headless Chromium opens /playground of the running app, sends a prompt, waits for the canvas to
    finish; the text it shows equals the API's answer to the same request. The screenshot goes to
    ``REMASK_PLAYGROUND_SCREENSHOT`` when set (reports/playground.png is drawn so), else to a temporary file."""
    import os
    from pathlib import Path

    from tests.browser import chromium_available, missing_reason, run_playground

    if not chromium_available():
        pytest.skip(missing_reason())
    assert httpx.get(app_url + "/playground").status_code == 200
    params = {"threshold": 0.9, "temperature": 0, "max_tokens": 48}
    prompt = "story: fox 3"
    shot = Path(os.environ.get("REMASK_PLAYGROUND_SCREENSHOT") or tmp_path / "playground.png")
    got = run_playground(app_url, prompt, params, shot)
    api_answer = post(app_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                          **params}).json()["choices"][0]["message"]["content"]
    assert got["status"] == "done" and got["answer"] == api_answer and api_answer
    assert got["rounds"] > 0 and got["cells_committed"] >= len(api_answer)  # one character a token (tiny-bd)
    assert not got["console_errors"], got["console_errors"]
    assert shot.stat().st_size > 10_000


def test_structured_outputs_and_a_tool_call_through_the_ray_app(app_url):
    """Structured outputs on the Ray app (tiny-bd, two replicas): a JSON schema plain and streamed and a named
    tool call, each a document its schema accepts; a schema that does not compile is a 400 naming the field."""
    schema = {"type": "object", "additionalProperties": False, "required": ["pick", "ok"],
              "properties": {"pick": {"enum": ["a", "b", "c", "d"]}, "ok": {"type": "boolean"}}}
    msgs = [{"role": "user", "content": "max: a3 b7 c1 d5"}]
    body = {"messages": msgs, "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}}

    def fits(text: str) -> bool:
        doc = json.loads(text)
        return set(doc) == {"pick", "ok"} and doc["pick"] in ("a", "b", "c", "d") and isinstance(doc["ok"], bool)

    r = post(app_url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and fits(choice["message"]["content"]), choice
    text, finish = "", None
    with httpx.stream("POST", app_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]
                text += delta["delta"].get("content") or ""
                finish = delta["finish_reason"] or finish
    assert finish == "stop" and fits(text), text
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}}
    r = post(app_url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 64, "tools": [tool],
                                                "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    choice = r.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_time", choice
    assert json.loads(call["function"]["arguments"])["zone"] in ("utc", "cet")
    bad = post(app_url, "/v1/chat/completions", {**body, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nope"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("response_format"), bad.text
