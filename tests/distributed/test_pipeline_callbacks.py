"""The pipeline callbacks in a real pp 2 run of the recipe module (issue 11).

One spawned 2-process world (:mod:`pipeline_callbacks_worker`): a static 1F1B run (2
micro-batches) with :class:`PipelineTimeline`, and a run where :class:`DynamicMicroBatching`
changes the micro-batch size mid-run (4 -> 2 rows, 2 -> 4 micro-batches; forced by a fake memory
source). Checks: the dynamic run's per-step losses equal the static run's and one process's
(rel 1e-5); the size changed when and as decided and was logged; the timeline holds a forward
and a backward interval for every (stage, micro-batch) of every recorded step, its measured
bubble lies in (0, 1), and the PNG and JSON were written. Run with ``-s`` for the figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))
import pipeline_callbacks_worker as worker
import recipe_faults_worker as rw

from lightning_mmpar.callbacks.pipeline_timeline import last_pass
from lightning_mmpar.testing import spawn

pytestmark = pytest.mark.distributed
RTOL = 1e-5
Results = tuple[list[dict[str, Any]], Path]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Results:
    root = tmp_path_factory.mktemp("pipeline_callbacks")
    return spawn(worker.world, 2, str(root), timeout=900), root


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(
        abs(a - b) <= RTOL * abs(b) for a, b in zip(got, want, strict=True)
    )


def test_dynamic_micro_batching_keeps_the_loss_trajectory(world: Results) -> None:
    results, _ = world
    digits = rw.digits()
    one = rw.fit(rw.tiny_module(digits.vocab_size), rw.batches(digits, worker.STEPS)).losses
    for rank, result in enumerate(results):
        static, dynamic = result["static"]["losses"], result["dynamic"]["losses"]
        assert _close(dynamic, static), (rank, dynamic, static)
        assert _close(dynamic, one), (rank, dynamic, one)
        assert [d["applied"] for d in result["dynamic"]["decisions"]] == [None, 2, None, None]
        assert [d["policy_size"] for d in result["dynamic"]["decisions"]] == [2] * worker.STEPS
        assert result["dynamic"]["logged"] == [(4.0, 2.0), (4.0, 2.0), (2.0, 4.0), (2.0, 4.0)]
    # the adapter lives on one stage: only its rank measures a latency; both decide alike
    watched = [r["dynamic"]["watched"] for r in results]
    assert watched[0] == watched[1] and watched[0], watched
    lat = [[d["latency_ms"] for d in r["dynamic"]["decisions"]] for r in results]
    assert lat[0] == lat[1] and all(x > 0 for x in lat[0]), lat
    print(f"\nlosses one process {one}\nstatic {static}\ndynamic {dynamic}\nlatency ms {lat[0]}")


def test_timeline_measures_every_micro_batch(world: Results) -> None:
    results, root = world
    for name, steps, m in (("static", [1, 2, 3], 2), ("dynamic", [2, 3], 4)):
        timelines = [r[name]["timeline"] for r in results]
        assert timelines[0] == timelines[1]  # gathered over the pipeline group
        assert [t["step"] for t in timelines[0]] == steps
        for t in timelines[0]:
            assert (t["schedule"], t["pp"], t["micro_batches"]) == ("1f1b", 2, m)
            assert t["formula"] == pytest.approx(1 / (m + 1))
            assert 0.0 < t["measured"] < 1.0 and 0.0 < t["measured_step"] < 1.0, t
            for stage, rank in enumerate(t["intervals"]):
                seen = {(i[0], i[1], i[2]) for i in last_pass([tuple(i) for i in rank])}
                want = {(stage, a, mb) for a in ("forward", "backward") for mb in range(m)}
                assert seen == want, (name, t["step"], stage, seen)
            print(
                f"{name} step {t['step']} m={m}: bubble measured {t['measured']:.3f} (whole "
                f"step {t['measured_step']:.3f}), formula {t['formula']:.3f}, span "
                f"{1e3 * t['span_s']:.1f} ms"
            )
        png = root / f"{name}.png"
        assert png.stat().st_size > 1000
        assert json.loads(png.with_suffix(".json").read_text())[-1]["step"] == steps[-1]
    print(f"world: static {results[0]['static_s']:.1f} s, dynamic {results[0]['dynamic_s']:.1f} s")
