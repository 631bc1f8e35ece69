"""PipelineTimeline: the measured pipeline bubble of chosen steps, next to the schedule's formula.

For each recorded step every pipeline rank times its stage actions through the engine's
observers (``trainer.strategy.pipeline.observers``: ``(stage, action, micro_batch, start, end)``
after each action, ``time.perf_counter`` seconds; actions ``forward``, ``backward`` (full),
``backward_input`` and ``backward_weight`` for the zero-bubble schedules' split backward).
After the step the intervals are gathered over the pipeline group (one ``all_gather_object``
through :mod:`lightning_mmpar.parallel.comm`) and the bubble is measured as::

    span   = last action end - first action start (over all pipeline ranks)
    busy_r = length of the union of rank r's action intervals
    bubble = sum_r (span - busy_r) / (span * pp)

over the training schedule's actions (:func:`last_pass`: a gradient-cache module runs a
forward-only pass first; ``measured_step`` covers the whole step).

Ranks align their clocks by a barrier at the step start (each rank's times are relative to its
own post-barrier ``perf_counter``), so the figure holds across hosts. The idle time includes
everything between actions: point-to-point send/recv waits, the loss on the last stage (torch's
schedules compute it after the forward action) and the schedule's own bookkeeping; and stages
of unequal cost wait for the slowest one. The measured bubble is therefore above the formula,
which assumes equal stage costs and free communication.

The formula (:func:`formula_bubble`) is :func:`lightning_mmpar.layout.schedules.bubble_fraction`,
the planner's bubble too: the idle share of the step when every stage's forward, input-gradient
and weight-gradient backward take one unit each (a full backward two) and communication is free,
equal to a simulation of the action order torch's schedule runs. Under those costs:
``(p - 1) / (m + p - 1)`` for GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2021);
``(p - 1) / (v m + p - 1)`` for interleaved 1F1B (Narayanan et al. 2021) and looped BFS
(Lamy-Poirier 2023) once ``m >= p``; ``(p - 1) / (3 v m + p - 1)`` for the zero-bubble ZB-H1
schedule (Qi et al. 2024) once ``m >= p``; ``(p - 1) / (6 m + p - 1)`` for ZB-V (Qi et al. 2024
section 6) and DualPipeV (DeepSeek-V3 report 2024) with enough micro-batches: their fill and
drain. Fewer micro-batches: :func:`lightning_mmpar.layout.schedules.step_units`.

Logged per recorded step (every rank, its pipeline group's value): ``pipeline_bubble_measured``,
``pipeline_bubble_formula``, ``pipeline_bubble_stage_cost`` and the bubble's parts
(:func:`bubble_split`) ``pipeline_bubble_wait``, ``pipeline_bubble_post`` (posting sends and
receives, timed through the engine's ``post_observers``), ``pipeline_bubble_host`` and
``pipeline_bubble_outside``. Global rank 0 (first data/tensor-parallel replica) writes the
intervals of every recorded step as JSON and the timeline of the last one as a PNG (matplotlib,
one row per pipeline rank, a numbered box per action and micro-batch). Without a pipeline
(another strategy, ``pipeline_parallel=1``) the callback warns once and does nothing.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_mmpar.layout.schedules import (
    SCHEDULE_SOURCES,
    SPLIT_BACKWARD_SCHEDULES,
    bubble_fraction,
)
from lightning_mmpar.parallel import comm
from lightning_mmpar.parallel.pipeline.simulation import stage_cost_bubble
from lightning_mmpar.trainer_topology import TrainerTopology

Interval = tuple[int, str, int, float, float]
"""``(stage, action, micro_batch, start, end)``; seconds relative to the step start."""

ACTIONS = {
    "forward": ("F", "#4c72b0"),
    "backward": ("B", "#55a868"),
    "backward_input": ("B", "#dd8452"),
    "backward_weight": ("W", "#8172b3"),
    "loss": ("L", "#c44e52"),
}
"""Engine action -> (label, colour) of the timeline."""


def formula_bubble(schedule: str, pp: int, micro_batches: int, virtual: int = 1) -> float:
    """The schedule's bubble as a fraction of the step span:
    ``lightning_mmpar.layout.schedules.bubble_fraction(schedule, pp, virtual, micro_batches)``
    (see the module docstring).

    Args: ``schedule`` a name of :data:`FORMULA_SOURCES`, ``pp`` pipeline ranks, ``micro_batches``
    per step (``m``), ``virtual`` stages per rank (``v``). Raises ``ValueError`` for an unknown
    schedule, sizes that are not positive integers or a stage count the schedule cannot lay out.
    """
    return bubble_fraction(schedule, pp, virtual, micro_batches)


FORMULA_SOURCES: dict[str, str] = SCHEDULE_SOURCES
"""Schedule name -> the formula of :func:`formula_bubble` and its source
(:data:`lightning_mmpar.layout.schedules.SCHEDULE_SOURCES`)."""


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _busy(rank: Sequence[Interval], start: float, end: float) -> float:
    """Union length of ``rank``'s intervals clipped to ``[start, end]``."""
    return _union_length(_spans(rank, start, end))


def measured_bubble(
    per_rank: Sequence[Sequence[Interval]], busy: Sequence[Sequence[Interval]] | None = None
) -> tuple[float, float]:
    """``(bubble, span)`` of one step from every pipeline rank's intervals (rank order).

    ``bubble = sum_r (span - busy_r) / (span * ranks)``, ``span`` from the first start to the
    last end of ``per_rank`` over all ranks (seconds), ``busy_r`` the union length of rank
    ``r``'s intervals in ``busy`` (default ``per_rank``) inside the span: the training pass's
    span (:func:`last_pass`) with every action of the step counted as work (a rank still
    finishing an earlier pass inside the span is busy, not idle). A rank without intervals
    counts as idle throughout. Raises ``ValueError`` when no rank has an interval.
    """
    starts = [i[3] for rank in per_rank for i in rank]
    if not starts:
        raise ValueError("measured_bubble needs at least one interval; none was recorded.")
    start = min(starts)
    span = max(i[4] for rank in per_rank for i in rank) - start
    if span <= 0:
        return 0.0, 0.0
    work = per_rank if busy is None else busy
    idle = sum(span - _busy(rank, start, start + span) for rank in work)
    return idle / (span * len(per_rank)), span


Wait = tuple[float, float]
"""``(start, end)`` of one point-to-point wait; seconds relative to the step start."""


def bubble_split(
    per_rank: Sequence[Sequence[Interval]],
    waits: Sequence[Sequence[Wait]],
    busy: Sequence[Sequence[Interval]] | None = None,
    posts: Sequence[Sequence[Wait]] | None = None,
) -> dict[str, Any]:
    """Where the step span goes, per pipeline rank (rank order) and in the mean over ranks:
    ``compute`` (union of the rank's actions in ``busy``, default ``per_rank``: stage actions
    and the loss), ``wait`` (its point-to-point waits inside the span, outside compute),
    ``outside`` (the span before the rank's first action or wait and after its last one: the
    fill and drain it spends outside torch's schedule, e.g. the last stage's rank, done with
    its last backward, waiting in the step's loss broadcast for the first stage's), ``post``
    (its postings of sends and receives, ``posts``, between its first and last action or wait,
    outside compute and waits: on gloo posting starts the transfer) and ``host`` (the rest,
    between its first and last action or wait: the schedule's bookkeeping), each a fraction of
    the span of ``per_rank`` (:func:`measured_bubble`), so ``wait + post + outside + host`` is
    the measured bubble. ``posts`` ``None``: none recorded (``post`` 0, posting counted as
    host). Raises ``ValueError`` as :func:`measured_bubble`.
    """
    _, span = measured_bubble(per_rank)
    start = min(i[3] for rank in per_rank for i in rank)
    end = start + span
    rows = []
    work_ranks = busy or per_rank
    rank_posts = posts if posts is not None else [[] for _ in work_ranks]
    for rank, rank_waits, posted in zip(work_ranks, waits, rank_posts, strict=True):
        work = _busy(rank, start, end)
        actions = _spans(rank, start, end)
        waited = _clip(rank_waits, start, end)
        wait = _union_length(waited + actions) - work  # a wait inside an action: none
        events = waited + actions
        outside, first, last = span, end, end
        if events:
            first, last = min(a for a, _ in events), max(b for _, b in events)
            outside = first - start + end - last
        posted = _clip(posted, first, last)  # one outside the rank's actions and waits: outside
        post = _union_length(posted + events) - work - wait
        parts = (work, wait, post, outside)
        compute, wait, post, outside = (x / span if span > 0 else 0.0 for x in parts)
        host = max(0.0, 1.0 - compute - wait - post - outside)
        rows.append(
            {"compute": compute, "wait": wait, "post": post, "host": host, "outside": outside}
        )
    keys = ("compute", "wait", "post", "host", "outside")
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    return {**mean, "ranks": rows}


def _clip(spans: Sequence[Wait], start: float, end: float) -> list[tuple[float, float]]:
    clipped = [(max(a, start), min(b, end)) for a, b in spans]
    return [(a, b) for a, b in clipped if b > a]


def _spans(rank: Sequence[Interval], start: float, end: float) -> list[tuple[float, float]]:
    clipped = [(max(i[3], start), min(i[4], end)) for i in rank]
    return [(a, b) for a, b in clipped if b > a]


def last_pass(intervals: Sequence[Interval]) -> list[Interval]:
    """The intervals of the last schedule pass of one rank's step, in time order.

    A step may run more than one schedule: a gradient-cache module
    (:class:`~lightning_mmpar.parallel.gradient_cache.BatchLossModule`) first runs a
    forward-only pass, then the training schedule. A pass ends where an action repeats for the
    same ``(stage, micro_batch)``.
    """
    passes: list[list[Interval]] = [[]]
    seen: set[tuple[int, str, int]] = set()
    for item in sorted(intervals, key=lambda i: i[3]):
        key = (item[0], item[1], item[2])
        if key in seen:
            passes.append([])
            seen = set()
        seen.add(key)
        passes[-1].append(item)
    return passes[-1]


_KIND = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}


def stage_costs(
    per_rank: Sequence[Sequence[Interval]], schedule: str
) -> dict[int, dict[str, float]]:
    """Each stage's median action durations in one training pass (:func:`last_pass` of every
    rank), as :func:`~lightning_mmpar.parallel.pipeline.simulation.stage_cost_bubble` takes
    them: ``F`` (plus the median loss on the stage that computes it), ``B``, or ``I`` and ``W``
    under the zero-bubble schedules (a stage whose whole backward runs in the input step,
    ``backward``, is its ``I``). Seconds."""
    split = schedule in SPLIT_BACKWARD_SCHEDULES
    times: dict[int, dict[str, list[float]]] = {}
    for rank in per_rank:
        for stage, action, mb, start, end in rank:
            kind = "L" if action == "loss" else _KIND.get(action)
            if kind is None or mb < 0:
                continue
            kind = "I" if split and kind == "B" else kind
            times.setdefault(stage, {}).setdefault(kind, []).append(end - start)
    costs = {s: {k: statistics.median(v) for k, v in kinds.items()} for s, kinds in times.items()}
    for cost in costs.values():
        cost["F"] = cost.get("F", 0.0) + cost.pop("L", 0.0)
    return costs


def draw_timeline(result: dict[str, Any], path: str | Path) -> Path | None:
    """Draw one :attr:`PipelineTimeline.results` entry to ``path`` (PNG): one row per pipeline
    rank, a box per action coloured by kind (:data:`ACTIONS`) and numbered by micro-batch
    (``m/s`` with the stage when ranks hold several stages); actions before the training
    schedule's pass (:func:`last_pass`) hatched. ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:  # pragma: no cover - matplotlib is a dependency of the docs/extras
        rank_zero_warn("PipelineTimeline: matplotlib is not installed; no timeline drawn.")
        return None
    rows = result["intervals"]
    t0 = min(i[3] for rank in rows for i in rank)
    scale = 1e3  # milliseconds
    several = result["num_stages"] > result["pp"]
    width = max(i[4] for rank in rows for i in rank) * scale - t0 * scale
    hatched = False
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.7 * len(rows)))
    for r, rank in enumerate(rows):
        training = set(last_pass([tuple(i) for i in rank]))
        for stage, action, mb, start, end in rank:
            label, colour = ACTIONS.get(action, ("?", "#999999"))
            x, w = (start - t0) * scale, (end - start) * scale
            earlier = (stage, action, mb, start, end) not in training  # forward-only pass
            ax.barh(
                r,
                w,
                left=x,
                height=0.8,
                color=colour,
                edgecolor="black",
                linewidth=0.4,
                alpha=0.4 if earlier else 1.0,
                hatch="//" if earlier else None,
            )
            text = f"{label}{mb}/s{stage}" if several else f"{label}{mb}"
            if w >= 0.012 * width:  # no label on slivers (a no-grad pass's empty backward)
                ax.text(x + w / 2, r, text, ha="center", va="center", fontsize=7, clip_on=True)
            hatched = hatched or earlier
    ax.set_yticks(range(len(rows)), [f"pp rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel("time in step (ms)")
    used = {a for rank in rows for i in rank for a in [i[1]]}
    handles = [Patch(color=c, label=f"{lbl} ({a})") for a, (lbl, c) in ACTIONS.items() if a in used]
    if hatched:
        handles.append(
            Patch(facecolor="white", edgecolor="black", hatch="//", label="earlier pass")
        )
    ax.legend(
        handles=handles,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        ncols=len(handles),
        frameon=False,
    )
    ax.set_title(
        f"{result['schedule']} p={result['pp']} v={result['virtual']} m={result['micro_batches']}"
        f", step {result['step']}: bubble measured {result['measured']:.3f}, formula "
        f"{result['formula']:.3f}",
        fontsize=9,
        loc="left",
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def no_pipeline(who: str, trainer: pl.Trainer, effect: str) -> str:
    """The warning of a pipeline callback in a run without a pipeline schedule."""
    return (
        f"{who}: the strategy runs no pipeline schedule ({type(trainer.strategy).__name__}); "
        f"{effect}. Use mm_parallel with pipeline_parallel >= 2."
    )


class PipelineTimeline(Callback):
    """Measure the pipeline bubble of chosen training steps and draw their timeline.

    Args:
        steps: ``trainer.global_step`` values (at batch start) to record; default ``(1,)`` (the
            second step: the first one builds the schedules).
        every_n_steps: also record every step divisible by this (``None``: only ``steps``).
        path: PNG of the last recorded step (``None``: ``<log_dir>/pipeline_timeline.png``);
            the JSON of every recorded step goes next to it with the suffix ``.json``.

    Attributes: :attr:`results` (one dict per recorded batch: ``step``, ``schedule``, ``pp``,
    ``virtual``, ``num_stages``, ``micro_batches``, ``measured`` and ``span_s`` of the training
    schedule (:func:`last_pass`), ``measured_step`` and ``step_span_s`` of the whole step (a
    gradient-cache module's forward-only pass included), ``formula``, ``source`` and
    ``intervals``: per pipeline rank a list of :data:`Interval`), :attr:`path`.
    Raises ``ValueError`` (naming the argument, its value and a fix) on invalid arguments.
    Collectives: a barrier and an object gather over the pipeline group on recorded steps.
    """

    def __init__(
        self,
        steps: Sequence[int] = (1,),
        every_n_steps: int | None = None,
        path: str | Path | None = None,
    ) -> None:
        bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or s < 0]
        if bad:
            raise ValueError(
                f"PipelineTimeline steps ({list(steps)!r}) must be non-negative integers; "
                "use e.g. steps=[5, 6]."
            )
        n = every_n_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(
                f"PipelineTimeline every_n_steps ({n!r}) must be a positive integer or None; "
                "use None to record only `steps`."
            )
        self.steps = frozenset(steps)
        self.every_n_steps = n
        self.path = None if path is None else Path(path)
        self.results: list[dict[str, Any]] = []
        self._engine: Any = None
        self._group: Any = None
        self._warned = False
        self._recording = False
        self._t0 = 0.0
        self._step = self._m = 0
        self._local: list[Interval] = []
        self._waits: list[Wait] = []
        self._posts: list[Wait] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.path is None:  # ``trainer.log_dir`` broadcasts under DDP: resolved on every rank
            folder = Path(trainer.log_dir or trainer.default_root_dir)
            self.path = folder / "pipeline_timeline.png"

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        topology = TrainerTopology.of(trainer)
        engine = topology.engine_with("observers")
        if engine is None:
            if not self._warned:
                rank_zero_warn(no_pipeline("PipelineTimeline", trainer, "nothing is recorded"))
                self._warned = True
            return
        self._engine = engine
        self._group = topology.dims.get_group("pp")
        engine.observers.append(self._observe)
        getattr(engine, "wait_observers", []).append(self._observe_wait)
        getattr(engine, "post_observers", []).append(self._observe_post)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._engine is not None and self._observe in self._engine.observers:
            self._engine.observers.remove(self._observe)
        for name, observer in (
            ("wait_observers", self._observe_wait),
            ("post_observers", self._observe_post),
        ):
            registered = getattr(self._engine, name, [])
            if observer in registered:
                registered.remove(observer)
        self._engine = None

    def _due(self, step: int) -> bool:
        """``step`` is chosen and not recorded yet (under gradient accumulation several batches
        share a step: the first one is recorded)."""
        n = self.every_n_steps
        if self.results and self.results[-1]["step"] == step:
            return False
        return step in self.steps or (n is not None and step % n == 0)

    def _observe(self, stage: int, action: str, mb: int, start: float, end: float) -> None:
        if self._recording:
            self._local.append((stage, action, mb, start - self._t0, end - self._t0))

    def _observe_wait(self, start: float, end: float) -> None:
        if self._recording:
            self._waits.append((start - self._t0, end - self._t0))

    def _observe_post(self, start: float, end: float) -> None:
        if self._recording:
            self._posts.append((start - self._t0, end - self._t0))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._engine is None or not self._due(trainer.global_step):
            return
        comm.barrier(self._group)  # a common origin on every pipeline rank
        self._local, self._waits, self._posts, self._recording = [], [], [], True
        self._step, self._m = trainer.global_step, int(self._engine.num_micro_batches)
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._recording:
            return
        self._recording = False
        mine = (self._local, self._waits, self._posts)
        gathered = comm.all_gather_objects(mine, self._group)
        per_rank, waits = [g[0] for g in gathered], [g[1] for g in gathered]
        result = self._result(self._step, per_rank, waits, [g[2] for g in gathered])
        self.results.append(result)
        for key, value in (
            ("measured", result["measured"]),
            ("formula", result["formula"]),
            ("stage_cost", result["stage_cost"]),
            ("wait", result["split"]["wait"]),
            ("post", result["split"]["post"]),
            ("host", result["split"]["host"]),
            ("outside", result["split"]["outside"]),
        ):
            pl_module.log(f"pipeline_bubble_{key}", value, on_step=True, on_epoch=False)
        if trainer.is_global_zero and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.with_suffix(".json").write_text(json.dumps(self.results, indent=1))
            draw_timeline(result, self.path)

    def _result(
        self,
        step: int,
        per_rank: list[list[Interval]],
        waits: list[list[Wait]],
        posts: list[list[Wait]] | None = None,
    ) -> dict[str, Any]:
        engine = self._engine
        pp, stages = int(engine.pp), int(engine.num_stages)
        m, schedule = self._m, str(engine.schedule_name)
        passes = [last_pass(rank) for rank in per_rank]
        measured, span = measured_bubble(passes, per_rank)
        whole, step_span = measured_bubble(per_rank)
        try:
            at_costs = stage_cost_bubble(
                schedule, pp, stages // pp, m, stage_costs(passes, schedule)
            )
        except ValueError:  # a stage without a recorded action (an aborted step)
            at_costs = float("nan")
        return {
            "step": step,
            "schedule": schedule,
            "pp": pp,
            "virtual": stages // pp,
            "num_stages": stages,
            "micro_batches": m,
            "measured": measured,
            "formula": formula_bubble(schedule, pp, m, stages // pp),
            "stage_cost": at_costs,
            "source": FORMULA_SOURCES.get(schedule, ""),
            "span_s": span,
            "split": bubble_split(passes, waits, per_rank, posts),
            "measured_step": whole,
            "step_span_s": step_span,
            "intervals": [[list(i) for i in rank] for rank in per_rank],
        }
