"""Ray (the edgellm[ray] extra): batch jobs on Ray Data, and the OpenAI-compatible server as a Ray Serve deployment.

Sections: the threads rule; Ray Data (`EdgeLLMPredictor` for Dataset.map_batches, `ray_executor` behind
`edgellm batch --ray`); Ray Serve (`serve_deployment`, and `app_builder` for `serve run`).

Threads: each actor or replica reserves num_cpus equal to its thread count, and gets the node's cores divided by the
actors placed on that node (at least one), so Ray's scheduler never puts more model threads on a node than it has
cores. A decode step reads every weight, so few replicas with several threads beat many single-threaded ones for
latency; more replicas help where the per-step Python overhead dominates (small models). On one node, replicas share
the weights through the page cache: the file is memory-mapped, read-only.
"""
from __future__ import annotations

import json
import os

import numpy as np
import ray

from edgellm.generation.jobs import DEFAULT_PARALLEL, run_requests

BATCHES_PER_SLOT = 4  # lines per map_batches call, per slot: enough to keep the slots refilled, small enough to retry


def threads_per_actor(cores_per_node: int, actors: int, nodes: int) -> int:
    """The threads rule: a node's cores shared by the actors placed on it (actors spread evenly over nodes)."""
    per_node = -(-actors // max(nodes, 1))
    return max(1, cores_per_node // per_node)


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


def connect(address: str | None = None) -> None:
    """Join the cluster at `address` ("auto", "ray://host:10001"), or start a local one ("local" or None); a
    session already open in this process is used as it is."""
    if not ray.is_initialized():
        ray.init(address=None if address in (None, "local") else address, log_to_driver=False)


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
        nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
        cores = int(min(n["Resources"]["CPU"] for n in nodes))
        n_actors = actors or len(nodes)
        threads = n_threads or threads_per_actor(cores, n_actors, len(nodes))
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

def serve_deployment(model=None, *, n_threads: int = 1, min_replicas: int = 1, max_replicas: int = 1,
                     target_queue: float = 2.0, max_ongoing_requests: int = 8, api_key: str | None = None,
                     model_name: str | None = None, **load_kwargs):
    """A Ray Serve application serving `model` with edgellm.server's OpenAI-compatible app (same routes, same
    shapes) in each replica: `serve.run(serve_deployment("smollm2-135m"), route_prefix="/")`.

    Replicas autoscale between min_replicas and max_replicas on queue length: Serve adds one when the requests
    queued at or running in the replicas average more than target_queue each (a replica generates one at a time,
    so 2 means one running and one waiting). Each replica reserves n_threads CPUs (the threads rule)."""
    # Serve (FastAPI and more) and the server's web stack load only when a deployment is made, not for Ray Data
    from ray import serve
    from edgellm.server import create_app
    model = _model_ref(model)

    @serve.ingress()
    class EdgeLLMServer:
        def __init__(self):
            import edgellm  # in the replica's process: the kernels load there
            self.llm = edgellm.load(model, n_threads=n_threads, **load_kwargs)

        def __serve_build_asgi_app__(self):
            name = model_name or (model if model and not str(model).endswith(".gguf") else None)
            return create_app(self.llm, api_key=api_key, model_name=name)

    scaling = ({"num_replicas": min_replicas} if min_replicas == max_replicas else
               {"autoscaling_config": {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                       "target_ongoing_requests": target_queue}})
    deployment = serve.deployment(EdgeLLMServer, name="edgellm", ray_actor_options={"num_cpus": n_threads},
                                  max_ongoing_requests=max_ongoing_requests, **scaling)
    return deployment.bind()


def app_builder(args: dict):
    """For Ray Serve's CLI: `serve run edgellm.integrations.ray:app_builder model=smollm2-135m max_replicas=4`
    (numbers given as text are converted)."""
    kwargs = {k: (int(v) if isinstance(v, str) and v.isdigit() else v) for k, v in args.items()}
    return serve_deployment(**kwargs)
