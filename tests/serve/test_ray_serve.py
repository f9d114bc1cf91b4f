"""Scale-out on Ray Serve (ninfer_serve.ray_serve, docs/scale-out.md): a local Ray cluster on the CPU, two
engine replicas of the embedded default model behind the ingress, driven over real HTTP.

Shown: the OpenAI and Anthropic routes answer through the ingress (streaming too) with the same greedy
text as one local engine; a session (prompt_cache_key, or the conversation's opening) stays on its replica
even when that replica is the busier one, and its second turn is served from the context cache; a stored
response is found by previous_response_id the same way; independent requests go to the least loaded
replica; a client that disconnects cancels its engine request; a killed replica fails its in-flight
requests (a 503 naming the replica failure, or an error event ending a started stream) while new requests
go to the replica still running, and Ray's replacement serves; ``ninfer serve --ray`` runs and stops.

Routing is checked through the ``x-ninfer-replica`` header each answer carries and Ray's per-replica count of
requests in flight. Nothing waits on a clock except the generous bounds of polls for a state to be reached.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from serve_helpers import MODEL_ID, client_for, sse_json

NO_RAY = "Ray Serve is not installed: pip install 'ninfer-serve[ray]'"
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason=NO_RAY)
# Ray Serve's own pydantic models still use a pydantic 1 idiom; not this code's warning to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`:DeprecationWarning")

REPLICA = "x-ninfer-replica"
ENGINE = {"device": "cpu", "dtype": "bfloat16", "max_concurrency": 2, "max_context": 512, "queue_capacity": 4}
# Long enough that a request is still generating while the test routes another one next to it or kills
# its replica (the default model decodes a few hundred tokens per second on the CPU).
LONG = 400


@pytest.fixture(scope="module")
def ray_base(request):
    ray = pytest.importorskip("ray", reason=NO_RAY)
    default_artifact = request.getfixturevalue("default_artifact")  # after the skip: no conversion without Ray
    from ninfer.contracts.options import EngineOptions
    from ninfer_serve.config import ServeConfig
    from ninfer_serve.process import free_port
    from ninfer_serve.ray_serve import ReplicaSpec, ScaleOut, build_application, run_application
    from ray import serve

    # Ray routes by the queue lengths its router caches per replica. The ingress is the only sender to the engine
    # replicas, and its router keeps them exact (+1 when it sends, the replica's own count when the replica accepts,
    # -1 when the call ends, cancelled calls included), so the tests make the entries never go stale. With Ray's
    # default (10 s), an entry that expired beside a fresh one made Ray pick the fresh one without asking, so a busy
    # replica could win over an idle one. The probes of replicas without an entry (a replacement) get 2-5 s before
    # they count as no answer instead of 0.1-1 s: on a loaded machine an idle replica could miss the deadline.
    # The cluster's processes inherit these at ray.init.
    ray_env = {"RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S": "3600",
               "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "2", "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5"}
    saved = {k: os.environ.get(k) for k in ray_env}
    os.environ.update(ray_env)
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
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(unique_id)]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def _ongoing(actor) -> int:
    import ray

    return ray.get(actor.get_num_ongoing_requests.remote())


def _poll(what: str, check, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


WITHOUT_RAY = "import sys; sys.modules['ray'] = None; "  # `import ray` then fails, as on a machine without it


def _engine_actors() -> list:
    import ray

    return [ray.get_actor(a["name"], namespace="serve") for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and "#NInferEngine#" in a["name"]]


@contextlib.contextmanager
def _busy(http, replica: str) -> Iterator[None]:
    """Hold ``replica`` busy with a long stream while the block runs, so that routing by load alone would send
    a new request elsewhere: streams with fresh conversations are opened (and kept open) until one lands on it.
    If the first landed on the other replica, both now hold one and the tie goes to that other one (Ray picks
    the first least loaded replica in a fixed order, as it did for the first stream). Afterwards the streams
    are closed (the ingress cancels them) and the test waits until no replica holds a request."""
    with contextlib.ExitStack() as streams:
        for _ in range(3):
            body = chat(f"Busy work {uuid.uuid4().hex}.", max_tokens=LONG, ignore_eos=True, stream=True)
            stream = streams.enter_context(http.stream("POST", "/v1/chat/completions", json=body))
            assert stream.status_code == 200
            chunks = stream.iter_bytes()
            next(chunks)  # generating now
            streams.callback(chunks.close)
            if stream.headers[REPLICA] == replica:
                break
        else:
            pytest.fail(f"no stream landed on {replica}")
        yield
    _poll("the replicas to be idle", lambda: all(_ongoing(a) == 0 for a in _engine_actors()))


def test_without_ray_the_package_and_the_flag_say_what_to_install():
    proc = subprocess.run([sys.executable, "-c", WITHOUT_RAY + "import ninfer_serve.ray_serve"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "pip install 'ninfer-serve[ray]'" in proc.stderr
    proc = subprocess.run([sys.executable, "-c", WITHOUT_RAY + "from ninfer.cli.main import main; "
                           "sys.exit(main(['serve', 'model.ninfer', '--ray']))"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "--ray needs Ray Serve, which is not installed: pip install 'ninfer-serve[ray]'" in proc.stderr


@needs_ray
def test_affinity_keys():
    from ninfer_serve.ray_serve.affinity import affinity_of

    def key(path: str, body: dict, method: str = "POST"):
        return affinity_of(method, path, json.dumps(body).encode())

    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    # A conversation's later turns share its key; another opening, or a prompt_cache_key, has another.
    assert key("/v1/chat/completions", {"messages": turn1}).key == key("/v1/chat/completions", {"messages": turn2}).key
    assert key("/v1/chat/completions", {"messages": turn1}).key != key("/v1/chat/completions",
                                                                       {"messages": turn1[1:]}).key
    cached = key("/v1/chat/completions", {"messages": turn1, "prompt_cache_key": "s"})
    assert cached.key == key("/v1/responses", {"input": "x", "prompt_cache_key": "s"}).key != \
        key("/v1/chat/completions", {"messages": turn1}).key
    # Anthropic's system prompt is part of the opening; Completions key on the prompt's start.
    assert key("/v1/messages", {"system": "a", "messages": turn1[1:]}).key != \
        key("/v1/messages", {"system": "b", "messages": turn1[1:]}).key
    long = "x" * 600
    assert key("/v1/completions", {"prompt": long + "1"}).key == key("/v1/completions", {"prompt": long + "2"}).key
    assert key("/v1/completions", {"prompt": ["a", "b"]}).key is None  # a batch: by load
    # Stored responses pin; everything else, and bodies that are not JSON objects, route by load.
    assert key("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}).response_id == "resp_1"
    assert affinity_of("GET", "/v1/responses/resp_2", b"").response_id == "resp_2"
    assert affinity_of("DELETE", "/v1/responses/resp_3", b"").response_id == "resp_3"
    assert affinity_of("POST", "/v1/chat/completions", b"{not json").key is None
    assert affinity_of("POST", "/v1/chat/completions", b"[1]").key is None
    assert affinity_of("GET", "/v1/models", b"").key is None
    assert affinity_of("POST", "/tokenize", b'{"prompt": "x"}').key is None


@needs_ray
def test_scale_out_bounds():
    from ninfer_serve.ray_serve import ScaleOut

    assert ScaleOut(min_replicas=2, max_replicas=2).replica_count() == {"num_replicas": 2}
    auto = ScaleOut(min_replicas=1, max_replicas=4, initial_replicas=2, target_ongoing_requests=8).replica_count()
    assert auto == {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                           "target_ongoing_requests": 8}}
    for bad in ({"min_replicas": 0}, {"min_replicas": 3, "max_replicas": 2}, {"max_replicas": 2, "initial_replicas": 3},
                {"target_ongoing_requests": 0}, {"num_gpus": -1}, {"max_ongoing_requests": 0}):
        with pytest.raises(ValueError):
            ScaleOut(**bad).validate()


def test_ray_flags_are_checked_before_anything_loads(capsys):
    from ninfer.cli import main as cli_main

    for argv, message in ((["--replicas", "2"], "--replicas needs --ray"),
                          (["--ray", "--replicas", "2", "--min-replicas", "1", "--max-replicas", "3"], "not both"),
                          (["--ray", "--min-replicas", "1"], "needs both --min-replicas and --max-replicas")):
        assert cli_main.main(["serve", "model.ninfer", *argv]) == 2
        assert message in capsys.readouterr().err


@needs_ray
def test_the_command_serves_on_a_ray_cluster_of_its_own(default_artifact):
    """``ninfer serve --ray``: a cluster started for the command, one replica, answering until SIGTERM, after
    which the command exits 0 (run before the module's cluster starts: one Ray cluster at a time)."""
    import os
    import signal

    from ninfer_serve.process import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", str(default_artifact), "--ray", "--ray-address", "local",
           "--replicas", "1", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "bfloat16",
           "--max-context", "512", "--max-concurrency", "2", "--no-warmup"]
    proc = subprocess.Popen(cmd, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "[ninfer] serving" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        _poll("the command to say it serves", lambda: ready.is_set() or proc.poll() is not None, timeout=180)
        assert ready.is_set(), "".join(lines)
        assert "with 1 engine replica(s)" in "".join(lines)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat("Hello."), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL_ID and r.headers[REPLICA]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, "".join(lines)
        reader.join(30)
        assert "[ninfer] stopping" in "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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


@pytest.mark.parametrize("key", ["session-a", None], ids=["prompt_cache_key", "conversation_prefix"])
def test_a_session_stays_on_its_replica_and_hits_the_cache(http, key):
    first = chat(f"Session {key}: tell me about rivers.", chat_template_kwargs={"enable_thinking": False},
                 **({"prompt_cache_key": key} if key else {}))
    one = http.post("/v1/chat/completions", json=first)
    assert one.status_code == 200, one.text
    messages = [*first["messages"], {"role": "assistant", "content": one.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And one more, please."}]
    # The second turn follows the first even while its replica is the busier one.
    with _busy(http, one.headers[REPLICA]):
        two = http.post("/v1/chat/completions", json={**first, "messages": messages})
    assert two.status_code == 200, two.text
    assert two.headers[REPLICA] == one.headers[REPLICA]
    assert two.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, two.json()["usage"]


def test_least_loaded_spreads_independent_requests(http):
    import ray

    # The premise of exact routing counts (see ray_base): the cluster's processes kept the cache setting.
    setting = ray.remote(lambda: os.environ.get("RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S"))
    assert ray.get(setting.remote(), timeout=120) == "3600"
    _poll("the replicas to be idle", lambda: all(_ongoing(a) == 0 for a in _engine_actors()))
    long = chat("Count slowly.", max_tokens=LONG, ignore_eos=True, stream=True)
    with http.stream("POST", "/v1/chat/completions", json=long) as busy, contextlib.ExitStack() as second:
        assert busy.status_code == 200
        busy_replica = busy.headers[REPLICA]
        chunks = busy.iter_bytes()  # kept: dropping the iterator would close the stream
        received = [next(chunks)]  # generating now
        # A second stream of the same conversation joins it there (affinity): the busy replica holds two, so one
        # end-of-call count of an earlier test's cancelled stream that reaches the ingress late cannot make it look
        # as idle as the other.
        again = second.enter_context(http.stream("POST", "/v1/chat/completions", json=long))
        assert again.status_code == 200 and again.headers[REPLICA] == busy_replica
        more = again.iter_bytes()
        next(more)
        second.callback(more.close)
        # While the first replica holds two requests, new conversations go to the idle one.
        for n in range(2):
            r = http.post("/v1/chat/completions", json=chat(f"Independent question {n}."))
            assert r.status_code == 200, r.text
            assert r.headers[REPLICA] != busy_replica
        received += list(chunks)
    assert b"".join(received).rstrip().endswith(b"data: [DONE]")


def test_previous_response_id_finds_the_replica_that_stored_it(http):
    ask = {"model": MODEL_ID, "max_output_tokens": 8, "temperature": 0, "reasoning": {"effort": "none"}}
    first = http.post("/v1/responses", json={**ask, "input": "Remember the number 7."})
    assert first.status_code == 200, first.text
    rid, owner = first.json()["id"], first.headers[REPLICA]
    with _busy(http, owner):
        follow = http.post("/v1/responses", json={**ask, "input": "What was it?", "previous_response_id": rid})
        got = http.get(f"/v1/responses/{rid}")
    assert follow.status_code == 200, follow.text
    assert follow.headers[REPLICA] == owner
    assert got.status_code == 200 and got.json()["id"] == rid and got.headers[REPLICA] == owner


def _cancelled(http) -> tuple[str, float]:
    """(replica, its count of cancelled chat requests) from ``/metrics``, which the least loaded replica answers."""
    r = http.get("/metrics")
    assert r.status_code == 200
    line = 'ninfer_requests_total{endpoint="/v1/chat/completions",outcome="cancelled"} '
    values = [float(x[len(line):]) for x in r.text.splitlines() if x.startswith(line)]
    return r.headers[REPLICA], (values[0] if values else 0.0)


def test_a_client_that_goes_away_cancels_its_engine_request(http):
    # With both replicas idle, Ray's least-loaded choice is the same replica for the stream and for /metrics.
    _poll("the replicas to be idle", lambda: all(_ongoing(a) == 0 for a in _engine_actors()))
    replica, before = _cancelled(http)
    with http.stream("POST", "/v1/chat/completions",
                     json=chat("Ramble on.", max_tokens=LONG, ignore_eos=True, stream=True)) as stream:
        assert stream.headers[REPLICA] == replica
        chunks = stream.iter_bytes()
        next(chunks)
        chunks.close()  # the connection closes mid-stream
    _poll("the replicas to be idle", lambda: all(_ongoing(a) == 0 for a in _engine_actors()))
    assert _cancelled(http) == (replica, before + 1)


def test_a_killed_replica_fails_its_request_and_new_ones_go_elsewhere(http):
    _poll("the replicas to be idle", lambda: all(_ongoing(a) == 0 for a in _engine_actors()))
    # A session's streamed answer and a whole-answer request are both on one replica when it is killed.
    key = {"prompt_cache_key": "doomed"}
    long = chat("Write a long story.", max_tokens=LONG, ignore_eos=True, **key)
    outcome: dict = {}

    def in_flight() -> None:
        outcome["response"] = http.post("/v1/chat/completions", json=long)

    with http.stream("POST", "/v1/chat/completions", json={**long, "stream": True}) as stream:
        assert stream.status_code == 200
        victim = stream.headers[REPLICA]
        actor = _replica_actor(victim)
        chunks = stream.iter_bytes()
        received = [next(chunks)]
        thread = threading.Thread(target=in_flight)
        thread.start()
        _poll("both requests to be on the victim", lambda: _ongoing(actor) >= 2)
        import ray

        ray.kill(actor, no_restart=True)
        received += list(chunks)
    thread.join(120)

    # The stream had started (status 200 sent): it ends with an error event naming the failure, then [DONE].
    events = sse_json(b"".join(received).decode())
    assert "replica" in events[-1]["error"]["message"], events[-1]
    assert b"".join(received).rstrip().endswith(b"data: [DONE]")
    # The whole-answer request gets a 503 in OpenAI's error shape. On a loaded machine it may still be waiting in the
    # victim's queue when the victim dies, never started there: Ray Serve then routes it to a running replica, which
    # answers it (never the victim).
    failed = outcome["response"]
    if failed.status_code == 200:
        assert failed.headers[REPLICA] != victim, (victim, failed.headers[REPLICA])
    else:
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
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#NInferEngine#" in a["name"]]
        deployment = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT]
        return (len(names) == 2 and not any(n.endswith(victim) for n in names)
                and deployment.status == "HEALTHY" and deployment.replica_states.get("RUNNING") == 2)

    _poll("a replacement replica", replaced)
    survivor = r.headers[REPLICA]
    (replacement,) = {a["name"].rsplit("#", 1)[1] for a in ray.util.list_named_actors(all_namespaces=True)
                      if "#NInferEngine#" in a["name"]} - {survivor}

    def lands_on_the_replacement() -> bool:
        r = http.post("/v1/chat/completions", json=chat(f"A new session {uuid.uuid4().hex}."))
        assert r.status_code == 200, r.text
        return r.headers[REPLICA] == replacement

    with _busy(http, survivor):
        # The ingress's router learns of a new replica from Ray's long-poll updates, a while after the controller
        # reports it running; until then new sessions go to the survivor.
        _poll("the ingress to route a new session to the replacement", lands_on_the_replacement)
