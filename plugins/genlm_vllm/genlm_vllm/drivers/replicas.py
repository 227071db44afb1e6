"""``replicas=N``: N independent engines as Ray actors behind one client (data parallel).

A request flows: the client's batcher -> :meth:`ReplicaDriver.logits` -> :class:`PrefixRouter` picks
a replica per request -> each replica's share goes to its :class:`ReplicaEngine` actor (an
:class:`~genlm_vllm.drivers.llm.LLMDriver` inside) at once -> rows come back as raw float32 bytes. A
replica that fails fails only its own requests, and the error names it; new contexts then go to the
others. A request that failed alone inside a replica (its live session's chunk) fails alone here too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from genlm_core import Failed, Request, RowsOut
from genlm_core.lineage import nearest_prefix
from genlm_vllm.drivers.base import EngineCall, EngineDriver, EngineOp
from genlm_vllm.drivers.llm import LLMDriver
from genlm_vllm.layout import Layout, layout
from genlm_vllm.options import VLLMOptions

log = logging.getLogger("genlm_vllm")

#: How many tokens back the router looks for a context it has already sent somewhere.
LOOKBACK = 8


class ReplicaError(RuntimeError):
    """A replica failed (its actor died, or its engine raised); names the replica."""


class PrefixRouter:
    """Chooses a replica per request. A context goes where its longest recently routed prefix (up to
    :data:`LOOKBACK` tokens shorter: a particle's previous step) went, so that replica's prefix cache
    holds it, unless that replica already has its fair share of the batch (all particles of one SMC
    run share the prompt; without the cap they would all stay on the first replica). Everything else
    goes to the replica with the least work in this batch, and is remembered there."""

    def __init__(self, replicas: int, memory: int = 1 << 16):
        self.replicas = replicas
        self.memory = memory
        self.dead: set[int] = set()
        self._where: OrderedDict[Request, int] = OrderedDict()

    def assign(self, contexts: Sequence[Sequence[int]]) -> list[int]:
        """One replica index per context."""
        alive = [i for i in range(self.replicas) if i not in self.dead]
        if not alive:
            raise ReplicaError(f"all {self.replicas} replicas have failed")
        load = dict.fromkeys(alive, 0)
        fair_share = -(-len(contexts) // len(alive))
        chosen = []
        for context in contexts:
            key = Request(tuple(context))
            replica = self._known(key)
            if replica is None or replica in self.dead or load[replica] >= fair_share:
                replica = min(alive, key=load.__getitem__)
            load[replica] += 1
            chosen.append(replica)
            self._remember(key, replica)
        return chosen

    def _known(self, key: Request) -> int | None:
        hit = nearest_prefix(self._where.get, key, LOOKBACK)
        return None if hit is None else hit[1]

    def _remember(self, key: Request, replica: int) -> None:
        self._where[key] = replica
        self._where.move_to_end(key)
        while len(self._where) > self.memory:
            self._where.popitem(last=False)


class ReplicaEngine:
    """One replica, inside a Ray actor: an :class:`~genlm_vllm.drivers.llm.LLMDriver` started from the
    client's options (``replicas=1``). It hosts that driver's own methods (:meth:`call`); only rows are
    sent in a form of their own (raw float32 bytes)."""

    #: The driver methods a client may call (:meth:`call`).
    CALLS = frozenset({"run", "engine_call", "load_lora", "remove_lora", "reset_prefix_cache"})

    def __init__(self, model: str, options: dict[str, Any]):
        own = VLLMOptions(**{**options, "replicas": 1})
        self.driver = LLMDriver.start(model, own, layout(own))

    def info(self) -> dict[str, Any]:
        import ray

        return {
            "node": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "context_limit": self.driver.context_limit,
            "runner": self.driver.runner,
        }

    def call(self, method: str, *args: Any) -> Any:
        """The driver's ``method`` (one of :data:`CALLS`), under its lock."""
        if method not in self.CALLS:
            raise ValueError(f"a replica does not take {method!r}: one of {sorted(self.CALLS)}")
        with self.driver.lock:
            return getattr(self.driver, method)(*args)

    @staticmethod
    def _requests(contexts: list[list[int]], adapters: list[str | None]) -> list[Request]:
        return [Request(tuple(c), a) for c, a in zip(contexts, adapters, strict=True)]

    def logits(self, contexts: list[list[int]], adapters: list[str | None]) -> tuple[int, bytes, dict[int, str]]:
        """The rows of a share as raw float32 bytes, and the requests that failed alone (by index, the error)."""
        with self.driver.lock:
            return pack_rows(self.driver.logits(self._requests(contexts, adapters)))

    def uncached_logits(self, context: list[int], adapter: str | None) -> tuple[int, bytes, dict[int, str]]:
        with self.driver.lock:
            return pack_rows(self.driver.uncached_logits(Request(tuple(context), adapter))[None])

    def close(self) -> None:
        self.driver.close()


def wait_for_replicas(actors: list[Any], every: float = 30.0) -> list[dict[str, Any]]:
    """Each actor's :meth:`ReplicaEngine.info` once its engine is up, logging what is still awaited
    (a replica waits for Ray to find it a device; loading a large model takes minutes)."""
    import ray

    refs = [a.info.remote() for a in actors]
    waited = 0.0
    while True:
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=every)
        if not pending:
            return ray.get(refs)
        waited += every
        log.warning(
            "%d of %d vLLM replicas still starting after %.0f s (Ray resources free now: %s)",
            len(pending),
            len(refs),
            waited,
            ray.available_resources(),
        )


class ReplicaDriver(EngineDriver):
    """``replicas=N`` engines (Ray actors) behind one driver."""

    def __init__(self, actors: list[Any], infos: list[dict[str, Any]], options: VLLMOptions, lay: Layout):
        super().__init__(lay, options)
        self.actors = actors
        self.infos = infos
        self.router = PrefixRouter(len(actors))
        self.context_limit = infos[0]["context_limit"]
        self.runner = infos[0]["runner"]

    @classmethod
    def start(cls, model: str, options: VLLMOptions, lay: Layout) -> ReplicaDriver:
        """Start ``options.replicas`` engine actors on the Ray cluster (joined or started here)."""
        import ray

        if not ray.is_initialized():
            ray.init(address=lay.ray_address)  # None: Ray's RAY_ADDRESS, else a local instance
        in_actor = lay.world_size == 1  # a TP/PP replica's own Ray workers claim the devices
        actor_class: Any = ray.remote(num_cpus=0, num_gpus=1 if in_actor else 0)(ReplicaEngine)
        settings = options.model_dump(exclude={"replicas"})
        log.info("starting %d vLLM replicas of %s as Ray actors (%s)", options.replicas, model, lay.describe())
        actors: list[Any] = [
            actor_class.options(scheduling_strategy="SPREAD").remote(model, settings) for _ in range(options.replicas)
        ]
        try:
            infos = wait_for_replicas(actors)
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            raise
        log.info("vLLM replicas on %s", ", ".join(f"{i['node']} (pid {i['pid']})" for i in infos))
        return cls(actors, infos, options, lay)

    @property
    def engine_count(self) -> int:
        return len(self.infos)

    def _name(self, replica: int) -> str:
        info = self.infos[replica]
        return f"replica {replica} of {len(self.actors)} (node {info['node']}, pid {info['pid']})"

    def _error(self, replica: int, exc: BaseException) -> ReplicaError:
        import ray

        if isinstance(exc, ray.exceptions.RayActorError):
            self.router.dead.add(replica)
        return ReplicaError(f"{self._name(replica)} failed: {type(exc).__name__}: {exc}")

    def _shares(self, contexts: Sequence[Sequence[int]]) -> dict[int, list[int]]:
        """The router's choice for each context, as each replica's share (indices, in order)."""
        shares: dict[int, list[int]] = {}
        for index, replica in enumerate(self.router.assign(contexts)):
            shares.setdefault(replica, []).append(index)
        return shares

    # ---- rows ---------------------------------------------------------------------------------

    def logits(self, requests: Sequence[Request]) -> list[torch.Tensor | Failed]:
        import ray

        shares = self._shares([r.token_ids for r in requests])
        pending = {
            replica: self.actors[replica].logits.remote(
                [list(requests[i].token_ids) for i in idx], [requests[i].adapter for i in idx]
            )
            for replica, idx in shares.items()
        }
        self.batches += 1
        out: list[torch.Tensor | Failed] = [Failed(RuntimeError("unreached"))] * len(requests)
        for replica, idx in shares.items():
            try:
                width, data, failed = ray.get(pending[replica])
                rows = unpack_rows(width, data, failed, len(idx), self._name(replica))
            except Exception as exc:
                rows = [Failed(self._error(replica, exc))] * len(idx)
            for i, row in zip(idx, rows, strict=True):
                out[i] = row
        return out

    def uncached_logits(self, request: Request) -> torch.Tensor:
        import ray

        replica = self.router.assign([request.token_ids])[0]
        try:
            width, data, _ = ray.get(
                self.actors[replica].uncached_logits.remote(list(request.token_ids), request.adapter)
            )
        except Exception as exc:
            raise self._error(replica, exc) from exc
        return _rows(width, data, 1)[0]  # one row computed alone: it is there, or the call raised

    # ---- the primitives -----------------------------------------------------------------------

    def run(self, calls: Sequence[EngineCall]) -> list[Any]:
        """Each call on the replica the router picks for its context; each share as one batch there."""
        import ray

        shares = self._shares([c.token_ids for c in calls])
        pending = {
            replica: self.actors[replica].call.remote(
                "run", [dataclasses.replace(calls[i], token_ids=list(calls[i].token_ids)) for i in idx]
            )
            for replica, idx in shares.items()
        }
        self.batches += 1
        out: list[Any] = [None] * len(calls)
        for replica, idx in shares.items():
            try:
                results = ray.get(pending[replica])
            except Exception as exc:
                raise self._error(replica, exc) from exc
            for i, result in zip(idx, results, strict=True):
                out[i] = result
        return out

    def engine_call(self, op: EngineOp, *args: Any) -> list[Any]:
        """The operation on every replica's engines, replica by replica."""
        return [reply for replies in self._on_every_replica("engine_call", op, *args) for reply in replies]

    def _on_every_replica(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([a.call.remote(method, *args) for a in self.actors])

    # ---- what each replica's own driver keeps -------------------------------------------------

    def load_lora(self, name: str, path: str) -> None:
        self._on_every_replica("load_lora", name, path)

    def remove_lora(self, name: str) -> None:
        self._on_every_replica("remove_lora", name)

    def reset_prefix_cache(self) -> None:
        self._on_every_replica("reset_prefix_cache")  # each replica ends its live sessions first

    def shutdown(self) -> None:
        import ray

        for replica, actor in enumerate(self.actors):
            try:
                ray.get(actor.close.remote(), timeout=60)
            except Exception as exc:
                log.info("%s: close: %s: %s", self._name(replica), type(exc).__name__, exc)
            ray.kill(actor)
        self.actors = []


def _rows(width: int, data: bytes, n: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(n, width)


def pack_rows(rows: RowsOut) -> tuple[int, bytes, dict[int, str]]:
    """A driver's rows as a replica sends them: width, raw float32 bytes (NaN in a failed request's
    place), and the failed requests' errors by index."""
    if isinstance(rows, torch.Tensor):
        out = rows.to(torch.float32).contiguous()
        return out.shape[1], out.cpu().numpy().tobytes(), {}
    failed = {i: f"{type(r.error).__name__}: {r.error}" for i, r in enumerate(rows) if isinstance(r, Failed)}
    good = [r for r in rows if not isinstance(r, Failed)]
    if not good:
        return 0, b"", failed
    nan = torch.full_like(good[0], float("nan"))
    out = torch.stack([nan if isinstance(r, Failed) else r for r in rows]).to(torch.float32).contiguous()
    return out.shape[1], out.cpu().numpy().tobytes(), failed


def unpack_rows(width: int, data: bytes, failed: dict[int, str], n: int, name: str) -> list[torch.Tensor | Failed]:
    """:func:`pack_rows`' rows as the client's: a :class:`ReplicaError` naming the replica in each
    failed request's place."""
    rows: list[torch.Tensor | Failed] = list(_rows(width, data, n)) if width else [Failed(RuntimeError())] * n
    for i, error in failed.items():
        rows[i] = Failed(ReplicaError(f"{name} failed on one request: {error}"))
    return rows
