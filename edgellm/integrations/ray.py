"""Ray (the edgellm[ray] extra): batch jobs on Ray Data, and the OpenAI-compatible server as a Ray Serve deployment.

Sections: the threads rule; Ray Data (`EdgeLLMPredictor` for Dataset.map_batches, `ray_executor` behind
`edgellm batch --ray`); Ray Serve (`serve_deployment`, `run_serve` behind `edgellm serve --ray`, and `app_builder`
for Ray's `serve run`).

Threads: each actor or replica reserves num_cpus equal to its thread count, and gets the node's cores divided by the
actors placed on that node (at least one), so Ray's scheduler never puts more model threads on a node than it has
cores. A decode step reads every weight, so few replicas with several threads beat many single-threaded ones for
latency; more replicas help where the per-step Python overhead dominates (small models). On one node, replicas share
the weights through the page cache: the file is memory-mapped, read-only.
"""
from __future__ import annotations

import json
import os
import sys
import threading

import numpy as np
import ray

from edgellm.errors import EdgeLLMError
from edgellm.generation.jobs import DEFAULT_PARALLEL, run_requests

BATCHES_PER_SLOT = 4  # lines per map_batches call, per slot: enough to keep the slots refilled, small enough to retry


def threads_per_actor(cores_per_node: int, actors: int, nodes: int) -> int:
    """The threads rule: a node's cores shared by the actors placed on it (actors spread evenly over nodes)."""
    per_node = -(-actors // max(nodes, 1))
    return max(1, cores_per_node // per_node)


def threads_for(replicas: int) -> int:
    """The threads rule for `replicas` replicas (or actors) spread over the connected cluster's CPU nodes."""
    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    cores = int(min(n["Resources"]["CPU"] for n in nodes))
    return threads_per_actor(cores, replicas, len(nodes))


def _model_ref(model):
    # a local file path must mean the same file in actors whose working directory differs
    return os.path.abspath(model) if model and os.path.exists(model) else model


# ---------------------------------------------------------------------------------------------------------------
# Ray Data
# ---------------------------------------------------------------------------------------------------------------

class EdgeLLMPredictor:
    """A callable class for Dataset.map_batches(EdgeLLMPredictor, fn_constructor_kwargs=..., concurrency=N,
    num_cpus=threads): rows {"index": int, "line": JSON request text} -> {"index", "record": JSON record text}
    (edgellm.generation.jobs: same lines, same records as `edgellm batch`). Each actor loads the model once."""

    def __init__(self, model=None, defaults: dict | None = None, n_parallel: int = DEFAULT_PARALLEL, **load_kwargs):
        import edgellm  # in the actor's process: the kernels load there, not in the driver
        self.model = edgellm.load(model, **load_kwargs)
        self.defaults = dict(defaults or {})
        self.n_parallel = n_parallel

    def __call__(self, batch: dict) -> dict:
        lines = [(int(i), str(text)) for i, text in zip(batch["index"], batch["line"])]
        records = list(run_requests(self.model, lines, self.defaults, self.n_parallel))
        return {"index": np.array([r["index"] for r in records], dtype=np.int64),
                "record": np.array([json.dumps(r, ensure_ascii=False) for r in records], dtype=object)}


def connect(address: str | None = None) -> bool:
    """Join the cluster at `address` ("auto", "ray://host:10001"), or start a local one ("local" or None); a
    session already open in this process is used as it is. True when this call opened the session."""
    if ray.is_initialized():
        return False
    ray.init(address=None if address in (None, "local") else address, log_to_driver=False)
    return True


def ray_executor(model=None, defaults: dict | None = None, address: str | None = None, actors: int | None = None,
                 n_parallel: int = DEFAULT_PARALLEL, batch_size: int | None = None, n_threads: int | None = None,
                 **load_kwargs):
    """execute() for edgellm.generation.jobs.run_file: the lines through a pool of EdgeLLMPredictor actors
    (default: one per node), records yielded as their batches come back. An actor that dies is restarted and its
    batch run again (Ray Data's default for actor pools)."""
    def execute(lines):
        if not lines:
            return
        connect(address)
        n_actors = actors or len([n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0])
        threads = n_threads or threads_for(n_actors)
        ray.data.DataContext.get_current().enable_progress_bars = False  # the job's own bar reports progress
        ds = ray.data.from_items([{"index": i, "line": text} for i, text in lines])
        ds = ds.map_batches(EdgeLLMPredictor, batch_size=batch_size or n_parallel * BATCHES_PER_SLOT,
                            concurrency=n_actors, num_cpus=threads,
                            fn_constructor_kwargs=dict(model=_model_ref(model), defaults=defaults,
                                                       n_parallel=n_parallel, n_threads=threads, **load_kwargs))
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            for text in batch["record"]:
                yield json.loads(text)
    return execute


# ---------------------------------------------------------------------------------------------------------------
# Ray Serve
# ---------------------------------------------------------------------------------------------------------------

APP_NAME = "edgellm"  # the Serve application and deployment `run_serve` makes
MAX_ONGOING = 8  # requests one replica takes by default (more if it decodes more together); the rest wait in Serve


def serve_deployment(model=None, *, n_threads: int | None = None, replicas: int | None = None,
                     min_replicas: int = 1, max_replicas: int = 1, target_ongoing_requests: float = 2.0,
                     autoscaling: dict | None = None, max_ongoing_requests: int | None = None,
                     api_key: str | None = None, model_name: str | None = None, app_options: dict | None = None,
                     **load_kwargs):
    """A Ray Serve application serving `model` with edgellm.server's OpenAI-compatible app (same routes, same
    shapes) in each replica: `serve.run(serve_deployment("smollm2-135m"), route_prefix="/")`.

    replicas: a fixed count. Otherwise replicas autoscale between min_replicas and max_replicas on queue length:
    Serve adds replicas while the requests queued at or running in them average more than target_ongoing_requests
    each, and removes them as that falls; `autoscaling` adds other keys of Serve's autoscaling_config
    (upscale_delay_s, downscale_delay_s, ...). Each replica reserves n_threads CPUs, by default the threads rule's
    share for the most replicas there may be. max_ongoing_requests: what Serve sends one replica at once (default
    MAX_ONGOING, or the replica's parallel slots if more). app_options: edgellm.server.served_app's (limits, parallel,
    cache_ram, host, ...), so a replica serves as `edgellm serve` with the same flags would."""
    # Serve (FastAPI and more) and the server's web stack load only when a deployment is made, not for Ray Data
    from ray import serve
    from edgellm.server import served_app
    model = _model_ref(model)
    most = replicas or max(min_replicas, max_replicas)
    if n_threads is None:
        n_threads = threads_for(most)
    options = {**(app_options or {}), "api_key": api_key, "model_name": model_name}
    max_ongoing_requests = max_ongoing_requests or max(MAX_ONGOING, options.get("parallel") or 0)

    @serve.ingress()
    class EdgeLLMServer:
        def __init__(self):
            import edgellm  # in the replica's process: the kernels load there
            llm = edgellm.load(model, n_threads=n_threads, **load_kwargs)
            self.name, self.asgi_app = served_app(llm, model, **options)  # `app` is Serve's own attribute

        def __serve_build_asgi_app__(self):
            return self.asgi_app

        def served_name(self) -> str:
            return self.name

    if replicas is not None:
        scaling = {"num_replicas": replicas}
    elif min_replicas == max_replicas:
        scaling = {"num_replicas": min_replicas}
    else:
        scaling = {"autoscaling_config": {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                          "target_ongoing_requests": target_ongoing_requests,
                                          **(autoscaling or {})}}
    deployment = serve.deployment(EdgeLLMServer, name=APP_NAME, ray_actor_options={"num_cpus": n_threads},
                                  max_ongoing_requests=max_ongoing_requests, **scaling)
    return deployment.bind()


def wait_for_interrupt() -> None:
    """Until Ctrl-C or SIGTERM (a service manager's stop). Both are taken over while waiting, since a process
    started in the background of a script inherits SIGINT ignored; the previous handlers come back after, so a
    second Ctrl-C interrupts the teardown."""
    import signal  # only a foreground `serve --ray` waits on signals
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        stop.wait()
        return
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_serve(model=None, *, address: str | None = None, host: str = "127.0.0.1", port: int = 8000,
              log=None, wait=None, **deployment_kwargs) -> int:
    """`edgellm serve --ray [ADDRESS]`: the deployment on Serve's HTTP proxy at host:port (a local Ray instance, or
    the cluster at `address`), until `wait` returns (default: Ctrl-C); then the application is deleted, and a Ray
    instance started here stopped. deployment_kwargs: serve_deployment's."""
    from ray import serve  # Serve's web stack loads only for serving
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    started = connect(address)
    try:
        serve.start(http_options={"host": host, "port": port})
        replicas = deployment_kwargs.get("replicas")
        lo, hi = deployment_kwargs.get("min_replicas", 1), deployment_kwargs.get("max_replicas", 1)
        threads = deployment_kwargs.pop("n_threads", None) or threads_for(replicas or max(lo, hi))
        app = serve_deployment(model, n_threads=threads, **deployment_kwargs)
        log(f"edgellm: starting {model or 'the default model'} on Ray Serve (replicas load the model; the address "
            f"answers once one is ready)")
        try:
            handle = serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # Serve gave up on the replicas: their tracebacks are in Ray's log
            last = [line for line in str(e).splitlines() if line.strip()][-1:] or ["no reason given"]
            raise EdgeLLMError(f"the Ray Serve replicas did not start ({last[0].strip()}); their errors are in "
                               "Ray's log (logs/serve/replica_*.log in the session directory)") from None
        name = handle.served_name.remote().result()
        scale = (f"{replicas or lo} replica{'s' if (replicas or lo) != 1 else ''}" if replicas or lo == hi
                 else f"{lo} to {hi} replicas (autoscaling)")
        log(f"edgellm: serving {name} on http://{host}:{port} (OpenAI base_url http://{host}:{port}/v1): {scale} "
            f"on Ray Serve, {threads} thread{'s' if threads != 1 else ''} each; Ctrl-C stops")
        (wait or wait_for_interrupt)()
    finally:
        if _app_exists():
            serve.delete(APP_NAME)
        if started:
            serve.shutdown()
            ray.shutdown()
    return 0


def _app_exists() -> bool:
    from ray import serve  # Serve's web stack loads only for serving
    try:
        return APP_NAME in serve.status().applications
    except Exception:  # no Serve instance (it never started): nothing to delete
        return False


def app_builder(args: dict):
    """For Ray Serve's CLI: `serve run edgellm.integrations.ray:app_builder model=smollm2-135m max_replicas=4`
    (numbers given as text are converted)."""
    kwargs = {k: (_number(v) if isinstance(v, str) else v) for k, v in args.items()}
    return serve_deployment(**kwargs)


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
