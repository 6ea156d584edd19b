import subprocess
import sys


def test_core_imports_neither_trl_nor_vllm():
    code = (
        "import sys, rollout_guard, rollout_guard.outputs.sinks, rollout_guard.outputs.charts, rollout_guard.injection, rollout_guard.action\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('trl', 'vllm'))\n"
        "assert not bad, bad\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_integrations_are_importable_under_the_package_name():
    import rollout_guard.testing.tiny_model as tiny_model
    import rollout_guard.integrations.trl as trl_adapter

    assert callable(trl_adapter.attach_guard) and callable(tiny_model.build_tiny_model)
