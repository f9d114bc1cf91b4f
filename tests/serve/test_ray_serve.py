"""Scale-out on Ray Serve (ninfer_serve.ray_serve, docs/scale-out.md): a local Ray cluster on the CPU, two
engine replicas of the embedded default model behind the ingress, driven over real HTTP.

Shown: the OpenAI and Anthropic routes answer through the ingress (streaming too) with the same greedy
text as one local engine; a session (prompt_cache_key, or the conversation's opening) stays on one replica
and its second turn is served from the context cache; independent requests spread to the least loaded
replica; a stored response is found by previous_response_id; a killed replica fails its in-flight request
with a 503 naming the replica failure while new requests go to the replica still running.

Routing is checked through the ``x-ninfer-replica`` header each answer carries. Nothing waits on a clock
except the generous bounds of polls for a state to be reached.
"""

from __future__ import annotations

import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ninfer-serve[ray]'")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'ninfer-serve[ray]'")
httpx = pytest.importorskip("httpx")

from serve_helpers import MODEL_ID, client_for, sse_json  # noqa: E402

REPLICA = "x-ninfer-replica"
ENGINE = {"device": "cpu", "dtype": "bfloat16", "max_concurrency": 2, "max_context": 512, "queue_capacity": 4}
# Long enough that a request is still generating while the test routes another one next to it or kills
# its replica (the default model decodes a few hundred tokens per second on the CPU).
LONG = 400


@pytest.fixture(scope="module")
def ray_base(default_artifact):
    from ninfer.contracts.options import EngineOptions
    from ninfer_serve.config import ServeConfig
    from ninfer_serve.process import free_port
    from ninfer_serve.ray_serve import ReplicaSpec, ScaleOut, build_application, run_application
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        spec = ReplicaSpec(model=str(default_artifact), engine_options=EngineOptions(**ENGINE),
                           config=ServeConfig(model_id=""))
        port = free_port()
        run_application(build_application(spec, ScaleOut(min_replicas=2, max_replicas=2, num_cpus=1)),
                        host="127.0.0.1", port=port)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def http(ray_base):
    with httpx.Client(base_url=ray_base, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def local(default_artifact):
    """The ordinary app over one local engine of the same model: the reference answers."""
    from ninfer import Engine

    engine = Engine.start(default_artifact, **ENGINE)
    try:
        with client_for(engine) as client:
            yield client
    finally:
        engine.close()


def chat(content: str, **fields) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 12, **fields}


def _replica_actor(unique_id: str):
    """The Ray actor of the engine replica with this unique id (Serve names replica actors after it)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(unique_id)]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def _ongoing(actor) -> int:
    return ray.get(actor.get_num_ongoing_requests.remote())


def _poll(what: str, check, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_greedy_chat_matches_one_local_engine(http, local):
    body = chat("Name three colours.")
    through_ray = http.post("/v1/chat/completions", json=body)
    assert through_ray.status_code == 200, through_ray.text
    assert through_ray.headers[REPLICA]
    reference = local.post("/v1/chat/completions", json=body)
    assert reference.status_code == 200, reference.text
    assert through_ray.json()["choices"][0]["message"] == reference.json()["choices"][0]["message"]

    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    deltas = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_json(text) if c.get("choices"))
    assert deltas == reference.json()["choices"][0]["message"]["content"]
    assert text.rstrip().endswith("data: [DONE]")


def test_completions_and_anthropic_routes(http, local):
    body = {"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == local.post("/v1/completions", json=body).json()["choices"][0]["text"]

    msg = {"model": MODEL_ID, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    r = http.post("/v1/messages", json=msg)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == local.post("/v1/messages", json=msg).json()["content"]
    with http.stream("POST", "/v1/messages", json={**msg, "stream": True}) as s:
        events = [line[len("event: "):] for line in s.read().decode().splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"

    # The API's own errors come from the replica's app, in each protocol's shape.
    bad = http.post("/v1/messages", json={"model": MODEL_ID, "messages": []})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert http.post("/v1/chat/completions", json={"model": "nope", "messages": []}).status_code in (400, 404)
    assert http.get("/v1/models").json()["data"][0]["id"] == MODEL_ID
    assert http.get("/health").status_code == 200


def _two_turns(http, first: dict) -> tuple[httpx.Response, httpx.Response]:
    one = http.post("/v1/chat/completions", json=first)
    assert one.status_code == 200, one.text
    answer = one.json()["choices"][0]["message"]["content"]
    messages = [*first["messages"], {"role": "assistant", "content": answer},
                {"role": "user", "content": "And one more, please."}]
    two = http.post("/v1/chat/completions", json={**first, "messages": messages})
    assert two.status_code == 200, two.text
    return one, two


@pytest.mark.parametrize("key", ["session-a", None], ids=["prompt_cache_key", "conversation_prefix"])
def test_a_session_stays_on_its_replica_and_hits_the_cache(http, key):
    fields = {"prompt_cache_key": key} if key else {}
    for n in range(3):  # several sessions, so both replicas are used and the affinity is not luck
        one, two = _two_turns(http, chat(f"Session {key} number {n}: tell me about rivers.",
                                         chat_template_kwargs={"enable_thinking": False}, **fields))
        assert two.headers[REPLICA] == one.headers[REPLICA]
        assert two.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, two.json()["usage"]


def test_least_loaded_spreads_independent_requests(http):
    long = chat("Count slowly.", max_tokens=LONG, ignore_eos=True, stream=True)
    with http.stream("POST", "/v1/chat/completions", json=long) as busy:
        assert busy.status_code == 200
        busy_replica = busy.headers[REPLICA]
        chunks = busy.iter_bytes()  # kept: dropping the iterator would close the stream
        received = [next(chunks)]  # generating now
        # While the first replica holds a request, new conversations go to the idle one.
        for n in range(2):
            r = http.post("/v1/chat/completions", json=chat(f"Independent question {n}."))
            assert r.status_code == 200, r.text
            assert r.headers[REPLICA] != busy_replica
        received += list(chunks)
    assert b"".join(received).rstrip().endswith(b"data: [DONE]")


def test_previous_response_id_finds_the_replica_that_stored_it(http):
    first = http.post("/v1/responses", json={"model": MODEL_ID, "input": "Remember the number 7.",
                                             "max_output_tokens": 8, "temperature": 0,
                                             "reasoning": {"effort": "none"}})
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    for n in range(3):
        follow = http.post("/v1/responses", json={"model": MODEL_ID, "input": f"What was it? ({n})",
                                                  "previous_response_id": rid, "max_output_tokens": 8,
                                                  "temperature": 0, "reasoning": {"effort": "none"}})
        assert follow.status_code == 200, follow.text
        assert follow.headers[REPLICA] == first.headers[REPLICA]
    got = http.get(f"/v1/responses/{rid}")
    assert got.status_code == 200 and got.json()["id"] == rid


def test_a_killed_replica_fails_its_request_and_new_ones_go_elsewhere(http):
    # Find the replica a session lives on, then give it a long request and kill it mid-generation.
    key = {"prompt_cache_key": "doomed"}
    victim = http.post("/v1/chat/completions", json=chat("Warm up.", **key)).headers[REPLICA]
    actor = _replica_actor(victim)
    _poll("the victim to be idle", lambda: _ongoing(actor) == 0)
    outcome: dict = {}

    def in_flight() -> None:
        outcome["response"] = http.post("/v1/chat/completions",
                                        json=chat("Write a long story.", max_tokens=LONG, ignore_eos=True, **key))

    thread = threading.Thread(target=in_flight)
    thread.start()
    _poll("the long request to reach the victim", lambda: _ongoing(actor) >= 1)
    ray.kill(actor, no_restart=True)
    thread.join(120)
    failed = outcome["response"]
    assert failed.status_code == 503, failed.text
    error = failed.json()["error"]
    assert error["type"] == "server_error" and "replica" in error["message"] and "failed" in error["message"]

    # New requests (the same session's too) are answered by a replica still running.
    for n in range(3):
        r = http.post("/v1/chat/completions", json=chat(f"After the failure {n}.", **(key if n == 0 else {})))
        assert r.status_code == 200, r.text
        assert r.headers[REPLICA] != victim

    # Ray replaces the dead replica; the replacement serves like the others.
    from ninfer_serve.ray_serve.deploy import APP_NAME, ENGINE_DEPLOYMENT
    from ray import serve

    def replaced() -> bool:
        deployment = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT]
        return deployment.status == "HEALTHY" and deployment.replica_states.get("RUNNING") == 2

    _poll("a replacement replica", replaced)
    seen = {http.post("/v1/chat/completions", json=chat(f"New session {n}.")).headers[REPLICA] for n in range(4)}
    assert victim not in seen
