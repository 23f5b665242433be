"""The pipe step path: a resident step loop in every rank, fed through named pipes (FIFOs) on one host.

Per rank, two FIFOs in a private directory under /dev/shm: requests (driver -> rank) and
replies (rank -> driver), carrying the packed frames of `actors.wire`. Each rank runs a
plain thread (`RankWorker.start_pipe_loop`, `actors.pipe_loop`) that blocks in `read` on
its request pipe, runs the step, and writes its reply; the driver writes every rank's
request, then waits in `select` for the replies. Waiting releases the GIL, so an engine
thread waiting for a step leaves the HTTP event loop free.

Submitting ahead: `send` and `receive` are separate, so a driver may send step k+1 before it
receives step k (its token ids can refer to step k's tokens, `actors.batch.prev_token`); each
rank launches a step as soon as its request arrives and replies in request order, so the
device runs step k+1 right after step k while the driver handles step k's tokens.

Wake-up latency: a thread woken from a blocking `select` on a busy host starts tens of
microseconds after the reply lands, a large share of a 1 ms decode step. The driver
therefore remembers how long the last step of the same shape took (phase, batch sizes,
decode steps) and sleeps in `select` only until `POLL_MARGIN_S` before that, then polls
(`select` with a zero timeout, GIL released on each call) for up to `poll_s` past it,
then blocks again. A shape seen for the first time polls from the start for `poll_s`.
`poll_s = 0` (CPU ranks, whose cores run the model) always blocks.

Why pipes rather than a Ray compiled graph: a step costs two small writes and two
wake-ups (tens of microseconds) instead of Ray's serialisation and channel round trip
(several times more, docs/benchmarks.md), and a dead rank is seen at once: the kernel closes
its end of the reply pipe, so the driver reads end-of-file instead of waiting for a
timeout. Needs every rank on the driver's host (the coordinator falls back to compiled
graphs or plain actor calls otherwise).

Opening order (no races, no blocking on a missing peer): the driver opens each reply pipe
non-blocking for reading; `start_pipe_loop` opens it for writing (a reader exists) and
starts the thread, which blocks opening the request pipe for reading; the driver opens
the request pipe for writing, retrying until that reader exists or a deadline passes.
Teardown: the driver closes its ends; each loop reads end-of-file and exits.
"""
from __future__ import annotations

import errno
import os
import select
import shutil
import tempfile
import threading
import time
from collections import deque
from typing import Any, Optional, Sequence

from actors.protocol import PipelinedStepper, StepPlan
from actors.rankset import RankCallError, RankFault, RankSet
from actors.wire import LENGTH, REPLY_ERROR, decode_reply, encode_disarm, encode_request

_F_SETPIPE_SZ = 1031  # Linux fcntl: pipe capacity (large prefill frames in one write)
POLL_MARGIN_S = 0.0003  # start polling this long before the expected reply
DRIVER_POLL_S = 0.002  # how long past the expected reply the driver polls (GPU ranks) before it blocks
_MAX_SHAPES = 4096  # remembered step shapes (prefill token counts vary): forgotten all at once beyond this


def read_exact(fd: int, n: int) -> Optional[bytearray]:
    """`n` bytes from `fd`, or None at end-of-file before that."""
    buf = bytearray(n)
    got = os.readv(fd, [buf]) if n else 0  # a frame written at once usually arrives whole
    if got < n:
        view = memoryview(buf)
        while got < n:
            k = os.readv(fd, [view[got:]])
            if k == 0:
                return None
            got += k
    return buf


def read_frame(fd: int) -> Optional[bytearray]:
    """One length-prefixed frame body, or None at end-of-file."""
    head = os.read(fd, LENGTH.size)
    if len(head) < LENGTH.size:
        rest = read_exact(fd, LENGTH.size - len(head)) if head else None
        if rest is None:
            return None
        head += rest
    (n,) = LENGTH.unpack(head)
    return read_exact(fd, n)


def write_all(fd: int, data: bytes) -> None:
    n = os.write(fd, data)  # a small frame goes in one write
    if n < len(data):
        view = memoryview(data)[n:]
        while view:
            view = view[os.write(fd, view):]


def grow_pipe(fd: int, size: int = 1 << 20) -> None:
    """Best effort: a larger pipe buffer (Linux; capped by /proc/sys/fs/pipe-max-size)."""
    try:
        import fcntl

        fcntl.fcntl(fd, _F_SETPIPE_SZ, size)
    except (OSError, ImportError):
        pass


def _set_blocking(fd: int) -> int:
    os.set_blocking(fd, True)
    return fd


class PipeStepper(PipelinedStepper):
    """Driver side of the pipe step path. `dp_of_rank[r]` is rank r's DP rank (whose batch it runs)."""

    name = "pipe"

    def __init__(self, ranks: RankSet, dp_of_rank: Sequence[int], timeout_s: float = 60.0, poll_s: float = 0.0,
                 disarm_after_s: float = 0.0, trace: bool = False, profile: Optional[str] = None):
        """`disarm_after_s` (> 0 where tensor-parallel ranks arm, `actors.armed`): after a step marked
        `arm_next`, when no request follows within that many seconds, a thread of this stepper sends every rank a
        disarm frame (under the same lock as `send`, so every rank sees it at the same place among its requests).
        `trace` (`DriverOptions.step_trace`): the driver and each rank's step loop record per-step timestamps
        (`bench.step_trace`; off by default: the rank's timing events cost a few microseconds per step);
        `profile` (`DriverOptions.step_profile`): with `trace`, each rank's loop is profiled into that path."""
        self.ranks = ranks
        self.dp_of_rank = list(dp_of_rank)
        self.poll_s = poll_s
        self._expected: dict[tuple, float] = {}  # step shape -> seconds its last step took (driver view)
        self._sent: deque[float] = deque()  # send times of the plans whose replies are still due, oldest first
        self._last_reply = 0.0  # when the last reply was received (monotonic)
        # (perf_counter after the requests were written, after the replies were read) per step, when tracing
        self.trace: Optional[deque[tuple[float, float]]] = deque(maxlen=4096) if trace else None
        self._trace_sent: deque[float] = deque()
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.dir = tempfile.mkdtemp(prefix="graphline-steps-", dir=base)
        self.req_fds: list[int] = []
        self.resp_fds: list[int] = []
        self._rank_of_fd: dict[int, int] = {}
        self.disarm_after_s = disarm_after_s
        self.disarms_sent = 0
        self._writing = threading.Condition()  # held while requests are written; the disarm thread waits on it
        self._disarm_at: Optional[float] = None  # monotonic deadline of the pending disarm
        self._disarm_thread: Optional[threading.Thread] = None
        self._disarm_idle = False  # the disarm thread waits with no deadline (a new one must wake it)
        self._closed = False
        try:
            paths = []
            for r in range(len(ranks)):
                req, resp = os.path.join(self.dir, f"req{r}"), os.path.join(self.dir, f"resp{r}")
                os.mkfifo(req, 0o600)
                os.mkfifo(resp, 0o600)
                fd = _set_blocking(os.open(resp, os.O_RDONLY | os.O_NONBLOCK))
                self.resp_fds.append(fd)
                self._rank_of_fd[fd] = r
                paths.append((req, resp))
            ranks.call("start_pipe_loop", [(req, resp, trace, profile) for req, resp in paths], per_rank=True,
                       timeout_s=timeout_s, what="start step loop")
            deadline = time.monotonic() + timeout_s
            for req, _ in paths:
                self.req_fds.append(self._open_writer(req, deadline))
        except BaseException:
            self.teardown()
            raise

    @staticmethod
    def _open_writer(path: str, deadline: float) -> int:
        while True:
            try:
                fd = _set_blocking(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                grow_pipe(fd)
                return fd
            except OSError as e:
                if e.errno != errno.ENXIO:  # ENXIO: the rank's loop has not opened its end yet
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"a rank's step loop did not open {path}")
            time.sleep(0.001)

    def run(self, plan: StepPlan, timeout_s: float) -> list[tuple[Any, float]]:
        """Send every rank its share of `plan`; returns (tokens or None, in-rank seconds) per rank."""
        self.send(plan)
        return self.receive(plan, timeout_s)

    def send(self, plan: StepPlan) -> None:
        """Write every rank's request for `plan` and return without waiting. Replies come back in the order the
        plans were sent; `receive` takes the oldest. Raises RankCallError when a rank's pipe is closed."""
        frames: dict[int, bytes] = {}
        faults: list[RankFault] = []
        with self._writing:
            self._disarm_at = None
            for r, fd in enumerate(self.req_fds):
                d = self.dp_of_rank[r]
                frame = frames.get(d)
                if frame is None:
                    frame = frames[d] = encode_request(plan, d)
                try:
                    write_all(fd, frame)
                except BrokenPipeError:
                    faults.append(RankFault(r, "died", "its step pipe is closed: the actor process exited"))
        if faults:
            raise RankCallError("step", faults, {})
        self._sent.append(time.monotonic())
        if self.trace is not None:
            self._trace_sent.append(time.perf_counter())

    def receive(self, plan: StepPlan, timeout_s: float) -> list[tuple[Any, float]]:
        """Every rank's reply to the oldest plan sent and not yet received (`plan` must be that one):
        (tokens or None, in-rank seconds) per rank. Raises RankCallError for a dead, failing or hung rank."""
        if not self._sent:
            raise RuntimeError("receive() without a plan in flight")
        sent = self._sent.popleft()
        behind = self._last_reply > sent  # another step ran on the ranks when this one was sent
        start = max(sent, self._last_reply)  # when the ranks could start on it
        results: dict[int, tuple[Any, float]] = {}
        faults: list[RankFault] = []
        pending = list(self.resp_fds)  # select reads it, does not keep it
        deadline = time.monotonic() + timeout_s
        sizes = tuple([None if b is None else (b.q_seqlens.shape[0], b.token_ids.shape[0]) for b in plan.batches])
        key = (plan.phase, plan.num_steps, plan.hints, sizes, behind)  # sizes: (B, T) per batch
        expected = self._expected.get(key)
        poll_from = start + max(0.0, expected - POLL_MARGIN_S) if expected is not None else start
        poll_until = (start + expected if expected is not None else start) + self.poll_s
        while pending and not faults:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                break
            if not self.poll_s or now >= poll_until:
                wait = left  # block
            elif now < poll_from:
                wait = poll_from - now  # sleep until just before the expected reply
            else:
                wait = 0.0  # poll
            for fd in select.select(pending, [], [], wait)[0]:
                pending.remove(fd)
                r = self._rank_of_fd[fd]
                body = read_frame(fd)
                if body is None:
                    faults.append(RankFault(r, "died", "its step pipe closed mid-step: the actor process exited"))
                    continue
                status, seconds, payload = decode_reply(body)
                if status == REPLY_ERROR:
                    faults.append(RankFault(r, "error", str(payload)))
                else:
                    if payload is not None and plan.num_steps > 1:
                        payload = payload.reshape(-1, plan.num_steps)
                    results[r] = (payload, seconds)
        if self.trace is not None:
            self.trace.append((self._trace_sent.popleft(), time.perf_counter()))
        if not pending and not faults:
            self._last_reply = time.monotonic()
            if len(self._expected) >= _MAX_SHAPES:
                self._expected.clear()
            self._expected[key] = self._last_reply - start
            if plan.arm_next and self.disarm_after_s > 0 and not self._sent:
                self._schedule_disarm(self._last_reply + self.disarm_after_s)
        if faults:
            raise RankCallError("step", sorted(faults, key=lambda f: f.rank), results)
        if pending:
            stuck = sorted(self._rank_of_fd[fd] for fd in pending)
            raise RankCallError("step", self.ranks.diagnose_hung(stuck, timeout_s), results)
        return [results[r] for r in range(len(self.req_fds))]

    def disarm_now(self) -> None:
        """The driver has gone idle (no step in flight, none to send): send every rank a disarm frame now, so a
        rank that armed behind its last step opens the gate on the padding rows while nothing waits, instead of
        when the next request comes (which would queue behind that padded replay). Harmless where nothing is
        armed: the rank reads the frame and answers nothing."""
        with self._writing:
            if self._closed or self._sent:
                return
            self._disarm_at = None
            try:
                frame = encode_disarm()
                for fd in self.req_fds:
                    write_all(fd, frame)
                self.disarms_sent += 1
            except OSError:  # a rank died: the next step reports it
                pass

    def _schedule_disarm(self, at: float) -> None:
        with self._writing:
            if self._closed:
                return
            self._disarm_at = at
            if self._disarm_thread is None:
                self._disarm_thread = threading.Thread(target=self._disarm_loop, name="graphline-disarm", daemon=True)
                self._disarm_thread.start()
            elif self._disarm_idle:  # else it wakes at an earlier deadline, finds this one and waits on
                self._writing.notify()

    def _disarm_loop(self) -> None:
        """Send the disarm frame once a scheduled deadline passes with no request written since."""
        frame = encode_disarm()
        with self._writing:
            while not self._closed:
                at = self._disarm_at
                if at is None:
                    self._disarm_idle = True
                    self._writing.wait()
                    self._disarm_idle = False
                    continue
                left = at - time.monotonic()
                if left > 0:
                    self._writing.wait(left)
                    continue
                self._disarm_at = None
                try:
                    for fd in self.req_fds:
                        write_all(fd, frame)
                    self.disarms_sent += 1
                except OSError:  # a rank died: the next step reports it
                    pass

    def teardown(self) -> None:
        """Close the driver's ends (every loop reads end-of-file and exits) and remove the FIFOs. Idempotent."""
        with self._writing:
            self._closed = True
            self._disarm_at = None
            self._writing.notify()
        for fd in self.req_fds + self.resp_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.req_fds, self.resp_fds = [], []
        self._rank_of_fd = {}
        shutil.rmtree(self.dir, ignore_errors=True)


def all_local(places: Sequence[Any]) -> bool:
    """Whether every rank runs on the driver's node (the pipe path needs it)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    return all(p.node_id == here for p in places)
