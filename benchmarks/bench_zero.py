"""Sharded data parallel vs DeepSpeed ZeRO-2 / ZeRO-3 on the fusion model (issue #14 items 3, 8).

    python benchmarks/bench_zero.py            # docs/results/zero.json + zero.png
    python benchmarks/bench_zero.py --smoke --out-dir /tmp/x   # one short repeat

**Item 3**: the CPU recipe's model and data (``recipes/clip_llama_cpu.yaml``, ``build_module``)
trained by Lightning on 2 gloo processes (dp 2, fp32, the recipe's AdamW and schedule; seed 0,
so every side starts from the same weights and sees the same batches), four sides interleaved
A B C D A B C D in one spawned world, each a fresh ``Trainer`` of ``--steps`` steps:

* ``mm_fsdp``: ``MultimodalParallelStrategy(data_parallel="fsdp")``, FSDP2 ``fully_shard`` per
  block (ZeRO-3 role: parameters, gradients and AdamW state sharded over dp);
* ``mm_ddp``: ``data_parallel="ddp"`` (whole parameters, gradient all-reduce). The package has
  no ZeRO-2-like mode (``data_parallel`` is ``fsdp`` / ``ddp`` / ``none``;
  ``parallel/data.py`` never sets ``reshard_after_forward=False``);
* ``ds_zero2`` / ``ds_zero3``: DeepSpeed's engine from ``deepspeed.initialize`` (called by
  ``CPUCapableDeepSpeedStrategy``: ``DS_ACCELERATOR=cpu``, gloo) with the module's own torch
  AdamW as the client optimizer, ZeRO stage 2 / 3. ZeRO-3 partitions the built model at
  ``initialize`` (no ``zero.Init``, so the weights are those of the other sides) and
  ``stage3_param_persistence_threshold=0`` (DeepSpeed's default keeps every parameter under
  1e5 elements whole - all of this model's); bucket sizes ``BUCKET`` elements.

Step time: the slowest rank's per-batch wall time (``StepTimer``), after ``--warmup`` steps;
``report.ratio_stats`` of the paired repeats. Per-rank bytes after the last step's backward,
before its optimizer step (``on_before_optimizer_step``): ``mm_parallel`` by
``comm_count.state_bytes_of`` (local shards, their gradients, ``optimizer.state``), next to
``layout.memory.state_bytes``; DeepSpeed by walking the tensors its engine holds (module
parameters and ``ds_tensor`` partitions, ``.grad``, the ZeRO optimizer's attributes, the torch
optimizer's state), each storage counted once (:func:`ds_state_bytes`); DeepSpeed keeps an
fp32 master partition even in fp32 training (``master``). The first step's loss is stored per
side and rank; the sides must agree (``loss_check``).

**Item 8**: whether torchtitan's ``parallelize_llama`` can run here (:func:`torchtitan_probe`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is first imported

import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from bench_stability import StepTimer
from report import CPU_YAML, interleaved, ratio_stats, save_figure, write_result

SIDES = ("mm_fsdp", "mm_ddp", "ds_zero2", "ds_zero3")
PAIRS = (("mm_fsdp", "ds_zero3"), ("mm_fsdp", "ds_zero2"), ("mm_ddp", "ds_zero2"))
WORLD = 2
BUCKET = 1_000_000
"""DeepSpeed reduce / all-gather / prefetch bucket elements (its 5e8 default would allocate a
2 GB gradient bucket per rank for a model of ~0.3 M parameters)."""
LOSS_RTOL = 1e-4
TORCHTITAN_PATH = os.environ.get("TORCHTITAN_PATH", "")
"""Directories (``os.pathsep``-separated) holding an unpacked torchtitan wheel and its
dependencies, added to ``sys.path`` for the probe only (never installed into the venv)."""


class Recorder(StepTimer):
    """Per-batch wall times, the first batch's loss, and the state bytes at the last step."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps, self.loss0, self.bytes = steps, float("nan"), {}

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        super().on_train_batch_end()
        if len(self.times) == 1:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            loss = loss if loss is not None else trainer.callback_metrics.get("train_loss")
            self.loss0 = float(loss)

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        if trainer.global_step != self.steps - 1:
            return
        from lightning_mmpar.parallel.comm_count import state_bytes_of

        engine = trainer.strategy.model
        if hasattr(engine, "optimizer") and hasattr(engine, "module"):  # DeepSpeedEngine
            self.bytes = ds_state_bytes(engine.module, engine.optimizer)
        else:
            names = ("parameters", "gradients", "optimizer")
            self.bytes = dict(
                zip(names, state_bytes_of(module, trainer.optimizers[0]), strict=True)
            )


def ds_state_bytes(module: torch.nn.Module, zero_opt: Any) -> dict[str, Any]:
    """Bytes of every tensor storage a DeepSpeed ZeRO engine holds on this rank, by role.

    Roles, in the order a storage is first claimed (a storage is counted once):
    ``parameters`` (the module's parameters and their ``ds_tensor`` partitions), ``optimizer``
    (the torch optimizer's ``state``), ``master`` (ZeRO attributes named ``*fp32*``: the fp32
    partition copy), ``gradients`` (``.grad`` of any of these, ZeRO attributes named ``*grad*``),
    ``other`` (any other tensor a ZeRO attribute holds: buckets, flat buffers). Returns
    ``{role: bytes, "attributes": {attribute: bytes}}``."""
    seen: set[int] = set()
    out: dict[str, Any] = {
        k: 0 for k in ("parameters", "gradients", "optimizer", "master", "other")
    }
    attrs: dict[str, int] = {}

    def claim(t: Any, role: str, name: str, depth: int = 4) -> None:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes() > 0:
                seen.add(storage.data_ptr())
                out[role] += storage.nbytes()
                attrs[name] = attrs.get(name, 0) + storage.nbytes()
            if t.grad is not None:
                claim(t.grad, "gradients", name + ".grad")
        elif depth > 0 and isinstance(t, list | tuple):
            for x in t:
                claim(x, role, name, depth - 1)
        elif depth > 0 and isinstance(t, dict):
            for x in t.values():
                claim(x, role, name, depth - 1)

    for p in module.parameters():
        claim(p, "parameters", "module.parameters")
        claim(getattr(p, "ds_tensor", None), "parameters", "ds_tensor")
    inner = getattr(zero_opt, "optimizer", zero_opt)
    claim(list(inner.state.values()), "optimizer", "optimizer.state")
    for key, value in vars(zero_opt).items():
        low = key.lower()
        role = "master" if "fp32" in low else "gradients" if "grad" in low else "other"
        claim(value, role, key)
    out["attributes"] = {k: v for k, v in attrs.items() if v}
    return out


def _strategy(side: str, batch: int) -> Any:
    from lightning_mmpar import MultimodalParallelStrategy
    from lightning_mmpar.parallel.deepspeed_strategy import CPUCapableDeepSpeedStrategy

    if side.startswith("mm_"):
        return MultimodalParallelStrategy(data_parallel=side[3:])
    zero: dict[str, Any] = {
        "stage": int(side[-1]),
        "reduce_bucket_size": BUCKET,
        "allgather_bucket_size": BUCKET,
    }
    if side == "ds_zero3":
        zero = {
            "stage": 3,
            "reduce_bucket_size": BUCKET,
            "stage3_prefetch_bucket_size": BUCKET,
            "stage3_param_persistence_threshold": 0,
        }
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
    }

    class Zero(CPUCapableDeepSpeedStrategy):  # type: ignore[misc]
        def model_sharded_context(self) -> Any:  # build whole: initialize partitions it
            return contextlib.nullcontext()

        def _setup_model_and_optimizer(self, model: Any, *args: Any) -> Any:
            if self.zero_stage_3:  # ZeRO-3's Init broadcasts p.view(uint8): no 0-dim tensors
                for p in model.parameters():
                    if p.dim() == 0:
                        p.data = p.data.reshape(1)
            return super()._setup_model_and_optimizer(model, *args)

    return Zero(config=config)


def run_side(side: str, steps: int, batch: int) -> tuple[list[float], float, dict[str, Any]]:
    """One fresh Trainer of ``steps`` steps on this world: (step seconds, loss 0, bytes)."""
    from lightning.pytorch import seed_everything

    from lightning_mmpar.recipes.partition import build_module
    from lightning_mmpar.testing import quiet_trainer

    config = yaml.safe_load(CPU_YAML.read_text())
    config["data"]["batch_size"] = batch
    seed_everything(0, verbose=False)
    module, data = build_module(config, meta=False)
    rec = Recorder(steps)
    trainer = quiet_trainer(
        devices=WORLD,
        strategy=_strategy(side, batch),
        max_steps=steps,
        limit_val_batches=0,
        callbacks=[rec],
    )
    trainer.fit(module, datamodule=data)
    return rec.times, rec.loss0, rec.bytes


def worker(
    rank: int, world: int, steps: int, repeats: int, batch: int, sides: tuple[str, ...] = SIDES
) -> dict[str, Any]:
    torch.set_num_threads(1)
    extra: dict[str, Any] = {s: {} for s in sides}

    def side(name: str) -> Any:
        def run() -> list[float]:
            times, loss0, nbytes = run_side(name, steps, batch)
            extra[name] = {"loss0": loss0, "bytes": nbytes}
            return times

        return run

    times = interleaved({s: side(s) for s in sides}, repeats)
    return {"times": times, "extra": extra}


def analytical(batch: int) -> dict[str, list[dict[str, int]]]:
    """``layout.memory.state_bytes`` of each rank under ``fsdp`` and ``ddp`` at dp 2."""
    from lightning_mmpar.layout import ParallelLayout
    from lightning_mmpar.layout.memory import state_bytes
    from lightning_mmpar.plans.fusion_cost import fusion_model_spec
    from lightning_mmpar.recipes.partition import build_module

    module, data = build_module(yaml.safe_load(CPU_YAML.read_text()))
    out = {}
    for mode in ("fsdp", "ddp"):
        lay = ParallelLayout(dp=WORLD, data_parallel=mode, micro_batch_size=batch)
        spec = fusion_model_spec(module, lay, int(data.max_length))
        out[f"mm_{mode}"] = [vars(state_bytes(spec, lay, {"dp": r})) for r in range(WORLD)]
    return out


def torchtitan_probe(path: str = TORCHTITAN_PATH) -> dict[str, Any]:
    """Whether torchtitan's ``parallelize_llama`` imports here (``path`` prepended to
    ``sys.path``); the finding of the helper's manual check (FINDING) is carried along."""
    res: dict[str, Any] = {"finding": FINDING, "path": path or None}
    old = list(sys.path)
    sys.path[:0] = [p for p in path.split(os.pathsep) if p]
    try:
        import torchtitan.models.llama3.parallelize as tt  # type: ignore[import-not-found]

        res["importable"] = True
        res["version"] = getattr(sys.modules.get("torchtitan"), "__version__", None)
        res["parallelize_llama"] = f"{tt.__name__}.parallelize_llama"
    except Exception as err:
        res["importable"] = False
        res["error"] = f"{type(err).__name__}: {err}"
    finally:
        sys.path[:] = old
    return res


FINDING = (
    "torchtitan 0.3.0 (pip download, 2026-12-01): pure-Python wheel, no torch pin in its metadata "
    "(README: needs a nightly torch); needs spmd_types==0.2.3, tyro, einops, torch_checkpointing "
    "(not in .venv). With those in a separate --target dir, torchtitan.models.llama3.parallelize "
    "imports under torch 2.14.1. Its mesh device is tools.utils.device_type = 'cuda' on a "
    "machine without an accelerator, and its language models accept only flex/varlen attention."
)


def summarize(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    repeats = len(ranks[0]["times"][SIDES[0]])
    per: dict[str, list[list[float]]] = {}
    for s in SIDES:
        per[s] = [
            [max(ts) for ts in zip(*(r["times"][s][i] for r in ranks), strict=True)][warmup:]
            for i in range(repeats)
        ]
    ratios = {f"{a}/{b}": ratio_stats(per[a], per[b]) for a, b in PAIRS}
    loss0 = {s: [r["extra"][s]["loss0"] for r in ranks] for s in SIDES}
    ref = loss0["mm_fsdp"]
    worst = max(abs(loss0[s][i] - ref[i]) / abs(ref[i]) for s in SIDES for i in range(WORLD))
    return {
        "step_s": {s: statistics.median(t for rep in per[s] for t in rep) for s in SIDES},
        "ratios": ratios,
        "loss0": loss0,
        "loss_check": {"max_rel_diff": worst, "rtol": LOSS_RTOL, "ok": worst <= LOSS_RTOL},
        "bytes": {s: [r["extra"][s]["bytes"] for r in ranks] for s in SIDES},
    }


def _total(b: dict[str, Any]) -> int:
    return sum(v for k, v in b.items() if k != "attributes" and isinstance(v, int))


def table(res: dict[str, Any]) -> str:
    lines = [
        f"{'side':10} {'step ms':>8} {'loss0 r0':>10} {'params':>9} {'grads':>9} "
        f"{'optim':>9} {'master':>9} {'other':>9} {'total B':>9}"
    ]
    for s in SIDES:
        b = res["bytes"][s][0]
        cells = [b.get(k, 0) for k in ("parameters", "gradients", "optimizer", "master", "other")]
        lines.append(
            f"{s:10} {res['step_s'][s] * 1e3:8.1f} {res['loss0'][s][0]:10.5f} "
            + " ".join(f"{c:9d}" for c in cells)
            + f" {_total(b):9d}"
        )
    for pair, st in res["ratios"].items():
        lines.append(f"{pair:18} ratio {st['ratio']:.3f} (spread {st['spread']:.3f})")
    for s, rows in res["analytical"].items():
        lines.append(f"analytical {s} rank0 {rows[0]}")
    lines.append(f"first-step loss check: {res['loss_check']}")
    return "\n".join(lines)


def plot(res: dict[str, Any], out_dir: Path | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(res["ratios"])
    a.bar(
        names,
        [res["ratios"][n]["ratio"] for n in names],
        yerr=[res["ratios"][n]["spread"] / 2 for n in names],
    )
    a.axhline(1.0, color="k", lw=0.8)
    a.set_ylabel("step-time ratio (median of repeats)")
    a.tick_params(axis="x", labelsize=8)
    bottom = [0.0] * len(SIDES)
    for role in ("parameters", "gradients", "optimizer", "master", "other"):
        vals = [res["bytes"][s][0].get(role, 0) / 2**20 for s in SIDES]
        b.bar(SIDES, vals, bottom=bottom, label=role)
        bottom = [x + y for x, y in zip(bottom, vals, strict=True)]
    b.set_ylabel("MiB on rank 0 (measured)")
    b.legend(fontsize=8)
    save_figure(fig, "zero", out_dir)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightning_mmpar.testing import spawn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--smoke", action="store_true", help="1 repeat of 2 steps, no plot")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.repeats, args.batch = 2, 1, 1, 4
    started = time.perf_counter()
    ranks = spawn(worker, WORLD, args.steps, args.repeats, args.batch, timeout=900)
    res = summarize(ranks, args.warmup)
    res["analytical"] = analytical(args.batch)
    res["config"] = {
        "yaml": CPU_YAML.name,
        "processes": WORLD,
        "batch_per_rank": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "ds_bucket_elements": BUCKET,
        "precision": "32-true",
    }
    res["torchtitan"] = torchtitan_probe()
    res["wall_s"] = round(time.perf_counter() - started, 1)
    print(table(res))
    print("torchtitan:", res["torchtitan"])
    write_result("zero", res, args.out_dir)
    if not args.smoke:
        plot(res, args.out_dir)
    return res


if __name__ == "__main__":
    main()
