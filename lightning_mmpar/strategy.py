"""``MultimodalParallelStrategy``: Lightning glue over topology, pipeline, data, checkpoints.

Set-up order (each step a function in :mod:`lightning_mmpar.parallel` taking a module, a mesh):

1. ``setup_environment``: processes and the default group exist; build the ``pp, edp, ep, tp``
   mesh (``dp`` flattened) and hand it to the LightningModule as ``self.device_mesh``.
2. Lightning calls ``configure_model()``: the module applies tensor-parallel plans on
   ``self.device_mesh["tp"]`` (also reachable as ``["tensor_parallel"]``, with
   ``["data_parallel"]`` for ``dp``: Lightning ModelParallelStrategy's names).
3. ``setup``: pipeline split (modules implementing
   :class:`~lightning_mmpar.parallel.pipeline.PipelineModule`), then data parallel (FSDP2 per
   block on ``dp``, or gradient all-reduce), then the module's optional
   ``load_sharded_parameters(device)`` hook fills parameters it left on the meta device with
   this rank's shards (:mod:`lightning_mmpar.parallel.deferred`), then optimizers.
"""

from __future__ import annotations

import os
from datetime import timedelta
from functools import partial
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size, sized_len
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mmpar.config import DataParallel, ParallelConfig, Schedule, check_train_batches
from lightning_mmpar.layout import StagePlan
from lightning_mmpar.parallel import checkpoint as ckpt
from lightning_mmpar.parallel import comm, deferred, finite
from lightning_mmpar.parallel import data as dpar
from lightning_mmpar.parallel.checkpoint_hooks import ShardedCheckpointHooks
from lightning_mmpar.parallel.fsdp_options import MemoryOptions
from lightning_mmpar.parallel.numerics_hooks import NumericsHooks
from lightning_mmpar.parallel.pipeline import PipelineChunk, PipelineEngine, PipelineModule
from lightning_mmpar.parallel.stage_plan import stage_plan_for
from lightning_mmpar.parallel.stash import GradientStash
from lightning_mmpar.precision.plugins import GlobalNormClipping, with_global_clipping
from lightning_mmpar.topology import ParallelDims


class MultimodalParallelStrategy(NumericsHooks, ShardedCheckpointHooks, ModelParallelStrategy):
    """Tensor x pipeline x expert x data parallelism in one Lightning strategy.

    Args:
        tensor_parallel: ranks per tensor-parallel group (Megatron's
            ``--tensor-model-parallel-size``).
        pipeline_parallel: pipeline ranks (``--pipeline-model-parallel-size``).
        expert_parallel: expert-parallel ranks, carved out of the dp ranks (needs MoE layers).
        virtual_pipeline: stages per pipeline rank (interleaved 1F1B).
        micro_batches: micro-batches per step under pipeline parallelism (default: pp).
        schedule: a torch pipeline schedule by name (``gpipe``, ``1f1b``, ``interleaved_1f1b``,
            ``looped_bfs``, ``interleaved_zero_bubble``, ``zbv_zero_bubble``, ``dualpipev``).
        data_parallel: ``"fsdp"`` (FSDP2 on the dp axis), ``"ddp"`` or ``"none"`` (only with a
            single data-parallel replica; refused otherwise).
        partition: how blocks become stages: ``equal``, ``balanced``, ``memory``,
            ``ratio:V:A:D`` or boundaries (:class:`ParallelConfig`); the plan is logged.
        placement: which global rank runs each mesh position (topology-aware): ``None`` /
            ``"auto"`` (topology-aware from ``nvidia-smi topo -m`` on a CUDA machine, else
            Megatron's order), ``"megatron"``, a list of ranks or a topology file; numerics do
            not change. Applied as ``parallel_dims.placement``, logged on rank 0.
        config: a complete :class:`ParallelConfig` instead of the individual sizes.
        on_nonfinite: what a non-finite loss or gradient does before the optimizer step
            (Megatron's ``--check-for-nan-in-loss-and-grad``): ``"raise"`` stops the run with a
            ``RuntimeError`` naming the global step, batch indices and ranks (inputs, loss,
            gradients), ``"skip"`` skips the step (gradients set to ``None`` on every rank;
            counted, logged as ``nonfinite_skipped_steps``, warned), ``"off"`` checks nothing.
            Cost: one ``[3]``-per-rank all-gather and one host sync per optimizer step
            (:class:`~lightning_mmpar.parallel.finite.NonFiniteGuard`). Checkpoints with
            non-finite weights are refused in every mode. Raises ``ValueError`` otherwise.
        mixed_precision: FSDP2 mixed precision: ``"bf16"`` (BF16 parameters and compute, FP32
            gradient reduction) or a ``MixedPrecisionPolicy`` dict; needs ``data_parallel="fsdp"``.
        offload_optimizer: FSDP2 ``CPUOffloadPolicy``: parameters, gradients and optimizer state
            in CPU memory. activation_checkpointing: ``"all"``, every ``k``-th block (``int``)
            or block kinds; compile_blocks: ``torch.compile`` each block (``True`` or a backend).
            All four: :class:`~lightning_mmpar.parallel.fsdp_options.MemoryOptions`.

    Data parallelism is ``world_size / (tensor_parallel * pipeline_parallel)``. A LightningModule
    that implements ``PipelineModule`` has its steps run by the strategy (any pp, 1 included) and
    ``train_loss`` / ``val_loss`` / ``test_loss`` logged; any other module runs its own steps
    (pp must then be 1).
    """

    strategy_name = "mm_parallel"

    def __init__(
        self,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        expert_parallel: int = 1,
        virtual_pipeline: int = 1,
        micro_batches: int | None = None,
        schedule: Schedule = "1f1b",
        data_parallel: DataParallel = "fsdp",
        partition: str | list[int] = "equal",
        placement: str | list[int] | None = None,
        config: ParallelConfig | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        on_nonfinite: finite.NonFiniteMode = "raise",
        mixed_precision: str | dict[str, Any] | None = None,
        offload_optimizer: bool = False,
        activation_checkpointing: str | int | list[str] | None = None,
        compile_blocks: bool | str | None = None,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.config = config or ParallelConfig(
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            expert_parallel=expert_parallel,
            virtual_pipeline=virtual_pipeline,
            micro_batches=micro_batches,
            schedule=schedule,
            data_parallel=data_parallel,
            partition=partition,
            placement=placement,
        )
        self.memory = MemoryOptions(
            mixed_precision, offload_optimizer, activation_checkpointing, compile_blocks
        )
        self.memory.check(self.config.data_parallel, self.config.expert_parallel)
        self._dims: ParallelDims | None = None
        self.pipeline: PipelineEngine | None = None
        self.stage_plan: StagePlan | None = None  # the partition in use (pp > 1, after setup)
        self._chunk: PipelineChunk | None = None
        self._replicated: list[nn.Parameter] = []
        self._experts: list[nn.Parameter] = []
        self._partial_over_tp: list[nn.Parameter] = []  # towers run data-parallel inside tp
        self._stash = GradientStash()  # the pipeline schedule's gradients until backward()
        mode = finite.check_mode(on_nonfinite)
        self.nonfinite = None if mode == "off" else finite.NonFiniteGuard(mode)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        description = "Tensor, pipeline, expert and data parallelism for multimodal models"
        strategy_registry.register(cls.strategy_name, cls, description=description)

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self.precision_plugin = Precision()  # Lightning's default, as a global-norm plugin
        assert self._precision_plugin is not None
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning's own plugins become their global-norm-clipping subclass, once, here.
        ``None`` stays unset, so the Trainer's ``precision=`` flag still decides the plugin."""
        if plugin is None:
            self._precision_plugin = None
            return
        plugin = with_global_clipping(plugin)
        if isinstance(plugin, GlobalNormClipping):
            plugin.clip_fn = self._clip_grad_by_norm
            plugin.check_fn = self._check_finite
        self._precision_plugin = plugin

    # ---------------------------------------------------------------- topology
    @property
    def parallel_dims(self) -> ParallelDims:
        """Degrees and meshes of this run (validated when the Trainer is built)."""
        if self._dims is None:
            self._dims = self._make_dims()
        return self._dims

    def _make_dims(self) -> ParallelDims:
        c, world = self.config, self.num_nodes * self.num_processes
        placement = c.resolve_placement(world)[0]  # cached: a file or nvidia-smi is read once
        dims = ParallelDims(
            world_size=world,
            tp=c.tensor_parallel,
            pp=c.pipeline_parallel,
            ep=c.expert_parallel,
            placement=placement,
        )
        c.check_world(dims.world_size)
        return dims

    @property
    @override
    def device_mesh(self) -> DeviceMesh:
        return self.parallel_dims.mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp = self.parallel_dims.get_mesh("dp")
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Key DataLoader worker seeds on the data-parallel rank, not the global rank, and set
        the sampler's epoch before Lightning restores a mid-epoch position into the loader.

        With ``seed_everything(..., workers=True)`` Lightning seeds each worker from the global
        rank, so two tensor/pipeline peers of one dp replica would draw different random
        augmentations of the same samples. A ``worker_init_fn`` of the user's own is left alone.
        A train loader with 0 batches on every rank raises ``ValueError`` (check_train_batches).
        """
        dataloader = super().process_dataloader(dataloader)
        if (trainer := getattr(self.lightning_module, "_trainer", None)) is not None:
            ckpt.set_sampler_epoch(dataloader, trainer.fit_loop.epoch_progress)
            if trainer.training and (n := sized_len(dataloader)) is not None:
                total = self.reduce(torch.tensor(n, device=self.root_device), reduce_op="sum")
                check_train_batches(int(total), dataloader)
        seeded = int(os.environ.get("PL_SEED_WORKERS", 0))
        if seeded and getattr(dataloader, "worker_init_fn", False) is None:
            dp_rank = self.parallel_dims.rank_coords(self.global_rank)["dp"]
            dataloader.worker_init_fn = partial(pl_worker_init_function, rank=dp_rank)
        return dataloader

    @override
    def _configure_launcher(self) -> None:
        self._dims = self._make_dims()  # layout errors surface when the Trainer is built
        for note in self.config.ineffective_options():  # and options with no effect, as warnings
            rank_zero_warn(note)
        self.memory.check_precision(self.precision_plugin)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        if self._dims is None or not self._dims.is_built:  # once per strategy, not per fit/test
            self._dims = self._make_dims()
            placement, source = self.config.resolve_placement(self._dims.world_size)  # cached
            if source.startswith("machine"):  # each rank read nvidia-smi: all must agree
                self._dims.check_agreed(comm.all_gather_objects(placement))
            if placement is not None:
                rank_zero_info(f"rank placement ({source}): {placement}")
        mesh = self._dims.build_mesh(self.root_device.type, self._timeout)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = mesh

    # ---------------------------------------------------------------- model set-up
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if not deferred.defers(self.model):  # a module with the hook fills its meta params
            _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        if any(p.device != self.root_device and not p.is_meta for p in self.model.parameters()):
            deferred.move(self.model, self.root_device)  # .to() would refuse meta parameters
        self._parallelize(self._module)
        # MoE aux-loss gradients follow the main loss: Lightning divides it by the accumulation,
        # the pipeline engine's gradients are divided afterwards (aux included)
        accumulate = 1 if self.pipeline is not None else trainer.accumulate_grad_batches
        dpar.set_aux_loss_scale(self._module, 1.0 / accumulate)
        self._check_clipping(trainer)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: LightningModule) -> None:
        if self.pipeline is not None or self._chunk is not None:
            return  # already set up by an earlier fit/validate call on this strategy
        dims, cfg = self.parallel_dims, self.config
        if cfg.pipeline_parallel > 1 and not isinstance(module, PipelineModule):
            raise TypeError(
                f"pipeline_parallel={cfg.pipeline_parallel} needs {type(module).__name__} to "
                "implement pipeline_blocks(), pipeline_inputs() and pipeline_loss() "
                "(lightning_mmpar.parallel.pipeline.PipelineModule); or set pipeline_parallel=1."
            )
        fsdp = cfg.data_parallel == "fsdp" and (dims.dp > 1 or self.memory.needs_fsdp)
        shard, fsdp_kw = (
            fsdp and not dpar.has_fsdp(module),
            self.memory.fsdp_kwargs(self.root_device),
        )
        self.memory.apply_to_blocks(module)  # checkpointing, compile: before any sharding
        dp_mesh, edp_mesh = dims.get_mesh("dp"), dims.get_mesh("edp")
        dpar.check_expert_layers(module, dims.ep)
        dpar.scale_expert_gradients(module, dims.ep)

        def wrap(chunk: PipelineChunk) -> nn.Module:
            if shard and dims.edp > 1:
                dpar.shard_experts(chunk, edp_mesh)
            return dpar.shard_blocks(chunk.blocks, chunk, dp_mesh, **fsdp_kw) if shard else chunk

        if cfg.pipeline_parallel > 1:
            pp_group = dims.get_mesh("pp").get_group()
            self.stage_plan = plan = stage_plan_for(module, cfg)
            rank_zero_info(plan.table())
            self.pipeline = PipelineEngine(
                module, cfg, pp_group, self.root_device, wrap, stage_ranges=plan.ranges
            )
        elif isinstance(module, PipelineModule):
            self._chunk = PipelineChunk(list(module.pipeline_blocks()))
            wrap(self._chunk)
        elif shard:
            if dims.edp > 1:
                dpar.shard_experts(module, edp_mesh)
            dpar.apply_fsdp(module, dp_mesh, **fsdp_kw)
        deferred.load_deferred(module, self.root_device)  # sharded meta params: their shards
        self._partial_over_tp = dpar.partial_over_tp_parameters(module) if dims.tp > 1 else []
        if dims.dp > 1 and cfg.data_parallel != "none":
            self._replicated = dpar.replicated_parameters(module)
            dpar.broadcast_parameters(self._replicated, dp_mesh.get_group())
            self._experts = dpar.expert_parameters(module)
            dpar.broadcast_parameters(self._experts, edp_mesh.get_group())

    # ---------------------------------------------------------------- steps
    @property
    def _module(self) -> Any:
        """The LightningModule (typed ``Any``: it also implements ``PipelineModule``)."""
        assert self.lightning_module is not None
        return self.lightning_module

    def _pipelined(self) -> bool:
        return self.pipeline is not None or self._chunk is not None

    def _loss(self, batch: Any, train: bool) -> Tensor:
        module = self._module
        if self.pipeline is not None:
            return self.pipeline.train_step(batch) if train else self.pipeline.eval_step(batch)
        assert self._chunk is not None
        inputs, target = module.pipeline_inputs(batch)
        return module.pipeline_loss(self._chunk(*inputs), target)

    def _log(self, name: str, loss: Tensor, batch: Any) -> None:
        """Log the per-sample mean over the data-parallel group, weighted by samples.

        Each dp rank contributes ``(loss * B_r, B_r)``; the logged value is their ratio and its
        ``batch_size`` the global batch, so Lightning's epoch mean of validation/test losses is
        the mean over samples, as on one process (not a mean of batch means).
        """
        samples = float(extract_batch_size(batch))
        pair = torch.stack([loss.detach().float() * samples, loss.new_tensor(samples).float()])
        pair = comm.all_reduce(pair, "sum", self.parallel_dims.get_group("dp"))
        value = pair[0] / pair[1]
        self._module.log(name, value, prog_bar=True, batch_size=int(pair[1].item()))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.nonfinite is not None and args:
            idx = args[1] if len(args) > 1 else self._module.trainer.fit_loop.batch_idx
            self.nonfinite.observe_batch(args[0], idx)
        if not self._pipelined():
            return super().training_step(*args, **kwargs)
        if self.pipeline is None:
            loss = self._loss(args[0], train=True)
        else:  # Lightning zeroes gradients before backward(): keep the schedule's aside
            params = list(self._module.parameters())
            loss = self._stash.capture(params, lambda: self._loss(args[0], train=True))
        self._log("train_loss", loss, args[0])
        return loss

    def _eval_loss(self, name: str, batch: Any) -> Tensor:
        loss = self._loss(batch, train=False)
        self._log(name, loss, batch)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._pipelined():
            return super().validation_step(*args, **kwargs)
        return self._eval_loss("val_loss", args[0])

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._pipelined():
            return super().test_step(*args, **kwargs)
        return self._eval_loss("test_loss", args[0])

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        module = self._module
        self.pre_backward(closure_loss)
        if self.nonfinite is not None and (self.pipeline is None or self.pipeline.has_last):
            self.nonfinite.observe_loss(closure_loss)  # the loss exists on the last stage only
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._stash.pending:
            scale = 1.0 / module.trainer.accumulate_grad_batches
            self._stash.restore(list(module.parameters()), scale)
        else:
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        if self._partial_over_tp:  # each tp rank's share of the batch: sum over tp
            dpar.sync_gradients(self._partial_over_tp, self.parallel_dims.get_group("tp"), "sum")
        if self._replicated:
            dpar.sync_gradients(self._replicated, self.parallel_dims.get_mesh("dp").get_group())
        if self._experts:  # expert weights: mean over their edp replicas (ep ranks differ)
            dpar.sync_gradients(self._experts, self.parallel_dims.get_mesh("edp").get_group())
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    # save/load/remove: ShardedCheckpointHooks (DCP shards, guarded against non-finite weights)
    def _rank_layout(self) -> dict[str, int]:
        dims = self.parallel_dims  # keyed by mesh position: resumable under another placement
        return ckpt.rank_layout(dims, self.config.virtual_pipeline, dims.position(self.global_rank))
