"""LightningCLI of the CLIP-LLaMA recipe, with any data module and a DeepSpeed-JSON option.

``--data.class_path`` names any ``LightningDataModule`` (LightningCLI's ``subclass_mode_data``):
:class:`~lightning_mmpar.data.CaptionsDataModule` (CSV/JSONL + images),
:class:`~lightning_mmpar.data.webdataset.WebDatasetCaptions` (tar shards) or the user's own;
without it, :class:`RecipeDigitsCaptions`, whose arguments a bare ``data:`` section holds. The
data's ``vocab_size`` becomes ``model.vocab_size``.

Megatron-LM's flags (``--tensor-model-parallel-size 2``, ``--micro-batch-size``, ...) set the
options they mean (:mod:`lightning_mmpar.recipes.megatron_cli`), one printed line each.
``--deepspeed ds_config.json`` (or Megatron-DeepSpeed's ``--deepspeed --deepspeed_config
ds_config.json``) maps the JSON (DeepSpeed's engine for ZeRO-1/2, ``mm_parallel`` with FSDP2 for
ZeRO-3, whose arguments are written into ``trainer.strategy``, the YAML's others kept) and sets
the Trainer's accumulation, clipping and precision, the data's batch size and ``model.optim``
from it (:func:`~lightning_mmpar.recipes.deepspeed_cli.apply_deepspeed_json`); every value it
replaces is said in one line; unknown or unmapped keys warn (``--deepspeed_strict true``: one
``ValueError``). Before ``fit``/``validate``/``test``/
``predict`` launch any process, :func:`lightning_mmpar.recipes.preflight.preflight` checks the
layout against the model and the data, in the main process, once.

``precision.fp8:`` (a top-level section of the YAML, or ``--precision.fp8 '{}'``) adds
:class:`~lightning_mmpar.callbacks.FP8Training` with its ``policy`` / ``fallback`` / ``drift``
arguments to ``trainer.callbacks``: FP8 linear layers, the BF16 fallback and the drift monitor.

Bad input ends as a command-line error (``<prog>: error: ...`` on stderr, exit status 2), not a
traceback: an option or YAML key the parser does not know (with the closest known names:
"did you mean --trainer.max_steps?"), and a ``ValueError`` / ``FileNotFoundError`` /
``MisconfigurationException`` raised while the flags and the JSON are mapped, the classes are
built or by the preflight checks (layout vs model and data, the checkpoint): one line. A
``trainer.strategy`` argument that the strategy refuses or that is not of its type is said by
its one reason, not by jsonargparse's text for a value no type of ``str | Strategy`` takes
(:func:`union_reason`). ``LIGHTNING_MMPAR_TRACEBACK=1`` re-raises those with their traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import json
import os
import pickle
import re
import sys
import warnings
from argparse import ArgumentError
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from jsonargparse._common import debug_mode_active
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_mmpar.callbacks.fp8_training import FP8Training
from lightning_mmpar.data.conversations import RaggedDataModule
from lightning_mmpar.data.digits import DigitsCaptions
from lightning_mmpar.data.transforms import ImagePreprocess
from lightning_mmpar.models.hf import FAMILIES, check_model_type, hf_data_args
from lightning_mmpar.models.hf.checkpoint import hf_config
from lightning_mmpar.models.hf.qwen3_convert import is_qwen3_moe_vl_dir
from lightning_mmpar.models.hf.qwen_convert import is_qwen_vl_dir
from lightning_mmpar.parallel.deepspeed_mapping import DeepSpeedPlan
from lightning_mmpar.recipes import faults
from lightning_mmpar.recipes.deepspeed_cli import apply_deepspeed_json, strategy_from_deepspeed
from lightning_mmpar.recipes.megatron_cli import add_megatron_flags, apply_megatron_flags
from lightning_mmpar.recipes.module import ClipLlamaModule
from lightning_mmpar.recipes.preflight import preflight
from lightning_mmpar.recipes.resume import AUTO, auto_ckpt_path

__all__ = ["ClipLlamaCLI", "RecipeDigitsCaptions", "main", "run_cli"]


class RecipeDigitsCaptions(DigitsCaptions):
    """:class:`DigitsCaptions` plus ``predict_dataloader`` (the held-out digits), so the CLI's
    ``predict`` captions the held-out images."""

    def predict_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        """The held-out digits in a fixed order."""
        return self.val_dataloader()


SETUP_ERROR_NOTE = "lightning_mmpar: raised while setting up the run (no process launched)"
"""Note added to a :data:`SETUP_ERRORS` error of class building or preflight; :func:`main`
prints such errors as command-line errors."""


SETUP_ERRORS = (ValueError, FileNotFoundError, MisconfigurationException)
"""Errors of bad input while the run is set up (Lightning's ``MisconfigurationException``: a
Trainer argument that contradicts another)."""


@contextmanager
def _setup_errors() -> Iterator[None]:
    try:
        yield
    except SETUP_ERRORS as err:
        err.add_note(SETUP_ERROR_NOTE)
        raise


def _option_names(parser: Any) -> list[str]:
    """Every dotted option name ``parser`` knows (``--trainer.max_steps``, ...)."""
    names = []
    for action in getattr(parser, "_actions", []):
        names += [o for o in action.option_strings if o.startswith("--")]
    return names


def _init_names(class_path: str) -> list[str]:
    """Argument names of ``class_path``'s ``__init__`` (through ``**kwargs`` to its bases)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in getattr(cls, "__mro__", ()):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names += [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return [n for n in dict.fromkeys(names) if n != "self"]


def suggest_options(message: str, known: list[str]) -> str:
    """``message`` plus "did you mean ...?" for each unknown ``--option``, ``'key'`` or class
    argument (``Option 'x' is not accepted`` for a ``class_path``'s init) it names that is close
    to a ``known`` option or to an argument of that class, and for a value outside a
    ``Literal`` (case ignored) the closest allowed ones (``difflib``; at most 3 each)."""
    unknown = re.findall(r"--[\w.\-]+", message) + [
        f"--{key}" for key in re.findall(r"option '([\w.\-]+)'", message)
    ]
    hints = []
    for name in dict.fromkeys(unknown):
        close = [] if name in known else difflib.get_close_matches(name, known, n=3, cutoff=0.75)
        if close:
            hints.append(f"{name}: did you mean {' or '.join(close)}?")
    for path, arg in re.findall(r"class_path '([\w.]+)'.*?Option '([\w]+)' is not", message, re.S):
        close = difflib.get_close_matches(arg, _init_names(path), n=3, cutoff=0.6)
        if close:
            hints.append(f"{arg} ({path.rsplit('.', 1)[-1]}): did you mean {' or '.join(close)}?")
    for choices, value in re.findall(r"Literal\[([^\]]*)\]\. Got value: (\S+)", message):
        options = re.findall(r"'([^']*)'", choices)
        folded = {o.lower(): o for o in options}
        close = difflib.get_close_matches(value.lower(), list(folded), n=3, cutoff=0.6)
        if close:
            hints.append(f"{value}: did you mean {' or '.join(folded[c] for c in close)}?")
    return message if not hints else message + "\n" + "\n".join(hints)


UNION_ERROR = "Does not validate against any of the Union subtypes"
"""jsonargparse's error for a value that no type of a ``Union`` takes (``trainer.strategy``:
``str | Strategy``)."""


def _union_parts(message: str) -> tuple[str, list[str], str] | None:
    """The subtypes, each subtype's error (its lines) and the given value of the first
    :data:`UNION_ERROR` in ``message`` (jsonargparse nests one per level, indented); ``None``
    without one."""
    lines = message.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == UNION_ERROR), None)
    if start is None:
        return None
    indent = len(lines[start]) - len(lines[start].lstrip())
    subtypes, given, items = "", "", []
    for line in lines[start + 1 :]:
        depth, text = len(line) - len(line.lstrip()), line.strip()
        if depth <= indent and text.startswith("Subtypes: "):
            subtypes = text.removeprefix("Subtypes: ")
        elif depth <= indent and text.startswith("Given value: "):
            given = text.removeprefix("Given value: ")
        elif depth <= indent:
            continue
        elif depth == indent + 2 and text.startswith("- "):
            items.append(text[2:])
        elif items:
            items[-1] += "\n" + line
    return subtypes, items, given


def _is_type_mismatch(item: str) -> bool:
    """Whether a subtype's error says only that the value is not of that type."""
    return re.fullmatch(r"Expected a <class '[\w.]+'>", " ".join(item.split())) is not None


def _type_reason(text: str) -> str:
    """``text`` (jsonargparse's error for one argument) on one line; a nested
    :data:`UNION_ERROR` (``int | None``, ``timedelta | None``) as the allowed types, the value
    given and each subtype's own reason (e.g. the form a ``timedelta`` takes)."""
    parts = _union_parts(text)
    if parts is None:
        return " ".join(text.split())
    subtypes, items, given = parts
    why = [" ".join(item.split()) for item in items if not _is_type_mismatch(item)]
    reason = f"Expected one of {subtypes}. Got value: {given}"
    return reason + (f" ({'; '.join(why)})" if why else "")


def union_reason(message: str) -> str | None:
    """The one reason in jsonargparse's :data:`UNION_ERROR` ``message``, on one line; ``None``
    for another message, or one with several reasons.

    jsonargparse lists each subtype's error with the subtypes and the whole parsed value: for a
    ``trainer.strategy`` section, "Expected a <class 'str'>" (the strategy's name) beside the
    class's own, which is the reason: the ``ValueError`` its constructor raised (e.g.
    ``MultimodalParallelStrategy``'s ``vision_ranks (-1) must be a non-negative integer: ...``),
    returned as it is, or the type one of its arguments must have, returned as
    ``trainer.strategy.init_args.<argument>: Expected a typing.Literal['ddp', 'fsdp']. Got
    value: zero``; for an argument that is itself a ``Union`` (``micro_batches: int | None``),
    ``trainer.strategy.init_args.micro_batches: Expected one of [<class 'int'>, <class
    'NoneType'>]. Got value: abc``, each subtype's own reason (a ``timedelta``'s form) after it
    in parentheses.
    """
    parts = _union_parts(message)
    if parts is None:
        return None
    reasons = [item for item in parts[1] if not _is_type_mismatch(item)]
    if len(reasons) != 1:
        return None
    nested = re.fullmatch(
        r"Problem with given class_path '[\w.]+':\s*Parser key \"(\w+)\":(.*)", reasons[0], re.S
    )
    if nested is None:
        return " ".join(reasons[0].split())
    key = re.match(r'\s*Parser key "([\w.]+)":', message)
    field = f"{key.group(1)}.init_args.{nested.group(1)}" if key else nested.group(1)
    return f"{field}: {_type_reason(nested.group(2))}"


class RecipeArgumentParser(LightningArgumentParser):
    """LightningArgumentParser whose errors are short: the message, the closest known options
    (:func:`suggest_options`) and where the full list is (not the whole usage)."""

    def error(self, message: str, ex: Exception | None = None) -> Any:
        if not self.exit_on_error or debug_mode_active():  # jsonargparse tries alternatives:
            return super().error(message, ex)  # it raises, catches and may go on parsing
        parser = getattr(ex, "subcommand_parser", None) or self
        message = suggest_options(union_reason(message) or message, _option_names(parser))
        words = parser.prog.replace(" [options]", "").split()
        command = " ".join(["python -m lightning_mmpar.recipes.clip_llama", *words[1:]])
        sys.stderr.write(f"error: {message}\ntip: {command} --help lists every option\n")
        self.exit(2)


DEFAULT_DATA = f"{__name__}.RecipeDigitsCaptions"
"""The data class of a command that names none (a bare ``data:`` section holds its arguments)."""


def _names_default_data(config: Namespace) -> bool:
    """Whether a parsed LightningCLI config (of its subcommand, if any) has the digits demo as
    its data class (jsonargparse writes the shortest import path of a class)."""
    sub = config.get("subcommand")
    data = (config[sub] if sub else config).get("data")
    path = data.get("class_path") if isinstance(data, Namespace) else None
    if not isinstance(path, str) or "." not in path:
        return False
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name, None) is RecipeDigitsCaptions


class ClipLlamaCLI(LightningCLI):
    """LightningCLI with ``data.vocab_size -> model.vocab_size``, ``--deepspeed`` and checks of
    the layout against model and data before any process is launched."""

    _deepspeed_plan: DeepSpeedPlan | None = None

    def _parse_ckpt_path(self) -> None:
        """LightningCLI's (a single-file checkpoint's hyper-parameters into the config); a file
        ``torch.load`` cannot read is a set-up error naming the path, not an unpickling
        traceback."""
        with _setup_errors():
            try:
                super()._parse_ckpt_path()
            except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
                sub = self.config.get("subcommand")
                path = self.config[sub].get("ckpt_path") if sub else None
                raise ValueError(
                    f"ckpt_path {str(path)!r} is not a checkpoint torch.load can read "
                    f"({type(err).__name__}); pass a checkpoint directory written by mm_parallel "
                    "(e.g. .../checkpoints/last.ckpt), a Lightning .ckpt file, or auto."
                ) from err

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """LightningCLI's, with the digits demo as the data default only where the command
        names no other data class.

        jsonargparse carries a default class's init arguments over to another ``class_path``
        whenever the new class takes the same names (jsonargparse issue #460): with the digits
        default, ``--data.class_path ...CaptionsDataModule`` got the digits' ``image_size=32``
        instead of its own 224, silently. A first parse (without ``--print_config``) reads the
        data class the command names; when it is another class, the arguments are parsed
        without the default, so that class gets its own defaults. A config whose bare
        ``data:`` section is then overridden by a ``--data.class_path`` keeps jsonargparse's
        behaviour (its values go to the named class where it takes them)."""
        argv = sys.argv[1:] if args is None else args
        if not isinstance(argv, (dict, Namespace)):
            probe = [a for a in argv if not str(a).startswith("--print_config")]
            if not _names_default_data(parser.parse_args(probe)):
                self._drop_default_data(parser, probe)
        super().parse_arguments(parser, args)

    def _drop_default_data(self, parser: LightningArgumentParser, probe: list[Any]) -> None:
        """Remove the digits default of ``data``, unless the arguments need it (a bare
        ``data:`` section of init arguments only)."""
        subcommands = list(getattr(self, "_subcommand_parsers", {}).values())
        holders = subcommands or [parser]  # the parsers add_arguments_to_parser gave the default
        parsers = [parser, *subcommands]
        for each in holders:
            each.set_defaults({"data": None})
        for each in parsers:  # raise, do not print and exit, while trying
            each.exit_on_error = False
        try:
            parser.parse_args(probe)
        except ArgumentError:
            for each in holders:
                each.set_defaults({"data": {"class_path": DEFAULT_DATA}})
        finally:
            for each in parsers:
                each.exit_on_error = True

    def instantiate_classes(self) -> None:
        """LightningCLI's; a :data:`SETUP_ERRORS` error (bad layout, missing file, contradicting
        Trainer arguments) is marked as a set-up error (:func:`main` prints it as a command-line
        error)."""
        with _setup_errors():
            super().instantiate_classes()

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Any LightningDataModule (--data.class_path); the digits demo when none is named, so a
        # YAML with a bare `data:` section (init arguments only) keeps working.
        parser.set_defaults({"data": {"class_path": DEFAULT_DATA}})
        parser.link_arguments(
            "data", "model.vocab_size", compute_fn=data_vocab_size, apply_on="instantiate"
        )
        parser.add_argument(
            "--deepspeed",
            nargs="?",
            const=True,
            type=str | bool | None,
            default=None,
            help="DeepSpeed JSON: zero_optimization.stage 1/2 -> DeepSpeed engine, 3 -> FSDP2; "
            "tensor_parallel.tp_size -> tensor_parallel; accumulation, clipping, fp16/bf16, "
            "batch sizes, optimizer/scheduler -> Trainer, data and model.optim. Megatron-"
            "DeepSpeed's spelling, --deepspeed --deepspeed_config <json>, works too.",
        )
        parser.add_argument(
            "--deepspeed_config",
            "--deepspeed-config",
            type=str | None,
            default=None,
            help="The DeepSpeed JSON (Megatron-DeepSpeed's name for --deepspeed <json>).",
        )
        add_megatron_flags(parser)
        parser.add_argument(
            "--precision.fp8",
            type=FP8Training | None,
            default=None,
            help="FP8 linear layers with the BF16 fallback and the drift monitor: the init "
            "arguments of lightning_mmpar.callbacks.FP8Training (policy: which modules stay "
            "BF16; fallback; drift), {} for its defaults; added to trainer.callbacks.",
        )
        parser.add_argument(
            "--deepspeed_strict",
            type=bool,
            default=False,
            help="Refuse (ValueError) a DeepSpeed JSON with unknown or unmapped keys.",
        )

    def before_instantiate_classes(self) -> None:
        """Apply the Megatron-LM flags (:func:`~lightning_mmpar.recipes.megatron_cli.
        apply_megatron_flags`), then ``--deepspeed`` to the parsed config, so the classes are
        built with their values, and preprocess images as the pretrained vision tower expects
        (:func:`link_vision_preprocess`). The mapping's lines are printed once (rank 0), after
        every check passed; a refusal is a set-up error (:func:`main`: one line, exit 2)."""
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        with _setup_errors():  # an unsupported checkpoint, before anything reads it
            if cfg.get("model.pretrained.hf"):
                check_model_type(cfg.get("model.pretrained.hf"))
        link_vision_preprocess(cfg)
        with _setup_errors():  # nothing printed before a refusal: the lines come at the end
            linked = link_hf_data(cfg)
            lines, fixed = apply_megatron_flags(cfg)
            lines = linked + lines
            path = deepspeed_path(cfg.get("deepspeed"), cfg.get("deepspeed_config"))
            if path:
                ds = _read_deepspeed_json(Path(path))
                strict = bool(cfg.get("deepspeed_strict"))
                plan = apply_deepspeed_json(cfg, ds, strict=strict, fixed=fixed, info=lines)
                self._deepspeed_plan = plan
        for line in lines:
            rank_zero_info(f"[lightning_mmpar] {line}")
        super()._set_seed()

    def _set_seed(self) -> None:
        """Deferred to the end of :meth:`before_instantiate_classes`: a refusal of the
        Megatron-LM flags or the DeepSpeed JSON is then the only line printed."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_config = self._get(self.config_init, "trainer", default={})
        _share_cpu_threads(trainer_config)
        if self._deepspeed_plan is not None and self._deepspeed_plan.engine == "deepspeed":
            kwargs["strategy"] = strategy_from_deepspeed(self._deepspeed_plan)
        trainer = super().instantiate_trainer(**kwargs)
        fp8 = self._get(self.config_init, "precision.fp8")
        if fp8 is not None:  # the `precision.fp8:` section
            trainer.callbacks.append(fp8)  # type: ignore[attr-defined]
        trainer.callbacks.append(faults.watch(trainer))  # type: ignore[attr-defined]
        return trainer

    def _preflight(self, fit: bool = False) -> None:
        ckpt_path = self._get(self.config, "ckpt_path")
        if ckpt_path == AUTO:  # the newest complete checkpoint, else a fresh start
            ckpt_path = self.config_init[str(self.subcommand)]["ckpt_path"] = auto_ckpt_path(
                self.trainer
            )
        with _setup_errors():
            preflight(self.trainer, self.model, self.datamodule, ckpt_path=ckpt_path, fit=fit)

    def before_fit(self) -> None:
        """Layout vs model and data (and a training batch on every rank), before ``fit``
        launches any process."""
        self._preflight(fit=True)

    def before_validate(self) -> None:
        """As :meth:`before_fit`."""
        self._preflight()

    def before_test(self) -> None:
        """As :meth:`before_fit`."""
        self._preflight()

    def before_predict(self) -> None:
        """As :meth:`before_fit`."""
        self._preflight()


def link_vision_preprocess(cfg: Any) -> str | None:
    """``model.pretrained.vision`` (or ``model.pretrained.hf``: its image processor) ->
    ``data.preprocess.from_pretrained`` when unset.

    A pretrained open_clip tower expects its own image normalisation and resize (its
    ``preprocess_cfg``); a data module with a ``preprocess``
    (:class:`~lightning_mmpar.data.transforms.ImagePreprocess`) argument whose
    ``from_pretrained`` is not set reads it from the same tower. An explicit
    ``data.preprocess.from_pretrained`` (or a data module without ``preprocess``, such as the
    digits demo) is left alone; explicit ``mean`` / ``std`` / resize fields still win over the
    tower's (:meth:`ImagePreprocess.resolve`). A Qwen2-VL / Qwen2.5-VL / Qwen3-VL-MoE
    ``model.pretrained.hf`` goes to ``data.image_processor`` instead (its dynamic-resolution
    processor, when the data module takes one and it is unset). Returns the path linked, or None.
    """
    vision = cfg.get("model.pretrained.vision") or cfg.get("model.pretrained.hf")
    init_args = cfg.get("data.init_args")
    qwen = is_qwen_vl_dir(vision) or is_qwen3_moe_vl_dir(vision)
    if qwen and init_args is not None and "image_processor" in init_args:
        if init_args.get("image_processor"):  # a Qwen-VL directory: its own image processor
            return None
        init_args["image_processor"] = str(vision)
        return str(vision)
    if not vision or init_args is None or "preprocess" not in init_args:
        return None
    preprocess = init_args.get("preprocess")
    if preprocess is None:
        fields = {f.name: None for f in dataclasses.fields(ImagePreprocess)}
        init_args["preprocess"] = preprocess = Namespace(**fields)
    elif isinstance(preprocess, ImagePreprocess):
        init_args["preprocess"] = preprocess = Namespace(**dataclasses.asdict(preprocess))
    if preprocess.get("from_pretrained"):
        return None
    preprocess["from_pretrained"] = str(vision)
    return str(vision)


def link_hf_data(cfg: Any) -> list[str]:
    """``model.pretrained.hf`` -> the data module's ``tokenizer`` (the checkpoint directory:
    its tokenizer and chat template; when neither ``tokenizer`` nor ``tokenizer_dir`` is set),
    ``image_size`` and ``image_seq_length`` (the ViT's tokens per image), from
    :func:`~lightning_mmpar.models.hf.hf_data_args`, where the data module takes them
    (a :class:`~lightning_mmpar.data.RaggedDataModule`: :class:`~lightning_mmpar.data.
    ConversationDataModule`; other data modules, and checkpoints of a model of their own such as
    Qwen-VL, are left alone). The checkpoint fixes the last two
    (its position embedding, its projector's token count): another value cannot train, so the
    checkpoint's replaces it. Returns one line per value changed (printed on rank 0).
    """
    hf, init_args = cfg.get("model.pretrained.hf"), cfg.get("data.init_args")
    if not hf or init_args is None or not _is_ragged(cfg.get("data.class_path")):
        return []
    if hf_config(hf).model_type not in FAMILIES:  # a model of its own (Qwen-VL): not linked
        return []
    lines = []
    for key, want in hf_data_args(hf).items():
        if key not in init_args or init_args.get(key) == want:
            continue
        if key == "tokenizer" and (init_args.get("tokenizer") or init_args.get("tokenizer_dir")):
            continue
        lines.append(
            f"data.init_args.{key}: {init_args.get(key)!r} -> {want!r} (model.pretrained.hf)"
        )
        init_args[key] = want
    return lines


def _is_ragged(class_path: Any) -> bool:
    """Whether ``data.class_path`` names a :class:`RaggedDataModule` (subclass)."""
    if not isinstance(class_path, str) or "." not in class_path:
        return False
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, RaggedDataModule)


def data_vocab_size(data: Any) -> int:
    """``data.vocab_size``: the LM head's output size comes from the data's tokenizer.

    Raises:
        ValueError: the data module has no positive integer ``vocab_size``.
    """
    size = getattr(data, "vocab_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"data ({type(data).__name__}) has no vocab_size (got {size!r}): the recipe sizes "
            "its LM head from the data's tokenizer; give the data module a vocab_size property "
            "(e.g. tokenizer.vocab_size), or use a caption module of lightning_mmpar.data."
        )
    return size


def deepspeed_path(deepspeed: str | bool | None, deepspeed_config: str | None) -> str | None:
    """The DeepSpeed JSON of ``--deepspeed <json>`` or of Megatron-DeepSpeed's
    ``--deepspeed --deepspeed_config <json>`` (``--deepspeed_config`` alone also applies it).

    Raises:
        ValueError: a bare ``--deepspeed`` without ``--deepspeed_config``, or two different
            files.
    """
    path = deepspeed if isinstance(deepspeed, str) else None
    if path and deepspeed_config and path != deepspeed_config:
        raise ValueError(
            f"--deepspeed {path!r} and --deepspeed_config {deepspeed_config!r} name two JSONs; "
            "give one."
        )
    if deepspeed is True and not deepspeed_config:
        raise ValueError(
            "--deepspeed without a JSON: pass --deepspeed ds_config.json (or Megatron-"
            "DeepSpeed's --deepspeed --deepspeed_config ds_config.json)."
        )
    return path or deepspeed_config


def _read_deepspeed_json(path: Path) -> Any:
    """The parsed ``--deepspeed`` file.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: it is not valid JSON (file, line and column named).
    """
    if not path.is_file():
        raise FileNotFoundError(f"--deepspeed {str(path)!r}: no such file; pass a DeepSpeed JSON.")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"--deepspeed {str(path)!r} is not valid JSON ({err}); fix the file (DeepSpeed "
            'configs are JSON objects such as {"zero_optimization": {"stage": 3}}).'
        ) from None


def _share_cpu_threads(trainer_config: dict[str, Any]) -> None:
    """Give each CPU process ``cores // processes`` intra-op threads (at least 1).

    torch's default (all cores in every process) oversubscribes a CPU world and made the
    4-process recipe 4x slower on 2 cores. Child processes inherit ``OMP_NUM_THREADS``;
    an explicit ``OMP_NUM_THREADS`` is respected.
    """
    devices = trainer_config.get("devices")
    if trainer_config.get("accelerator") != "cpu" or not isinstance(devices, int) or devices < 2:
        return
    threads = max(1, (os.cpu_count() or 1) // devices)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def run_cli(args: list[str] | None = None) -> ClipLlamaCLI:
    """Parse ``args`` (default ``sys.argv``) and run the subcommand."""
    # Epoch-level metrics are combined by the module itself (dp group only), not by Lightning.
    warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
    warnings.filterwarnings("ignore", message=".*Slicing a flattened dim.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    return ClipLlamaCLI(
        ClipLlamaModule,
        LightningDataModule,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_class=RecipeArgumentParser,
        parser_kwargs={"allow_abbrev": False},  # --trainer.max_step is a typo, not max_steps
    )


def main(args: list[str] | None = None) -> None:
    """The recipe's LightningCLI (``fit``, ``validate``, ``test``, ``predict``).

    A set-up error (:data:`SETUP_ERROR_NOTE`: bad layout, missing checkpoint, ...) is printed as
    ``clip_llama <subcommand>: error: <message>`` and exits with status 2, unless
    ``LIGHTNING_MMPAR_TRACEBACK=1``. A failed collective (a dead or hung rank) goes to
    :func:`~lightning_mmpar.recipes.faults.report_failure`: the traceback to a log file, one
    block on one surviving rank, exit status 1. Other errors once training runs keep their
    traceback.
    """
    try:
        run_cli(args)
    except SETUP_ERRORS as err:
        if SETUP_ERROR_NOTE not in getattr(err, "__notes__", ()):
            raise
        if os.environ.get("LIGHTNING_MMPAR_TRACEBACK", "") not in ("", "0"):
            raise
        argv = sys.argv[1:] if args is None else args
        sub = next((a for a in argv if not a.startswith("-")), "")
        hint = "(LIGHTNING_MMPAR_TRACEBACK=1 shows the traceback)"
        reason = union_reason(str(err)) or err  # the strategy's refusal, not jsonargparse's text
        print(f"{' '.join(['clip_llama', sub]).strip()}: error: {reason} {hint}", file=sys.stderr)
        raise SystemExit(2) from None
    except RuntimeError as err:  # torch's DistError family included
        if not faults.is_collective_failure(err) or os.environ.get("LIGHTNING_MMPAR_TRACEBACK"):
            raise
        raise SystemExit(faults.report_failure(err)) from None
