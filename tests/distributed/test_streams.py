"""Where encoder ops run: inline (CPU, and CUDA with the side stream off) or on a CUDA side stream.

On the CPU the executor with ``InlineStream`` is covered number for number by test_runtime; here
the stream objects themselves. The GPU tests check the side stream's ordering (events, no host
synchronisation), its overlap with main-stream work and ``record_stream`` on cross-stream tensors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from optimus_mllm.runtime.executor import Mailbox
from optimus_mllm.runtime.streams import InlineStream, SideStream, make_encoder_stream, to_device

from support.distributed_utils import run_distributed
from support.paths import CONFIGS

pytestmark = pytest.mark.distributed

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ONE_GPU = [
    "cluster.num_gpus=1",
    "parallel.llm={dp: 1, pp: 1, tp: 1, vp: 1}",
    "training.global_batch_size=8",
]


def test_inline_stream_runs_ops_at_once_in_call_order():
    stream = InlineStream()
    order = []
    with stream.launch():
        order.append("a")
        x = torch.ones(3)
        order.append("b")
    order.append("after")
    assert order == ["a", "b", "after"]
    assert stream.publish(x) is None
    stream.consume(None)
    assert stream.adopt(x) is x
    stream.finish()
    assert stream.device == torch.device("cpu")


def test_stream_choice_by_device():
    assert isinstance(make_encoder_stream("cpu"), InlineStream)
    disabled = make_encoder_stream("cuda", side_stream=False)  # no GPU needed to build it
    assert isinstance(disabled, InlineStream) and disabled.device.type == "cuda"


def test_mailbox_hands_embeddings_over_unchanged_inline():
    mailbox = Mailbox()
    a = torch.randn(4, 2, 8)
    mailbox.put_embeddings((3, 0), a)
    assert mailbox.take_embeddings((3, 0)) is a
    assert not mailbox.embeddings and not mailbox.ready


def test_to_device_keeps_cpu_tensors():
    x = torch.randn(2, 3)
    assert to_device(x, torch.device("cpu")) is x


class _RecordingCuda:
    """Stand-in for ``torch.cuda``'s streams on the CPU: which stream is current, who waited on
    whom."""

    def __init__(self) -> None:
        self.main = _FakeStream("main", self)
        self.current = self.main
        self.waits: list[tuple[str, str]] = []

    def Stream(self, device: object) -> _FakeStream:  # noqa: N802 - torch.cuda's name
        return _FakeStream("side", self)

    def current_stream(self, device: object = None) -> _FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: _FakeStream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


@dataclass
class _FakeStream:
    name: str
    cuda: _RecordingCuda

    def wait_stream(self, other: _FakeStream) -> None:
        self.cuda.waits.append((self.name, other.name))


def _streams_at_ddp_hooks() -> tuple[set[str], set[str], str, list[tuple[str, str]] | None]:
    """An Optimus trainer built with a side stream (on the CPU a recording stand-in): the stream
    current where megatron-core's DDP captured each parameter's gradient-accumulation node
    (encoder, LLM)."""
    from megatron.core.distributed import DistributedDataParallel

    import optimus_mllm.runtime.trainer as trainer_module
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.scheduler.artifact import schedule_job_artifact

    cuda = None
    if not torch.cuda.is_available():
        cuda = _RecordingCuda()
        for name in ("Stream", "current_stream", "stream"):
            setattr(torch.cuda, name, getattr(cuda, name))
    streams: list[SideStream] = []
    trainer_module.make_encoder_stream = lambda device, side_stream=True: (
        streams.append(SideStream("cuda")) or streams[-1]
    )
    stream_of: dict[int, str] = {}
    make_hook = DistributedDataParallel._make_backward_post_hook

    def recording(ddp: DistributedDataParallel, param: torch.nn.Parameter):
        # DDP registers the hook on param's grad_acc node
        stream_of[id(param)] = "side" if torch.cuda.current_stream() == streams[0].side else "main"
        return make_hook(ddp, param)

    DistributedDataParallel._make_backward_post_hook = recording
    config = load_config(CONFIGS / "tiny.yaml", ONE_GPU)
    planned = plan(config)
    trainer = trainer_module.Trainer(
        config, planned.llm_plan, "optimus", schedule_job_artifact(config, planned)
    )
    try:
        encoder = {stream_of[id(p)] for p in trainer.encoder.parameters() if p.requires_grad}
        llm = {stream_of[id(p)] for c in trainer.chunks for p in c.parameters() if p.requires_grad}
        current = "side" if torch.cuda.current_stream() == streams[0].side else "main"
        return encoder, llm, current, cuda.waits if cuda is not None else None
    finally:
        trainer.close()


def test_encoder_ddp_captures_its_gradient_accumulation_on_the_side_stream():
    (result,) = run_distributed(_streams_at_ddp_hooks, 1, timeout=180)
    encoder, llm, current_after, waits = result
    assert encoder == {"side"}, "the encoder's accumulation nodes would belong to the LLM's stream"
    assert llm == {"main"}
    assert current_after == "main"
    if waits is not None:  # the stand-in's record
        # the side stream started after the main stream's work so far; the main stream waits on it
        assert waits[0] == ("side", "main") and waits[-1] == ("main", "side"), waits


# -- GPU ------------------------------------------------------------------------------------------


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles of torch.cuda._sleep per millisecond, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _matmuls(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = torch.tanh(x @ x)
    return x


@needs_gpu
def test_side_stream_overlaps_main_stream_sleep():
    cycles_per_ms = _sleep_cycles_per_ms()
    stream = SideStream("cuda")
    x = torch.randn(2048, 2048, device="cuda") / 64
    _matmuls(x, 2)
    torch.cuda.synchronize()

    def timed(side: bool, window_ms: float) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(5 * cycles_per_ms))  # keep the GPU busy while the host enqueues
        start.record()
        if side:
            with stream.launch():  # the hook point: side waits for the main stream so far
                _matmuls(x, 40)
        if window_ms:
            torch.cuda._sleep(int(window_ms * cycles_per_ms))  # the LLM's window after the hook
        stream.finish()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    encoder_ms = timed(True, 0)
    window_ms = 2 * encoder_ms
    both_ms = timed(True, window_ms)
    assert both_ms < window_ms + 0.3 * encoder_ms, (encoder_ms, window_ms, both_ms)


@needs_gpu
def test_published_tensor_is_ready_where_the_main_stream_consumes_it():
    cycles_per_ms = _sleep_cycles_per_ms()
    stream = SideStream("cuda")
    with stream.launch():
        torch.cuda._sleep(int(20 * cycles_per_ms))  # a slow encoder op
        a = torch.full((1 << 20,), 3.0, device="cuda")
        ready = stream.publish(a)
    stream.consume(ready)
    b = a + 1  # on the main stream
    assert torch.equal(b, torch.full_like(b, 4.0))


@needs_gpu
def test_adopted_main_stream_tensor_is_not_reused_while_side_stream_reads_it():
    cycles_per_ms = _sleep_cycles_per_ms()
    stream = SideStream("cuda")
    g = torch.full((1 << 22,), 1.0, device="cuda")  # like G_i: made on the LLM's stream
    with stream.launch():
        torch.cuda._sleep(int(20 * cycles_per_ms))
        out = stream.adopt(g) * 2  # read by the side stream after the sleep
    del g
    # the main stream takes the same size at once and writes it before the side stream has read g:
    # without adopt the allocator hands it g's memory. With adopt the native allocator hands it
    # other memory, and cudaMallocAsync may hand it g's, ordered after the side stream's read;
    # either way the side stream reads 1.0
    h = torch.empty(1 << 22, device="cuda")
    h.fill_(7.0)
    stream.finish()
    assert torch.equal(out, torch.full_like(out, 2.0)), "the side stream read memory reused by main"


def _one_gpu_losses(side_stream: bool) -> dict[str, list[float]]:
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer
    from optimus_mllm.scheduler.artifact import schedule_job_artifact

    config = load_config(CONFIGS / "tiny.yaml", ONE_GPU)
    planned = plan(config)
    losses = {}
    for mode, artifact in (("baseline", None), ("optimus", schedule_job_artifact(config, planned))):
        trainer = Trainer(config, planned.llm_plan, mode, artifact, side_stream=side_stream)
        assert trainer.device.type == "cuda"
        losses[mode] = [trainer.train_step(i).loss for i in range(3)]
        trainer.close()
    return losses


@needs_gpu
def test_side_stream_training_equals_inline_and_baseline_on_one_gpu():
    # both within the device run's per-test limit (scripts/gpu_truth.sh, TEST_LIMIT_S)
    (side,) = run_distributed(_one_gpu_losses, 1, True, timeout=55)
    (inline,) = run_distributed(_one_gpu_losses, 1, False, timeout=55)
    # cuBLAS may differ per stream
    assert side["optimus"] == pytest.approx(inline["optimus"], rel=1e-5)
    assert side["optimus"] == pytest.approx(side["baseline"], rel=1e-4)
