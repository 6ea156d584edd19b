"""verl plugin (the ``verl.plugins`` entry point of ``rollout-guard``): registers the guarded trainers in every
process that imports verl's v1 trainers, so that ``trainer.v1.trainer_mode=guarded_sync`` works with no other
change. It costs nothing until then: the trainers' module is imported after ``verl.trainer.ppo.v1`` (a post-import
hook, ``wrapt.register_post_import_hook``), not when verl itself is imported. Without wrapt, set
``VERL_USE_EXTERNAL_MODULES=rollout_guard.integrations.verl.trainer`` instead.
"""

from __future__ import annotations

import importlib

TRAINERS_MODULE = "rollout_guard.integrations.verl.trainer"


def _register(_module: object) -> None:
    importlib.import_module(TRAINERS_MODULE)


try:
    import wrapt
except ImportError:  # verl swallows a plugin's import error; say nothing and register nothing
    pass
else:
    wrapt.register_post_import_hook(_register, "verl.trainer.ppo.v1")
