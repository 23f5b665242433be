"""The live rank actors of one deployment, and bounded calls to them.

Every call to the ranks goes through `RankSet.call`: `ray.wait` with a deadline (never
an unbounded `ray.get`), results by rank, and failures classified per rank:
- died: the actor process is gone (Ray's actor-death notification is the sentinel);
- error: the method raised (a rank that raised mid-collective leaves its peers stuck);
- hung: no answer before the deadline; the health group (`health()`, answered by a
  separate thread while a step runs) says whether the rank is alive and what it is doing.
Steps go through a stepper (`actors.protocol.Stepper`: the whole step in `run`): plain actor
calls, or a Ray compiled graph (one input channel to every rank, one output per rank; the
actors run a resident loop).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from actors.placement import ActorPlace, remove_group
from actors.protocol import StepPlan, Stepper

PEER_DEATH_GRACE_S = 3.0  # how long a step that failed with a rank's error waits to see whether a peer died


@dataclass(frozen=True)
class RankFault:
    rank: int
    kind: str  # "died" | "error" | "hung"
    detail: str

    def __str__(self) -> str:
        return f"rank {self.rank} {self.kind}: {self.detail}"


class RankCallError(Exception):
    """Some ranks failed a call; `faults` names them, `results` holds what the others returned."""

    def __init__(self, what: str, faults: Sequence[RankFault], results: dict[int, Any]):
        self.what, self.faults, self.results = what, list(faults), results
        super().__init__(f"{what}: " + "; ".join(str(f) for f in self.faults))

    @property
    def dead_ranks(self) -> set[int]:
        return {f.rank for f in self.faults if f.kind == "died"}


def _death_text(e: BaseException) -> str:
    """A short reason for an actor death (Ray's message is a paragraph)."""
    text = " ".join(str(e).split())
    if "ray.kill" in text:
        why = "killed by ray.kill"
    elif "Worker exit type:" in text:
        why = text.split("Worker exit type:", 1)[1].split(" Some common causes", 1)[0].strip()[:160]
    else:
        why = text[:160]
    pid = getattr(e, "pid", None) or (text.split("pid: ", 1)[1].split(" ", 1)[0] if "pid: " in text else "?")
    return f"actor process is gone (pid {pid}): {why}"


def _error_text(e: BaseException) -> str:
    """One line: the exception (the remote cause for a RayTaskError)."""
    cause = getattr(e, "cause", None)
    if isinstance(e, RayTaskError) and cause is not None:
        e = cause
    text = " | ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return f"{type(e).__name__}: {text}"[:800]


class RankSet:
    """Workers in rank order, where they run, and their placement group (owned: `kill()` removes it)."""

    def __init__(self, workers: Sequence[Any], places: Sequence[ActorPlace], pg: Any):
        self.workers = list(workers)
        self.places = list(places)
        self.pg = pg
        self.killed = False
        self.watcher: Any = None  # `actors.watch.RankWatcher` of a serving group: its heartbeats explain silence
        self._rank_of_actor = {w._actor_id.hex(): r for r, w in enumerate(self.workers)}
        self._rank_of_pid = {p.pid: r for r, p in enumerate(self.places)}

    def __len__(self) -> int:
        return len(self.workers)

    def call(self, method: str, args: Any = (), *, timeout_s: float, what: Optional[str] = None,
             per_rank: bool = False, fail_fast: bool = True, ranks: Optional[Sequence[int]] = None) -> list[Any]:
        """Call `method` on every rank (or `ranks`); returns results in rank order or raises RankCallError.

        per_rank: `args` is a list of argument tuples, one per called rank.
        fail_fast: stop waiting at the first fault (steps; peers may be stuck in collectives).
        """
        ranks = list(range(len(self.workers))) if ranks is None else list(ranks)
        refs = {}
        for i, r in enumerate(ranks):
            a = args[i] if per_rank else args
            refs[getattr(self.workers[r], method).remote(*a)] = r
        return self.wait(refs, timeout_s=timeout_s, what=what or method, fail_fast=fail_fast)

    def wait(self, refs: dict[Any, int], *, timeout_s: float, what: str, fail_fast: bool = True) -> list[Any]:
        pending = list(refs)
        results: dict[int, Any] = {}
        faults: list[RankFault] = []
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for ref in ready:
                r = refs[ref]
                try:
                    results[r] = ray.get(ref, timeout=0)
                except RayActorError as e:
                    faults.append(RankFault(r, "died", _death_text(e)))
                except RayTaskError as e:
                    faults.append(RankFault(r, "error", _error_text(e)))
            if faults and fail_fast:
                break
        if pending and faults and fail_fast and all(f.kind == "error" for f in faults):
            faults.extend(self._dead_peers(refs, pending, deadline))
        if pending and not (faults and fail_fast):
            faults.extend(self.diagnose_hung([refs[p] for p in pending], timeout_s))
        if faults:  # a death first: a peer's collective error is its consequence
            raise RankCallError(what, sorted(faults, key=lambda f: (f.kind != "died", f.rank)), results)
        return [results[refs_r] for refs_r in sorted(results)]

    def _dead_peers(self, refs: dict[Any, int], pending: list[Any], deadline: float) -> list[RankFault]:
        """After a rank raised (often a collective error: a peer's connection reset): which pending ranks died,
        within `PEER_DEATH_GRACE_S` (Ray or the heartbeat watcher needs a moment to see a killed process). Ranks
        still pending after it are left alone (stuck in a collective with the failed rank)."""
        grace_end = min(deadline, time.monotonic() + PEER_DEATH_GRACE_S)
        dead: list[RankFault] = []
        while pending and not dead:
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(0.1, max(0.0, grace_end - time.monotonic())))
            for ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except RayActorError as e:
                    dead.append(RankFault(refs[ref], "died", _death_text(e)))
                except RayTaskError:
                    pass  # its own collective error: the consequence, not the cause
            if self.watcher is not None and not dead:
                pend = {refs[p] for p in pending}
                dead = [RankFault(b["rank"], "died", "its process is gone (seen by the heartbeat watcher)")
                        for b in self.watcher.snapshot()["ranks"] if b["state"] == "dead" and b["rank"] in pend]
            if time.monotonic() >= grace_end:
                break
        return dead

    def diagnose_hung(self, ranks: Sequence[int], waited_s: float) -> list[RankFault]:
        """Why ranks did not answer: alive-but-stuck, or dead. From the watcher's latest heartbeats when one runs
        (no further wait), else by probing each rank's health thread (up to 3 s)."""
        if self.watcher is not None:
            beats = {b["rank"]: b for b in self.watcher.snapshot()["ranks"]}
            out = []
            for r in ranks:
                b = beats[r]
                if b["state"] == "dead":
                    out.append(RankFault(r, "died", "its process is gone (seen by the heartbeat watcher)"))
                elif b["state"] == "unresponsive":
                    out.append(RankFault(r, "hung", f"no answer after {waited_s:.1f}s and no heartbeat for "
                                                    f"{b['silent_s']:.1f}s"))
                else:
                    out.append(RankFault(r, "hung", f"no answer after {waited_s:.1f}s; alive, in '{b['phase']}' "
                                                    f"for {b['phase_s']:.1f}s"))
            return out
        probes = {self.workers[r].health.remote(): r for r in ranks}
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=3.0)
        out = []
        for ref, r in probes.items():
            if ref not in ready:
                out.append(RankFault(r, "hung", f"no answer after {waited_s:.1f}s and its health probe is silent"))
                continue
            try:
                h = ray.get(ref, timeout=0)
                out.append(RankFault(r, "hung", f"no answer after {waited_s:.1f}s; alive, in '{h['phase']}' "
                                                f"for {h['phase_s']:.1f}s"))
            except (RayActorError, RayTaskError, GetTimeoutError) as e:
                out.append(RankFault(r, "died", _death_text(e)))
        return out

    def probe(self, timeout_s: float = 5.0, method: str = "info") -> list[Optional[dict]]:
        """`info()` of every rank (None for a dead or silent one); never raises."""
        if self.killed:
            return [None] * len(self.workers)
        refs = [getattr(w, method).remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=0) if ref in ready else None)
            except Exception:  # noqa: BLE001 - dead rank
                out.append(None)
        return out

    def rank_of_error(self, e: BaseException) -> Optional[int]:
        actor_id = getattr(e, "actor_id", None)
        if actor_id is not None:
            key = actor_id if isinstance(actor_id, str) else getattr(actor_id, "hex", lambda: None)()
            if key in self._rank_of_actor:
                return self._rank_of_actor[key]
        pid = getattr(e, "pid", None)
        return self._rank_of_pid.get(pid) if pid is not None else None

    def kill(self) -> None:
        """Kill every actor and release the placement group (idempotent)."""
        if self.killed:
            return
        self.killed = True
        self.kill_processes()
        remove_group(self.pg)

    def kill_processes(self) -> None:
        """Kill every rank's process, from any thread, leaving the placement group: ranks on the driver's node get
        SIGKILL directly (a stopped process, SIGSTOP, cannot act on Ray's request to exit), every actor
        `ray.kill`. Best effort: a process already gone is skipped."""
        import os
        import signal

        try:
            here = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - Ray already shut down
            here = None
        for p in self.places:
            if here is not None and p.node_id == here and p.pid and p.pid != os.getpid():
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except OSError:
                    pass
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass


class PlainStepper(Stepper):
    """One actor call per rank per step."""

    name = "plain"

    def __init__(self, ranks: RankSet):
        self.ranks = ranks

    def run(self, plan: StepPlan, timeout_s: float) -> list[tuple[Any, float]]:
        return self.ranks.call("execute_step", (plan,), timeout_s=timeout_s, what="step")

    def teardown(self) -> None:
        pass


class CompiledStepper(Stepper):
    """A Ray compiled graph: InputNode -> execute_step on every rank -> MultiOutputNode."""

    name = "compiled"

    def __init__(self, ranks: RankSet):
        from ray.dag import InputNode, MultiOutputNode

        self.ranks = ranks
        with InputNode() as inp:
            dag = MultiOutputNode([w.execute_step.bind(inp) for w in ranks.workers])
        self.dag = dag.experimental_compile()

    def run(self, plan: StepPlan, timeout_s: float) -> list[tuple[Any, float]]:
        from ray.exceptions import RayChannelTimeoutError

        t0 = time.monotonic()
        try:
            refs = self.dag.execute(plan)
            return ray.get(refs, timeout=timeout_s)
        except (RayChannelTimeoutError, GetTimeoutError):
            n = len(self.ranks)
            faults = self.ranks.diagnose_hung(range(n), time.monotonic() - t0)
            stuck = [f for f in faults if f.kind == "died" or f.detail.find("'execute'") >= 0] or faults
            raise RankCallError("step", stuck, {}) from None
        except RayActorError as e:
            r = self.ranks.rank_of_error(e)
            raise RankCallError("step", self._named(r, "died", e), {}) from None
        except RayTaskError as e:
            r = self.ranks.rank_of_error(e)
            raise RankCallError("step", self._named(r, "error", e), {}) from None

    def _named(self, rank: Optional[int], kind: str, e: BaseException) -> list[RankFault]:
        if rank is not None:
            return [RankFault(rank, kind, _death_text(e) if kind == "died" else _error_text(e))]
        dead = [RankFault(r, "died", "no answer to its health probe")
                for r, info in enumerate(self.ranks.probe(3.0, "health")) if info is None]
        return dead or [RankFault(-1, kind, _error_text(e))]

    def teardown(self) -> None:
        try:
            self.dag.teardown()
        except Exception:  # noqa: BLE001 - actors already killed
            pass
