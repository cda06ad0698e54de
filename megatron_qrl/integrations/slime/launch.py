"""``python -m megatron_qrl.integrations.slime.launch [slime's flags] [--qrl-* flags]``.

slime's own ``train.py`` loop, unchanged, with one difference: the arguments are parsed by
slime's ``parse_args(add_custom_arguments=add_qrl_args)``, so the ``--qrl-*`` flags (generated
from the config dataclasses, :func:`megatron_qrl.config.add_qrl_args`) are real flags with help
and checks instead of YAML keys. Then the hook paths the qrl options need and the user left
unset are filled in (the Megatron init / before-log-prob / before-train-step hooks, the
error-token post-process when ``--qrl-error-tokens-action`` is not none, ``--spec`` for the
aligned forward), the options are validated before Ray starts, and ``train(args)`` of slime's
``train.py`` runs (found beside the installed ``slime`` package, i.e. slime's repository root,
or at ``$SLIME_TRAIN_PY``). slime's loss choice is left to the user: ``--loss-type custom_loss
--custom-loss-function-path megatron_qrl.integrations.slime.loss.qrl_policy_loss`` or slime's
PPO loss with ``--custom-tis-function-path ...loss.qrl_tis_function`` (docs/SLIME.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_qrl.config import QrlArgumentError, add_qrl_args
from megatron_qrl.integrations.slime import options as o


def _wanted_hooks(opts: o.SlimeQrlOptions) -> dict[str, Any]:
    hooks: dict[str, Any] = {
        "custom_megatron_init_path": o.INIT_PATH,
        "custom_megatron_before_log_prob_hook_path": o.BEFORE_LOG_PROB_PATH,
        "custom_megatron_before_train_step_hook_path": o.BEFORE_TRAIN_STEP_PATH,
    }
    if opts.error_tokens.action != "none":
        hooks["rollout_data_postprocess_path"] = o.POSTPROCESS_PATH
    if opts.train.forward == "aligned":
        hooks["spec"] = o.SPEC
    return hooks


def fill_hooks(args: Any) -> list[str]:
    """Set the qrl hook paths the user left unset on ``args``; return the flags set.

    A hook the user set to something else is an error naming the flag (slime takes one
    function per hook).
    """
    opts = o.SlimeQrlOptions(dict(o.validate_qrl_args(o.qrl_namespace(args))))
    done, clashes = [], []
    for dest, value in _wanted_hooks(opts).items():
        current = getattr(args, dest, None)
        flag = "--" + dest.replace("_", "-")
        if not current:
            setattr(args, dest, value)
            done.append(f"{flag} {' '.join(value) if isinstance(value, list) else value}")
        elif current != value:
            clashes.append(f"{flag} is {current!r}; the qrl options need {value!r}")
    if clashes:
        raise QrlArgumentError("megatron_qrl launcher: hook conflicts:\n  - " + "\n  - ".join(clashes))
    uses_loss = getattr(args, "custom_loss_function_path", None) == o.LOSS_PATH
    if not uses_loss and getattr(args, "custom_tis_function_path", None) != o.TIS_PATH:
        warnings.warn(f"--qrl-loss-* flags take effect through --loss-type custom_loss "
                      f"--custom-loss-function-path {o.LOSS_PATH} or --custom-tis-function-path "
                      f"{o.TIS_PATH}; this run uses slime's loss unchanged", UserWarning, stacklevel=2)
    return done


@contextlib.contextmanager
def _argv(argv: Sequence[str] | None) -> Iterator[None]:
    saved = sys.argv
    if argv is not None:
        sys.argv = [saved[0] if saved else "launch", *argv]
    try:
        yield
    finally:
        sys.argv = saved


def parse(argv: Sequence[str] | None = None) -> Any:
    """slime's ``parse_args`` with the ``--qrl-*`` flags, hooks filled in, options validated."""
    from slime.utils.arguments import parse_args

    with _argv(argv):
        args = parse_args(add_custom_arguments=add_qrl_args)
    for line in fill_hooks(args):
        print(f"[megatron_qrl] set {line}", flush=True)
    o.slime_options(args)
    return args


def slime_train() -> Callable[[Any], None]:
    """``train`` of slime's ``train.py`` ($SLIME_TRAIN_PY, else beside the ``slime`` package)."""
    import slime

    path = Path(os.environ.get("SLIME_TRAIN_PY") or Path(slime.__file__).resolve().parent.parent
                / "train.py")
    if not path.is_file():
        raise FileNotFoundError(f"slime's train.py not found at {path}: install slime from its "
                                "repository (pip install -e .) or set SLIME_TRAIN_PY")
    spec = importlib.util.spec_from_file_location("slime_train_entry", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.train


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    slime_train()(args)


if __name__ == "__main__":
    main()
