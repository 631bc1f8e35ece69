"""Layout mistakes that need the model or the data fail in the CLI's main process, before any
process is launched (issue 15, "Errors that arrive late").

Each invocation runs the recipe's CLI in this process with ``Trainer.fit``/``validate`` and
``subprocess.Popen`` (what Lightning's launcher starts the other ranks with) replaced by
recorders: a mistake must raise one ``ValueError`` from ``before_<subcommand>``, within seconds,
with neither called. Before the check these errors came from ``configure_model``/``setup`` on
every rank, 13-20 s in.
"""

from __future__ import annotations

import functools
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Trainer

from lightning_mmpar.config import ParallelConfig
from lightning_mmpar.recipes.cli import run_cli
from lightning_mmpar.recipes.options import check_image_size

YAML = str(Path(__file__).resolve().parents[3] / "recipes" / "clip_llama_cpu.yaml")
STRATEGY = "--trainer.strategy.init_args."
TRACEBACK_HINT = "(LIGHTNING_MMPAR_TRACEBACK=1 shows the traceback)"


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of what ran past the pre-flight check: ``fit``/``validate`` or a child process."""
    calls: list[str] = []

    def record(name: str) -> Any:
        # keep the signature: LightningCLI builds each subcommand's arguments from it
        original = getattr(Trainer, name, None)
        recorder = lambda *args, **kwargs: calls.append(name)  # noqa: E731
        return functools.wraps(original)(recorder) if original else recorder

    for name in ("fit", "validate"):
        monkeypatch.setattr(Trainer, name, record(name))
    monkeypatch.setattr(subprocess, "Popen", record("Popen"))
    return calls


MISTAKES = [
    (  # heads vs tp: validate_tensor_parallel, raised in configure_model before
        ["--model.fusion.language.num_key_value_heads", "1"],
        r"num_key_value_heads \(1\) must be divisible by the tensor-parallel size \(2\)",
    ),
    (  # stages vs blocks: pipeline.partition, raised in the strategy's setup before
        [
            f"{STRATEGY}virtual_pipeline",
            "8",
            f"{STRATEGY}schedule",
            "interleaved_1f1b",
            f"{STRATEGY}micro_batches",
            "4",
        ],
        r"pipeline stages \(16 = pipeline_parallel \* virtual_pipeline\) exceed the model's "
        r"pipeline blocks \(9\)",
    ),
    (  # micro-batch divisibility: raised at the first pipeline step before
        ["--data.batch_size", "71"],
        r"data.batch_size \(71\) must be divisible by micro_batches \(2\).*e.g. 70",
    ),
    (  # image size: raised in the module's setup before
        ["--data.image_size", "16"],
        r"data.image_size \(16\) must equal model.fusion.vision.image_size \(32\)",
    ),
    (  # a val_fraction that leaves no training batch: scikit-learn's message on 4 ranks before
        ["--data.val_fraction", "0.97"],
        r"^data.val_fraction \(0.97\) leaves 53 of the 1797 digits for training: 53 per "
        r"data-parallel rank \(dp 1\), 19 short of one batch of data.batch_size \(72; the last "
        r"partial batch is dropped\), so fit would run no step. Use data.val_fraction <= 0.9599 "
        r"\(>= 72 digits per rank\) or data.batch_size <= 53.",
    ),
    (  # a split scikit-learn cannot stratify: refused when the data module is built
        ["--data.val_fraction", "0.999", "--data.batch_size", "2"],
        r"val_fraction \(0.999\) leaves 1 training and 1796 held-out digits of 1797; the split "
        r"is stratified by class and needs at least 10 in each: use a val_fraction from 0.0051 "
        r"to 0.9944",
    ),
    (  # the vision tower on its own ranks with one-image batches: raised at the first batch
        [
            "--trainer.devices",
            "3",
            f"{STRATEGY}pipeline_parallel",
            "1",
            f"{STRATEGY}micro_batches",
            "null",
            f"{STRATEGY}vision_ranks",
            "1",
        ],
        r"vision_ranks \(1: the vision tower on ranks of its own\) takes ragged batches .*"
        r"RecipeDigitsCaptions gives one image per sample",
    ),
    (  # vision_parallel="dp": micro-batch vs tp, raised at the first forward before
        ["--model.plan.vision_parallel", "dp", "--data.batch_size", "70"],
        r"vision_parallel='dp' splits the images of each micro-batch \(data.batch_size 70 / "
        r"micro_batches 2\) .*its size \(35\) must be divisible by tensor_parallel \(2\)",
    ),
]


MOE_YAML = str(Path(YAML).with_name("clip_llama_moe_cpu.yaml"))
MISTAKES = [(YAML, args, message) for args, message in MISTAKES] + [
    (YAML, *m) if "expert_parallel" in m[0][0] else (MOE_YAML, *m)
    for m in [
        (  # expert parallelism without MoE layers: raised in the strategy's setup before
            [
                f"{STRATEGY}expert_parallel",
                "2",
                f"{STRATEGY}pipeline_parallel",
                "1",
                f"{STRATEGY}micro_batches",
                "null",
            ],
            r"expert_parallel \(2\) needs mixture-of-experts layers, but model.fusion.language.moe "
            r"is null",
        ),
        (  # sequence parallel with MoE layers: raised in configure_model before
            ["--model.plan.sequence_parallel", "true"],
            r"sequence_parallel \(True\) is not supported with mixture-of-experts layers",
        ),
        (  # experts vs ep: raised by apply_expert_parallel in configure_model before
            ["--model.fusion.language.moe.num_experts", "3"],
            r"model.fusion.language.moe.num_experts \(3\) must be divisible by expert_parallel "
            r"\(2\)",
        ),
    ]
]


@pytest.mark.parametrize(("config", "args", "message"), MISTAKES, ids=lambda v: str(v)[-40:])
def test_mistake_fails_in_main_process_before_launch(
    launched: list[str], config: str, args: list[str], message: str
) -> None:
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        run_cli(["fit", "--config", config, *args])
    assert launched == [], f"ran past the check: {launched}"
    assert time.perf_counter() - start < 10


def test_valid_layout_reaches_fit_and_validate_is_checked_too(launched: list[str]) -> None:
    run_cli(["fit", "--config", YAML])
    assert launched == ["fit"]
    with pytest.raises(ValueError, match=r"data.image_size \(16\)"):
        run_cli(["validate", "--config", YAML, "--data.image_size", "16"])
    assert launched == ["fit"]


def test_training_batches_per_dp_rank() -> None:
    """``ceil(train / dp)`` digits per rank against ``batch_size``: the fix is the largest
    ``val_fraction`` that trains (it does), and the smaller batch when none does."""
    from lightning_mmpar.data.digits import DigitsCaptions, split_sizes
    from lightning_mmpar.recipes.preflight import check_training_batches

    assert split_sizes(0.2) == (1437, 360)  # scikit-learn's train_test_split of the digits
    check_training_batches(DigitsCaptions(batch_size=72, val_fraction=0.9599), 1)
    with pytest.raises(ValueError, match=r"71 per data-parallel rank \(dp 1\), 1 short.*0.9599"):
        check_training_batches(DigitsCaptions(batch_size=72, val_fraction=0.96), 1)
    check_training_batches(DigitsCaptions(batch_size=9, val_fraction=0.96), 8)  # 71 / 8 ranks
    with pytest.raises(ValueError, match=r"9 per data-parallel rank \(dp 8\).*<= 0.9593"):
        check_training_batches(DigitsCaptions(batch_size=10, val_fraction=0.96), 8)
    check_training_batches(DigitsCaptions(batch_size=10, val_fraction=0.9593), 8)
    with pytest.raises(ValueError, match=r"No val_fraction leaves 500 digits per rank: use "):
        check_training_batches(DigitsCaptions(batch_size=500, val_fraction=0.2), 4)


def test_check_functions() -> None:
    pp2 = ParallelConfig(pipeline_parallel=2, micro_batches=4)
    pp2.check_batch_size(8)
    ParallelConfig().check_batch_size(7)  # pp 1: the batch runs whole
    with pytest.raises(ValueError, match=r"batch_size \(6\).*micro_batches \(4\).*e.g. 4"):
        pp2.check_batch_size(6)
    check_image_size(32, 32)
    with pytest.raises(ValueError, match=r"data.image_size \(8\)"):
        check_image_size(8, 32)


def test_checkpoint_is_checked_before_launch(launched: list[str], tmp_path: Path) -> None:
    """``--ckpt_path``: a single-file checkpoint, one written with other tower sizes and one
    with another learning rate (restored from the checkpoint: the new value would be ignored)
    are refused in the main process (``validate_checkpoint``); recomputation may change."""
    import torch
    from torch import nn

    from lightning_mmpar.parallel.checkpoint import save_sharded

    single = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, single)
    with pytest.raises(ValueError, match=r"model.ckpt.*director"):
        run_cli(["fit", "--config", YAML, "--ckpt_path", str(single)])
    assert launched == []

    other = run_cli(
        [
            "fit",
            "--config",
            YAML,
            "--model.fusion.language.num_hidden_layers",
            "1",
            "--model.optim.lr",
            "0.1",
        ]
    )
    launched.clear()
    ckpt = tmp_path / "last.ckpt"
    save_sharded(ckpt, nn.Linear(2, 2), [], {"hyper_parameters": dict(other.model.hparams)}, True)
    with pytest.raises(ValueError, match=r"num_hidden_layers: checkpoint 1, this run 2"):
        run_cli(["fit", "--config", YAML, "--ckpt_path", str(ckpt)])
    with pytest.raises(ValueError, match=r"optim.lr: checkpoint 0.1, this run 0.003"):
        run_cli(
            [
                "fit",
                "--config",
                YAML,
                "--ckpt_path",
                str(ckpt),
                "--model.fusion.language.num_hidden_layers",
                "1",
            ]
        )
    assert launched == []
    run_cli(
        [
            "fit",
            "--config",
            YAML,
            "--ckpt_path",
            str(ckpt),
            "--model.fusion.language.num_hidden_layers",
            "1",
            "--model.optim.lr",
            "0.1",
            "--model.plan.activation_checkpointing",
            "true",
            "--model.loss.caption_weight",
            "2.0",
        ]
    )
    assert launched == ["fit"]  # layout and loss weights may change on resume


def test_checkpoint_before_the_plan_rename_resumes(launched: list[str], tmp_path: Path) -> None:
    """A checkpoint whose hyper-parameters keep the plan options under their old name
    (``tensor_parallel``) is compared under that name: the layout options may still change, the
    vocabulary padding may not; and the deprecated ``model.tensor_parallel`` still configures."""
    from torch import nn

    from lightning_mmpar.parallel.checkpoint import save_sharded

    with pytest.warns(DeprecationWarning, match="model.tensor_parallel is deprecated"):
        old = run_cli(["fit", "--config", YAML, "--model.tensor_parallel.vl_combine", "all_gather"])
    assert old.model.plan_options.vl_combine == "all_gather"
    assert "tensor_parallel" not in old.model.hparams and "plan" in old.model.hparams
    launched.clear()
    hparams = dict(old.model.hparams)
    hparams["tensor_parallel"] = hparams.pop("plan")
    ckpt = tmp_path / "last.ckpt"
    save_sharded(ckpt, nn.Linear(2, 2), [], {"hyper_parameters": hparams}, True)
    run_cli(["fit", "--config", YAML, "--ckpt_path", str(ckpt)])  # vl_combine may change
    assert launched == ["fit"]
    with pytest.raises(ValueError, match=r"tensor_parallel.vocab_multiple: checkpoint 8, this "):
        run_cli(
            ["fit", "--config", YAML, "--ckpt_path", str(ckpt), "--model.plan.vocab_multiple", "16"]
        )


def test_cli_prints_setup_errors_and_unknown_options_without_traceback(
    launched: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``main``: a preflight error is one ``clip_llama fit: error: ...`` line and exit status 2
    (``LIGHTNING_MMPAR_TRACEBACK=1`` re-raises it); an unknown option or YAML key names the
    closest known ones."""
    from lightning_mmpar.recipes.cli import main, suggest_options

    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", YAML, "--data.batch_size", "7"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and launched == []
    assert "clip_llama fit: error: data.batch_size (7) must be divisible" in err
    assert "Traceback" not in err
    monkeypatch.setenv("LIGHTNING_MMPAR_TRACEBACK", "1")
    with pytest.raises(ValueError, match=r"data.batch_size \(7\)"):
        main(["fit", "--config", YAML, "--data.batch_size", "7"])
    monkeypatch.delenv("LIGHTNING_MMPAR_TRACEBACK")
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", YAML, "--trainer.max_stepz", "5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--trainer.max_stepz: did you mean --trainer.max_steps" in err
    assert "usage:" not in err and "fit --help lists every option" in err  # short, not a dump
    with pytest.raises(SystemExit) as exit_:  # a prefix is a typo, not an abbreviation
        main(["fit", "--config", YAML, "--trainer.max_step", "5"])
    assert exit_.value.code == 2
    assert "--trainer.max_step: did you mean --trainer.max_steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an argument of the data module's class
        main(["fit", "--config", YAML, "--data.batch_sise", "24"])
    assert "batch_sise (RecipeDigitsCaptions): did you mean batch_size?" in capsys.readouterr().err
    readme = str(Path(YAML).parents[1] / "README.md")  # a file that is no checkpoint
    with pytest.raises(SystemExit) as exit_:
        main(["validate", "--config", YAML, "--ckpt_path", readme])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "is not a checkpoint torch.load can read" in err, err
    known = ["--trainer.max_steps", "--data.batch_size"]
    got = suggest_options("Subcommand 'fit' does not accept option 'data.batch_sise'", known)
    assert got.endswith("--data.batch_sise: did you mean --data.batch_size?")
    assert suggest_options("unrecognized arguments: --zzz 1", known).count("\n") == 0
    nested = (
        "Problem with given class_path 'lightning_mmpar.strategy.MultimodalParallelStrategy':"
        "\n    Option 'tensor_paralel' is not accepted"
    )
    assert "tensor_paralel (MultimodalParallelStrategy): did you mean tensor_parallel" in (
        suggest_options(nested, known)
    )
    literal = "Expected a typing.Literal['gpipe', '1f1b', 'dualpipev']. Got value: 1f1B"
    assert suggest_options(literal, known).endswith("1f1B: did you mean 1f1b?")
    assert launched == []


STRATEGY_REFUSALS = [  # arguments the strategy's constructor refuses (a ValueError)
    {"vision_ranks": -1},
    {"vision_ranks": 1, "vision_data_parallel": "fsdp"},
    {"data_parallel": "ddp", "offload_optimizer": True},
]


@pytest.mark.parametrize("kwargs", STRATEGY_REFUSALS, ids=lambda v: "-".join(map(str, v.values())))
def test_cli_prints_a_strategy_refusal_as_its_one_line(
    kwargs: dict[str, Any], launched: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A refusal of ``MultimodalParallelStrategy``'s arguments is its ``ValueError``, one line,
    exit status 2, as the layout's pre-launch refusals (sequence parallelism with vision ranks,
    ...) are; it was printed inside jsonargparse's "Does not validate against any of the Union
    subtypes" text (the subtypes, each one's error, the whole parsed section)."""
    from lightning_mmpar.recipes.cli import main
    from lightning_mmpar.strategy import MultimodalParallelStrategy

    with pytest.raises(ValueError) as raised:
        MultimodalParallelStrategy(tensor_parallel=2, pipeline_parallel=2, **kwargs)
    options = [str(x) for key, value in kwargs.items() for x in (f"{STRATEGY}{key}", value)]
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", YAML, *options])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and launched == []
    assert err == f"clip_llama fit: error: {raised.value} {TRACEBACK_HINT}\n", err


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (
            "vision_data_parallel",
            "zero",
            "Expected a typing.Literal['ddp', 'fsdp']. Got value: zero",
        ),
        ("tensor_parallel", "two", "Expected a <class 'int'>. Got value: two"),
        (
            "on_nonfinite",
            "abc",
            "Expected a typing.Literal['raise', 'skip', 'off']. Got value: abc",
        ),
        (  # an Optional argument: a Union nested in trainer.strategy's (was 17 lines)
            "timeout",
            "xyz",
            "Expected one of [<class 'datetime.timedelta'>, <class 'NoneType'>]. Got value: xyz"
            ' (Not of type timedelta: Expected a string with form "h:m:s" or "d days, h:m:s"'
            ' but got "xyz")',
        ),
        (  # was cut at "... Errors:" with no reason nor value
            "micro_batches",
            "abc",
            "Expected one of [<class 'int'>, <class 'NoneType'>]. Got value: abc",
        ),
        (  # a three-way Union with a list: the list's own reason kept
            "placement",
            "[a]",
            "Expected one of [<class 'str'>, list[int], <class 'NoneType'>]. Got value: ['a']"
            " (Expected a <class 'int'>. Got value: a)",
        ),
    ],
)
def test_cli_prints_a_strategy_argument_of_the_wrong_type_in_one_line(
    key: str, value: str, expected: str, launched: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A strategy argument the parser refuses (not of its type) is one line naming the option,
    the allowed values and the value given (and where ``--help`` lists every option), not
    jsonargparse's Union text."""
    from lightning_mmpar.recipes.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", YAML, f"{STRATEGY}{key}", value])
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and launched == []
    assert lines[0] == f"error: trainer.strategy.init_args.{key}: {expected}", lines
    assert len(lines) == 2 and lines[1].startswith("tip: "), lines
