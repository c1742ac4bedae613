"""A comparison runs a few tensors at once (comparator.hidden.pipeline): the same report, in the same order."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import dumper
from comparator import CompareConfig, compare_dumps
from comparator.hidden.pipeline import in_order
from dumper.prefill.forward import pad_batch, prefill
from dumper.prefill.run import RunConfig, run_dump
from tests.conftest import tiny_llama

PROMPTS = (
    "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. " * 2,
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "Chunked prefill must not change a single number that the model computes, ever.",
)


def test_results_come_in_job_order_with_bounded_concurrency():
    lock, running, peak = threading.Lock(), [0], [0]
    together: list[threading.Barrier] = []

    def job(i: int):
        def run(kernel_threads: int) -> tuple[int, int]:
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            if i < together[0].parties:  # the first jobs wait for each other, so they overlap however slowly a
                together[0].wait(
                    timeout=30
                )  # busy machine starts their threads (not, it fails: they never ran at once)
            time.sleep(0.002 * (7 - i % 7))  # early jobs finish last
            with lock:
                running[0] -= 1
            return i, kernel_threads

        return run

    for threads in (1, 2, 3):
        peak[0] = 0
        together[:] = [threading.Barrier(threads)]
        out = list(in_order([job(i) for i in range(10)], threads))
        assert [i for i, _ in out] == list(range(10))
        # one kernel thread per job while others run; the last (or a lone job) gets them all
        assert [k for _, k in out] == ([1] * 9 + [threads] if threads > 1 else [1] * 10)
        assert peak[0] == threads
    together[:] = [threading.Barrier(1)]
    assert list(in_order([job(0)], 3)) == [(0, 3)]


def test_a_failing_job_raises_and_stops_the_rest():
    started = []

    def job(i: int):
        def run(kernel_threads: int) -> int:
            started.append(i)
            if i == 2:
                raise ValueError("job 2 broke")
            time.sleep(0.01)
            return i

        return run

    got = []
    with pytest.raises(ValueError, match="job 2 broke"):
        for r in in_order([job(i) for i in range(50)], 2):
            got.append(r)
    assert got == [0, 1] and max(started) <= 4  # a bounded window, not the remaining 47 jobs


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """A one-pass baseline and a padded batch with a bug at layer 2, prompt 1, token 20."""
    root = tmp_path_factory.mktemp("pipeline")
    run_dump(RunConfig(out=str(root / "base"), prompts=PROMPTS, layers="all"))
    model, tok = tiny_llama()
    gen = torch.Generator().manual_seed(0)

    def corrupt(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden[1, 20] += 0.3 * torch.randn(hidden.shape[-1], generator=gen)
        return output

    handle = model.model.layers[2].register_forward_hook(corrupt)
    with torch.inference_mode(), dumper.capture(model, root / "bad", layers="all") as cap:
        cap.set_sequence_ids([0, 1, 2])
        ids, mask = pad_batch([tok.encode(p) for p in PROMPTS], side="right")
        prefill(model, ids, mask, chunk_size=None)
    handle.remove()
    return root / "base", root / "bad"


def test_the_report_and_the_token_sink_do_not_depend_on_threads(dumps):
    reports, sinks = {}, {}
    for threads in (1, 2, 3):
        sink: list[tuple[str, int | None, list[float]]] = []
        report = compare_dumps(
            *dumps,
            CompareConfig(threads=threads),
            token_sink=lambda c, tokens, _, sink=sink: sink.append((c.name, c.sequence, tokens.tolist())),
        )
        reports[threads], sinks[threads] = report.to_json(), sink
    fd = reports[1]["first_divergent"]
    assert (fd["layer"], fd["sequence"], fd["token"]) == (3, 1, 20)
    assert len(sinks[1]) == 8 * len(PROMPTS)
    assert reports[2] == reports[1] and reports[3] == reports[1]  # bit for bit, tensor order included
    assert sinks[2] == sinks[1] and sinks[3] == sinks[1]  # the sink sees the same tensors in the same order
