"""``MultimodalParallelStrategy``: Lightning's hooks over topology, pipeline, data, checkpoints.

Set-up order, torchtitan's (each step a function taking a module, the layout and options):

1. ``setup_environment``: processes and the default group exist; build the ``pp, edp, ep, tp``
   mesh (``dp`` flattened) and hand it to the LightningModule as ``self.device_mesh``.
2. Lightning calls ``configure_model()``: the module builds its model (a module applying
   tensor-parallel styles itself uses ``self.device_mesh["tp"]``, also reachable as
   ``["tensor_parallel"]``, with ``["data_parallel"]`` for ``dp``: Lightning
   ModelParallelStrategy's names).
3. ``setup``: one :func:`~lightning_mmpar.parallel.parallelize.parallelize` call with the
   module's plan (its optional ``parallel_plan(dims)``) and the strategy's options: tensor
   parallel -> expert parallel -> activation checkpointing / compile -> pipeline split (modules
   implementing :class:`~lightning_mmpar.parallel.pipeline.PipelineModule`) -> data parallel
   (FSDP2 per block of this rank's stages on ``dp``, or gradient all-reduce), then the
   module's optional ``load_sharded_parameters(device)`` hook fills parameters it left on the
   meta device with this rank's shards (:mod:`lightning_mmpar.parallel.deferred`), then
   optimizers.

Before any process starts (Lightning's launcher; under torchrun / SLURM, before step 1),
:mod:`~lightning_mmpar.strategy.setup_checks` refuses a module the layout cannot act on (no
plan at ``tensor_parallel > 1``, no ``PipelineModule`` methods at ``pipeline_parallel > 1``);
step 3 refuses a degree the plan left without effect. Every set-up refusal is raised on global
rank 0 only, the other ranks stop quietly.

The steps of a pipelined module, the numerics hooks and the checkpoint hooks are mixins:
:mod:`~lightning_mmpar.strategy.pipelined_steps`, :mod:`~lightning_mmpar.strategy.numerics_hooks`,
:mod:`~lightning_mmpar.strategy.checkpoint_hooks`.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
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
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.data import sized_len
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mmpar.config import (
    DataParallel,
    ParallelConfig,
    Schedule,
    VisionDataParallel,
    check_train_batches,
)
from lightning_mmpar.layout import StagePlan
from lightning_mmpar.parallel import checkpoint as ckpt
from lightning_mmpar.parallel import comm, deferred, finite, replication
from lightning_mmpar.parallel.data import GradientSync
from lightning_mmpar.parallel.fsdp_options import MemoryOptions
from lightning_mmpar.parallel.moe_state import set_aux_loss_scale
from lightning_mmpar.parallel.parallelize import (
    ParallelizeOptions,
    UnappliedDegreeError,
    module_plan,
    parallelize,
)
from lightning_mmpar.parallel.pipeline import PipelineChunk, PipelineEngine
from lightning_mmpar.parallel.token_loss import TokenCount
from lightning_mmpar.parallel.unit_order import UnitOrderGuard
from lightning_mmpar.precision.plugins import GlobalNormClipping, with_global_clipping
from lightning_mmpar.strategy.checkpoint_hooks import ShardedCheckpointHooks
from lightning_mmpar.strategy.gradient_stash import GradientStash
from lightning_mmpar.strategy.numerics_hooks import NumericsHooks
from lightning_mmpar.strategy.pipelined_steps import PipelinedSteps
from lightning_mmpar.strategy.setup_checks import (
    CheckedLauncher,
    check_module_before_launch,
    refuse_once,
)
from lightning_mmpar.strategy.tower_steps import TowerSteps
from lightning_mmpar.topology import ParallelDims


def _check_unit_order_option(value: Any) -> None:
    """``check_unit_order``: a bool, else ``ValueError``."""
    if not isinstance(value, bool):
        raise ValueError(
            f"check_unit_order={value!r}: give True (check that every data-parallel rank "
            "enters the same FSDP2 unit) or False (no check)."
        )


class MultimodalParallelStrategy(
    TowerSteps, NumericsHooks, ShardedCheckpointHooks, PipelinedSteps, ModelParallelStrategy
):
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
        partition: how blocks become stages: ``equal``, ``balanced`` (FLOPs), ``measured``
            (each block timed at set-up on one micro-batch of the first training batch),
            ``memory``, ``ratio:V:A:D`` or boundaries (:class:`ParallelConfig`); the plan is
            logged.
        placement: which global rank runs each mesh position (topology-aware placement,
            :mod:`lightning_mmpar.layout.placement`): ``None`` /
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
            in CPU memory. activation_checkpointing: ``"all"``, ``"layers"`` (the model's
            repeated layers, as its plan names them), every ``k``-th block (``int``) or block
            kinds; compile_blocks: ``torch.compile`` each block (``True`` or a backend).
            All four: :class:`~lightning_mmpar.parallel.fsdp_options.MemoryOptions`.
        check_unit_order: for a module with its own steps under ``data_parallel="fsdp"``, every
            dp rank says which FSDP2 unit it enters next (one CPU all-gather of one integer per
            unit and forward, over gloo) and all raise one clear ``RuntimeError`` when a rank
            skipped a unit, instead of a hang (:mod:`~lightning_mmpar.parallel.unit_order`).
            ``False`` leaves the check out, for a module that runs every unit on every rank.
            Raises ``ValueError`` for anything but a bool.
        vision_ranks: ranks that run the vision tower alone (non-colocated towers,
            Megatron-Bridge MIMO's layout; :mod:`lightning_mmpar.parallel.towers`): the last
            ``vision_ranks`` global ranks, by default each with a full copy of the tower,
            gradients summed over them (``vision_data_parallel``); the other ranks are laid
            out by the sizes above. ``0`` (default):
            colocated. Needs ragged batches and a module with ``use_tower_role``,
            ``tower_blocks`` and ``tower_inputs`` (``ClipLlamaModule``); refused with
            ``expert_parallel > 1``, zero-bubble schedules and sequence parallelism.
        vision_data_parallel: the vision tower's data parallelism over its ``vision_ranks``:
            ``"ddp"`` (default: a full copy per vision rank, gradients summed over them) or
            ``"fsdp"`` (FSDP2 ``fully_shard`` of each tower block over the vision ranks:
            parameters, gradients and AdamW state sharded, gradients reduce-scattered; needs
            ``vision_ranks >= 2``). Raises ``ValueError`` otherwise.

    Data parallelism is ``world_size / (tensor_parallel * pipeline_parallel)``. A LightningModule
    that implements ``PipelineModule`` has its steps run by the strategy (any pp, 1 included) and
    ``train_loss`` / ``val_loss`` / ``test_loss`` logged; any other module runs its own steps
    (pp must then be 1).

    Loss normalisation: a ``pipeline_loss`` (or a ``training_step``) that returns a plain mean
    gets the mean of (micro-)batch means; one that returns ``(sum, token count)`` or a
    :class:`~lightning_mmpar.parallel.token_loss.TokenMean` (what
    :func:`lightning_mmpar.losses.caption_loss` returns) gets the mean over every target token
    of the optimizer step, across pipeline micro-batches, ``accumulate_grad_batches`` and the dp
    ranks (:meth:`normalise_token_gradients`; Megatron-core's per-token loss).
    """

    strategy_name = "mm_parallel"
    applies_parallel_plans = True
    """``setup`` applies the module's parallel plan (:func:`~lightning_mmpar.parallel.
    parallelize.applies_plans`), so its ``configure_model`` only builds the model."""

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
        check_unit_order: bool = True,
        vision_ranks: int = 0,
        vision_data_parallel: VisionDataParallel = "ddp",
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        try:  # under torchrun / SLURM every rank builds the strategy: one message, rank 0's
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
                vision_ranks=vision_ranks,
                vision_data_parallel=vision_data_parallel,
            )
            self.memory = MemoryOptions(
                mixed_precision, offload_optimizer, activation_checkpointing, compile_blocks
            )
            self.memory.check(self.config.data_parallel, self.config.expert_parallel)
            _check_unit_order_option(check_unit_order)
        except ValueError as err:
            refuse_once(err, rank_zero_only.rank)  # type: ignore[attr-defined]
        self._dims: ParallelDims | None = None
        self.pipeline: PipelineEngine | None = None
        self.stage_plan: StagePlan | None = None  # the partition in use (pp > 1, after setup)
        self._chunk: PipelineChunk | None = None
        self._grad_sync = GradientSync()  # gradients no FSDP unit or DDP reduces, after backward
        self.check_unit_order = check_unit_order
        self._unit_order: UnitOrderGuard | None = None  # same FSDP2 unit next on every dp rank
        self._replicated: torch.nn.Module | None = None  # what torch's DDP reduces (ddp)
        self._stash = GradientStash()  # the pipeline schedule's gradients until backward()
        self._step_tokens = TokenCount()  # target tokens of the step's token losses
        self._warned_aux = False
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
        c.check_world(world)
        language = world - c.vision_ranks  # the last vision_ranks ranks run the vision tower
        placement = c.resolve_placement(language)[0]  # cached: a file or nvidia-smi read once
        dims = ParallelDims(
            world_size=language,
            tp=c.tensor_parallel,
            pp=c.pipeline_parallel,
            ep=c.expert_parallel,
            placement=placement,
        )
        return dims

    @property
    @override
    def device_mesh(self) -> DeviceMesh:
        return self.parallel_dims.mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if (served := self._tower_data_rank()) is not None:
            return {"num_replicas": served[0], "rank": served[1]}
        dp = self.parallel_dims.get_mesh("dp")
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Key DataLoader worker seeds on the data-parallel rank, not the global rank, and set
        the sampler's epoch before Lightning restores a mid-epoch position into the loader;
        under ``accumulate_grad_batches > 1`` the training loader of a module that counts its
        target tokens is read one accumulation window at a time (:meth:`_windowed`).

        With ``seed_everything(..., workers=True)`` Lightning seeds each worker from the global
        rank, so two tensor/pipeline peers of one dp replica would draw different random
        augmentations of the same samples. A ``worker_init_fn`` of the user's own is left alone.
        A train loader with 0 batches on every rank raises ``ValueError`` (check_train_batches).
        """
        dataloader = super().process_dataloader(dataloader)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:
            ckpt.set_sampler_epoch(dataloader, trainer.fit_loop.epoch_progress)
            if trainer.training and (n := sized_len(dataloader)) is not None:
                total = self.reduce(torch.tensor(n, device=self.root_device), reduce_op="sum")
                check_train_batches(int(total), dataloader)
        seeded = int(os.environ.get("PL_SEED_WORKERS", 0))
        if seeded and getattr(dataloader, "worker_init_fn", False) is None:
            served = self._tower_data_rank()
            dp_rank = (
                served[1] if served else self.parallel_dims.rank_coords(self.global_rank)["dp"]
            )
            dataloader.worker_init_fn = partial(pl_worker_init_function, rank=dp_rank)
        if trainer is not None and trainer.training:  # accumulation windows (pipelined_steps)
            dataloader = self._windowed(dataloader, trainer)
        return dataloader

    def _launch_rank(self) -> int:
        """This process's global rank before the process group exists (Lightning's
        ``_set_world_ranks`` formula: node rank * processes per node + local rank)."""
        return self.node_rank * self.num_processes + self.local_rank

    @override
    def _configure_launcher(self) -> None:
        try:  # layout errors surface when the Trainer is built, once (rank 0)
            self._dims = self._make_dims()
        except ValueError as err:
            refuse_once(err, self._launch_rank())
        for note in self.config.ineffective_options():  # and options with no effect, as warnings
            rank_zero_warn(note)
        self.memory.check_precision(self.precision_plugin)
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:  # as Lightning's, checked
            self._launcher = CheckedLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
            self._launcher.before_launch = self._check_module

    def _check_module(self) -> None:
        """:func:`~lightning_mmpar.strategy.setup_checks.check_module_before_launch` on the
        module being fitted, before Lightning starts the other processes (its launcher) or
        before the process group exists (processes started by torchrun / SLURM), once."""
        if self.lightning_module is None:
            return
        try:
            check_module_before_launch(self.lightning_module, self.config)
        except (TypeError, ValueError) as err:
            refuse_once(err, self._launch_rank())

    @override
    def setup_environment(self) -> None:
        self._check_module()
        self._setup_distributed()
        if self._dims is None or not self._dims.is_built:  # once per strategy, not per fit/test
            self._dims = self._make_dims()
            placement, source = self.config.resolve_placement(self._dims.world_size)  # cached
            if source.startswith("machine"):  # each rank read nvidia-smi: all must agree
                self._dims.check_agreed(comm.all_gather_objects(placement))
            if placement is not None:
                rank_zero_info(f"rank placement ({source}): {placement}")
            if self._tower_setup_environment(self._dims):
                return  # a vision rank: no mesh (its groups are its own, TowerSteps)
        elif self._towers is not None and self._towers.is_vision(self.global_rank):
            return
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
        if not self._tower_split(self._module):  # a vision rank runs the tower alone
            self._parallelize(self._module)
        # MoE aux-loss gradients follow the main loss: Lightning divides it by the accumulation,
        # the pipeline engine's gradients are divided afterwards (aux included)
        accumulate = 1 if self.pipeline is not None else trainer.accumulate_grad_batches
        set_aux_loss_scale(self._module, 1.0 / accumulate)
        self._check_clipping(trainer)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: LightningModule, device: torch.device | None = None) -> None:
        """The one :func:`~lightning_mmpar.parallel.parallelize.parallelize` call, with the
        module's own plan (``parallel_plan(dims)``, when it defines one); ``device``: instead
        of the root device (``meta``: the dry run, :mod:`lightning_mmpar.recipes.dryrun`)."""
        if self._pipelined():
            return  # already set up by an earlier fit/validate call on this strategy
        dims = self.parallel_dims
        options = ParallelizeOptions(
            self.config, self.memory, device or self.root_device, self.check_unit_order
        )
        try:
            done = parallelize(module, dims, module_plan(module, dims), options)
        except UnappliedDegreeError as err:  # every rank finds it: rank 0 says it
            refuse_once(err, self.global_rank)
        self.pipeline, self._chunk, self.stage_plan = done.pipeline, done.chunk, done.stage_plan
        if done.stage_plan is not None:
            rank_zero_info(done.stage_plan.table())
        self._grad_sync, self._replicated = done.grad_sync, done.replicated
        self._unit_order = done.unit_order
        if self.config.data_parallel == "ddp" and dims.dp > 1 and done.replicated is None:
            why = replication.ddp_fallback(dims, self.config) or "a module with its own steps"
            rank_zero_info(f"data_parallel='ddp': gradients all-reduced after backward ({why})")

    def _identical_grads(self) -> bool:
        """Whether every rank holds the same gradients after backward: torch's DDP over the
        whole world (:func:`~lightning_mmpar.parallel.replication.ddp_covers_world`)."""
        return replication.ddp_covers_world(self._replicated, self.parallel_dims)

    # ---------------------------------------------------------------- gradients
    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's gradient accumulation (and manual optimization's ``toggle_model(
        sync_grad=False)``): torch's DDP skips its all-reduce (``no_sync``) for the backward
        inside; gradients then accumulate locally until a synced backward reduces their sum."""
        replication.set_gradient_sync(self._replicated, False)
        try:
            yield None
        finally:
            replication.set_gradient_sync(self._replicated, True)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        module = self._module
        self.pre_backward(closure_loss)
        if self.nonfinite is not None and (self.pipeline is None or self.pipeline.has_last):
            self.nonfinite.observe_loss(closure_loss)  # the loss exists on the last stage only
        if self._unit_order is not None:  # a rank that skipped the last FSDP2 unit: raise
            self._unit_order.end_of_forward()
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        piped = self._stash.pending
        if piped:
            scale = 1.0 / module.trainer.accumulate_grad_batches
            self._stash.restore(list(module.parameters()), scale)
        elif self._exchange is None or not self._exchange.is_vision:
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        self._tower_backward(piped)  # non-colocated towers: the embeddings' gradients
        self._grad_sync.sync(self.parallel_dims)  # what no FSDP unit reduced: tp, dp, edp
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._step_tokens.reset()  # nothing left over from an interrupted fit

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step, with the step's token-sum gradients divided by its target tokens
        right after the last backward (before the ``on_before_optimizer_step`` hooks, clipping
        and the non-finite check)."""

        def closure_then_normalise() -> Any:
            out = closure()
            self.normalise_token_gradients(optimizer)
            return out

        return super().optimizer_step(optimizer, closure_then_normalise, model, **kwargs)

    def normalise_token_gradients(self, optimizer: Any) -> int | None:
        """Turn the gradients of the step's summed token losses into those of its token mean.

        Every gradient of ``optimizer``'s parameters is multiplied by ``A * M * dp / N``: ``A``
        undoes Lightning's ``1 / accumulate_grad_batches``, ``M`` the pipeline's
        ``1 / micro_batches``, ``dp`` the gradient average over data-parallel ranks, and ``N``
        is the step's target tokens summed over batches, micro-batches and the dp group (one
        all-reduce of a scalar; Megatron's ``finalize_model_grads`` with ``num_tokens``).
        Returns ``N``, or ``None`` for a step of plain mean losses (nothing done). Called once
        per optimizer step by :meth:`optimizer_step`; a callback that recomputes a step's
        gradients calls it again afterwards. Collective over the dp group for token losses.
        """
        if self._exchange is not None and self._exchange.is_vision:
            return self._normalise_vision(optimizer)
        module = self._module
        total = None
        if self._step_tokens.pending:  # plain mean losses: nothing to scale, no collective
            micro = self.pipeline.num_micro_batches if self.pipeline is not None else 1
            scale = float(module.trainer.accumulate_grad_batches * micro * self.parallel_dims.dp)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            total = self._step_tokens.finish(params, self.parallel_dims.get_group("dp"), scale)
        else:
            self._step_tokens.reset()
        self._tower_tokens(total)  # non-colocated towers: the vision ranks scale by it too
        if total is not None and not self._warned_aux:
            self._warned_aux = True
            if any(hasattr(m, "aux_loss_scale") for m in module.modules()):
                rank_zero_warn(
                    "a token loss (caption_loss or (sum, count)) with MoE layers: their aux-loss "
                    "gradients are divided by the step's target tokens too (as under "
                    "Megatron's calculate_per_token_loss); raise the aux-loss weight to match, "
                    "or return a plain mean loss."
                )
        return total

    # save/load/remove: ShardedCheckpointHooks (DCP shards, guarded against non-finite weights)
    def _rank_layout(self) -> dict[str, int]:
        dims = self.parallel_dims  # keyed by mesh position: resumable under another placement
        if self._towers is None:
            position = dims.position(self.global_rank)
            return ckpt.rank_layout(dims, self.config.virtual_pipeline, position)
        vision = self._towers.is_vision(self.global_rank)  # vision ranks: after the mesh's
        position = self.global_rank if vision else dims.position(self.global_rank)
        layout = ckpt.rank_layout(dims, self.config.virtual_pipeline, position)
        return {**layout, "vision_ranks": self._towers.vision_ranks}
