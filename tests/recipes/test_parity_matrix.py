"""Parity matrix of the product's own model (issue 9): every layout we ship equals one process.

The recipe module (CLIP-ViT + adapter + LLaMA fusion, contrastive + caption + MML with the CPU
YAML's weights) trains 3 AdamW steps on the same global batches in each layout of
:data:`parity_matrix_worker.LAYOUTS` and on one process (no strategy, no process group). For
every layout: each step's logged loss and the first-step gradient of every parameter
(union over pipeline stages, full tensors over TP and FSDP shards) within a relative 1e-5 of
one process. Gradient clipping (global norm 0.05, below the gradient norm) and gradient
accumulation (2 batches per step) each run in one layout against a one-process run with the
same option; activation checkpointing (every 2nd block under pp2; every block with FSDP2's
optimizer offload under tp2 x dp2) runs against the plain one, and the test checks the blocks
were checkpointed. Layouts are grouped into one spawned world per size (1, 2, 4 and 8
processes: :class:`Worlds`), which then trains the shipped YAMLs of that size for 2 steps
(:mod:`yaml_runs_worker`); the 2-process world also runs the schedule engine checks, the
pipeline callbacks (:mod:`pipeline_callbacks_worker`) and density-driven top-k, the 4-process
one the MoE checkpoint's resharding (:mod:`moe_reshard_worker`). Each layout, check and YAML is
its own test, named after it; the world's result is shared, and a failure inside a world names
the layout or check that raised it.

Run with ``-s`` to print the measured worst differences (docs/strategy.md reports them);
``MMPAR_PARITY_ONLY="<layout>;<layout>"`` runs those layouts alone.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_mmpar.layout import ParallelLayout
from lightning_mmpar.layout.comm import comm_bounds, comm_bytes, comm_calls, comm_parts
from lightning_mmpar.layout.memory import state_bytes
from lightning_mmpar.layout.schedules import MULTI_STAGE_SCHEDULES
from lightning_mmpar.plans.fusion_cost import fusion_model_spec
from lightning_mmpar.testing import spawn
from tests.recipes import parity_matrix_worker as pm
from tests.recipes import pipeline_callbacks_worker as pcw
from tests.recipes import recipe_faults_worker as rw
from tests.recipes import yaml_runs_worker as yw

RTOL = 1e-5


@pytest.fixture(scope="module")
def references() -> dict[Any, rw.Recorder]:
    """One-process runs, one per (accumulate, clip, moe, chunks) the layouts use."""
    digits = rw.digits()
    return {
        key: pm.reference(key, digits) for key in sorted({x.reference for x in pm.LAYOUTS}, key=str)
    }


def _check_yaml_run(name: str, results: list[dict[str, Any]]) -> None:
    """One shipped YAML's run on every rank of its world: the steps, finite losses, the layout
    and precision it was given, and the run summary (routers for the MoE YAMLs)."""
    world_size = len(results)
    for result in results:
        summary = result["yaml"][name]["summary"]
        assert summary["steps"] == yw.STEPS, (name, summary)
        rows = summary["history"]["train"]
        assert rows and all(math.isfinite(r["train_loss"]) for r in rows), (name, rows)
        args = yw.overrides(name, Path())["trainer"]["strategy"]["init_args"]
        layout = summary["layout"]
        tp, pp = args.get("tensor_parallel", 1), args.get("pipeline_parallel", 1)
        assert (layout["tp"], layout["pp"], layout["dp"]) == (tp, pp, world_size // (tp * pp))
        assert layout["ep"] == args.get("expert_parallel", 1), (name, layout)
        if "moe" in name:  # rank 0 (first stage) reports the MoE layers of every stage
            _check_router(name, summary)
        assert layout["virtual"] == args.get("virtual_pipeline", 1), (name, layout)
        shipped = yaml.safe_load((yw.RECIPES / f"{name}.yaml").read_text())["trainer"]
        assert result["yaml"][name]["precision"] == shipped.get("precision", "32-true")
    printed = results[0]["yaml"][name]["printed"]  # rank 0's run summary
    assert "run summary" in printed, printed
    assert ("router (vision)" in printed) == ("moe" in name), printed
    print(f"yaml | {name} | {summary['layout']} | {yw.STEPS} steps, finite losses")


def _check_router(name: str, summary: dict[str, Any]) -> None:
    """The run summary's router section: both routers, every MoE layer, statistics in range,
    the expert-load heatmap written (the MoE learning bar's run checked these before it moved
    to ``benchmarks/bench_learning.py``)."""
    router = summary["router"]
    assert sorted(router) == ["text", "vision"], router
    model = (
        yw.overrides(name, Path())["model"]
        or yaml.safe_load((yw.RECIPES / f"{name}.yaml").read_text())["model"]
    )
    language = model["fusion"]["language"]
    assert router["text"]["layers"] == language["num_hidden_layers"], router
    experts, top_k = language["moe"]["num_experts"], language["moe"]["top_k"]
    for stats in router.values():  # entropy at most log2(experts) bits, the top-1 share >= 1/E
        assert 0 < stats["routing_entropy_bits"] <= math.log2(experts), (name, stats)
        assert 1 / experts <= stats["top1_share"] <= 1.0, (name, stats)
        assert 0 < stats["experts_per_token"] <= top_k and 0 <= stats["dropped_fraction"] < 1
    assert Path(summary["expert_load_heatmap"]).read_bytes()[:4] == b"\x89PNG", summary


class Worlds:
    """The spawned worlds of the matrix, one per size, each started by the first test that
    needs it and kept for the others (an error too: every test of that world reports it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.results: dict[int, list[dict[str, Any]] | Exception] = {}

    def __call__(self, world_size: int) -> list[dict[str, Any]]:
        if world_size not in self.results:
            root = self.root / f"world{world_size}"
            try:
                self.results[world_size] = spawn(pm.world, world_size, str(root), timeout=1200)
            except Exception as err:  # kept: the other tests of this world fail with it
                self.results[world_size] = err
        got = self.results[world_size]
        if isinstance(got, Exception):
            raise RuntimeError(f"the {world_size}-process world failed (see its error)") from got
        return got

    def parity(self, world_size: int, name: str) -> list[Any]:
        """Every rank's result of the layout or check ``name``."""
        return [r["parity"][name] for r in self(world_size)]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Worlds:
    return Worlds(tmp_path_factory.mktemp("parity_matrix"))


def _check_layout(layout: pm.Layout, ref: Any, results: list[dict[str, Any]]) -> None:
    """One layout against its one-process reference: every step's loss and every first-step
    gradient within :data:`RTOL`; the partition, the measured bytes and the checkpointed
    blocks where the layout has them."""
    grads: dict[str, Any] = {}
    loss_diff = 0.0
    for got in results:
        if layout.moe != "aux":  # aux-only runs log a zero loss: their gradients are checked
            n = layout.steps * layout.accumulate  # a loss per batch
            assert len(got["losses"]) == n, layout.name
            for a, b in zip(got["losses"], ref.losses[:n], strict=True):
                loss_diff = max(loss_diff, abs(a - b) / abs(b))
        grads.update(got["grads"])
    assert grads.keys() == ref.grads.keys(), (layout.name, grads.keys() ^ ref.grads.keys())
    if layout.name in pm.PLANS:  # the partition was applied, on every rank
        assert {tuple(r["boundaries"]) for r in results} == {tuple(pm.PLANS[layout.name])}
    if layout.name in pm.MEASURED:
        _check_measured(layout, results)
    checkpointed = [r["checkpointed"] for r in results]
    if "activation_checkpointing" in layout.strategy:  # the option reached the blocks
        assert min(checkpointed) > 0, (layout.name, checkpointed)
    else:
        assert max(checkpointed) == 0, (layout.name, checkpointed)
    name, ratio = rw.worst_gradient(grads, ref.grads)
    took = max(r["seconds"] for r in results)
    print(
        f"parity | {layout.name} | loss {loss_diff:.1e} | gradient {ratio:.1e} ({name}) | "
        f"{took:.1f} s"
    )
    assert loss_diff <= RTOL and ratio <= RTOL, (layout.name, loss_diff, name, ratio)


def layout_spec(layout: pm.Layout) -> ParallelLayout:
    """The cost model's view of a parity layout (the batch of :data:`rw.BATCH` rows split
    over dp ranks and micro-batches)."""
    s, dims = layout.strategy, layout.dims
    micro = (s.get("micro_batches") or dims.pp) if dims.pp > 1 else 1
    return ParallelLayout(
        tp=dims.tp,
        pp=dims.pp,
        dp=dims.dp,
        ep=dims.ep,
        virtual=s.get("virtual_pipeline", 1),
        micro_batches=micro,
        micro_batch_size=rw.BATCH // dims.dp // micro,
        accumulate=layout.accumulate,
        schedule=s.get("schedule", "1f1b"),
        partition=tuple(p) if isinstance(p := s.get("partition", "equal"), list) else p,
        vision_parallel=layout.vision_parallel,
        sequence_parallel=layout.sequence_parallel,
        data_parallel=s.get("data_parallel", "fsdp"),
        clip=layout.clip is not None,
    )


@functools.cache
def _vocab_size() -> int:
    return int(rw.digits().vocab_size)


_PURPOSE = {
    "fsdp": "FSDP all-gather / reduce-scatter",
    "ddp": "dp gradient all-reduce",
    "replicated": "gradient all-reduce of parameters FSDP does not manage",
    "experts": "expert weights over edp",
    "tp grads": "gradients summed over tp",
    "activations": "tp activations / ep all-to-all",
    "boundary": "pp boundaries",
}


def _purposes(parts: dict[str, int]) -> str:
    """What a key carries by :func:`~lightning_mmpar.layout.comm.comm_parts` purpose, for the
    failure message: ``"pp boundaries 83,200 B"``; ``"not predicted"`` for none."""
    named = [f"{_PURPOSE.get(why, why)} {n:,} B" for why, n in parts.items()]
    return " + ".join(named) or "not predicted"


def _check_measured(layout: pm.Layout, results: list[dict[str, Any]]) -> None:
    """Issue 12: every rank's communication bytes of one optimizer step, per ``<dim>.<kind>``,
    its calls per exact key (``comm_calls``), and its parameter / gradient / AdamW-state bytes
    equal the cost model's, exactly (a failure names the layout, the rank, the key and what it
    carries: :func:`_purposes`); the MoE
    token dispatch (``ep.all_to_all_v``, routing-dependent) within its predicted bounds. A
    placed layout (a rank permutation) is predicted at each rank's mesh coordinates, unplaced:
    the placement moves bytes between ranks, never changes them."""
    spec = layout_spec(layout)
    module = pm.build(_vocab_size(), layout.moe, layout.sequence_parallel, layout.vision_parallel)
    model = fusion_model_spec(module, spec, rw.TEXT_LENGTH)
    for rank, result in enumerate(results):
        coords = layout.dims.rank_coords(rank)
        got = result
        bounds = comm_bounds(model, spec, coords["pp"])
        exact = {k: low for k, (low, high) in bounds.items() if low == high}
        counted = {k: v for k, v in got["comm"].items() if k in exact or k not in bounds}
        state = state_bytes(model, spec, coords)
        print(
            f"comm | {layout.name} | rank {rank} | counted {got['comm']} | state {got['state']}"
            f" | expected {comm_bytes(model, spec, coords['pp'])}"
        )
        parts = comm_parts(model, spec, coords["pp"])
        for key in sorted(counted.keys() | exact.keys()):  # one kind at a time, named
            assert counted.get(key, 0) == exact.get(key, 0), (
                f"{layout.name}, rank {rank}: {key} ({_purposes(parts.get(key, {}))}) counted "
                f"{counted.get(key, 0):,} B vs predicted {exact.get(key, 0):,} B"
            )
        calls = comm_calls(model, spec, coords["pp"])  # the ops per key too (latency terms)
        for key in sorted(exact):
            n, want = got["calls"].get(key, 0), calls.get(key, 0)
            assert n == want, (
                f"{layout.name}, rank {rank}: {key} ({_purposes(parts.get(key, {}))}) "
                f"{n} calls counted vs {want} predicted"
            )
        for key in bounds.keys() - exact.keys():  # data-dependent: within bounds
            assert bounds[key][0] <= got["comm"].get(key, 0) <= bounds[key][1], (
                f"{layout.name}, rank {rank}: {key} ({_purposes(parts.get(key, {}))}) counted "
                f"{got['comm'].get(key, 0):,} B outside the predicted {bounds[key]}"
            )
        assert got["state"] == (state.parameters, state.gradients, state.optimizer), (
            layout.name,
            rank,
            got["state"],
            state,
        )


def _check_engine(ranks: list[dict[str, dict[str, Any]]]) -> None:
    """:func:`parity_matrix_worker.engine_checks`: every schedule's loss, gradients (also after
    ``set_micro_batches(4)``) and eval loss equal autograd's; stages on the loop / V layout;
    every stage reports its actions (split backward for the zero-bubble schedules) and the last
    stage its loss (action ``loss``); the multi-stage schedules ran under the engine's
    ``LeanRuntime``, equal to torch's own loop to the bit; a boundary of two floats between
    ranks travels packed; a forward-only pass keeps no stage outputs (the loss reads them,
    nothing merges them)."""
    for name in ranks[0]:
        got = [r[name] for r in ranks]
        print(
            f"engine | {name} | "
            + " | ".join(f"{k} {got[0][k]:.1e}" for k in ("loss", "eval"))
            + f" | gradient {max(g['grad'] for g in got):.1e} | {got[0]['actions']}"
        )
        for g in got:
            assert max(g["loss"], g["grad"], g["eval"]) <= RTOL, (name, g)
            assert g["stages"] == g["owned"] and g["micro"] == [0, 1, 2, 3], (name, g)
            assert g["kept_outputs"] == 0, (name, g)  # forward-only: no outputs merged or kept
            # the multi-stage schedules run under LeanRuntime, bitwise equal to torch's own loop
            assert g["lean_vs_torch"] == 0.0, (name, g)
            assert (g["lean_steps"] > 0) == (name in MULTI_STAGE_SCHEDULES), (name, g)
        actions = {a for g in got for a in g["actions"]}
        split = {"backward_input", "backward_weight"}  # zero-bubble: dW deferred
        assert {"forward", "loss"} <= actions <= split | {"forward", "backward", "loss"}, actions
        zero_bubble = "zero_bubble" in name or name == "dualpipev"
        assert split <= actions if zero_bubble else not split & actions, (name, actions)
        if name in ("gpipe", "1f1b"):
            assert [g["owned"] for g in got] == [[0], [1]]
        elif name in ("zbv_zero_bubble", "dualpipev"):  # V: the last stage on pp rank 0
            assert [g["owned"] for g in got] == [[0, 3], [1, 2]]
        else:
            assert [g["owned"] for g in got] == [[0, 2], [1, 3]]
        # from the embedding on, a boundary carries two floats: one buffer between ranks (stages
        # 2 and 3 of the loop layout; the V layout's 1 -> 2 is its in-memory turn; 1F1B's one
        # boundary is before it: a float and an int, nothing to merge)
        packed = {"zbv_zero_bubble": [3], "dualpipev": [3], "gpipe": [], "1f1b": []}
        assert sorted(s for g in got for s in g["packed"]) == packed.get(name, [2, 3]), name
        top = max(s for g in got for s in g["owned"])  # the last stage's owner, on every rank
        assert {g["last_rank"] for g in got} == {r for r, g in enumerate(got) if top in g["owned"]}


def test_references_differ_by_option(references: dict[Any, Any]) -> None:
    """Clipping, accumulation and MoE change the run (so the layouts using them test
    something); aux-only gradients differ with the chunking and reach the vision tower."""
    base = references[1, None, None, 1]
    for key, rec in references.items():
        if key != (1, None, None, 1) and key[2] != "aux":
            assert rec.losses[1:] != pytest.approx(base.losses[1:], rel=1e-4), key
    aux = {key: rec for key, rec in references.items() if key[2] == "aux"}
    assert len(aux) == 2  # chunks 4 (dp 2 x 2 micro-batches; pp 2 schedules share it), 2
    (_, a), (_, b) = sorted(aux.items(), key=str)
    name = "blocks.0.conv1.weight"
    assert float(a.grads[name].norm()) > 0 and float(b.grads[name].norm()) > 0
    assert rw.worst_gradient(a.grads, b.grads)[1] > 1e-3


def _skip_unless_everything() -> None:
    if pm.only():
        pytest.skip("MMPAR_PARITY_ONLY: layouts only")


@pytest.mark.distributed
@pytest.mark.parametrize("layout", pm.LAYOUTS, ids=[x.name for x in pm.LAYOUTS])
def test_layout_matches_one_process(layout: pm.Layout, references: Any, worlds: Worlds) -> None:
    if layout not in pm.selected(layout.world):
        pytest.skip("not in MMPAR_PARITY_ONLY")
    _check_layout(layout, references[layout.reference], worlds.parity(layout.world, layout.name))


@pytest.mark.distributed
def test_every_schedule_equals_autograd(worlds: Worlds) -> None:
    """The engine checks of the 2-process world (:func:`schedules_worker.engine_checks`)."""
    _check_engine(worlds.parity(2, "engine"))


@pytest.mark.distributed
def test_pipeline_callbacks_at_pp2(worlds: Worlds) -> None:
    """PipelineTimeline and DynamicMicroBatching at pp 2 (:mod:`pipeline_callbacks_worker`)."""
    _skip_unless_everything()
    runs = worlds.parity(2, "pipeline callbacks")
    pcw.check_dynamic(runs)
    pcw.check_timeline(runs, worlds.root / "world2" / "pipeline_callbacks")


@pytest.mark.distributed
def test_moe_density_estimate_is_one_over_dp(worlds: Worlds) -> None:
    """Density-driven top-k at ep 2 (dp 2): one estimate over dp, fewer experts per token."""
    _skip_unless_everything()
    runs = worlds.parity(2, "moe density")
    assert len(runs[0]["estimates"]) == 3 and min(runs[0]["seen"]) > 0, runs[0]  # adapter + 2
    for a, b in zip(runs[0]["estimates"], runs[1]["estimates"], strict=True):
        assert bool(a.any()) and torch.equal(a, b)
    assert any(k < 2.0 for r in runs for k in r["experts_per_token"]), runs  # fewer experts


@pytest.mark.distributed
def test_moe_checkpoint_reshards_over_ep_bitwise(worlds: Worlds) -> None:
    """DCP reshards the MoE module ep 2 -> 1 -> 4 (:mod:`moe_reshard_worker`), bitwise."""
    _skip_unless_everything()
    reshard = worlds.parity(4, "moe reshard")[0]
    print(f"moe reshard | {reshard}")
    assert reshard["count"] > 100 and all(reshard["same_keys"].values()), reshard
    assert reshard["diffs"] == {"ep1": 0.0, "ep4": 0.0}, reshard


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(yw.RUNS))
def test_shipped_yaml_trains(name: str, worlds: Worlds) -> None:
    """Each shipped YAML through the CLI for :data:`yaml_runs_worker.STEPS` steps, in the
    world of its size (``clip_llama_1gpu.yaml``: one process, ``data_parallel: none``)."""
    _skip_unless_everything()
    _check_yaml_run(name, worlds(yw.RUNS[name]["world"]))
