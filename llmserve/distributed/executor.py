"""Runs a parallel group (tensor x pipeline ranks): rank 0 in the engine's process, one worker process per other
rank. Rank r is tensor-parallel rank r % tp of pipeline stage r // tp; rank 0 is the first stage's first.

Why this split: the scheduler, the KV manager and the sampler's results live in one process (the
engine's), as with one rank; the workers only mirror the model runner. Each step, rank 0 pickles the
step's inputs once (the `SchedulerOutput`s since the last step, the step cut into its pipeline
micro-batches, and the tokens sampled last time) and writes the same bytes to every worker's pipe; then
every rank runs the same `ModelRunner.execute` on each micro-batch, whose forward pass meets its stage's
other ranks in two all-reduces per layer and one all-gather of the logits (distributed/tensor_parallel.py)
and hands its hidden states to the next stage (distributed/pipeline_parallel.py). The last stage samples;
its first rank writes the step's result back on its pipe. Tensor-parallel ranks sample too (it keeps every
rank on the same code path), but a request sampling from the engine's random stream may draw differently on
another rank, so the kept tokens replace each worker's at the next step (`ModelRunner.replace_sampled`),
and reach the stages that sampled nothing the same way.

Failure: a step that fails on any rank leaves the others waiting in a collective or a receive, or out of
step with rank 0, so it is never retried: the group is stopped and the engine raises `ParallelGroupError`,
which ends its loop (the server turns unhealthy and exits non-zero). Collectives and receives time out
(`collective_timeout_s`), as does rank 0's wait for the last stage's result, so a hung rank is found too. A
worker whose parent dies sees its pipe close and exits; workers are daemons, and `shutdown` (or the
engine's exit) stops them.
"""

from __future__ import annotations

import datetime
import functools
import logging
import multiprocessing as mp
import pickle
import queue
import time
import weakref
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from llmserve.config import EngineConfig
from llmserve.distributed.pipeline_parallel import PipelineStage, micro_batches
from llmserve.distributed.tensor_parallel import TensorParallel
from llmserve.engine.build_plan import BuildPlan
from llmserve.engine.model_runner import ModelRunner, RunnerStoppedError
from llmserve.engine.step import ModelRunnerOutput, SchedulerOutput
from llmserve.loader import Checkpoint

logger = logging.getLogger(__name__)


class ParallelGroupError(RunnerStoppedError):
    """The parallel group cannot run another step (a rank died, failed or hung)."""


class ParallelRunner:
    """Rank 0 of the group, with `ModelRunner`'s interface: what the engine holds instead of one runner."""

    def __init__(self, plan: BuildPlan, ckpt: Checkpoint, config: EngineConfig) -> None:
        size = plan.tensor_parallel_size * plan.pipeline_parallel_size
        parallel = config.parallel
        self.timeout_s = parallel.collective_timeout_s
        threads = max(1, (parallel.threads_per_rank or torch.get_num_threads() // size))
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # the group's meeting point: rank 0's store, on a port the system picks
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        context = mp.get_context("spawn")  # never fork a process holding torch's thread pools
        ready = context.Queue()
        self._workers: list[mp.Process] = []
        self._pipes: list[Connection] = []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            args = (rank, size, store.port, threads, self.timeout_s, config, plan, theirs, ready)
            worker = context.Process(target=_worker_main, name=f"llmserve-rank{rank}", daemon=True, args=args)
            worker.start()
            theirs.close()
            self._workers.append(worker)
            self._pipes.append(ours)
        self._finalizer = weakref.finalize(self, _stop, self._pipes, self._workers, torch.get_num_threads())
        start = time.perf_counter()
        try:
            torch.set_num_threads(threads)
            tp, pipeline = _join_groups(0, plan, store, timeout)
            self.local = ModelRunner(plan, ckpt, tp, pipeline=pipeline)
            self._wait_ready(ready, size - 1)
        except BaseException:
            self.shutdown()
            raise
        logger.info("parallel group: %d tensor-parallel rank(s) x %d pipeline stage(s) over %s, %d thread(s) each, "
                    "ready in %.1fs", plan.tensor_parallel_size, plan.pipeline_parallel_size,
                    "nccl" if plan.device.startswith("cuda") else "gloo", threads, time.perf_counter() - start)
        # the last stage's first rank answers each step (with one stage, rank 0 samples itself)
        self._answers = self._pipes[_reporting_rank(plan) - 1] if plan.pipeline_parallel_size > 1 else None
        self._stages = plan.pipeline_parallel_size
        self._pending: list[SchedulerOutput] = []  # state changes the workers have not seen yet
        self._last_sampled: dict[str, list[int]] = {}
        self._error: BaseException | None = None

    # --- ModelRunner's interface ---------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._error is None and all(w.is_alive() for w in self._workers)

    def update_states(self, out: SchedulerOutput) -> None:
        self._pending.append(out)
        self.local.update_states(out)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if not self.healthy:
            raise ParallelGroupError(f"the parallel group has stopped: {self._describe_failure()}")
        batches = micro_batches(out, self._stages)
        parts = [out] if len(batches) == 1 else [out.restricted_to(batch) for batch in batches]
        message = pickle.dumps((self._pending, parts, self._last_sampled), protocol=pickle.HIGHEST_PROTOCOL)
        self._pending = []
        try:
            for pipe in self._pipes:
                pipe.send_bytes(message)
            results = [self.local.execute(part) for part in parts]
            if self._answers is not None:  # the first stage: its hidden states sent, the tokens come from the last
                self.local.pipeline.flush()
                results = [self._answer()]
                self.local.replace_sampled({}, results[0].sampled_token_ids)
        except Exception as e:
            self._error = e
            reason = self._describe_failure()
            self.shutdown()
            raise ParallelGroupError(f"a parallel step failed ({reason}); the group is stopped") from e
        result = functools.reduce(ModelRunnerOutput.merge, results)
        self._last_sampled = result.sampled_token_ids
        return result

    def shutdown(self) -> None:
        """Stop the workers (a message, then a terminate for any that lingers)."""
        self._finalizer()

    # --- internals -----------------------------------------------------------------------------

    def _answer(self) -> ModelRunnerOutput:
        """The last stage's result for this step: waits while every rank lives, up to the collective timeout."""
        deadline = time.monotonic() + self.timeout_s
        while not self._answers.poll(0.05):
            if dead := [w for w in self._workers if not w.is_alive()]:
                raise ParallelGroupError(f"{dead[0].name} exited (code {dead[0].exitcode}) during a step")
            if time.monotonic() > deadline:
                raise ParallelGroupError(f"the last pipeline stage did not answer within {self.timeout_s:g}s")
        return pickle.loads(self._answers.recv_bytes())

    def _wait_ready(self, ready: mp.Queue, count: int) -> None:
        """Each worker's model built, or the first failure (a worker's error, or its death)."""
        waiting = count
        while waiting:
            try:
                rank, error = ready.get(timeout=1.0)
            except queue.Empty:
                dead = [w for w in self._workers if not w.is_alive()]
                if dead:
                    raise ParallelGroupError(f"{dead[0].name} exited (code {dead[0].exitcode}) while loading") \
                        from None
                continue
            if error is not None:
                raise ParallelGroupError(f"rank {rank} failed to load: {error}")
            waiting -= 1

    def _describe_failure(self) -> str:
        time.sleep(0.2)  # a peer whose socket just closed is usually exiting: let it, so its code shows
        dead = [f"{w.name} exited with code {w.exitcode}" for w in self._workers if not w.is_alive()]
        return "; ".join(dead) or f"{type(self._error).__name__}: {self._error}"


def _worker_main(rank: int, size: int, port: int, threads: int, timeout_s: float, config: EngineConfig,
                 plan: BuildPlan, pipe: Connection, ready: mp.Queue) -> None:
    """A worker rank: join the group, build this rank's slice, then run each step rank 0 sends until its
    pipe closes or says stop (the last stage's first rank writing the step's result back). Any failure ends the
    process non-zero (rank 0 sees it and stops the group)."""
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    torch.set_num_threads(threads)
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
        tp, pipeline = _join_groups(rank, plan, store, timeout)
        from llmserve.kernels import load_cpu_kernels
        from llmserve.loader import load_checkpoint

        if "native" in (plan.attention, plan.elementwise, plan.argmax, plan.small_step_kernels):
            load_cpu_kernels()
        runner = ModelRunner(plan, load_checkpoint(config.model.model), tp, pipeline=pipeline)
    except BaseException as e:
        ready.put((rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from e
    ready.put((rank, None))
    sampled: dict[str, list[int]] = {}
    answers = rank == _reporting_rank(plan) and plan.pipeline_parallel_size > 1  # this rank writes each step's result
    while True:
        try:
            message = pipe.recv_bytes()
        except (EOFError, OSError):  # rank 0 is gone
            break
        if not message:  # stop
            break
        updates, parts, truth = pickle.loads(message)
        runner.replace_sampled(sampled, truth)
        for update in updates:
            runner.update_states(update)
        # raising ends the process: rank 0 sees the group fail
        result = functools.reduce(ModelRunnerOutput.merge, [runner.execute(part) for part in parts])
        if pipeline is not None:
            pipeline.flush()
        sampled = result.sampled_token_ids
        if answers:
            pipe.send_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))


def _reporting_rank(plan: BuildPlan) -> int:
    """The rank that answers each step: the last stage's first."""
    return (plan.pipeline_parallel_size - 1) * plan.tensor_parallel_size


def _join_groups(rank: int, plan: BuildPlan, store: dist.Store, timeout: datetime.timedelta
                 ) -> tuple[TensorParallel | None, PipelineStage | None]:
    """This rank's tensor-parallel group (its stage's ranks) and pipeline group (the same tensor-parallel rank of
    every stage), each on its own prefix of the store; None where that dimension is 1. Returns once every member
    has joined (or raises after `timeout`)."""
    tp_size, pp_size = plan.tensor_parallel_size, plan.pipeline_parallel_size
    stage, tp_rank = divmod(rank, tp_size)
    if plan.device.startswith("cuda"):
        torch.cuda.set_device(rank)
    tp = pipeline = None
    if tp_size > 1:
        group = _process_group(dist.PrefixStore(f"tp{stage}", store), tp_rank, tp_size, timeout, plan.device)
        tp = TensorParallel(tp_rank, tp_size, group)
    if pp_size > 1:
        group = _process_group(dist.PrefixStore(f"pp{tp_rank}", store), stage, pp_size, timeout, plan.device)
        pipeline = PipelineStage(stage, pp_size, group, plan.pipeline_stages[stage], plan.dtype)
    return tp, pipeline


def _process_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, device: str
                   ) -> dist.ProcessGroup:
    """Gloo on CPU; on CUDA, NCCL with rank r on GPU r (not tested here: no GPU on this machine)."""
    if device.startswith("cuda"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _stop(pipes: list[Connection], workers: list[mp.Process], threads: int) -> None:
    """Stop the workers, and give the engine's process back the threads it had before rank 0 took one share."""
    torch.set_num_threads(threads)
    for pipe in pipes:
        try:
            pipe.send_bytes(b"")
            pipe.close()
        except OSError:
            pass
    for worker in workers:
        worker.join(timeout=5.0)
        if worker.is_alive():
            worker.terminate()
            worker.join(timeout=5.0)
